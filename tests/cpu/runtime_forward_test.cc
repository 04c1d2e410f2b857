// forward_layer on the CPU backend: TP = 2 and TP = 4 (ranks as threads) against TP = 1, and
// TP = 1 against the test kit's composed reference of the layer (m3msa/testing/oracle.h: the CPU
// reference ops with double-precision matmuls and norms; independent numerics, so wiring errors
// cannot cancel).
//
// Tolerances (bf16 outputs, values O(1)): |got - want| <= kAbsTol + kRelTol * |want|.
//  - TP = P vs TP = 1: the only difference is the fp32 order of the o_proj / mlp_down sums (rank
//    partials added in rank order), so a few bf16 ulps: kRelTol = 2^-6, kAbsTol = 2^-8.
//  - TP = 1 vs the reference: double vs fp32 accumulation can flip a bf16 rounding anywhere in
//    the chain (projections, norms, attention), over two layers and three steps: kRelTol = 2^-5,
//    kAbsTol = 2^-6.
// Exact checks: every rank of a TP group returns bit-identical outputs; the first sparse layer's
// caches of every rank equal the TP = 1 caches (projection rows do not depend on TP).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "m3msa/comm.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "m3msa/runtime.h"
#include "m3msa/testing/checks.h"
#include "m3msa/testing/oracle.h"
#include "m3msa/testing/runtime_model.h"

