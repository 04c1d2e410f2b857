// Kernels of the context-parallel indexer exchange (docs/context_parallel.md,
// include/m3msa/cp_cuda.h). Framework-free: raw pointers and one params struct
// (cp_exchange_params.h), launched by cp_exchange.cu.
//
// Scoring of a rank's round-robin shard reuses the one-GPU scoring kernels (indexer_kernel.cuh:
// the split kernel, or the span kernel under M3MSA_CP_SPAN_SCORING=1) in their scores-only modes
// over a *shard table*: local block l of shard r is global block l*P + r. The
// kernel masks tokens by the local position, so cp_exchange_shard_tables_kernel gives every live
// request a local length that makes all of its shard's blocks fully visible; this is exact because
// every block a row scores (rather than forces) is fully visible to it: the only partly visible
// block of a row is its own, which is forced whenever local_blocks >= 1 (checked on the host). The
// dot products and maxima of a block are then computed by the same code in the same order as on one
// GPU, so every key, and so every selection, is bit-identical.
//
// Call words (lockstep check). Next to its k keys, each nomination carries one more tagged 64-bit
// word describing the call that made it: a 32-bit digest of (layer, num_reqs, q_len, table width,
// cache dtype) and the batch shape in plain bits. It is its own arrival flag like the keys, so
// once it carries this call's tag it describes the sender's current call; a consumer whose own
// word differs has found a rank that passed another shape (or another layer) for the same call
// and records it instead of merging what it got. The allreduce-max transport carries the same
// digests through its all-reduce (one slot per rank). Keys themselves are untouched, so the
// selections stay bit-identical.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cp/cp_exchange_params.h"
#include "cuda/indexer_kernel.cuh"
#include "m3msa/sort_key.h"

