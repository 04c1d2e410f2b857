// The CPU reference backend: plain, obviously correct, multi-threaded over rows. It is the oracle
// every other backend is tested against, and the embedded default where there is no GPU.
//
// Numerics (the contract the GPU backends approximate):
//  - preprocessing in fp32 from bf16 inputs; norm output rounded to bf16, then RoPE in fp32 and
//    rounded to bf16 again; caches written with float_to_bf16 / float_to_fp8e4m3.
//  - a block score is the max over its visible tokens of an fp32 dot product accumulated in
//    dimension order 0..D-1 (so scores do not depend on threading or sharding); NaN propagates
//    through the max: a block with any NaN dot product among its visible tokens scores NaN;
//  - RoPE angles pos * theta^(-2i/rope_dim) and their cos / sin are computed in double and rounded
//    once to fp32 (an fp32 angle is off by up to ~0.03 rad at million-token positions);
//  - attention: fp32 logits and softmax (two passes), fp32 accumulation, bf16 output.
// All functions validate their arguments (ops.h) and the batch contents before touching data.
#pragma once

#include <cstdint>
#include <vector>

#include "m3msa/ops.h"

namespace m3msa::cpu {

// threads = 0: hardware concurrency. Every function is deterministic regardless of threads.
void preprocess(const SparseConfig& config, const PreprocessArgs& args, int threads = 0);
void select_topk(const SparseConfig& config, const IndexerArgs& args, int threads = 0);
void sparse_attention(const SparseConfig& config, const AttentionArgs& args, int threads = 0);

// ---- Building blocks, exposed for tests, the CP model and tools ----

// S(t, h, b) for every row, head and block < max_blocks: [rows, H, max_blocks] f32. Entries of
// blocks a row cannot see (and of dead rows) are set to -inf and are never candidates: use
// visible_blocks() to know which entries are scores.
void score_blocks(const SparseConfig& config, const IndexerArgs& args, TensorView scores,
                  int threads = 0);

// The nominations of one shard of `num_shards` (round-robin: block b belongs to b % num_shards):
// the shard's top-k sort keys per (row, head), descending, padded with kNoCandidate (0), tag 0.
// keys: [rows, H, k] u64. With num_shards = 1 this is the full selection as keys.
void nominate(const SparseConfig& config, const IndexerArgs& args, int shard, int num_shards,
              TensorView keys, int threads = 0);

// The k largest of `candidates` (tags stripped first), descending; kNoCandidate entries ignored.
std::vector<uint64_t> top_keys(const std::vector<uint64_t>& candidates, int k);

// Key list -> the docs/spec.md output row: block ids of the non-empty keys, then -1.
void keys_to_indices(const uint64_t* keys, int n, int32_t* out, int k);

// Dense causal attention over every visible key (the oracle for nb <= topk).
void dense_attention(const SparseConfig& config, const AttentionArgs& args, int threads = 0);

// Insert one token's vectors (already normed/roped, fp32) into the caches; negative slot skips.
void insert_index_k(IndexCache& cache, int64_t slot, const float* index_k, int index_dim);
void insert_kv(KVCache& cache, int64_t slot, int kv_head, const float* k, const float* v,
               int head_dim);

}  // namespace m3msa::cpu
