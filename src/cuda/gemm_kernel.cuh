// Skinny projection GEMM of the decode runtime: out[r, n] = sum_k x[r, k] * w[n, k] (* scale[n])
// for at most 16 token rows (gemm.h has the host contract). Framework-free: raw pointers and
// GemmSkinnyParams; launched by gemm.cu.
//
// Decode projections have at most 16 token rows: one m16 tile of the tensor-core MMA (mma.sync
// m16n8k16 bf16, fp32 accumulation) covers them all, so the kernel streams every weight byte
// exactly once. Each warp owns 16 output columns (two n8 tiles) and a slice of K; a CTA is 4 (or,
// split_k8, 8) warps over the same 16 columns, reduced in a fixed order through shared memory.
// Weight rows are read with 16-byte streaming loads; because a dot product may visit k in any
// order, each thread's 16 contiguous k values are mapped onto its fragment positions (the
// activations use the same mapping), so no shuffles are needed. fp8 e4m3 weights are converted
// exactly to bf16 in registers (an e4m3 NaN makes its output column NaN). The loops (register
// ring, groups, deep) only change how many chunks are in flight, never the order of a column's
// sum, so they give the same bits; the warps per tile (split_k8) and the chunk width do change it.
// Requirements: 1 <= rows <= 16, k % 64 == 0, 16-byte aligned x rows and weight base.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bulk_copy.cuh"
#include "cuda/gemm_params.h"
#include "m3msa/dtype.h"

namespace m3msa::cuda::gemm {

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
// `mult` (bf16x2, both halves): 2^120, or 2^120 times an MXFP8 block scale (mx_fold_multiplier),
// which restores and scales in the one multiply, rounded once as the two in turn would round.
inline constexpr uint32_t kTwoPow120x2 = 0x7B807B80u;  // bf16x2
__device__ __forceinline__ void fp8x4_to_bf16x4(uint32_t four, uint32_t& lo, uint32_t& hi,
                                                uint32_t& nan_bits, uint32_t mult = kTwoPow120x2) {
  const uint32_t mag = four & 0x7F7F7F7Fu;
  nan_bits |= mag + 0x01010101u;  // only a 0x7F magnitude carries into bit 7 (masked later)
  // byte << 8 per 16-bit half, and the magnitude per half: 16 m + s << 15 = (b << 8) - 240 m.
  const uint32_t b_lo = __byte_perm(four, 0, 0x1404), b_hi = __byte_perm(four, 0, 0x3424);
  const uint32_t m_lo = __byte_perm(mag, 0, 0x4140), m_hi = __byte_perm(mag, 0, 0x4342);
  const uint32_t scaled_lo = b_lo - 240u * m_lo, scaled_hi = b_hi - 240u * m_hi;
  constexpr uint32_t kMinusZero = 0x80008000u;  // bf16x2
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(lo) : "r"(scaled_lo), "r"(mult), "r"(kMinusZero));
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(hi) : "r"(scaled_hi), "r"(mult), "r"(kMinusZero));
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
// kFresh: x was written earlier in the same launch (the persistent moe kernel), so it is read
// through L2 (ld.global.cg), not the read-only path, which may only serve data the launch never
// writes.
// kSharedX: the row is in shared memory (a CTA that staged its activations there).
template <bool kFp8, bool kFresh = false, bool kSharedX = false>
__device__ __forceinline__ void load_x(const uint16_t* row_chunk, int t, uint32_t (&a)[8]) {
  const auto load = [](const uint16_t* p) {
    if constexpr (kSharedX) {
      uint4 v;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                   : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))));
      return v;
    } else if constexpr (kFresh) {
      return __ldcg(reinterpret_cast<const uint4*>(p));
    } else {
      return __ldg(reinterpret_cast<const uint4*>(p));
    }
  };
  const uint4 lo = load(row_chunk + (kFp8 ? t * 16 : t * 8));
  const uint4 hi = load(row_chunk + (kFp8 ? t * 16 + 8 : 32 + t * 8));
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
// `mult`: fp8x4_to_bf16x4's multiplier.
template <bool kFp8>
__device__ __forceinline__ void weight_words(const WeightRegs<kFp8>& w, uint32_t (&b)[8],
                                             uint32_t& nan_bits, uint32_t mult = kTwoPow120x2) {
  if constexpr (kFp8) {
    const uint32_t bytes[4] = {w.v[0].x, w.v[0].y, w.v[0].z, w.v[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      fp8x4_to_bf16x4(bytes[i], b[2 * i], b[2 * i + 1], nan_bits, mult);
    }
  } else {
    b[0] = w.v[0].x, b[1] = w.v[0].y, b[2] = w.v[0].z, b[3] = w.v[0].w;
    b[4] = w.v[1].x, b[5] = w.v[1].y, b[6] = w.v[1].z, b[7] = w.v[1].w;
  }
}

// An MXFP8 e8m0 scale code as a bf16x2 multiplier (both halves): 2^(code - 127) is a bf16 power
// of two (code 0: the subnormal 2^-127), code 255 NaN; the same values as e8m0_to_float.
__device__ __forceinline__ uint32_t e8m0_to_bf16x2(uint32_t code) {
  const uint32_t half = code == 0xFFu ? 0x7FC0u : (code == 0u ? 0x0040u : code << 7);
  return half | (half << 16);
}

// Codes whose 2^120 x 2^(code - 127) = 2^(code - 7) is a normal bf16: their scale folds into the
// widening's multiply (fp8x4_to_bf16x4). Larger codes (and 255, NaN) take the multiply apart.
inline constexpr uint32_t kMxFoldMaxCode = 134;
__device__ __forceinline__ uint32_t mx_fold_multiplier(uint32_t code) {
  const uint32_t half = (code + 120u) << 7;  // exponent field code - 7 + 127
  return half | (half << 16);
}

// w * scale for a bf16x2 pair of weights: exact (a power of two), except where the product leaves
// the bf16 normal range.
__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t w, uint32_t scale) {
  uint32_t out;
  constexpr uint32_t kMinusZero = 0x80008000u;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(out) : "r"(w), "r"(scale), "r"(kMinusZero));
  return out;
}

