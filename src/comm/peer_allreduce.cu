// Host side of the one-shot peer all-reduce (src/comm/peer_allreduce.h; kernel and protocol in
// peer_allreduce_kernel.cuh): the host agreement, the buffer layout in one PeerMemory allocation,
// the fixed grid, the launch, and the turning of the device error record into an Error naming the
// rank.
//
// Layout of each rank's PeerMemory allocation (u64 words unless said otherwise):
//   [2 parities][P sources][slot_words]       the tagged values (slot_words: max_count, even)
//   [2 parities][P sources][CTAs][kCallWords]  the tagged call words
//   (256-byte aligned) PeerAllReduceControl              this rank's generation, CTA count, error
//   record
// Peers store into the first two regions only; the control block is the owner's.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "comm/call_digest.h"
#include "comm/peer_allreduce.h"
#include "comm/peer_allreduce_kernel.cuh"
#include "comm/peer_allreduce_params.h"
#include "comm/peer_memory.h"
#include "cuda/common.cuh"
#include "m3msa/error.h"

namespace m3msa {

namespace {

using Clock = std::chrono::steady_clock;
using cuda::peer_allreduce::PeerAllReduceParams;
using Kernel = void (*)(const PeerAllReduceParams);

Kernel kernel_for(int world) {
  if (world <= 2) return cuda::peer_allreduce::peer_allreduce_sum_kernel<2>;
  if (world <= 4) return cuda::peer_allreduce::peer_allreduce_sum_kernel<4>;
  return cuda::peer_allreduce::peer_allreduce_sum_kernel<8>;
}

// FNV-1a over (count, call_id): what every rank must pass identically for one call.
uint32_t call_digest(int64_t count, int call_id) {
  return call_digest_of({count, call_id});
}

std::string config_string(const PeerAllReduceConfig& c, int world) {
  return detail::concat("(world_size=", world, ", max_count=", c.max_count,
                        ", spin_budget_us=", c.spin_budget.count(),
                        ", host_timeout_ms=", c.host_timeout.count(), ", max_ctas=", c.max_ctas,
                        ")");
}

// What every rank posts at setup: the configuration (which must agree) and the facts the grid is
// sized from (which may differ).
struct SetupPost {
  int64_t world, max_count, spin_budget_us, host_timeout_ms, max_ctas;
  int64_t sms, resident_per_sm;
  std::string bus_id;
  auto config_tie() const {
    return std::tie(world, max_count, spin_budget_us, host_timeout_ms, max_ctas);
  }
  ByteRecord record() const {
    RecordWriter w;
    w.i64(world).i64(max_count).i64(spin_budget_us).i64(host_timeout_ms).i64(max_ctas);
    w.i64(sms).i64(resident_per_sm).str(bus_id);
    return w.take();
  }
  static SetupPost parse(const ByteRecord& bytes, int rank) {
    RecordReader r(bytes, "peer all-reduce setup record of rank " + std::to_string(rank));
    SetupPost s;
    s.world = r.i64();
    s.max_count = r.i64();
    s.spin_budget_us = r.i64();
    s.host_timeout_ms = r.i64();
    s.max_ctas = r.i64();
    s.sms = r.i64();
    s.resident_per_sm = r.i64();
    s.bus_id = r.str();
    return s;
  }
  PeerAllReduceConfig config() const {
    PeerAllReduceConfig c;
    c.max_count = max_count;
    c.spin_budget = std::chrono::microseconds(spin_budget_us);
    c.host_timeout = std::chrono::milliseconds(host_timeout_ms);
    c.max_ctas = static_cast<int>(max_ctas);
    return c;
  }
};

int64_t round_up(int64_t v, int64_t m) {
  return (v + m - 1) / m * m;
}

}  // namespace

struct PeerAllReduce::Impl {
  Communicator* comm = nullptr;
  int rank = 0;
  int world = 1;
  int device = 0;
  PeerAllReduceConfig config;
  int ctas = 1;
  Kernel kernel = nullptr;
  std::unique_ptr<PeerMemory> memory;
  cuda::peer_allreduce::PeerAllReduceControl* control = nullptr;
  PeerAllReduceParams base;  // everything but the call's own fields
  cuda::peer_allreduce::PeerAllReduceError* host_error =
      nullptr;  // pinned mirror of control->error
  bool failed = false;
  std::optional<PeerAllReduceFault> fault;
  std::optional<Error> error;  // the fault check() threw, thrown again by later checks
  int64_t last_count = -1;     // of the last call queued (for messages)
  int last_call_id = -1;

