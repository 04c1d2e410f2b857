// Decode / prefill indexer kernels (docs/spec.md section 4): block scores of the index-K cache
// against the index queries, and the exact top-k block selection. Framework-free: raw pointers, one
// params struct (params.h), launched by indexer.cu.
//
// Scoring. A CTA of 8 warps walks a contiguous span of the batch's blocks (all units' blocks laid
// end to end, split evenly over the grid, so the grid depends only on the plan). Each warp owns 16
// tokens of every block: it reads each 256-byte (bf16) or 128-byte (fp8) token row once, with
// 16-byte loads held in registers a few blocks ahead, and scores the tokens against every query
// vector of the unit (q_len x H <= 32) with mma.sync m16n8k16 (tokens are the m16 side, query
// vectors the n8 side, fp32 accumulation). fp8 e4m3 is widened to bf16 exactly in registers
// (e4m3 -> f16 -> f32 -> bf16; NaN stays NaN). An fp8 index_q against the fp8 cache runs on the
// FP8 tensor cores instead: a warpgroup MMA per k32 step (wgmma m64nNk32 e4m3, the warpgroup's 64
// tokens from the warps' registers, the query vectors staged once per unit in shared memory), each
// step's partial added in fp32 (an sm_90a build; other targets take mma.sync m16n8k32, which
// ptxas lowers to a widening and two f16 MMAs). The reduction axis is permuted so that each thread
// consumes whole 16-byte chunks; A and B use the same permutation, fixed per dtype, so the dot
// product of a token is computed in the same order wherever it is scored: block scores do not
// depend on the span split (the context-parallel path relies on it). Tokens after a row's position
// are masked before the max, which propagates NaN like the CPU reference.
//
// Selection (fused). After each block the 8 warps' partial maxima meet in shared memory; the owner
// lane of each query vector turns the block score into its sort key (forced blocks, NaN, -0.0 per
// docs/spec.md) and appends it to a per-vector buffer if it beats the vector's current k-th key; a
// full buffer is cut back to its top k. When a unit's segment ends, a unit covered by one CTA
// writes its answer directly; otherwise each CTA writes its best min(k, blocks) keys per vector to
// the workspace, and the last CTA to arrive (atomic counter, reset by that CTA for the next launch
// or graph replay) selects the exact top k from them. Keys are unique, so the answer is unique.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cub/block/block_scan.cuh>

#include <climits>
#include <cstdint>

#include "cuda/bulk_copy.cuh"
#include "cuda/indexer_params.h"
#include "cuda/timeline.cuh"
#include "cuda/wgmma.cuh"
#include "m3msa/sort_key.h"

