// Block-sparse GQA attention kernel (docs/spec.md, section 5). Framework-free: raw pointers, one
// params struct (AttentionParams), launched by attention.cu.
//
// One CTA of 4 warps handles one (row, kv head, split). The 16 query heads of the KV head are the
// m16 side of mma.sync m16n8k16 (bf16 KV: bf16 operands, the softmax weights split into hi + lo
// bf16 parts; fp8 KV: f16 operands, since every e4m3 value is exact in f16 and f16 weights keep
// 11 bits; fp32 accumulation either way). The split's selected blocks are streamed as chunks
// (K tile + V tile) through a cp.async pipeline into XOR-swizzled shared memory (KvLayout: bf16
// 64 tokens, 32 KB, in 3 stages; fp8 one row per CTA a whole 128-token block, 32 KB, in 3 stages;
// fp8 rows grouped 64 tokens, 16 KB, in 4; the deep pipeline, one row per CTA: one CTA of 8
// warps per SM with 192 KB of stages); each warp takes its share of a chunk (as 16-token
// pieces) and keeps its own online softmax (exp2 domain, lazily rescaled) and 16x128 fp32
// accumulator, so warps never wait on each other inside a chunk. The epilogue merges the warps in
// shared memory; when the (row, kv head) is split over several CTAs, the splits merge either
// through a thread-block cluster (DSMEM, each rank merging a share of the output dims) or through
// (O, max, sum) partials in the workspace that the last CTA to arrive (an atomic counter it resets)
// merges. Both merge in split order, so results are deterministic. In the balanced plan (one wave
// of one-row CTAs) a CTA takes an equal share of the flattened (unit, selection entry) list
// instead, one unit's segment after another (balanced_segment); a unit cut by shares' boundaries
// merges its parts through the workspace the same way.
//
// Several decode rows of one request (speculative tokens, q_len > 1) share a CTA: kTiles rows,
// one m16 tile each, 4 / kTiles warps per tile, each warp taking 16 * kTiles tokens of a chunk.
// The CTA streams the union of its rows' selections (deduplicated in shared memory, first
// appearance order, each entry tagged with the rows that selected it), so a block selected by
// several rows is read once; a warp skips the chunks its row did not select and masks the tokens
// after its row's position. Rows that share one selection cost the bytes of one row.
//
// Dimension permutations: the reduction axis of an mma may be permuted freely as long as A and B
// agree, so each thread reads whole 16-byte chunks of a K row, and the V output columns are
// permuted so each thread reads whole chunks of a V row (out_dim() undoes it in the epilogue).
//
// Requirements (checked by the launcher): head_dim = block_size = 128, at most 16 query heads per
// KV head, contiguous q / out / tables; K and V are strided views (page, head, token strides in
// whole 16-byte units, so every copy stays one aligned 16-byte cp.async); more than one split
// needs the workspace partials or a cluster.
#pragma once

#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/arrival.cuh"
#include "cuda/attention_params.h"
#include "cuda/timeline.cuh"

namespace m3msa::cuda::attention {

inline constexpr int kHeadDim = 128;
inline constexpr int kBlockTokens = 128;
inline constexpr int kChunkTokens = 64;
inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kTileHeads = 16;                 // query heads per CTA (m16)
inline constexpr int kMaxRoundBlocks = 64;            // blocks whose pages are looked up at once
inline constexpr int kMergeStride = kHeadDim + 4;     // padded fp32 row of the warp merge
inline constexpr int kMergeUnits = kMergeStride / 4;  // its 16-byte units (33: odd, see merge_unit)
inline constexpr float kLazyRescale = 8.0f;           // log2 units; softmax weights stay <= 256
inline constexpr int kMaxMergeSplits = 64;            // splits a global merge handles
inline constexpr int kMaxClusterRanks = 16;           // splits a cluster merge handles
inline constexpr int kMaxRowTiles = 4;                // decode rows of one request per CTA
inline constexpr int kMaxGroupedTopk = 32;            // topk a CTA of several rows takes

// Cluster barrier halves (PTX barrier.cluster): every thread of every rank arrives, then waits.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// kTiles: the m16 tiles (decode rows) one CTA takes; each needs its own published partial.
// kDeep (one row per CTA): the deep pipeline, one CTA of 8 warps per SM with 192 KB of stages
// (fp8 6 of 32 KB, bf16 3 of 64 KB: whole blocks), for grids of one CTA per SM on part of the
// SMs, where a CTA alone on its SM keeps 128-160 KB of copies in flight.
template <bool kFp8, int kTiles = 1, bool kDeep = false>
struct KvLayout {
  static_assert(!kDeep || kTiles == 1, "the deep pipeline is one row per CTA");
  static constexpr int kWarps = kDeep ? 2 * attention::kWarps : attention::kWarps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowBytes = kHeadDim * (kFp8 ? 1 : 2);
  static constexpr int kRowChunks = kRowBytes / 16;
  // fp8 one row per CTA, and the deep pipeline (bf16 too): a whole 128-token block per chunk (fp8:
  // 32 KB of K + V, as a bf16 chunk of 64 tokens), each warp 32 tokens of it (16 in the deep
  // pipeline's 8 warps); otherwise 64 tokens.
  static constexpr int kChunk = (kFp8 && kTiles == 1) || kDeep ? kBlockTokens : kChunkTokens;
  static constexpr int kChunksPerBlock = kBlockTokens / kChunk;
  static constexpr int kTileBytes = kChunk * kRowBytes;  // one K (or V) chunk
  static constexpr int kStageBytes = 2 * kTileBytes;
  // Pipeline depth: 3 stages of 32 KB keep two CTAs (96 KB each) per SM (bf16; fp8 one row per
  // CTA); 4 fp8 stages of 64-token chunks (64 KB) keep three CTAs per SM (fp8 rows grouped).
  static constexpr int kStages = kDeep                      ? 192 * 1024 / kStageBytes
                                 : kStageBytes >= 32 * 1024 ? 3
                                                            : 4;
  static constexpr int kCtasPerSm = kDeep ? 1 : kStageBytes >= 32 * 1024 ? 2 : 3;
  static constexpr int kPipeBytes = kStages * kStageBytes;
  static constexpr int kMergeBytes =
      (kWarps * kTileHeads * kMergeStride + kWarps * kTileHeads * 2) * 4;
  // The split's partial, published for the cluster merge (after the warp-merge area).
  static constexpr int kPublishBytes = kTiles * (kTileHeads * kHeadDim + kTileHeads * 2) * 4;
  static constexpr int kEpilogueBytes = kMergeBytes + kPublishBytes;
  static constexpr int kSharedBytes = kPipeBytes > kEpilogueBytes ? kPipeBytes : kEpilogueBytes;
  // One row per CTA: where the other ranks of a cluster push their slices of this rank's output
  // dims ([ranks][16][128 / ranks] partial outputs, then [ranks][16] (max, sum)), apart from
  // the pipeline, which this rank may still be streaming when a faster rank pushes.
  static constexpr int kRecvOffset = (kSharedBytes + 15) / 16 * 16;
  static constexpr int kRecvBytes =
      kTiles == 1 ? (kTileHeads * kHeadDim + kMaxClusterRanks * kTileHeads * 2) * 4 : 0;
  static constexpr int kSmemBytes = kRecvOffset + kRecvBytes;
};

// ---- small device helpers ----

// XOR swizzle of the low 3 bits of a row's 16-byte chunk index: conflict-free for both the K reads
// (rows r, r+1 at chunks c + 4i) and the V reads (rows 0,2,4,6 / 1,3,5,7 at chunks g, g + 8).
// The logit factor in the exp2 domain and the output factor, from the run-time scales when given
// (the launcher's host expression otherwise: the same double product, so the same bits).
__device__ __forceinline__ float logit_scale_log2(const AttentionParams& p) {
  if (p.k_scale_ptr == nullptr) return p.scale_log2;
  return static_cast<float>(static_cast<double>(p.softmax_scale) *
                            static_cast<double>(*p.k_scale_ptr) * 1.4426950408889634);
}

__device__ __forceinline__ float output_v_scale(const AttentionParams& p) {
  return p.v_scale_ptr == nullptr ? p.v_scale : *p.v_scale_ptr;
}

__device__ __forceinline__ int swizzle(int row) {
  return (row & 6) ^ ((row & 1) << 2);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Plain C++ shared loads (not asm), so the compiler orders them against __syncthreads.
__device__ __forceinline__ uint4 lds128(const uint8_t* p) {
  return *reinterpret_cast<const uint4*>(p);
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// D += A * B, m16n8k16, fp32 accumulators. kF16 selects f16 operands, else bf16.
template <bool kF16>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (kF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two e4m3 values (low byte -> low half) to f16x2; exact.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t pair16) {
  uint32_t out;
  const unsigned short in = static_cast<unsigned short>(pair16 & 0xFFFFu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(out) : "h"(in));
  return out;
}

// (lo, hi) fp32 -> packed pair, lo in the low half.
template <bool kF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t out;
  if constexpr (kF16) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(out) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(out) : "f"(hi), "f"(lo));
  }
  return out;
}

