// The scalar conversions every backend shares (dtype.h), checked against values computed here from
// the format definitions: fp8 e4m3 "fn" (bias 7, no inf, S.1111.111 = NaN, max 448) and bf16.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "m3msa/dtype.h"
#include "m3msa/testing/formats.h"

namespace m3msa {
namespace {

bool is_fp8_nan(uint8_t code) {
  return (code & 0x7F) == 0x7F;
}

TEST(ReferenceConversion, Fp8DecodeMatchesDefinitionForAll256Codes) {
  for (int code = 0; code < 256; ++code) {
    const float decoded = fp8e4m3_to_float(static_cast<uint8_t>(code));
    const double expected = testkit::fp8_e4m3_definition(static_cast<uint8_t>(code));
    if (std::isnan(expected)) {
      EXPECT_TRUE(std::isnan(decoded)) << "code " << code;
    } else {
      EXPECT_EQ(decoded, static_cast<float>(expected)) << "code " << code;
      EXPECT_EQ(std::signbit(decoded), (code & 0x80) != 0) << "code " << code;
    }
  }
  EXPECT_EQ(fp8e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(fp8e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(fp8e4m3_to_float(0x08), std::ldexp(1.0f, -6));  // smallest normal
}

TEST(ReferenceConversion, Fp8RoundTripOfAll256Codes) {
  for (int code = 0; code < 256; ++code) {
    const uint8_t c = static_cast<uint8_t>(code);
    const uint8_t back = float_to_fp8e4m3(fp8e4m3_to_float(c));
    if (is_fp8_nan(c)) {
      EXPECT_TRUE(is_fp8_nan(back)) << "code " << code;
    } else {
      EXPECT_EQ(back, c) << "code " << code;  // -0 (0x80) included
    }
  }
}

TEST(ReferenceConversion, Fp8SaturatesAndKeepsNan) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float v : {448.0f, 449.0f, 464.0f, 479.0f, 480.0f, 1e6f, 3e38f, inf}) {
    EXPECT_EQ(float_to_fp8e4m3(v), 0x7E) << v;
    EXPECT_EQ(float_to_fp8e4m3(-v), 0xFE) << -v;
  }
  EXPECT_TRUE(is_fp8_nan(float_to_fp8e4m3(std::nanf(""))));
  EXPECT_TRUE(is_fp8_nan(float_to_fp8e4m3(-std::nanf(""))));
}

// Every midpoint between two adjacent finite codes rounds to the even code; one ulp either side
// rounds to the nearer code. Covers subnormals, the subnormal/normal seam and every binade.
TEST(ReferenceConversion, Fp8RoundsToNearestEvenAtEveryMidpoint) {
  for (int code = 0; code < 0x7E; ++code) {
    const float lo = fp8e4m3_to_float(static_cast<uint8_t>(code));
    const float hi = fp8e4m3_to_float(static_cast<uint8_t>(code + 1));
    const float mid = (lo + hi) / 2.0f;  // exact: both have few mantissa bits
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2.0);
    const uint8_t even =
        (code % 2 == 0) ? static_cast<uint8_t>(code) : static_cast<uint8_t>(code + 1);
    EXPECT_EQ(float_to_fp8e4m3(mid), even) << "midpoint of codes " << code << ", " << code + 1;
    EXPECT_EQ(float_to_fp8e4m3(-mid), even | 0x80) << "negative midpoint of " << code;
    EXPECT_EQ(float_to_fp8e4m3(std::nextafter(mid, 0.0f)), code) << code;
    EXPECT_EQ(float_to_fp8e4m3(std::nextafter(mid, 1e9f)), code + 1) << code;
  }
  // Below half the smallest subnormal everything flushes to (signed) zero; above it, code 1.
  EXPECT_EQ(float_to_fp8e4m3(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(float_to_fp8e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(float_to_fp8e4m3(-std::ldexp(1.0f, -12)), 0x80);
  EXPECT_EQ(float_to_fp8e4m3(std::numeric_limits<float>::denorm_min()), 0x00);
}

TEST(ReferenceConversion, Bf16RoundTripOfAllCodes) {
  for (uint32_t code = 0; code < 0x10000; ++code) {
    const uint16_t c = static_cast<uint16_t>(code);
    const float f = bf16_to_float(c);
    ASSERT_EQ(float_bits(f), code << 16);
    const uint16_t back = float_to_bf16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_float(back))) << code;
      EXPECT_EQ(back & 0x8000, c & 0x8000) << code;
    } else {
      ASSERT_EQ(back, c) << code;
    }
  }
}

TEST(ReferenceConversion, Bf16RoundsToNearestEven) {
  uint64_t state = 12345;
  for (int i = 0; i < 20000; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const uint32_t high = static_cast<uint32_t>(state >> 48) & 0x7F7Fu;  // finite, not max binade
    const uint32_t low = static_cast<uint32_t>(state >> 16) & 0xFFFFu;
    const float f = bits_float((high << 16) | low);
    const uint16_t got = float_to_bf16(f);
    uint16_t expected;
    if (low < 0x8000u) {
      expected = static_cast<uint16_t>(high);
    } else if (low > 0x8000u) {
      expected = static_cast<uint16_t>(high + 1);
    } else {
      expected = static_cast<uint16_t>((high & 1u) ? high + 1 : high);
    }
    ASSERT_EQ(got, expected) << std::hex << "bits " << ((high << 16) | low);
  }
  // Overflow past the largest bf16 rounds to infinity; a NaN with payload only in the low bits
  // stays NaN instead of collapsing to infinity.
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(bits_float(0x7F800001u)))));
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.0f, -8)), float_to_bf16(1.0f));  // tie -> even
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);           // tie -> even (up)
}

}  // namespace
}  // namespace m3msa
