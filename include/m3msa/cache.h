// The two paged caches (docs/spec.md section 3). Views only.
#pragma once

#include "m3msa/config.h"
#include "m3msa/tensor.h"

namespace m3msa {

// Index-K cache: one index_dim vector per token, no head axis.
struct IndexCache {
  TensorView data;  // [pages, block_size, index_dim] bf16 | fp8_e4m3 (saturating cast, no scale)
  int64_t pages() const { return data.shape[0]; }
};

// Main KV cache: K tile then V tile of one head of one page, each contiguous.
struct KVCache {
  TensorView data;       // [pages, kv_heads, 2, block_size, head_dim] bf16 | fp8_e4m3
  float k_scale = 1.0f;  // stored = value / scale, read = stored * scale (fp8 only)
  float v_scale = 1.0f;
  int64_t pages() const { return data.shape[0]; }
};

void validate_index_cache(const IndexCache& cache, const SparseConfig& config, const char* name);
void validate_kv_cache(const KVCache& cache, const SparseConfig& config, const char* name);

}  // namespace m3msa