// The fp32 values of a packed pair (exactly what the tensor core multiplies).
template <bool kF16>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (kF16) {
    float lo, hi;
    asm("{.reg .f16 l, h;\n mov.b32 {l, h}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, h;}\n"
        : "=f"(lo), "=f"(hi)
        : "r"(v));
    return make_float2(lo, hi);
  } else {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u));
  }
}

// bf16x2 -> f16x2 (exact for the magnitudes a normed query has).
__device__ __forceinline__ uint32_t bf16x2_to_f16x2(uint32_t v) {
  return pack2<true>(__uint_as_float(v << 16), __uint_as_float(v & 0xFFFF0000u));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint16_t f32_to_bf16_bits(float f) {
  uint16_t out;
  asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(out) : "f"(f));
  return out;
}

// Output dimension of accumulator column `n` (0..7) of PV n-tile `tile` (0..15).
template <bool kFp8>
__host__ __device__ constexpr int out_dim(int tile, int n) {
  if constexpr (kFp8) {
    return 16 * n + tile;
  } else {
    return (tile < 8) ? 8 * n + tile : 64 + 8 * n + (tile - 8);
  }
}

// Where 16-byte unit u (dims 4u .. 4u + 3) of a head's row sits in the warp merge's shared memory:
// an XOR of bits 1-2 with bits 3-4. With the odd row length (kMergeUnits) it keeps both sides of
// the merge free of bank conflicts: a warp's fragment stores (each thread 4 dims of one head at
// once, heads g and g + 8, columns 2c and 2c + 1, either out_dim layout) and the merging threads'
// loads (8 threads of one head, 8 consecutive units).
__host__ __device__ constexpr int merge_unit(int u) {
  return u ^ (((u >> 3) & 3) << 1);
}

