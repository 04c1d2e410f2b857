#include "m3msa/testing/oracle.h"

#include <algorithm>
#include <cmath>

#include "m3msa/cpu_reference.h"
#include "m3msa/dtype.h"
#include "m3msa/error.h"
#include "m3msa/testing/parallel.h"

namespace m3msa::testkit {

namespace {

double f(uint16_t v) {
  return static_cast<double>(bf16_to_float(v));
}
uint16_t bf(double v) {
  return float_to_bf16(static_cast<float>(v));
}

// y[n] = bf16(sum_i x[i] * w[n, i]) in double, output rows split over `threads`.
void matvec(const uint16_t* x, std::span<const float> w, int64_t n_out, int64_t n_in, uint16_t* y,
            int threads) {
  std::vector<double> xd(static_cast<std::size_t>(n_in));
  for (int64_t i = 0; i < n_in; ++i) xd[static_cast<std::size_t>(i)] = f(x[i]);
  parallel_for(n_out, threads, [&](int64_t b, int64_t e) {
    for (int64_t n = b; n < e; ++n) {
      double acc = 0.0;
      const float* row = w.data() + n * n_in;
      for (int64_t i = 0; i < n_in; ++i) acc += xd[static_cast<std::size_t>(i)] * row[i];
      y[n] = bf(acc);
    }
  });
}

void rmsnorm(const uint16_t* x, std::span<const float> w, int64_t n, double eps, uint16_t* y) {
  double sum_sq = 0.0;
  for (int64_t i = 0; i < n; ++i) sum_sq += f(x[i]) * f(x[i]);
  const double r = 1.0 / std::sqrt(sum_sq / static_cast<double>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = bf(f(x[i]) * r * (1.0 + w[static_cast<std::size_t>(i)]));
}

}  // namespace

void reference_layer(const ModelConfig& m, const ReferenceLayer& w, const BatchMeta& batch,
                     const TensorView& positions, std::vector<uint16_t>& hidden,
                     std::vector<uint16_t>& residual, const ReferenceOptions& options) {
  const SparseConfig sc = m.sparse(1);
  const int64_t rows = batch.num_rows();
  const int64_t H = m.hidden;
  const bool dense = w.dense_mlp != nullptr;
  const int64_t W = sc.qkv_width();
  const int64_t A = int64_t{sc.q_heads} * sc.head_dim;
  // A dense layer projects [q | k | v] into the leading columns; its index columns stay zero and
  // are never read.
  const int64_t projected = dense ? A + int64_t{2} * sc.kv_heads * sc.head_dim : W;
  const int threads = std::max(1, options.threads);
  M3MSA_CHECK_INTERNAL(static_cast<int64_t>(hidden.size()) == rows * H &&
                           static_cast<int64_t>(residual.size()) == rows * H,
                       "reference_layer: hidden / residual are not [", rows, ", ", H, "]");
  std::vector<uint16_t> x(static_cast<std::size_t>(rows * H)), normed(x.size());
  std::vector<uint16_t> qkv(static_cast<std::size_t>(rows * W), 0);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = bf(f(hidden[i]) + f(residual[i]));
  for (int64_t r = 0; r < rows; ++r) {
    rmsnorm(&x[static_cast<std::size_t>(r * H)], w.input_norm, H, m.rms_eps,
            &normed[static_cast<std::size_t>(r * H)]);
    matvec(&normed[static_cast<std::size_t>(r * H)], w.qkv, projected, H,
           &qkv[static_cast<std::size_t>(r * W)], threads);
  }
  HostTensor q(DType::kBF16, {rows, sc.q_heads, sc.head_dim});
  HostTensor iq(DType::kBF16, {rows, sc.index_heads, sc.index_dim});
  HostTensor topk(DType::kI32, {rows, sc.index_heads, sc.topk});
  HostTensor attn(DType::kBF16, {rows, sc.q_heads, sc.head_dim});

  PreprocessArgs pre;
  pre.qkv = TensorView::contiguous(qkv.data(), DType::kBF16, {rows, W});
  pre.q_norm = w.q_norm;
  pre.k_norm = w.k_norm;
  pre.index_q_norm = w.index_q_norm;
  pre.index_k_norm = w.index_k_norm;
  pre.positions = positions;
  pre.batch = batch;
  pre.kv_cache = w.kv_cache;
  pre.q_out = q.view();
  const bool selects = !dense && options.shared_topk == nullptr;
  if (selects) {
    pre.index_cache = w.index_cache;
    pre.index_q_out = iq.view();
  }
  cpu::preprocess(sc, pre, threads);
  if (selects) {
    IndexerArgs sel{iq.view(), w.index_cache, batch, topk.view()};
    cpu::select_topk(sc, sel, threads);
    if (options.scores_out.defined()) cpu::score_blocks(sc, sel, options.scores_out, threads);
    if (options.select_out != nullptr) *options.select_out = topk;
  }
  AttentionArgs att{q.view(), w.kv_cache, batch, TensorView{}, attn.view()};
  if (dense) {
    cpu::dense_attention(sc, att, threads);
  } else {
    att.topk_idx = (selects ? topk : *options.shared_topk).view();
    cpu::sparse_attention(sc, att, threads);
  }

  const bool mlp = !w.gate.empty();
  const int64_t I = mlp ? static_cast<int64_t>(w.gate.size()) / H : 0;
  std::vector<uint16_t> o(static_cast<std::size_t>(H));
  for (int64_t r = 0; r < rows; ++r) {
    matvec(attn.ptr<uint16_t>() + r * A, w.o_proj, H, A, o.data(), threads);
    uint16_t* res = &residual[static_cast<std::size_t>(r * H)];
    uint16_t* hid = &hidden[static_cast<std::size_t>(r * H)];
    for (int64_t i = 0; i < H; ++i) {
      res[i] = bf(f(x[static_cast<std::size_t>(r * H + i)]) + f(o[static_cast<std::size_t>(i)]));
    }
    rmsnorm(res, w.post_norm, H, m.rms_eps, hid);
    if (dense) {
      const std::vector<double> y = dense_mlp_double(m, *w.dense_mlp, hid);
      for (int64_t i = 0; i < H; ++i) hid[i] = bf(y[static_cast<std::size_t>(i)]);
      continue;
    }
    if (w.moe != nullptr) {
      const std::vector<double> y = moe_double(m, *w.moe, hid);
      for (int64_t i = 0; i < H; ++i) hid[i] = bf(y[static_cast<std::size_t>(i)]);
      continue;
    }
    if (!mlp) continue;
    std::vector<uint16_t> g(static_cast<std::size_t>(I)), u(g.size()), act(g.size());
    matvec(hid, w.gate, I, H, g.data(), threads);
    matvec(hid, w.up, I, H, u.data(), threads);
    const double limit = options.swiglu_limit;
    for (int64_t j = 0; j < I; ++j) {
      const double gate = std::min(f(g[static_cast<std::size_t>(j)]), limit);
      const double up = std::max(std::min(f(u[static_cast<std::size_t>(j)]), limit), -limit);
      act[static_cast<std::size_t>(j)] = bf(gate / (1.0 + std::exp(-1.702 * gate)) * (up + 1.0));
    }
    matvec(act.data(), w.down, H, I, hid, threads);
  }
}

}  // namespace m3msa::testkit
