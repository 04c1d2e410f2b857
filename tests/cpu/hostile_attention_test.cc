// Numerical hostility for the CPU reference attention (docs/spec.md sections 5 and 6).
//
// What the tests pin down:
//  - NaN / inf anywhere the selection does not reach (unselected blocks, the tail of the last
//    page after seq_len, pages past a request's last block, unmapped pages) leaves every output
//    bit-identical: those values are never read.
//  - Dead rows write zeros even when every cache value is NaN.
//  - Inside a selected block the values propagate as IEEE arithmetic makes them (documented in
//    docs/reliability.md, section "NaN in a selected block"):
//      NaN in one K element      -> every output element of that row's query-head group is NaN;
//      NaN in V element d        -> element d of that group's outputs is NaN, the others unchanged;
//      +-inf in one K element    -> per query head: logit +inf or NaN (q[d] > 0 or == 0) -> NaN
//                                   outputs; logit -inf (q[d] < 0) -> the token gets weight 0;
//      NaN in q of one head      -> that head's outputs are NaN, the other heads unchanged.
//  - Contexts of exactly 1, 127, 128 and 129 tokens at the M3 block size: sparse == dense bit for
//    bit, and a single visible token returns its V exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <vector>

#include "m3msa/cpu_reference.h"
#include "reference_test_util.h"