// Request and position of `row`; pos < 0 marks a dead row.
__device__ __forceinline__ void resolve_row(const AttentionRowLayoutParams& layout, int64_t row,
                                            int& req, int64_t& pos) {
  if (!layout.is_prefill) {
    req = static_cast<int>(row / layout.q_len);
    const int j = static_cast<int>(row - int64_t{req} * layout.q_len);
    const int seq = layout.seq_lens[req];
    pos = seq > 0 ? int64_t{seq} - layout.q_len + j : -1;
    return;
  }
  // Largest r with cu[r] <= row; cu[num_reqs] > row, so request r owns the row.
  int lo = 0;
  int hi = layout.num_reqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (layout.cu_seqlens_q[mid] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  req = lo;
  pos = int64_t{layout.context_lens[lo]} + (row - layout.cu_seqlens_q[lo]);
}

// ---- the kernel ----

// Timeline marks (kAttentionMarks; skipped unless a recorder set p.timeline).
enum Mark : int { kStart, kPages, kFirstChunk, kChunksDone, kPublished, kEnd };

// A balanced-plan CTA's segment of one (row, kv head) unit, and how its result leaves the CTA
// (the static plan's unit, split and merge slots follow from blockIdx).
struct UnitWork {
  int64_t unit = 0;
  int first = 0;  // the unit's selection entries [first, last)
  int last = 0;
  int parts = 1;        // CTAs sharing the unit: 1 stores the output, more merge their partials
  int64_t slot = 0;     // this CTA's partial slot (parts > 1)
  int64_t slot0 = 0;    // the unit's first part's slot; part i > 0 is at 2 (counter + i)
  int64_t counter = 0;  // the unit's arrival counter: its first CTA, c0
};

// A UnitWork field. kShared (the balanced plan's segments, in shared memory): a fresh load where
// it is used, so the body does not hold it in a register from the start (the fp8 body has none
// to spare); otherwise the value itself (the static plan's work, computed from blockIdx).
template <bool kShared, typename T>
__device__ __forceinline__ T field(const T& value) {
  if constexpr (kShared) {
    return *const_cast<const volatile T*>(&value);
  } else {
    return value;
  }
}

// kSplitP (bf16 KV only): P = P_hi + P_lo, two bf16 PV mmas, so the softmax weights keep ~16
// bits (a bf16 P alone has 8, which costs ~2^-9 relative error in the output).
// kTiles: decode rows per CTA (1, 2 or 4; see the file comment). kBalanced: a segment of the
// balanced plan (no cluster merge). The params come as a restrict pointer to the kernel's
// parameter: taken by reference, the inlined body spilled 4-8 bytes in the fp8 kernels (ptxas),
// which the body written in the kernel itself did not.
template <bool kFp8, bool kSplitP, int kTiles, bool kBalanced, bool kDeep = false>
__device__ __forceinline__ void attend_unit(const AttentionParams* __restrict__ params,
                                            const UnitWork& w) {
  const AttentionParams& p = *params;
  using L = KvLayout<kFp8, kTiles, kDeep>;
  constexpr int kWarps = L::kWarps;  // shadows the default's
  constexpr int kThreads = L::kThreads;
  constexpr int kWarpsPerTile = kWarps / kTiles;
  constexpr int kSliceTokens = L::kChunk / kWarpsPerTile;  // a warp's tokens of a chunk
  static_assert(kSliceTokens >= 16 && kSliceTokens % 16 == 0, "whole 16-token pieces");
  constexpr int kMaxUnion = kTiles * kMaxGroupedTopk;  // candidates of a CTA's rows
  static_assert(kTiles == 1 || kMaxUnion <= kThreads, "one candidate per thread");
  constexpr bool kF16 = kFp8;  // operand type of both mmas
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ int s_page[kMaxRoundBlocks];
  __shared__ int s_block[kMaxRoundBlocks];
  __shared__ uint32_t s_rows[kTiles > 1 ? kMaxRoundBlocks : 1];  // tiles that selected the block
  __shared__ int s_union[kTiles > 1 ? kMaxUnion : 1];
  __shared__ uint32_t s_union_rows[kTiles > 1 ? kMaxUnion : 1];
  __shared__ int s_warp_count[kWarps];
  __shared__ int s_last;
  // The static plan's CTA runs the body once: it is the kernel's start and end (the timeline's
  // marks, the cluster arrival, the programmatic wait); the balanced kernel does those itself.
  if (!kBalanced) timeline::mark(p.timeline, kStart);
  const timeline::MarkOnExit end_mark{kBalanced ? nullptr : p.timeline, kEnd};
  // One row per CTA in a cluster: a rank may write into another's shared memory only once that
  // one has started; this arrival (waited for before the first push) says so.
  if (!kBalanced && kTiles == 1 && p.cluster_merge) cluster_arrive_relaxed();
  // Programmatic dependent launch: everything this kernel reads may come from the previous kernel
  // in the stream, so wait for it before the first load (a no-op without a programmatic edge);
  // with early_prologue only the selection may, and the wait comes right before its first read.
  const bool early = p.early_prologue != 0 && p.topk_idx != nullptr;
  if (!kBalanced && !early) asm volatile("griddepcontrol.wait;\n" ::: "memory");

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int g = lane >> 2;  // mma group: row (head) g and g + 8, column/token g
  const int c = lane & 3;   // thread in group

  const float scale_log2 = logit_scale_log2(p);
  const int split =
      kBalanced ? 0 : static_cast<int>(blockIdx.x % static_cast<unsigned>(p.num_splits));
  // unit = row group * kv_heads + kvh; a group is one row (kTiles == 1) or rows j0 .. j0 +
  // kTiles - 1 of one decode request (those < q_len are live).
  const int64_t unit =
      kBalanced ? field<true>(w.unit) : blockIdx.x / static_cast<unsigned>(p.num_splits);
  // The static plan's merge: the unit's splits, its slots from unit * num_splits, its counter.
  auto parts_of = [&] { return kBalanced ? field<true>(w.parts) : p.num_splits; };
  auto counter_of = [&] { return kBalanced ? field<true>(w.counter) : unit; };
  const int kvh = static_cast<int>(unit % p.kv_heads);
  const int64_t row_group = unit / p.kv_heads;
  int64_t row0 = row_group;  // the CTA's first row
  int live_tiles = 1;
  int group_req = 0;
  if constexpr (kTiles > 1) {
    group_req = static_cast<int>(row_group / p.groups_per_req);
    const int j0 = static_cast<int>(row_group - int64_t{group_req} * p.groups_per_req) * kTiles;
    row0 = int64_t{group_req} * p.rows_layout.q_len + j0;
    live_tiles = min(kTiles, p.rows_layout.q_len - j0);
  }
  const int tile = warp / kWarpsPerTile;   // this warp's row: row0 + tile
  const int slice = warp % kWarpsPerTile;  // this warp's tokens of a chunk
  const bool tile_live = tile < live_tiles;
  const int64_t row = row0 + tile;

  int req = 0;
  int64_t pos = -1;  // this warp's row; resolved below, after the first loads are issued

  // ---- Q fragments (A operand), loaded straight from global memory ----
  // k-step s covers, for thread c, whole 16-byte chunks of the head (see the permutation note).
  uint32_t qa[8][4];
  {
    const uint16_t* q_base =
        p.q + (row * p.q_heads + int64_t{kvh} * p.group) * static_cast<int64_t>(kHeadDim);
    const bool live0 = tile_live && g < p.group;
    const bool live1 = tile_live && g + 8 < p.group;
    const uint16_t* q0 = q_base + g * kHeadDim;
    const uint16_t* q1 = q_base + (g + 8) * kHeadDim;
    if constexpr (!kFp8) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int chunk = c + 4 * i;  // dims 8*chunk .. 8*chunk + 7
        const uint4 x =
            live0 ? *reinterpret_cast<const uint4*>(q0 + 8 * chunk) : make_uint4(0, 0, 0, 0);
        const uint4 y =
            live1 ? *reinterpret_cast<const uint4*>(q1 + 8 * chunk) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          qa[2 * i + h][0] = word(x, 2 * h);
          qa[2 * i + h][1] = word(y, 2 * h);
          qa[2 * i + h][2] = word(x, 2 * h + 1);
          qa[2 * i + h][3] = word(y, 2 * h + 1);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int chunk = c + 4 * i;  // dims 16*chunk .. 16*chunk + 15
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint4 x = live0 ? *reinterpret_cast<const uint4*>(q0 + 16 * chunk + 8 * half)
                                : make_uint4(0, 0, 0, 0);
          const uint4 y = live1 ? *reinterpret_cast<const uint4*>(q1 + 16 * chunk + 8 * half)
                                : make_uint4(0, 0, 0, 0);
#pragma unroll
          for (int uu = 0; uu < 2; ++uu) {
            const int s = 4 * i + 2 * half + uu;  // u = 2*half + uu: dims 4u .. 4u + 3
            qa[s][0] = bf16x2_to_f16x2(word(x, 2 * uu));
            qa[s][1] = bf16x2_to_f16x2(word(y, 2 * uu));
            qa[s][2] = bf16x2_to_f16x2(word(x, 2 * uu + 1));
            qa[s][3] = bf16x2_to_f16x2(word(y, 2 * uu + 1));
          }
        }
      }
    }
  }

  // The request's block-table row into L2 (up to 64 lines: 2048 blocks) while the selection is
  // read, so the page lookup after it finds the entry there: with early_prologue before the wait
  // (the selection is the previous kernel's), and in the cluster plan (a few requests, where the
  // chain of dependent loads is the kernel's time).
  if (early || (kTiles == 1 && p.cluster_merge && p.topk_idx != nullptr)) {
    if (!p.rows_layout.is_prefill && tid < 64) {
      const int64_t req0 = row0 / p.rows_layout.q_len;
      const char* row = reinterpret_cast<const char*>(p.kv_block_table + req0 * p.table_cols);
      if (128 * int64_t{tid} < p.table_cols * 4) {
        asm volatile("prefetch.global.L2 [%0];" ::"l"(row + 128 * tid));
      }
    }
  }
  if (early) asm volatile("griddepcontrol.wait;\n" ::: "memory");

  // ---- the split's share of the row's block list ----
  // A selection is split statically (ceil(topk / splits) entries per CTA), so the entries and their
  // pages are read without waiting for the row's position; entries < 0 are skipped (the valid
  // entries form a prefix, so exactly the prefix is read). Dense attention splits the row's nb
  // visible blocks evenly.
  const int32_t* entries = p.topk_idx != nullptr
                               ? p.topk_idx + row0 * p.topk_row_stride + kvh * p.topk_head_stride
                               : nullptr;
  int first = 0;
  int last = 0;
  int first_entry = -1;  // kTiles == 1: entries[first + tid], issued before the position is known
  // The CTA's rows sit at positions pos0 + t (consecutive decode rows), t < live_tiles; pos0 < 0:
  // a dead request. Scalars, so that no lambda captures an array (which would put it on the stack).
  int64_t pos0 = -1;
  if constexpr (kTiles == 1) {
    if (kBalanced && entries != nullptr) {
      first = field<true>(w.first);
      last = field<true>(w.last);
    } else if (entries != nullptr) {
      const int per_split = (p.topk + p.num_splits - 1) / p.num_splits;
      first = min(p.topk, split * per_split);
      last = min(p.topk, first + per_split);
    }
    if (entries != nullptr && tid < min(kMaxRoundBlocks, last - first)) {
      first_entry = entries[first + tid];
    }
    resolve_row(p.rows_layout, row, req, pos);
    pos0 = pos;
  } else {
    // The union of the live rows' selections: candidate tid is entry tid % topk of row
    // tid / topk; the first appearance of each block owns it and records every row that has it.
    const int candidates = entries != nullptr ? live_tiles * p.topk : 0;
    int cand = -1;
    if (tid < candidates) {
      const int t = tid / p.topk;
      cand = entries[t * p.topk_row_stride + (tid - t * p.topk)];
    }
    req = group_req;
    const int seq = p.rows_layout.seq_lens[req];
    const int j0 = static_cast<int>(row0 - int64_t{req} * p.rows_layout.q_len);
    pos0 = seq > 0 ? int64_t{seq} - p.rows_layout.q_len + j0 : -1;
    pos = (tile_live && pos0 >= 0) ? pos0 + tile : -1;
    int count = 0;
    if (entries != nullptr) {
      if (tid < kMaxUnion) s_union[tid] = cand;  // staged; compacted in place below
      __syncthreads();
      bool owner = cand >= 0;
      uint32_t rows = 0;
      if (owner) {
        for (int t = 0; t < live_tiles; ++t) {
#pragma unroll 4
          for (int i = 0; i < p.topk; ++i) {
            const int j = t * p.topk + i;
            if (s_union[j] == cand) {
              rows |= 1u << t;
              if (j < tid) owner = false;
            }
          }
        }
      }
      const unsigned ballot = __ballot_sync(0xFFFFFFFFu, owner);
      if (lane == 0) s_warp_count[warp] = __popc(ballot);
      __syncthreads();  // also: every candidate has been read before the compaction writes
      int offset = 0;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        if (w < warp) offset += s_warp_count[w];
        count += s_warp_count[w];
      }
      if (owner) {
        const int at = offset + __popc(ballot & ((1u << lane) - 1u));
        s_union[at] = cand;
        s_union_rows[at] = rows;
      }
      __syncthreads();
    } else {
      // Dense: every block the last live row can see (earlier rows mask their later tokens).
      const int64_t last_pos = pos0 >= 0 ? pos0 + live_tiles - 1 : -1;
      count = last_pos >= 0 ? static_cast<int>(last_pos / kBlockTokens) + 1 : 0;
    }
    const int per_split = (count + p.num_splits - 1) / p.num_splits;
    first = min(count, split * per_split);
    last = min(count, first + per_split);
  }
  if constexpr (kTiles == 1) {
    if (entries == nullptr) {
      const int count = pos >= 0 ? static_cast<int>(pos / kBlockTokens) + 1 : 0;
      const int per_split = (count + p.num_splits - 1) / p.num_splits;
      first = min(count, split * per_split);
      last = min(count, first + per_split);
    }
  }

  // ---- per-warp online softmax state ----
  float o[16][4];
