// Launchers of the CP exchange kernels (cp_exchange.h).
#include "cp/cp_exchange.h"

#include "cp/cp_exchange_kernel.cuh"
#include "cuda/common.cuh"

namespace m3msa::cuda {

namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// One warp per (row, merged head) of max_rows.
int merge_ctas(const cp_exchange::CpExchangeParams& p) {
  return narrow_int(ceil_div(int64_t{p.max_rows} * p.merged, cp_exchange::kWarps), "merge CTAs");
}

// One warp per (row, head) of max_rows.
int nominate_ctas(const cp_exchange::CpExchangeParams& p) {
  return narrow_int(ceil_div(int64_t{p.max_rows} * p.heads, cp_exchange::kWarps), "nominate CTAs");
}

}  // namespace

void launch_cp_exchange_shard_tables(const cp_exchange::CpExchangeParams& p, int max_reqs,
                                     cudaStream_t stream) {
  cp_exchange::cp_exchange_shard_tables_kernel<<<max_reqs, cp_exchange::kThreads, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

void launch_cp_exchange_nominate(const cp_exchange::CpExchangeParams& p, cudaStream_t stream) {
  cp_exchange::cp_exchange_nominate_kernel<<<nominate_ctas(p), cp_exchange::kThreads, 0, stream>>>(
      p);
  CUDA_CHECK_LAUNCH();
}

void launch_cp_exchange_merge(const cp_exchange::CpExchangeParams& p, cudaStream_t stream) {
  cp_exchange::cp_exchange_merge_kernel<<<merge_ctas(p), cp_exchange::kThreads, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

void launch_cp_exchange_fused(const cp_exchange::CpExchangeParams& p, cudaStream_t stream) {
  const int nominate = nominate_ctas(p);
  cp_exchange::
      cp_exchange_fused_kernel<<<nominate + merge_ctas(p), cp_exchange::kThreads, 0, stream>>>(
          p, nominate);
  CUDA_CHECK_LAUNCH();
}

void launch_cp_exchange_scatter_scores(const cp_exchange::CpExchangeParams& p,
                                       cudaStream_t stream) {
  const dim3 grid(narrow_int(ceil_div(p.full_cols, 256), "scatter CTAs"), p.max_rows * p.heads);
  cp_exchange::cp_exchange_scatter_scores_kernel<<<grid, cp_exchange::kThreads, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH();
}

void launch_cp_exchange_select_full(const cp_exchange::CpExchangeParams& p, cudaStream_t stream) {
  cp_exchange::cp_exchange_select_full_kernel<<<merge_ctas(p), cp_exchange::kThreads, 0, stream>>>(
      p);
  CUDA_CHECK_LAUNCH();
}

void launch_cp_exchange_gather_heads(const int32_t* full, int32_t* out, int live_rows, int heads,
                                     int merged, int head0, int k, cudaStream_t stream) {
  const int64_t total = int64_t{live_rows} * merged * k;
  if (total == 0) return;
  cp_exchange::cp_exchange_gather_heads_kernel<<<narrow_int(ceil_div(total, 256), "gather CTAs"),
                                                 256, 0, stream>>>(full, out, live_rows, heads,
                                                                   merged, head0, k);
  CUDA_CHECK_LAUNCH();
}

void launch_cp_exchange_debug(const cp_exchange::CpExchangeParams& p, int transport,
                              cudaStream_t stream) {
  cp_exchange::cp_exchange_debug_kernel<<<1, 1, 0, stream>>>(p, transport);
  CUDA_CHECK_LAUNCH();
}

}  // namespace m3msa::cuda
