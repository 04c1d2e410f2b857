// The NaN rule of docs/spec.md section 4, as scenarios every backend's selection must pass
// (tests/cpu/nan_score_test.cc, tests/cuda/nan_score_gpu_test.cc):
//  - a block with a NaN dot product among the numbers of its visible tokens scores NaN: its key's
//    score image is 0, so it ranks below every numeric block and above "no candidate" (it fills
//    the valid prefix when too few numbers remain, never a -1 in it);
//  - a NaN at a position after the row's own position (later rows of the same request, or the
//    garbage after the sequence in its last page) is masked and changes nothing;
//  - dead rows are all -1.
// The values are built so that every block score is an exact small integer, distinct per head:
// index_q is one-hot (head h reads dimension h) and index_k holds base(b, h) at the even tokens
// of block b and base(b, h) - 1 at the odd ones, 0 in the other dimensions (index_q bf16, or fp8
// beside an fp8 cache). Every dot product is
// then exact in any summation order, so all backends must agree bit for bit, and the expected
// selection is computed here from the rule alone (in double, NaN sticky through the max).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "m3msa/batch.h"
#include "m3msa/config.h"
#include "m3msa/dtype.h"
#include "m3msa/sort_key.h"
#include "m3msa/synthetic.h"
#include "m3msa/tensor.h"