  [[noreturn]] void fail(ErrorCode code, const PeerAllReduceFault& f, const std::string& message);
  bool wait(cudaStream_t stream, Clock::time_point deadline, cudaError_t& status) const;
};

void PeerAllReduce::Impl::fail(ErrorCode code, const PeerAllReduceFault& f,
                               const std::string& message) {
  failed = true;
  if (memory) memory->mark_failed();
  fault = f;
  error = Error(code, message, __FILE__, __LINE__, rank);
  throw *error;
}

// Polls `stream` until it is idle (true), fails (false, status set) or the deadline passes (false,
// status cudaErrorNotReady). Never blocks in a CUDA call.
bool PeerAllReduce::Impl::wait(cudaStream_t stream, Clock::time_point deadline,
                               cudaError_t& status) const {
  for (uint32_t polls = 0;; ++polls) {
    status = cudaStreamQuery(stream);
    if (status == cudaSuccess) return true;
    if (status != cudaErrorNotReady) return false;
    if (Clock::now() >= deadline) return false;
    if (polls > 64) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

PeerAllReduce::PeerAllReduce(Communicator& comm, int device, const PeerAllReduceConfig& config)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.comm = &comm;
  m.rank = comm.rank();
  m.world = comm.world_size();
  m.device = device;
  m.config = config;
  try {
    M3MSA_CHECK_ARG(config.max_count >= 1 && config.max_count <= INT_MAX,
                    "PeerAllReduceConfig.max_count must be in [1, ", INT_MAX, "], got ",
                    config.max_count);
    M3MSA_CHECK_ARG(config.spin_budget.count() > 0,
                    "PeerAllReduceConfig.spin_budget must be > 0 us");
    M3MSA_CHECK_ARG(config.host_timeout.count() > 0,
                    "PeerAllReduceConfig.host_timeout must be > 0 ms");
    M3MSA_CHECK_ARG(config.max_ctas >= 0, "PeerAllReduceConfig.max_ctas must be >= 0, got ",
                    config.max_ctas);
    M3MSA_CHECK_SUPPORTED(m.world >= 1 && m.world <= cuda::peer_allreduce::kMaxWorld,
                          "peer all-reduce: world size ", m.world, " outside [1, ",
                          cuda::peer_allreduce::kMaxWorld, "]");
    cuda::DeviceGuard guard(device);
    m.kernel = kernel_for(m.world);
    SetupPost mine;
    mine.world = m.world;
    mine.max_count = config.max_count;
    mine.spin_budget_us = config.spin_budget.count();
    mine.host_timeout_ms = config.host_timeout.count();
    mine.max_ctas = config.max_ctas;
    int sms = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    int resident = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, m.kernel,
                                                             cuda::peer_allreduce::kThreads, 0));
    mine.sms = sms;
    mine.resident_per_sm = resident;
    char bus_id[32] = {};
    CUDA_CHECK(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device));
    mine.bus_id = bus_id;

    // Host agreement: every rank posts its configuration; any difference is an error on every
    // rank (each compares its own with everyone's).
    const std::vector<ByteRecord> posts = comm.all_gather(mine.record(), "peer-allreduce/setup");
    std::vector<SetupPost> all;
    for (int r = 0; r < m.world; ++r) {
      all.push_back(SetupPost::parse(posts[static_cast<std::size_t>(r)], r));
    }
    for (int r = 0; r < m.world; ++r) {
      const SetupPost& other = all[static_cast<std::size_t>(r)];
      M3MSA_CHECK_ARG(other.config_tie() == mine.config_tie(), "peer all-reduce setup: rank ", r,
                      " asked for ", config_string(other.config(), static_cast<int>(other.world)),
                      " but rank ", m.rank, " asked for ", config_string(config, m.world),
                      "; every rank must build its PeerAllReduce with the same config");
    }

    // The grid, the same on every rank: CTA c of a rank waits for CTA c of every peer, so the
    // CTAs of all ranks that share a device must be resident on it together.
    std::map<std::string, int> ranks_on;
    for (const SetupPost& s : all) ++ranks_on[s.bus_id];
    int64_t fit = INT_MAX;
    int64_t min_sms = INT_MAX;
    for (const SetupPost& s : all) {
      fit = std::min(fit, s.resident_per_sm * s.sms / ranks_on[s.bus_id]);
      min_sms = std::min(min_sms, s.sms);
    }
    M3MSA_CHECK_SUPPORTED(fit >= 1, "peer all-reduce: ", ranks_on[mine.bus_id],
                          " ranks share device ", device,
                          ", more than can each keep a CTA resident on it");
    const int64_t slot_words = round_up(config.max_count, 2);
    const int64_t needed =
        (slot_words / 2 + cuda::peer_allreduce::kThreads - 1) / cuda::peer_allreduce::kThreads;
    const int64_t want = config.max_ctas > 0 ? config.max_ctas : min_sms;
    m.ctas = static_cast<int>(std::max<int64_t>(1, std::min({want, fit, needed})));

