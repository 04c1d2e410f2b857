#include "m3msa/testing/layouts.h"

#include <cstring>

#include "m3msa/error.h"

namespace m3msa::testkit {

std::vector<int64_t> kv_layout_shape(KVLayout layout, int64_t pages, int64_t kv_heads,
                                     int64_t block_size, int64_t head_dim) {
  switch (layout) {
    case KVLayout::kOurs: return {pages, kv_heads, 2, block_size, head_dim};
    case KVLayout::kVllm: return {pages, 2, block_size, kv_heads, head_dim};
    case KVLayout::kFlashInfer: return {pages, kv_heads, block_size, 2 * head_dim};
  }
  M3MSA_THROW(ErrorCode::kInvalidArgument, "layout: unknown value ", static_cast<int>(layout));
}

namespace {

void copy_rows(const TensorView& from, const TensorView& to) {
  M3MSA_CHECK_ARG(from.ndim == to.ndim && from.dtype == to.dtype && from.sizes() == to.sizes(),
                  "copy: ", describe(from), " and ", describe(to), " differ");
  const int last = from.ndim - 1;
  const auto bytes = static_cast<int64_t>(dtype_size(from.dtype));
  const int64_t row_bytes = from.shape[last] * bytes;
  int64_t rows = 1;
  for (int d = 0; d < last; ++d) rows *= from.shape[d];
  for (int64_t r = 0; r < rows; ++r) {
    int64_t rest = r;
    int64_t src = 0;
    int64_t dst = 0;
    for (int d = last - 1; d >= 0; --d) {
      const int64_t i = rest % from.shape[d];
      rest /= from.shape[d];
      src += i * from.strides[d];
      dst += i * to.strides[d];
    }
    std::memcpy(static_cast<uint8_t*>(to.data) + dst * bytes,
                static_cast<const uint8_t*>(from.data) + src * bytes,
                static_cast<std::size_t>(row_bytes));
  }
}

}  // namespace

void copy_kv_cache(const KVCache& from, const KVCache& to) {
  copy_rows(from.keys(), to.keys());
  copy_rows(from.values(), to.values());
}

void copy_index_cache(const IndexCache& from, const IndexCache& to) {
  copy_rows(from.data, to.data);
}

HostTensor relayout_kv_cache(const HostTensor& ours, KVLayout layout) {
  const std::vector<int64_t>& s = ours.shape();
  M3MSA_CHECK_ARG(s.size() == 5 && s[2] == 2, "relayout_kv_cache: expected a packed cache, got ",
                  describe(ours.view()));
  HostTensor out(ours.dtype(), kv_layout_shape(layout, s[0], s[1], s[3], s[4]));
  out.fill_bytes(0);
  copy_kv_cache(KVCache(ours.view()), kv_cache_from_layout(out.view(), layout));
  return out;
}

TensorView kv_head_subview(const HostTensor& wide, int64_t first_head, int64_t kv_heads) {
  TensorView view = wide.view();
  M3MSA_CHECK_ARG(view.ndim == 5 && first_head >= 0 && first_head + kv_heads <= view.shape[1],
                  "kv_head_subview: heads [", first_head, ", ", first_head + kv_heads, ") of ",
                  describe(view));
  view.data = static_cast<uint8_t*>(view.data) +
              first_head * view.strides[1] * static_cast<int64_t>(dtype_size(view.dtype));
  view.shape[1] = kv_heads;
  return view;
}

}  // namespace m3msa::testkit
