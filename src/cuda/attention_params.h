// Kernel parameter structs of the attention family (attention_kernel.cuh). Plain data, passed by
// value (__grid_constant__); every pointer carries its shape, every derived scalar is computed on
// the host by the launcher (attention.cu). Element strides are narrowed to int64.
#pragma once

#include <cstdint>

namespace m3msa::cuda {

// Where the rows of a batch sit.
struct AttentionRowLayoutParams {
  int is_prefill = 0;  // 0: decode (row = req * q_len + j), 1: prefill
  int num_reqs = 0;
  int q_len = 1;                          // decode rows per request
  const int32_t* seq_lens = nullptr;      // decode:  [num_reqs], counts the q_len new tokens
  const int32_t* cu_seqlens_q = nullptr;  // prefill: [num_reqs + 1]
  const int32_t* context_lens = nullptr;  // prefill: [num_reqs]
};

// Block-sparse (or dense causal) GQA decode/prefill attention over the paged main KV cache.
// One CTA = one (row group, kv head, split): a group is one row, or up to 4 decode rows of one
// request (the kernel's kTiles); the 16 query heads of the KV head form one m16 tile per row.
struct AttentionParams {
  const uint16_t* q = nullptr;        // [rows, q_heads, head_dim] bf16
  const void* k_cache = nullptr;      // [pages, kv_heads, block_size, head_dim] bf16 | fp8, strided
  const void* v_cache = nullptr;      // same shape and dtype, strides of its own
  const int32_t* topk_idx = nullptr;  // [rows, kv_heads, topk] i32, -1 ends the valid prefix;
                                      // null: dense causal attention over every visible block
  int64_t topk_row_stride = 0;        // element strides of topk_idx's outer axes (a head-major
  int64_t topk_head_stride = 0;       // selection is a permuted view); its k entries contiguous
  const int32_t* kv_block_table = nullptr;  // [num_reqs, table_cols] i32 -> page
  uint16_t* out = nullptr;                  // [rows, q_heads, head_dim] bf16
  float* partial_o = nullptr;    // [partial_slots * tiles, 16, head_dim] f32, unnormalized output
  float* partial_ml = nullptr;   // [partial_slots * tiles, 16, 2] f32, (running max log2, sum)
  uint32_t* counters = nullptr;  // [partial_slots] arrival counters, zero between launches
  AttentionRowLayoutParams rows_layout;
  int64_t num_rows = 0;
  int64_t num_pages = 0;  // pages in the cache (device-side guard on table entries)
  // Element strides of the K and V views (page, kv head, token); multiples of 16 bytes.
  int64_t k_page_stride = 0;
  int64_t k_head_stride = 0;
  int64_t k_token_stride = 0;
  int64_t v_page_stride = 0;
  int64_t v_head_stride = 0;
  int64_t v_token_stride = 0;
  int64_t table_cols = 0;  // kv_block_table.shape[1]
  int q_heads = 0;
  int kv_heads = 0;
  int group = 0;  // q_heads / kv_heads, <= 16
  int topk = 0;
  int groups_per_req = 1;   // decode rows of a request per CTA > 1: ceil(q_len / rows per CTA)
  int num_splits = 1;       // CTAs per (row group, kv head); > 1 merges the splits' partials:
  int cluster_merge = 0;    //   1: the splits form one cluster (DSMEM merge on rank 0);
                            //   0: partial_* + counters in global memory, last CTA merges
  float scale_log2 = 0.0f;  // softmax_scale * k_scale * log2(e): logits in the exp2 domain
  float v_scale = 1.0f;     // applied to the normalized output (1 for bf16)
  // fp8 scales read at run time (null: the two floats above). Given, the kernel forms scale_log2
  // from softmax_scale and *k_scale_ptr with the launcher's expression, so the bits agree.
  const float* k_scale_ptr = nullptr;  // [1] f32
  const float* v_scale_ptr = nullptr;  // [1] f32
  float softmax_scale = 0.0f;
  // 1: the programmatic wait comes after the q loads, the row lengths and an L2 prefetch of the
  // block table, right before the first selection read (AttentionTuning::early_prologue).
  int early_prologue = 0;
  // Stage timeline (timeline.h): [ctas] records, marks kAttentionMarks; null: not recorded.
  uint64_t* timeline = nullptr;
};

// The kernel's timeline marks and record kinds (the CTA that merges its unit's splits is kind 1).
inline constexpr const char* kAttentionMarks[] = {
    "start", "pages looked up", "first chunk in", "chunks done", "published", "end"};
inline constexpr const char* kAttentionKinds[] = {"split", "merging split"};

}  // namespace m3msa::cuda
