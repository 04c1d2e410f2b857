#include "m3msa/testing/runtime_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "m3msa/dtype.h"

namespace m3msa::testkit {

ModelConfig small_model(int intermediate) {
  ModelConfig m;
  m.hidden = 256;
  m.num_layers = 3;
  m.first_sparse_layer = 1;
  m.q_heads = 4;
  m.kv_heads = 2;
  m.head_dim = 32;
  m.index_heads = 2;
  m.index_dim = 32;
  m.block_size = 16;
  m.topk = 4;
  m.init_blocks = 0;
  m.local_blocks = 1;
  m.rope_dim = 16;
  m.rope_theta = 10000.0;
  m.intermediate = intermediate;
  return m;
}

RuntimeConfig small_config(int intermediate) {
  RuntimeConfig c;
  c.model = small_model(intermediate);
  c.token_buckets = {1, 2, 4, 8};
  c.query_lens = {1, 2, 4};
  c.max_requests = 4;
  c.max_context = 256;
  c.threads = 1;
  return c;
}

namespace {

// A layer's attention-block weights in one drawing order; the index projections and norms only
// for a sparse layer (a dense layer's draws are the sparse ones without them).
void draw_attention_weights(const ModelConfig& m, bool sparse, SplitMix64& rng, MasterLayer& w) {
  const std::size_t H = static_cast<std::size_t>(m.hidden);
  const std::size_t hd = static_cast<std::size_t>(m.head_dim);
  const std::size_t id = static_cast<std::size_t>(m.index_dim);
  const float in_scale = 1.7f / std::sqrt(static_cast<float>(m.hidden));
  w.wq = random_values(rng, m.q_heads * hd * H, in_scale);
  w.wk = random_values(rng, m.kv_heads * hd * H, in_scale);
  w.wv = random_values(rng, m.kv_heads * hd * H, in_scale);
  if (sparse) {
    w.wiq = random_values(rng, m.index_heads * id * H, in_scale);
    w.wik = random_values(rng, id * H, in_scale);
  }
  w.q_norm = random_values(rng, hd, 0.2f);
  w.k_norm = random_values(rng, hd, 0.2f);
  if (sparse) {
    w.iq_norm = random_values(rng, id, 0.2f);
    w.ik_norm = random_values(rng, id, 0.2f);
  }
  w.input_norm = random_values(rng, H, 0.2f);
  w.post_norm = random_values(rng, H, 0.2f);
  w.wo = random_values(rng, H * m.q_heads * hd,
                       1.7f / std::sqrt(static_cast<float>(m.q_heads * m.head_dim)));
}

HostTensor draw_kv_cache(const ModelConfig& m, int64_t pages, SplitMix64& rng) {
  const std::size_t n = static_cast<std::size_t>(pages) * m.kv_heads * 2 * m.block_size *
                        static_cast<std::size_t>(m.head_dim);
  return bf16_tensor(random_values(rng, n, 1.0f), {pages, m.kv_heads, 2, m.block_size, m.head_dim});
}

}  // namespace

MasterModel make_master(const ModelConfig& m, int64_t pages, uint64_t seed,
                        bool mlp_on_last_layer) {
  MasterModel model;
  model.config = m;
  model.pages = pages;
  SplitMix64 rng(seed);
  const std::size_t H = static_cast<std::size_t>(m.hidden);
  const std::size_t id = static_cast<std::size_t>(m.index_dim);
  const float in_scale = 1.7f / std::sqrt(static_cast<float>(m.hidden));
  for (int layer = m.first_sparse_layer; layer < m.num_layers; ++layer) {
    MasterLayer w;
    w.layer = layer;
    draw_attention_weights(m, true, rng, w);
    w.mlp = mlp_on_last_layer && layer == m.num_layers - 1 && m.intermediate > 0;
    if (w.mlp) {
      const std::size_t I = static_cast<std::size_t>(m.intermediate);
      // Wide enough that many gates and ups land beyond the clamping limit of 7.
      w.gate = random_values(rng, I * H, 5.0f * in_scale);
      w.up = random_values(rng, I * H, 5.0f * in_scale);
      w.down = random_values(rng, H * I, 1.7f / std::sqrt(static_cast<float>(I)));
    }
    w.kv_cache = draw_kv_cache(m, pages, rng);
    const std::size_t ix_n = static_cast<std::size_t>(pages) * m.block_size * id;
    w.index_cache = bf16_tensor(random_values(rng, ix_n, 1.0f), {pages, m.block_size, m.index_dim});
    model.layers.push_back(std::move(w));
  }
  return model;
}

void add_dense_layers(MasterModel& model, uint64_t seed, bool fp8_mlp) {
  const ModelConfig& m = model.config;
  SplitMix64 rng(seed);
  std::vector<MasterLayer> dense;
  for (int layer = 0; layer < m.first_sparse_layer; ++layer) {
    MasterLayer w;
    w.layer = layer;
    w.dense = true;
    draw_attention_weights(m, false, rng, w);
    w.dense_mlp = make_master_dense_mlp(m, rng.next(), fp8_mlp);
    w.kv_cache = draw_kv_cache(m, model.pages, rng);
    dense.push_back(std::move(w));
  }
  model.layers.insert(model.layers.begin(), std::make_move_iterator(dense.begin()),
                      std::make_move_iterator(dense.end()));
}

void append_rows(std::vector<float>& out, const std::vector<float>& w, int64_t cols, int64_t first,
                 int64_t count) {
  out.insert(out.end(), w.begin() + first * cols, w.begin() + (first + count) * cols);
}

std::vector<float> columns(const std::vector<float>& w, int64_t rows, int64_t cols, int64_t first,
                           int64_t count) {
  std::vector<float> out;
  out.reserve(static_cast<std::size_t>(rows * count));
  for (int64_t r = 0; r < rows; ++r) {
    out.insert(out.end(), w.begin() + r * cols + first, w.begin() + r * cols + first + count);
  }
  return out;
}

std::vector<float> rank_qkv_rows(const ModelConfig& m, const MasterLayer& w, int rank, int world,
                                 bool context_parallel) {
  const int64_t H = m.hidden;
  std::vector<float> rows;
  const RankLayout l = rank_layout(m, rank, world, context_parallel);
  append_rows(rows, w.wq, H, l.q_rows.first, l.q_rows.count);
  append_rows(rows, w.wk, H, l.k_rows.first, l.k_rows.count);
  append_rows(rows, w.wv, H, l.v_rows.first, l.v_rows.count);
  if (w.dense) return rows;  // no index segments
  append_rows(rows, w.wiq, H, l.index_q_rows.first, l.index_q_rows.count);
  append_rows(rows, w.wik, H, l.index_k_rows.first, l.index_k_rows.count);
  return rows;
}

RankModel make_rank_model(const MasterModel& master, int rank, int world, bool fp8_qkv,
                          bool context_parallel) {
  const ModelConfig& m = master.config;
  const SparseConfig sc = m.sparse(world, context_parallel);
  RankModel out;
  out.storage.reserve(64);
  const int64_t H = m.hidden;
  for (const MasterLayer& w : master.layers) {
    LayerWeights lw;
    lw.layer = w.layer;
    const int64_t width = w.dense ? rank_layout(m, rank, world).dense_qkv_width : sc.qkv_width();
    const std::vector<float> qkv = rank_qkv_rows(m, w, rank, world, context_parallel);
    if (fp8_qkv) {
      HostTensor q8(DType::kFP8E4M3, {width, H});
      HostTensor scale(DType::kF32, {width});
      for (int64_t n = 0; n < width; ++n) {
        float amax = 0.0f;
        for (int64_t k = 0; k < H; ++k) amax = std::max(amax, std::fabs(qkv[n * H + k]));
        const float s = amax > 0 ? amax / 448.0f : 1.0f;
        scale.ptr<float>()[n] = s;
        for (int64_t k = 0; k < H; ++k) {
          q8.ptr<uint8_t>()[n * H + k] = float_to_fp8e4m3(qkv[n * H + k] / s);
        }
      }
      lw.qkv_proj = out.keep(std::move(q8));
      lw.qkv_proj_scale = out.keep(std::move(scale));
    } else {
      lw.qkv_proj = out.keep(bf16_tensor(qkv, {width, H}));
    }
    lw.q_norm = out.keep(bf16_tensor(w.q_norm, {m.head_dim}));
    lw.k_norm = out.keep(bf16_tensor(w.k_norm, {m.head_dim}));
    if (!w.dense) {
      lw.index_q_norm = out.keep(bf16_tensor(w.iq_norm, {m.index_dim}));
      lw.index_k_norm = out.keep(bf16_tensor(w.ik_norm, {m.index_dim}));
    }
    lw.input_norm = out.keep(bf16_tensor(w.input_norm, {H}));
    lw.post_attention_norm = out.keep(bf16_tensor(w.post_norm, {H}));
    const int64_t attn_cols = int64_t{sc.q_heads} * m.head_dim;
    lw.o_proj =
        out.keep(bf16_tensor(columns(w.wo, H, int64_t{m.q_heads} * m.head_dim,
                                     rank_layout(m, rank, world).o_proj_cols.first, attn_cols),
                             {H, attn_cols}));
    if (w.mlp) {
      const int64_t I = m.intermediate / world;
      std::vector<float> gate_up;
      append_rows(gate_up, w.gate, H, rank * I, I);
      append_rows(gate_up, w.up, H, rank * I, I);
      lw.mlp_gate_up = out.keep(bf16_tensor(gate_up, {2 * I, H}));
      lw.mlp_down = out.keep(bf16_tensor(columns(w.down, H, m.intermediate, rank * I, I), {H, I}));
    }
    if (w.has_moe) bind_moe(m, w.moe, rank, world, out.storage, lw);
    if (w.dense) lw.dense_mlp = bind_dense_mlp(m, w.dense_mlp, rank, world, out.storage);
    // Caches: this rank's KV heads of every page; the whole index-K cache.
    const int64_t pages = master.pages;
    const int64_t tile = int64_t{2} * m.block_size * m.head_dim;  // K and V of one head
    HostTensor kv(DType::kBF16, {pages, sc.kv_heads, 2, m.block_size, m.head_dim});
    const int kv0 = rank_layout(m, rank, world).first_kv_head;
    for (int64_t p = 0; p < pages; ++p) {
      for (int h = 0; h < sc.kv_heads; ++h) {
        std::memcpy(kv.ptr<uint16_t>() + (p * sc.kv_heads + h) * tile,
                    w.kv_cache.ptr<uint16_t>() + (p * m.kv_heads + kv0 + h) * tile,
                    sizeof(uint16_t) * static_cast<std::size_t>(tile));
      }
    }
    HostTensor index;
    if (!w.dense) {
      index = HostTensor(DType::kBF16, w.index_cache.shape());
      std::memcpy(index.data(), w.index_cache.data(), index.nbytes());
      lw.index_cache = {index.view()};
    }
    out.kv_caches.push_back(kv);
    out.index_caches.push_back(index);
    lw.kv_cache = {kv.view(), 1.0f, 1.0f};
    out.weights.layers.push_back(lw);
  }
  return out;
}

int64_t kv_tiles_differing(const ModelConfig& m, int rank, int world, const HostTensor& rank_kv,
                           const HostTensor& one_kv) {
  const SparseConfig sc = m.sparse(world);
  const int64_t tile = int64_t{2} * m.block_size * m.head_dim;
  const int kv0 = rank_layout(m, rank, world).first_kv_head;
  int64_t differing = 0;
  for (int64_t p = 0; p < rank_kv.shape()[0]; ++p) {
    for (int h = 0; h < sc.kv_heads; ++h) {
      differing += std::memcmp(rank_kv.ptr<uint16_t>() + (p * sc.kv_heads + h) * tile,
                               one_kv.ptr<uint16_t>() + (p * m.kv_heads + kv0 + h) * tile,
                               sizeof(uint16_t) * static_cast<std::size_t>(tile)) != 0;
    }
  }
  return differing;
}

StepMeta make_step(const std::vector<int32_t>& seq_lens, int q_len, int block_size,
                   int64_t max_blocks, const std::vector<int32_t>& index_perm,
                   const std::vector<int32_t>& kv_perm) {
  StepMeta s;
  const int64_t n = static_cast<int64_t>(seq_lens.size());
  const int64_t rows = n * q_len;
  s.seq_lens = HostTensor(DType::kI32, {n});
  s.index_table = HostTensor(DType::kI32, {n, max_blocks});
  s.kv_table = HostTensor(DType::kI32, {n, max_blocks});
  s.slots = HostTensor(DType::kI64, {rows});
  s.index_slots = HostTensor(DType::kI64, {rows});
  s.positions = HostTensor(DType::kI64, {rows});
  for (int64_t r = 0; r < n; ++r) {
    s.seq_lens.ptr<int32_t>()[r] = seq_lens[static_cast<std::size_t>(r)];
    for (int64_t b = 0; b < max_blocks; ++b) {
      s.index_table.ptr<int32_t>()[r * max_blocks + b] =
          index_perm[static_cast<std::size_t>(r * max_blocks + b)];
      s.kv_table.ptr<int32_t>()[r * max_blocks + b] =
          kv_perm[static_cast<std::size_t>(r * max_blocks + b)];
    }
    for (int j = 0; j < q_len; ++j) {
      const int64_t row = r * q_len + j;
      const int32_t len = seq_lens[static_cast<std::size_t>(r)];
      const int64_t pos = len == 0 ? -1 : int64_t{len} - q_len + j;
      s.positions.ptr<int64_t>()[row] = pos;
      if (pos < 0 || pos / block_size >= max_blocks) {  // dead row, or past the table
        s.slots.ptr<int64_t>()[row] = -1;
        s.index_slots.ptr<int64_t>()[row] = -1;
      } else {
        const int64_t b = pos / block_size;
        s.slots.ptr<int64_t>()[row] =
            int64_t{s.kv_table.ptr<int32_t>()[r * max_blocks + b]} * block_size + pos % block_size;
        s.index_slots.ptr<int64_t>()[row] =
            int64_t{s.index_table.ptr<int32_t>()[r * max_blocks + b]} * block_size +
            pos % block_size;
      }
    }
  }
  s.batch.kind = BatchKind::kDecode;
  s.batch.num_reqs = static_cast<int>(n);
  s.batch.q_len = q_len;
  s.batch.seq_lens = s.seq_lens.view();
  s.batch.index_block_table = s.index_table.view();
  s.batch.kv_block_table = s.kv_table.view();
  s.batch.slot_mapping = s.slots.view();
  s.batch.index_slot_mapping = s.index_slots.view();
  return s;
}

}  // namespace m3msa::testkit