// kSub consecutive 64-k sub-chunks of the tile's two weight rows: one slot of tile_accumulate's
// loops; kMx: each row's MXFP8 block-scale multiplier for this lane's 16 k of each sub-chunk
// (mma_chunk's kFoldScale: its e8m0 code).
template <bool kFp8, int kSub, bool kMx = false>
struct ChunkRegs {
  WeightRegs<kFp8> w[kSub][2];
  uint32_t scale[kMx ? kSub : 1][2];

  // Sub-chunk u of row j read as zeros (an absent n8 tile, or past the tile's k).
  __device__ __forceinline__ void clear(int u, int j) {
#pragma unroll
    for (int i = 0; i < (kFp8 ? 1 : 2); ++i) w[u][j].v[i] = make_uint4(0, 0, 0, 0);
    if constexpr (kMx) scale[u][j] = 0u;
  }
};

// One 16-column tile's operands as one lane sees them: the activation rows g and g + 8 of A and
// the weight rows of column g of each n8 tile of B (null: absent, read as zeros), and with MXFP8
// weights (kMx) those rows' e8m0 scale codes (one per 32 k).
struct TileOperands {
  const uint16_t* x_lo = nullptr;
  const uint16_t* x_hi = nullptr;
  const uint8_t* w_row[2] = {nullptr, nullptr};
  const uint8_t* scale_row[2] = {nullptr, nullptr};
  int chunks = 0;  // k / (64 * kSub)
};

// One chunk of a tile's two weight rows as this lane loads it (kSub 64-k sub-chunks from k0;
// ok false: zeros, an absent row or a chunk past the end), with the MXFP8 block-scale multipliers
// (kMx).
template <bool kFp8, int kSub, bool kMx>
__device__ __forceinline__ void load_chunk_rows(const uint8_t* const (&w_row)[2],
                                                const uint8_t* const (&scale_row)[2],
                                                const bool (&ok)[2], int64_t k0, int t,
                                                ChunkRegs<kFp8, kSub, kMx>& slot) {
  constexpr int kElem = kFp8 ? 1 : 2;
#pragma unroll
  for (int u = 0; u < kSub; ++u) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int64_t k = k0 + u * kChunk;
      if (ok[j]) {
        load_w<kFp8>(w_row[j] + k * kElem, t, slot.w[u][j]);
        if constexpr (kMx)
          slot.scale[u][j] = e8m0_to_bf16x2(__ldg(scale_row[j] + (k + t * 16) / 32));
      } else {
        slot.clear(u, j);
      }
    }
  }
}

