// Built only without nvcc: the CUDA backend and the device helpers of cuda_backend.h say that
// this build has no CUDA.
#include "m3msa/cuda_backend.h"
#include "m3msa/error.h"

namespace m3msa {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  M3MSA_THROW(ErrorCode::kUnsupported, what,
              ": this build has no CUDA (configured without nvcc or with M3MSA_ENABLE_CUDA=OFF)");
}
}  // namespace

DeviceTensor::DeviceTensor(DType, std::vector<int64_t>, int) {
  no_cuda("DeviceTensor");
}
int64_t DeviceTensor::numel() const {
  return 0;
}
TensorView DeviceTensor::view() const {
  return {};
}
DeviceTensor to_device(const HostTensor&, int) {
  no_cuda("to_device");
}
void copy_to_host(const TensorView&, HostTensor&) {
  no_cuda("copy_to_host");
}
void copy_to_device(const HostTensor&, const TensorView&) {
  no_cuda("copy_to_device");
}
void fill_device_bytes(const TensorView&, uint8_t) {
  no_cuda("fill_device_bytes");
}
IndexerArgs DeviceCase::indexer_args(const TensorView&) const {
  no_cuda("DeviceCase");
}
AttentionArgs DeviceCase::attention_args(const TensorView&, const TensorView&) const {
  no_cuda("DeviceCase");
}
DeviceCase upload(const SyntheticCase&, int) {
  no_cuda("upload");
}
std::unique_ptr<CudaBackend> make_cuda_backend(int) {
  no_cuda("make_cuda_backend");
}

}  // namespace m3msa
