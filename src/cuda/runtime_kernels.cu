// The small kernels of the fused decode runtime (runtime_kernels.h): residual add + Gemma
// RMSNorm, the skinny projection GEMM, SwiGLU-OAI and the f32 -> bf16 conversion, with their
// launchers. Framework-free kernels, host validation in the launchers.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/runtime_kernels.h"
#include "m3msa/dtype.h"
#include "m3msa/error.h"

namespace m3msa::cuda {
namespace rk {

// ---- Residual add + Gemma RMSNorm ----

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
__device__ __forceinline__ void load_delta8(const AddNormParams& p, int64_t at, float (&d)[8]) {
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
__device__ __forceinline__ void add_residual8(const AddNormParams& p, int64_t row_base, int i,
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
__device__ __forceinline__ float block_inv_rms(float sum, const AddNormParams& p,
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
    add_rmsnorm_kernel(const __grid_constant__ AddNormParams p) {
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
// order), over a different partition than add_rmsnorm_kernel's.
inline constexpr int kNormMaxThreads = 1024;

template <int kChunks>
__global__ void __launch_bounds__(kNormMaxThreads)
    add_rmsnorm_regs_kernel(const __grid_constant__ AddNormParams p) {
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

// ---- Skinny GEMM ----

inline constexpr int kGemmWarps = 4;  // split K inside a CTA
inline constexpr int kGemmThreads = kGemmWarps * 32;
inline constexpr int kColsPerCta = 16;  // two n8 MMA tiles
inline constexpr int kChunk = 64;       // k per warp step (4 MMAs of k16)
// <= 102 registers: 5 CTAs per SM, so the 616 CTAs of M3's TP = 1 projection are resident at once
// (4 per SM would leave a second partial wave).
inline constexpr int kGemmMinCtasPerSm = 5;

// Weights are read exactly once: keep them out of L1.
__device__ __forceinline__ uint4 load_stream(const void* ptr) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(ptr));
  return v;
}

// Four e4m3 values (byte i = element i) -> two bf16x2 words (lo = elements 0, 1; hi = 2, 3),
// exactly, on the integer and fp16 pipes: the conversion instructions (e4m3 -> f16 -> f32 -> bf16,
// four per pair at 16 per clock per SM) would cap the GEMM at ~8 weights per clock per SM, under
// half of what HBM delivers. The 7 magnitude bits go to bf16 bits 4..10 and the sign to bit 15,
// which reads as the value x 2^-120 (normal, subnormal and zero alike), and one bf16x2 multiply by
// 2^120 restores it exactly. The two NaN codes (magnitude 0x7F) would read as +-480: their bytes
// are flagged in `nan_bits` (bit 7 of the byte) and gemm_tile makes those columns NaN.
__device__ __forceinline__ void fp8x4_to_bf16x4(uint32_t four, uint32_t& lo, uint32_t& hi,
                                                uint32_t& nan_bits) {
  const uint32_t mag = four & 0x7F7F7F7Fu;
  nan_bits |= mag + 0x01010101u;  // only a 0x7F magnitude carries into bit 7 (masked later)
  // byte << 8 per 16-bit half, and the magnitude per half: 16 m + s << 15 = (b << 8) - 240 m.
  const uint32_t b_lo = __byte_perm(four, 0, 0x1404), b_hi = __byte_perm(four, 0, 0x3424);
  const uint32_t m_lo = __byte_perm(mag, 0, 0x4140), m_hi = __byte_perm(mag, 0, 0x4342);
  const uint32_t scaled_lo = b_lo - 240u * m_lo, scaled_hi = b_hi - 240u * m_hi;
  constexpr uint32_t kTwoPow120 = 0x7B807B80u, kMinusZero = 0x80008000u;  // bf16x2
  asm("fma.rn.bf16x2 %0, %1, %2, %3;"
      : "=r"(lo)
      : "r"(scaled_lo), "r"(kTwoPow120), "r"(kMinusZero));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;"
      : "=r"(hi)
      : "r"(scaled_hi), "r"(kTwoPow120), "r"(kMinusZero));
}

__device__ __forceinline__ void mma_bf16_16x8x16(float (&c)[4], uint32_t a0, uint32_t a1,
                                                 uint32_t a2, uint32_t a3, uint32_t b0,
                                                 uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The 16 activations of one row that pair with this thread's 16 weights of a chunk, as 8 bf16x2
// words (word w = elements 2w, 2w + 1). Offsets: bf16 weights {t*8 .. +8} and {32 + t*8 .. +8};
// fp8 weights {t*16 .. +16}.
template <bool kFp8>
__device__ __forceinline__ void load_x(const uint16_t* row_chunk, int t, uint32_t (&a)[8]) {
  const uint4 lo = __ldg(reinterpret_cast<const uint4*>(row_chunk + (kFp8 ? t * 16 : t * 8)));
  const uint4 hi =
      __ldg(reinterpret_cast<const uint4*>(row_chunk + (kFp8 ? t * 16 + 8 : 32 + t * 8)));
  a[0] = lo.x, a[1] = lo.y, a[2] = lo.z, a[3] = lo.w;
  a[4] = hi.x, a[5] = hi.y, a[6] = hi.z, a[7] = hi.w;
}

template <bool kFp8>
struct WeightRegs {
  uint4 v[kFp8 ? 1 : 2];
};

template <bool kFp8>
__device__ __forceinline__ void load_w(const uint8_t* row_chunk, int t, WeightRegs<kFp8>& w) {
  if constexpr (kFp8) {
    w.v[0] = load_stream(row_chunk + t * 16);
  } else {
    w.v[0] = load_stream(row_chunk + t * 16);       // bf16 elements t*8 .. +8
    w.v[1] = load_stream(row_chunk + 64 + t * 16);  // bf16 elements 32 + t*8 .. +8
  }
}

// `nan_bits` (fp8 only): bit 7 of a byte is set where a weight was an e4m3 NaN.
template <bool kFp8>
__device__ __forceinline__ void weight_words(const WeightRegs<kFp8>& w, uint32_t (&b)[8],
                                             uint32_t& nan_bits) {
  if constexpr (kFp8) {
    const uint32_t bytes[4] = {w.v[0].x, w.v[0].y, w.v[0].z, w.v[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) fp8x4_to_bf16x4(bytes[i], b[2 * i], b[2 * i + 1], nan_bits);
  } else {
    b[0] = w.v[0].x, b[1] = w.v[0].y, b[2] = w.v[0].z, b[3] = w.v[0].w;
    b[4] = w.v[1].x, b[5] = w.v[1].y, b[6] = w.v[1].z, b[7] = w.v[1].w;
  }
}

// kSub consecutive 64-k sub-chunks of the tile's two weight rows: one slot of gemm_tile's loops.
template <bool kFp8, int kSub>
struct ChunkRegs {
  WeightRegs<kFp8> w[kSub][2];
};

// One 16-column tile: out[:, n0 .. n0 + 16). K is cut into chunks of kSub x 64 (kSub 2: fp8
// weights read 128 bytes per row per chunk, as bf16's 64-k chunks are). Warp w of kWarps handles
// the chunks c = w, w + kWarps, ... of K for the tile's 16 columns, kUnroll chunks in flight (a
// group loaded before any is used, or a ring: kRing). Lanes: g = lane / 4 is the MMA group (rows g
// and g + 8 of A, column g of each n8 tile of B), t = lane % 4 picks the k slice (see load_x). A
// warp accumulates its chunks in increasing order (their sub-chunks too) whatever kUnroll and
// kRing are, so they give the same bits; kWarps and kSub change the order.
template <bool kFp8, int kUnroll, bool kRing, int kWarps, int kSub = 1>
__device__ __forceinline__ void gemm_tile(const SkinnyGemmParams& p, int n0,
                                          float (&s_red)[kWarps][kSkinnyMaxRows][kColsPerCta + 1]) {
  constexpr int kElem = kFp8 ? 1 : 2;
  constexpr int kChunkK = kChunk * kSub;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int chunks = p.k / kChunkK;
  const bool lo_ok = g < p.rows;
  const bool hi_ok = g + 8 < p.rows;
  const uint16_t* x_lo = p.x + static_cast<int64_t>(lo_ok ? g : 0) * p.x_stride;
  const uint16_t* x_hi = p.x + static_cast<int64_t>(hi_ok ? g + 8 : 0) * p.x_stride;
  const uint8_t* w_base = static_cast<const uint8_t*>(p.w);
  const uint8_t* w_row[2];
  bool col_ok[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int col = n0 + j * 8 + g;
    col_ok[j] = col < p.n;
    w_row[j] = w_base + static_cast<int64_t>(col_ok[j] ? col : 0) * p.k * kElem;
  }

  using Slot = ChunkRegs<kFp8, kSub>;
  const auto load_chunk = [&](int c, Slot& slot) {
#pragma unroll
    for (int u = 0; u < kSub; ++u) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (c < chunks && col_ok[j]) {
          load_w<kFp8>(w_row[j] + (static_cast<int64_t>(c) * kChunkK + u * kChunk) * kElem, t,
                       slot.w[u][j]);
        } else {
#pragma unroll
          for (int i = 0; i < (kFp8 ? 1 : 2); ++i) slot.w[u][j].v[i] = make_uint4(0, 0, 0, 0);
        }
      }
    }
  };
  float acc[2][4] = {};
  uint32_t nan_bits[2] = {0u, 0u};
  const auto compute_chunk = [&](int c, const Slot& slot) {
#pragma unroll
    for (int u = 0; u < kSub; ++u) {
      const int64_t k0 = static_cast<int64_t>(c) * kChunkK + u * kChunk;
      uint32_t a_lo[8] = {}, a_hi[8] = {};
      if (lo_ok) load_x<kFp8>(x_lo + k0, t, a_lo);
      if (hi_ok) load_x<kFp8>(x_hi + k0, t, a_hi);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t b[8];
        weight_words<kFp8>(slot.w[u][j], b, nan_bits[j]);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          mma_bf16_16x8x16(acc[j], a_lo[2 * s], a_hi[2 * s], a_lo[2 * s + 1], a_hi[2 * s + 1],
                           b[2 * s], b[2 * s + 1]);
        }
      }
    }
  };

  if constexpr (kRing) {
    // Slot u of the register ring holds chunk first + u * kWarps and is refilled with the
    // chunk kUnroll steps ahead as soon as its MMAs are issued, so each warp keeps kUnroll - 1
    // chunks in flight while it computes (the group loop below leaves HBM idle while the warps
    // of an SM, started together, compute at once). 128-byte chunks only (bf16, fp8 with kSub
    // 2): each slot's loads need a load scoreboard of their own (a warp has six), and fp8's six
    // 64-byte chunks would share them (measured 18-38 % slower).
    Slot w[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load_chunk(warp + u * kWarps, w[u]);
    for (int first = warp; first < chunks; first += kWarps * kUnroll) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = first + u * kWarps;
        if (c >= chunks) break;  // warp-uniform
        compute_chunk(c, w[u]);
        load_chunk(c + kWarps * kUnroll, w[u]);
      }
    }
  } else {
    // Groups: kUnroll chunks' weights are loaded before any is used.
    for (int first = warp; first < chunks; first += kWarps * kUnroll) {
      Slot w[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) load_chunk(first + u * kWarps, w[u]);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = first + u * kWarps;
        if (c >= chunks) break;  // warp-uniform
        compute_chunk(c, w[u]);
      }
    }
  }

