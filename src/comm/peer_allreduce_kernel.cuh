// The one-shot tensor-parallel all-reduce through peer-mapped buffers (src/comm/peer_allreduce.h),
// device side. Framework-free: raw pointers, one params struct (peer_allreduce_params.h), launched
// by peer_allreduce.cu.
//
// Purpose: data[0..count) <- the fp32 sum over the P ranks, in rank order, in place, for
// decode-sized messages (count <= a few hundred thousand floats), in one kernel and without a
// barrier (the exchange of docs/context_parallel.md "The exchange without a barrier", applied to a
// sum).
//
// Algorithm (one launch per call, on every rank):
//  - Every CTA reads the rank's generation counter g (calls completed) at its start; the call uses
//    tag t = g % 0xFFFFFFFF + 1 (never 0, never the same for two calls of one parity, see below)
//    and parity g & 1.
//  - Each rank owns a receive buffer [2 parities][P sources][slot] of u64 words (zeroed once,
//    never cleared) that every peer can store into, then the call words
//    [2 parities][P sources][CTAs][kCallWords]. A word is (t << 32) | bits, so the payload is its
//    own arrival flag: no flag word, no clear, no second round trip.
//  - Send: thread tid of CTA c owns the element pairs j = c * kThreads + tid + n * CTAs * kThreads
//    (the partition depends on the fixed grid only, never on count). It stores its call word
//    (CTA c's: the digest of (count, call id), count, call id) and then every pair it owns, as
//    16-byte system-scope stores of two tagged words, into slot [parity][own rank][2j] of every
//    peer.
//  - Receive: for each owned pair it spins (bounded) on its own buffer's slot [parity][r][2j]
//    until both words carry t, for every source r != own rank, and sums the P values in rank
//    order 0..P-1 (its own read from data): s = v_0; s += v_1; ...; s += v_{P-1}, in fp32. Every
//    rank therefore computes bit-identical sums. Meanwhile lanes 0..P-1 of warp 0 spin on the
//    call words of the peers' CTA c; a word that differs (another count or call id for the same
//    call) is recorded as a fault. No sum is written before the CTA has checked every peer's call
//    word (one __syncthreads between the first pair's receive and its write), so a mismatched
//    call writes nothing.
//  - The last CTA to finish advances the counter (g + 1): exactly once per call.
//
// Why two parities suffice (the argument of docs/context_parallel.md): a rank's call g+2 stores
// into parity p slots that its peers read during their call g. The rank started call g+2 after its
// call g+1 completed (stream order), which needed every peer's call word of g+1 (every CTA waits
// for them, whatever count), which each peer stored after its call g had completed. So every peer's
// reads of call g are finished before the first store of call g+2 into the same parity. On both
// sides the two accesses are separated by a kernel boundary (which orders all memory operations of
// a grid before those of the next grid of the stream), so a load of call g cannot observe a store
// of g+2. Within a parity, tags of calls g and g+2k differ for every 0 < 2k < 2^32 - 1 (the counter
// wraps at 2^32, the tag period is 2^32 - 1, and the wrap only repeats a tag on consecutive calls,
// which have different parities), and the zeroed buffer holds tag 0, which is never expected.
//
// Stale slots: a call stores only the pairs below its count, so a slot above the counts in use
// keeps an old word for as long as the counts stay small; after 2^32 - 1 calls its tag would come
// round again, and a later call with a large count would take that stale word for a fresh one.
// So every call also rewrites one pair per CTA above its count (a rotating refresh pointer, with
// a tagged 0.0), and every slot is rewritten at least once per slot_pairs / CTAs calls of its
// parity, far below the tag period. Nobody reads refreshed slots in that call (they are above the
// agreed count).
//
// Requirements:
//  - Every rank makes the same calls with the same count in the same order (checked: call words),
//    on one stream per rank (a rank's calls must never overlap).
//  - All CTAs of every rank's launch are co-resident: CTA c spins on the peers' CTA c, so on a
//    device that also runs a peer (ranks sharing one GPU) a launch that filled every SM would
//    starve the peer's CTAs it waits for. The host sizes the grid (the same on every rank) so that
//    the ranks on one device fit it together, and at most one CTA per SM by default. Should a CTA
//    still be starved, the bounded spin turns it into a timeout error, not a hang.
//  - Every wait is bounded by budget_ns (%globaltimer, read after a first miss and then every 32
//    polls); on expiry the first thread records (kind, source, element, expected tag, seen tag)
//    in the device error record and every thread of the launch leaves at its next check. A
//    launch that finds the error record already set (an earlier call failed) does nothing: the
//    ranks are out of lockstep, and a graph replayed after a fault must not spin again.
//  - After a fault data[0..count) is unspecified (sums of pairs received before it may be in).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "comm/peer_allreduce_params.h"