// The MMAs of one loaded chunk (k0 as it was loaded) into the two n8 tiles' accumulators; kFresh
// as for load_x. kFoldScale (kMx): slot.scale holds e8m0 codes, and each block scale is folded
// into the widening's multiply (one rounding either way, so the same bits) instead of a multiply
// per weight pair; for the streamed tile, whose registers allow the code it takes (the register
// rings' kernels measured 140 -> 170-180 registers with it). kSharedX: x_lo / x_hi point into
// shared memory (load_x).
template <bool kFp8, int kSub, bool kMx, bool kFresh = false, bool kFoldScale = false,
          bool kSharedX = false>
__device__ __forceinline__ void mma_chunk(const uint16_t* x_lo, const uint16_t* x_hi, int64_t k0,
                                          int t, const ChunkRegs<kFp8, kSub, kMx>& slot,
                                          float (&acc)[2][4], uint32_t (&nan_bits)[2]) {
#pragma unroll
  for (int u = 0; u < kSub; ++u) {
    const int64_t k = k0 + u * kChunk;
    uint32_t a_lo[8] = {}, a_hi[8] = {};
    if (x_lo != nullptr) load_x<kFp8, kFresh, kSharedX>(x_lo + k, t, a_lo);
    if (x_hi != nullptr) load_x<kFp8, kFresh, kSharedX>(x_hi + k, t, a_hi);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      uint32_t b[8];
      if constexpr (kMx && kFoldScale) {
        // A warp with a code above kMxFoldMaxCode (never in practice) multiplies apart.
        const uint32_t code = slot.scale[u][j];
        if (!__any_sync(0xFFFFFFFFu, code > kMxFoldMaxCode)) {
          weight_words<kFp8>(slot.w[u][j], b, nan_bits[j], mx_fold_multiplier(code));
        } else {
          weight_words<kFp8>(slot.w[u][j], b, nan_bits[j]);
          const uint32_t scale = e8m0_to_bf16x2(code);
#pragma unroll
          for (int i = 0; i < 8; ++i) b[i] = scale_bf16x2(b[i], scale);
        }
      } else {
        weight_words<kFp8>(slot.w[u][j], b, nan_bits[j]);
        if constexpr (kMx) {
#pragma unroll
          for (int i = 0; i < 8; ++i) b[i] = scale_bf16x2(b[i], slot.scale[u][j]);
        }
      }
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        mma_bf16_16x8x16(acc[j], a_lo[2 * s], a_hi[2 * s], a_lo[2 * s + 1], a_hi[2 * s + 1],
                         b[2 * s], b[2 * s + 1]);
      }
    }
  }
}

// A warp's sums of one 16-column tile into its s_red slice (warp-uniform call). fp8: a NaN weight
// makes its column NaN whatever x is (as NaN * x would).
template <bool kFp8>
__device__ __forceinline__ void store_warp_sums(
    float (&acc)[2][4], const uint32_t (&nan_bits)[2],
    float (&s_red_warp)[kSkinnyMaxRows][kColsPerCta + 1]) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  if constexpr (kFp8) {
    // Lanes 4c .. 4c + 3 loaded column c of tile j; this lane holds the sums of columns 2t and
    // 2t + 1.
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
    s_red_warp[g][col] = acc[j][0];
    s_red_warp[g][col + 1] = acc[j][1];
    s_red_warp[g + 8][col] = acc[j][2];
    s_red_warp[g + 8][col + 1] = acc[j][3];
  }
}

