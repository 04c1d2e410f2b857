// splitmix64 (Steele, Lea and Flood, 2014): the one seeded generator of the synthetic cases, the
// demo, the tests, the fuzzers and the benchmarks. Each user keeps its own stream of a seed (a
// salt, or the seed as the state); the draws below are shared so equal seeds give equal data
// wherever they are drawn. Header-only and dependency-free: the library's synthetic cases
// (m3msa/synthetic.h) draw from it too.
#pragma once

#include <cstdint>

namespace m3msa::testkit {

struct SplitMix64 {
  static constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
  uint64_t state;

  explicit SplitMix64(uint64_t seed) : state(seed) {}
  // The stream of `seed` for one user among several that share seeds.
  static SplitMix64 salted(uint64_t seed, uint64_t salt) {
    return SplitMix64(seed * kGolden + salt);
  }

  static uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint64_t next() { return mix(state += kGolden); }
  // [0, n) (0 for n <= 0; modulo bias is negligible for the small ranges drawn here).
  int64_t below(int64_t n) {
    return n <= 0 ? 0 : static_cast<int64_t>(next() % static_cast<uint64_t>(n));
  }
  // [0, 1) with 53 random bits.
  double uniform01() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform01(); }
  // [lo, hi], inclusive.
  int64_t range(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1));
  }
  // Uniform over [-sqrt(3), sqrt(3)): zero mean, unit variance.
  float unit_variance() {
    return static_cast<float>((uniform01() * 2.0 - 1.0) * 1.7320508075688772);
  }
  // Uniform over [-1, 1).
  float signed_unit() { return static_cast<float>(uniform01() * 2.0 - 1.0); }
};

// The stream of a suite that salts its seeds with `Salt` (suites sharing seeds stay apart).
template <uint64_t Salt>
struct SaltedRng : SplitMix64 {
  explicit SaltedRng(uint64_t seed) : SplitMix64(salted(seed, Salt)) {}
};

// Counter-based draw: element `i` of stream `stream`, uniform in [-1, 1). Any element of a
// tensor is generated directly, so any slice of it is too.
inline float hashed_unit(uint64_t stream, uint64_t i) {
  const uint64_t z = SplitMix64::mix(stream + (i + 1) * SplitMix64::kGolden);
  return static_cast<float>(static_cast<double>(z >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

}  // namespace m3msa::testkit
