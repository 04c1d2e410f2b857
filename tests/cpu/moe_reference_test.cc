// The CPU reference of the mixture of experts and the dense MLP (docs/spec.md section 8) against a
// direct composition in double precision written here from the spec's formulas (its own e4m3 and
// e8m0 decoding, its own sort), plus the routing rules (ties, NaN keys, the bias used only for
// picking), MXFP8 quantization round trips, the TP split of the intermediate and the refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "m3msa/dtype.h"
#include "m3msa/error.h"
#include "m3msa/moe.h"
#include "m3msa/testing/formats.h"
#include "m3msa/testing/splitmix.h"

namespace m3msa {
namespace {

using testkit::SplitMix64;

using testkit::e8m0_definition;
using testkit::fp8_e4m3_definition;

// One weight matrix stack of the test: bf16 or MXFP8 storage plus its decoded values in double.
struct Weights {
  bool fp8 = false;
  std::vector<int64_t> shape;  // ([E,] rows, k)
  std::vector<uint16_t> bf16;
  std::vector<uint8_t> codes, scales;
  std::vector<double> value;  // decoded here, independently of the library

  TensorView view() {
    return fp8 ? TensorView::contiguous(codes.data(), DType::kFP8E4M3, shape)
               : TensorView::contiguous(bf16.data(), DType::kBF16, shape);
  }
  TensorView scale_view() {
    if (!fp8) return {};
    std::vector<int64_t> s = shape;
    s.back() /= kMxfp8Block;
    return TensorView::contiguous(scales.data(), DType::kU8, s);
  }
};

Weights make_weights(SplitMix64& rng, std::vector<int64_t> shape, bool fp8, float scale) {
  Weights w;
  w.fp8 = fp8;
  w.shape = shape;
  const int64_t n = std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
  const int64_t k = shape.back();
  std::vector<float> raw(static_cast<std::size_t>(n));
  for (float& v : raw) v = rng.signed_unit() * scale;
  w.value.resize(raw.size());
  if (fp8) {
    w.codes.resize(raw.size());
    w.scales.resize(raw.size() / kMxfp8Block);
    cpu::quantize_mxfp8(raw.data(), n / k, k, w.codes.data(), w.scales.data());
    for (std::size_t i = 0; i < raw.size(); ++i) {
      w.value[i] = fp8_e4m3_definition(w.codes[i]) * e8m0_definition(w.scales[i / kMxfp8Block]);
    }
  } else {
    w.bf16.resize(raw.size());
    for (std::size_t i = 0; i < raw.size(); ++i) {
      w.bf16[i] = float_to_bf16(raw[i]);
      w.value[i] = bf16_to_float(w.bf16[i]);
    }
  }
  return w;
}

struct Expert {
  Weights w13, w2;
  ExpertWeights view() { return {w13.view(), w13.scale_view(), w2.view(), w2.scale_view()}; }
};

struct Problem {
  MoeConfig config;
  int64_t rows = 0;
  std::vector<uint16_t> x;
  std::vector<float> gate, bias;
  Expert experts, shared;
};

Problem make_problem(uint64_t seed, int64_t rows, int hidden, int E, int k, int inter, int shared,
                     bool fp8) {
  SplitMix64 rng(seed);
  Problem p;
  p.config.hidden = hidden;
  p.config.num_experts = E;
  p.config.experts_per_token = k;
  p.config.intermediate = inter;
  p.config.shared_intermediate = shared;
  p.rows = rows;
  p.x.resize(static_cast<std::size_t>(rows * hidden));
  for (uint16_t& v : p.x) v = float_to_bf16(rng.unit_variance());
  p.gate.resize(static_cast<std::size_t>(E) * hidden);
  for (float& v : p.gate) v = rng.signed_unit() * 0.2f;
  p.bias.resize(static_cast<std::size_t>(E));
  for (float& v : p.bias) v = rng.signed_unit() * 0.05f;
  // Scales put g and u around a few units, so the clamps at 7 are reached now and then.
  const float w_scale = 3.0f / std::sqrt(static_cast<float>(hidden));
  p.experts.w13 = make_weights(rng, {E, 2 * inter, hidden}, fp8, w_scale);
  p.experts.w2 = make_weights(rng, {E, hidden, inter}, fp8, 1.0f / std::sqrt(float(inter)));
  if (shared > 0) {
    p.shared.w13 = make_weights(rng, {2 * shared, hidden}, fp8, w_scale);
    p.shared.w2 = make_weights(rng, {hidden, shared}, fp8, 1.0f / std::sqrt(float(shared)));
  }
  return p;
}

MoeArgs args_of(Problem& p, std::vector<float>& out) {
  out.assign(static_cast<std::size_t>(p.rows * p.config.hidden), -1.0f);
  MoeArgs a;
  a.x = TensorView::contiguous(p.x.data(), DType::kBF16, {p.rows, int64_t{p.config.hidden}});
  a.router_weight = TensorView::contiguous(p.gate.data(), DType::kF32,
                                           {int64_t{p.config.num_experts}, p.config.hidden});
  a.router_bias = TensorView::contiguous(p.bias.data(), DType::kF32, {p.config.num_experts});
  a.experts = p.experts.view();
  if (p.config.shared_intermediate > 0) a.shared = p.shared.view();
  a.out = TensorView::contiguous(out.data(), DType::kF32, {p.rows, int64_t{p.config.hidden}});
  return a;
}

// ---- The double-precision composition ----

struct DoubleRoute {
  std::vector<int> ids;
  std::vector<double> weights;
  std::vector<double> keys;  // every expert's key, to measure the margin of the pick
};

DoubleRoute route_double(const Problem& p, int64_t r) {
  const MoeConfig& c = p.config;
  DoubleRoute out;
  std::vector<double> s(static_cast<std::size_t>(c.num_experts));
  for (int e = 0; e < c.num_experts; ++e) {
    double logit = 0;
    for (int i = 0; i < c.hidden; ++i) {
      logit += double(bf16_to_float(p.x[std::size_t(r * c.hidden + i)])) *
               p.gate[std::size_t(int64_t{e} * c.hidden + i)];
    }
    s[std::size_t(e)] = 1.0 / (1.0 + std::exp(-logit));
    out.keys.push_back(s[std::size_t(e)] + p.bias[std::size_t(e)]);
  }
  std::vector<int> order(static_cast<std::size_t>(c.num_experts));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return out.keys[std::size_t(a)] > out.keys[std::size_t(b)];
  });
  double sum = 0;
  for (int i = 0; i < c.experts_per_token; ++i) sum += s[std::size_t(order[std::size_t(i)])];
  for (int i = 0; i < c.experts_per_token; ++i) {
    out.ids.push_back(order[std::size_t(i)]);
    out.weights.push_back(c.routed_scaling * s[std::size_t(order[std::size_t(i)])] / sum);
  }
  return out;
}

