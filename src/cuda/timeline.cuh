// Device side of the stage timeline (timeline.h): a kernel stamps the end of its stages into
// the record its params' `timeline` pointer names; a null pointer (every launch not under a
// timeline::Recorder) skips each mark on one uniform branch.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/timeline.h"

namespace m3msa::cuda::timeline {

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  // The clobber keeps the compiler from moving memory accesses across the stamp.
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)::"memory");
  return t;
}

__device__ __forceinline__ uint32_t sm_index() {
  uint32_t s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

__device__ __forceinline__ int64_t cta_index() {
  return static_cast<int64_t>(blockIdx.x) +
         static_cast<int64_t>(gridDim.x) *
             (static_cast<int64_t>(blockIdx.y) + static_cast<int64_t>(gridDim.y) * blockIdx.z);
}

// Stamps mark `mark` of record `unit` (mark 0 also writes the tag: SM and `kind`). The caller
// picks the one thread that stamps.
__device__ __forceinline__ void stamp(uint64_t* records, int64_t unit, int mark,
                                      uint32_t kind = 0) {
  uint64_t* r = records + unit * kWords;
  r[mark] = global_ns();
  if (mark == 0) r[kMarks] = (static_cast<uint64_t>(kind) << 32) | sm_index();
}

// Thread 0 stamps mark `mark` of its CTA's record.
__device__ __forceinline__ void mark(uint64_t* records, int mark) {
  if (records != nullptr && threadIdx.x == 0) stamp(records, cta_index(), mark);
}

// Thread 0 sets its CTA's record kind (after mark 0).
__device__ __forceinline__ void set_kind(uint64_t* records, uint32_t kind) {
  if (records != nullptr && threadIdx.x == 0) {
    uint64_t* tag = records + cta_index() * kWords + kMarks;
    *tag = (static_cast<uint64_t>(kind) << 32) | (*tag & 0xFFFFFFFFull);
  }
}

// Mark `mark` at every exit of the scope that holds it (a kernel's "end", whichever return).
struct MarkOnExit {
  uint64_t* records;
  int mark_index;
  __device__ __forceinline__ ~MarkOnExit() { mark(records, mark_index); }
};

}  // namespace m3msa::cuda::timeline
