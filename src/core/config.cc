#include "m3msa/config.h"

#include <cmath>
#include <limits>
#include <sstream>

#include "m3msa/error.h"
#include "m3msa/sort_key.h"

namespace m3msa {

namespace {
constexpr int kMaxHeads = 1 << 16;
constexpr int kMaxHeadDim = 1 << 16;
constexpr int kMaxBlockSize = 1 << 20;
constexpr int kMaxExperts = 1 << 12;
constexpr int kMaxExpertsPerToken = 32;
constexpr int kMaxSharedExperts = 16;
constexpr int kMaxWidth = 1 << 20;
}  // namespace

float SparseConfig::softmax_scale() const {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

int64_t SparseConfig::qkv_width() const {
  return int64_t{q_heads} * head_dim + 2 * int64_t{kv_heads} * head_dim +
         int64_t{index_heads} * index_dim + index_dim;
}

void SparseConfig::validate() const {
  // Upper bounds keep every derived size (qkv_width, strides) far from int64 overflow; they are
  // orders of magnitude above any real model.
  M3MSA_CHECK_ARG(q_heads > 0 && q_heads <= kMaxHeads, "config.q_heads must be in [1, ", kMaxHeads,
                  "], got ", q_heads);
  M3MSA_CHECK_ARG(kv_heads > 0 && kv_heads <= kMaxHeads, "config.kv_heads must be in [1, ",
                  kMaxHeads, "], got ", kv_heads);
  M3MSA_CHECK_ARG(q_heads % kv_heads == 0, "config.q_heads (", q_heads,
                  ") must be a multiple of config.kv_heads (", kv_heads, ")");
  // Equal without CP; a multiple in the CP view (config.h).
  M3MSA_CHECK_ARG(index_heads > 0 && index_heads <= kMaxHeads && index_heads % kv_heads == 0,
                  "config.index_heads (", index_heads, ") must equal config.kv_heads (", kv_heads,
                  "): index head h selects for KV head h (or, in the view of a context-parallel "
                  "rank, be a multiple of it)");
  M3MSA_CHECK_ARG(head_dim > 0 && head_dim % 8 == 0 && head_dim <= kMaxHeadDim,
                  "config.head_dim must be a positive multiple of 8 and <= ", kMaxHeadDim, ", got ",
                  head_dim);
  M3MSA_CHECK_ARG(index_dim > 0 && index_dim % 8 == 0 && index_dim <= kMaxHeadDim,
                  "config.index_dim must be a positive multiple of 8 and <= ", kMaxHeadDim,
                  ", got ", index_dim);
  M3MSA_CHECK_ARG(block_size > 0 && block_size <= kMaxBlockSize,
                  "config.block_size must be in [1, ", kMaxBlockSize, "], got ", block_size);
  M3MSA_CHECK_ARG(topk > 0 && topk <= 1024, "config.topk must be in [1, 1024], got ", topk);
  M3MSA_CHECK_ARG(init_blocks >= 0, "config.init_blocks must be >= 0, got ", init_blocks);
  M3MSA_CHECK_ARG(local_blocks >= 0, "config.local_blocks must be >= 0, got ", local_blocks);
  // In 64 bits: two hostile ints must not overflow before the comparison.
  const int64_t forced = int64_t{init_blocks} + local_blocks;
  M3MSA_CHECK_ARG(forced <= topk, "config.init_blocks + config.local_blocks (", forced,
                  ") must be <= config.topk (", topk, ")");
  M3MSA_CHECK_ARG(
      rope_dim >= 0 && rope_dim % 2 == 0 && rope_dim <= head_dim && rope_dim <= index_dim,
      "config.rope_dim must be even and <= head_dim and index_dim, got ", rope_dim);
  M3MSA_CHECK_ARG(std::isfinite(rope_theta) && rope_theta > 0,
                  "config.rope_theta must be finite and > 0, got ", rope_theta);
  M3MSA_CHECK_ARG(std::isfinite(rms_eps) && rms_eps > 0,
                  "config.rms_eps must be finite and > 0, got ", rms_eps);
}

std::string SparseConfig::to_string() const {
  std::ostringstream out;
  out << "q_heads=" << q_heads << " kv_heads=" << kv_heads << " head_dim=" << head_dim
      << " index_heads=" << index_heads << " index_dim=" << index_dim
      << " block_size=" << block_size << " topk=" << topk << " init_blocks=" << init_blocks
      << " local_blocks=" << local_blocks << " rope_dim=" << rope_dim
      << " rope_theta=" << rope_theta;
  return out.str();
}

void ModelConfig::validate() const {
  M3MSA_CHECK_ARG(hidden > 0, "model.hidden must be > 0, got ", hidden);
  // The bound keeps per-layer bookkeeping (one slot per layer id) small; real models have ~100.
  M3MSA_CHECK_ARG(num_layers > 0 && num_layers <= 65536,
                  "model.num_layers must be in [1, 65536], got ", num_layers);
  M3MSA_CHECK_ARG(first_sparse_layer >= 0 && first_sparse_layer < num_layers,
                  "model.first_sparse_layer must be in [0, num_layers), got ", first_sparse_layer);
  M3MSA_CHECK_ARG(intermediate >= 0, "model.intermediate must be >= 0, got ", intermediate);
  // Bounds keep every derived size (E * 2I * hidden) far from int64 overflow.
  M3MSA_CHECK_ARG(num_experts > 0 && num_experts <= kMaxExperts,
                  "model.num_experts must be in [1, ", kMaxExperts, "], got ", num_experts);
  M3MSA_CHECK_ARG(experts_per_token > 0 && experts_per_token <= kMaxExpertsPerToken &&
                      experts_per_token <= num_experts,
                  "model.experts_per_token must be in [1, min(", kMaxExpertsPerToken,
                  ", num_experts = ", num_experts, ")], got ", experts_per_token);
  M3MSA_CHECK_ARG(moe_intermediate > 0 && moe_intermediate <= kMaxWidth,
                  "model.moe_intermediate must be in [1, ", kMaxWidth, "], got ", moe_intermediate);
  M3MSA_CHECK_ARG(shared_experts >= 0 && shared_experts <= kMaxSharedExperts,
                  "model.shared_experts must be in [0, ", kMaxSharedExperts, "], got ",
                  shared_experts);
  M3MSA_CHECK_ARG(dense_intermediate >= 0 && dense_intermediate <= kMaxWidth,
                  "model.dense_intermediate must be in [0, ", kMaxWidth, "], got ",
                  dense_intermediate);
  M3MSA_CHECK_ARG(std::isfinite(routed_scaling) && routed_scaling > 0,
                  "model.routed_scaling must be finite and > 0, got ", routed_scaling);
  M3MSA_CHECK_ARG(std::isfinite(activation_limit) && activation_limit > 0,
                  "model.activation_limit must be finite and > 0, got ", activation_limit);
  M3MSA_CHECK_ARG(hidden <= kMaxWidth, "model.hidden must be <= ", kMaxWidth, ", got ", hidden);
  // Checked here, not only through sparse(1): the split maps 0 KV heads to 1 per rank.
  M3MSA_CHECK_ARG(q_heads > 0 && kv_heads > 0, "model.q_heads and model.kv_heads must be > 0, got ",
                  q_heads, " and ", kv_heads);
  M3MSA_CHECK_ARG(index_heads == kv_heads, "model.index_heads (", index_heads,
                  ") must equal model.kv_heads (", kv_heads,
                  "): index head h selects for KV head h");
  sparse(1).validate();
}

SparseConfig ModelConfig::sparse(int tp_size, bool context_parallel) const {
  M3MSA_CHECK_ARG(tp_size > 0, "tp_size must be > 0, got ", tp_size);
  M3MSA_CHECK_ARG(q_heads % tp_size == 0, "tp_size (", tp_size, ") must divide q_heads (", q_heads,
                  ")");
  M3MSA_CHECK_ARG(kv_heads % tp_size == 0 || tp_size % kv_heads == 0, "tp_size (", tp_size,
                  ") must divide kv_heads (", kv_heads, ") or be a multiple of it");
  SparseConfig s = *this;  // every field but the head counts is the same on every rank
  s.q_heads = q_heads / tp_size;
  s.kv_heads = tp_size <= kv_heads ? kv_heads / tp_size : 1;
  s.index_heads = context_parallel         ? index_heads
                  : tp_size <= index_heads ? index_heads / tp_size
                                           : 1;
  return s;
}

MoeConfig ModelConfig::moe(int tp_size) const {
  M3MSA_CHECK_ARG(tp_size > 0, "tp_size must be > 0, got ", tp_size);
  M3MSA_CHECK_ARG(moe_intermediate % tp_size == 0, "tp_size (", tp_size,
                  ") must divide model.moe_intermediate (", moe_intermediate, ")");
  MoeConfig c;
  c.hidden = hidden;
  c.num_experts = num_experts;
  c.experts_per_token = experts_per_token;
  c.intermediate = moe_intermediate / tp_size;
  // In 64 bits: hostile counts must not overflow before a validate() refuses them.
  const int64_t shared = int64_t{shared_experts} * (moe_intermediate / tp_size);
  M3MSA_CHECK_ARG(shared >= 0 && shared <= std::numeric_limits<int>::max(),
                  "model.shared_experts (", shared_experts, ") x model.moe_intermediate / tp (",
                  moe_intermediate / tp_size, ") must be in [0, 2^31)");
  c.shared_intermediate = static_cast<int>(shared);
  c.routed_scaling = routed_scaling;
  c.activation_limit = activation_limit;
  return c;
}

void MoeConfig::validate() const {
  M3MSA_CHECK_ARG(hidden > 0 && hidden <= kMaxWidth, "moe.hidden must be in [1, ", kMaxWidth,
                  "], got ", hidden);
  M3MSA_CHECK_ARG(num_experts > 0 && num_experts <= kMaxExperts, "moe.num_experts must be in [1, ",
                  kMaxExperts, "], got ", num_experts);
  M3MSA_CHECK_ARG(experts_per_token > 0 && experts_per_token <= kMaxExpertsPerToken &&
                      experts_per_token <= num_experts,
                  "moe.experts_per_token must be in [1, min(", kMaxExpertsPerToken,
                  ", num_experts = ", num_experts, ")], got ", experts_per_token);
  M3MSA_CHECK_ARG(intermediate > 0 && intermediate <= kMaxWidth, "moe.intermediate must be in [1, ",
                  kMaxWidth, "], got ", intermediate);
  M3MSA_CHECK_ARG(shared_intermediate >= 0 && shared_intermediate <= kMaxWidth * kMaxSharedExperts,
                  "moe.shared_intermediate must be in [0, ", kMaxWidth * kMaxSharedExperts,
                  "], got ", shared_intermediate);
  M3MSA_CHECK_ARG(std::isfinite(routed_scaling) && routed_scaling > 0,
                  "moe.routed_scaling must be finite and > 0, got ", routed_scaling);
  M3MSA_CHECK_ARG(std::isfinite(activation_limit) && activation_limit > 0,
                  "moe.activation_limit must be finite and > 0, got ", activation_limit);
}

std::string MoeConfig::to_string() const {
  std::ostringstream out;
  out << "hidden=" << hidden << " num_experts=" << num_experts
      << " experts_per_token=" << experts_per_token << " intermediate=" << intermediate
      << " shared_intermediate=" << shared_intermediate << " routed_scaling=" << routed_scaling
      << " activation_limit=" << activation_limit;
  return out.str();
}

}  // namespace m3msa
