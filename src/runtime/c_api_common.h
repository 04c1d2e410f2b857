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

// Copies the SparseConfig fields between a C config struct (m3msa_sparse_config,
// m3msa_runtime_config) and a SparseConfig, in either direction: they share the field names.
template <typename From, typename To>
void copy_sparse_fields(const From& from, To& to) {
  to.q_heads = from.q_heads;
  to.kv_heads = from.kv_heads;
  to.head_dim = from.head_dim;
  to.index_heads = from.index_heads;
  to.index_dim = from.index_dim;
  to.block_size = from.block_size;
  to.topk = from.topk;
  to.init_blocks = from.init_blocks;
  to.local_blocks = from.local_blocks;
  to.rope_dim = from.rope_dim;
  to.rope_theta = from.rope_theta;
  to.rms_eps = from.rms_eps;
}

DType to_dtype(int32_t dtype);
TensorView to_view(const m3msa_tensor& t, const char* name);
BatchMeta to_batch(const m3msa_batch& b);

}  // namespace m3msa::capi
