/* A C ABI over the runtime (runtime.h) and the in-process communicator (comm.h), for other
 * languages. Opaque handles; every function returns an m3msa_status, and on failure the calling
 * thread's m3msa_last_error() holds the message (with the rank where one applies). Nothing here
 * throws across the boundary. Shapes and semantics are those of runtime.h. */
#ifndef M3MSA_RUNTIME_C_H_
#define M3MSA_RUNTIME_C_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum m3msa_status {
  M3MSA_OK = 0,
  M3MSA_ERR_INVALID_ARGUMENT = 1,
  M3MSA_ERR_UNSUPPORTED = 2,
  M3MSA_ERR_TIMEOUT = 3,
  M3MSA_ERR_INTERNAL = 4,
} m3msa_status;

/* The message of the last failed call on this thread ("" after none). Valid until the thread's
 * next failing call. */
const char* m3msa_last_error(void);

/* ---- Tensors (views: the caller owns the storage) ---- */

typedef enum m3msa_dtype {
  M3MSA_F32 = 0,
  M3MSA_BF16 = 1,
  M3MSA_FP8E4M3 = 2,
  M3MSA_I32 = 3,
  M3MSA_I64 = 4,
  M3MSA_U64 = 5,
  M3MSA_U8 = 6,
} m3msa_dtype;

#define M3MSA_MAX_DIMS 6

/* ndim == 0 and data == NULL: "not given". strides == all zero: contiguous row-major.
 * device_type: 0 CPU, 1 CUDA. */
typedef struct m3msa_tensor {
  void* data;
  int32_t dtype;
  int32_t ndim;
  int64_t shape[M3MSA_MAX_DIMS];
  int64_t strides[M3MSA_MAX_DIMS];
  int32_t device_type;
  int32_t device_index;
} m3msa_tensor;

/* ---- Communicator: ranks as threads of one process ---- */

typedef struct m3msa_thread_group m3msa_thread_group;
typedef struct m3msa_comm m3msa_comm;

m3msa_status m3msa_thread_group_create(int world_size, int64_t timeout_ms,
                                       m3msa_thread_group** out);
void m3msa_thread_group_destroy(m3msa_thread_group* group);
/* A handle for rank `rank`; one thread drives it. Keeps the group alive. */
m3msa_status m3msa_thread_group_comm(m3msa_thread_group* group, int rank, m3msa_comm** out);
/* A world of one rank (TP = 1). */
m3msa_status m3msa_single_rank_comm(m3msa_comm** out);
void m3msa_comm_destroy(m3msa_comm* comm);

/* ---- Runtime ---- */

/* RuntimeConfig (runtime.h). Arrays are borrowed for the duration of the call. */
typedef struct m3msa_runtime_config {
  /* ModelConfig */
  int32_t hidden, num_layers, first_sparse_layer;
  int32_t q_heads, kv_heads, head_dim, index_heads, index_dim;
  int32_t block_size, topk, init_blocks, local_blocks, rope_dim;
  double rope_theta;
  float rms_eps;
  int32_t intermediate;
  /* options */
  int32_t pipeline_parallel_size;
  int32_t activation_dtype; /* m3msa_dtype */
  int32_t cache_block_size;
  const int32_t* token_buckets;
  int32_t num_token_buckets;
  const int32_t* query_lens;
  int32_t num_query_lens;
  int32_t max_requests;
  int64_t max_context;
  int32_t context_parallel;
  int32_t cp_transport; /* CpTransport: 0 peer, 1 nccl */
  int64_t cp_spin_budget_us;
  int32_t selection_share_period;
  int32_t tp_allreduce; /* TpAllReduce: 0 auto, 1 nccl, 2 peer */
  float swiglu_limit;
  int32_t threads;
  int32_t indexer_overlap; /* rank-local IndexerOverlap: 0 auto, 1 off, 2 on (CUDA, no CP) */
  /* ModelConfig: the mixture of experts and the dense MLP (docs/spec.md section 8) */
  int32_t num_experts, experts_per_token, moe_intermediate, shared_experts, dense_intermediate;
  float routed_scaling, activation_limit;
} m3msa_runtime_config;

/* Fills `config` with the C++ defaults (MiniMax-M3 dimensions, default buckets). The bucket and
 * query-length arrays point to static storage. */
void m3msa_runtime_config_default(m3msa_runtime_config* config);

