// Seeded random tensors of the test kit, all drawn from splitmix64 (splitmix.h): derived seeds,
// bf16 fills, bf16-exact float vectors and page permutations. The streams are fixed: tests, the
// demo and the benchmarks compare against values drawn from them.
#pragma once

#include <cstdint>
#include <vector>

#include "m3msa/tensor.h"
#include "m3msa/testing/splitmix.h"

namespace m3msa::testkit {

// A seed for stream `a`, `b` of `seed` (distinct streams never share a sequence).
uint64_t derive_seed(uint64_t seed, uint64_t a, uint64_t b = 0);

// Fills a bf16 tensor with unit-variance values (SplitMix64::unit_variance) times `scale`.
void fill_bf16(HostTensor& tensor, uint64_t seed, float scale = 1.0f);

// n bf16-exact values, uniform in [-scale, scale) (SplitMix64::signed_unit).
std::vector<float> random_values(SplitMix64& rng, std::size_t n, float scale);

// A bf16 tensor of `shape` holding `values` (rounded to bf16).
HostTensor bf16_tensor(const std::vector<float>& values, std::vector<int64_t> shape);

// The values of a bf16 tensor as floats.
std::vector<float> to_floats(const HostTensor& tensor);

// A uniform shuffle of [0, pages) (Fisher-Yates from the top, SplitMix64(seed)).
std::vector<int32_t> page_permutation(int64_t pages, uint64_t seed);

}  // namespace m3msa::testkit
