// Host side of the small kernels of the fused decode runtime (src/runtime/gpu_layer.cc): the
// fused residual add + Gemma RMSNorm, the skinny projection GEMM of decode rows, the SwiGLU-OAI
// activation and an f32 -> bf16 conversion. One POD params struct per kernel family (passed by
// value as __grid_constant__), a launcher per family that validates on the host, allocates
// nothing, never synchronizes and is CUDA-graph capturable (grids depend only on host shapes).
//
// Numerics (the contract of runtime.h, approximated; the CPU runtime is the oracle):
//  - add + norm: x = bf16(residual + delta) (delta f32 is first rounded to bf16, as the CPU
//    does), y = bf16((x * r) * (1 + w)) with r = 1 / sqrt(mean(x^2) + eps); the sum of squares is
//    a fixed-order tree in fp32 (not the CPU's sequential order), so r can differ in its last
//    bits and y by one bf16 ulp.
//  - skinny GEMM: fp32 accumulation on tensor cores (mma.sync m16n8k16 bf16), fp8 e4m3 weights
//    converted exactly to bf16 in registers (an e4m3 NaN makes its output column NaN), then *
//    scale[n]; fixed reduction order, so the same inputs give bit-identical outputs run to run
//    (graph replay == eager) and whichever loop a launch takes (ring, group, deep).
// Deterministic run to run: every kernel here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace m3msa::cuda {

// ---- Residual add + Gemma RMSNorm ----

struct AddNormParams {
  const void* delta = nullptr;       // [rows, n] bf16 | f32 (delta_f32), row stride n; may == out
  uint16_t* residual = nullptr;      // [rows, n] bf16 in: old residual; out: x = residual + delta
  const uint16_t* weight = nullptr;  // [n] bf16 Gemma norm weight (y = x * r * (1 + w))
  uint16_t* out = nullptr;           // [rows, n] bf16 normed x
  int rows = 0;
  int n = 0;          // multiple of 8
  int delta_f32 = 0;  // 1: delta is f32 (rounded to bf16 before the add)
  float eps = 1e-6f;
};

void launch_add_rmsnorm(const AddNormParams& p, cudaStream_t stream);

// ---- Skinny projection GEMM: out[r, n] = sum_k x[r, k] * w[n, k] (* scale[n]) ----
//
// Decode projections have at most 16 token rows: one m16 tile of the tensor-core MMA covers them
// all, so the kernel streams every weight byte exactly once. Each warp owns 16 output columns
// (two n8 tiles) and a quarter of K; a CTA is 4 warps over the same 16 columns, reduced in a
// fixed order through shared memory. Weight rows are read with 16-byte loads; because a dot
// product may visit k in any order, each thread's 16 contiguous k values are mapped onto its
// fragment positions (the activations use the same mapping), so no shuffles are needed.
// Requirements (kUnsupported otherwise): 1 <= rows <= 16, k % 64 == 0, 16-byte aligned x rows
// and weight base.
inline constexpr int kSkinnyMaxRows = 16;
inline constexpr int kSkinnyKAlign = 64;

struct SkinnyGemmParams {
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
  // < 4 CTAs per SM (skinny_gemm_prefers_split_k8). Another reduction order than 0, so every
  // launch of one projection (also column ranges of it, deep or not) must use the same value.
  int split_k8 = 0;
};

void launch_skinny_gemm(const SkinnyGemmParams& p, cudaStream_t stream);
// CTAs of one launch (for the launch-count and byte bookkeeping of the benchmarks).
int skinny_gemm_ctas(int n);
// Whether a projection of n output columns should be launched with split_k8 on this device: its
// grid puts < 4 CTAs on every SM (measured on H200: M3's o_proj, 384 CTAs, 3-22 % faster). Decide
// once per projection from its full width and use it for every launch of it.
bool skinny_gemm_prefers_split_k8(int n);

// ---- SwiGLU-OAI activation: act[r, j] = bf16(swiglu(gate_up[r, j], gate_up[r, I + j])) ----

struct SwigluParams {
  const uint16_t* gate_up = nullptr;  // [rows, 2 * I] bf16, rows [gate | up]
  uint16_t* act = nullptr;            // [rows, I] bf16
  int rows = 0;
  int inter = 0;  // I
  float limit = 7.0f;
};

void launch_swiglu(const SwigluParams& p, cudaStream_t stream);

// ---- f32 -> bf16 (round to nearest even) ----

void launch_f32_to_bf16(const float* in, uint16_t* out, int64_t count, cudaStream_t stream);

}  // namespace m3msa::cuda
