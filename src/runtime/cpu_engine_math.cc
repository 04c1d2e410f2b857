// The plain CPU math of the CPU engine (cpu_engine.cc) beside the CPU reference ops: projections,
// Gemma RMSNorm of hidden rows, the SwiGLU-OAI activation. Written to be obviously correct, not
// fast; a translation unit of its own so the fuzzers can leave its loops uninstrumented
// (fuzz/coverage_ignore.txt).
#include <array>
#include <cmath>

#include "m3msa/dtype.h"
#include "runtime/runtime_internal.h"

namespace m3msa::runtime_detail {

namespace {

const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = fp8e4m3_to_float(static_cast<uint8_t>(i));
    return t;
  }();
  return table;
}

}  // namespace

void linear(const uint16_t* x, int64_t rows, int64_t in, const TensorView& w,
            const TensorView& scale, float* out, float* x_row) {
  const int64_t out_features = w.shape[0];
  const float* scales = scale.defined() ? scale.ptr<const float>() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < in; ++k) x_row[k] = bf16_to_float(x[r * in + k]);
    float* y = out + r * out_features;
    if (w.dtype == DType::kBF16) {
      const uint16_t* weights = w.ptr<const uint16_t>();
      for (int64_t n = 0; n < out_features; ++n) {
        const uint16_t* row = weights + n * in;
        float acc = 0.0f;
        for (int64_t k = 0; k < in; ++k) acc += x_row[k] * bf16_to_float(row[k]);
        y[n] = scales ? acc * scales[n] : acc;
      }
    } else {
      const uint8_t* weights = w.ptr<const uint8_t>();
      const std::array<float, 256>& table = fp8_table();
      for (int64_t n = 0; n < out_features; ++n) {
        const uint8_t* row = weights + n * in;
        float acc = 0.0f;
        for (int64_t k = 0; k < in; ++k) acc += x_row[k] * table[row[k]];
        y[n] = scales ? acc * scales[n] : acc;
      }
    }
  }
}

void gemma_rmsnorm_row(const uint16_t* x, const uint16_t* weight, int64_t n, float eps,
                       uint16_t* y) {
  float sum_sq = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = bf16_to_float(x[i]);
    sum_sq += v * v;
  }
  const float r = 1.0f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    y[i] = float_to_bf16(bf16_to_float(x[i]) * r * (1.0f + bf16_to_float(weight[i])));
  }
}

float swiglu_oai(float gate, float up, float limit) {
  // Comparisons (not fmin/fmax) so a NaN input stays NaN, as torch.clamp does.
  const float g = gate > limit ? limit : gate;
  const float u = up > limit ? limit : (up < -limit ? -limit : up);
  const float glu = g / (1.0f + std::exp(-1.702f * g));
  return glu * (u + 1.0f);
}

}  // namespace m3msa::runtime_detail
