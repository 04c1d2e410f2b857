/* The C ABI of the decode operations (ops_c.h) from a C program: one request of 300 tokens, one
 * index head; the selection must be the own block, then the other visible blocks, then -1. */
#include <stdio.h>
#include <string.h>

#include "m3msa/ops_c.h"
#include "m3msa/version.h"

static m3msa_tensor tensor(void* data, int32_t dtype, int32_t ndim, const int64_t* shape) {
  m3msa_tensor t;
  memset(&t, 0, sizeof(t));
  t.data = data;
  t.dtype = dtype;
  t.ndim = ndim;
  for (int d = 0; d < ndim; ++d) t.shape[d] = shape[d];
  return t;
}

int main(void) {
  if (m3msa_version() != M3MSA_VERSION_MAJOR * 10000 + M3MSA_VERSION_MINOR * 100 +
                             M3MSA_VERSION_PATCH) {
    printf("version mismatch: library %s, header %s\n", m3msa_version_string(),
           M3MSA_VERSION_STRING);
    return 1;
  }
  m3msa_sparse_config config;
  m3msa_sparse_config_init(&config);
  config.q_heads = 8;
  config.kv_heads = 1;
  config.index_heads = 1;
  config.topk = 4;
  m3msa_ops_options options;
  m3msa_ops_options_init(&options);
  options.threads = 1;
  m3msa_ops* ops = NULL;
  if (m3msa_ops_create(&config, &options, &ops) != M3MSA_OK) {
    printf("create: %s\n", m3msa_last_error());
    return 1;
  }
  enum { kPages = 3, kBlock = 128, kDim = 128 };
  static uint16_t cache[kPages * kBlock * kDim];
  static uint16_t query[kDim];
  for (int i = 0; i < kPages * kBlock * kDim; ++i) cache[i] = 0x3F80; /* bf16 1.0 */
  for (int i = 0; i < kDim; ++i) query[i] = 0x3F80;
  int32_t seq_len = 300; /* blocks 0, 1 and the own block 2 */
  int32_t table[3] = {2, 0, 1};
  int32_t topk[4] = {7, 7, 7, 7};
  const int64_t cache_shape[3] = {kPages, kBlock, kDim};
  const int64_t q_shape[3] = {1, 1, kDim};
  const int64_t one[1] = {1};
  const int64_t table_shape[2] = {1, 3};
  const int64_t out_shape[3] = {1, 1, 4};
  m3msa_indexer_args args;
  m3msa_indexer_args_init(&args);
  args.index_q = tensor(query, M3MSA_BF16, 3, q_shape);
  args.index_cache = tensor(cache, M3MSA_BF16, 3, cache_shape);
  args.batch.kind = 0;
  args.batch.num_reqs = 1;
  args.batch.q_len = 1;
  args.batch.seq_lens = tensor(&seq_len, M3MSA_I32, 1, one);
  args.batch.index_block_table = tensor(table, M3MSA_I32, 2, table_shape);
  args.topk_idx = tensor(topk, M3MSA_I32, 3, out_shape);
  if (m3msa_select_topk(ops, &args, NULL) != M3MSA_OK) {
    printf("select_topk: %s\n", m3msa_last_error());
    return 1;
  }
  /* Equal scores: the own block (forced) first, then the lower ids. */
  if (topk[0] != 2 || topk[1] != 0 || topk[2] != 1 || topk[3] != -1) {
    printf("selection %d %d %d %d, expected 2 0 1 -1\n", topk[0], topk[1], topk[2], topk[3]);
    return 1;
  }
  args.struct_size = 0;
  if (m3msa_select_topk(ops, &args, NULL) != M3MSA_ERR_INVALID_ARGUMENT ||
      strstr(m3msa_last_error(), "struct_size") == NULL) {
    printf("struct_size 0 was not refused by name: %s\n", m3msa_last_error());
    return 1;
  }
  m3msa_ops_destroy(ops);
  printf("C consumer ok: m3msa %s\n", m3msa_version_string());
  return 0;
}
