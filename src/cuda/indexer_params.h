// Kernel parameter structs of the indexer family (every family keeps its own in
// <family>_params.h). Plain data, passed by value as __grid_constant__; every pointer carries its
// shape; derived scalars are computed on the host by the launcher (indexer.cu).
#pragma once

#include <vector_types.h>

#include <cstdint>

namespace m3msa::cuda {

// Sticky device-side guard bits, OR-ed into IndexerParams::status. The host validates contents
// before launching when asked to; these catch what it could not see (graph replays with new
// metadata) without ever reading or writing out of bounds.
inline constexpr uint32_t kStatusBadPage = 1u;  // a table entry outside [0, num_pages): page 0 read
inline constexpr uint32_t kStatusBadLength = 2u;  // a request needs more blocks than the table has
                                                  // (or past the block id cap): its rows get -1
inline constexpr uint32_t kStatusTooManyUnits = 4u;  // prefill: more row groups than planned

// A "unit" is what one set of query fragments covers: the rows of one decode request, or up to
// kPrefillUnitRows consecutive rows of one prefill request (consecutive positions either way).
struct IndexerParams {
  const void* index_q = nullptr;          // [rows, heads, 128] bf16 | fp8 e4m3 (fp8 cache only)
  const void* index_cache = nullptr;      // [num_pages, 128, 128] bf16 | fp8 e4m3, page_bytes apart
  const int32_t* block_table = nullptr;   // [num_reqs, table_cols] i32 -> index-cache page
  const int32_t* seq_lens = nullptr;      // decode:  [num_reqs] i32 (0 = padding request)
  const int32_t* cu_seqlens_q = nullptr;  // prefill: [num_reqs + 1] i32
  const int32_t* context_lens = nullptr;  // prefill: [num_reqs] i32
  int32_t* topk_idx = nullptr;            // i32 out (fused / top-k kernels): answer (row, head) at
                                // row * out_row_stride + head * out_head_stride, topk entries
  float* scores = nullptr;       // unfused: [rows, heads, score_cols] f32 block scores
  uint64_t* cand = nullptr;      // [(grid + max_units) * topk * unit_vectors] u64 per-CTA keys
  uint32_t* counters = nullptr;  // [max_units] arrival counters, zero between launches
  uint32_t* status = nullptr;    // [1] kStatus* bits (sticky until the host clears them)
  int4* units = nullptr;         // prefill: [max_units] (req, first row, rows, first pos)
  int32_t* num_units = nullptr;  // prefill: [1] units written by the prep kernel
  int64_t num_pages = 0;
  int64_t page_bytes = 0;  // bytes between index-cache pages (a multiple of 16; tokens contiguous)
  int64_t table_cols = 0;
  int64_t num_rows = 0;
  int64_t out_row_stride = 0;   // topk_idx elements between rows (token-major: heads * topk)
  int64_t out_head_stride = 0;  // topk_idx elements between heads (token-major: topk)
  int out_ascending = 0;        // 1: each answer's blocks in ascending id (SelectionOrder)
  int separate_merge = 0;       // split kernel: candidates only, indexer_split_merge_kernel merges
  int scores_only = 0;          // split kernel: block scores to `scores` only (CP shard scoring)
  int split_ctas = 0;           // the split kernel's grid.x (the merge recomputes its ranges)
  int64_t score_cols = 0;       // unfused: blocks per score row (>= every row's visible blocks)
  int num_reqs = 0;
  int q_len = 1;  // decode rows per request
  int heads = 0;  // index heads H (<= 4 per unit of 8 rows; q_len * H <= 32)
  int topk = 0;   // <= 32
  int init_blocks = 0;
  int local_blocks = 0;
  int unit_vectors = 0;  // query vectors per unit: q_len * H (decode), 8 * H (prefill)
  int max_units = 0;     // capacity of counters / units (decode: >= num_reqs)
  int is_prefill = 0;
  int min_blocks_per_cta = 1;  // IndexerPlan::min_blocks_per_cta
  // Stage timeline (timeline.h) of the split kernel or the split merge kernel: [ctas] records,
  // marks kIndexerSplitMarks / kIndexerMergeMarks; null: not recorded.
  uint64_t* timeline = nullptr;
};

// Timeline marks and record kinds of the split kernel (kind 1: the CTA that merged its request,
// 2: a CTA with no blocks; "survivors listed": the merging CTA's candidates loaded and cut to
// the survivor lists, before their ranking) and of the split merge kernel.
inline constexpr const char* kIndexerSplitMarks[] = {
    "start", "first page in", "scored", "candidates out", "arrived", "survivors listed", "end"};
inline constexpr const char* kIndexerSplitKinds[] = {"cta", "merging cta", "idle cta"};
inline constexpr const char* kIndexerMergeMarks[] = {"start", "split kernel done", "end"};

}  // namespace m3msa::cuda
