// Built only without nvcc: peer memory and the peer all-reduce (src/comm/peer_memory.h,
// src/comm/peer_allreduce.h) say that this build has no CUDA.
#include "comm/peer_allreduce.h"
#include "comm/peer_memory.h"
#include "m3msa/error.h"

namespace m3msa {

struct PeerMemory::Impl {};

PeerMemory::PeerMemory(Communicator&, int, std::size_t, std::string_view) {
  M3MSA_THROW(ErrorCode::kUnsupported,
              "PeerMemory: this build has no CUDA (configured without nvcc or with "
              "M3MSA_ENABLE_CUDA=OFF)");
}
PeerMemory::~PeerMemory() = default;
int PeerMemory::rank() const {
  return 0;
}
int PeerMemory::world_size() const {
  return 1;
}
int PeerMemory::device() const {
  return 0;
}
std::size_t PeerMemory::bytes() const {
  return 0;
}
void* PeerMemory::local() const {
  return nullptr;
}
void* PeerMemory::peer(int) const {
  return nullptr;
}
bool PeerMemory::same_device(int) const {
  return false;
}
bool PeerMemory::mapped_by_ipc() const {
  return false;
}
void PeerMemory::mark_failed() {}
bool PeerMemory::failed() const {
  return false;
}

struct PeerAllReduce::Impl {};

PeerAllReduce::PeerAllReduce(Communicator&, int, const PeerAllReduceConfig&) {
  M3MSA_THROW(ErrorCode::kUnsupported,
              "PeerAllReduce: this build has no CUDA (configured without nvcc or with "
              "M3MSA_ENABLE_CUDA=OFF)");
}
PeerAllReduce::~PeerAllReduce() = default;
void PeerAllReduce::run(float*, int64_t, int, void*) {}
void PeerAllReduce::check(void*) {}
std::size_t PeerAllReduce::buffer_bytes_per_rank() const {
  return 0;
}
bool PeerAllReduce::mapped_by_ipc() const {
  return false;
}
uint32_t PeerAllReduce::generation() const {
  return 0;
}
int PeerAllReduce::rank() const {
  return 0;
}
int PeerAllReduce::world_size() const {
  return 1;
}
int PeerAllReduce::ctas() const {
  return 0;
}
std::optional<PeerAllReduceFault> PeerAllReduce::last_fault() const {
  return std::nullopt;
}

}  // namespace m3msa
