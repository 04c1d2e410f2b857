// The C ABI of runtime_c.h: converts the C structs to the C++ ones and every exception to a
// status plus a thread-local message.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "c_api_common.h"
#include "m3msa/comm.h"
#include "m3msa/error.h"
#include "m3msa/runtime.h"
#include "m3msa/runtime_c.h"

struct m3msa_thread_group {
  std::shared_ptr<m3msa::ThreadGroup> group;
};

struct m3msa_comm {
  std::unique_ptr<m3msa::Communicator> comm;
};

struct m3msa_runtime {
  std::unique_ptr<m3msa::Runtime> runtime;
};

namespace {

using m3msa::capi::guarded;
using m3msa::capi::to_batch;
using m3msa::capi::to_dtype;
using m3msa::capi::to_view;

m3msa::RuntimeConfig to_config(const m3msa_runtime_config& c) {
  m3msa::RuntimeConfig config;
  m3msa::ModelConfig& m = config.model;
  m.hidden = c.hidden;
  m.num_layers = c.num_layers;
  m.first_sparse_layer = c.first_sparse_layer;
  m3msa::capi::copy_sparse_fields(c, m);
  m.intermediate = c.intermediate;
  m.num_experts = c.num_experts;
  m.experts_per_token = c.experts_per_token;
  m.moe_intermediate = c.moe_intermediate;
  m.shared_experts = c.shared_experts;
  m.dense_intermediate = c.dense_intermediate;
  m.routed_scaling = c.routed_scaling;
  m.activation_limit = c.activation_limit;
  config.pipeline_parallel_size = c.pipeline_parallel_size;
  config.activation_dtype = to_dtype(c.activation_dtype);
  config.cache_block_size = c.cache_block_size;
  M3MSA_CHECK_ARG(c.num_token_buckets >= 0 && (c.num_token_buckets == 0 || c.token_buckets),
                  "config.token_buckets: ", c.num_token_buckets, " entries at a NULL pointer");
  M3MSA_CHECK_ARG(c.num_query_lens >= 0 && (c.num_query_lens == 0 || c.query_lens),
                  "config.query_lens: ", c.num_query_lens, " entries at a NULL pointer");
  config.token_buckets.assign(c.token_buckets, c.token_buckets + c.num_token_buckets);
  config.query_lens.assign(c.query_lens, c.query_lens + c.num_query_lens);
  config.max_requests = c.max_requests;
  config.max_context = c.max_context;
  config.context_parallel = c.context_parallel != 0;
  config.cp_transport = static_cast<m3msa::CpTransport>(c.cp_transport);
  config.cp_spin_budget = std::chrono::microseconds(c.cp_spin_budget_us);
  config.selection_share_period = c.selection_share_period;
  config.tp_allreduce = static_cast<m3msa::TpAllReduce>(c.tp_allreduce);
  config.swiglu_limit = c.swiglu_limit;
  config.threads = c.threads;
  config.indexer_overlap = static_cast<m3msa::IndexerOverlap>(c.indexer_overlap);
  return config;
}

m3msa::LayerWeights to_layer(const m3msa_layer_weights& w) {
  m3msa::LayerWeights out;
  out.layer = w.layer;
  out.qkv_proj = to_view(w.qkv_proj, "qkv_proj");
  out.qkv_proj_scale = to_view(w.qkv_proj_scale, "qkv_proj_scale");
  out.q_norm = to_view(w.q_norm, "q_norm");
  out.k_norm = to_view(w.k_norm, "k_norm");
  out.index_q_norm = to_view(w.index_q_norm, "index_q_norm");
  out.index_k_norm = to_view(w.index_k_norm, "index_k_norm");
  out.input_norm = to_view(w.input_norm, "input_norm");
  out.post_attention_norm = to_view(w.post_attention_norm, "post_attention_norm");
  out.o_proj = to_view(w.o_proj, "o_proj");
  out.o_proj_scale = to_view(w.o_proj_scale, "o_proj_scale");
  out.kv_cache = {to_view(w.kv_cache, "kv_cache"), w.k_scale, w.v_scale};
  out.index_cache = {to_view(w.index_cache, "index_cache")};
  out.mlp_gate_up = to_view(w.mlp_gate_up, "mlp_gate_up");
  out.mlp_down = to_view(w.mlp_down, "mlp_down");
  out.router_weight = to_view(w.router_weight, "router_weight");
  out.router_bias = to_view(w.router_bias, "router_bias");
  out.experts = {
      to_view(w.experts_w13, "experts_w13"), to_view(w.experts_w13_scale, "experts_w13_scale"),
      to_view(w.experts_w2, "experts_w2"), to_view(w.experts_w2_scale, "experts_w2_scale")};
  out.shared_expert = {
      to_view(w.shared_w13, "shared_w13"), to_view(w.shared_w13_scale, "shared_w13_scale"),
      to_view(w.shared_w2, "shared_w2"), to_view(w.shared_w2_scale, "shared_w2_scale")};
  out.dense_mlp = {to_view(w.dense_w13, "dense_w13"), to_view(w.dense_w13_scale, "dense_w13_scale"),
                   to_view(w.dense_w2, "dense_w2"), to_view(w.dense_w2_scale, "dense_w2_scale")};
  return out;
}

}  // namespace

