// Parameters of the CP exchange kernels (cp_exchange_kernel.cuh, launched by cp_exchange.cu):
// plain structs shared by host and device code, and the layout constants both sides size by.
#pragma once

#include <cstdint>

namespace m3msa::cuda::cp_exchange {

inline constexpr int kMaxWorld = 8;
inline constexpr int kWarps = 8;
inline constexpr int kThreads = 256;
inline constexpr int kMaxCand = kMaxWorld * 32;  // P * k candidates of one (row, head)

// What a failed wait found (CpExchangeError::kind).
inline constexpr uint32_t kFaultTimeout = 1;        // a source never delivered within the budget
inline constexpr uint32_t kFaultShapeMismatch = 2;  // a source's call word differs from ours

// Device error record of a failed wait (docs/context_parallel.md "No silent hang"); the first
// writer wins.
struct CpExchangeError {
  uint32_t flag;  // 0: none
  int32_t layer;
  int32_t row;
  int32_t head;
  int32_t source;
  uint32_t expected_tag;
  uint32_t seen_tag;
  uint32_t kind;           // kFault*
  uint64_t expected_word;  // this rank's call word (tag included)
  uint64_t seen_word;      // the source's call word found at the slot (mismatch) or 0
};

// Per buffer set, in the rank's own memory.
struct CpExchangeControl {
  uint32_t generation;  // calls completed on this set (bumped by the last merge CTA)
  uint32_t done;        // merge CTAs arrived in the current call (back to 0 after each call)
  uint32_t status;      // sticky guard bits of the shard scoring (params.h kStatus*)
  uint32_t pad;
  CpExchangeError error;
};

struct CpExchangeParams {
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
  CpExchangeControl* control = nullptr;  // [1], the buffer set's, in this rank's memory
  // Peer: dest[r] = rank r's buffer [2][P][merged][max_rows][k] u64 keys, then the call words.
  // NCCL (dest_local): dest[0] = the send buffer [H][max_rows][k] u64 keys, then [H][max_rows].
  uint64_t* dest[kMaxWorld] = {};
  int dest_local = 0;  // 1: nominations go to dest[0] as [H][max_rows][k] (nccl)
  // This rank's buffer to merge from: peer dest[rank]; NCCL the receive buffer [P][per source
  // block as in dest[0]] u64.
  const uint64_t* cand = nullptr;
  int64_t parity_stride = 0;  // elements (0 for nccl: the recv buffer is per call)
  int64_t source_stride = 0;
  int64_t head_stride = 0;  // per merged head (peer) / per global head (nccl)
  int cand_head_base = 0;   // head index of merged head 0 in the cand layout (0 / head0)
  // Call words: element offset of the word region from dest[r] / cand, and its strides (the
  // head stride is max_rows). Peer: [2][P][merged][max_rows] after the keys; nccl: [H][max_rows]
  // after each source's keys.
  int64_t word_offset = 0;
  int64_t word_parity_stride = 0;
  int64_t word_source_stride = 0;
  uint64_t call_word = 0;  // this call's word without its tag (call_word_of)
  int layer = 0;
  uint64_t budget_ns = 0;
  int32_t* topk_idx = nullptr;  // [live_rows, merged, k] i32 out
  // allreduce-max.
  float* full_scores = nullptr;  // [max_rows, H, full_cols] f32, then [P][2] digest halves
  int64_t full_cols = 0;
};

// The call word (without tag): bits 63..32 the digest, 23..8 num_reqs, 7..0 q_len (both as far
// as they fit; the digest covers them whole). Bits 31..24 carry the generation tag on the wire.
constexpr uint64_t call_word_of(uint32_t digest, int num_reqs, int q_len) {
  return (static_cast<uint64_t>(digest) << 32) |
         (static_cast<uint64_t>(static_cast<uint32_t>(num_reqs) & 0xFFFFu) << 8) |
         (static_cast<uint64_t>(static_cast<uint32_t>(q_len) & 0xFFu));
}

}  // namespace m3msa::cuda::cp_exchange
