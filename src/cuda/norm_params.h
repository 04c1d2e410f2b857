// Kernel parameter struct of the norm family (norm_kernel.cuh): the residual add fused with the
// Gemma RMSNorm of the decode runtime. Plain data, passed by value as __grid_constant__.
#pragma once

#include <cstdint>

namespace m3msa::cuda {

// residual <- bf16(residual + delta); out <- bf16((x * r) * (1 + weight)), one row per CTA.
struct NormResidualParams {
  const void* delta = nullptr;       // [rows, n] bf16 | f32 (delta_f32), row stride n; may == out
  uint16_t* residual = nullptr;      // [rows, n] bf16 in: old residual; out: x = residual + delta
  const uint16_t* weight = nullptr;  // [n] bf16 Gemma norm weight (y = x * r * (1 + w))
  uint16_t* out = nullptr;           // [rows, n] bf16 normed x
  int rows = 0;
  int n = 0;          // multiple of 8
  int delta_f32 = 0;  // 1: delta is f32 (rounded to bf16 before the add)
  float eps = 1e-6f;
};

}  // namespace m3msa::cuda