namespace m3msa::cuda::indexer {

inline constexpr int kDim = 128;          // index_dim
inline constexpr int kBlockTokens = 128;  // block_size
inline constexpr int kWarps = 8;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kTokensPerWarp = kBlockTokens / kWarps;  // 16: one m16 tile
inline constexpr int kMaxVectors = 32;                        // query vectors per unit
inline constexpr int kMaxTopk = 32;
inline constexpr int kCap = 64;                             // per-vector key buffer
inline constexpr int kSlotsPerWarp = kMaxVectors / kWarps;  // 4 vectors owned per warp
inline constexpr int kScratch = kSlotsPerWarp * kCap;       // 256 keys of scratch per warp
inline constexpr int kPrefillUnitRows = 8;
inline constexpr int kModeTopk = 0;    // fused scoring + selection
inline constexpr int kModeScores = 1;  // scoring only: block scores to memory (unfused baseline)

// ---------------------------------------------------------------------------------------------
// Small device helpers

__device__ __forceinline__ float nan_max(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ int64_t i64_min(int64_t a, int64_t b) {
  return a < b ? a : b;
}
__device__ __forceinline__ int64_t i64_max(int64_t a, int64_t b) {
  return a > b ? a : b;
}
__device__ __forceinline__ uint64_t u64_max(uint64_t a, uint64_t b) {
  return a > b ? a : b;
}
__device__ __forceinline__ uint64_t u64_min(uint64_t a, uint64_t b) {
  return a < b ? a : b;
}

// Two e4m3 values (low byte = lower element) -> bf16x2, exactly.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t two_bytes) {
  uint32_t h2;
  asm("{\n\t.reg .b16 t;\n\tcvt.u16.u32 t, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, t;\n\t}"
      : "=r"(h2)
      : "r"(two_bytes));
  const float lo = __half2float(__ushort_as_half(static_cast<unsigned short>(h2 & 0xFFFFu)));
  const float hi = __half2float(__ushort_as_half(static_cast<unsigned short>(h2 >> 16)));
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// D += A * B, m16n8k16, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// D += A * B, m16n8k32, fp8 e4m3 inputs (an fp8 index_q against an fp8 cache), fp32 accumulators.
__device__ __forceinline__ void mma_fp8(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The fp8 x fp8 path (kQ8) runs 4 k-steps of 32: step s takes chunk i = s >> 1 (dims 64i + 16t
// of thread t's 16-byte chunk) and its half hi = s & 1: logical k 4t..4t+3 <- dims base+0..3,
// logical k 16+4t..16+4t+3 <- dims base+4..7, base = 64i + 16t + 8hi. The query fragment of
// thread t is then the 8 contiguous bytes at base.
__host__ __device__ constexpr int q8_dim_base(int step, int t) {
  return 64 * (step >> 1) + 16 * t + 8 * (step & 1);
}

// The staged B operand of the FP8 path: 8 vectors x 16 bytes per core matrix, two core matrices
// (logical k 0..15, 16..31) per n-tile of a k32 step, kNT n-tiles per step.
inline constexpr int kQ8CoreBytes = 128;
inline constexpr int kQ8TileBytes = 2 * kQ8CoreBytes;
template <int kNT>
inline constexpr int kQ8StepBytes = kQ8TileBytes* kNT;

// First physical dimension of the 4 dims that thread t feeds into k-step s (see the file
// comment): logical k (2t, 2t+1) <- dims base+0..1, logical k (2t+8, 2t+9) <- dims base+2..3.
template <bool kFp8>
__host__ __device__ constexpr int dim_base(int step, int t) {
  return kFp8 ? 64 * (step >> 2) + 16 * t + 4 * (step & 3)
              : 32 * (step >> 1) + 8 * t + 4 * (step & 1);
}

__device__ __forceinline__ unsigned lane_id() {
  return threadIdx.x & 31u;
}

// ---------------------------------------------------------------------------------------------
// Warp-level exact top-k of unique 64-bit keys (0 = no candidate)

// Bitonic sort, descending, of 32*E keys; element i = lane * E + e.
template <int E>
__device__ __forceinline__ void warp_sort_desc(uint64_t (&v)[E]) {
  const int lane = static_cast<int>(lane_id());
#pragma unroll
  for (int size = 2; size <= 32 * E; size <<= 1) {
#pragma unroll
    for (int j = size >> 1; j > 0; j >>= 1) {
      uint64_t next[E];
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int i = lane * E + e;
        const uint64_t other =
            j < E ? v[e ^ (j < E ? j : 0)] : __shfl_xor_sync(0xFFFFFFFFu, v[e], j / E);
        const bool descending_block = (i & size) == 0;
        const bool low = (i & j) == 0;
        next[e] = (low == descending_block) ? u64_max(v[e], other) : u64_min(v[e], other);
      }
#pragma unroll
      for (int e = 0; e < E; ++e) v[e] = next[e];
    }
  }
}

// Top of <= 64 keys: lane i returns the i-th largest (0 past the end).
template <typename Get>
__device__ __forceinline__ uint64_t warp_top64(Get get, int count) {
  const int lane = static_cast<int>(lane_id());
  uint64_t v[2];
  v[0] = 2 * lane < count ? get(2 * lane) : 0;
  v[1] = 2 * lane + 1 < count ? get(2 * lane + 1) : 0;
  warp_sort_desc<2>(v);
  const uint64_t a = __shfl_sync(0xFFFFFFFFu, v[0], lane >> 1);
  const uint64_t b = __shfl_sync(0xFFFFFFFFu, v[1], lane >> 1);
  return (lane & 1) ? b : a;
}

// The k-th largest of one value per lane (k <= 32), broadcast.
__device__ __forceinline__ uint64_t warp_kth_of_lanes(uint64_t value, int k) {
  uint64_t v[1] = {value};
  warp_sort_desc<1>(v);
  return __shfl_sync(0xFFFFFFFFu, v[0], k - 1);
}

// Exact fallback with bounded memory: streams 32 keys at a time through a running top-32.
template <typename Get>
__device__ uint64_t warp_top_stream(Get get, int count, int k) {
  const int lane = static_cast<int>(lane_id());
  uint64_t run = 0;  // lane i: the i-th largest so far
  uint64_t kth = 0;
  for (int base = 0; base < count; base += 32) {
    uint64_t x = base + lane < count ? get(base + lane) : 0;
    if (x <= kth) x = 0;
    if (__ballot_sync(0xFFFFFFFFu, x != 0) == 0) continue;
    uint64_t v[2] = {run, x};
    warp_sort_desc<2>(v);
    const uint64_t a = __shfl_sync(0xFFFFFFFFu, v[0], lane >> 1);
    const uint64_t b = __shfl_sync(0xFFFFFFFFu, v[1], lane >> 1);
    run = (lane & 1) ? b : a;
    kth = __shfl_sync(0xFFFFFFFFu, run, k - 1);
  }
  return run;
}

// Exact top-k (k <= 32) of `count` unique keys read through get(i): lane i returns the i-th
// largest key (0 when fewer exist). The k-th largest of the 32 lane maxima is a lower bound of the
// answer's k-th key, so only keys at or above it are kept (in `scratch`, kScratch keys,
// warp-private) and the filter is repeated there until <= 64 are left. Keys are read kBatch per
// lane at a time, all loads in flight together (one round trip per 32 * kBatch keys; when the
// keys fit one batch they are read once). Concentrated inputs that overflow the scratch take the
// streaming path. Every lane of the warp must call it.
template <typename Get>
__device__ uint64_t warp_top_keys(Get get, int count, int k, uint64_t* scratch) {
  constexpr int kBatch = 8;
  if (count <= 64) return warp_top64(get, count);
  const unsigned lane = lane_id();
  const unsigned lanes_below = (1u << lane) - 1u;
  const bool one_batch = count <= 32 * kBatch;
  uint64_t v[kBatch];
  uint64_t lane_max = 0;
  // Row m of 32 keys is read rotated by m lanes. Inputs are often lists of k keys sorted
  // descending laid end to end (one per CTA); unrotated, lane l would always hold rank l % k and
  // the k-th lane maximum would be a weak floor (most keys pass, the scratch overflows and the
  // serial streaming path runs). Rotated, every lane sees every rank.
  auto index_of = [&](int base, int j) {
    const int row = base / 32 + j;
    return 32 * row + ((static_cast<int>(lane) + row) & 31);
  };
  for (int base = 0; base < count; base += 32 * kBatch) {
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = index_of(base, j);
      v[j] = i < count ? get(i) : 0;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) lane_max = u64_max(lane_max, v[j]);
  }
  uint64_t floor_key = warp_kth_of_lanes(lane_max, k);
  if (floor_key == 0) floor_key = 1;  // never keep "no candidate"
  int kept = 0;
  for (int base = 0; base < count; base += 32 * kBatch) {
    if (!one_batch) {
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int i = index_of(base, j);
        v[j] = i < count ? get(i) : 0;
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const bool keep = v[j] >= floor_key;
      const unsigned mask = __ballot_sync(0xFFFFFFFFu, keep);
      if (kept + __popc(mask) > kScratch) return warp_top_stream(get, count, k);
      if (keep) scratch[kept + __popc(mask & lanes_below)] = v[j];
      kept += __popc(mask);
    }
  }
  __syncwarp();
  while (kept > 64) {  // each round drops every key of the 32 - k lanes with the smallest maxima
    lane_max = 0;
    for (int i = static_cast<int>(lane); i < kept; i += 32)
      lane_max = u64_max(lane_max, scratch[i]);
    floor_key = warp_kth_of_lanes(lane_max, k);
    int out = 0;
    for (int base = 0; base < kept; base += 32) {
      const int i = base + static_cast<int>(lane);
      const uint64_t x = i < kept ? scratch[i] : 0;
      __syncwarp();
      const bool keep = x != 0 && x >= floor_key;
      const unsigned mask = __ballot_sync(0xFFFFFFFFu, keep);
      if (keep) scratch[out + __popc(mask & lanes_below)] = x;  // out <= base: never ahead
      out += __popc(mask);
      __syncwarp();
    }
    kept = out;
  }
  return warp_top64([&](int i) { return scratch[i]; }, kept);
}

// Writes one (row, head) output row from the keys held by the warp (lane i: i-th largest), in
// descending key order (the CP exchange's rows; the indexer's go through write_key_answer).
__device__ __forceinline__ void write_topk_row(int32_t* out, uint64_t key, int k) {
  const int lane = static_cast<int>(lane_id());
  if (lane < k) out[lane] = key != kNoCandidate ? key_block(key) : -1;
}

// Where the (row, head) answer goes in topk_idx (token- or head-major, rows of any capacity).
__device__ __forceinline__ int32_t* answer_row(const IndexerParams& p, int64_t row, int head) {
  return p.topk_idx + row * p.out_row_stride + head * p.out_head_stride;
}

// Puts a written answer (descending key, then -1) into the order asked for: with out_ascending,
// its valid prefix by ascending block id (ranks by counting across the warp; ids are distinct).
// The whole warp calls it after writing `out`.
__device__ __forceinline__ void order_answer(const IndexerParams& p, int32_t* out) {
  if (!p.out_ascending) return;
  __syncwarp();
  const int lane = static_cast<int>(lane_id());
  const int32_t block = lane < p.topk ? out[lane] : -1;
  const uint32_t mine = block >= 0 ? static_cast<uint32_t>(block) : 0xFFFFFFFFu;
  int rank = 0;
  for (int j = 0; j < 32; ++j) rank += __shfl_sync(0xFFFFFFFFu, mine, j) < mine ? 1 : 0;
  __syncwarp();
  if (block >= 0) out[rank] = block;
  __syncwarp();
}

// Writes one answer row from a warp, lane i holding entry i (descending key, then -1; lanes >= k
// hold -1): as it stands, or with out_ascending its valid prefix by ascending block id.
__device__ __forceinline__ void write_answer(const IndexerParams& p, int32_t* out, int32_t block) {
  const int lane = static_cast<int>(lane_id());
  int at = lane;
  if (p.out_ascending) {
    const uint32_t mine = block >= 0 ? static_cast<uint32_t>(block) : 0xFFFFFFFFu;
    int rank = 0;
    for (int j = 0; j < 32; ++j) rank += __shfl_sync(0xFFFFFFFFu, mine, j) < mine ? 1 : 0;
    if (block >= 0) at = rank;
  }
  if (lane < p.topk) out[at] = block;
}

// write_answer from keys held by the warp (lane i: the i-th largest, or kNoCandidate).
__device__ __forceinline__ void write_key_answer(const IndexerParams& p, int32_t* out,
                                                 uint64_t key) {
  const bool valid = static_cast<int>(lane_id()) < p.topk && key != kNoCandidate;
  write_answer(p, out, valid ? key_block(key) : -1);
}

// The merges' short path: the exact top k of <= 64 candidate keys (unique, or kNoCandidate) at
// src[0, count) straight into `out`, by one warp. Each lane holds two keys and ranks them by
// counting the larger ones across the warp; the key of rank r < k is entry r. One L2 round trip
// and a few dozen instructions in a loop: where a merge has this few candidates (one request of a
// short context) its cost is the code it runs once, on one SM, so the code is kept short. The
// whole warp calls it; the answer is then in the order asked for (order_answer).
__device__ __forceinline__ void write_top_of_few(const IndexerParams& p, const uint64_t* src,
                                                 int count, int32_t* out) {
  const int lane = static_cast<int>(lane_id());
  const int k = p.topk;
  const uint64_t a = lane < count ? __ldcg(src + lane) : kNoCandidate;
  const uint64_t b = 32 + lane < count ? __ldcg(src + 32 + lane) : kNoCandidate;
  int rank_a = 0;
  int rank_b = 0;
#pragma unroll 4
  for (int o = 0; o < 32; ++o) {
    const uint64_t other_a = __shfl_sync(0xFFFFFFFFu, a, o);
    const uint64_t other_b = __shfl_sync(0xFFFFFFFFu, b, o);
    rank_a += (other_a > a) + (other_b > a);
    rank_b += (other_a > b) + (other_b > b);
  }
  const int real = __popc(__ballot_sync(0xFFFFFFFFu, a != kNoCandidate)) +
                   __popc(__ballot_sync(0xFFFFFFFFu, b != kNoCandidate));
  if (a != kNoCandidate && rank_a < k) out[rank_a] = key_block(a);
  if (b != kNoCandidate && rank_b < k) out[rank_b] = key_block(b);
  for (int i = real + lane; i < k; i += 32) out[i] = -1;
  order_answer(p, out);
}
inline constexpr int kFewCandidates = 64;  // write_top_of_few's capacity

// Every answer of rows [row0, row0 + rows) is -1 (dead rows), the CTA's threads striding.
__device__ __forceinline__ void write_dead_answers(const IndexerParams& p, int64_t row0, int rows,
                                                   int tid, int threads) {
  const int k = p.topk;
  for (int i = tid; i < rows * p.heads * k; i += threads) {
    answer_row(p, row0 + i / (p.heads * k), (i / k) % p.heads)[i % k] = -1;
  }
}

// ---------------------------------------------------------------------------------------------
// Units: the decode request / prefill row group a set of query fragments covers

struct Unit {
  int req = 0;
  int row0 = 0;    // first row
  int rows = 0;    // rows of the unit (written even when dead)
  int pos0 = 0;    // position of the first row (rows have consecutive positions)
  int blocks = 0;  // visible blocks of the last row (0: dead unit, nothing to score)
};

__device__ __forceinline__ Unit load_unit(const IndexerParams& p, int u) {
  Unit unit;
  if (p.is_prefill) {
    const int4 d = p.units[u];
    unit.req = d.x;
    unit.row0 = d.y;
    unit.rows = d.z;
    unit.pos0 = d.w;
  } else {
    const int seq_len = p.seq_lens[u];
    unit.req = u;
    unit.row0 = u * p.q_len;
    unit.rows = p.q_len;
    unit.pos0 = seq_len > 0 ? seq_len - p.q_len : -1 - p.q_len;
  }
  const int last = unit.pos0 + unit.rows - 1;
  int blocks = last >= 0 ? last / kBlockTokens + 1 : 0;
  if (blocks > p.table_cols || blocks - 1 > static_cast<int>(kMaxBlockId) ||
      (blocks > 0 && p.num_pages == 0)) {
    blocks = 0;  // rows of an unreadable unit are written as -1
    atomicOr(p.status, kStatusBadLength);
  }
  unit.blocks = blocks;
  return unit;
}

// Visible blocks of a row at `pos` (0 for a dead row).
__device__ __forceinline__ int row_blocks(int pos) {
  return pos >= 0 ? pos / kBlockTokens + 1 : 0;
}

// The CTA that owns block x when T blocks are split evenly over `ctas` (every span non-empty).
__device__ __forceinline__ int block_owner(int64_t x, int64_t total, int ctas) {
  return static_cast<int>(((x + 1) * ctas - 1) / total);
}
__device__ __forceinline__ int64_t span_begin(int c, int64_t total, int ctas) {
  return static_cast<int64_t>(c) * total / ctas;
}

// ---------------------------------------------------------------------------------------------
// Per-block token tile of one warp, held in registers

// 16-byte read-only load that skips L1 (each token row is read once) and asks L2 for the whole
// 256-byte sector pair, so the row's other half arrives with it.
__device__ __forceinline__ uint4 load_stream16(const void* global) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(global));
  return v;
}

