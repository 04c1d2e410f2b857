// Seeded random test cases: caches filled with random contexts (garbage after each sequence, so
// masking bugs show), shuffled page tables, random queries. Used by the demo, the tests of every
// backend, the benchmarks and the fuzzers, so all of them draw from one generator.
#pragma once

#include <cstdint>
#include <vector>

#include "m3msa/batch.h"
#include "m3msa/cache.h"
#include "m3msa/config.h"
#include "m3msa/ops.h"
#include "m3msa/tensor.h"

namespace m3msa {

struct SyntheticSpec {
  SparseConfig config;
  BatchKind kind = BatchKind::kDecode;
  int num_reqs = 4;
  int q_len = 1;                  // decode rows per request
  std::vector<int64_t> seq_lens;  // decode: per request (0 = padding); empty: drawn at random
  int64_t min_context = 1;        // range for drawn lengths (decode seq_len / prefill context)
  int64_t max_context = 4096;
  std::vector<int64_t> chunk_lens;    // prefill: new tokens per request; empty: drawn in [1, 64]
  std::vector<int64_t> context_lens;  // prefill: cached tokens per request; empty: drawn
  int padding_reqs = 0;               // decode: this many trailing requests get seq_len 0
  DType index_dtype = DType::kBF16;   // index-K cache dtype
  DType kv_dtype = DType::kBF16;      // main KV cache dtype
  float k_scale = 1.0f;
  float v_scale = 1.0f;
  int extra_pages = 3;           // unused pages in each cache (tables must not touch them)
  float query_scale = 1.0f;      // std-dev of the random queries
  bool make_index_cache = true;  // skip a cache a test does not need (long contexts are big)
  bool make_kv_cache = true;
  uint64_t seed = 1;
};

// Owns every tensor; `batch` and the cache views point into them.
struct SyntheticCase {
  SparseConfig config;
  BatchMeta batch;
  HostTensor seq_lens;            // [num_reqs] i32 (decode)
  HostTensor cu_seqlens_q;        // [num_reqs + 1] i32 (prefill)
  HostTensor context_lens;        // [num_reqs] i32 (prefill)
  HostTensor index_block_table;   // [num_reqs, max_blocks] i32
  HostTensor kv_block_table;      // [num_reqs, max_blocks] i32
  HostTensor slot_mapping;        // [rows] i64
  HostTensor index_slot_mapping;  // [rows] i64
  HostTensor positions;           // [rows] i64 (-1 for dead rows)
  HostTensor index_q;             // [rows, H, D] bf16
  HostTensor q;                   // [rows, QH, HD] bf16
  HostTensor index_cache;         // [pages, block_size, D] bf16 | fp8
  HostTensor kv_cache;            // [pages, kv_heads, 2, block_size, HD] bf16 | fp8 (kv_layout)
  KVLayout kv_layout = KVLayout::kOurs;  // how kv_cache is laid out (a replayed case may differ)
  float k_scale = 1.0f;
  float v_scale = 1.0f;

  IndexCache index_cache_view() const { return {index_cache.view()}; }
  KVCache kv_cache_view() const {
    return kv_cache_from_layout(kv_cache.view(), kv_layout, k_scale, v_scale);
  }
  IndexerArgs indexer_args(const TensorView& topk_idx) const;
  AttentionArgs attention_args(const TensorView& topk_idx, const TensorView& out) const;
  int64_t num_rows() const { return batch.num_rows(); }
};

// Deterministic for a given spec (seed included), independent of thread count.
SyntheticCase make_synthetic_case(const SyntheticSpec& spec);

}  // namespace m3msa