// The sums of one 16-column tile: K is cut into chunks of kSub x 64 (kSub 2: fp8 weights read 128
// bytes per row per chunk, as bf16's 64-k chunks are). Warp w of kWarps handles the chunks c = w,
// w + kWarps, ... of K for the tile's 16 columns, kUnroll chunks in flight (a group loaded before
// any is used, or a ring: kRing). Lanes: g = lane / 4 is the MMA group (rows g and g + 8 of A,
// column g of each n8 tile of B), t = lane % 4 picks the k slice (see load_x). A warp accumulates
// its chunks in increasing order (their sub-chunks too) whatever kUnroll and kRing are, so they
// give the same bits; kWarps and kSub change the order. kMx (fp8 only): every weight is multiplied
// by its MXFP8 block scale in registers before the MMA (a lane's 16 k of a sub-chunk lie in one
// 32-k block). Leaves warp w's sums in s_red[w][row][col], the block synchronized.
template <bool kFp8, int kUnroll, bool kRing, int kWarps, int kSub = 1, bool kMx = false>
__device__ __forceinline__ void tile_accumulate(
    const TileOperands& op, float (&s_red)[kWarps][kSkinnyMaxRows][kColsPerCta + 1]) {
  static_assert(!kMx || kFp8, "block scales are for fp8 weights");
  constexpr int kChunkK = kChunk * kSub;
  const int warp = threadIdx.x >> 5;
  const int t = threadIdx.x & 3;
  const int chunks = op.chunks;
  const bool lo_ok = op.x_lo != nullptr;
  const bool hi_ok = op.x_hi != nullptr;
  const uint16_t* x_lo = op.x_lo;
  const uint16_t* x_hi = op.x_hi;
  const uint8_t* w_row[2] = {op.w_row[0], op.w_row[1]};
  const bool col_ok[2] = {op.w_row[0] != nullptr, op.w_row[1] != nullptr};
  constexpr int kElem = kFp8 ? 1 : 2;

  using Slot = ChunkRegs<kFp8, kSub, kMx>;
  // The loads stay written out here rather than through load_chunk_rows: that helper moved the
  // skinny GEMM's register allocation (ptxas: the fp8 kernel's spill 8 -> 24 bytes).
  const auto load_chunk = [&](int c, Slot& slot) {
#pragma unroll
    for (int u = 0; u < kSub; ++u) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int64_t k0 = static_cast<int64_t>(c) * kChunkK + u * kChunk;
        if (c < chunks && col_ok[j]) {
          load_w<kFp8>(w_row[j] + k0 * kElem, t, slot.w[u][j]);
          if constexpr (kMx) {
            slot.scale[u][j] = e8m0_to_bf16x2(__ldg(op.scale_row[j] + (k0 + t * 16) / 32));
          }
        } else {
          slot.clear(u, j);
        }
      }
    }
  };
  float acc[2][4] = {};
  uint32_t nan_bits[2] = {0u, 0u};
  const auto compute_chunk = [&](int c, const Slot& slot) {
    mma_chunk<kFp8, kSub, kMx>(lo_ok ? x_lo : nullptr, hi_ok ? x_hi : nullptr,
                               static_cast<int64_t>(c) * kChunkK, t, slot, acc, nan_bits);
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

  store_warp_sums<kFp8>(acc, nan_bits, s_red[warp]);
  __syncthreads();
}