  if constexpr (kFp8) {
    // A NaN weight makes its column NaN whatever x is (as NaN * x would). Lanes 4c .. 4c + 3
    // loaded column c of tile j; this lane holds the sums of columns 2t and 2t + 1.
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint32_t nan_lanes = __ballot_sync(0xFFFFFFFFu, (nan_bits[j] & 0x80808080u) != 0u);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if ((nan_lanes >> (4 * (2 * t + e))) & 0xFu) {
          acc[j][e] = acc[j][e + 2] = __int_as_float(0x7FFFFFFF);
        }
      }
    }
  }
  // C fragment: c0, c1 = (row g, cols 2t, 2t + 1), c2, c3 = (row g + 8, same cols).
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int col = j * 8 + 2 * t;
    s_red[warp][g][col] = acc[j][0];
    s_red[warp][g][col + 1] = acc[j][1];
    s_red[warp][g + 8][col] = acc[j][2];
    s_red[warp][g + 8][col + 1] = acc[j][3];
  }
  __syncthreads();
  for (int o = threadIdx.x; o < kSkinnyMaxRows * kColsPerCta; o += kWarps * 32) {
    const int row = o / kColsPerCta;
    const int col = n0 + o % kColsPerCta;
    if (row >= p.rows || col >= p.n) continue;
    float sum = s_red[0][row][o % kColsPerCta];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) sum = __fadd_rn(sum, s_red[w][row][o % kColsPerCta]);
    if (p.scale != nullptr) sum = __fmul_rn(sum, p.scale[col]);
    if (p.out_f32) {
      static_cast<float*>(p.out)[static_cast<int64_t>(row) * p.out_stride + col] = sum;
    } else {
      static_cast<uint16_t*>(p.out)[static_cast<int64_t>(row) * p.out_stride + col] =
          float_to_bf16(sum);
    }
  }
}