#pragma unroll
  for (int t = 0; t < 16; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};  // heads g, g + 8 (log2 domain)
  float l_run[2] = {0.0f, 0.0f};            // this thread's share of the weight sum

  const uint8_t* k_cache = static_cast<const uint8_t*>(p.k_cache);
  const uint8_t* v_cache = static_cast<const uint8_t*>(p.v_cache);
  const int64_t elem_bytes = kFp8 ? 1 : 2;
  const int64_t k_token_bytes = p.k_token_stride * elem_bytes;
  const int64_t v_token_bytes = p.v_token_stride * elem_bytes;
  const int64_t table_base = int64_t{req} * p.table_cols;

  // This thread's 16-byte piece of every copy pass: row tid / kRowChunks, chunk tid % kRowChunks.
  constexpr int kCopyRowsPerPass = kThreads / L::kRowChunks;
  static_assert(kCopyRowsPerPass % 8 == 0, "the swizzle must repeat between copy passes");
  const uint32_t smem_base = smem_addr(smem);
  const int copy_row = tid / L::kRowChunks;
  const uint32_t copy_dst =
      copy_row * L::kRowBytes + (((tid % L::kRowChunks) ^ swizzle(copy_row)) << 4);
  // The same piece in the (strided) cache, from the first token of a chunk.
  const int64_t k_copy_src = copy_row * k_token_bytes + (tid % L::kRowChunks) * 16;
  const int64_t v_copy_src = copy_row * v_token_bytes + (tid % L::kRowChunks) * 16;

  for (int round = first; round < last; round += kMaxRoundBlocks) {
    const int nblocks = min(kMaxRoundBlocks, last - round);
    for (int i = tid; i < nblocks; i += kThreads) {
      int b = round + i;  // dense
      if constexpr (kTiles == 1) {
        if (entries != nullptr) b = round == first ? first_entry : entries[round + i];
      } else {
        s_rows[i] = entries != nullptr ? s_union_rows[round + i] : 0xFFFFFFFFu;
        if (entries != nullptr) b = s_union[round + i];
      }
      int page = -1;
      // Blocks past pos are dropped by chunk_valid(), so the table read need not wait for pos.
      if (b >= 0 && b < p.table_cols) {
        page = p.kv_block_table[table_base + b];
        if (page < 0 || page >= p.num_pages) page = -1;  // never read outside the cache
      }
      s_block[i] = b;
      s_page[i] = page;
    }
    __syncthreads();
    if (round == first) timeline::mark(p.timeline, kPages);

    const int nchunks = L::kChunksPerBlock * nblocks;
    // Tokens of chunk `ch` that tile t (at position row_pos) sees: 0 when the chunk lies wholly
    // after the position, its page is unusable or the tile's row did not select the block.
    auto chunk_valid = [&](int ch, int t, int64_t row_pos) -> int {
      const int e = ch / L::kChunksPerBlock;
      if (s_page[e] < 0) return 0;
      if constexpr (kTiles > 1) {
        if (((s_rows[e] >> t) & 1u) == 0) return 0;
      }
      const int64_t lo = int64_t{s_block[e]} * kBlockTokens + (ch % L::kChunksPerBlock) * L::kChunk;
      const int64_t n = row_pos + 1 - lo;
      return n <= 0 ? 0 : (n >= L::kChunk ? L::kChunk : static_cast<int>(n));
    };
    // Some row sees the chunk: the last live row that selected the block (positions grow with
    // the row) sees a token of it.
    auto chunk_needed = [&](int ch) -> bool {
      if constexpr (kTiles == 1) {
        return chunk_valid(ch, 0, pos0) > 0;
      } else {
        const uint32_t rows = s_rows[ch / L::kChunksPerBlock] & ((1u << live_tiles) - 1u);
        if (rows == 0 || pos0 < 0) return false;
        const int t = 31 - __clz(static_cast<int>(rows));
        return chunk_valid(ch, t, pos0 + t) > 0;
      }
    };
    auto issue = [&](int ch) {
      if (ch < nchunks && chunk_needed(ch)) {
        const int e = ch / L::kChunksPerBlock;
        const int64_t page = s_page[e];
        const int64_t first_token = (ch % L::kChunksPerBlock) * L::kChunk;
        const uint8_t* k_src =
            k_cache + (page * p.k_page_stride + int64_t{kvh} * p.k_head_stride) * elem_bytes +
            first_token * k_token_bytes + k_copy_src;
        const uint8_t* v_src =
            v_cache + (page * p.v_page_stride + int64_t{kvh} * p.v_head_stride) * elem_bytes +
            first_token * v_token_bytes + v_copy_src;
        const uint32_t stage = smem_base + (ch % L::kStages) * L::kStageBytes + copy_dst;
#pragma unroll
        for (int it = 0; it < L::kTileBytes / 16 / kThreads; ++it) {
          // Rows advance by a multiple of 8 per iteration, so the swizzle stays the same.
          const uint32_t dst = stage + it * kCopyRowsPerPass * L::kRowBytes;
          cp_async16(dst, k_src + it * kCopyRowsPerPass * k_token_bytes);
          cp_async16(dst + L::kTileBytes, v_src + it * kCopyRowsPerPass * v_token_bytes);
        }
      }
      cp_async_commit();
    };

#pragma unroll
    for (int s = 0; s < L::kStages - 1; ++s) issue(s);

    for (int ch = 0; ch < nchunks; ++ch) {
      cp_async_wait<L::kStages - 2>();
      __syncthreads();
      if (ch == 0 && round == first) timeline::mark(p.timeline, kFirstChunk);
      issue(ch + L::kStages - 1);

      const int valid = tile_live ? chunk_valid(ch, tile, pos) : 0;
      const uint8_t* k_tile = smem + (ch % L::kStages) * L::kStageBytes;
      const uint8_t* v_tile = k_tile + L::kTileBytes;
#pragma unroll 1
      for (int piece = 0; piece < kSliceTokens / 16; ++piece) {
        const int tok0 = slice * kSliceTokens + 16 * piece;  // the warp's next 16 tokens
        if (valid <= tok0) break;                            // nothing more visible for this warp
        const bool partial = valid < tok0 + 16;

        // S = Q K^T for tokens tok0 + 8j + g (columns), heads g, g + 8 (rows).
        float s_acc[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          s_acc[j][0] = s_acc[j][1] = s_acc[j][2] = s_acc[j][3] = 0.0f;
          const int r = tok0 + 8 * j + g;
          const uint8_t* k_row = k_tile + r * L::kRowBytes;
          if constexpr (!kFp8) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const uint4 kv = lds128(k_row + (((c + 4 * i) ^ swizzle(r)) << 4));
              mma16816<false>(s_acc[j], qa[2 * i], kv.x, kv.y);
              mma16816<false>(s_acc[j], qa[2 * i + 1], kv.z, kv.w);
            }
          } else {
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const uint4 kv = lds128(k_row + (((c + 4 * i) ^ swizzle(r)) << 4));
#pragma unroll
              for (int u = 0; u < 4; ++u) {
                const uint32_t w = word(kv, u);
                mma16816<true>(s_acc[j], qa[4 * i + u], e4m3x2_to_f16x2(w),
                               e4m3x2_to_f16x2(w >> 16));
              }
            }
          }
        }

        // Online softmax in the exp2 domain; masked tokens get -inf (never their garbage).
        float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float v = s_acc[j][e] * scale_log2;
            if (partial && tok0 + 8 * j + 2 * c + (e & 1) >= valid) v = -INFINITY;
            s_acc[j][e] = v;
            row_max[e >> 1] = fmaxf(row_max[e >> 1], v);
          }
        }
        // Lazy rescale: the reference max moves only when a row's max exceeds it by more than
        // kLazyRescale (log2 units), so weights stay <= 2^kLazyRescale and the 64 accumulator
        // multiplies are skipped on most chunks (a warp-uniform vote). Exact either way.
        float m_next[2];
        bool grow = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xFFFFFFFFu, row_max[h], 1));
          row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xFFFFFFFFu, row_max[h], 2));
          const bool up = row_max[h] > m_run[h] + kLazyRescale || m_run[h] == -INFINITY;
          m_next[h] = up ? fmaxf(m_run[h], row_max[h]) : m_run[h];
          grow |= up;
        }
        if (__any_sync(0xFFFFFFFFu, grow)) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            // m_run == m_next gives exactly 1; m_run == -inf gives 0 (nothing accumulated yet).
            const float alpha = m_next[h] == -INFINITY ? 1.0f : fast_exp2(m_run[h] - m_next[h]);
            l_run[h] *= alpha;
