// Kernel parameter structs of the sparse-attention and preprocessing kernels. Plain data, passed by
// value (__grid_constant__); every pointer carries its shape, every derived scalar is computed on
// the host by the launcher (attention.cu, preprocess.cu). Element strides are narrowed to int64.
#pragma once

#include <cstdint>

namespace m3msa::cuda {

// Where the rows of a batch sit (shared by attention and preprocessing).
struct RowLayoutParams {
  int is_prefill = 0;  // 0: decode (row = req * q_len + j), 1: prefill
  int num_reqs = 0;
  int q_len = 1;                          // decode rows per request
  const int32_t* seq_lens = nullptr;      // decode:  [num_reqs], counts the q_len new tokens
  const int32_t* cu_seqlens_q = nullptr;  // prefill: [num_reqs + 1]
  const int32_t* context_lens = nullptr;  // prefill: [num_reqs]
};

// Block-sparse (or dense causal) GQA decode/prefill attention over the paged main KV cache.
// One CTA = one (row, kv head, split); the 16 query heads of the KV head form one m16 tile.
struct SparseAttentionParams {
  const uint16_t* q = nullptr;              // [rows, q_heads, head_dim] bf16
  const void* kv_cache = nullptr;           // [pages, kv_heads, 2, block_size, head_dim] bf16 | fp8
  const int32_t* topk_idx = nullptr;        // [rows, kv_heads, topk] i32, -1 ends the valid prefix;
                                            // null: dense causal attention over every visible block
  const int32_t* kv_block_table = nullptr;  // [num_reqs, table_cols] i32 -> page
  uint16_t* out = nullptr;                  // [rows, q_heads, head_dim] bf16
  float* partial_o = nullptr;    // [partial_slots, 16, head_dim] f32, unnormalized output
  float* partial_ml = nullptr;   // [partial_slots, 16, 2] f32, (running max log2, sum)
  uint32_t* counters = nullptr;  // [partial_slots] arrival counters, zero between launches
  RowLayoutParams rows_layout;
  int64_t num_rows = 0;
  int64_t num_pages = 0;    // pages in the cache (device-side guard on table entries)
  int64_t page_stride = 0;  // elements per page = kv_heads * 2 * block_size * head_dim
  int64_t head_stride = 0;  // elements per (page, kv head) = 2 * block_size * head_dim
  int64_t table_cols = 0;   // kv_block_table.shape[1]
  int q_heads = 0;
  int kv_heads = 0;
  int group = 0;  // q_heads / kv_heads, <= 16
  int topk = 0;
  int num_splits = 1;       // CTAs per (row, kv head); > 1 merges the splits' partials:
  int cluster_merge = 0;    //   1: the splits form one cluster (DSMEM merge on rank 0);
                            //   0: partial_* + counters in global memory, last CTA merges
  float scale_log2 = 0.0f;  // softmax_scale * k_scale * log2(e): logits in the exp2 domain
  float v_scale = 1.0f;     // applied to the normalized output (1 for bf16)
};

// Per-token RMSNorm + partial NeoX RoPE + cache insert (spec.md section 2), one launch.
inline constexpr int kMaxRopeHalf = 64;  // rope_dim / 2 <= 64
struct PreprocessParams {
  const uint16_t* qkv = nullptr;     // [rows, qkv_width] bf16: [q | k | v | index_q | index_k]
  const uint16_t* q_norm = nullptr;  // [head_dim] bf16
  const uint16_t* k_norm = nullptr;  // [head_dim] bf16
  const uint16_t* index_q_norm = nullptr;       // [index_dim] bf16
  const uint16_t* index_k_norm = nullptr;       // [index_dim] bf16
  const int64_t* positions = nullptr;           // [rows] i64, < 0: dead row
  const int64_t* slot_mapping = nullptr;        // [rows] i64, < 0: no main-cache write
  const int64_t* index_slot_mapping = nullptr;  // [rows] i64, < 0: no index-cache write
  void* kv_cache = nullptr;         // [kv_pages, kv_heads, 2, block_size, head_dim] bf16 | fp8
  void* index_cache = nullptr;      // [index_pages, block_size, index_dim] bf16 | fp8
  uint16_t* q_out = nullptr;        // [rows, q_heads, head_dim] bf16
  uint16_t* index_q_out = nullptr;  // [rows, index_heads, index_dim] bf16
  int64_t num_rows = 0;
  int64_t qkv_row_stride = 0;  // elements between rows of qkv (>= qkv_width)
  int64_t kv_slots = 0;        // kv_pages * block_size (device-side guard)
  int64_t index_slots = 0;     // index_pages * block_size
  int q_heads = 0;
  int kv_heads = 0;
  int index_heads = 0;
  int head_dim = 0;
  int index_dim = 0;
  int block_size = 0;
  int rope_half = 0;  // rope_dim / 2; pairs (i, i + rope_half)
  int kv_fp8 = 0;     // main cache dtype: 0 bf16, 1 fp8 e4m3 (value / scale)
  int index_fp8 = 0;  // index cache dtype: 0 bf16, 1 fp8 e4m3 (no scale)
  // Vectors per row, in the order q heads, k heads, v heads, index_q heads, index_k (the last
  // index_heads + 1 left out when the launch has no index part).
  int num_vectors = 0;
  int first_vector = 0;  // the launch covers vectors [first_vector, num_vectors) of each row
  float rms_eps = 1e-6f;
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  double inv_freq[kMaxRopeHalf] = {};  // theta^(-2i / rope_dim), computed on the host in double
};

}  // namespace m3msa::cuda
