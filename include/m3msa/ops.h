// The argument structs of the public operations, shared by every backend. Shapes use the
// per-rank SparseConfig: H = index_heads = kv_heads, D = index_dim, QH = q_heads, HD = head_dim,
// k = topk, rows = batch.num_rows().
#pragma once

#include <string>

#include "m3msa/batch.h"
#include "m3msa/cache.h"
#include "m3msa/config.h"
#include "m3msa/tensor.h"

namespace m3msa {

// Per-token preprocessing: head norms, partial NeoX RoPE, cache insert (docs/spec.md section 2).
struct PreprocessArgs {
  TensorView qkv;           // [rows, qkv_width] bf16: [q | k | v | index_q | index_k]
  TensorView q_norm;        // [HD] bf16 Gemma RMSNorm weights (y = x * rms * (1 + w))
  TensorView k_norm;        // [HD] bf16
  TensorView index_q_norm;  // [D] bf16
  TensorView index_k_norm;  // [D] bf16
  TensorView positions;     // [rows] i64, position of each token (<0: padding, nothing written)
  BatchMeta batch;          // slot_mapping and index_slot_mapping are used
  KVCache kv_cache;         // written: k and v at slot_mapping
  IndexCache index_cache;   // written: index_k at index_slot_mapping
  TensorView q_out;         // [rows, QH, HD] bf16, normed + roped q
  TensorView index_q_out;   // [rows, H, D] bf16, normed + roped index_q
  // index_cache and index_q_out both not given (ndim 0): a layer that shares another layer's
  // selection (docs/spec.md section 7) computes no index_q and inserts no index_k; the index
  // columns of qkv (and index_q_norm / index_k_norm) are then not read.
  bool has_index_part() const { return index_q_out.defined() || index_cache.data.defined(); }
};

// How select_topk writes its answer (docs/spec.md section 4). The selected set is the same
// either way; only its order and where each (row, head) answer goes change.
enum class SelectionOrder : int {
  kDescendingKey = 0,   // descending sort key (forced blocks first), then -1
  kAscendingBlock = 1,  // the same blocks in ascending block id, then -1
};
enum class SelectionMajor : int {
  kTokenMajor = 0,  // topk_idx [rows, H, k]
  kHeadMajor = 1,   // topk_idx [H, rows, k]
};
struct SelectionOptions {
  SelectionOrder order = SelectionOrder::kDescendingKey;
  SelectionMajor major = SelectionMajor::kTokenMajor;
  bool is_default() const {
    return order == SelectionOrder::kDescendingKey && major == SelectionMajor::kTokenMajor;
  }
};
const char* selection_order_name(SelectionOrder order);  // "descending", "ascending"
const char* selection_major_name(SelectionMajor major);  // "token", "head"
SelectionOrder parse_selection_order(const std::string& text, const char* what);
SelectionMajor parse_selection_major(const std::string& text, const char* what);

// Index scoring + exact top-k block selection (docs/spec.md section 4).
struct IndexerArgs {
  TensorView index_q;      // [rows, H, D] bf16
  IndexCache index_cache;  // read through batch.index_block_table
  BatchMeta batch;
  // i32 out: logical block ids, -1 padded, [rows, H, k] (token-major) or [H, rows, k]
  // (head-major). The two outer strides are free (a caller's buffer of larger capacity: rows of
  // stride >= k), k is contiguous; the (row, head) answers must not overlap.
  TensorView topk_idx;
  SelectionOptions selection = {};
};

// Block-sparse GQA attention over the selected blocks (docs/spec.md section 5).
struct AttentionArgs {
  TensorView q;      // [rows, QH, HD] bf16
  KVCache kv_cache;  // read through batch.kv_block_table
  BatchMeta batch;
  TensorView topk_idx;  // [rows, kv_heads, k] i32, any outer strides; not given (ndim 0) = dense
                        // causal attention
  TensorView out;       // [rows, QH, HD] bf16 out
};

// Host-side shape / dtype / device validation shared by all backends; throws naming the argument.
void validate(const SparseConfig& config, const PreprocessArgs& args, Device device);
void validate(const SparseConfig& config, const IndexerArgs& args, Device device);
void validate(const SparseConfig& config, const AttentionArgs& args, Device device);

}  // namespace m3msa
