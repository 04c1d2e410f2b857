// rank_layout (runtime.h): the one statement of which heads and weight rows a rank holds.
#include "m3msa/error.h"
#include "m3msa/runtime.h"

namespace m3msa {

namespace {

// The first of the `per_rank` heads of `total` rank `rank` holds: split evenly when tp_size
// divides total, replicated (tp_size / total ranks per head) when tp_size is a multiple of it.
int first_head(int total, int rank, int tp_size) {
  return tp_size <= total ? rank * (total / tp_size) : rank / (tp_size / total);
}

}  // namespace

RankLayout rank_layout(const ModelConfig& model, int tp_rank, int tp_size, bool context_parallel) {
  const SparseConfig sc = model.sparse(tp_size, context_parallel);  // checks the split
  M3MSA_CHECK_ARG(tp_rank >= 0 && tp_rank < tp_size, "tp_rank ", tp_rank, " outside [0, ", tp_size,
                  ")");
  RankLayout l;
  l.tp_rank = tp_rank;
  l.tp_size = tp_size;
  l.context_parallel = context_parallel;
  l.q_heads = sc.q_heads;
  l.first_q_head = tp_rank * sc.q_heads;
  l.kv_heads = sc.kv_heads;
  l.first_kv_head = first_head(model.kv_heads, tp_rank, tp_size);
  l.index_heads = sc.index_heads;
  l.first_index_head = context_parallel ? 0 : first_head(model.index_heads, tp_rank, tp_size);
  const int64_t hd = model.head_dim;
  const int64_t id = model.index_dim;
  l.q_rows = {l.first_q_head * hd, l.q_heads * hd};
  l.k_rows = {l.first_kv_head * hd, l.kv_heads * hd};
  l.v_rows = l.k_rows;
  l.index_q_rows = {l.first_index_head * id, l.index_heads * id};
  l.index_k_rows = {0, id};
  l.o_proj_cols = l.q_rows;
  const int64_t inter = model.intermediate / tp_size;
  l.mlp_rows = {tp_rank * inter, inter};
  l.dense_qkv_width = l.q_rows.count + l.k_rows.count + l.v_rows.count;
  const int64_t dense = model.dense_intermediate / tp_size;
  l.dense_mlp_rows = {tp_rank * dense, dense};
  return l;
}

}  // namespace m3msa