extern "C" {

const char* m3msa_last_error(void) {
  return m3msa::capi::last_error().c_str();
}

m3msa_status m3msa_thread_group_create(int world_size, int64_t timeout_ms,
                                       m3msa_thread_group** out) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(out);
    *out = nullptr;
    auto group = m3msa::ThreadGroup::create(world_size, std::chrono::milliseconds(timeout_ms));
    *out = new m3msa_thread_group{std::move(group)};
  });
}

void m3msa_thread_group_destroy(m3msa_thread_group* group) {
  delete group;
}

m3msa_status m3msa_thread_group_comm(m3msa_thread_group* group, int rank, m3msa_comm** out) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(group);
    M3MSA_C_CHECK_NOT_NULL(out);
    *out = nullptr;
    auto comm = group->group->communicator(rank);
    *out = new m3msa_comm{std::move(comm)};
  });
}

m3msa_status m3msa_single_rank_comm(m3msa_comm** out) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(out);
    *out = new m3msa_comm{m3msa::make_single_rank_communicator()};
  });
}

void m3msa_comm_destroy(m3msa_comm* comm) {
  delete comm;
}

void m3msa_runtime_config_default(m3msa_runtime_config* config) {
  if (config == nullptr) return;
  static const m3msa::RuntimeConfig defaults;
  static const std::vector<int32_t> buckets(defaults.token_buckets.begin(),
                                            defaults.token_buckets.end());
  static const std::vector<int32_t> query_lens(defaults.query_lens.begin(),
                                               defaults.query_lens.end());
  const m3msa::ModelConfig& m = defaults.model;
  std::memset(config, 0, sizeof(*config));
  config->hidden = m.hidden;
  config->num_layers = m.num_layers;
  config->first_sparse_layer = m.first_sparse_layer;
  m3msa::capi::copy_sparse_fields(m, *config);
  config->intermediate = m.intermediate;
  config->num_experts = m.num_experts;
  config->experts_per_token = m.experts_per_token;
  config->moe_intermediate = m.moe_intermediate;
  config->shared_experts = m.shared_experts;
  config->dense_intermediate = m.dense_intermediate;
  config->routed_scaling = m.routed_scaling;
  config->activation_limit = m.activation_limit;
  config->pipeline_parallel_size = defaults.pipeline_parallel_size;
  config->activation_dtype = static_cast<int32_t>(defaults.activation_dtype);
  config->cache_block_size = defaults.cache_block_size;
  config->token_buckets = buckets.data();
  config->num_token_buckets = static_cast<int32_t>(buckets.size());
  config->query_lens = query_lens.data();
  config->num_query_lens = static_cast<int32_t>(query_lens.size());
  config->max_requests = defaults.max_requests;
  config->max_context = defaults.max_context;
  config->context_parallel = defaults.context_parallel ? 1 : 0;
  config->cp_transport = static_cast<int32_t>(defaults.cp_transport);
  config->cp_spin_budget_us = defaults.cp_spin_budget.count();
  config->selection_share_period = defaults.selection_share_period;
  config->tp_allreduce = static_cast<int32_t>(defaults.tp_allreduce);
  config->swiglu_limit = defaults.swiglu_limit;
  config->threads = defaults.threads;
  config->indexer_overlap = static_cast<int32_t>(defaults.indexer_overlap);
}

