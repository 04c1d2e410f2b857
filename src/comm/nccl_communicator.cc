// Communicator over NCCL (include/m3msa/cp_cuda.h): ranks as threads (ncclCommInitAll) or as
// processes (a TCP exchange of the ncclUniqueId on MASTER_ADDR:MASTER_PORT). Host records travel
// through persistent device buffers and pinned host staging: a fixed-size header all-gather
// (tag + length), then one padded byte all-gather. The host never blocks inside a CUDA call that
// waits for a collective: every wait polls the stream and ncclCommGetAsyncError against a
// deadline, and on expiry the communicator is aborted (ncclCommAbort, on a helper thread, itself
// bounded), so a missing peer is an error, never a hang. M3MSA_CP_DEBUG=1 logs every wait.
// Without CUDA this file only holds stubs that throw kUnsupported.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <thread>

#include "m3msa/cp_cuda.h"
#include "m3msa/error.h"

#if defined(M3MSA_WITH_CUDA)
#include <arpa/inet.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "comm/nccl_check.h"

#include <cstdlib>
#endif

namespace m3msa {

#if defined(M3MSA_WITH_CUDA)

namespace {

using Clock = std::chrono::steady_clock;

#define CUDA_COMM_CHECK(expr)                                                     \
  do {                                                                            \
    const cudaError_t m3msa_cuda_status_ = (expr);                                \
    if (m3msa_cuda_status_ != cudaSuccess) {                                      \
      M3MSA_THROW(::m3msa::ErrorCode::kInternal, "CUDA call failed: " #expr ": ", \
                  cudaGetErrorName(m3msa_cuda_status_));                          \
    }                                                                             \
  } while (0)

constexpr std::size_t kTagBytes = 56;  // header: tag (56 bytes) + payload length (8 bytes)
constexpr std::size_t kHeaderBytes = kTagBytes + 8;

class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

// ---- TCP bootstrap of the unique id ----

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : std::string(fallback);
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long value = std::strtol(v, &end, 10);
  M3MSA_CHECK_ARG(end != v && *end == '\0', "environment variable ", name, " = '", v,
                  "' is not an integer");
  return static_cast<int>(value);
}

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<int64_t>(0, left.count()));
}

void send_all(int fd, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    const ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL);
    M3MSA_CHECK(n > 0, ErrorCode::kInternal, "bootstrap: send failed");
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
}

bool recv_all(int fd, void* data, std::size_t bytes, Clock::time_point deadline) {
  auto* p = static_cast<uint8_t*>(data);
  while (bytes > 0) {
    pollfd pfd{fd, POLLIN, 0};
    if (::poll(&pfd, 1, remaining_ms(deadline)) <= 0) return false;
    const ssize_t n = ::recv(fd, p, bytes, 0);
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<std::size_t>(n);
  }
  return true;
}

