// Kernels of the moe family: the mixture of experts of one rank for a decode step of at most
// kMoeMaxRows token rows (docs/spec.md section 8). Framework-free: raw pointers and MoeParams;
// launched by moe.cu.
//
//  - moe_route_logits_kernel: one CTA per expert (the router's bytes spread over the GPU: a row
//    of CTAs would leave one SM to stream the whole [E, hidden] fp32 gate); warp w takes 1/4 of K,
//    each gate float4 loaded once for every row, lanes then a butterfly sum, the 4 warps' partials
//    added in warp order; s = sigmoid(logit), key = s + bias, per (row, expert).
//  - moe_route_topk_kernel: one CTA, a warp per row: the top-k keys (NaN last, the lower id on
//    ties) by k warp-wide arg-max rounds; ids and weights routed_scaling * s_i / sum s; then the
//    step's expert slots (MoeParams::slot_*), made once for every expert CTA.
//  - moe_gate_up_kernel: one CTA per (tile of 16 intermediate rows j, expert slot); slot y is the
//    y-th smallest distinct expert the step picked (min(E, rows * k) slots: a slot past the count
//    returns at once), the last slot the shared expert. The CTA reads the slot's rows (made by the
//    top-k kernel; all rows for the shared one); each warp takes
//    rows j of the tile and reads the gate row j and the up row I + j once, for every listed token
//    (x from global memory, L1/L2 resident), accumulating in fp32; then g and u are rounded to
//    bf16 and the SwiGLU-OAI activation is stored as bf16.
//  - moe_down_kernel: the same grid over (tile of 32 hidden rows n, expert slot): y[row, slot, n] =
//    act[row, slot] . w2[e, n] in fp32.
//  - moe_combine_kernel: out[row, n] = sum_i w_i y[row, i, n] + y[row, k, n] in pick order with
//    unfused fp32 operations, the CPU reference's order.
// MXFP8 weights are decoded in registers: code -> fp32 (exact) times 2^(scale - 127) (exact).
// Requirements (checked by the launcher): hidden and I multiples of 8 (16-byte rows), 16-byte
// aligned tensors, rows <= kMoeMaxRows, topk <= kMoeMaxTopk, num_experts <= kMoeMaxExperts.
//
// Tensor-core kernels (MoeParams::tensor_cores, hidden and every intermediate multiples of 64):
// moe_gate_up_mma_kernel and moe_down_mma_kernel replace the two fp32 FMA kernels on the same
// expert-slot grid with the gemm family's 16-column tile (gemm::tile_accumulate): the expert's
// token rows are the m16 side of mma.sync, so each weight byte is read once and multiplies every
// token on the tensor cores (the FMA kernels re-read each token's activations from L1 per weight
// chunk, which caps them at a few tokens per expert). MXFP8 weights: e4m3 -> bf16 exactly on the
// integer pipes, times the block's power-of-two scale in registers. A gate/up CTA takes 8 rows j:
// gate rows as the first n8 tile, the matching up rows as the second, so the activation needs no
// exchange between CTAs. The shared expert's gate/up tiles run in the router's launch
// (moe_route_and_shared_kernel), beside the logits: they need no routing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/gemm_kernel.cuh"
#include "cuda/moe_params.h"
#include "m3msa/dtype.h"
#include "m3msa/moe.h"

namespace m3msa::cuda::moe {

inline constexpr int kThreads = kMoeWarps * 32;
inline constexpr int kGateUpTile = 16;  // intermediate rows j per CTA
inline constexpr int kDownTile = 32;    // hidden rows n per CTA

// Programmatic dependent launch (MoeParams::pdl): every kernel waits for the previous kernel of
// the stream before its first read (a no-op without a programmatic edge) and lets the next one be
// scheduled once its main work is issued; the next one's CTAs then wait on the hardware, not on
// a launch.
__device__ __forceinline__ void wait_previous_kernel() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void release_next_kernel() {
  asm volatile("griddepcontrol.launch_dependents;" :::);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  return v;
}

// Elements [k0, k0 + 8) of row `row` (counted over the whole stack) of a [.., K] weight matrix.
__device__ __forceinline__ void load_weights8(const void* w, const uint8_t* scales, bool fp8,
                                              int64_t row, int K, int k0, float out[8]) {
  if (fp8) {
    const uint2 raw =
        __ldg(reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(w) + row * K + k0));
    const float scale = e8m0_to_float(__ldg(scales + row * (K / kMxfp8Block) + k0 / kMxfp8Block));
    const uint32_t words[2] = {raw.x, raw.y};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      out[i] = fp8e4m3_to_float(static_cast<uint8_t>(words[i / 4] >> (8 * (i % 4)))) * scale;
    }
  } else {
    const uint4 raw =
        __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(w) + row * K + k0));
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      out[i] = bf16_to_float(static_cast<uint16_t>(words[i / 2] >> (16 * (i % 2))));
    }
  }
}

