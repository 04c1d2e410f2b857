// Numerical hostility for the CPU reference selection (docs/spec.md sections 4 and 6): NaN and inf
// in index queries and index keys (bf16 and fp8 caches), ties everywhere, and contexts of exactly
// 1, 127, 128 and 129 tokens at the M3 block size. The rule under test: whatever the values, every
// (row, head) holds min(k, nb) distinct visible blocks as a prefix, forced blocks first, then the
// order of docs/spec.md section 4 (bigger score first, NaN after -inf, lower id on ties), then -1.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "m3msa/cpu_reference.h"
#include "m3msa/sort_key.h"
#include "reference_test_util.h"

namespace m3msa {
namespace {

using reftest::Case;
using reftest::CaseSpec;
using reftest::make_case;
using reftest::oracle_selection;

constexpr float kInf = std::numeric_limits<float>::infinity();

HostTensor select(const Case& c, int threads = 2) {
  HostTensor topk(DType::kI32, {c.rows(), c.config.index_heads, c.config.topk});
  topk.fill_bytes(0x5A);  // poison: every entry must be written
  cpu::select_topk(c.config, c.indexer(topk.view()), threads);
  return topk;
}

HostTensor scores_of(const Case& c, int64_t max_blocks) {
  HostTensor scores(DType::kF32, {c.rows(), c.config.index_heads, max_blocks});
  cpu::score_blocks(c.config, c.indexer(), scores.view(), 1);
  return scores;
}

std::vector<int32_t> row_of(const Case& c, const HostTensor& topk, int64_t row, int h) {
  const int32_t* p = topk.ptr<int32_t>() + (row * c.config.index_heads + h) * c.config.topk;
  return {p, p + c.config.topk};
}

// The contract of docs/spec.md section 4 that holds for any values: a valid prefix of min(k, nb)
// distinct visible ids, forced blocks first in ascending id order, -1 after.
void expect_valid_prefix(const Case& c, const HostTensor& topk) {
  const int k = c.config.topk;
  for (int64_t row = 0; row < c.rows(); ++row) {
    const int64_t nb = c.nb(row);
    int64_t forced = 0;
    for (int64_t b = 0; b < nb; ++b) {
      forced += is_forced_block(b, nb, c.config.init_blocks, c.config.local_blocks);
    }
    for (int h = 0; h < c.config.index_heads; ++h) {
      const std::vector<int32_t> sel = row_of(c, topk, row, h);
      const int valid = static_cast<int>(std::min<int64_t>(k, nb));
      std::vector<bool> seen(static_cast<std::size_t>(nb), false);
      for (int i = 0; i < k; ++i) {
        SCOPED_TRACE(testing::Message() << "row " << row << " head " << h << " entry " << i);
        if (i >= valid) {
          EXPECT_EQ(sel[i], -1);
          continue;
        }
        ASSERT_GE(sel[i], 0) << "a -1 inside the valid prefix";
        ASSERT_LT(sel[i], nb);
        EXPECT_FALSE(seen[static_cast<std::size_t>(sel[i])]) << "repeated block";
        seen[static_cast<std::size_t>(sel[i])] = true;
        EXPECT_EQ(is_forced_block(sel[i], nb, c.config.init_blocks, c.config.local_blocks),
                  i < forced);
        if (i > 0 && i < forced) {
          EXPECT_LT(sel[i - 1], sel[i]);
        }
      }
    }
  }
}

void expect_matches_oracle(const Case& c, const HostTensor& topk) {
  for (int64_t row = 0; row < c.rows(); ++row) {
    for (int h = 0; h < c.config.index_heads; ++h) {
      EXPECT_EQ(row_of(c, topk, row, h), oracle_selection(c, row, h))
          << "row " << row << " (pos " << c.row_pos[row] << ") head " << h;
    }
  }
}

// Forced blocks in ascending order, then the lowest non-forced ids: the answer when every
// non-forced block has the same key image (all equal, or all NaN).
std::vector<int32_t> ties_everywhere(const SparseConfig& config, int64_t nb) {
  std::vector<int32_t> out;
  for (int64_t b = 0; b < nb; ++b) {
    if (is_forced_block(b, nb, config.init_blocks, config.local_blocks)) out.push_back(b);
  }
  for (int64_t b = 0; b < nb; ++b) {
    if (!is_forced_block(b, nb, config.init_blocks, config.local_blocks)) out.push_back(b);
  }
  out.resize(static_cast<std::size_t>(config.topk), -1);
  return out;
}

void fill_index_cache(Case& c, float value) {
  for (int64_t i = 0; i < c.index_cache.numel(); ++i) {
    if (c.index_cache.dtype() == DType::kBF16) {
      c.index_cache.ptr<uint16_t>()[i] = float_to_bf16(value);
    } else {
      c.index_cache.ptr<uint8_t>()[i] = float_to_fp8e4m3(value);
    }
  }
}

const std::vector<std::pair<int, int>> kForcedSettings = {{0, 1}, {1, 1}, {2, 2}, {0, 0}};

TEST(HostileSelection, AllNanIndexCacheKeepsAFullPrefix) {
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    for (auto [init, local] : kForcedSettings) {
      SCOPED_TRACE(testing::Message()
                   << dtype_name(dtype) << " init " << init << " local " << local);
      CaseSpec spec;
      spec.index_dtype = dtype;
      spec.config.init_blocks = init;
      spec.config.local_blocks = local;
      spec.q_len = 2;
      spec.seq_lens = {100, 17, 9, 2, 0};
      Case c = make_case(spec);
      fill_index_cache(c, std::nanf(""));  // fp8: the NaN code 0x7F
      const HostTensor topk = select(c);
      expect_valid_prefix(c, topk);
      expect_matches_oracle(c, topk);
      for (int64_t row = 0; row < c.rows(); ++row) {
        for (int h = 0; h < c.config.index_heads; ++h) {
          EXPECT_EQ(row_of(c, topk, row, h), ties_everywhere(c.config, c.nb(row))) << row;
        }
      }
    }
  }
}

TEST(HostileSelection, NanQueryRowLosesEveryScoreButOnlyItsOwnRow) {
  CaseSpec spec;
  spec.q_len = 2;
  spec.seq_lens = {100, 60};
  Case c = make_case(spec);
  const HostTensor before = select(c);
  // Row 1 head 0: one NaN dimension makes every dot product NaN.
  c.set_index_q(1, 0, 3, std::nanf(""));
  const HostTensor after = select(c);
  expect_valid_prefix(c, after);
  expect_matches_oracle(c, after);
  EXPECT_EQ(row_of(c, after, 1, 0), ties_everywhere(c.config, c.nb(1)));
  for (int64_t row = 0; row < c.rows(); ++row) {
    for (int h = 0; h < c.config.index_heads; ++h) {
      if (row == 1 && h == 0) continue;
      EXPECT_EQ(row_of(c, after, row, h), row_of(c, before, row, h)) << row << " " << h;
    }
  }
}

TEST(HostileSelection, InfinitiesRankAboveAndBelowNumbersAndNanRanksLast) {
  CaseSpec spec;
  spec.config.topk = 8;
  spec.seq_lens = {8 * 12};  // nb 12, own block 11 forced
  Case c = make_case(spec);
  const int bs = c.config.block_size;
  // Head 0: query +inf in dim 0 and 0 elsewhere, so a block's score is +inf, -inf or NaN by the
  // sign of its keys' dim 0 (inf * 0 = NaN); head 1 keeps finite scores for comparison.
  for (int d = 0; d < c.config.index_dim; ++d) c.set_index_q(0, 0, d, d == 0 ? kInf : 0.0f);
  //                         block: 0   1   2   3   4   5   6   7   8   9  10
  const float dim0_sign[] = {-1, +1, 0, +1, -1, 0, +1, -1, -1, +1, 0};
  for (int b = 0; b < 11; ++b) {
    for (int t = 0; t < bs; ++t) c.set_index_k(0, b * bs + t, 0, dim0_sign[b]);
  }
  // Head 1: an index key of +inf in one token of block 4 makes it +inf if the query's dim is
  // positive there; a -inf key makes block 6 -inf.
  c.set_index_q(0, 1, 1, 1.0f);
  for (int t = 0; t < bs; ++t) {
    c.set_index_k(0, 4 * bs + t, 1, t == 2 ? kInf : 0.5f);
    c.set_index_k(0, 6 * bs + t, 1, -kInf);
  }
  const HostTensor topk = select(c);
  expect_valid_prefix(c, topk);
  expect_matches_oracle(c, topk);
  // Blocks 4 and 6 also carry +-inf in dim 1 (for head 1), which head 0's zero query turns into
  // 0 * inf = NaN: so for head 0, +inf: 1 3 9; -inf: 0 7 8; NaN: 2 4 5 6 10. Forced 11 first,
  // then +inf, then -inf, and the first NaN block fills the last place of the prefix.
  EXPECT_EQ(row_of(c, topk, 0, 0), (std::vector<int32_t>{11, 1, 3, 9, 0, 7, 8, 2}));
  const std::vector<int32_t> head1 = row_of(c, topk, 0, 1);
  EXPECT_EQ(head1[0], 11);
  EXPECT_EQ(head1[1], 4) << "+inf beats every finite score";
  EXPECT_EQ(std::count(head1.begin(), head1.end(), 6), 0) << "-inf loses to finite scores";
  const HostTensor scores = scores_of(c, 12);
  EXPECT_EQ(scores.ptr<float>()[1 * 12 + 4], kInf);
  EXPECT_EQ(scores.ptr<float>()[1 * 12 + 6], -kInf);
}

TEST(HostileSelection, NanBlocksFillTheTailWhenTooFewNumbersRemain) {
  CaseSpec spec;
  spec.config.topk = 6;
  spec.seq_lens = {8 * 7};  // nb 7: 6 candidates besides the own block
  Case c = make_case(spec);
  const int bs = c.config.block_size;
  for (int b : {0, 2, 3, 5}) c.set_index_k(0, b * bs + 1, 0, std::nanf(""));
  const HostTensor topk = select(c);
  expect_valid_prefix(c, topk);
  expect_matches_oracle(c, topk);
  for (int h = 0; h < c.config.index_heads; ++h) {
    const std::vector<int32_t> sel = row_of(c, topk, 0, h);
    EXPECT_EQ(sel[0], 6);
    // Blocks 1 and 4 are the only numbers; the NaN blocks follow in id order: no -1 before them.
    EXPECT_EQ(std::vector<int32_t>(sel.begin() + 3, sel.end()), (std::vector<int32_t>{0, 2, 3}));
  }
}

TEST(HostileSelection, AllEqualScoresPickForcedThenLowestIds) {
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    for (auto [init, local] : kForcedSettings) {
      SCOPED_TRACE(testing::Message()
                   << dtype_name(dtype) << " init " << init << " local " << local);
      CaseSpec spec;
      spec.index_dtype = dtype;
      spec.config.init_blocks = init;
      spec.config.local_blocks = local;
      spec.q_len = 3;
      spec.seq_lens = {200, 40, 8};
      Case c = make_case(spec);
      // Every key the same vector: every row scores every block identically (queries random).
      fill_index_cache(c, 0.75f);
      const HostTensor topk = select(c);
      expect_valid_prefix(c, topk);
      for (int64_t row = 0; row < c.rows(); ++row) {
        for (int h = 0; h < c.config.index_heads; ++h) {
          EXPECT_EQ(row_of(c, topk, row, h), ties_everywhere(c.config, c.nb(row))) << row;
        }
      }
    }
  }
}

