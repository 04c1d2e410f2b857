// The two paged caches (docs/spec.md section 3). Views only: every cache is read and written in
// place through element strides, so an engine's own cache layout needs no copy.
#pragma once

#include <string>

#include "m3msa/config.h"
#include "m3msa/tensor.h"

namespace m3msa {

// Index-K cache: one index_dim vector per token, no head axis. Page and token strides are free
// (index_dim contiguous) on the CPU backend; the CUDA indexer reads a contiguous cache.
struct IndexCache {
  TensorView data;  // [pages, block_size, index_dim] bf16 | fp8_e4m3 (saturating cast, no scale)
  int64_t pages() const { return data.ndim == 3 ? data.shape[0] : 0; }
};

// The main-cache layouts engines use, each read in place (kv_cache_from_layout).
enum class KVLayout : int {
  kOurs = 0,        // [pages, kv_heads, 2, block_size, head_dim]: K tile then V tile per head
  kVllm = 1,        // [pages, 2, block_size, kv_heads, head_dim]: K = [:, 0], V = [:, 1]
  kFlashInfer = 2,  // [pages, kv_heads, block_size, 2 * head_dim]: K then V in each token row
};
const char* kv_layout_name(KVLayout layout);  // "ours", "vllm", "flashinfer"
KVLayout parse_kv_layout(const std::string& text, const char* what);

// Main KV cache: K and V as two views of logical shape [pages, kv_heads, block_size, head_dim]
// with any element strides (head_dim stride 1), or the packed form `data` from which both are
// derived. Exactly one of the two forms is given.
struct KVCache {
  KVCache() = default;
  // The packed form (what the CPU backend, the runtime and the tests allocate).
  KVCache(const TensorView& packed, float k_scale_ = 1.0f, float v_scale_ = 1.0f)
      : data(packed), k_scale(k_scale_), v_scale(v_scale_) {}

  TensorView data;       // packed [pages, kv_heads, 2, block_size, head_dim] bf16 | fp8_e4m3
  float k_scale = 1.0f;  // stored = value / scale, read = stored * scale (fp8 only)
  float v_scale = 1.0f;
  TensorView k;  // [pages, kv_heads, block_size, head_dim], given with v instead of data
  TensorView v;  // same shape, dtype and device as k; strides of its own
  // Scales read when the operation runs, not when it is called: a [1] (or 0-d) f32 on the
  // cache's device that replaces k_scale / v_scale when given (the CPU backend; the CUDA kernels
  // take the floats). Only fp8 caches read them; > 0 and finite is the caller's promise.
  TensorView k_scale_tensor;
  TensorView v_scale_tensor;

  // The K and V views whichever form was given (not given: ndim 0).
  TensorView keys() const;
  TensorView values() const;
  bool defined() const { return data.defined() || k.defined() || v.defined(); }
  int64_t pages() const;
  // The scales in force for a host-memory cache (the CPU reference): the tensors' values when
  // given, else k_scale / v_scale.
  float host_k_scale() const;
  float host_v_scale() const;
  DType dtype() const { return data.defined() ? data.dtype : k.dtype; }
  Device device() const { return data.defined() ? data.device : k.device; }

  static KVCache split(const TensorView& k, const TensorView& v, float k_scale = 1.0f,
                       float v_scale = 1.0f);
};

// K and V of `cache` as laid out by `layout` (shapes in KVLayout), read in place; `cache` may be
// a strided sub-view (innermost stride 1). kInvalidArgument naming "kv_cache" on a wrong rank or
// an odd FlashInfer row.
KVCache kv_cache_from_layout(const TensorView& cache, KVLayout layout, float k_scale = 1.0f,
                             float v_scale = 1.0f);

void validate_index_cache(const IndexCache& cache, const SparseConfig& config, const char* name);
void validate_kv_cache(const KVCache& cache, const SparseConfig& config, const char* name);

// What the CUDA kernels take (after validate_*): any layout and strided view whose base address
// and outer strides are multiples of 16 bytes, and an index cache whose tokens are contiguous
// within a page. Error(kUnsupported) naming the cache and the stride otherwise.
void check_index_cache_cuda(const IndexCache& cache, const char* name);
void check_kv_cache_cuda(const KVCache& cache, const char* name);

}  // namespace m3msa
