#include "backend_select.h"

#include <algorithm>
#include <cstring>

#include "m3msa/cuda_backend.h"
#include "m3msa/error.h"

namespace m3msa::cli {

namespace {

class HostStaging final : public Staging {
 public:
  TensorView upload(const HostTensor& host) override { return host.view(); }
  void download(const TensorView& device, HostTensor& host) override {
    if (device.data == host.data()) return;
    M3MSA_CHECK_INTERNAL(device.nbytes() == host.nbytes(), "download of ", describe(device),
                         " into ", host.nbytes(), " bytes");
    if (host.nbytes()) std::memcpy(host.data(), device.data, host.nbytes());
  }
  void refresh(const HostTensor& host, const TensorView& device) override {
    if (device.data == host.data()) return;
    M3MSA_CHECK_INTERNAL(device.nbytes() == host.nbytes(), "refresh of ", describe(device),
                         " from ", host.nbytes(), " bytes");
    if (host.nbytes()) std::memcpy(device.data, host.data(), host.nbytes());
  }
};

// Device copies through the helpers of cuda_backend.h; every upload lives as long as this object.
class CudaStaging final : public Staging {
 public:
  explicit CudaStaging(int device) : device_(device) {}
  TensorView upload(const HostTensor& host) override {
    owned_.push_back(to_device(host, device_));
    return owned_.back().view();
  }
  void download(const TensorView& device, HostTensor& host) override { copy_to_host(device, host); }
  void refresh(const HostTensor& host, const TensorView& device) override {
    copy_to_device(host, device);
  }

 private:
  int device_;
  std::vector<DeviceTensor> owned_;
};

}  // namespace

const std::vector<std::string>& backend_choices() {
  static const std::vector<std::string> choices = {"auto", "cpu", "cuda"};
  return choices;
}

bool cuda_backend_usable(std::string* why) {
  auto fail = [&](const std::string& reason) {
    if (why) *why = reason;
    return false;
  };
  if (!built_with_cuda()) {
    return fail("this build has no CUDA (configured without nvcc or with M3MSA_ENABLE_CUDA=OFF)");
  }
  if (cuda_device_count() == 0) return fail("no CUDA device is visible (or no driver)");
  return true;
}

std::unique_ptr<Backend> select_backend(const std::string& name, int threads,
                                        std::string* why_chosen) {
  std::string why_not_cuda;
  const bool cuda = cuda_backend_usable(&why_not_cuda);
  if (name == "cpu" || (name == "auto" && !cuda)) {
    if (why_chosen) {
      *why_chosen = name == "cpu" ? "cpu: requested" : "auto -> cpu: " + why_not_cuda;
    }
    return make_cpu_backend(threads);
  }
  if (name == "cuda" || name == "auto") {
    M3MSA_CHECK_SUPPORTED(cuda, "--backend cuda: ", why_not_cuda);
    if (why_chosen) *why_chosen = name == "cuda" ? "cuda: requested" : "auto -> cuda: device 0";
    return make_cuda_backend(/*device=*/0);
  }
  M3MSA_THROW(ErrorCode::kInvalidArgument, "--backend: unknown backend '", name,
              "' (expected auto, cpu or cuda)");
}

bool is_cpu_reference(const Backend& backend) {
  return backend.name() == "cpu-reference";
}

void plan_backend(Backend& backend, const SparseConfig& config, int max_reqs, int max_q_len,
                  int64_t max_rows, int64_t max_context) {
  if (auto* cuda = dynamic_cast<CudaBackend*>(&backend)) {
    PlanLimits limits;
    limits.max_reqs = std::max(1, max_reqs);
    limits.max_q_len = std::max(1, max_q_len);
    limits.max_rows = max_rows;
    limits.max_context = max_context;
    cuda->plan(config, limits);
  }
}

std::unique_ptr<Staging> make_staging(const Backend& backend) {
  if (backend.device().type == DeviceType::kCPU) return std::make_unique<HostStaging>();
  if (backend.device().type == DeviceType::kCUDA) {
    return std::make_unique<CudaStaging>(backend.device().index);
  }
  M3MSA_THROW(ErrorCode::kUnsupported, "no host <-> ", device_name(backend.device()),
              " staging in this build (backend ", backend.name(), ")");
}

}  // namespace m3msa::cli