// kTiles consecutive 16-column tiles of one CTA, each summed exactly as tile_accumulate sums it
// (kSub 1: warp w takes the chunks w, w + kWarps, ... of every tile in increasing order, from
// zero), so every tile gets tile_accumulate's bits; but the weight loads are one register ring over
// the warp's chunks of all the tiles, kUnroll chunks in flight across the tile boundaries. For
// short K (a few chunks per warp) a CTA per tile pays a whole round trip per tile with the loads
// idle before and after it; here only the first chunks wait. Tile i's weight rows are op.w_row
// advanced by i * row_stride bytes (its scale rows by i * scale_stride): the caller passes the
// first tile's rows, all tiles present. kFresh: x was written earlier in the same launch (load_x).
// Leaves warp w's sums of tile i in s_red[i][w][row][col], the block synchronized.
template <bool kFp8, int kUnroll, int kWarps, int kTiles, bool kMx = false, bool kFresh = false>
__device__ __forceinline__ void tiles_accumulate(
    const TileOperands& op, int64_t row_stride, int64_t scale_stride,
    float (&s_red)[kTiles][kWarps][kSkinnyMaxRows][kColsPerCta + 1]) {
  static_assert(!kMx || kFp8, "block scales are for fp8 weights");
  const int warp = threadIdx.x >> 5;
  const int t = threadIdx.x & 3;
  const int chunks = op.chunks;
  const bool col_ok[2] = {op.w_row[0] != nullptr, op.w_row[1] != nullptr};
  // This warp's chunks per tile; its stream runs over (tile, i), chunk warp + i * kWarps of the
  // tile, tile by tile. Loads run kUnroll positions ahead of the MMAs, each side with its own
  // position (no divisions in the loop).
  const int per_tile = warp < chunks ? (chunks - warp + kWarps - 1) / kWarps : 0;
  const int total = kTiles * per_tile;

  using Slot = ChunkRegs<kFp8, 1, kMx>;
  int load_tile = 0, load_i = 0;
  const auto load_next = [&](Slot& slot) {
    const bool live = load_tile < kTiles && per_tile > 0;
    const bool ok[2] = {live && col_ok[0], live && col_ok[1]};
    const uint8_t* rows[2] = {nullptr, nullptr};
    const uint8_t* scales[2] = {nullptr, nullptr};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (!ok[j]) continue;
      rows[j] = op.w_row[j] + load_tile * row_stride;
      if constexpr (kMx) scales[j] = op.scale_row[j] + load_tile * scale_stride;
    }
    load_chunk_rows<kFp8, 1, kMx>(rows, scales, ok,
                                  static_cast<int64_t>(warp + load_i * kWarps) * kChunk, t, slot);
    if (++load_i == per_tile) load_i = 0, ++load_tile;
  };
  float acc[2][4] = {};
  uint32_t nan_bits[2] = {0u, 0u};
  if (total == 0) {  // a warp without chunks still posts its (zero) sums for every tile
#pragma unroll
    for (int i = 0; i < kTiles; ++i) store_warp_sums<kFp8>(acc, nan_bits, s_red[i][warp]);
  }
  Slot w[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) load_next(w[u]);
  int tile = 0, i = 0;
  for (int first = 0; first < total; first += kUnroll) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (first + u >= total) break;  // warp-uniform
      mma_chunk<kFp8, 1, kMx, kFresh>(op.x_lo, op.x_hi,
                                      static_cast<int64_t>(warp + i * kWarps) * kChunk, t, w[u],
                                      acc, nan_bits);
      load_next(w[u]);
      if (++i == per_tile) {  // the tile's last chunk: post its sums, start the next from zero
        store_warp_sums<kFp8>(acc, nan_bits, s_red[tile][warp]);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          nan_bits[j] = 0u;
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
        }
        i = 0;
        ++tile;
      }
    }
  }
  __syncthreads();
}

// ---- the streamed tile: the weights through a shared-memory ring ----
// tile_accumulate keeps a warp's weight chunks in flight in registers: ~140 registers, so 3 CTAs
// of 4 warps per SM, too few warps for the MXFP8 loop's issue rate (ncu: 0.4-0.5 instructions
// issued per scheduler cycle, the warps waiting on their loads). Here the bulk-copy engine streams
// the tile's 16 weight rows through a ring of up to kStreamSlots stages in dynamic shared memory
// (one copy per row and stage, issued by thread 0): ~70 registers, up to kStreamSlots x 16 KB in
// flight per CTA, and the CTAs per SM that shared memory allows; the warps read each chunk from
// shared memory into the registers tile_accumulate loads it into. Warp w still takes the 64-k
// chunks w, w + kWarps, ... in increasing order (a stage holds a multiple of kWarps chunks), so
// the sums are tile_accumulate's (kSub 1) bits.
inline constexpr int kStreamStageBytes = 1024;  // bytes of each weight row per stage
inline constexpr int kMxBlock = 32;             // MXFP8: one e8m0 scale per 32 k
// Row pitch in the ring: 16 bytes of padding put the 8 rows a warp reads at once (lanes g, 16-byte
// reads at t * 16) in distinct 16-byte bank groups, so the reads are conflict-free.
inline constexpr int kStreamRowPitch = kStreamStageBytes + 16;
// Two slots: measured against 1, 3 and 4 on the MoE's MXFP8 experts, the best or within 2 % at
// 1-16 tokens (one slot: 7-9 % faster at 4-16 tokens, 4-6 % slower at one; more slots take the
// shared memory of more CTAs, whose warps the issue-bound loop needs more).
inline constexpr int kStreamSlots = 2;
inline constexpr int kStreamBarrierBytes = 64;  // the slots' barriers, at the start
inline constexpr int kStreamSlotBytes = kColsPerCta * kStreamRowPitch;

