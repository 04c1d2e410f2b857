// Hopper's warpgroup MMA (wgmma.mma_async, sm_90a only) as the indexer uses it: A (the m64 token
// side) from registers, B (the query vectors) from shared memory in the canonical K-major layout
// without swizzle, fp32 accumulators. It is the only path to the FP8 tensor cores on Hopper:
// ptxas lowers an e4m3 mma.sync to a widening of both operands to f16 plus two f16 MMAs.
//
// B layout: "core matrices" of 8 rows (query vectors) x 16 bytes (the reduction axis), 128
// contiguous bytes each; the descriptor names the byte offset between the two core matrices of a
// row group that are adjacent along K (`k_step_bytes`, the leading byte offset) and between row
// groups of 8 (`row_group_bytes`, the stride byte offset).
//
// The register fragments (PTX ISA, "Register Fragments" of wgmma): warp w of the warpgroup holds
// rows 16w .. 16w + 15 of A and of D in the layout of mma.sync m16n8k32 (A) and m16n8 (D, one n8
// tile after the other), so a warp's mma.sync fragments feed it unchanged.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/bulk_copy.cuh"

namespace m3msa::cuda::wgmma {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
inline constexpr bool kAvailable = true;
#else
inline constexpr bool kAvailable = false;
#endif

// Shared-memory matrix descriptor, K-major, no swizzle (all offsets 16-byte multiples).
__device__ __forceinline__ uint64_t kmajor_desc(const void* smem, uint32_t k_step_bytes,
                                                uint32_t row_group_bytes) {
  return static_cast<uint64_t>((smem_u32(smem) & 0x3FFFFu) >> 4) |
         (static_cast<uint64_t>(k_step_bytes >> 4) << 16) |
         (static_cast<uint64_t>(row_group_bytes >> 4) << 32);
}

// Orders this thread's earlier register writes (A fragments, accumulators) before the wgmmas
// that follow; every warp of the warpgroup executes it.
__device__ __forceinline__ void fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

// Waits for every committed group; then the accumulators may be read.
__device__ __forceinline__ void wait_all() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#endif
}

// Keeps the compiler from moving reads of an accumulator above wait_all.
__device__ __forceinline__ void fence_operand(float& x) {
  asm volatile("" : "+f"(x)::"memory");
}

// d = A x B for one k32 step of e4m3 x e4m3 (the accumulator's old value is ignored), N = 8 * kNT.
template <int kNT>
__device__ __forceinline__ void mma_e4m3_k32(float (&d)[4 * kNT], const uint32_t (&a)[4],
                                             uint64_t b_desc) {
  static_assert(kNT == 1 || kNT == 2 || kNT == 4, "N = 8, 16 or 32");
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  if constexpr (kNT == 1) {
    asm volatile(
        "{\n.reg .pred fresh;\nsetp.ne.b32 fresh, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, fresh, 1, 1;\n}"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
  } else if constexpr (kNT == 2) {
    asm volatile(
        "{\n.reg .pred fresh;\nsetp.ne.b32 fresh, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, fresh, 1, 1;\n}"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]),
          "=f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
  } else {
    asm volatile(
        "{\n.reg .pred fresh;\nsetp.ne.b32 fresh, 0, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, fresh, 1, 1;\n}"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]),
          "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]),
          "=f"(d[14]), "=f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
  }
#else
  for (int i = 0; i < 4 * kNT; ++i) d[i] = 0.0f;  // never called: callers test kAvailable
#endif
}

}  // namespace m3msa::cuda::wgmma
