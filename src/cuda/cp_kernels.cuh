// Kernels of the context-parallel indexer (docs/cp.md, include/m3msa/cp_cuda.h). Framework-free:
// raw pointers and one params struct, launched by cp_indexer.cu.
//
// Scoring of a rank's round-robin shard reuses the one-GPU scoring kernel (indexer.cuh) in its
// scores-only mode over a *shard table*: local block l of shard r is global block l*P + r. The
// kernel masks tokens by the local position, so cp_shard_tables_kernel gives every live request a
// local length that makes all of its shard's blocks fully visible; this is exact because every
// block a row scores (rather than forces) is fully visible to it: the only partly visible block
// of a row is its own, which is forced whenever local_blocks >= 1 (checked on the host). The dot
// products and maxima of a block are then computed by the same code in the same order as on one
// GPU, so every key, and so every selection, is bit-identical.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/indexer.cuh"
#include "m3msa/sort_key.h"

namespace m3msa::cuda::cp {

inline constexpr int kMaxWorld = 8;
inline constexpr int kWarps = 8;
inline constexpr int kThreads = 256;
inline constexpr int kMaxCand = kMaxWorld * 32;  // P * k candidates of one (row, head)

// Device error record of a timed-out wait (cp.md "No silent hang"); the first writer wins.
struct CpDeviceError {
  uint32_t flag;  // 0: none
  int32_t layer;
  int32_t row;
  int32_t head;
  int32_t source;
  uint32_t expected_tag;
  uint32_t seen_tag;
  uint32_t pad;
};

// Per buffer set, in the rank's own memory.
struct CpControl {
  uint32_t generation;  // calls completed on this set (bumped by the last merge CTA)
  uint32_t done;        // merge CTAs arrived in the current call (back to 0 after each call)
  uint32_t status;      // sticky guard bits of the shard scoring (params.h kStatus*)
  uint32_t pad;
  CpDeviceError error;
};

struct CpParams {
  // Batch (the live call; grids come from max_rows).
  const int32_t* seq_lens = nullptr;     // [num_reqs] i32, global lengths
  const int32_t* block_table = nullptr;  // [num_reqs, table_cols] i32, global table
  int64_t table_cols = 0;
  int num_reqs = 0;
  int q_len = 1;
  int live_rows = 0;  // num_reqs * q_len
  int max_rows = 0;
  // Shard.
  int rank = 0;
  int world = 1;   // P
  int heads = 0;   // H (all index heads; every rank scores all of them)
  int merged = 0;  // heads this rank merges (H / P, or 1 when P > H)
  int head0 = 0;   // first global head this rank merges (they are consecutive)
  int topk = 0;
  int init_blocks = 0;
  int local_blocks = 1;
  // Shard tables and scores.
  int32_t* local_seq_lens = nullptr;  // [max_reqs] i32
  int32_t* local_table = nullptr;     // [max_reqs, local_cols] i32
  float* scores = nullptr;            // [max_rows, H, local_cols] f32 (shard block scores)
  int64_t local_cols = 0;
  // Exchange.
  CpControl* control = nullptr;
  uint64_t* dest[kMaxWorld] = {};  // peer: every rank's candidate buffer; local: [0] = send
  int dest_local = 0;              // 1: nominations go to dest[0] as [H][max_rows][k] (nccl)
  const uint64_t* cand = nullptr;  // this rank's buffer to merge from
  int64_t parity_stride = 0;       // elements (0 for nccl: the recv buffer is per call)
  int64_t source_stride = 0;
  int64_t head_stride = 0;  // per merged head (peer) / per global head (nccl)
  int cand_head_base = 0;   // head index of merged head 0 in the cand layout (0 / head0)
  int layer = 0;
  uint64_t budget_ns = 0;
  int32_t* topk_idx = nullptr;  // [live_rows, merged, k] i32 out
  // allreduce-max.
  float* full_scores = nullptr;  // [max_rows, H, full_cols] f32
  int64_t full_cols = 0;
};

__device__ __forceinline__ int row_pos(const CpParams& p, int row) {
  if (row >= p.live_rows) return -1;
  const int req = row / p.q_len;
  const int seq = p.seq_lens[req];
  return seq > 0 ? seq - p.q_len + row % p.q_len : -1;
}

// Blocks b < nb with b % P == r.
__device__ __forceinline__ int shard_count(int nb, int r, int P) {
  return nb > r ? (nb - 1 - r) / P + 1 : 0;
}

__device__ __forceinline__ uint64_t load_sys(const uint64_t* ptr) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ void store_sys(uint64_t* ptr, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---------------------------------------------------------------------------------------------
// Shard tables. Purpose: per live request, the local length and table of this rank's shard.
// Grid: max_reqs CTAs (one per request slot); requests past num_reqs are padding (length 0).
// Local length 128 * cnt + q_len - 1 makes the cnt shard blocks fully visible to every row; rows
// j >= 1 see one more local block (column cnt), which points at the request's page of block 0
// (always valid) and whose score nobody reads.
__global__ void __launch_bounds__(kThreads)
    cp_shard_tables_kernel(const __grid_constant__ CpParams p) {
  const int req = blockIdx.x;
  int cnt = 0;
  int seq = 0;
  if (req < p.num_reqs) {
    seq = p.seq_lens[req];
    const int nb = seq > 0 ? (seq - 1) / idx::kBlockTokens + 1 : 0;
    cnt = shard_count(nb, p.rank, p.world);
    if (nb > p.table_cols) cnt = 0;  // unreadable request: the scoring guard would flag it
  }
  if (threadIdx.x == 0) {
    p.local_seq_lens[req] = cnt > 0 ? idx::kBlockTokens * cnt + p.q_len - 1 : 0;
  }
  if (cnt == 0) return;
  const int32_t* row = p.block_table + static_cast<int64_t>(req) * p.table_cols;
  int32_t* out = p.local_table + static_cast<int64_t>(req) * p.local_cols;
  for (int l = threadIdx.x; l <= cnt && l < p.local_cols; l += blockDim.x) {
    out[l] = l < cnt ? row[static_cast<int64_t>(l) * p.world + p.rank] : row[0];
  }
}

// ---------------------------------------------------------------------------------------------
// Nominate. Purpose: each (row, head) of the buffer's max_rows gets this shard's best k keys,
// descending, 0-padded, tagged with generation tag g % 255 + 1, stored (system scope, one 64-bit
// store per key: each slot is its own arrival flag) into every consumer's slice
// [parity][this shard][consumer-local head][row][k]; or into a local send buffer
// [H][max_rows][k] for the NCCL transport. Rows past the live batch send tagged empties so every
// consumer's wait is met. Grid: ceil(max_rows * H / 8) CTAs of 8 warps, one warp per (row, head).
__device__ __forceinline__ void nominate_item(const CpParams& p, int item, uint32_t generation,
                                              uint64_t* scratch) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  if (item >= p.max_rows * p.heads) return;
  const int row = item / p.heads;
  const int head = item % p.heads;
  const int k = p.topk;
  const uint32_t tag = generation_tag(generation);
  const int parity = static_cast<int>(generation & 1u);

  const int pos = row_pos(p, row);
  const int nb = pos >= 0 ? pos / idx::kBlockTokens + 1 : 0;
  int cnt = shard_count(nb, p.rank, p.world);
  if (nb > p.table_cols) cnt = 0;
  const float* scores = p.scores + (static_cast<int64_t>(row) * p.heads + head) * p.local_cols;
  auto get = [&](int l) -> uint64_t {
    const uint32_t block = static_cast<uint32_t>(l * p.world + p.rank);
    return is_forced_block(block, nb, p.init_blocks, p.local_blocks) ? forced_key(block)
                                                                     : scored_key(scores[l], block);
  };
  const uint64_t key = cnt > 0 ? idx::warp_top_keys(get, cnt, k, scratch) : 0;
  if (lane >= k) return;
  const uint64_t wire = with_tag(key, tag);
  if (p.dest_local) {
    store_sys(p.dest[0] + (static_cast<int64_t>(head) * p.max_rows + row) * k + lane, wire);
    return;
  }
  // Consumers of `head` (cp_consumers) and the head's index among each one's merged heads.
  if (p.world <= p.heads) {
    const int per = p.heads / p.world;
    const int consumer = head / per;
    const int local_head = head % per;
    uint64_t* slot = p.dest[consumer] + parity * p.parity_stride + p.rank * p.source_stride +
                     local_head * p.head_stride + static_cast<int64_t>(row) * k + lane;
    store_sys(slot, wire);
  } else {
    const int per_head = p.world / p.heads;
    for (int i = 0; i < per_head; ++i) {
      const int consumer = head * per_head + i;
      uint64_t* slot = p.dest[consumer] + parity * p.parity_stride + p.rank * p.source_stride +
                       static_cast<int64_t>(row) * k + lane;
      store_sys(slot, wire);
    }
  }
}

// The generation of the call being made (the counter holds the calls completed).
__device__ __forceinline__ uint32_t next_generation(const CpParams& p) {
  return *reinterpret_cast<volatile uint32_t*>(&p.control->generation) + 1u;
}

__global__ void __launch_bounds__(kThreads) cp_nominate_kernel(const __grid_constant__ CpParams p) {
  __shared__ __align__(16) uint64_t s_scratch[kWarps][idx::kScratch];
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  nominate_item(p, blockIdx.x * kWarps + warp, next_generation(p), &s_scratch[warp][0]);
}

// ---------------------------------------------------------------------------------------------
// Merge. Purpose: for each (row, merged head) of the buffer's max_rows, wait until every source's
// k slots carry this call's tag, strip the tags and select the exact top k of the P * k
// candidates (cp.md "Exactness"); live rows write topk_idx. The wait is bounded: the timer is read
// only after a first miss, then every 32 polls; on expiry (or when another warp already gave up)
// the warp records (layer, row, head, source, expected tag, seen tag) once and leaves. The last
// CTA to finish bumps the generation counter for the next call.
// Grid: ceil(max_rows * merged / 8) CTAs of 8 warps, one warp per (row, merged head).
__device__ __forceinline__ void merge_item(const CpParams& p, int item, uint32_t generation,
                                           uint64_t* s_cand_warp, uint64_t* scratch) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const uint32_t tag = generation_tag(generation);
  const int parity = static_cast<int>(generation & 1u);
  const int k = p.topk;