m3msa_status m3msa_runtime_create(m3msa_log_fn log, void* user, m3msa_runtime** out) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(out);
    *out = nullptr;
    m3msa::Runtime::LogSink sink;
    if (log != nullptr) sink = [log, user](const std::string& line) { log(line.c_str(), user); };
    *out = new m3msa_runtime{std::make_unique<m3msa::Runtime>(std::move(sink))};
  });
}

void m3msa_runtime_destroy(m3msa_runtime* runtime) {
  delete runtime;
}

m3msa_status m3msa_runtime_prepare(m3msa_runtime* runtime, const m3msa_runtime_config* config,
                                   const m3msa_layer_weights* layers, int num_layers,
                                   m3msa_comm* comm, int capturing, int has_metadata, int* result) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(runtime);
    M3MSA_C_CHECK_NOT_NULL(config);
    M3MSA_C_CHECK_NOT_NULL(comm);
    M3MSA_C_CHECK_NOT_NULL(result);
    M3MSA_CHECK_ARG(num_layers >= 0 && (num_layers == 0 || layers != nullptr),
                    "layers: ", num_layers, " entries at a NULL pointer");
    m3msa::ModelWeights model;
    for (int i = 0; i < num_layers; ++i) model.layers.push_back(to_layer(layers[i]));
    m3msa::StepContext step;
    step.capturing = capturing != 0;
    step.has_metadata = has_metadata != 0;
    *result =
        static_cast<int>(runtime->runtime->prepare(model, to_config(*config), *comm->comm, step));
  });
}

m3msa_status m3msa_runtime_begin_step(m3msa_runtime* runtime, const m3msa_batch* batch,
                                      int* accepted) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(runtime);
    M3MSA_C_CHECK_NOT_NULL(batch);
    M3MSA_C_CHECK_NOT_NULL(accepted);
    *accepted = runtime->runtime->begin_step(to_batch(*batch)) ? 1 : 0;
  });
}

m3msa_status m3msa_runtime_forward_layer(m3msa_runtime* runtime, int layer,
                                         const m3msa_tensor* hidden, const m3msa_tensor* residual,
                                         const m3msa_tensor* positions) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(runtime);
    M3MSA_C_CHECK_NOT_NULL(hidden);
    M3MSA_C_CHECK_NOT_NULL(residual);
    M3MSA_C_CHECK_NOT_NULL(positions);
    runtime->runtime->forward_layer(layer, to_view(*hidden, "hidden"),
                                    to_view(*residual, "residual"),
                                    to_view(*positions, "positions"));
  });
}

m3msa_status m3msa_runtime_detach(m3msa_runtime* runtime, const m3msa_layer_caches* replacement,
                                  int num_replacement) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(runtime);
    M3MSA_CHECK_ARG(num_replacement >= 0 && (num_replacement == 0 || replacement != nullptr),
                    "replacement: ", num_replacement, " entries at a NULL pointer");
    std::vector<m3msa::LayerCaches> caches;
    for (int i = 0; i < num_replacement; ++i) {
      m3msa::LayerCaches c;
      c.layer = replacement[i].layer;
      c.kv_cache.data = to_view(replacement[i].kv_cache, "replacement.kv_cache");
      c.index_cache.data = to_view(replacement[i].index_cache, "replacement.index_cache");
      caches.push_back(c);
    }
    runtime->runtime->detach(caches);
  });
}

m3msa_status m3msa_runtime_close(m3msa_runtime* runtime) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(runtime);
    runtime->runtime->close();
  });
}

m3msa_status m3msa_runtime_state(const m3msa_runtime* runtime, int* state) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(runtime);
    M3MSA_C_CHECK_NOT_NULL(state);
    *state = static_cast<int>(runtime->runtime->state());
  });
}

m3msa_status m3msa_runtime_stats_json(const m3msa_runtime* runtime, char* buffer, size_t capacity,
                                      size_t* needed) {
  return guarded([&] {
    M3MSA_C_CHECK_NOT_NULL(runtime);
    M3MSA_C_CHECK_NOT_NULL(needed);
    const std::string json = runtime->runtime->stats().to_json();
    *needed = json.size() + 1;
    if (capacity == 0) return;
    M3MSA_C_CHECK_NOT_NULL(buffer);
    const std::size_t n = std::min(capacity - 1, json.size());
    std::memcpy(buffer, json.data(), n);
    buffer[n] = '\0';
  });
}

}  // extern "C"