// One warp's 16 tokens of one block, held in registers. The main loop keeps kDepth of them in
// flight (loads issued kDepth blocks ahead, consumed in order), so no shared-memory staging and
// no barrier guards the prefetch: a thread only ever reads the registers its own loads filled.
template <bool kFp8>
struct Tile {
  static constexpr int kRowBytes = kFp8 ? kDim : 2 * kDim;
  static constexpr int kPageBytes = kBlockTokens * kRowBytes;
  static constexpr int kLoads = kFp8 ? 4 : 8;  // 16-byte chunks per thread per block
  // Blocks in flight per warp: 64 registers of prefetch per thread for both dtypes, i.e. 32 KB
  // (bf16) or 16 KB (fp8) per block and CTA, 64 KB per CTA in flight.
  static constexpr int kDepth = kFp8 ? 4 : 2;
  uint4 r[kLoads];  // [row half][chunk t + 4i]

  // Thread (g, t) of `warp` loads token rows 16 * warp + g and + 8, chunks t, t + 4, ...
  __device__ __forceinline__ void load(const uint8_t* cache, int64_t page_bytes, int page, int warp,
                                       int g, int t) {
    const uint8_t* base = cache + static_cast<int64_t>(page) * page_bytes +
                          (kTokensPerWarp * warp + g) * kRowBytes + 16 * t;
    constexpr int kChunks = kLoads / 2;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        r[half * kChunks + i] = load_stream16(base + half * 8 * kRowBytes + 64 * i);
      }
    }
  }

  // The same registers from a page staged in shared memory (the split kernel): same offsets, so
  // the same fragments and the same scores bit for bit.
  __device__ __forceinline__ void load_shared(const uint8_t* page, int warp, int g, int t) {
    const uint8_t* base = page + (kTokensPerWarp * warp + g) * kRowBytes + 16 * t;
    constexpr int kChunks = kLoads / 2;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        r[half * kChunks + i] =
            *reinterpret_cast<const uint4*>(base + half * 8 * kRowBytes + 64 * i);
      }
    }
  }

  // The A fragment of fp8 k32-step s (kQ8, see q8_dim_base): the tile's own bytes, no widening.
  __device__ __forceinline__ void fragment_fp8(int s, uint32_t (&a)[4]) const {
    const int i = s >> 1;
    const bool hi = (s & 1) != 0;
    a[0] = hi ? r[i].z : r[i].x;
    a[1] = hi ? r[2 + i].z : r[2 + i].x;
    a[2] = hi ? r[i].w : r[i].y;
    a[3] = hi ? r[2 + i].w : r[2 + i].y;
  }

  // A fragment of k-step s: {row g k(2t..), row g+8 k(2t..), row g k(2t+8..), row g+8 k(2t+8..)}.
  __device__ __forceinline__ void fragment(int s, uint32_t (&a)[4]) const {
    if constexpr (kFp8) {
      const int i = s >> 2;
      const int q = s & 3;
      const uint32_t w0 = q == 0 ? r[i].x : q == 1 ? r[i].y : q == 2 ? r[i].z : r[i].w;
      const uint32_t w1 = q == 0   ? r[2 + i].x
                          : q == 1 ? r[2 + i].y
                          : q == 2 ? r[2 + i].z
                                   : r[2 + i].w;
      a[0] = e4m3x2_to_bf16x2(w0 & 0xFFFFu);
      a[1] = e4m3x2_to_bf16x2(w1 & 0xFFFFu);
      a[2] = e4m3x2_to_bf16x2(w0 >> 16);
      a[3] = e4m3x2_to_bf16x2(w1 >> 16);
    } else {
      const int i = s >> 1;
      const bool upper = (s & 1) != 0;
      a[0] = upper ? r[i].z : r[i].x;
      a[1] = upper ? r[4 + i].z : r[4 + i].x;
      a[2] = upper ? r[i].w : r[i].y;
      a[3] = upper ? r[4 + i].w : r[4 + i].y;
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Steps both scoring kernels share (one copy, so their scores and keys stay bit-identical)

// The unit's query vectors ([rows, H, 128], contiguous) staged with coalesced 16-byte loads (every
// CTA of a unit reads them, so fewer, wider requests matter at small batch), then scattered into
// the B fragments of the token x vector MMAs. `staging` (>= 32 x 128 bf16) is free scratch; the
// caller's next barrier publishes the fragments.
template <bool kFp8, int kNT, bool kQ8 = false>
__device__ __forceinline__ void stage_query_fragments(const IndexerParams& p, const Unit& unit,
                                                      int nvec, uint4* staging,
                                                      uint2 (&bfrag)[kNT][8][32]) {
  static_assert(!kQ8 || kFp8, "an fp8 index_q is scored against an fp8 cache only");
  constexpr int kQBytes = kQ8 ? 1 : 2;
  const int tid = static_cast<int>(threadIdx.x);
  const uint4* src =
      reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(p.index_q) +
                                     static_cast<int64_t>(unit.row0) * p.heads * kDim * kQBytes);
  for (int i = tid; i < nvec * (kDim * kQBytes / 16); i += kThreads) staging[i] = src[i];
  __syncthreads();
  if constexpr (kQ8 && wgmma::kAvailable) {
    // The B operand of the warpgroup MMAs (score_tile): k32 step s of n-tile nt is two core
    // matrices, logical k 0..15 then 16..31, at kQ8StepBytes * s + kQ8TileBytes * nt; logical k 4t
    // + j holds dim q8_dim_base(s, t) + j and k 16 + 4t + j dim q8_dim_base(s, t) + 4 + j (j < 4),
    // the order of the tile's own bytes (Tile::fragment_fp8).
    const uint8_t* q_all = reinterpret_cast<const uint8_t*>(staging);
    uint8_t* b = reinterpret_cast<uint8_t*>(&bfrag[0][0][0]);
    for (int i = tid; i < 4 * kNT * 8 * 2; i += kThreads) {
      const int half = i & 1;  // logical k 0..15 or 16..31
      const int n = (i >> 1) % (kNT * 8);
      const int s = (i >> 1) / (kNT * 8);
      uint32_t w[4] = {0u, 0u, 0u, 0u};
      if (n < nvec) {
#pragma unroll
        for (int tt = 0; tt < 4; ++tt) {
          w[tt] =
              *reinterpret_cast<const uint32_t*>(q_all + n * kDim + q8_dim_base(s, tt) + 4 * half);
        }
      }
      *reinterpret_cast<uint4*>(b + kQ8StepBytes<kNT> * s + kQ8TileBytes * (n >> 3) +
                                kQ8CoreBytes * half + 16 * (n & 7)) =
          make_uint4(w[0], w[1], w[2], w[3]);
    }
    // The MMAs read it through the async proxy: order these generic stores before them.
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  } else if constexpr (kQ8) {
    const uint8_t* q_all = reinterpret_cast<const uint8_t*>(staging);
    for (int i = tid; i < kNT * 4 * 32; i += kThreads) {
      const int nt = i >> 7;
      const int s = (i >> 5) & 3;
      const int ln = i & 31;
      const int n = nt * 8 + (ln >> 2);
      uint2 frag = make_uint2(0u, 0u);
      if (n < nvec) {
        frag = *reinterpret_cast<const uint2*>(q_all + n * kDim + q8_dim_base(s, ln & 3));
      }
      bfrag[nt][s][ln] = frag;
    }
  } else {
    const uint16_t* q_all = reinterpret_cast<const uint16_t*>(staging);
    for (int i = tid; i < kNT * 8 * 32; i += kThreads) {
      const int nt = i >> 8;
      const int s = (i >> 5) & 7;
      const int ln = i & 31;
      const int n = nt * 8 + (ln >> 2);
      uint2 frag = make_uint2(0u, 0u);
      if (n < nvec) {
        frag = *reinterpret_cast<const uint2*>(q_all + n * kDim + dim_base<kFp8>(s, ln & 3));
      }
      bfrag[nt][s][ln] = frag;
    }
  }
}

// Accumulator column e of n-tile nt is vector nt*8 + 2t + e; token row g (and g + 8) of the warp
// is visible to it while block_first + g <= pos, i.e. block_first <= limit = pos - 16 * warp - g.
template <int kNT>
__device__ __forceinline__ void vector_limits(int (&limit)[kNT][2], const Unit& unit, int nvec,
                                              int H, int warp, int g, int t) {
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int n = nt * 8 + 2 * t + e;
      limit[nt][e] = n < nvec ? unit.pos0 + n / H - kTokensPerWarp * warp - g : INT_MIN;
    }
  }
}

