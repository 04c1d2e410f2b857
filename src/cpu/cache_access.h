// Plain element access to the paged caches and the block tables, shared by the CPU reference's
// indexer, attention and preprocessing. Only ever used after the arguments were validated, so the
// helpers do no checks of their own.
#pragma once

#include <cstdint>

#include "m3msa/cache.h"
#include "m3msa/dtype.h"
#include "m3msa/tensor.h"

namespace m3msa::cpu::detail {

// Element `index` of a bf16 or fp8 e4m3 buffer, decoded to fp32 (exact for both dtypes).
inline float load_element(const void* base, DType dtype, int64_t index) {
  if (dtype == DType::kBF16) return bf16_to_float(static_cast<const uint16_t*>(base)[index]);
  return fp8e4m3_to_float(static_cast<const uint8_t*>(base)[index]);
}

// Decodes n consecutive elements starting at `offset`; fp8 values are multiplied by `scale`
// (stored = value / scale), bf16 values are taken as they are.
inline void load_vector(const TensorView& tensor, int64_t offset, int n, float scale, float* out) {
  if (tensor.dtype == DType::kBF16) {
    const uint16_t* data = tensor.ptr<const uint16_t>() + offset;
    for (int i = 0; i < n; ++i) out[i] = bf16_to_float(data[i]);
  } else {
    const uint8_t* data = tensor.ptr<const uint8_t>() + offset;
    for (int i = 0; i < n; ++i) out[i] = fp8e4m3_to_float(data[i]) * scale;
  }
}

inline void load_bf16(const uint16_t* data, int n, float* out) {
  for (int i = 0; i < n; ++i) out[i] = bf16_to_float(data[i]);
}

// Physical page of logical block `block` of request `req` in a [num_reqs, max_blocks] table.
inline int64_t table_page(const TensorView& table, int req, int64_t block) {
  return table.ptr<const int32_t>()[int64_t{req} * table.shape[1] + block];
}

// Element offset of token `pos` of request `req` in the index-K cache [pages, block_size, D]
// (strided pages and tokens, D contiguous).
inline int64_t index_cache_offset(const IndexCache& cache, const TensorView& table, int req,
                                  int64_t pos) {
  const int64_t block_size = cache.data.shape[1];
  const int64_t page = table_page(table, req, pos / block_size);
  return page * cache.data.strides[0] + (pos % block_size) * cache.data.strides[1];
}

// Element offset of the vector of token `pos` of request `req`, KV head `kv_head`, in `part`: the
// K or the V view [pages, kv_heads, block_size, head_dim] of the main cache (KVCache::keys(),
// values()).
inline int64_t kv_cache_offset(const TensorView& part, const TensorView& table, int req,
                               int kv_head, int64_t pos) {
  const int64_t block_size = part.shape[2];
  const int64_t page = table_page(table, req, pos / block_size);
  return page * part.strides[0] + kv_head * part.strides[1] + (pos % block_size) * part.strides[2];
}

}  // namespace m3msa::cpu::detail
