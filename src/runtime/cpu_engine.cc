// The CPU backend of the runtime: forward_layer with the CPU reference (cpu::preprocess /
// select_topk / sparse_attention) and the plain math of cpu_engine_math.cc, the TP reduce and the
// CP exchange through the communicator, over host buffers allocated once at prepare.
#include <algorithm>
#include <cstdio>
#include <cstring>

#include "m3msa/cp.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/dtype.h"
#include "m3msa/error.h"
#include "m3msa/moe.h"
#include "m3msa/ops.h"
#include "runtime/runtime_internal.h"

namespace m3msa::runtime_detail {

CpuEngine::CpuEngine(const RuntimeConfig& config, const RankLayout& layout, Communicator& comm,
                     const std::vector<LayerWeights>& layers)
    : config_(config),
      sparse_(config.model.sparse(layout.tp_size, config.context_parallel)),
      layout_(layout),
      comm_(&comm) {
  const ModelConfig& m = config_.model;
  max_rows_ = config_.token_buckets.back();
  max_blocks_ = blocks_for(config_.max_context, m.block_size);
  const int64_t rows = max_rows_;
  const int64_t reqs = config_.max_requests;
  seq_lens_ = HostTensor(DType::kI32, {reqs});
  index_block_table_ = HostTensor(DType::kI32, {reqs, max_blocks_});
  kv_block_table_ = HostTensor(DType::kI32, {reqs, max_blocks_});
  slot_mapping_ = HostTensor(DType::kI64, {rows});
  index_slot_mapping_ = HostTensor(DType::kI64, {rows});
  seq_lens_.fill_bytes(0);
  index_block_table_.fill_bytes(0xFF);  // -1: no page
  kv_block_table_.fill_bytes(0xFF);
  slot_mapping_.fill_bytes(0xFF);
  index_slot_mapping_.fill_bytes(0xFF);

  const int64_t hidden = m.hidden;
  const int64_t width = sparse_.qkv_width();
  const int64_t attn_width = int64_t{sparse_.q_heads} * sparse_.head_dim;
  bool any_mlp = false;
  for (const LayerWeights& w : layers) any_mlp = any_mlp || w.mlp_gate_up.defined();
  const int64_t mlp_width = any_mlp ? layout_.mlp_rows.count : 0;  // no MLP: no scratch
  normed_ = HostTensor(DType::kBF16, {rows, hidden});
  hidden_out_ = HostTensor(DType::kBF16, {rows, hidden});
  residual_out_ = HostTensor(DType::kBF16, {rows, hidden});
  qkv_ = HostTensor(DType::kBF16, {rows, width});
  q_ = HostTensor(DType::kBF16, {rows, sparse_.q_heads, sparse_.head_dim});
  index_q_ = HostTensor(DType::kBF16, {rows, sparse_.index_heads, sparse_.index_dim});
  topk_ = HostTensor(DType::kI32, {rows, sparse_.kv_heads, sparse_.topk});  // this rank's heads
  attn_ = HostTensor(DType::kBF16, {rows, sparse_.q_heads, sparse_.head_dim});
  if (any_mlp) {
    mlp_gu_ = HostTensor(DType::kBF16, {rows, 2 * mlp_width});
    mlp_act_ = HostTensor(DType::kBF16, {rows, mlp_width});
  }
  f32_out_.assign(static_cast<std::size_t>(rows * std::max({width, hidden, 2 * mlp_width})), 0.0f);
  x_row_.assign(static_cast<std::size_t>(std::max({hidden, attn_width, mlp_width})), 0.0f);
  if (config_.context_parallel) {
    cp_keys_.assign(static_cast<std::size_t>(rows) * sparse_.index_heads * sparse_.topk, 0);
  }
}

BatchMeta CpuEngine::stage_step(const BatchMeta& batch, int pad) {
  const int n = batch.num_reqs;
  const int64_t rows = batch.num_rows();
  const int64_t padded_rows = int64_t{pad} * batch.q_len;
  // Copy into the fixed buffers (addresses never change; only the views' shapes follow the
  // step). Padding requests: length 0, no pages; padding rows: no slots.
  int32_t* seq = seq_lens_.ptr<int32_t>();
  std::memcpy(seq, batch.seq_lens.data, sizeof(int32_t) * static_cast<std::size_t>(n));
  std::fill(seq + n, seq + pad, 0);
  const std::pair<const TensorView*, HostTensor*> tables[] = {
      {&batch.index_block_table, &index_block_table_}, {&batch.kv_block_table, &kv_block_table_}};
  for (const auto& [src, dst] : tables) {
    const int64_t cols = std::min<int64_t>(src->shape[1], max_blocks_);
    int32_t* out = dst->ptr<int32_t>();
    for (int r = 0; r < pad; ++r) {
      int64_t copied = 0;
      if (r < n) {
        const int32_t* in = src->ptr<const int32_t>() + r * src->strides[0];
        for (int64_t col = 0; col < cols; ++col)
          out[r * max_blocks_ + col] = in[col * src->strides[1]];
        copied = cols;
      }
      std::fill(out + r * max_blocks_ + copied, out + (r + 1) * max_blocks_, -1);
    }
  }
  const std::pair<const TensorView*, HostTensor*> slot_maps[] = {
      {&batch.slot_mapping, &slot_mapping_}, {&batch.index_slot_mapping, &index_slot_mapping_}};
  for (const auto& [src, dst] : slot_maps) {
    int64_t* out = dst->ptr<int64_t>();
    std::memcpy(out, src->data, sizeof(int64_t) * static_cast<std::size_t>(rows));
    std::fill(out + rows, out + padded_rows, int64_t{-1});
  }

  BatchMeta step;
  step.kind = BatchKind::kDecode;
  step.num_reqs = pad;
  step.q_len = batch.q_len;
  step.seq_lens = TensorView::contiguous(seq_lens_.data(), DType::kI32, {int64_t{pad}});
  step.index_block_table =
      TensorView::contiguous(index_block_table_.data(), DType::kI32, {int64_t{pad}, max_blocks_});
  step.kv_block_table =
      TensorView::contiguous(kv_block_table_.data(), DType::kI32, {int64_t{pad}, max_blocks_});
  step.slot_mapping = TensorView::contiguous(slot_mapping_.data(), DType::kI64, {padded_rows});
  step.index_slot_mapping =
      TensorView::contiguous(index_slot_mapping_.data(), DType::kI64, {padded_rows});
  return step;
}

void CpuEngine::forward_layer(int layer, const LayerWeights& w, const BatchMeta& step,
                              const TensorView& hidden, const TensorView& residual,
                              const TensorView& positions, bool run_indexer, RuntimeStats& stats,
                              int& selection_layer) {
  const SparseConfig& sc = sparse_;
  const ModelConfig& m = config_.model;
  const int64_t rows = step.num_rows();
  const int64_t H = m.hidden;
  const int threads = config_.threads;
  // A dense layer (docs/spec.md section 8): no index part, dense attention, the dense MLP.
  const bool dense = layer < m.first_sparse_layer;
  // The layer works on scratch copies and writes hidden / residual only at the end, so a call
  // that throws part way (a refused argument) leaves the engine's tensors as they were.
  const uint16_t* h_in = hidden.ptr<const uint16_t>();
  const uint16_t* res_in = residual.ptr<const uint16_t>();
  uint16_t* h = hidden_out_.ptr<uint16_t>();
  uint16_t* res = residual_out_.ptr<uint16_t>();
  uint16_t* normed = normed_.ptr<uint16_t>();
  float* f32 = f32_out_.data();
  char tag[48];

  // 1. x = hidden + residual (the new residual), h = input_norm(x).
  for (int64_t i = 0; i < rows * H; ++i) {
    res[i] = float_to_bf16(bf16_to_float(h_in[i]) + bf16_to_float(res_in[i]));
  }
  for (int64_t r = 0; r < rows; ++r) {
    gemma_rmsnorm_row(res + r * H, w.input_norm.ptr<const uint16_t>(), H, m.rms_eps,
                      normed + r * H);
  }

  // 2. The fused projection [q | k | v | index_q | index_k] ([q | k | v] of a dense layer, in the
  // leading columns of the same rows; its index columns are zero and never read).
  const int64_t width = sc.qkv_width();
  const int64_t projected = w.qkv_proj.shape[0];
  linear(normed, rows, H, w.qkv_proj, w.qkv_proj_scale, f32, x_row_.data());
  uint16_t* qkv = qkv_.ptr<uint16_t>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t n = 0; n < projected; ++n)
      qkv[r * width + n] = float_to_bf16(f32[r * projected + n]);
    std::fill(qkv + r * width + projected, qkv + (r + 1) * width, uint16_t{0});
  }

  // 3. Head norms, RoPE, cache insert; 4. selection; 5. sparse (dense: causal) attention.
  PreprocessArgs pre;
  pre.qkv = TensorView::contiguous(qkv, DType::kBF16, {rows, width});
  pre.q_norm = w.q_norm;
  pre.k_norm = w.k_norm;
  pre.index_q_norm = w.index_q_norm;
  pre.index_k_norm = w.index_k_norm;
  pre.positions = positions;
  pre.batch = step;
  pre.kv_cache = w.kv_cache;
  pre.q_out = TensorView::contiguous(q_.data(), DType::kBF16,
                                     {rows, int64_t{sc.q_heads}, int64_t{sc.head_dim}});
  if (run_indexer) {
    pre.index_cache = w.index_cache;
    pre.index_q_out = TensorView::contiguous(
        index_q_.data(), DType::kBF16, {rows, int64_t{sc.index_heads}, int64_t{sc.index_dim}});
  }
  cpu::preprocess(sc, pre, threads);

  const TensorView topk = TensorView::contiguous(topk_.data(), DType::kI32,
                                                 {rows, int64_t{sc.kv_heads}, int64_t{sc.topk}});
  if (run_indexer) {
    IndexerArgs idx;
    idx.index_q = pre.index_q_out;
    idx.index_cache = w.index_cache;
    idx.batch = step;
    idx.topk_idx = topk;
    if (config_.context_parallel) {
      cp_select(layer, idx);
    } else {
      cpu::select_topk(sc, idx, threads);
    }
    selection_layer = layer;
    ++stats.indexer_layers_run;
  } else if (!dense) {
    ++stats.sharing_layers_run;
  }

  AttentionArgs att;
  att.q = pre.q_out;
  att.kv_cache = w.kv_cache;
  att.batch = step;
  if (!dense) att.topk_idx = topk;
  att.out = TensorView::contiguous(attn_.data(), DType::kBF16,
                                   {rows, int64_t{sc.q_heads}, int64_t{sc.head_dim}});
  cpu::sparse_attention(sc, att, threads);

  // 6. Output projection (this rank's heads) and the TP reduce.
  const int64_t attn_width = int64_t{sc.q_heads} * sc.head_dim;
  linear(attn_.ptr<const uint16_t>(), rows, attn_width, w.o_proj, w.o_proj_scale, f32,
         x_row_.data());
  std::snprintf(tag, sizeof(tag), "layer %d o_proj", layer);
  comm_->all_reduce_sum(f32, static_cast<std::size_t>(rows * H), tag);
  // The FFNs end alike: this rank's fp32 partial in f32, summed over the ranks, hidden <- bf16.
  auto reduce_into_hidden = [&](const char* what) {
    std::snprintf(tag, sizeof(tag), "layer %d %s", layer, what);
    comm_->all_reduce_sum(f32, static_cast<std::size_t>(rows * H), tag);
    for (int64_t i = 0; i < rows * H; ++i) h[i] = float_to_bf16(f32[i]);
  };

  // 7. x2 = x + o (the new residual), h2 = post_attention_norm(x2).
  for (int64_t i = 0; i < rows * H; ++i) {
    res[i] = float_to_bf16(bf16_to_float(res[i]) + round_to_bf16(f32[i]));
  }
  for (int64_t r = 0; r < rows; ++r) {
    gemma_rmsnorm_row(res + r * H, w.post_attention_norm.ptr<const uint16_t>(), H, m.rms_eps,
                      h + r * H);
  }

  // 8. Optional dense SwiGLU-OAI MLP: hidden <- mlp(h2).
  if (w.mlp_gate_up.defined()) {
    const int64_t I = layout_.mlp_rows.count;
    linear(h, rows, H, w.mlp_gate_up, TensorView{}, f32, x_row_.data());
    uint16_t* act = mlp_act_.ptr<uint16_t>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < I; ++j) {
        const float gate = round_to_bf16(f32[r * 2 * I + j]);
        const float up = round_to_bf16(f32[r * 2 * I + I + j]);
        act[r * I + j] = float_to_bf16(swiglu_oai(gate, up, config_.swiglu_limit));
      }
    }
    linear(act, rows, I, w.mlp_down, TensorView{}, f32, x_row_.data());
    reduce_into_hidden("mlp_down");
  }

  // 8'. Or the mixture of experts (docs/spec.md section 8): this rank's partial of the routed and
  // shared experts, one TP reduce for both, then hidden <- bf16(sum).
  if (w.has_moe()) {
    MoeArgs moe;
    moe.x = TensorView::contiguous(h, DType::kBF16, {rows, H});
    moe.router_weight = w.router_weight;
    moe.router_bias = w.router_bias;
    moe.experts = w.experts;
    moe.shared = w.shared_expert;
    moe.out = TensorView::contiguous(f32, DType::kF32, {rows, H});
    cpu::moe(m.moe(layout_.tp_size), moe, threads);
    reduce_into_hidden("moe");
  }

  // 8''. Or a dense layer's MLP (docs/spec.md section 8, "Dense MLP"): the expert function with
  // weight 1 on this rank's slice of the intermediate, one TP reduce.
  if (w.dense_mlp.defined()) {
    DenseMlpArgs mlp;
    mlp.x = TensorView::contiguous(h, DType::kBF16, {rows, H});
    mlp.mlp = w.dense_mlp;
    mlp.out = TensorView::contiguous(f32, DType::kF32, {rows, H});
    mlp.activation_limit = m.activation_limit;
    cpu::dense_mlp(mlp, threads);
    reduce_into_hidden("dense_mlp");
  }
  const std::size_t bytes = sizeof(uint16_t) * static_cast<std::size_t>(rows * H);
  std::memcpy(hidden.data, h, bytes);
  std::memcpy(residual.data, res, bytes);
  ++stats.layers_run;
}