/* LayerWeights (runtime.h). */
typedef struct m3msa_layer_weights {
  int32_t layer;
  m3msa_tensor qkv_proj, qkv_proj_scale;
  m3msa_tensor q_norm, k_norm, index_q_norm, index_k_norm;
  m3msa_tensor input_norm, post_attention_norm;
  m3msa_tensor o_proj, o_proj_scale;
  m3msa_tensor kv_cache;
  float k_scale, v_scale;
  m3msa_tensor index_cache;
  m3msa_tensor mlp_gate_up, mlp_down;
  /* The mixture of experts (optional; all zero: none): router f32, w13 / w2 bf16 or fp8 e4m3 with
   * u8 e8m0 scales (MXFP8). */
  m3msa_tensor router_weight, router_bias;
  m3msa_tensor experts_w13, experts_w13_scale, experts_w2, experts_w2_scale;
  m3msa_tensor shared_w13, shared_w13_scale, shared_w2, shared_w2_scale;
  /* A dense layer's MLP (layer < first_sparse_layer; all zero on a sparse layer): w13 / w2 bf16
   * or fp8 e4m3 with u8 e8m0 scales (MXFP8). A dense layer binds no index tensors. */
  m3msa_tensor dense_w13, dense_w13_scale, dense_w2, dense_w2_scale;
} m3msa_layer_weights;

/* BatchMeta (batch.h); kind: 0 decode, 1 prefill. */
typedef struct m3msa_batch {
  int32_t kind;
  int32_t num_reqs;
  int32_t q_len;
  int64_t num_tokens;
  m3msa_tensor seq_lens, cu_seqlens_q, context_lens;
  m3msa_tensor index_block_table, kv_block_table;
  m3msa_tensor slot_mapping, index_slot_mapping;
} m3msa_batch;

/* LayerCaches for detach (the replacement storage; must be empty; a dense layer has no
 * index_cache). */
typedef struct m3msa_layer_caches {
  int32_t layer;
  m3msa_tensor kv_cache;
  m3msa_tensor index_cache;
} m3msa_layer_caches;

typedef enum m3msa_prepare_result {
  M3MSA_PREPARE_SKIPPED = 0,
  M3MSA_PREPARE_NOT_READY = 1,
  M3MSA_PREPARE_ACTIVE = 2,
  M3MSA_PREPARE_FALLBACK = 3,
} m3msa_prepare_result;

typedef struct m3msa_runtime m3msa_runtime;

/* log: receives fallback / readiness lines (NULL: stderr); user is passed back. */
typedef void (*m3msa_log_fn)(const char* line, void* user);
m3msa_status m3msa_runtime_create(m3msa_log_fn log, void* user, m3msa_runtime** out);
/* Frees host memory only (never runs a collective): close on every rank first. */
void m3msa_runtime_destroy(m3msa_runtime* runtime);

/* comm must stay alive until close. result: an m3msa_prepare_result. */
m3msa_status m3msa_runtime_prepare(m3msa_runtime* runtime, const m3msa_runtime_config* config,
                                   const m3msa_layer_weights* layers, int num_layers,
                                   m3msa_comm* comm, int capturing, int has_metadata, int* result);
/* accepted: 1 when the runtime serves the step, 0 for a (counted) refusal. */
m3msa_status m3msa_runtime_begin_step(m3msa_runtime* runtime, const m3msa_batch* batch,
                                      int* accepted);
m3msa_status m3msa_runtime_forward_layer(m3msa_runtime* runtime, int layer,
                                         const m3msa_tensor* hidden, const m3msa_tensor* residual,
                                         const m3msa_tensor* positions);
m3msa_status m3msa_runtime_detach(m3msa_runtime* runtime, const m3msa_layer_caches* replacement,
                                  int num_replacement);
m3msa_status m3msa_runtime_close(m3msa_runtime* runtime);
/* state: 0 idle, 1 active, 2 fallback, 3 closed. */
m3msa_status m3msa_runtime_state(const m3msa_runtime* runtime, int* state);
/* The stats as one JSON object. Writes at most `capacity` bytes including the terminating NUL;
 * *needed gets the full size (NUL included), so a call with capacity 0 asks for the size. */
m3msa_status m3msa_runtime_stats_json(const m3msa_runtime* runtime, char* buffer, size_t capacity,
                                      size_t* needed);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* M3MSA_RUNTIME_C_H_ */
