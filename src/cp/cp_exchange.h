// Launchers of the CP exchange kernels (cp_exchange_kernel.cuh) for the CUDA CP indexer
// (cp_indexer.cu): each computes its grid from the planned maxima in the params (never the live
// batch, so a captured graph replays any metadata within the plan) and launches on `stream`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cp/cp_exchange_params.h"

namespace m3msa::cuda {

// Shard tables of every request slot: grid max_reqs.
void launch_cp_exchange_shard_tables(const cp_exchange::CpExchangeParams& p, int max_reqs,
                                     cudaStream_t stream);
// Nominations of every (row, head) of max_rows (peer: into the consumers' buffers; nccl: into
// the send buffer).
void launch_cp_exchange_nominate(const cp_exchange::CpExchangeParams& p, cudaStream_t stream);
// The bounded wait and merge of every (row, merged head) of max_rows.
void launch_cp_exchange_merge(const cp_exchange::CpExchangeParams& p, cudaStream_t stream);
// Peer: nominate and merge in one launch.
void launch_cp_exchange_fused(const cp_exchange::CpExchangeParams& p, cudaStream_t stream);
// allreduce-max: the shard's scores into the full-width tensor, before the all-reduce ...
void launch_cp_exchange_scatter_scores(const cp_exchange::CpExchangeParams& p, cudaStream_t stream);
// ... and the top-k of the reduced scores after it.
void launch_cp_exchange_select_full(const cp_exchange::CpExchangeParams& p, cudaStream_t stream);
// replicated: out [live_rows, merged, k] i32 <- the merged heads' rows of full [live_rows, H, k].
void launch_cp_exchange_gather_heads(const int32_t* full, int32_t* out, int live_rows, int heads,
                                     int merged, int head0, int k, cudaStream_t stream);
// M3MSA_CP_DEBUG: one device line per rank after a call's exchange.
void launch_cp_exchange_debug(const cp_exchange::CpExchangeParams& p, int transport,
                              cudaStream_t stream);

}  // namespace m3msa::cuda
