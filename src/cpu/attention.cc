// The CPU reference of block-sparse GQA attention and of dense causal attention (docs/spec.md
// section 5).
//
// Both paths share one routine that attends over an ascending list of key positions, so sparse
// attention whose selection covers every visible block is bit-identical to dense attention (the
// selection's order in topk_idx does not matter: the selected blocks are visited by block id).
// Numerics: logit = (sum over d in order of q[d] * K[p][d], fp32) * softmax_scale; a two-pass
// softmax (max, then exp(logit - max) in fp32); weights and weight * V summed in fp32 in position
// order; out = acc / sum rounded to bf16. fp8 K and V are decoded and multiplied by k_scale /
// v_scale before use. A row with no keys writes zeros.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cache_access.h"
#include "cpu/thread_pool.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"

namespace m3msa::cpu {
namespace {

// The k entries of (row, kv_head) in a topk_idx [rows, kv_heads, k] of any outer strides.
const int32_t* selection_entries(const TensorView& topk_idx, int64_t row, int kv_head) {
  return topk_idx.ptr<const int32_t>() + row * topk_idx.strides[0] + kv_head * topk_idx.strides[1];
}

// Checks every topk_idx entry against the row it belongs to: -1 or a visible block, the valid
// entries a prefix, no block twice. GPU kernels rely on all three, so the oracle refuses a
// selection a kernel would mis-read instead of quietly reading it some other way.
void validate_selection(const SparseConfig& config, const TensorView& topk_idx,
                        const std::vector<RowPosition>& rows) {
  const int heads = config.kv_heads;
  const int k = config.topk;
  std::vector<int32_t> seen(static_cast<std::size_t>(k));
  for (std::size_t row = 0; row < rows.size(); ++row) {
    const int64_t nb = visible_blocks(rows[row].pos, config.block_size);
    for (int h = 0; h < heads; ++h) {
      const int32_t* entries = selection_entries(topk_idx, static_cast<int64_t>(row), h);
      int valid = 0;
      for (int i = 0; i < k; ++i) {
        const int32_t block = entries[i];
        if (block == -1) continue;
        M3MSA_CHECK_ARG(block >= 0 && block < nb, "topk_idx[", row, "][", h, "][", i, "] = ", block,
                        " is neither -1 nor a visible block of the row (", nb,
                        " visible blocks at position ", rows[row].pos, ")");
        M3MSA_CHECK_ARG(valid == i, "topk_idx[", row, "][", h, "][", i, "] = ", block,
                        " follows a -1: the valid entries must form a prefix");
        seen[static_cast<std::size_t>(valid++)] = block;
      }
      std::sort(seen.begin(), seen.begin() + valid);
      const auto repeated = std::adjacent_find(seen.begin(), seen.begin() + valid);
      M3MSA_CHECK_ARG(repeated == seen.begin() + valid, "topk_idx[", row, "][", h,
                      "] selects block ", (repeated == seen.begin() + valid ? -1 : *repeated),
                      " more than once");
    }
  }
}

// Full host validation of an attention call; returns where every row sits.
std::vector<RowPosition> validate_attention(const SparseConfig& config, const AttentionArgs& args,
                                            bool use_selection) {
  validate(config, args, Device::cpu());
  // Only the KV table is read here; the other batch fields must not be checked against caches
  // this call does not see.
  BatchMeta used = args.batch;
  used.index_block_table = {};
  used.slot_mapping = {};
  used.index_slot_mapping = {};
  validate_batch_contents(used, config, 0, args.kv_cache.pages());
  std::vector<RowPosition> rows = row_positions(args.batch);
  if (use_selection) validate_selection(config, args.topk_idx, rows);
  return rows;
}

// Attends the group of query heads of `kv_head` over `positions` (ascending) and writes their bf16
// outputs to out[g * head_dim + d] for g in the group.
void attend_group(const SparseConfig& config, const AttentionArgs& args, int64_t row, int req,
                  int kv_head, const std::vector<int64_t>& positions, uint16_t* out) {
  const int group = config.group_size();
  const int dim = config.head_dim;
  const std::size_t n = positions.size();
  const std::size_t out_count = static_cast<std::size_t>(group) * dim;
  if (n == 0) {
    std::fill(out, out + out_count, float_to_bf16(0.0f));
    return;
  }
  std::vector<float> query(out_count);
  detail::load_bf16(
      args.q.ptr<const uint16_t>() + (row * config.q_heads + int64_t{kv_head} * group) * dim,
      static_cast<int>(out_count), query.data());
  const float scale = config.softmax_scale();
  const TensorView& table = args.batch.kv_block_table;
  const TensorView keys = args.kv_cache.keys();
  const TensorView values = args.kv_cache.values();
  const float k_scale = args.kv_cache.host_k_scale();
  const float v_scale = args.kv_cache.host_v_scale();
  std::vector<float> vec(static_cast<std::size_t>(dim));

  std::vector<float> logits(static_cast<std::size_t>(group) * n);
  for (std::size_t i = 0; i < n; ++i) {
    detail::load_vector(keys, detail::kv_cache_offset(keys, table, req, kv_head, positions[i]), dim,
                        k_scale, vec.data());
    for (int g = 0; g < group; ++g) {
      const float* q = query.data() + static_cast<std::size_t>(g) * dim;
      float dot = 0.0f;
      for (int d = 0; d < dim; ++d) dot += q[d] * vec[d];
      logits[g * n + i] = dot * scale;
    }
  }
  std::vector<float> max_logit(static_cast<std::size_t>(group),
                               -std::numeric_limits<float>::infinity());
  for (int g = 0; g < group; ++g) {
    for (std::size_t i = 0; i < n; ++i) max_logit[g] = std::max(max_logit[g], logits[g * n + i]);
  }

  std::vector<float> sum(static_cast<std::size_t>(group), 0.0f);
  std::vector<float> acc(out_count, 0.0f);
  for (std::size_t i = 0; i < n; ++i) {
    detail::load_vector(values, detail::kv_cache_offset(values, table, req, kv_head, positions[i]),
                        dim, v_scale, vec.data());
    for (int g = 0; g < group; ++g) {
      const float weight = std::exp(logits[g * n + i] - max_logit[g]);
      sum[g] += weight;
      float* a = acc.data() + static_cast<std::size_t>(g) * dim;
      for (int d = 0; d < dim; ++d) a[d] += weight * vec[d];
    }
  }
  for (int g = 0; g < group; ++g) {
    for (int d = 0; d < dim; ++d) out[g * dim + d] = float_to_bf16(acc[g * dim + d] / sum[g]);
  }
}

// Attends every row; `use_selection` false means every visible token p <= pos.
void attend(const SparseConfig& config, const AttentionArgs& args, bool use_selection,
            int threads) {
  const std::vector<RowPosition> rows = validate_attention(config, args, use_selection);
  const int64_t block_size = config.block_size;
  const int64_t row_elems = int64_t{config.q_heads} * config.head_dim;
  const int64_t group_elems = int64_t{config.group_size()} * config.head_dim;
  detail::parallel_for(static_cast<int64_t>(rows.size()), threads, [&](int64_t row) {
    uint16_t* out = args.out.ptr<uint16_t>() + row * row_elems;
    const RowPosition& where = rows[static_cast<std::size_t>(row)];
    std::vector<int64_t> positions;
    for (int kv_head = 0; kv_head < config.kv_heads; ++kv_head) {
      positions.clear();
      if (where.pos >= 0 && !use_selection) {
        for (int64_t p = 0; p <= where.pos; ++p) positions.push_back(p);
      } else if (where.pos >= 0) {
        const int32_t* entries = selection_entries(args.topk_idx, row, kv_head);
        std::vector<int64_t> blocks;
        for (int i = 0; i < config.topk && entries[i] >= 0; ++i) blocks.push_back(entries[i]);
        std::sort(blocks.begin(), blocks.end());
        for (int64_t b : blocks) {
          const int64_t end = std::min(block_size * b + block_size, where.pos + 1);
          for (int64_t p = block_size * b; p < end; ++p) positions.push_back(p);
        }
      }
      attend_group(config, args, row, where.req, kv_head, positions,
                   out + int64_t{kv_head} * group_elems);
    }
  });
}

}  // namespace

// topk_idx not given means dense causal attention (ops.h).
void sparse_attention(const SparseConfig& config, const AttentionArgs& args, int threads) {
  attend(config, args, args.topk_idx.defined(), threads);
}

// Ignores the contents of topk_idx (validate() still checks its shape when it is given), so the
// args of a sparse call can be reused to get the dense oracle.
void dense_attention(const SparseConfig& config, const AttentionArgs& args, int threads) {
  attend(config, args, false, threads);
}

}  // namespace m3msa::cpu
