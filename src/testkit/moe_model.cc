#include "m3msa/testing/moe_model.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "m3msa/dtype.h"
#include "m3msa/moe.h"
#include "m3msa/testing/random.h"

namespace m3msa::testkit {

namespace {

MoeMatrix make_matrix(SplitMix64& rng, std::vector<int64_t> shape, bool fp8, float scale) {
  MoeMatrix w;
  w.fp8 = fp8;
  w.shape = std::move(shape);
  const int64_t n =
      std::accumulate(w.shape.begin(), w.shape.end(), int64_t{1}, std::multiplies<>());
  const int64_t k = w.shape.back();
  w.value = random_values(rng, static_cast<std::size_t>(n), scale);
  if (fp8) {
    w.codes.resize(w.value.size());
    w.scales.resize(w.value.size() / kMxfp8Block);
    cpu::quantize_mxfp8(w.value.data(), n / k, k, w.codes.data(), w.scales.data());
    for (std::size_t i = 0; i < w.value.size(); ++i) {
      w.value[i] = cpu::mxfp8_value(w.codes.data(), w.scales.data(), static_cast<int64_t>(i));
    }
  }
  return w;
}

// Rows (over the whole stack) `pick(r)` for r < count of a [.., K] matrix, as a bound tensor
// (bf16, or the fp8 codes) plus its scales.
struct Sliced {
  HostTensor w, scale;
};

Sliced slice(const MoeMatrix& m, const std::vector<int64_t>& shape, int64_t col0, int64_t cols,
             const std::vector<int64_t>& src_rows) {
  const int64_t K = m.shape.back();
  Sliced out;
  const int64_t n = static_cast<int64_t>(src_rows.size());
  if (m.fp8) {
    out.w = HostTensor(DType::kFP8E4M3, shape);
    std::vector<int64_t> sshape = shape;
    sshape.back() /= kMxfp8Block;
    out.scale = HostTensor(DType::kU8, sshape);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t src = src_rows[static_cast<std::size_t>(r)];
      std::copy_n(m.codes.begin() + src * K + col0, cols, out.w.ptr<uint8_t>() + r * cols);
      std::copy_n(m.scales.begin() + (src * K + col0) / kMxfp8Block, cols / kMxfp8Block,
                  out.scale.ptr<uint8_t>() + r * (cols / kMxfp8Block));
    }
  } else {
    out.w = HostTensor(DType::kBF16, shape);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t src = src_rows[static_cast<std::size_t>(r)];
      for (int64_t c = 0; c < cols; ++c) {
        out.w.ptr<uint16_t>()[r * cols + c] = float_to_bf16(m.value[src * K + col0 + c]);
      }
    }
  }
  return out;
}

// This rank's slice of one expert set (E = 0: no expert axis) with whole intermediate `inter`.
ExpertWeights bind_set(const MoeMatrix& w13, const MoeMatrix& w2, int64_t E, int64_t inter,
                       int64_t hidden, int rank, int world, std::vector<HostTensor>& storage) {
  const int64_t ir = inter / world;
  const int64_t stacks = std::max<int64_t>(E, 1);
  std::vector<int64_t> rows13, rows2;
  for (int64_t e = 0; e < stacks; ++e) {
    for (int half = 0; half < 2; ++half) {
      for (int64_t j = 0; j < ir; ++j)
        rows13.push_back(e * 2 * inter + half * inter + rank * ir + j);
    }
    for (int64_t n = 0; n < hidden; ++n) rows2.push_back(e * hidden + n);
  }
  const std::vector<int64_t> shape13 =
      E > 0 ? std::vector<int64_t>{E, 2 * ir, hidden} : std::vector<int64_t>{2 * ir, hidden};
  const std::vector<int64_t> shape2 =
      E > 0 ? std::vector<int64_t>{E, hidden, ir} : std::vector<int64_t>{hidden, ir};
  Sliced a = slice(w13, shape13, 0, hidden, rows13);
  Sliced b = slice(w2, shape2, rank * ir, ir, rows2);
  ExpertWeights out;
  auto keep = [&](HostTensor& t) -> TensorView {
    if (t.empty()) return {};
    storage.push_back(t);
    return storage.back().view();
  };
  out.w13 = keep(a.w);
  out.w13_scale = keep(a.scale);
  out.w2 = keep(b.w);
  out.w2_scale = keep(b.scale);
  return out;
}

double bf(double v) {
  return round_to_bf16(static_cast<float>(v));
}

void expert_double(const std::vector<double>& x, const MoeMatrix& w13, const MoeMatrix& w2,
                   int64_t e, int64_t inter, int64_t hidden, double limit, double weight,
                   std::vector<double>& y) {
  std::vector<double> a(static_cast<std::size_t>(inter));
  for (int64_t j = 0; j < inter; ++j) {
    double g = 0, u = 0;
    const float* gr = w13.value.data() + (e * 2 * inter + j) * hidden;
    const float* ur = w13.value.data() + (e * 2 * inter + inter + j) * hidden;
    for (int64_t i = 0; i < hidden; ++i) {
      g += x[static_cast<std::size_t>(i)] * gr[i];
      u += x[static_cast<std::size_t>(i)] * ur[i];
    }
    g = std::min(bf(g), limit);
    u = std::clamp(bf(u), -limit, limit);
    a[static_cast<std::size_t>(j)] = bf(g / (1.0 + std::exp(-1.702 * g)) * (u + 1.0));
  }
  for (int64_t n = 0; n < hidden; ++n) {
    double acc = 0;
    const float* row = w2.value.data() + (e * hidden + n) * inter;
    for (int64_t j = 0; j < inter; ++j) acc += a[static_cast<std::size_t>(j)] * row[j];
    y[static_cast<std::size_t>(n)] += weight * acc;
  }
}

}  // namespace