// y += weight * expert(x); abs += |weight| * sum_j |a_j w2_nj| (the scale of the sum's error).
void expert_double(const std::vector<double>& x, const Weights& w13, const Weights& w2, int64_t e,
                   int64_t inter, int64_t hidden, double limit, double weight, double* y,
                   double* abs) {
  std::vector<double> a(static_cast<std::size_t>(inter));
  for (int64_t j = 0; j < inter; ++j) {
    double g = 0, u = 0;
    for (int64_t i = 0; i < hidden; ++i) {
      g += x[std::size_t(i)] * w13.value[std::size_t((e * 2 * inter + j) * hidden + i)];
      u += x[std::size_t(i)] * w13.value[std::size_t((e * 2 * inter + inter + j) * hidden + i)];
    }
    g = std::min(g, limit);
    u = std::clamp(u, -limit, limit);
    a[std::size_t(j)] = g / (1.0 + std::exp(-1.702 * g)) * (u + 1.0);
  }
  for (int64_t n = 0; n < hidden; ++n) {
    double acc = 0, acc_abs = 0;
    for (int64_t j = 0; j < inter; ++j) {
      const double term = a[std::size_t(j)] * w2.value[std::size_t((e * hidden + n) * inter + j)];
      acc += term;
      acc_abs += std::fabs(term);
    }
    y[n] += weight * acc;
    abs[n] += std::fabs(weight) * acc_abs;
  }
}

