// The CPU reference of the mixture of experts and the dense MLP (docs/spec.md section 8): plain
// loops, parallel over rows, every sum in one fixed order so the result never depends on threads.
#include "m3msa/moe.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "cpu/thread_pool.h"
#include "m3msa/error.h"

namespace m3msa {

namespace {

std::string join(const char* prefix, const char* field) {
  return std::string(prefix) + "." + field;
}

// Whether `w` is MXFP8 (fp8 codes + e8m0 scales) or bf16; the scales must come exactly with fp8.
void check_matrix(const TensorView& w, const TensorView& scale, const std::string& name,
                  int64_t experts, int64_t rows, int64_t k, const Device* device) {
  const std::string scale_name = name + "_scale";
  if (experts > 0) {
    check_tensor(w, name.c_str(), {DType::kBF16, DType::kFP8E4M3}, {experts, rows, k});
  } else {
    check_tensor(w, name.c_str(), {DType::kBF16, DType::kFP8E4M3}, {rows, k});
  }
  if (device != nullptr) check_device(w, name.c_str(), *device);
  if (w.dtype == DType::kBF16) {
    M3MSA_CHECK_ARG(!scale.defined(), scale_name, ": bf16 weights take no scales, got ",
                    describe(scale));
    return;
  }
  M3MSA_CHECK_ARG(k % kMxfp8Block == 0, name, ": MXFP8 needs K (", k, ") to be a multiple of ",
                  kMxfp8Block);
  M3MSA_CHECK_ARG(scale.defined(), scale_name, ": MXFP8 weights need their e8m0 scales (u8",
                  experts > 0 ? shape_string({experts, rows, k / kMxfp8Block})
                              : shape_string({rows, k / kMxfp8Block}),
                  "), got none");
  if (experts > 0) {
    check_tensor(scale, scale_name.c_str(), DType::kU8, {experts, rows, k / kMxfp8Block});
  } else {
    check_tensor(scale, scale_name.c_str(), DType::kU8, {rows, k / kMxfp8Block});
  }
  if (device != nullptr) check_device(scale, scale_name.c_str(), *device);
}

// One weight matrix (of one expert, or a stack of them) read row by row as fp32.
struct Matrix {
  const void* data = nullptr;
  const uint8_t* scales = nullptr;  // MXFP8 only
  bool fp8 = false;
  int64_t k = 0;  // elements per row

  explicit Matrix(const TensorView& w, const TensorView& scale) {
    data = w.data;
    fp8 = w.dtype == DType::kFP8E4M3;
    scales = fp8 ? scale.ptr<const uint8_t>() : nullptr;
    k = w.shape[w.ndim - 1];
  }
  // Row `r` (counted over the whole stack) decoded into out[0, k).
  void row(int64_t r, float* out) const {
    if (fp8) {
      const uint8_t* codes = static_cast<const uint8_t*>(data) + r * k;
      const uint8_t* s = scales + r * (k / kMxfp8Block);
      for (int64_t i = 0; i < k; ++i) out[i] = cpu::mxfp8_value(codes, s, i);
    } else {
      const uint16_t* v = static_cast<const uint16_t*>(data) + r * k;
      for (int64_t i = 0; i < k; ++i) out[i] = bf16_to_float(v[i]);
    }
  }
};

float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

float swiglu_oai(float gate, float up, float limit) {
  // Comparisons (not fmin / fmax) so a NaN stays NaN.
  const float g = gate > limit ? limit : gate;
  const float u = up > limit ? limit : (up < -limit ? -limit : up);
  return g / (1.0f + std::exp(-1.702f * g)) * (u + 1.0f);
}

// Scratch of one row.
struct RowScratch {
  std::vector<float> x, w, act, y;
};

// acc[n] += weight * expert e (of the stack) applied to x, for n < hidden.
void expert_into(const Matrix& w13, const Matrix& w2, int64_t e, int64_t inter, int64_t hidden,
                 float limit, float weight, RowScratch& s, float* acc) {
  s.w.resize(static_cast<std::size_t>(std::max(hidden, inter)));
  s.act.resize(static_cast<std::size_t>(inter));
  for (int64_t j = 0; j < inter; ++j) {
    w13.row(e * 2 * inter + j, s.w.data());
    const float g = round_to_bf16(dot(s.x.data(), s.w.data(), hidden));
    w13.row(e * 2 * inter + inter + j, s.w.data());
    const float u = round_to_bf16(dot(s.x.data(), s.w.data(), hidden));
    s.act[static_cast<std::size_t>(j)] = round_to_bf16(swiglu_oai(g, u, limit));
  }
  for (int64_t n = 0; n < hidden; ++n) {
    w2.row(e * hidden + n, s.w.data());
    acc[n] += weight * dot(s.act.data(), s.w.data(), inter);
  }
}

// The router of one row: ids and weights in pick order.
void route_row(const MoeConfig& c, const float* x, const float* gate, const float* bias,
               int32_t* ids, float* weights, std::vector<float>& s, std::vector<int32_t>& order) {
  const int E = c.num_experts;
  s.resize(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) {
    const float logit = dot(x, gate + int64_t{e} * c.hidden, c.hidden);
    s[static_cast<std::size_t>(e)] = 1.0f / (1.0f + std::exp(-logit));
  }
  auto key = [&](int e) {
    return s[static_cast<std::size_t>(e)] + (bias != nullptr ? bias[e] : 0.0f);
  };
  // Larger key first, NaN keys last, equal keys by lower id.
  auto before = [&](int a, int b) {
    const float ka = key(a);
    const float kb = key(b);
    const bool na = std::isnan(ka);
    const bool nb = std::isnan(kb);
    if (na != nb) return nb;
    if (!na && ka != kb) return ka > kb;
    return a < b;
  };
  order.resize(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) order[static_cast<std::size_t>(e)] = e;
  const int k = c.experts_per_token;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), before);
  float sum = 0.0f;
  for (int i = 0; i < k; ++i)
    sum += s[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])];
  for (int i = 0; i < k; ++i) {
    const int e = order[static_cast<std::size_t>(i)];
    ids[i] = e;
    weights[i] = sum == 0.0f ? 0.0f : c.routed_scaling * s[static_cast<std::size_t>(e)] / sum;
  }
}