namespace m3msa::cuda::cp_exchange {

__device__ __forceinline__ int row_pos(const CpExchangeParams& p, int row) {
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
    cp_exchange_shard_tables_kernel(const __grid_constant__ CpExchangeParams p) {
  const int req = blockIdx.x;
  int cnt = 0;
  int seq = 0;
  if (req < p.num_reqs) {
    seq = p.seq_lens[req];
    const int nb = seq > 0 ? (seq - 1) / indexer::kBlockTokens + 1 : 0;
    cnt = shard_count(nb, p.rank, p.world);
    if (nb > p.table_cols) cnt = 0;  // unreadable request: the scoring guard would flag it
  }
  if (threadIdx.x == 0) {
    p.local_seq_lens[req] = cnt > 0 ? indexer::kBlockTokens * cnt + p.q_len - 1 : 0;
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
// [parity][this shard][consumer-local head][row][k], plus the tagged call word of the (row, head)
// in the consumer's word region; or into a local send buffer ([H][max_rows][k] keys, then
// [H][max_rows] words) for the NCCL transport. Rows past the live batch send tagged empties so
// every consumer's wait is met. Grid: ceil(max_rows * H / 8) CTAs of 8 warps, one warp per
// (row, head).
__device__ __forceinline__ void nominate_item(const CpExchangeParams& p, int item,
                                              uint32_t generation, uint64_t* scratch) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  if (item >= p.max_rows * p.heads) return;
  const int row = item / p.heads;
  const int head = item % p.heads;
  const int k = p.topk;
  const uint32_t tag = generation_tag(generation);
  const int parity = static_cast<int>(generation & 1u);

  const int pos = row_pos(p, row);
  const int nb = pos >= 0 ? pos / indexer::kBlockTokens + 1 : 0;
  int cnt = shard_count(nb, p.rank, p.world);
  if (nb > p.table_cols) cnt = 0;
  const float* scores = p.scores + (static_cast<int64_t>(row) * p.heads + head) * p.local_cols;
  auto get = [&](int l) -> uint64_t {
    const uint32_t block = static_cast<uint32_t>(l * p.world + p.rank);
    return is_forced_block(block, nb, p.init_blocks, p.local_blocks) ? forced_key(block)
                                                                     : scored_key(scores[l], block);
  };
  const uint64_t key = cnt > 0 ? indexer::warp_top_keys(get, cnt, k, scratch) : 0;
  if (lane >= k) return;
  const uint64_t wire = with_tag(key, tag);
  const uint64_t word = with_tag(p.call_word, tag);
  if (p.dest_local) {
    store_sys(p.dest[0] + (static_cast<int64_t>(head) * p.max_rows + row) * k + lane, wire);
    if (lane == 0) {
      store_sys(p.dest[0] + p.word_offset + static_cast<int64_t>(head) * p.max_rows + row, word);
    }
    return;
  }
  // Consumers of `head` (cp_consumers) and the head's index among each one's merged heads.
  const int per_head = p.world <= p.heads ? 1 : p.world / p.heads;
  const int first_consumer = p.world <= p.heads ? head / (p.heads / p.world) : head * per_head;
  const int local_head = p.world <= p.heads ? head % (p.heads / p.world) : 0;
  for (int i = 0; i < per_head; ++i) {
    uint64_t* base = p.dest[first_consumer + i];
    store_sys(base + parity * p.parity_stride + p.rank * p.source_stride +
                  local_head * p.head_stride + static_cast<int64_t>(row) * k + lane,
              wire);
    if (lane == 0) {
      store_sys(base + p.word_offset + parity * p.word_parity_stride +
                    p.rank * p.word_source_stride + static_cast<int64_t>(local_head) * p.max_rows +
                    row,
                word);
    }
  }
}

// The generation of the call being made (the counter holds the calls completed).
__device__ __forceinline__ uint32_t next_generation(const CpExchangeParams& p) {
  return *reinterpret_cast<volatile uint32_t*>(&p.control->generation) + 1u;
}

__global__ void __launch_bounds__(kThreads)
    cp_exchange_nominate_kernel(const __grid_constant__ CpExchangeParams p) {
  __shared__ __align__(16) uint64_t s_scratch[kWarps][indexer::kScratch];
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  nominate_item(p, blockIdx.x * kWarps + warp, next_generation(p), &s_scratch[warp][0]);
}

// ---------------------------------------------------------------------------------------------
// Merge. Purpose: for each (row, merged head) of the buffer's max_rows, wait until every source's
// k slots and call word carry this call's tag, check the word against this rank's (a different
// one is a rank that passed another shape: recorded, nothing merged), strip the tags and select
// the exact top k of the P * k candidates (docs/context_parallel.md "Exactness"); live rows write
// topk_idx. Every wait is bounded: the timer is read only after a first miss, then every 32 polls;
// on expiry (or when another warp already gave up) the warp records (layer, row, head, source,
// expected tag, seen tag) once and leaves. The last CTA to finish bumps the generation counter for
// the next call. Grid: ceil(max_rows * merged / 8) CTAs of 8 warps, one warp per (row, merged
// head).

// Records the first fault of the call (the first writer wins); one lane calls it.
__device__ __forceinline__ void record_fault(const CpExchangeParams& p, uint32_t kind, int row,
                                             int head, int source, uint32_t expected_tag,
                                             uint32_t seen_tag, uint64_t expected_word,
                                             uint64_t seen_word) {
  if (atomicCAS(&p.control->error.flag, 0u, 1u) != 0u) return;
  CpExchangeError& e = p.control->error;
  e.layer = p.layer;
  e.row = row;
  e.head = head;
  e.source = source;
  e.expected_tag = expected_tag;
  e.seen_tag = seen_tag;
  e.kind = kind;
  e.expected_word = expected_word;
  e.seen_word = seen_word;
  __threadfence_system();
}

// Spins (bounded) until `*slot` carries `tag` in every lane with `active` set; `v` holds the
// last value read. False when the budget ran out or another warp already recorded a fault.
// Warp-uniform result.
__device__ __forceinline__ bool wait_tagged(const CpExchangeParams& p, const uint64_t* slot,
                                            bool active, uint32_t tag, uint64_t& v) {
  v = active ? load_sys(slot) : 0;
  bool arrived = !active || key_tag(v) == tag;
  if (__all_sync(0xFFFFFFFFu, arrived)) return true;
  const volatile uint32_t* error_flag = &p.control->error.flag;
  const uint64_t start = global_timer_ns();
  for (uint32_t polls = 1;; ++polls) {
    if (!arrived) {
      v = load_sys(slot);
      arrived = key_tag(v) == tag;
    }
    if (__all_sync(0xFFFFFFFFu, arrived)) return true;
    if ((polls & 31u) == 0) {
      const bool expired = global_timer_ns() - start > p.budget_ns || *error_flag != 0;
      if (__any_sync(0xFFFFFFFFu, expired)) return false;
    }
  }
}

__device__ __forceinline__ void merge_item(const CpExchangeParams& p, int item, uint32_t generation,
                                           uint64_t* s_cand_warp, uint64_t* scratch) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const uint32_t tag = generation_tag(generation);
  const int parity = static_cast<int>(generation & 1u);
  const int k = p.topk;

  if (item < p.max_rows * p.merged) {
    const int row = item / p.merged;
    const int local_head = item % p.merged;
    const int head = p.head0 + local_head;
    const uint64_t* base = p.cand + parity * p.parity_stride +
                           (p.cand_head_base + local_head) * p.head_stride +
                           static_cast<int64_t>(row) * k;
    const uint64_t* words = p.cand + p.word_offset + parity * p.word_parity_stride +
                            static_cast<int64_t>(p.cand_head_base + local_head) * p.max_rows + row;
    const uint64_t my_word = with_tag(p.call_word, tag);
    bool failed = false;
    for (int source = 0; source < p.world && !failed; ++source) {
      uint64_t v = 0;
      if (!wait_tagged(p, base + source * p.source_stride + lane, lane < k, tag, v)) {
        const unsigned missing = __ballot_sync(0xFFFFFFFFu, lane < k && key_tag(v) != tag);
        if (lane == (missing ? __ffs(missing) - 1 : 0)) {
          record_fault(p, kFaultTimeout, row, head, source, tag, key_tag(v), my_word, 0);
        }
        failed = true;
        break;
      }
      if (lane < k) s_cand_warp[source * k + lane] = with_tag(v, 0);
      // The call word: every lane reads the same slot (one transaction).
      uint64_t w = 0;
      if (!wait_tagged(p, words + source * p.word_source_stride, true, tag, w)) {
        if (lane == 0) {
          record_fault(p, kFaultTimeout, row, head, source, tag, key_tag(w), my_word, 0);
        }
        failed = true;
        break;
      }
      if (w != my_word) {
        if (lane == 0) {
          record_fault(p, kFaultShapeMismatch, row, head, source, tag, key_tag(w), my_word, w);
        }
        failed = true;
      }
    }
    __syncwarp();
    if (!failed && row < p.live_rows) {
      const uint64_t* cand = s_cand_warp;
      const uint64_t top =
          indexer::warp_top_keys([&](int i) { return cand[i]; }, p.world * k, k, scratch);
      indexer::write_topk_row(p.topk_idx + (static_cast<int64_t>(row) * p.merged + local_head) * k,
                              top, k);
    }
  }
}

// Every CTA of the launch has read the generation before it arrives here, so the last one to
// arrive may bump it for the next call.
__device__ __forceinline__ void finish_call(const CpExchangeParams& p, uint32_t generation) {
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

__global__ void __launch_bounds__(kThreads)
    cp_exchange_merge_kernel(const __grid_constant__ CpExchangeParams p) {
  __shared__ __align__(16) uint64_t s_cand[kWarps][kMaxCand];
  __shared__ __align__(16) uint64_t s_scratch[kWarps][indexer::kScratch];
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
    cp_exchange_fused_kernel(const __grid_constant__ CpExchangeParams p, int nominate_ctas) {
  __shared__ __align__(16) uint64_t s_cand[kWarps][kMaxCand];
  __shared__ __align__(16) uint64_t s_scratch[kWarps][indexer::kScratch];
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
// Diagnostics (M3MSA_CP_DEBUG=1 only; one thread, queued after a call's exchange): prints the
// generation the call completed, its tag and parity, the call word every source left in this
// rank's buffer for row 0 / merged head 0, and the error record. Device printf is flushed at the
// host's next synchronization.
__global__ void cp_exchange_debug_kernel(const __grid_constant__ CpExchangeParams p,
                                         int transport) {
  const volatile CpExchangeControl* c = p.control;
  const uint32_t g = c->generation;
  const int parity = static_cast<int>(g & 1u);
  printf(
      "m3msa cp dev: rank %d transport %d layer %d: generation %u done (tag %u, parity %d), "
      "own word %016llx, error flag %u kind %u source %d row %d expected tag %u seen tag %u\n",
      p.rank, transport, p.layer, g, generation_tag(g), parity,
      static_cast<unsigned long long>(with_tag(p.call_word, generation_tag(g))), c->error.flag,
      c->error.kind, c->error.source, c->error.row, c->error.expected_tag, c->error.seen_tag);
  if (p.cand == nullptr) return;
  for (int source = 0; source < p.world; ++source) {
    const uint64_t w = load_sys(p.cand + p.word_offset + parity * p.word_parity_stride +
                                source * p.word_source_stride +
                                static_cast<int64_t>(p.cand_head_base) * p.max_rows);
    const uint64_t k0 = load_sys(p.cand + parity * p.parity_stride + source * p.source_stride +
                                 static_cast<int64_t>(p.cand_head_base) * p.head_stride);
    printf(
        "m3msa cp dev: rank %d layer %d: from rank %d row 0: word %016llx (tag %u, num_reqs "
        "%u, q_len %u), key 0 %016llx (tag %u)\n",
        p.rank, p.layer, source, static_cast<unsigned long long>(w), key_tag(w),
        static_cast<unsigned>((w >> 8) & 0xFFFFu), static_cast<unsigned>(w & 0xFFu),
        static_cast<unsigned long long>(k0), key_tag(k0));
  }
}

// ---------------------------------------------------------------------------------------------
// allreduce-max, step 1. Purpose: the shard's scores into the full-width tensor
// [max_rows, H, full_cols]: column b holds this shard's score of block b when b % P == r and b is
// visible to the row, -inf everywhere else (so an NCCL MAX all-reduce assembles every block's
// score); then the digest slots [P][2] after it: this rank's call digest as two 16-bit halves in
// its own slot (exact in fp32), -inf in the others, so after the MAX every rank holds every
// rank's digest. Grid: (ceil(full_cols / 256), max_rows * H).
__global__ void __launch_bounds__(kThreads)
    cp_exchange_scatter_scores_kernel(const __grid_constant__ CpExchangeParams p) {
  const int item = blockIdx.y;
  const int row = item / p.heads;
  const int head = item % p.heads;
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const float neg_inf = -__int_as_float(0x7F800000);
  if (item == 0 && blockIdx.x == 0 && threadIdx.x < 2 * kMaxWorld) {
    const int slot_rank = static_cast<int>(threadIdx.x) / 2;
    const uint32_t digest = static_cast<uint32_t>(p.call_word >> 32);
    const uint32_t half = (threadIdx.x & 1u) ? (digest & 0xFFFFu) : (digest >> 16);
    float* slots = p.full_scores + static_cast<int64_t>(p.max_rows) * p.heads * p.full_cols;
    if (slot_rank < p.world) {
      slots[threadIdx.x] = slot_rank == p.rank ? static_cast<float>(half) : neg_inf;
    }
  }
  if (b >= p.full_cols) return;
  const int pos = row_pos(p, row);
  const int nb = pos >= 0 ? pos / indexer::kBlockTokens + 1 : 0;
  float value = neg_inf;
  if (b < nb && nb <= p.table_cols && b % p.world == p.rank) {
    value = p.scores[(static_cast<int64_t>(row) * p.heads + head) * p.local_cols + b / p.world];
  }
  p.full_scores[(static_cast<int64_t>(row) * p.heads + head) * p.full_cols + b] = value;
}

// allreduce-max, step 2. Purpose: the ordinary top-k of the reduced scores for the merged heads,
// after checking that every rank's digest equals this one's (else the first differing rank is
// recorded as a shape mismatch and nothing is written).
// Grid: ceil(max_rows * merged / 8) CTAs, one warp per (row, merged head); live rows only write.
__global__ void __launch_bounds__(kThreads)
    cp_exchange_select_full_kernel(const __grid_constant__ CpExchangeParams p) {
  __shared__ __align__(16) uint64_t s_scratch[kWarps][indexer::kScratch];
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int item = blockIdx.x * kWarps + warp;
  if (item >= p.max_rows * p.merged) return;
  const int row = item / p.merged;
  const int local_head = item % p.merged;
  {
    const float* slots = p.full_scores + static_cast<int64_t>(p.max_rows) * p.heads * p.full_cols;
    const uint32_t mine = static_cast<uint32_t>(p.call_word >> 32);
    uint32_t theirs = mine;
    if (lane < p.world) {
      const float hi = slots[2 * lane];
      const float lo = slots[2 * lane + 1];
      // A -inf (the rank never wrote its slot) or anything not a 16-bit integer is a mismatch.
      const bool valid = hi >= 0.0f && hi <= 65535.0f && lo >= 0.0f && lo <= 65535.0f;
      theirs = valid ? (static_cast<uint32_t>(hi) << 16) | static_cast<uint32_t>(lo) : ~mine;
    }
    const unsigned differing = __ballot_sync(0xFFFFFFFFu, theirs != mine);
    if (differing != 0) {
      const int source = __ffs(differing) - 1;
      if (lane == source) {
        record_fault(p, kFaultShapeMismatch, row, p.head0 + local_head, source, 0, 0,
                     static_cast<uint64_t>(mine) << 32, static_cast<uint64_t>(theirs) << 32);
      }
      return;
    }
  }
  if (row >= p.live_rows) return;
  const int pos = row_pos(p, row);
  int nb = pos >= 0 ? pos / indexer::kBlockTokens + 1 : 0;
  if (nb > p.table_cols) nb = 0;
  const float* scores =
      p.full_scores + (static_cast<int64_t>(row) * p.heads + p.head0 + local_head) * p.full_cols;
  auto get = [&](int b) -> uint64_t {
    const uint32_t block = static_cast<uint32_t>(b);
    return is_forced_block(b, nb, p.init_blocks, p.local_blocks) ? forced_key(block)
                                                                 : scored_key(scores[b], block);
  };
  const uint64_t top = indexer::warp_top_keys(get, nb, p.topk, &s_scratch[warp][0]);
  indexer::write_topk_row(p.topk_idx + (static_cast<int64_t>(row) * p.merged + local_head) * p.topk,
                          top, p.topk);
}

// replicated: the merged heads' rows of a full [live_rows, H, k] selection.
// Grid: ceil(live_rows * merged * k / 256) CTAs.
__global__ void __launch_bounds__(kThreads)
    cp_exchange_gather_heads_kernel(const int32_t* full, int32_t* out, int live_rows, int heads,
                                    int merged, int head0, int k) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t total = static_cast<int64_t>(live_rows) * merged * k;
  if (i >= total) return;
  const int64_t row = i / (static_cast<int64_t>(merged) * k);
  const int rest = static_cast<int>(i % (static_cast<int64_t>(merged) * k));
  const int lh = rest / k;
  const int j = rest % k;
  out[i] = full[(row * heads + head0 + lh) * k + j];
}

}  // namespace m3msa::cuda::cp_exchange