// Scores of the warp's 16 tokens against every query vector (fp32 accumulators).
// kBatch: k32 steps of the FP8 path issued per wait (their partials live in registers together).
template <bool kFp8, int kNT, bool kQ8 = false, int kBatch = (kNT <= 2 ? 4 : 2)>
__device__ __forceinline__ void score_tile(const Tile<kFp8>& tile, const uint2 (&bfrag)[kNT][8][32],
                                           float (&acc)[kNT][4]) {
  const int lane = static_cast<int>(lane_id());
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
  if constexpr (kQ8 && wgmma::kAvailable) {
    // The warpgroup's 64 tokens against every vector on the FP8 tensor cores (B staged by
    // stage_query_fragments). Each k32 step starts from zero and the steps are added in fp32 in
    // step order: the FP8 tensor cores keep ~14 mantissa bits of what they accumulate, so a
    // running accumulator would lose bits of the whole sum.
    static_assert(4 % kBatch == 0, "whole batches of k32 steps");
    const uint64_t desc0 = wgmma::kmajor_desc(&bfrag[0][0][0], kQ8CoreBytes, kQ8TileBytes);
#pragma unroll
    for (int s0 = 0; s0 < 4; s0 += kBatch) {
      float part[kBatch][4 * kNT];
      wgmma::fence();
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        uint32_t a[4];
        tile.fragment_fp8(s0 + j, a);
        wgmma::mma_e4m3_k32<kNT>(part[j], a, desc0 + ((kQ8StepBytes<kNT> * (s0 + j)) >> 4));
      }
      wgmma::commit();
      wgmma::wait_all();
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            wgmma::fence_operand(part[j][4 * nt + e]);
            acc[nt][e] += part[j][4 * nt + e];
          }
        }
      }
    }
  } else if constexpr (kQ8) {
    // Each k32 MMA starts from zero and is added in fp32 (as above).
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      uint32_t a[4];
      tile.fragment_fp8(s, a);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const uint2 b = bfrag[nt][s][lane];
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_fp8(part, a[0], a[1], a[2], a[3], b.x, b.y);
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] += part[e];
      }
    }
  } else {
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      uint32_t a[4];
      tile.fragment(s, a);
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        const uint2 b = bfrag[nt][s][lane];
        mma_bf16(acc[nt], a[0], a[1], a[2], a[3], b.x, b.y);
      }
    }
  }
}

// Masks the tokens after each vector's position, takes the max over the warp's 16 tokens (NaN
// propagates) and posts it to `red` ([kNT * 8] floats of this warp).
template <int kNT>
__device__ __forceinline__ void post_warp_maxima(const float (&acc)[kNT][4],
                                                 const int (&limit)[kNT][2], int block_first,
                                                 float* red, int g, int t) {
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) {
    const float neg_inf = -__int_as_float(0x7F800000);
    const int l0 = limit[nt][0];
    const int l1 = limit[nt][1];
    float v0 = nan_max(l0 >= block_first ? acc[nt][0] : neg_inf,
                       l0 >= block_first + 8 ? acc[nt][2] : neg_inf);
    float v1 = nan_max(l1 >= block_first ? acc[nt][1] : neg_inf,
                       l1 >= block_first + 8 ? acc[nt][3] : neg_inf);
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      v0 = nan_max(v0, __shfl_xor_sync(0xFFFFFFFFu, v0, off));
      v1 = nan_max(v1, __shfl_xor_sync(0xFFFFFFFFu, v1, off));
    }
    if (g == 0) *reinterpret_cast<float2*>(&red[nt * 8 + 2 * t]) = make_float2(v0, v1);
  }
}

// The block's score for vector `n`: the max of the warps' posted maxima.
template <int kNT>
__device__ __forceinline__ float block_score(const float (&red)[kWarps][kNT * 8], int n) {
  float score = red[0][n];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) score = nan_max(score, red[w][n]);
  return score;
}

// The scores modes (the span kernel's kModeScores, the split kernel's scores_only): block lb's
// score of (row, head) into p.scores, or the bad-length status bit past the score tensor.
__device__ __forceinline__ void write_block_score(const IndexerParams& p, int64_t row, int head,
                                                  int lb, float score) {
  if (lb < p.score_cols) {
    p.scores[(row * p.heads + head) * p.score_cols + lb] = score;
  } else {
    atomicOr(p.status, kStatusBadLength);
  }
}

// Block lb's sort key for a row with `blocks` visible blocks (docs/spec.md section 4).
__device__ __forceinline__ uint64_t block_key(const IndexerParams& p, float score, int lb,
                                              int blocks) {
  const uint32_t block = static_cast<uint32_t>(lb);
  return is_forced_block(lb, blocks, p.init_blocks, p.local_blocks) ? forced_key(block)
                                                                    : scored_key(score, block);
}

// Cuts every full owner buffer of the warp (kCap keys) back to its top k and raises its floor.
__device__ __forceinline__ void cut_full_buffers(uint64_t* warp_keys, bool owner, int& count,
                                                 uint64_t& kth, int k) {
  const int lane = static_cast<int>(lane_id());
  __syncwarp();  // the owners' appends are read by the whole warp below
  unsigned full = __ballot_sync(0xFFFFFFFFu, owner && count == kCap);
  while (full) {
    const int slot = __ffs(full) - 1;
    full &= full - 1;
    uint64_t* keys = warp_keys + slot * kCap;
    const uint64_t top = warp_top64([&](int j) { return keys[j]; }, kCap);
    __syncwarp();
    if (lane < k) keys[lane] = top;
    const uint64_t new_kth = __shfl_sync(0xFFFFFFFFu, top, k - 1);
    if (lane == slot) {
      count = k;
      kth = new_kth;
    }
    __syncwarp();
  }
}

// The warp's owner buffers when this CTA holds a unit's every block: each vector's top k is the
// answer.
__device__ __forceinline__ void write_own_answers(const IndexerParams& p, const uint64_t* warp_keys,
                                                  int count, const Unit& unit, int nvec) {
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int H = p.heads;
  for (int slot = 0; slot < kSlotsPerWarp; ++slot) {
    const int n = warp + kWarps * slot;
    if (n >= nvec) break;
    const int cnt = __shfl_sync(0xFFFFFFFFu, count, slot);
    const uint64_t* keys = warp_keys + slot * kCap;
    const uint64_t top = warp_top64([&](int j) { return keys[j]; }, cnt);
    write_key_answer(p, answer_row(p, unit.row0 + n / H, n % H), top);
  }
}

// The warp's owner buffers as candidates for the unit's last CTA: `slots` keys per vector (its
// best when it holds more, padded with "no candidate"), vector n's at vec0 + n * vec_stride.
__device__ __forceinline__ void write_own_candidates(const uint64_t* warp_keys, int count, int nvec,
                                                     int slots, uint64_t* vec0,
                                                     int64_t vec_stride) {
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(lane_id());
  for (int slot = 0; slot < kSlotsPerWarp; ++slot) {
    const int n = warp + kWarps * slot;
    if (n >= nvec) break;
    const int cnt = __shfl_sync(0xFFFFFFFFu, count, slot);
    const uint64_t* keys = warp_keys + slot * kCap;
    const uint64_t value = cnt > slots ? warp_top64([&](int j) { return keys[j]; }, cnt)
                                       : (lane < cnt ? keys[lane] : 0);
    if (lane < slots) vec0[n * vec_stride + lane] = value;
  }
}