MasterMoe make_master_moe(const ModelConfig& m, uint64_t seed, bool fp8) {
  SplitMix64 rng(seed);
  MasterMoe w;
  const int64_t E = m.num_experts, H = m.hidden, I = m.moe_intermediate;
  const int64_t S = int64_t{m.shared_experts} * I;
  w.router = random_values(rng, static_cast<std::size_t>(E * H), 2.0f / std::sqrt(float(H)));
  w.bias = random_values(rng, static_cast<std::size_t>(E), 0.05f);
  // g and u of a few units: the clamps at 7 are reached now and then.
  const float in_scale = 5.0f / std::sqrt(static_cast<float>(H));
  w.w13 = make_matrix(rng, {E, 2 * I, H}, fp8, in_scale);
  w.w2 = make_matrix(rng, {E, H, I}, fp8, 1.7f / std::sqrt(static_cast<float>(I)));
  if (S > 0) {
    w.shared_w13 = make_matrix(rng, {2 * S, H}, fp8, in_scale);
    w.shared_w2 = make_matrix(rng, {H, S}, fp8, 1.7f / std::sqrt(static_cast<float>(S)));
  }
  return w;
}

void bind_moe(const ModelConfig& m, const MasterMoe& moe, int rank, int world,
              std::vector<HostTensor>& storage, LayerWeights& layer) {
  const int64_t E = m.num_experts, H = m.hidden;
  HostTensor router(DType::kF32, {E, H});
  std::copy(moe.router.begin(), moe.router.end(), router.ptr<float>());
  HostTensor bias(DType::kF32, {E});
  std::copy(moe.bias.begin(), moe.bias.end(), bias.ptr<float>());
  storage.push_back(router);
  layer.router_weight = storage.back().view();
  storage.push_back(bias);
  layer.router_bias = storage.back().view();
  layer.experts = bind_set(moe.w13, moe.w2, E, m.moe_intermediate, H, rank, world, storage);
  if (m.shared_experts > 0) {
    layer.shared_expert =
        bind_set(moe.shared_w13, moe.shared_w2, 0, int64_t{m.shared_experts} * m.moe_intermediate,
                 H, rank, world, storage);
  }
}

std::vector<double> moe_double(const ModelConfig& m, const MasterMoe& moe, const uint16_t* x) {
  const int64_t H = m.hidden, E = m.num_experts;
  std::vector<double> xr(static_cast<std::size_t>(H));
  for (int64_t i = 0; i < H; ++i) xr[static_cast<std::size_t>(i)] = bf16_to_float(x[i]);
  std::vector<double> s(static_cast<std::size_t>(E)), key(s.size());
  for (int64_t e = 0; e < E; ++e) {
    double logit = 0;
    for (int64_t i = 0; i < H; ++i)
      logit += xr[static_cast<std::size_t>(i)] * moe.router[e * H + i];
    s[static_cast<std::size_t>(e)] = 1.0 / (1.0 + std::exp(-logit));
    key[static_cast<std::size_t>(e)] = s[static_cast<std::size_t>(e)] + moe.bias[e];
  }
  std::vector<int64_t> order(static_cast<std::size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return key[static_cast<std::size_t>(a)] > key[static_cast<std::size_t>(b)];
  });
  const int k = m.experts_per_token;
  double sum = 0;
  for (int i = 0; i < k; ++i)
    sum += s[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])];
  std::vector<double> y(static_cast<std::size_t>(H), 0.0);
  for (int i = 0; i < k; ++i) {
    const int64_t e = order[static_cast<std::size_t>(i)];
    const double w = sum == 0 ? 0 : m.routed_scaling * s[static_cast<std::size_t>(e)] / sum;
    expert_double(xr, moe.w13, moe.w2, e, m.moe_intermediate, H, m.activation_limit, w, y);
  }
  if (m.shared_experts > 0) {
    expert_double(xr, moe.shared_w13, moe.shared_w2, 0,
                  int64_t{m.shared_experts} * m.moe_intermediate, H, m.activation_limit, 1.0, y);
  }
  return y;
}

MasterDenseMlp make_master_dense_mlp(const ModelConfig& m, uint64_t seed, bool fp8) {
  SplitMix64 rng(seed);
  const int64_t H = m.hidden, D = m.dense_intermediate;
  MasterDenseMlp w;
  // g and u as the experts'; the down projection 4x narrower, so the output (activations of RMS
  // ~5) stays O(1) like the residual stream it is added to, layer after layer.
  w.w13 = make_matrix(rng, {2 * D, H}, fp8, 5.0f / std::sqrt(static_cast<float>(H)));
  w.w2 = make_matrix(rng, {H, D}, fp8, 0.425f / std::sqrt(static_cast<float>(D)));
  return w;
}

ExpertWeights bind_dense_mlp(const ModelConfig& m, const MasterDenseMlp& mlp, int rank, int world,
                             std::vector<HostTensor>& storage) {
  return bind_set(mlp.w13, mlp.w2, 0, m.dense_intermediate, m.hidden, rank, world, storage);
}

std::vector<double> dense_mlp_double(const ModelConfig& m, const MasterDenseMlp& mlp,
                                     const uint16_t* x) {
  const int64_t H = m.hidden;
  std::vector<double> xr(static_cast<std::size_t>(H));
  for (int64_t i = 0; i < H; ++i) xr[static_cast<std::size_t>(i)] = bf16_to_float(x[i]);
  std::vector<double> y(static_cast<std::size_t>(H), 0.0);
  expert_double(xr, mlp.w13, mlp.w2, 0, m.dense_intermediate, H, m.activation_limit, 1.0, y);
  return y;
}

}  // namespace m3msa::testkit
