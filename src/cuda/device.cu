// Device discovery for the CUDA build. A machine without a GPU or driver reports 0 devices.
#include <cuda_runtime.h>

#include "m3msa/backend.h"

namespace m3msa {

bool built_with_cuda() {
  return true;
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return count;
}

}  // namespace m3msa
