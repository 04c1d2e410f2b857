// The C ABI (runtime_c.h): status codes and last-error messages, and one decode step through it
// equal, bit for bit, to the same step through the C++ API.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "c_api_test_util.h"
#include "m3msa/runtime.h"
#include "m3msa/runtime_c.h"
#include "m3msa/testing/runtime_model.h"

namespace m3msa {
namespace {

using capitest::c_batch;
using capitest::c_tensor;

m3msa_layer_weights c_layer(const LayerWeights& w) {
  m3msa_layer_weights c;
  std::memset(&c, 0, sizeof(c));
  c.layer = w.layer;
  c.qkv_proj = c_tensor(w.qkv_proj);
  c.qkv_proj_scale = c_tensor(w.qkv_proj_scale);
  c.q_norm = c_tensor(w.q_norm);
  c.k_norm = c_tensor(w.k_norm);
  c.index_q_norm = c_tensor(w.index_q_norm);
  c.index_k_norm = c_tensor(w.index_k_norm);
  c.input_norm = c_tensor(w.input_norm);
  c.post_attention_norm = c_tensor(w.post_attention_norm);
  c.o_proj = c_tensor(w.o_proj);
  c.o_proj_scale = c_tensor(w.o_proj_scale);
  c.kv_cache = c_tensor(w.kv_cache.data);
  c.k_scale = w.kv_cache.k_scale;
  c.v_scale = w.kv_cache.v_scale;
  c.index_cache = c_tensor(w.index_cache.data);
  c.mlp_gate_up = c_tensor(w.mlp_gate_up);
  c.mlp_down = c_tensor(w.mlp_down);
  c.router_weight = c_tensor(w.router_weight);
  c.router_bias = c_tensor(w.router_bias);
  c.experts_w13 = c_tensor(w.experts.w13);
  c.experts_w13_scale = c_tensor(w.experts.w13_scale);
  c.experts_w2 = c_tensor(w.experts.w2);
  c.experts_w2_scale = c_tensor(w.experts.w2_scale);
  c.shared_w13 = c_tensor(w.shared_expert.w13);
  c.shared_w13_scale = c_tensor(w.shared_expert.w13_scale);
  c.shared_w2 = c_tensor(w.shared_expert.w2);
  c.shared_w2_scale = c_tensor(w.shared_expert.w2_scale);
  c.dense_w13 = c_tensor(w.dense_mlp.w13);
  c.dense_w13_scale = c_tensor(w.dense_mlp.w13_scale);
  c.dense_w2 = c_tensor(w.dense_mlp.w2);
  c.dense_w2_scale = c_tensor(w.dense_mlp.w2_scale);
  return c;
}

m3msa_runtime_config c_config(const RuntimeConfig& r, std::vector<int32_t>& buckets,
                              std::vector<int32_t>& q_lens) {
  m3msa_runtime_config c;
  m3msa_runtime_config_default(&c);
  const ModelConfig& m = r.model;
  c.hidden = m.hidden;
  c.num_layers = m.num_layers;
  c.first_sparse_layer = m.first_sparse_layer;
  c.q_heads = m.q_heads;
  c.kv_heads = m.kv_heads;
  c.head_dim = m.head_dim;
  c.index_heads = m.index_heads;
  c.index_dim = m.index_dim;
  c.block_size = m.block_size;
  c.topk = m.topk;
  c.init_blocks = m.init_blocks;
  c.local_blocks = m.local_blocks;
  c.rope_dim = m.rope_dim;
  c.rope_theta = m.rope_theta;
  c.rms_eps = m.rms_eps;
  c.intermediate = m.intermediate;
  c.num_experts = m.num_experts;
  c.experts_per_token = m.experts_per_token;
  c.moe_intermediate = m.moe_intermediate;
  c.shared_experts = m.shared_experts;
  c.dense_intermediate = m.dense_intermediate;
  c.routed_scaling = m.routed_scaling;
  c.activation_limit = m.activation_limit;
  buckets.assign(r.token_buckets.begin(), r.token_buckets.end());
  q_lens.assign(r.query_lens.begin(), r.query_lens.end());
  c.token_buckets = buckets.data();
  c.num_token_buckets = static_cast<int32_t>(buckets.size());
  c.query_lens = q_lens.data();
  c.num_query_lens = static_cast<int32_t>(q_lens.size());
  c.max_requests = r.max_requests;
  c.max_context = r.max_context;
  c.threads = r.threads;
  return c;
}

TEST(RuntimeCApi, StatusCodesAndLastError) {
  m3msa_runtime_config defaults;
  m3msa_runtime_config_default(&defaults);
  EXPECT_EQ(defaults.hidden, 6144);
  EXPECT_EQ(defaults.q_heads, 64);
  EXPECT_EQ(defaults.num_token_buckets, 5);
  EXPECT_EQ(defaults.indexer_overlap, 0);  // auto

  m3msa_thread_group* group = nullptr;
  EXPECT_EQ(m3msa_thread_group_create(0, 1000, &group), M3MSA_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(m3msa_last_error()).find("world_size must be >= 1"), std::string::npos);
  ASSERT_EQ(m3msa_thread_group_create(1, 1000, &group), M3MSA_OK);
  m3msa_comm* comm = nullptr;
  EXPECT_EQ(m3msa_thread_group_comm(group, 3, &comm), M3MSA_ERR_INVALID_ARGUMENT);
  ASSERT_EQ(m3msa_thread_group_comm(group, 0, &comm), M3MSA_OK);

  m3msa_runtime* rt = nullptr;
  ASSERT_EQ(m3msa_runtime_create(nullptr, nullptr, &rt), M3MSA_OK);
  int result = -1;
  EXPECT_EQ(m3msa_runtime_prepare(rt, &defaults, nullptr, 0, comm, /*capturing=*/1, 1, &result),
            M3MSA_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(m3msa_last_error()).find("capturing"), std::string::npos);
  EXPECT_EQ(m3msa_runtime_prepare(rt, &defaults, nullptr, 0, comm, 0, /*has_metadata=*/0, &result),
            M3MSA_OK);
  EXPECT_EQ(result, M3MSA_PREPARE_SKIPPED);
  m3msa_runtime_config bad = defaults;
  bad.hidden = -1;
  EXPECT_EQ(m3msa_runtime_prepare(rt, &bad, nullptr, 0, comm, 0, 1, &result),
            M3MSA_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(m3msa_last_error()).find("rank 0: invalid argument: model.hidden"),
            std::string::npos)
      << m3msa_last_error();
  EXPECT_EQ(m3msa_runtime_prepare(nullptr, &defaults, nullptr, 0, comm, 0, 1, &result),
            M3MSA_ERR_INVALID_ARGUMENT);

  // Unsupported everywhere (pipeline parallelism) -> fallback, with the reason in the stats.
  m3msa_runtime_config pp = defaults;
  pp.pipeline_parallel_size = 2;
  EXPECT_EQ(m3msa_runtime_prepare(rt, &pp, nullptr, 0, comm, 0, 1, &result), M3MSA_OK);
  EXPECT_EQ(result, M3MSA_PREPARE_FALLBACK);
  int state = -1;
  ASSERT_EQ(m3msa_runtime_state(rt, &state), M3MSA_OK);
  EXPECT_EQ(state, 2);
  size_t needed = 0;
  ASSERT_EQ(m3msa_runtime_stats_json(rt, nullptr, 0, &needed), M3MSA_OK);
  std::vector<char> json(needed);
  ASSERT_EQ(m3msa_runtime_stats_json(rt, json.data(), json.size(), &needed), M3MSA_OK);
  EXPECT_NE(std::string(json.data()).find("pipeline parallelism (pipeline_parallel_size 2)"),
            std::string::npos)
      << json.data();
  EXPECT_EQ(m3msa_runtime_close(rt), M3MSA_OK);
  EXPECT_EQ(m3msa_runtime_close(rt), M3MSA_OK);
  m3msa_runtime_destroy(rt);
  m3msa_comm_destroy(comm);
  m3msa_thread_group_destroy(group);
}

// moe: the mixture of experts (MXFP8) on every sparse layer instead of the dense MLP; dense: the
// dense layer 0 (MXFP8 dense MLP) bound and run too.
void one_step_equals_the_cpp_api(bool moe, bool dense = false) {
  RuntimeConfig config = testkit::small_config(/*intermediate=*/moe ? 0 : 64);
  if (moe) {
    config.model.num_experts = 8;
    config.model.experts_per_token = 2;
    config.model.moe_intermediate = 64;
    config.model.shared_experts = 1;
    config.model.dense_intermediate = 128;
  }
  const int64_t max_blocks = config.max_context / config.model.block_size;
  const int64_t pages = config.max_requests * max_blocks + 2;
  testkit::MasterModel master = testkit::make_master(config.model, pages, 77, !moe);
  if (moe) {
    for (std::size_t i = 0; i < master.layers.size(); ++i) {
      master.layers[i].has_moe = true;
      master.layers[i].moe = testkit::make_master_moe(config.model, 90 + i, /*fp8=*/true);
    }
  }
  if (dense) testkit::add_dense_layers(master, 91, /*fp8_mlp=*/true);
  const std::vector<int> run = dense ? std::vector<int>{0, 1, 2} : std::vector<int>{1, 2};
  const testkit::StepMeta step = testkit::make_step(
      {50, 90}, 2, config.model.block_size, max_blocks, testkit::page_permutation(pages, 78),
      testkit::page_permutation(pages, 79));
  const int64_t rows = step.batch.num_rows();
  const int64_t H = config.model.hidden;
  testkit::SplitMix64 rng(80);
  std::vector<uint16_t> hidden_in(static_cast<std::size_t>(rows * H)),
      residual_in(hidden_in.size());
  for (std::size_t i = 0; i < hidden_in.size(); ++i) {
    hidden_in[i] = float_to_bf16(rng.signed_unit());
    residual_in[i] = float_to_bf16(rng.signed_unit());
  }

  // C++.
  testkit::RankModel cpp_model = testkit::make_rank_model(master, 0, 1);
  auto comm = make_single_rank_communicator();
  Runtime cpp([](const std::string&) {});
  ASSERT_EQ(cpp.prepare(cpp_model.weights, config, *comm), PrepareResult::kActive);
  ASSERT_TRUE(cpp.begin_step(step.batch));
  std::vector<uint16_t> cpp_hidden = hidden_in, cpp_residual = residual_in;
  for (int layer : run) {
    cpp.forward_layer(layer, TensorView::contiguous(cpp_hidden.data(), DType::kBF16, {rows, H}),
                      TensorView::contiguous(cpp_residual.data(), DType::kBF16, {rows, H}),
                      step.positions.view());
  }
  cpp.close();

  // C, on fresh copies of the same caches.
  testkit::RankModel c_model = testkit::make_rank_model(master, 0, 1);
  std::vector<m3msa_layer_weights> layers;
  for (const LayerWeights& w : c_model.weights.layers) layers.push_back(c_layer(w));
  std::vector<int32_t> buckets, q_lens;
  const m3msa_runtime_config c = c_config(config, buckets, q_lens);
  m3msa_comm* c_comm = nullptr;
  ASSERT_EQ(m3msa_single_rank_comm(&c_comm), M3MSA_OK);
  m3msa_runtime* rt = nullptr;
  ASSERT_EQ(m3msa_runtime_create(nullptr, nullptr, &rt), M3MSA_OK);
  int result = -1;
  ASSERT_EQ(m3msa_runtime_prepare(rt, &c, layers.data(), static_cast<int>(layers.size()), c_comm, 0,
                                  1, &result),
            M3MSA_OK)
      << m3msa_last_error();
  ASSERT_EQ(result, M3MSA_PREPARE_ACTIVE);
  const m3msa_batch batch = c_batch(step.batch);
  int accepted = 0;
  ASSERT_EQ(m3msa_runtime_begin_step(rt, &batch, &accepted), M3MSA_OK) << m3msa_last_error();
  ASSERT_EQ(accepted, 1);
  std::vector<uint16_t> c_hidden = hidden_in, c_residual = residual_in;
  const m3msa_tensor h = c_tensor(TensorView::contiguous(c_hidden.data(), DType::kBF16, {rows, H}));
  const m3msa_tensor r =
      c_tensor(TensorView::contiguous(c_residual.data(), DType::kBF16, {rows, H}));
  const m3msa_tensor pos = c_tensor(step.positions.view());
  for (int layer : run) {
    ASSERT_EQ(m3msa_runtime_forward_layer(rt, layer, &h, &r, &pos), M3MSA_OK) << m3msa_last_error();
  }
  if (!dense) {
    EXPECT_EQ(m3msa_runtime_forward_layer(rt, 0, &h, &r, &pos), M3MSA_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(m3msa_last_error()).find("layer 0 is a dense layer"), std::string::npos)
        << m3msa_last_error();
  }
  EXPECT_EQ(c_hidden, cpp_hidden);
  EXPECT_EQ(c_residual, cpp_residual);

  // Detach refuses live storage, accepts an empty replacement, then the runtime is closed.
  m3msa_layer_caches replacement;
  std::memset(&replacement, 0, sizeof(replacement));
  replacement.layer = 1;
  replacement.kv_cache = c_tensor(c_model.weights.layers[0].kv_cache.data);
  EXPECT_EQ(m3msa_runtime_detach(rt, &replacement, 1), M3MSA_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(m3msa_last_error()).find("replacement must be empty"), std::string::npos);
  replacement.kv_cache = c_tensor(TensorView{});
  EXPECT_EQ(m3msa_runtime_detach(rt, &replacement, 1), M3MSA_OK) << m3msa_last_error();
  int state = -1;
  ASSERT_EQ(m3msa_runtime_state(rt, &state), M3MSA_OK);
  EXPECT_EQ(state, 3);
  m3msa_runtime_destroy(rt);
  m3msa_comm_destroy(c_comm);
}

TEST(RuntimeCApi, OneStepEqualsTheCppApi) {
  one_step_equals_the_cpp_api(false);
}

TEST(RuntimeCApi, OneMoeStepEqualsTheCppApi) {
  one_step_equals_the_cpp_api(true);
}

TEST(RuntimeCApi, OneStepWithTheDenseLayerEqualsTheCppApi) {
  one_step_equals_the_cpp_api(true, /*dense=*/true);
}

}  // namespace
}  // namespace m3msa