namespace m3msa {
namespace {

using testkit::MasterModel;
using testkit::StepMeta;

constexpr int64_t kMaxContext = 256;

struct Scenario {
  MasterModel master;
  RuntimeConfig config;
  int64_t max_blocks = 0;
  std::vector<StepMeta> steps;
  std::vector<std::vector<uint16_t>> hidden_in;    // per step [rows, hidden]
  std::vector<std::vector<uint16_t>> residual_in;  // per step [rows, hidden]
};

// Three decode steps: speculative rows (q = 2) with a padding request, then plain decode (q = 1)
// with a new request. Contexts span 3..10 blocks of 16 against top-4.
Scenario make_scenario(int intermediate, uint64_t seed) {
  Scenario s;
  s.config = testkit::small_config(intermediate);
  s.config.max_context = kMaxContext;
  const ModelConfig& m = s.config.model;
  s.max_blocks = kMaxContext / m.block_size;
  const int64_t pages = s.config.max_requests * s.max_blocks + 3;
  s.master = testkit::make_master(m, pages, seed, /*mlp_on_last_layer=*/true);
  const auto index_perm = testkit::page_permutation(pages, seed + 1);
  const auto kv_perm = testkit::page_permutation(pages, seed + 2);
  const std::vector<std::pair<std::vector<int32_t>, int>> shapes = {
      {{70, 150, 0}, 2}, {{72, 152, 0}, 2}, {{73, 153, 40, 0}, 1}};
  testkit::SplitMix64 rng(seed + 3);
  for (const auto& [lens, q] : shapes) {
    s.steps.push_back(testkit::make_step(lens, q, m.block_size, s.max_blocks, index_perm, kv_perm));
    const std::size_t n = lens.size() * static_cast<std::size_t>(q) * m.hidden;
    std::vector<uint16_t> h(n), r(n);
    for (std::size_t i = 0; i < n; ++i) {
      h[i] = float_to_bf16(rng.signed_unit());
      r[i] = float_to_bf16(rng.signed_unit());
    }
    s.hidden_in.push_back(h);
    s.residual_in.push_back(r);
  }
  return s;
}

struct RunOptions {
  bool fp8_qkv = false;
  bool context_parallel = false;
  int share_period = 1;
};

struct RunResult {
  // [rank][step]: the last layer's (hidden, residual).
  std::vector<std::vector<std::vector<uint16_t>>> hidden, residual;
  // [rank][step][layer]: the selection of every layer ([rows, KV heads of the rank, k]).
  std::vector<std::vector<std::vector<std::vector<int32_t>>>> topk;
  std::vector<testkit::RankModel> ranks;  // their caches after the run
  std::vector<RuntimeStats> stats;        // per rank, before close
};

RunResult run_runtime(const Scenario& s, int world, const RunOptions& options = {}) {
  RunResult out;
  out.hidden.assign(static_cast<std::size_t>(world), {});
  out.residual.assign(static_cast<std::size_t>(world), {});
  out.topk.assign(static_cast<std::size_t>(world), {});
  out.stats.assign(static_cast<std::size_t>(world), {});
  for (int r = 0; r < world; ++r) {
    out.ranks.push_back(
        testkit::make_rank_model(s.master, r, world, options.fp8_qkv, options.context_parallel));
  }
  RuntimeConfig config = s.config;
  config.context_parallel = options.context_parallel;
  config.selection_share_period = options.share_period;
  auto group = ThreadGroup::create(world, std::chrono::seconds(60));
  const auto errors = run_ranks(group, [&](Communicator& comm) {
    const int r = comm.rank();
    Runtime runtime([](const std::string&) {});
    const PrepareResult prepared =
        runtime.prepare(out.ranks[static_cast<std::size_t>(r)].weights, config, comm);
    M3MSA_CHECK_INTERNAL(prepared == PrepareResult::kActive, "prepare returned ",
                         prepare_result_name(prepared));
    for (std::size_t step = 0; step < s.steps.size(); ++step) {
      const StepMeta& meta = s.steps[step];
      M3MSA_CHECK_INTERNAL(runtime.begin_step(meta.batch), "step ", step,
                           " refused: ", runtime.stats().last_refusal);
      std::vector<uint16_t> hidden = s.hidden_in[step];
      std::vector<uint16_t> residual = s.residual_in[step];
      const int64_t rows = meta.batch.num_rows();
      const int64_t H = s.config.model.hidden;
      auto& selections = out.topk[static_cast<std::size_t>(r)].emplace_back();
      for (const testkit::MasterLayer& layer : s.master.layers) {
        runtime.forward_layer(layer.layer,
                              TensorView::contiguous(hidden.data(), DType::kBF16, {rows, H}),
                              TensorView::contiguous(residual.data(), DType::kBF16, {rows, H}),
                              meta.positions.view());
        const TensorView topk = runtime.last_layer_trace().topk;
        selections.emplace_back(topk.ptr<const int32_t>(),
                                topk.ptr<const int32_t>() + topk.numel());
      }
      out.hidden[static_cast<std::size_t>(r)].push_back(hidden);
      out.residual[static_cast<std::size_t>(r)].push_back(residual);
    }
    out.stats[static_cast<std::size_t>(r)] = runtime.stats();
    runtime.close();
  });
  for (int r = 0; r < world; ++r) {
    if (errors[static_cast<std::size_t>(r)])
      std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
  }
  return out;
}

// ---- The composed reference (TP = 1, the test kit's oracle) ----

struct Reference {
  std::vector<HostTensor> kv, index;         // the reference's own caches
  std::vector<std::vector<float>> qkv_rows;  // per layer, [W, hidden]
};

Reference make_reference(const MasterModel& master) {
  Reference ref;
  for (const testkit::MasterLayer& w : master.layers) {
    HostTensor kv(DType::kBF16, w.kv_cache.shape());
    std::memcpy(kv.data(), w.kv_cache.data(), kv.nbytes());
    HostTensor index(DType::kBF16, w.index_cache.shape());
    std::memcpy(index.data(), w.index_cache.data(), index.nbytes());
    ref.kv.push_back(kv);
    ref.index.push_back(index);
    ref.qkv_rows.push_back(testkit::rank_qkv_rows(master.config, w, 0, 1));
  }
  return ref;
}

// shared_topk: the layer shares this selection (docs/spec.md section 7: no index_q, no index_k
// insert, no indexer); otherwise it selects and, when select_out is given, returns its selection.
void reference_layer(const Scenario& s, Reference& ref, std::size_t li, const StepMeta& meta,
                     std::vector<uint16_t>& hidden, std::vector<uint16_t>& residual,
                     const HostTensor* shared_topk = nullptr, HostTensor* select_out = nullptr) {
  const ModelConfig& m = s.config.model;
  const testkit::MasterLayer& w = s.master.layers[li];
  const HostTensor qn = testkit::bf16_tensor(w.q_norm, {m.head_dim});
  const HostTensor kn = testkit::bf16_tensor(w.k_norm, {m.head_dim});
  const HostTensor iqn = testkit::bf16_tensor(w.iq_norm, {m.index_dim});
  const HostTensor ikn = testkit::bf16_tensor(w.ik_norm, {m.index_dim});
  testkit::ReferenceLayer layer;
  layer.qkv = ref.qkv_rows[li];
  layer.o_proj = w.wo;
  if (w.mlp) {
    layer.gate = w.gate;
    layer.up = w.up;
    layer.down = w.down;
  }
  layer.input_norm = w.input_norm;
  layer.post_norm = w.post_norm;
  layer.q_norm = qn.view();
  layer.k_norm = kn.view();
  layer.index_q_norm = iqn.view();
  layer.index_k_norm = ikn.view();
  layer.kv_cache = {ref.kv[li].view(), 1.0f, 1.0f};
  layer.index_cache = {ref.index[li].view()};
  testkit::ReferenceOptions options;
  options.swiglu_limit = s.config.swiglu_limit;
  options.shared_topk = shared_topk;
  options.select_out = select_out;
  testkit::reference_layer(m, layer, meta.batch, meta.positions.view(), hidden, residual, options);
}

// ---- Comparison ----

void expect_close(const std::vector<uint16_t>& got, const std::vector<uint16_t>& want,
                  double abs_tol, double rel_tol, int64_t hidden, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  testkit::ValueCheck check;
  testkit::compare_close(check, got, want, static_cast<int64_t>(want.size()) / hidden, hidden,
                         abs_tol, rel_tol, {}, what);
  EXPECT_EQ(check.bad, 0) << check.first << " (" << check.bad << " of " << check.checked
                          << " values beyond the tolerance)";
}

constexpr double kTpRel = 1.0 / 64;
constexpr double kTpAbs = 1.0 / 256;
constexpr double kRefRel = 1.0 / 32;
constexpr double kRefAbs = 1.0 / 64;

TEST(RuntimeForward, TensorParallelEqualsOneRankAndOneRankEqualsReference) {
  const Scenario s = make_scenario(/*intermediate=*/128, /*seed=*/11);
  const int64_t H = s.config.model.hidden;
  const RunResult one = run_runtime(s, 1);

  // TP = 1 against the hand-written reference.
  Reference ref = make_reference(s.master);
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    std::vector<uint16_t> hidden = s.hidden_in[step];
    std::vector<uint16_t> residual = s.residual_in[step];
    for (std::size_t li = 0; li < s.master.layers.size(); ++li) {
      reference_layer(s, ref, li, s.steps[step], hidden, residual);
    }
    const std::string at = "step " + std::to_string(step);
    expect_close(one.hidden[0][step], hidden, kRefAbs, kRefRel, H,
                 "TP=1 vs reference hidden, " + at);
    expect_close(one.residual[0][step], residual, kRefAbs, kRefRel, H,
                 "TP=1 vs reference residual, " + at);
  }

