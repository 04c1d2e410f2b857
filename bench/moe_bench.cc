// m3msa bench moe: the moe family (src/cuda/moe.h) alone under CUDA-graph replay: M3's mixture of
// experts of one rank (router + top 4 of 128 experts + the shared expert, launch_moe) and the dense
// MLP of layers 0-2 (launch_dense_mlp), at one rank's shapes of TP P on one GPU (expert
// intermediate 3072 / P, dense 12288 / P, hidden 6144), bf16 or MXFP8 weights (e4m3 codes + one
// e8m0 scale per 32 along K), on tensor cores (`mma`) or as fp32 FMA (`fma`), 1-16 token rows.
//
// Timing (docs/benchmarks.md "Method"): `copies` layer copies of every weight the launch reads
// (router, routed experts, shared expert; or the dense MLP) on disjoint memory, enough that one
// graph cycles through more than --rotate-bytes (4 x the 60 MB L2) of the bytes its launches
// read, as many as free memory holds (at TP 1 one bf16 copy of the routed experts is ~14.5 GB, so
// there one or two: every launch then reads far more than the L2 anyway), and --x-copies distinct
// token inputs, so consecutive launches route to other experts. The layer copies share the
// router's values (not its memory), so an input routes alike on every copy. One graph holds
// `launches` back-to-back launches cycling through (copy i % copies, input i % x-copies); one
// launch = replay time / launches, median over replays.
//
// Floor per launch: bytes / 4.57 TB/s, bytes = the router (fp32 [E, hidden] + bias) + the
// distinct experts that launch's tokens route to (w13 + w2 + MXFP8 scales, this rank's shard:
// read from topk_ids after one eager launch per input) + the shared expert + x (bf16) + out (f32);
// averaged over the graph's launches. Dense: the MLP's weights (+ scales) + x + out.
//
// Check (per configuration, before timing): the output poisoned (NaN bits), one eager launch on
// (copy 0, input 0): every output finite, a guard row after it still poisoned; with both kernel
// kinds requested, mma against fma within |a - b| <= max|fma row| / 128 + 1e-6 (the bound of
// tests/cuda/moe_kernel_test.cc against the CPU oracle); mma-ring, mma-shared-late,
// mma-shared-early, mma-deep, mma-down4, mma-persistent, mma-down-apart and mma-down-combine give
// mma's bits; one launch captured in a graph and replayed over the poisoned output gives the eager
// bits. A failure exits 1 after the run.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "bench_registry.h"
#include "cuda/common.cuh"
#include "cuda/moe.h"
#include "fill.h"
#include "harness.h"
#include "m3msa/backend.h"
#include "m3msa/config.h"
#include "m3msa/dtype.h"
#include "m3msa/error.h"
#include "m3msa/moe.h"
#include "m3msa/testing/splitmix.h"
#include "moe_floor.h"
#include "timeline.h"

namespace m3msa::bench {
namespace {

// e8m0 scale codes drawn uniformly from this range (2^-7 .. 2^0): the spread of a real MXFP8
// checkpoint's blocks; their values do not change the bytes or the kernels' work.
constexpr int kScaleCodeLo = 120;
constexpr int kScaleCodeHi = 127;

struct Options {
  // The comma lists as given; parsed (and checked) into the vectors below.
  std::string tp_text = "1,4,8";
  std::string tokens_text = "1,4,16";
  std::string dtypes_text = "bf16,mxfp8";
  std::string kernels_text = "mma,fma";
  std::string what_text = "moe,dense";
  std::vector<int> tp;
  std::vector<int> tokens;
  std::vector<std::string> dtypes;
  std::vector<std::string> kernels;
  std::vector<std::string> what;
  bool quick = false;
  bool timeline = false;
  int reps = 50;
  int x_copies = 16;
  int min_launches = 64;
  int max_copies = 64;
  int64_t rotate_bytes = 4 * kL2Bytes;
  uint64_t seed = 1;
  std::string json_path;
  std::string commit = "unknown";
};

// The device memory of one (what, TP, dtype) group; views into it.
class DeviceArena {
 public:
  explicit DeviceArena(cudaStream_t stream) : stream_(stream) {}

