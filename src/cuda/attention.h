// Host launchers of the attention family: block-sparse (or dense causal) GQA attention over the
// paged main KV cache (attention_kernel.cuh has the algorithm). Called by the CUDA backend
// (backend.cu), the fused runtime, the tests and the benchmarks. Plan/run contract, as for the
// indexer:
//  - attention_workspace_size() sizes the caller-owned workspace for every batch within `limits`;
//    the workspace must be zeroed once before its first use, and every launch leaves it ready for
//    the next one (arrival counters reset themselves).
//  - launch_attention() validates shapes on the host (no device reads), allocates nothing, never
//    synchronizes the host and is CUDA-graph capturable; its grid depends only on the host shapes
//    (num_reqs, q_len / num_tokens) and `config`, never on device contents.
// The tuning knobs and the plan they lead to (AttentionTuning, attention_plan_info,
// launch_attention_tuned) are for tests and benchmarks; launch_attention uses
// default_attention_tuning(); a caller that launches the attention right after the indexer (the
// runtime's sparse layer) uses attention_tuning_after_indexer().
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "m3msa/cuda_backend.h"
#include "m3msa/ops.h"

namespace m3msa::cuda {

size_t attention_workspace_size(const SparseConfig& config, const PlanLimits& limits);

// args tensors live on the current device; args.topk_idx not given = dense causal attention.
void launch_attention(const SparseConfig& config, const AttentionArgs& args, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream);

struct AttentionTuning {
  // bf16 KV: P as hi + lo bf16 (two PV mmas, ~16-bit weights); false: one bf16 P per weight
  // (FlashAttention's numerics, ~2^-9 relative output error: benchmarks only, not tested).
  bool split_p = true;
  // The largest split count whose CTAs merge through one thread-block cluster (distributed shared
  // memory, every rank merging a share of the output); more splits (or 0 / 1 here) merge through
  // the workspace with an arrival counter. Clusters above 2 CTAs are planned only where the grid
  // fills at most half the SMs (few (row, kv head) units); there the plan raises the split count
  // up to this (one block per split at 16). 2 reproduces the plan of two-split clusters only.
  int max_cluster = 16;
  // Programmatic dependent launch: the kernel may be scheduled while the previous kernel in the
  // stream finishes (it waits for it before its first load). Off by default: measured on H200 it
  // saves ~0.5 us for bf16 but costs 2-3 us for fp8 at batch 4-32 (the early CTAs are placed on
  // the SMs that happen to be free, which unbalances one-wave grids).
  bool pdl = false;
  // 0: the default split plan of a selection (attention.cu, choose_splits). N > 0: the wave plan
  // (as many splits as fit one wave of resident CTAs, up to topk) capped at N (16: the wave plan
  // uncapped; 2: two clustered splits up to one wave of units), for comparisons.
  int max_splits = 0;
  // Decode rows of one request per CTA at most (1, 2 or 4; above 1 the plan takes 4 or 2 by
  // q_len): the rows' selections are read as one union, each shared block once, one warp per row.
  // Off by default: measured on H200 it wins only where every row shares one selection at >= 32
  // requests (q_len 4: 1.2-1.4x); with each row's own selection (what the indexer produces) or
  // at 1-4 requests one row per CTA is 1.2-4.7x faster (docs/benchmarks.md).
  int max_row_tiles = 1;
  // With pdl: the programmatic wait guards the selection (topk_idx) only. The query rows, their
  // lengths and (prefetched into L2) the block table are read before it, while the previous
  // kernel still runs, so only the selection -> pages -> K/V chain follows that kernel's end.
  // The caller's promise: the previous kernel in the stream writes nothing the attention reads
  // but topk_idx (the indexer, launched after whatever wrote q and the cache). Off by default.
  bool early_prologue = false;
  // The balanced plan (one row per CTA, a selection): a grid of exactly one wave of resident
  // CTAs, each an equal share of the units' selected blocks (a unit cut by shares' boundaries
  // merges its parts through the workspace). 1: where the units exceed one wave by at most a
  // third of it; 2: wherever they exceed one wave; 0: never (one CTA per unit beyond one wave, two
  // clustered splits per unit up to 4/3 of it). 2 and 0 for comparisons.
  int balance = 1;
  // One row per CTA: the deep pipeline, one CTA of 8 warps per SM with 192 KB of stages instead of
  // two CTAs of 4 warps and 96 KB, the splits planned for one CTA per SM. -1: where the plan's
  // rule takes it (attention_plan_info: units between half the SMs and 2/3 of them fp8, 3/5
  // bf16, one CTA per unit); 1: wherever one row per CTA is planned; 0: never. 0 and 1 for
  // comparisons.
  int deep = -1;

  std::string name() const;  // "splitp1-cluster2-pdl1" (+ "-splits8", "-rows4", "-early", "-deep1",
                             // "-balance0" off default)
  // Parses "splitp=1,cluster=2,pdl=0,splits=8,rows=4,early=1,balance=0,deep=1" (any subset; the
  // rest default); throws naming the text.
  static AttentionTuning parse(const std::string& text);
};

// The tuning launch_attention uses.
AttentionTuning default_attention_tuning();

// The tuning for an attention launched right after launch_indexer in the same stream, so that the
// indexer's last kernel is its previous kernel and writes nothing it reads but topk_idx (the
// promise of early_prologue). One decode row in all (rows = requests x q_len): pdl +
// early_prologue, the attention's prologue overlapping the indexer's merge (measured faster there,
// slower from 4 rows: docs/benchmarks.md, sparse-step section); otherwise the default.
AttentionTuning attention_tuning_after_indexer(int64_t rows);

// The plan launch_attention uses for these host shapes.
struct AttentionPlanInfo {
  int row_tiles = 1;       // decode rows per CTA
  int groups_per_req = 1;  // row groups of a request (row_tiles > 1)
  int splits = 1;          // CTAs per (row group, kv head)
  bool cluster = false;    // splits merged through a thread-block cluster (else global memory)
  bool balanced = false;   // one wave of CTAs, each an equal share of the units' blocks
  bool deep = false;       // one row per CTA, one CTA of 8 warps per SM, the deep pipeline
  int64_t ctas = 0;
  int slots = 0;  // CTAs of one wave: resident at once on the device
};
// q_len: decode rows per request (rows = requests * q_len); 0 for prefill rows.
AttentionPlanInfo attention_plan_info(const SparseConfig& config, int64_t rows, int64_t q_len,
                                      bool dense, bool fp8_kv, const AttentionTuning& tuning);

void launch_attention_tuned(const SparseConfig& config, const AttentionArgs& args, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream,
                            const AttentionTuning& tuning);

}  // namespace m3msa::cuda