void load_x(const TensorView& x, int64_t r, int64_t hidden, std::vector<float>& out) {
  out.resize(static_cast<std::size_t>(hidden));
  const uint16_t* row = x.ptr<const uint16_t>() + r * hidden;
  for (int64_t i = 0; i < hidden; ++i) out[static_cast<std::size_t>(i)] = bf16_to_float(row[i]);
}

void check_route_args(const MoeConfig& c, const TensorView& x, const TensorView& router_weight,
                      const TensorView& router_bias) {
  c.validate();
  check_tensor(x, "x", DType::kBF16, {-1, c.hidden});
  check_tensor(router_weight, "router_weight", DType::kF32, {c.num_experts, c.hidden});
  if (router_bias.defined()) {
    check_tensor(router_bias, "router_bias", DType::kF32, {c.num_experts});
  }
}

}  // namespace

void validate_expert_weights(const ExpertWeights& w, const char* name, int64_t experts,
                             int64_t intermediate, int64_t hidden, const Device* device) {
  M3MSA_CHECK_ARG(w.w13.defined() && w.w2.defined(), name,
                  ": w13 and w2 must both be given (found ",
                  w.w13.defined() ? "only w13" : (w.w2.defined() ? "only w2" : "neither"), ")");
  check_matrix(w.w13, w.w13_scale, join(name, "w13"), experts, 2 * intermediate, hidden, device);
  check_matrix(w.w2, w.w2_scale, join(name, "w2"), experts, hidden, intermediate, device);
  M3MSA_CHECK_ARG(w.w13.dtype == w.w2.dtype, name, ".w2: expected dtype ", dtype_name(w.w13.dtype),
                  " (as ", name, ".w13), got ", dtype_name(w.w2.dtype));
}

void validate(const MoeConfig& c, const MoeArgs& a) {
  check_route_args(c, a.x, a.router_weight, a.router_bias);
  const int64_t rows = a.x.shape[0];
  validate_expert_weights(a.experts, "experts", c.num_experts, c.intermediate, c.hidden);
  if (c.shared_intermediate > 0) {
    M3MSA_CHECK_ARG(a.shared.defined(), "shared: the shared expert (intermediate ",
                    c.shared_intermediate, ") must be given");
    validate_expert_weights(a.shared, "shared", 0, c.shared_intermediate, c.hidden);
  } else {
    M3MSA_CHECK_ARG(!a.shared.defined(),
                    "shared: the configuration has no shared expert (shared_intermediate 0), got "
                    "shared weights");
  }
  check_tensor(a.out, "out", DType::kF32, {rows, c.hidden});
  if (a.topk_ids.defined()) {
    check_tensor(a.topk_ids, "topk_ids", DType::kI32, {rows, c.experts_per_token});
  }
  if (a.topk_weights.defined()) {
    check_tensor(a.topk_weights, "topk_weights", DType::kF32, {rows, c.experts_per_token});
  }
}

void validate(const DenseMlpArgs& a) {
  check_tensor(a.x, "x", DType::kBF16, {-1, -1});
  const int64_t rows = a.x.shape[0];
  const int64_t hidden = a.x.shape[1];
  check_extents(a.mlp.w2, "mlp.w2");
  M3MSA_CHECK_ARG(a.mlp.w2.ndim == 2, "mlp.w2: expected shape [", hidden, ", D], got ",
                  shape_string(a.mlp.w2.sizes()));
  validate_expert_weights(a.mlp, "mlp", 0, a.mlp.w2.shape[1], hidden);
  check_tensor(a.out, "out", DType::kF32, {rows, hidden});
  M3MSA_CHECK_ARG(std::isfinite(a.activation_limit) && a.activation_limit > 0,
                  "activation_limit must be finite and > 0, got ", a.activation_limit);
}

