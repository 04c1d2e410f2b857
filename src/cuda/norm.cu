// Launcher of the norm family: validation and the choice between the register and the loop
// variant (norm_kernel.cuh has the algorithm).
#include <cuda_runtime.h>

#include "cuda/common.cuh"
#include "cuda/norm.h"
#include "cuda/norm_kernel.cuh"
#include "m3msa/error.h"

namespace m3msa::cuda {

void launch_norm_residual(const NormResidualParams& p, cudaStream_t stream) {
  M3MSA_CHECK_ARG(p.rows >= 0, "norm_residual: rows must be >= 0, got ", p.rows);
  M3MSA_CHECK_SUPPORTED(p.n > 0 && p.n % 8 == 0,
                        "norm_residual: the width must be a positive "
                        "multiple of 8, got ",
                        p.n);
  M3MSA_CHECK_ARG(p.delta && p.residual && p.weight && p.out, "norm_residual: null pointer");
  M3MSA_CHECK_ARG(
      aligned16(p.delta) && aligned16(p.residual) && aligned16(p.weight) && aligned16(p.out),
      "norm_residual: every tensor must be 16-byte aligned");
  if (p.rows == 0) return;
  // One pass with the row in registers up to 4 chunks of 8 per thread (hidden <= 32768); the loop
  // beyond. Threads: enough warps for the chunks of one pass, at most 1024.
  const int vectors = p.n / 8;
  const int chunks = (vectors + norm::kNormMaxThreads - 1) / norm::kNormMaxThreads;
  const int threads = ((vectors + chunks - 1) / chunks + 31) / 32 * 32;
  switch (chunks) {
    case 1: norm::norm_residual_regs_kernel<1><<<p.rows, threads, 0, stream>>>(p); break;
    case 2: norm::norm_residual_regs_kernel<2><<<p.rows, threads, 0, stream>>>(p); break;
    case 3:
    case 4: norm::norm_residual_regs_kernel<4><<<p.rows, threads, 0, stream>>>(p); break;
    default: norm::norm_residual_kernel<<<p.rows, norm::kNormThreads, 0, stream>>>(p); break;
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace m3msa::cuda
