// The moe family (src/cuda/moe.h) against the CPU reference cpu::moe (docs/spec.md section 8):
// M3's per-rank shapes at TP 4 and 8 and a small one, 1..16 token rows, bf16 and MXFP8 experts;
// CUDA-graph replay equals eager bit for bit; deterministic run to run. The dense MLP on the same
// kernels (cuda::launch_dense_mlp) against cpu::dense_mlp alike, at M3's dense rank shapes.
// The expert projections run both ways: on tensor cores (MoeParams::tensor_cores, shapes with
// hidden and intermediates multiples of 64) and as fp32 FMA, and on tensor cores with
// programmatic dependent launches (MoeParams::pdl); the "no shared" case (intermediate 96) takes
// the FMA kernels either way. Skips without a GPU.
//
// Routing: the GPU sums a logit in another fp32 order than the CPU, so two experts whose keys are
// within 1e-5 of each other across the k-th place may swap; such rows are counted and skipped
// (their outputs legitimately differ), every other row must pick the CPU's experts in the CPU's
// order with weights within 1e-5 relative.
// Outputs (fp32 partials): g, u and the activation are rounded to bf16 on both sides, so a
// different fp32 sum order can move one of them by one bf16 ulp (2^-8 relative); the error of an
// output element is bounded by ~2^-7 of the row's largest magnitude: |gpu - cpu| <= 2^-7 * max
// |cpu row| + 1e-6.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "cuda/common.cuh"
#include "cuda/moe.h"
#include "cuda/moe_params.h"
#include "cuda/timeline.h"
#include "indexer_test_util.h"
#include "m3msa/moe.h"
#include "m3msa/testing/moe_model.h"
#include "m3msa/testing/random.h"

