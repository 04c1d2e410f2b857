// Device building blocks of the indexer, tested directly: the warp top-k (every path: small sort,
// threshold filter, repeated filter, streaming fallback) and the merge kernel's histogram merge
// (every key count it takes, adversarial score images, both output orders) against std::sort, and
// the exact e4m3 -> bf16 widening on all 256 byte values.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/indexer_kernel.cuh"
#include "indexer_test_util.h"
#include "m3msa/dtype.h"
#include "m3msa/sort_key.h"

namespace m3msa::idxtest {
namespace {

__global__ void warp_top_keys_kernel(const uint64_t* keys, int count, int k, uint64_t* out) {
  __shared__ uint64_t scratch[cuda::indexer::kScratch];
  const uint64_t top =
      cuda::indexer::warp_top_keys([&](int i) { return keys[i]; }, count, k, scratch);
  out[threadIdx.x] = top;
}

// merge_by_histogram on one vector by one CTA; accepted[0] says whether it took the keys.
__global__ void histogram_merge_kernel(const uint64_t* keys, int count, int k, int ascending,
                                       int32_t* out, int* accepted) {
  __shared__ __align__(16) uint8_t smem[cuda::indexer::kHistSmemBytes];
  cuda::IndexerParams p;
  p.topk = k;
  p.out_ascending = ascending;
  const bool took = cuda::indexer::merge_by_histogram(p, keys, count, smem, out);
  if (threadIdx.x == 0) accepted[0] = took ? 1 : 0;
}

__global__ void widen_fp8_kernel(uint32_t* out) {
  const uint32_t v = threadIdx.x;  // 0..255 in the low byte, v ^ 0x55 in the high byte
  out[v] = cuda::indexer::e4m3x2_to_bf16x2(v | ((v ^ 0x55u) << 8));
}

std::vector<uint64_t> reference_top(std::vector<uint64_t> keys, int k) {
  keys.erase(std::remove(keys.begin(), keys.end(), uint64_t{0}), keys.end());
  std::sort(keys.begin(), keys.end(), std::greater<uint64_t>());
  keys.resize(32, 0);
  for (int i = k; i < 32; ++i) keys[i] = 0;
  return keys;
}

void check_top(const std::string& name, const std::vector<uint64_t>& keys, int k) {
  cuda::DeviceBuffer d_keys(std::max<size_t>(keys.size(), 1) * 8);
  cuda::DeviceBuffer d_out(32 * 8);
  if (!keys.empty()) {
    CUDA_CHECK(cudaMemcpy(d_keys.data(), keys.data(), keys.size() * 8, cudaMemcpyHostToDevice));
  }
  warp_top_keys_kernel<<<1, 32>>>(d_keys.as<uint64_t>(), static_cast<int>(keys.size()), k,
                                  d_out.as<uint64_t>());
  CUDA_CHECK_LAUNCH();
  std::vector<uint64_t> got(32);
  CUDA_CHECK(cudaMemcpy(got.data(), d_out.data(), 32 * 8, cudaMemcpyDeviceToHost));
  for (int i = k; i < 32; ++i) got[i] = 0;  // lanes >= k are unspecified
  const std::vector<uint64_t> want = reference_top(keys, k);
  for (int i = 0; i < 32; ++i) {
    ASSERT_EQ(got[i], want[i]) << name << ": count " << keys.size() << " k " << k << " rank " << i;
  }
}

TEST(CudaIndexerBlocks, WarpTopKeysMatchesSort) {
  M3MSA_INDEXER_REQUIRE_GPU();
  Rng rng(3);
  auto unique_random = [&](int n, double zero_fraction) {
    std::vector<uint64_t> keys(n);
    for (int i = 0; i < n; ++i) {
      // Distinct low bits (the block id field) make every key unique, as in the kernels.
      keys[i] = (rng.next() & 0xFFFFFFFF00000000ull) | static_cast<uint64_t>(i + 1);
      if (rng.uniform(0, 1) < zero_fraction) keys[i] = 0;
    }
    return keys;
  };
  for (int k : {1, 16, 32}) {
    for (int n : {0, 1, 5, 31, 64, 65, 100, 257, 513, 1000, 1024, 2048, 4224, 9000}) {
      check_top("random", unique_random(n, 0.0), k);
      check_top("random, half empty", unique_random(n, 0.5), k);
      std::vector<uint64_t> up(n), down(n);
      for (int i = 0; i < n; ++i) {
        up[i] = (uint64_t{0x80000000u} + i) << 32 | static_cast<uint64_t>(i + 1);
        down[i] = (uint64_t{0x80000000u} + n - i) << 32 | static_cast<uint64_t>(i + 1);
      }
      check_top("ascending", up, k);
      check_top("descending", down, k);
      // All top keys in one lane's residue class (positions 0 mod 32), 15 medium lane maxima:
      // overflows the filter's scratch for large n and takes the streaming path.
      std::vector<uint64_t> skew(n);
      for (int i = 0; i < n; ++i) {
        const uint64_t image = i % 32 == 0 ? 0xF0000000u + i : (i < 32 ? 0xA0000000u : 0x10000000u);
        skew[i] = image << 32 | static_cast<uint64_t>(i + 1);
      }
      check_top("one hot lane", skew, k);
      // The fused merge's layout: runs of up to k keys sorted descending, one per CTA, laid end to
      // end, here 4 per run (a CTA's 4 blocks at 128K), with levels rising along the context (later
      // blocks score higher), so the last batches hold the answer.
      std::vector<uint64_t> runs(n);
      for (int i = 0; i < n; ++i) {
        const int run = i / 4, rank = i % 4;
        runs[i] = (uint64_t{0x40000000u} + 64u * run - rank) << 32 | static_cast<uint64_t>(i + 1);
      }
      check_top("rising sorted runs", runs, k);
      // Equal scores: order by block id only.
      std::vector<uint64_t> flat(n);
      for (int i = 0; i < n; ++i) flat[i] = make_key(0xC0000000u, static_cast<uint32_t>(i));
      check_top("equal scores", flat, k);
    }
  }
}

// The answer rows the histogram merge must write: the blocks of the k largest keys (descending),
// or with `ascending` the same blocks by ascending id, then -1.
std::vector<int32_t> reference_blocks(std::vector<uint64_t> keys, int k, bool ascending) {
  keys.erase(std::remove(keys.begin(), keys.end(), kNoCandidate), keys.end());
  std::sort(keys.begin(), keys.end(), std::greater<uint64_t>());
  std::vector<int32_t> blocks;
  for (std::size_t i = 0; i < keys.size() && static_cast<int>(i) < k; ++i) {
    blocks.push_back(key_block(keys[i]));
  }
  if (ascending) std::sort(blocks.begin(), blocks.end());
  blocks.resize(static_cast<std::size_t>(k), -1);
  return blocks;
}

// Runs the histogram merge on `keys`; false if it handed over (too many keys reach the boundary
// bin), else the answer must equal the reference in both orders.
bool histogram_merge_matches(const std::string& name, const std::vector<uint64_t>& keys, int k) {
  cuda::DeviceBuffer d_keys(keys.size() * 8);
  cuda::DeviceBuffer d_out(32 * 4);
  cuda::DeviceBuffer d_accepted(4);
  CUDA_CHECK(cudaMemcpy(d_keys.data(), keys.data(), keys.size() * 8, cudaMemcpyHostToDevice));
  bool accepted_any = false;
  for (int ascending : {0, 1}) {
    CUDA_CHECK(cudaMemset(d_out.data(), 0x5A, 32 * 4));  // poison: every entry must be written
    histogram_merge_kernel<<<1, cuda::indexer::kThreads>>>(
        d_keys.as<uint64_t>(), static_cast<int>(keys.size()), k, ascending, d_out.as<int32_t>(),
        d_accepted.as<int>());
    CUDA_CHECK_LAUNCH();
    int accepted = 0;
    CUDA_CHECK(cudaMemcpy(&accepted, d_accepted.data(), 4, cudaMemcpyDeviceToHost));
    if (accepted == 0) continue;
    accepted_any = true;
    std::vector<int32_t> got(32);
    CUDA_CHECK(cudaMemcpy(got.data(), d_out.data(), 32 * 4, cudaMemcpyDeviceToHost));
    const std::vector<int32_t> want = reference_blocks(keys, k, ascending != 0);
    for (int i = 0; i < k; ++i) {
      EXPECT_EQ(got[static_cast<std::size_t>(i)], want[static_cast<std::size_t>(i)])
          << name << ": count " << keys.size() << " k " << k << " ascending " << ascending
          << " entry " << i;
    }
    if (k < 32) {
      EXPECT_EQ(got[static_cast<std::size_t>(k)], 0x5A5A5A5A)
          << name << ": wrote past the answer's k entries";
    }
  }
  return accepted_any;
}

TEST(CudaIndexerBlocks, HistogramMergeMatchesSort) {
  M3MSA_INDEXER_REQUIRE_GPU();
  Rng rng(17);
  // Keys as the kernels make them: a score image, a unique block id; some slots empty (a CTA
  // with fewer blocks than slots pads with kNoCandidate).
  auto keys_of = [&](int n, const std::function<uint32_t(int)>& image, double empty_fraction) {
    std::vector<uint64_t> keys(static_cast<std::size_t>(n));
    for (int i = 0; i < n; ++i) {
      const uint32_t block = static_cast<uint32_t>((i * 7919) % 1000003);
      keys[static_cast<std::size_t>(i)] =
          rng.uniform01() < empty_fraction ? kNoCandidate : make_key(image(i), block);
    }
    return keys;
  };
  auto gauss = [&] {
    const double u = std::max(rng.uniform01(), 1e-12);
    return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * rng.uniform01());
  };
  for (int k : {1, 16, 32}) {
    for (int n : {65, 100, 257, 1000, 1020, 1024, 2047, 2048, 3001, 4080, 4096}) {
      const std::string at = " (n " + std::to_string(n) + ", k " + std::to_string(k) + ")";
      // Uniform images: the boundary bin holds a few keys, so the histogram takes them.
      const bool uniform = histogram_merge_matches(
          "uniform" + at,
          keys_of(
              n, [&](int) { return static_cast<uint32_t>(rng.next()); }, 0.0),
          k);
      if (k <= 16 && n <= 1024) EXPECT_TRUE(uniform) << "uniform images" << at << " handed over";
      // Gaussian scores, both signs, with empty slots, a NaN block and forced blocks.
      histogram_merge_matches("gaussian, NaN, forced" + at,
                              keys_of(
                                  n,
                                  [&](int i) {
                                    if (i == 3) return 0u;                 // NaN: image 0
                                    if (i % 97 == 5) return kForcedImage;  // forced blocks
                                    return ordered_score(static_cast<float>(gauss()));
                                  },
                                  0.25),
                              k);
      // Lognormal scores (a long upper tail) and scores rising with the block.
      histogram_merge_matches(
          "lognormal" + at,
          keys_of(
              n, [&](int) { return ordered_score(static_cast<float>(std::exp(3 * gauss()))); },
              0.0),
          k);
      histogram_merge_matches(
          "rising" + at,
          keys_of(
              n, [&](int i) { return ordered_score(0.5f * static_cast<float>(i)); }, 0.0),
          k);
      // One outlier far above scores packed into a sliver of the range; -inf and +inf scores.
      histogram_merge_matches("outlier" + at,
                              keys_of(
                                  n,
                                  [&](int i) {
                                    if (i == n / 2) return ordered_score(1e30f);
                                    return ordered_score(1.0f + 1e-3f * static_cast<float>(i % 50));
                                  },
                                  0.0),
                              k);
      histogram_merge_matches("infinities" + at,
                              keys_of(
                                  n,
                                  [&](int i) {
                                    if (i % 3 == 0) return ordered_score(-INFINITY);
                                    if (i % 11 == 0) return ordered_score(INFINITY);
                                    return ordered_score(static_cast<float>(gauss()));
                                  },
                                  0.1),
                              k);
      // Ties on the score image across the boundary: blocks order them.
      histogram_merge_matches(
          "ties" + at,
          keys_of(
              n, [&](int i) { return ordered_score(static_cast<float>(i % 8)); }, 0.0),
          k);
      // Every score equal: one bin holds every key, so the merge must hand over.
      EXPECT_FALSE(histogram_merge_matches("all equal" + at,
                                           keys_of(
                                               n, [](int) { return ordered_score(2.0f); }, 0.0),
                                           k))
          << "all equal" << at << ": taken with every key in one bin";
    }
  }
}

TEST(CudaIndexerBlocks, Fp8WideningIsExact) {
  M3MSA_INDEXER_REQUIRE_GPU();
  cuda::DeviceBuffer d_out(256 * 4);
  widen_fp8_kernel<<<1, 256>>>(d_out.as<uint32_t>());
  CUDA_CHECK_LAUNCH();
  std::vector<uint32_t> got(256);
  CUDA_CHECK(cudaMemcpy(got.data(), d_out.data(), 256 * 4, cudaMemcpyDeviceToHost));
  for (int v = 0; v < 256; ++v) {
    for (int half = 0; half < 2; ++half) {
      const int byte = half ? v ^ 0x55 : v;
      const float value = fp8e4m3_to_float(static_cast<uint8_t>(byte));
      const uint16_t bits = static_cast<uint16_t>(half ? got[v] >> 16 : got[v] & 0xFFFF);
      if (std::isnan(value)) {
        EXPECT_TRUE(std::isnan(bf16_to_float(bits))) << "byte " << byte;
      } else {
        EXPECT_EQ(bits, float_to_bf16(value)) << "byte " << byte << " value " << value;
      }
    }
  }
}

}  // namespace
}  // namespace m3msa::idxtest
