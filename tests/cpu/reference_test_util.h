// Small hand-built cases and plain brute-force oracles for the CPU reference tests. The oracles
// are written straight from docs/spec.md (sorting candidates with std::sort and a comparator,
// softmax in double) and share no code with src/cpu, so a bug in the reference cannot hide in both.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "m3msa/batch.h"
#include "m3msa/cache.h"
#include "m3msa/config.h"
#include "m3msa/dtype.h"
#include "m3msa/ops.h"
#include "m3msa/tensor.h"
#include "m3msa/testing/splitmix.h"

namespace m3msa::reftest {

// splitmix64 (the test kit's): deterministic, seedable, no dependence on the standard library's
// distributions.
using Rng = testkit::SaltedRng<1>;

// Small enough to brute-force, big enough for many blocks per sequence and a real GQA group.
inline SparseConfig small_config() {
  SparseConfig c;
  c.q_heads = 4;
  c.kv_heads = 2;
  c.index_heads = 2;
  c.head_dim = 16;
  c.index_dim = 16;
  c.block_size = 8;
  c.topk = 4;
  c.init_blocks = 0;
  c.local_blocks = 1;
  c.rope_dim = 8;
  return c;
}

inline void fill_random(HostTensor& t, Rng& rng, double scale) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float v = static_cast<float>(rng.uniform(-1.0, 1.0) * scale);
    switch (t.dtype()) {
      case DType::kBF16: t.ptr<uint16_t>()[i] = float_to_bf16(v); break;
      case DType::kFP8E4M3: t.ptr<uint8_t>()[i] = float_to_fp8e4m3(v); break;
      case DType::kF32: t.ptr<float>()[i] = v; break;
      default: FAIL() << "fill_random: unsupported dtype";
    }
  }
}

struct CaseSpec {
  SparseConfig config = small_config();
  BatchKind kind = BatchKind::kDecode;
  int q_len = 1;
  std::vector<int64_t> seq_lens;      // decode: per request, 0 = padding
  std::vector<int64_t> context_lens;  // prefill: cached tokens per request
  std::vector<int64_t> chunk_lens;    // prefill: new tokens per request
  int64_t table_blocks = 0;           // table columns; 0 = just enough
  DType index_dtype = DType::kBF16;
  DType kv_dtype = DType::kBF16;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  int extra_pages = 2;
  bool with_kv_cache = true;  // false: a 0-page KV cache (indexer-only tests at M3 sizes)
  uint64_t seed = 1;
};

// Owns every tensor of one call; `batch` points into them. Caches are random everywhere, including
// the tail of each request's last page, so reading past a sequence changes answers.
struct Case {
  SparseConfig config;
  BatchMeta batch;
  HostTensor seq_lens, cu_seqlens_q, context_lens;
  HostTensor index_table, kv_table, slot_mapping, index_slot_mapping, positions;
  HostTensor index_q, q, index_cache, kv_cache;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  std::vector<int> row_req;
  std::vector<int64_t> row_pos;

  int64_t rows() const { return batch.num_rows(); }
  int64_t nb(int64_t row) const { return visible_blocks(row_pos[row], config.block_size); }
  IndexCache index_cache_view() const { return {index_cache.view()}; }
  KVCache kv_cache_view() const { return {kv_cache.view(), k_scale, v_scale}; }
  IndexerArgs indexer(TensorView topk = {}) const {
    IndexerArgs a;
    a.index_q = index_q.view();
    a.index_cache = index_cache_view();
    a.batch = batch;
    a.topk_idx = topk;
    return a;
  }
  AttentionArgs attention(TensorView topk, TensorView out) const {
    AttentionArgs a;
    a.q = q.view();
    a.kv_cache = kv_cache_view();
    a.batch = batch;
    a.topk_idx = topk;
    a.out = out;
    return a;
  }