namespace m3msa {
namespace {

using reftest::Case;
using reftest::CaseSpec;
using reftest::make_case;

constexpr float kInf = std::numeric_limits<float>::infinity();

HostTensor select(const Case& c) {
  HostTensor topk(DType::kI32, {c.rows(), c.config.index_heads, c.config.topk});
  cpu::select_topk(c.config, c.indexer(topk.view()), 2);
  return topk;
}

HostTensor attend(const Case& c, const HostTensor* topk) {
  HostTensor out(DType::kBF16, {c.rows(), c.config.q_heads, c.config.head_dim});
  out.fill_bytes(0xFF);  // bf16 NaN: every element must be written
  if (topk) {
    cpu::sparse_attention(c.config, c.attention(topk->view(), out.view()), 2);
  } else {
    cpu::dense_attention(c.config, c.attention({}, out.view()), 2);
  }
  return out;
}

float out_at(const Case& c, const HostTensor& out, int64_t row, int g, int d) {
  return bf16_to_float(out.ptr<uint16_t>()[(row * c.config.q_heads + g) * c.config.head_dim + d]);
}

bool same_bits(const HostTensor& a, const HostTensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

// Writes `value` into every K and V element of (logical block b of request req, kv head), or of a
// whole physical page when req < 0.
void poison_block(Case& c, int req, int kvh, int64_t b, float value) {
  for (int t = 0; t < c.config.block_size; ++t) {
    for (int part = 0; part < 2; ++part) {
      for (int d = 0; d < c.config.head_dim; ++d) {
        c.set_kv_raw(req, kvh, part, b * c.config.block_size + t, d, value);
      }
    }
  }
}

// Poisons every KV value no row of the batch may read under `topk` (null: dense attention):
// unselected blocks, the tail of the last page, table columns past the last block and unmapped
// pages. Returns how many values it poisoned.
int64_t poison_unread(Case& c, const HostTensor* topk, float value) {
  const int bs = c.config.block_size;
  const int reqs = c.batch.num_reqs;
  const int64_t columns = c.kv_table.shape()[1];
  int64_t poisoned = 0;
  std::set<int64_t> mapped;
  for (int req = 0; req < reqs; ++req) {
    int64_t end = 0;  // one past the last position of the request
    for (int64_t row = 0; row < c.rows(); ++row) {
      if (c.row_req[row] == req) end = std::max(end, c.row_pos[row] + 1);
    }
    for (int kvh = 0; kvh < c.config.kv_heads; ++kvh) {
      std::set<int64_t> read;  // blocks some row of this request reads for this head
      for (int64_t row = 0; row < c.rows(); ++row) {
        if (c.row_req[row] != req || c.row_pos[row] < 0) continue;
        for (int64_t b = 0; b < c.nb(row); ++b) {
          bool selected = topk == nullptr;
          for (int i = 0; topk && i < c.config.topk; ++i) {
            selected =
                selected ||
                topk->ptr<int32_t>()[(row * c.config.kv_heads + kvh) * c.config.topk + i] == b;
          }
          if (selected) read.insert(b);
        }
      }
      for (int64_t b = 0; b < columns; ++b) {
        mapped.insert(c.kv_table.ptr<int32_t>()[req * columns + b]);
        if (!read.count(b)) {
          poison_block(c, req, kvh, b, value);
          poisoned += int64_t{bs} * 2 * c.config.head_dim;
          continue;
        }
        for (int64_t p = std::max(b * bs, end); p < b * bs + bs; ++p) {  // the tail after seq_len
          for (int part = 0; part < 2; ++part) {
            for (int d = 0; d < c.config.head_dim; ++d) c.set_kv_raw(req, kvh, part, p, d, value);
          }
          poisoned += 2 * c.config.head_dim;
        }
      }
    }
  }
  // Pages no table maps: write through the raw layout.
  const int64_t page_elems = int64_t{c.config.kv_heads} * 2 * bs * c.config.head_dim;
  for (int64_t page = 0; page < c.kv_cache.shape()[0]; ++page) {
    if (mapped.count(page)) continue;
    for (int64_t i = page * page_elems; i < (page + 1) * page_elems; ++i) {
      if (c.kv_cache.dtype() == DType::kBF16) {
        c.kv_cache.ptr<uint16_t>()[i] = float_to_bf16(value);
      } else {
        c.kv_cache.ptr<uint8_t>()[i] = float_to_fp8e4m3(value);
      }
    }
    poisoned += page_elems;
  }
  return poisoned;
}

TEST(HostileAttention, NanAndInfWhereTheSelectionDoesNotReachChangeNothing) {
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    for (float poison : {std::nanf(""), kInf, -kInf}) {
      SCOPED_TRACE(testing::Message() << dtype_name(dtype) << " poison " << poison);
      CaseSpec spec;
      spec.kv_dtype = dtype;
      spec.q_len = 2;
      spec.seq_lens = {100, 61, 30, 0};
      spec.extra_pages = 3;
      Case c = make_case(spec);
      const HostTensor topk = select(c);
      const HostTensor before = attend(c, &topk);
      ASSERT_GT(poison_unread(c, &topk, poison), 0);
      const HostTensor after = attend(c, &topk);
      EXPECT_TRUE(same_bits(before, after));
    }
  }
}

TEST(HostileAttention, DenseAttentionNeverReadsPastTheSequence) {
  CaseSpec spec;
  spec.q_len = 3;
  spec.seq_lens = {45, 13, 3};
  Case c = make_case(spec);
  const HostTensor before = attend(c, nullptr);
  ASSERT_GT(poison_unread(c, nullptr, std::nanf("")), 0);
  EXPECT_TRUE(same_bits(before, attend(c, nullptr)));
}

TEST(HostileAttention, DeadRowsWriteZerosOverAllNanCaches) {
  CaseSpec spec;
  spec.seq_lens = {0, 20, 0};
  Case c = make_case(spec);
  c.kv_cache.fill_bytes(0xFF);  // NaN in bf16 and in fp8 alike
  const HostTensor topk = select(c);
  const HostTensor out = attend(c, &topk);
  for (int64_t row : {0, 2}) {
    for (int g = 0; g < c.config.q_heads; ++g) {
      for (int d = 0; d < c.config.head_dim; ++d) {
        EXPECT_EQ(float_bits(out_at(c, out, row, g, d)), 0u) << row << " " << g << " " << d;
      }
    }
  }
}

// Row 0 of a one-request batch at position 20 (blocks 0..2, all selected with k = 4): a token in
// the own block is read by every head of the row.
Case one_row_case(DType dtype) {
  CaseSpec spec;
  spec.kv_dtype = dtype;
  spec.seq_lens = {21};
  return make_case(spec);
}

TEST(HostileAttention, NanInOneSelectedKeyMakesItsGroupNan) {
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    Case c = one_row_case(dtype);
    const HostTensor topk = select(c);
    const HostTensor before = attend(c, &topk);
    c.set_kv_raw(0, /*kvh=*/0, /*part=*/0, /*pos=*/17, /*d=*/5, std::nanf(""));
    const HostTensor after = attend(c, &topk);
    const int group = c.config.group_size();
    for (int g = 0; g < c.config.q_heads; ++g) {
      for (int d = 0; d < c.config.head_dim; ++d) {
        if (g < group) {
          EXPECT_TRUE(std::isnan(out_at(c, after, 0, g, d))) << g << " " << d;
        } else {
          EXPECT_EQ(float_bits(out_at(c, after, 0, g, d)), float_bits(out_at(c, before, 0, g, d)));
        }
      }
    }
  }
}

TEST(HostileAttention, NanInOneSelectedValueOnlyReachesItsDimension) {
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    Case c = one_row_case(dtype);
    const HostTensor topk = select(c);
    const HostTensor before = attend(c, &topk);
    c.set_kv_raw(0, /*kvh=*/1, /*part=*/1, /*pos=*/3, /*d=*/7, std::nanf(""));
    const HostTensor after = attend(c, &topk);
    const int group = c.config.group_size();
    for (int g = 0; g < c.config.q_heads; ++g) {
      for (int d = 0; d < c.config.head_dim; ++d) {
        if (g / group == 1 && d == 7) {
          EXPECT_TRUE(std::isnan(out_at(c, after, 0, g, d)));
        } else {
          EXPECT_EQ(float_bits(out_at(c, after, 0, g, d)), float_bits(out_at(c, before, 0, g, d)))
              << g << " " << d;
        }
      }
    }
  }
}