#pragma unroll
            for (int t = 0; t < 16; ++t) {
              o[t][2 * h] *= alpha;
              o[t][2 * h + 1] *= alpha;
            }
          }
        }
        float m_use[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          m_run[h] = m_next[h];
          m_use[h] = m_next[h] == -INFINITY ? 0.0f : m_next[h];
        }
        uint32_t pa[4];
        uint32_t pb[4];  // kSplitP: the low parts
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float e0 = fast_exp2(s_acc[j][2 * h] - m_use[h]);
            const float e1 = fast_exp2(s_acc[j][2 * h + 1] - m_use[h]);
            const uint32_t packed = pack2<kF16>(e0, e1);
            pa[2 * j + h] = packed;
            if constexpr (kSplitP) {
              const float2 w = unpack2<false>(packed);
              pb[2 * j + h] = pack2<false>(e0 - w.x, e1 - w.y);
            } else {
              pb[2 * j + h] = 0;
            }
            // The fp32 weights (the f16 / bf16 hi+lo rounding of P is ~2^-11 / ~2^-16 relative).
            l_run[h] += e0 + e1;
          }
        }

        // O += P V. Thread (g, c) reads tokens 2c, 2c+1, 2c+8, 2c+9 of the warp's 16.
        const int r0 = tok0 + 2 * c;
        const int rows[4] = {r0, r0 + 1, r0 + 8, r0 + 9};
        if constexpr (!kFp8) {
#pragma unroll
          for (int hc = 0; hc < 2; ++hc) {
            const int chunk = g + 8 * hc;  // dims 8g + 64hc .. +7
            uint4 x[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              x[k] = lds128(v_tile + rows[k] * L::kRowBytes + ((chunk ^ swizzle(rows[k])) << 4));
              if (partial && rows[k] >= valid) x[k] = make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int t = 0; t < 8; ++t) {
              const uint32_t sel = (t & 1) ? 0x7632u : 0x5410u;
              const uint32_t b0 = __byte_perm(word(x[0], t >> 1), word(x[1], t >> 1), sel);
              const uint32_t b1 = __byte_perm(word(x[2], t >> 1), word(x[3], t >> 1), sel);
              mma16816<false>(o[8 * hc + t], pa, b0, b1);
              if constexpr (kSplitP) mma16816<false>(o[8 * hc + t], pb, b0, b1);
            }
          }
        } else {
          uint4 x[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            x[k] = lds128(v_tile + rows[k] * L::kRowBytes + ((g ^ swizzle(rows[k])) << 4));
            if (partial && rows[k] >= valid) x[k] = make_uint4(0, 0, 0, 0);
          }
#pragma unroll
          for (int u = 0; u < 4; ++u) {  // dims 16g + 4u .. +3
            const uint32_t t01 = __byte_perm(word(x[0], u), word(x[1], u), 0x5140u);
            const uint32_t t23 = __byte_perm(word(x[0], u), word(x[1], u), 0x7362u);
            const uint32_t t01b = __byte_perm(word(x[2], u), word(x[3], u), 0x5140u);
            const uint32_t t23b = __byte_perm(word(x[2], u), word(x[3], u), 0x7362u);
            mma16816<true>(o[4 * u + 0], pa, e4m3x2_to_f16x2(t01), e4m3x2_to_f16x2(t01b));
            mma16816<true>(o[4 * u + 1], pa, e4m3x2_to_f16x2(t01 >> 16),
                           e4m3x2_to_f16x2(t01b >> 16));
            mma16816<true>(o[4 * u + 2], pa, e4m3x2_to_f16x2(t23), e4m3x2_to_f16x2(t23b));
            mma16816<true>(o[4 * u + 3], pa, e4m3x2_to_f16x2(t23 >> 16),
                           e4m3x2_to_f16x2(t23b >> 16));
          }
        }
      }  // piece
    }
    cp_async_wait<0>();
    __syncthreads();  // the next round rewrites s_page / s_block and the stages
  }

  timeline::mark(p.timeline, kChunksDone);
  // The next kernel in the stream may be scheduled now (it waits for this grid to finish).
  asm volatile("griddepcontrol.launch_dependents;\n" :::);

  // ---- merge the warps of each tile through shared memory ----
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xFFFFFFFFu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xFFFFFFFFu, l_run[h], 2);
  }
  float* s_o = reinterpret_cast<float*>(smem);             // [warps][16][kMergeStride]
  float* s_ml = s_o + kWarps * kTileHeads * kMergeStride;  // [warps][16][2]
  {
    // Accumulator tiles t0 .. t0 + 3 of a column are 4 consecutive dims in both out_dim layouts:
    // one 16-byte store each (merge_unit: no bank conflicts).
    float4* my_o = reinterpret_cast<float4*>(s_o + warp * kTileHeads * kMergeStride);
#pragma unroll
    for (int t0 = 0; t0 < 16; t0 += 4) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int head = g + 8 * (e >> 1);
        const int unit = out_dim<kFp8>(t0, 2 * c + (e & 1)) / 4;
        my_o[head * kMergeUnits + merge_unit(unit)] =
            make_float4(o[t0][e], o[t0 + 1][e], o[t0 + 2][e], o[t0 + 3][e]);
      }
    }
    if (c == 0) {
      s_ml[(warp * kTileHeads + g) * 2 + 0] = m_run[0];
      s_ml[(warp * kTileHeads + g) * 2 + 1] = l_run[0];
      s_ml[(warp * kTileHeads + g + 8) * 2 + 0] = m_run[1];
      s_ml[(warp * kTileHeads + g + 8) * 2 + 1] = l_run[1];
    }
  }
  __syncthreads();

  // Thread t owns head (t / 8) % 16 and the 16-byte units u0 + 8 (part kOwned + j) (j < kOwned;
  // u0 = t % 8; part = t / 128: 8 warps split a head's units in two) of every tile: acc[4j + i]
  // is dim owned_dim(j) + i. Eight threads of one head read eight consecutive units.
  constexpr int kParts = kThreads / 128;
  constexpr int kOwned = 4 / kParts;
  const int head = (tid >> 3) & (kTileHeads - 1);
  const int part = tid >> 7;
  const int u0 = tid & 7;
  auto owned_unit = [&](int j) { return u0 + 8 * (part * kOwned + j); };
  auto owned_dim = [&](int j) { return 4 * owned_unit(j); };
  float acc[4 * kOwned];
  // acc = tile t's warps merged (unnormalized); m_out / l_out = the tile's max and sum.
  auto merge_warps = [&](int t, float& m_out, float& l_out) {
    float m_cta = -INFINITY;
#pragma unroll
    for (int i = 0; i < kWarpsPerTile; ++i) {
      m_cta = fmaxf(m_cta, s_ml[((t * kWarpsPerTile + i) * kTileHeads + head) * 2]);
    }
    const float m_ref = m_cta == -INFINITY ? 0.0f : m_cta;
    float l_cta = 0.0f;
#pragma unroll
    for (int d = 0; d < 4 * kOwned; ++d) acc[d] = 0.0f;
#pragma unroll
    for (int i = 0; i < kWarpsPerTile; ++i) {
      const int w = t * kWarpsPerTile + i;
      const float wt = fast_exp2(s_ml[(w * kTileHeads + head) * 2] - m_ref);
      l_cta += s_ml[(w * kTileHeads + head) * 2 + 1] * wt;
      const float4* src =
          reinterpret_cast<const float4*>(s_o) + (w * kTileHeads + head) * kMergeUnits;
#pragma unroll
      for (int j = 0; j < kOwned; ++j) {
        const float4 v = src[merge_unit(owned_unit(j))];
        acc[4 * j] += v.x * wt;
        acc[4 * j + 1] += v.y * wt;
        acc[4 * j + 2] += v.z * wt;
        acc[4 * j + 3] += v.w * wt;
      }
    }
    m_out = m_cta;
    l_out = l_cta;
  };

  const bool store_head = head < p.group;
  // Stores acc * inv as bf16 into row out_row.
  auto store_out = [&](int64_t out_row, float inv) {
    if (!store_head) return;
    uint16_t* out = p.out + (out_row * p.q_heads + int64_t{kvh} * p.group + head) * kHeadDim;
    uint32_t packed[2 * kOwned];
#pragma unroll
    for (int d = 0; d < 2 * kOwned; ++d) {
      packed[d] = static_cast<uint32_t>(f32_to_bf16_bits(acc[2 * d] * inv)) |
                  (static_cast<uint32_t>(f32_to_bf16_bits(acc[2 * d + 1] * inv)) << 16);
    }
#pragma unroll
    for (int j = 0; j < kOwned; ++j) {
      *reinterpret_cast<uint2*>(out + owned_dim(j)) = make_uint2(packed[2 * j], packed[2 * j + 1]);
    }
  };
  auto write_out = [&](int64_t out_row, float l_total) {
    store_out(out_row, l_total > 0.0f ? output_v_scale(p) / l_total : 0.0f);
  };

  if (parts_of() == 1) {
#pragma unroll 1
    for (int t = 0; t < live_tiles; ++t) {
      float m_cta, l_cta;
      merge_warps(t, m_cta, l_cta);
      write_out(row0 + t, l_cta);
    }
    return;
  }

  if (!kBalanced && kTiles == 1 && p.cluster_merge) {
    // ---- one row, the splits in one cluster: rank r owns the output dims [r span, (r + 1)
    // span); each rank pushes its partial's slices (and its (max, sum) per head) into the owners'
    // receive areas, then one barrier, then each owner merges its dims from its own shared
    // memory in rank order. No rank reads another's memory, so no closing barrier. ----
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    const int ranks = p.num_splits;     // a power of two <= kMaxClusterRanks
    const int span = kHeadDim / ranks;  // >= 8: a float4 never straddles two owners
    const int src = static_cast<int>(cluster.block_rank());
    float* recv_o = reinterpret_cast<float*>(smem + L::kRecvOffset);  // [ranks][16][span]
    float* recv_ml = recv_o + kTileHeads * kHeadDim;                  // [ranks][16][2]
    float m_cta, l_cta;
    merge_warps(0, m_cta, l_cta);
    cluster_wait_acquire();  // every rank has started (the arrival at the kernel's start)
#pragma unroll
    for (int j = 0; j < kOwned; ++j) {
      const int d = owned_dim(j);
      const int owner = d / span;
      float* dst = cluster.map_shared_rank(recv_o, owner) + (src * kTileHeads + head) * span +
                   (d - owner * span);
      *reinterpret_cast<float4*>(dst) =
          make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
    }
    for (int r = tid & 7; part == 0 && r < ranks; r += 8) {
      float* dst = cluster.map_shared_rank(recv_ml, r) + (src * kTileHeads + head) * 2;
      *reinterpret_cast<float2*>(dst) = make_float2(m_cta, l_cta);
    }
    cluster_arrive_release();
    cluster_wait_acquire();
    timeline::mark(p.timeline, kPublished);
    timeline::set_kind(p.timeline, 1);
    const int pairs_per_head = span / 2;
#pragma unroll 1
    for (int e = tid; e < p.group * pairs_per_head; e += kThreads) {
      const int h = e / pairs_per_head;
      const int dd = 2 * (e - h * pairs_per_head);
      // Every rank's (max, sum) and pair loaded at once (a loop over the ranks' loads would wait
      // for each), then added in rank order.
      float2 ml[kMaxClusterRanks];
      float2 v[kMaxClusterRanks];
#pragma unroll
      for (int r = 0; r < kMaxClusterRanks; ++r) {
        if (r < ranks) {
          ml[r] = *reinterpret_cast<const float2*>(recv_ml + (r * kTileHeads + h) * 2);
          v[r] = *reinterpret_cast<const float2*>(recv_o + (r * kTileHeads + h) * span + dd);
        }
      }
      float m_all = -INFINITY;
#pragma unroll
      for (int r = 0; r < kMaxClusterRanks; ++r) {
        if (r < ranks) m_all = fmaxf(m_all, ml[r].x);
      }
      const float m_ref = m_all == -INFINITY ? 0.0f : m_all;
      float l_all = 0.0f;
      float a0 = 0.0f;
      float a1 = 0.0f;
#pragma unroll
      for (int r = 0; r < kMaxClusterRanks; ++r) {
        if (r < ranks) {
          const float wt = fast_exp2(ml[r].x - m_ref);
          l_all += ml[r].y * wt;
          a0 += v[r].x * wt;
          a1 += v[r].y * wt;
        }
      }
      const float inv = l_all > 0.0f ? output_v_scale(p) / l_all : 0.0f;
      uint16_t* out =
          p.out + (row0 * p.q_heads + int64_t{kvh} * p.group + h) * kHeadDim + src * span + dd;
      *reinterpret_cast<uint32_t*>(out) = static_cast<uint32_t>(f32_to_bf16_bits(a0 * inv)) |
                                          (static_cast<uint32_t>(f32_to_bf16_bits(a1 * inv)) << 16);
    }
    return;
  }

  if (!kBalanced && kTiles > 1 && p.cluster_merge) {
    // ---- several rows per CTA, the splits in one cluster: each rank publishes its partials in
    // its own shared memory and, after a barrier, merges a share of the output dims from every
    // rank's ----
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    float* pub_o = reinterpret_cast<float*>(smem + L::kMergeBytes);  // [kTiles][16][128]
    float* pub_ml = pub_o + kTiles * kTileHeads * kHeadDim;          // [kTiles][16][2]
#pragma unroll 1
    for (int t = 0; t < live_tiles; ++t) {
      float m_cta, l_cta;
      merge_warps(t, m_cta, l_cta);
      float* pub_row = pub_o + (t * kTileHeads + head) * kHeadDim;
#pragma unroll
      for (int j = 0; j < kOwned; ++j) {
        *reinterpret_cast<float4*>(pub_row + owned_dim(j)) =
            make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
      }
      if ((tid & 7) == 0 && part == 0) {
        pub_ml[(t * kTileHeads + head) * 2] = m_cta;
        pub_ml[(t * kTileHeads + head) * 2 + 1] = l_cta;
      }
    }
    cluster.sync();
    timeline::mark(p.timeline, kPublished);
    // Every rank merges a share: rank r the output dims [r * span, (r + 1) * span) of each head,
    // from every rank's partial (the max over the ranks, then the weighted sums in rank order),
    // so the merge is spread over the cluster's SMs.
    timeline::set_kind(p.timeline, 1);
    const int span = kHeadDim / p.num_splits;  // num_splits: a power of two <= 16
    const int pairs_per_head = span / 2;
    const int d_first = static_cast<int>(cluster.block_rank()) * span;
#pragma unroll 1
    for (int t = 0; t < live_tiles; ++t) {
#pragma unroll 1
      for (int e = tid; e < p.group * pairs_per_head; e += kThreads) {
        const int h = e / pairs_per_head;
        const int d = d_first + 2 * (e - h * pairs_per_head);
        const int at = t * kTileHeads + h;
        // Every rank's (max, sum) and output pair loaded in one round (a DSMEM load costs a
        // round trip; a loop over the ranks would wait for each).
        float2 ml[kMaxClusterRanks];
        float2 v[kMaxClusterRanks];
#pragma unroll
        for (int r = 0; r < kMaxClusterRanks; ++r) {
          if (r < p.num_splits) {
            ml[r] = *reinterpret_cast<const float2*>(cluster.map_shared_rank(pub_ml, r) + at * 2);
            v[r] = *reinterpret_cast<const float2*>(cluster.map_shared_rank(pub_o, r) +
                                                    at * kHeadDim + d);
          }
        }
        float m_all = -INFINITY;
#pragma unroll
        for (int r = 0; r < kMaxClusterRanks; ++r) {
          if (r < p.num_splits) m_all = fmaxf(m_all, ml[r].x);
        }
        const float m_ref = m_all == -INFINITY ? 0.0f : m_all;
        float l_all = 0.0f;
        float a0 = 0.0f;
        float a1 = 0.0f;
#pragma unroll
        for (int r = 0; r < kMaxClusterRanks; ++r) {
          if (r < p.num_splits) {
            const float wt = fast_exp2(ml[r].x - m_ref);
            l_all += ml[r].y * wt;
            a0 += v[r].x * wt;
            a1 += v[r].y * wt;
          }
        }
        const float inv = l_all > 0.0f ? output_v_scale(p) / l_all : 0.0f;
        uint16_t* out =
            p.out + ((row0 + t) * p.q_heads + int64_t{kvh} * p.group + h) * kHeadDim + d;
        *reinterpret_cast<uint32_t*>(out) =
            static_cast<uint32_t>(f32_to_bf16_bits(a0 * inv)) |
            (static_cast<uint32_t>(f32_to_bf16_bits(a1 * inv)) << 16);
      }
    }
    cluster.sync();  // every CTA's shared memory stays alive until every rank has read it
    return;
  }

  // ---- split-K: publish this split's partials (slot * kTiles + tile); the last CTA of the unit
  // merges ----
  const int64_t slot = kBalanced ? field<true>(w.slot) : int64_t{blockIdx.x};
