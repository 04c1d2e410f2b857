// Conversions and error handling shared by the C ABI entry points (c_api_common.h).
#include "c_api_common.h"

namespace m3msa::capi {

std::string& last_error() {
  thread_local std::string message;
  return message;
}

m3msa_status status_of(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return M3MSA_ERR_INVALID_ARGUMENT;
    case ErrorCode::kUnsupported: return M3MSA_ERR_UNSUPPORTED;
    case ErrorCode::kTimeout: return M3MSA_ERR_TIMEOUT;
    case ErrorCode::kInternal: return M3MSA_ERR_INTERNAL;
  }
  return M3MSA_ERR_INTERNAL;
}

void check_struct_size(std::size_t given, std::size_t needed, const char* name) {
  M3MSA_CHECK_ARG(given >= needed, name, ".struct_size must be sizeof(", name, ") = ", needed,
                  " (set by the header's *_default / *_init functions), got ", given);
}

DType to_dtype(int32_t dtype) {
  M3MSA_CHECK_ARG(dtype >= M3MSA_F32 && dtype <= M3MSA_U8, "unknown m3msa_dtype ", dtype);
  return static_cast<DType>(dtype);
}

TensorView to_view(const m3msa_tensor& t, const char* name) {
  TensorView view;
  if (t.ndim == 0 && t.data == nullptr) return view;  // not given
  M3MSA_CHECK_ARG(t.ndim >= 0 && t.ndim <= M3MSA_MAX_DIMS, name, ": ndim must be in [0, ",
                  M3MSA_MAX_DIMS, "], got ", t.ndim);
  M3MSA_CHECK_ARG(t.device_type == 0 || t.device_type == 1, name, ": unknown device_type ",
                  t.device_type);
  view.data = t.data;
  view.dtype = to_dtype(t.dtype);
  view.ndim = t.ndim;
  view.device = {static_cast<DeviceType>(t.device_type), t.device_index};
  bool strides_given = false;
  for (int d = 0; d < t.ndim; ++d) strides_given = strides_given || t.strides[d] != 0;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    M3MSA_CHECK_ARG(t.shape[d] >= 0, name, ": negative extent ", t.shape[d], " in dimension ", d);
    view.shape[d] = t.shape[d];
    view.strides[d] = strides_given ? t.strides[d] : stride;
    stride *= t.shape[d];
  }
  return view;
}

BatchMeta to_batch(const m3msa_batch& b) {
  M3MSA_CHECK_ARG(b.kind == 0 || b.kind == 1, "batch.kind must be 0 (decode) or 1 (prefill), got ",
                  b.kind);
  BatchMeta batch;
  batch.kind = static_cast<BatchKind>(b.kind);
  batch.num_reqs = b.num_reqs;
  batch.q_len = b.q_len;
  batch.num_tokens = b.num_tokens;
  batch.seq_lens = to_view(b.seq_lens, "batch.seq_lens");
  batch.cu_seqlens_q = to_view(b.cu_seqlens_q, "batch.cu_seqlens_q");
  batch.context_lens = to_view(b.context_lens, "batch.context_lens");
  batch.index_block_table = to_view(b.index_block_table, "batch.index_block_table");
  batch.kv_block_table = to_view(b.kv_block_table, "batch.kv_block_table");
  batch.slot_mapping = to_view(b.slot_mapping, "batch.slot_mapping");
  batch.index_slot_mapping = to_view(b.index_slot_mapping, "batch.index_slot_mapping");
  return batch;
}

}  // namespace m3msa::capi
