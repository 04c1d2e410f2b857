// Kernel parameter struct of the activation family (activation_kernel.cuh): the SwiGLU-OAI
// activation of the decode runtime's MLP. Plain data, passed by value as __grid_constant__.
#pragma once

#include <cstdint>

namespace m3msa::cuda {

// act[r, j] = bf16(swiglu(gate_up[r, j], gate_up[r, I + j])).
struct ActivationSwigluParams {
  const uint16_t* gate_up = nullptr;  // [rows, 2 * I] bf16, rows [gate | up]
  uint16_t* act = nullptr;            // [rows, I] bf16
  int rows = 0;
  int inter = 0;  // I
  float limit = 7.0f;
};

}  // namespace m3msa::cuda
