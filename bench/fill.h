// Device-side random fills for the benchmarks (inputs are never zeros; docs/benchmarks.md).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace m3msa::bench {

// `count` unit-variance uniform values, as bf16 (fp8 = false) or fp8 e4m3, seeded; async.
void fill_random(void* data, int64_t count, bool fp8, uint64_t seed, cudaStream_t stream);

}  // namespace m3msa::bench
