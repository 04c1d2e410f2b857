// Parameters of the one-shot peer all-reduce kernel (peer_allreduce_kernel.cuh, launched by
// peer_allreduce.cu): plain structs shared by host and device code, and the layout constants both
// sides size by.
#pragma once

#include <cstdint>

namespace m3msa::cuda::peer_allreduce {

inline constexpr int kMaxWorld = 8;
inline constexpr int kThreads = 256;
inline constexpr int kCallWords = 4;  // per (parity, source, CTA): digest, count lo, call id, hi

// What a failed wait found (PeerAllReduceError::kind).
inline constexpr uint32_t kFaultTimeout = 1;   // a source never delivered within the budget
inline constexpr uint32_t kFaultMismatch = 2;  // a source's call word differs from ours

// Device error record of a failed call; the first writer wins.
struct PeerAllReduceError {
  uint32_t flag;  // 0: none
  uint32_t kind;  // kFault*
  int32_t source;
  int32_t cta;
  int64_t element;  // the element waited on; -1: the call word
  uint32_t expected_tag;
  uint32_t seen_tag;  // tag found in the slot at expiry (0: never written)
  int64_t count;      // this rank's count and call id
  int32_t call_id;
  uint32_t digest;
  int64_t seen_count;  // the source's (mismatch only)
  int32_t seen_call_id;
  uint32_t seen_digest;
};

// Per rank, in its own memory (peers never touch it).
struct PeerAllReduceControl {
  uint32_t generation;  // calls completed (advanced by the last CTA of each call)
  uint32_t done;        // CTAs finished in the current call (back to 0 after each call)
  uint32_t pad[2];
  PeerAllReduceError error;
};

struct PeerAllReduceParams {
  float* data = nullptr;  // [count] f32, summed in place
  int64_t count = 0;
  int64_t pairs = 0;               // ceil(count / 2)
  uint64_t* dest[kMaxWorld] = {};  // [world] every rank's receive buffer (own unused)
  const uint64_t* recv = nullptr;  // this rank's receive buffer
  int64_t slot_words = 0;          // words per (parity, source): max_count rounded up to even
  int64_t slot_pairs = 0;          // slot_words / 2 (the refresh pointer's range)
  int64_t call_offset = 0;         // word offset of the call words [2][P][CTAs][kCallWords]
  PeerAllReduceControl* control = nullptr;  // [1] this rank's
  uint64_t budget_ns = 0;
  uint32_t digest = 0;  // of (count, call_id), host computed
  int32_t call_id = 0;
  int rank = 0;
  int world = 1;
  int data_aligned = 0;  // data is 8-byte aligned: float2 accesses
};

}  // namespace m3msa::cuda::peer_allreduce