namespace cpu {

void moe_route(const MoeConfig& c, const TensorView& x, const TensorView& router_weight,
               const TensorView& router_bias, TensorView topk_ids, TensorView topk_weights,
               int threads) {
  check_route_args(c, x, router_weight, router_bias);
  const int64_t rows = x.shape[0];
  const int k = c.experts_per_token;
  check_tensor(topk_ids, "topk_ids", DType::kI32, {rows, k});
  check_tensor(topk_weights, "topk_weights", DType::kF32, {rows, k});
  detail::parallel_for(rows, threads, [&](int64_t r) {
    std::vector<float> xr, s;
    std::vector<int32_t> order;
    load_x(x, r, c.hidden, xr);
    route_row(c, xr.data(), router_weight.ptr<const float>(),
              router_bias.defined() ? router_bias.ptr<const float>() : nullptr,
              topk_ids.ptr<int32_t>() + r * k, topk_weights.ptr<float>() + r * k, s, order);
  });
}

void moe(const MoeConfig& c, const MoeArgs& a, int threads) {
  validate(c, a);
  const int64_t rows = a.x.shape[0];
  const int64_t H = c.hidden;
  const int k = c.experts_per_token;
  const Matrix w13(a.experts.w13, a.experts.w13_scale);
  const Matrix w2(a.experts.w2, a.experts.w2_scale);
  const bool shared = c.shared_intermediate > 0;
  detail::parallel_for(rows, threads, [&](int64_t r) {
    RowScratch s;
    std::vector<float> scores;
    std::vector<int32_t> order;
    std::vector<int32_t> ids(static_cast<std::size_t>(k));
    std::vector<float> weights(static_cast<std::size_t>(k));
    load_x(a.x, r, H, s.x);
    route_row(c, s.x.data(), a.router_weight.ptr<const float>(),
              a.router_bias.defined() ? a.router_bias.ptr<const float>() : nullptr, ids.data(),
              weights.data(), scores, order);
    float* out = a.out.ptr<float>() + r * H;
    std::fill(out, out + H, 0.0f);
    for (int i = 0; i < k; ++i) {
      expert_into(w13, w2, ids[static_cast<std::size_t>(i)], c.intermediate, H, c.activation_limit,
                  weights[static_cast<std::size_t>(i)], s, out);
    }
    if (shared) {
      expert_into(Matrix(a.shared.w13, a.shared.w13_scale), Matrix(a.shared.w2, a.shared.w2_scale),
                  0, c.shared_intermediate, H, c.activation_limit, 1.0f, s, out);
    }
    if (a.topk_ids.defined()) std::copy(ids.begin(), ids.end(), a.topk_ids.ptr<int32_t>() + r * k);
    if (a.topk_weights.defined()) {
      std::copy(weights.begin(), weights.end(), a.topk_weights.ptr<float>() + r * k);
    }
  });
}

void dense_mlp(const DenseMlpArgs& a, int threads) {
  validate(a);
  const int64_t rows = a.x.shape[0];
  const int64_t H = a.x.shape[1];
  const int64_t D = a.mlp.w2.shape[1];
  const Matrix w13(a.mlp.w13, a.mlp.w13_scale);
  const Matrix w2(a.mlp.w2, a.mlp.w2_scale);
  detail::parallel_for(rows, threads, [&](int64_t r) {
    RowScratch s;
    load_x(a.x, r, H, s.x);
    float* out = a.out.ptr<float>() + r * H;
    std::fill(out, out + H, 0.0f);
    expert_into(w13, w2, 0, D, H, a.activation_limit, 1.0f, s, out);
  });
}

void quantize_mxfp8(const float* values, int64_t rows, int64_t k, uint8_t* codes, uint8_t* scales) {
  M3MSA_CHECK_ARG(rows >= 0 && k >= 0 && k % kMxfp8Block == 0,
                  "quantize_mxfp8: K must be a non-negative multiple of ", kMxfp8Block, ", got ",
                  k);
  const int64_t groups = k / kMxfp8Block;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* v = values + r * k + g * kMxfp8Block;
      float amax = 0.0f;
      for (int i = 0; i < kMxfp8Block; ++i) {
        const float a = std::fabs(v[i]);
        if (a > amax) amax = a;  // NaN never raises amax; it stays NaN in its code
      }
      int biased = 0;
      if (amax > 0.0f && std::isfinite(amax)) {
        biased = std::clamp(static_cast<int>(std::floor(std::log2(amax))) - 8 + 127, 0, 254);
      } else if (std::isinf(amax)) {
        biased = 254;
      }
      scales[r * groups + g] = static_cast<uint8_t>(biased);
      // Scaling by a power of two is exact (up to overflow, which the cast saturates, and
      // underflow at biased 254, far below e4m3's reach); the one rounding is the e4m3 cast.
      const float inv = std::ldexp(1.0f, 127 - biased);
      for (int i = 0; i < kMxfp8Block; ++i) {
        codes[r * k + g * kMxfp8Block + i] = float_to_fp8e4m3(v[i] * inv);
      }
    }
  }
}

}  // namespace cpu
}  // namespace m3msa
