// How the CLI chooses the backend it runs on, and how it moves tensors to that backend's device:
// the one place that knows about the CUDA backend (cuda_backend.h), so every subcommand runs on
// whichever backend select_backend() returns.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "m3msa/backend.h"
#include "m3msa/tensor.h"

namespace m3msa::cli {

// The values --backend accepts.
const std::vector<std::string>& backend_choices();  // {"auto", "cpu", "cuda"}

// Whether the CUDA backend can run here; when not, `why` says why (no CUDA in the build, or no
// device).
bool cuda_backend_usable(std::string* why);

// "auto": the CUDA backend (device 0) when usable, else the CPU reference. "cpu": the CPU
// reference with `threads` threads (0 = all). "cuda": the CUDA backend on device 0, or
// Error(kUnsupported) saying why not.
// `why_chosen` (optional) gets one line explaining an "auto" choice.
std::unique_ptr<Backend> select_backend(const std::string& name, int threads,
                                        std::string* why_chosen = nullptr);

// Sizes a backend's workspaces for the batches to come (the CUDA backend's plan(); nothing for the
// CPU reference). max_rows 0: max_reqs * max_q_len.
void plan_backend(Backend& backend, const SparseConfig& config, int max_reqs, int max_q_len,
                  int64_t max_rows, int64_t max_context);

// Whether a backend is the CPU reference itself (so "compare with the CPU reference" is empty).
bool is_cpu_reference(const Backend& backend);

// Host <-> backend-device copies. For a backend on the CPU the "device" tensors are the host
// tensors themselves and every call is free.
class Staging {
 public:
  virtual ~Staging() = default;
  // A tensor on the device with the contents of `host` (owned by this object).
  virtual TensorView upload(const HostTensor& host) = 0;
  // device -> host (nothing to do when `device` is `host`'s own view).
  virtual void download(const TensorView& device, HostTensor& host) = 0;
  // host -> an existing device tensor.
  virtual void refresh(const HostTensor& host, const TensorView& device) = 0;
};

std::unique_ptr<Staging> make_staging(const Backend& backend);

}  // namespace m3msa::cli
