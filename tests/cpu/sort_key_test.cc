#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "m3msa/sort_key.h"

namespace m3msa {
namespace {

TEST(SortKey, OrderedIsMonotoneOverSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float denorm = std::numeric_limits<float>::denorm_min();
  // Ascending order; -0.0 and +0.0 collapse.
  const float ascending[] = {-inf, -3.5f, -1.0f, -denorm, 0.0f, denorm, 1.0f, 3.5f, inf};
  for (std::size_t i = 0; i + 1 < std::size(ascending); ++i) {
    EXPECT_LT(ordered_score(ascending[i]), ordered_score(ascending[i + 1])) << i;
  }
  EXPECT_EQ(ordered_score(-0.0f), ordered_score(0.0f));
  EXPECT_EQ(ordered_score(std::nanf("")), 0u);
  EXPECT_GT(ordered_score(-inf), 0u);
  EXPECT_LT(ordered_score(inf), kForcedImage);
}

TEST(SortKey, ForcedBeatsEverythingNanBeatsNothing) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_GT(forced_key(100), scored_key(inf, 0));
  EXPECT_LT(scored_key(std::nanf(""), 0), scored_key(-inf, 1000));
  EXPECT_GT(scored_key(std::nanf(""), kMaxBlockId), kNoCandidate);
}

TEST(SortKey, EqualScoresPreferLowerBlock) {
  EXPECT_GT(scored_key(2.0f, 3), scored_key(2.0f, 4));
  EXPECT_GT(forced_key(0), forced_key(1));
  EXPECT_EQ(key_block(scored_key(-7.0f, 12345)), 12345);
  EXPECT_EQ(key_block(with_tag(scored_key(1.0f, 77), 200)), 77);
  EXPECT_EQ(key_tag(with_tag(scored_key(1.0f, 77), 200)), 200u);
}

TEST(SortKey, GenerationTagNeverZero) {
  for (uint32_t g = 0; g < 1000; ++g) {
    EXPECT_GE(generation_tag(g), 1u);
    EXPECT_LE(generation_tag(g), 255u);
  }
  EXPECT_NE(generation_tag(0), generation_tag(1));
}

}  // namespace
}  // namespace m3msa