  int64_t page(const HostTensor& table, int req, int64_t pos) const {
    return table.ptr<int32_t>()[req * table.shape()[1] + pos / config.block_size];
  }
  int64_t index_offset(int req, int64_t pos, int d) const {
    return (page(index_table, req, pos) * config.block_size + pos % config.block_size) *
               config.index_dim +
           d;
  }
  int64_t kv_offset(int req, int kvh, int part, int64_t pos, int d) const {
    const int64_t p = page(kv_table, req, pos);
    return (((p * config.kv_heads + kvh) * 2 + part) * config.block_size +
            pos % config.block_size) *
               config.head_dim +
           d;
  }
  float index_k(int req, int64_t pos, int d) const {
    const int64_t i = index_offset(req, pos, d);
    return index_cache.dtype() == DType::kBF16 ? bf16_to_float(index_cache.ptr<uint16_t>()[i])
                                               : fp8e4m3_to_float(index_cache.ptr<uint8_t>()[i]);
  }
  void set_index_k(int req, int64_t pos, int d, float v) {
    const int64_t i = index_offset(req, pos, d);
    if (index_cache.dtype() == DType::kBF16) {
      index_cache.ptr<uint16_t>()[i] = float_to_bf16(v);
    } else {
      index_cache.ptr<uint8_t>()[i] = float_to_fp8e4m3(v);
    }
  }
  // The value attention reads: decoded, times the scale for fp8.
  double kv(int req, int kvh, int part, int64_t pos, int d) const {
    const int64_t i = kv_offset(req, kvh, part, pos, d);
    if (kv_cache.dtype() == DType::kBF16) return bf16_to_float(kv_cache.ptr<uint16_t>()[i]);
    return static_cast<double>(fp8e4m3_to_float(kv_cache.ptr<uint8_t>()[i])) *
           (part == 0 ? k_scale : v_scale);
  }
  void set_kv_raw(int req, int kvh, int part, int64_t pos, int d, float stored) {
    const int64_t i = kv_offset(req, kvh, part, pos, d);
    if (kv_cache.dtype() == DType::kBF16) {
      kv_cache.ptr<uint16_t>()[i] = float_to_bf16(stored);
    } else {
      kv_cache.ptr<uint8_t>()[i] = float_to_fp8e4m3(stored);
    }
  }
  float index_q_at(int64_t row, int h, int d) const {
    return bf16_to_float(
        index_q.ptr<uint16_t>()[(row * config.index_heads + h) * config.index_dim + d]);
  }
  void set_index_q(int64_t row, int h, int d, float v) {
    index_q.ptr<uint16_t>()[(row * config.index_heads + h) * config.index_dim + d] =
        float_to_bf16(v);
  }
  float q_at(int64_t row, int g, int d) const {
    return bf16_to_float(q.ptr<uint16_t>()[(row * config.q_heads + g) * config.head_dim + d]);
  }
};