// ---- Contexts of exactly 1, 127, 128 and 129 tokens at the M3 block size (128). ----

SparseConfig m3_block_config() {
  SparseConfig c = reftest::small_config();
  c.block_size = 128;
  c.topk = 16;
  return c;
}

TEST(HostileSelection, DecodeContextsAroundOneBlock) {
  for (int q_len : {1, 4}) {
    CaseSpec spec;
    spec.config = m3_block_config();
    spec.q_len = q_len;
    spec.seq_lens = {1, 127, 128, 129};
    if (q_len > 1) spec.seq_lens[0] = 4;  // seq_len must be >= q_len
    const Case c = make_case(spec);
    const HostTensor topk = select(c);
    expect_valid_prefix(c, topk);
    expect_matches_oracle(c, topk);
    std::vector<int32_t> one_block(16, -1), two_blocks(16, -1);
    one_block[0] = 0;
    two_blocks[0] = 1;  // the own block is forced and comes first
    two_blocks[1] = 0;
    for (int64_t row = 0; row < c.rows(); ++row) {
      for (int h = 0; h < c.config.index_heads; ++h) {
        EXPECT_EQ(row_of(c, topk, row, h), c.row_pos[row] < 128 ? one_block : two_blocks)
            << "row " << row << " pos " << c.row_pos[row];
      }
    }
  }
}

TEST(HostileSelection, PrefillChunksCrossingTheFirstBlockBoundary) {
  CaseSpec spec;
  spec.config = m3_block_config();
  spec.config.init_blocks = 1;  // block 0 is forced too: with 2 blocks both are forced
  spec.kind = BatchKind::kPrefill;
  spec.context_lens = {0, 126, 127, 128};
  spec.chunk_lens = {1, 3, 2, 1};  // positions 0 | 126..128 | 127..128 | 128
  const Case c = make_case(spec);
  const HostTensor topk = select(c);
  expect_valid_prefix(c, topk);
  expect_matches_oracle(c, topk);
  for (int64_t row = 0; row < c.rows(); ++row) {
    std::vector<int32_t> expected(16, -1);
    expected[0] = 0;
    if (c.row_pos[row] >= 128) expected[1] = 1;  // forced 0 (init) and 1 (own), ascending
    for (int h = 0; h < c.config.index_heads; ++h) {
      EXPECT_EQ(row_of(c, topk, row, h), expected) << "pos " << c.row_pos[row];
    }
  }
}

}  // namespace
}  // namespace m3msa