// The MoE of row r in double; abs gets the per-element error scale.
std::vector<double> moe_double(const Problem& p, int64_t r, std::vector<double>& abs) {
  const MoeConfig& c = p.config;
  std::vector<double> x(static_cast<std::size_t>(c.hidden));
  for (int i = 0; i < c.hidden; ++i)
    x[std::size_t(i)] = bf16_to_float(p.x[std::size_t(r * c.hidden + i)]);
  std::vector<double> y(static_cast<std::size_t>(c.hidden), 0.0);
  abs.assign(static_cast<std::size_t>(c.hidden), 0.0);
  const DoubleRoute route = route_double(p, r);
  for (int i = 0; i < c.experts_per_token; ++i) {
    expert_double(x, p.experts.w13, p.experts.w2, route.ids[std::size_t(i)], c.intermediate,
                  c.hidden, c.activation_limit, route.weights[std::size_t(i)], y.data(),
                  abs.data());
  }
  if (c.shared_intermediate > 0) {
    expert_double(x, p.shared.w13, p.shared.w2, 0, c.shared_intermediate, c.hidden,
                  c.activation_limit, 1.0, y.data(), abs.data());
  }
  return y;
}

// g, u and a are rounded to bf16 (2^-9 relative each) and the sums are fp32: the error of an
// output element is a small multiple of 2^-9 of the sum of the magnitudes of its terms.
constexpr double kRelTolerance = 1.0 / 64;

void expect_matches_double(Problem& p, const char* what) {
  std::vector<float> out;
  MoeArgs a = args_of(p, out);
  std::vector<int32_t> ids(static_cast<std::size_t>(p.rows * p.config.experts_per_token));
  std::vector<float> weights(ids.size());
  a.topk_ids = TensorView::contiguous(ids.data(), DType::kI32,
                                      {p.rows, int64_t{p.config.experts_per_token}});
  a.topk_weights = TensorView::contiguous(weights.data(), DType::kF32,
                                          {p.rows, int64_t{p.config.experts_per_token}});
  cpu::moe(p.config, a, 2);
  int64_t checked = 0;
  for (int64_t r = 0; r < p.rows; ++r) {
    const DoubleRoute route = route_double(p, r);
    for (int i = 0; i < p.config.experts_per_token; ++i) {
      const std::size_t at = std::size_t(r * p.config.experts_per_token + i);
      ASSERT_EQ(ids[at], route.ids[std::size_t(i)]) << what << " row " << r << " pick " << i;
      EXPECT_NEAR(weights[at], route.weights[std::size_t(i)], 1e-5 * route.weights[std::size_t(i)])
          << what << " row " << r << " pick " << i;
    }
    std::vector<double> abs;
    const std::vector<double> want = moe_double(p, r, abs);
    for (int n = 0; n < p.config.hidden; ++n) {
      const double got = out[std::size_t(r * p.config.hidden + n)];
      ASSERT_LE(std::fabs(got - want[std::size_t(n)]), kRelTolerance * abs[std::size_t(n)] + 1e-6)
          << what << " row " << r << " element " << n << ": got " << got << ", want "
          << want[std::size_t(n)];
      ++checked;
    }
  }
  EXPECT_EQ(checked, p.rows * p.config.hidden);
}

TEST(MoeReference, Bf16MatchesDoubleComposition) {
  Problem p = make_problem(1, 5, 64, 16, 4, 32, 32, /*fp8=*/false);
  expect_matches_double(p, "bf16");
}

TEST(MoeReference, Mxfp8MatchesDoubleComposition) {
  Problem p = make_problem(2, 5, 64, 16, 4, 32, 64, /*fp8=*/true);
  expect_matches_double(p, "mxfp8");
}

TEST(MoeReference, WithoutSharedExpertAndOtherK) {
  Problem p = make_problem(3, 3, 96, 8, 2, 64, 0, /*fp8=*/true);
  expect_matches_double(p, "no shared, k 2");
}

