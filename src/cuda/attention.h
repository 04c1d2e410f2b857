// Host launchers of the sparse-attention kernels (implemented in attention.cu by the attention
// owner; called by the CUDA backend in backend.cu). Plan/run contract, as for the indexer:
//  - sparse_attention_workspace_size() sizes the caller-owned workspace for every batch within
//    `limits`; the workspace must be zeroed once before its first use, and every launch leaves it
//    ready for the next one (arrival counters reset themselves).
//  - launch_sparse_attention() validates shapes on the host (no device reads), allocates nothing,
//    never synchronizes the host and is CUDA-graph capturable; its grid depends only on the host
//    shapes (num_reqs, q_len / num_tokens) and `config`, never on device contents.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "m3msa/cuda_backend.h"
#include "m3msa/ops.h"

namespace m3msa::cuda {

size_t sparse_attention_workspace_size(const SparseConfig& config, const PlanLimits& limits);

// args tensors live on the current device; args.topk_idx not given = dense causal attention.
void launch_sparse_attention(const SparseConfig& config, const AttentionArgs& args, void* workspace,
                             size_t workspace_bytes, cudaStream_t stream);

}  // namespace m3msa::cuda