// Grid: ceil(n / 16) CTAs of 4 warps, one tile each. kRing: gemm_tile's ring loop (128-byte
// chunks: bf16, or fp8 with kSub 2). Three 128-byte chunks (six 64-byte ones for fp8 of kSub 1)
// per warp in flight.
template <bool kFp8, bool kRing, int kSub>
__global__ void __launch_bounds__(kGemmThreads, kGemmMinCtasPerSm)
    skinny_gemm_kernel(const __grid_constant__ SkinnyGemmParams p) {
  static_assert(!kRing || !kFp8 || kSub == 2, "the ring needs 128-byte chunks");
  __shared__ float s_red[kGemmWarps][kSkinnyMaxRows][kColsPerCta + 1];
  gemm_tile<kFp8, (kFp8 && kSub == 1) ? 6 : 3, kRing, kGemmWarps, kSub>(p, blockIdx.x * kColsPerCta,
                                                                        s_red);
}

// SkinnyGemmParams::split_k8: 8 warps over K per tile (another reduction order than 4), 3 CTAs
// per SM (<= 85 registers: groups of two bf16 / four fp8 chunks); with deep, the deep variant's
// groups at one CTA per SM (the same bits as without deep).
template <bool kFp8>
__global__ void __launch_bounds__(2 * kGemmThreads, 3)
    skinny_gemm_k8_kernel(const __grid_constant__ SkinnyGemmParams p) {
  __shared__ float s_red[2 * kGemmWarps][kSkinnyMaxRows][kColsPerCta + 1];
  gemm_tile<kFp8, kFp8 ? 4 : 2, false, 2 * kGemmWarps>(p, blockIdx.x * kColsPerCta, s_red);
}

