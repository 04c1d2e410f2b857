// Element type conversion kernel of the decode runtime: f32 -> bf16, round to nearest even (the
// encoder of m3msa/dtype.h, so NaN stays NaN). Framework-free: raw pointers and ConvertParams;
// launched by convert.cu. A grid-stride loop, one element per thread and step.
// Requirements: none beyond the shapes of the params.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/convert_params.h"
#include "m3msa/dtype.h"

namespace m3msa::cuda::convert {

__global__ void convert_f32_to_bf16_kernel(const __grid_constant__ ConvertParams p) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < p.count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    p.out[i] = float_to_bf16(p.in[i]);
  }
}

}  // namespace m3msa::cuda::convert