namespace m3msa {
namespace {

using attntest::DevTensor;
using attntest::to_dev;

HostTensor host_of(const TensorView& v) {
  HostTensor t(v.dtype, v.sizes());
  if (v.defined()) std::memcpy(t.data(), v.data, v.nbytes());
  return t;
}

// The kernel choices every case runs: tensor cores (where the shapes allow; MXFP8 experts' weights
// streamed through shared memory), the same with the register ring only (MoeParams::stream off),
// the shared expert's gate/up in the gate/up launch and beside the router at every row count
// (MoeParams::shared_with_router_min_rows), the
// top-k in a launch of its own at every row count and in the router's at every one
// (MoeParams::router_picks_max_rows), the down projection and the combine in two launches at every
// row count and in one at every row count with 3 and 2 ring slots (MoeParams::down_combine,
// down_combine_max_rows), the fp32 FMA kernels, tensor cores with programmatic dependent
// launches, tensor cores with more chunks in flight (MoeParams::deep), the down
// projection's tiles sharing one load ring (MoeParams::down_tiles), and the whole MoE in one
// persistent launch (MoeParams::persistent, twice, so a launch after one that ran finds the
// counters reset); the register ring and the last ones must give mma's bits (the first choice).
struct KernelChoice {
  const char* name;
  bool tensor_cores = true;
  bool pdl = false;
  bool deep = false;
  int down_tiles = 1;
  bool persistent = false;
  bool stream = true;  // MoeParams::stream (false: the register ring)
  int shared_with_router_min_rows = cuda::kMoeSharedWithRouterMinRows;
  int router_picks_max_rows = cuda::kMoeRouterPicksMaxRows;
  int down_combine = cuda::kMoeDownCombineSlots;  // MoeParams::down_combine
  int down_combine_max_rows = cuda::kMoeDownCombineMaxRows;
  bool same_bits_as_mma() const {
    return deep || down_tiles > 1 || persistent || !stream ||
           shared_with_router_min_rows != cuda::kMoeSharedWithRouterMinRows ||
           router_picks_max_rows != cuda::kMoeRouterPicksMaxRows ||
           down_combine != cuda::kMoeDownCombineSlots ||
           down_combine_max_rows != cuda::kMoeDownCombineMaxRows;
  }
};
// Each choice names only what it changes from the defaults above.
constexpr KernelChoice kKernelChoices[] = {
    {.name = "mma"},
    {.name = "mma-ring", .stream = false},
    {.name = "mma-shared-late", .shared_with_router_min_rows = cuda::kMoeMaxRows + 1},
    {.name = "mma-shared-early", .shared_with_router_min_rows = 0},
    {.name = "mma-topk-apart", .router_picks_max_rows = 0},
    {.name = "mma-topk-in-router", .router_picks_max_rows = cuda::kMoeMaxRows},
    {.name = "mma-down-apart", .down_combine = 0},
    {.name = "mma-down-combine", .down_combine_max_rows = cuda::kMoeMaxRows},
    {.name = "mma-down-combine2-topk-apart",
     .router_picks_max_rows = 0,
     .down_combine = 2,
     .down_combine_max_rows = cuda::kMoeMaxRows},
    {.name = "fma", .tensor_cores = false},
    {.name = "mma+pdl", .pdl = true},
    {.name = "mma-deep", .deep = true},
    {.name = "mma-down4", .down_tiles = cuda::kMoeDownTiles},
    {.name = "mma-persistent", .persistent = true},
    {.name = "mma-persistent+pdl", .pdl = true, .persistent = true}};

// Records the "mma" choice's output; the deep, tiled and persistent choices must give its bits
// (the same k order).
void expect_same_as_mma(const KernelChoice& kernels, const HostTensor& got,
                        std::vector<float>& mma_out) {
  const float* data = got.ptr<float>();
  const std::size_t n = static_cast<std::size_t>(got.numel());
  if (kernels.tensor_cores && !kernels.pdl && !kernels.same_bits_as_mma()) {
    mma_out.assign(data, data + n);
  }
  if (!kernels.same_bits_as_mma()) return;
  ASSERT_EQ(mma_out.size(), n) << "the mma choice runs before " << kernels.name;
  EXPECT_EQ(std::memcmp(mma_out.data(), data, n * sizeof(float)), 0)
      << kernels.name << " changed bits of the mma kernels' output";
}

struct Case {
  const char* name;
  int hidden, experts, topk, inter_rank, shared_rank;
  bool fp8;
  // > 0: expert e takes the router row and bias of expert e % router_groups, so experts tie
  // exactly and the picks follow the tie rule (the lower id first).
  int router_groups = 0;
  // The MXFP8 scale tensors one byte into their allocations (not 16-byte aligned): the streamed
  // kernels' bulk copies cannot take them, so the launch must keep the register ring (mma's bits).
  bool unaligned_scales = false;
};

struct Device3 {
  std::vector<DevTensor> keep;
  TensorView up(const TensorView& v) {
    if (!v.defined()) return {};
    keep.push_back(to_dev(host_of(v)));
    return keep.back().view;
  }
  // A copy `offset` bytes into its allocation.
  TensorView up_at(const TensorView& v, std::size_t offset) {
    if (!v.defined()) return {};
    DevTensor d;
    d.buffer = cuda::DeviceBuffer(v.nbytes() + offset);
    d.view = v;
    d.view.data = static_cast<char*>(d.buffer.data()) + offset;
    d.view.device = Device::cuda(0);
    CUDA_CHECK(cudaMemcpy(d.view.data, v.data, v.nbytes(), cudaMemcpyHostToDevice));
    keep.push_back(std::move(d));
    return keep.back().view;
  }
};

// One model per case (M3's rank shapes take seconds to draw), checked at every row count.
// `launch` (which wrote `eager` into `out`) captured into a graph and replayed over a poisoned
// `out`, then run eagerly once more: both give `eager`'s bits.
template <typename Launch>
void expect_replay_equals_eager(Launch launch, cudaStream_t stream, const TensorView& out,
                                const HostTensor& eager, int launches = -1) {
  HostTensor again(eager.dtype(), eager.shape());
  CUDA_CHECK(cudaMemsetAsync(out.data, 0xFF, eager.nbytes(), stream));
  cudaGraph_t graph = nullptr;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  launch(stream);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  size_t nodes = 0;
  CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
  if (launches >= 0) {
    EXPECT_EQ(nodes, static_cast<size_t>(launches)) << "kernels in the graph of one launch";
  }
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaMemcpy(again.data(), out.data, again.nbytes(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(again.data(), eager.data(), eager.nbytes()), 0) << "graph replay != eager";
  launch(stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaMemcpy(again.data(), out.data, again.nbytes(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(again.data(), eager.data(), eager.nbytes()), 0) << "eager run to run";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

// One launch_moe recorded on `rec` over a poisoned output: it must give `eager`'s bits.
void record_moe_launch(const cuda::MoeParams& p, cudaStream_t stream, const TensorView& out,
                       const HostTensor& eager, cuda::timeline::Recorder& rec) {
  CUDA_CHECK(cudaMemsetAsync(out.data, 0xFF, eager.nbytes(), stream));
  {
    cuda::timeline::Scope scope(rec);
    cuda::launch_moe(p, stream);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  HostTensor again(eager.dtype(), eager.shape());
  CUDA_CHECK(cudaMemcpy(again.data(), out.data, again.nbytes(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(again.data(), eager.data(), eager.nbytes()), 0)
      << "a recorded launch changed the output";
}

// The persistent launch under a timeline recorder (cuda/timeline.h): `eager`'s bits, and one
// record per work item, each started and ended, of the item kinds the launch has (one router
// item per expert, one top-k item).
void expect_recorded_persistent_launch(const cuda::MoeParams& p, cudaStream_t stream,
                                       const TensorView& out, const HostTensor& eager) {
  cuda::timeline::Recorder rec;
  record_moe_launch(p, stream, out, eager, rec);
  ASSERT_EQ(rec.launches().size(), 1u);
  const cuda::timeline::Launch& l = rec.launches()[0];
  EXPECT_EQ(l.kernel, "moe persistent");
  ASSERT_EQ(l.marks.size(), 3u);
  const std::vector<uint64_t> words = rec.read();
  std::vector<int> per_kind(l.kinds.size(), 0);
  for (int64_t u = 0; u < l.units; ++u) {
    const uint64_t* r = words.data() + (l.first + u) * cuda::timeline::kWords;
    ASSERT_NE(r[0], 0u) << "item " << u << " has no start";
    ASSERT_NE(r[2], 0u) << "item " << u << " has no end";
    EXPECT_LE(r[0], r[2]) << "item " << u;
    if (r[1] != 0) {
      EXPECT_LE(r[0], r[1]) << "item " << u;
      EXPECT_LE(r[1], r[2]) << "item " << u;
    }
    const uint64_t kind = r[cuda::timeline::kMarks] >> 32;
    ASSERT_LT(kind, l.kinds.size()) << "item " << u;
    ++per_kind[static_cast<size_t>(kind)];
  }
  EXPECT_EQ(per_kind[0], p.num_experts) << "router items";
  EXPECT_EQ(per_kind[2], 1) << "top-k items";
  EXPECT_FALSE(cuda::timeline::summarize(rec.launches(), words).empty());
}

// The launch sequence under a timeline recorder: `eager`'s bits, one recorded launch per kernel
// (cuda::moe_launches), every CTA started, had its inputs and ended in that order, of the kinds
// its launch has (the router's launch: a CTA per expert's logits, one of them or a launch of its
// own taking the top-k, the shared expert's gate/up tiles beside them; the expert launches:
// routed, shared expert or no tokens), and every launch's CTAs had their inputs only after every
// CTA of the launch before it ended (the programmatic wait, or stream order).
void expect_recorded_launch_sequence(const cuda::MoeParams& p, cudaStream_t stream,
                                     const TensorView& out, const HostTensor& eager) {
  cuda::timeline::Recorder rec;
  record_moe_launch(p, stream, out, eager, rec);
  const auto& launches = rec.launches();
  ASSERT_EQ(launches.size(), static_cast<std::size_t>(cuda::moe_launches(p)));
  const std::vector<uint64_t> words = rec.read();
  uint64_t previous_end = 0;
  int topk_ctas = 0;
  for (std::size_t i = 0; i < launches.size(); ++i) {
    const cuda::timeline::Launch& l = launches[i];
    SCOPED_TRACE(l.kernel);
    ASSERT_EQ(l.marks.size(), 3u);
    const bool router = l.kernel == "moe router" || l.kernel == "moe top-k";
    EXPECT_EQ(i == 0, l.kernel == "moe router") << "launch " << i;
    std::vector<int64_t> per_kind(l.kinds.size(), 0);
    uint64_t first_inputs = ~uint64_t{0};
    uint64_t last_end = 0;
    for (int64_t u = 0; u < l.units; ++u) {
      const uint64_t* r = words.data() + (l.first + u) * cuda::timeline::kWords;
      ASSERT_NE(r[0], 0u) << "CTA " << u << " has no start";
      ASSERT_NE(r[1], 0u) << "CTA " << u << " has no inputs mark";
      ASSERT_NE(r[2], 0u) << "CTA " << u << " has no end";
      EXPECT_LE(r[0], r[1]) << "CTA " << u;
      EXPECT_LE(r[1], r[2]) << "CTA " << u;
      first_inputs = std::min(first_inputs, r[1]);
      last_end = std::max(last_end, r[2]);
      const uint64_t kind = r[cuda::timeline::kMarks] >> 32;
      ASSERT_LT(kind, l.kinds.size()) << "CTA " << u;
      ++per_kind[static_cast<std::size_t>(kind)];
    }
    if (router) {
      topk_ctas += static_cast<int>(per_kind[2]);
      if (l.kernel == "moe router") {
        EXPECT_EQ(per_kind[0] + per_kind[2], p.num_experts) << "logits CTAs";
        EXPECT_EQ(per_kind[0] + per_kind[1] + per_kind[2], l.units);
      }
    }
    if (i > 0) {
      EXPECT_GE(first_inputs, previous_end)
          << "a CTA had its inputs before the launch before it ended";
    }
    previous_end = last_end;
  }
  EXPECT_EQ(topk_ctas, 1) << "one CTA takes the top-k";
  EXPECT_FALSE(cuda::timeline::summarize(launches, words).empty());
}

void run_case(const Case& c, const std::vector<int>& row_counts, uint64_t seed) {
  ModelConfig m;
  m.hidden = c.hidden;
  m.num_experts = c.experts;
  m.experts_per_token = c.topk;
  m.moe_intermediate = c.inter_rank;  // one rank's slice as a TP 1 model
  m.shared_experts = c.shared_rank > 0 ? 1 : 0;
  const MoeConfig config = m.moe(1);
  testkit::MasterMoe master = testkit::make_master_moe(m, seed, c.fp8);
  if (c.router_groups > 0) {
    for (int e = c.router_groups; e < c.experts; ++e) {
      const auto from = static_cast<std::size_t>(e % c.router_groups);
      std::copy_n(master.router.begin() + static_cast<std::ptrdiff_t>(from) * c.hidden, c.hidden,
                  master.router.begin() + static_cast<std::ptrdiff_t>(e) * c.hidden);
      master.bias[static_cast<std::size_t>(e)] = master.bias[from];
    }
  }
  std::vector<HostTensor> storage;
  LayerWeights lw;
  testkit::bind_moe(m, master, 0, 1, storage, lw);
  // Only the router is needed from here on (the near-tie margins).
  master.w13 = {};
  master.w2 = {};
  master.shared_w13 = {};
  master.shared_w2 = {};
  Device3 dev;
  MoeArgs weights_on_gpu;
  weights_on_gpu.router_weight = dev.up(lw.router_weight);
  weights_on_gpu.router_bias = dev.up(lw.router_bias);
  const std::size_t scale_offset = c.unaligned_scales ? 1 : 0;
  weights_on_gpu.experts = {dev.up(lw.experts.w13), dev.up_at(lw.experts.w13_scale, scale_offset),
                            dev.up(lw.experts.w2), dev.up_at(lw.experts.w2_scale, scale_offset)};
  weights_on_gpu.shared = {
      dev.up(lw.shared_expert.w13), dev.up_at(lw.shared_expert.w13_scale, scale_offset),
      dev.up(lw.shared_expert.w2), dev.up_at(lw.shared_expert.w2_scale, scale_offset)};
  for (int rows : row_counts) {
    SCOPED_TRACE(std::string(c.name) + " rows " + std::to_string(rows) +
                 (c.fp8 ? " mxfp8" : " bf16"));
    HostTensor x(DType::kBF16, {rows, c.hidden});
    testkit::fill_bf16(x, seed + 1 + static_cast<uint64_t>(rows));

    // CPU reference.
    HostTensor want(DType::kF32, {rows, c.hidden});
    HostTensor ids(DType::kI32, {rows, c.topk});
    HostTensor weights(DType::kF32, {rows, c.topk});
    MoeArgs cpu_args;
    cpu_args.x = x.view();
    cpu_args.router_weight = lw.router_weight;
    cpu_args.router_bias = lw.router_bias;
    cpu_args.experts = lw.experts;
    cpu_args.shared = lw.shared_expert;
    cpu_args.out = want.view();
    cpu_args.topk_ids = ids.view();
    cpu_args.topk_weights = weights.view();
    cpu::moe(config, cpu_args, 0);

    // The margin of each row's pick: the k-th key against the best key not picked.
    std::vector<bool> near_tie(static_cast<std::size_t>(rows), false);
    for (int r = 0; r < rows; ++r) {
      std::vector<double> key(static_cast<std::size_t>(c.experts));
      for (int e = 0; e < c.experts; ++e) {
        double logit = 0;
        for (int i = 0; i < c.hidden; ++i) {
          logit += double(bf16_to_float(x.ptr<uint16_t>()[r * c.hidden + i])) *
                   master.router[static_cast<std::size_t>(e) * c.hidden + i];
        }
        key[std::size_t(e)] = 1.0 / (1.0 + std::exp(-logit)) + master.bias[std::size_t(e)];
      }
      // Exact ties (experts sharing a router row) are not near ties: both sides break them by
      // id. A near tie: a different key within 1e-5 of the k-th.
      std::vector<double> sorted = key;
      std::sort(sorted.rbegin(), sorted.rend());
      const double kth = sorted[std::size_t(c.topk - 1)];
      for (double k : key) {
        if (k != kth && std::fabs(k - kth) < 1e-5) near_tie[std::size_t(r)] = true;
      }
    }

    // GPU: the tensor-core kernels (where the shapes allow) and the fp32 FMA kernels.
    std::vector<float>
        mma_out;  // the first choice's output: the deep and tiled kernels must match it
    for (const KernelChoice& kernels : kKernelChoices) {
      SCOPED_TRACE(kernels.name);
      MoeArgs g = weights_on_gpu;
      const DevTensor dx = to_dev(x);
      g.x = dx.view;
      HostTensor out_host(DType::kF32, {rows, c.hidden});
      DevTensor dout = to_dev(out_host);
      g.out = dout.view;
      g.topk_ids = {};
      g.topk_weights = {};
      cuda::DeviceBuffer workspace(cuda::moe_workspace_bytes(config, rows));
      CUDA_CHECK(cudaMemset(workspace.data(), 0, cuda::moe_workspace_bytes(config, rows)));
      cuda::MoeParams p = cuda::moe_params(config, g, workspace.data());
      p.tensor_cores = kernels.tensor_cores;
      p.pdl = kernels.pdl;
      p.deep = kernels.deep;
      p.down_tiles = kernels.down_tiles;
      p.persistent = kernels.persistent;
      p.stream = kernels.stream;
      p.shared_with_router_min_rows = kernels.shared_with_router_min_rows;
      p.router_picks_max_rows = kernels.router_picks_max_rows;
      p.down_combine = kernels.down_combine;
      p.down_combine_max_rows = kernels.down_combine_max_rows;
      cuda::Stream stream;
      cuda::launch_moe(p, stream.get());
      if (kernels.persistent) {  // again, on counters the first launch reset
        CUDA_CHECK(cudaMemsetAsync(dout.view.data, 0xFF, out_host.nbytes(), stream.get()));
        cuda::launch_moe(p, stream.get());
      }
      stream.synchronize();
      HostTensor got(DType::kF32, {rows, c.hidden});
      CUDA_CHECK(cudaMemcpy(got.data(), dout.view.data, got.nbytes(), cudaMemcpyDeviceToHost));
      expect_same_as_mma(kernels, got, mma_out);
      HostTensor gpu_ids(DType::kI32, {rows, c.topk});
      HostTensor gpu_weights(DType::kF32, {rows, c.topk});
      CUDA_CHECK(cudaMemcpy(gpu_ids.data(), p.topk_ids, gpu_ids.nbytes(), cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemcpy(gpu_weights.data(), p.topk_weights, gpu_weights.nbytes(),
                            cudaMemcpyDeviceToHost));

      int skipped = 0;
      double worst = 0;
      for (int r = 0; r < rows; ++r) {
        if (near_tie[std::size_t(r)]) {
          ++skipped;
          continue;
        }
        for (int i = 0; i < c.topk; ++i) {
          ASSERT_EQ(gpu_ids.ptr<int32_t>()[r * c.topk + i], ids.ptr<int32_t>()[r * c.topk + i])
              << "row " << r << " pick " << i;
          const float w = weights.ptr<float>()[r * c.topk + i];
          EXPECT_NEAR(gpu_weights.ptr<float>()[r * c.topk + i], w, 1e-5f * std::fabs(w) + 1e-7f);
        }
        double row_max = 0;
        for (int n = 0; n < c.hidden; ++n) {
          row_max = std::max(row_max, double(std::fabs(want.ptr<float>()[r * c.hidden + n])));
        }
        for (int n = 0; n < c.hidden; ++n) {
          const double a = got.ptr<float>()[r * c.hidden + n];
          const double b = want.ptr<float>()[r * c.hidden + n];
          const double tol = row_max / 128 + 1e-6;
          worst = std::max(worst, std::fabs(a - b) / tol);
          ASSERT_LE(std::fabs(a - b), tol) << "row " << r << " element " << n;
        }
      }
      std::printf(
          "[ info ] %s rows %d %s %s: worst error / tolerance %.3f, near-tie rows skipped %d\n",
          c.name, rows, c.fp8 ? "mxfp8" : "bf16", kernels.name, worst, skipped);
      EXPECT_LT(skipped, std::max(1, rows / 2 + 1));

      // Graph replay == eager, and a second eager run changes no bit.
      expect_replay_equals_eager([&](cudaStream_t s) { cuda::launch_moe(p, s); }, stream.get(),
                                 dout.view, got, cuda::moe_launches(p));
      // The persistent kernel's waits all ended (none gave up).
      uint32_t status = 0;
      CUDA_CHECK(
          cudaMemcpy(&status, cuda::moe_status_word(p), sizeof(status), cudaMemcpyDeviceToHost));
      EXPECT_EQ(status, 0u) << kernels.name << ": a persistent wait gave up";
      if (cuda::moe_runs_persistent(p)) {
        expect_recorded_persistent_launch(p, stream.get(), dout.view, got);
      } else if (std::string(kernels.name) == "mma" || std::string(kernels.name) == "fma" ||
                 std::string(kernels.name) == "mma-topk-apart" ||
                 std::string(kernels.name) == "mma-down-apart") {
        // Every kernel of the launch sequence stamps its CTAs (these choices launch each one).
        expect_recorded_launch_sequence(p, stream.get(), dout.view, got);
      }
    }
  }
}

TEST(MoeKernel, SmallShapesMatchTheCpuReference) {
  M3MSA_REQUIRE_GPU();
  for (bool fp8 : {false, true}) {
    const Case c{"small", 256, 16, 4, 64, 64, fp8};
    run_case(c, {1, 3, 16}, fp8 ? 101 : 102);
  }
}

TEST(MoeKernel, SmallWithoutSharedExpertAndTopTwo) {
  M3MSA_REQUIRE_GPU();
  const Case c{"no shared", 128, 8, 2, 96, 0, true};
  run_case(c, {1, 5}, 201);
}

// The same without a shared expert at shapes the tensor-core kernels (and the persistent one)
// take.
TEST(MoeKernel, SmallWithoutSharedExpertOnTensorCores) {
  M3MSA_REQUIRE_GPU();
  for (bool fp8 : {false, true}) {
    const Case c{"no shared, mma", 128, 8, 2, 64, 0, fp8};
    run_case(c, {1, 5, 16}, fp8 ? 211 : 212);
  }
}

// MXFP8 scales that are not 16-byte aligned: the launch keeps the register ring (the streamed
// kernels' bulk copies need aligned rows) and gives the same answers and bits.
TEST(MoeKernel, UnalignedMxfp8ScalesKeepTheRegisterRing) {
  M3MSA_REQUIRE_GPU();
  Case c{"unaligned scales", 256, 16, 4, 64, 64, true};
  c.unaligned_scales = true;
  run_case(c, {1, 16}, 241);
}

// Experts sharing router rows and bias tie exactly: the picks take the lower ids first, as the
// CPU reference does (with 128 experts the top-k holds the keys in registers).
TEST(MoeKernel, TiedRoutingKeysPickTheLowerExpertIds) {
  M3MSA_REQUIRE_GPU();
  for (bool fp8 : {false, true}) {
    Case c{"tied router rows", 128, 128, 4, 64, 64, fp8};
    c.router_groups = 3;
    run_case(c, {1, 4, 16}, fp8 ? 221 : 222);
  }
}

// Parameters the launcher's validation takes up to the field a refusal test sets (it refuses
// before any CUDA call, so these run without a GPU).
cuda::MoeParams params_checked_before_launch() {
  cuda::MoeParams p;
  p.rows = 1;
  p.topk = 4;
  p.num_experts = 8;
  p.hidden = 64;
  return p;
}

// MoeParams::down_combine takes 0, 2 or 3 ring slots: anything else is refused, naming the field,
// before any launch.
TEST(MoeKernel, RefusesADownCombineRingOfAnotherSize) {
  for (int slots : {1, 4, -1}) {
    SCOPED_TRACE(slots);
    cuda::MoeParams p = params_checked_before_launch();
    p.down_combine = slots;
    idxtest::expect_error([&] { cuda::launch_moe(p, nullptr); }, ErrorCode::kInvalidArgument,
                          "down_combine");
  }
}

// MoeParams::shared_with_router_min_rows takes 0 (always beside the router) and up: a negative
// count is refused, naming the field, before any launch.
TEST(MoeKernel, RefusesANegativeSharedWithRouterMinRows) {
  cuda::MoeParams p = params_checked_before_launch();
  p.shared_with_router_min_rows = -1;
  idxtest::expect_error([&] { cuda::launch_moe(p, nullptr); }, ErrorCode::kInvalidArgument,
                        "shared_with_router_min_rows");
}

// More experts than the top-k holds in registers: the picks read the keys from memory, ties too.
TEST(MoeKernel, ManyExpertsTakeTheTopKFromMemory) {
  M3MSA_REQUIRE_GPU();
  Case c{"300 experts", 128, 300, 4, 64, 64, true};
  c.router_groups = 150;
  run_case(c, {1, 5}, 231);
}

// M3's rank shapes: hidden 6144, 128 experts, top 4, I_r 768 (TP 4) and 384 (TP 8).
TEST(MoeKernel, M3RankShapesMatchTheCpuReference) {
  M3MSA_REQUIRE_GPU();
  for (bool fp8 : {true, false}) {
    for (int inter : {768, 384}) {
      const Case c{inter == 768 ? "M3 TP4 rank" : "M3 TP8 rank", 6144, 128, 4, inter, inter, fp8};
      run_case(c, {1, 4, 16}, 300 + inter + (fp8 ? 1 : 0));
    }
  }
}

// The dense MLP of the dense layers: M3's D_r 3072 (TP 4) and 1536 (TP 8) at hidden 6144, and a
// small shape; the same output tolerance as the experts (no routing).
void run_dense_case(int hidden, int width, bool fp8, const std::vector<int>& row_counts,
                    uint64_t seed) {
  ModelConfig m;
  m.hidden = hidden;
  m.dense_intermediate = width;
  const testkit::MasterDenseMlp master = testkit::make_master_dense_mlp(m, seed, fp8);
  std::vector<HostTensor> storage;
  const ExpertWeights mlp = testkit::bind_dense_mlp(m, master, 0, 1, storage);
  Device3 dev;
  const ExpertWeights on_gpu{dev.up(mlp.w13), dev.up(mlp.w13_scale), dev.up(mlp.w2),
                             dev.up(mlp.w2_scale)};
  for (int rows : row_counts) {
    SCOPED_TRACE("dense mlp hidden " + std::to_string(hidden) + " width " + std::to_string(width) +
                 " rows " + std::to_string(rows) + (fp8 ? " mxfp8" : " bf16"));
    HostTensor x(DType::kBF16, {rows, hidden});
    testkit::fill_bf16(x, seed + 1 + static_cast<uint64_t>(rows));
    HostTensor want(DType::kF32, {rows, hidden});
    DenseMlpArgs cpu_args;
    cpu_args.x = x.view();
    cpu_args.mlp = mlp;
    cpu_args.out = want.view();
    cpu::dense_mlp(cpu_args, 0);

    std::vector<float>
        mma_out;  // the first choice's output: the deep and tiled kernels must match it
    for (const KernelChoice& kernels : kKernelChoices) {
      SCOPED_TRACE(kernels.name);
      const DevTensor dx = to_dev(x);
      HostTensor out_host(DType::kF32, {rows, hidden});
      DevTensor dout = to_dev(out_host);
      DenseMlpArgs g;
      g.x = dx.view;
      g.mlp = on_gpu;
      g.out = dout.view;
      cuda::DeviceBuffer workspace(cuda::dense_mlp_workspace_bytes(width, rows));
      cuda::MoeParams p = cuda::dense_mlp_params(g, workspace.data());
      p.tensor_cores = kernels.tensor_cores;
      p.pdl = kernels.pdl;
      p.deep = kernels.deep;
      p.down_tiles = kernels.down_tiles;
      p.stream = kernels.stream;
      cuda::Stream stream;
      cuda::launch_dense_mlp(p, stream.get());
      stream.synchronize();
      HostTensor got(DType::kF32, {rows, hidden});
      CUDA_CHECK(cudaMemcpy(got.data(), dout.view.data, got.nbytes(), cudaMemcpyDeviceToHost));
      expect_same_as_mma(kernels, got, mma_out);
      double worst = 0;
      for (int r = 0; r < rows; ++r) {
        double row_max = 0;
        for (int n = 0; n < hidden; ++n) {
          row_max = std::max(row_max, double(std::fabs(want.ptr<float>()[r * hidden + n])));
        }
        for (int n = 0; n < hidden; ++n) {
          const double a = got.ptr<float>()[r * hidden + n];
          const double b = want.ptr<float>()[r * hidden + n];
          const double tol = row_max / 128 + 1e-6;
          worst = std::max(worst, std::fabs(a - b) / tol);
          ASSERT_LE(std::fabs(a - b), tol) << "row " << r << " element " << n;
        }
      }
      std::printf("[ info ] dense mlp %d x %d rows %d %s %s: worst error / tolerance %.3f\n",
                  hidden, width, rows, fp8 ? "mxfp8" : "bf16", kernels.name, worst);

      // Graph replay == eager, and a second eager run changes no bit.
      expect_replay_equals_eager([&](cudaStream_t s) { cuda::launch_dense_mlp(p, s); },
                                 stream.get(), dout.view, got);
    }
  }
}

TEST(DenseMlpKernel, SmallShapesMatchTheCpuReference) {
  M3MSA_REQUIRE_GPU();
  for (bool fp8 : {false, true}) run_dense_case(256, 128, fp8, {1, 3, 16}, fp8 ? 401 : 402);
}

TEST(DenseMlpKernel, M3RankShapesMatchTheCpuReference) {
  M3MSA_REQUIRE_GPU();
  for (bool fp8 : {true, false}) {
    for (int width : {3072, 1536}) run_dense_case(6144, width, fp8, {1, 4, 16}, 500 + width);
  }
}

}  // namespace
}  // namespace m3msa
