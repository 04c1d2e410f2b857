// Launcher of the convert family (convert_kernel.cuh has the kernel).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/convert.h"
#include "cuda/convert_kernel.cuh"
#include "m3msa/error.h"

namespace m3msa::cuda {

void launch_convert_f32_to_bf16(const float* in, uint16_t* out, int64_t count,
                                cudaStream_t stream) {
  M3MSA_CHECK_ARG(count >= 0, "convert_f32_to_bf16: count ", count);
  if (count == 0) return;
  M3MSA_CHECK_ARG(in && out, "convert_f32_to_bf16: null pointer");
  ConvertParams p;
  p.in = in;
  p.out = out;
  p.count = count;
  const int64_t blocks = std::min<int64_t>((count + 255) / 256, 1024);
  convert::convert_f32_to_bf16_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

}  // namespace m3msa::cuda
