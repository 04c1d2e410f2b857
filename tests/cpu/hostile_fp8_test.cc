// fp8 e4m3 saturation (docs/spec.md section 3): a value beyond +-448 (after dividing by the cache
// scale) is stored as +-448, never as NaN or a wrapped code; NaN stays NaN. Checked on the scalar
// conversion, on both cache inserts (with scales), through preprocessing with norm weights that
// push keys far past the range, and in selection, where saturated keys tie.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "m3msa/cpu_reference.h"
#include "reference_test_util.h"

namespace m3msa {
namespace {

using reftest::Case;
using reftest::CaseSpec;
using reftest::make_case;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kMax = std::numeric_limits<float>::max();

TEST(HostileFp8, BeyondTheRangeSaturatesToPlusMinus448) {
  for (float v : {448.0f, 449.0f, 463.9f, 464.0f, 480.0f, 1e4f, 1e30f, kMax, kInf}) {
    EXPECT_EQ(float_to_fp8e4m3(v), 0x7E) << v;
    EXPECT_EQ(float_to_fp8e4m3(-v), 0xFE) << -v;
    EXPECT_EQ(fp8e4m3_to_float(float_to_fp8e4m3(v)), 448.0f);
    EXPECT_EQ(fp8e4m3_to_float(float_to_fp8e4m3(-v)), -448.0f);
  }
  EXPECT_EQ(fp8e4m3_to_float(float_to_fp8e4m3(447.0f)), 448.0f) << "rounds up to the max";
  EXPECT_EQ(fp8e4m3_to_float(float_to_fp8e4m3(420.0f)), 416.0f);
  EXPECT_TRUE(std::isnan(fp8e4m3_to_float(float_to_fp8e4m3(std::nanf("")))));
  EXPECT_TRUE(std::isnan(fp8e4m3_to_float(float_to_fp8e4m3(-std::nanf("")))));
}

TEST(HostileFp8, IndexKeyInsertSaturates) {
  HostTensor data(DType::kFP8E4M3, {2, 4, 8});
  data.fill_bytes(0);
  IndexCache cache{data.view()};
  const float in[8] = {449.0f, -1e6f, kInf, -kInf, 448.0f, 96.0f, std::nanf(""), -kMax};
  cpu::insert_index_k(cache, /*slot=*/5, in, 8);
  const float want[8] = {448.0f, -448.0f, 448.0f, -448.0f, 448.0f, 96.0f, NAN, -448.0f};
  for (int d = 0; d < 8; ++d) {
    const float got = fp8e4m3_to_float(data.ptr<uint8_t>()[5 * 8 + d]);
    if (std::isnan(want[d])) {
      EXPECT_TRUE(std::isnan(got)) << d;
    } else {
      EXPECT_EQ(got, want[d]) << d;
    }
  }
}

TEST(HostileFp8, KvInsertSaturatesAfterTheScale) {
  // stored = value / scale, read = stored * scale: the saturation point moves with the scale.
  HostTensor data(DType::kFP8E4M3, {1, 1, 2, 4, 8});
  data.fill_bytes(0);
  KVCache cache{data.view(), /*k_scale=*/0.5f, /*v_scale=*/4.0f};
  const float k[8] = {224.0f, 225.0f, 300.0f, -1e9f, kInf, 0.5f, -224.0f, 100.0f};
  const float v[8] = {1792.0f, 1800.0f, 1e9f, -2000.0f, -kInf, 4.0f, -1792.0f, 32.0f};
  cpu::insert_kv(cache, /*slot=*/2, /*kv_head=*/0, k, v, 8);
  const float k_want[8] = {224.0f, 224.0f, 224.0f, -224.0f, 224.0f, 0.5f, -224.0f, 96.0f};
  const float v_want[8] = {1792.0f, 1792.0f, 1792.0f, -1792.0f, -1792.0f, 4.0f, -1792.0f, 32.0f};
  for (int d = 0; d < 8; ++d) {
    EXPECT_EQ(fp8e4m3_to_float(data.ptr<uint8_t>()[(0 * 4 + 2) * 8 + d]) * 0.5f, k_want[d]) << d;
    EXPECT_EQ(fp8e4m3_to_float(data.ptr<uint8_t>()[(1 * 4 + 2) * 8 + d]) * 4.0f, v_want[d]) << d;
  }
}

TEST(HostileFp8, PreprocessSaturatesNormedKeysAndRawValues) {
  CaseSpec spec;
  spec.index_dtype = DType::kFP8E4M3;
  spec.kv_dtype = DType::kFP8E4M3;
  spec.q_len = 2;
  spec.seq_lens = {20, 9};
  Case c = make_case(spec);
  const SparseConfig& cfg = c.config;
  c.kv_cache.fill_bytes(0);
  c.index_cache.fill_bytes(0);
  const int64_t rows = c.rows();
  const int64_t width = cfg.qkv_width();
  HostTensor qkv(DType::kBF16, {rows, width});
  reftest::Rng rng(7);
  reftest::fill_random(qkv, rng, 1.0);
  // v is stored unnormed: +-1000 must land as +-448.
  const int64_t v_at = int64_t{cfg.q_heads} * cfg.head_dim + int64_t{cfg.kv_heads} * cfg.head_dim;
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t i = 0; i < int64_t{cfg.kv_heads} * cfg.head_dim; ++i) {
      qkv.ptr<uint16_t>()[row * width + v_at + i] = float_to_bf16(i % 2 ? -1000.0f : 1000.0f);
    }
  }
  // (1 + w) = 1000: normed k and index_k reach far past 448.
  auto norm = [](int n, float w) {
    HostTensor t(DType::kBF16, {n});
    for (int i = 0; i < n; ++i) t.ptr<uint16_t>()[i] = float_to_bf16(w);
    return t;
  };
  HostTensor q_norm = norm(cfg.head_dim, 0.0f), k_norm = norm(cfg.head_dim, 999.0f);
  HostTensor iq_norm = norm(cfg.index_dim, 0.0f), ik_norm = norm(cfg.index_dim, 999.0f);
  HostTensor q_out(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
  HostTensor iq_out(DType::kBF16, {rows, cfg.index_heads, cfg.index_dim});
  PreprocessArgs args;
  args.qkv = qkv.view();
  args.q_norm = q_norm.view();
  args.k_norm = k_norm.view();
  args.index_q_norm = iq_norm.view();
  args.index_k_norm = ik_norm.view();
  args.positions = c.positions.view();
  args.batch = c.batch;
  args.kv_cache = c.kv_cache_view();
  args.index_cache = c.index_cache_view();
  args.q_out = q_out.view();
  args.index_q_out = iq_out.view();
  cpu::preprocess(cfg, args, 2);

  int saturated_k = 0, saturated_index_k = 0;
  for (int64_t row = 0; row < rows; ++row) {
    const int req = c.row_req[row];
    const int64_t pos = c.row_pos[row];
    for (int h = 0; h < cfg.kv_heads; ++h) {
      for (int d = 0; d < cfg.head_dim; ++d) {
        const double k = c.kv(req, h, 0, pos, d);
        ASSERT_TRUE(std::isfinite(k));
        ASSERT_LE(std::abs(k), 448.0);
        saturated_k += std::abs(k) == 448.0;
        EXPECT_EQ(c.kv(req, h, 1, pos, d), (h * cfg.head_dim + d) % 2 ? -448.0 : 448.0);
      }
    }
    for (int d = 0; d < cfg.index_dim; ++d) {
      const float k = c.index_k(req, pos, d);
      ASSERT_TRUE(std::isfinite(k));
      ASSERT_LE(std::abs(k), 448.0f);
      saturated_index_k += std::abs(k) == 448.0f;
    }
  }
  EXPECT_GT(saturated_k, 0) << "the test must push some keys past the range";
  EXPECT_GT(saturated_index_k, 0);
}

TEST(HostileFp8, SaturatedKeysTieAndTheLowerBlockWins) {
  CaseSpec spec;
  spec.index_dtype = DType::kFP8E4M3;
  spec.seq_lens = {8 * 4 + 3};  // nb 5: blocks 0..3 scored, 4 forced
  Case c = make_case(spec);
  const int bs = c.config.block_size;
  // Block 1 holds 448, block 2 1e6 (saturated to 448), block 3 440 (rounds to 448), block 0 1.
  const float value[4] = {1.0f, 448.0f, 1e6f, 440.0f};
  for (int b = 0; b < 4; ++b) {
    for (int t = 0; t < bs; ++t) {
      for (int d = 0; d < c.config.index_dim; ++d) c.set_index_k(0, b * bs + t, d, value[b]);
    }
  }
  for (int h = 0; h < c.config.index_heads; ++h) {
    for (int d = 0; d < c.config.index_dim; ++d) c.set_index_q(0, h, d, 1.0f);
  }
  HostTensor topk(DType::kI32, {1, c.config.index_heads, c.config.topk});
  cpu::select_topk(c.config, c.indexer(topk.view()), 1);
  for (int h = 0; h < c.config.index_heads; ++h) {
    const int32_t* sel = topk.ptr<int32_t>() + h * c.config.topk;
    EXPECT_EQ(std::vector<int32_t>(sel, sel + c.config.topk), (std::vector<int32_t>{4, 1, 2, 3}));
  }
}

}  // namespace
}  // namespace m3msa