// Builds the case; tables map every request's blocks to distinct shuffled pages, different for the
// two caches, with spare pages nobody maps.
inline Case make_case(const CaseSpec& spec) {
  Case c;
  c.config = spec.config;
  c.k_scale = spec.k_scale;
  c.v_scale = spec.v_scale;
  Rng rng(spec.seed);
  const int bs = spec.config.block_size;
  const bool decode = spec.kind == BatchKind::kDecode;
  const int reqs = static_cast<int>(decode ? spec.seq_lens.size() : spec.chunk_lens.size());
  c.batch.kind = spec.kind;
  c.batch.num_reqs = reqs;
  c.batch.q_len = spec.q_len;
  std::vector<int64_t> end(reqs);
  if (decode) {
    c.seq_lens = HostTensor(DType::kI32, {reqs});
    for (int r = 0; r < reqs; ++r) {
      c.seq_lens.ptr<int32_t>()[r] = static_cast<int32_t>(spec.seq_lens[r]);
      end[r] = spec.seq_lens[r];
      for (int j = 0; j < spec.q_len; ++j) {
        c.row_req.push_back(r);
        c.row_pos.push_back(end[r] == 0 ? -1 : end[r] - spec.q_len + j);
      }
    }
    c.batch.seq_lens = c.seq_lens.view();
  } else {
    c.cu_seqlens_q = HostTensor(DType::kI32, {reqs + 1});
    c.context_lens = HostTensor(DType::kI32, {reqs});
    int32_t* cu = c.cu_seqlens_q.ptr<int32_t>();
    cu[0] = 0;
    for (int r = 0; r < reqs; ++r) {
      c.context_lens.ptr<int32_t>()[r] = static_cast<int32_t>(spec.context_lens[r]);
      cu[r + 1] = cu[r] + static_cast<int32_t>(spec.chunk_lens[r]);
      end[r] = spec.context_lens[r] + spec.chunk_lens[r];
      for (int64_t i = 0; i < spec.chunk_lens[r]; ++i) {
        c.row_req.push_back(r);
        c.row_pos.push_back(spec.context_lens[r] + i);
      }
    }
    c.batch.num_tokens = cu[reqs];
    c.batch.cu_seqlens_q = c.cu_seqlens_q.view();
    c.batch.context_lens = c.context_lens.view();
  }
  int64_t columns = std::max<int64_t>(spec.table_blocks, 1);
  int64_t used = 0;
  for (int r = 0; r < reqs; ++r) {
    columns = std::max(columns, (end[r] + bs - 1) / bs);
  }
  used = columns * reqs;
  const int64_t pages = used + spec.extra_pages;
  auto make_table = [&](HostTensor& table) {
    std::vector<int32_t> order(static_cast<std::size_t>(pages));
    std::iota(order.begin(), order.end(), 0);
    for (int64_t i = pages - 1; i > 0; --i) std::swap(order[i], order[rng.range(0, i)]);
    table = HostTensor(DType::kI32, {reqs, columns});
    for (int64_t i = 0; i < table.numel(); ++i) table.ptr<int32_t>()[i] = order[i];
  };
  make_table(c.index_table);
  make_table(c.kv_table);
  c.batch.index_block_table = c.index_table.view();
  c.batch.kv_block_table = c.kv_table.view();

  const int64_t rows = static_cast<int64_t>(c.row_pos.size());
  c.positions = HostTensor(DType::kI64, {rows});
  c.slot_mapping = HostTensor(DType::kI64, {rows});
  c.index_slot_mapping = HostTensor(DType::kI64, {rows});
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t pos = c.row_pos[row];
    c.positions.ptr<int64_t>()[row] = pos;
    c.slot_mapping.ptr<int64_t>()[row] =
        pos < 0 ? -1 : c.page(c.kv_table, c.row_req[row], pos) * bs + pos % bs;
    c.index_slot_mapping.ptr<int64_t>()[row] =
        pos < 0 ? -1 : c.page(c.index_table, c.row_req[row], pos) * bs + pos % bs;
  }
  c.batch.slot_mapping = c.slot_mapping.view();
  c.batch.index_slot_mapping = c.index_slot_mapping.view();

  const SparseConfig& cfg = spec.config;
  c.index_q = HostTensor(DType::kBF16, {rows, cfg.index_heads, cfg.index_dim});
  c.q = HostTensor(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
  c.index_cache = HostTensor(spec.index_dtype, {pages, bs, cfg.index_dim});
  c.kv_cache = HostTensor(spec.kv_dtype,
                          {spec.with_kv_cache ? pages : 0, cfg.kv_heads, 2, bs, cfg.head_dim});
  fill_random(c.index_q, rng, 1.0);
  fill_random(c.q, rng, 1.0);
  fill_random(c.index_cache, rng, 1.0);
  fill_random(c.kv_cache, rng, 1.0);
  return c;
}

// ---- Oracles written from docs/spec.md ----