namespace m3msa::cuda::peer_allreduce {

// Never 0 (the zeroed buffer) and, within one parity, never the same for two calls less than
// 2^32 - 1 calls apart (see the file comment).
__host__ __device__ inline uint32_t ar_tag(uint32_t generation) {
  return generation % 0xFFFFFFFFu + 1u;
}

__device__ __forceinline__ uint32_t word_tag(uint64_t word) {
  return static_cast<uint32_t>(word >> 32);
}

// Each 8-byte word of a vector access is single-copy atomic on its own, which is all the
// protocol needs (every word carries its tag).
__device__ __forceinline__ void store_pair_sys(uint64_t* ptr, uint64_t a, uint64_t b) {
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(ptr), "l"(a), "l"(b)
               : "memory");
}

__device__ __forceinline__ void load_pair_sys(const uint64_t* ptr, uint64_t& a, uint64_t& b) {
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];"
               : "=l"(a), "=l"(b)
               : "l"(ptr)
               : "memory");
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ float2 load_data_pair(const PeerAllReduceParams& p, int64_t j) {
  const int64_t e = 2 * j;
  if (p.data_aligned && e + 1 < p.count) return reinterpret_cast<const float2*>(p.data)[j];
  return make_float2(p.data[e], e + 1 < p.count ? p.data[e + 1] : 0.0f);
}

__device__ __forceinline__ void store_data_pair(const PeerAllReduceParams& p, int64_t j, float2 v) {
  const int64_t e = 2 * j;
  if (p.data_aligned && e + 1 < p.count) {
    reinterpret_cast<float2*>(p.data)[j] = v;
    return;
  }
  p.data[e] = v.x;
  if (e + 1 < p.count) p.data[e + 1] = v.y;
}

// The words of a call-word slot: (tag << 32) | digest, count bits 31..0, call id, count
// bits 63..32.
struct CallWords {
  uint64_t w[kCallWords];
};

// Records the first fault of the call (the first writer wins) and tells the CTA to stop.
// `seen` is the source's call word when has_seen (a mismatch).
__device__ __noinline__ void record_fault(const PeerAllReduceParams& p, uint32_t kind, int source,
                                          int64_t element, uint32_t expected_tag, uint32_t seen_tag,
                                          bool has_seen, CallWords seen, volatile int* s_abort) {
  *s_abort = 1;
  if (atomicCAS(&p.control->error.flag, 0u, 1u) != 0u) return;
  PeerAllReduceError& e = p.control->error;
  e.kind = kind;
  e.source = source;
  e.cta = static_cast<int32_t>(blockIdx.x);
  e.element = element;
  e.expected_tag = expected_tag;
  e.seen_tag = seen_tag;
  e.count = p.count;
  e.call_id = p.call_id;
  e.digest = p.digest;
  e.seen_digest = has_seen ? static_cast<uint32_t>(seen.w[0]) : 0u;
  e.seen_count =
      has_seen
          ? static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(seen.w[3])) << 32) |
                                 static_cast<uint32_t>(seen.w[1]))
          : -1;
  e.seen_call_id = has_seen ? static_cast<int32_t>(static_cast<uint32_t>(seen.w[2])) : -1;
  __threadfence_system();
}

// Whether this thread must stop waiting: the budget ran out (recorded by the caller), another
// thread of the CTA or another CTA of the launch already recorded a fault.
__device__ __forceinline__ bool other_fault(const PeerAllReduceParams& p,
                                            const volatile int* s_abort) {
  return *s_abort != 0 || *reinterpret_cast<volatile uint32_t*>(&p.control->error.flag) != 0u;
}