    const int64_t P = m.world;
    const int64_t data_words = 2 * P * slot_words;
    const int64_t call_words = 2 * P * m.ctas * cuda::peer_allreduce::kCallWords;
    const int64_t control_offset = round_up((data_words + call_words) * 8, 256);
    const std::size_t bytes = static_cast<std::size_t>(control_offset) +
                              sizeof(cuda::peer_allreduce::PeerAllReduceControl);
    m.memory = std::make_unique<PeerMemory>(comm, device, bytes, "allreduce");
    m.control = reinterpret_cast<cuda::peer_allreduce::PeerAllReduceControl*>(
        static_cast<char*>(m.memory->local()) + control_offset);
    CUDA_CHECK(cudaMallocHost(&m.host_error, sizeof(cuda::peer_allreduce::PeerAllReduceError)));

    PeerAllReduceParams& b = m.base;
    for (int r = 0; r < m.world; ++r) b.dest[r] = static_cast<uint64_t*>(m.memory->peer(r));
    b.recv = static_cast<const uint64_t*>(m.memory->local());
    b.slot_words = slot_words;
    b.slot_pairs = slot_words / 2;
    b.call_offset = data_words;
    b.control = m.control;
    b.budget_ns = static_cast<uint64_t>(config.spin_budget.count()) * 1000u;
    b.rank = m.rank;
    b.world = m.world;
  } catch (const Error& error) {
    if (m.memory) m.memory->mark_failed();  // peers may hold its address: leave it allocated
    if (error.rank() >= 0) throw;
    throw error.with_rank(m.rank);
  }
}

PeerAllReduce::~PeerAllReduce() {
  if (!impl_) return;
  Impl& m = *impl_;
  // A failed object leaves everything allocated: the memory (PeerMemory, marked failed) and the
  // pinned mirror (freeing pinned memory synchronizes the device).
  if (m.failed || m.host_error == nullptr) return;
  cudaFreeHost(m.host_error);
  m.host_error = nullptr;
  // m.memory's destructor runs the release protocol.
}

void PeerAllReduce::run(float* data, int64_t count, int call_id, void* stream) {
  Impl& m = *impl_;
  try {
    M3MSA_CHECK_ARG(
        !m.failed, "peer all-reduce rank ", m.rank,
        ": an earlier call failed and the ranks are out of lockstep; rebuild the group");
    M3MSA_CHECK_ARG(count >= 0 && count <= m.config.max_count, "peer all-reduce: count = ", count,
                    " outside [0, PeerAllReduceConfig.max_count = ", m.config.max_count, "]");
    if (count > 0) {
      M3MSA_CHECK_ARG(data != nullptr, "peer all-reduce: data is null with count = ", count);
      cudaPointerAttributes attr{};
      const cudaError_t e = cudaPointerGetAttributes(&attr, data);
      if (e != cudaSuccess) cudaGetLastError();
      const bool ok =
          e == cudaSuccess && ((attr.type == cudaMemoryTypeDevice && attr.device == m.device) ||
                               attr.type == cudaMemoryTypeManaged);
      M3MSA_CHECK_ARG(ok, "peer all-reduce: data (", static_cast<const void*>(data),
                      ") is not device memory of device ", m.device, " (memory type ",
                      static_cast<int>(attr.type), ", device ", attr.device, ")");
    }
    cuda::DeviceGuard guard(m.device);
    PeerAllReduceParams p = m.base;
    p.data = data;
    p.count = count;
    p.pairs = (count + 1) / 2;
    p.digest = call_digest(count, call_id);
    p.call_id = call_id;
    p.data_aligned = (reinterpret_cast<uintptr_t>(data) & 7u) == 0 ? 1 : 0;
    m.kernel<<<m.ctas, cuda::peer_allreduce::kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
    CUDA_CHECK_LAUNCH();
    m.last_count = count;
    m.last_call_id = call_id;
  } catch (const Error& error) {
    if (error.rank() >= 0) throw;
    throw error.with_rank(m.rank);
  }
}

