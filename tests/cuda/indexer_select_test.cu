// Device building blocks of the indexer, tested directly: the warp top-k (every path: small sort,
// threshold filter, repeated filter, streaming fallback) against std::sort, and the exact
// e4m3 -> bf16 widening on all 256 byte values.
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

namespace m3msa::idxtest {
namespace {

__global__ void warp_top_keys_kernel(const uint64_t* keys, int count, int k, uint64_t* out) {
  __shared__ uint64_t scratch[cuda::indexer::kScratch];
  const uint64_t top =
      cuda::indexer::warp_top_keys([&](int i) { return keys[i]; }, count, k, scratch);
  out[threadIdx.x] = top;
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
