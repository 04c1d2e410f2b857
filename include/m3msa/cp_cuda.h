// The context-parallel (CP) indexer on several GPUs (docs/cp.md), and the NCCL communicator it
// (and the runtime) can run on. The CPU model of the same protocol is cp.h; this is its CUDA
// counterpart, with the same head placement (cp_merged_heads / cp_consumers), buffer key, tags,
// parities and bounded spin.
//
// Transports, kept side by side (cp.md):
//  - kPeer:          each rank scores every index head over its round-robin shard (global block
//                    l*P + r is its local block l), nominates its full top-k per (row, head) with
//                    the generation tag and stores it with system-scope stores straight into each
//                    consumer's candidate buffer (peer access in one process, CUDA IPC across
//                    processes); a merge kernel spins (bounded) on the tags and selects.
//  - kNccl:          the same nominations through ncclAllGather; the same merge kernel.
//  - kReplicated:    no CP: every rank runs the one-GPU indexer over every block (what TP does).
//  - kAllReduceMax:  shard scores into a full-width fp32 tensor prefilled with -inf, an NCCL MAX
//                    all-reduce, then an ordinary top-k.
// Every transport's selection is bit-identical to the one-GPU indexer's (cp.md "Exactness").
//
// Graphs: the constructor is a collective setup step (host agreement, buffer set, peer mapping);
// select() afterwards allocates nothing, never synchronizes the host and can be captured into a
// CUDA graph. Grids come from the planned maxima, never the live batch, so one graph replays any
// metadata within the plan. The rule of cp.md holds: every rank makes the same calls with the
// same shapes in the same order.
//
// Works in every build: without CUDA the constructors throw Error(kUnsupported).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "m3msa/comm.h"
#include "m3msa/config.h"
#include "m3msa/cp.h"
#include "m3msa/ops.h"

namespace m3msa {

// ---- NCCL communicator ----

// Communicator over NCCL: all_gather of byte records (a length all-gather, then a padded byte
// all-gather, through device buffers) and all_reduce_sum, plus the raw ncclComm_t for device-side
// collectives. Every wait is bounded by `timeout`: on expiry the communicator aborts its NCCL
// communicator (ncclCommAbort) and throws kTimeout; the communicator is then broken.
class NcclCommunicator : public Communicator {
 public:
  ~NcclCommunicator() override;
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  std::string name() const override;
  std::vector<ByteRecord> all_gather(const ByteRecord& record, std::string_view tag) override;
  void all_reduce_sum(float* data, std::size_t count, std::string_view tag) override;

  int device() const { return device_; }
  void* nccl_comm() const { return comm_; }  // ncclComm_t
  // Waits (bounded by timeout) for `stream` (a cudaStream_t), polling NCCL's async error; throws
  // kTimeout after aborting the communicator, kInternal on an NCCL error.
  void wait(void* stream, std::string_view what);
  std::chrono::milliseconds timeout() const { return timeout_; }

  struct Impl;

 private:
  friend std::vector<std::unique_ptr<NcclCommunicator>> make_nccl_communicators_in_process(
      const std::vector<int>&, std::chrono::milliseconds);
  friend std::unique_ptr<NcclCommunicator> make_nccl_communicator_from_env(
      std::chrono::milliseconds);
  NcclCommunicator(void* comm, int rank, int world_size, int device,
                   std::chrono::milliseconds timeout);
  void* comm_ = nullptr;
  int rank_ = 0;
  int world_size_ = 1;
  int device_ = 0;
  std::chrono::milliseconds timeout_;
  bool broken_ = false;
  std::unique_ptr<Impl> impl_;
};

// Ranks as threads of one process, one GPU each (ncclCommInitAll); element r is rank r, driven by
// one thread. devices.size() is the world size.
std::vector<std::unique_ptr<NcclCommunicator>> make_nccl_communicators_in_process(
    const std::vector<int>& devices, std::chrono::milliseconds timeout = kDefaultCommTimeout);

// Ranks as processes: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK, default RANK)
// from the environment; rank 0 serves the ncclUniqueId over TCP on MASTER_ADDR:MASTER_PORT, the
// others fetch it (bounded by timeout). The device is LOCAL_RANK % the visible device count.
std::unique_ptr<NcclCommunicator> make_nccl_communicator_from_env(
    std::chrono::milliseconds timeout = kDefaultCommTimeout);

// ---- The CP indexer ----

enum class CpTransport : int { kPeer = 0, kNccl = 1, kReplicated = 2, kAllReduceMax = 3 };
const char* cp_transport_name(CpTransport transport);     // "peer", "nccl", "replicated", ...
CpTransport parse_cp_transport(const std::string& text);  // kInvalidArgument naming the value

struct CudaCpConfig {
  int world_size = 1;
  int max_reqs = 1;         // decode requests per call (padding included)
  int max_q_len = 1;        // rows per request; max_rows = max_reqs * max_q_len
  int64_t max_context = 0;  // tokens per request (sizes the shard tables and score tensors)
  CpTransport transport = CpTransport::kPeer;
  std::chrono::microseconds spin_budget = kDefaultCpSpinBudget;  // bound on every device wait
};

// Per-rank stats of the last synchronizing check (for tests and tools).
struct CudaCpInfo {
  CpBufferKey key;
  std::size_t buffer_bytes_per_rank = 0;
  int buffer_sets = 0;  // sets alive in this process for this communicator
  bool peer_mapped_by_ipc = false;
};

// One rank's CP indexer on one GPU. Construction is collective over `comm` (every rank must
// construct with the same config and the same CudaCpConfig; a mismatch throws kInvalidArgument on
// every rank naming both shapes). For kNccl and kAllReduceMax `comm` must be an NcclCommunicator.
// Indexers of one rank with the same buffer key (say, one per layer) share one buffer set and one
// generation counter, so they must be driven in one stream order.
class CudaCpIndexer {
 public:
  CudaCpIndexer(Communicator& comm, int device, const SparseConfig& config, const CudaCpConfig& cp);
  ~CudaCpIndexer();
  CudaCpIndexer(const CudaCpIndexer&) = delete;
  CudaCpIndexer& operator=(const CudaCpIndexer&) = delete;

  // One decode indexer call of layer `layer` on `stream` (a cudaStream_t on this rank's device).
  // args: the one-GPU IndexerArgs (index_q [rows, H, D], the rank's full index cache and tables)
  // except topk_idx: [rows, merged_heads().size(), k] i32, the heads this rank attends. No host
  // synchronization; capturable.
  void select(int layer, const IndexerArgs& args, void* stream);
  // The parts, for benchmarks: scoring of the shard only, or exchange + merge of the last
  // scores only (select() == score() then exchange()).
  void score(const IndexerArgs& args, void* stream);
  void exchange(int layer, const IndexerArgs& args, void* stream);

  // Synchronizes `stream` and throws the device error of a timed-out wait, if any: kTimeout naming
  // the rank that never delivered (the record stays readable through last_timeout()). A rank that
  // timed out is out of lockstep: further calls throw kInvalidArgument.
  void check(void* stream);
  std::optional<CpTimeoutRecord> last_timeout() const;

  int rank() const;
  const std::vector<int>& merged_heads() const;
  CudaCpInfo info() const;
  // Calls made so far on this rank's buffer set (synchronizes the device).
  uint32_t generation() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3msa
