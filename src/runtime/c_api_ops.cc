// The C ABI of ops_c.h: one Backend per m3msa_ops object (the CPU reference, or a CudaBackend
// planned at creation), the C argument structs converted to ops.h's.
#include <cstring>
#include <memory>
#include <mutex>

#include "c_api_common.h"
#include "m3msa/backend.h"
#include "m3msa/cuda_backend.h"
#include "m3msa/ops.h"
#include "m3msa/ops_c.h"
#include "m3msa/version.h"

struct m3msa_ops {
  m3msa::SparseConfig config;
  std::unique_ptr<m3msa::Backend> backend;
  m3msa::CudaBackend* cuda = nullptr;  // backend, when it runs on a GPU
  std::mutex mutex;                    // one call at a time: the stream and workspaces are shared
};

namespace {

using m3msa::capi::check_struct_size;
using m3msa::capi::guarded;
using m3msa::capi::to_batch;
using m3msa::capi::to_view;

// cudaStreamLegacy (driver_types.h), spelled out so this file needs no CUDA headers: a NULL
// stream means the caller's default stream, which a backend would read as its own stream.
void* const kLegacyStream = reinterpret_cast<void*>(uintptr_t{1});

m3msa::SparseConfig to_sparse_config(const m3msa_sparse_config& c) {
  check_struct_size(c.struct_size, sizeof(m3msa_sparse_config), "m3msa_sparse_config");
  m3msa::SparseConfig s;
  m3msa::capi::copy_sparse_fields(c, s);
  s.validate();
  return s;
}

// Runs `body(backend)` under the object's lock with the call's stream set.
template <typename Body>
void run_on(m3msa_ops* ops, void* stream, Body&& body) {
  std::lock_guard<std::mutex> lock(ops->mutex);
  if (ops->cuda != nullptr) ops->cuda->set_stream(stream != nullptr ? stream : kLegacyStream);
  body(*ops->backend);
}

}  // namespace

extern "C" {

int32_t m3msa_version(void) {
  return m3msa::kVersionMajor * 10000 + m3msa::kVersionMinor * 100 + m3msa::kVersionPatch;
}

const char* m3msa_version_string(void) {
  return m3msa::kVersionString;
}

void m3msa_sparse_config_init(m3msa_sparse_config* config) {
  if (config == nullptr) return;
  std::memset(config, 0, sizeof(*config));
  config->struct_size = sizeof(*config);
  m3msa::capi::copy_sparse_fields(m3msa::SparseConfig{}, *config);
}

void m3msa_ops_options_init(m3msa_ops_options* options) {
  if (options == nullptr) return;
  std::memset(options, 0, sizeof(*options));
  options->struct_size = sizeof(*options);
  options->validate_contents = 1;
  options->max_reqs = 1;
  options->max_q_len = 1;
}

m3msa_status m3msa_ops_create(const m3msa_sparse_config* config, const m3msa_ops_options* options,
                              m3msa_ops** out) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(config);
    M3MSA_C_CHECK_NOT_NULL(options);
    M3MSA_C_CHECK_NOT_NULL(out);
    *out = nullptr;
    check_struct_size(options->struct_size, sizeof(m3msa_ops_options), "m3msa_ops_options");
    auto ops = std::make_unique<m3msa_ops>();
    ops->config = to_sparse_config(*config);
    if (options->device_type == 0) {
      M3MSA_CHECK_ARG(options->threads >= 0, "options.threads must be >= 0, got ",
                      options->threads);
      ops->backend = m3msa::make_cpu_backend(options->threads);
    } else {
      M3MSA_CHECK_ARG(options->device_type == 1,
                      "options.device_type must be 0 (CPU) or 1 (CUDA), got ",
                      options->device_type);
      M3MSA_CHECK_ARG(options->device_index >= 0, "options.device_index must be >= 0, got ",
                      options->device_index);
      M3MSA_CHECK_ARG(options->max_reqs >= 1, "options.max_reqs must be >= 1, got ",
                      options->max_reqs);
      M3MSA_CHECK_ARG(options->max_q_len >= 1, "options.max_q_len must be >= 1, got ",
                      options->max_q_len);
      M3MSA_CHECK_ARG(options->max_rows >= 0, "options.max_rows must be >= 0, got ",
                      options->max_rows);
      M3MSA_CHECK_ARG(options->max_context >= 0, "options.max_context must be >= 0, got ",
                      options->max_context);
      std::unique_ptr<m3msa::CudaBackend> cuda = m3msa::make_cuda_backend(options->device_index);
      m3msa::PlanLimits limits;
      limits.max_reqs = options->max_reqs;
      limits.max_q_len = options->max_q_len;
      limits.max_rows = options->max_rows;
      limits.max_context = options->max_context;
      cuda->plan(ops->config, limits);
      cuda->set_validate_contents(options->validate_contents != 0);
      ops->cuda = cuda.get();
      ops->backend = std::move(cuda);
    }
    *out = ops.release();
  });
}

