// An executable CPU model of the context-parallel (CP) indexer exchange of
// docs/context_parallel.md: P ranks are threads of one process, each rank's device buffer is host
// memory of std::atomic<uint64_t>, and the protocol is the one the GPU "peer" transport runs, step
// for step:
//  - rank r scores its round-robin shard (block b belongs to b % P) for all H index heads and
//    nominates its full top-k per (row, head), tagged with its generation tag;
//  - it stores the nominations straight into the candidate buffer of every rank that merges that
//    head ([2 parities][P sources][merged heads][max_rows][k], zeroed once, never cleared);
//  - each consumer spins (bounded by a clock budget) on every slot until the expected tag shows,
//    strips it and keeps the exact top-k of the P*k candidates.
// There is no barrier anywhere: the payload is its own arrival flag and the two parities keep
// consecutive calls apart. The result is bit-identical to cpu::select_topk
// (docs/context_parallel.md "Exactness"), which is what the tests check. The model exists to pin
// down the protocol (tags, parities, the host agreement, the bounded wait and its error) before and
// beside the CUDA transport.
//
// The SparseConfig given here follows the convention of cp.h (all H index heads).
//
// Determinism: every call is deterministic and independent of thread timing and of P.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "m3msa/config.h"
#include "m3msa/cp.h"
#include "m3msa/ops.h"

namespace m3msa {

struct CpConfig {
  int world_size = 1;  // P, the tensor-parallel world the indexer is spread over
  int max_rows = 1;    // rows the exchange buffers are sized for; a call may pass fewer
  // Bound on every wait (each candidate slot, the host agreement); on expiry: ErrorCode::kTimeout.
  std::chrono::microseconds spin_budget = kDefaultCpSpinBudget;
  int threads = 1;  // CPU threads one rank uses to score its shard (0 = hardware concurrency)
};

// ---- Ranks ----

// The state every rank of one world shares (what peer mappings make shared on a GPU host): the
// registry of buffer sets and the host agreement. Ranks hold it through a shared_ptr.
class CpuCpWorld {
 public:
  explicit CpuCpWorld(int world_size);
  ~CpuCpWorld();
  CpuCpWorld(const CpuCpWorld&) = delete;
  CpuCpWorld& operator=(const CpuCpWorld&) = delete;

  int world_size() const;
  // Buffer sets created so far (layers with one key share one set).
  int num_buffer_sets() const;

 private:
  friend class CpuCpRank;
  struct State;  // defined in src/cp
  std::unique_ptr<State> state_;
};

// One rank's CP indexer: what each rank's runtime builds, independently, with its own arguments.
// Several CpuCpRank objects of one rank (say, one per layer) with the same buffer key share one
// buffer set and one generation counter, so one thread must drive all of a rank's objects (as one
// stream orders a GPU rank's launches); different ranks run on different threads.
//
// The one hard rule (docs/context_parallel.md): every rank makes the same calls with the same
// shapes in the same order. What the model does when the rule is broken:
//  - the first select() of each CpuCpRank is a collective setup step in which every rank posts its
//    shape; a rank that sees a different shape throws kInvalidArgument naming both, a rank that
//    never posts makes the others throw kTimeout naming it;
//  - a rank that skips a call makes every rank waiting for its nominations throw kTimeout naming
//    it within about spin_budget.
// After either failure the ranks are out of lockstep: further calls on a failed CpuCpRank throw
// kInvalidArgument, and the world must be rebuilt.
class CpuCpRank {
 public:
  // Validates config, cp and the head placement (kInvalidArgument); touches no shared state.
  CpuCpRank(std::shared_ptr<CpuCpWorld> world, int rank, const SparseConfig& config,
            const CpConfig& cp);
  ~CpuCpRank();
  CpuCpRank(CpuCpRank&&) noexcept;
  CpuCpRank& operator=(CpuCpRank&&) noexcept;

  // One indexer call of layer `layer`. args is the one-GPU IndexerArgs (index_q: [rows, H, D]
  // bf16, rows <= max_rows) except args.topk_idx: [rows, merged_heads().size(), k] i32, the
  // selections of the heads this rank merges, in merged_heads() order. Errors carry the rank.
  void select(int layer, const IndexerArgs& args);

  int rank() const;
  const std::vector<int>& merged_heads() const;
  CpBufferKey buffer_key() const;
  // Calls made so far on this rank's buffer set (by every CpuCpRank sharing it); 0 before setup.
  uint32_t generation() const;
  // The record of the wait that timed out on this rank, if one did.
  std::optional<CpTimeoutRecord> last_timeout() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// P ranks over one world with one configuration: what tests and tools use.
class CpuCpGroup {
 public:
  CpuCpGroup(const SparseConfig& config, const CpConfig& cp);

  int world_size() const { return static_cast<int>(ranks_.size()); }
  const SparseConfig& config() const { return config_; }
  const CpConfig& cp_config() const { return cp_; }
  const std::vector<int>& merged_heads(int rank) const;
  CpuCpRank& rank(int rank);
  const std::shared_ptr<CpuCpWorld>& world() const { return world_; }

  // select() of one rank (see CpuCpRank::select); to make a rank skip a call, do not call it.
  void select(int rank, int layer, const IndexerArgs& args);

 private:
  SparseConfig config_;
  CpConfig cp_;
  std::shared_ptr<CpuCpWorld> world_;
  std::vector<CpuCpRank> ranks_;
};

// Runs one call on every rank of `group`, one thread per rank, and assembles the full selection
// into args.topk_idx ([rows, H, k] i32, as cpu::select_topk writes it). When P > H, the consumers
// of a head must agree bit for bit (kInternal otherwise). If any rank throws, rethrows after all
// ranks finished: the lowest rank's error that is not a timeout (the cause), else the lowest
// rank's timeout.
void cp_select_all(CpuCpGroup& group, int layer, const IndexerArgs& args);

}  // namespace m3msa