TEST(HostileAttention, InfInOneSelectedKeyNanOrDropsTheTokenPerHead) {
  Case c = one_row_case(DType::kBF16);
  const HostTensor topk = select(c);
  const int pos = 9, dim = 2;
  c.set_kv_raw(0, 0, 0, pos, dim, kInf);
  const HostTensor out = attend(c, &topk);
  const std::vector<int64_t> all = reftest::attended_positions(c, 0, topk.ptr<int32_t>());
  std::vector<int64_t> without;
  for (int64_t p : all) {
    if (p != pos) without.push_back(p);
  }
  int nan_heads = 0, dropped_heads = 0;
  for (int g = 0; g < c.config.group_size(); ++g) {
    const float q = c.q_at(0, g, dim);
    if (q >= 0) {  // logit +inf (q > 0) or NaN (inf * 0): exp(inf - inf) = NaN
      ++nan_heads;
      for (int d = 0; d < c.config.head_dim; ++d) EXPECT_TRUE(std::isnan(out_at(c, out, 0, g, d)));
    } else {  // logit -inf: weight exp(-inf) = 0, the token is dropped
      ++dropped_heads;
      const std::vector<double> want = reftest::oracle_attention(c, 0, g, without);
      for (int d = 0; d < c.config.head_dim; ++d) {
        EXPECT_NEAR(out_at(c, out, 0, g, d), want[d], std::ldexp(std::abs(want[d]), -8) + 1e-4);
      }
    }
  }
  EXPECT_EQ(nan_heads + dropped_heads, c.config.group_size());
}

TEST(HostileAttention, NanQueryHeadOnlySpoilsItself) {
  Case c = one_row_case(DType::kBF16);
  const HostTensor topk = select(c);
  const HostTensor before = attend(c, &topk);
  c.q.ptr<uint16_t>()[(0 * c.config.q_heads + 1) * c.config.head_dim + 4] = 0x7FC0;  // bf16 NaN
  const HostTensor after = attend(c, &topk);
  for (int g = 0; g < c.config.q_heads; ++g) {
    for (int d = 0; d < c.config.head_dim; ++d) {
      if (g == 1) {
        EXPECT_TRUE(std::isnan(out_at(c, after, 0, g, d)));
      } else {
        EXPECT_EQ(float_bits(out_at(c, after, 0, g, d)), float_bits(out_at(c, before, 0, g, d)));
      }
    }
  }
}

TEST(HostileAttention, ContextsAroundOneBlockSparseEqualsDense) {
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    for (int q_len : {1, 4}) {
      SCOPED_TRACE(testing::Message() << dtype_name(dtype) << " q_len " << q_len);
      CaseSpec spec;
      spec.config = reftest::small_config();
      spec.config.block_size = 128;
      spec.config.topk = 16;
      spec.kv_dtype = dtype;
      spec.q_len = q_len;
      spec.seq_lens = {q_len == 1 ? 1 : 4, 127, 128, 129};
      Case c = make_case(spec);
      // Garbage after each sequence must not matter: make it NaN.
      poison_unread(c, nullptr, std::nanf(""));
      const HostTensor topk = select(c);
      const HostTensor sparse = attend(c, &topk);
      const HostTensor dense = attend(c, nullptr);
      EXPECT_TRUE(same_bits(sparse, dense)) << "nb <= k: sparse must equal dense";
      for (int64_t row = 0; row < c.rows(); ++row) {
        for (int g = 0; g < c.config.q_heads; ++g) {
          for (int d = 0; d < c.config.head_dim; ++d) {
            const float v = out_at(c, sparse, row, g, d);
            ASSERT_TRUE(std::isfinite(v)) << row << " " << g << " " << d;
            if (c.row_pos[row] == 0) {  // one key: softmax weight 1, out = V exactly
              const int kvh = g / c.config.group_size();
              EXPECT_EQ(v, static_cast<float>(c.kv(c.row_req[row], kvh, 1, 0, d)));
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace m3msa
