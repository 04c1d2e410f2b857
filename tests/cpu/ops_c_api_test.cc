// The decode operations through the C ABI (ops_c.h) on the CPU reference: bit for bit the results
// of the same calls through the C++ backend; the version calls; refusals that name the argument.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "c_api_test_util.h"
#include "m3msa/backend.h"
#include "m3msa/ops_c.h"
#include "m3msa/synthetic.h"
#include "m3msa/testing/random.h"
#include "m3msa/version.h"

namespace m3msa {
namespace {

using capitest::c_batch;
using capitest::c_tensor;

m3msa_sparse_config c_config(const SparseConfig& s) {
  m3msa_sparse_config c;
  m3msa_sparse_config_init(&c);
  c.q_heads = s.q_heads;
  c.kv_heads = s.kv_heads;
  c.head_dim = s.head_dim;
  c.index_heads = s.index_heads;
  c.index_dim = s.index_dim;
  c.block_size = s.block_size;
  c.topk = s.topk;
  c.init_blocks = s.init_blocks;
  c.local_blocks = s.local_blocks;
  c.rope_dim = s.rope_dim;
  c.rope_theta = s.rope_theta;
  c.rms_eps = s.rms_eps;
  return c;
}

m3msa_ops* cpu_ops(const SparseConfig& config, int threads) {
  m3msa_ops_options options;
  m3msa_ops_options_init(&options);
  options.threads = threads;
  const m3msa_sparse_config c = c_config(config);
  m3msa_ops* ops = nullptr;
  EXPECT_EQ(m3msa_ops_create(&c, &options, &ops), M3MSA_OK) << m3msa_last_error();
  return ops;
}

bool same_bytes(const HostTensor& a, const HostTensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

TEST(OpsCApi, VersionMatchesTheHeader) {
  EXPECT_EQ(m3msa_version(),
            M3MSA_VERSION_MAJOR * 10000 + M3MSA_VERSION_MINOR * 100 + M3MSA_VERSION_PATCH);
  EXPECT_STREQ(m3msa_version_string(), M3MSA_VERSION_STRING);
}

TEST(OpsCApi, DefaultsAreTheCppDefaults) {
  m3msa_sparse_config c;
  std::memset(&c, 0xAB, sizeof(c));
  m3msa_sparse_config_init(&c);
  const SparseConfig s;
  EXPECT_EQ(c.struct_size, sizeof(c));
  EXPECT_EQ(c.q_heads, s.q_heads);
  EXPECT_EQ(c.kv_heads, s.kv_heads);
  EXPECT_EQ(c.index_heads, s.index_heads);
  EXPECT_EQ(c.topk, s.topk);
  EXPECT_EQ(c.local_blocks, s.local_blocks);
  EXPECT_EQ(c.rope_theta, s.rope_theta);
  m3msa_attention_args a;
  std::memset(&a, 0xAB, sizeof(a));
  m3msa_attention_args_init(&a);
  EXPECT_EQ(a.struct_size, sizeof(a));
  EXPECT_EQ(a.k_scale, 1.0f);
  EXPECT_EQ(a.topk_idx.data, nullptr);
  EXPECT_EQ(a.topk_idx.ndim, 0);
}

// Decode and prefill, bf16 and fp8 caches (with scales): the indexer's selection and the
// attention output through the C ABI equal the C++ CPU backend's bit for bit.
TEST(OpsCApi, IndexerAndAttentionEqualTheCppBackend) {
  struct Shape {
    BatchKind kind;
    int reqs;
    int q_len;
    DType index_dtype;
    DType kv_dtype;
  };
  const Shape shapes[] = {
      {BatchKind::kDecode, 3, 1, DType::kBF16, DType::kBF16},
      {BatchKind::kDecode, 2, 4, DType::kFP8E4M3, DType::kFP8E4M3},
      {BatchKind::kPrefill, 2, 1, DType::kBF16, DType::kFP8E4M3},
  };
  uint64_t seed = 71;
  for (const Shape& shape : shapes) {
    SyntheticSpec spec;
    spec.config.q_heads = 8;
    spec.config.kv_heads = 2;
    spec.config.index_heads = 2;
    spec.kind = shape.kind;
    spec.num_reqs = shape.reqs;
    spec.q_len = shape.q_len;
    spec.min_context = 300;
    spec.max_context = 3000;
    spec.index_dtype = shape.index_dtype;
    spec.kv_dtype = shape.kv_dtype;
    if (shape.kv_dtype == DType::kFP8E4M3) {
      spec.k_scale = 0.5f;
      spec.v_scale = 2.0f;
    }
    spec.seed = seed++;
    const SyntheticCase c = make_synthetic_case(spec);
    const SparseConfig& config = c.config;
    const int64_t rows = c.num_rows();
    const std::string what = "shape " + std::to_string(seed);

    std::unique_ptr<Backend> cpp = make_cpu_backend(2);
    HostTensor want_sel(DType::kI32, {rows, config.index_heads, config.topk});
    HostTensor want_out(DType::kBF16, {rows, config.q_heads, config.head_dim});
    cpp->select_topk(config, c.indexer_args(want_sel.view()));
    cpp->sparse_attention(config, c.attention_args(want_sel.view(), want_out.view()));

    m3msa_ops* ops = cpu_ops(config, 2);
    ASSERT_NE(ops, nullptr);
    HostTensor sel(DType::kI32, {rows, config.index_heads, config.topk});
    HostTensor out(DType::kBF16, {rows, config.q_heads, config.head_dim});
    std::memset(sel.data(), 0x5A, sel.nbytes());  // poisoned: every entry must be written
    std::memset(out.data(), 0x5A, out.nbytes());
    m3msa_indexer_args ia;
    m3msa_indexer_args_init(&ia);
    ia.index_q = c_tensor(c.index_q.view());
    ia.index_cache = c_tensor(c.index_cache.view());
    ia.batch = c_batch(c.batch);
    ia.topk_idx = c_tensor(sel.view());
    ASSERT_EQ(m3msa_select_topk(ops, &ia, nullptr), M3MSA_OK) << what << ": " << m3msa_last_error();
    m3msa_attention_args aa;
    m3msa_attention_args_init(&aa);
    aa.q = c_tensor(c.q.view());
    aa.kv_cache = c_tensor(c.kv_cache.view());
    aa.k_scale = c.k_scale;
    aa.v_scale = c.v_scale;
    aa.batch = c_batch(c.batch);
    aa.topk_idx = c_tensor(sel.view());
    aa.out = c_tensor(out.view());
    ASSERT_EQ(m3msa_sparse_attention(ops, &aa, nullptr), M3MSA_OK)
        << what << ": " << m3msa_last_error();
    EXPECT_TRUE(same_bytes(sel, want_sel)) << what;
    EXPECT_TRUE(same_bytes(out, want_out)) << what;

    // Dense causal attention: topk_idx not given.
    HostTensor dense_want(DType::kBF16, {rows, config.q_heads, config.head_dim});
    cpp->sparse_attention(config, c.attention_args(TensorView{}, dense_want.view()));
    aa.topk_idx = c_tensor(TensorView{});
    ASSERT_EQ(m3msa_sparse_attention(ops, &aa, nullptr), M3MSA_OK) << m3msa_last_error();
    EXPECT_TRUE(same_bytes(out, dense_want)) << what << " (dense)";
    m3msa_ops_destroy(ops);
  }
}

// Preprocessing (norms, RoPE, cache inserts) through the C ABI writes what the C++ call writes.
TEST(OpsCApi, PreprocessEqualsTheCppBackend) {
  SyntheticSpec spec;
  spec.config.q_heads = 8;
  spec.config.kv_heads = 2;
  spec.config.index_heads = 2;
  spec.num_reqs = 3;
  spec.q_len = 2;
  spec.min_context = 200;
  spec.max_context = 900;
  spec.kv_dtype = DType::kFP8E4M3;
  spec.k_scale = 0.25f;
  spec.v_scale = 0.5f;
  spec.seed = 81;
  const SparseConfig config = spec.config;
  const int64_t rows = int64_t{spec.num_reqs} * spec.q_len;
  HostTensor qkv(DType::kBF16, {rows, config.qkv_width()});
  HostTensor q_norm(DType::kBF16, {config.head_dim}), k_norm(DType::kBF16, {config.head_dim});
  HostTensor iq_norm(DType::kBF16, {config.index_dim}), ik_norm(DType::kBF16, {config.index_dim});
  testkit::fill_bf16(qkv, 1);
  testkit::fill_bf16(q_norm, 2, 0.1f);
  testkit::fill_bf16(k_norm, 3, 0.1f);
  testkit::fill_bf16(iq_norm, 4, 0.1f);
  testkit::fill_bf16(ik_norm, 5, 0.1f);

  SyntheticCase want = make_synthetic_case(spec);  // its caches are written in place
  SyntheticCase got = make_synthetic_case(spec);
  HostTensor want_q(DType::kBF16, {rows, config.q_heads, config.head_dim});
  HostTensor want_iq(DType::kBF16, {rows, config.index_heads, config.index_dim});
  HostTensor got_q(DType::kBF16, {rows, config.q_heads, config.head_dim});
  HostTensor got_iq(DType::kBF16, {rows, config.index_heads, config.index_dim});
  PreprocessArgs a;
  a.qkv = qkv.view();
  a.q_norm = q_norm.view();
  a.k_norm = k_norm.view();
  a.index_q_norm = iq_norm.view();
  a.index_k_norm = ik_norm.view();
  a.positions = want.positions.view();
  a.batch = want.batch;
  a.kv_cache = want.kv_cache_view();
  a.index_cache = want.index_cache_view();
  a.q_out = want_q.view();
  a.index_q_out = want_iq.view();
  make_cpu_backend(2)->preprocess(config, a);

  m3msa_ops* ops = cpu_ops(config, 2);
  ASSERT_NE(ops, nullptr);
  m3msa_preprocess_args c;
  m3msa_preprocess_args_init(&c);
  c.qkv = c_tensor(qkv.view());
  c.q_norm = c_tensor(q_norm.view());
  c.k_norm = c_tensor(k_norm.view());
  c.index_q_norm = c_tensor(iq_norm.view());
  c.index_k_norm = c_tensor(ik_norm.view());
  c.positions = c_tensor(got.positions.view());
  c.batch = c_batch(got.batch);
  c.kv_cache = c_tensor(got.kv_cache.view());
  c.k_scale = got.k_scale;
  c.v_scale = got.v_scale;
  c.index_cache = c_tensor(got.index_cache.view());
  c.q_out = c_tensor(got_q.view());
  c.index_q_out = c_tensor(got_iq.view());
  ASSERT_EQ(m3msa_preprocess(ops, &c, nullptr), M3MSA_OK) << m3msa_last_error();
  EXPECT_TRUE(same_bytes(got_q, want_q));
  EXPECT_TRUE(same_bytes(got_iq, want_iq));
  EXPECT_TRUE(same_bytes(got.kv_cache, want.kv_cache));
  EXPECT_TRUE(same_bytes(got.index_cache, want.index_cache));
  m3msa_ops_destroy(ops);
}

void expect_refused(m3msa_status status, m3msa_status code, const std::string& needle) {
  EXPECT_EQ(status, code) << needle;
  EXPECT_NE(std::string(m3msa_last_error()).find(needle), std::string::npos)
      << "message: " << m3msa_last_error() << "\nexpected to contain: " << needle;
}

TEST(OpsCApi, RefusalsNameTheArgument) {
  SyntheticSpec spec;
  spec.config.q_heads = 8;
  spec.config.kv_heads = 2;
  spec.config.index_heads = 2;
  spec.num_reqs = 2;
  spec.seed = 91;
  const SyntheticCase c = make_synthetic_case(spec);
  const SparseConfig& config = c.config;
  m3msa_ops* ops = cpu_ops(config, 1);
  ASSERT_NE(ops, nullptr);
  HostTensor sel(DType::kI32, {c.num_rows(), config.index_heads, config.topk});
  m3msa_indexer_args ia;
  m3msa_indexer_args_init(&ia);
  ia.index_q = c_tensor(c.index_q.view());
  ia.index_cache = c_tensor(c.index_cache.view());
  ia.batch = c_batch(c.batch);
  ia.topk_idx = c_tensor(sel.view());
  ASSERT_EQ(m3msa_select_topk(ops, &ia, nullptr), M3MSA_OK) << m3msa_last_error();

  m3msa_indexer_args bad = ia;
  bad.struct_size = 0;
  expect_refused(m3msa_select_topk(ops, &bad, nullptr), M3MSA_ERR_INVALID_ARGUMENT,
                 "m3msa_indexer_args.struct_size");
  bad = ia;
  bad.topk_idx.dtype = M3MSA_F32;
  expect_refused(m3msa_select_topk(ops, &bad, nullptr), M3MSA_ERR_INVALID_ARGUMENT, "topk_idx");
  bad = ia;
  bad.index_q.dtype = 99;
  expect_refused(m3msa_select_topk(ops, &bad, nullptr), M3MSA_ERR_INVALID_ARGUMENT,
                 "unknown m3msa_dtype 99");
  bad = ia;
  bad.batch.kind = 7;
  expect_refused(m3msa_select_topk(ops, &bad, nullptr), M3MSA_ERR_INVALID_ARGUMENT, "batch.kind");
  bad = ia;
  bad.index_cache.device_type = 1;  // a CPU pointer claimed to be on a GPU
  expect_refused(m3msa_select_topk(ops, &bad, nullptr), M3MSA_ERR_INVALID_ARGUMENT, "index_cache");
  expect_refused(m3msa_select_topk(nullptr, &ia, nullptr), M3MSA_ERR_INVALID_ARGUMENT, "ops");
  expect_refused(m3msa_select_topk(ops, nullptr, nullptr), M3MSA_ERR_INVALID_ARGUMENT, "args");
  m3msa_attention_args aa;
  m3msa_attention_args_init(&aa);
  aa.struct_size = sizeof(aa) - 8;  // a caller built against a shorter struct than this library's
  expect_refused(m3msa_sparse_attention(ops, &aa, nullptr), M3MSA_ERR_INVALID_ARGUMENT,
                 "m3msa_attention_args.struct_size");
  uint32_t status = 1;
  EXPECT_EQ(m3msa_ops_device_status(ops, 1, &status), M3MSA_OK);
  EXPECT_EQ(status, 0u);
  m3msa_ops_destroy(ops);

  m3msa_sparse_config sc = c_config(config);
  m3msa_ops_options options;
  m3msa_ops_options_init(&options);
  m3msa_ops* out = nullptr;
  sc.topk = 0;
  expect_refused(m3msa_ops_create(&sc, &options, &out), M3MSA_ERR_INVALID_ARGUMENT, "topk");
  EXPECT_EQ(out, nullptr);
  sc = c_config(config);
  sc.struct_size = 4;
  expect_refused(m3msa_ops_create(&sc, &options, &out), M3MSA_ERR_INVALID_ARGUMENT,
                 "m3msa_sparse_config.struct_size");
  sc = c_config(config);
  options.device_type = 2;
  expect_refused(m3msa_ops_create(&sc, &options, &out), M3MSA_ERR_INVALID_ARGUMENT,
                 "options.device_type");
  options.device_type = 0;
  options.threads = -1;
  expect_refused(m3msa_ops_create(&sc, &options, &out), M3MSA_ERR_INVALID_ARGUMENT,
                 "options.threads");
  if (cuda_device_count() == 0) {  // no GPU here: CUDA objects are refused as unsupported
    options.threads = 0;
    options.device_type = 1;
    EXPECT_EQ(m3msa_ops_create(&sc, &options, &out), M3MSA_ERR_UNSUPPORTED) << m3msa_last_error();
    EXPECT_EQ(out, nullptr);
  }
}

}  // namespace
}  // namespace m3msa