// One streamed tile's operands: the activations as in TileOperands (this lane's rows g, g + 8),
// the first of the 8 consecutive weight rows of each n8 tile (null: absent, read as zeros) and,
// for MXFP8 (kMx), the first of their 8 consecutive scale rows (k / 32 bytes each). Requires
// k % 64 == 0 and 16-byte aligned weight and scale rows (every row then is: k / 4 scale bytes per
// 8 rows).
struct StreamOperands {
  const uint16_t* x_lo = nullptr;
  const uint16_t* x_hi = nullptr;
  const uint8_t* w_first[2] = {nullptr, nullptr};
  const uint8_t* scale_first[2] = {nullptr, nullptr};
  int k = 0;
  // kSharedX: x_lo / x_hi point into shared memory, filled by bulk copies that complete on this
  // barrier (phase 0), waited once before the first stage's chunks: the caller inits it before
  // the call (the call's first __syncthreads orders that before every wait) and stages x only
  // for a tile with weight rows, so the wait (inside the stage loop) always runs.
  uint64_t* x_ready = nullptr;
};

// Stages of k per weight row, and the dynamic shared memory a streamed tile of that k takes: the
// barriers, min(stages, kStreamSlots) ring slots, then the tile's MXFP8 scales (16 x k / 32).
__host__ __device__ constexpr int stream_stages(int k, bool fp8) {
  return (k * (fp8 ? 1 : 2) + kStreamStageBytes - 1) / kStreamStageBytes;
}
__host__ __device__ constexpr int stream_slots(int k, bool fp8) {
  return stream_stages(k, fp8) < kStreamSlots ? stream_stages(k, fp8) : kStreamSlots;
}
__host__ __device__ constexpr int stream_smem_bytes(int k, bool fp8, bool mx) {
  return kStreamBarrierBytes + stream_slots(k, fp8) * kStreamSlotBytes +
         (mx ? kColsPerCta * (k / kMxBlock) : 0);
}

// One chunk of a tile's two weight rows as this lane reads it from a streamed ring stage: rows
// j * 8 + g at kStreamRowPitch, kSub 64-k sub-chunks from kk (the stage's k), and with MXFP8 (kMx)
// their e8m0 codes from `scales` ([16][scale_row_bytes], k counted from scale_k0 + kk); present[j]
// false: zeros (an absent n8 tile).
template <bool kFp8, int kSub, bool kMx>
__device__ __forceinline__ void read_stage_chunk(const uint8_t* stage, const uint8_t* scales,
                                                 int scale_row_bytes, int scale_k0, int kk,
                                                 const bool (&present)[2], int g, int t,
                                                 ChunkRegs<kFp8, kSub, kMx>& regs) {
  constexpr int kElem = kFp8 ? 1 : 2;
#pragma unroll
  for (int u = 0; u < kSub; ++u) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = j * 8 + g;
      const int k = kk + u * kChunk;
      const uint8_t* src = stage + row * kStreamRowPitch + k * kElem + t * 16;
      if (present[j]) {
        regs.w[u][j].v[0] = *reinterpret_cast<const uint4*>(src);
        if constexpr (!kFp8) regs.w[u][j].v[1] = *reinterpret_cast<const uint4*>(src + 64);
        if constexpr (kMx) {
          regs.scale[u][j] = scales[row * scale_row_bytes + (scale_k0 + k + t * 16) / kMxBlock];
        }
      } else {
        regs.clear(u, j);
      }
    }
  }
}

// The sums of one 16-column tile streamed through `smem` (stream_smem_bytes(op.k, kFp8, kMx)
// bytes of dynamic shared memory, 128-byte aligned); every thread of the CTA calls it. Leaves warp
// w's sums in s_red[w][row][col], the block synchronized; kFresh as for load_x. kSub: a warp's
// step is kSub consecutive 64-k sub-chunks, as tile_accumulate's (its bits for the same kSub;
// op.k a multiple of 64 x kSub). kSharedX: the activations are in shared memory (op.x_ready).
template <bool kFp8, int kWarps, bool kMx = false, bool kFresh = false, int kSub = 1,
          bool kSharedX = false>
