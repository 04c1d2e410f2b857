#include "m3msa/cache.h"

#include <cmath>
#include <cstdint>
#include <string>

#include "m3msa/error.h"

namespace m3msa {

const char* kv_layout_name(KVLayout layout) {
  switch (layout) {
    case KVLayout::kOurs: return "ours";
    case KVLayout::kVllm: return "vllm";
    case KVLayout::kFlashInfer: return "flashinfer";
  }
  return "unknown";
}

KVLayout parse_kv_layout(const std::string& text, const char* what) {
  if (text == "ours") return KVLayout::kOurs;
  if (text == "vllm") return KVLayout::kVllm;
  if (text == "flashinfer") return KVLayout::kFlashInfer;
  M3MSA_THROW(ErrorCode::kInvalidArgument, what, ": unknown kv cache layout '", text,
              "' (expected ours, vllm or flashinfer)");
}

namespace {

// A 4-d view [pages, kv_heads, block_size, head_dim] of `base` offset by `offset` elements, with
// the strides of the source dimensions (page, head, token, dim).
TensorView part_view(const TensorView& base, int64_t offset, const int64_t (&dims)[4]) {
  TensorView view;
  view.data = base.data == nullptr ? nullptr
                                   : static_cast<uint8_t*>(base.data) +
                                         offset * static_cast<int64_t>(dtype_size(base.dtype));
  view.dtype = base.dtype;
  view.device = base.device;
  view.ndim = 4;
  for (int d = 0; d < 4; ++d) {
    view.shape[d] = base.shape[dims[d]];
    view.strides[d] = base.strides[dims[d]];
  }
  return view;
}

}  // namespace

TensorView KVCache::keys() const {
  if (!data.defined()) return k;
  if (data.ndim != 5) return {};
  return part_view(data, 0, {0, 1, 3, 4});
}

TensorView KVCache::values() const {
  if (!data.defined()) return v;
  if (data.ndim != 5) return {};
  return part_view(data, data.strides[2], {0, 1, 3, 4});
}

float KVCache::host_k_scale() const {
  return k_scale_tensor.defined() ? *static_cast<const float*>(k_scale_tensor.data) : k_scale;
}

float KVCache::host_v_scale() const {
  return v_scale_tensor.defined() ? *static_cast<const float*>(v_scale_tensor.data) : v_scale;
}

int64_t KVCache::pages() const {
  const TensorView view = keys();
  return view.ndim == 4 ? view.shape[0] : 0;
}

KVCache KVCache::split(const TensorView& k, const TensorView& v, float k_scale, float v_scale) {
  KVCache cache;
  cache.k = k;
  cache.v = v;
  cache.k_scale = k_scale;
  cache.v_scale = v_scale;
  return cache;
}

KVCache kv_cache_from_layout(const TensorView& cache, KVLayout layout, float k_scale,
                             float v_scale) {
  switch (layout) {
    case KVLayout::kOurs: return KVCache(cache, k_scale, v_scale);
    case KVLayout::kVllm: {
      M3MSA_CHECK_ARG(cache.ndim == 5,
                      "kv_cache: layout vllm expects [pages, 2, block_size, "
                      "kv_heads, head_dim], got ",
                      describe(cache));
      M3MSA_CHECK_ARG(cache.shape[1] == 2,
                      "kv_cache: layout vllm expects 2 in dimension 1 (K, V), "
                      "got ",
                      describe(cache));
      return KVCache::split(part_view(cache, 0, {0, 3, 2, 4}),
                            part_view(cache, cache.strides[1], {0, 3, 2, 4}), k_scale, v_scale);
    }
    case KVLayout::kFlashInfer: {
      M3MSA_CHECK_ARG(cache.ndim == 4,
                      "kv_cache: layout flashinfer expects [pages, kv_heads, "
                      "block_size, 2 * head_dim], got ",
                      describe(cache));
      M3MSA_CHECK_ARG(cache.shape[3] % 2 == 0,
                      "kv_cache: layout flashinfer expects an even last "
                      "dimension (K then V), got ",
                      describe(cache));
      TensorView half = cache;
      half.shape[3] = cache.shape[3] / 2;
      return KVCache::split(part_view(half, 0, {0, 1, 2, 3}),
                            part_view(half, half.shape[3] * cache.strides[3], {0, 1, 2, 3}),
                            k_scale, v_scale);
    }
  }
  M3MSA_THROW(ErrorCode::kInvalidArgument, "kv_cache: unknown layout ", static_cast<int>(layout));
}

void validate_index_cache(const IndexCache& cache, const SparseConfig& config, const char* name) {
  check_strided_tensor(cache.data, name, {DType::kBF16, DType::kFP8E4M3},
                       {-1, config.block_size, config.index_dim});
}

void validate_kv_cache(const KVCache& cache, const SparseConfig& config, const char* name) {
  const std::string n(name);
  if (cache.data.defined()) {
    M3MSA_CHECK_ARG(!cache.k.defined() && !cache.v.defined(), name,
                    ": give either the packed data or k and v, not both");
    check_strided_tensor(cache.data, name, {DType::kBF16, DType::kFP8E4M3},
                         {-1, config.kv_heads, 2, config.block_size, config.head_dim});
  } else {
    M3MSA_CHECK_ARG(cache.k.defined() && cache.v.defined(), name,
                    ": expected the packed data or both k and v, got k ", describe(cache.k),
                    " and v ", describe(cache.v));
    const std::initializer_list<int64_t> shape = {-1, config.kv_heads, config.block_size,
                                                  config.head_dim};
    check_strided_tensor(cache.k, (n + ".k").c_str(), {DType::kBF16, DType::kFP8E4M3}, shape);
    check_strided_tensor(cache.v, (n + ".v").c_str(), {cache.k.dtype}, shape);
    M3MSA_CHECK_ARG(cache.v.shape[0] == cache.k.shape[0], name, ".v: expected ", cache.k.shape[0],
                    " pages (as k), got ", cache.v.shape[0]);
    M3MSA_CHECK_ARG(cache.v.device == cache.k.device, name, ".v: expected a tensor on ",
                    device_name(cache.k.device), " (as k), got one on ",
                    device_name(cache.v.device));
  }
  for (const auto& [scale, scale_name] : {std::pair{&cache.k_scale_tensor, "k_scale_tensor"},
                                          {&cache.v_scale_tensor, "v_scale_tensor"}}) {
    if (!scale->defined()) continue;
    const std::string full = n + "." + scale_name;
    M3MSA_CHECK_ARG(scale->dtype == DType::kF32, full, ": expected dtype f32, got ",
                    dtype_name(scale->dtype));
    check_extents(*scale, full.c_str());
    M3MSA_CHECK_ARG(scale->ndim == 0 || (scale->ndim == 1 && scale->shape[0] == 1), full,
                    ": expected one element ([1] or 0-d), got ", describe(*scale));
    M3MSA_CHECK_ARG(scale->data != nullptr, full, ": null data pointer");
    M3MSA_CHECK_ARG(scale->device == cache.device(), full, ": expected a tensor on ",
                    device_name(cache.device()), " (as the cache), got one on ",
                    device_name(scale->device));
  }
  M3MSA_CHECK_ARG(std::isfinite(cache.k_scale) && cache.k_scale > 0 &&
                      std::isfinite(cache.v_scale) && cache.v_scale > 0,
                  name, ": k_scale and v_scale must be finite and > 0, got ", cache.k_scale,
                  " and ", cache.v_scale);
}

namespace {

// A cache view the CUDA kernels address through its strides: 16-byte aligned base and outer
// strides, so every page, head and token row starts where a vector load or a bulk copy can.
void check_cuda_view(const TensorView& view, const char* name, const char* const (&axes)[4],
                     int ndim) {
  const auto bytes = static_cast<int64_t>(dtype_size(view.dtype));
  M3MSA_CHECK_SUPPORTED(reinterpret_cast<uintptr_t>(view.data) % 16 == 0, name,
                        ": the CUDA kernels need a 16-byte aligned base address, got ", view.data);
  for (int d = 0; d + 1 < ndim; ++d) {
    M3MSA_CHECK_SUPPORTED(view.shape[d] <= 1 || view.strides[d] * bytes % 16 == 0, name, ": ",
                          axes[d], " stride ", view.strides[d], " (", view.strides[d] * bytes,
                          " bytes) is not a multiple of 16 bytes, which the CUDA kernels need");
  }
}

}  // namespace

void check_index_cache_cuda(const IndexCache& cache, const char* name) {
  check_cuda_view(cache.data, name, {"page", "token", "", ""}, 3);
  M3MSA_CHECK_SUPPORTED(
      cache.data.shape[1] <= 1 || cache.data.strides[1] == cache.data.shape[2], name,
      ": token stride ", cache.data.strides[1], " is not index_dim = ", cache.data.shape[2],
      "; the CUDA indexer stages whole pages and needs each page's tokens contiguous");
}

void check_kv_cache_cuda(const KVCache& cache, const char* name) {
  const std::string n(name);
  check_cuda_view(cache.keys(), (n + ".k").c_str(), {"page", "head", "token", ""}, 4);
  check_cuda_view(cache.values(), (n + ".v").c_str(), {"page", "head", "token", ""}, 4);
}

}  // namespace m3msa
