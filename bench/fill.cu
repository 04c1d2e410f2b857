#include "fill.h"

#include "cuda/common.cuh"
#include "m3msa/dtype.h"

namespace m3msa::bench {
namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [-sqrt 3, sqrt 3] (unit variance), as the synthetic cases draw them.
__global__ void fill_random_kernel(void* data, int64_t count, int fp8, uint64_t seed) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const uint64_t h = mix64(seed + 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(i + 1));
    const double unit = static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);
    const float u = static_cast<float>((unit * 2.0 - 1.0) * 1.7320508075688772);
    if (fp8) {
      static_cast<uint8_t*>(data)[i] = float_to_fp8e4m3(u);
    } else {
      static_cast<uint16_t*>(data)[i] = float_to_bf16(u);
    }
  }
}

}  // namespace

void fill_random(void* data, int64_t count, bool fp8, uint64_t seed, cudaStream_t stream) {
  if (count == 0) return;
  fill_random_kernel<<<2048, 256, 0, stream>>>(data, count, fp8 ? 1 : 0, seed);
  CUDA_CHECK_LAUNCH();
}

}  // namespace m3msa::bench
