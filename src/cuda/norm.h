// Host launcher of the norm family: the residual add fused with the Gemma RMSNorm of the fused
// decode runtime (src/runtime/gpu_engine.cc). The launcher validates on the host, allocates
// nothing, never synchronizes and is CUDA-graph capturable (the grid depends only on host shapes).
//
// Numerics (the contract of runtime.h, approximated; the CPU runtime is the oracle):
// x = bf16(residual + delta) (delta f32 is first rounded to bf16, as the CPU does),
// y = bf16((x * r) * (1 + w)) with r = 1 / sqrt(mean(x^2) + eps); the sum of squares is a
// fixed-order tree in fp32 (not the CPU's sequential order), so r can differ in its last bits and
// y by one bf16 ulp. Deterministic run to run.
#pragma once

#include <cuda_runtime.h>

#include "cuda/norm_params.h"

namespace m3msa::cuda {

// Requirements: n a positive multiple of 8, every tensor 16-byte aligned.
void launch_norm_residual(const NormResidualParams& p, cudaStream_t stream);

}  // namespace m3msa::cuda
