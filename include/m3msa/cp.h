// Context parallelism (CP) of the indexer (docs/context_parallel.md): the facts every
// implementation shares. Under CP the P ranks of a tensor-parallel group split each request's index
// blocks round-robin (block b belongs to rank b % P), every rank scores all H index heads over its
// shard and nominates its top k per (row, head), and the ranks that merge a head keep the exact top
// k of the P * k nominations, bit-identical to the one-GPU selection (docs/context_parallel.md
// "Exactness"). This header holds what both implementations agree on: the head placement (who
// merges what), the identity and size of a buffer set, the bound on every wait and the record of a
// wait that ran out. The CUDA indexer is cp_cuda.h; the executable CPU model of the same protocol
// is cp_model.h.
//
// Configuration convention: the SparseConfig given to a CP indexer is the indexer's view of one
// rank under CP, i.e. it has all H index heads (every rank projects and scores all of them); it is
// the SparseConfig of ModelConfig::sparse(1), not of sparse(P).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace m3msa {

// Well under a second (docs/context_parallel.md): long enough for any healthy peer, short enough to
// fail fast.
inline constexpr std::chrono::microseconds kDefaultCpSpinBudget{500000};

// ---- Head placement (docs/context_parallel.md "Who merges what") ----

// Throws Error(kInvalidArgument) naming the world size and the head count unless P divides H
// (one merger per head) or is a multiple of it (P/H consumers per head, each merging for itself).
void validate_cp_placement(int world_size, int index_heads);
// The global index heads rank `rank` merges and writes, ascending: H/P of them or exactly one.
std::vector<int> cp_merged_heads(int world_size, int index_heads, int rank);
// The ranks that merge `head`, ascending: one rank when P <= H, P/H ranks when P > H.
std::vector<int> cp_consumers(int world_size, int index_heads, int head);

// ---- Buffer sets ----

// The identity of a buffer set (docs/context_parallel.md): one set per key, shared by every layer
// that uses it.
struct CpBufferKey {
  int world_size = 0;
  int merged_heads = 0;  // heads each rank merges (H/P, or 1 when P > H)
  int max_rows = 0;
  int topk = 0;

  bool operator==(const CpBufferKey&) const = default;
  // Candidate bytes each rank owns: 2 * P * merged_heads * max_rows * k * 8.
  std::size_t bytes_per_rank() const;
  std::string to_string() const;  // "(world_size=4, merged_heads=1, max_rows=8, topk=16)"
};

// What a bounded wait saw when its budget ran out: the device error word of
// docs/context_parallel.md.
struct CpTimeoutRecord {
  int layer = -1;   // the caller's layer id of the call that gave up
  int row = -1;     // buffer row waited on
  int head = -1;    // global index head waited on
  int source = -1;  // the rank whose nomination never arrived
  uint32_t expected_tag = 0;
  uint32_t seen_tag = 0;  // tag found in the slot at expiry (0: never written)
};

}  // namespace m3msa