void m3msa_ops_destroy(m3msa_ops* ops) {
  delete ops;
}

void m3msa_preprocess_args_init(m3msa_preprocess_args* args) {
  if (args == nullptr) return;
  std::memset(args, 0, sizeof(*args));
  args->struct_size = sizeof(*args);
  args->k_scale = 1.0f;
  args->v_scale = 1.0f;
}

void m3msa_indexer_args_init(m3msa_indexer_args* args) {
  if (args == nullptr) return;
  std::memset(args, 0, sizeof(*args));
  args->struct_size = sizeof(*args);
}

void m3msa_attention_args_init(m3msa_attention_args* args) {
  if (args == nullptr) return;
  std::memset(args, 0, sizeof(*args));
  args->struct_size = sizeof(*args);
  args->k_scale = 1.0f;
  args->v_scale = 1.0f;
}

m3msa_status m3msa_preprocess(m3msa_ops* ops, const m3msa_preprocess_args* args, void* stream) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(ops);
    M3MSA_C_CHECK_NOT_NULL(args);
    check_struct_size(args->struct_size, sizeof(m3msa_preprocess_args), "m3msa_preprocess_args");
    m3msa::PreprocessArgs a;
    a.qkv = to_view(args->qkv, "qkv");
    a.q_norm = to_view(args->q_norm, "q_norm");
    a.k_norm = to_view(args->k_norm, "k_norm");
    a.index_q_norm = to_view(args->index_q_norm, "index_q_norm");
    a.index_k_norm = to_view(args->index_k_norm, "index_k_norm");
    a.positions = to_view(args->positions, "positions");
    a.batch = to_batch(args->batch);
    a.kv_cache.data = to_view(args->kv_cache, "kv_cache");
    a.kv_cache.k_scale = args->k_scale;
    a.kv_cache.v_scale = args->v_scale;
    a.index_cache.data = to_view(args->index_cache, "index_cache");
    a.q_out = to_view(args->q_out, "q_out");
    a.index_q_out = to_view(args->index_q_out, "index_q_out");
    run_on(ops, stream, [&](m3msa::Backend& b) { b.preprocess(ops->config, a); });
  });
}

m3msa_status m3msa_select_topk(m3msa_ops* ops, const m3msa_indexer_args* args, void* stream) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(ops);
    M3MSA_C_CHECK_NOT_NULL(args);
    check_struct_size(args->struct_size, sizeof(m3msa_indexer_args), "m3msa_indexer_args");
    m3msa::IndexerArgs a;
    a.index_q = to_view(args->index_q, "index_q");
    a.index_cache.data = to_view(args->index_cache, "index_cache");
    a.batch = to_batch(args->batch);
    a.topk_idx = to_view(args->topk_idx, "topk_idx");
    run_on(ops, stream, [&](m3msa::Backend& b) { b.select_topk(ops->config, a); });
  });
}

m3msa_status m3msa_sparse_attention(m3msa_ops* ops, const m3msa_attention_args* args,
                                    void* stream) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(ops);
    M3MSA_C_CHECK_NOT_NULL(args);
    check_struct_size(args->struct_size, sizeof(m3msa_attention_args), "m3msa_attention_args");
    m3msa::AttentionArgs a;
    a.q = to_view(args->q, "q");
    a.kv_cache.data = to_view(args->kv_cache, "kv_cache");
    a.kv_cache.k_scale = args->k_scale;
    a.kv_cache.v_scale = args->v_scale;
    a.batch = to_batch(args->batch);
    a.topk_idx = to_view(args->topk_idx, "topk_idx");
    a.out = to_view(args->out, "out");
    run_on(ops, stream, [&](m3msa::Backend& b) { b.sparse_attention(ops->config, a); });
  });
}

m3msa_status m3msa_ops_device_status(m3msa_ops* ops, int clear, uint32_t* status) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(ops);
    M3MSA_C_CHECK_NOT_NULL(status);
    std::lock_guard<std::mutex> lock(ops->mutex);
    *status = ops->cuda != nullptr ? ops->cuda->indexer_device_status(clear != 0) : 0u;
  });
}

}  // extern "C"