// The CPU backend's CP indexer (docs/context_parallel.md on the host): this rank scores its
// round-robin shard of the blocks for every index head and nominates its top-k keys, the
// nominations of every rank travel through the communicator's all-gather, and the rank keeps the
// exact top-k of the P*k candidates of each head it attends. Bit-identical to cpu::select_topk
// (docs/context_parallel.md "Exactness"). idx.topk_idx: [rows, KV heads of this rank, k].
void CpuEngine::cp_select(int layer, const IndexerArgs& idx) {
  const SparseConfig& sc = sparse_;
  const int P = layout_.tp_size;
  const int rank = layout_.tp_rank;
  const int64_t rows = idx.batch.num_rows();
  const int H = sc.index_heads;
  const int k = sc.topk;
  const std::size_t count = static_cast<std::size_t>(rows) * H * k;
  M3MSA_CHECK_INTERNAL(cp_keys_.size() >= count, "CP nominations buffer too small");
  IndexerArgs shard = idx;
  shard.topk_idx = {};  // nominate writes keys, not the selection
  cpu::nominate(
      sc, shard, rank, P,
      TensorView::contiguous(cp_keys_.data(), DType::kU64, {rows, int64_t{H}, int64_t{k}}),
      config_.threads);
  char tag[48];
  std::snprintf(tag, sizeof(tag), "layer %d cp nominations", layer);
  const std::string payload(reinterpret_cast<const char*>(cp_keys_.data()),
                            count * sizeof(uint64_t));
  const std::vector<ByteRecord> all =
      comm_->all_gather(RecordWriter().i64(rows).i64(H).i64(k).str(payload).take(), tag);
  const std::vector<int> heads = cp_merged_heads(P, H, rank);
  std::vector<std::string> nominations(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r) {
    RecordReader reader(all[static_cast<std::size_t>(r)],
                        "CP nominations of rank " + std::to_string(r));
    const int64_t r_rows = reader.i64();
    const int64_t r_heads = reader.i64();
    const int64_t r_k = reader.i64();
    if (r_rows != rows || r_heads != H || r_k != k) {
      throw Error(ErrorCode::kInvalidArgument,
                  "layer " + std::to_string(layer) + " CP exchange: rank " + std::to_string(r) +
                      " nominated for " + std::to_string(r_rows) + " rows x " +
                      std::to_string(r_heads) + " heads x k " + std::to_string(r_k) +
                      ", this rank for " + std::to_string(rows) + " x " + std::to_string(H) +
                      " x " + std::to_string(k) + " (the ranks are out of lockstep)",
                  __FILE__, __LINE__, rank);
    }
    nominations[static_cast<std::size_t>(r)] = reader.str();
  }
  std::vector<uint64_t> candidates(static_cast<std::size_t>(P) * k);
  int32_t* out = idx.topk_idx.ptr<int32_t>();
  for (int64_t row = 0; row < rows; ++row) {
    for (std::size_t m = 0; m < heads.size(); ++m) {
      const int64_t at = (row * H + heads[m]) * k;
      for (int r = 0; r < P; ++r) {
        std::memcpy(candidates.data() + static_cast<std::size_t>(r) * k,
                    nominations[static_cast<std::size_t>(r)].data() + at * sizeof(uint64_t),
                    sizeof(uint64_t) * static_cast<std::size_t>(k));
      }
      const std::vector<uint64_t> top = cpu::top_keys(candidates, k);
      cpu::keys_to_indices(
          top.data(), static_cast<int>(top.size()),
          out + (row * static_cast<int64_t>(heads.size()) + static_cast<int64_t>(m)) * k, k);
    }
  }
}

Runtime::LayerTrace CpuEngine::trace(int64_t rows) const {
  Runtime::LayerTrace t;
  const SparseConfig& sc = sparse_;
  auto view = [&](const HostTensor& h, DType dtype, std::initializer_list<int64_t> shape) {
    return TensorView::contiguous(const_cast<void*>(h.data()), dtype, shape);
  };
  t.normed = view(normed_, DType::kBF16, {rows, int64_t{config_.model.hidden}});
  t.qkv = view(qkv_, DType::kBF16, {rows, sc.qkv_width()});
  t.q = view(q_, DType::kBF16, {rows, int64_t{sc.q_heads}, int64_t{sc.head_dim}});
  t.index_q = view(index_q_, DType::kBF16, {rows, int64_t{sc.index_heads}, int64_t{sc.index_dim}});
  t.topk = view(topk_, DType::kI32, {rows, int64_t{sc.kv_heads}, int64_t{sc.topk}});
  t.attn = view(attn_, DType::kBF16, {rows, int64_t{sc.q_heads}, int64_t{sc.head_dim}});
  return t;
}

}  // namespace m3msa::runtime_detail
