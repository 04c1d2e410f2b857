// m3msa demo (default mode): the fused decode runtime on a synthetic model; see demo_runtime.h.
//
// Two runs:
//  1. The demo run: the requested model (M3's attention dimensions, hidden 6144 on the GPU) at
//     TP over the GPUs present, prepare -> steps -> detach, timed per step, stats() printed.
//  2. The check run, on a small configuration (M3's attention dimensions, hidden 512, 2 layers,
//     2 requests, 2 steps, contexts of ~17 blocks so top-16 is a real selection), same backend and
//     TP, every layer's inputs / outputs / selections recorded; then an oracle replays every layer
//     from the recorded input (teacher forcing, so differences do not compound); the model, the
//     oracles and the comparisons are the test kit's (m3msa/testing/demo_model.h,
//     demo_oracle.h, checks.h):
//       - CUDA: the CPU runtime at TP = 1 on the same weights and caches;
//       - CPU:  the composed double-precision reference (m3msa/testing/oracle.h: the CPU
//               reference ops with double-precision projections and norms).
//     Outputs must agree within |got - want| <= abs + rel |want| (the tolerances of
//     tests/cpu/runtime_forward_test.cc and tests/cuda/runtime_gpu_fixture.h, the TP terms added
//     when TP > 1); selections equal, or differing only by swaps of near-tied blocks (docs/spec.md
//     section 4, 1e-3 of the k-th score; such rows are left out of the value check, at most a
//     quarter of them); every rank's outputs bit-identical to rank 0's.
#include "demo_runtime.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "backend_select.h"
#include "commands.h"
#include "common.h"
#include "json_out.h"
#include "m3msa/comm.h"
#include "m3msa/dtype.h"
#include "m3msa/error.h"
#include "m3msa/testing/checks.h"
#include "m3msa/testing/demo_oracle.h"
#include "progress.h"

