// forward_layer with the mixture of experts on the CPU backend (docs/runtime.md, docs/spec.md
// section 8): TP = 1 against the test kit's composed oracle (double-precision matmuls, the MoE
// composed in double with the spec's bf16 roundings), TP = 2 and 4 (ranks as threads, each with its
// slice of the intermediate) against TP = 1, bf16 and MXFP8 experts; the same with the dense
// layers [0, first_sparse_layer) bound in front (dense attention and the dense MLP, the oracle's
// composition of cpu::preprocess, cpu::dense_attention and the MLP in double); the binding
// refusals name the tensor and the expected and found shape.
//
// Tolerances: per row, relative L2 error <= 2^-5 and every element within 0.25 (see
// expect_close): TP = P vs TP = 1 differ in the order of the fp32 sums (o_proj and the MoE
// partials added in rank order), TP = 1 vs the oracle in double vs fp32 sums; either can flip a
// bf16 rounding anywhere in the chain, which the experts amplify. Ranks are bit-identical.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "m3msa/comm.h"
#include "m3msa/error.h"
#include "m3msa/runtime.h"
#include "m3msa/testing/checks.h"
#include "m3msa/testing/moe_model.h"
#include "m3msa/testing/oracle.h"
#include "m3msa/testing/runtime_model.h"

