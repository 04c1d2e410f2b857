#include "dispatch.h"

#include <map>
#include <memory>
#include <mutex>

#include "m3msa/error.h"

#if M3MSA_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace m3msa::python {

namespace {

// cudaStreamLegacy (driver_types.h: ((cudaStream_t)0x1)); spelled out so this file needs the CUDA
// headers only for the capture query below.
constexpr uintptr_t kLegacyStream = 1;

// A backend and the mutex that serializes its calls (its stream and workspaces are per call).
struct SharedBackend {
  std::unique_ptr<Backend> backend;
  std::mutex mutex;
};

// One backend per key, built on first use and kept for the process (a backend may own a thread
// pool or device workspaces; rebuilding it per call would cost more than most small calls). The
// maps are leaked: there is no safe teardown order against the CUDA runtime at exit.
SharedBackend& shared_backend(bool cuda, int key) {
  static std::mutex mutex;
  static auto* backends = new std::map<std::pair<bool, int>, std::unique_ptr<SharedBackend>>();
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<SharedBackend>& slot = (*backends)[{cuda, key}];
  if (!slot) {
    auto made = std::make_unique<SharedBackend>();
    made->backend = cuda ? std::unique_ptr<Backend>(make_cuda_backend(key)) : make_cpu_backend(key);
    slot = std::move(made);  // only once construction succeeded: a failure is retried next call
  }
  return *slot;
}

// Unplanned CUDA calls validate the batch contents with synchronous copies, which a stream
// capture forbids (and which would invalidate the capture): refuse before any work instead.
// Also orders the caller's pending writes before those copies: they run on the legacy stream,
// which does not wait for non-blocking streams such as torch's side streams.
void prepare_unplanned_cuda_call(int device, void* stream) {
#if M3MSA_WITH_CUDA
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t query = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status);
  const cudaError_t sync = query == cudaSuccess && status == cudaStreamCaptureStatusNone
                               ? cudaStreamSynchronize(static_cast<cudaStream_t>(stream))
                               : cudaSuccess;
  cudaSetDevice(previous);
  M3MSA_CHECK(query == cudaSuccess, ErrorCode::kInternal,
              "stream: cudaStreamIsCapturing failed: ", cudaGetErrorString(query));
  M3MSA_CHECK_ARG(status == cudaStreamCaptureStatusNone,
                  "stream: the call is being captured into a CUDA graph, but it has no plan: pass "
                  "plan=m3msa.CudaPlan(...) (an unplanned call validates the batch on the host, "
                  "which synchronizes, and may allocate)");
  M3MSA_CHECK(sync == cudaSuccess, ErrorCode::kInternal,
              "stream: cudaStreamSynchronize failed: ", cudaGetErrorString(sync));
#else
  static_cast<void>(device);
  static_cast<void>(stream);
#endif
}

bool same_config(const SparseConfig& a, const SparseConfig& b) {
  return a.to_string() == b.to_string();
}

}  // namespace

void* cuda_stream_handle(Stream stream) {
  const uintptr_t handle = stream.value_or(0) == 0 ? kLegacyStream : *stream;
  return reinterpret_cast<void*>(handle);
}

bool cuda_backend_available() {
  return built_with_cuda() && cuda_device_count() > 0;
}

BackendLease backend_for(Device device, int threads, Stream stream) {
  M3MSA_CHECK_ARG(threads >= 0, "threads must be >= 0, got ", threads);
  if (device.type == DeviceType::kCPU) {
    SharedBackend& shared = shared_backend(false, threads);
    return BackendLease(*shared.backend, std::unique_lock<std::mutex>(shared.mutex));
  }
  M3MSA_CHECK_SUPPORTED(built_with_cuda(), "CUDA backend not built: the tensors are on ",
                        device_name(device),
                        " and this build of the m3msa Python module runs the CPU reference only");
  SharedBackend& shared = shared_backend(true, device.index);  // kUnsupported without a GPU
  std::unique_lock<std::mutex> lock(shared.mutex);
  auto& cuda = static_cast<CudaBackend&>(*shared.backend);
  void* handle = cuda_stream_handle(stream);
  prepare_unplanned_cuda_call(device.index, handle);
  cuda.set_stream(handle);
  cuda.set_validate_contents(true);
  return BackendLease(cuda, std::move(lock));
}

CudaPlan::CudaPlan(const SparseConfig& config, const PlanLimits& limits, int device,
                   bool validate_contents)
    : config_(config), limits_(limits), device_(device), validate_contents_(validate_contents) {
  config_.validate();
  M3MSA_CHECK_ARG(limits.max_reqs >= 1, "max_reqs must be >= 1, got ", limits.max_reqs);
  M3MSA_CHECK_ARG(limits.max_q_len >= 1 && limits.max_q_len <= kMaxQueryLen,
                  "max_q_len must be in [1, ", kMaxQueryLen, "], got ", limits.max_q_len);
  M3MSA_CHECK_ARG(limits.max_rows >= 0, "max_rows must be >= 0, got ", limits.max_rows);
  M3MSA_CHECK_ARG(limits.max_context >= 0, "max_context must be >= 0, got ", limits.max_context);
  if (limits_.max_rows == 0) limits_.max_rows = int64_t{limits_.max_reqs} * limits_.max_q_len;
  M3MSA_CHECK_SUPPORTED(
      built_with_cuda(),
      "m3msa.CudaPlan: this build of the m3msa Python module has no CUDA backend");
  backend_ = make_cuda_backend(device);  // kUnsupported without a GPU, kInvalidArgument device
  backend_->set_validate_contents(validate_contents_);
  // The plan's work is queued on the legacy stream; every call sets the caller's stream anyway.
  backend_->set_stream(cuda_stream_handle(std::nullopt));
  backend_->plan(config_, limits_);
  backend_->synchronize();  // the zeroed workspaces are ready before any call on any stream
}

BackendLease CudaPlan::lease(const SparseConfig& config, const BatchMeta& batch, Stream stream,
                             const char* entry) {
  M3MSA_CHECK_ARG(same_config(config, config_), entry,
                  ": config differs from the plan's: the plan was made for ", config_.to_string(),
                  ", the call passes ", config.to_string());
  M3MSA_CHECK_ARG(batch.num_reqs <= limits_.max_reqs, entry, ": batch.num_reqs = ", batch.num_reqs,
                  " exceeds the plan's max_reqs = ", limits_.max_reqs);
  M3MSA_CHECK_ARG(batch.kind != BatchKind::kDecode || batch.q_len <= limits_.max_q_len, entry,
                  ": batch.q_len = ", batch.q_len,
                  " exceeds the plan's max_q_len = ", limits_.max_q_len);
  M3MSA_CHECK_ARG(batch.num_rows() <= limits_.max_rows, entry, ": batch rows = ", batch.num_rows(),
                  " exceed the plan's max_rows = ", limits_.max_rows);
  std::unique_lock<std::mutex> lock(mutex_);
  backend_->set_stream(cuda_stream_handle(stream));
  return BackendLease(*backend_, std::move(lock));
}

uint32_t CudaPlan::device_status(bool clear, Stream stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  backend_->set_stream(cuda_stream_handle(stream));
  return backend_->indexer_device_status(clear);
}

}  // namespace m3msa::python
