// The test kit itself (m3msa/testing): its random streams are pinned (tests, the demo and the
// benchmarks compare against values drawn from them), and its comparison rules accept what they
// should and catch what they should.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "m3msa/cpu_reference.h"
#include "m3msa/dtype.h"
#include "m3msa/sort_key.h"
#include "m3msa/synthetic.h"
#include "m3msa/testing/checks.h"
#include "m3msa/testing/random.h"
#include "m3msa/testing/splitmix.h"

namespace m3msa {
namespace {

TEST(TestKit, RandomStreamsArePinned) {
  // splitmix64's reference outputs for state 0, then the kit's derived draws.
  testkit::SplitMix64 zero(0);
  EXPECT_EQ(zero.next(), 0xE220A8397B1DCDAFull);
  EXPECT_EQ(zero.next(), 0x6E789E6AA1B965F4ull);
  EXPECT_EQ(zero.next(), 0x06C45D188009454Full);
  testkit::SplitMix64 one(1);
  EXPECT_EQ(one.next(), 0x910A2DEC89025CC1ull);
  EXPECT_EQ(one.next(), 0xBEEB8DA1658EEC67ull);
  EXPECT_EQ(testkit::derive_seed(1, 2, 3), 0xA236022F19FE209Eull);
  EXPECT_EQ(testkit::derive_seed(5, 7), 0xAD1041CFF643254Bull);
  EXPECT_EQ(testkit::hashed_unit(123, 0), static_cast<float>(0.4129824435274134));
  EXPECT_EQ(testkit::hashed_unit(123, 45), static_cast<float>(0.09255067605365497));
  EXPECT_EQ(testkit::page_permutation(8, 3), (std::vector<int32_t>{7, 0, 1, 4, 2, 6, 3, 5}));
  // A salted stream is the plain stream of the salted seed.
  testkit::SaltedRng<7> salted(11);
  testkit::SplitMix64 plain(11 * testkit::SplitMix64::kGolden + 7);
  EXPECT_EQ(salted.next(), plain.next());
}

TEST(TestKit, NearTieIsRelativeToTheKthScoreAboveOne) {
  EXPECT_TRUE(testkit::near_tie(1.0005, 1.0));
  EXPECT_FALSE(testkit::near_tie(1.002, 1.0));
  EXPECT_TRUE(testkit::near_tie(0.0009, 0.0));  // below 1 the tolerance is absolute
  EXPECT_TRUE(testkit::near_tie(2001.5, 2000.0));
  EXPECT_FALSE(testkit::near_tie(2003.0, 2000.0));
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_FALSE(testkit::near_tie(nan, 1.0));
  EXPECT_FALSE(testkit::near_tie(1.0, nan));
}

HostTensor bf16_filled(std::vector<int64_t> shape, float value) {
  HostTensor t(DType::kBF16, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<uint16_t>()[i] = float_to_bf16(value);
  return t;
}

TEST(TestKit, CompareValuesMeasuresUlpsOfTheDtype) {
  const HostTensor want = bf16_filled({2, 3}, 1.0f);
  HostTensor got = bf16_filled({2, 3}, 1.0f);
  got.ptr<uint16_t>()[4] = float_to_bf16(1.0078125f);  // one bf16 ulp above 1
  const testkit::CheckResult loose = testkit::compare_values("x", got.view(), want.view(), 2.0);
  EXPECT_TRUE(loose.passed()) << loose.detail;
  EXPECT_EQ(loose.checked, 6);
  EXPECT_EQ(loose.worst, 1.0);
  const testkit::CheckResult tight = testkit::compare_values("x", got.view(), want.view(), 0.5);
  EXPECT_EQ(tight.failed, 1);
  EXPECT_NE(tight.detail.find("[1, 1]"), std::string::npos) << tight.detail;
  const testkit::CheckResult exact = testkit::compare_exact("x", got.view(), want.view());
  EXPECT_EQ(exact.failed, 1);
  EXPECT_NE(exact.detail.find("first mismatch at [1, 1]"), std::string::npos) << exact.detail;
}

TEST(TestKit, CompareCloseFailsBeyondTheToleranceAndOnNonFinite) {
  const std::vector<uint16_t> want(4, float_to_bf16(1.0f));
  std::vector<uint16_t> got = want;
  got[1] = float_to_bf16(1.0078125f);
  testkit::ValueCheck within;
  testkit::compare_close(within, got, want, 2, 2, 1.0 / 64, 1.0 / 32, {}, "within");
  EXPECT_EQ(within.bad, 0) << within.first;
  EXPECT_EQ(within.differ, 1);
  EXPECT_EQ(within.checked, 4);
  got[2] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  testkit::ValueCheck nan;
  testkit::compare_close(nan, got, want, 2, 2, 1.0 / 64, 1.0 / 32, {}, "nan");
  EXPECT_EQ(nan.bad, 1);
  EXPECT_NE(nan.first.find("nan [row 1, col 0]"), std::string::npos) << nan.first;
  testkit::ValueCheck skipped;  // the row holding the NaN left out
  testkit::compare_close(skipped, got, want, 2, 2, 1.0 / 64, 1.0 / 32, {false, true}, "skipped");
  EXPECT_EQ(skipped.bad, 0);
  EXPECT_EQ(skipped.checked, 2);
}

SyntheticCase small_case() {
  SyntheticSpec spec;
  spec.config.q_heads = 4;
  spec.config.kv_heads = 2;
  spec.config.index_heads = 2;
  spec.config.head_dim = 16;
  spec.config.index_dim = 16;
  spec.config.block_size = 8;
  spec.config.topk = 4;
  spec.config.rope_dim = 8;
  spec.num_reqs = 3;
  spec.q_len = 2;
  spec.min_context = 2;
  spec.max_context = 120;
  spec.make_kv_cache = false;
  spec.seed = 17;
  return make_synthetic_case(spec);
}

// The CPU reference's selection passes every selection rule of the kit; a list with a block far
// from the k-th score swapped in fails them.
TEST(TestKit, SelectionRulesAcceptTheReferenceAndCatchAFarSwap) {
  const SyntheticCase c = small_case();
  const SparseConfig& cfg = c.config;
  const int64_t rows = c.num_rows();
  const int64_t cols = c.index_block_table.shape()[1];
  HostTensor topk(DType::kI32, {rows, cfg.index_heads, cfg.topk});
  cpu::select_topk(cfg, c.indexer_args(topk.view()));
  HostTensor scores(DType::kF32, {rows, cfg.index_heads, cols});
  cpu::score_blocks(cfg, c.indexer_args(topk.view()), scores.view());

  EXPECT_TRUE(testkit::check_selections_wellformed(cfg, c.batch, topk.view()).passed());
  const testkit::CheckResult exact =
      testkit::check_selections_vs_scores(cfg, c.indexer_args(topk.view()), 0.0, 1);
  EXPECT_TRUE(exact.passed()) << exact.detail;
  const std::vector<int32_t> want(topk.ptr<int32_t>(), topk.ptr<int32_t>() + topk.numel());
  std::vector<bool> swapped(static_cast<std::size_t>(rows), false);
  std::string first;
  EXPECT_EQ(testkit::compare_selection_near_tie(cfg, want, want, scores, c.batch, swapped, first),
            0)
      << first;
  for (bool s : swapped) EXPECT_FALSE(s);

  // Swap the k-th (last, non-forced) block of one list for the unselected block whose score is
  // farthest below it.
  const std::vector<RowPosition> positions = row_positions(c.batch);
  std::vector<int32_t> got = want;
  bool changed = false;
  for (int64_t row = 0; row < rows && !changed; ++row) {
    const int64_t nb = visible_blocks(positions[static_cast<std::size_t>(row)].pos, cfg.block_size);
    if (nb <= cfg.topk) continue;
    int32_t* list = got.data() + row * cfg.index_heads * cfg.topk;  // head 0
    const float* s = scores.ptr<float>() + row * cfg.index_heads * cols;
    const int32_t kth = list[cfg.topk - 1];
    int32_t far = -1;
    for (int32_t b = 0; b < nb; ++b) {
      bool selected = false;
      for (int i = 0; i < cfg.topk; ++i) selected = selected || list[i] == b;
      if (!selected && (far < 0 || s[b] < s[far])) far = b;
    }
    if (far < 0 || testkit::near_tie(s[far], s[kth])) continue;
    list[cfg.topk - 1] = far;
    changed = true;
  }
  ASSERT_TRUE(changed) << "the case has no list with a far unselected block";
  HostTensor bad(DType::kI32, topk.shape());
  std::copy(got.begin(), got.end(), bad.ptr<int32_t>());
  EXPECT_TRUE(testkit::check_selections_wellformed(cfg, c.batch, bad.view()).passed());
  EXPECT_EQ(testkit::check_selections_vs_scores(cfg, c.indexer_args(bad.view()), 0.0, 1).failed, 1);
  EXPECT_EQ(testkit::check_selections_vs_scores(cfg, c.indexer_args(bad.view()),
                                                testkit::kSelectionTieTolerance, 1)
                .failed,
            1);
  std::fill(swapped.begin(), swapped.end(), false);
  EXPECT_EQ(testkit::compare_selection_near_tie(cfg, got, want, scores, c.batch, swapped, first),
            1);
}

}  // namespace
}  // namespace m3msa
