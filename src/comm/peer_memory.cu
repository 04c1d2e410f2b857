// PeerMemory (src/comm/peer_memory.h): allocation, address / IPC handle exchange, peer mapping
// and the destruction protocol.
#include <cuda_runtime.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "comm/peer_memory.h"
#include "cuda/common.cuh"
#include "m3msa/error.h"

namespace m3msa {

namespace {

// M3MSA_CP_DEBUG=1: one line per mapped peer and per release.
bool peer_debug() {
  static const bool on = [] {
    const char* v = std::getenv("M3MSA_CP_DEBUG");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

// Identifies this process among the ranks: a pid alone does not (two containers of one host may
// run their ranks under the same pid), and mistaking a process of another container for this one
// would hand out raw addresses of another address space.
uint64_t process_token() {
  static const uint64_t token = [] {
    std::random_device device;
    uint64_t t = (static_cast<uint64_t>(device()) << 32) ^ device();
    t ^= static_cast<uint64_t>(::getpid()) << 20;
    t ^= static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    return t;
  }();
  return token;
}

std::string pci_bus_id(int device) {
  char id[32] = {};
  CUDA_CHECK(cudaDeviceGetPCIBusId(id, sizeof(id), device));
  return id;
}

// The local ordinal of the device with this PCI bus id, or -1 when it is not visible here.
int local_device_of(const std::string& bus_id) {
  int device = -1;
  if (cudaDeviceGetByPCIBusId(&device, bus_id.c_str()) != cudaSuccess) {
    cudaGetLastError();  // not visible in this process
    return -1;
  }
  return device;
}

struct PeerRecord {
  uint64_t token = 0;
  int64_t pid = 0;
  int64_t device = 0;
  std::string bus_id;
  uint64_t address = 0;
  int64_t bytes = 0;
  std::string handle;  // empty: the owner could not export one
};

}  // namespace

struct PeerMemory::Impl {
  Communicator* comm = nullptr;
  std::string name;
  int rank = 0;
  int world = 1;
  int device = 0;
  std::size_t bytes = 0;
  void* local = nullptr;
  std::vector<void*> peers;       // by rank
  std::vector<char> same_device;  // by rank
  std::vector<void*> ipc_opened;
  bool by_ipc = false;
  std::atomic<bool> failed{false};

  std::string tag(const char* what) const {
    return detail::concat("peer-memory/", name, "/", what);
  }
  void map(const std::vector<PeerRecord>& all);
};

void PeerMemory::Impl::map(const std::vector<PeerRecord>& all) {
  const PeerRecord& me = all[static_cast<std::size_t>(rank)];
  bool one_process = true;
  for (const PeerRecord& r : all) one_process = one_process && r.token == me.token;
  by_ipc = !one_process;
  peers.assign(static_cast<std::size_t>(world), nullptr);
  same_device.assign(static_cast<std::size_t>(world), 0);
  for (int r = 0; r < world; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    const PeerRecord& peer = all[ur];
    same_device[ur] = peer.bus_id == me.bus_id ? 1 : 0;
    if (r == rank) {
      peers[ur] = local;
      continue;
    }
    const char* how = "";
    if (one_process) {
      // Device ordinals mean the same to every rank of one process.
      const int peer_device = static_cast<int>(peer.device);
      if (peer_device != device) {
        int can = 0;
        CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, peer_device));
        M3MSA_CHECK_SUPPORTED(can, "peer memory ", name, ": device ", device, " (rank ", rank,
                              ") cannot access device ", peer_device, " (rank ", r,
                              "): no peer access");
        const cudaError_t e = cudaDeviceEnablePeerAccess(peer_device, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();  // clear the "already enabled" status
        } else {
          CUDA_CHECK(e);
        }
        how = "peer access";
      } else {
        how = "same device";
      }
      peers[ur] = reinterpret_cast<void*>(static_cast<uintptr_t>(peer.address));
    } else {
      // Ordinals of another process may differ (CUDA_VISIBLE_DEVICES): go by the PCI bus id.
      const int peer_device = local_device_of(peer.bus_id);
      if (peer_device >= 0 && peer_device != device) {
        int can = 0;
        CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device, peer_device));
        M3MSA_CHECK_SUPPORTED(can, "peer memory ", name, ": device ", device, " (rank ", rank,
                              ") cannot access the device of rank ", r, " (", peer.bus_id,
                              "): no peer access");
      }
      M3MSA_CHECK_SUPPORTED(!peer.handle.empty(), "peer memory ", name, ": rank ", r,
                            " could not export a CUDA IPC handle of its buffer, so rank ", rank,
                            " (another process) cannot map it");
      cudaIpcMemHandle_t handle{};
      M3MSA_CHECK_INTERNAL(peer.handle.size() == sizeof(handle), "IPC handle of rank ", r, " has ",
                           peer.handle.size(), " bytes");
      std::memcpy(&handle, peer.handle.data(), sizeof(handle));
      void* mapped = nullptr;
      CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess));
      ipc_opened.push_back(mapped);
      peers[ur] = mapped;
      how = "CUDA IPC";
    }
    if (peer_debug()) {
      std::fprintf(stderr,
                   "m3msa peer-memory %s[rank %d]: %zu bytes of rank %d (pid %lld, device %lld, "
                   "%s, its address 0x%llx) mapped here at %p by %s\n",
                   name.c_str(), rank, bytes, r, static_cast<long long>(peer.pid),
                   static_cast<long long>(peer.device), peer.bus_id.c_str(),
                   static_cast<unsigned long long>(peer.address), peers[ur], how);
    }
  }
}