// The merge kernel's merge of one query vector, with a short dependent chain (a merge's time is its
// chain of shared-memory, shuffle and barrier steps, ~30-45 cycles each on H100, more than its
// instruction count): the exact top k of `count` (<= 16 x 256) candidate keys (unique, or
// kNoCandidate) at src, by the whole CTA. Every thread loads its <= 16 keys in one coalesced
// round trip; a 256-bin histogram over the range of the scored keys' high words (the score
// image; bins keep the keys' order, forced keys take the top bin and NaN keys the bottom one, so
// one forced block or one NaN does not squeeze the scores into a few bins); every warp finds the
// bin b where the count from the top reaches k by itself; the keys of bin b and above are listed
// in a fixed order (warp ballots, no atomics) and ranked by counting. False, with only `smem`
// written, when more than kHistList keys reach bin b (e.g. all scores equal: one bin holds every
// key); the caller then takes another merge.
inline constexpr int kHistBins = 256;
inline constexpr int kHistList = 64;
inline constexpr int kHistSmemBytes = kHistBins * 4 + kHistList * 8 + kMaxTopk * 4 + 3 * kWarps * 4;

// A warp's keys that pass a test, listed without returning atomics: ballot_kept sets masks[e] to
// the lanes whose key slot e passes keep(e) and returns how many keys passed in the warp;
// scatter_kept then hands each of this lane's passing slots its place from `base` in (slot, lane)
// order, store(place, e). The histogram merge and the last CTA's survivors list keys this way.
template <int kN, typename Keep>
__device__ __forceinline__ int ballot_kept(unsigned (&masks)[kN], Keep keep) {
  int kept = 0;
#pragma unroll
  for (int e = 0; e < kN; ++e) {
    masks[e] = __ballot_sync(0xFFFFFFFFu, keep(e));
    kept += __popc(masks[e]);
  }
  return kept;
}

template <int kN, typename Store>
__device__ __forceinline__ void scatter_kept(const unsigned (&masks)[kN], int base, Store store) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const unsigned lower = (1u << lane) - 1u;
#pragma unroll
  for (int e = 0; e < kN; ++e) {
    if ((masks[e] >> lane) & 1u) store(base + __popc(masks[e] & lower), e);
    base += __popc(masks[e]);
  }
}

// How many of the m (<= kHistList) keys at s are larger than key: unconditional 16-byte broadcast
// loads (a branch around them would keep them from pipelining), two running counts.
__device__ __forceinline__ int count_larger(const uint64_t* s, int m, uint64_t key) {
  int a = 0;
  int b = 0;
#pragma unroll
  for (int j = 0; j < kHistList; j += 4) {
    const ulonglong2 p0 = *reinterpret_cast<const ulonglong2*>(s + j);
    const ulonglong2 p1 = *reinterpret_cast<const ulonglong2*>(s + j + 2);
    a += (j < m && p0.x > key) + (j + 1 < m && p0.y > key);
    b += (j + 2 < m && p1.x > key) + (j + 3 < m && p1.y > key);
  }
  return a + b;
}

template <int kKeys>
__device__ bool merge_by_histogram_of(const IndexerParams& p, const uint64_t* src, int count,
                                      uint8_t* smem, int32_t* out) {
  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int k = p.topk;
  int* hist = reinterpret_cast<int*>(smem);                        // [256]
  uint64_t* list = reinterpret_cast<uint64_t*>(hist + kHistBins);  // [64], 16-byte aligned
  int32_t* ans = reinterpret_cast<int32_t*>(list + kHistList);     // [32]
  uint32_t* wmin = reinterpret_cast<uint32_t*>(ans + kMaxTopk);    // [8 warps]
  uint32_t* wmax = wmin + kWarps;                                  // [8 warps]
  int* wcount = reinterpret_cast<int*>(wmax + kWarps);             // [8 warps]

  // Keys, all loads in flight; the shared state cleared while they travel.
  uint64_t x[kKeys];
#pragma unroll
  for (int e = 0; e < kKeys; ++e) {
    const int i = tid + kThreads * e;
    x[e] = i < count ? __ldcg(src + i) : kNoCandidate;
  }
  static_assert(kHistBins == kThreads, "one bin per thread to clear");
  hist[tid] = 0;
  if (tid < kMaxTopk) ans[tid] = -1;
  // The range of the scored keys' high words (not forced, not NaN).
  uint32_t lo = 0xFFFFFFFFu;
  uint32_t hi = 0;
#pragma unroll
  for (int e = 0; e < kKeys; ++e) {
    const uint32_t h = static_cast<uint32_t>(x[e] >> 32);
    if (h != 0 && h != kForcedImage) {
      lo = min(lo, h);
      hi = max(hi, h);
    }
  }
  lo = __reduce_min_sync(0xFFFFFFFFu, lo);
  hi = __reduce_max_sync(0xFFFFFFFFu, hi);
  if (lane == 0) {
    wmin[warp] = lo;
    wmax[warp] = hi;
  }
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    lo = min(lo, wmin[w]);
    hi = max(hi, wmax[w]);
  }
  // Scored keys: bin 1 + (h - lo) * 253 / (range + 1) in float (each step rounds monotonically,
  // so the bins keep the keys' order), clamped to 1..253; forced keys bin 255, NaN keys bin 0.
  const float scale =
      static_cast<float>(kHistBins - 3) / (static_cast<float>(hi >= lo ? hi - lo : 0u) + 1.0f);
  int bins[kKeys];
#pragma unroll
  for (int e = 0; e < kKeys; ++e) {
    const uint32_t h = static_cast<uint32_t>(x[e] >> 32);
    bins[e] = x[e] == kNoCandidate ? -1
              : h == kForcedImage  ? kHistBins - 1
              : h == 0
                  ? 0
                  : 1 + min(kHistBins - 4, static_cast<int>(static_cast<float>(h - lo) * scale));
    if (bins[e] >= 0) atomicAdd(&hist[bins[e]], 1);
  }
  __syncthreads();
  // Every warp: the bin b where the count from the top reaches k (lane 0 holds the 8 top bins);
  // fewer than k keys: every bin.
  int b = 0;
  {
    const int4 c_lo = *reinterpret_cast<const int4*>(hist + kHistBins - 8 - 8 * lane);
    const int4 c_hi = *reinterpret_cast<const int4*>(hist + kHistBins - 4 - 8 * lane);
    const int c[8] = {c_hi.w, c_hi.z, c_hi.y, c_hi.x, c_lo.w, c_lo.z, c_lo.y, c_lo.x};
    int sum = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += c[j];
    int prefix = sum;  // inclusive, from the top bins down
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int other = __shfl_up_sync(0xFFFFFFFFu, prefix, o);
      if (lane >= o) prefix += other;
    }
    const unsigned reach = __ballot_sync(0xFFFFFFFFu, prefix >= k);
    if (reach != 0) {
      int before = prefix - sum;
      int mine = -1;
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // unrolled: c stays in registers
        if (mine < 0 && before + c[j] >= k) mine = kHistBins - 1 - 8 * lane - j;
        before += c[j];
      }
      b = __shfl_sync(0xFFFFFFFFu, mine, __ffs(reach) - 1);
    }
  }
  // The keys of bin b and above, listed in (key slot, warp, lane) order.
  unsigned in[kKeys];
  const int mine = ballot_kept(in, [&](int e) { return bins[e] >= b; });
  if (lane == 0) wcount[warp] = mine;
  __syncthreads();
  int base = 0;
  int listed = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    const int c = wcount[w];
    base += w < warp ? c : 0;
    listed += c;
  }
  if (listed > kHistList) return false;  // every thread reads the same counts
  scatter_kept(in, base, [&](int at, int e) { list[at] = x[e]; });
  __syncthreads();
  // Ranked by counting: the key with r larger ones is entry r.
  if (tid < listed) {
    const uint64_t key = list[tid];
    const int above = count_larger(list, listed, key);
    if (above < k) ans[above] = key_block(key);
  }
  __syncthreads();
  if (warp == 0) write_answer(p, out, lane < k ? ans[lane] : -1);
  return true;
}

__device__ __forceinline__ bool merge_by_histogram(const IndexerParams& p, const uint64_t* src,
                                                   int count, uint8_t* smem, int32_t* out) {
  if (count <= 4 * kThreads) return merge_by_histogram_of<4>(p, src, count, smem, out);
  if (count <= 8 * kThreads) return merge_by_histogram_of<8>(p, src, count, smem, out);
  if (count <= 16 * kThreads) return merge_by_histogram_of<16>(p, src, count, smem, out);
  return false;
}

// Publishes this CTA's candidates and counts its arrival on `counter`: true in the CTA that
// arrives last (of `ctas`), which resets the counter for the next launch or graph replay.
// Every thread calls it; `last` is CTA-shared scratch.
__device__ __forceinline__ bool arrive_last(uint32_t* counter, int ctas, int& last) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t arrived = atomicAdd(counter, 1u);
    last = arrived == static_cast<uint32_t>(ctas - 1);
    if (last) *counter = 0;
  }
  __syncthreads();
  if (last) __threadfence();  // the other CTAs' candidates are visible from here
  return last != 0;
}