  for (int world : {2, 4}) {
    const RunResult tp = run_runtime(s, world);
    const std::string name = "TP=" + std::to_string(world);
    for (int r = 0; r < world; ++r) {
      for (std::size_t step = 0; step < s.steps.size(); ++step) {
        // Every rank holds the same (all-reduced) result, bit for bit.
        EXPECT_EQ(tp.hidden[static_cast<std::size_t>(r)][step], tp.hidden[0][step])
            << name << " rank " << r << " step " << step;
        EXPECT_EQ(tp.residual[static_cast<std::size_t>(r)][step], tp.residual[0][step])
            << name << " rank " << r << " step " << step;
      }
    }
    for (std::size_t step = 0; step < s.steps.size(); ++step) {
      const std::string at = name + " vs TP=1, step " + std::to_string(step);
      expect_close(tp.hidden[0][step], one.hidden[0][step], kTpAbs, kTpRel, H, at + " hidden");
      expect_close(tp.residual[0][step], one.residual[0][step], kTpAbs, kTpRel, H,
                   at + " residual");
    }
    // The first sparse layer's projections do not depend on TP: its caches are bit-identical.
    const ModelConfig& m = s.config.model;
    for (int r = 0; r < world; ++r) {
      const auto& rank = tp.ranks[static_cast<std::size_t>(r)];
      EXPECT_EQ(std::memcmp(rank.index_caches[0].data(), one.ranks[0].index_caches[0].data(),
                            rank.index_caches[0].nbytes()),
                0)
          << name << " rank " << r << " index cache";
      EXPECT_EQ(
          testkit::kv_tiles_differing(m, r, world, rank.kv_caches[0], one.ranks[0].kv_caches[0]), 0)
          << name << " rank " << r << " kv cache";
    }
  }
}

TEST(RuntimeForward, Fp8ProjectionMatchesDequantizedReference) {
  const Scenario s = make_scenario(/*intermediate=*/0, /*seed=*/23);
  const int64_t H = s.config.model.hidden;
  const RunResult fp8 = run_runtime(s, 1, {.fp8_qkv = true});
  // The reference with the dequantized weights (stored fp8 * per-channel scale).
  const testkit::RankModel rank = testkit::make_rank_model(s.master, 0, 1, /*fp8_qkv=*/true);
  Reference ref = make_reference(s.master);
  for (std::size_t li = 0; li < s.master.layers.size(); ++li) {
    const LayerWeights& w = rank.weights.layers[li];
    std::vector<float>& rows = ref.qkv_rows[li];
    for (int64_t n = 0; n < w.qkv_proj.shape[0]; ++n) {
      for (int64_t k = 0; k < H; ++k) {
        rows[static_cast<std::size_t>(n * H + k)] =
            fp8e4m3_to_float(w.qkv_proj.ptr<uint8_t>()[n * H + k]) *
            w.qkv_proj_scale.ptr<float>()[n];
      }
    }
  }
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    std::vector<uint16_t> hidden = s.hidden_in[step];
    std::vector<uint16_t> residual = s.residual_in[step];
    for (std::size_t li = 0; li < s.master.layers.size(); ++li) {
      reference_layer(s, ref, li, s.steps[step], hidden, residual);
    }
    const std::string at = "fp8 step " + std::to_string(step);
    expect_close(fp8.hidden[0][step], hidden, kRefAbs, kRefRel, H, at + " hidden");
    expect_close(fp8.residual[0][step], residual, kRefAbs, kRefRel, H, at + " residual");
  }
}

