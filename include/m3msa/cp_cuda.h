// The context-parallel (CP) indexer on several GPUs (docs/context_parallel.md). The CPU model of
// the same protocol is cp_model.h; this is its CUDA counterpart, with the same head placement
// (cp_merged_heads / cp_consumers of cp.h), buffer key, tags, parities and bounded spin. The NCCL
// transports run on the NcclCommunicator of comm.h.
//
// Transports, kept side by side (docs/context_parallel.md):
//  - kPeer:          each rank scores every index head over its round-robin shard (global block
//                    l*P + r is its local block l), nominates its full top-k per (row, head) with
//                    the generation tag and stores it with system-scope stores straight into each
//                    consumer's candidate buffer (peer access in one process, CUDA IPC across
//                    processes); a merge kernel spins (bounded) on the tags and selects.
//  - kNccl:          the same nominations through ncclAllGather; the same merge kernel.
//  - kReplicated:    no CP: every rank runs the one-GPU indexer over every block (what TP does).
//  - kAllReduceMax:  shard scores into a full-width fp32 tensor prefilled with -inf, an NCCL MAX
//                    all-reduce, then an ordinary top-k.
// Every transport's selection is bit-identical to the one-GPU indexer's (docs/context_parallel.md
// "Exactness").
//
// Graphs: the constructor is a collective setup step (host agreement, buffer set, peer mapping);
// select() afterwards allocates nothing, never synchronizes the host and can be captured into a
// CUDA graph. Grids come from the planned maxima, never the live batch, so one graph replays any
// metadata within the plan. The rule of docs/context_parallel.md holds: every rank makes the same
// calls with the same shapes in the same order.
//
// When the rule is broken (docs/context_parallel.md "No silent hang"): every nomination carries a
// tagged call word (a digest of layer, num_reqs, q_len, table width and cache dtype), so
//  - a rank that skips a call, or whose process died, makes the others' check() throw kTimeout
//    naming it within the spin budget (peer, nccl: the device watchdog; for the NCCL transports a
//    collective that never completes is bounded by CudaCpConfig::host_timeout on the host, then
//    the NCCL communicator is aborted);
//  - a rank that passes another shape or layer for the same call makes the others' check() throw
//    kInvalidArgument naming it, as soon as its nominations land (nothing is merged from them);
//  - mismatched configurations are refused by the constructor's host agreement.
// After any of these the buffer set is failed: every indexer on it refuses further calls, and
// its device memory is left allocated (a peer may still store into it) instead of freed.
// (kReplicated exchanges nothing, so it has nothing to check.)
//
// M3MSA_CP_DEBUG=1 logs to stderr: the buffer set mapping, every select() (layer, shape, digest),
// and after every exchange a device line per rank with the generation completed, its tag and
// parity, and the call word each source left (so a stuck run shows who is behind).
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
  // Bound on check()'s host wait for the stream. The device waits of peer and nccl are bounded
  // by spin_budget; this bounds what has no device-side bound (an NCCL collective whose peer
  // never joins) and anything else queued before check() on that stream.
  std::chrono::milliseconds host_timeout{10000};
};

// What check() found, when it threw (tests and tools; see the fault list above).
struct CudaCpFault {
  enum class Kind { kTimeout, kShapeMismatch, kHostTimeout } kind = Kind::kTimeout;
  int layer = -1;
  int row = -1;
  int head = -1;
  int source = -1;  // the rank named (-1: not known, e.g. a stuck NCCL collective with P > 2)
  uint32_t expected_tag = 0;
  uint32_t seen_tag = 0;
  uint64_t expected_word = 0;  // this rank's call word (digest << 32 | num_reqs << 8 | q_len)
  uint64_t seen_word = 0;      // the named rank's (shape mismatch)
};

// Per-rank facts about the buffer set (for tests and tools).
struct CudaCpInfo {
  CpBufferKey key;
  std::size_t buffer_bytes_per_rank = 0;  // candidates + call words (peer; 0 otherwise)
  std::size_t word_bytes_per_rank = 0;    // the call words: 2 * P * merged_heads * max_rows * 8
  int buffer_sets = 0;                    // sets alive in this process for this communicator
  bool peer_mapped_by_ipc = false;
};

// One rank's CP indexer on one GPU. Construction is collective over `comm` (every rank must
// construct with the same config and the same CudaCpConfig; a mismatch throws kInvalidArgument on
// every rank naming both shapes). For kNccl and kAllReduceMax `comm` must be an NcclCommunicator.
// Indexers of one rank with the same buffer key (say, one per layer) share one buffer set and one
// generation counter, so they must be driven in one stream order. `comm` must outlive the
// indexer. Destroying the last indexer of a set is collective too when the ranks are processes
// (their CUDA IPC mappings are closed everywhere before any rank frees its buffer).
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

  // Waits for `stream` (bounded by CudaCpConfig::host_timeout, polling) and throws what the
  // exchange found: kTimeout naming the rank that never delivered (the record stays readable
  // through last_timeout() / last_fault()), kInvalidArgument naming a rank that passed another
  // shape, kTimeout when the stream did not finish in time (NCCL communicator aborted). A rank
  // that failed is out of lockstep: further calls on its buffer set throw kInvalidArgument.
  // Not while `stream` is capturing.
  void check(void* stream);
  std::optional<CpTimeoutRecord> last_timeout() const;
  std::optional<CudaCpFault> last_fault() const;

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