  if (item < p.max_rows * p.merged) {
    const int row = item / p.merged;
    const int local_head = item % p.merged;
    const uint64_t* base = p.cand + parity * p.parity_stride +
                           (p.cand_head_base + local_head) * p.head_stride +
                           static_cast<int64_t>(row) * k;
    volatile uint32_t* error_flag = &p.control->error.flag;
    bool failed = false;
    for (int source = 0; source < p.world && !failed; ++source) {
      const uint64_t* slot = base + source * p.source_stride + lane;
      uint64_t v = lane < k ? load_sys(slot) : 0;
      bool arrived = lane >= k || key_tag(v) == tag;
      if (!__all_sync(0xFFFFFFFFu, arrived)) {
        const uint64_t start = global_timer_ns();
        for (uint32_t polls = 1;; ++polls) {
          if (!arrived) {
            v = load_sys(slot);
            arrived = key_tag(v) == tag;
          }
          if (__all_sync(0xFFFFFFFFu, arrived)) break;
          if ((polls & 31u) == 0) {
            const bool expired = global_timer_ns() - start > p.budget_ns || *error_flag != 0;
            if (__any_sync(0xFFFFFFFFu, expired)) {
              const unsigned missing = __ballot_sync(0xFFFFFFFFu, !arrived);
              if (lane == __ffs(missing) - 1 && atomicCAS(&p.control->error.flag, 0u, 1u) == 0u) {
                CpDeviceError& e = p.control->error;
                e.layer = p.layer;
                e.row = row;
                e.head = p.head0 + local_head;
                e.source = source;
                e.expected_tag = tag;
                e.seen_tag = key_tag(v);
                __threadfence_system();
              }
              failed = true;
              break;
            }
          }
        }
      }
      if (lane < k) s_cand_warp[source * k + lane] = with_tag(v, 0);
    }
    __syncwarp();
    if (!failed && row < p.live_rows) {
      const uint64_t* cand = s_cand_warp;
      const uint64_t top =
          idx::warp_top_keys([&](int i) { return cand[i]; }, p.world * k, k, scratch);
      idx::write_topk_row(p.topk_idx + (static_cast<int64_t>(row) * p.merged + local_head) * k, top,
                          k);
    }
  }
}