TEST(MoeReference, ThreadCountChangesNoBit) {
  Problem p = make_problem(4, 7, 64, 16, 4, 32, 32, /*fp8=*/true);
  std::vector<float> one, three;
  MoeArgs a = args_of(p, one);
  cpu::moe(p.config, a, 1);
  MoeArgs b = args_of(p, three);
  cpu::moe(p.config, b, 3);
  EXPECT_EQ(std::memcmp(one.data(), three.data(), one.size() * sizeof(float)), 0);
}

// The TP split: rank r holds gate rows [r I/P, (r+1) I/P) and the same up rows, and those
// columns of w2; the ranks' partials add up to the whole MoE (the shared expert split alike).
TEST(MoeReference, TensorParallelPartialsSumToTheWhole) {
  constexpr int P = 2;
  Problem whole = make_problem(5, 3, 64, 8, 2, 64, 64, /*fp8=*/false);
  std::vector<float> want;
  MoeArgs a = args_of(whole, want);
  cpu::moe(whole.config, a, 1);
  std::vector<double> sum(want.size(), 0.0);
  auto slice = [&](const Weights& w, int64_t E, int64_t inter, int64_t hidden, bool is_w13,
                   int rank) {
    Weights s;
    const int64_t ir = inter / P;
    const int64_t e_count = std::max<int64_t>(E, 1);
    s.shape = E > 0 ? std::vector<int64_t>{E, is_w13 ? 2 * ir : hidden, is_w13 ? hidden : ir}
                    : std::vector<int64_t>{is_w13 ? 2 * ir : hidden, is_w13 ? hidden : ir};
    for (int64_t e = 0; e < e_count; ++e) {
      if (is_w13) {
        for (int half = 0; half < 2; ++half) {
          for (int64_t j = 0; j < ir; ++j) {
            const int64_t row = e * 2 * inter + half * inter + rank * ir + j;
            s.bf16.insert(s.bf16.end(), w.bf16.begin() + row * hidden,
                          w.bf16.begin() + (row + 1) * hidden);
          }
        }
      } else {
        for (int64_t n = 0; n < hidden; ++n) {
          const int64_t at = (e * hidden + n) * inter + rank * ir;
          s.bf16.insert(s.bf16.end(), w.bf16.begin() + at, w.bf16.begin() + at + ir);
        }
      }
    }
    return s;
  };
  for (int rank = 0; rank < P; ++rank) {
    Problem part = whole;
    part.config.intermediate = whole.config.intermediate / P;
    part.config.shared_intermediate = whole.config.shared_intermediate / P;
    const int E = whole.config.num_experts, H = whole.config.hidden;
    part.experts.w13 = slice(whole.experts.w13, E, whole.config.intermediate, H, true, rank);
    part.experts.w2 = slice(whole.experts.w2, E, whole.config.intermediate, H, false, rank);
    part.shared.w13 = slice(whole.shared.w13, 0, whole.config.shared_intermediate, H, true, rank);
    part.shared.w2 = slice(whole.shared.w2, 0, whole.config.shared_intermediate, H, false, rank);
    std::vector<float> out;
    MoeArgs pa = args_of(part, out);
    cpu::moe(part.config, pa, 1);
    for (std::size_t i = 0; i < out.size(); ++i) sum[i] += out[i];
  }
  for (int64_t r = 0; r < whole.rows; ++r) {
    std::vector<double> abs;
    moe_double(whole, r, abs);
    for (int n = 0; n < whole.config.hidden; ++n) {
      const std::size_t i = std::size_t(r * whole.config.hidden + n);
      // The same bf16 roundings on both sides; only the fp32 sums are split.
      EXPECT_LE(std::fabs(sum[i] - want[i]), 1e-5 * abs[std::size_t(n)] + 1e-6) << "element " << i;
    }
  }
}

// ---- Routing rules ----

// A router whose logits are exactly `logits` (x = e_0, gate[e][0] = logit).
struct Router {
  MoeConfig config;
  std::vector<uint16_t> x;
  std::vector<float> gate, bias;
  std::vector<int32_t> ids;
  std::vector<float> weights;

