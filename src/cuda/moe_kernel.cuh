// Kernels of the moe family: the mixture of experts of one rank for a decode step of at most
// kMoeMaxRows token rows (docs/spec.md section 8). Framework-free: raw pointers and MoeParams;
// launched by moe.cu.
//
//  - moe_route_logits_kernel: one CTA per expert (the router's bytes spread over the GPU: a row
//    of CTAs would leave one SM to stream the whole [E, hidden] fp32 gate); warp w takes 1/4 of K,
//    each gate float4 loaded once for every row, lanes then a butterfly sum, the 4 warps' partials
//    added in warp order; s = sigmoid(logit), key = s + bias, per (row, expert).
//    The last of those CTAs to finish (an arrival count in MoeParams::sync) then takes the top-k
//    (route_topk), a warp per row: the top-k keys (NaN last, the lower id on ties) by k warp-wide
//    arg-max rounds; ids and weights routed_scaling * s_i / sum s; then the step's expert slots
//    (MoeParams::slot_*), made once for every expert CTA.
//  - moe_gate_up_kernel: one CTA per (tile of 16 intermediate rows j, expert slot); slot y is the
//    y-th smallest distinct expert the step picked (min(E, rows * k) slots: a slot past the count
//    returns at once), the last slot the shared expert. The CTA reads the slot's rows (made by the
//    router's top-k; all rows for the shared one); each warp takes
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
// (moe_route_and_shared_kernel), beside the logits: they need no routing. At one token row the
// MXFP8 down projection and the combine are one launch (moe_down_combine_kernel,
// MoeParams::down_combine). moe_persistent_kernel (MoeParams::persistent) runs all of it as work
// items of one launch (see there).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/arrival.cuh"
#include "cuda/gemm_kernel.cuh"
#include "cuda/moe_params.h"
#include "cuda/timeline.cuh"
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

// The launch sequence's timeline marks (kMoeLaunchMarks) and CTA kinds (kMoeRouterKinds,
// kMoeExpertKinds); skipped unless a recorder set p.timeline.
enum LaunchMark : int { kLaunchStart, kLaunchInputs, kLaunchEnd };
enum RouterKind : uint32_t { kRouterLogits, kRouterSharedGateUp, kRouterTopk };
enum ExpertKind : uint32_t { kExpertRouted, kExpertShared, kExpertIdle };

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

// Warps of a logits CTA: each takes a contiguous 1/kRouteWarps of K.
inline constexpr int kRouteWarps = 4;
inline constexpr int kRouteThreads = kRouteWarps * 32;
// Gate-row float4 loads in flight per lane: M3's hidden 6144 is 12 per lane, one round trip in the
// launch sequence's router kernels; the persistent kernel takes two of 6 (12 at once raised its
// spills).
inline constexpr int kRouteLoads = 12;
inline constexpr int kRouteLoadsPersistent = 6;