__device__ __forceinline__ void tile_accumulate_streamed(
    const StreamOperands& op, uint8_t* smem,
    float (&s_red)[kWarps][kSkinnyMaxRows][kColsPerCta + 1]) {
  static_assert(!kMx || kFp8, "block scales are for fp8 weights");
  constexpr int kElem = kFp8 ? 1 : 2;
  constexpr int kStageK = kStreamStageBytes / kElem;
  constexpr int kStepK = kChunk * kSub;
  static_assert((kStageK / kStepK) % kWarps == 0, "a warp's steps keep their order over stages");
  const int k = op.k;
  const int stages = stream_stages(k, kFp8);
  const int slots = stream_slots(k, kFp8);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);
  uint8_t* ring = smem + kStreamBarrierBytes;
  uint8_t* scales = ring + slots * kStreamSlotBytes;  // [16][k / 32]
  const int scale_bytes = k / kMxBlock;               // per row
  const int tid = static_cast<int>(threadIdx.x);
  const bool col_ok[2] = {op.w_first[0] != nullptr, op.w_first[1] != nullptr};
  const int tiles_present = (col_ok[0] ? 1 : 0) + (col_ok[1] ? 1 : 0);
  const int64_t row_bytes = static_cast<int64_t>(k) * kElem;

  // Stage s (thread 0): every present row's k0 .. k0 + stage bytes into slot s % slots; the
  // first stage also brings the scales.
  const auto fill = [&](int s) {
    const int slot = s % slots;
    const int k0 = s * kStageK;
    const uint32_t bytes = static_cast<uint32_t>(min(kStageK, k - k0) * kElem);
    uint32_t tx = tiles_present * 8 * bytes;
    if (kMx && s == 0) tx += tiles_present * 8 * scale_bytes;
    mbar_expect_tx(&full[slot], tx);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (!col_ok[j]) continue;
      if (kMx && s == 0) {
        bulk_copy(scales + j * 8 * scale_bytes, op.scale_first[j], 8 * scale_bytes, &full[slot]);
      }
      for (int r = 0; r < 8; ++r) {
        bulk_copy(ring + slot * kStreamSlotBytes + (j * 8 + r) * kStreamRowPitch,
                  op.w_first[j] + r * row_bytes + static_cast<int64_t>(k0) * kElem, bytes,
                  &full[slot]);
      }
    }
  };
  if (tid == 0) {
    for (int i = 0; i < slots; ++i) mbar_init(&full[i], 1);
    mbar_init_fence();
    if (tiles_present > 0) {
      for (int s = 0; s < slots; ++s) fill(s);
    }
  }
  __syncthreads();  // the barriers' inits before anyone waits on them

  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  float acc[2][4] = {};
  uint32_t nan_bits[2] = {0u, 0u};
  for (int s = 0; s < stages && tiles_present > 0; ++s) {
    const int slot = s % slots;
    mbar_wait(&full[slot], static_cast<uint32_t>(s / slots) & 1u);
    if constexpr (kSharedX) {
      if (s == 0) mbar_wait(op.x_ready, 0u);
    }
    const int k0 = s * kStageK;
    const int steps = min(kStageK, k - k0) / kStepK;
    const uint8_t* stage = ring + slot * kStreamSlotBytes;
    for (int c = warp; c < steps; c += kWarps) {
      ChunkRegs<kFp8, kSub, kMx> regs;
      read_stage_chunk<kFp8, kSub, kMx>(stage, scales, scale_bytes, k0, c * kStepK, col_ok, g, t,
                                        regs);
      mma_chunk<kFp8, kSub, kMx, kFresh, kMx, kSharedX>(
          op.x_lo, op.x_hi, static_cast<int64_t>(k0) + c * kStepK, t, regs, acc, nan_bits);
    }
    __syncthreads();  // the slot's readers are done: it may be filled again
    if (tid == 0 && s + slots < stages) fill(s + slots);
  }
  store_warp_sums<kFp8>(acc, nan_bits, s_red[warp]);
  __syncthreads();
}

// The warps' partial sums of output (row, col) of a tile, added in warp order (warp 0 first): the
// order of every tile's epilogue, so schedules that split k alike give the same bits.
template <int kWarps>
__device__ __forceinline__ float warp_order_sum(
    const float (&s_red)[kWarps][kSkinnyMaxRows][kColsPerCta + 1], int row, int col) {
  float sum = s_red[0][row][col];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) sum = __fadd_rn(sum, s_red[w][row][col]);
  return sum;
}

