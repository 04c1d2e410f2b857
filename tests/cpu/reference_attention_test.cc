// CPU reference attention: sparse == dense when every block is selected (bit for bit), both
// against a double-precision oracle, and the rows that have no keys.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "m3msa/synthetic.h"
#include "reference_test_util.h"

namespace m3msa {
namespace {

using reftest::Case;
using reftest::CaseSpec;
using reftest::make_case;

HostTensor run_select(const Case& c) {
  HostTensor topk(DType::kI32, {c.rows(), c.config.index_heads, c.config.topk});
  cpu::select_topk(c.config, c.indexer(topk.view()), 2);
  return topk;
}

HostTensor new_out(const Case& c) {
  HostTensor out(DType::kBF16, {c.rows(), c.config.q_heads, c.config.head_dim});
  out.fill_bytes(0xFF);  // bf16 NaN everywhere: every element must be written
  return out;
}

HostTensor run_sparse(const Case& c, const TensorView& topk, int threads = 2) {
  HostTensor out = new_out(c);
  cpu::sparse_attention(c.config, c.attention(topk, out.view()), threads);
  return out;
}

HostTensor run_dense(const Case& c, int threads = 2) {
  HostTensor out = new_out(c);
  cpu::dense_attention(c.config, c.attention({}, out.view()), threads);
  return out;
}

// Tolerance of a bf16 output against the double oracle: half a bf16 ulp of rounding plus the fp32
// logits / exp / accumulation error, bounded by one bf16 ulp (2^-8 relative) plus 1e-4 absolute for
// outputs that cancel to near zero. Dropping or adding a single key moves outputs by ~1e-2, far
// outside this.
void expect_matches_oracle(const Case& c, const HostTensor& out, const HostTensor* topk) {
  const int group = c.config.group_size();
  double worst = 0.0;
  for (int64_t row = 0; row < c.rows(); ++row) {
    for (int g = 0; g < c.config.q_heads; ++g) {
      const int kvh = g / group;
      const int32_t* selection =
          topk ? topk->ptr<int32_t>() + (row * c.config.kv_heads + kvh) * c.config.topk : nullptr;
      const std::vector<int64_t> positions = c.row_pos[row] < 0
                                                 ? std::vector<int64_t>{}
                                                 : reftest::attended_positions(c, row, selection);
      const std::vector<double> want = reftest::oracle_attention(c, row, g, positions);
      for (int d = 0; d < c.config.head_dim; ++d) {
        const float got = bf16_to_float(
            out.ptr<uint16_t>()[(row * c.config.q_heads + g) * c.config.head_dim + d]);
        const double err = std::abs(got - want[d]);
        const double tol = std::ldexp(std::abs(want[d]), -8) + 1e-4;
        worst = std::max(worst, err / tol);
        ASSERT_LE(err, tol) << "row " << row << " (pos " << c.row_pos[row] << ") head " << g
                            << " dim " << d << ": got " << got << ", oracle " << want[d];
      }
    }
  }
  EXPECT_LE(worst, 1.0);
}

struct KvVariant {
  DType dtype;
  float k_scale;
  float v_scale;
};
const KvVariant kKvVariants[] = {
    {DType::kBF16, 1.0f, 1.0f}, {DType::kFP8E4M3, 1.0f, 1.0f}, {DType::kFP8E4M3, 0.5f, 2.0f}};

TEST(ReferenceAttention, SparseEqualsDenseWhenEveryBlockIsSelected) {
  for (const KvVariant& kv : kKvVariants) {
    for (int q_len : {1, 3}) {
      CaseSpec spec;
      spec.kv_dtype = kv.dtype;
      spec.k_scale = kv.k_scale;
      spec.v_scale = kv.v_scale;
      spec.q_len = q_len;
      spec.seq_lens = {3, 7, 20, 32, 0};  // nb <= 4 = k everywhere
      const Case c = make_case(spec);
      SCOPED_TRACE(testing::Message() << dtype_name(kv.dtype) << " scales " << kv.k_scale << "/"
                                      << kv.v_scale << " q_len " << q_len);
      const HostTensor topk = run_select(c);
      const HostTensor sparse = run_sparse(c, topk.view());
      const HostTensor dense = run_dense(c);
      EXPECT_EQ(reftest::bytes_of(sparse), reftest::bytes_of(dense));
      EXPECT_EQ(reftest::bytes_of(run_sparse(c, TensorView{})), reftest::bytes_of(dense))
          << "sparse_attention without topk_idx is dense attention";
      expect_matches_oracle(c, dense, nullptr);
    }
  }
}

TEST(ReferenceAttention, DenseMatchesDoubleOracle) {
  for (const KvVariant& kv : kKvVariants) {
    CaseSpec spec;
    spec.kv_dtype = kv.dtype;
    spec.k_scale = kv.k_scale;
    spec.v_scale = kv.v_scale;
    spec.q_len = 2;
    spec.seq_lens = {2, 50, 200, 0};
    spec.seed = 3;
    const Case c = make_case(spec);
    SCOPED_TRACE(dtype_name(kv.dtype));
    expect_matches_oracle(c, run_dense(c), nullptr);
  }
}

TEST(ReferenceAttention, SparseMatchesDoubleOracleOverSelectedBlocks) {
  for (const KvVariant& kv : kKvVariants) {
    CaseSpec spec;
    spec.kv_dtype = kv.dtype;
    spec.k_scale = kv.k_scale;
    spec.v_scale = kv.v_scale;
    spec.q_len = 4;
    spec.seq_lens = {100, 37, 0, 180};
    spec.seed = 4;
    const Case c = make_case(spec);
    SCOPED_TRACE(dtype_name(kv.dtype));
    const HostTensor topk = run_select(c);
    const HostTensor sparse = run_sparse(c, topk.view());
    expect_matches_oracle(c, sparse, &topk);
    EXPECT_NE(reftest::bytes_of(sparse), reftest::bytes_of(run_dense(c)))
        << "with nb > k the selection must matter";
  }
}

TEST(ReferenceAttention, M3SizedHeads) {
  CaseSpec spec;
  spec.config = SparseConfig{};
  spec.seq_lens = {300, 2100};
  const Case c = make_case(spec);
  const HostTensor topk = run_select(c);
  expect_matches_oracle(c, run_sparse(c, topk.view()), &topk);
}

// The shared generator's cases (shuffled tables with -1 in unused columns, garbage after every
// sequence): with nb <= k everywhere, sparse over the selection is dense, at any thread count.
TEST(ReferenceAttention, SyntheticM3CaseSparseEqualsDense) {
  SyntheticSpec spec;
  spec.num_reqs = 3;
  spec.q_len = 2;
  spec.max_context = 2048;  // nb <= 16 = topk
  spec.padding_reqs = 1;
  spec.kv_dtype = DType::kFP8E4M3;
  spec.k_scale = 0.5f;
  spec.v_scale = 1.5f;
  const SyntheticCase c = make_synthetic_case(spec);
  const SparseConfig& cfg = c.config;
  HostTensor topk(DType::kI32, {c.num_rows(), cfg.index_heads, cfg.topk});
  cpu::select_topk(cfg, c.indexer_args(topk.view()), 3);
  HostTensor sparse(DType::kBF16, {c.num_rows(), cfg.q_heads, cfg.head_dim});
  HostTensor dense(DType::kBF16, {c.num_rows(), cfg.q_heads, cfg.head_dim});
  cpu::sparse_attention(cfg, c.attention_args(topk.view(), sparse.view()), 3);
  cpu::dense_attention(cfg, c.attention_args({}, dense.view()), 1);
  EXPECT_EQ(reftest::bytes_of(sparse), reftest::bytes_of(dense));
}

TEST(ReferenceAttention, SelectionOrderDoesNotMatter) {
  CaseSpec spec;
  spec.q_len = 2;
  spec.seq_lens = {100, 60};
  const Case c = make_case(spec);
  HostTensor topk = run_select(c);
  const auto before = reftest::bytes_of(run_sparse(c, topk.view()));
  const int k = c.config.topk;
  for (int64_t i = 0; i < topk.numel(); i += k) {
    std::reverse(topk.ptr<int32_t>() + i, topk.ptr<int32_t>() + i + k);  // all entries valid
  }
  EXPECT_EQ(reftest::bytes_of(run_sparse(c, topk.view())), before);
}

// An engine that keeps the selection head-major in a buffer of larger capacity ([H, cap, k + 3])
// passes it as a permuted view: the same blocks, the same bits, no copy. A last axis that is not
// contiguous is refused by name.
TEST(ReferenceAttention, StridedSelectionAttendsLikeContiguous) {
  CaseSpec spec;
  spec.q_len = 2;
  spec.seq_lens = {700, 130, 0, 1000};
  const Case c = make_case(spec);
  const HostTensor topk = run_select(c);
  const auto want = reftest::bytes_of(run_sparse(c, topk.view()));

  const int64_t rows = c.rows();
  const int heads = c.config.kv_heads;
  const int k = c.config.topk;
  const int64_t cap = rows + 5;
  const int64_t width = k + 3;
  std::vector<int32_t> buffer(static_cast<std::size_t>(heads * cap * width), 7777);
  for (int64_t row = 0; row < rows; ++row) {
    for (int h = 0; h < heads; ++h) {
      std::copy_n(topk.ptr<const int32_t>() + (row * heads + h) * k, k,
                  buffer.data() + (h * cap + row) * width);
    }
  }
  TensorView view = TensorView::contiguous(buffer.data(), DType::kI32, {rows, heads, k});
  view.strides = {width, cap * width, 1};
  EXPECT_EQ(reftest::bytes_of(run_sparse(c, view)), want);

  view.strides[2] = 2;
  HostTensor out = new_out(c);
  try {
    cpu::sparse_attention(c.config, c.attention(view, out.view()), 1);
    ADD_FAILURE() << "a selection with stride 2 in its last axis was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("topk_idx"), std::string::npos) << e.what();
  }
}

TEST(ReferenceAttention, RowsWithoutKeysGiveZeros) {
  for (const KvVariant& kv : kKvVariants) {
    CaseSpec spec;
    spec.kv_dtype = kv.dtype;
    spec.q_len = 2;
    spec.seq_lens = {0, 40, 0};
    const Case c = make_case(spec);
    HostTensor topk = run_select(c);
    // Request 1, KV head 1 gets an empty selection: its query heads have no keys.
    const int k = c.config.topk;
    for (int64_t row : {2, 3}) {
      std::fill(topk.ptr<int32_t>() + (row * 2 + 1) * k, topk.ptr<int32_t>() + (row * 2 + 2) * k,
                -1);
    }
    const HostTensor sparse = run_sparse(c, topk.view());
    const HostTensor dense = run_dense(c);
    const int64_t per_row = int64_t{c.config.q_heads} * c.config.head_dim;
    for (int64_t row = 0; row < c.rows(); ++row) {
      for (int64_t i = 0; i < per_row; ++i) {
        const bool dead = c.row_pos[row] < 0;
        const bool no_keys = dead || (i >= per_row / 2);  // heads 2, 3 use KV head 1
        if (no_keys) {
          ASSERT_EQ(sparse.ptr<uint16_t>()[row * per_row + i], 0) << "row " << row << " elem " << i;
        }
        if (dead) {
          ASSERT_EQ(dense.ptr<uint16_t>()[row * per_row + i], 0) << row;
        }
        ASSERT_FALSE(std::isnan(bf16_to_float(sparse.ptr<uint16_t>()[row * per_row + i])));
      }
    }
    expect_matches_oracle(c, sparse, &topk);
  }
}

TEST(ReferenceAttention, DeterministicForAnyThreadCount) {
  CaseSpec spec;
  spec.q_len = 3;
  reftest::Rng rng(5);
  for (int r = 0; r < 7; ++r) spec.seq_lens.push_back(r == 2 ? 0 : rng.range(3, 300));
  const Case c = make_case(spec);
  const HostTensor topk = run_select(c);
  const auto sparse1 = reftest::bytes_of(run_sparse(c, topk.view(), 1));
  const auto dense1 = reftest::bytes_of(run_dense(c, 1));
  for (int threads : {2, 5, 0}) {
    EXPECT_EQ(reftest::bytes_of(run_sparse(c, topk.view(), threads)), sparse1) << threads;
    EXPECT_EQ(reftest::bytes_of(run_dense(c, threads)), dense1) << threads;
  }
}

}  // namespace
}  // namespace m3msa
