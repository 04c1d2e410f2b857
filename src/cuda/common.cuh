// Host-side CUDA plumbing shared by every launcher, the backend, the tests and the benchmarks:
// error checks that throw m3msa::Error, RAII device buffers, stream / event helpers, and the
// checked narrowing of 64-bit extents. No kernels here.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <utility>

#include "m3msa/error.h"

// Throws Error(kInternal) naming the failed expression, the CUDA error and file:line.
#define CUDA_CHECK(expr)                                                          \
  do {                                                                            \
    const cudaError_t m3msa_cuda_status_ = (expr);                                \
    if (m3msa_cuda_status_ != cudaSuccess) {                                      \
      M3MSA_THROW(::m3msa::ErrorCode::kInternal, "CUDA call failed: " #expr ": ", \
                  cudaGetErrorName(m3msa_cuda_status_), " (",                     \
                  cudaGetErrorString(m3msa_cuda_status_), ")");                   \
    }                                                                             \
  } while (0)

// After a launch: a bad configuration shows up here (asynchronous faults show at the next sync).
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

namespace m3msa::cuda {

// An int64 extent narrowed to int, with an error naming it when it does not fit.
inline int narrow_int(int64_t value, const char* what) {
  M3MSA_CHECK_ARG(value >= 0 && value <= std::numeric_limits<int>::max(), what, " = ", value,
                  " does not fit the 32-bit range the kernels use");
  return static_cast<int>(value);
}

// Whether `ptr` is 16-byte aligned (the kernels' vector loads need it).
inline bool aligned16(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

// Raises `kernel`'s dynamic shared memory limit on the current device to `bytes` the first time a
// launch needs more than the limit set so far (the kernels that stream through a ring sized by
// their shapes).
inline void raise_dynamic_smem_limit(const void* kernel, int bytes) {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, int> limits;
  std::lock_guard<std::mutex> lock(mutex);
  int& limit = limits[{device, kernel}];
  if (bytes > limit) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    limit = bytes;
  }
}

// Launches kernel(params) on `stream`; pdl: as a programmatic dependent of the previous kernel in
// the stream (scheduled while that one finishes; the kernel waits for it with
// griddepcontrol.wait before its first read of what it wrote).
template <typename Params>
void launch_kernel_ex(void (*kernel)(Params), dim3 grid, dim3 block, std::size_t smem,
                      cudaStream_t stream, bool pdl, const Params& params) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = pdl ? 1 : 0;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, params));
}

// Makes `device` current for the scope and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) CUDA_CHECK(cudaSetDevice(device));
    changed_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// Owning, uninitialized device memory on the current device.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes_) CUDA_CHECK(cudaMalloc(&data_, bytes_));
  }
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = std::exchange(other.data_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void reset() {
    if (data_) cudaFree(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Owning stream (non-blocking with respect to the legacy default stream).
class Stream {
 public:
  Stream() { CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~Stream() {
    if (stream_) cudaStreamDestroy(stream_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return stream_; }
  void synchronize() const { CUDA_CHECK(cudaStreamSynchronize(stream_)); }

 private:
  cudaStream_t stream_ = nullptr;
};

// Owning event (timing enabled).
class Event {
 public:
  Event() { CUDA_CHECK(cudaEventCreate(&event_)); }
  ~Event() {
    if (event_) cudaEventDestroy(event_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }
  void record(cudaStream_t stream) { CUDA_CHECK(cudaEventRecord(event_, stream)); }
  // Milliseconds from `start` to this event (both recorded and complete).
  float elapsed_ms_since(const Event& start) const {
    CUDA_CHECK(cudaEventSynchronize(event_));
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, event_));
    return ms;
  }

 private:
  cudaEvent_t event_ = nullptr;
};

// A captured CUDA graph, instantiated, replayable on any stream.
class Graph {
 public:
  Graph() = default;
  ~Graph() { reset(); }
  Graph(Graph&& other) noexcept
      : graph_(std::exchange(other.graph_, nullptr)), exec_(std::exchange(other.exec_, nullptr)) {}
  Graph& operator=(Graph&& other) noexcept {
    if (this != &other) {
      reset();
      graph_ = std::exchange(other.graph_, nullptr);
      exec_ = std::exchange(other.exec_, nullptr);
    }
    return *this;
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;

  // Captures everything `body` queues on `stream` (thread-local capture mode).
  template <typename Body>
  static Graph capture(cudaStream_t stream, Body&& body) {
    Graph g;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      body();
    } catch (...) {
      cudaGraph_t broken = nullptr;
      cudaStreamEndCapture(stream, &broken);
      if (broken) cudaGraphDestroy(broken);
      throw;
    }
    CUDA_CHECK(cudaStreamEndCapture(stream, &g.graph_));
    // Node priorities: kernels captured on a high-priority stream keep their priority.
    CUDA_CHECK(cudaGraphInstantiate(&g.exec_, g.graph_, cudaGraphInstantiateFlagUseNodePriority));
    return g;
  }
  void launch(cudaStream_t stream) const { CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }
  void reset() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
    exec_ = nullptr;
    graph_ = nullptr;
  }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace m3msa::cuda