// Lanes 0..P-1 of warp 0: wait for the call word of source `lane`'s CTA, check it against ours.
__device__ __forceinline__ void check_call_word(const PeerAllReduceParams& p, int parity,
                                                uint32_t tag, volatile int* s_abort) {
  const int source = static_cast<int>(threadIdx.x);
  const uint64_t* slot =
      p.recv + p.call_offset +
      ((static_cast<int64_t>(parity) * p.world + source) * gridDim.x + blockIdx.x) * kCallWords;
  CallWords c;
  uint64_t start = 0;
  for (uint32_t polls = 0;; ++polls) {
    load_pair_sys(slot, c.w[0], c.w[1]);
    load_pair_sys(slot + 2, c.w[2], c.w[3]);
    const bool arrived = word_tag(c.w[0]) == tag && word_tag(c.w[1]) == tag &&
                         word_tag(c.w[2]) == tag && word_tag(c.w[3]) == tag;
    if (arrived) break;
    if (polls == 0) start = global_timer_ns();
    if ((polls & 31u) == 31u) {
      if (global_timer_ns() - start > p.budget_ns) {
        const uint32_t seen = word_tag(c.w[0]) != tag   ? word_tag(c.w[0])
                              : word_tag(c.w[1]) != tag ? word_tag(c.w[1])
                              : word_tag(c.w[2]) != tag ? word_tag(c.w[2])
                                                        : word_tag(c.w[3]);
        record_fault(p, kFaultTimeout, source, -1, tag, seen, false, c, s_abort);
        return;
      }
      if (other_fault(p, s_abort)) return;
    }
  }
  const uint64_t count = static_cast<uint64_t>(p.count);
  const bool same = static_cast<uint32_t>(c.w[0]) == p.digest &&
                    static_cast<uint32_t>(c.w[1]) == static_cast<uint32_t>(count) &&
                    static_cast<uint32_t>(c.w[2]) == static_cast<uint32_t>(p.call_id) &&
                    static_cast<uint32_t>(c.w[3]) == static_cast<uint32_t>(count >> 32);
  if (!same) record_fault(p, kFaultMismatch, source, -1, tag, tag, true, c, s_abort);
}

// Receives pair j from every peer (bounded spin) and sums the P values in rank order into `sum`.
// False when this thread must stop (a fault was recorded, here or elsewhere).
template <int kMaxP>
__device__ __forceinline__ bool receive_pair(const PeerAllReduceParams& p, int64_t j, int parity,
                                             uint32_t tag, volatile int* s_abort, float2& sum) {
  const uint64_t* base = p.recv + static_cast<int64_t>(parity) * p.world * p.slot_words + 2 * j;
  uint64_t w[kMaxP][2];
  bool arrived[kMaxP];
#pragma unroll
  for (int r = 0; r < kMaxP; ++r) {
    arrived[r] = r >= p.world || r == p.rank;
    if (!arrived[r]) {
      load_pair_sys(base + r * p.slot_words, w[r][0], w[r][1]);
      arrived[r] = word_tag(w[r][0]) == tag && word_tag(w[r][1]) == tag;
    }
  }
  bool all = true;
#pragma unroll
  for (int r = 0; r < kMaxP; ++r) all = all && arrived[r];
  if (!all) {
    const uint64_t start = global_timer_ns();
    for (uint32_t polls = 1; !all; ++polls) {
      all = true;
#pragma unroll
      for (int r = 0; r < kMaxP; ++r) {
        if (!arrived[r]) {
          load_pair_sys(base + r * p.slot_words, w[r][0], w[r][1]);
          arrived[r] = word_tag(w[r][0]) == tag && word_tag(w[r][1]) == tag;
        }
        all = all && arrived[r];
      }
      if (!all && (polls & 31u) == 0u) {
        if (global_timer_ns() - start > p.budget_ns) {
          // The lowest source still missing, and its first missing word.
          int source = -1;
          int64_t element = 0;
          uint32_t seen = 0;
#pragma unroll
          for (int r = kMaxP - 1; r >= 0; --r) {
            if (!arrived[r]) {
              const bool first_missing = word_tag(w[r][0]) != tag;
              source = r;
              element = 2 * j + (first_missing ? 0 : 1);
              seen = word_tag(first_missing ? w[r][0] : w[r][1]);
            }
          }
          record_fault(p, kFaultTimeout, source, element, tag, seen, false, CallWords{}, s_abort);
          return false;
        }
        if (other_fault(p, s_abort)) return false;
      }
    }
  }
  const float2 own = load_data_pair(p, j);
  float2 s = make_float2(0.0f, 0.0f);
#pragma unroll
  for (int r = 0; r < kMaxP; ++r) {
    if (r >= p.world) break;
    const float2 v = r == p.rank ? own
                                 : make_float2(__uint_as_float(static_cast<uint32_t>(w[r][0])),
                                               __uint_as_float(static_cast<uint32_t>(w[r][1])));
    if (r == 0) {
      s = v;
    } else {
      s.x = __fadd_rn(s.x, v.x);
      s.y = __fadd_rn(s.y, v.y);
    }
  }
  sum = s;
  return true;
}