  TensorView alloc(DType dtype, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t e : shape) n *= e;
    buffers_.emplace_back(static_cast<std::size_t>(n) * dtype_size(dtype));
    return TensorView::contiguous(buffers_.back().data(), dtype, shape, Device::cuda(device()));
  }
  // Unit-variance uniform bf16 or e4m3 values.
  TensorView random(DType dtype, std::vector<int64_t> shape, uint64_t seed) {
    TensorView v = alloc(dtype, std::move(shape));
    fill_random(v.data, v.numel(), dtype == DType::kFP8E4M3, seed, stream_);
    return v;
  }
  // e8m0 codes in [kScaleCodeLo, kScaleCodeHi]: a host pattern of a few MB repeated (its period
  // is not a multiple of a row, so neighbouring rows differ).
  TensorView scales(std::vector<int64_t> shape, uint64_t seed) {
    TensorView v = alloc(DType::kU8, std::move(shape));
    const int64_t n = v.numel();
    const int64_t period = std::min<int64_t>(n, (4 << 20) + 4099);
    std::vector<uint8_t> pattern(static_cast<std::size_t>(period));
    testkit::SplitMix64 rng(seed);
    for (uint8_t& c : pattern) c = static_cast<uint8_t>(rng.range(kScaleCodeLo, kScaleCodeHi));
    for (int64_t at = 0; at < n; at += period) {
      const int64_t len = std::min(period, n - at);
      CUDA_CHECK(cudaMemcpyAsync(static_cast<uint8_t*>(v.data) + at, pattern.data(),
                                 static_cast<std::size_t>(len), cudaMemcpyHostToDevice, stream_));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // the pattern dies here
    return v;
  }
  // fp32 values copied from the host.
  TensorView upload(const std::vector<float>& host, std::vector<int64_t> shape) {
    TensorView v = alloc(DType::kF32, std::move(shape));
    CUDA_CHECK(cudaMemcpyAsync(v.data, host.data(), host.size() * sizeof(float),
                               cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    return v;
  }
  // One expert set: w13 [(E,) 2 I, H], w2 [(E,) H, I], bf16 or MXFP8 with scales.
  ExpertWeights experts(bool fp8, int64_t e, int64_t inter, int64_t hidden, uint64_t& seed) {
    const DType wd = fp8 ? DType::kFP8E4M3 : DType::kBF16;
    std::vector<int64_t> w13 = {2 * inter, hidden}, w2 = {hidden, inter};
    if (e > 0) {
      w13.insert(w13.begin(), e);
      w2.insert(w2.begin(), e);
    }
    auto blocks = [](std::vector<int64_t> s) {
      s.back() /= kMxfp8Block;
      return s;
    };
    ExpertWeights w;
    w.w13 = random(wd, w13, seed++);
    w.w2 = random(wd, w2, seed++);
    if (fp8) {
      w.w13_scale = scales(blocks(w13), seed++);
      w.w2_scale = scales(blocks(w2), seed++);
    }
    return w;
  }

 private:
  static int device() {
    int d = 0;
    CUDA_CHECK(cudaGetDevice(&d));
    return d;
  }
  cudaStream_t stream_;
  std::vector<cuda::DeviceBuffer> buffers_;
};

// One layer copy's weights: the MoE's (router, experts, shared) or the dense MLP's.
struct LayerCopy {
  MoeArgs moe;
  ExpertWeights mlp;
};

struct KernelCheck {
  std::vector<float> eager;  // rows x hidden, the eager launch's output
  int64_t bad = 0;           // non-finite (or still poisoned) outputs
  bool guard_ok = true;
  bool replay_same = true;
  int64_t mismatch = 0;  // mma vs fma elements outside the bound
  double worst = 0.0;    // max |mma - fma| / bound
  bool compared = false;
  bool same_as_mma = true;  // the variants that must give mma's bits (when mma ran too)
};

int run_moe_bench(int argc, char** argv) {
  Options opt;
  const ModelConfig model;  // M3 defaults
  CLI::App app{
      "The moe family alone: M3's mixture of experts (router + top 4 of 128 + the shared expert) "
      "and the dense MLP at one rank's shapes of TP P, bf16 / MXFP8 weights, tensor-core or FMA "
      "kernels, graph replay with rotated layer copies; floor = the bytes of the experts actually "
      "routed to (+ router, shared expert, x, out) / 4.57 TB/s"};
  app.option_defaults()->always_capture_default();
  app.add_option("--tp", opt.tp_text,
                 fmt::format("comma-separated: one rank's shapes at TP P (expert intermediate {} / "
                             "P, dense MLP {} / P, hidden {}), on one GPU",
                             model.moe_intermediate, model.dense_intermediate, model.hidden));
  app.add_option("--tokens", opt.tokens_text,
                 fmt::format("comma-separated token rows (1..{})", cuda::kMoeMaxRows));
  app.add_option("--dtypes", opt.dtypes_text,
                 "comma-separated weights: bf16, mxfp8 (e4m3 + e8m0 per 32)");
  app.add_option(
      "--kernels", opt.kernels_text,
      "comma-separated expert projections: mma (tensor cores, the weights streamed "
      "through shared memory), mma-ring (tensor cores, the weights in a register "
      "ring: MoeParams::stream off), mma-shared-late (tensor cores, the shared expert's "
      "gate/up in the gate/up launch at every row count), mma-shared-early (beside the "
      "router's logits at every row count: MoeParams::shared_with_router_min_rows 0), "
      "mma-topk-apart (tensor cores, the top-k in a launch of its own at every row "
      "count: MoeParams::router_picks_max_rows 0), mma-topk-in-router (the top-k in the "
      "router's launch at every row count), fma (fp32 "
      "FMA kernels), mma+pdl (tensor cores, "
      "programmatic dependent launches), mma-deep (tensor cores "
      "at 4 CTAs per SM with more weight chunks in flight: MoeParams::deep), mma-down4 "
      "(four down tiles per CTA over one load ring: MoeParams::down_tiles), "
      "mma-persistent (the whole MoE in one launch: MoeParams::persistent; the dense "
      "MLP runs mma), mma-down-apart (the down projection and the combine in two launches at "
      "every row count: MoeParams::down_combine 0), mma-down-combine (in one launch "
      "at every row count: MoeParams::down_combine_max_rows)");
  app.add_option("--what", opt.what_text,
                 "comma-separated: moe (router + routed + shared experts), dense (the MLP of "
                 "layers 0-2)");
  app.add_flag("--quick", opt.quick,
               "tokens 1,16 and mma only (unless given), at most 20 reps: every TP, dtype, what");
  app.add_option("--reps", opt.reps, "graph replays per measurement (at most)");
  app.add_flag("--timeline", opt.timeline,
               "after timing, record one more launch's stage stamps (every kernel's CTAs: start, "
               "inputs ready and end, by kind of CTA; mma-persistent: the same per work item) and "
               "print when each stage ended (bench/timeline.h); also in the JSON");
  app.add_option("--x-copies", opt.x_copies, "distinct token inputs the launches cycle through");
  app.add_option("--min-launches", opt.min_launches,
                 "at least this many launches per graph (a multiple of --x-copies)");
  app.add_option("--max-copies", opt.max_copies, "at most this many layer copies");
  app.add_option("--rotate-bytes", opt.rotate_bytes,
                 "bytes one graph's launches cycle through (more than this; default 4 x L2)");
  app.add_option("--seed", opt.seed, "random seed of the weights and inputs");
  app.add_option("--json", opt.json_path, "write the results as JSON here");
  app.add_option("--commit", opt.commit, "commit id recorded in the JSON (default $M3MSA_COMMIT)");
  if (auto code = parse_flags(app, argc, argv)) return *code;
  // Every value is checked here, before the device and the first measurement.
  opt.tp = int_list("--tp", opt.tp_text, 1);
  for (int tp : opt.tp) require_ffn_split("--tp", tp);
  opt.tokens = int_list("--tokens", opt.tokens_text, 1, cuda::kMoeMaxRows);
  opt.dtypes = choice_list("--dtypes", opt.dtypes_text, {"bf16", "mxfp8"});
  opt.kernels = choice_list("--kernels", opt.kernels_text,
                            {"mma", "mma-ring", "mma-shared-late", "mma-shared-early",
                             "mma-topk-apart", "mma-topk-in-router", "fma", "mma+pdl", "mma-deep",
                             "mma-down4", "mma-persistent", "mma-down-apart", "mma-down-combine"});
  opt.what = choice_list("--what", opt.what_text, {"moe", "dense"});
  require_range("--reps", opt.reps, 1);
  require_range("--min-launches", opt.min_launches, 1);
  require_range("--max-copies", opt.max_copies, 1);
  require_range("--x-copies", opt.x_copies, 1, 256);
  require_range("--rotate-bytes", opt.rotate_bytes, 0);
  if (opt.quick) {
    if (app.count("--tokens") == 0) opt.tokens = {1, 16};
    if (app.count("--kernels") == 0) opt.kernels = {"mma"};
    opt.reps = std::min(opt.reps, 20);
  }
  require_output_path("--json", opt.json_path);
  require_device("bench moe");

  cuda::Stream stream;
  const std::string device = device_description();
  std::printf("m3msa bench moe on %s\n", device.c_str());
  std::printf(
      "floor = (router + the distinct routed experts' w13, w2 (+ MXFP8 scales) + the shared "
      "expert + x + out) / %.2f TB/s, averaged over a graph's launches; dense: its weights + x + "
      "out\n\n",
      kReadCeilingTBs);

  Table table({"what", "tp", "dtype", "kernels", "tokens", "us", "p10", "p90", "noise", "experts",
               "MB", "TB/s", "floor us", "% floor", "copies", "launches", "check"});
  const char* tolerance =
      "finite outputs over a poisoned buffer, a guard row untouched, graph replay == eager bits; "
      "mma vs fma: |a - b| <= max|fma row| / 128 + 1e-6";
  ResultFile results("moe", argc, argv, opt.json_path, opt.commit);
  results.meta()["check_tolerance"] = tolerance;
  results.meta()["scale_codes"] = {kScaleCodeLo, kScaleCodeHi};
  results.meta()["skipped"] = nlohmann::json::array();
  auto save = [&](bool complete) { results.write(table.records(), complete); };

  const int max_tokens = *std::max_element(opt.tokens.begin(), opt.tokens.end());
  const int min_tokens = *std::min_element(opt.tokens.begin(), opt.tokens.end());
  const int S = opt.x_copies;
  bool all_ok = true;

  for (const std::string& what : opt.what) {
    const bool dense = what == "dense";
    for (int tp : opt.tp) {
      for (const std::string& dtype : opt.dtypes) {
        const bool fp8 = dtype == "mxfp8";
        const MoeConfig mc = model.moe(tp);
        const int64_t H = model.hidden;
        const int64_t E = mc.num_experts;
        const int64_t I = mc.intermediate;
        const int64_t Sh = mc.shared_intermediate;
        const int64_t D = model.dense_intermediate / tp;
        const int64_t router_bytes = E * H * 4 + E * 4;
        const int64_t one_expert = expert_bytes(H, I, fp8);
        const int64_t shared_bytes = Sh > 0 ? expert_bytes(H, Sh, fp8) : 0;
        const int64_t dense_bytes = expert_bytes(H, D, fp8);
        const int64_t copy_bytes =
            dense ? dense_bytes : router_bytes + E * one_expert + shared_bytes;
        // What the lightest launch reads: sizes the rotation.
        const double light_launch = dense ? static_cast<double>(dense_bytes)
                                          : static_cast<double>(router_bytes) +
                                                expected_distinct_experts(mc, min_tokens) *
                                                    static_cast<double>(one_expert) +
                                                static_cast<double>(shared_bytes);
        const int want_copies = static_cast<int>(
            std::clamp<double>(std::floor(static_cast<double>(opt.rotate_bytes) / light_launch) + 1,
                               1, opt.max_copies));
        const std::size_t ws_bytes =
            dense ? cuda::dense_mlp_workspace_bytes(static_cast<int>(D), max_tokens)
                  : cuda::moe_workspace_bytes(mc, max_tokens);
        const double fixed = static_cast<double>(S) * max_tokens * H * 2 +
                             static_cast<double>(max_tokens + 1) * H * 4 +
                             static_cast<double>(ws_bytes) + static_cast<double>(1 << 29);
        size_t free_bytes = 0, total_bytes = 0;
        CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
        const double usable = 0.85 * static_cast<double>(free_bytes) - fixed;
        const int fit_copies = usable > 0
                                   ? static_cast<int>(std::min<double>(
                                         usable / static_cast<double>(copy_bytes), opt.max_copies))
                                   : 0;
        const std::string group = fmt::format("{} tp {} {}", what, tp, dtype);
        if (fit_copies < 1) {
          std::printf(
              "skip %s: one layer copy needs %.1f GB (+ %.1f GB inputs and margin), %.1f "
              "GB free\n",
              group.c_str(), copy_bytes / 1e9, fixed / 1e9, free_bytes / 1e9);
          results.meta()["skipped"].push_back({{"what", what},
                                               {"tp", tp},
                                               {"dtype", dtype},
                                               {"copy_bytes", copy_bytes},
                                               {"free_bytes", free_bytes}});
          std::fflush(stdout);
          continue;
        }
        const int L = std::min(want_copies, fit_copies);
        if (L < want_copies) {
          std::printf("%s: %d layer copies fit (%d wanted for %.0f MB of rotation)\n",
                      group.c_str(), L, want_copies, opt.rotate_bytes / 1e6);
        }

        // ---- Weights and inputs ----
        DeviceArena arena(stream.get());
        uint64_t seed = opt.seed * 1000003u +
                        static_cast<uint64_t>(tp * 131 + (fp8 ? 7 : 0) + (dense ? 977 : 0));
        std::vector<LayerCopy> copies(static_cast<std::size_t>(L));
        if (dense) {
          for (LayerCopy& c : copies) c.mlp = arena.experts(fp8, 0, D, H, seed);
        } else {
          // One router for every copy (each in its own memory): an input routes alike on all.
          testkit::SplitMix64 rng(seed++);
          std::vector<float> router(static_cast<std::size_t>(E * H));
          const float amp = 2.0f / std::sqrt(static_cast<float>(H));
          for (float& v : router) v = rng.signed_unit() * amp;
          std::vector<float> bias(static_cast<std::size_t>(E));
          for (float& v : bias) v = rng.signed_unit() * 0.01f;
          for (LayerCopy& c : copies) {
            c.moe.router_weight = arena.upload(router, {E, H});
            c.moe.router_bias = arena.upload(bias, {E});
            c.moe.experts = arena.experts(fp8, E, I, H, seed);
            if (Sh > 0) c.moe.shared = arena.experts(fp8, 0, Sh, H, seed);
          }
        }
        const TensorView x_all = arena.random(DType::kBF16, {S, max_tokens, H}, seed++);
        const TensorView out_all = arena.alloc(DType::kF32, {max_tokens + 1, H});
        cuda::DeviceBuffer workspace(ws_bytes);
        CUDA_CHECK(cudaMemsetAsync(workspace.data(), 0, ws_bytes, stream.get()));  // moe.h contract
        stream.synchronize();

        for (int t : opt.tokens) {
          const int64_t out_elems = int64_t{t} * H;
          auto x_view = [&](int s) {
            return TensorView::contiguous(
                static_cast<uint16_t*>(x_all.data) + static_cast<int64_t>(s) * max_tokens * H,
                DType::kBF16, {t, H}, x_all.device);
          };
          const TensorView out_view =
              TensorView::contiguous(out_all.data, DType::kF32, {t, H}, out_all.device);
          // kernels: "mma", "mma-ring" (MoeParams::stream off), "fma", "mma+pdl" (tensor cores,
          // programmatic dependent launches),
          // "mma-deep" (MoeParams::deep), "mma-down4" (MoeParams::down_tiles) or "mma-persistent"
          // (MoeParams::persistent).
          auto params = [&](int l, int s, const std::string& kernels) {
            cuda::MoeParams p;
            if (dense) {
              DenseMlpArgs a;
              a.x = x_view(s);
              a.mlp = copies[static_cast<std::size_t>(l)].mlp;
              a.out = out_view;
              a.activation_limit = model.activation_limit;
              p = cuda::dense_mlp_params(a, workspace.data());
            } else {
              MoeArgs a = copies[static_cast<std::size_t>(l)].moe;
              a.x = x_view(s);
              a.out = out_view;
              p = cuda::moe_params(mc, a, workspace.data());
            }
            p.tensor_cores = kernels != "fma";
            p.pdl = kernels == "mma+pdl";
            p.deep = kernels == "mma-deep";
            p.down_tiles = kernels == "mma-down4" ? cuda::kMoeDownTiles : 1;
            p.persistent = kernels == "mma-persistent";
            p.stream = kernels != "mma-ring";
            if (kernels == "mma-shared-late") p.shared_with_router_min_rows = cuda::kMoeMaxRows + 1;
            if (kernels == "mma-shared-early") p.shared_with_router_min_rows = 0;
            if (kernels == "mma-topk-apart") p.router_picks_max_rows = 0;
            if (kernels == "mma-topk-in-router") p.router_picks_max_rows = cuda::kMoeMaxRows;
            if (kernels == "mma-down-apart") p.down_combine = 0;
            if (kernels == "mma-down-combine") p.down_combine_max_rows = cuda::kMoeMaxRows;
            return p;
          };
          auto launch = [&](const cuda::MoeParams& p) {
            if (dense) {
              cuda::launch_dense_mlp(p, stream.get());
            } else {
              cuda::launch_moe(p, stream.get());
            }
          };
          auto poison = [&] {
            CUDA_CHECK(cudaMemsetAsync(out_all.data, 0xFF,
                                       static_cast<std::size_t>((t + 1) * H) * 4, stream.get()));
          };
          auto read_out = [&](std::vector<float>& host, int64_t elems) {
            stream.synchronize();
            host.resize(static_cast<std::size_t>(elems));
            CUDA_CHECK(
                cudaMemcpy(host.data(), out_all.data, host.size() * 4, cudaMemcpyDeviceToHost));
          };

          // ---- Routing of every input: the distinct experts each launch reads ----
          std::vector<int> distinct(static_cast<std::size_t>(S), 0);
          if (!dense) {
            const int k = mc.experts_per_token;
            std::vector<int32_t> ids(static_cast<std::size_t>(t * k));
            for (int s = 0; s < S; ++s) {
              const cuda::MoeParams p = params(0, s, opt.kernels.front());
              launch(p);
              stream.synchronize();
              CUDA_CHECK(
                  cudaMemcpy(ids.data(), p.topk_ids, ids.size() * 4, cudaMemcpyDeviceToHost));
              distinct[static_cast<std::size_t>(s)] =
                  static_cast<int>(std::set<int32_t>(ids.begin(), ids.end()).size());
            }
          }

          // ---- Correctness: eager on (copy 0, input 0), then mma vs fma ----
          std::vector<KernelCheck> checks(opt.kernels.size());
          for (std::size_t ki = 0; ki < opt.kernels.size(); ++ki) {
            KernelCheck& c = checks[ki];
            poison();
            launch(params(0, 0, opt.kernels[ki]));
            std::vector<float> host;
            read_out(host, out_elems + H);
            for (int64_t i = 0; i < out_elems; ++i) {
              if (!std::isfinite(host[static_cast<std::size_t>(i)])) ++c.bad;
            }
            for (int64_t i = out_elems; i < out_elems + H; ++i) {
              uint32_t bits;
              std::memcpy(&bits, &host[static_cast<std::size_t>(i)], 4);
              c.guard_ok = c.guard_ok && bits == 0xFFFFFFFFu;
            }
            host.resize(static_cast<std::size_t>(out_elems));
            c.eager = std::move(host);
          }
          const auto mma_it = std::find(opt.kernels.begin(), opt.kernels.end(), "mma");
          const auto fma_it = std::find(opt.kernels.begin(), opt.kernels.end(), "fma");
          if (mma_it != opt.kernels.end() && fma_it != opt.kernels.end()) {
            KernelCheck& a = checks[static_cast<std::size_t>(mma_it - opt.kernels.begin())];
            KernelCheck& b = checks[static_cast<std::size_t>(fma_it - opt.kernels.begin())];
            int64_t mismatch = 0;
            double worst = 0.0;
            for (int r = 0; r < t; ++r) {
              double row_max = 0.0;
              for (int64_t n = 0; n < H; ++n) {
                row_max = std::max(row_max,
                                   std::fabs(double(b.eager[static_cast<std::size_t>(r * H + n)])));
              }
              const double bound = row_max / 128 + 1e-6;
              for (int64_t n = 0; n < H; ++n) {
                const std::size_t i = static_cast<std::size_t>(r * H + n);
                const double diff = std::fabs(double(a.eager[i]) - double(b.eager[i]));
                if (!(diff <= bound)) ++mismatch;
                if (std::isfinite(diff)) worst = std::max(worst, diff / bound);
              }
            }
            for (KernelCheck* c : {&a, &b}) {
              c->compared = true;
              c->mismatch = mismatch;
              c->worst = worst;
            }
          }
          // The other mma variants (every choice but mma, fma and mma+pdl) change only how the
          // mma kernels' work is scheduled and cached: the same bits as mma.
          if (mma_it != opt.kernels.end()) {
            const KernelCheck& mma = checks[static_cast<std::size_t>(mma_it - opt.kernels.begin())];
            for (std::size_t ki = 0; ki < opt.kernels.size(); ++ki) {
              const std::string& k = opt.kernels[ki];
              if (k == "mma" || k == "fma" || k == "mma+pdl") continue;
              checks[ki].same_as_mma =
                  std::memcmp(checks[ki].eager.data(), mma.eager.data(), mma.eager.size() * 4) == 0;
            }
          }

          for (std::size_t ki = 0; ki < opt.kernels.size(); ++ki) {
            const std::string& kernels = opt.kernels[ki];
            KernelCheck& chk = checks[ki];

            // Graph replay of one launch over the poisoned output == the eager bits.
            {
              const cuda::MoeParams p = params(0, 0, kernels);
              cuda::Graph one = cuda::Graph::capture(stream.get(), [&] { launch(p); });
              poison();
              one.launch(stream.get());
              std::vector<float> host;
              read_out(host, out_elems);
              chk.replay_same = std::memcmp(host.data(), chk.eager.data(), host.size() * 4) == 0;
            }

            // ---- Timing ----
            const int launches = S * ((std::max(opt.min_launches, L) + S - 1) / S);
            std::vector<cuda::MoeParams> plist;
            plist.reserve(static_cast<std::size_t>(launches));
            double bytes_sum = 0.0, distinct_sum = 0.0;
            const double io_bytes = static_cast<double>(t) * H * (2 + 4);
            for (int i = 0; i < launches; ++i) {
              plist.push_back(params(i % L, i % S, kernels));
              if (dense) {
                bytes_sum += static_cast<double>(dense_bytes) + io_bytes;
              } else {
                const int d = distinct[static_cast<std::size_t>(i % S)];
                distinct_sum += d;
                bytes_sum += static_cast<double>(router_bytes) +
                             static_cast<double>(d) * static_cast<double>(one_expert) +
                             static_cast<double>(shared_bytes) + io_bytes;
              }
            }
            const double bytes = bytes_sum / launches;
            const double distinct_mean = distinct_sum / launches;
            cuda::Graph graph = cuda::Graph::capture(stream.get(), [&] {
              for (const cuda::MoeParams& p : plist) launch(p);
            });
            const Timing tm = time_graph(graph, stream.get(), launches, 2, opt.reps);
            nlohmann::json timeline;
            if (opt.timeline) {  // the layer copy the replay read longest ago
              graph.launch(stream.get());
              const cuda::MoeParams p = params(launches % L, 0, kernels);
              timeline = record_timeline(
                  fmt::format("{} tp {} {} {} tokens {}", what, tp, dtype, kernels, t),
                  [&] { launch(p); });
            }

            std::string check = "ok";
            if (chk.bad > 0) check = fmt::format("BAD {}/{} non-finite", chk.bad, out_elems);
            if (!chk.guard_ok) check += " guard";
            if (!chk.replay_same) check += " replay!=eager";
            if (chk.mismatch > 0) check += fmt::format(" mma!=fma {}", chk.mismatch);
            if (!chk.same_as_mma) check += " bits!=mma";
            const bool ok = chk.bad == 0 && chk.guard_ok && chk.replay_same && chk.mismatch == 0 &&
                            chk.same_as_mma;
            all_ok = all_ok && ok;

            const double floor_us = bytes / (kReadCeilingTBs * 1e12) * 1e6;
            const double pct = tm.median_us > 0 ? 100.0 * floor_us / tm.median_us : 0.0;
            const double tbs = tm.median_us > 0 ? bytes / (tm.median_us * 1e-6) / 1e12 : 0.0;
            nlohmann::json rec = {{"what", what},
                                  {"tp", tp},
                                  {"dtype", dtype},
                                  {"kernels", kernels},
                                  {"tokens", t},
                                  {"hidden", H},
                                  {"intermediate", dense ? D : I},
                                  {"shared_intermediate", dense ? 0 : Sh},
                                  {"tb_per_s", tbs},
                                  {"layer_copies", L},
                                  {"x_copies", S},
                                  {"launches", launches},
                                  {"check", check}};
            if (!dense) {
              rec["num_experts"] = E;
              rec["experts_per_token"] = mc.experts_per_token;
              rec["distinct_experts_mean"] = distinct_mean;
              rec["expert_bytes"] = one_expert;
              rec["shared_bytes"] = shared_bytes;
              rec["router_bytes"] = router_bytes;
            }
            rec.update(measured_fields(tm, bytes));
            if (chk.compared) rec["mma_vs_fma_worst_over_bound"] = chk.worst;
            if (!timeline.is_null()) rec["timeline"] = timeline;
            table.add({what, std::to_string(tp), dtype, kernels, std::to_string(t),
                       fmt::format("{:.2f}", tm.median_us), fmt::format("{:.2f}", tm.p10_us),
                       fmt::format("{:.2f}", tm.p90_us), fmt::format("{:.1f}%", 100.0 * tm.noise()),
                       dense ? std::string("-") : fmt::format("{:.2f}", distinct_mean),
                       fmt::format("{:.1f}", bytes / 1e6), fmt::format("{:.2f}", tbs),
                       fmt::format("{:.2f}", floor_us), fmt::format("{:.0f}%", pct),
                       std::to_string(L), std::to_string(launches), check},
                      rec);
            std::printf(
                "%-5s tp %d %-5s %s tokens %2d: %9.2f us (%3.0f%% of floor %.2f us), %s%d "
                "copies x %d launches [%s]\n",
                what.c_str(), tp, dtype.c_str(), kernels.c_str(), t, tm.median_us, pct, floor_us,
                dense ? "" : fmt::format("{:.2f} experts, ", distinct_mean).c_str(), L, launches,
                check.c_str());
            std::fflush(stdout);
            save(false);
          }
        }
      }
    }
  }
  std::printf("\n");
  table.print();
  std::printf(
      "\nexperts = distinct routed experts per launch (mean over the graph); %% floor = floor / "
      "median.\ncheck: %s.\n",
      tolerance);
  save(true);
  if (!all_ok) {
    std::fprintf(stderr, "m3msa bench moe: a correctness check failed (see the check column)\n");
    return 1;
  }
  return 0;
}

const m3msa::cli::BenchRegistrar kRegistrar(
    "moe", "the moe family alone (MoE, dense MLP) at M3 rank shapes, graph replay, byte floors",
    run_moe_bench);

}  // namespace
}  // namespace m3msa::bench