// Expert e's logit for every row (a CTA of kRouteThreads): s and key into the workspace.
template <int kLoads = kRouteLoads>
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
  // kLoads gate float4s in flight per lane, then per row its kLoads pieces of x in
  // flight at once (a load per piece after the previous one's use was a round trip each), consumed
  // in the order of i: the same sums.
  for (int base = begin + lane; base < end; base += 32 * kLoads) {
    float4 w[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      const int i = base + 32 * u;
      w[u] = i < end ? __ldg(g + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int r = 0; r < kMoeMaxRows; ++r) {
      if (r < p.rows) {
        const uint2* x = reinterpret_cast<const uint2*>(p.x + static_cast<int64_t>(r) * p.hidden);
        uint2 xr[kLoads];
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          const int i = base + 32 * u;
          xr[u] = i < end ? __ldg(x + i) : make_uint2(0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < kLoads; ++u) {
          if (base + 32 * u < end) {
            acc[r] = fmaf(bf16_to_float(static_cast<uint16_t>(xr[u].x)), w[u].x, acc[r]);
            acc[r] = fmaf(bf16_to_float(static_cast<uint16_t>(xr[u].x >> 16)), w[u].y, acc[r]);
            acc[r] = fmaf(bf16_to_float(static_cast<uint16_t>(xr[u].y)), w[u].z, acc[r]);
            acc[r] = fmaf(bf16_to_float(static_cast<uint16_t>(xr[u].y >> 16)), w[u].w, acc[r]);
          }
        }
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

// Experts per lane whose keys the top-k holds in registers (rows of up to 256 experts; M3: 128).
inline constexpr int kTopkRegisterExperts = 8;

// The warp's largest pick-order key (moe_pick_order) on every lane.
__device__ __forceinline__ uint64_t warp_max_order(uint64_t v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
  }
  return v;
}

// What the top-k reads and writes of MoeParams, as values: the out-of-line call would otherwise
// reach the kernel's parameters through a generic pointer, one dependent load per use (PTX: the
// expert count reloaded before every key load).
struct TopkOperands {
  const float* route_s;
  const float* route_key;
  int32_t* topk_ids;
  float* topk_weights;
  int32_t* slot_expert;
  int32_t* slot_count;
  int32_t* slot_picks;
  int num_experts;
  int rows;
  int topk;
  float routed_scaling;
};

__device__ __forceinline__ TopkOperands topk_operands(const MoeParams& p) {
  return {p.route_s,    p.route_key,   p.topk_ids, p.topk_weights, p.slot_expert,   p.slot_count,
          p.slot_picks, p.num_experts, p.rows,     p.topk,         p.routed_scaling};
}

// The top-k's CTA-shared scratch: every row's picks and their s in pick order, and the set of
// picked experts.
struct TopkScratch {
  int pick[kMoeMaxRows * kMoeMaxTopk];
  float pick_s[kMoeMaxRows * kMoeMaxTopk];
  uint32_t used[kMoeMaxExperts / 32];
};

// The top-k picks of every row and the step's expert slots (MoeParams::slot_*), by one CTA of any
// whole number of warps (the picks are warp-local, the slots one thread per pick, <= 128 picks:
// the same bits for every CTA size). Reads the router's outputs through L2: the persistent kernel
// writes them earlier in the same launch.
// Its code is kept short on purpose (the pick rounds not unrolled, the picks kept in shared
// memory rather than in registers): it runs once per step on one SM whose instruction cache it
// finds cold, so every 128-byte line of code it executes is a fetch from L2 or DRAM.
__device__ __forceinline__ void route_topk(const TopkOperands& p, TopkScratch& scratch) {
  const int tid = static_cast<int>(threadIdx.x);
  const int threads = static_cast<int>(blockDim.x);
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int words = (p.num_experts + 31) / 32;
  for (int w = tid; w < words; w += threads) scratch.used[w] = 0u;
  // Every slot's pick list -1 (the picks overwrite theirs after the barrier below), so an expert
  // CTA may load its whole list beside the count.
  const int slot_entries = min(p.num_experts, p.rows * p.topk) * kMoeMaxRows;
  for (int i = tid; i < slot_entries; i += threads) p.slot_picks[i] = -1;
  __syncthreads();
#pragma unroll 1
  for (int row = warp; row < p.rows; row += threads / 32) {
    const float* key = p.route_key + static_cast<int64_t>(row) * p.num_experts;
    const float* s = p.route_s + static_cast<int64_t>(row) * p.num_experts;
    int* pick = scratch.pick + row * p.topk;
    float* pick_s = scratch.pick_s + row * p.topk;
    float sum = 0.0f;
    if (p.num_experts <= 32 * kTopkRegisterExperts) {
      // The row's keys as pick-order keys in registers (expert lane + 32 j; 0: no candidate), all
      // loads in flight at once: one L2 round trip for the row, then k rounds of branch-free
      // maxima (moe_pick_order: the rule's order as one u64) and a five-step warp maximum.
      uint64_t order[kTopkRegisterExperts];
      float svals[kTopkRegisterExperts];
#pragma unroll
      for (int j = 0; j < kTopkRegisterExperts; ++j) {
        const int e = lane + 32 * j;
        const bool exists = e < p.num_experts;
        const float k = exists ? __ldcg(key + e) : 0.0f;
        svals[j] = exists ? __ldcg(s + e) : 0.0f;
        order[j] = exists ? moe_pick_order(k, e) : 0ull;  // a candidate's key is never 0
      }
#pragma unroll 1
      for (int i = 0; i < p.topk; ++i) {
        uint64_t best = order[0];
#pragma unroll
        for (int j = 1; j < kTopkRegisterExperts; ++j) best = max(best, order[j]);
        best = warp_max_order(best);
        // topk <= num_experts: some candidate is always left, so best is one.
        const int picked = moe_pick_id(best);
        float own_s = 0.0f;
#pragma unroll
        for (int j = 0; j < kTopkRegisterExperts; ++j) {
          if (lane + 32 * j == picked) {
            own_s = svals[j];
            order[j] = 0ull;
          }
        }
        const float best_s = __shfl_sync(0xFFFFFFFFu, own_s, picked % 32);
        if (lane == 0) {
          pick[i] = picked;
          pick_s[i] = best_s;
        }
        sum = __fadd_rn(sum, best_s);
      }
    } else {
#pragma unroll 1
      for (int i = 0; i < p.topk; ++i) {
        // This lane's best expert not yet picked, then the warp's best of the lanes' bests.
        __syncwarp();          // lane 0's earlier picks, before the lanes skip them
        uint64_t best = 0ull;  // no candidate
#pragma unroll 1
        for (int e = lane; e < p.num_experts; e += 32) {
          bool used = false;
#pragma unroll 1
          for (int t = 0; t < i; ++t) used = used || pick[t] == e;
          if (!used) best = max(best, moe_pick_order(__ldcg(key + e), e));
        }
        const int picked = moe_pick_id(warp_max_order(best));
        const float best_s = __ldcg(s + picked);
        if (lane == 0) {
          pick[i] = picked;
          pick_s[i] = best_s;
        }
        sum = __fadd_rn(sum, best_s);
      }
    }
    __syncwarp();  // lane 0's picks, before every lane writes one
    if (lane < p.topk) {
      const int e = pick[lane];
      p.topk_ids[row * p.topk + lane] = e;
      p.topk_weights[row * p.topk + lane] =
          sum == 0.0f ? 0.0f : __fdiv_rn(__fmul_rn(p.routed_scaling, pick_s[lane]), sum);
      atomicOr(&scratch.used[e / 32], 1u << (e % 32));
    }
  }
  __syncthreads();
  // The expert slots, one thread per pick: its slot is the number of distinct experts below its
  // expert, its place in the slot's list the number of earlier picks of the same expert.
  const int picks = p.rows * p.topk;
  const int max_slots = min(p.num_experts, picks);
  if (tid < picks) {
    const int e = scratch.pick[tid];
    int slot = __popc(scratch.used[e / 32] & ((1u << (e % 32)) - 1u));
#pragma unroll 1
    for (int w = 0; w < e / 32; ++w) slot += __popc(scratch.used[w]);
    int place = 0;
    int count = 0;
#pragma unroll 1
    for (int j = 0; j < picks; ++j) {
      const bool same = scratch.pick[j] == e;
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
#pragma unroll 1
  for (int w = 0; w < words; ++w) distinct += __popc(scratch.used[w]);
  for (int y = distinct + tid; y < max_slots; y += threads) {
    p.slot_expert[y] = -1;
    p.slot_count[y] = 0;
  }
}

// route_topk out of line: inlined into the router's kernels it took the registers of the shared
// expert's gate/up tiles beside it (ptxas: 168 -> 128 registers and spills).
__device__ __noinline__ void route_topk_apart(const TopkOperands p, TopkScratch& scratch) {
  route_topk(p, scratch);
}

// The router launch's CTAs count their arrivals in this word of MoeParams::sync (the persistent
// kernel's block, which that kernel leaves zero as well); the last to arrive takes the top-k.
inline constexpr int kSyncRouteArrivals = 5;

// Expert e's logits (route_logits), then, in the last of the launch's E logits CTAs to finish,
// the top-k picks and the expert slots (route_topk) from every CTA's logits, so the picks need no
// launch of their own (MoeParams::router_picks_max_rows). The last CTA resets the count for the
// next launch. A CTA of kRouteThreads (one thread per pick).
__device__ __forceinline__ void route_and_pick(const MoeParams& p, int e,
                                               float (&partial)[kRouteWarps][kMoeMaxRows]) {
  static_assert(kMoeMaxRows * kMoeMaxTopk <= kRouteThreads, "one thread per pick");
  __shared__ TopkScratch s_topk;
  __shared__ bool last;
  route_logits(p, e, partial);
  __syncthreads();  // this CTA's logits, before its arrival (arrive_acq_rel)
  if (threadIdx.x == 0) {
    const uint32_t before = arrive_acq_rel(p.sync + kSyncRouteArrivals);
    last = before == static_cast<uint32_t>(p.num_experts - 1);
    if (last) p.sync[kSyncRouteArrivals] = 0u;
  }
  __syncthreads();  // the last CTA's threads read the other CTAs' logits after the acquire
  if (!last) return;
  timeline::set_kind(p.timeline, kRouterTopk);
  timeline::mark(p.timeline, kLaunchInputs);  // every CTA's logits: the top-k's inputs
  route_topk_apart(topk_operands(p), s_topk);
}

// kPick: the last CTA takes the top-k (route_and_pick); else moe_route_topk_kernel follows.
template <bool kPick>
__global__ void __launch_bounds__(kRouteThreads)
    moe_route_logits_kernel(const __grid_constant__ MoeParams p) {
  __shared__ float partial[kRouteWarps][kMoeMaxRows];
  timeline::mark(p.timeline, kLaunchStart);
  const timeline::MarkOnExit end_mark{p.timeline, kLaunchEnd};
  wait_previous_kernel();
  timeline::mark(p.timeline, kLaunchInputs);
  release_next_kernel();
  if constexpr (kPick) {
    route_and_pick(p, blockIdx.x, partial);
  } else {
    route_logits(p, blockIdx.x, partial);
  }
}

// The top-k picks and expert slots (route_topk) in a launch of their own: one CTA, a warp per row.
__global__ void __launch_bounds__(kThreads)
    moe_route_topk_kernel(const __grid_constant__ MoeParams p) {
  static_assert(kMoeMaxRows * kMoeMaxTopk <= kThreads, "one thread per pick");
  __shared__ TopkScratch s_topk;
  timeline::mark(p.timeline, kLaunchStart);
  timeline::set_kind(p.timeline, kRouterTopk);
  const timeline::MarkOnExit end_mark{p.timeline, kLaunchEnd};
  wait_previous_kernel();
  timeline::mark(p.timeline, kLaunchInputs);
  release_next_kernel();
  route_topk(topk_operands(p), s_topk);
}

// The shared expert's token list: every row, at pick slot k (its place in y).
__device__ __forceinline__ void list_every_row(const MoeParams& p, int* tok_row, int* tok_slot) {
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < p.rows) {
    tok_row[tid] = tid;
    tok_slot[tid] = p.topk;
  }
}

// The tokens (rows and pick slots) of expert slot `y` (MoeParams::slot_*, the y-th smallest
// distinct expert the step picked; none past their count), or with `shared` of the shared expert
// (id E, every row, slot k). Returns the token count (0: nothing to do); every thread of the CTA
// gets it and `ex`. The slot lists are read through L2: the persistent kernel writes them earlier
// in the same launch.
__device__ __forceinline__ int slot_tokens(const MoeParams& p, int y, bool shared, int* tok_row,
                                           int* tok_slot, int& ex) {
  __shared__ int count;
  __shared__ int expert;
  const int tid = static_cast<int>(threadIdx.x);
  if (shared) {
    list_every_row(p, tok_row, tok_slot);
    if (tid == 0) {
      count = p.rows;
      expert = p.num_experts;
    }
  } else {
    // The slot's list, made once by the top-k: its count, picks and expert loaded together (one
    // L2 round trip; the top-k writes every entry of the slot's row, -1 past its count).
    const int n = __ldcg(p.slot_count + y);
    const int pick = tid < kMoeMaxRows ? __ldcg(p.slot_picks + y * kMoeMaxRows + tid) : -1;
    const int e = tid == 0 ? __ldcg(p.slot_expert + y) : -1;
    if (tid < n) {
      tok_row[tid] = pick / p.topk;
      tok_slot[tid] = pick % p.topk;
    }
    if (tid == 0) {
      count = n;
      expert = e;
    }
  }
  __syncthreads();
  ex = expert;
  return count;
}

// The expert CTA row `y` of the expert grid serves and the rows (and pick slots) that use it:
// rows y < grid.y - 1 (all rows without a shared expert) take expert slot y, the last row with a
// shared expert takes the shared expert (slot_tokens). Waits for the previous kernel first and
// then releases the next one (MoeParams::pdl), as every expert kernel starts with it.
__device__ __forceinline__ int list_tokens(const MoeParams& p, int* tok_row, int* tok_slot,
                                           int& ex) {
  wait_previous_kernel();  // the routing and the activations come from earlier kernels
  const int y = blockIdx.y;
  const bool shared = p.shared_slot != 0 && y == static_cast<int>(gridDim.y) - 1;
  const int count = slot_tokens(p, y, shared, tok_row, tok_slot, ex);
  timeline::mark(p.timeline, kLaunchInputs);
  timeline::set_kind(p.timeline,
                     count == 0 ? kExpertIdle : (shared ? kExpertShared : kExpertRouted));
  release_next_kernel();
  return count;
}

__global__ void __launch_bounds__(kThreads)
    moe_gate_up_kernel(const __grid_constant__ MoeParams p) {
  __shared__ int tok_row[kMoeMaxRows];
  __shared__ int tok_slot[kMoeMaxRows];
  timeline::mark(p.timeline, kLaunchStart);
  const timeline::MarkOnExit end_mark{p.timeline, kLaunchEnd};
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
  timeline::mark(p.timeline, kLaunchStart);
  const timeline::MarkOnExit end_mark{p.timeline, kLaunchEnd};
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
// MoeParams::down_tiles: the tiled down kernel's ring, also at 4 CTAs per SM (ptxas: <= 128
// registers without a spill with the ring's bookkeeping; one chunk more spills).
template <bool kFp8>
inline constexpr int kMmaTiledChunksInFlight = kFp8 ? 5 : 4;

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
// kStream: the weights stream through `stream_smem` (gemm::tile_accumulate_streamed, the same
// bits; intermediates a multiple of 8, so every tile is whole), else the register ring.
// kStageX (kStream): the tokens' rows of x are bulk-copied into shared memory after the ring
// (stream_smem + gemm::stream_smem_bytes(H, ...), ntok x H bf16) on `x_bar` before the weights'
// first fills, and the chunks read them there; the same values, so the same bits.
template <bool kFp8, int kInFlight, bool kStream = false, bool kStageX = false>
__device__ __forceinline__ void gate_up_tile(
    const MoeParams& p, bool shared, int64_t e, int ntok, const int* tok_row, const int* tok_slot,
    int j0, float (&s_red)[kMmaWarps][kSkinnyMaxRows][gemm::kColsPerCta + 1],
    uint8_t* stream_smem = nullptr, uint64_t* x_bar = nullptr) {
  static_assert(!kStageX || kStream, "x is staged beside the streamed ring");
  const MoeExpertSet& set = shared ? p.shared : p.experts;
  const int I = set.inter;
  if (j0 >= I) return;
  const int H = p.hidden;
  const int g = (threadIdx.x & 31) >> 2;
  const uint16_t* x_lo = g < ntok ? p.x + static_cast<int64_t>(tok_row[g]) * H : nullptr;
  const uint16_t* x_hi = g + 8 < ntok ? p.x + static_cast<int64_t>(tok_row[g + 8]) * H : nullptr;
  if constexpr (kStream) {
    gemm::StreamOperands op;
    op.x_lo = x_lo;
    op.x_hi = x_hi;
    if constexpr (kStageX) {
      uint16_t* s_x =
          reinterpret_cast<uint16_t*>(stream_smem + gemm::stream_smem_bytes(H, kFp8, kFp8));
      if (threadIdx.x == 0) {
        mbar_init(x_bar, 1);
        mbar_init_fence();
        mbar_expect_tx(x_bar, static_cast<uint32_t>(ntok * H * 2));
        for (int i = 0; i < ntok; ++i) {
          bulk_copy(s_x + static_cast<int64_t>(i) * H, p.x + static_cast<int64_t>(tok_row[i]) * H,
                    static_cast<uint32_t>(H * 2), x_bar);
        }
      }
      // The ring's first barrier synchronization orders the init before anyone's wait.
      op.x_lo = g < ntok ? s_x + static_cast<int64_t>(g) * H : nullptr;
      op.x_hi = g + 8 < ntok ? s_x + static_cast<int64_t>(g + 8) * H : nullptr;
      op.x_ready = x_bar;
    }
    const int64_t gate = e * 2 * I + j0;  // the first n8 tile's rows: gate rows j0 ..
    const int64_t up = gate + I;          // the second's: the matching up rows
    op.w_first[0] = weight_row<kFp8>(set.w13, gate, H);
    op.w_first[1] = weight_row<kFp8>(set.w13, up, H);
    if constexpr (kFp8) {
      op.scale_first[0] = scale_row(set.w13_scale, gate, H);
      op.scale_first[1] = scale_row(set.w13_scale, up, H);
    }
    op.k = H;
    gemm::tile_accumulate_streamed<kFp8, kMmaWarps, kFp8, false, 1, kStageX>(op, stream_smem,
                                                                             s_red);
  } else {
    gemm::TileOperands op;
    op.x_lo = x_lo;
    op.x_hi = x_hi;
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
    gemm::tile_accumulate<kFp8, kInFlight, false, kMmaWarps, 1, kFp8>(op, s_red);
  }
  // s_red[w][token][jj]: warp w's gate sum of row j0 + jj, at jj + 8 its up sum.
  for (int o = threadIdx.x; o < kSkinnyMaxRows * kMmaGateUpRows; o += kMmaThreads) {
    const int r = o / kMmaGateUpRows;
    const int jj = o % kMmaGateUpRows;
    const int j = j0 + jj;
    if (r >= ntok || j >= I) continue;
    // The gate and up sums in one loop (each in warp order, gemm::warp_order_sum's).
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

// kStream (MoeParams::stream): the weights streamed through shared memory (dynamic shared memory
// gemm::stream_smem_bytes(hidden, ...)), the same bits; at most 128 registers (ptxas: ~70), so the
// shared memory (a 2-slot ring of 16 weight rows x 1 KB, the tile's scales, the warps' sums:
// ~41 KB for M3's hidden) sets how many CTAs fit an SM (5; more for the short down rows).
// kStageX (kStream): the tokens' rows of x staged in shared memory after the ring (gate_up_tile);
// the launcher adds ntok x hidden x 2 bytes to the dynamic shared memory.
template <bool kFp8, bool kDeep, bool kStream = false, bool kStageX = false>
__global__ void __launch_bounds__(kMmaThreads, (kDeep || kStream) ? kMmaDeepMinCtasPerSm : 1)
    moe_gate_up_mma_kernel(const __grid_constant__ MoeParams p) {
  extern __shared__ __align__(128) uint8_t s_stream[];
  __shared__ uint64_t x_bar;
  __shared__ int tok_row[kMoeMaxRows];
  __shared__ int tok_slot[kMoeMaxRows];
  __shared__ float s_red[kMmaWarps][kSkinnyMaxRows][gemm::kColsPerCta + 1];
  timeline::mark(p.timeline, kLaunchStart);
  const timeline::MarkOnExit end_mark{p.timeline, kLaunchEnd};
  int ex = -1;
  const int ntok = list_tokens(p, tok_row, tok_slot, ex);
  if (ntok == 0) return;
  const bool shared = ex == p.num_experts;
  gate_up_tile<kFp8, kMmaChunksInFlight<kFp8, kDeep>, kStream, kStageX>(
      p, shared, shared ? 0 : ex, ntok, tok_row, tok_slot, blockIdx.x * kMmaGateUpRows, s_red,
      s_stream, &x_bar);
}

// The router's logits (CTAs 0 .. E - 1, one expert each) beside the shared expert's gate/up tiles
// (the CTAs after them), which need no routing: one launch, so the shared expert's weights stream
// while the router reads its gate.
// kStream: the shared expert's tiles stream their weights (dynamic shared memory
// gemm::stream_smem_bytes(hidden, ...)). kPick: the last logits CTA takes the top-k
// (route_and_pick); its call caps the kernel at 128 registers, which the shared expert's tiles pay
// for at many rows (MoeParams::router_picks_max_rows).
template <bool kFp8, bool kStream, bool kPick>
__global__ void __launch_bounds__(kMmaThreads)
    moe_route_and_shared_kernel(const __grid_constant__ MoeParams p) {
  static_assert(kMmaThreads == kRouteThreads, "one CTA size for both halves");
  extern __shared__ __align__(128) uint8_t s_stream[];
  __shared__ float partial[kRouteWarps][kMoeMaxRows];
  __shared__ int tok_row[kMoeMaxRows];
  __shared__ int tok_slot[kMoeMaxRows];
  __shared__ float s_red[kMmaWarps][kSkinnyMaxRows][gemm::kColsPerCta + 1];
  timeline::mark(p.timeline, kLaunchStart);
  const timeline::MarkOnExit end_mark{p.timeline, kLaunchEnd};
  wait_previous_kernel();
  timeline::mark(p.timeline, kLaunchInputs);
  release_next_kernel();
  const int cta = blockIdx.x;
  if (cta >= p.num_experts) timeline::set_kind(p.timeline, kRouterSharedGateUp);
  if (cta < p.num_experts) {
    if constexpr (kPick) {
      route_and_pick(p, cta, partial);
    } else {
      route_logits(p, cta, partial);
    }
    return;
  }
  list_every_row(p, tok_row, tok_slot);
  __syncthreads();
  gate_up_tile<kFp8, kMmaChunksInFlight<kFp8, false>, kStream>(
      p, true, 0, p.rows, tok_row, tok_slot, (cta - p.num_experts) * kMmaGateUpRows, s_red,
      s_stream);
}

// kTiles x 16 hidden rows n0.. of the down projection of expert `ex` (the shared expert: E) for
// its ntok listed tokens into p.y. kTiles > 1: the tiles share one ring of weight loads
// (gemm::tiles_accumulate; each tile's bits as with kTiles 1); the caller takes them only where
// every tile is present (hidden a multiple of kTiles x 16). kFresh: the activations were written
// earlier in the same launch (the persistent kernel).
// kStream (kTiles 1): the weights stream through `stream_smem` (gemm::tile_accumulate_streamed,
// the same bits; hidden a multiple of 16, so every tile is whole).
template <bool kFp8, int kInFlight, int kTiles, bool kFresh = false, bool kStream = false>
__device__ __forceinline__ void down_tiles(
    const MoeParams& p, int ex, int ntok, const int* tok_row, const int* tok_slot, int n0,
    float (&s_red)[kTiles][kMmaWarps][kSkinnyMaxRows][gemm::kColsPerCta + 1],
    uint8_t* stream_smem = nullptr) {
  static_assert(!kStream || (kTiles == 1 && !kFresh), "the streamed tile is one tile");
  constexpr int kCols = kTiles * gemm::kColsPerCta;
  const bool shared = ex == p.num_experts;
  const MoeExpertSet& set = shared ? p.shared : p.experts;
  const int I = set.inter;
  const int H = p.hidden;
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
  if constexpr (kStream) {
    gemm::StreamOperands so;
    so.x_lo = op.x_lo;
    so.x_hi = op.x_hi;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int n = n0 + j * 8;  // the n8 tile's first row
      so.w_first[j] = weight_row<kFp8>(set.w2, e * H + n, I);
      if constexpr (kFp8) so.scale_first[j] = scale_row(set.w2_scale, e * H + n, I);
    }
    so.k = I;
    gemm::tile_accumulate_streamed<kFp8, kMmaWarps, kFp8>(so, stream_smem, s_red[0]);
  } else if constexpr (kTiles == 1 && !kFresh) {
    gemm::tile_accumulate<kFp8, kInFlight, false, kMmaWarps, 1, kFp8>(op, s_red[0]);
  } else {
    const int64_t tile_rows = gemm::kColsPerCta;
    gemm::tiles_accumulate<kFp8, kInFlight, kMmaWarps, kTiles, kFp8, kFresh>(
        op, tile_rows * I * (kFp8 ? 1 : 2), tile_rows * (I / kMxfp8Block), s_red);
  }
  for (int o = threadIdx.x; o < kSkinnyMaxRows * kCols; o += kMmaThreads) {
    const int r = o / kCols;
    const int col = o % kCols;
    const int tile = col / gemm::kColsPerCta;
    const int cc = col % gemm::kColsPerCta;
    const int n = n0 + col;
    if (r >= ntok || n >= H) continue;
    const float sum = gemm::warp_order_sum(s_red[tile], r, cc);
    p.y[(static_cast<int64_t>(tok_row[r]) * (p.topk + 1) + tok_slot[r]) * H + n] = sum;
  }
}

// The down projection: a CTA per (kTiles x 16 hidden rows n, expert slot). kTiles > 1
// (MoeParams::down_tiles): the CTA's tiles share one ring of weight loads, at 4 CTAs per SM
// (kMmaTiledChunksInFlight): TP 4 / 8 ranks' K (768 / 384) gives a warp three or fewer chunks per
// tile, so a CTA per tile waits a whole round trip for each, and one token's 5 x 384 CTAs take
// five waves.
// kStream (MoeParams::stream, kTiles 1): the weights streamed through shared memory (dynamic
// shared memory gemm::stream_smem_bytes(inter, ...)), the same bits.
template <bool kFp8, bool kDeep, int kTiles = 1, bool kStream = false>
__global__ void __launch_bounds__(kMmaThreads,
                                  (kDeep || kTiles > 1 || kStream) ? kMmaDeepMinCtasPerSm : 1)
    moe_down_mma_kernel(const __grid_constant__ MoeParams p) {
  constexpr int kInFlight =
      kTiles > 1 ? kMmaTiledChunksInFlight<kFp8> : kMmaChunksInFlight<kFp8, kDeep>;
  extern __shared__ __align__(128) uint8_t s_stream[];
  __shared__ int tok_row[kMoeMaxRows];
  __shared__ int tok_slot[kMoeMaxRows];
  __shared__ float s_red[kTiles][kMmaWarps][kSkinnyMaxRows][gemm::kColsPerCta + 1];
  timeline::mark(p.timeline, kLaunchStart);
  const timeline::MarkOnExit end_mark{p.timeline, kLaunchEnd};
  int ex = -1;
  const int ntok = list_tokens(p, tok_row, tok_slot, ex);
  if (ntok == 0) return;
  const int n0 = blockIdx.x * kTiles * gemm::kColsPerCta;
  if (n0 >= p.hidden) return;
  down_tiles<kFp8, kInFlight, kTiles, false, kStream>(p, ex, ntok, tok_row, tok_slot, n0, s_red,
                                                      s_stream);
}

// Row r's output at one column: sum_i w_i y_i + y_k in pick order with unfused fp32 operations
// (the CPU reference's order), y_at(i) giving expert pick i's output (i = topk: the shared
// expert's); the weights read through L2 (the persistent kernel writes them earlier in the same
// launch). Every combine takes its sums from here, so they agree bit for bit.
template <class YAt>
__device__ __forceinline__ float combine_sum(const MoeParams& p, int64_t r, YAt y_at) {
  float acc = 0.0f;
  for (int k = 0; k < p.topk; ++k) {
    acc = __fadd_rn(acc, __fmul_rn(__ldcg(p.topk_weights + r * p.topk + k), y_at(k)));
  }
  if (p.shared.inter > 0) acc = __fadd_rn(acc, y_at(p.topk));
  return acc;
}

// out[r, n] from p.y, read through L2 (the persistent kernel writes it earlier in the same launch).
__device__ __forceinline__ void combine_element(const MoeParams& p, int64_t r, int64_t n) {
  const float* y = p.y + r * (p.topk + 1) * p.hidden + n;
  p.out[r * p.hidden + n] =
      combine_sum(p, r, [&](int k) { return __ldcg(y + static_cast<int64_t>(k) * p.hidden); });
}

// ---- the down projection and the combine in one launch (MoeParams::down_combine) ----
// One CTA per 16 hidden columns n0 .. n0 + 15 for the whole step (MXFP8 weights, every K at most
// one ring stage: I <= kStreamStageBytes). Its segments are the step's expert slots that have
// picks (a prefix of the slots, in slot order), then the shared expert; each segment's 16 weight
// rows (n0 .. of its expert's w2) and their scales stream through one ring that runs across the
// segments, so the CTA keeps copies in flight from one expert into the next instead of a CTA per
// (tile, slot) paying a round trip and a start each. A segment's tile is computed as the streamed
// down tile computes it (warp w the 64-k chunks w, w + 4, ..., the warps' sums added in warp
// order) into s_y[row][pick slot][col], and the CTA then combines its columns in
// moe_combine_kernel's order: the down + combine launches' bits, in one launch with a fifth of the
// CTAs at one token.
inline constexpr int kDownCombineMaxK = gemm::kStreamStageBytes;
inline constexpr int kDownCombineScaleBytes = gemm::kColsPerCta * (kDownCombineMaxK / kMxfp8Block);
inline constexpr int kDownCombineSlotBytes = gemm::kStreamSlotBytes + kDownCombineScaleBytes;
// The dynamic shared memory: the barriers, kSlots ring slots (segments in flight,
// MoeParams::down_combine), the segments' sums s_y ([rows][topk + 1][16] f32) and, where they are
// staged (act_bytes > 0, down_combine_act_bytes), the segments' activation rows.
__host__ __device__ constexpr int down_combine_smem_bytes(int slots, int rows, int topk,
                                                          int act_bytes) {
  return gemm::kStreamBarrierBytes + slots * kDownCombineSlotBytes +
         rows * (topk + 1) * gemm::kColsPerCta * 4 + act_bytes;
}
// The activations a CTA stages: every segment's (at most min(E, rows x topk) slots and the shared
// expert) token rows of K bf16 each, at one pitch of the larger K. Staged where they take at most
// kDownCombineMaxActBytes (one token row: 5 segments x 1.5 KB at TP 4): with s_y, within what the
// smaller static s_y freed and the CTAs per SM allow (3 slots: 3 CTAs per SM up to ~15.3 KB of
// s_y + activations; 2 slots: 4 up to ~13.0 KB).
inline constexpr int kDownCombineMaxActBytes = 12 * 1024;
__host__ __device__ constexpr int down_combine_act_bytes(int segments, int rows, int max_k) {
  return segments * rows * max_k * 2;
}
inline constexpr int kMoeMaxSlots = kMoeMaxRows * kMoeMaxTopk;  // distinct experts of one step

// kStageAct: the segments' activation rows are bulk-copied into shared memory with the ring's
// first fills (one barrier, waited once before the first segment) instead of each warp loading
// its first chunk's activations from L2 after every segment's wait; the same values, so the same
// bits.
template <int kSlots, bool kStageAct = false>
__global__ void __launch_bounds__(kMmaThreads, kMmaDeepMinCtasPerSm)
    moe_down_combine_kernel(const __grid_constant__ MoeParams p) {
  static_assert(kMoeMaxSlots <= kMmaThreads, "a thread per slot");
  static_assert((kSlots + 1) * 8 <= gemm::kStreamBarrierBytes, "a barrier per ring slot + one");
  extern __shared__ __align__(128) uint8_t s_stream[];
  __shared__ int s_seg_expert[kMoeMaxSlots + 1];  // E: the shared expert
  __shared__ int s_seg_count[kMoeMaxSlots + 1];
  __shared__ uint8_t s_seg_row[kMoeMaxSlots + 1][kMoeMaxRows];   // token i's row
  __shared__ uint8_t s_seg_slot[kMoeMaxSlots + 1][kMoeMaxRows];  // its pick slot (topk: shared)
  __shared__ float s_red[kMmaWarps][kSkinnyMaxRows][gemm::kColsPerCta + 1];
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int H = p.hidden;
  const int n0 = static_cast<int>(blockIdx.x) * gemm::kColsPerCta;
  timeline::mark(p.timeline, kLaunchStart);
  const timeline::MarkOnExit end_mark{p.timeline, kLaunchEnd};
  wait_previous_kernel();  // the slots and the activations come from earlier kernels
  // The segments: the slots with an expert (a prefix: slot y is the y-th smallest picked expert),
  // then the shared expert with every row at pick slot topk.
  const int slots = min(p.num_experts, p.rows * p.topk);
  int expert = -1;
  if (tid < slots) {
    // The slot's expert, count and first pick loaded together (one L2 round trip at one token).
    expert = __ldg(p.slot_expert + tid);
    const int count = __ldg(p.slot_count + tid);
    const int first = __ldg(p.slot_picks + tid * kMoeMaxRows);
    if (expert >= 0) {
      s_seg_expert[tid] = expert;
      s_seg_count[tid] = count;
      for (int i = 0; i < count; ++i) {
        const int pick = i == 0 ? first : __ldg(p.slot_picks + tid * kMoeMaxRows + i);
        s_seg_row[tid][i] = static_cast<uint8_t>(pick / p.topk);
        s_seg_slot[tid][i] = static_cast<uint8_t>(pick % p.topk);
      }
    }
  }
  const int used = __syncthreads_count(expert >= 0);
  release_next_kernel();
  const bool has_shared = p.shared.inter > 0;
  if (has_shared && tid < p.rows) {
    if (tid == 0) {
      s_seg_expert[used] = p.num_experts;
      s_seg_count[used] = p.rows;
    }
    s_seg_row[used][tid] = static_cast<uint8_t>(tid);
    s_seg_slot[used][tid] = static_cast<uint8_t>(p.topk);
  }
  const int segments = used + (has_shared ? 1 : 0);
  __syncthreads();
  timeline::mark(p.timeline, kLaunchInputs);

  uint64_t* full = reinterpret_cast<uint64_t*>(s_stream);
  uint8_t* ring = s_stream + gemm::kStreamBarrierBytes;
  // s_y[row][pick slot][col] at (row * (topk + 1) + pick slot) * 16 + col; then the staged
  // activations: segment seg's token i at (seg * rows + i) * max_k.
  float* s_y = reinterpret_cast<float*>(ring + kSlots * kDownCombineSlotBytes);
  uint16_t* s_act = reinterpret_cast<uint16_t*>(s_y + p.rows * (p.topk + 1) * gemm::kColsPerCta);
  const int max_k = max(p.experts.inter, p.shared.inter);
  // The activations of segment seg's token i (the MMA's row i), in global memory.
  const auto act_row = [&](int seg, int i) -> const uint16_t* {
    const bool shared = s_seg_expert[seg] == p.num_experts;
    const int K = shared ? p.shared.inter : p.experts.inter;
    const int64_t row = s_seg_row[seg][i];
    return shared ? p.act_shared + row * K : p.act + (row * p.topk + s_seg_slot[seg][i]) * K;
  };
  // Segment s into ring slot s % kSlots (thread 0): 16 weight rows of K bytes at the
  // ring's padded pitch, then the rows' K / 32 scale bytes each (16 consecutive rows: one copy).
  const auto fill = [&](int seg) {
    const int slot = seg % kSlots;
    const bool shared = s_seg_expert[seg] == p.num_experts;
    const MoeExpertSet& set = shared ? p.shared : p.experts;
    const int K = set.inter;
    const int64_t first = (shared ? 0 : int64_t{s_seg_expert[seg]}) * H + n0;
    uint8_t* dst = ring + slot * kDownCombineSlotBytes;
    const uint32_t scale_bytes = static_cast<uint32_t>(gemm::kColsPerCta * (K / kMxfp8Block));
    mbar_expect_tx(&full[slot], static_cast<uint32_t>(gemm::kColsPerCta * K) + scale_bytes);
    for (int r = 0; r < gemm::kColsPerCta; ++r) {
      bulk_copy(dst + r * gemm::kStreamRowPitch,
                static_cast<const uint8_t*>(set.w2) + (first + r) * K, static_cast<uint32_t>(K),
                &full[slot]);
    }
    bulk_copy(dst + gemm::kStreamSlotBytes, set.w2_scale + first * (K / kMxfp8Block), scale_bytes,
              &full[slot]);
  };
  if (tid == 0) {
    for (int i = 0; i <= kSlots; ++i) mbar_init(&full[i], 1);
    mbar_init_fence();
    if constexpr (kStageAct) {  // the activations first: the first segment needs them too
      uint32_t bytes = 0;
      for (int seg = 0; seg < segments; ++seg) {
        const bool shared = s_seg_expert[seg] == p.num_experts;
        bytes += static_cast<uint32_t>(s_seg_count[seg] *
                                       (shared ? p.shared.inter : p.experts.inter) * 2);
      }
      mbar_expect_tx(&full[kSlots], bytes);
      for (int seg = 0; seg < segments; ++seg) {
        const bool shared = s_seg_expert[seg] == p.num_experts;
        const int K = shared ? p.shared.inter : p.experts.inter;
        for (int i = 0; i < s_seg_count[seg]; ++i) {
          bulk_copy(s_act + static_cast<int64_t>(seg * p.rows + i) * max_k, act_row(seg, i),
                    static_cast<uint32_t>(K * 2), &full[kSlots]);
        }
      }
    }
    for (int seg = 0; seg < segments && seg < kSlots; ++seg) fill(seg);
  }
  __syncthreads();  // the barriers' inits before anyone waits on them
  if constexpr (kStageAct) mbar_wait(&full[kSlots], 0u);

  for (int seg = 0; seg < segments; ++seg) {
    const int slot = seg % kSlots;
    const bool shared = s_seg_expert[seg] == p.num_experts;
    const int K = shared ? p.shared.inter : p.experts.inter;
    const int count = s_seg_count[seg];
    const auto x_row = [&](int i) -> const uint16_t* {
      if constexpr (kStageAct) {
        return s_act + static_cast<int64_t>(seg * p.rows + i) * max_k;
      } else {
        return act_row(seg, i);
      }
    };
    const uint16_t* x_lo = g < count ? x_row(g) : nullptr;
    const uint16_t* x_hi = g + 8 < count ? x_row(g + 8) : nullptr;
    mbar_wait(&full[slot], static_cast<uint32_t>(seg / kSlots) & 1u);
    const uint8_t* stage = ring + slot * kDownCombineSlotBytes;
    const uint8_t* scales = stage + gemm::kStreamSlotBytes;
    const int scale_row_bytes = K / kMxfp8Block;
    float acc[2][4] = {};
    uint32_t nan_bits[2] = {0u, 0u};
    constexpr bool kPresent[2] = {true, true};  // every segment's 16 rows are real
    for (int c = warp; c < K / gemm::kChunk; c += kMmaWarps) {
      gemm::ChunkRegs<true, 1, true> regs;
      gemm::read_stage_chunk<true, 1, true>(stage, scales, scale_row_bytes, 0, c * gemm::kChunk,
                                            kPresent, g, t, regs);
      gemm::mma_chunk<true, 1, true, false, true, kStageAct>(x_lo, x_hi, int64_t{c} * gemm::kChunk,
                                                             t, regs, acc, nan_bits);
    }
    gemm::store_warp_sums<true>(acc, nan_bits, s_red[warp]);
    __syncthreads();  // the slot's readers and the warps' sums are done
    if (tid == 0 && seg + kSlots < segments) fill(seg + kSlots);
    for (int o = tid; o < count * gemm::kColsPerCta; o += kMmaThreads) {
      const int i = o / gemm::kColsPerCta;
      const int cc = o % gemm::kColsPerCta;
      s_y[(s_seg_row[seg][i] * (p.topk + 1) + s_seg_slot[seg][i]) * gemm::kColsPerCta + cc] =
          gemm::warp_order_sum(s_red, i, cc);
    }
    __syncthreads();  // s_red is free again; s_y holds the segment
  }
  // The combine kernel's sums (combine_sum), from s_y.
  for (int o = tid; o < p.rows * gemm::kColsPerCta; o += kMmaThreads) {
    const int r = o / gemm::kColsPerCta;
    const int cc = o % gemm::kColsPerCta;
    const float* y_r = s_y + r * (p.topk + 1) * gemm::kColsPerCta + cc;
    p.out[static_cast<int64_t>(r) * H + n0 + cc] =
        combine_sum(p, r, [&](int k) { return y_r[k * gemm::kColsPerCta]; });
  }
}

__global__ void moe_combine_kernel(const __grid_constant__ MoeParams p) {
  timeline::mark(p.timeline, kLaunchStart);
  const timeline::MarkOnExit end_mark{p.timeline, kLaunchEnd};
  wait_previous_kernel();
  timeline::mark(p.timeline, kLaunchInputs);
  release_next_kernel();
  const int64_t total = static_cast<int64_t>(p.rows) * p.hidden;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    combine_element(p, i / p.hidden, i % p.hidden);
  }
}

// ---- the persistent kernel (MoeParams::persistent) ----
//
// The whole MoE in one launch of at most one wave of CTAs, which take work items in a fixed order
// from a ticket counter: the router's logits (one item per expert), the shared expert's gate/up
// tiles, the top-k, the shared expert's down column groups, then per expert slot its gate/up
// tiles, per slot its down column groups, and the combine per column group. An item waits only for
// items before it (counters in MoeParams::sync: the router, the shared gate/up, the top-k, each
// slot's gate/up, each column group's downs), and a CTA draws its next ticket only when its item
// is done, so the smallest unfinished item can always run: no deadlock, whatever the residency.
// What it removes: the launch sequence's boundaries, where every kernel's last wave drains before
// the next one's first loads (TP 4 / 8 ranks' short rows make each of them a few microseconds).
// Each item computes exactly what the matching CTA of the launch sequence computes (the same code),
// so the output has the mma kernels' bits. The CTA that draws the last exit ticket (every other CTA
// has drawn one, so every item is done) zeroes the counters for the next launch. A wait that never
// ends (a bug) flags kMoeStatusTimeout in the sync words and goes on: a wrong result, not a hang.
inline constexpr uint32_t kSpinLimit = 1u << 24;  // polls of one wait (~4 s) before giving up

inline constexpr int kDownGroupCols = kMoeDownTiles * gemm::kColsPerCta;  // a down item's columns
inline constexpr int kSyncSlots = 8;  // [E] gate/up items done per slot, then
                                      // [groups] down items done per column group

// First item of each kind, in ticket order (host and device: the host sizes the grid).
struct PersistentItems {
  int shared_gate_up_tiles = 0;  // gate/up tiles of the shared expert
  int gate_up_tiles = 0;         // gate/up tiles of a routed expert
  int slots = 0;                 // expert slots: min(E, rows * topk)
  int groups = 0;                // down / combine column groups of kDownGroupCols
  int shared_gate_up = 0, topk = 0, shared_down = 0, routed_gate_up = 0, routed_down = 0,
      combine = 0, total = 0;
};

__host__ __device__ inline PersistentItems persistent_items(const MoeParams& p) {
  PersistentItems it;
  it.shared_gate_up_tiles = p.shared.inter / kMmaGateUpRows;
  it.gate_up_tiles = p.experts.inter / kMmaGateUpRows;
  it.slots = p.num_experts < p.rows * p.topk ? p.num_experts : p.rows * p.topk;
  it.groups = p.hidden / kDownGroupCols;
  it.shared_gate_up = p.num_experts;  // items 0 .. E - 1: the router's logits
  it.topk = it.shared_gate_up + it.shared_gate_up_tiles;
  it.shared_down = it.topk + 1;
  it.routed_gate_up = it.shared_down + (it.shared_gate_up_tiles > 0 ? it.groups : 0);
  it.routed_down = it.routed_gate_up + it.slots * it.gate_up_tiles;
  it.combine = it.routed_down + it.slots * it.groups;
  it.total = it.combine + it.groups;
  return it;
}

// The sync words: counters (zero between launches), then the sticky status.
inline constexpr int kSyncTicket = 0;
inline constexpr int kSyncRouter = 1;        // router items done
inline constexpr int kSyncSharedGateUp = 2;  // shared gate/up items done
inline constexpr int kSyncTopk = 3;          // 1 once the top-k item is done
inline constexpr int kSyncStatus = 4;        // kMoeStatus* bits, sticky until the host clears them
static_assert(kSyncRouteArrivals > kSyncStatus, "the launch sequence's word is its own");
// Fixed by the config, not the rows: one workspace serves launches of any row count.
__host__ __device__ inline int persistent_sync_words(int num_experts, int hidden) {
  return kSyncSlots + num_experts + hidden / kDownGroupCols;
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* ptr) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// Thread 0 waits until *counter >= target, then the whole CTA goes on with the producers' writes
// visible (read through L2). Once any wait has given up (the status word), the others give up
// too, so a broken launch ends in seconds, not in one spin limit per item.
__device__ __forceinline__ void wait_count(const MoeParams& p, const uint32_t* counter,
                                           uint32_t target) {
  if (threadIdx.x == 0) {
    uint32_t polls = 0;
    while (load_acquire(counter) < target) {
      ++polls;
      const bool given_up =
          (polls & 255u) == 0 && (__ldcg(p.sync + kSyncStatus) & kMoeStatusTimeout) != 0;
      if (given_up || polls > kSpinLimit) {
        atomicOr(p.sync + kSyncStatus, kMoeStatusTimeout);
        break;
      }
      __nanosleep(polls < 64 ? 32 : 256);
    }
    __threadfence();
  }
  __syncthreads();
}

// Publishes the CTA's writes of an item and counts it on `counter`.
__device__ __forceinline__ void count_done(uint32_t* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
  }
}

template <bool kFp8>
__global__ void __launch_bounds__(kMmaThreads, kMmaDeepMinCtasPerSm)
    moe_persistent_kernel(const __grid_constant__ MoeParams p) {
  static_assert(kMmaThreads == kRouteThreads, "one CTA size for the router's items");
  static_assert(kMoeMaxRows * kMoeMaxTopk <= kMmaThreads, "one thread per pick in the top-k");
  __shared__ int tok_row[kMoeMaxRows];
  __shared__ int tok_slot[kMoeMaxRows];
  __shared__ float partial[kRouteWarps][kMoeMaxRows];
  __shared__ TopkScratch s_topk;
  __shared__ float s_red[kMoeDownTiles][kMmaWarps][kSkinnyMaxRows][gemm::kColsPerCta + 1];
  __shared__ int s_item;
  wait_previous_kernel();  // x comes from the previous kernel
  const PersistentItems it = persistent_items(p);
  uint32_t* const sync = p.sync;
  uint32_t* const slot_done = sync + kSyncSlots;
  uint32_t* const group_done = slot_done + p.num_experts;
  const bool has_shared = it.shared_gate_up_tiles > 0;
  const int E = p.num_experts;
  constexpr int kInFlight = kMmaTiledChunksInFlight<kFp8>;
  for (;;) {
    __syncthreads();  // the previous item's shared memory is free
    if (threadIdx.x == 0) s_item = static_cast<int>(atomicAdd(sync + kSyncTicket, 1u));
    __syncthreads();
    const int item = s_item;
    // Timeline (kMoePersistentMarks): the item's start, inputs ready, end; its kind in the tag.
    auto item_mark = [&](int mark) {
      if (p.timeline == nullptr || threadIdx.x != 0) return;
      const int kind = item < it.shared_gate_up   ? 0
                       : item < it.topk           ? 1
                       : item == it.topk          ? 2
                       : item < it.routed_gate_up ? 3
                       : item < it.routed_down    ? 4
                       : item < it.combine        ? 5
                                                  : 6;
      timeline::stamp(p.timeline, item, mark, static_cast<uint32_t>(kind));
    };
    if (item >= it.total) {
      if (item == it.total + static_cast<int>(gridDim.x) - 1) {
        // The last exit ticket: every item is done. Zero the counters for the next launch.
        const int words = persistent_sync_words(p.num_experts, p.hidden);
        for (int w = threadIdx.x; w < words; w += kMmaThreads) {
          if (w != kSyncStatus) sync[w] = 0u;
        }
      }
      return;
    }
    item_mark(0);
    if (item < it.shared_gate_up) {
      route_logits<kRouteLoadsPersistent>(p, item, partial);
      count_done(sync + kSyncRouter);
    } else if (item < it.topk) {
      list_every_row(p, tok_row, tok_slot);
      __syncthreads();
      gate_up_tile<kFp8, kInFlight>(p, true, 0, p.rows, tok_row, tok_slot,
                                    (item - it.shared_gate_up) * kMmaGateUpRows, s_red[0]);
      count_done(sync + kSyncSharedGateUp);
    } else if (item == it.topk) {
      wait_count(p, sync + kSyncRouter, static_cast<uint32_t>(E));
      item_mark(1);
      route_topk(topk_operands(p), s_topk);
      count_done(sync + kSyncTopk);
    } else if (item < it.routed_gate_up) {
      const int group = item - it.shared_down;
      wait_count(p, sync + kSyncSharedGateUp, static_cast<uint32_t>(it.shared_gate_up_tiles));
      item_mark(1);
      int ex = -1;
      const int ntok = slot_tokens(p, 0, true, tok_row, tok_slot, ex);
      down_tiles<kFp8, kInFlight, kMoeDownTiles, true>(p, ex, ntok, tok_row, tok_slot,
                                                       group * kDownGroupCols, s_red);
      count_done(group_done + group);
    } else if (item < it.routed_down) {
      const int slot = (item - it.routed_gate_up) / it.gate_up_tiles;
      const int tile = (item - it.routed_gate_up) % it.gate_up_tiles;
      wait_count(p, sync + kSyncTopk, 1u);
      item_mark(1);
      int ex = -1;
      const int ntok = slot_tokens(p, slot, false, tok_row, tok_slot, ex);
      if (ntok > 0) {
        gate_up_tile<kFp8, kInFlight>(p, false, ex, ntok, tok_row, tok_slot, tile * kMmaGateUpRows,
                                      s_red[0]);
      }
      count_done(slot_done + slot);
    } else if (item < it.combine) {
      const int slot = (item - it.routed_down) / it.groups;
      const int group = (item - it.routed_down) % it.groups;
      wait_count(p, slot_done + slot, static_cast<uint32_t>(it.gate_up_tiles));
      item_mark(1);
      int ex = -1;
      const int ntok = slot_tokens(p, slot, false, tok_row, tok_slot, ex);
      if (ntok > 0) {
        down_tiles<kFp8, kInFlight, kMoeDownTiles, true>(p, ex, ntok, tok_row, tok_slot,
                                                         group * kDownGroupCols, s_red);
      }
      count_done(group_done + group);
    } else {
      const int group = item - it.combine;
      wait_count(p, group_done + group, static_cast<uint32_t>(it.slots + (has_shared ? 1 : 0)));
      item_mark(1);
      for (int o = threadIdx.x; o < p.rows * kDownGroupCols; o += kMmaThreads) {
        combine_element(p, o / kDownGroupCols, group * kDownGroupCols + o % kDownGroupCols);
      }
    }
    item_mark(2);  // thread 0's view: its share done (and, but for combine, the counter bumped)
  }
}

}  // namespace m3msa::cuda::moe
