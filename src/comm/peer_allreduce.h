// A one-shot tensor-parallel fp32 sum all-reduce through peer-mapped buffers, without a barrier,
// for decode-sized messages (the per-layer [rows <= 16, hidden] all-reduce of the fused decode
// runtime). Internal to the library; the kernel and the protocol in peer_allreduce_kernel.cuh (its
// parameters in peer_allreduce_params.h), host side in peer_allreduce.cu (a build without CUDA
// has a stub whose constructor throws kUnsupported).
//
// One kernel per call: every rank stores its values, tagged with its call generation, straight
// into every peer's receive buffer (PeerMemory: peer access, the same device, or CUDA IPC) and
// sums what the peers stored into its own, in rank order. Like the CP exchange of
// docs/context_parallel.md ("The exchange without a barrier") the payload is its own arrival flag
// and two parities keep consecutive calls apart, so there is no barrier, no flag word and no clear.
//
// Determinism: data[i] = ((x_0[i] + x_1[i]) + x_2[i]) + ... + x_{P-1}[i] in fp32 (x_r: rank r's
// input), the same bits on every rank and every run, for any P, count and grid.
//
// The rule of docs/context_parallel.md holds: every rank makes the same calls, with the same count,
// in the same order, each rank on one stream. When it is broken (docs/context_parallel.md "No
// silent hang"):
//  - a rank that skips a call (or died) makes the others' check() throw kTimeout naming it within
//    about spin_budget (the device wait is bounded; check()'s host wait by host_timeout);
//  - a rank that passes another count or call id for the same call makes the others' check() throw
//    kInvalidArgument naming it and both counts, as soon as its call word lands;
//  - a mismatched configuration is refused by the constructor on every rank.
// After any fault the object refuses further calls (kInvalidArgument), a graph replayed after it
// does nothing, and its device memory is left allocated (a peer out of lockstep may still store
// into it). Rebuild the group.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "m3msa/comm.h"
#include "m3msa/cp.h"  // kDefaultCpSpinBudget

namespace m3msa {

struct PeerAllReduceConfig {
  int64_t max_count = 0;  // floats per call at most, in [1, 2^31 - 1]
  // Bound on every device wait of a call; on expiry check() throws kTimeout naming the rank.
  std::chrono::microseconds spin_budget = kDefaultCpSpinBudget;
  // Bound on check()'s host wait for the stream.
  std::chrono::milliseconds host_timeout{10000};
  // CTAs per launch (0: one per SM of the smallest device). Always capped so that the CTAs of
  // every rank sharing a device are resident together (peer_allreduce_kernel.cuh).
  int max_ctas = 0;
};

// What check() found when it threw (tests and tools).
struct PeerAllReduceFault {
  enum class Kind { kTimeout, kCountMismatch, kHostTimeout, kCudaError } kind = Kind::kTimeout;
  int source = -1;       // the rank that never delivered / passed another count (-1: unknown)
  int64_t element = -1;  // element waited on (-1: the call word)
  uint32_t expected_tag = 0;
  uint32_t seen_tag = 0;  // 0: the slot was never written in this parity
  int64_t count = -1;     // this rank's count and call id of the failed call
  int call_id = -1;
  int64_t seen_count = -1;  // the source's (kCountMismatch)
  int seen_call_id = -1;
};

class PeerAllReduce {
 public:
  // Collective over comm (every rank, same config: host agreement through comm.all_gather, a
  // mismatch -> kInvalidArgument on every rank naming both); comm must outlive it. World sizes
  // 1..8. Allocates the receive buffers once (PeerMemory), zeroed once, never cleared.
  PeerAllReduce(Communicator& comm, int device, const PeerAllReduceConfig& config);
  // Across processes: closes the IPC mappings, meets the other ranks (bounded), then frees (the
  // PeerMemory protocol). Within one process the caller makes sure every rank's last call has
  // completed first. After a fault nothing is freed.
  ~PeerAllReduce();
  PeerAllReduce(const PeerAllReduce&) = delete;
  PeerAllReduce& operator=(const PeerAllReduce&) = delete;

  // data[0..count) <- sum over ranks in rank order (fp32), in place; data is device memory of
  // `device`. 0 <= count <= max_count; call_id: the caller's label of this call (e.g. layer * 2 +
  // which), part of the call word every rank checks. No allocation, no host sync, capturable into
  // a CUDA graph (a replay is a new call: the generation lives on the device). stream: a
  // cudaStream_t of `device`.
  void run(float* data, int64_t count, int call_id, void* stream);
  // Waits (bounded by host_timeout) for `stream` and throws what the calls queued on it found
  // (see above); returns when they all completed cleanly.
  void check(void* stream);

  std::size_t buffer_bytes_per_rank() const;  // the PeerMemory allocation of each rank
  bool mapped_by_ipc() const;
  // Calls completed on this rank (reads the device counter; call after check()).
  uint32_t generation() const;
  int rank() const;
  int world_size() const;
  int ctas() const;  // CTAs per launch (the same on every rank)
  std::optional<PeerAllReduceFault> last_fault() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3msa