PeerMemory::PeerMemory(Communicator& comm, int device, std::size_t bytes, std::string_view name)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.comm = &comm;
  m.name = std::string(name);
  m.rank = comm.rank();
  m.world = comm.world_size();
  m.device = device;
  m.bytes = bytes;
  M3MSA_CHECK_ARG(bytes > 0, "peer memory ", m.name, ": bytes must be > 0");
  cuda::DeviceGuard guard(device);
  const std::string bus_id = pci_bus_id(device);
  CUDA_CHECK(cudaMalloc(&m.local, bytes));
  cudaIpcMemHandle_t handle{};
  bool exported = false;
  try {
    cuda::Stream stream;
    CUDA_CHECK(cudaMemsetAsync(m.local, 0, bytes, stream.get()));  // zeroed once: tag 0
    stream.synchronize();
    exported = cudaIpcGetMemHandle(&handle, m.local) == cudaSuccess;
    if (!exported) cudaGetLastError();  // only needed across processes (checked when mapping)
  } catch (...) {
    cudaFree(m.local);  // nobody has the address yet
    m.local = nullptr;
    throw;
  }
  // From here on peers may hold the address: a failure leaves the memory allocated.
  try {
    RecordWriter w;
    w.i64(static_cast<int64_t>(process_token())).i64(static_cast<int64_t>(::getpid())).i64(device);
    w.str(bus_id).i64(static_cast<int64_t>(reinterpret_cast<uintptr_t>(m.local)));
    w.i64(static_cast<int64_t>(bytes));
    w.str(exported ? std::string_view(reinterpret_cast<const char*>(&handle), sizeof(handle))
                   : std::string_view());
    const std::vector<ByteRecord> posts = comm.all_gather(w.take(), m.tag("addresses"));
    std::vector<PeerRecord> all(static_cast<std::size_t>(m.world));
    for (int r = 0; r < m.world; ++r) {
      RecordReader reader(posts[static_cast<std::size_t>(r)],
                          "peer-memory record of rank " + std::to_string(r));
      PeerRecord& p = all[static_cast<std::size_t>(r)];
      p.token = static_cast<uint64_t>(reader.i64());
      p.pid = reader.i64();
      p.device = reader.i64();
      p.bus_id = reader.str();
      p.address = static_cast<uint64_t>(reader.i64());
      p.bytes = reader.i64();
      p.handle = reader.str();
    }
    for (int r = 0; r < m.world; ++r) {
      const int64_t other = all[static_cast<std::size_t>(r)].bytes;
      M3MSA_CHECK_ARG(other == static_cast<int64_t>(bytes), "peer memory ", m.name, ": rank ", r,
                      " asked for ", other, " bytes, rank ", m.rank, " for ", bytes,
                      "; every rank must allocate the same size");
    }
    m.map(all);
    // Nobody may store into a buffer before its owner has zeroed it (done above, synchronously).
    comm.all_gather({}, m.tag("ready"));
  } catch (...) {
    m.failed.store(true);
    throw;
  }
}

PeerMemory::~PeerMemory() {
  if (!impl_ || impl_->local == nullptr) return;
  Impl& m = *impl_;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(m.device);
  if (m.failed.load()) {
    if (peer_debug()) {
      std::fprintf(stderr, "m3msa peer-memory %s[rank %d]: failed, %zu bytes left allocated\n",
                   m.name.c_str(), m.rank, m.bytes);
    }
  } else {
    cudaDeviceSynchronize();  // no kernel of ours may still store into or read a mapping
    for (void* p : m.ipc_opened) cudaIpcCloseMemHandle(p);
    bool may_free = true;
    if (m.by_ipc && m.comm != nullptr) {
      // Every process has closed its mapping of our memory before we free it (freeing an
      // exported allocation that is still mapped elsewhere is undefined).
      try {
        m.comm->all_gather({}, m.tag("closed"));
      } catch (const std::exception& e) {
        may_free = false;
        std::fprintf(stderr,
                     "m3msa peer-memory %s[rank %d]: %zu bytes left allocated: the ranks did not "
                     "meet to release them (%s)\n",
                     m.name.c_str(), m.rank, m.bytes, e.what());
      }
    }
    if (may_free) cudaFree(m.local);
    if (peer_debug()) {
      std::fprintf(stderr, "m3msa peer-memory %s[rank %d]: released (%s)\n", m.name.c_str(), m.rank,
                   may_free ? "freed" : "left allocated");
    }
  }
  cudaSetDevice(previous);
}

int PeerMemory::rank() const {
  return impl_->rank;
}
int PeerMemory::world_size() const {
  return impl_->world;
}
int PeerMemory::device() const {
  return impl_->device;
}
std::size_t PeerMemory::bytes() const {
  return impl_->bytes;
}
void* PeerMemory::local() const {
  return impl_->local;
}
void* PeerMemory::peer(int r) const {
  M3MSA_CHECK_ARG(r >= 0 && r < impl_->world, "PeerMemory::peer: rank ", r, " outside [0, ",
                  impl_->world, ")");
  return impl_->peers[static_cast<std::size_t>(r)];
}
bool PeerMemory::same_device(int r) const {
  M3MSA_CHECK_ARG(r >= 0 && r < impl_->world, "PeerMemory::same_device: rank ", r, " outside [0, ",
                  impl_->world, ")");
  return impl_->same_device[static_cast<std::size_t>(r)] != 0;
}
bool PeerMemory::mapped_by_ipc() const {
  return impl_->by_ipc;
}
void PeerMemory::mark_failed() {
  impl_->failed.store(true);
}
bool PeerMemory::failed() const {
  return impl_->failed.load();
}

}  // namespace m3msa