// kMaxP: the world size rounded up to 2, 4 or 8 (register arrays of the receive).
// Grid: the host's fixed CTA count (the same on every rank); kThreads threads.
template <int kMaxP>
__global__ void __launch_bounds__(kThreads)
    peer_allreduce_sum_kernel(const __grid_constant__ PeerAllReduceParams p) {
  __shared__ uint32_t s_generation;
  __shared__ int s_abort;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) {
    const volatile PeerAllReduceControl* c = p.control;
    s_generation = c->generation;
    s_abort = c->error.flag != 0u ? 1 : 0;  // an earlier call failed: do nothing
  }
  __syncthreads();
  const uint32_t g = s_generation;
  const bool stopped = s_abort != 0;
  if (!stopped) {
    const uint32_t tag = ar_tag(g);
    const int parity = static_cast<int>(g & 1u);
    const uint64_t hi = static_cast<uint64_t>(tag) << 32;
    const int64_t parity_offset = static_cast<int64_t>(parity) * p.world * p.slot_words;
    const int64_t own_slot = parity_offset + static_cast<int64_t>(p.rank) * p.slot_words;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + tid;

    // Send: the call word of this CTA, then every owned pair, into every peer.
    if (tid < p.world && tid != p.rank) {
      const uint64_t count = static_cast<uint64_t>(p.count);
      uint64_t* slot =
          p.dest[tid] + p.call_offset +
          ((static_cast<int64_t>(parity) * p.world + p.rank) * gridDim.x + blockIdx.x) * kCallWords;
      store_pair_sys(slot, hi | p.digest, hi | static_cast<uint32_t>(count));
      store_pair_sys(slot + 2, hi | static_cast<uint32_t>(p.call_id),
                     hi | static_cast<uint32_t>(count >> 32));
    }
    for (int64_t j = first; j < p.pairs; j += stride) {
      const float2 x = load_data_pair(p, j);
      const uint64_t w0 = hi | __float_as_uint(x.x);
      const uint64_t w1 = hi | __float_as_uint(x.y);
#pragma unroll
      for (int r = 0; r < kMaxP; ++r) {
        if (r < p.world && r != p.rank) store_pair_sys(p.dest[r] + own_slot + 2 * j, w0, w1);
      }
    }
    // Refresh one pair per CTA above the count (file comment, "Stale slots").
    if (tid == kThreads - 1) {
      const int64_t q = (static_cast<int64_t>(g >> 1) * gridDim.x + blockIdx.x) % p.slot_pairs;
      if (q >= p.pairs) {
#pragma unroll
        for (int r = 0; r < kMaxP; ++r) {
          if (r < p.world && r != p.rank) store_pair_sys(p.dest[r] + own_slot + 2 * q, hi, hi);
        }
      }
    }

    // Receive: the call words (warp 0), the first owned pair, then, once every call word is
    // checked, its sum and the other pairs.
    if (tid < p.world && tid != p.rank) check_call_word(p, parity, tag, &s_abort);
    float2 sum = make_float2(0.0f, 0.0f);
    const bool have = first < p.pairs;
    const bool ok = have && receive_pair<kMaxP>(p, first, parity, tag, &s_abort, sum);
    __syncthreads();
    if (*reinterpret_cast<volatile int*>(&s_abort) == 0) {
      if (ok) store_data_pair(p, first, sum);
      for (int64_t j = first + stride; ok && j < p.pairs; j += stride) {
        if (!receive_pair<kMaxP>(p, j, parity, tag, &s_abort, sum)) break;
        store_data_pair(p, j, sum);
      }
    }
  }
  // Every CTA read the generation at its start before arriving here, so the last one to arrive
  // may advance it for the next call.
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    const uint32_t arrived = atomicAdd(&p.control->done, 1u);
    if (arrived == gridDim.x - 1) {
      p.control->done = 0;
      p.control->generation = g + 1u;
    }
  }
}

}  // namespace m3msa::cuda::peer_allreduce