  Router(const std::vector<float>& logits, std::vector<float> b, int k) : bias(std::move(b)) {
    const int E = static_cast<int>(logits.size());
    config.hidden = 32;
    config.num_experts = E;
    config.experts_per_token = k;
    x.assign(32, float_to_bf16(0.0f));
    x[0] = float_to_bf16(1.0f);
    gate.assign(static_cast<std::size_t>(E) * 32, 0.0f);
    for (int e = 0; e < E; ++e) gate[std::size_t(e) * 32] = logits[std::size_t(e)];
    ids.assign(std::size_t(k), -7);
    weights.assign(std::size_t(k), -7.0f);
    cpu::moe_route(
        config, TensorView::contiguous(x.data(), DType::kBF16, {1, 32}),
        TensorView::contiguous(gate.data(), DType::kF32, {E, 32}),
        bias.empty() ? TensorView{} : TensorView::contiguous(bias.data(), DType::kF32, {E}),
        TensorView::contiguous(ids.data(), DType::kI32, {1, k}),
        TensorView::contiguous(weights.data(), DType::kF32, {1, k}), 1);
  }
};

float sigmoid(float v) {
  return 1.0f / (1.0f + std::exp(-v));
}

TEST(MoeRouting, EqualKeysPickTheLowerExpertId) {
  // Every s is 0.5; the bias makes experts 3 and 5 equal and first, the rest tie at 0.5.
  std::vector<float> bias(8, 0.0f);
  bias[5] = 1.0f;
  bias[3] = 1.0f;
  Router r(std::vector<float>(8, 0.0f), bias, 4);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 5, 0, 1}));
  for (float w : r.weights) EXPECT_FLOAT_EQ(w, 0.5f);  // 2 * 0.5 / 2
  Router no_bias(std::vector<float>(8, 0.0f), {}, 4);
  EXPECT_EQ(no_bias.ids, (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(MoeRouting, BiasPicksButDoesNotWeigh) {
  const std::vector<float> logits = {2.0f, 1.0f, -1.0f, -2.0f, 0.5f, 0.0f};
  // Without a bias: 0, 1, 4, 5 by s. A bias lifts expert 3 (the smallest s) to the top.
  std::vector<float> bias(6, 0.0f);
  bias[3] = 0.9f;
  Router r(logits, bias, 2);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{3, 0}));
  const float s3 = sigmoid(-2.0f), s0 = sigmoid(2.0f);
  EXPECT_FLOAT_EQ(r.weights[0], 2.0f * s3 / (s3 + s0));
  EXPECT_FLOAT_EQ(r.weights[1], 2.0f * s0 / (s3 + s0));
  Router plain(logits, {}, 4);
  EXPECT_EQ(plain.ids, (std::vector<int32_t>{0, 1, 4, 5}));
  float sum = 0;
  for (int e : plain.ids) sum += sigmoid(logits[std::size_t(e)]);
  EXPECT_NEAR(plain.weights[0] + plain.weights[1] + plain.weights[2] + plain.weights[3], 2.0f,
              1e-6f);
  EXPECT_FLOAT_EQ(plain.weights[0], 2.0f * sigmoid(2.0f) / sum);
}

TEST(MoeRouting, NanKeysRankLastAndLowerIdFirst) {
  std::vector<float> bias(6, 0.0f);
  bias[0] = std::nanf("");
  bias[2] = std::nanf("");
  const std::vector<float> logits = {5.0f, 1.0f, 4.0f, 0.0f, 3.0f, 2.0f};
  Router r(logits, bias, 4);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{4, 5, 1, 3}));
  Router all(logits, std::vector<float>(6, std::nanf("")), 3);
  EXPECT_EQ(all.ids, (std::vector<int32_t>{0, 1, 2}));
  // The weights use s, never the bias: finite though the keys were NaN.
  for (float w : all.weights) EXPECT_TRUE(std::isfinite(w));
}

// ---- MXFP8 ----