#pragma unroll 1
  for (int t = 0; t < live_tiles; ++t) {
    float m_cta, l_cta;
    merge_warps(t, m_cta, l_cta);
    const int64_t at = (slot * kTiles + t) * kTileHeads + head;
    float* dst = p.partial_o + at * kHeadDim;
#pragma unroll
    for (int j = 0; j < kOwned; ++j) {
      *reinterpret_cast<float4*>(dst + owned_dim(j)) =
          make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
    }
    if ((tid & 7) == 0 && part == 0) {
      p.partial_ml[at * 2 + 0] = m_cta;
      p.partial_ml[at * 2 + 1] = l_cta;
    }
  }
  // The barrier orders every thread's partial stores before thread 0's arrival, whose release
  // (GPU scope, cumulative) publishes them; the last CTA's acquire, shared by the next barrier,
  // orders its reads of the other splits' partials after every arrival. One fence per CTA, not a
  // sequentially consistent fence in every thread before and after the arrival.
  __syncthreads();
  if (tid == 0) {
    const unsigned prev = arrive_acq_rel(&p.counters[counter_of()]);
    s_last = prev == static_cast<unsigned>(parts_of() - 1);
  }
  __syncthreads();
  timeline::mark(p.timeline, kPublished);
  if (!s_last) return;
  timeline::set_kind(p.timeline, 1);

  // Per tile: every (split, head) max and sum in one round of loads; the per-split weights, with
  // the normalization and v_scale folded in, in shared memory; then the partial outputs with
  // independent loads, four splits at a time, summed in split order (deterministic).
  const int64_t slot0 = kBalanced ? field<true>(w.slot0) : unit * p.num_splits;
  const int parts = parts_of();
  // Part sp's slot: the static plan's follow slot0; the balanced plan's after the first are the
  // first segments of CTAs c0 + sp (slot 2 (c0 + sp), c0 the unit's counter).
  const int64_t slot_base = kBalanced ? 2 * field<true>(w.counter) : slot0;
  auto part_slot = [&](int sp) -> int64_t {
    return kBalanced ? (sp == 0 ? slot0 : slot_base + 2 * sp) : slot0 + sp;
  };
  float* s_weight = reinterpret_cast<float*>(smem);        // [splits][16]: max, then weight
  float* s_sum = s_weight + kMaxMergeSplits * kTileHeads;  // [splits][16]
  constexpr int kSplitStride4 = kTiles * kTileHeads * kHeadDim / 4;  // float4s per split
  // v[j]: the split's owned unit j (dims owned_dim(j) .. +3).
  auto accumulate = [&](const float4(&v)[kOwned], float wt) {
#pragma unroll
    for (int j = 0; j < kOwned; ++j) {
      acc[4 * j] += v[j].x * wt;
      acc[4 * j + 1] += v[j].y * wt;
      acc[4 * j + 2] += v[j].z * wt;
      acc[4 * j + 3] += v[j].w * wt;
    }
  };