template <bool kFp8>
__global__ void __launch_bounds__(2 * kGemmThreads, 1)
    skinny_gemm_k8_deep_kernel(const __grid_constant__ SkinnyGemmParams p) {
  __shared__ float s_red[2 * kGemmWarps][kSkinnyMaxRows][kColsPerCta + 1];
  gemm_tile<kFp8, kFp8 ? 16 : 12, false, 2 * kGemmWarps>(p, blockIdx.x * kColsPerCta, s_red);
}

// SkinnyGemmParams::deep: the same grid and bits, 4x (bf16) / 2.7x (fp8) the weight chunks in
// flight per warp (up to 255 registers): for narrow outputs, whose few CTAs would otherwise wait
// on latency.
template <bool kFp8, int kSub>
__global__ void __launch_bounds__(kGemmThreads, 1)
    skinny_gemm_deep_kernel(const __grid_constant__ SkinnyGemmParams p) {
  __shared__ float s_red[kGemmWarps][kSkinnyMaxRows][kColsPerCta + 1];
  gemm_tile<kFp8, kFp8 ? 16 / kSub : 12, false, kGemmWarps, kSub>(p, blockIdx.x * kColsPerCta,
                                                                  s_red);
}

// ---- SwiGLU-OAI and conversion ----

__global__ void swiglu_kernel(const __grid_constant__ SwigluParams p) {
  const int64_t total = static_cast<int64_t>(p.rows) * p.inter;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / p.inter;
    const int64_t j = i % p.inter;
    const uint16_t* gu = p.gate_up + row * 2 * p.inter;
    float gate = bf16_to_float(gu[j]);
    float up = bf16_to_float(gu[p.inter + j]);
    // Comparisons (not fminf / fmaxf) so a NaN stays NaN, as in the CPU runtime.
    gate = gate > p.limit ? p.limit : gate;
    up = up > p.limit ? p.limit : (up < -p.limit ? -p.limit : up);
    const float glu = __fdiv_rn(gate, __fadd_rn(1.0f, expf(__fmul_rn(-1.702f, gate))));
    p.act[i] = float_to_bf16(__fmul_rn(glu, __fadd_rn(up, 1.0f)));
  }
}