TEST(Mxfp8, ScaleDecodeFollowsTheDefinition) {
  for (int code = 0; code < 256; ++code) {
    const float got = e8m0_to_float(static_cast<uint8_t>(code));
    const double want = e8m0_definition(static_cast<uint8_t>(code));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got));
    } else {
      EXPECT_EQ(double(got), want) << "code " << code;
    }
  }
}

TEST(Mxfp8, QuantizeRoundTrips) {
  SplitMix64 rng(9);
  constexpr int64_t rows = 6, k = 128;
  std::vector<float> v(rows * k);
  for (int64_t i = 0; i < rows * k; ++i) {
    // Groups of very different magnitudes, and one all-zero group.
    const int64_t group = i / kMxfp8Block;
    v[std::size_t(i)] =
        group == 3 ? 0.0f : rng.signed_unit() * std::ldexp(1.0f, int(group % 9) * 7 - 30);
  }
  std::vector<uint8_t> codes(v.size()), scales(v.size() / kMxfp8Block);
  cpu::quantize_mxfp8(v.data(), rows, k, codes.data(), scales.data());
  for (std::size_t g = 0; g < scales.size(); ++g) {
    double amax = 0;
    for (int i = 0; i < kMxfp8Block; ++i)
      amax = std::max(amax, double(std::fabs(v[g * kMxfp8Block + i])));
    if (amax == 0) {
      EXPECT_EQ(scales[g], 0);
      continue;
    }
    const double scale = e8m0_definition(scales[g]);
    EXPECT_GE(amax / scale, 256.0) << "group " << g;  // the scale uses the top of e4m3's range
    EXPECT_LT(amax / scale, 512.0) << "group " << g;
    for (int i = 0; i < kMxfp8Block; ++i) {
      const std::size_t at = g * kMxfp8Block + i;
      const double back = fp8_e4m3_definition(codes[at]) * scale;
      const float lib = cpu::mxfp8_value(codes.data(), scales.data(), int64_t(at));
      EXPECT_EQ(double(lib), back);
      // e4m3: 3 mantissa bits (relative 2^-4), subnormal step 2^-9, saturation at 448.
      const double tol = std::max(std::fabs(v[at]) / 16.0, std::ldexp(scale, -10)) +
                         std::max(0.0, std::fabs(v[at]) - 448 * scale);
      EXPECT_LE(std::fabs(back - v[at]), tol) << "element " << at;
    }
  }
  // Values that are already codes times the group's scale survive exactly.
  std::vector<float> exact(kMxfp8Block);
  for (int i = 0; i < kMxfp8Block; ++i) {
    exact[std::size_t(i)] =
        float(fp8_e4m3_definition(uint8_t(0x40 + i % 0x38)) * std::ldexp(1.0, -20));
  }
  exact[0] = float(fp8_e4m3_definition(0x7E) * std::ldexp(1.0, -20));  // 448: sets the scale
  std::vector<uint8_t> c(kMxfp8Block), s(1);
  cpu::quantize_mxfp8(exact.data(), 1, kMxfp8Block, c.data(), s.data());
  for (int i = 0; i < kMxfp8Block; ++i) {
    EXPECT_EQ(cpu::mxfp8_value(c.data(), s.data(), i), exact[std::size_t(i)]) << i;
  }
}

// ---- The dense MLP ----

TEST(DenseMlpReference, MatchesDoubleComposition) {
  for (bool fp8 : {false, true}) {
    SplitMix64 rng(fp8 ? 21 : 22);
    constexpr int64_t rows = 3, H = 64, D = 96;
    std::vector<uint16_t> x(rows * H);
    for (uint16_t& v : x) v = float_to_bf16(rng.unit_variance());
    Weights w13 = make_weights(rng, {2 * D, H}, fp8, 3.0f / 8);
    Weights w2 = make_weights(rng, {H, D}, fp8, 0.1f);
    std::vector<float> out(rows * H);
    DenseMlpArgs a;
    a.x = TensorView::contiguous(x.data(), DType::kBF16, {rows, H});
    a.mlp = {w13.view(), w13.scale_view(), w2.view(), w2.scale_view()};
    a.out = TensorView::contiguous(out.data(), DType::kF32, {rows, H});
    cpu::dense_mlp(a, 2);
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<double> xr(H), y(H, 0.0), abs(H, 0.0);
      for (int64_t i = 0; i < H; ++i) xr[std::size_t(i)] = bf16_to_float(x[std::size_t(r * H + i)]);
      expert_double(xr, w13, w2, 0, D, H, 7.0, 1.0, y.data(), abs.data());
      for (int64_t n = 0; n < H; ++n) {
        EXPECT_LE(std::fabs(out[std::size_t(r * H + n)] - y[std::size_t(n)]),
                  kRelTolerance * abs[std::size_t(n)] + 1e-6)
            << (fp8 ? "mxfp8" : "bf16") << " row " << r << " element " << n;
      }
    }
  }
}