namespace m3msa {
namespace {

using testkit::MasterModel;
using testkit::StepMeta;

constexpr int64_t kMaxContext = 256;

// 8 experts, 2 per token, expert intermediate 128 (32 per rank at TP 4: one MXFP8 group), one
// shared expert; the MoE on every sparse layer.
RuntimeConfig moe_config() {
  RuntimeConfig c = testkit::small_config(/*intermediate=*/0);
  c.max_context = kMaxContext;
  c.model.num_experts = 8;
  c.model.experts_per_token = 2;
  c.model.moe_intermediate = 128;
  c.model.shared_experts = 1;
  c.model.dense_intermediate = 256;
  return c;
}

struct Scenario {
  MasterModel master;
  RuntimeConfig config;
  std::vector<StepMeta> steps;
  std::vector<std::vector<uint16_t>> hidden_in, residual_in;
};

// dense_layers: layers 0 and 1 dense (dense_intermediate 256: 64 per rank at TP 4, two MXFP8
// groups), layers 2 and 3 sparse with the MoE.
Scenario make_scenario(bool fp8, uint64_t seed, bool dense_layers = false) {
  Scenario s;
  s.config = moe_config();
  if (dense_layers) {
    s.config.model.first_sparse_layer = 2;
    s.config.model.num_layers = 4;
  }
  const ModelConfig& m = s.config.model;
  const int64_t max_blocks = kMaxContext / m.block_size;
  const int64_t pages = s.config.max_requests * max_blocks + 3;
  s.master = testkit::make_master(m, pages, seed, /*mlp_on_last_layer=*/false);
  for (std::size_t i = 0; i < s.master.layers.size(); ++i) {
    s.master.layers[i].has_moe = true;
    s.master.layers[i].moe = testkit::make_master_moe(m, seed * 31 + i, fp8);
  }
  if (dense_layers) testkit::add_dense_layers(s.master, seed * 37, fp8);
  const auto index_perm = testkit::page_permutation(pages, seed + 1);
  const auto kv_perm = testkit::page_permutation(pages, seed + 2);
  const std::vector<std::pair<std::vector<int32_t>, int>> shapes = {{{70, 150, 0}, 2},
                                                                    {{73, 153, 40, 0}, 1}};
  testkit::SplitMix64 rng(seed + 3);
  for (const auto& [lens, q] : shapes) {
    s.steps.push_back(testkit::make_step(lens, q, m.block_size, max_blocks, index_perm, kv_perm));
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

// [rank][step]: the last layer's hidden. `stats`: rank 0's before close; `models`: every rank's
// model (its caches) after the run.
std::vector<std::vector<std::vector<uint16_t>>> run_runtime(
    const Scenario& s, int world, RuntimeStats* stats = nullptr,
    std::vector<testkit::RankModel>* models = nullptr) {
  std::vector<std::vector<std::vector<uint16_t>>> out(static_cast<std::size_t>(world));
  std::vector<testkit::RankModel> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(testkit::make_rank_model(s.master, r, world));
  auto group = ThreadGroup::create(world, std::chrono::seconds(60));
  const auto errors = run_ranks(group, [&](Communicator& comm) {
    const int r = comm.rank();
    Runtime runtime([](const std::string&) {});
    const PrepareResult prepared =
        runtime.prepare(ranks[static_cast<std::size_t>(r)].weights, s.config, comm);
    M3MSA_CHECK_INTERNAL(prepared == PrepareResult::kActive, "prepare returned ",
                         prepare_result_name(prepared));
    for (std::size_t step = 0; step < s.steps.size(); ++step) {
      const StepMeta& meta = s.steps[step];
      M3MSA_CHECK_INTERNAL(runtime.begin_step(meta.batch), "step refused");
      std::vector<uint16_t> hidden = s.hidden_in[step];
      std::vector<uint16_t> residual = s.residual_in[step];
      const int64_t rows = meta.batch.num_rows();
      const int64_t H = s.config.model.hidden;
      for (const testkit::MasterLayer& layer : s.master.layers) {
        runtime.forward_layer(layer.layer,
                              TensorView::contiguous(hidden.data(), DType::kBF16, {rows, H}),
                              TensorView::contiguous(residual.data(), DType::kBF16, {rows, H}),
                              meta.positions.view());
      }
      out[static_cast<std::size_t>(r)].push_back(hidden);
    }
    if (stats != nullptr && r == 0) *stats = runtime.stats();
    runtime.close();
  });
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  if (models != nullptr) *models = std::move(ranks);
  return out;
}

std::vector<std::vector<uint16_t>> run_oracle(const Scenario& s) {
  const ModelConfig& m = s.config.model;
  std::vector<HostTensor> kv, index;
  for (const testkit::MasterLayer& w : s.master.layers) {
    kv.emplace_back(DType::kBF16, w.kv_cache.shape());
    std::memcpy(kv.back().data(), w.kv_cache.data(), w.kv_cache.nbytes());
    index.emplace_back();
    if (w.dense) continue;  // no index cache
    index.back() = HostTensor(DType::kBF16, w.index_cache.shape());
    std::memcpy(index.back().data(), w.index_cache.data(), w.index_cache.nbytes());
  }
  std::vector<std::vector<uint16_t>> out;
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    std::vector<uint16_t> hidden = s.hidden_in[step];
    std::vector<uint16_t> residual = s.residual_in[step];
    for (std::size_t li = 0; li < s.master.layers.size(); ++li) {
      const testkit::MasterLayer& w = s.master.layers[li];
      const std::vector<float> qkv = testkit::rank_qkv_rows(m, w, 0, 1);
      const HostTensor qn = testkit::bf16_tensor(w.q_norm, {m.head_dim});
      const HostTensor kn = testkit::bf16_tensor(w.k_norm, {m.head_dim});
      testkit::ReferenceLayer layer;
      layer.qkv = qkv;
      layer.o_proj = w.wo;
      HostTensor iqn, ikn;
      if (w.dense) {
        layer.dense_mlp = &w.dense_mlp;
      } else {
        layer.moe = &w.moe;
        iqn = testkit::bf16_tensor(w.iq_norm, {m.index_dim});
        ikn = testkit::bf16_tensor(w.ik_norm, {m.index_dim});
        layer.index_q_norm = iqn.view();
        layer.index_k_norm = ikn.view();
        layer.index_cache = {index[li].view()};
      }
      layer.input_norm = w.input_norm;
      layer.post_norm = w.post_norm;
      layer.q_norm = qn.view();
      layer.k_norm = kn.view();
      layer.kv_cache = {kv[li].view(), 1.0f, 1.0f};
      testkit::reference_layer(m, layer, s.steps[step].batch, s.steps[step].positions.view(),
                               hidden, residual);
    }
    out.push_back(hidden);
  }
  return out;
}

// Live rows only: the padding request's rows are whatever the layer makes of garbage. The MoE
// output is a sum of 2-GEMM functions of h2: a one-ulp flip of a bf16 g, u or activation (from
// any upstream flip) moves an element by |w2 * a| with a up to limit * (limit + 1), and the layers
// chain, so elementwise bounds of O(1) outputs do not apply. Rows are compared by relative L2
// error <= l2_tol (a wrong slice, expert or weight gives O(1)) and elementwise within 0.25
// (garbage, NaN and inf positions).
void expect_close(const Scenario& s, std::size_t step, const std::vector<uint16_t>& got,
                  const std::vector<uint16_t>& want, double l2_tol, const std::string& what) {
  const StepMeta& meta = s.steps[step];
  const int64_t H = s.config.model.hidden;
  int64_t rows = 0;
  for (int64_t r = 0; r < meta.batch.num_rows(); ++r) {
    if (meta.positions.ptr<int64_t>()[r] < 0) continue;
    ++rows;
    double err = 0, norm = 0;
    for (int64_t i = 0; i < H; ++i) {
      const double g = bf16_to_float(got[static_cast<std::size_t>(r * H + i)]);
      const double w = bf16_to_float(want[static_cast<std::size_t>(r * H + i)]);
      ASSERT_TRUE(std::isfinite(g) && std::isfinite(w)) << what << " row " << r << " col " << i;
      ASSERT_LE(std::fabs(g - w), 0.25)
          << what << " row " << r << " col " << i << " got " << g << " want " << w;
      err += (g - w) * (g - w);
      norm += w * w;
    }
    EXPECT_LE(std::sqrt(err / norm), l2_tol) << what << " row " << r;
  }
  EXPECT_GT(rows, 0);
}

void check_scenario(bool fp8, uint64_t seed, bool dense_layers = false) {
  const Scenario s = make_scenario(fp8, seed, dense_layers);
  RuntimeStats stats;
  std::vector<testkit::RankModel> one_model;
  const auto one = run_runtime(s, 1, &stats, &one_model);
  const auto oracle = run_oracle(s);
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    expect_close(
        s, step, one[0][step], oracle[step], 1.0 / 32,
        std::string(fp8 ? "mxfp8" : "bf16") + " TP 1 vs oracle, step " + std::to_string(step));
  }
  // Every bound layer ran; only the sparse ones ran an indexer.
  const int64_t steps = static_cast<int64_t>(s.steps.size());
  EXPECT_EQ(stats.layers_run, steps * static_cast<int64_t>(s.master.layers.size()));
  EXPECT_EQ(stats.indexer_layers_run, steps * s.config.model.num_sparse_layers());
  EXPECT_EQ(static_cast<int>(stats.bound_layers.size()), dense_layers ? 4 : 2);
  for (int world : {2, 4}) {
    std::vector<testkit::RankModel> tp_models;
    const auto tp = run_runtime(s, world, nullptr, &tp_models);
    // The first layer's input does not depend on TP, nor do its projection rows: its KV cache is
    // bit-identical to TP 1's (a dense layer's when they are bound).
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(testkit::kv_tiles_differing(s.config.model, r, world,
                                            tp_models[static_cast<std::size_t>(r)].kv_caches[0],
                                            one_model[0].kv_caches[0]),
                0)
          << "TP " << world << " rank " << r << " layer " << s.master.layers[0].layer
          << " kv cache";
    }
    for (int r = 0; r < world; ++r) {
      for (std::size_t step = 0; step < s.steps.size(); ++step) {
        EXPECT_EQ(tp[static_cast<std::size_t>(r)][step], tp[0][step])
            << "rank " << r << " differs from rank 0 at TP " << world;
        expect_close(s, step, tp[static_cast<std::size_t>(r)][step], one[0][step], 1.0 / 32,
                     std::string(fp8 ? "mxfp8" : "bf16") + " TP " + std::to_string(world) +
                         " vs TP 1, step " + std::to_string(step));
      }
    }
  }
}

TEST(MoeRuntime, Bf16ExpertsMatchTheOracleAndTensorParallel) {
  check_scenario(false, 5);
}

TEST(MoeRuntime, Mxfp8ExpertsMatchTheOracleAndTensorParallel) {
  check_scenario(true, 6);
}

TEST(DenseLayersRuntime, Bf16DenseAndMoeLayersMatchTheOracleAndTensorParallel) {
  check_scenario(false, 8, /*dense_layers=*/true);
}

TEST(DenseLayersRuntime, Mxfp8DenseAndMoeLayersMatchTheOracleAndTensorParallel) {
  check_scenario(true, 9, /*dense_layers=*/true);
}

// ---- Binding refusals ----

std::string prepare_error(const RuntimeConfig& config, const ModelWeights& weights) {
  auto group = ThreadGroup::create(1, std::chrono::seconds(10));
  std::string message;
  const auto errors = run_ranks(group, [&](Communicator& comm) {
    Runtime runtime([](const std::string&) {});
    try {
      // A wrong dtype is "unsupported" (the engine falls back and the reason is logged), a wrong
      // shape an error; either names the tensor.
      if (runtime.prepare(weights, config, comm) == PrepareResult::kFallback) {
        for (const auto& [reason, count] : runtime.stats().fallback_reasons) message += reason;
      }
    } catch (const Error& e) {
      message = e.what();
    }
    runtime.close();
  });
  return message;
}

TEST(MoeRuntime, BindingRefusalsNameTheTensorAndShapes) {
  const Scenario s = make_scenario(/*fp8=*/true, 7);
  testkit::RankModel rank = testkit::make_rank_model(s.master, 0, 1);
  struct Case {
    std::function<void(LayerWeights&)> edit;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {[](LayerWeights& w) { w.experts.w13.shape[1] = 255; },
       {"layer 1 experts.w13", "expected shape [8, 256, 256]", "got [8, 255, 256]"}},
      {[](LayerWeights& w) { w.experts.w2_scale = {}; }, {"layer 1 experts.w2_scale"}},
      {[](LayerWeights& w) { w.router_weight.shape[0] = 7; },
       {"layer 1 router_weight", "[8, 256]", "[7, 256]"}},
      {[](LayerWeights& w) { w.router_weight = {}; }, {"layer 1 router_weight", "found none"}},
      {[](LayerWeights& w) { w.router_bias.dtype = DType::kBF16; }, {"router_bias", "f32"}},
      {[](LayerWeights& w) { w.shared_expert = {}; }, {"layer 1 shared_expert"}},
      {[](LayerWeights& w) { w.shared_expert.w2.shape[1] = 64; },
       {"shared_expert.w2", "expected shape [256, 128]", "got [256, 64]"}},
      {[](LayerWeights& w) { w.mlp_down = w.experts.w2; }, {"layer 1 moe", "exclusive"}},
  };
  for (const Case& c : cases) {
    ModelWeights weights = rank.weights;
    c.edit(weights.layers[0]);
    const std::string message = prepare_error(s.config, weights);
    ASSERT_FALSE(message.empty()) << "accepted; expected " << c.parts.front();
    for (const std::string& part : c.parts) {
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
    }
  }
}

TEST(DenseLayersRuntime, BindingRefusalsNameTheLayerAndTensor) {
  const Scenario s = make_scenario(/*fp8=*/true, 10, /*dense_layers=*/true);
  const testkit::RankModel rank = testkit::make_rank_model(s.master, 0, 1);
  // rank.weights.layers: layers 0 and 1 (dense), 2 and 3 (sparse). D = 256: w13 [512, 256].
  struct Case {
    std::function<void(std::vector<LayerWeights>&)> edit;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {[](auto& l) { l[0].index_cache = l[2].index_cache; },
       {"layer 0 index_cache", "bound on a dense layer"}},
      {[](auto& l) { l[1].index_q_norm = l[2].index_q_norm; },
       {"layer 1 index_q_norm", "bound on a dense layer"}},
      {[](auto& l) { l[0].experts = l[2].experts; }, {"layer 0 experts.w13", "dense layer"}},
      {[](auto& l) { l.erase(l.begin() + 1); },
       {"1 of the 2 dense layers are bound", "missing layer 1"}},
      {[](auto& l) { l[0].dense_mlp.w13.shape[0] = 511; },
       {"layer 0 dense_mlp.w13", "expected shape [512, 256]", "got [511, 256]"}},
      {[](auto& l) { l[1].dense_mlp.w2.shape[1] = 128; },
       {"layer 1 dense_mlp.w2", "expected shape [256, 256]", "got [256, 128]"}},
      {[](auto& l) { l[0].dense_mlp.w2_scale = {}; }, {"layer 0 dense_mlp.w2_scale"}},
      {[](auto& l) { l[0].dense_mlp = {}; }, {"layer 0 dense_mlp: not bound", "[512, 256]"}},
      {[](auto& l) { l[0].qkv_proj = l[2].qkv_proj; },
       {"layer 0 qkv_proj", "expected shape [256, 256]", "found [352, 256]"}},
      {[](auto& l) { l[2].dense_mlp = l[0].dense_mlp; },
       {"layer 2 dense_mlp", "bound on a sparse layer"}},
  };
  for (const Case& c : cases) {
    ModelWeights weights = rank.weights;
    c.edit(weights.layers);
    const std::string message = prepare_error(s.config, weights);
    ASSERT_FALSE(message.empty()) << "accepted; expected " << c.parts.front();
    for (const std::string& part : c.parts) {
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
    }
  }
  // The whole model binds.
  EXPECT_EQ(prepare_error(s.config, rank.weights), "");
}

// Without its dense layers the model binds as before (the engine runs them), and forward_layer
// refuses a dense layer by name.
TEST(DenseLayersRuntime, SparseLayersAloneBindAndADenseLayerIsRefused) {
  const Scenario s = make_scenario(/*fp8=*/false, 11, /*dense_layers=*/true);
  testkit::RankModel rank = testkit::make_rank_model(s.master, 0, 1);
  ModelWeights sparse = rank.weights;
  sparse.layers.erase(sparse.layers.begin(), sparse.layers.begin() + 2);
  auto group = ThreadGroup::create(1, std::chrono::seconds(10));
  const auto errors = run_ranks(group, [&](Communicator& comm) {
    Runtime runtime([](const std::string&) {});
    ASSERT_EQ(runtime.prepare(sparse, s.config, comm), PrepareResult::kActive);
    EXPECT_EQ(runtime.stats().bound_layers, (std::vector<int>{2, 3}));
    const StepMeta& meta = s.steps[0];
    ASSERT_TRUE(runtime.begin_step(meta.batch));
    std::vector<uint16_t> hidden = s.hidden_in[0];
    std::vector<uint16_t> residual = s.residual_in[0];
    const int64_t rows = meta.batch.num_rows();
    const int64_t H = s.config.model.hidden;
    const TensorView h = TensorView::contiguous(hidden.data(), DType::kBF16, {rows, H});
    const TensorView r = TensorView::contiguous(residual.data(), DType::kBF16, {rows, H});
    try {
      runtime.forward_layer(1, h, r, meta.positions.view());
      ADD_FAILURE() << "forward_layer ran a dense layer that is not bound";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("layer 1 is a dense layer"), std::string::npos)
          << e.what();
    }
    runtime.forward_layer(2, h, r, meta.positions.view());
    runtime.forward_layer(3, h, r, meta.positions.view());
    EXPECT_EQ(runtime.stats().layers_run, 2);
    runtime.close();
  });
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace
}  // namespace m3msa