// ---------------------------------------------------------------------------------------------
// The scoring / fused-selection kernel
//
// Purpose: decode or prefill indexer; kMode selects fused top-k or scores-only (unfused baseline).
// Grid: any number of CTAs (the plan uses 2 per SM); 256 threads; dynamic shared memory holds the
// units' block prefix sums ((max_units + 1) ints).
// Requires: index_dim = block_size = 128, unit_vectors <= 8 * kNT, topk <= 32, counters zero
// before the launch (left zero after it), prefill units prepared by indexer_prefill_units_kernel.
template <bool kFp8, int kNT, int kMode, bool kQ8 = false>
__global__ void __launch_bounds__(kThreads, 2)
    indexer_span_kernel(const __grid_constant__ IndexerParams p) {
  using TileT = Tile<kFp8>;
  constexpr int kDepth = TileT::kDepth;
  // Dynamic: [units + 1] first block of each unit and the total.
  extern __shared__ __align__(16) int32_t s_prefix[];
  __shared__ __align__(128) uint2 s_bfrag[kNT][8][32];  // B fragments of the unit's query vectors
  __shared__ __align__(16) float s_red[2][kWarps][kNT * 8];    // per-warp partial block maxima
  __shared__ __align__(16) uint64_t s_keys[kWarps][kScratch];  // per-vector buffers / scratch
  __shared__ typename cub::BlockScan<int, kThreads>::TempStorage s_scan;
  __shared__ int s_last;

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int H = p.heads;
  const int k = p.topk;
  const uint8_t* cache = static_cast<const uint8_t*>(p.index_cache);

  // ---- Prologue: block prefix sums over units (every CTA computes them; units are few) ----
  int num_units = p.is_prefill ? min(*p.num_units, p.max_units) : p.num_reqs;
  {
    const int per = (num_units + kThreads - 1) / kThreads;
    const int u_begin = min(num_units, tid * per);
    const int u_end = min(num_units, u_begin + per);
    int local = 0;
    for (int u = u_begin; u < u_end; ++u) local += load_unit(p, u).blocks;
    int running = 0;
    cub::BlockScan<int, kThreads>(s_scan).ExclusiveSum(local, running);
    for (int u = u_begin; u < u_end; ++u) {
      s_prefix[u] = running;
      running += load_unit(p, u).blocks;
    }
    if (tid == kThreads - 1) s_prefix[num_units] = running;
    __syncthreads();
  }
  const int64_t total = s_prefix[num_units];

  // Rows of dead units (padding requests) are all -1; unit u belongs to CTA u % gridDim.x.
  if constexpr (kMode == kModeTopk) {
    for (int u = blockIdx.x; u < num_units; u += gridDim.x) {
      if (s_prefix[u + 1] != s_prefix[u]) continue;
      const Unit unit = load_unit(p, u);
      write_dead_answers(p, unit.row0, unit.rows, tid, kThreads);
    }
  }
  if (total == 0) return;
  const int ctas = static_cast<int>(
      i64_min(gridDim.x, (total + p.min_blocks_per_cta - 1) / p.min_blocks_per_cta));
  const int cta = blockIdx.x;
  if (cta >= ctas) return;
  const int64_t span_lo = span_begin(cta, total, ctas);
  const int64_t span_hi = span_begin(cta + 1, total, ctas);

  // The unit holding span_lo: the last u with prefix[u] <= span_lo.
  int u;
  {
    int lo = 0, hi = num_units - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (s_prefix[mid] <= span_lo) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    u = lo;
  }

  for (int64_t x = span_lo; x < span_hi;) {
    while (s_prefix[u + 1] <= x) ++u;
    const Unit unit = load_unit(p, u);
    const int64_t unit_lo = s_prefix[u];
    const int64_t unit_hi = s_prefix[u + 1];
    const int seg_end = static_cast<int>(i64_min(span_hi, unit_hi) - unit_lo);
    const int lb_begin = static_cast<int>(x - unit_lo);
    const int nblk = seg_end - lb_begin;
    x = i64_min(span_hi, unit_hi);
    const int nvec = unit.rows * H;

    // ---- Segment setup: page windows (first: their loads overlap the rest), query
    // fragments, masks, owner state ----
    const int32_t* table_row = p.block_table + static_cast<int64_t>(unit.req) * p.table_cols;
    auto load_window = [&](int w) -> int {
      const int i = 32 * w + lane;
      int page = 0;
      if (i < nblk) {
        page = table_row[lb_begin + i];
        if (page < 0 || page >= p.num_pages) {
          atomicOr(p.status, kStatusBadPage);
          page = 0;
        }
      }
      return page;
    };
    int window0 = load_window(0);
    int window1 = nblk > 32 ? load_window(1) : 0;
    auto page_of = [&](int i) {
      const int src = ((i >> 5) & 1) ? window1 : window0;
      return __shfl_sync(0xFFFFFFFFu, src, i & 31);
    };
    // s_keys is free here and only used after the next barrier.
    stage_query_fragments<kFp8, kNT, kQ8>(p, unit, nvec, reinterpret_cast<uint4*>(&s_keys[0][0]),
                                          s_bfrag);
    int limit[kNT][2];
    vector_limits<kNT>(limit, unit, nvec, H, warp, g, t);
    // Owner lane `lane` (< 4) of warp `warp` keeps vector warp + 8 * lane.
    const int own_n = warp + kWarps * lane;
    const bool owner = lane < kSlotsPerWarp && own_n < nvec;
    int own_blocks = 0;
    int own_row = 0;
    int own_head = 0;
    if (owner) {
      own_row = unit.row0 + own_n / H;
      own_head = own_n % H;
      own_blocks = row_blocks(unit.pos0 + own_n / H);
    }
    int count = 0;     // keys in the owner's buffer
    uint64_t kth = 0;  // keys <= kth can no longer make the top k
    uint64_t* my_keys = &s_keys[warp][(lane & (kSlotsPerWarp - 1)) * kCap];

    __syncthreads();  // fragments ready

    // Prologue: the first kDepth blocks in flight.
    TileT pipe[kDepth];
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (d < nblk) pipe[d].load(cache, p.page_bytes, page_of(d), warp, g, t);
    }

    // The loop is unrolled by kDepth so that every pipe slot is a fixed set of registers.
#pragma unroll 1
    for (int i0 = 0; i0 < nblk; i0 += kDepth) {
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        const int i = i0 + d;
        if (i >= nblk) break;  // uniform across the CTA
        const int lb = lb_begin + i;

        float acc[kNT][4];
        // Fewer FP8 partials at once than the split kernel: the register pipe holds kDepth tiles.
        score_tile<kFp8, kNT, kQ8, (kNT <= 1 ? 2 : 1)>(pipe[d], s_bfrag, acc);
        // The slot is consumed: refill it with block i + kDepth (before the barrier below, so the
        // loads fly while the CTA reduces and selects).
        const int ahead = i + kDepth;
        if (ahead < nblk) {
          // Entering page window W = ahead / 32: fetch window W + 1 into the slot of W - 1.
          if ((ahead & 31) == 0 && ahead >= 32) {
            const int w = (ahead >> 5) + 1;
            if (32 * w < nblk) {
              const int page = load_window(w);
              if (w & 1) {
                window1 = page;
              } else {
                window0 = page;
              }
            }
          }
          pipe[d].load(cache, p.page_bytes, page_of(ahead), warp, g, t);
        }
        const int parity = i & 1;
        post_warp_maxima<kNT>(acc, limit, kBlockTokens * lb, &s_red[parity][warp][0], g, t);
        __syncthreads();

        // Owners: block score -> sort key -> buffer (or -> score tensor).
        if (owner && lb < own_blocks) {
          const float score = block_score<kNT>(s_red[parity], own_n);
          if constexpr (kMode == kModeScores) {
            write_block_score(p, own_row, own_head, lb, score);
          } else {
            const uint64_t key = block_key(p, score, lb, own_blocks);
            if (key > kth) my_keys[count++] = key;
          }
        }
        if constexpr (kMode == kModeTopk) cut_full_buffers(&s_keys[warp][0], owner, count, kth, k);
      }
    }

    // ---- Segment end ----
    if constexpr (kMode == kModeTopk) {
      __syncwarp();  // owners' buffers are read by their whole warp
      const int c_lo = block_owner(unit_lo, total, ctas);
      const int c_hi = block_owner(unit_hi - 1, total, ctas);
      const int segs = c_hi - c_lo + 1;
      if (segs == 1) {
        write_own_answers(p, &s_keys[warp][0], count, unit, nvec);  // the whole unit is here
      } else {
        // Slots of every segment of the unit: min(k, its blocks); this CTA's offset and the total.
        int my_offset = 0;
        int unit_slots = 0;
        for (int sidx = lane; sidx < segs; sidx += 32) {
          const int c = c_lo + sidx;
          const int64_t lo = i64_max(span_begin(c, total, ctas), unit_lo);
          const int64_t hi = i64_min(span_begin(c + 1, total, ctas), unit_hi);
          const int slots = static_cast<int>(i64_min(k, hi - lo));
          unit_slots += slots;
          if (c < cta) my_offset += slots;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
          unit_slots += __shfl_xor_sync(0xFFFFFFFFu, unit_slots, off);
          my_offset += __shfl_xor_sync(0xFFFFFFFFu, my_offset, off);
        }
        const int64_t region = (static_cast<int64_t>(c_lo) + u) * k * p.unit_vectors;
        const int64_t vec_stride = static_cast<int64_t>(segs) * k;
        write_own_candidates(&s_keys[warp][0], count, nvec, min(k, nblk),
                             p.cand + region + my_offset, vec_stride);
        if (arrive_last(&p.counters[u], segs, s_last)) {
          for (int slot = 0; slot < kSlotsPerWarp; ++slot) {
            const int n = warp + kWarps * slot;
            if (n >= nvec) break;
            const uint64_t* src = p.cand + region + n * vec_stride;
            const uint64_t top = warp_top_keys([&](int j) { return __ldcg(src + j); }, unit_slots,
                                               k, &s_keys[warp][0]);
            int32_t* out = answer_row(p, unit.row0 + n / H, n % H);
            write_key_answer(p, out, top);
            __syncwarp();
          }
        }
      }
    }
    __syncthreads();  // buffers and fragments are rebuilt for the next segment
  }
}