// ---- Refusals ----

void expect_refusal(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one naming " << parts.front();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "'" << part << "' not in: " << e.what();
    }
  }
}

TEST(MoeReference, RefusalsNameTheTensorAndTheShapes) {
  Problem p = make_problem(7, 2, 64, 8, 2, 32, 32, /*fp8=*/true);
  std::vector<float> out;
  const MoeArgs good = args_of(p, out);
  {
    MoeArgs a = good;
    a.experts.w13 = TensorView::contiguous(a.experts.w13.data, DType::kFP8E4M3, {8, 63, 64});
    expect_refusal([&] { cpu::moe(p.config, a, 1); },
                   {"experts.w13", "expected shape [8, 64, 64]", "got [8, 63, 64]"});
  }
  {
    MoeArgs a = good;
    a.experts.w2_scale = {};
    expect_refusal([&] { cpu::moe(p.config, a, 1); }, {"experts.w2_scale", "[8, 64, 1]"});
  }
  {
    MoeArgs a = good;
    a.experts.w13_scale = TensorView::contiguous(a.experts.w13_scale.data, DType::kU8, {8, 64, 3});
    expect_refusal([&] { cpu::moe(p.config, a, 1); },
                   {"experts.w13_scale", "expected shape [8, 64, 2]", "got [8, 64, 3]"});
  }
  {
    MoeArgs a = good;
    a.router_weight.dtype = DType::kBF16;
    expect_refusal([&] { cpu::moe(p.config, a, 1); }, {"router_weight", "f32", "bf16"});
  }
  {
    MoeArgs a = good;
    a.router_bias = TensorView::contiguous(a.router_bias.data, DType::kF32, {7});
    expect_refusal([&] { cpu::moe(p.config, a, 1); }, {"router_bias", "[8]", "[7]"});
  }
  {
    MoeArgs a = good;
    a.shared = {};
    expect_refusal([&] { cpu::moe(p.config, a, 1); }, {"shared", "32"});
  }
  {
    MoeArgs a = good;
    a.shared.w2 = TensorView::contiguous(a.shared.w2.data, DType::kFP8E4M3, {32, 32});
    expect_refusal([&] { cpu::moe(p.config, a, 1); },
                   {"shared.w2", "expected shape [64, 32]", "got [32, 32]"});
  }
  {
    MoeArgs a = good;
    a.out.dtype = DType::kBF16;
    expect_refusal([&] { cpu::moe(p.config, a, 1); }, {"out", "f32"});
  }
  {
    MoeConfig c = p.config;
    c.experts_per_token = 9;
    expect_refusal([&] { cpu::moe(c, good, 1); }, {"moe.experts_per_token", "9"});
  }
  {
    // An MXFP8 K that is not a multiple of 32.
    MoeConfig c = p.config;
    c.intermediate = 20;
    MoeArgs a = good;
    a.experts.w13 = TensorView::contiguous(a.experts.w13.data, DType::kFP8E4M3, {8, 40, 64});
    a.experts.w13_scale = TensorView::contiguous(a.experts.w13_scale.data, DType::kU8, {8, 40, 2});
    a.experts.w2 = TensorView::contiguous(a.experts.w2.data, DType::kFP8E4M3, {8, 64, 20});
    expect_refusal([&] { cpu::moe(c, a, 1); }, {"experts.w2", "multiple of 32"});
  }
}