__device__ __forceinline__ void load_bf16x8(const uint16_t* p, float out[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 8; ++i)
    out[i] = bf16_to_float(static_cast<uint16_t>(words[i / 2] >> (16 * (i % 2))));
}

// The SwiGLU-OAI activation of the fp32 gate and up sums, as bf16 bits: g and u rounded to bf16,
// clamped, a = min(g, L) * sigmoid(1.702 min(g, L)) * (clamp(u, -L, L) + 1).
__device__ __forceinline__ uint16_t swiglu_oai(float g_sum, float u_sum, float limit) {
  float g = round_to_bf16(g_sum);
  float u = round_to_bf16(u_sum);
  // Comparisons (not fminf / fmaxf) so a NaN stays NaN, as in the CPU reference.
  g = g > limit ? limit : g;
  u = u > limit ? limit : (u < -limit ? -limit : u);
  const float glu = __fdiv_rn(g, __fadd_rn(1.0f, expf(__fmul_rn(-1.702f, g))));
  return float_to_bf16(__fmul_rn(glu, __fadd_rn(u, 1.0f)));
}

// Larger key first; NaN keys after every number; equal keys: the lower id.
__device__ __forceinline__ bool key_before(float ka, int a, float kb, int b) {
  const bool na = ka != ka;
  const bool nb = kb != kb;
  if (na != nb) return nb;
  if (!na && ka != kb) return ka > kb;
  return a < b;
}

// Warps of a logits CTA: each takes a contiguous 1/kRouteWarps of K.
inline constexpr int kRouteWarps = 4;
inline constexpr int kRouteThreads = kRouteWarps * 32;

// Expert e's logit for every row (a CTA of kRouteThreads): s and key into the workspace.
__device__ __forceinline__ void route_logits(const MoeParams& p, int e,
                                             float (&partial)[kRouteWarps][kMoeMaxRows]) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  // hidden % 8 == 0: whole float4s of the gate row, whole 8-byte pieces of x.
  const int n4 = p.hidden / 4;
  const int per_warp = (n4 + kRouteWarps - 1) / kRouteWarps;
  const int begin = min(n4, warp * per_warp);
  const int end = min(n4, begin + per_warp);
  const float4* g =
      reinterpret_cast<const float4*>(p.router_weight + static_cast<int64_t>(e) * p.hidden);
  float acc[kMoeMaxRows];
#pragma unroll
  for (int r = 0; r < kMoeMaxRows; ++r) acc[r] = 0.0f;
