// Host launchers of the moe family: the mixture of experts of one rank (docs/spec.md section 8)
// for decode steps of 1..16 token rows. Four or five launches: the router's logits (one CTA per
// expert; up to MoeParams::router_picks_max_rows rows the last of them to finish takes the top-k,
// else a launch of its own does), the gate/up projections with the activation, the down
// projection (one CTA per distinct picked expert, plus the shared expert, and tile of outputs, so
// each selected expert's weights are read once per step whatever the number of tokens routed to
// it), and the weighted sum in pick order. MXFP8 weights are
// decoded in registers; the projections run on tensor cores (fp32 accumulation) where hidden and
// the intermediates are multiples of 64 (MoeParams::tensor_cores), else as fp32 FMA.
// On tensor cores the shared expert's gate/up tiles run in the gate/up launch, or from
// MoeParams::shared_with_router_min_rows rows in the router's launch beside the logits (they need
// no routing).
// MoeParams::persistent runs the same work as ordered items of one launch (moe_kernel.cuh), with
// the same bits. Validates on the host, allocates nothing, never synchronizes, CUDA-graph
// capturable; deterministic run to run.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/moe_params.h"
#include "m3msa/moe.h"

namespace m3msa::cuda {

// Bytes of workspace for `rows` rows (topk_ids, topk_weights, act, act_shared, y, and the
// persistent kernel's sync words), each part 256-byte aligned; moe_carve points the params'
// workspace fields into `workspace`. Zero the workspace once before its first launch (cudaMemset):
// every launch leaves its arrival counters (the router's; the persistent kernel's) zero again.
std::size_t moe_workspace_bytes(const MoeConfig& config, int rows);
void moe_carve(const MoeConfig& config, int rows, void* workspace, MoeParams& p);
// The persistent kernel's sticky status word in the workspace (kMoeStatus* bits; 0: no wait gave
// up), for tests and diagnostics; the caller clears it.
const uint32_t* moe_status_word(const MoeParams& p);

// Fills MoeParams from the validated tensors of `args` (device tensors on one GPU; args.out is
// the f32 partial) and a workspace of moe_workspace_bytes. Throws naming the argument.
MoeParams moe_params(const MoeConfig& config, const MoeArgs& args, void* workspace);

// The launches on `stream` (MoeParams::persistent: one, where moe_runs_persistent).
void launch_moe(const MoeParams& p, cudaStream_t stream);
// Whether launch_moe runs `p` as the one persistent launch: p.persistent, and shapes the
// tensor-core kernels take with hidden a multiple of 64 (else it runs the launch sequence).
bool moe_runs_persistent(const MoeParams& p);
// The kernel launches launch_moe makes for `p`: 0 without rows, 1 persistent, else 4 or 5 (router
// logits with the shared gate/up beside them or not, and the top-k in that launch or its own;
// gate/up; down; combine).
int moe_launches(const MoeParams& p);

// A dense layer's MLP (docs/spec.md section 8, "Dense MLP") on the same kernels: the shared-expert
// slot alone (no router, no routed experts), its down projection written straight to args.out
// (the expert function with weight 1: no combine). Two launches. Workspace: the activations.
std::size_t dense_mlp_workspace_bytes(int intermediate, int rows);
MoeParams dense_mlp_params(const DenseMlpArgs& args, void* workspace);
void launch_dense_mlp(const MoeParams& p, cudaStream_t stream);

}  // namespace m3msa::cuda
