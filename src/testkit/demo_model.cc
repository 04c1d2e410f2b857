#include "m3msa/testing/demo_model.h"

#include <algorithm>
#include <cmath>

#include "m3msa/dtype.h"
#include "m3msa/error.h"
#include "m3msa/runtime.h"
#include "m3msa/testing/parallel.h"
#include "m3msa/testing/random.h"

namespace m3msa::testkit::demo {

namespace {

// ---- Counter-based random values: element i of tensor stream s, uniform in [-1, 1) ----

// The tensors of one layer, each its own stream.
enum TensorId : uint64_t {
  kWq = 0,
  kWk,
  kWv,
  kWiq,
  kWik,
  kQNorm,
  kKNorm,
  kIqNorm,
  kIkNorm,
  kInputNorm,
  kPostNorm,
  kWo,
  kGate,
  kUp,
  kDown,
  kKvCache,
  kIndexCache,
};

uint64_t stream_of(const Spec& spec, int layer, TensorId id) {
  return derive_seed(spec.seed, 1000 + static_cast<uint64_t>(layer), id);
}

// Scales: inputs of the projections have unit RMS, so weights uniform in [-s, s) with
// s = 1.7 / sqrt(fan_in) keep outputs at unit RMS. Gate and up kGateUpWidth x wider, so ~1-2 %
// land beyond the SwiGLU clamping limit of 7; the down projection kDownNarrow x narrower,
// so the MLP output (its activations have an RMS of ~6) stays O(1) like the residual stream.
constexpr float kGateUpWidth = 3.0f;
constexpr float kDownNarrow = 0.125f;
float proj_scale(int64_t fan_in) {
  return 1.7f / std::sqrt(static_cast<float>(fan_in));
}

// One row of a master weight matrix segment: (tensor, master row, scale).
struct RowSource {
  TensorId id;
  int64_t row;
  float scale;
};

// This rank's fused projection rows [q | k | v | index_q | index_k] (ModelConfig::sparse; with
// CP every index_q head); [q | k | v] of a dense layer.
std::vector<RowSource> qkv_rows(const ModelConfig& m, int rank, int world, bool cp, bool dense) {
  const float s = proj_scale(m.hidden);
  std::vector<RowSource> rows;
  auto add = [&](TensorId id, int64_t first, int64_t count) {
    for (int64_t i = 0; i < count; ++i) rows.push_back({id, first + i, s});
  };
  const RankLayout l = rank_layout(m, rank, world, cp);
  add(kWq, l.q_rows.first, l.q_rows.count);
  add(kWk, l.k_rows.first, l.k_rows.count);
  add(kWv, l.v_rows.first, l.v_rows.count);
  if (dense) return rows;
  add(kWiq, l.index_q_rows.first, l.index_q_rows.count);
  add(kWik, l.index_k_rows.first, l.index_k_rows.count);
  return rows;
}

// Fills `out` ([rows, cols] bf16 or fp8 + per-row scale) with master columns [c0, c0 + cols) of
// master rows of width `master_cols`. fp8: the scale is max |w| / 448 over the whole master row,
// so the dequantized values do not depend on TP.
void fill_matrix(const Spec& spec, int layer, const std::vector<RowSource>& rows,
                 int64_t master_cols, int64_t c0, int64_t cols, bool fp8, HostTensor& out,
                 HostTensor* scale, std::vector<float>* dequantized, int threads) {
  const int64_t n = static_cast<int64_t>(rows.size());
  if (dequantized) dequantized->assign(static_cast<std::size_t>(n * cols), 0.0f);
  parallel_for(n, threads, [&](int64_t b, int64_t e) {
    std::vector<float> v(static_cast<std::size_t>(master_cols));
    for (int64_t r = b; r < e; ++r) {
      const RowSource& src = rows[static_cast<std::size_t>(r)];
      const uint64_t stream = stream_of(spec, layer, src.id);
      float amax = 0.0f;
      for (int64_t c = 0; c < master_cols; ++c) {
        const bool needed = fp8 || (c >= c0 && c < c0 + cols);
        if (!needed) continue;
        v[static_cast<std::size_t>(c)] = round_to_bf16(
            hashed_unit(stream, static_cast<uint64_t>(src.row * master_cols + c)) * src.scale);
        amax = std::max(amax, std::fabs(v[static_cast<std::size_t>(c)]));
      }
      const float s = amax > 0 ? amax / 448.0f : 1.0f;
      if (fp8 && scale) scale->ptr<float>()[r] = s;
      for (int64_t c = 0; c < cols; ++c) {
        const float x = v[static_cast<std::size_t>(c0 + c)];
        float deq;
        if (fp8) {
          const uint8_t q = float_to_fp8e4m3(x / s);
          out.ptr<uint8_t>()[r * cols + c] = q;
          deq = fp8e4m3_to_float(q) * s;
        } else {
          out.ptr<uint16_t>()[r * cols + c] = float_to_bf16(x);
          deq = x;
        }
        if (dequantized) (*dequantized)[static_cast<std::size_t>(r * cols + c)] = deq;
      }
    }
  });
}

HostTensor norm_tensor(const Spec& spec, int layer, TensorId id, int64_t n) {
  HostTensor t(DType::kBF16, {n});
  const uint64_t stream = stream_of(spec, layer, id);
  for (int64_t i = 0; i < n; ++i) {
    t.ptr<uint16_t>()[i] = float_to_bf16(hashed_unit(stream, static_cast<uint64_t>(i)) * 0.2f);
  }
  return t;
}

}  // namespace

RuntimeConfig Spec::runtime_config(int threads) const {
  RuntimeConfig c;
  c.model = model;
  c.token_buckets.clear();
  for (int b = 1;; b *= 2) {
    c.token_buckets.push_back(b);
    if (b >= rows()) break;
  }
  c.query_lens = {q_len};
  c.max_requests = batch;
  c.max_context = max_blocks * model.block_size;
  c.context_parallel = context_parallel;
  c.threads = std::max(1, threads);
  return c;
}

double Spec::weight_bytes(int tp) const {
  const SparseConfig sc = model.sparse(tp, context_parallel);
  const double per = fp8 ? 1.0 : 2.0;
  const double H = model.hidden;
  const double qkv = static_cast<double>(sc.qkv_width()) * H * per;
  const double o = H * sc.q_heads * sc.head_dim * per;
  const double mlp = moe ? 0.0 : 3.0 * H * (model.intermediate / tp) * 2.0;
  // MoE: every expert's slice, plus one e8m0 byte per 32 MXFP8 elements, plus the f32 router.
  const double mx = moe_fp8 ? 1.0 + 1.0 / 32 : 2.0;
  const double expert_elems =
      moe ? 3.0 * H * (model.moe_intermediate / tp) * (model.num_experts + model.shared_experts)
          : 0.0;
  const double experts = expert_elems * mx + (moe ? 4.0 * H * (model.num_experts + 1) : 0.0);
  const double dense_qkv = static_cast<double>(rank_layout(model, 0, tp).dense_qkv_width) * H * per;
  const double dense_mlp = 3.0 * H * (model.dense_intermediate / tp) * mx;
  return (qkv + o + mlp + experts) * model.num_sparse_layers() +
         (dense_layers ? (dense_qkv + o + dense_mlp) * model.first_sparse_layer : 0.0);
}

double Spec::cache_bytes(int tp) const {
  const SparseConfig sc = model.sparse(tp);
  const double kv = static_cast<double>(pages) * sc.kv_heads * 2 * model.block_size * sc.head_dim;
  const double ix = static_cast<double>(pages) * model.block_size * sc.index_dim;
  return ((kv + ix) * model.num_sparse_layers() +
          (dense_layers ? kv * model.first_sparse_layer : 0)) *
         2.0;
}

Spec make_spec(const ModelConfig& model, bool fp8, uint64_t seed, int batch, int64_t context,
               int q_len, int steps) {
  Spec s;
  s.model = model;
  s.fp8 = fp8;
  s.seed = seed;
  s.batch = batch;
  s.q_len = q_len;
  s.steps = steps;
  int64_t longest = 0;
  for (int r = 0; r < batch; ++r) {
    // Contexts differ by a block and a token per request (block boundaries move between rows).
    const int64_t c = std::max<int64_t>(0, context - int64_t{r} * (model.block_size + 1));
    s.contexts.push_back(c);
    longest = std::max(longest, c);
  }
  const int64_t final_len = longest + int64_t{steps} * q_len;
  M3MSA_CHECK_ARG(final_len <= INT32_MAX, "--context + --steps * --q-len = ", final_len,
                  " does not fit the i32 seq_lens");
  s.max_blocks = (final_len + model.block_size - 1) / model.block_size;
  s.pages = int64_t{batch} * s.max_blocks + 1;  // one page no request owns
  return s;
}

MasterMoe make_layer_moe(const Spec& spec, int layer) {
  return make_master_moe(spec.model, derive_seed(spec.seed, 5000 + static_cast<uint64_t>(layer)),
                         spec.moe_fp8);
}

MasterDenseMlp make_layer_dense_mlp(const Spec& spec, int layer) {
  return make_master_dense_mlp(
      spec.model, derive_seed(spec.seed, 6000 + static_cast<uint64_t>(layer)), spec.moe_fp8);
}

HostModel make_host_model(const Spec& spec, int rank, int world, int threads) {
  const ModelConfig& m = spec.model;
  const SparseConfig sc = m.sparse(world);
  HostModel out;
  out.storage.reserve(32 * static_cast<std::size_t>(spec.run_layers()));
  auto keep = [&](HostTensor t) {
    out.storage.push_back(std::move(t));
    return out.storage.back().view();
  };
  const int64_t H = m.hidden;
  const int64_t A = int64_t{m.q_heads} * m.head_dim;  // master attention width
  const int64_t Ar = int64_t{sc.q_heads} * m.head_dim;
  const RankLayout layout = rank_layout(m, rank, world);
  const int64_t q0 = layout.first_q_head;
  const int kv0 = layout.first_kv_head;
  for (int layer = spec.first_layer(); layer < m.num_layers; ++layer) {
    LayerWeights w;
    w.layer = layer;
    const bool dense = layer < m.first_sparse_layer;
    const std::vector<RowSource> rows = qkv_rows(m, rank, world, spec.context_parallel, dense);
    const int64_t W = static_cast<int64_t>(rows.size());
    HostTensor qkv(spec.fp8 ? DType::kFP8E4M3 : DType::kBF16, {W, H});
    HostTensor qkv_scale(DType::kF32, {W});
    fill_matrix(spec, layer, rows, H, 0, H, spec.fp8, qkv, &qkv_scale, nullptr, threads);
    w.qkv_proj = keep(qkv);
    if (spec.fp8) w.qkv_proj_scale = keep(qkv_scale);
    std::vector<RowSource> o_rows;
    for (int64_t n = 0; n < H; ++n) o_rows.push_back({kWo, n, proj_scale(A)});
    HostTensor o(spec.fp8 ? DType::kFP8E4M3 : DType::kBF16, {H, Ar});
    HostTensor o_scale(DType::kF32, {H});
    fill_matrix(spec, layer, o_rows, A, q0 * m.head_dim, Ar, spec.fp8, o, &o_scale, nullptr,
                threads);
    w.o_proj = keep(o);
    if (spec.fp8) w.o_proj_scale = keep(o_scale);
    w.q_norm = keep(norm_tensor(spec, layer, kQNorm, m.head_dim));
    w.k_norm = keep(norm_tensor(spec, layer, kKNorm, m.head_dim));
    if (!dense) {
      w.index_q_norm = keep(norm_tensor(spec, layer, kIqNorm, m.index_dim));
      w.index_k_norm = keep(norm_tensor(spec, layer, kIkNorm, m.index_dim));
    }
    w.input_norm = keep(norm_tensor(spec, layer, kInputNorm, H));
    w.post_attention_norm = keep(norm_tensor(spec, layer, kPostNorm, H));
    if (dense) {
      w.dense_mlp = bind_dense_mlp(m, make_layer_dense_mlp(spec, layer), rank, world, out.storage);
    } else if (spec.moe) {
      bind_moe(m, make_layer_moe(spec, layer), rank, world, out.storage, w);
    } else if (m.intermediate > 0) {
      const int64_t I = m.intermediate;
      const int64_t Ir = I / world;
      std::vector<RowSource> gu;
      for (int64_t i = 0; i < Ir; ++i)
        gu.push_back({kGate, rank * Ir + i, kGateUpWidth * proj_scale(H)});
      for (int64_t i = 0; i < Ir; ++i)
        gu.push_back({kUp, rank * Ir + i, kGateUpWidth * proj_scale(H)});
      HostTensor gate_up(DType::kBF16, {2 * Ir, H});
      fill_matrix(spec, layer, gu, H, 0, H, false, gate_up, nullptr, nullptr, threads);
      w.mlp_gate_up = keep(gate_up);
      std::vector<RowSource> d_rows;
      for (int64_t n = 0; n < H; ++n) d_rows.push_back({kDown, n, kDownNarrow * proj_scale(I)});
      HostTensor down(DType::kBF16, {H, Ir});
      fill_matrix(spec, layer, d_rows, I, rank * Ir, Ir, false, down, nullptr, nullptr, threads);
      w.mlp_down = keep(down);
    }
    // Caches: random everywhere (the prefix context and the pages no request owns alike).
    const int64_t tile = int64_t{2} * m.block_size * m.head_dim;  // K and V of one head
    HostTensor kv(DType::kBF16, {spec.pages, sc.kv_heads, 2, m.block_size, m.head_dim});
    const uint64_t kv_stream = stream_of(spec, layer, kKvCache);
    parallel_for(spec.pages * sc.kv_heads, threads, [&](int64_t b, int64_t e) {
      for (int64_t ph = b; ph < e; ++ph) {
        const int64_t p = ph / sc.kv_heads;
        const int64_t h = ph % sc.kv_heads;
        const int64_t master = (p * m.kv_heads + kv0 + h) * tile;
        uint16_t* dst = kv.ptr<uint16_t>() + ph * tile;
        for (int64_t i = 0; i < tile; ++i) {
          dst[i] = float_to_bf16(hashed_unit(kv_stream, static_cast<uint64_t>(master + i)));
        }
      }
    });
    w.kv_cache = {keep(kv), 1.0f, 1.0f};
    if (!dense) {
      HostTensor index(DType::kBF16, {spec.pages, m.block_size, m.index_dim});
      const uint64_t ix_stream = stream_of(spec, layer, kIndexCache);
      parallel_for(index.numel(), threads, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          index.ptr<uint16_t>()[i] =
              float_to_bf16(hashed_unit(ix_stream, static_cast<uint64_t>(i)));
        }
      });
      w.index_cache = {keep(index)};
    }
    out.weights.layers.push_back(w);
  }
  return out;
}