#pragma unroll 4
  for (int i = begin + lane; i < end; i += 32) {
    const float4 w = __ldg(g + i);
#pragma unroll
    for (int r = 0; r < kMoeMaxRows; ++r) {
      if (r < p.rows) {
        const uint2 xr =
            __ldg(reinterpret_cast<const uint2*>(p.x + static_cast<int64_t>(r) * p.hidden) + i);
        acc[r] = fmaf(bf16_to_float(static_cast<uint16_t>(xr.x)), w.x, acc[r]);
        acc[r] = fmaf(bf16_to_float(static_cast<uint16_t>(xr.x >> 16)), w.y, acc[r]);
        acc[r] = fmaf(bf16_to_float(static_cast<uint16_t>(xr.y)), w.z, acc[r]);
        acc[r] = fmaf(bf16_to_float(static_cast<uint16_t>(xr.y >> 16)), w.w, acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kMoeMaxRows; ++r) {
    if (r < p.rows) {
      const float sum = warp_sum(acc[r]);
      if (lane == 0) partial[warp][r] = sum;
    }
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < p.rows) {
    const int r = threadIdx.x;
    float logit = partial[0][r];
#pragma unroll
    for (int w = 1; w < kRouteWarps; ++w) logit = __fadd_rn(logit, partial[w][r]);
    const float sv = 1.0f / (1.0f + expf(-logit));
    p.route_s[static_cast<int64_t>(r) * p.num_experts + e] = sv;
    p.route_key[static_cast<int64_t>(r) * p.num_experts + e] =
        p.router_bias != nullptr ? __fadd_rn(sv, p.router_bias[e]) : sv;
  }
}

__global__ void __launch_bounds__(kRouteThreads)
    moe_route_logits_kernel(const __grid_constant__ MoeParams p) {
  __shared__ float partial[kRouteWarps][kMoeMaxRows];
  wait_previous_kernel();
  release_next_kernel();
  route_logits(p, blockIdx.x, partial);
}

__global__ void __launch_bounds__(kThreads)
    moe_route_topk_kernel(const __grid_constant__ MoeParams p) {
  __shared__ int s_pick[kMoeMaxRows * kMoeMaxTopk];
  __shared__ uint32_t s_used[kMoeMaxExperts / 32];
  wait_previous_kernel();
  release_next_kernel();
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int words = (p.num_experts + 31) / 32;
  for (int w = tid; w < words; w += kThreads) s_used[w] = 0u;
  __syncthreads();
  for (int row = warp; row < p.rows; row += kMoeWarps) {
    const float* key = p.route_key + static_cast<int64_t>(row) * p.num_experts;
    const float* s = p.route_s + static_cast<int64_t>(row) * p.num_experts;
    int picked[kMoeMaxTopk];
    float sum = 0.0f;
    for (int i = 0; i < p.topk; ++i) {
      // This lane's best expert not yet picked, then the warp's best of the lanes' bests.
      int best = -1;
      float best_key = 0.0f;
      for (int e = lane; e < p.num_experts; e += 32) {
        bool used = false;
        for (int t = 0; t < i; ++t) used = used || picked[t] == e;
        if (used) continue;
        const float k = key[e];
        if (best < 0 || key_before(k, e, best_key, best)) {
          best = e;
          best_key = k;
        }
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        const int other = __shfl_xor_sync(0xFFFFFFFFu, best, offset);
        const float other_key = __shfl_xor_sync(0xFFFFFFFFu, best_key, offset);
        if (other >= 0 && (best < 0 || key_before(other_key, other, best_key, best))) {
          best = other;
          best_key = other_key;
        }
      }
      picked[i] = best;  // topk <= num_experts: some expert is always left
      sum = __fadd_rn(sum, s[best]);
    }
    if (lane == 0) {
      for (int i = 0; i < p.topk; ++i) {
        p.topk_ids[row * p.topk + i] = picked[i];
        p.topk_weights[row * p.topk + i] =
            sum == 0.0f ? 0.0f : __fdiv_rn(__fmul_rn(p.routed_scaling, s[picked[i]]), sum);
        s_pick[row * p.topk + i] = picked[i];
        atomicOr(&s_used[picked[i] / 32], 1u << (picked[i] % 32));
      }
    }
  }
  __syncthreads();
  // The expert slots, one thread per pick: its slot is the number of distinct experts below its
  // expert, its place in the slot's list the number of earlier picks of the same expert.
  const int picks = p.rows * p.topk;
  const int max_slots = min(p.num_experts, picks);
  if (tid < picks) {
    const int e = s_pick[tid];
    int slot = __popc(s_used[e / 32] & ((1u << (e % 32)) - 1u));
    for (int w = 0; w < e / 32; ++w) slot += __popc(s_used[w]);
    int place = 0;
    int count = 0;
    for (int j = 0; j < picks; ++j) {
      const bool same = s_pick[j] == e;
      place += same && j < tid;
      count += same;
    }
    p.slot_picks[slot * kMoeMaxRows + place] = tid;
    if (place == 0) {
      p.slot_expert[slot] = e;
      p.slot_count[slot] = count;
    }
  }
  // Slots past the distinct experts: nothing to do.
  int distinct = 0;
  for (int w = 0; w < words; ++w) distinct += __popc(s_used[w]);
  for (int y = distinct + tid; y < max_slots; y += kThreads) {
    p.slot_expert[y] = -1;
    p.slot_count[y] = 0;
  }
}

// The shared expert's token list: every row, at pick slot k (its place in y).
__device__ __forceinline__ void list_every_row(const MoeParams& p, int* tok_row, int* tok_slot) {
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < p.rows) {
    tok_row[tid] = tid;
    tok_slot[tid] = p.topk;
  }
}

// The expert CTA row `y` of the expert grid serves and the rows (and pick slots) that use it.
// Rows y < grid.y - 1 (all rows without a shared expert) take expert slot y (MoeParams::slot_*,
// the y-th smallest distinct expert the step picked; none past their count: the CTA has nothing to
// do); the last row with a shared expert takes the shared expert (id E, every row, slot k).
// Returns the token count (0: return); every thread of the CTA gets it and `ex`. Waits for the
// previous kernel first and then releases the next one (MoeParams::pdl), as every expert kernel
// starts with it.
__device__ __forceinline__ int list_tokens(const MoeParams& p, int* tok_row, int* tok_slot,
                                           int& ex) {
  wait_previous_kernel();  // the routing and the activations come from earlier kernels
  __shared__ int count;
  __shared__ int expert;
  const int y = blockIdx.y;
  const int tid = static_cast<int>(threadIdx.x);
  if (p.shared_slot != 0 && y == static_cast<int>(gridDim.y) - 1) {
    list_every_row(p, tok_row, tok_slot);
    if (tid == 0) {
      count = p.rows;
      expert = p.num_experts;
    }
  } else {
    // The slot's list, made once by the top-k kernel.
    const int n = p.slot_count[y];
    if (tid < n) {
      const int pick = p.slot_picks[y * kMoeMaxRows + tid];
      tok_row[tid] = pick / p.topk;
      tok_slot[tid] = pick % p.topk;
    }
    if (tid == 0) {
      count = n;
      expert = p.slot_expert[y];
    }
  }
  __syncthreads();
  release_next_kernel();
  ex = expert;
  return count;
}

__global__ void __launch_bounds__(kThreads)
    moe_gate_up_kernel(const __grid_constant__ MoeParams p) {
  __shared__ int tok_row[kMoeMaxRows];
  __shared__ int tok_slot[kMoeMaxRows];
  int ex = -1;
  const int ntok = list_tokens(p, tok_row, tok_slot, ex);
  if (ntok == 0) return;
  const bool shared = ex == p.num_experts;
  const MoeExpertSet& set = shared ? p.shared : p.experts;
  const int I = set.inter;
  const int j0 = blockIdx.x * kGateUpTile;
  if (j0 >= I) return;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int H = p.hidden;
  const int64_t e = shared ? 0 : ex;
  for (int j = j0 + warp; j < j0 + kGateUpTile && j < I; j += kMoeWarps) {
    float ag[kMoeMaxRows];
    float au[kMoeMaxRows];
#pragma unroll
    for (int t = 0; t < kMoeMaxRows; ++t) ag[t] = au[t] = 0.0f;
#pragma unroll 4
    for (int k0 = lane * 8; k0 < H; k0 += 32 * 8) {
      float wg[8];
      float wu[8];
      load_weights8(set.w13, set.w13_scale, p.fp8, e * 2 * I + j, H, k0, wg);
      load_weights8(set.w13, set.w13_scale, p.fp8, e * 2 * I + I + j, H, k0, wu);
#pragma unroll
      for (int t = 0; t < kMoeMaxRows; ++t) {
        if (t < ntok) {
          float xv[8];
          load_bf16x8(p.x + static_cast<int64_t>(tok_row[t]) * H + k0, xv);
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            ag[t] = fmaf(xv[i], wg[i], ag[t]);
            au[t] = fmaf(xv[i], wu[i], au[t]);
          }
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kMoeMaxRows; ++t) {
      if (t < ntok) {
        const float g_sum = warp_sum(ag[t]);
        const float u_sum = warp_sum(au[t]);
        if (lane == 0) {
          const uint16_t a = swiglu_oai(g_sum, u_sum, p.limit);
          const int64_t r = tok_row[t];
          if (shared) {
            p.act_shared[r * I + j] = a;
          } else {
            p.act[(r * p.topk + tok_slot[t]) * I + j] = a;
          }
        }
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads) moe_down_kernel(const __grid_constant__ MoeParams p) {
  __shared__ int tok_row[kMoeMaxRows];
  __shared__ int tok_slot[kMoeMaxRows];
  int ex = -1;
  const int ntok = list_tokens(p, tok_row, tok_slot, ex);
  if (ntok == 0) return;
  const bool shared = ex == p.num_experts;
  const MoeExpertSet& set = shared ? p.shared : p.experts;
  const int I = set.inter;
  const int H = p.hidden;
  const int n0 = blockIdx.x * kDownTile;
  if (n0 >= H) return;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t e = shared ? 0 : ex;
  for (int n = n0 + warp; n < n0 + kDownTile && n < H; n += kMoeWarps) {
    float acc[kMoeMaxRows];
#pragma unroll
    for (int t = 0; t < kMoeMaxRows; ++t) acc[t] = 0.0f;
#pragma unroll 4
    for (int k0 = lane * 8; k0 < I; k0 += 32 * 8) {
      float w[8];
      load_weights8(set.w2, set.w2_scale, p.fp8, e * H + n, I, k0, w);
#pragma unroll
      for (int t = 0; t < kMoeMaxRows; ++t) {
        if (t < ntok) {
          const int64_t r = tok_row[t];
          const uint16_t* a =
              shared ? p.act_shared + r * I : p.act + (r * p.topk + tok_slot[t]) * I;
          float av[8];
          load_bf16x8(a + k0, av);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[t] = fmaf(av[i], w[i], acc[t]);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kMoeMaxRows; ++t) {
      if (t < ntok) {
        const float sum = warp_sum(acc[t]);
        if (lane == 0) {
          const int64_t r = tok_row[t];
          p.y[(r * (p.topk + 1) + tok_slot[t]) * H + n] = sum;
        }
      }
    }
  }
}

// ---- the tensor-core kernels ----
inline constexpr int kMmaWarps = gemm::kGemmWarps;
inline constexpr int kMmaThreads = kMmaWarps * 32;
inline constexpr int kMmaGateUpRows = 8;  // rows j per CTA: 8 gate + 8 up = one 16-column tile
// Weight chunks in flight per warp (the gemm family's group loop: 64-byte fp8 / 128-byte bf16).
template <bool kFp8>
inline constexpr int kMmaUnroll = kFp8 ? 6 : 3;
// MoeParams::deep: 8 fp8 / 6 bf16 chunks at <= 128 registers, 4 CTAs per SM (the default kernels
// take 140-150 registers: 3 CTAs per SM, so TP 4's 480 gate/up CTAs of one token need 1.2 waves);
// the same k order, so the same bits.
template <bool kFp8, bool kDeep>
inline constexpr int kMmaChunksInFlight = kDeep ? (kFp8 ? 8 : 6) : kMmaUnroll<kFp8>;
inline constexpr int kMmaDeepMinCtasPerSm = 4;

// The weight rows of a w13 / w2 matrix in bytes, and their MXFP8 scale rows.
template <bool kFp8>
__device__ __forceinline__ const uint8_t* weight_row(const void* w, int64_t row, int k) {
  return static_cast<const uint8_t*>(w) + row * k * (kFp8 ? 1 : 2);
}

__device__ __forceinline__ const uint8_t* scale_row(const uint8_t* scales, int64_t row, int k) {
  return scales + row * (k / kMxfp8Block);
}

// One gate/up tile (rows j0 .. j0 + 7 of gate and up) of expert e (the shared expert: e = 0 of
// p.shared) for the ntok listed tokens, with the activation stored.
template <bool kFp8, bool kDeep = false>
__device__ __forceinline__ void gate_up_tile(
    const MoeParams& p, bool shared, int64_t e, int ntok, const int* tok_row, const int* tok_slot,
    int j0, float (&s_red)[kMmaWarps][kSkinnyMaxRows][gemm::kColsPerCta + 1]) {
  const MoeExpertSet& set = shared ? p.shared : p.experts;
  const int I = set.inter;
  if (j0 >= I) return;
  const int H = p.hidden;
  const int g = (threadIdx.x & 31) >> 2;
  gemm::TileOperands op;
  op.x_lo = g < ntok ? p.x + static_cast<int64_t>(tok_row[g]) * H : nullptr;
  op.x_hi = g + 8 < ntok ? p.x + static_cast<int64_t>(tok_row[g + 8]) * H : nullptr;
  if (j0 + g < I) {
    const int64_t gate = e * 2 * I + j0 + g;  // column g of the first n8 tile
    const int64_t up = gate + I;              // column g of the second
    op.w_row[0] = weight_row<kFp8>(set.w13, gate, H);
    op.w_row[1] = weight_row<kFp8>(set.w13, up, H);
    if constexpr (kFp8) {
      op.scale_row[0] = scale_row(set.w13_scale, gate, H);
      op.scale_row[1] = scale_row(set.w13_scale, up, H);
    }
  }
  op.chunks = H / gemm::kChunk;
  gemm::tile_accumulate<kFp8, kMmaChunksInFlight<kFp8, kDeep>, false, kMmaWarps, 1, kFp8>(op,
                                                                                        s_red);
  // s_red[w][token][jj]: warp w's gate sum of row j0 + jj, at jj + 8 its up sum.
  for (int o = threadIdx.x; o < kSkinnyMaxRows * kMmaGateUpRows; o += kMmaThreads) {
    const int r = o / kMmaGateUpRows;
    const int jj = o % kMmaGateUpRows;
    const int j = j0 + jj;
    if (r >= ntok || j >= I) continue;
    float g_sum = s_red[0][r][jj];
    float u_sum = s_red[0][r][jj + kMmaGateUpRows];
#pragma unroll
    for (int w = 1; w < kMmaWarps; ++w) {
      g_sum = __fadd_rn(g_sum, s_red[w][r][jj]);
      u_sum = __fadd_rn(u_sum, s_red[w][r][jj + kMmaGateUpRows]);
    }
    const uint16_t a = swiglu_oai(g_sum, u_sum, p.limit);
    const int64_t row = tok_row[r];
    if (shared) {
      p.act_shared[row * I + j] = a;
    } else {
      p.act[(row * p.topk + tok_slot[r]) * I + j] = a;
    }
  }
}

template <bool kFp8, bool kDeep>
__global__ void __launch_bounds__(kMmaThreads, kDeep ? kMmaDeepMinCtasPerSm : 1)
    moe_gate_up_mma_kernel(const __grid_constant__ MoeParams p) {
  __shared__ int tok_row[kMoeMaxRows];
  __shared__ int tok_slot[kMoeMaxRows];
  __shared__ float s_red[kMmaWarps][kSkinnyMaxRows][gemm::kColsPerCta + 1];
  int ex = -1;
  const int ntok = list_tokens(p, tok_row, tok_slot, ex);
  if (ntok == 0) return;
  const bool shared = ex == p.num_experts;
  gate_up_tile<kFp8, kDeep>(p, shared, shared ? 0 : ex, ntok, tok_row, tok_slot,
                            blockIdx.x * kMmaGateUpRows, s_red);
}

// The router's logits (CTAs 0 .. E - 1, one expert each) beside the shared expert's gate/up tiles
// (the CTAs after them), which need no routing: one launch, so the shared expert's weights stream
// while the router reads its gate.
template <bool kFp8>
__global__ void __launch_bounds__(kMmaThreads)
    moe_route_and_shared_kernel(const __grid_constant__ MoeParams p) {
  static_assert(kMmaThreads == kRouteThreads, "one CTA size for both halves");
  __shared__ float partial[kRouteWarps][kMoeMaxRows];
  __shared__ int tok_row[kMoeMaxRows];
  __shared__ int tok_slot[kMoeMaxRows];
  __shared__ float s_red[kMmaWarps][kSkinnyMaxRows][gemm::kColsPerCta + 1];
  wait_previous_kernel();
  release_next_kernel();
  const int cta = blockIdx.x;
  if (cta < p.num_experts) {
    route_logits(p, cta, partial);
    return;
  }
  list_every_row(p, tok_row, tok_slot);
  __syncthreads();
  gate_up_tile<kFp8>(p, true, 0, p.rows, tok_row, tok_slot, (cta - p.num_experts) * kMmaGateUpRows,
                     s_red);
}

template <bool kFp8, bool kDeep>
__global__ void __launch_bounds__(kMmaThreads, kDeep ? kMmaDeepMinCtasPerSm : 1)
    moe_down_mma_kernel(const __grid_constant__ MoeParams p) {
  __shared__ int tok_row[kMoeMaxRows];
  __shared__ int tok_slot[kMoeMaxRows];
  __shared__ float s_red[kMmaWarps][kSkinnyMaxRows][gemm::kColsPerCta + 1];
  int ex = -1;
  const int ntok = list_tokens(p, tok_row, tok_slot, ex);
  if (ntok == 0) return;
  const bool shared = ex == p.num_experts;
  const MoeExpertSet& set = shared ? p.shared : p.experts;
  const int I = set.inter;
  const int H = p.hidden;
  const int n0 = blockIdx.x * gemm::kColsPerCta;
  if (n0 >= H) return;
  const int64_t e = shared ? 0 : ex;
  const int g = (threadIdx.x & 31) >> 2;
  // The activations of token r of the list.
  const auto act_row = [&](int r) -> const uint16_t* {
    const int64_t row = tok_row[r];
    return shared ? p.act_shared + row * I : p.act + (row * p.topk + tok_slot[r]) * I;
  };
  gemm::TileOperands op;
  op.x_lo = g < ntok ? act_row(g) : nullptr;
  op.x_hi = g + 8 < ntok ? act_row(g + 8) : nullptr;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int n = n0 + j * 8 + g;
    if (n < H) {
      op.w_row[j] = weight_row<kFp8>(set.w2, e * H + n, I);
      if constexpr (kFp8) op.scale_row[j] = scale_row(set.w2_scale, e * H + n, I);
    }
  }
  op.chunks = I / gemm::kChunk;
  gemm::tile_accumulate<kFp8, kMmaChunksInFlight<kFp8, kDeep>, false, kMmaWarps, 1, kFp8>(op,
                                                                                        s_red);
  for (int o = threadIdx.x; o < kSkinnyMaxRows * gemm::kColsPerCta; o += kMmaThreads) {
    const int r = o / gemm::kColsPerCta;
    const int n = n0 + o % gemm::kColsPerCta;
    if (r >= ntok || n >= H) continue;
    float sum = s_red[0][r][o % gemm::kColsPerCta];
#pragma unroll
    for (int w = 1; w < kMmaWarps; ++w) sum = __fadd_rn(sum, s_red[w][r][o % gemm::kColsPerCta]);
    p.y[(static_cast<int64_t>(tok_row[r]) * (p.topk + 1) + tok_slot[r]) * H + n] = sum;
  }
}

__global__ void moe_combine_kernel(const __grid_constant__ MoeParams p) {
  wait_previous_kernel();
  release_next_kernel();
  const int64_t total = static_cast<int64_t>(p.rows) * p.hidden;
  const bool shared = p.shared.inter > 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / p.hidden;
    const int64_t n = i % p.hidden;
    const float* y = p.y + r * (p.topk + 1) * p.hidden + n;
    float acc = 0.0f;
    for (int k = 0; k < p.topk; ++k) {
      acc = __fadd_rn(acc, __fmul_rn(p.topk_weights[r * p.topk + k], y[k * p.hidden]));
    }
    if (shared) acc = __fadd_rn(acc, y[static_cast<int64_t>(p.topk) * p.hidden]);
    p.out[i] = acc;
  }
}

}  // namespace m3msa::cuda::moe