namespace m3msa::cli {

namespace demo_rt {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

RunResult start_run(const Spec& spec, const char* backend, int tp, bool record) {
  RunResult out;
  out.backend = backend;
  out.tp = tp;
  if (record) {
    const ModelConfig& m = spec.model;
    const std::size_t topk_values =
        static_cast<std::size_t>(spec.rows() * m.index_heads * m.sparse(tp).topk);
    out.records.assign(static_cast<std::size_t>(spec.steps),
                       std::vector<LayerRecord>(static_cast<std::size_t>(spec.run_layers())));
    for (auto& step : out.records) {
      for (auto& rec : step) rec.topk.assign(topk_values, -1);
    }
  }
  return out;
}

void RankOutputs::keep(const Spec& spec, int rank, int tp, const int32_t* topk,
                       const std::vector<uint16_t>& hidden, const std::vector<uint16_t>& residual,
                       LayerRecord& rec) {
  const ModelConfig& m = spec.model;
  const SparseConfig sc = m.sparse(tp);
  const int k = sc.topk;
  const int64_t rows = spec.rows();
  const int kv0 = rank_layout(m, rank, tp).first_kv_head;
  std::lock_guard<std::mutex> lock(mutex_);
  for (int64_t row = 0; row < rows && topk != nullptr; ++row) {
    for (int h = 0; h < sc.kv_heads; ++h) {  // this rank's heads
      std::memcpy(&rec.topk[static_cast<std::size_t>((row * m.index_heads + kv0 + h) * k)],
                  topk + (row * sc.kv_heads + h) * k, sizeof(int32_t) * k);
    }
  }
  auto& mine = outputs_[static_cast<std::size_t>(rank)];
  mine.push_back(hidden);
  mine.push_back(residual);
  if (rank == 0) {
    rec.out_hidden = hidden;
    rec.out_residual = residual;
  }
}

int64_t RankOutputs::mismatches() const {
  int64_t count = 0;
  const auto& zero = outputs_[0];
  for (std::size_t r = 1; r < outputs_.size(); ++r) {
    const auto& mine = outputs_[r];
    for (std::size_t i = 0; i < mine.size() && i < zero.size(); ++i) {
      for (std::size_t j = 0; j < mine[i].size() && j < zero[i].size(); ++j) {
        count += mine[i][j] != zero[i][j];
      }
    }
    if (mine.size() != zero.size()) ++count;
  }
  return count;
}

RunResult run_cpu(const Spec& spec, int tp, int threads, bool record,
                  const std::function<void(const std::string&)>& progress) {
  RunResult out = start_run(spec, "cpu", tp, record);
  const ModelConfig& m = spec.model;
  const int layers = spec.run_layers();
  const int64_t rows = spec.rows();
  const int64_t H = m.hidden;
  const int rank_threads = std::max(1, threads / tp);
  const std::vector<Step> steps = make_steps(spec);
  RankOutputs kept(tp);
  const RuntimeConfig config = spec.runtime_config(rank_threads);
  auto group = ThreadGroup::create(tp, std::chrono::seconds(120));
  const auto errors = run_ranks(group, [&](Communicator& comm) {
    const int r = comm.rank();
    const auto t_setup = Clock::now();
    if (r == 0) progress("building the weights and caches");
    HostModel model = make_host_model(spec, r, tp, rank_threads);
    Runtime rt([](const std::string&) {});  // fallbacks are reported through stats()
    const PrepareResult prepared = rt.prepare(model.weights, config, comm);
    if (r == 0) {
      out.prepared = prepared;
      out.setup_s = seconds_since(t_setup);
    }
    if (prepared != PrepareResult::kActive) {
      if (r == 0) out.stats = rt.stats();
      rt.close();
      return;
    }
    std::vector<uint16_t> hidden, residual;
    for (int s = 0; s < spec.steps; ++s) {
      if (r == 0) progress(fmt::format("step {}/{}", s + 1, spec.steps));
      const Step& step = steps[static_cast<std::size_t>(s)];
      const auto t0 = Clock::now();
      M3MSA_CHECK_INTERNAL(rt.begin_step(step.batch), "rank ", r, ": step ", s + 1,
                           " refused: ", rt.stats().last_refusal);
      hidden = step.hidden_in;
      residual.assign(hidden.size(), 0);
      const TensorView hv = TensorView::contiguous(hidden.data(), DType::kBF16, {rows, H});
      const TensorView rv = TensorView::contiguous(residual.data(), DType::kBF16, {rows, H});
      for (int l = 0; l < layers; ++l) {
        LayerRecord* rec =
            record ? &out.records[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)]
                   : nullptr;
        if (rec && r == 0) {
          rec->in_hidden = hidden;
          rec->in_residual = residual;
        }
        rt.forward_layer(spec.first_layer() + l, hv, rv, step.positions.view());
        if (!rec) continue;
        const Runtime::LayerTrace trace = rt.last_layer_trace();
        kept.keep(spec, r, tp, spec.is_dense(l) ? nullptr : trace.topk.ptr<const int32_t>(), hidden,
                  residual, *rec);
      }
      if (r == 0) out.step_ms.push_back(seconds_since(t0) * 1e3);
    }
    if (r == 0) out.stats = rt.stats();
    std::vector<LayerCaches> empty;
    for (const LayerWeights& w : model.weights.layers) empty.push_back({w.layer, {}, {}});
    rt.detach(empty);
  });
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  out.rank_mismatches = kept.mismatches();
  return out;
}

}  // namespace demo_rt

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::ordered_json;
using namespace demo_rt;

// Tolerances (bf16 outputs of O(1)): |got - want| <= kAbs + kRel |want|, per layer from the same
// input. Backend or reference vs the CPU runtime / reference: 2^-6 + 2^-5 |want|; TP = P adds
// the split o_proj / mlp_down sums: + 2^-8 + 2^-6 |want|.
constexpr double kAbsTol = 1.0 / 64;
constexpr double kRelTol = 1.0 / 32;
constexpr double kTpAbsTol = 1.0 / 256;
constexpr double kTpRelTol = 1.0 / 64;
// The check configuration's hidden and MLP width: M3's attention dimensions are kept (the
// attention width 64 x 128 = 8192 dominates the projections anyway).
constexpr int kCheckHidden = 512;
// The MoE output is a sum of 2-GEMM functions of h2: a one-ulp flip of a bf16 gate, up or
// activation (from any upstream flip) moves an element by |w2 * a| with a up to limit * (limit +
// 1), so elementwise bounds of O(1) outputs do not apply; rows are compared by relative L2 error
// (a wrong slice, expert or weight gives O(1)), elements against garbage, NaN and inf.
constexpr double kMoeRowL2Tol = 1.0 / 32;
constexpr double kMoeAbsCap = 0.25;

std::string mib(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024)
    return fmt::format("{:.2f} GiB", bytes / (1024.0 * 1024 * 1024));
  return fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024));
}

