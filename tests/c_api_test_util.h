// C++ views -> the C ABI's structs (runtime_c.h, ops_c.h), for the tests of both.
#pragma once

#include <cstring>

#include "m3msa/batch.h"
#include "m3msa/runtime_c.h"
#include "m3msa/tensor.h"

namespace m3msa::capitest {

// strides 0 (contiguous) unless the view is not.
inline m3msa_tensor c_tensor(const TensorView& v) {
  m3msa_tensor t;
  std::memset(&t, 0, sizeof(t));
  if (!v.defined()) return t;
  t.data = v.data;
  t.dtype = static_cast<int32_t>(v.dtype);
  t.ndim = v.ndim;
  t.device_type = static_cast<int32_t>(v.device.type);
  t.device_index = v.device.index;
  int64_t stride = 1;
  bool contiguous = true;
  for (int d = v.ndim - 1; d >= 0; --d) {
    contiguous = contiguous && (v.shape[d] <= 1 || v.strides[d] == stride);
    stride *= v.shape[d];
  }
  for (int d = 0; d < v.ndim; ++d) {
    t.shape[d] = v.shape[d];
    t.strides[d] = contiguous ? 0 : v.strides[d];
  }
  return t;
}

inline m3msa_batch c_batch(const BatchMeta& b) {
  m3msa_batch c;
  std::memset(&c, 0, sizeof(c));
  c.kind = static_cast<int32_t>(b.kind);
  c.num_reqs = b.num_reqs;
  c.q_len = b.q_len;
  c.num_tokens = b.num_tokens;
  c.seq_lens = c_tensor(b.seq_lens);
  c.cu_seqlens_q = c_tensor(b.cu_seqlens_q);
  c.context_lens = c_tensor(b.context_lens);
  c.index_block_table = c_tensor(b.index_block_table);
  c.kv_block_table = c_tensor(b.kv_block_table);
  c.slot_mapping = c_tensor(b.slot_mapping);
  c.index_slot_mapping = c_tensor(b.index_slot_mapping);
  return c;
}

}  // namespace m3msa::capitest