MasterLayer make_master_layer(const Spec& spec, int layer_index, int threads) {
  const ModelConfig& m = spec.model;
  const int layer = spec.first_layer() + layer_index;
  const int64_t H = m.hidden;
  const int64_t A = int64_t{m.q_heads} * m.head_dim;
  MasterLayer out;
  out.layer = layer;
  out.dense = layer < m.first_sparse_layer;
  const std::vector<RowSource> rows = qkv_rows(m, 0, 1, false, out.dense);
  const int64_t W = static_cast<int64_t>(rows.size());
  HostTensor scratch(spec.fp8 ? DType::kFP8E4M3 : DType::kBF16, {W, H});
  HostTensor scale(DType::kF32, {std::max(W, H)});
  fill_matrix(spec, layer, rows, H, 0, H, spec.fp8, scratch, &scale, &out.qkv, threads);
  std::vector<RowSource> o_rows;
  for (int64_t n = 0; n < H; ++n) o_rows.push_back({kWo, n, proj_scale(A)});
  HostTensor o(spec.fp8 ? DType::kFP8E4M3 : DType::kBF16, {H, A});
  fill_matrix(spec, layer, o_rows, A, 0, A, spec.fp8, o, &scale, &out.o_proj, threads);
  if (out.dense) {
    out.dense_mlp = make_layer_dense_mlp(spec, layer);
  } else if (spec.moe) {
    out.has_moe = true;
    out.moe = make_layer_moe(spec, layer);
  } else if (m.intermediate > 0) {
    const int64_t I = m.intermediate;
    std::vector<RowSource> g, u, d;
    for (int64_t i = 0; i < I; ++i) g.push_back({kGate, i, kGateUpWidth * proj_scale(H)});
    for (int64_t i = 0; i < I; ++i) u.push_back({kUp, i, kGateUpWidth * proj_scale(H)});
    for (int64_t n = 0; n < H; ++n) d.push_back({kDown, n, kDownNarrow * proj_scale(I)});
    HostTensor gs(DType::kBF16, {I, H}), ds(DType::kBF16, {H, I});
    fill_matrix(spec, layer, g, H, 0, H, false, gs, nullptr, &out.gate, threads);
    fill_matrix(spec, layer, u, H, 0, H, false, gs, nullptr, &out.up, threads);
    fill_matrix(spec, layer, d, I, 0, I, false, ds, nullptr, &out.down, threads);
  }
  out.q_norm = to_floats(norm_tensor(spec, layer, kQNorm, m.head_dim));
  out.k_norm = to_floats(norm_tensor(spec, layer, kKNorm, m.head_dim));
  if (!out.dense) {
    out.iq_norm = to_floats(norm_tensor(spec, layer, kIqNorm, m.index_dim));
    out.ik_norm = to_floats(norm_tensor(spec, layer, kIkNorm, m.index_dim));
  }
  out.input_norm = to_floats(norm_tensor(spec, layer, kInputNorm, H));
  out.post_norm = to_floats(norm_tensor(spec, layer, kPostNorm, H));
  return out;
}

