// Residual add + Gemma RMSNorm kernels of the decode runtime (norm.h has the numerics contract).
// Framework-free: raw pointers and NormResidualParams; launched by norm.cu.
//
// One CTA per row: x = bf16(residual + delta) is written back to the residual, its sum of
// squares reduced in a fixed order (thread, warp xor tree, warps in order), then
// y = bf16((x * r) * (1 + w)). Two variants with the same contract: norm_residual_regs_kernel
// keeps the row in registers (one round trip to L2, rows up to 32768 elements);
// norm_residual_kernel loops over the row twice (any width). Their partitions of the sum differ,
// so the launcher picks the variant from the width alone.
// Requirements: n a multiple of 8 and every tensor 16-byte aligned (8-element vector accesses).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/norm_params.h"
#include "m3msa/dtype.h"

namespace m3msa::cuda::norm {

inline constexpr int kNormThreads = 256;
inline constexpr int kNormWarps = kNormThreads / 32;

__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}

__device__ __forceinline__ uint4 pack_bf16x8(const float (&f)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = static_cast<uint32_t>(float_to_bf16(f[2 * i])) |
           (static_cast<uint32_t>(float_to_bf16(f[2 * i + 1])) << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// delta[at .. at + 8) as floats: bf16, or f32 rounded to bf16 first (as the CPU does).
__device__ __forceinline__ void load_delta8(const NormResidualParams& p, int64_t at,
                                            float (&d)[8]) {
  if (p.delta_f32) {
    const float* delta = static_cast<const float*>(p.delta) + at;
    const float4 d0 = *reinterpret_cast<const float4*>(delta);
    const float4 d1 = *reinterpret_cast<const float4*>(delta + 4);
    const float raw[8] = {d0.x, d0.y, d0.z, d0.w, d1.x, d1.y, d1.z, d1.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) d[j] = round_to_bf16(raw[j]);
  } else {
    unpack_bf16x8(*reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.delta) + at), d);
  }
}

// x = bf16(residual + delta) of the 8 elements at row_base + i, written back to the residual;
// adds their squares to sum in order.
__device__ __forceinline__ void add_residual8(const NormResidualParams& p, int64_t row_base, int i,
                                              float (&x)[8], float& sum) {
  uint16_t* residual = p.residual + row_base + i;
  float r[8], d[8];
  unpack_bf16x8(*reinterpret_cast<const uint4*>(residual), r);
  load_delta8(p, row_base + i, d);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    x[j] = round_to_bf16(__fadd_rn(r[j], d[j]));
    sum = __fadd_rn(sum, __fmul_rn(x[j], x[j]));
  }
  *reinterpret_cast<uint4*>(residual) = pack_bf16x8(x);
}

// 1 / sqrt(mean(x^2) + eps) of a row from each thread's partial sum of squares, in a fixed
// order (warp: xor tree; CTA: warps in order) so the same partition gives the same bits. Every
// thread gets it. s_partial: blockDim.x / 32 + 1 floats of shared memory.
__device__ __forceinline__ float block_inv_rms(float sum, const NormResidualParams& p,
                                               float* s_partial) {
  const int warps = static_cast<int>(blockDim.x >> 5);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
  if ((threadIdx.x & 31) == 0) s_partial[threadIdx.x >> 5] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total = __fadd_rn(total, s_partial[w]);
    s_partial[warps] = 1.0f / sqrtf(__fadd_rn(total / static_cast<float>(p.n), p.eps));
  }
  __syncthreads();
  return s_partial[warps];
}

// Gemma RMSNorm of 8 elements: bf16((x * r) * (1 + w)).
__device__ __forceinline__ uint4 gemma_norm8(const float (&x)[8], float rms, const float (&w)[8]) {
  float y[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) y[j] = __fmul_rn(__fmul_rn(x[j], rms), __fadd_rn(1.0f, w[j]));
  return pack_bf16x8(y);
}

// One CTA per row. Pass 1: x = bf16(residual + delta) -> residual, sum of squares; a fixed-order
// block reduction; pass 2: y = bf16((x * r) * (1 + w)) -> out. Each thread re-reads only what it
// wrote itself, and reads delta[i] before writing out[i], so out may alias delta.
__global__ void __launch_bounds__(kNormThreads)
    norm_residual_kernel(const __grid_constant__ NormResidualParams p) {
  __shared__ float s_partial[kNormWarps + 1];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * p.n;
  uint16_t* residual = p.residual + base;
  float sum = 0.0f;
  for (int i = threadIdx.x * 8; i < p.n; i += kNormThreads * 8) {
    float x[8];
    add_residual8(p, base, i, x, sum);
  }
  const float rms = block_inv_rms(sum, p, s_partial);
  uint16_t* out = p.out + base;
  for (int i = threadIdx.x * 8; i < p.n; i += kNormThreads * 8) {
    float x[8], w[8];
    unpack_bf16x8(*reinterpret_cast<const uint4*>(residual + i), x);
    unpack_bf16x8(*reinterpret_cast<const uint4*>(p.weight + i), w);
    *reinterpret_cast<uint4*>(out + i) = gemma_norm8(x, rms, w);
  }
}

// The same in one pass, for rows of up to kNormMaxThreads * 8 * kChunks elements: each thread
// holds its kChunks 8-element chunks (chunk c at (c * blockDim + tid) * 8) in registers, and the
// norm weight is loaded before the reduction, so a row costs one round trip to L2 instead of the
// loop's two passes (a 1-row decode step waits on this kernel twice per layer). The sum of
// squares is again a fixed-order tree (thread: its chunks in order; warp: xor tree; CTA: warps in
// order), over a different partition than norm_residual_kernel's.
inline constexpr int kNormMaxThreads = 1024;

template <int kChunks>
__global__ void __launch_bounds__(kNormMaxThreads)
    norm_residual_regs_kernel(const __grid_constant__ NormResidualParams p) {
  __shared__ float s_partial[kNormMaxThreads / 32 + 1];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * p.n;
  float x[kChunks][8];
  uint4 w[kChunks];
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int i = (c * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x)) * 8;
    if (i >= p.n) break;
    w[c] = __ldg(reinterpret_cast<const uint4*>(p.weight + i));
    add_residual8(p, base, i, x[c], sum);
  }
  const float rms = block_inv_rms(sum, p, s_partial);
  uint16_t* out = p.out + base;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int i = (c * static_cast<int>(blockDim.x) + static_cast<int>(threadIdx.x)) * 8;
    if (i >= p.n) break;
    float wf[8];
    unpack_bf16x8(w[c], wf);
    *reinterpret_cast<uint4*>(out + i) = gemma_norm8(x[c], rms, wf);
  }
}

}  // namespace m3msa::cuda::norm
