// Host launcher of the preprocess family (preprocess_kernel.cuh has the algorithm; called by the
// CUDA backend in backend.cu and the fused runtime): RMSNorm + partial NeoX RoPE of q, k, index_q,
// index_k and the cache inserts, one launch (docs/spec.md, section 2). Validates shapes on the
// host (no device reads), allocates nothing, never synchronizes, CUDA-graph capturable.
#pragma once

#include <cuda_runtime.h>

#include "m3msa/ops.h"

namespace m3msa::cuda {

// Which vectors of each row a launch covers: all, the attention part (q, k, v: RoPE'd q and the
// KV cache insert) or the index part (index_q and the index-K cache insert). The two parts
// together write exactly what kAll writes, so the runtime can run the index part (and the
// indexer after it) beside the attention part. args are validated whole either way.
enum class PreprocessPart { kAll, kAttention, kIndex };

void launch_preprocess(const SparseConfig& config, const PreprocessArgs& args, cudaStream_t stream,
                       PreprocessPart part = PreprocessPart::kAll);

}  // namespace m3msa::cuda
