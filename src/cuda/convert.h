// Host launcher of the convert family: f32 -> bf16 (round to nearest even) for the fused decode
// runtime (src/runtime/gpu_engine.cc). Validates on the host, allocates nothing, never
// synchronizes, CUDA-graph capturable.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/convert_params.h"

namespace m3msa::cuda {

void launch_convert_f32_to_bf16(const float* in, uint16_t* out, int64_t count, cudaStream_t stream);

}  // namespace m3msa::cuda