void PeerAllReduce::check(void* stream) {
  Impl& m = *impl_;
  if (m.error) throw *m.error;
  cuda::DeviceGuard guard(m.device);
  auto s = static_cast<cudaStream_t>(stream);
  const Clock::time_point deadline = Clock::now() + m.config.host_timeout;
  PeerAllReduceFault f;
  f.count = m.last_count;
  f.call_id = m.last_call_id;
  cudaError_t status = cudaSuccess;
  bool done = m.wait(s, deadline, status);
  if (done) {
    // The stream is idle: the copy of the error record is immediate.
    status = cudaMemcpyAsync(m.host_error, &m.control->error,
                             sizeof(cuda::peer_allreduce::PeerAllReduceError),
                             cudaMemcpyDeviceToHost, s);
    done = status == cudaSuccess && m.wait(s, deadline, status);
  }
  if (!done && status != cudaErrorNotReady) {
    f.kind = PeerAllReduceFault::Kind::kCudaError;
    m.fail(ErrorCode::kInternal, f,
           detail::concat("peer all-reduce rank ", m.rank, ": CUDA error ",
                          cudaGetErrorName(status), " (", cudaGetErrorString(status),
                          ") while waiting for call id ", m.last_call_id));
  }
  if (!done) {
    // No device wait outlives the spin budget, so the stream is held by other work or by a launch
    // whose CTAs could not all be scheduled.
    f.kind = PeerAllReduceFault::Kind::kHostTimeout;
    std::string missing = "a rank that never joined?";
    if (m.world == 2) {
      f.source = 1 - m.rank;
      missing = detail::concat("rank ", f.source, " never joined?");
    }
    m.fail(ErrorCode::kTimeout, f,
           detail::concat("peer all-reduce rank ", m.rank, ": call id ", m.last_call_id, " (count ",
                          m.last_count, ") did not complete within ", m.config.host_timeout.count(),
                          " ms: no device wait outlives the spin budget, so the stream is held by "
                          "other work or a launch that could not be scheduled (",
                          missing, ")"));
  }
  const cuda::peer_allreduce::PeerAllReduceError& e = *m.host_error;
  if (e.flag == 0) return;
  f.source = e.source;
  f.element = e.element;
  f.expected_tag = e.expected_tag;
  f.seen_tag = e.seen_tag;
  f.count = e.count;
  f.call_id = e.call_id;
  if (e.kind == cuda::peer_allreduce::kFaultMismatch) {
    f.kind = PeerAllReduceFault::Kind::kCountMismatch;
    f.seen_count = e.seen_count;
    f.seen_call_id = e.seen_call_id;
    m.fail(ErrorCode::kInvalidArgument, f,
           detail::concat("peer all-reduce rank ", m.rank, ": rank ", e.source, " passed count ",
                          e.seen_count, " (call id ", e.seen_call_id,
                          ") for the same call where this rank passed count ", e.count,
                          " (call id ", e.call_id,
                          "); every rank must make the same calls with the same counts in the "
                          "same order"));
  }
  f.kind = PeerAllReduceFault::Kind::kTimeout;
  const std::string what =
      e.element < 0 ? std::string("its call word") : detail::concat("element ", e.element);
  m.fail(ErrorCode::kTimeout, f,
         detail::concat("peer all-reduce rank ", m.rank, ": rank ", e.source, " never delivered ",
                        what, " of call id ", e.call_id, " (count ", e.count, "; expected tag ",
                        e.expected_tag, ", saw tag ", e.seen_tag, ") within the spin budget of ",
                        m.config.spin_budget.count(), " us"));
}

std::size_t PeerAllReduce::buffer_bytes_per_rank() const {
  return impl_->memory->bytes();
}

bool PeerAllReduce::mapped_by_ipc() const {
  return impl_->memory->mapped_by_ipc();
}

uint32_t PeerAllReduce::generation() const {
  const Impl& m = *impl_;
  cuda::DeviceGuard guard(m.device);
  // On a private stream (not behind a call that may still be spinning), bounded.
  cudaStream_t side = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  uint32_t g = 0;
  cudaError_t status =
      cudaMemcpyAsync(&g, &m.control->generation, sizeof(g), cudaMemcpyDeviceToHost, side);
  if (status == cudaSuccess) m.wait(side, Clock::now() + m.config.host_timeout, status);
  cudaStreamDestroy(side);
  CUDA_CHECK(status);
  return g;
}

int PeerAllReduce::rank() const {
  return impl_->rank;
}

int PeerAllReduce::world_size() const {
  return impl_->world;
}

int PeerAllReduce::ctas() const {
  return impl_->ctas;
}

std::optional<PeerAllReduceFault> PeerAllReduce::last_fault() const {
  return impl_->fault;
}

}  // namespace m3msa