// CP on vs CP off (docs/context_parallel.md "Exactness"): every layer's selection of every rank is
// bit-identical, and since nothing else differs (the q, k, v columns of the projection are computed
// the same way), so is every output. P = 1, 2 (= index heads) and 4 (> index heads: replicated KV
// heads).
TEST(RuntimeForward, ContextParallelEqualsCpOffBitForBit) {
  const Scenario s = make_scenario(/*intermediate=*/128, /*seed=*/31);
  for (int world : {1, 2, 4}) {
    const RunResult off = run_runtime(s, world);
    const RunResult on = run_runtime(s, world, {.context_parallel = true});
    const std::string name = "P=" + std::to_string(world);
    for (int r = 0; r < world; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      EXPECT_TRUE(on.stats[ur].context_parallel) << name;
      for (std::size_t step = 0; step < s.steps.size(); ++step) {
        for (std::size_t li = 0; li < s.master.layers.size(); ++li) {
          EXPECT_EQ(on.topk[ur][step][li], off.topk[ur][step][li])
              << name << " rank " << r << " step " << step << " layer " << li;
        }
        EXPECT_EQ(on.hidden[ur][step], off.hidden[ur][step]) << name << " rank " << r;
        EXPECT_EQ(on.residual[ur][step], off.residual[ur][step]) << name << " rank " << r;
      }
      // The index cache of every layer got the same inserts.
      for (std::size_t li = 0; li < s.master.layers.size(); ++li) {
        EXPECT_EQ(
            std::memcmp(on.ranks[ur].index_caches[li].data(), off.ranks[ur].index_caches[li].data(),
                        on.ranks[ur].index_caches[li].nbytes()),
            0)
            << name << " rank " << r << " layer " << li << " index cache";
      }
    }
  }
}

// A CP projection bound without every index_q head is refused, naming the tensor and shapes.
TEST(RuntimeForward, ContextParallelNeedsEveryIndexQHeadInTheProjection) {
  const Scenario s = make_scenario(/*intermediate=*/0, /*seed=*/5);
  RuntimeConfig config = s.config;
  config.context_parallel = true;
  auto group = ThreadGroup::create(2, std::chrono::seconds(20));
  std::vector<testkit::RankModel> ranks;
  for (int r = 0; r < 2; ++r) ranks.push_back(testkit::make_rank_model(s.master, r, 2));
  const auto errors = run_ranks(group, [&](Communicator& comm) {
    Runtime runtime([](const std::string&) {});
    runtime.prepare(ranks[static_cast<std::size_t>(comm.rank())].weights, config, comm);
  });
  const ModelConfig& m = s.config.model;
  const std::string want_shape =
      "[" + std::to_string(m.sparse(2, true).qkv_width()) + ", " + std::to_string(m.hidden) + "]";
  for (const auto& e : errors) {
    ASSERT_TRUE(e);
    try {
      std::rethrow_exception(e);
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(err.message().find("qkv_proj: expected shape " + want_shape), std::string::npos)
          << err.message();
    }
  }
}