__global__ void f32_to_bf16_kernel(const float* in, uint16_t* out, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = float_to_bf16(in[i]);
  }
}

bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

}  // namespace rk

void launch_add_rmsnorm(const AddNormParams& p, cudaStream_t stream) {
  M3MSA_CHECK_ARG(p.rows >= 0, "add_rmsnorm: rows must be >= 0, got ", p.rows);
  M3MSA_CHECK_SUPPORTED(p.n > 0 && p.n % 8 == 0,
                        "add_rmsnorm: the width must be a positive "
                        "multiple of 8, got ",
                        p.n);
  M3MSA_CHECK_ARG(p.delta && p.residual && p.weight && p.out, "add_rmsnorm: null pointer");
  M3MSA_CHECK_ARG(rk::aligned16(p.delta) && rk::aligned16(p.residual) && rk::aligned16(p.weight) &&
                      rk::aligned16(p.out),
                  "add_rmsnorm: every tensor must be 16-byte aligned");
  if (p.rows == 0) return;
  // One pass with the row in registers up to 4 chunks of 8 per thread (hidden <= 32768); the loop
  // beyond. Threads: enough warps for the chunks of one pass, at most 1024.
  const int vectors = p.n / 8;
  const int chunks = (vectors + rk::kNormMaxThreads - 1) / rk::kNormMaxThreads;
  const int threads = ((vectors + chunks - 1) / chunks + 31) / 32 * 32;
  switch (chunks) {
    case 1: rk::add_rmsnorm_regs_kernel<1><<<p.rows, threads, 0, stream>>>(p); break;
    case 2: rk::add_rmsnorm_regs_kernel<2><<<p.rows, threads, 0, stream>>>(p); break;
    case 3:
    case 4: rk::add_rmsnorm_regs_kernel<4><<<p.rows, threads, 0, stream>>>(p); break;
    default: rk::add_rmsnorm_kernel<<<p.rows, rk::kNormThreads, 0, stream>>>(p); break;
  }
  CUDA_CHECK_LAUNCH();
}

int skinny_gemm_ctas(int n) {
  return (n + rk::kColsPerCta - 1) / rk::kColsPerCta;
}

namespace {
// The current device's SM count, queried once per device (launches call this on every step).
int current_device_sms() {
  static std::array<std::atomic<int>, 64> cached{};
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  M3MSA_CHECK_INTERNAL(device >= 0 && device < 64, "skinny GEMM: device ", device);
  int sms = cached[static_cast<std::size_t>(device)].load(std::memory_order_relaxed);
  if (sms == 0) {
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    cached[static_cast<std::size_t>(device)].store(sms, std::memory_order_relaxed);
  }
  return sms;
}
}  // namespace

bool skinny_gemm_prefers_split_k8(int n) {
  return skinny_gemm_ctas(n) < 4 * current_device_sms();
}

