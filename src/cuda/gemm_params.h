// Kernel parameter struct of the gemm family (gemm_kernel.cuh): the skinny projection GEMM of the
// decode runtime. Plain data, passed by value as __grid_constant__.
#pragma once

#include <cstdint>

namespace m3msa::cuda {

inline constexpr int kSkinnyMaxRows = 16;  // token rows: one m16 MMA tile
inline constexpr int kSkinnyKAlign = 64;   // k per warp step

// out[r, n] = sum_k x[r, k] * w[n, k] (* scale[n]).
struct GemmSkinnyParams {
  const uint16_t* x = nullptr;   // [rows, k] bf16, row stride x_stride (elements)
  const void* w = nullptr;       // [n, k] bf16 | fp8 e4m3 (w_fp8), row-major
  const float* scale = nullptr;  // [n] f32 per output channel, or null (scale 1)
  void* out = nullptr;           // [rows, n] bf16 | f32 (out_f32), row stride out_stride
  int64_t x_stride = 0;
  int64_t out_stride = 0;
  int rows = 0;  // 1..16
  int n = 0;
  int k = 0;  // multiple of 64
  int w_fp8 = 0;
  int out_f32 = 0;
  // 1: 4x (bf16) / 2.7x (fp8) the weight chunks in flight per warp (up to 255 registers: fewer
  // CTAs per SM), for narrow outputs whose few CTAs would otherwise wait on latency. The same bits
  // as deep = 0.
  int deep = 0;
  // 1: the ring loop whatever the grid (tests: it is otherwise taken only for grids of >= 4 CTAs
  // per SM), for bf16 weights and for fp8 ones read in 128-byte chunks (no split_k8, k a multiple
  // of 128; other fp8 launches never take it). The same bits.
  int force_ring = 0;
  // 1: 8 warps split K per 16-column tile instead of 4: twice the bytes in flight for grids of
  // < 4 CTAs per SM (gemm_skinny_prefers_split_k8). Another reduction order than 0, so every
  // launch of one projection (also column ranges of it, deep or not) must use the same value.
  int split_k8 = 0;
};

}  // namespace m3msa::cuda