Step make_step(const Spec& spec, int step) {
  const std::vector<int32_t> index_perm =
      page_permutation(spec.pages, derive_seed(spec.seed, 7, 0));
  const std::vector<int32_t> kv_perm = page_permutation(spec.pages, derive_seed(spec.seed, 7, 1));
  std::vector<int32_t> seq_lens;
  for (int64_t c : spec.contexts) {
    seq_lens.push_back(static_cast<int32_t>(c + int64_t{step + 1} * spec.q_len));
  }
  Step s;
  static_cast<StepMeta&>(s) = testkit::make_step(seq_lens, spec.q_len, spec.model.block_size,
                                                 spec.max_blocks, index_perm, kv_perm);
  const uint64_t stream = derive_seed(spec.seed, 3000 + static_cast<uint64_t>(step));
  s.hidden_in.resize(static_cast<std::size_t>(spec.rows() * spec.model.hidden));
  for (std::size_t i = 0; i < s.hidden_in.size(); ++i) {
    s.hidden_in[i] = float_to_bf16(hashed_unit(stream, i));
  }
  return s;
}

std::vector<Step> make_steps(const Spec& spec) {
  std::vector<Step> steps;
  for (int s = 0; s < spec.steps; ++s) steps.push_back(make_step(spec, s));
  return steps;
}

}  // namespace m3msa::testkit::demo