TEST(MoeConfigTest, ModelFieldsAreValidatedAndSplit) {
  ModelConfig m;
  EXPECT_NO_THROW(m.validate());
  const MoeConfig r4 = m.moe(4);
  EXPECT_EQ(r4.intermediate, 768);
  EXPECT_EQ(r4.shared_intermediate, 768);
  EXPECT_EQ(r4.num_experts, 128);
  EXPECT_EQ(r4.experts_per_token, 4);
  EXPECT_EQ(m.moe(8).intermediate, 384);
  expect_refusal([&] { (void)m.moe(5); }, {"model.moe_intermediate", "3072"});
  const std::vector<std::pair<std::function<void(ModelConfig&)>, std::string>> bad = {
      {[](ModelConfig& c) { c.num_experts = 0; }, "model.num_experts"},
      {[](ModelConfig& c) { c.experts_per_token = 129; }, "model.experts_per_token"},
      {[](ModelConfig& c) { c.moe_intermediate = -1; }, "model.moe_intermediate"},
      {[](ModelConfig& c) { c.shared_experts = -1; }, "model.shared_experts"},
      {[](ModelConfig& c) { c.dense_intermediate = -3; }, "model.dense_intermediate"},
      {[](ModelConfig& c) { c.routed_scaling = std::nanf(""); }, "model.routed_scaling"},
      {[](ModelConfig& c) { c.activation_limit = 0; }, "model.activation_limit"},
  };
  for (const auto& [edit, name] : bad) {
    ModelConfig c;
    edit(c);
    expect_refusal([&] { c.validate(); }, {name});
  }
}

}  // namespace
}  // namespace m3msa

namespace m3msa {
namespace {

// The routing rule written out: larger key first, NaN keys after every number, equal keys (-0 and
// +0 equal) by the lower id.
bool picked_before(float ka, int a, float kb, int b) {
  const bool na = std::isnan(ka);
  const bool nb = std::isnan(kb);
  if (na != nb) return nb;
  if (!na && ka != kb) return ka > kb;
  return a < b;
}

// moe_pick_order (the GPU top-k's one-max order) against the rule on every pair of special and
// random keys, ids included (and the id read back from the key): NaNs of both signs and several
// payloads, +-0, +-inf, subnormals, the extremes, neighbours of one value, and random bits.
TEST(MoeReference, PickOrderKeyMatchesTheRoutingRule) {
  std::vector<float> keys = {0.0f,
                             -0.0f,
                             1.0f,
                             -1.0f,
                             std::nextafter(1.0f, 2.0f),
                             std::nextafter(1.0f, 0.0f),
                             bits_float(0x7F800000u),
                             bits_float(0xFF800000u),
                             bits_float(0x7FC00000u),
                             bits_float(0xFFC00000u),
                             bits_float(0x7F800001u),
                             bits_float(0x00000001u),
                             bits_float(0x80000001u),
                             bits_float(0x007FFFFFu),
                             bits_float(0x7F7FFFFFu),
                             bits_float(0xFF7FFFFFu),
                             0.5f,
                             0.75f};
  SplitMix64 rng(0x51C0DEull);
  for (int i = 0; i < 48; ++i) keys.push_back(bits_float(static_cast<uint32_t>(rng.next())));
  const int ids[] = {0, 1, 2, 31, 32, 127, 128, 4095};
  for (float ka : keys) {
    for (int a : ids) {
      for (float kb : keys) {
        for (int b : ids) {
          if (a == b) continue;  // one expert has one key
          EXPECT_EQ(moe_pick_order(ka, a) > moe_pick_order(kb, b), picked_before(ka, a, kb, b))
              << "keys " << float_bits(ka) << " / " << float_bits(kb) << ", ids " << a << " / "
              << b;
          EXPECT_NE(moe_pick_order(ka, a), 0u) << "a candidate's key is never 0";
          EXPECT_EQ(moe_pick_id(moe_pick_order(ka, a)), a) << "the id comes back from the key";
        }
      }
    }
  }
}

}  // namespace
}  // namespace m3msa