// ---------------------------------------------------------------------------------------------
// The split decode kernel
//
// Purpose: the decode indexer with every request's blocks spread over many CTAs and the pages
// streamed by the bulk-copy engine, so that a few long requests still read at the HBM rate.
// Grid: (splits, num_reqs); 256 threads; 2 CTAs per SM. Request r's visible blocks go to
// active = ceil(blocks / per) CTAs of at most per = max(min_blocks_per_cta, ceil(blocks / splits))
// blocks each: CTA (s, r) takes block s, then blocks active + s (per - 1) .. active + (s + 1)
// (per - 1) - 1 (CTAs past `active` return at once), so the split follows the live sequence
// length without a prefix sum over the batch. A CTA's first block is its index whatever the
// length, so its table entry is read beside the length instead of after it (one round trip less
// before the first page); the rest are contiguous, so the ring's later entries share cache lines.
// One thread streams the CTA's pages into a ring of kSplitRingBytes of shared memory with
// cp.async.bulk (one whole page per copy, its mbarrier counting the bytes); the warps read their
// 16 token rows from there into the same registers as the fused kernel's Tile::load, so block
// scores and keys are bit-identical to it. Each CTA keeps its best min(k, per) keys per query
// vector and writes them to the workspace; the merge kernel (p.separate_merge) or the last CTA of
// the request (arrival counter, reset by that CTA) selects the exact top k per vector from them,
// the latter in one L2 round trip: lane-maximum floors cut each slice down to a few survivors,
// which are ranked by counting (see the merge below); at most kFewCandidates per vector (a short
// context) are ranked directly, a warp per vector (write_top_of_few).
// Requires: decode; index_dim = block_size = 128, unit_vectors <= 8 * kNT, topk <= 32, counters
// zero before the launch (left zero after it), 16-byte aligned cache pages.
inline constexpr int kSplitRingBytes = 64 * 1024;  // 2 CTAs per SM
// A CTA whose blocks all fit the ring (few blocks per CTA: one or a few long requests) requests
// only this many pages at its start and each further one when the page kSplitFirstPages before
// it has arrived. All of them at once put the whole grid's bytes in flight together, and DRAM
// completes every page near the end of the wave (a page is done when its last line is); half
// the first wave completes each CTA's first pages sooner, so scoring overlaps the rest (H100, 1
// request / 128K fp8: the median first page 5.4 -> 4.3 us after the CTAs' start). A CTA with more
// blocks than slots starts with the ring full: there the deeper start keeps HBM busier.
inline constexpr int kSplitFirstPages = 2;

