// Host launcher of the gemm family: the skinny projection GEMM of the fused decode runtime
// (src/runtime/gpu_engine.cc), out[r, n] = sum_k x[r, k] * w[n, k] (* scale[n]) for 1..16 token
// rows. The launcher validates on the host (kUnsupported for rows > 16 or k % 64 != 0),
// allocates nothing, never synchronizes and is CUDA-graph capturable (the grid depends only on
// host shapes).
//
// Numerics: fp32 accumulation on tensor cores (mma.sync m16n8k16 bf16), fp8 e4m3 weights
// converted exactly to bf16 in registers (an e4m3 NaN makes its output column NaN), then *
// scale[n]; fixed reduction order, so the same inputs give bit-identical outputs run to run
// (graph replay == eager) and whichever loop a launch takes (ring, group, deep).
#pragma once

#include <cuda_runtime.h>

#include "cuda/gemm_params.h"

namespace m3msa::cuda {

void launch_gemm_skinny(const GemmSkinnyParams& p, cudaStream_t stream);
// CTAs of one launch (for the launch-count and byte bookkeeping of the benchmarks).
int gemm_skinny_ctas(int n);
// Whether a projection of n output columns should be launched with split_k8 on this device: its
// grid puts < 4 CTAs on every SM (measured on H200: M3's o_proj, 384 CTAs, 3-22 % faster). Decide
// once per projection from its full width and use it for every launch of it.
bool gemm_skinny_prefers_split_k8(int n);

}  // namespace m3msa::cuda
