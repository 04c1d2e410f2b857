// Launcher of the activation family (activation_kernel.cuh has the kernel).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/activation.h"
#include "cuda/activation_kernel.cuh"
#include "cuda/common.cuh"
#include "m3msa/error.h"

namespace m3msa::cuda {

void launch_activation_swiglu(const ActivationSwigluParams& p, cudaStream_t stream) {
  M3MSA_CHECK_ARG(p.rows >= 0 && p.inter > 0, "swiglu: rows ", p.rows, ", width ", p.inter);
  M3MSA_CHECK_ARG(p.gate_up && p.act, "swiglu: null pointer");
  const int64_t total = static_cast<int64_t>(p.rows) * p.inter;
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, 1024);
  activation::activation_swiglu_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

}  // namespace m3msa::cuda
