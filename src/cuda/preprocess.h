// Host launcher of the preprocessing kernel (implemented in preprocess.cu by the preprocessing
// owner; called by the CUDA backend in backend.cu): RMSNorm + partial NeoX RoPE of q, k, index_q,
// index_k and the cache inserts, one launch (spec.md section 2). Validates shapes on the host
// (no device reads), allocates nothing, never synchronizes, CUDA-graph capturable.
#pragma once

#include <cuda_runtime.h>

#include "m3msa/ops.h"

namespace m3msa::cuda {

void launch_preprocess(const SparseConfig& config, const PreprocessArgs& args, cudaStream_t stream);

}  // namespace m3msa::cuda
