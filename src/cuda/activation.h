// Host launcher of the activation family: the SwiGLU-OAI activation of the fused decode runtime's
// MLP (src/runtime/gpu_engine.cc). Validates on the host, allocates nothing, never synchronizes,
// CUDA-graph capturable; deterministic run to run.
#pragma once

#include <cuda_runtime.h>

#include "cuda/activation_params.h"

namespace m3msa::cuda {

void launch_activation_swiglu(const ActivationSwigluParams& p, cudaStream_t stream);

}  // namespace m3msa::cuda
