// What every C ABI entry point shares (runtime_c.h, ops_c.h): C structs to C++ views, and every
// exception to a status plus the calling thread's last-error message. Internal to the library.
#pragma once

#include <cstddef>
#include <exception>
#include <new>
#include <string>

#include "m3msa/batch.h"
#include "m3msa/config.h"
#include "m3msa/error.h"
#include "m3msa/runtime_c.h"
#include "m3msa/tensor.h"

namespace m3msa::capi {

// The calling thread's message of its last failed call.
std::string& last_error();

m3msa_status status_of(ErrorCode code);

// Runs `body`; an exception becomes a status and the thread's last-error message.
template <typename Body>
m3msa_status guarded(Body&& body) {
  try {
    body();
    return M3MSA_OK;
  } catch (const Error& e) {
    last_error() = e.what();
    return status_of(e.code());
  } catch (const std::bad_alloc&) {
    last_error() = "m3msa: out of host memory";
    return M3MSA_ERR_INTERNAL;
  } catch (const std::exception& e) {
    last_error() = e.what();
    return M3MSA_ERR_INTERNAL;
  } catch (...) {
    last_error() = "m3msa: unknown exception";
    return M3MSA_ERR_INTERNAL;
  }
}

#define M3MSA_C_CHECK_NOT_NULL(ptr) M3MSA_CHECK_ARG((ptr) != nullptr, #ptr " must not be NULL")

// An extensible struct's struct_size must cover every field this library reads (callers set it to
// sizeof of the struct in the header they compiled against).
void check_struct_size(std::size_t given, std::size_t needed, const char* name);

// The SparseConfig fields of a C config struct (m3msa_sparse_config, m3msa_runtime_config: the
// same field names), in each direction.
template <typename C>
void sparse_fields_from_c(const C& c, SparseConfig& s) {
  s.q_heads = c.q_heads;
  s.kv_heads = c.kv_heads;
  s.head_dim = c.head_dim;
  s.index_heads = c.index_heads;
  s.index_dim = c.index_dim;
  s.block_size = c.block_size;
  s.topk = c.topk;
  s.init_blocks = c.init_blocks;
  s.local_blocks = c.local_blocks;
  s.rope_dim = c.rope_dim;
  s.rope_theta = c.rope_theta;
  s.rms_eps = c.rms_eps;
}

template <typename C>
void sparse_fields_to_c(const SparseConfig& s, C& c) {
  c.q_heads = s.q_heads;
  c.kv_heads = s.kv_heads;
  c.head_dim = s.head_dim;
  c.index_heads = s.index_heads;
  c.index_dim = s.index_dim;
  c.block_size = s.block_size;
  c.topk = s.topk;
  c.init_blocks = s.init_blocks;
  c.local_blocks = s.local_blocks;
  c.rope_dim = s.rope_dim;
  c.rope_theta = s.rope_theta;
  c.rms_eps = s.rms_eps;
}

DType to_dtype(int32_t dtype);
TensorView to_view(const m3msa_tensor& t, const char* name);
BatchMeta to_batch(const m3msa_batch& b);

}  // namespace m3msa::capi
