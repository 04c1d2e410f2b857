// Kernel parameter struct of the preprocess family (preprocess_kernel.cuh). Plain data, passed by
// value (__grid_constant__); every pointer carries its shape, every derived scalar (the RoPE
// frequency table too) is computed on the host by the launcher (preprocess.cu).
#pragma once

#include <cstdint>

namespace m3msa::cuda {

// Per-token RMSNorm + partial NeoX RoPE + cache insert (docs/spec.md, section 2), one launch.
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
  void* k_cache = nullptr;      // [kv_pages, kv_heads, block_size, head_dim] bf16 | fp8, strided
  void* v_cache = nullptr;      // same shape and dtype, strides of its own
  void* index_cache = nullptr;  // [index_pages, block_size, index_dim] bf16 | fp8, strided
  uint16_t* q_out = nullptr;    // [rows, q_heads, head_dim] bf16
  uint16_t* index_q_out = nullptr;  // [rows, index_heads, index_dim] bf16
  int64_t num_rows = 0;
  int64_t qkv_row_stride = 0;  // elements between rows of qkv (>= qkv_width)
  int64_t kv_slots = 0;        // kv_pages * block_size (device-side guard)
  int64_t index_slots = 0;     // index_pages * block_size
  int64_t k_strides[3] = {};   // element strides of K: page, kv head, token
  int64_t v_strides[3] = {};
  int64_t index_strides[2] = {};  // element strides of the index cache: page, token
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
  const float* k_scale_ptr = nullptr;  // [1] f32 read at run time instead of k_scale (fp8 only)
  const float* v_scale_ptr = nullptr;
  double inv_freq[kMaxRopeHalf] = {};  // theta^(-2i / rope_dim), computed on the host in double
};

}  // namespace m3msa::cuda