#pragma unroll 1
  for (int t = 0; t < live_tiles; ++t) {
    for (int i = tid; i < parts * kTileHeads; i += kThreads) {
      const int sp = i / kTileHeads;
      const float2 ml = __ldcg(reinterpret_cast<const float2*>(p.partial_ml) +
                               (part_slot(sp) * kTiles + t) * kTileHeads + (i - sp * kTileHeads));
      s_weight[i] = ml.x;
      s_sum[i] = ml.y;
    }
    __syncthreads();
    if (tid < kTileHeads) {
      float m_all = -INFINITY;
      for (int sp = 0; sp < parts; ++sp) {
        m_all = fmaxf(m_all, s_weight[sp * kTileHeads + tid]);
      }
      const float ref = m_all == -INFINITY ? 0.0f : m_all;
      float l_all = 0.0f;
      for (int sp = 0; sp < parts; ++sp) {
        l_all += s_sum[sp * kTileHeads + tid] * fast_exp2(s_weight[sp * kTileHeads + tid] - ref);
      }
      const float scale = l_all > 0.0f ? output_v_scale(p) / l_all : 0.0f;
      for (int sp = 0; sp < parts; ++sp) {
        s_weight[sp * kTileHeads + tid] = fast_exp2(s_weight[sp * kTileHeads + tid] - ref) * scale;
      }
    }
    __syncthreads();
#pragma unroll
    for (int d = 0; d < 4 * kOwned; ++d) acc[d] = 0.0f;
    // Part sp's float4s at part_src(sp) (the static plan's parts follow slot0's).
    const int64_t src_slot = kBalanced ? 0 : slot0;
    const float4* src =
        reinterpret_cast<const float4*>(p.partial_o +
                                        ((src_slot * kTiles + t) * kTileHeads + head) * kHeadDim) +
        owned_unit(0);
    auto part_src = [&](int sp) {
      if constexpr (kBalanced) {
        return src + part_slot(sp) * kSplitStride4;
      } else {
        return src + sp * kSplitStride4;
      }
    };
    int sp = 0;
    for (; sp + 4 <= parts; sp += 4) {
      float4 v[4][kOwned];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int j = 0; j < kOwned; ++j) {
          v[u][j] = __ldcg(part_src(sp + u) + 8 * j);
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) accumulate(v[u], s_weight[(sp + u) * kTileHeads + head]);
    }
    for (; sp < parts; ++sp) {
      float4 v[kOwned];
#pragma unroll
      for (int j = 0; j < kOwned; ++j) v[j] = __ldcg(part_src(sp) + 8 * j);
      accumulate(v, s_weight[sp * kTileHeads + head]);
    }
    store_out(row0 + t, 1.0f);
    __syncthreads();  // the next tile rewrites s_weight / s_sum
  }
  if (tid == 0) p.counters[counter_of()] = 0;  // ready for the next launch (stream order)
}

