#include "dispatch.h"

#include <map>
#include <memory>
#include <mutex>

#include "m3msa/error.h"

namespace m3msa::python {

namespace {

// One CPU backend per thread count, built on first use and kept for the process (a backend may
// own a thread pool; rebuilding it per call would cost more than most small calls).
Backend& cpu_backend(int threads) {
  static std::mutex mutex;
  static std::map<int, std::unique_ptr<Backend>>* backends =
      new std::map<int, std::unique_ptr<Backend>>();  // leaked: no teardown order at exit
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<Backend>& backend = (*backends)[threads];
  if (!backend) backend = make_cpu_backend(threads);
  return *backend;
}

}  // namespace

bool cuda_backend_available() {
  return false;
}

Backend& backend_for(Device device, int threads, std::optional<uintptr_t> cuda_stream) {
  M3MSA_CHECK_ARG(threads >= 0, "threads must be >= 0, got ", threads);
  if (device.type == DeviceType::kCPU) return cpu_backend(threads);
  // ---- CUDA: where the CUDA backend plugs in ----
  // When make_cuda_backend() (include/m3msa/cuda_backend.h) is implemented in every build: keep
  // one CudaBackend per device index, built with make_cuda_backend(device.index) on first use
  // (same caching as cpu_backend above, per device); call
  // set_stream(reinterpret_cast<void*>(cuda_stream.value_or(0))) before each call so the work
  // lands on the caller's (torch's current) stream; return it; and make cuda_backend_available()
  // return built_with_cuda(). For torch.cuda.graph capture the backend must be planned
  // (plan(config, limits)) and set_validate_contents(false) before capture: expose both to Python
  // (a plan() entry taking PlanLimits, a validate_contents flag) rather than deciding here.
  static_cast<void>(cuda_stream);
  M3MSA_THROW(ErrorCode::kUnsupported, "CUDA backend not built: the tensors are on ",
              device_name(device),
              " and this build of the m3msa Python module runs the CPU "
              "reference only");
}

}  // namespace m3msa::python
