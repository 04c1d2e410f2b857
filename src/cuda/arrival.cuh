// The arrival of the "last CTA finishes the job" pattern, shared by the kernel families that use
// it (the attention's split merge, the MoE router launch's top-k).
#pragma once

namespace m3msa::cuda {

// counter += 1 with acquire-release semantics at GPU scope; returns the old value. Called by one
// thread after a barrier: the release is cumulative, so it publishes every store of the CTA the
// barrier ordered before it; the CTA that sees the last count acquires every other CTA's stores
// (its other threads through the barrier after). One fence per CTA, not one per thread.
__device__ __forceinline__ unsigned arrive_acq_rel(unsigned* counter) {
  unsigned old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
               : "=r"(old)
               : "l"(counter)
               : "memory");
  return old;
}

}  // namespace m3msa::cuda
