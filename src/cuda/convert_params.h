// Kernel parameter struct of the convert family (convert_kernel.cuh): element type conversions of
// the decode runtime. Plain data, passed by value as __grid_constant__.
#pragma once

#include <cstdint>

namespace m3msa::cuda {

// out[i] = bf16(in[i]) (round to nearest even), i < count.
struct ConvertParams {
  const float* in = nullptr;  // [count] f32
  uint16_t* out = nullptr;    // [count] bf16
  int64_t count = 0;
};

}  // namespace m3msa::cuda