std::string contexts_text(const Spec& spec) {
  const auto [lo, hi] = std::minmax_element(spec.contexts.begin(), spec.contexts.end());
  return *lo == *hi ? std::to_string(*hi) : fmt::format("{}..{}", *hi, *lo);
}

json stats_json(const RuntimeStats& st) {
  return json::parse(st.to_json());
}

std::string stats_line(const RuntimeStats& st) {
  std::string buckets;
  for (std::size_t i = 0; i < st.buckets.size(); ++i) {
    if (st.bucket_steps[i] == 0) continue;
    buckets += fmt::format("{}bucket {}: {}", buckets.empty() ? "" : ", ", st.buckets[i],
                           st.bucket_steps[i]);
  }
  int64_t refusals = 0;
  for (int64_t r : st.refusals) refusals += r;
  std::string fallbacks;
  for (const auto& [reason, count] : st.fallback_reasons) {
    fallbacks += fmt::format("{}{} (x{})", fallbacks.empty() ? "" : "; ", reason, count);
  }
  return fmt::format(
      "state {}, backend {}, TP {} (rank {}, all-reduce {}), CP {}, steps accepted {} ({}), "
      "layers run {}, launches per layer {}{}, refusals {}, fallbacks {}",
      runtime_state_name(st.state), st.backend, st.tp_size, st.tp_rank,
      st.tp_allreduce.empty() ? "-" : st.tp_allreduce, st.context_parallel ? "on" : "off",
      st.steps_accepted, buckets.empty() ? "-" : buckets, st.layers_run, st.launches_per_layer,
      st.backend == "cpu" ? " (CPU backend: no kernels)" : "", refusals,
      fallbacks.empty() ? "none" : fallbacks);
}

}  // namespace

