// Device memory that every rank of a communicator can store into: the transport under the
// barrier-free exchanges (the CP peer transport of docs/context_parallel.md, the one-shot TP
// all-reduce of peer_allreduce.h). Internal to the library; implementation in peer_memory.cu (a
// build without CUDA has a stub whose constructor throws kUnsupported).
//
// Construction is a collective step over the communicator (every rank, same order, same size):
//  1. allocate `bytes` on this rank's device and zero them (synchronously, on a private stream);
//  2. exchange (process token, pid, device, PCI bus id, address, CUDA IPC handle) through
//     comm.all_gather;
//  3. map every peer's allocation: the address itself when the peer is on the same device of the
//     same process (two ranks sharing one GPU, as threads), peer access when all ranks are threads
//     of one process on different devices, CUDA IPC handles when they are processes of one host;
//  4. a "ready" all-gather, so no rank stores into a buffer before its owner has zeroed it.
// Every allocation's address stays fixed for the object's life, so CUDA graphs may capture it.
//
// Destruction (the protocol of the CP buffer sets): when the memory is not failed, synchronize
// the device (no kernel of ours may still address a mapping), close the IPC mappings, and across
// processes meet the other ranks (an all-gather, bounded by the communicator's timeout) before
// freeing: an exporter must not free memory another process still maps. When that meeting fails,
// or after mark_failed() (a peer out of lockstep may still store into this memory, a dead peer
// cannot meet), nothing is freed: the memory stays allocated until the process exits. Within one
// process there is no meeting: the caller makes sure no peer still stores into the memory (every
// rank's last call has completed, e.g. a host barrier after the last check()).
//
// Thread safety: one thread drives an object (the rank's thread), like the communicator handle.
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>

#include "m3msa/comm.h"

namespace m3msa {

class PeerMemory {
 public:
  // Collective over comm (see above); `name` labels its all-gathers ("peer-memory/NAME/...")
  // and messages. Every rank must ask for the same `bytes` (> 0): kInvalidArgument on every rank
  // naming the ranks' sizes. Peers that cannot be mapped: kUnsupported naming the pair. comm must
  // outlive the object.
  PeerMemory(Communicator& comm, int device, std::size_t bytes, std::string_view name);
  ~PeerMemory();
  PeerMemory(const PeerMemory&) = delete;
  PeerMemory& operator=(const PeerMemory&) = delete;

  int rank() const;
  int world_size() const;
  int device() const;
  std::size_t bytes() const;
  // This rank's allocation (device memory of device()).
  void* local() const;
  // Rank r's allocation as this rank's device addresses it (local() for r == rank()).
  void* peer(int r) const;
  // Whether rank r's allocation lives on this rank's device (true for r == rank()).
  bool same_device(int r) const;
  // Whether some peer is mapped through CUDA IPC (the ranks are processes).
  bool mapped_by_ipc() const;

  // After a fault: the destructor leaves the memory allocated (see above).
  void mark_failed();
  bool failed() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3msa
