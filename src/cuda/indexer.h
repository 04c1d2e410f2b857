// Host side of the CUDA indexer: plan (workspace layout from the limits) and run (launch on a
// stream). Used by the CUDA backend, the tests and the benchmarks.
//
// Plan/run contract:
//  - plan_indexer() sizes one caller-owned workspace for every batch within `limits`;
//    init_indexer_workspace() zeroes it once (counters start at zero, and every launch leaves them
//    at zero again).
//  - launch_indexer() validates shapes and dtypes on the host (it reads no device memory),
//    allocates nothing, never synchronizes the host and is CUDA-graph capturable. Its grids depend
//    only on the plan and the host-side shapes (num_reqs, q_len, num_tokens), never on seq_lens or
//    table contents, so one captured graph replays any metadata within the plan.
//  - Deterministic: the same inputs give bit-identical outputs, and block scores (hence
//    selections) do not depend on the batch composition or on how blocks are split among CTAs.
// Support: index_dim = block_size = 128, topk <= 32, q_len * index_heads <= 32 (decode),
// index_heads <= 4 (prefill); kUnsupported names the value otherwise.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "cuda/indexer_params.h"
#include "m3msa/cuda_backend.h"
#include "m3msa/ops.h"

namespace m3msa::cuda {

struct IndexerPlan {
  SparseConfig config;
  PlanLimits limits;  // as given, with max_rows filled in
  int device = 0;
  // CTAs of the span kernel (2 per SM); the split kernel gives each of a decode batch's
  // num_reqs requests grid / num_reqs of them.
  int grid = 0;
  // Each CTA that scores takes at least this many blocks: of the batch's (span kernel; fewer CTAs
  // score short batches, the rest only clear dead units) or of its request's (split kernel). Any
  // value gives the same selection.
  int min_blocks_per_cta = 1;
  int max_units = 0;       // decode requests or prefill row groups
  int unit_vectors = 0;    // query vectors per unit the candidate buffer is laid out for
  int64_t score_cols = 0;  // unfused baseline: blocks per score row (0: baseline not planned)
  std::size_t off_status = 0;
  std::size_t off_num_units = 0;
  std::size_t off_counters = 0;
  std::size_t off_units = 0;
  std::size_t off_cand = 0;
  std::size_t off_scores = 0;
  std::size_t workspace_bytes = 0;
};

// Throws Error(kUnsupported) naming the first configuration value the CUDA indexer cannot run.
void check_indexer_supported(const SparseConfig& config);
// What the CUDA kernels take of a call's arguments beyond validate(): an index cache they can
// address (check_index_cache_cuda); every index_q dtype and selection option the validation
// accepts is served. Throws Error(kUnsupported) naming the argument.
void check_indexer_args_supported(const IndexerArgs& args);

// The decode indexer's kernels as launch_indexer picks them, for callers that launch them over
// their own tables (the CP shard scoring): n_tiles 1, 2 or 4 n8 tiles of query vectors; q8: an
// fp8 index_q beside the fp8 cache. The span kernel selects, or with scores_only writes every
// block score; the split kernel does either by IndexerParams::scores_only.
using IndexerKernel = void (*)(const IndexerParams);
IndexerKernel span_indexer_kernel(bool fp8, bool q8, int n_tiles, bool scores_only);
IndexerKernel split_indexer_kernel(bool fp8, bool q8, int n_tiles);
// The span kernel's dynamic shared memory for max_units units (their block prefix sums), and
// raising every decode-indexer kernel's limit to it on `device` (the current device). The limit
// is per kernel and device, shared by every plan and CP indexer of the process: one registry,
// only ever raised, so a smaller user never lowers it under a bigger one.
std::size_t span_indexer_smem_bytes(int max_units);
void raise_indexer_smem_limit(int device, std::size_t smem);

// limits.max_context > 0 also plans the unfused baseline's score tensor.
IndexerPlan plan_indexer(const SparseConfig& config, const PlanLimits& limits, int device);

// Zeroes the counters and the status word (asynchronous on `stream`).
void init_indexer_workspace(const IndexerPlan& plan, void* workspace, cudaStream_t stream);

// Whether a call with these host-side shapes fits the plan (and why not, if `why` is given).
bool indexer_fits_plan(const IndexerPlan& plan, const SparseConfig& config, const IndexerArgs& args,
                       IndexerVariant variant, std::string* why);

// Runs the indexer on `stream` (see the contract above). The tensors must live on plan.device.
void launch_indexer(const IndexerPlan& plan, const SparseConfig& config, const IndexerArgs& args,
                    IndexerVariant variant, void* workspace, cudaStream_t stream);

// The sticky kStatus* bits (indexer_params.h) of the device-side guards; synchronizes `stream`.
uint32_t read_indexer_status(const IndexerPlan& plan, const void* workspace, cudaStream_t stream,
                             bool clear);

}  // namespace m3msa::cuda