// Every CTA of the launch has read the generation before it arrives here, so the last one to
// arrive may bump it for the next call.
__device__ __forceinline__ void finish_call(const CpParams& p, uint32_t generation) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t arrived = atomicAdd(&p.control->done, 1u);
    if (arrived == gridDim.x - 1) {
      p.control->done = 0;
      p.control->generation = generation;
    }
  }
}

__global__ void __launch_bounds__(kThreads) cp_merge_kernel(const __grid_constant__ CpParams p) {
  __shared__ __align__(16) uint64_t s_cand[kWarps][kMaxCand];
  __shared__ __align__(16) uint64_t s_scratch[kWarps][idx::kScratch];
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const uint32_t generation = next_generation(p);
  merge_item(p, blockIdx.x * kWarps + warp, generation, &s_cand[warp][0], &s_scratch[warp][0]);
  finish_call(p, generation);
}

// Peer exchange in one launch: CTAs [0, nominate_ctas) nominate, the rest merge, so a call pays
// one kernel boundary instead of two. Nominating CTAs come first in the grid (the order in which
// CTAs are dispatched) and, for the supported sizes, every CTA of both roles is resident at once;
// should a merging CTA still starve a nominating one, the bounded wait turns that into a timeout
// error, not a hang. Grid: nominate_ctas + ceil(max_rows * merged / 8) CTAs of 8 warps.
__global__ void __launch_bounds__(kThreads)
    cp_exchange_kernel(const __grid_constant__ CpParams p, int nominate_ctas) {
  __shared__ __align__(16) uint64_t s_cand[kWarps][kMaxCand];
  __shared__ __align__(16) uint64_t s_scratch[kWarps][idx::kScratch];
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const uint32_t generation = next_generation(p);
  if (static_cast<int>(blockIdx.x) < nominate_ctas) {
    nominate_item(p, blockIdx.x * kWarps + warp, generation, &s_scratch[warp][0]);
  } else {
    merge_item(p, (blockIdx.x - nominate_ctas) * kWarps + warp, generation, &s_cand[warp][0],
               &s_scratch[warp][0]);
  }
  finish_call(p, generation);
}

