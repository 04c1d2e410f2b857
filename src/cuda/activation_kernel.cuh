// SwiGLU-OAI activation kernel of the decode runtime: act = bf16(glu * (up + 1)) with
// gate clamped above and up clamped on both sides at `limit`, glu = gate * sigmoid(1.702 * gate).
// Framework-free: raw pointers and ActivationSwigluParams; launched by activation.cu.
//
// A grid-stride loop, one element per thread and step; unfused fp32 operations in the CPU
// runtime's order, and comparisons for the clamps so a NaN stays NaN.
// Requirements: none beyond the shapes of the params.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/activation_params.h"
#include "m3msa/dtype.h"

namespace m3msa::cuda::activation {

__global__ void activation_swiglu_kernel(const __grid_constant__ ActivationSwigluParams p) {
  const int64_t total = static_cast<int64_t>(p.rows) * p.inter;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / p.inter;
    const int64_t j = i % p.inter;
    const uint16_t* gu = p.gate_up + row * 2 * p.inter;
    float gate = bf16_to_float(gu[j]);
    float up = bf16_to_float(gu[p.inter + j]);
    // Comparisons (not fminf / fmaxf) so a NaN stays NaN, as in the CPU runtime.
    gate = gate > p.limit ? p.limit : gate;
    up = up > p.limit ? p.limit : (up < -p.limit ? -p.limit : up);
    const float glu = __fdiv_rn(gate, __fadd_rn(1.0f, expf(__fmul_rn(-1.702f, gate))));
    p.act[i] = float_to_bf16(__fmul_rn(glu, __fadd_rn(up, 1.0f)));
  }
}

}  // namespace m3msa::cuda::activation
