// Which backend runs a call: chosen once per call from the device of its tensors (the device of
// the call's first tensor; the backend's own validation then checks every other tensor is there
// too, and names the one that is not).
#pragma once

#include <cstdint>
#include <optional>

#include "m3msa/backend.h"

namespace m3msa::python {

// The backend for tensors on `device`. threads: CPU worker threads (0 = every hardware thread).
// cuda_stream: the caller's CUDA stream as an integer handle (nullopt: the legacy default stream).
// Throws Error(kUnsupported) for a device this build cannot run on.
Backend& backend_for(Device device, int threads, std::optional<uintptr_t> cuda_stream);

// Whether this build can run calls on CUDA tensors.
bool cuda_backend_available();

}  // namespace m3msa::python