// Rank 0 serves `id` to world_size - 1 peers; the others fetch it. Bounded by `timeout`.
void bootstrap_unique_id(ncclUniqueId& id, int rank, int world_size, const std::string& addr,
                         int port, std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  if (rank == 0) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    M3MSA_CHECK(fd >= 0, ErrorCode::kInternal, "bootstrap: socket() failed");
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(static_cast<uint16_t>(port));
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 || ::listen(fd, 64) != 0) {
      ::close(fd);
      M3MSA_THROW(ErrorCode::kInternal, "bootstrap: rank 0 cannot listen on port ", port,
                  " (MASTER_PORT)");
    }
    int served = 0;
    while (served < world_size - 1) {
      pollfd pfd{fd, POLLIN, 0};
      if (::poll(&pfd, 1, remaining_ms(deadline)) <= 0) {
        ::close(fd);
        throw Error(ErrorCode::kTimeout,
                    detail::concat("bootstrap: only ", served, " of ", world_size - 1,
                                   " peers connected to rank 0 on port ", port, " within ",
                                   timeout.count(), " ms"),
                    __FILE__, __LINE__, rank);
      }
      const int peer = ::accept(fd, nullptr, nullptr);
      if (peer < 0) continue;
      send_all(peer, &id, sizeof(id));
      ::close(peer);
      ++served;
    }
    ::close(fd);
    return;
  }
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port_text = std::to_string(port);
  M3MSA_CHECK_ARG(::getaddrinfo(addr.c_str(), port_text.c_str(), &hints, &found) == 0 && found,
                  "bootstrap: cannot resolve MASTER_ADDR '", addr, "'");
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd >= 0 && ::connect(fd, found->ai_addr, found->ai_addrlen) == 0) {
      const bool ok = recv_all(fd, &id, sizeof(id), deadline);
      ::close(fd);
      ::freeaddrinfo(found);
      if (!ok) {
        throw Error(
            ErrorCode::kTimeout,
            detail::concat("bootstrap: rank 0 at ", addr, ":", port, " accepted but sent no id"),
            __FILE__, __LINE__, rank);
      }
      return;
    }
    if (fd >= 0) ::close(fd);
    if (Clock::now() >= deadline) {
      ::freeaddrinfo(found);
      throw Error(ErrorCode::kTimeout,
                  detail::concat("bootstrap: rank 0 never listened on ", addr, ":", port,
                                 " within ", timeout.count(), " ms"),
                  __FILE__, __LINE__, rank);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

bool comm_debug() {
  static const bool on = [] {
    const char* v = std::getenv("M3MSA_CP_DEBUG");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

// Runs `fn` on a helper thread and waits for it at most `timeout`. Returns whether it finished;
// if not, the thread is left running detached (the caller logs and leaks what it guarded).
template <typename Fn>
bool run_bounded(Fn fn, std::chrono::milliseconds timeout) {
  auto finished = std::make_shared<std::atomic<bool>>(false);
  std::thread worker([fn, finished] {
    fn();
    finished->store(true);
  });
  const Clock::time_point deadline = Clock::now() + timeout;
  while (!finished->load() && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (finished->load()) {
    worker.join();
    return true;
  }
  worker.detach();
  return false;
}

// NCCL connects every peer inside ncclCommInit* (not lazily at a collective's first call, which
// would block the host in the call until the peer makes the same call).
void connect_at_init() {
  ::setenv("NCCL_RUNTIME_CONNECT", "0", 0);
}

}  // namespace

// Persistent staging for the host collectives: device buffer [P + 1] x slot (the all-gather's
// output, then this rank's input) and pinned host memory of the same size. Buffers only grow;
// a replaced buffer is kept until destruction, because freeing device memory synchronizes the
// whole device, which must never wait on a collective stuck elsewhere.
struct NcclCommunicator::Impl {
  cudaStream_t stream = nullptr;
  void* device_buffer = nullptr;
  uint8_t* host_buffer = nullptr;
  std::size_t bytes = 0;
  std::vector<void*> retired_device;
  std::vector<void*> retired_host;

  void reserve(std::size_t need) {
    if (need <= bytes) return;
    const std::size_t grown = std::max<std::size_t>(need, std::max<std::size_t>(2 * bytes, 4096));
    void* d = nullptr;
    void* h = nullptr;
    CUDA_COMM_CHECK(cudaMalloc(&d, grown));
    const cudaError_t e = cudaMallocHost(&h, grown);
    if (e != cudaSuccess) {
      retired_device.push_back(d);
      CUDA_COMM_CHECK(e);
    }
    if (device_buffer) retired_device.push_back(device_buffer);
    if (host_buffer) retired_host.push_back(host_buffer);
    device_buffer = d;
    host_buffer = static_cast<uint8_t*>(h);
    bytes = grown;
  }
  void release() {
    if (device_buffer) retired_device.push_back(device_buffer);
    if (host_buffer) retired_host.push_back(host_buffer);
    for (void* d : retired_device) cudaFree(d);
    for (void* h : retired_host) cudaFreeHost(h);
    retired_device.clear();
    retired_host.clear();
    device_buffer = nullptr;
    host_buffer = nullptr;
    bytes = 0;
  }
};

NcclCommunicator::NcclCommunicator(void* comm, int rank, int world_size, int device,
                                   std::chrono::milliseconds timeout)
    : comm_(comm),
      rank_(rank),
      world_size_(world_size),
      device_(device),
      timeout_(timeout),
      impl_(std::make_unique<Impl>()) {
  DeviceScope scope(device_);
  CUDA_COMM_CHECK(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking));
  impl_->reserve(kHeaderBytes * static_cast<std::size_t>(world_size_ + 1));
}

NcclCommunicator::~NcclCommunicator() {
  if (abandoned_) return;  // see abandon(): nothing is destroyed, nothing is waited for
  DeviceScope scope(device_);
  if (comm_ != nullptr) {
    ncclComm_t comm = static_cast<ncclComm_t>(comm_);
    const bool aborting = broken_;
    const bool done = run_bounded(
        [comm, aborting] {
          if (aborting) {
            ncclCommAbort(comm);
          } else {
            ncclCommDestroy(comm);
          }
        },
        timeout_);
    if (!done) {
      std::fprintf(stderr,
                   "m3msa nccl: rank %d: %s did not return within %lld ms (a peer is gone?); "
                   "the communicator and its buffers are left allocated\n",
                   rank_, aborting ? "ncclCommAbort" : "ncclCommDestroy",
                   static_cast<long long>(timeout_.count()));
      return;
    }
  }
  if (broken_) return;  // a collective may still be stuck on the device: free nothing
  if (impl_) {
    if (impl_->stream) cudaStreamDestroy(impl_->stream);
    impl_->release();
  }
}

std::string NcclCommunicator::name() const {
  return detail::concat("nccl(rank ", rank_, " of ", world_size_, ", device ", device_, ")");
}

void NcclCommunicator::check_async_error(std::string_view what) {
  if (comm_ == nullptr) return;
  ncclResult_t async = ncclSuccess;
  ncclCommGetAsyncError(static_cast<ncclComm_t>(comm_), &async);
  if (async != ncclSuccess && async != ncclInProgress) {
    broken_ = true;
    throw Error(ErrorCode::kInternal,
                detail::concat(what, ": NCCL error ", ncclGetErrorString(async), " on ", name()),
                __FILE__, __LINE__, rank_);
  }
}

void NcclCommunicator::abort(std::string_view why) {
  broken_ = true;
  if (comm_ == nullptr) return;
  ncclComm_t comm = static_cast<ncclComm_t>(comm_);
  comm_ = nullptr;
  // ncclCommAbort first raises the abort flag the kernels poll, then reclaims resources, which
  // can wait for the other ranks; past the timeout the reclaim is left behind.
  if (!run_bounded([comm] { ncclCommAbort(comm); }, timeout_)) {
    std::fprintf(
        stderr, "m3msa nccl: rank %d: ncclCommAbort (%.*s) did not return within %lld ms\n", rank_,
        static_cast<int>(why.size()), why.data(), static_cast<long long>(timeout_.count()));
  } else if (comm_debug()) {
    std::fprintf(stderr, "m3msa nccl: rank %d: communicator aborted (%.*s)\n", rank_,
                 static_cast<int>(why.size()), why.data());
  }
}

void NcclCommunicator::abandon() {
  broken_ = true;
  abandoned_ = true;
  comm_ = nullptr;
}

void NcclCommunicator::wait(void* stream, std::string_view what) {
  M3MSA_CHECK_ARG(!broken_, name(), ": broken by an earlier failure; rebuild the group");
  const Clock::time_point start = Clock::now();
  const Clock::time_point deadline = start + timeout_;
  auto s = static_cast<cudaStream_t>(stream);
  for (uint32_t spins = 0;; ++spins) {
    const cudaError_t q = cudaStreamQuery(s);
    if (q == cudaSuccess) {
      if (comm_debug()) {
        std::fprintf(stderr, "m3msa nccl: rank %d: %.*s done after %.3f ms\n", rank_,
                     static_cast<int>(what.size()), what.data(),
                     std::chrono::duration<double, std::milli>(Clock::now() - start).count());
      }
      return;
    }
    if (q != cudaErrorNotReady) {
      broken_ = true;
      throw Error(ErrorCode::kInternal,
                  detail::concat(what, ": CUDA error ", cudaGetErrorName(q), " on ", name()),
                  __FILE__, __LINE__, rank_);
    }
    check_async_error(what);
    if (Clock::now() >= deadline) {
      abort(what);  // unblocks the kernel waiting for the missing peer
      throw Error(ErrorCode::kTimeout,
                  detail::concat(what, ": rank ", rank_, " timed out after ", timeout_.count(),
                                 " ms waiting for its peers (a rank never arrived); the NCCL "
                                 "communicator was aborted"),
                  __FILE__, __LINE__, rank_);
    }
    if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

std::vector<ByteRecord> NcclCommunicator::all_gather(const ByteRecord& record,
                                                     std::string_view tag) {
  M3MSA_CHECK_ARG(!broken_, name(), ": broken by an earlier failure; rebuild the group");
  DeviceScope scope(device_);
  ncclComm_t comm = static_cast<ncclComm_t>(comm_);
  const std::size_t P = static_cast<std::size_t>(world_size_);
  Impl& m = *impl_;
  // Round 1: the headers (tag + length), so every rank can check the tags and size round 2.
  // Every copy goes through pinned memory: a copy to pageable memory would block the host until
  // the collective before it finished, out of reach of the bounded wait.
  m.reserve(kHeaderBytes * (P + 1));
  uint8_t* header = m.host_buffer + kHeaderBytes * P;
  std::memset(header, 0, kHeaderBytes);
  std::memcpy(header, tag.data(), std::min(tag.size(), kTagBytes - 1));
  const uint64_t length = record.size();
  std::memcpy(header + kTagBytes, &length, 8);
  {
    auto* send = static_cast<uint8_t*>(m.device_buffer) + kHeaderBytes * P;
    CUDA_COMM_CHECK(
        cudaMemcpyAsync(send, header, kHeaderBytes, cudaMemcpyHostToDevice, impl_->stream));
    M3MSA_NCCL_CHECK(
        ncclAllGather(send, m.device_buffer, kHeaderBytes, ncclUint8, comm, impl_->stream));
    CUDA_COMM_CHECK(cudaMemcpyAsync(m.host_buffer, m.device_buffer, kHeaderBytes * P,
                                    cudaMemcpyDeviceToHost, impl_->stream));
    wait(impl_->stream, detail::concat("all_gather '", tag, "' (headers)"));
  }
  const std::vector<uint8_t> headers(m.host_buffer, m.host_buffer + kHeaderBytes * P);
  uint64_t max_length = 0;
  std::vector<uint64_t> lengths(P);
  bool same_tag = true;
  for (std::size_t r = 0; r < P; ++r) {
    std::memcpy(&lengths[r], headers.data() + r * kHeaderBytes + kTagBytes, 8);
    max_length = std::max(max_length, lengths[r]);
    same_tag =
        same_tag && std::memcmp(headers.data() + r * kHeaderBytes, headers.data(), kTagBytes) == 0;
  }
  if (!same_tag) {
    std::ostringstream msg;
    msg << "all_gather: ranks called different collectives (out of lockstep):";
    for (std::size_t r = 0; r < P; ++r) {
      msg << " rank " << r << " '"
          << reinterpret_cast<const char*>(headers.data() + r * kHeaderBytes) << "'";
    }
    broken_ = true;
    throw Error(ErrorCode::kInternal, msg.str(), __FILE__, __LINE__, rank_);
  }
  std::vector<ByteRecord> out(P);
  if (max_length == 0) return out;
  // Round 2: the payloads, padded to the longest.
  m.reserve(max_length * (P + 1));
  {
    uint8_t* mine = m.host_buffer + max_length * P;
    std::memset(mine, 0, max_length);
    if (!record.empty()) std::memcpy(mine, record.data(), record.size());
    auto* send = static_cast<uint8_t*>(m.device_buffer) + max_length * P;
    CUDA_COMM_CHECK(cudaMemcpyAsync(send, mine, max_length, cudaMemcpyHostToDevice, impl_->stream));
    M3MSA_NCCL_CHECK(
        ncclAllGather(send, m.device_buffer, max_length, ncclUint8, comm, impl_->stream));
    CUDA_COMM_CHECK(cudaMemcpyAsync(m.host_buffer, m.device_buffer, max_length * P,
                                    cudaMemcpyDeviceToHost, impl_->stream));
    wait(impl_->stream, detail::concat("all_gather '", tag, "'"));
  }
  for (std::size_t r = 0; r < P; ++r) {
    out[r].assign(m.host_buffer + r * max_length, m.host_buffer + r * max_length + lengths[r]);
  }
  return out;
}

void NcclCommunicator::all_reduce_sum(float* data, std::size_t count, std::string_view tag) {
  if (world_size_ == 1) return;
  M3MSA_CHECK_ARG(data != nullptr || count == 0, "all_reduce_sum '", tag, "': null data");
  // The counts travel first so a mismatch is an error on every rank, not a hang.
  ByteRecord mine = RecordWriter().i64(static_cast<int64_t>(count)).take();
  const std::vector<ByteRecord> counts = all_gather(mine, tag);
  bool same = true;
  std::ostringstream msg;
  msg << "all_reduce_sum '" << tag << "': ranks passed different element counts:";
  for (std::size_t r = 0; r < counts.size(); ++r) {
    RecordReader reader(counts[r], "all_reduce_sum count");
    const int64_t c = reader.i64();
    same = same && c == static_cast<int64_t>(count);
    msg << " rank " << r << " " << c;
  }
  if (!same) throw Error(ErrorCode::kInvalidArgument, msg.str(), __FILE__, __LINE__, rank_);
  if (count == 0) return;
  DeviceScope scope(device_);
  Impl& m = *impl_;
  const std::size_t bytes = count * sizeof(float);
  m.reserve(bytes);
  std::memcpy(m.host_buffer, data, bytes);
  CUDA_COMM_CHECK(cudaMemcpyAsync(m.device_buffer, m.host_buffer, bytes, cudaMemcpyHostToDevice,
                                  impl_->stream));
  M3MSA_NCCL_CHECK(ncclAllReduce(m.device_buffer, m.device_buffer, count, ncclFloat32, ncclSum,
                                 static_cast<ncclComm_t>(comm_), impl_->stream));
  CUDA_COMM_CHECK(cudaMemcpyAsync(m.host_buffer, m.device_buffer, bytes, cudaMemcpyDeviceToHost,
                                  impl_->stream));
  wait(impl_->stream, detail::concat("all_reduce_sum '", tag, "'"));
  std::memcpy(data, m.host_buffer, bytes);
}

std::vector<std::unique_ptr<NcclCommunicator>> make_nccl_communicators_in_process(
    const std::vector<int>& devices, std::chrono::milliseconds timeout) {
  M3MSA_CHECK_ARG(!devices.empty(), "make_nccl_communicators_in_process: no devices");
  M3MSA_CHECK_ARG(timeout.count() > 0, "NCCL communicator timeout must be > 0 ms");
  const int n = static_cast<int>(devices.size());
  connect_at_init();
  std::vector<ncclComm_t> comms(devices.size(), nullptr);
  M3MSA_NCCL_CHECK(ncclCommInitAll(comms.data(), n, devices.data()));
  std::vector<std::unique_ptr<NcclCommunicator>> out;
  for (int r = 0; r < n; ++r) {
    out.push_back(std::unique_ptr<NcclCommunicator>(new NcclCommunicator(
        comms[static_cast<std::size_t>(r)], r, n, devices[static_cast<std::size_t>(r)], timeout)));
  }
  return out;
}

std::unique_ptr<NcclCommunicator> make_nccl_communicator_from_env(
    std::chrono::milliseconds timeout) {
  const int world_size = env_int("WORLD_SIZE", 1);
  const int rank = env_int("RANK", 0);
  const int local_rank = env_int("LOCAL_RANK", rank);
  M3MSA_CHECK_ARG(world_size >= 1 && rank >= 0 && rank < world_size, "RANK (", rank,
                  ") must be in [0, WORLD_SIZE = ", world_size, ")");
  const std::string addr = env_or("MASTER_ADDR", "127.0.0.1");
  const int port = env_int("MASTER_PORT", 29500);
  int devices = 0;
  CUDA_COMM_CHECK(cudaGetDeviceCount(&devices));
  M3MSA_CHECK_SUPPORTED(devices > 0, "NCCL communicator: no CUDA device visible");
  const int device = local_rank % devices;
  ncclUniqueId id{};
  connect_at_init();
  if (rank == 0) M3MSA_NCCL_CHECK(ncclGetUniqueId(&id));
  if (world_size > 1) bootstrap_unique_id(id, rank, world_size, addr, port, timeout);
  DeviceScope scope(device);
  CUDA_COMM_CHECK(cudaSetDevice(device));
  ncclComm_t comm = nullptr;
  M3MSA_NCCL_CHECK(ncclCommInitRank(&comm, world_size, id, rank));
  return std::unique_ptr<NcclCommunicator>(
      new NcclCommunicator(comm, rank, world_size, device, timeout));
}

#else  // no CUDA: stubs

struct NcclCommunicator::Impl {};
NcclCommunicator::~NcclCommunicator() = default;
std::string NcclCommunicator::name() const {
  return "nccl (not built)";
}
std::vector<ByteRecord> NcclCommunicator::all_gather(const ByteRecord&, std::string_view) {
  M3MSA_THROW(ErrorCode::kUnsupported, "NCCL communicator: built without CUDA");
}
void NcclCommunicator::all_reduce_sum(float*, std::size_t, std::string_view) {
  M3MSA_THROW(ErrorCode::kUnsupported, "NCCL communicator: built without CUDA");
}
void NcclCommunicator::wait(void*, std::string_view) {
  M3MSA_THROW(ErrorCode::kUnsupported, "NCCL communicator: built without CUDA");
}
void NcclCommunicator::check_async_error(std::string_view) {
  M3MSA_THROW(ErrorCode::kUnsupported, "NCCL communicator: built without CUDA");
}
void NcclCommunicator::abort(std::string_view) {
  broken_ = true;
}
void NcclCommunicator::abandon() {
  broken_ = true;
  abandoned_ = true;
}
std::vector<std::unique_ptr<NcclCommunicator>> make_nccl_communicators_in_process(
    const std::vector<int>&, std::chrono::milliseconds) {
  M3MSA_THROW(ErrorCode::kUnsupported, "NCCL communicator: built without CUDA");
}
std::unique_ptr<NcclCommunicator> make_nccl_communicator_from_env(std::chrono::milliseconds) {
  M3MSA_THROW(ErrorCode::kUnsupported, "NCCL communicator: built without CUDA");
}

#endif

const char* cp_transport_name(CpTransport transport) {
  switch (transport) {
    case CpTransport::kPeer: return "peer";
    case CpTransport::kNccl: return "nccl";
    case CpTransport::kReplicated: return "replicated";
    case CpTransport::kAllReduceMax: return "allreduce-max";
  }
  return "unknown";
}

CpTransport parse_cp_transport(const std::string& text) {
  for (CpTransport t : {CpTransport::kPeer, CpTransport::kNccl, CpTransport::kReplicated,
                        CpTransport::kAllReduceMax}) {
    if (text == cp_transport_name(t)) return t;
  }
  M3MSA_THROW(ErrorCode::kInvalidArgument,
              "CP transport must be peer, nccl, replicated or "
              "allreduce-max, got '",
              text, "'");
}

}  // namespace m3msa