// Cross-layer selection sharing (docs/spec.md section 7) with period 2 over the two sparse layers
// (no MLP: how it amplifies one-ulp differences is not what this test is about): layer 2 (ordinal
// 1) computes no index_q and inserts no index_k, runs no indexer and attends with layer 1's
// selection of the same step. Oracle: the reference composition with layer 1's selection handed to
// layer 2; TP = 2 equals TP = 1 within the TP tolerance; CP + sharing equals sharing alone bit for
// bit.
TEST(RuntimeForward, SelectionSharingReusesTheLastIndexerLayersSelection) {
  const Scenario s = make_scenario(/*intermediate=*/0, /*seed=*/41);
  const int64_t H = s.config.model.hidden;
  const RunResult one = run_runtime(s, 1, {.share_period = 2});
  ASSERT_EQ(s.master.layers.size(), 2u);

  Reference ref = make_reference(s.master);
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    std::vector<uint16_t> hidden = s.hidden_in[step];
    std::vector<uint16_t> residual = s.residual_in[step];
    HostTensor selection;
    reference_layer(s, ref, 0, s.steps[step], hidden, residual, nullptr, &selection);
    reference_layer(s, ref, 1, s.steps[step], hidden, residual, &selection);
    const std::string at = "step " + std::to_string(step);
    // The shared layer's selection is the indexer layer's, bit for bit.
    EXPECT_EQ(one.topk[0][step][1], one.topk[0][step][0]) << at;
    expect_close(one.hidden[0][step], hidden, kRefAbs, kRefRel, H, "sharing vs reference, " + at);
    expect_close(one.residual[0][step], residual, kRefAbs, kRefRel, H,
                 "sharing vs reference residual, " + at);
  }
  // Layer 2's index cache is untouched; layer 1's got the steps' keys.
  const auto& master_index = s.master.layers[1].index_cache;
  EXPECT_EQ(
      std::memcmp(one.ranks[0].index_caches[1].data(), master_index.data(), master_index.nbytes()),
      0);
  EXPECT_NE(std::memcmp(one.ranks[0].index_caches[0].data(), s.master.layers[0].index_cache.data(),
                        master_index.nbytes()),
            0);
  EXPECT_EQ(one.stats[0].indexer_layers_run, static_cast<int64_t>(s.steps.size()));
  EXPECT_EQ(one.stats[0].sharing_layers_run, static_cast<int64_t>(s.steps.size()));

  const RunResult two = run_runtime(s, 2, {.share_period = 2});
  const RunResult two_cp = run_runtime(s, 2, {.context_parallel = true, .share_period = 2});
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    const std::string at = "TP=2 sharing, step " + std::to_string(step);
    expect_close(two.hidden[0][step], one.hidden[0][step], kTpAbs, kTpRel, H, at);
    expect_close(two.residual[0][step], one.residual[0][step], kTpAbs, kTpRel, H, at);
    for (int r = 0; r < 2; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      EXPECT_EQ(two_cp.topk[ur][step], two.topk[ur][step]) << at << " rank " << r;
      EXPECT_EQ(two_cp.hidden[ur][step], two.hidden[ur][step]) << at << " CP rank " << r;
    }
  }
}

// A sharing layer needs an indexer layer earlier in the step.
TEST(RuntimeForward, SharingLayerBeforeAnyIndexerLayerOfTheStepIsRefused) {
  const Scenario s = make_scenario(/*intermediate=*/0, /*seed=*/7);
  RuntimeConfig config = s.config;
  config.selection_share_period = 2;
  testkit::RankModel rank = testkit::make_rank_model(s.master, 0, 1);
  auto comm = make_single_rank_communicator();
  Runtime runtime([](const std::string&) {});
  ASSERT_EQ(runtime.prepare(rank.weights, config, *comm), PrepareResult::kActive);
  const StepMeta& meta = s.steps[0];
  ASSERT_TRUE(runtime.begin_step(meta.batch));
  const int64_t rows = meta.batch.num_rows();
  std::vector<uint16_t> hidden = s.hidden_in[0], residual = s.residual_in[0];
  const TensorView h = TensorView::contiguous(hidden.data(), DType::kBF16, {rows, 256});
  const TensorView res = TensorView::contiguous(residual.data(), DType::kBF16, {rows, 256});
  try {
    runtime.forward_layer(2, h, res, meta.positions.view());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(e.message().find("layer 2 shares the selection"), std::string::npos) << e.message();
  }
  runtime.forward_layer(1, h, res, meta.positions.view());
  runtime.forward_layer(2, h, res, meta.positions.view());  // now fine
  // A new step starts without a selection again.
  ASSERT_TRUE(runtime.begin_step(meta.batch));
  EXPECT_THROW(runtime.forward_layer(2, h, res, meta.positions.view()), Error);
  runtime.close();
}

}  // namespace
}  // namespace m3msa
