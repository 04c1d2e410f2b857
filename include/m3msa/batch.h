// Per-step batch metadata (docs/spec.md section 3). Views only: the engine owns the storage.
#pragma once

#include <cstdint>
#include <vector>

#include "m3msa/config.h"
#include "m3msa/tensor.h"

namespace m3msa {

enum class BatchKind : int { kDecode = 0, kPrefill = 1 };

inline constexpr int kMaxQueryLen = 8;  // decode rows per request (1 + speculative tokens)

struct BatchMeta {
  BatchKind kind = BatchKind::kDecode;
  int num_reqs = 0;
  int q_len = 1;           // decode: rows per request, rows are request-major (row = req*q_len + j)
  int64_t num_tokens = 0;  // prefill: total new tokens (== cu_seqlens_q[num_reqs]); decode: ignored

  TensorView seq_lens;      // decode:  [num_reqs] i32, counts the q_len new tokens; 0 = padding
  TensorView cu_seqlens_q;  // prefill: [num_reqs + 1] i32, row offsets of each request
  TensorView context_lens;  // prefill: [num_reqs] i32, tokens cached before this chunk
  TensorView index_block_table;  // [num_reqs, max_index_blocks] i32 -> index-K cache page
  TensorView kv_block_table;     // [num_reqs, max_kv_blocks] i32 -> main KV cache page
  TensorView slot_mapping;  // [rows] i64, main KV cache slot (page*block_size + offset), <0 skip
  TensorView index_slot_mapping;  // [rows] i64, index-K cache slot, <0 skip

  int64_t num_rows() const {
    return kind == BatchKind::kDecode ? int64_t{num_reqs} * q_len : num_tokens;
  }
};

// Shape and dtype checks every backend runs (no reads of the data).
void validate_batch_shapes(const BatchMeta& batch, Device device);

// Full host-side validation of the contents (lengths, table entries, slots), for host tensors:
// every live row's visible blocks must map to a page in [0, pages) in both tables.
void validate_batch_contents(const BatchMeta& batch, const SparseConfig& config,
                             int64_t index_pages, int64_t kv_pages);

// Two live rows (positions[row] >= 0) must not write one cache slot (the cache would depend on
// thread timing): every non-negative slots[row] of a live row is distinct, else kInvalidArgument
// naming both rows. slots, positions: [rows] i64 host tensors.
void check_unique_slots(const TensorView& slots, const TensorView& positions, const char* name);

// Where each row of the batch sits. pos < 0 marks a dead row (padding request).
struct RowPosition {
  int req = 0;
  int64_t pos = -1;
};
std::vector<RowPosition> row_positions(const BatchMeta& batch);  // host tensors only

// Number of visible blocks of a row at position pos (0 for a dead row).
inline int64_t visible_blocks(int64_t pos, int block_size) {
  return pos < 0 ? 0 : pos / block_size + 1;
}

}  // namespace m3msa
