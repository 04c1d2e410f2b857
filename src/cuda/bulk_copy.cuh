// The bulk-copy engine (cp.async.bulk, global -> shared) and the shared-memory barriers that
// count its bytes, as the kernels that stream through a shared-memory ring use them (the split
// indexer's pages, the streamed weight tiles of the gemm and moe families).
//
// The usual ring: one thread inits a barrier per slot (count 1) and fences the inits, then per
// fill it arrives with the slot's byte count (mbar_expect_tx) and issues the copies into the slot
// (bulk_copy: destination and source 16-byte aligned, size a multiple of 16); the readers wait for
// the fill's phase (mbar_wait with parity (fill / slots) & 1) and synchronize before the slot is
// filled again.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace m3msa::cuda {

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

// Makes the barriers' inits visible to the bulk-copy engine (before the first copy names them).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "wait_%=:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra wait_%=;\n\t}" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// `bytes` (a multiple of 16) from global `src` to shared `dst`, completion counted on `bar`.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

}  // namespace m3msa::cuda
