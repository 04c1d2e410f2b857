// What the environment asks of the GPU suite.
#pragma once

#include <cstdint>
#include <cstdlib>

namespace m3msa {

// M3MSA_TEST_SMALL=1 (set by scripts/gpu_steps/sanitize-all.sh): the suite runs under
// compute-sanitizer, where every kernel is instrumented, so suites that draw large cases draw
// smaller ones (contexts of at most kSmallTestContext tokens, fewer shapes); every check stays.
inline constexpr int64_t kSmallTestContext = 16384;
inline bool test_small() {
  const char* value = std::getenv("M3MSA_TEST_SMALL");
  return value != nullptr && value[0] != '\0' && value[0] != '0';
}

}  // namespace m3msa