// S(row, h, b): fp32 dot products in dimension order, max over the visible tokens; any NaN token
// makes the block NaN.
inline float oracle_score(const Case& c, int64_t row, int h, int64_t b) {
  const int bs = c.config.block_size;
  const int64_t last = std::min<int64_t>(int64_t{bs} * b + bs, c.row_pos[row] + 1);
  float best = -INFINITY;
  bool any_nan = false;
  for (int64_t p = int64_t{bs} * b; p < last; ++p) {
    float dot = 0.0f;
    for (int d = 0; d < c.config.index_dim; ++d) {
      dot += c.index_q_at(row, h, d) * c.index_k(c.row_req[row], p, d);
    }
    if (std::isnan(dot)) any_nan = true;
    if (dot > best) best = dot;
  }
  return any_nan ? NAN : best;
}

// The selection of docs/spec.md section 4 by sorting every visible block with a comparator that
// spells the ranking out: forced first, then numbers (bigger first), then NaN; ties to the lower
// id.
inline std::vector<int32_t> oracle_selection(const Case& c, int64_t row, int h) {
  const int k = c.config.topk;
  std::vector<int32_t> out(static_cast<std::size_t>(k), -1);
  if (c.row_pos[row] < 0) return out;
  const int64_t nb = c.nb(row);
  struct Candidate {
    bool forced;
    float score;
    int32_t block;
  };
  std::vector<Candidate> all;
  for (int64_t b = 0; b < nb; ++b) {
    const bool forced = b < c.config.init_blocks || b >= nb - c.config.local_blocks;
    all.push_back({forced, forced ? 0.0f : oracle_score(c, row, h, b), static_cast<int32_t>(b)});
  }
  std::sort(all.begin(), all.end(), [](const Candidate& x, const Candidate& y) {
    if (x.forced != y.forced) return x.forced;
    if (!x.forced) {
      const bool xn = std::isnan(x.score), yn = std::isnan(y.score);
      if (xn != yn) return !xn;
      if (!xn && x.score != y.score) return x.score > y.score;
    }
    return x.block < y.block;
  });
  for (int i = 0; i < k && i < static_cast<int>(all.size()); ++i) out[i] = all[i].block;
  return out;
}

// Attention of query head g of `row` over `positions`, entirely in double.
inline std::vector<double> oracle_attention(const Case& c, int64_t row, int g,
                                            const std::vector<int64_t>& positions) {
  const int dim = c.config.head_dim;
  const int kvh = g / c.config.group_size();
  const int req = c.row_req[row];
  std::vector<double> out(static_cast<std::size_t>(dim), 0.0);
  if (positions.empty()) return out;
  std::vector<double> logits;
  double max_logit = -INFINITY;
  for (int64_t p : positions) {
    double dot = 0.0;
    for (int d = 0; d < dim; ++d)
      dot += static_cast<double>(c.q_at(row, g, d)) * c.kv(req, kvh, 0, p, d);
    logits.push_back(dot / std::sqrt(static_cast<double>(dim)));
    max_logit = std::max(max_logit, logits.back());
  }
  double sum = 0.0;
  for (std::size_t i = 0; i < positions.size(); ++i) {
    const double w = std::exp(logits[i] - max_logit);
    sum += w;
    for (int d = 0; d < dim; ++d) out[d] += w * c.kv(req, kvh, 1, positions[i], d);
  }
  for (double& v : out) v /= sum;
  return out;
}

// The token positions attended by `row` for KV head h given its selection row (dense when null).
inline std::vector<int64_t> attended_positions(const Case& c, int64_t row,
                                               const int32_t* selection) {
  std::vector<int64_t> positions;
  const int64_t pos = c.row_pos[row];
  for (int64_t p = 0; p <= pos; ++p) {
    if (selection == nullptr) {
      positions.push_back(p);
      continue;
    }
    for (int i = 0; i < c.config.topk; ++i) {
      if (selection[i] == p / c.config.block_size) positions.push_back(p);
    }
  }
  return positions;
}

inline std::vector<uint8_t> bytes_of(const HostTensor& t) {
  const uint8_t* p = static_cast<const uint8_t*>(t.data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

}  // namespace m3msa::reftest
