// CPU reference preprocessing (norms, RoPE, cache inserts) against a double-precision oracle, and
// the end-to-end identity: a sequence prefilled in chunks gives exactly what decoding it token by
// token gives.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "reference_test_util.h"

namespace m3msa {
namespace {

using reftest::Case;
using reftest::CaseSpec;
using reftest::make_case;
using reftest::Rng;

struct Weights {
  HostTensor q_norm, k_norm, index_q_norm, index_k_norm;
};

Weights random_weights(const SparseConfig& cfg, Rng& rng) {
  Weights w{HostTensor(DType::kBF16, {cfg.head_dim}), HostTensor(DType::kBF16, {cfg.head_dim}),
            HostTensor(DType::kBF16, {cfg.index_dim}), HostTensor(DType::kBF16, {cfg.index_dim})};
  for (HostTensor* t : {&w.q_norm, &w.k_norm, &w.index_q_norm, &w.index_k_norm}) {
    reftest::fill_random(*t, rng, 0.5);
  }
  return w;
}

// Projection rows with a different magnitude per row, so the norm has something to undo.
HostTensor random_qkv(const SparseConfig& cfg, int64_t rows, Rng& rng) {
  HostTensor qkv(DType::kBF16, {rows, cfg.qkv_width()});
  for (int64_t r = 0; r < rows; ++r) {
    const double scale = rng.uniform(0.1, 5.0);
    for (int64_t i = 0; i < cfg.qkv_width(); ++i) {
      qkv.ptr<uint16_t>()[r * cfg.qkv_width() + i] =
          float_to_bf16(static_cast<float>(rng.uniform(-1.0, 1.0) * scale));
    }
  }
  return qkv;
}

struct Outputs {
  HostTensor q_out, index_q_out;
};

Outputs new_outputs(const SparseConfig& cfg, int64_t rows) {
  Outputs o{HostTensor(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim}),
            HostTensor(DType::kBF16, {rows, cfg.index_heads, cfg.index_dim})};
  o.q_out.fill_bytes(0xFF);
  o.index_q_out.fill_bytes(0xFF);
  return o;
}

PreprocessArgs make_args(const HostTensor& qkv, const Weights& w, const HostTensor& positions,
                         const BatchMeta& batch, KVCache kv, IndexCache index, const Outputs& o) {
  PreprocessArgs a;
  a.qkv = qkv.view();
  a.q_norm = w.q_norm.view();
  a.k_norm = w.k_norm.view();
  a.index_q_norm = w.index_q_norm.view();
  a.index_k_norm = w.index_k_norm.view();
  a.positions = positions.view();
  a.batch = batch;
  a.kv_cache = kv;
  a.index_cache = index;
  a.q_out = o.q_out.view();
  a.index_q_out = o.index_q_out.view();
  return a;
}

// One head through the spec in double: Gemma RMSNorm -> bf16 -> NeoX RoPE (unrounded result).
// `normed` returns the bf16 norm output the rotation started from.
std::vector<double> oracle_head(const uint16_t* x, const HostTensor& weight, int n,
                                const SparseConfig& cfg, int64_t pos, std::vector<double>& normed) {
  double sum_sq = 0.0;
  for (int i = 0; i < n; ++i) sum_sq += std::pow(bf16_to_float(x[i]), 2);
  const double r = 1.0 / std::sqrt(sum_sq / n + static_cast<double>(cfg.rms_eps));
  normed.assign(static_cast<std::size_t>(n), 0.0);
  for (int i = 0; i < n; ++i) {
    const double y = bf16_to_float(x[i]) * r * (1.0 + bf16_to_float(weight.ptr<uint16_t>()[i]));
    normed[i] = round_to_bf16(static_cast<float>(y));
  }
  std::vector<double> out = normed;
  const int half = cfg.rope_dim / 2;
  for (int i = 0; i < half; ++i) {
    const double angle =
        static_cast<double>(pos) * std::pow(cfg.rope_theta, -2.0 * i / cfg.rope_dim);
    out[i] = normed[i] * std::cos(angle) - normed[i + half] * std::sin(angle);
    out[i + half] = normed[i + half] * std::cos(angle) + normed[i] * std::sin(angle);
  }
  return out;
}

// bf16 outputs of RMSNorm + RoPE against the oracle. Tolerance: one bf16 ulp (2^-7 relative) of the
// value, plus, on rotated dims, one ulp of both rotation inputs (a norm output that rounded the
// other way at a near-tie moves the rotation by that much).
void expect_head_close(const std::vector<double>& want, const std::vector<double>& normed,
                       int rope_dim, const std::function<float(int)>& got, double extra_rel,
                       double extra_abs, const std::string& where) {
  const int n = static_cast<int>(want.size());
  const int half = rope_dim / 2;
  for (int i = 0; i < n; ++i) {
    double tol = std::ldexp(std::abs(want[i]), -7);
    if (i < rope_dim) {
      const int j = i < half ? i + half : i - half;
      tol += std::ldexp(std::abs(normed[i]) + std::abs(normed[j]), -7);
    }
    tol += extra_rel * std::abs(want[i]) + extra_abs + 1e-6;
    ASSERT_LE(std::abs(got(i) - want[i]), tol)
        << where << " dim " << i << ": got " << got(i) << ", oracle " << want[i];
  }
}

void check_against_oracle(DType index_dtype, DType kv_dtype, float k_scale, float v_scale) {
  CaseSpec spec;
  spec.index_dtype = index_dtype;
  spec.kv_dtype = kv_dtype;
  spec.k_scale = k_scale;
  spec.v_scale = v_scale;
  spec.q_len = 2;
  spec.seq_lens = {9, 0, 70, 3};
  Case c = make_case(spec);
  const SparseConfig& cfg = c.config;
  Rng rng(11);
  const Weights w = random_weights(cfg, rng);
  const HostTensor qkv = random_qkv(cfg, c.rows(), rng);
  // Large positions too: an fp32 angle would be off by far more than the tolerance there.
  c.positions.ptr<int64_t>()[0] = 1000003;
  c.positions.ptr<int64_t>()[1] = 123456789;
  // Row 2 and 3 are dead (padding request): give them real slots, nothing may be written there.
  c.slot_mapping.ptr<int64_t>()[2] = 5;
  c.index_slot_mapping.ptr<int64_t>()[3] = 6;
  // Row 5 is live but skips both inserts.
  c.slot_mapping.ptr<int64_t>()[5] = -1;
  c.index_slot_mapping.ptr<int64_t>()[5] = -3;

  const std::vector<uint8_t> kv_bytes = reftest::bytes_of(c.kv_cache);
  const std::vector<uint8_t> index_bytes = reftest::bytes_of(c.index_cache);
  const Outputs o = new_outputs(cfg, c.rows());
  cpu::preprocess(
      cfg, make_args(qkv, w, c.positions, c.batch, c.kv_cache_view(), c.index_cache_view(), o), 2);

  const int64_t width = cfg.qkv_width();
  const int64_t k_at = int64_t{cfg.q_heads} * cfg.head_dim;
  const int64_t v_at = k_at + int64_t{cfg.kv_heads} * cfg.head_dim;
  const int64_t iq_at = v_at + int64_t{cfg.kv_heads} * cfg.head_dim;
  const int64_t ik_at = iq_at + int64_t{cfg.index_heads} * cfg.index_dim;
  std::vector<bool> kv_written(kv_bytes.size(), false), index_written(index_bytes.size(), false);
  const double fp8_rel = std::ldexp(1.0, -4);   // half an fp8 ulp (3 mantissa bits)
  const double fp8_abs = std::ldexp(1.0, -10);  // half the fp8 subnormal step, times the scale
  for (int64_t row = 0; row < c.rows(); ++row) {
    const int64_t pos = c.positions.ptr<int64_t>()[row];
    const uint16_t* in = qkv.ptr<uint16_t>() + row * width;
    std::vector<double> normed;
    const std::string where = "row " + std::to_string(row);
    if (pos < 0) {
      for (int64_t i = 0; i < int64_t{cfg.q_heads} * cfg.head_dim; ++i) {
        ASSERT_EQ(o.q_out.ptr<uint16_t>()[row * cfg.q_heads * cfg.head_dim + i], 0) << where;
      }
      for (int64_t i = 0; i < int64_t{cfg.index_heads} * cfg.index_dim; ++i) {
        ASSERT_EQ(o.index_q_out.ptr<uint16_t>()[row * cfg.index_heads * cfg.index_dim + i], 0);
      }
      continue;
    }
    for (int g = 0; g < cfg.q_heads; ++g) {
      const auto want =
          oracle_head(in + g * cfg.head_dim, w.q_norm, cfg.head_dim, cfg, pos, normed);
      expect_head_close(
          want, normed, cfg.rope_dim,
          [&](int i) {
            return bf16_to_float(
                o.q_out.ptr<uint16_t>()[(row * cfg.q_heads + g) * cfg.head_dim + i]);
          },
          0.0, 0.0, where + " q head " + std::to_string(g));
    }
    for (int h = 0; h < cfg.index_heads; ++h) {
      const auto want = oracle_head(in + iq_at + h * cfg.index_dim, w.index_q_norm, cfg.index_dim,
                                    cfg, pos, normed);
      expect_head_close(
          want, normed, cfg.rope_dim,
          [&](int i) {
            return bf16_to_float(
                o.index_q_out.ptr<uint16_t>()[(row * cfg.index_heads + h) * cfg.index_dim + i]);
          },
          0.0, 0.0, where + " index_q head " + std::to_string(h));
    }
    const int64_t slot = c.slot_mapping.ptr<int64_t>()[row];
    const int64_t islot = c.index_slot_mapping.ptr<int64_t>()[row];
    const std::size_t kv_elem = kv_dtype == DType::kBF16 ? 2 : 1;
    const std::size_t index_elem = index_dtype == DType::kBF16 ? 2 : 1;
    auto cache_value = [](const HostTensor& t, int64_t i, float scale) {
      return t.dtype() == DType::kBF16 ? bf16_to_float(t.ptr<uint16_t>()[i])
                                       : fp8e4m3_to_float(t.ptr<uint8_t>()[i]) * scale;
    };
    if (slot >= 0) {
      const int64_t page = slot / cfg.block_size, off = slot % cfg.block_size;
      for (int h = 0; h < cfg.kv_heads; ++h) {
        const int64_t k_base =
            (((page * cfg.kv_heads + h) * 2 + 0) * cfg.block_size + off) * cfg.head_dim;
        const int64_t v_base = k_base + int64_t{cfg.block_size} * cfg.head_dim;
        const auto want =
            oracle_head(in + k_at + h * cfg.head_dim, w.k_norm, cfg.head_dim, cfg, pos, normed);
        expect_head_close(
            want, normed, cfg.rope_dim,
            [&](int i) { return cache_value(c.kv_cache, k_base + i, k_scale); },
            kv_dtype == DType::kBF16 ? 0.0 : fp8_rel,
            kv_dtype == DType::kBF16 ? 0.0 : fp8_abs * k_scale,
            where + " k head " + std::to_string(h));
        for (int d = 0; d < cfg.head_dim; ++d) {
          const uint16_t v = in[v_at + h * cfg.head_dim + d];
          if (kv_dtype == DType::kBF16) {
            EXPECT_EQ(c.kv_cache.ptr<uint16_t>()[v_base + d], v) << "v is copied unchanged";
          } else {
            EXPECT_EQ(c.kv_cache.ptr<uint8_t>()[v_base + d],
                      float_to_fp8e4m3(bf16_to_float(v) / v_scale));
          }
        }
        for (int64_t i = 0; i < cfg.head_dim; ++i) {
          for (std::size_t b = 0; b < kv_elem; ++b) {
            kv_written[(k_base + i) * kv_elem + b] = true;
            kv_written[(v_base + i) * kv_elem + b] = true;
          }
        }
      }
    }
    if (islot >= 0) {
      const auto want = oracle_head(in + ik_at, w.index_k_norm, cfg.index_dim, cfg, pos, normed);
      expect_head_close(
          want, normed, cfg.rope_dim,
          [&](int i) { return cache_value(c.index_cache, islot * cfg.index_dim + i, 1.0f); },
          index_dtype == DType::kBF16 ? 0.0 : fp8_rel, index_dtype == DType::kBF16 ? 0.0 : fp8_abs,
          where + " index_k");
      for (int64_t i = 0; i < cfg.index_dim; ++i) {
        for (std::size_t b = 0; b < index_elem; ++b) {
          index_written[(islot * cfg.index_dim + i) * index_elem + b] = true;
        }
      }
    }
  }
  // Nothing outside the written slots changed.
  const std::vector<uint8_t> kv_after = reftest::bytes_of(c.kv_cache);
  const std::vector<uint8_t> index_after = reftest::bytes_of(c.index_cache);
  for (std::size_t i = 0; i < kv_after.size(); ++i) {
    if (!kv_written[i]) {
      ASSERT_EQ(kv_after[i], kv_bytes[i]) << "kv cache byte " << i;
    }
  }
  for (std::size_t i = 0; i < index_after.size(); ++i) {
    if (!index_written[i]) {
      ASSERT_EQ(index_after[i], index_bytes[i]) << "index cache byte " << i;
    }
  }
}

TEST(ReferencePreprocess, MatchesDoubleOracleBf16Caches) {
  check_against_oracle(DType::kBF16, DType::kBF16, 1.0f, 1.0f);
}

TEST(ReferencePreprocess, MatchesDoubleOracleFp8Caches) {
  check_against_oracle(DType::kFP8E4M3, DType::kFP8E4M3, 1.0f, 1.0f);
  check_against_oracle(DType::kFP8E4M3, DType::kFP8E4M3, 0.25f, 4.0f);
}

TEST(ReferencePreprocess, InsertHelpersConvertAndSkipNegativeSlots) {
  CaseSpec spec;
  spec.seq_lens = {8};
  spec.kv_dtype = DType::kFP8E4M3;
  spec.k_scale = 2.0f;
  spec.v_scale = 0.5f;
  Case c = make_case(spec);
  const int hd = c.config.head_dim;
  std::vector<float> k(hd), v(hd);
  for (int d = 0; d < hd; ++d) {
    k[d] = 0.3f * d - 1.0f;
    v[d] = 1000.0f;  // saturates: 1000 / 0.5 > 448
  }
  KVCache kv = c.kv_cache_view();
  const auto before = reftest::bytes_of(c.kv_cache);
  cpu::insert_kv(kv, -1, 0, k.data(), v.data(), hd);
  EXPECT_EQ(reftest::bytes_of(c.kv_cache), before);
  cpu::insert_kv(kv, 3, 1, k.data(), v.data(), hd);
  const int64_t page = 0, off = 3;  // slot 3 lies in page 0
  const int64_t k_base = (((page * 2 + 1) * 2 + 0) * 8 + off) * hd;
  const int64_t v_base = (((page * 2 + 1) * 2 + 1) * 8 + off) * hd;
  for (int d = 0; d < hd; ++d) {
    EXPECT_EQ(c.kv_cache.ptr<uint8_t>()[k_base + d], float_to_fp8e4m3(k[d] / 2.0f));
    EXPECT_EQ(c.kv_cache.ptr<uint8_t>()[v_base + d], 0x7E);
  }
  IndexCache index = c.index_cache_view();
  std::vector<float> ik(c.config.index_dim, 1.5f);
  cpu::insert_index_k(index, 9, ik.data(), c.config.index_dim);
  for (int d = 0; d < c.config.index_dim; ++d) {
    EXPECT_EQ(c.index_cache.ptr<uint16_t>()[9 * c.config.index_dim + d], float_to_bf16(1.5f));
  }
  const int64_t past = c.index_cache.shape()[0] * c.config.block_size;
  EXPECT_THROW(cpu::insert_index_k(index, past, ik.data(), c.config.index_dim), Error);
  EXPECT_THROW(cpu::insert_kv(kv, 0, 2, k.data(), v.data(), hd), Error);
}

// ---- Chunked prefill == token-by-token decode ----

// Step-local batch tensors around shared tables.
struct Step {
  HostTensor seq_lens, cu, context, slots, index_slots, positions, qkv;
  BatchMeta batch;
};

struct Record {
  std::vector<int32_t> topk;
  std::vector<uint16_t> out, q_out, index_q_out;
};

// Runs preprocess -> select -> attend on one step and records every live row by (req, pos).
void run_step(const SparseConfig& cfg, Step& s, const Weights& w, const Case& tables, KVCache kv,
              IndexCache index, const std::vector<std::pair<int, int64_t>>& row_ids,
              std::map<std::pair<int, int64_t>, Record>& records, int threads) {
  const int64_t rows = s.batch.num_rows();
  const Outputs o = new_outputs(cfg, rows);
  s.batch.index_block_table = tables.index_table.view();
  s.batch.kv_block_table = tables.kv_table.view();
  s.batch.slot_mapping = s.slots.view();
  s.batch.index_slot_mapping = s.index_slots.view();
  cpu::preprocess(cfg, make_args(s.qkv, w, s.positions, s.batch, kv, index, o), threads);
  HostTensor topk(DType::kI32, {rows, cfg.index_heads, cfg.topk});
  IndexerArgs ia;
  ia.index_q = o.index_q_out.view();
  ia.index_cache = index;
  ia.batch = s.batch;
  ia.topk_idx = topk.view();
  cpu::select_topk(cfg, ia, threads);
  HostTensor out(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
  AttentionArgs aa;
  aa.q = o.q_out.view();
  aa.kv_cache = kv;
  aa.batch = s.batch;
  aa.topk_idx = topk.view();
  aa.out = out.view();
  cpu::sparse_attention(cfg, aa, threads);
  const int64_t sel = int64_t{cfg.index_heads} * cfg.topk;
  const int64_t q_elems = int64_t{cfg.q_heads} * cfg.head_dim;
  const int64_t iq_elems = int64_t{cfg.index_heads} * cfg.index_dim;
  for (int64_t row = 0; row < rows; ++row) {
    if (row_ids[row].second < 0) continue;
    Record r;
    r.topk.assign(topk.ptr<int32_t>() + row * sel, topk.ptr<int32_t>() + (row + 1) * sel);
    r.out.assign(out.ptr<uint16_t>() + row * q_elems, out.ptr<uint16_t>() + (row + 1) * q_elems);
    r.q_out.assign(o.q_out.ptr<uint16_t>() + row * q_elems,
                   o.q_out.ptr<uint16_t>() + (row + 1) * q_elems);
    r.index_q_out.assign(o.index_q_out.ptr<uint16_t>() + row * iq_elems,
                         o.index_q_out.ptr<uint16_t>() + (row + 1) * iq_elems);
    ASSERT_TRUE(records.emplace(row_ids[row], std::move(r)).second);
  }
}

TEST(ReferencePreprocess, ChunkedPrefillEqualsTokenByTokenDecode) {
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    SCOPED_TRACE(dtype_name(dtype));
    CaseSpec spec;
    spec.config.topk = 3;
    spec.config.init_blocks = 1;
    spec.seq_lens = {45, 30};
    spec.index_dtype = dtype;
    spec.kv_dtype = dtype;
    spec.k_scale = 0.5f;
    spec.v_scale = 2.0f;
    const Case tables = make_case(spec);  // tables + garbage-filled caches shared by both paths
    const SparseConfig& cfg = tables.config;
    const int bs = cfg.block_size;
    const std::vector<int64_t> lengths = {45, 30};
    Rng rng(21);
    const Weights w = random_weights(cfg, rng);
    std::vector<HostTensor> tokens;  // per request: [length, width]
    for (int64_t len : lengths) tokens.push_back(random_qkv(cfg, len, rng));
    const int64_t width = cfg.qkv_width();
    auto slot_of = [&](const HostTensor& table, int req, int64_t pos) {
      return int64_t{table.ptr<int32_t>()[req * table.shape()[1] + pos / bs]} * bs + pos % bs;
    };
    auto fill_row = [&](Step& s, int64_t row, int req, int64_t pos) {
      s.positions.ptr<int64_t>()[row] = pos;
      s.slots.ptr<int64_t>()[row] = pos < 0 ? -1 : slot_of(tables.kv_table, req, pos);
      s.index_slots.ptr<int64_t>()[row] = pos < 0 ? -1 : slot_of(tables.index_table, req, pos);
      for (int64_t i = 0; i < width; ++i) {
        s.qkv.ptr<uint16_t>()[row * width + i] =
            pos < 0 ? 0 : tokens[req].ptr<uint16_t>()[pos * width + i];
      }
    };
    auto new_step = [&](int64_t rows) {
      Step s;
      s.slots = HostTensor(DType::kI64, {rows});
      s.index_slots = HostTensor(DType::kI64, {rows});
      s.positions = HostTensor(DType::kI64, {rows});
      s.qkv = HostTensor(DType::kBF16, {rows, width});
      return s;
    };

    // Path A: decode one token per step; a finished request becomes a padding request.
    HostTensor kv_a(tables.kv_cache.dtype(), tables.kv_cache.shape());
    HostTensor index_a(tables.index_cache.dtype(), tables.index_cache.shape());
    std::memcpy(kv_a.data(), tables.kv_cache.data(), kv_a.nbytes());
    std::memcpy(index_a.data(), tables.index_cache.data(), index_a.nbytes());
    std::map<std::pair<int, int64_t>, Record> decoded;
    for (int64_t t = 0; t < 45; ++t) {
      Step s = new_step(2);
      s.seq_lens = HostTensor(DType::kI32, {2});
      std::vector<std::pair<int, int64_t>> ids;
      for (int r = 0; r < 2; ++r) {
        const bool live = t < lengths[r];
        s.seq_lens.ptr<int32_t>()[r] = live ? static_cast<int32_t>(t + 1) : 0;
        fill_row(s, r, r, live ? t : -1);
        ids.emplace_back(r, live ? t : -1);
      }
      s.batch.kind = BatchKind::kDecode;
      s.batch.num_reqs = 2;
      s.batch.q_len = 1;
      s.batch.seq_lens = s.seq_lens.view();
      run_step(cfg, s, w, tables, {kv_a.view(), 0.5f, 2.0f}, {index_a.view()}, ids, decoded, 1);
    }

    // Path B: prefill in three chunks of different shapes per request (one chunk empty).
    HostTensor kv_b(tables.kv_cache.dtype(), tables.kv_cache.shape());
    HostTensor index_b(tables.index_cache.dtype(), tables.index_cache.shape());
    std::memcpy(kv_b.data(), tables.kv_cache.data(), kv_b.nbytes());
    std::memcpy(index_b.data(), tables.index_cache.data(), index_b.nbytes());
    const std::vector<std::vector<int64_t>> chunks = {{20, 7}, {17, 0}, {8, 23}};
    std::map<std::pair<int, int64_t>, Record> prefilled;
    std::vector<int64_t> done = {0, 0};
    for (const std::vector<int64_t>& chunk : chunks) {
      Step s = new_step(chunk[0] + chunk[1]);
      s.cu = HostTensor(DType::kI32, {3});
      s.context = HostTensor(DType::kI32, {2});
      s.cu.ptr<int32_t>()[0] = 0;
      std::vector<std::pair<int, int64_t>> ids;
      int64_t row = 0;
      for (int r = 0; r < 2; ++r) {
        s.context.ptr<int32_t>()[r] = static_cast<int32_t>(done[r]);
        s.cu.ptr<int32_t>()[r + 1] = static_cast<int32_t>(s.cu.ptr<int32_t>()[r] + chunk[r]);
        for (int64_t i = 0; i < chunk[r]; ++i, ++row) {
          fill_row(s, row, r, done[r] + i);
          ids.emplace_back(r, done[r] + i);
        }
        done[r] += chunk[r];
      }
      s.batch.kind = BatchKind::kPrefill;
      s.batch.num_reqs = 2;
      s.batch.num_tokens = row;
      s.batch.cu_seqlens_q = s.cu.view();
      s.batch.context_lens = s.context.view();
      run_step(cfg, s, w, tables, {kv_b.view(), 0.5f, 2.0f}, {index_b.view()}, ids, prefilled, 2);
    }

    ASSERT_EQ(decoded.size(), 75u);
    ASSERT_EQ(prefilled.size(), 75u);
    for (const auto& [id, want] : decoded) {
      const Record& got = prefilled.at(id);
      SCOPED_TRACE(testing::Message() << "request " << id.first << " position " << id.second);
      EXPECT_EQ(got.topk, want.topk);
      EXPECT_EQ(got.out, want.out);
      EXPECT_EQ(got.q_out, want.q_out);
      EXPECT_EQ(got.index_q_out, want.index_q_out);
    }
    EXPECT_EQ(reftest::bytes_of(kv_a), reftest::bytes_of(kv_b));
    EXPECT_EQ(reftest::bytes_of(index_a), reftest::bytes_of(index_b));
    // The selection must have been a real choice somewhere (nb > k for late tokens).
    EXPECT_NE(decoded.at({0, 44}).topk[3 - 1], -1);
  }
}

}  // namespace
}  // namespace m3msa
