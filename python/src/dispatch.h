// Which backend runs a call, and on which CUDA stream.
//
// Without a plan, the backend follows the device of the call's first tensor: the CPU reference
// for CPU tensors, or one shared CudaBackend per GPU that validates the batch contents on the host
// (it synchronizes, and may grow its workspaces: eager use only; refused while the stream is being
// captured into a CUDA graph). With a CudaPlan the call runs on the plan's own backend, whose
// workspaces were sized up front: it allocates nothing, never synchronizes the host and can be
// captured (torch.cuda.graph).
//
// Callers validate the arguments against the chosen device before taking a lease, so a tensor on
// the wrong device is reported by name before any CUDA call. Leases are taken with the GIL
// released (a lease holds the backend's mutex for the whole call, and taking a mutex while holding
// the GIL could deadlock against a thread that holds the mutex and waits for the GIL).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>

#include "m3msa/backend.h"
#include "m3msa/batch.h"
#include "m3msa/config.h"
#include "m3msa/cuda_backend.h"

namespace m3msa::python {

// A CUDA stream as an integer handle (cudaStream_t); nullopt: the caller gave none.
using Stream = std::optional<uintptr_t>;

// The cudaStream_t a call is queued on: the caller's stream, with 0 and "none" meaning the legacy
// default stream (torch reports its default stream as 0; the backend would read a null stream as
// "its own stream", which is ordered with nothing the caller does).
void* cuda_stream_handle(Stream stream);

// Exclusive use of one backend for one call, with the call's stream set.
class BackendLease {
 public:
  BackendLease(Backend& backend, std::unique_lock<std::mutex> lock)
      : backend_(&backend), lock_(std::move(lock)) {}
  Backend* operator->() const { return backend_; }
  Backend& operator*() const { return *backend_; }

 private:
  Backend* backend_;
  std::unique_lock<std::mutex> lock_;
};

// The backend for an unplanned call on `device`. threads: CPU worker threads (0 = every hardware
// thread). Throws Error(kUnsupported) for a device this build cannot run on, and
// Error(kInvalidArgument) for a CUDA call while `stream` is being captured.
BackendLease backend_for(Device device, int threads, Stream stream);

// Whether this build can run calls on CUDA tensors here (built with CUDA and a GPU is visible).
bool cuda_backend_available();

// m3msa.CudaPlan: a CudaBackend of its own, planned for `limits` at construction.
class CudaPlan {
 public:
  CudaPlan(const SparseConfig& config, const PlanLimits& limits, int device,
           bool validate_contents);

  // Checks that a call with `config` and `batch` fits the plan (Error(kInvalidArgument) naming
  // the limit otherwise: a call outside the plan would have to allocate), then leases the backend
  // with `stream` set. `entry` names the call in messages.
  BackendLease lease(const SparseConfig& config, const BatchMeta& batch, Stream stream,
                     const char* entry);

  const SparseConfig& config() const { return config_; }
  const PlanLimits& limits() const { return limits_; }
  int device_index() const { return device_; }
  Device device() const { return Device::cuda(device_); }
  bool validate_contents() const { return validate_contents_; }
  // The indexer's sticky device-side guard bits (cuda_backend.h); synchronizes `stream`.
  uint32_t device_status(bool clear, Stream stream);

 private:
  SparseConfig config_;
  PlanLimits limits_;
  int device_;
  bool validate_contents_;
  std::unique_ptr<CudaBackend> backend_;
  std::mutex mutex_;
};

}  // namespace m3msa::python
