// Model and sparse-attention configuration with MiniMax-M3 defaults (docs/spec.md section 1).
// Every number is a validated field; nothing downstream hard-codes an M3 constant.
#pragma once

#include <cstdint>
#include <string>

namespace m3msa {

// What one sparse layer's kernels need, with head counts *local to one rank*.
// index_heads == kv_heads (index head h selects for KV head h), except in the view of one rank
// under indexer-only context parallelism (docs/context_parallel.md): every rank projects and scores
// all H index heads over its shard of the blocks while it attends only its H/P KV heads, so
// index_heads is then a multiple of kv_heads (ModelConfig::sparse(P, true)).
struct SparseConfig {
  int q_heads = 64;  // query heads on this rank
  int kv_heads = 4;  // KV heads on this rank
  int head_dim = 128;
  int index_heads = 4;  // index heads projected and scored on this rank
  int index_dim = 128;
  int block_size = 128;  // tokens per sparse block == tokens per cache page
  int topk = 16;         // blocks selected per (row, kv head)
  int init_blocks = 0;   // forced leading blocks
  int local_blocks = 1;  // forced trailing blocks (the own block for 1)
  int rope_dim = 64;     // NeoX RoPE on dims [0, rope_dim) of every head
  double rope_theta = 5e6;
  float rms_eps = 1e-6f;

  int group_size() const { return q_heads / kv_heads; }  // query heads per KV head
  float softmax_scale() const;                           // 1 / sqrt(head_dim)
  // Width of one token's fused projection output [q | k | v | index_q | index_k].
  int64_t qkv_width() const;

  // Throws Error(kInvalidArgument) naming the field and value, or kUnsupported for valid but
  // unimplemented values.
  void validate() const;
  std::string to_string() const;
};

// The mixture of experts of one rank (docs/spec.md section 8): what the router, the routed experts
// and the shared expert need. Intermediates are this rank's (the model's / TP).
struct MoeConfig {
  int hidden = 6144;
  int num_experts = 128;
  int experts_per_token = 4;
  int intermediate = 3072;         // one routed expert's intermediate on this rank
  int shared_intermediate = 3072;  // the shared experts' intermediate on this rank (0: none)
  float routed_scaling = 2.0f;
  float activation_limit = 7.0f;

  // Throws Error(kInvalidArgument) naming the field and value.
  void validate() const;
  std::string to_string() const;
};

// The whole model (the runtime and the demo use it; kernels take SparseConfig): the attention
// fields of SparseConfig with *global* head counts (the view of one rank at TP = 1, which is
// sparse(1)), plus what only the whole model has.
struct ModelConfig : SparseConfig {
  int hidden = 6144;
  int num_layers = 60;
  int first_sparse_layer = 3;  // layers [0, first_sparse_layer) are dense
  int intermediate = 0;        // dense MLP width for the demo's FFN stand-in (0: none)
  // The mixture of experts after each sparse layer and the MLP of the dense layers
  // (docs/spec.md section 8). Widths are the whole model's; TP splits every intermediate.
  int num_experts = 128;           // routed experts
  int experts_per_token = 4;       // routed experts picked per token
  int moe_intermediate = 3072;     // intermediate of one routed expert
  int shared_experts = 1;          // always-on experts of width moe_intermediate (0: none)
  int dense_intermediate = 12288;  // MLP of the dense layers [0, first_sparse_layer)
  float routed_scaling = 2.0f;     // w_i = routed_scaling * s_i / sum of the picked s
  float activation_limit = 7.0f;   // SwiGLU-OAI clamp of the experts and the dense MLP

  int num_sparse_layers() const { return num_layers - first_sparse_layer; }
  void validate() const;
  // Per-rank sparse configuration under tensor parallelism of `tp_size` ranks: q heads split,
  // KV and index heads split (replicated when tp_size > kv_heads). With context_parallel, the
  // CP view: every index head stays on every rank (index_heads = this->index_heads).
  SparseConfig sparse(int tp_size = 1, bool context_parallel = false) const;
  // One rank's view of the mixture of experts under TP of `tp_size` ranks (every intermediate
  // split evenly). kInvalidArgument naming the width that tp_size does not divide.
  MoeConfig moe(int tp_size = 1) const;
};

}  // namespace m3msa
