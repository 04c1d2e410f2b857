// m3msa demo (default mode): the fused decode runtime on a synthetic model; see demo_runtime.h.
//
// Two runs:
//  1. The demo run: the requested model (M3's attention dimensions, hidden 6144 on the GPU) at
//     TP over the GPUs present, prepare -> steps -> detach, timed per step, stats() printed.
//  2. The check run, on a small configuration (M3's attention dimensions, hidden 512, 2 layers,
//     2 requests, 2 steps, contexts of ~17 blocks so top-16 is a real selection), same backend and
//     TP, every layer's inputs / outputs / selections recorded; then an oracle replays every layer
//     from the recorded input (teacher forcing, so differences do not compound):
//       - CUDA: the CPU runtime at TP = 1 on the same weights and caches;
//       - CPU:  an independent composition of the CPU reference ops (cpu::preprocess /
//               select_topk / sparse_attention) with double-precision projections and norms.
//     Outputs must agree within |got - want| <= abs + rel |want| (the tolerances of
//     tests/cpu/runtime_forward_test.cc and tests/cuda/runtime_gpu_test.cc, the TP terms added
//     when TP > 1); selections equal, or differing only by swaps of near-tied blocks (method.md,
//     1e-3 of the k-th score; such rows are left out of the value check, at most a quarter of
//     them); every rank's outputs bit-identical to rank 0's.
#include "demo_runtime.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "backend_select.h"
#include "checks.h"
#include "commands.h"
#include "common.h"
#include "json_out.h"
#include "m3msa/comm.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/dtype.h"
#include "m3msa/error.h"
#include "m3msa/sort_key.h"
#include "progress.h"