int run_runtime_demo(const RuntimeDemoOptions& o) {
  const auto start = Clock::now();
  Progress progress(!o.quiet);
  auto note = [&](const std::string& text) { progress.update(text); };

  // ---- Backend and TP ----
  std::string why_not_cuda;
  const bool cuda_ok = cuda_backend_usable(&why_not_cuda);
  bool cuda = false;
  std::string why;
  if (o.backend == "cuda") {
    M3MSA_CHECK_SUPPORTED(cuda_ok, "--backend cuda: ", why_not_cuda);
    cuda = true;
    why = "cuda: requested";
  } else if (o.backend == "auto") {
    cuda = cuda_ok;
    why = cuda ? "auto -> cuda" : "auto -> cpu: " + why_not_cuda;
  } else {
    why = "cpu: requested";
  }
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = o.threads > 0 ? o.threads : hw;
  int tp = o.tp;
  if (cuda) {
    const int gpus = cuda_devices();
    if (tp == 0) tp = std::min(2, gpus);
    if (tp > gpus) {
      throw UsageError(
          fmt::format("--tp {}: only {} CUDA device(s) visible (one rank per GPU)", tp, gpus));
    }
  } else if (tp == 0) {
    tp = hw >= 2 ? 2 : 1;
  }

  // ---- The model ----
  ModelConfig model;  // M3's attention dimensions
  model.hidden = o.hidden > 0 ? o.hidden : (cuda ? kM3Hidden : kCpuDefaultHidden);
  model.intermediate = o.intermediate > 0 ? o.intermediate : model.hidden;
  model.num_layers = model.first_sparse_layer + o.layers;
  if (model.hidden % 64 != 0) {
    throw UsageError(fmt::format("--hidden {}: must be a multiple of 64", model.hidden));
  }
  if (o.moe) {
    if (o.intermediate > 0) throw UsageError("--intermediate: not with --moe (no dense MLP)");
    model.intermediate = 0;
    model.num_experts = kDemoExperts;
    model.experts_per_token = kDemoExpertsPerToken;
    model.moe_intermediate = kDemoExpertWidth;
    model.shared_experts = 1;
    model.dense_intermediate = kDemoDenseWidth;
  } else if ((model.intermediate / tp) % 64 != 0 || model.intermediate % tp != 0) {
    throw UsageError(fmt::format("--intermediate {}: must be a multiple of 64 * TP ({})",
                                 model.intermediate, 64 * tp));
  }
  if (cuda && int64_t{o.batch} * o.q_len > 16) {
    throw UsageError(fmt::format(
        "--batch {} x --q-len {} = {} rows: the CUDA runtime serves decode steps of <= 16 rows",
        o.batch, o.q_len, int64_t{o.batch} * o.q_len));
  }
  if (cuda && o.q_len * (model.index_heads / std::min(tp, model.index_heads)) > 32) {
    throw UsageError(
        fmt::format("--q-len {}: the CUDA indexer takes q_len * index heads <= 32", o.q_len));
  }
  const bool fp8 = o.weights == "fp8";
  Spec spec = make_spec(model, fp8, o.seed, o.batch, o.context, o.q_len, o.steps);
  spec.context_parallel = o.cp;
  spec.moe = o.moe;
  spec.moe_fp8 = o.moe_weights == "mxfp8";
  spec.dense_layers = o.moe;
  const std::string ffn_text =
      o.moe ? fmt::format("MoE {} experts x {} (top-{}, 1 shared, {})", model.num_experts,
                          model.moe_intermediate, model.experts_per_token, o.moe_weights)
            : fmt::format("dense SwiGLU-OAI MLP {}", model.intermediate);
  const std::string dense_text =
      spec.dense_layers
          ? fmt::format(" after {} dense layer{} (dense attention, dense MLP {})",
                        model.first_sparse_layer, model.first_sparse_layer == 1 ? "" : "s",
                        model.dense_intermediate)
          : std::string();
  const int run_layers = spec.run_layers();
  auto run = [&](const Spec& s, bool record) {
    return cuda ? run_cuda(s, tp, threads, record, note) : run_cpu(s, tp, threads, record, note);
  };

  const std::string backend_name = cuda ? "cuda" : "cpu";
  std::printf(
      "m3msa demo: the fused decode runtime (mono) on %s (%s), TP %d (%s), CP %s\n",
      backend_name.c_str(), why.c_str(), tp,
      cuda ? (tp > 1 ? "one GPU per rank" : "one GPU") : (tp > 1 ? "ranks as threads" : "one rank"),
      o.cp ? "on (the indexer over the TP ranks)" : "off");
  std::printf(
      "  model: hidden %d%s, %d q heads / %d KV heads x %d, %d index heads x %d, block %d, "
      "top-%d, %s, %d sparse layer%s%s, weights %s\n",
      model.hidden,
      o.hidden > 0 ? ""
      : cuda       ? " (M3's)"
                   : " (CPU default; M3's is 6144: --hidden 6144)",
      model.q_heads, model.kv_heads, model.head_dim, model.index_heads, model.index_dim,
      model.block_size, model.topk, ffn_text.c_str(), o.layers, o.layers == 1 ? "" : "s",
      dense_text.c_str(), fp8 ? "fp8 e4m3 (qkv_proj, o_proj; per-channel scales)" : "bf16");
  std::printf(
      "  batch %d x q-len %d = %lld rows per step, contexts %s tokens, %d steps, seed %llu; per "
      "rank: weights %s, caches %s\n",
      o.batch, o.q_len, static_cast<long long>(spec.rows()), contexts_text(spec).c_str(), o.steps,
      static_cast<unsigned long long>(o.seed), mib(spec.weight_bytes(tp)).c_str(),
      mib(spec.cache_bytes(tp)).c_str());
  std::fflush(stdout);

  json j;
  j["command"] = command_line();
  j["version"] = version_string();
  j["mode"] = "runtime";
  j["backend"] = backend_name;
  j["backend_choice"] = why;
  j["tp"] = tp;
  j["cp"] = o.cp;
  j["threads"] = threads;
  j["options"] = {{"batch", o.batch},       {"context", o.context},
                  {"q_len", o.q_len},       {"layers", o.layers},
                  {"steps", o.steps},       {"weights", o.weights},
                  {"hidden", model.hidden}, {"intermediate", model.intermediate},
                  {"seed", o.seed},         {"check", o.check},
                  {"moe", o.moe},           {"moe_weights", o.moe_weights}};

  // ---- The demo run ----
  const RunResult main = run(spec, false);
  progress.finish();
  std::printf("  prepare: %s (weights and caches built and bound in %.2f s)\n",
              prepare_result_name(main.prepared), main.setup_s);
  j["prepare"] = prepare_result_name(main.prepared);
  j["setup_s"] = main.setup_s;
  j["stats"] = stats_json(main.stats);
  if (main.prepared != PrepareResult::kActive) {
    std::printf("  stats (rank 0): %s\n", stats_line(main.stats).c_str());
    std::printf(
        "\nthe runtime did not become active (an engine would run these layers natively): "
        "the fallback reasons above say why\n");
    std::printf("FAIL (%.1f s)\n", seconds_since(start));
    j["passed"] = false;
    j["wall_s"] = seconds_since(start);
    if (!o.json_path.empty()) write_json_file(o.json_path, j);
    return kExitCheckFailed;
  }

  std::printf("\n%-5s %5s %-16s %11s %11s\n", "step", "rows", "seq_len", "time", "per layer");
  json jsteps = json::array();
  for (int s = 0; s < o.steps; ++s) {
    const double ms = main.step_ms[static_cast<std::size_t>(s)];
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t c : spec.contexts) {
      lo = std::min(lo, c + int64_t{s + 1} * o.q_len);
      hi = std::max(hi, c + int64_t{s + 1} * o.q_len);
    }
    const std::string lens = lo == hi ? std::to_string(hi) : fmt::format("{}..{}", hi, lo);
    std::printf("%-5d %5lld %-16s %8.3f ms %8.3f ms\n", s + 1, static_cast<long long>(spec.rows()),
                lens.c_str(), ms, ms / run_layers);
    jsteps.push_back(
        {{"step", s + 1}, {"rows", spec.rows()}, {"ms", ms}, {"ms_per_layer", ms / run_layers}});
  }
  j["steps"] = jsteps;
  std::printf("(time: begin_step through the last layer's output, eager, %s)\n",
              cuda ? "host-synchronized at the end of the step" : "wall clock of rank 0");
  std::printf("stats (rank 0): %s\n", stats_line(main.stats).c_str());

  // ---- The check run ----
  bool passed = main.stats.fallback_reasons.empty() && main.stats.steps_accepted == o.steps;
  json jchecks = json::array();
  auto report = [&](bool ok, const std::string& name, const std::string& detail) {
    std::printf("  [%s] %s%s%s\n", ok ? "ok" : "FAIL", name.c_str(), detail.empty() ? "" : ": ",
                detail.c_str());
    jchecks.push_back({{"name", name}, {"passed", ok}, {"detail", detail}});
    passed = passed && ok;
  };
  if (o.check == "none") {
    std::printf("\nchecks: none (--check none)\n");
  } else {
    ModelConfig small = model;
    small.hidden = std::min(model.hidden, kCheckHidden);
    small.intermediate = std::min(model.intermediate, kCheckHidden);
    small.num_layers = small.first_sparse_layer + 2;
    // ~17 blocks of context: top-16 is a real selection; the second request a block shorter.
    Spec check = make_spec(small, fp8, o.seed + 1, 2, 2200, o.q_len, 2);
    check.context_parallel = o.cp;
    check.moe = spec.moe;
    check.moe_fp8 = spec.moe_fp8;
    check.dense_layers = spec.dense_layers;
    std::printf(
        "\ncheck (small configuration: hidden %d, %s, 2 sparse layers%s, 2 requests x q-len %d, "
        "contexts %s, 2 steps, weights %s; %s at TP %d, every layer replayed by the oracle from "
        "the same input):\n",
        small.hidden, o.moe ? ffn_text.c_str() : fmt::format("MLP {}", small.intermediate).c_str(),
        dense_text.c_str(), o.q_len, contexts_text(check).c_str(), o.weights.c_str(),
        backend_name.c_str(), tp);
    const auto check_start = Clock::now();
    const RunResult sut = run(check, true);
    note("check: the oracle");
    const std::unique_ptr<testkit::demo::Oracle> oracle =
        cuda ? testkit::demo::make_cpu_runtime_oracle(check, threads)
             : testkit::demo::make_composed_oracle(check, threads);
    const SparseConfig sc = small.sparse(1);
    const int64_t rows = check.rows();
    const double abs_tol = kAbsTol + (tp > 1 ? kTpAbsTol : 0.0);
    const double rel_tol = kRelTol + (tp > 1 ? kTpRelTol : 0.0);
    testkit::ValueCheck values, moe_values;
    int64_t sel_fail = 0, swapped_rows = 0, lists = 0, sparse_layers_checked = 0;
    std::string sel_first;
    for (int s = 0; s < check.steps; ++s) {
      const Step step = make_step(check, s);
      oracle->begin_step(step);
      for (int l = 0; l < check.run_layers(); ++l) {
        const LayerRecord& rec =
            sut.records[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)];
        std::vector<uint16_t> hidden = rec.in_hidden;
        std::vector<uint16_t> residual = rec.in_residual;
        std::vector<int32_t> topk;
        HostTensor scores(DType::kF32, {rows, sc.index_heads, check.max_blocks});
        oracle->layer(l, step, hidden, residual, topk, scores);
        std::vector<bool> swapped(static_cast<std::size_t>(rows), false);
        const bool dense = check.is_dense(l);  // no selection
        if (!dense) {
          sel_fail += testkit::compare_selection_near_tie(sc, rec.topk, topk, scores, step.batch,
                                                          swapped, sel_first);
          lists += rows * sc.index_heads;
          ++sparse_layers_checked;
        }
        for (bool b : swapped) swapped_rows += b;
        const std::string where = fmt::format("step {} layer {}", s + 1, check.first_layer() + l);
        testkit::compare_close(values, rec.out_residual, residual, rows, small.hidden, abs_tol,
                               rel_tol, swapped, where + " residual");
        if (check.moe) {
          testkit::compare_rows_l2(moe_values, rec.out_hidden, hidden, rows, small.hidden,
                                   kMoeRowL2Tol, kMoeAbsCap, swapped,
                                   where + (dense ? " dense MLP output" : " MoE output"));
        } else {
          testkit::compare_close(values, rec.out_hidden, hidden, rows, small.hidden, abs_tol,
                                 rel_tol, swapped, where + " hidden");
        }
      }
    }
    progress.finish();
    std::printf("  oracle: %s (check run + oracle: %.2f s)\n", oracle->name().c_str(),
                seconds_since(check_start));
    j["check_s"] = seconds_since(check_start);
    const int64_t total_rows = rows * sparse_layers_checked;
    report(
        sel_fail == 0,
        "selections equal the oracle's (or swap near-tied blocks only, 1e-3 of the k-th score)",
        fmt::format("{} (row, head) lists, {} failed, {} of {} rows with near-tie swaps{}", lists,
                    sel_fail, swapped_rows, total_rows, sel_fail ? " - first: " + sel_first : ""));
    report(swapped_rows * 4 <= total_rows, "at most a quarter of the rows swap near-tied blocks",
           fmt::format("{} of {}", swapped_rows, total_rows));
    report(
        values.bad == 0 && values.checked > 0,
        fmt::format("layer outputs ({}) within {:g} + {:g} |want| of the oracle's",
                    check.moe ? "residual" : "hidden, residual", abs_tol, rel_tol),
        fmt::format("{} values ({} not bit-identical), {} failed, worst {:.3f} of the tolerance{}",
                    values.checked, values.differ, values.bad, values.worst,
                    values.bad ? " - first: " + values.first : ""));
    if (check.moe) {
      report(moe_values.bad == 0 && moe_values.checked > 0,
             fmt::format("MoE outputs (hidden) per row within relative L2 {:g} of the oracle's, "
                         "every element within {:g}{}",
                         kMoeRowL2Tol, kMoeAbsCap,
                         check.dense_layers ? " (and the dense layers' MLP outputs)" : ""),
             fmt::format("{} values ({} not bit-identical), {} rows failed, worst {:.3f} of the "
                         "tolerance{}",
                         moe_values.checked, moe_values.differ, moe_values.bad, moe_values.worst,
                         moe_values.bad ? " - first: " + moe_values.first : ""));
    }
    if (tp > 1) {
      report(sut.rank_mismatches == 0,
             fmt::format("every rank's outputs bit-identical (TP {})", tp),
             fmt::format("{} mismatched values", sut.rank_mismatches));
    }
    report(sut.stats.fallback_reasons.empty() && sut.stats.steps_accepted == check.steps,
           "no fallback, every step accepted", stats_line(sut.stats));
    j["check_oracle"] = oracle->name();
    j["check_tolerance"] = {{"abs", abs_tol}, {"rel", rel_tol}};
  }
  const double wall = seconds_since(start);
  std::printf("%s (%.1f s)\n", passed ? "PASS" : "FAIL", wall);
  j["checks"] = jchecks;
  j["passed"] = passed;
  j["wall_s"] = wall;
  if (!o.json_path.empty()) write_json_file(o.json_path, j);
  return passed ? kExitOk : kExitCheckFailed;
}

}  // namespace m3msa::cli