template <bool kFp8, int kNT, bool kQ8 = false>
__global__ void __launch_bounds__(kThreads, 2)
    indexer_split_kernel(const __grid_constant__ IndexerParams p) {
  using TileT = Tile<kFp8>;
  constexpr int kPageBytes = TileT::kPageBytes;
  constexpr int kRingBytes = kSplitRingBytes;
  constexpr int kRing = kRingBytes / kPageBytes;      // 2 bf16 pages, 4 fp8 pages
  extern __shared__ __align__(128) uint8_t s_ring[];  // [kRing][kPageBytes], then staged keys
  __shared__ __align__(8) uint64_t s_full[kRing];
  __shared__ __align__(128) uint2 s_bfrag[kNT][8][32];
  __shared__ __align__(16) float s_red[2][kWarps][kNT * 8];
  __shared__ __align__(16) uint64_t s_keys[kWarps][kScratch];
  __shared__ int s_survivor_count[kMaxVectors];
  __shared__ int s_survivor_first[kMaxVectors + 1];
  __shared__ int s_last;

  const int tid = static_cast<int>(threadIdx.x);
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int H = p.heads;
  const int k = p.topk;
  const int r = blockIdx.y;
  const int split = blockIdx.x;
  const int splits = gridDim.x;
  // Timeline marks (kIndexerSplitMarks; skipped unless a recorder set p.timeline).
  enum { kStart, kFirstPage, kScored, kCandidates, kArrived, kSurvivors, kEnd };
  timeline::mark(p.timeline, kStart);
  const timeline::MarkOnExit end_mark{p.timeline, kEnd};
  // The next kernel, if launched programmatically dependent (the merge kernel, or an attention
  // with pdl), may be scheduled now: its CTAs wait (griddepcontrol.wait) until this grid has
  // finished and its writes are visible, and may read what this grid does not write before that.
  asm volatile("griddepcontrol.launch_dependents;\n" :::);

  // The table entry of the CTA's first block (block `split` whatever the length), read beside the
  // request's length (decode: the request is r).
  int first_page = -1;
  if (tid == 0 && !p.is_prefill && split < p.table_cols) {
    first_page = p.block_table[static_cast<int64_t>(r) * p.table_cols + split];
  }
  const Unit unit = load_unit(p, r);
  const int nvec = unit.rows * H;
  // Scores only (p.scores_only, the CP shard scoring): every block score of the CTA's range to
  // p.scores, as the span kernel's scores mode writes them (the same bits), and no selection.
  const bool scores_only = p.scores_only != 0;
  if (unit.blocks == 0) {  // padding request or unreadable length: every row -1
    if (split == 0 && !scores_only) write_dead_answers(p, unit.row0, unit.rows, tid, kThreads);
    timeline::set_kind(p.timeline, 2);
    return;
  }
  const int per = max(p.min_blocks_per_cta, (unit.blocks + splits - 1) / splits);
  const int active = (unit.blocks + per - 1) / per;
  if (split >= active) {
    timeline::set_kind(p.timeline, 2);
    return;
  }
  // This CTA's blocks: block `split`, then its share of the blocks past the first `active`, cut
  // into contiguous ranges of per - 1 (so the refills' table entries share cache lines); nblk <=
  // per, and every block is some CTA's since blocks <= active * per.
  const int rest0 = active + split * (per - 1);
  const int nblk = 1 + max(0, min(per - 1, unit.blocks - rest0));
  const int32_t* table_row = p.block_table + static_cast<int64_t>(unit.req) * p.table_cols;
  auto block_of = [&](int i) { return i == 0 ? split : rest0 + i - 1; };
  const uint8_t* cache = static_cast<const uint8_t*>(p.index_cache);
  auto checked_page = [&](int page) {
    if (page < 0 || page >= p.num_pages) {
      atomicOr(p.status, kStatusBadPage);
      page = 0;
    }
    return page;
  };

  // Slot d <- the page (checked), its bytes counted on the slot's barrier.
  auto copy_page = [&](int d, int page) {
    mbar_expect_tx(&s_full[d], kPageBytes);
    bulk_copy(s_ring + d * kPageBytes, cache + static_cast<int64_t>(page) * p.page_bytes,
              kPageBytes, &s_full[d]);
  };

  // The first pages in flight before anything else waits: `first` of them; slot d >= first gets
  // block d when block d - first has arrived (kSplitFirstPages).
  const int first = nblk <= kRing ? min(kSplitFirstPages, kRing) : kRing;
  int entry[kRing];  // thread 0: the ring's first table entries
  if (tid == 0) {
#pragma unroll
    for (int d = 0; d < kRing; ++d) mbar_init(&s_full[d], 1);
    mbar_init_fence();
#pragma unroll
    for (int d = 0; d < kRing; ++d) {
      entry[d] = d == 0 && !p.is_prefill ? first_page : d < nblk ? table_row[block_of(d)] : 0;
    }
#pragma unroll
    for (int d = 0; d < kRing; ++d) {
      if (d >= first || d >= nblk) break;
      copy_page(d, checked_page(entry[d]));
    }
  }
  // Query vectors -> B fragments (staged through s_keys, free until the first block).
  stage_query_fragments<kFp8, kNT, kQ8>(p, unit, nvec, reinterpret_cast<uint4*>(&s_keys[0][0]),
                                        s_bfrag);
  int limit[kNT][2];
  vector_limits<kNT>(limit, unit, nvec, H, warp, g, t);
  const int own_n = warp + kWarps * lane;
  const bool owner = lane < kSlotsPerWarp && own_n < nvec;
  const int own_blocks = owner ? row_blocks(unit.pos0 + own_n / H) : 0;
  int count = 0;
  uint64_t kth = 0;
  uint64_t* my_keys = &s_keys[warp][(lane & (kSlotsPerWarp - 1)) * kCap];
  __syncthreads();  // fragments ready, s_keys free again, barriers initialised

#pragma unroll 1
  for (int i = 0; i < nblk; ++i) {
    const int slot = i % kRing;
    const bool refill = tid == 0 && i + kRing < nblk;
    int next_page = 0;
    if (refill) next_page = table_row[block_of(i + kRing)];  // in flight while i is scored
    mbar_wait(&s_full[slot], (i / kRing) & 1);
    if (i == 0) timeline::mark(p.timeline, kFirstPage);
    if (tid == 0 && i + first < nblk && i + first < kRing) {  // a slot's first fill, late
      const int d = i + first;
      int late_entry = 0;  // entry[d] without indexing the array at run time (no local memory)
#pragma unroll
      for (int x = 0; x < kRing; ++x) late_entry = x == d ? entry[x] : late_entry;
      copy_page(d, checked_page(late_entry));
    }
    TileT tile;
    tile.load_shared(s_ring + slot * kPageBytes, warp, g, t);
    float acc[kNT][4];
    score_tile<kFp8, kNT, kQ8>(tile, s_bfrag, acc);
    const int lb = block_of(i);
    const int parity = i & 1;
    post_warp_maxima<kNT>(acc, limit, kBlockTokens * lb, &s_red[parity][warp][0], g, t);
    __syncthreads();  // every warp is done with the slot and has posted its maxima
    if (refill) {
      const int page = checked_page(next_page);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      copy_page(slot, page);
    }
    if (scores_only) {
      if (owner && lb < own_blocks) {
        write_block_score(p, unit.row0 + own_n / H, own_n % H, lb,
                          block_score<kNT>(s_red[parity], own_n));
      }
      continue;
    }
    if (owner && lb < own_blocks) {
      const uint64_t key = block_key(p, block_score<kNT>(s_red[parity], own_n), lb, own_blocks);
      if (key > kth) my_keys[count++] = key;
    }
    cut_full_buffers(&s_keys[warp][0], owner, count, kth, k);
  }
  __syncwarp();
  timeline::mark(p.timeline, kScored);
  if (scores_only) return;

  // ---- This CTA's best keys: the answer itself, or candidates for the request's last CTA ----
  if (active == 1) {
    write_own_answers(p, &s_keys[warp][0], count, unit, nvec);
    timeline::mark(p.timeline, kCandidates);
    return;
  }
  const int slots = min(k, per);  // keys per CTA and vector (padded with "no candidate")
  const int cand_count = active * slots;
  const int64_t vec_stride = static_cast<int64_t>(splits) * k;
  uint64_t* region = p.cand + static_cast<int64_t>(r) * p.unit_vectors * vec_stride;
  write_own_candidates(&s_keys[warp][0], count, nvec, slots, region + split * slots, vec_stride);
  timeline::mark(p.timeline, kCandidates);
  if (p.separate_merge) return;  // indexer_split_merge_kernel selects
  const bool last = arrive_last(&p.counters[r], active, s_last);
  timeline::mark(p.timeline, kArrived);
  if (!last) return;
  timeline::set_kind(p.timeline, 1);
  if (cand_count <= kFewCandidates) {  // a short context: one warp per vector, one round trip
    for (int v = warp; v < nvec; v += kWarps) {
      write_top_of_few(p, region + v * vec_stride, cand_count,
                       answer_row(p, unit.row0 + v / H, v % H));
    }
    return;
  }
  // The request's merge, one L2 round trip deep. Jobs of (vector, slice of <= kSliceKeys keys)
  // go to the warps; a warp loads its slice with every load in flight, takes the k-th largest of
  // its 32 lane maxima as a floor (k distinct keys of the slice are >= it, so every key of the
  // vector's top k is too) and appends the keys at or above it to the vector's survivor list in
  // shared memory. Then each vector's survivors are ranked by counting: survivor i with rank
  // < k is the answer's entry i. A list that overflows takes the exact streaming path instead.
  constexpr int kSliceLoads = 16;
  constexpr int kSliceKeys = 32 * kSliceLoads;
  constexpr int kSurvivorCap = 128;
  static_assert(kMaxVectors * (kSurvivorCap * 8 + kMaxTopk * 4) <= kRingBytes,
                "survivor lists and answers fit the ring");
  uint64_t* survivors = reinterpret_cast<uint64_t*>(s_ring);  // [nvec][kSurvivorCap]
  if (tid < nvec) s_survivor_count[tid] = 0;
  __syncthreads();
  const int slices = (cand_count + kSliceKeys - 1) / kSliceKeys;
  for (int job = warp; job < nvec * slices; job += kWarps) {
    const int v = job / slices;
    const int lo = (job - v * slices) * kSliceKeys;
    const int n = min(kSliceKeys, cand_count - lo);
    const uint64_t* src = region + v * vec_stride + lo;
    uint64_t x[kSliceLoads];
    uint64_t lane_max = 0;
#pragma unroll
    for (int e = 0; e < kSliceLoads; ++e) {
      const int i = e * 32 + lane;
      x[e] = i < n ? __ldcg(src + i) : 0;
    }
#pragma unroll
    for (int e = 0; e < kSliceLoads; ++e) lane_max = u64_max(lane_max, x[e]);
    // Rank of this lane's maximum among the 32 (equal maxima are only "no candidate" zeros).
    int rank = 0;
#pragma unroll
    for (int o = 0; o < 32; ++o) {
      const uint64_t other = __shfl_sync(0xFFFFFFFFu, lane_max, o);
      rank += other > lane_max || (other == lane_max && o < lane);
    }
    const unsigned at_k = __ballot_sync(0xFFFFFFFFu, rank == k - 1);
    uint64_t floor_key = __shfl_sync(0xFFFFFFFFu, lane_max, __ffs(at_k) - 1);
    if (floor_key == 0) floor_key = 1;  // fewer than k lanes hold keys: keep every key
    // The slice's survivors appended with one shared atomic for the warp.
    unsigned keep[kSliceLoads];
    const int kept = ballot_kept(keep, [&](int e) { return x[e] >= floor_key; });
    int base = 0;
    if (lane == 0) base = atomicAdd(&s_survivor_count[v], kept);
    base = __shfl_sync(0xFFFFFFFFu, base, 0);
    scatter_kept(keep, base, [&](int at, int e) {
      if (at < kSurvivorCap) survivors[v * kSurvivorCap + at] = x[e];
    });
  }
  __syncthreads();
  timeline::mark(p.timeline, kSurvivors);
  // Every vector's survivors ranked by the whole CTA, a thread per survivor (the lists in one
  // index space through their prefix sums), into answers in shared memory; lists that overflowed
  // take the streaming path below.
  int32_t* answers = reinterpret_cast<int32_t*>(survivors + kMaxVectors * kSurvivorCap);
  if (warp == 0) {
    const int cnt = lane < nvec ? s_survivor_count[lane] : 0;
    int first = cnt <= kSurvivorCap ? cnt : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int other = __shfl_up_sync(0xFFFFFFFFu, first, o);
      if (lane >= o) first += other;
    }
    s_survivor_first[lane + 1] = first;  // inclusive: the next list's first index
    if (lane == 0) s_survivor_first[0] = 0;
  }
  for (int j = tid; j < nvec * kMaxTopk; j += kThreads) answers[j] = -1;
  __syncthreads();
  const int listed = s_survivor_first[nvec];
  for (int j = tid; j < listed; j += kThreads) {
    int v = 0;
    while (s_survivor_first[v + 1] <= j) ++v;
    const int cnt = s_survivor_count[v];
    const uint64_t* list = survivors + v * kSurvivorCap;
    const uint64_t key = list[j - s_survivor_first[v]];
    int above = 0;
#pragma unroll 4
    for (int i = 0; i < cnt; ++i) above += list[i] > key;
    if (above < k) answers[v * kMaxTopk + above] = key_block(key);
  }
  __syncthreads();
  for (int v = warp; v < nvec; v += kWarps) {
    int32_t block = lane < k ? answers[v * kMaxTopk + lane] : -1;
    if (s_survivor_count[v] > kSurvivorCap) {
      const uint64_t* src = region + v * vec_stride;
      const uint64_t top =
          warp_top_keys([&](int j) { return __ldcg(src + j); }, cand_count, k, &s_keys[warp][0]);
      block = lane < k && top != kNoCandidate ? key_block(top) : -1;
    }
    write_answer(p, answer_row(p, unit.row0 + v / H, v % H), block);
  }
}

}  // namespace m3msa::cuda::indexer