void launch_skinny_gemm(const SkinnyGemmParams& p, cudaStream_t stream) {
  M3MSA_CHECK_SUPPORTED(p.rows >= 0 && p.rows <= kSkinnyMaxRows,
                        "skinny GEMM: rows must be in [0, ", kSkinnyMaxRows, "], got ", p.rows);
  M3MSA_CHECK_SUPPORTED(p.k > 0 && p.k % kSkinnyKAlign == 0,
                        "skinny GEMM: the input width must be a positive multiple of ",
                        kSkinnyKAlign, ", got ", p.k);
  M3MSA_CHECK_ARG(p.n > 0, "skinny GEMM: the output width must be > 0, got ", p.n);
  M3MSA_CHECK_ARG(p.x && p.w && p.out, "skinny GEMM: null pointer");
  M3MSA_CHECK_ARG(rk::aligned16(p.x) && rk::aligned16(p.w) && p.x_stride % 8 == 0,
                  "skinny GEMM: x rows and the weight must be 16-byte aligned (x stride ",
                  p.x_stride, ")");
  M3MSA_CHECK_ARG(p.x_stride >= p.k && p.out_stride >= p.n, "skinny GEMM: strides (x ", p.x_stride,
                  ", out ", p.out_stride, ") below the widths (", p.k, ", ", p.n, ")");
  if (p.rows == 0) return;
  const int tiles = skinny_gemm_ctas(p.n);
  // The ring (bf16) when the grid puts >= 4 CTAs on every SM: M3's TP = 1 q/k/v projection (616
  // CTAs) measured 9-15 % faster; o_proj's 384 CTAs were up to 9 % slower with it (a group puts
  // three chunks in flight per warp at its start, the ring two). Every loop gives the same bits.
  // fp8 weights of a 4-warp projection (no split_k8) are read in 128-byte chunks (two 64-k
  // sub-chunks), as bf16's: the same bytes per load and slot, so the fp8 projection can take the
  // ring too. Another k order than 64-byte chunks: it follows from split_k8 and k alone, so every
  // launch of one projection makes the same choice.
  const bool wide_fp8 = p.w_fp8 && !p.split_k8 && p.k % (2 * rk::kChunk) == 0;
  // At one token row the fp8 ring measured slower than the group loop (M3's q/k/v: 25.4 us
  // against 23.7 for the 128-byte group, 24.1 for the 64-byte one): fp8 takes it from 2 rows.
  // Ring and group give the same bits, so choosing by rows keeps a row's result independent of
  // its batch.
  const bool ring =
      (!p.w_fp8 || wide_fp8) && !p.deep &&
      (p.force_ring || (tiles >= 4 * current_device_sms() && (!p.w_fp8 || p.rows >= 2)));
  if (p.split_k8) {
    auto* kernel =
        p.deep ? (p.w_fp8 ? rk::skinny_gemm_k8_deep_kernel<true>
                          : rk::skinny_gemm_k8_deep_kernel<false>)
               : (p.w_fp8 ? rk::skinny_gemm_k8_kernel<true> : rk::skinny_gemm_k8_kernel<false>);
    kernel<<<tiles, 2 * rk::kGemmThreads, 0, stream>>>(p);
    CUDA_CHECK_LAUNCH();
    return;
  }
  auto* kernel =
      p.deep     ? (!p.w_fp8   ? rk::skinny_gemm_deep_kernel<false, 1>
                    : wide_fp8 ? rk::skinny_gemm_deep_kernel<true, 2>
                               : rk::skinny_gemm_deep_kernel<true, 1>)
      : !p.w_fp8 ? (ring ? rk::skinny_gemm_kernel<false, true, 1>
                         : rk::skinny_gemm_kernel<false, false, 1>)
      : wide_fp8
          ? (ring ? rk::skinny_gemm_kernel<true, true, 2> : rk::skinny_gemm_kernel<true, false, 2>)
          : rk::skinny_gemm_kernel<true, false, 1>;
  kernel<<<tiles, rk::kGemmThreads, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

void launch_swiglu(const SwigluParams& p, cudaStream_t stream) {
  M3MSA_CHECK_ARG(p.rows >= 0 && p.inter > 0, "swiglu: rows ", p.rows, ", width ", p.inter);
  M3MSA_CHECK_ARG(p.gate_up && p.act, "swiglu: null pointer");
  const int64_t total = static_cast<int64_t>(p.rows) * p.inter;
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, 1024);
  rk::swiglu_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

void launch_f32_to_bf16(const float* in, uint16_t* out, int64_t count, cudaStream_t stream) {
  M3MSA_CHECK_ARG(count >= 0, "f32_to_bf16: count ", count);
  if (count == 0) return;
  M3MSA_CHECK_ARG(in && out, "f32_to_bf16: null pointer");
  const int64_t blocks = std::min<int64_t>((count + 255) / 256, 1024);
  rk::f32_to_bf16_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(in, out, count);
  CUDA_CHECK_LAUNCH();
}

}  // namespace m3msa::cuda