// ---------------------------------------------------------------------------------------------
// allreduce-max, step 1. Purpose: the shard's scores into the full-width tensor
// [max_rows, H, full_cols]: column b holds this shard's score of block b when b % P == r and b is
// visible to the row, -inf everywhere else (so an NCCL MAX all-reduce assembles every block's
// score). Grid: (ceil(full_cols / 256), max_rows * H).
__global__ void __launch_bounds__(kThreads)
    cp_scatter_scores_kernel(const __grid_constant__ CpParams p) {
  const int item = blockIdx.y;
  const int row = item / p.heads;
  const int head = item % p.heads;
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= p.full_cols) return;
  const int pos = row_pos(p, row);
  const int nb = pos >= 0 ? pos / idx::kBlockTokens + 1 : 0;
  float value = -__int_as_float(0x7F800000);
  if (b < nb && nb <= p.table_cols && b % p.world == p.rank) {
    value = p.scores[(static_cast<int64_t>(row) * p.heads + head) * p.local_cols + b / p.world];
  }
  p.full_scores[(static_cast<int64_t>(row) * p.heads + head) * p.full_cols + b] = value;
}

// allreduce-max, step 2. Purpose: the ordinary top-k of the reduced scores for the merged heads.
// Grid: ceil(max_rows * merged / 8) CTAs, one warp per (row, merged head); live rows only write.
__global__ void __launch_bounds__(kThreads)
    cp_select_full_kernel(const __grid_constant__ CpParams p) {
  __shared__ __align__(16) uint64_t s_scratch[kWarps][idx::kScratch];
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int item = blockIdx.x * kWarps + warp;
  if (item >= p.max_rows * p.merged) return;
  const int row = item / p.merged;
  const int local_head = item % p.merged;
  if (row >= p.live_rows) return;
  const int pos = row_pos(p, row);
  int nb = pos >= 0 ? pos / idx::kBlockTokens + 1 : 0;
  if (nb > p.table_cols) nb = 0;
  const float* scores =
      p.full_scores + (static_cast<int64_t>(row) * p.heads + p.head0 + local_head) * p.full_cols;
  auto get = [&](int b) -> uint64_t {
    const uint32_t block = static_cast<uint32_t>(b);
    return is_forced_block(b, nb, p.init_blocks, p.local_blocks) ? forced_key(block)
                                                                 : scored_key(scores[b], block);
  };
  const uint64_t top = idx::warp_top_keys(get, nb, p.topk, &s_scratch[warp][0]);
  idx::write_topk_row(p.topk_idx + (static_cast<int64_t>(row) * p.merged + local_head) * p.topk,
                      top, p.topk);
}

// replicated: the merged heads' rows of a full [live_rows, H, k] selection.
// Grid: ceil(live_rows * merged * k / 256) CTAs.
__global__ void __launch_bounds__(kThreads)
    cp_gather_heads_kernel(const int32_t* full, int32_t* out, int live_rows, int heads, int merged,
                           int head0, int k) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = static_cast<int64_t>(live_rows) * merged * k;
  if (i >= total) return;
  const int64_t row = i / (static_cast<int64_t>(merged) * k);
  const int rest = static_cast<int>(i % (static_cast<int64_t>(merged) * k));
  const int lh = rest / k;
  const int j = rest % k;
  out[i] = full[(row * heads + head0 + lh) * k + j];
}

}  // namespace m3msa::cuda::cp
