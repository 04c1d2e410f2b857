/* A C ABI over the decode operations (ops.h): preprocessing, the indexer (scores + exact top-k
 * blocks) and block-sparse attention, on the CPU reference or one GPU, for engines that are not
 * written in C++. Conventions are those of runtime_c.h (m3msa_status, m3msa_last_error(),
 * m3msa_tensor, m3msa_batch); shapes and semantics are those of ops.h and docs/spec.md.
 *
 * Every struct here begins with `struct_size`: the caller sets it to sizeof(struct) of the header
 * it was compiled against (the *_init functions do), so fields can be appended in later versions
 * without breaking callers built against this one.
 *
 * An m3msa_ops object owns one executor. On a GPU it is planned at creation for the batches
 * within its limits: calls within them allocate nothing, and with validate_contents = 0 never
 * synchronize the host and can be captured into a CUDA graph. Calls on one object are serialized;
 * use one object per thread for concurrency. */
#ifndef M3MSA_OPS_C_H_
#define M3MSA_OPS_C_H_

#include <stddef.h>
#include <stdint.h>

#include "m3msa/runtime_c.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The library version: major * 10000 + minor * 100 + patch, and as "major.minor.patch". Compare
 * with M3MSA_VERSION_* of m3msa/version.h to detect a header / library mismatch. */
int32_t m3msa_version(void);
const char* m3msa_version_string(void);

/* SparseConfig (config.h): head counts local to this rank. */
typedef struct m3msa_sparse_config {
  size_t struct_size;
  int32_t q_heads, kv_heads, head_dim, index_heads, index_dim;
  int32_t block_size, topk, init_blocks, local_blocks, rope_dim;
  double rope_theta;
  float rms_eps;
} m3msa_sparse_config;

/* MiniMax-M3's values at TP 1, and struct_size. */
void m3msa_sparse_config_init(m3msa_sparse_config* config);

/* Where an m3msa_ops object runs and what it is planned for. */
typedef struct m3msa_ops_options {
  size_t struct_size;
  int32_t device_type;       /* 0: the CPU reference, 1: CUDA */
  int32_t device_index;      /* CUDA device */
  int32_t threads;           /* CPU worker threads (0: every hardware thread) */
  int32_t validate_contents; /* CUDA: 1 copies the batch metadata to the host and checks it before
                                each call (synchronizes); 0: shapes only (graph-capturable) */
  /* PlanLimits (cuda_backend.h): the largest batch a call may bring. */
  int32_t max_reqs;
  int32_t max_q_len;
  int64_t max_rows;    /* 0: max_reqs * max_q_len (decode) */
  int64_t max_context; /* tokens per request (0: unknown) */
} m3msa_ops_options;

/* CPU, all hardware threads, validate_contents 1, limits of one request of one row. */
void m3msa_ops_options_init(m3msa_ops_options* options);

typedef struct m3msa_ops m3msa_ops;

/* config is copied; every call on the object uses it. */
m3msa_status m3msa_ops_create(const m3msa_sparse_config* config, const m3msa_ops_options* options,
                              m3msa_ops** out);
void m3msa_ops_destroy(m3msa_ops* ops);

/* PreprocessArgs (ops.h). index_cache and index_q_out both not given: a layer without an index
 * part. */
typedef struct m3msa_preprocess_args {
  size_t struct_size;
  m3msa_tensor qkv, q_norm, k_norm, index_q_norm, index_k_norm, positions;
  m3msa_batch batch;
  m3msa_tensor kv_cache;
  float k_scale, v_scale;
  m3msa_tensor index_cache;
  m3msa_tensor q_out, index_q_out;
} m3msa_preprocess_args;

/* IndexerArgs (ops.h): topk_idx [rows, H, k] i32 out, descending key, -1 padded. */
typedef struct m3msa_indexer_args {
  size_t struct_size;
  m3msa_tensor index_q;
  m3msa_tensor index_cache;
  m3msa_batch batch;
  m3msa_tensor topk_idx;
} m3msa_indexer_args;

/* AttentionArgs (ops.h). topk_idx [rows, KVH, k] i32, any strides of its two outer axes (a
   head-major selection as a permuted view); not given: dense causal attention. */
typedef struct m3msa_attention_args {
  size_t struct_size;
  m3msa_tensor q;
  m3msa_tensor kv_cache;
  float k_scale, v_scale;
  m3msa_batch batch;
  m3msa_tensor topk_idx;
  m3msa_tensor out;
} m3msa_attention_args;

/* Zeroed, with struct_size set and the scales at 1. */
void m3msa_preprocess_args_init(m3msa_preprocess_args* args);
void m3msa_indexer_args_init(m3msa_indexer_args* args);
void m3msa_attention_args_init(m3msa_attention_args* args);

/* stream: the cudaStream_t the work is queued on (NULL: the legacy default stream); ignored on
 * the CPU, where the call returns when the work is done. Tensors must be on the object's device. */
m3msa_status m3msa_preprocess(m3msa_ops* ops, const m3msa_preprocess_args* args, void* stream);
m3msa_status m3msa_select_topk(m3msa_ops* ops, const m3msa_indexer_args* args, void* stream);
m3msa_status m3msa_sparse_attention(m3msa_ops* ops, const m3msa_attention_args* args, void* stream);

/* CUDA: the indexer's sticky device-side guard bits (cuda_backend.h; 0 on the CPU), cleared when
 * `clear` is non-zero. Synchronizes the object's last stream. */
m3msa_status m3msa_ops_device_status(m3msa_ops* ops, int clear, uint32_t* status);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* M3MSA_OPS_C_H_ */