namespace m3msa::nantest {

inline constexpr uint16_t kBf16Nan = 0x7FC0;
inline constexpr uint8_t kFp8Nan = 0x7F;
inline constexpr int kNanDim = 100;  // a dimension no head's query weighs: 0 * NaN is still NaN

// One selection of the whole batch: [rows, H, k] i32 on the host.
using SelectFn = std::function<HostTensor(const SyntheticCase&)>;

// M3's index geometry (the CUDA indexer needs D = 128 and 128-token blocks) with topk 4, so a
// request of 16 blocks leaves 12 numeric blocks out of its selection.
inline SparseConfig nan_config(int local_blocks) {
  SparseConfig config;
  config.q_heads = 4;
  config.kv_heads = 4;
  config.index_heads = 4;
  config.topk = 4;
  config.init_blocks = 0;
  config.local_blocks = local_blocks;
  return config;
}

// Distinct in b for every h (5 is coprime with 16); block 15 is head 0's best.
inline int base_score(int64_t block, int head) {
  return static_cast<int>((5 * block + 3 * head + 4) % 16) - 8;
}

inline int64_t block_of(const SyntheticCase& c, int req, int64_t pos) {
  return c.index_block_table
      .ptr<int32_t>()[req * c.index_block_table.shape()[1] + pos / c.config.block_size];
}

inline int64_t index_element(const SyntheticCase& c, int req, int64_t pos, int dim) {
  const int64_t bs = c.config.block_size;
  return (block_of(c, req, pos) * bs + pos % bs) * c.config.index_dim + dim;
}

inline void set_index_value(SyntheticCase& c, int64_t element, float value) {
  if (c.index_cache.dtype() == DType::kBF16) {
    c.index_cache.ptr<uint16_t>()[element] = float_to_bf16(value);
  } else {
    c.index_cache.ptr<uint8_t>()[element] = float_to_fp8e4m3(value);
  }
}

inline void set_index_nan(SyntheticCase& c, int req, int64_t pos) {
  const int64_t element = index_element(c, req, pos, kNanDim);
  if (c.index_cache.dtype() == DType::kBF16) {
    c.index_cache.ptr<uint16_t>()[element] = kBf16Nan;
  } else {
    c.index_cache.ptr<uint8_t>()[element] = kFp8Nan;
  }
}

// Tokens of request `req` in the cache (its largest row position + 1; 0 for a padding request).
inline int64_t request_length(const SyntheticCase& c, int req) {
  int64_t length = 0;
  for (const RowPosition& where : row_positions(c.batch)) {
    if (where.req == req && where.pos >= 0) length = std::max(length, where.pos + 1);
  }
  return length;
}

// Decode: 3 requests x q_len 2 (lengths 2008, 300 and a padding request); rows 0, 1 at positions
// 2006, 2007 (16 blocks), rows 2, 3 at 298, 299 (3 blocks), rows 4, 5 dead. Prefill: chunks of 3
// and 2 tokens ending at the same lengths.
// `query_dtype` kFP8E4M3 (with an fp8 cache): index_q holds the same one-hot values in fp8.
inline SyntheticCase make_nan_case(DType index_dtype, int local_blocks, BatchKind kind,
                                   DType query_dtype = DType::kBF16) {
  SyntheticSpec spec;
  spec.config = nan_config(local_blocks);
  spec.kind = kind;
  if (kind == BatchKind::kDecode) {
    spec.num_reqs = 3;
    spec.q_len = 2;
    spec.seq_lens = {2008, 300, 0};
  } else {
    spec.num_reqs = 2;
    spec.chunk_lens = {3, 2};
    spec.context_lens = {2005, 298};
  }
  spec.index_dtype = index_dtype;
  spec.make_kv_cache = false;
  spec.seed = 20;
  SyntheticCase c = make_synthetic_case(spec);
  const SparseConfig& cfg = c.config;
  if (query_dtype == DType::kFP8E4M3) c.index_q = HostTensor(DType::kFP8E4M3, c.index_q.shape());
  for (int64_t i = 0; i < c.index_q.numel(); ++i) {
    const int dim = static_cast<int>(i % cfg.index_dim);
    const int head = static_cast<int>((i / cfg.index_dim) % cfg.index_heads);
    const float one_hot = dim == head ? 1.0f : 0.0f;
    if (query_dtype == DType::kFP8E4M3) {
      c.index_q.ptr<uint8_t>()[i] = float_to_fp8e4m3(one_hot);
    } else {
      c.index_q.ptr<uint16_t>()[i] = float_to_bf16(one_hot);
    }
  }
  // The cached tokens of every live request; what lies after them stays random garbage.
  for (int req = 0; req < c.batch.num_reqs; ++req) {
    const int64_t length = request_length(c, req);
    for (int64_t pos = 0; pos < length; ++pos) {
      const int64_t block = pos / cfg.block_size;
      for (int dim = 0; dim < cfg.index_dim; ++dim) {
        const float value =
            dim < cfg.index_heads ? static_cast<float>(base_score(block, dim) - (pos % 2)) : 0.0f;
        set_index_value(c, index_element(c, req, pos, dim), value);
      }
    }
  }
  return c;
}

inline float query_value(const SyntheticCase& c, int64_t element) {
  return c.index_q.dtype() == DType::kBF16 ? bf16_to_float(c.index_q.ptr<uint16_t>()[element])
                                           : fp8e4m3_to_float(c.index_q.ptr<uint8_t>()[element]);
}

inline float index_value(const SyntheticCase& c, int64_t element) {
  return c.index_cache.dtype() == DType::kBF16
             ? bf16_to_float(c.index_cache.ptr<uint16_t>()[element])
             : fp8e4m3_to_float(c.index_cache.ptr<uint8_t>()[element]);
}

// The selection the rule gives, computed from the cache contents alone.
inline std::vector<int32_t> expected_selection(const SyntheticCase& c, int64_t row, int head) {
  const SparseConfig& cfg = c.config;
  std::vector<int32_t> out(static_cast<std::size_t>(cfg.topk), -1);
  const RowPosition where = row_positions(c.batch)[static_cast<std::size_t>(row)];
  if (where.pos < 0) return out;
  const int64_t nb = visible_blocks(where.pos, cfg.block_size);
  const int64_t q0 = (row * cfg.index_heads + head) * cfg.index_dim;
  std::vector<uint64_t> keys;
  for (int64_t b = 0; b < nb; ++b) {
    double best = -std::numeric_limits<double>::infinity();
    const int64_t end = std::min((b + 1) * cfg.block_size, where.pos + 1);
    for (int64_t pos = b * cfg.block_size; pos < end; ++pos) {
      double dot = 0.0;
      for (int d = 0; d < cfg.index_dim; ++d) {
        dot += static_cast<double>(query_value(c, q0 + d)) *
               index_value(c, index_element(c, where.req, pos, d));
      }
      if (std::isnan(best)) break;
      if (std::isnan(dot) || dot > best) best = dot;
    }
    const uint32_t id = static_cast<uint32_t>(b);
    keys.push_back(is_forced_block(b, nb, cfg.init_blocks, cfg.local_blocks)
                       ? forced_key(id)
                       : scored_key(static_cast<float>(best), id));
  }
  std::sort(keys.begin(), keys.end(), std::greater<uint64_t>());
  for (std::size_t i = 0; i < keys.size() && i < out.size(); ++i) out[i] = key_block(keys[i]);
  return out;
}

inline std::vector<int32_t> selection_of(const SyntheticCase& c, const HostTensor& topk,
                                         int64_t row, int head) {
  const int k = c.config.topk;
  const int32_t* p = topk.ptr<int32_t>() + (row * c.config.index_heads + head) * k;
  return {p, p + k};
}

inline bool selects(const std::vector<int32_t>& selection, int64_t block) {
  return std::find(selection.begin(), selection.end(), block) != selection.end();
}

// Every row and head equals the rule's selection; dead rows are all -1.
inline void expect_rule(const SyntheticCase& c, const HostTensor& topk, const char* what) {
  const std::vector<RowPosition> rows = row_positions(c.batch);
  for (int64_t row = 0; row < c.num_rows(); ++row) {
    for (int h = 0; h < c.config.index_heads; ++h) {
      const std::vector<int32_t> got = selection_of(c, topk, row, h);
      EXPECT_EQ(got, expected_selection(c, row, h))
          << what << ": row " << row << " (pos " << rows[static_cast<std::size_t>(row)].pos
          << ") head " << h;
      if (rows[static_cast<std::size_t>(row)].pos < 0) {
        EXPECT_EQ(got, std::vector<int32_t>(got.size(), -1)) << what << ": dead row " << row;
      }
    }
  }
}

// Rows [first, last] of request `req` (request-major rows, decode and prefill alike).
inline std::vector<int64_t> rows_of(const SyntheticCase& c, int req) {
  std::vector<int64_t> out;
  const std::vector<RowPosition> rows = row_positions(c.batch);
  for (std::size_t row = 0; row < rows.size(); ++row) {
    if (rows[row].req == req && rows[row].pos >= 0) out.push_back(static_cast<int64_t>(row));
  }
  return out;
}

// What a check runs, for its failure messages.
inline std::string scenario(const char* what, DType dtype, DType query_dtype, int local_blocks,
                            BatchKind kind) {
  return std::string(what) + ", " + dtype_name(dtype) + ", query " + dtype_name(query_dtype) +
         ", local_blocks " + std::to_string(local_blocks) + ", " +
         (kind == BatchKind::kDecode ? "decode" : "prefill");
}

// A NaN in one odd token of request 0's best scored block (head 0 of its first row): that block
// leaves every selection of request 0 (12 numeric blocks remain for 4 places or fewer). A NaN in
// block 0 of request 1 (3 blocks, k = 4): block 0 takes the last valid place, after the numbers.
inline void check_visible_nan(const SelectFn& select, DType dtype, int local_blocks, BatchKind kind,
                              DType query_dtype = DType::kBF16) {
  SCOPED_TRACE(scenario("visible NaN", dtype, query_dtype, local_blocks, kind));
  SyntheticCase c = make_nan_case(dtype, local_blocks, kind, query_dtype);
  const HostTensor before = select(c);
  expect_rule(c, before, "without NaN");
  const int64_t first_row = rows_of(c, 0).front();
  const std::vector<int32_t> head0 = selection_of(c, before, first_row, 0);
  const int64_t nb0 = visible_blocks(request_length(c, 0) - 1, c.config.block_size);
  int32_t target = -1;
  for (int32_t b : head0) {
    if (b >= 0 && !is_forced_block(b, nb0, c.config.init_blocks, c.config.local_blocks)) {
      target = b;
      break;
    }
  }
  ASSERT_GE(target, 0) << "no scored block selected: the scenario tests nothing";
  set_index_nan(c, 0, int64_t{target} * c.config.block_size + 1);
  set_index_nan(c, 1, 2);
  const HostTensor after = select(c);
  expect_rule(c, after, "NaN in a visible token");
  for (int64_t row : rows_of(c, 0)) {
    for (int h = 0; h < c.config.index_heads; ++h) {
      EXPECT_FALSE(selects(selection_of(c, after, row, h), target))
          << "block " << target << " scores NaN but is still selected: row " << row << " head "
          << h;
    }
  }
  for (int64_t row : rows_of(c, 1)) {
    const int64_t nb = visible_blocks(row_positions(c.batch)[static_cast<std::size_t>(row)].pos,
                                      c.config.block_size);
    ASSERT_LT(nb, c.config.topk);
    for (int h = 0; h < c.config.index_heads; ++h) {
      const std::vector<int32_t> got = selection_of(c, after, row, h);
      EXPECT_EQ(got[static_cast<std::size_t>(nb - 1)], 0)
          << "the NaN block must follow every number and fill the prefix: row " << row << " head "
          << h;
      EXPECT_EQ(got[static_cast<std::size_t>(nb)], -1) << "row " << row << " head " << h;
    }
  }
}

// NaNs after a row's position: in request 0's last token (seen only by its last row) and in the
// garbage after both live requests. Every other row's selection is unchanged; with local_blocks 0
// the own block (head 0's best) leaves the last row's selection only.
inline void check_masked_nan(const SelectFn& select, DType dtype, int local_blocks, BatchKind kind,
                             DType query_dtype = DType::kBF16) {
  SCOPED_TRACE(scenario("masked NaN", dtype, query_dtype, local_blocks, kind));
  SyntheticCase c = make_nan_case(dtype, local_blocks, kind, query_dtype);
  const HostTensor before = select(c);
  expect_rule(c, before, "without NaN");
  const int64_t length0 = request_length(c, 0);
  const int64_t own = (length0 - 1) / c.config.block_size;
  const std::vector<int64_t> rows0 = rows_of(c, 0);
  const int64_t last_row = rows0.back();
  ASSERT_EQ(selection_of(c, before, last_row - 1, 0).front(), own)
      << "the own block must lead head 0 before the NaN: the scenario tests nothing";
  set_index_nan(c, 0, length0 - 1);
  set_index_nan(c, 0, length0 + 3);               // garbage in the last page
  set_index_nan(c, 1, request_length(c, 1) + 5);  // garbage in the last page
  const HostTensor after = select(c);
  expect_rule(c, after, "NaN after the position");
  for (int64_t row = 0; row < c.num_rows(); ++row) {
    if (row == last_row) continue;
    for (int h = 0; h < c.config.index_heads; ++h) {
      EXPECT_EQ(selection_of(c, after, row, h), selection_of(c, before, row, h))
          << "a masked NaN changed row " << row << " head " << h;
    }
  }
  EXPECT_EQ(selects(selection_of(c, after, last_row, 0), own), local_blocks > 0)
      << "the last row sees the NaN: its own block is forced or scores NaN";
}

}  // namespace m3msa::nantest