// One 16-column tile of the projection: out[:, n0 .. n0 + 16), the warps' sums added in warp
// order.
template <bool kFp8, int kUnroll, bool kRing, int kWarps, int kSub = 1>
__device__ __forceinline__ void gemm_tile(const GemmSkinnyParams& p, int n0,
                                          float (&s_red)[kWarps][kSkinnyMaxRows][kColsPerCta + 1]) {
  constexpr int kElem = kFp8 ? 1 : 2;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  TileOperands op;
  op.x_lo = g < p.rows ? p.x + static_cast<int64_t>(g) * p.x_stride : nullptr;
  op.x_hi = g + 8 < p.rows ? p.x + static_cast<int64_t>(g + 8) * p.x_stride : nullptr;
  const uint8_t* w_base = static_cast<const uint8_t*>(p.w);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int col = n0 + j * 8 + g;
    op.w_row[j] = col < p.n ? w_base + static_cast<int64_t>(col) * p.k * kElem : nullptr;
  }
  op.chunks = p.k / (kChunk * kSub);
  tile_accumulate<kFp8, kUnroll, kRing, kWarps, kSub>(op, s_red);
  for (int o = threadIdx.x; o < kSkinnyMaxRows * kColsPerCta; o += kWarps * 32) {
    const int row = o / kColsPerCta;
    const int col = n0 + o % kColsPerCta;
    if (row >= p.rows || col >= p.n) continue;
    float sum = warp_order_sum(s_red, row, o % kColsPerCta);
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
    gemm_skinny_kernel(const __grid_constant__ GemmSkinnyParams p) {
  static_assert(!kRing || !kFp8 || kSub == 2, "the ring needs 128-byte chunks");
  __shared__ float s_red[kGemmWarps][kSkinnyMaxRows][kColsPerCta + 1];
  gemm_tile<kFp8, (kFp8 && kSub == 1) ? 6 : 3, kRing, kGemmWarps, kSub>(p, blockIdx.x * kColsPerCta,
                                                                        s_red);
}

// GemmSkinnyParams::split_k8: 8 warps over K per tile (another reduction order than 4), 3 CTAs
// per SM (<= 85 registers: groups of two bf16 / four fp8 chunks); with deep, the deep variant's
// groups at one CTA per SM (the same bits as without deep).
template <bool kFp8>
__global__ void __launch_bounds__(2 * kGemmThreads, 3)
    gemm_skinny_k8_kernel(const __grid_constant__ GemmSkinnyParams p) {
  __shared__ float s_red[2 * kGemmWarps][kSkinnyMaxRows][kColsPerCta + 1];
  gemm_tile<kFp8, kFp8 ? 4 : 2, false, 2 * kGemmWarps>(p, blockIdx.x * kColsPerCta, s_red);
}

template <bool kFp8>
__global__ void __launch_bounds__(2 * kGemmThreads, 1)
    gemm_skinny_k8_deep_kernel(const __grid_constant__ GemmSkinnyParams p) {
  __shared__ float s_red[2 * kGemmWarps][kSkinnyMaxRows][kColsPerCta + 1];
  gemm_tile<kFp8, kFp8 ? 16 : 12, false, 2 * kGemmWarps>(p, blockIdx.x * kColsPerCta, s_red);
}

// GemmSkinnyParams::deep: the same grid and bits, 4x (bf16) / 2.7x (fp8) the weight chunks in
// flight per warp (up to 255 registers): for narrow outputs, whose few CTAs would otherwise wait
// on latency.
template <bool kFp8, int kSub>
__global__ void __launch_bounds__(kGemmThreads, 1)
    gemm_skinny_deep_kernel(const __grid_constant__ GemmSkinnyParams p) {
  __shared__ float s_red[kGemmWarps][kSkinnyMaxRows][kColsPerCta + 1];
  gemm_tile<kFp8, kFp8 ? 16 / kSub : 12, false, kGemmWarps, kSub>(p, blockIdx.x * kColsPerCta,
                                                                  s_red);
}

}  // namespace m3msa::cuda::gemm
