// Built only without nvcc: the CUDA entry points report that the backend is absent.
#include "m3msa/backend.h"

namespace m3msa {
bool built_with_cuda() {
  return false;
}
int cuda_device_count() {
  return 0;
}
}  // namespace m3msa
