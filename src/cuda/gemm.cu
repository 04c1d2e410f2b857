// Launcher of the gemm family: validation and the choice of loop and warps per tile
// (gemm_kernel.cuh has the algorithm).
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstddef>

#include "cuda/common.cuh"
#include "cuda/gemm.h"
#include "cuda/gemm_kernel.cuh"
#include "m3msa/error.h"

namespace m3msa::cuda {

int gemm_skinny_ctas(int n) {
  return (n + gemm::kColsPerCta - 1) / gemm::kColsPerCta;
}

namespace {
// The current device's SM count, queried once per device (launches call this on every step).
int current_device_sms() {
  static std::array<std::atomic<int>, 64> cached{};
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  M3MSA_CHECK_INTERNAL(device >= 0 && device < 64, "skinny GEMM: device ", device);
  int sms = cached[static_cast<std::size_t>(device)].load(std::memory_order_relaxed);
  if (sms == 0) {
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    cached[static_cast<std::size_t>(device)].store(sms, std::memory_order_relaxed);
  }
  return sms;
}
}  // namespace

bool gemm_skinny_prefers_split_k8(int n) {
  return gemm_skinny_ctas(n) < 4 * current_device_sms();
}

void launch_gemm_skinny(const GemmSkinnyParams& p, cudaStream_t stream) {
  M3MSA_CHECK_SUPPORTED(p.rows >= 0 && p.rows <= kSkinnyMaxRows,
                        "skinny GEMM: rows must be in [0, ", kSkinnyMaxRows, "], got ", p.rows);
  M3MSA_CHECK_SUPPORTED(p.k > 0 && p.k % kSkinnyKAlign == 0,
                        "skinny GEMM: the input width must be a positive multiple of ",
                        kSkinnyKAlign, ", got ", p.k);
  M3MSA_CHECK_ARG(p.n > 0, "skinny GEMM: the output width must be > 0, got ", p.n);
  M3MSA_CHECK_ARG(p.x && p.w && p.out, "skinny GEMM: null pointer");
  M3MSA_CHECK_ARG(aligned16(p.x) && aligned16(p.w) && p.x_stride % 8 == 0,
                  "skinny GEMM: x rows and the weight must be 16-byte aligned (x stride ",
                  p.x_stride, ")");
  M3MSA_CHECK_ARG(p.x_stride >= p.k && p.out_stride >= p.n, "skinny GEMM: strides (x ", p.x_stride,
                  ", out ", p.out_stride, ") below the widths (", p.k, ", ", p.n, ")");
  if (p.rows == 0) return;
  const int tiles = gemm_skinny_ctas(p.n);
  // The ring (bf16) when the grid puts >= 4 CTAs on every SM: M3's TP = 1 q/k/v projection (616
  // CTAs) measured 9-15 % faster; o_proj's 384 CTAs were up to 9 % slower with it (a group puts
  // three chunks in flight per warp at its start, the ring two). Every loop gives the same bits.
  // fp8 weights of a 4-warp projection (no split_k8) are read in 128-byte chunks (two 64-k
  // sub-chunks), as bf16's: the same bytes per load and slot, so the fp8 projection can take the
  // ring too. Another k order than 64-byte chunks: it follows from split_k8 and k alone, so every
  // launch of one projection makes the same choice.
  const bool wide_fp8 = p.w_fp8 && !p.split_k8 && p.k % (2 * gemm::kChunk) == 0;
  // At one token row the fp8 ring measured slower than the group loop (M3's q/k/v: 25.4 us
  // against 23.7 for the 128-byte group, 24.1 for the 64-byte one): fp8 takes it from 2 rows.
  // Ring and group give the same bits, so choosing by rows keeps a row's result independent of
  // its batch.
  const bool ring =
      (!p.w_fp8 || wide_fp8) && !p.deep &&
      (p.force_ring || (tiles >= 4 * current_device_sms() && (!p.w_fp8 || p.rows >= 2)));
  if (p.split_k8) {
    auto* kernel =
        p.deep ? (p.w_fp8 ? gemm::gemm_skinny_k8_deep_kernel<true>
                          : gemm::gemm_skinny_k8_deep_kernel<false>)
               : (p.w_fp8 ? gemm::gemm_skinny_k8_kernel<true> : gemm::gemm_skinny_k8_kernel<false>);
    kernel<<<tiles, 2 * gemm::kGemmThreads, 0, stream>>>(p);
    CUDA_CHECK_LAUNCH();
    return;
  }
  auto* kernel = p.deep     ? (!p.w_fp8   ? gemm::gemm_skinny_deep_kernel<false, 1>
                               : wide_fp8 ? gemm::gemm_skinny_deep_kernel<true, 2>
                                          : gemm::gemm_skinny_deep_kernel<true, 1>)
                 : !p.w_fp8 ? (ring ? gemm::gemm_skinny_kernel<false, true, 1>
                                    : gemm::gemm_skinny_kernel<false, false, 1>)
                 : wide_fp8 ? (ring ? gemm::gemm_skinny_kernel<true, true, 2>
                                    : gemm::gemm_skinny_kernel<true, false, 2>)
                            : gemm::gemm_skinny_kernel<true, false, 1>;
  kernel<<<tiles, gemm::kGemmThreads, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

}  // namespace m3msa::cuda
