// Head placement and buffer keys of the CP indexer (docs/context_parallel.md "Who merges what").
// Shared by the CPU model and, later, the CUDA transports, so both place heads identically.
#include <sstream>

#include "m3msa/cp.h"
#include "m3msa/error.h"

namespace m3msa {

void validate_cp_placement(int world_size, int index_heads) {
  M3MSA_CHECK_ARG(world_size >= 1, "CP: world size must be >= 1, got ", world_size);
  M3MSA_CHECK_ARG(index_heads >= 1, "CP: index heads must be >= 1, got ", index_heads);
  // Tensor parallelism itself splits KV heads this way, so any other P has no rank to attend for
  // some head and nothing to merge for.
  M3MSA_CHECK_ARG(index_heads % world_size == 0 || world_size % index_heads == 0, "CP: world size ",
                  world_size, " neither divides the ", index_heads,
                  " index heads nor is a multiple of them: tensor parallelism cannot place its "
                  "heads");
}

std::vector<int> cp_merged_heads(int world_size, int index_heads, int rank) {
  validate_cp_placement(world_size, index_heads);
  M3MSA_CHECK_ARG(rank >= 0 && rank < world_size, "CP: rank must be in [0, ", world_size, "), got ",
                  rank);
  if (world_size <= index_heads) {
    const int per_rank = index_heads / world_size;
    std::vector<int> heads(static_cast<std::size_t>(per_rank));
    for (int i = 0; i < per_rank; ++i) heads[static_cast<std::size_t>(i)] = rank * per_rank + i;
    return heads;
  }
  // KV heads are replicated: P/H consecutive ranks attend for (and so merge) the same head.
  return {rank / (world_size / index_heads)};
}

std::vector<int> cp_consumers(int world_size, int index_heads, int head) {
  validate_cp_placement(world_size, index_heads);
  M3MSA_CHECK_ARG(head >= 0 && head < index_heads, "CP: head must be in [0, ", index_heads,
                  "), got ", head);
  if (world_size <= index_heads) return {head / (index_heads / world_size)};
  const int per_head = world_size / index_heads;
  std::vector<int> ranks(static_cast<std::size_t>(per_head));
  for (int i = 0; i < per_head; ++i) ranks[static_cast<std::size_t>(i)] = head * per_head + i;
  return ranks;
}

std::size_t CpBufferKey::bytes_per_rank() const {
  return std::size_t{2} * static_cast<std::size_t>(world_size) *
         static_cast<std::size_t>(merged_heads) * static_cast<std::size_t>(max_rows) *
         static_cast<std::size_t>(topk) * sizeof(uint64_t);
}

std::string CpBufferKey::to_string() const {
  std::ostringstream out;
  out << "(world_size=" << world_size << ", merged_heads=" << merged_heads
      << ", max_rows=" << max_rows << ", topk=" << topk << ")";
  return out.str();
}

}  // namespace m3msa