namespace m3msa::cli {

namespace demo_rt {

namespace {

using Clock = std::chrono::steady_clock;

// ---- Counter-based random values: element i of tensor stream s, uniform in [-1, 1) ----

inline float hashed_unit(uint64_t stream, uint64_t i) {
  uint64_t z = stream + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

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

// Calls body(begin, end) over [0, n) on up to `threads` threads.
void parallel_for(int64_t n, int threads, const std::function<void(int64_t, int64_t)>& body) {
  const int t = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, n / 64)));
  if (t <= 1) {
    if (n > 0) body(0, n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t chunk = (n + t - 1) / t;
  for (int i = 0; i < t; ++i) {
    const int64_t b = i * chunk;
    const int64_t e = std::min(n, b + chunk);
    if (b < e) pool.emplace_back([&, b, e] { body(b, e); });
  }
  for (auto& th : pool) th.join();
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
// CP every index_q head).
std::vector<RowSource> qkv_rows(const ModelConfig& m, int rank, int world, bool cp) {
  const float s = proj_scale(m.hidden);
  std::vector<RowSource> rows;
  auto add = [&](TensorId id, int64_t first, int64_t count) {
    for (int64_t i = 0; i < count; ++i) rows.push_back({id, first + i, s});
  };
  const RankLayout l = rank_layout(m, rank, world, cp);
  add(kWq, l.q_rows.first, l.q_rows.count);
  add(kWk, l.k_rows.first, l.k_rows.count);
  add(kWv, l.v_rows.first, l.v_rows.count);
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

std::vector<float> to_floats(const HostTensor& t) {
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_float(t.ptr<uint16_t>()[i]);
  return out;
}

std::vector<int32_t> page_permutation(int64_t pages, uint64_t seed) {
  std::vector<int32_t> perm(static_cast<std::size_t>(pages));
  for (std::size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int32_t>(i);
  Rng rng(seed);
  for (std::size_t i = perm.size(); i > 1; --i) {
    std::swap(perm[i - 1], perm[static_cast<std::size_t>(rng.next() % i)]);
  }
  return perm;
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
  const double mlp = 3.0 * H * (model.intermediate / tp) * 2.0;
  return (qkv + o + mlp) * model.num_sparse_layers();
}

double Spec::cache_bytes(int tp) const {
  const SparseConfig sc = model.sparse(tp);
  const double kv = static_cast<double>(pages) * sc.kv_heads * 2 * model.block_size * sc.head_dim;
  const double ix = static_cast<double>(pages) * model.block_size * sc.index_dim;
  return (kv + ix) * 2.0 * model.num_sparse_layers();
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

HostModel make_host_model(const Spec& spec, int rank, int world, int threads) {
  const ModelConfig& m = spec.model;
  const SparseConfig sc = m.sparse(world);
  HostModel out;
  out.storage.reserve(32 * static_cast<std::size_t>(m.num_sparse_layers()));
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
  for (int layer = m.first_sparse_layer; layer < m.num_layers; ++layer) {
    LayerWeights w;
    w.layer = layer;
    const std::vector<RowSource> rows = qkv_rows(m, rank, world, spec.context_parallel);
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
    w.index_q_norm = keep(norm_tensor(spec, layer, kIqNorm, m.index_dim));
    w.index_k_norm = keep(norm_tensor(spec, layer, kIkNorm, m.index_dim));
    w.input_norm = keep(norm_tensor(spec, layer, kInputNorm, H));
    w.post_attention_norm = keep(norm_tensor(spec, layer, kPostNorm, H));
    if (m.intermediate > 0) {
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
    HostTensor index(DType::kBF16, {spec.pages, m.block_size, m.index_dim});
    const uint64_t ix_stream = stream_of(spec, layer, kIndexCache);
    parallel_for(index.numel(), threads, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        index.ptr<uint16_t>()[i] = float_to_bf16(hashed_unit(ix_stream, static_cast<uint64_t>(i)));
      }
    });
    w.kv_cache = {keep(kv), 1.0f, 1.0f};
    w.index_cache = {keep(index)};
    out.weights.layers.push_back(w);
  }
  return out;
}

MasterLayer make_master_layer(const Spec& spec, int layer_index, int threads) {
  const ModelConfig& m = spec.model;
  const int layer = m.first_sparse_layer + layer_index;
  const int64_t H = m.hidden;
  const int64_t A = int64_t{m.q_heads} * m.head_dim;
  MasterLayer out;
  out.layer = layer;
  const std::vector<RowSource> rows = qkv_rows(m, 0, 1, false);
  const int64_t W = static_cast<int64_t>(rows.size());
  HostTensor scratch(spec.fp8 ? DType::kFP8E4M3 : DType::kBF16, {W, H});
  HostTensor scale(DType::kF32, {std::max(W, H)});
  fill_matrix(spec, layer, rows, H, 0, H, spec.fp8, scratch, &scale, &out.qkv, threads);
  std::vector<RowSource> o_rows;
  for (int64_t n = 0; n < H; ++n) o_rows.push_back({kWo, n, proj_scale(A)});
  HostTensor o(spec.fp8 ? DType::kFP8E4M3 : DType::kBF16, {H, A});
  fill_matrix(spec, layer, o_rows, A, 0, A, spec.fp8, o, &scale, &out.o_proj, threads);
  if (m.intermediate > 0) {
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
  out.iq_norm = to_floats(norm_tensor(spec, layer, kIqNorm, m.index_dim));
  out.ik_norm = to_floats(norm_tensor(spec, layer, kIkNorm, m.index_dim));
  out.input_norm = to_floats(norm_tensor(spec, layer, kInputNorm, H));
  out.post_norm = to_floats(norm_tensor(spec, layer, kPostNorm, H));
  return out;
}

Step make_step(const Spec& spec, int step) {
  Step s;
  const int64_t n = spec.batch;
  const int q = spec.q_len;
  const int64_t rows = n * q;
  const int64_t mb = spec.max_blocks;
  const int bs = spec.model.block_size;
  const std::vector<int32_t> index_perm =
      page_permutation(spec.pages, derive_seed(spec.seed, 7, 0));
  const std::vector<int32_t> kv_perm = page_permutation(spec.pages, derive_seed(spec.seed, 7, 1));
  s.seq_lens = HostTensor(DType::kI32, {n});
  s.index_table = HostTensor(DType::kI32, {n, mb});
  s.kv_table = HostTensor(DType::kI32, {n, mb});
  s.slots = HostTensor(DType::kI64, {rows});
  s.index_slots = HostTensor(DType::kI64, {rows});
  s.positions = HostTensor(DType::kI64, {rows});
  for (int64_t r = 0; r < n; ++r) {
    const int64_t len = spec.contexts[static_cast<std::size_t>(r)] + int64_t{step + 1} * q;
    s.seq_lens.ptr<int32_t>()[r] = static_cast<int32_t>(len);
    for (int64_t b = 0; b < mb; ++b) {
      s.index_table.ptr<int32_t>()[r * mb + b] = index_perm[static_cast<std::size_t>(r * mb + b)];
      s.kv_table.ptr<int32_t>()[r * mb + b] = kv_perm[static_cast<std::size_t>(r * mb + b)];
    }
    for (int j = 0; j < q; ++j) {
      const int64_t row = r * q + j;
      const int64_t pos = len - q + j;
      const int64_t b = pos / bs;
      s.positions.ptr<int64_t>()[row] = pos;
      s.slots.ptr<int64_t>()[row] = int64_t{s.kv_table.ptr<int32_t>()[r * mb + b]} * bs + pos % bs;
      s.index_slots.ptr<int64_t>()[row] =
          int64_t{s.index_table.ptr<int32_t>()[r * mb + b]} * bs + pos % bs;
    }
  }
  s.batch.kind = BatchKind::kDecode;
  s.batch.num_reqs = static_cast<int>(n);
  s.batch.q_len = q;
  s.batch.seq_lens = s.seq_lens.view();
  s.batch.index_block_table = s.index_table.view();
  s.batch.kv_block_table = s.kv_table.view();
  s.batch.slot_mapping = s.slots.view();
  s.batch.index_slot_mapping = s.index_slots.view();
  const uint64_t stream = derive_seed(spec.seed, 3000 + static_cast<uint64_t>(step));
  s.hidden_in.resize(static_cast<std::size_t>(rows * spec.model.hidden));
  for (std::size_t i = 0; i < s.hidden_in.size(); ++i) {
    s.hidden_in[i] = float_to_bf16(hashed_unit(stream, i));
  }
  return s;
}

RunResult start_run(const Spec& spec, const char* backend, int tp, bool record) {
  RunResult out;
  out.backend = backend;
  out.tp = tp;
  if (record) {
    const ModelConfig& m = spec.model;
    const std::size_t topk_values =
        static_cast<std::size_t>(spec.rows() * m.index_heads * m.sparse(tp).topk);
    out.records.assign(static_cast<std::size_t>(spec.steps),
                       std::vector<LayerRecord>(static_cast<std::size_t>(m.num_sparse_layers())));
    for (auto& step : out.records) {
      for (auto& rec : step) rec.topk.assign(topk_values, -1);
    }
  }
  return out;
}

std::vector<Step> make_steps(const Spec& spec) {
  std::vector<Step> steps;
  for (int s = 0; s < spec.steps; ++s) steps.push_back(make_step(spec, s));
  return steps;
}

RunResult run_cpu(const Spec& spec, int tp, int threads, bool record,
                  const std::function<void(const std::string&)>& progress) {
  RunResult out = start_run(spec, "cpu", tp, record);
  const ModelConfig& m = spec.model;
  const int layers = m.num_sparse_layers();
  const int64_t rows = spec.rows();
  const int64_t H = m.hidden;
  const SparseConfig sc = m.sparse(tp);
  const int k = sc.topk;
  const int IH = m.index_heads;
  const int rank_threads = std::max(1, threads / tp);
  const std::vector<Step> steps = make_steps(spec);
  // Every rank's outputs per (step, layer), to compare them with rank 0's.
  std::vector<std::vector<std::vector<uint16_t>>> rank_out(static_cast<std::size_t>(tp));
  std::mutex mutex;
  const RuntimeConfig config = spec.runtime_config(rank_threads);
  auto group = ThreadGroup::create(tp, std::chrono::seconds(120));
  const auto errors = run_ranks(group, [&](Communicator& comm) {
    const int r = comm.rank();
    const auto t_setup = Clock::now();
    if (r == 0) progress("building the weights and caches");
    HostModel model = make_host_model(spec, r, tp, rank_threads);
    Runtime rt([](const std::string&) {});  // fallbacks are reported through stats()
    const PrepareResult prepared = rt.prepare(model.weights, config, comm);
    if (r == 0) {
      out.prepared = prepared;
      out.setup_s = seconds_since(t_setup);
    }
    if (prepared != PrepareResult::kActive) {
      if (r == 0) out.stats = rt.stats();
      rt.close();
      return;
    }
    std::vector<uint16_t> hidden, residual;
    for (int s = 0; s < spec.steps; ++s) {
      if (r == 0) progress(fmt::format("step {}/{}", s + 1, spec.steps));
      const Step& step = steps[static_cast<std::size_t>(s)];
      const auto t0 = Clock::now();
      M3MSA_CHECK_INTERNAL(rt.begin_step(step.batch), "rank ", r, ": step ", s + 1,
                           " refused: ", rt.stats().last_refusal);
      hidden = step.hidden_in;
      residual.assign(hidden.size(), 0);
      const TensorView hv = TensorView::contiguous(hidden.data(), DType::kBF16, {rows, H});
      const TensorView rv = TensorView::contiguous(residual.data(), DType::kBF16, {rows, H});
      for (int l = 0; l < layers; ++l) {
        LayerRecord* rec =
            record ? &out.records[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)]
                   : nullptr;
        if (rec && r == 0) {
          rec->in_hidden = hidden;
          rec->in_residual = residual;
        }
        rt.forward_layer(m.first_sparse_layer + l, hv, rv, step.positions.view());
        if (!rec) continue;
        const Runtime::LayerTrace trace = rt.last_layer_trace();
        const int32_t* topk = trace.topk.ptr<const int32_t>();
        const int kv0 = rank_layout(m, r, tp).first_kv_head;
        {
          std::lock_guard<std::mutex> lock(mutex);
          for (int64_t row = 0; row < rows; ++row) {
            for (int h = 0; h < sc.kv_heads; ++h) {  // this rank's heads
              std::memcpy(&rec->topk[static_cast<std::size_t>((row * IH + kv0 + h) * k)],
                          topk + (row * sc.kv_heads + h) * k, sizeof(int32_t) * k);
            }
          }
          auto& mine = rank_out[static_cast<std::size_t>(r)];
          mine.push_back(hidden);
          mine.push_back(residual);
        }
        if (r == 0) {
          rec->out_hidden = hidden;
          rec->out_residual = residual;
        }
      }
      if (r == 0) out.step_ms.push_back(seconds_since(t0) * 1e3);
    }
    if (r == 0) out.stats = rt.stats();
    std::vector<LayerCaches> empty;
    for (const LayerWeights& w : model.weights.layers) empty.push_back({w.layer, {}, {}});
    rt.detach(empty);
  });
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  for (int r = 1; r < tp; ++r) {
    const auto& mine = rank_out[static_cast<std::size_t>(r)];
    const auto& zero = rank_out[0];
    for (std::size_t i = 0; i < mine.size() && i < zero.size(); ++i) {
      for (std::size_t j = 0; j < mine[i].size(); ++j)
        out.rank_mismatches += mine[i][j] != zero[i][j];
    }
    if (mine.size() != zero.size()) ++out.rank_mismatches;
  }
  return out;
}

// ---- Oracles: one layer from a given input ----

class Oracle {
 public:
  virtual ~Oracle() = default;
  virtual std::string name() const = 0;
  virtual void begin_step(const Step& step) = 0;
  // In place: the layer's outputs; topk [rows, H, k]; scores [rows, H, max_blocks] of the
  // oracle's index_q over its own caches (the near-tie rule's reference).
  virtual void layer(int li, const Step& step, std::vector<uint16_t>& hidden,
                     std::vector<uint16_t>& residual, std::vector<int32_t>& topk,
                     HostTensor& scores) = 0;
};

// The CPU runtime at TP = 1 (the oracle of the CUDA path).
class CpuRuntimeOracle final : public Oracle {
 public:
  CpuRuntimeOracle(const Spec& spec, int threads)
      : spec_(spec),
        model_(make_host_model(spec, 0, 1, threads)),
        comm_(make_single_rank_communicator()),
        rt_([](const std::string&) {}) {
    const PrepareResult p = rt_.prepare(model_.weights, spec.runtime_config(threads), *comm_);
    M3MSA_CHECK_INTERNAL(p == PrepareResult::kActive, "the CPU runtime oracle: prepare returned ",
                         prepare_result_name(p));
  }
  ~CpuRuntimeOracle() override {
    try {
      rt_.close();
    } catch (...) {
    }
  }
  std::string name() const override { return "the CPU runtime (TP = 1)"; }
  void begin_step(const Step& step) override {
    M3MSA_CHECK_INTERNAL(rt_.begin_step(step.batch),
                         "the CPU runtime oracle refused a step: ", rt_.stats().last_refusal);
  }
  void layer(int li, const Step& step, std::vector<uint16_t>& hidden,
             std::vector<uint16_t>& residual, std::vector<int32_t>& topk,
             HostTensor& scores) override {
    const int64_t rows = spec_.rows();
    const int64_t H = spec_.model.hidden;
    rt_.forward_layer(spec_.model.first_sparse_layer + li,
                      TensorView::contiguous(hidden.data(), DType::kBF16, {rows, H}),
                      TensorView::contiguous(residual.data(), DType::kBF16, {rows, H}),
                      step.positions.view());
    const Runtime::LayerTrace t = rt_.last_layer_trace();
    topk.assign(t.topk.ptr<const int32_t>(), t.topk.ptr<const int32_t>() + t.topk.numel());
    IndexerArgs idx;
    idx.index_q = t.index_q;
    idx.index_cache = model_.weights.layers[static_cast<std::size_t>(li)].index_cache;
    idx.batch = rt_.step_metadata();
    idx.topk_idx = t.topk;
    cpu::score_blocks(spec_.model.sparse(1), idx, scores.view());
  }

 private:
  Spec spec_;
  HostModel model_;
  std::unique_ptr<Communicator> comm_;
  Runtime rt_;
};

// The independent composition (the oracle of the CPU path): the CPU reference ops for the
// attention core, double-precision projections and norms written out here, so wiring errors of
// the runtime (a wrong slice, a wrong norm, a wrong order of adds) cannot cancel.
class ComposedOracle final : public Oracle {
 public:
  ComposedOracle(const Spec& spec, int threads) : spec_(spec), threads_(threads) {
    HostModel caches = make_host_model(spec, 0, 1, threads);
    for (int li = 0; li < spec.model.num_sparse_layers(); ++li) {
      master_.push_back(make_master_layer(spec, li, threads));
      const LayerWeights& w = caches.weights.layers[static_cast<std::size_t>(li)];
      kv_.push_back(w.kv_cache);
      index_.push_back(w.index_cache);
      norms_.push_back({w.q_norm, w.k_norm, w.index_q_norm, w.index_k_norm});
    }
    keep_ = std::move(caches.storage);
  }
  std::string name() const override {
    return "the independent reference (CPU reference ops + double-precision matmuls and norms, "
           "TP = 1)";
  }
  void begin_step(const Step&) override {}
  void layer(int li, const Step& step, std::vector<uint16_t>& hidden,
             std::vector<uint16_t>& residual, std::vector<int32_t>& topk,
             HostTensor& scores) override {
    const ModelConfig& m = spec_.model;
    const MasterLayer& w = master_[static_cast<std::size_t>(li)];
    const SparseConfig sc = m.sparse(1);
    const int64_t rows = spec_.rows();
    const int64_t H = m.hidden;
    const int64_t W = sc.qkv_width();
    const int64_t A = int64_t{sc.q_heads} * sc.head_dim;
    auto f = [](uint16_t v) { return static_cast<double>(bf16_to_float(v)); };
    auto bf = [](double v) { return float_to_bf16(static_cast<float>(v)); };
    auto matvec = [&](const uint16_t* x, const std::vector<float>& wt, int64_t n_out, int64_t n_in,
                      uint16_t* y) {
      std::vector<double> xd(static_cast<std::size_t>(n_in));
      for (int64_t i = 0; i < n_in; ++i) xd[static_cast<std::size_t>(i)] = f(x[i]);
      parallel_for(n_out, threads_, [&](int64_t b, int64_t e) {
        for (int64_t n = b; n < e; ++n) {
          double acc = 0.0;
          const float* row = wt.data() + n * n_in;
          for (int64_t i = 0; i < n_in; ++i) acc += xd[static_cast<std::size_t>(i)] * row[i];
          y[n] = bf(acc);
        }
      });
    };
    auto rmsnorm = [&](const uint16_t* x, const std::vector<float>& wt, int64_t n, uint16_t* y) {
      double sum_sq = 0.0;
      for (int64_t i = 0; i < n; ++i) sum_sq += f(x[i]) * f(x[i]);
      const double r = 1.0 / std::sqrt(sum_sq / static_cast<double>(n) + m.rms_eps);
      for (int64_t i = 0; i < n; ++i) y[i] = bf(f(x[i]) * r * (1.0 + wt[static_cast<size_t>(i)]));
    };
    std::vector<uint16_t> x(static_cast<std::size_t>(rows * H)), normed(x.size());
    std::vector<uint16_t> qkv(static_cast<std::size_t>(rows * W));
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = bf(f(hidden[i]) + f(residual[i]));
    for (int64_t r = 0; r < rows; ++r) {
      rmsnorm(&x[static_cast<std::size_t>(r * H)], w.input_norm, H,
              &normed[static_cast<std::size_t>(r * H)]);
      matvec(&normed[static_cast<std::size_t>(r * H)], w.qkv, W, H,
             &qkv[static_cast<std::size_t>(r * W)]);
    }
    HostTensor q(DType::kBF16, {rows, sc.q_heads, sc.head_dim});
    HostTensor iq(DType::kBF16, {rows, sc.index_heads, sc.index_dim});
    HostTensor sel(DType::kI32, {rows, sc.index_heads, sc.topk});
    HostTensor attn(DType::kBF16, {rows, sc.q_heads, sc.head_dim});
    const auto& n = norms_[static_cast<std::size_t>(li)];
    PreprocessArgs pre;
    pre.qkv = TensorView::contiguous(qkv.data(), DType::kBF16, {rows, W});
    pre.q_norm = n[0];
    pre.k_norm = n[1];
    pre.index_q_norm = n[2];
    pre.index_k_norm = n[3];
    pre.positions = step.positions.view();
    pre.batch = step.batch;
    pre.kv_cache = kv_[static_cast<std::size_t>(li)];
    pre.index_cache = index_[static_cast<std::size_t>(li)];
    pre.q_out = q.view();
    pre.index_q_out = iq.view();
    cpu::preprocess(sc, pre, threads_);
    IndexerArgs idx{iq.view(), pre.index_cache, step.batch, sel.view()};
    cpu::select_topk(sc, idx, threads_);
    cpu::score_blocks(sc, idx, scores.view(), threads_);
    AttentionArgs att{q.view(), pre.kv_cache, step.batch, sel.view(), attn.view()};
    cpu::sparse_attention(sc, att, threads_);
    topk.assign(sel.ptr<int32_t>(), sel.ptr<int32_t>() + sel.numel());

    std::vector<uint16_t> o(static_cast<std::size_t>(H));
    for (int64_t r = 0; r < rows; ++r) {
      matvec(attn.ptr<uint16_t>() + r * A, w.o_proj, H, A, o.data());
      uint16_t* res = &residual[static_cast<std::size_t>(r * H)];
      uint16_t* hid = &hidden[static_cast<std::size_t>(r * H)];
      for (int64_t i = 0; i < H; ++i)
        res[i] = bf(f(x[static_cast<std::size_t>(r * H + i)]) + f(o[static_cast<std::size_t>(i)]));
      rmsnorm(res, w.post_norm, H, hid);
      if (m.intermediate <= 0) continue;
      const int64_t I = m.intermediate;
      std::vector<uint16_t> g(static_cast<std::size_t>(I)), u(g.size()), act(g.size());
      matvec(hid, w.gate, I, H, g.data());
      matvec(hid, w.up, I, H, u.data());
      const double limit = RuntimeConfig{}.swiglu_limit;  // what runtime_config() binds
      for (int64_t j = 0; j < I; ++j) {
        const double gate = std::min(f(g[static_cast<std::size_t>(j)]), limit);
        const double up = std::max(std::min(f(u[static_cast<std::size_t>(j)]), limit), -limit);
        act[static_cast<std::size_t>(j)] = bf(gate / (1.0 + std::exp(-1.702 * gate)) * (up + 1.0));
      }
      matvec(act.data(), w.down, H, I, hid);
    }
  }

 private:
  Spec spec_;
  int threads_;
  std::vector<MasterLayer> master_;
  std::vector<KVCache> kv_;
  std::vector<IndexCache> index_;
  std::vector<std::array<TensorView, 4>> norms_;
  std::vector<HostTensor> keep_;
};

}  // namespace demo_rt

namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::ordered_json;
using namespace demo_rt;

// Tolerances (bf16 outputs of O(1)): |got - want| <= kAbs + kRel |want|, per layer from the same
// input. Backend or reference vs the CPU runtime / reference: 2^-6 + 2^-5 |want|; TP = P adds
// the split o_proj / mlp_down sums: + 2^-8 + 2^-6 |want|.
constexpr double kAbsTol = 1.0 / 64;
constexpr double kRelTol = 1.0 / 32;
constexpr double kTpAbsTol = 1.0 / 256;
constexpr double kTpRelTol = 1.0 / 64;
constexpr double kTieTolerance = 1e-3;
// The check configuration's hidden and MLP width: M3's attention dimensions are kept (the
// attention width 64 x 128 = 8192 dominates the projections anyway).
constexpr int kCheckHidden = 512;

struct ValueCheck {
  int64_t checked = 0;
  int64_t differ = 0;  // not bit-identical (within the tolerance or not)
  int64_t bad = 0;
  double worst = 0.0;
  std::string first;
};

void compare_rows(ValueCheck& c, const std::vector<uint16_t>& got,
                  const std::vector<uint16_t>& want, int64_t rows, int64_t cols, double abs_tol,
                  double rel_tol, const std::vector<bool>& skip, const std::string& what) {
  for (int64_t r = 0; r < rows; ++r) {
    if (skip[static_cast<std::size_t>(r)]) continue;
    for (int64_t i = 0; i < cols; ++i) {
      const double g = bf16_to_float(got[static_cast<std::size_t>(r * cols + i)]);
      const double w = bf16_to_float(want[static_cast<std::size_t>(r * cols + i)]);
      ++c.checked;
      c.differ += got[static_cast<std::size_t>(r * cols + i)] !=
                  want[static_cast<std::size_t>(r * cols + i)];
      const bool finite = std::isfinite(g) && std::isfinite(w);
      const double ratio = finite ? std::fabs(g - w) / (abs_tol + rel_tol * std::fabs(w)) : 1e30;
      if (ratio > 1.0 && c.bad++ == 0) {
        c.first = fmt::format("{} [row {}, col {}]: got {}, want {}", what, r, i, g, w);
      }
      if (finite) c.worst = std::max(c.worst, ratio);
    }
  }
}

// The system's selection vs the oracle's under the near-tie rule; marks rows that swapped
// near-tied blocks; returns the (row, head) failures.
int64_t compare_selection(const SparseConfig& sc, const std::vector<int32_t>& got,
                          const std::vector<int32_t>& want, const HostTensor& scores,
                          const BatchMeta& batch, std::vector<bool>& swapped, std::string& first) {
  const int H = sc.index_heads;
  const int k = sc.topk;
  const int64_t cols = scores.shape()[2];
  const std::vector<RowPosition> rows = row_positions(batch);
  int64_t failures = 0;
  for (int64_t row = 0; row < static_cast<int64_t>(rows.size()); ++row) {
    const int64_t nb = visible_blocks(rows[static_cast<std::size_t>(row)].pos, sc.block_size);
    const int64_t expect = std::min<int64_t>(k, nb);
    for (int h = 0; h < H; ++h) {
      const int32_t* g = got.data() + (row * H + h) * k;
      const int32_t* c = want.data() + (row * H + h) * k;
      const float* s = scores.ptr<float>() + (row * H + h) * cols;
      std::set<int32_t> gs, cs;
      bool structure = true;
      for (int i = 0; i < k; ++i) {
        if (i < expect) {
          if (g[i] < 0 || g[i] >= nb || !gs.insert(g[i]).second) structure = false;
          cs.insert(c[i]);
        } else if (g[i] != -1) {
          structure = false;
        }
      }
      const std::string where = fmt::format("row {} head {}: ", row, h);
      if (!structure) {
        if (failures++ == 0) first = where + "malformed selection";
        continue;
      }
      if (gs == cs) continue;
      double kth = INFINITY;
      for (int32_t b : cs) {
        if (!is_forced_block(b, nb, sc.init_blocks, sc.local_blocks))
          kth = std::min<double>(kth, s[b]);
      }
      bool near = std::isfinite(kth);
      auto close = [&](int32_t b) {
        return std::fabs(s[b] - kth) <= kTieTolerance * std::max(1.0, std::fabs(kth));
      };
      for (int32_t b : gs) near = near && (cs.count(b) || close(b));
      for (int32_t b : cs) near = near && (gs.count(b) || close(b));
      if (near) {
        swapped[static_cast<std::size_t>(row)] = true;
      } else if (failures++ == 0) {
        first = where + fmt::format("selections differ beyond a near tie (k-th score {})", kth);
      }
    }
  }
  return failures;
}

std::string mib(double bytes) {
  if (bytes >= 1024.0 * 1024 * 1024)
    return fmt::format("{:.2f} GiB", bytes / (1024.0 * 1024 * 1024));
  return fmt::format("{:.1f} MiB", bytes / (1024.0 * 1024));
}

std::string contexts_text(const Spec& spec) {
  const auto [lo, hi] = std::minmax_element(spec.contexts.begin(), spec.contexts.end());
  return *lo == *hi ? std::to_string(*hi) : fmt::format("{}..{}", *hi, *lo);
}

json stats_json(const RuntimeStats& st) {
  return json::parse(st.to_json());
}

std::string stats_line(const RuntimeStats& st) {
  std::string buckets;
  for (std::size_t i = 0; i < st.buckets.size(); ++i) {
    if (st.bucket_steps[i] == 0) continue;
    buckets += fmt::format("{}bucket {}: {}", buckets.empty() ? "" : ", ", st.buckets[i],
                           st.bucket_steps[i]);
  }
  int64_t refusals = 0;
  for (int64_t r : st.refusals) refusals += r;
  std::string fallbacks;
  for (const auto& [reason, count] : st.fallback_reasons) {
    fallbacks += fmt::format("{}{} (x{})", fallbacks.empty() ? "" : "; ", reason, count);
  }
  return fmt::format(
      "state {}, backend {}, TP {} (rank {}, all-reduce {}), CP {}, steps accepted {} ({}), "
      "layers run {}, launches per layer {}{}, refusals {}, fallbacks {}",
      runtime_state_name(st.state), st.backend, st.tp_size, st.tp_rank,
      st.tp_allreduce.empty() ? "-" : st.tp_allreduce, st.context_parallel ? "on" : "off",
      st.steps_accepted, buckets.empty() ? "-" : buckets, st.layers_run, st.launches_per_layer,
      st.backend == "cpu" ? " (CPU backend: no kernels)" : "", refusals,
      fallbacks.empty() ? "none" : fallbacks);
}

}  // namespace

int run_runtime_demo(const RuntimeDemoOptions& o) {
  const auto start = Clock::now();
  Progress progress(!o.quiet);
  auto note = [&](const std::string& text) { progress.update(text); };

  // ---- Backend and TP ----
  std::string why_not_cuda;
  const bool cuda_ok = cuda_backend_usable(&why_not_cuda);
  bool cuda = false;
  std::string why;
  if (o.backend == "cuda") {
    M3MSA_CHECK_SUPPORTED(cuda_ok, "--backend cuda: ", why_not_cuda);
    cuda = true;
    why = "cuda: requested";
  } else if (o.backend == "auto") {
    cuda = cuda_ok;
    why = cuda ? "auto -> cuda" : "auto -> cpu: " + why_not_cuda;
  } else {
    why = "cpu: requested";
  }
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = o.threads > 0 ? o.threads : hw;
  int tp = o.tp;
  if (cuda) {
    const int gpus = cuda_devices();
    if (tp == 0) tp = std::min(2, gpus);
    if (tp > gpus) {
      throw UsageError(
          fmt::format("--tp {}: only {} CUDA device(s) visible (one rank per GPU)", tp, gpus));
    }
  } else if (tp == 0) {
    tp = hw >= 2 ? 2 : 1;
  }

  // ---- The model ----
  ModelConfig model;  // M3's attention dimensions
  model.hidden = o.hidden > 0 ? o.hidden : (cuda ? kM3Hidden : kCpuDefaultHidden);
  model.intermediate = o.intermediate > 0 ? o.intermediate : model.hidden;
  model.num_layers = model.first_sparse_layer + o.layers;
  if (model.hidden % 64 != 0) {
    throw UsageError(fmt::format("--hidden {}: must be a multiple of 64", model.hidden));
  }
  if ((model.intermediate / tp) % 64 != 0 || model.intermediate % tp != 0) {
    throw UsageError(fmt::format("--intermediate {}: must be a multiple of 64 * TP ({})",
                                 model.intermediate, 64 * tp));
  }
  if (cuda && int64_t{o.batch} * o.q_len > 16) {
    throw UsageError(fmt::format(
        "--batch {} x --q-len {} = {} rows: the CUDA runtime serves decode steps of <= 16 rows",
        o.batch, o.q_len, int64_t{o.batch} * o.q_len));
  }
  if (cuda && o.q_len * (model.index_heads / std::min(tp, model.index_heads)) > 32) {
    throw UsageError(
        fmt::format("--q-len {}: the CUDA indexer takes q_len * index heads <= 32", o.q_len));
  }
  const bool fp8 = o.weights == "fp8";
  Spec spec = make_spec(model, fp8, o.seed, o.batch, o.context, o.q_len, o.steps);
  spec.context_parallel = o.cp;
  auto run = [&](const Spec& s, bool record) {
    return cuda ? run_cuda(s, tp, threads, record, note) : run_cpu(s, tp, threads, record, note);
  };

  const std::string backend_name = cuda ? "cuda" : "cpu";
  std::printf(
      "m3msa demo: the fused decode runtime (mono) on %s (%s), TP %d (%s), CP %s\n",
      backend_name.c_str(), why.c_str(), tp,
      cuda ? (tp > 1 ? "one GPU per rank" : "one GPU") : (tp > 1 ? "ranks as threads" : "one rank"),
      o.cp ? "on (the indexer over the TP ranks)" : "off");
  std::printf(
      "  model: hidden %d%s, %d q heads / %d KV heads x %d, %d index heads x %d, block %d, "
      "top-%d, dense SwiGLU-OAI MLP %d, %d sparse layer%s, weights %s\n",
      model.hidden,
      o.hidden > 0 ? ""
      : cuda       ? " (M3's)"
                   : " (CPU default; M3's is 6144: --hidden 6144)",
      model.q_heads, model.kv_heads, model.head_dim, model.index_heads, model.index_dim,
      model.block_size, model.topk, model.intermediate, o.layers, o.layers == 1 ? "" : "s",
      fp8 ? "fp8 e4m3 (qkv_proj, o_proj; per-channel scales)" : "bf16");
  std::printf(
      "  batch %d x q-len %d = %lld rows per step, contexts %s tokens, %d steps, seed %llu; per "
      "rank: weights %s, caches %s\n",
      o.batch, o.q_len, static_cast<long long>(spec.rows()), contexts_text(spec).c_str(), o.steps,
      static_cast<unsigned long long>(o.seed), mib(spec.weight_bytes(tp)).c_str(),
      mib(spec.cache_bytes(tp)).c_str());
  std::fflush(stdout);

  json j;
  j["command"] = command_line();
  j["version"] = version_string();
  j["mode"] = "runtime";
  j["backend"] = backend_name;
  j["backend_choice"] = why;
  j["tp"] = tp;
  j["cp"] = o.cp;
  j["threads"] = threads;
  j["options"] = {{"batch", o.batch},       {"context", o.context},
                  {"q_len", o.q_len},       {"layers", o.layers},
                  {"steps", o.steps},       {"weights", o.weights},
                  {"hidden", model.hidden}, {"intermediate", model.intermediate},
                  {"seed", o.seed},         {"check", o.check}};

  // ---- The demo run ----
  const RunResult main = run(spec, false);
  progress.finish();
  std::printf("  prepare: %s (weights and caches built and bound in %.2f s)\n",
              prepare_result_name(main.prepared), main.setup_s);
  j["prepare"] = prepare_result_name(main.prepared);
  j["setup_s"] = main.setup_s;
  j["stats"] = stats_json(main.stats);
  if (main.prepared != PrepareResult::kActive) {
    std::printf("  stats (rank 0): %s\n", stats_line(main.stats).c_str());
    std::printf(
        "\nthe runtime did not become active (an engine would run these layers natively): "
        "the fallback reasons above say why\n");
    std::printf("FAIL (%.1f s)\n", seconds_since(start));
    j["passed"] = false;
    j["wall_s"] = seconds_since(start);
    if (!o.json_path.empty()) write_json_file(o.json_path, j);
    return kExitCheckFailed;
  }

  std::printf("\n%-5s %5s %-16s %11s %11s\n", "step", "rows", "seq_len", "time", "per layer");
  json jsteps = json::array();
  for (int s = 0; s < o.steps; ++s) {
    const double ms = main.step_ms[static_cast<std::size_t>(s)];
    int64_t lo = INT64_MAX, hi = 0;
    for (int64_t c : spec.contexts) {
      lo = std::min(lo, c + int64_t{s + 1} * o.q_len);
      hi = std::max(hi, c + int64_t{s + 1} * o.q_len);
    }
    const std::string lens = lo == hi ? std::to_string(hi) : fmt::format("{}..{}", hi, lo);
    std::printf("%-5d %5lld %-16s %8.3f ms %8.3f ms\n", s + 1, static_cast<long long>(spec.rows()),
                lens.c_str(), ms, ms / o.layers);
    jsteps.push_back(
        {{"step", s + 1}, {"rows", spec.rows()}, {"ms", ms}, {"ms_per_layer", ms / o.layers}});
  }
  j["steps"] = jsteps;
  std::printf("(time: begin_step through the last layer's output, eager, %s)\n",
              cuda ? "host-synchronized at the end of the step" : "wall clock of rank 0");
  std::printf("stats (rank 0): %s\n", stats_line(main.stats).c_str());

  // ---- The check run ----
  bool passed = main.stats.fallback_reasons.empty() && main.stats.steps_accepted == o.steps;
  json jchecks = json::array();
  auto report = [&](bool ok, const std::string& name, const std::string& detail) {
    std::printf("  [%s] %s%s%s\n", ok ? "ok" : "FAIL", name.c_str(), detail.empty() ? "" : ": ",
                detail.c_str());
    jchecks.push_back({{"name", name}, {"passed", ok}, {"detail", detail}});
    passed = passed && ok;
  };
  if (o.check == "none") {
    std::printf("\nchecks: none (--check none)\n");
  } else {
    ModelConfig small = model;
    small.hidden = std::min(model.hidden, kCheckHidden);
    small.intermediate = std::min(model.intermediate, kCheckHidden);
    small.num_layers = small.first_sparse_layer + 2;
    // ~17 blocks of context: top-16 is a real selection; the second request a block shorter.
    Spec check = make_spec(small, fp8, o.seed + 1, 2, 2200, o.q_len, 2);
    check.context_parallel = o.cp;
    std::printf(
        "\ncheck (small configuration: hidden %d, MLP %d, 2 layers, 2 requests x q-len %d, "
        "contexts %s, 2 steps, weights %s; %s at TP %d, every layer replayed by the oracle from "
        "the same input):\n",
        small.hidden, small.intermediate, o.q_len, contexts_text(check).c_str(), o.weights.c_str(),
        backend_name.c_str(), tp);
    const auto check_start = Clock::now();
    const RunResult sut = run(check, true);
    note("check: the oracle");
    std::unique_ptr<Oracle> oracle;
    if (cuda) {
      oracle = std::make_unique<CpuRuntimeOracle>(check, threads);
    } else {
      oracle = std::make_unique<ComposedOracle>(check, threads);
    }
    const SparseConfig sc = small.sparse(1);
    const int64_t rows = check.rows();
    const double abs_tol = kAbsTol + (tp > 1 ? kTpAbsTol : 0.0);
    const double rel_tol = kRelTol + (tp > 1 ? kTpRelTol : 0.0);
    ValueCheck values;
    int64_t sel_fail = 0, swapped_rows = 0, lists = 0;
    std::string sel_first;
    for (int s = 0; s < check.steps; ++s) {
      const Step step = make_step(check, s);
      oracle->begin_step(step);
      for (int l = 0; l < small.num_sparse_layers(); ++l) {
        const LayerRecord& rec =
            sut.records[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)];
        std::vector<uint16_t> hidden = rec.in_hidden;
        std::vector<uint16_t> residual = rec.in_residual;
        std::vector<int32_t> topk;
        HostTensor scores(DType::kF32, {rows, sc.index_heads, check.max_blocks});
        oracle->layer(l, step, hidden, residual, topk, scores);
        std::vector<bool> swapped(static_cast<std::size_t>(rows), false);
        sel_fail += compare_selection(sc, rec.topk, topk, scores, step.batch, swapped, sel_first);
        lists += rows * sc.index_heads;
        for (bool b : swapped) swapped_rows += b;
        const std::string where =
            fmt::format("step {} layer {}", s + 1, small.first_sparse_layer + l);
        compare_rows(values, rec.out_residual, residual, rows, small.hidden, abs_tol, rel_tol,
                     swapped, where + " residual");
        compare_rows(values, rec.out_hidden, hidden, rows, small.hidden, abs_tol, rel_tol, swapped,
                     where + " hidden");
      }
    }
    progress.finish();
    std::printf("  oracle: %s (check run + oracle: %.2f s)\n", oracle->name().c_str(),
                seconds_since(check_start));
    j["check_s"] = seconds_since(check_start);
    const int64_t total_rows = rows * check.steps * small.num_sparse_layers();
    report(
        sel_fail == 0,
        "selections equal the oracle's (or swap near-tied blocks only, 1e-3 of the k-th score)",
        fmt::format("{} (row, head) lists, {} failed, {} of {} rows with near-tie swaps{}", lists,
                    sel_fail, swapped_rows, total_rows, sel_fail ? " - first: " + sel_first : ""));
    report(swapped_rows * 4 <= total_rows, "at most a quarter of the rows swap near-tied blocks",
           fmt::format("{} of {}", swapped_rows, total_rows));
    report(
        values.bad == 0 && values.checked > 0,
        fmt::format("layer outputs (hidden, residual) within {:g} + {:g} |want| of the oracle's",
                    abs_tol, rel_tol),
        fmt::format("{} values ({} not bit-identical), {} failed, worst {:.3f} of the tolerance{}",
                    values.checked, values.differ, values.bad, values.worst,
                    values.bad ? " - first: " + values.first : ""));
    if (tp > 1) {
      report(sut.rank_mismatches == 0,
             fmt::format("every rank's outputs bit-identical (TP {})", tp),
             fmt::format("{} mismatched values", sut.rank_mismatches));
    }
    report(sut.stats.fallback_reasons.empty() && sut.stats.steps_accepted == check.steps,
           "no fallback, every step accepted", stats_line(sut.stats));
    j["check_oracle"] = oracle->name();
    j["check_tolerance"] = {{"abs", abs_tol}, {"rel", rel_tol}};
  }
  const double wall = seconds_since(start);
  std::printf("%s (%.1f s)\n", passed ? "PASS" : "FAIL", wall);
  j["checks"] = jchecks;
  j["passed"] = passed;
  j["wall_s"] = wall;
  if (!o.json_path.empty()) write_json_file(o.json_path, j);
  return passed ? kExitOk : kExitCheckFailed;
}

}  // namespace m3msa::cli