// The balanced plan's segment of CTA `cta` of `ctas` that starts at entry `at` of the flattened
// (unit, selection entry) list of `items` = units * topk entries, the CTA's share being [cta
// items / ctas, (cta + 1) items / ctas) = [lo, hi). A unit cut by shares' boundaries spans CTAs
// c0 .. c1, one part each; a CTA's first segment publishes to slot 2 cta, a later one (only its
// last can be cut) to 2 cta + 1, and the last part to arrive on counter c0 merges them all.
__host__ __device__ inline UnitWork balanced_segment(int64_t at, int64_t items, int topk,
                                                     int64_t cta, int64_t ctas) {
  // The CTA whose share holds entry i: the largest c with c items / ctas <= i.
  auto cta_of = [&](int64_t i) { return ((i + 1) * ctas - 1) / items; };
  const int64_t lo = cta * items / ctas;
  const int64_t hi = (cta + 1) * items / ctas;
  UnitWork w;
  w.unit = at / topk;
  const int64_t begin = w.unit * topk;
  const int64_t end = begin + topk;
  w.first = static_cast<int>(at - begin);
  w.last = static_cast<int>((end < hi ? end : hi) - begin);
  if (begin < lo || end > hi) {
    const int64_t c0 = cta_of(begin);
    w.parts = static_cast<int>(cta_of(end - 1) - c0 + 1);
    w.slot = 2 * cta + (at == lo ? 0 : 1);
    w.slot0 = 2 * c0 + (begin == c0 * items / ctas ? 0 : 1);
    w.counter = c0;
  }
  return w;
}

// The static plan: CTA = (unit, split). Resident CTAs per SM: KvLayout::kCtasPerSm (fp8 rows
// grouped: 3, <= 170 registers, 64 KB of stages; otherwise 2).
template <bool kFp8, bool kSplitP, int kTiles, bool kDeep = false>
__global__ void __launch_bounds__(KvLayout<kFp8, kTiles, kDeep>::kThreads,
                                  KvLayout<kFp8, kTiles, kDeep>::kCtasPerSm)
    attention_sparse_kernel(const __grid_constant__ AttentionParams p) {
  static_assert(!(kFp8 && kSplitP), "the fp8 path multiplies f16 weights (11 bits) already");
  static_assert(kTiles == 1 || kTiles == 2 || kTiles == 4, "1, 2 or 4 rows per CTA");
  // unused: unit, split from blockIdx
  attend_unit<kFp8, kSplitP, kTiles, false, kDeep>(&p, UnitWork{});
}

// The balanced plan (one row per CTA, a selection, no cluster): one wave of CTAs, each running
// the segments of its share one after another. A kernel of its own, so the static plan's code is
// not compiled around a loop. The segment and the loop's cursor live in shared memory, not in
// registers the body needs (field()); the body's dynamic shared memory ends before the cluster
// receive area (KvLayout::kSharedBytes). Same residency as the static one-row kernel.
template <bool kFp8, bool kSplitP>
__global__ void __launch_bounds__(kThreads, KvLayout<kFp8, 1>::kCtasPerSm)
    attention_balanced_kernel(const __grid_constant__ AttentionParams p) {
  static_assert(!(kFp8 && kSplitP), "the fp8 path multiplies f16 weights (11 bits) already");
  timeline::mark(p.timeline, kStart);
  const timeline::MarkOnExit end_mark{p.timeline, kEnd};
  // The programmatic dependent launch's wait, as attend_unit's: with early_prologue each segment
  // waits right before its selection's read instead.
  if (!(p.early_prologue != 0 && p.topk_idx != nullptr)) {
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
  }
  __shared__ UnitWork s_work;
  __shared__ int64_t s_at;  // the share's next entry; -1 once its last segment is running
  const int64_t items = p.num_rows * p.kv_heads * p.topk;
  if (threadIdx.x == 0) s_at = static_cast<int64_t>(blockIdx.x) * items / gridDim.x;
#pragma unroll 1
  while (true) {
    if (threadIdx.x == 0) {
      s_work = balanced_segment(s_at, items, p.topk, blockIdx.x, gridDim.x);
      s_at = s_work.unit * p.topk + s_work.last;
      if (s_at >= (blockIdx.x + int64_t{1}) * items / gridDim.x) s_at = -1;
    }
    __syncthreads();
    attend_unit<kFp8, kSplitP, 1, true>(&p, s_work);
    const bool done = field<true>(s_at) < 0;
    __syncthreads();  // the next segment rewrites s_work and reuses the shared memory
    if (done) break;
  }
}

}  // namespace m3msa::cuda::attention
