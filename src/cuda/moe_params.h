// Kernel parameter struct of the moe family (moe_kernel.cuh): the mixture of experts of one rank
// for a decode step of up to kMoeMaxRows token rows (docs/spec.md section 8). Plain data, passed
// by value as __grid_constant__.
#pragma once

#include <cstdint>

namespace m3msa::cuda {

inline constexpr int kMoeMaxRows = 16;                  // token rows of one step
inline constexpr int kMoeMaxTopk = 8;                   // experts_per_token the kernels take
inline constexpr int kMoeMaxExperts = 4096;             // routed experts the kernels take
inline constexpr int kMoeWarps = 8;                     // warps per CTA of every moe kernel
inline constexpr int kMoeRowsPerWarp = 2;               // output rows (j or n) per warp and pass
inline constexpr int kMoeDownTiles = 4;                 // MoeParams::down_tiles above 1
inline constexpr int kMoeRouterPicksMaxRows = 4;        // MoeParams::router_picks_max_rows
inline constexpr int kMoeSharedWithRouterMinRows = 16;  // MoeParams::shared_with_router_min_rows
inline constexpr int kMoeDownCombineSlots = 3;          // MoeParams::down_combine
inline constexpr int kMoeDownCombineMaxRows = 1;        // MoeParams::down_combine_max_rows
// The streamed gate/up CTAs stage one token row of x in shared memory up to this many bytes
// (M3's hidden 6144: 12 KB), where the grid stays resident in one wave with the larger CTAs.
inline constexpr int kMoeStageXMaxBytes = 12 * 1024;
// MoeParams::stream: the largest hidden / intermediate the streamed kernels take.
inline constexpr int kMoeStreamMaxK = 65536;
// Sticky bits of the persistent kernel's status word (moe_status_word in moe.h).
inline constexpr uint32_t kMoeStatusTimeout = 1u;  // a wait for other items gave up: wrong output

// One expert set's weights: bf16, or MXFP8 (e4m3 codes + e8m0 scales per 32 elements along K).
// Routed: [E, 2 I, hidden] and [E, hidden, I]; shared: the same with E = 1.
struct MoeExpertSet {
  const void* w13 = nullptr;
  const uint8_t* w13_scale = nullptr;  // MXFP8 only
  const void* w2 = nullptr;
  const uint8_t* w2_scale = nullptr;  // MXFP8 only
  int inter = 0;                      // I on this rank (0: the set is absent)
};

struct MoeParams {
  const uint16_t* x = nullptr;           // [rows, hidden] bf16
  const float* router_weight = nullptr;  // [E, hidden] f32
  const float* router_bias = nullptr;    // [E] f32 or null (zeros)
  MoeExpertSet experts;
  MoeExpertSet shared;
  bool fp8 = false;  // both sets MXFP8 (else both bf16)
  // The expert projections on tensor cores (moe_*_mma_kernel) where hidden and the intermediates
  // are multiples of 64; false, or other shapes: the fp32 FMA kernels.
  bool tensor_cores = true;
  // The MoE's tensor-core launches of the expert projections that keep one tile per CTA (not
  // deep, one down tile) with MXFP8 weights stream the weights through a two-slot ring in shared
  // memory with the bulk-copy engine (the moe_*_mma_kernel's kStream; the same bits as the register
  // ring): ~70 registers instead of ~140, so twice the warps per SM share the MXFP8 loop's issue
  // slots. Taken where the scale tensors are 16-byte aligned and K <= kMoeStreamMaxK; bf16 weights
  // and the dense MLP keep the register ring (measured slower streamed); false: never streamed.
  bool stream = true;
  // On tensor cores, the shared expert's gate/up tiles run beside the router's logits in its
  // launch where rows >= this, else in the routed experts' gate/up launch as its last slot (the
  // same bits). Beside the router they keep the gate/up launch short but hold the router's
  // launch open and slow the top-k that follows the logits (their weight streams): measured
  // faster only at 16 rows (1-4 % slower at 1-14). 0: always beside the router; above
  // kMoeMaxRows: never. Measured in bench moe --kernels mma-shared-early,mma-shared-late.
  int shared_with_router_min_rows = kMoeSharedWithRouterMinRows;
  // The router launch's last logits CTA takes the top-k (no top-k launch) where rows <= this;
  // else a top-k launch of its own follows (one CTA, a warp per row; 0: always that). The in-launch
  // top-k caps the router kernel's registers, which the shared expert's gate/up tiles beside it
  // pay for at many rows. Measured in bench moe --kernels mma,mma-topk-apart.
  int router_picks_max_rows = kMoeRouterPicksMaxRows;
  // Each kernel launched as a programmatic dependent of the previous one in the stream (PDL): the
  // next kernel is scheduled while this one finishes and waits on the device. Off by default
  // until measured (bench moe --kernels mma,mma+pdl).
  bool pdl = false;
  // The tensor-core launches of the expert projections (the routed experts' gate/up, every down)
  // at 4 CTAs per SM with more weight chunks in flight per warp (moe_kernel.cuh; the same bits):
  // for the short rows of TP 4 / 8 ranks, whose CTAs wait on latency. Off by default until
  // measured (bench moe --kernels mma,mma-deep).
  bool deep = false;
  // Hidden-row tiles of 16 per tensor-core down CTA, 1 or kMoeDownTiles: the CTA's tiles share
  // one ring of weight loads at 4 CTAs per SM (moe_down_mma_kernel; the same bits). For TP 4 / 8
  // ranks, whose short down rows (K 768 / 384) leave a CTA per tile waiting a round trip per tile.
  // Off (1) by default until measured (bench moe --kernels mma,mma-down4).
  int down_tiles = 1;
  // The whole MoE in one launch (moe_persistent_kernel: work items in a fixed order from a ticket
  // counter, waits on counters in `sync`; the same bits as the tensor-core launches). Needs the
  // tensor-core shapes and hidden a multiple of 64; else the launch sequence. Off by default until
  // measured (bench moe --kernels mma,mma-persistent).
  bool persistent = false;
  // The down projection and the combine in one launch (moe_down_combine_kernel: a CTA per 16
  // hidden columns over every expert of the step, one ring of weight copies across them; the same
  // bits), with this many ring slots (2 or 3; 0: never), where the step has at most
  // down_combine_max_rows rows. Taken with the streamed MXFP8 experts (MoeParams::stream), one
  // down tile per CTA, not deep, K <= 1024 for the routed and the shared expert (TP 4 / 8 ranks of
  // M3) and hidden a multiple of 16; else the down and combine launches. Measured in bench moe
  // --kernels mma,mma-down-apart,mma-down-combine: 7 % faster at one token (TP 4 and 8), at 4
  // tokens 8 % faster at TP 8 and 2 % slower at TP 4 (a CTA's 16 experts in series).
  int down_combine = kMoeDownCombineSlots;
  int down_combine_max_rows = kMoeDownCombineMaxRows;
  // Set by the launcher per launch: 1 when the expert grid's last row is the shared expert.
  int shared_slot = 0;
  int rows = 0;
  int hidden = 0;
  int num_experts = 0;
  int topk = 0;
  float routed_scaling = 2.0f;
  float limit = 7.0f;
  // Workspace (moe_workspace_bytes) and outputs.
  float* route_s = nullptr;     // [rows, E] f32: sigmoid of the router logits
  float* route_key = nullptr;   // [rows, E] f32: s + bias, the picking keys
  int32_t* topk_ids = nullptr;  // [rows, topk] i32: the picked experts, pick order
  // The expert slots of the step, written with the picks: slot y is the y-th smallest distinct
  // expert picked, with its picks in row order, then pick order (max_slots = min(E, rows * topk)).
  int32_t* slot_expert = nullptr;  // [max_slots] the expert (-1: no expert left for the slot)
  int32_t* slot_count = nullptr;   // [max_slots] its picks (<= rows: a row picks it at most once)
  int32_t* slot_picks = nullptr;   // [max_slots, kMoeMaxRows] pick index row * topk + i
  float* topk_weights = nullptr;   // [rows, topk] f32
  uint16_t* act = nullptr;         // [rows, topk, I] bf16: the routed experts' activations
  uint16_t* act_shared = nullptr;  // [rows, S] bf16
  float* y = nullptr;              // [rows, topk + 1, hidden] f32: each expert's output
  float* out = nullptr;            // [rows, hidden] f32: this rank's partial
  // The arrival counters (the router launch's; the persistent kernel's) and the persistent
  // kernel's status word (moe_kernel.cuh, kSync*): zero before the first launch
  // (moe_workspace_bytes' contract); each launch leaves the counters zero.
  uint32_t* sync = nullptr;
  // Stage timeline (timeline.h) of the launch: per CTA (marks kMoeLaunchMarks; kinds
  // kMoeRouterKinds in the router's launch, else kMoeExpertKinds), or in the persistent kernel
  // one record per work item (ticket order; kMoePersistentMarks, kMoePersistentKinds); null: not
  // recorded.
  uint64_t* timeline = nullptr;
};

// The launch sequence's timeline (every kernel but the persistent one): when each CTA started,
// had its inputs (the previous kernels' outputs it waits for: the programmatic wait and, for the
// expert kernels, their slot's token list) and ended, by kind of CTA.
inline constexpr const char* kMoeLaunchMarks[] = {"start", "inputs ready", "end"};
inline constexpr const char* kMoeRouterKinds[] = {"router logits", "shared gate/up", "top-k"};
inline constexpr const char* kMoeExpertKinds[] = {"routed", "shared expert", "no tokens"};

// The persistent kernel's timeline: when each work item started, had its inputs (the counters
// it waits on complete) and ended, by kind of item.
inline constexpr const char* kMoePersistentMarks[] = {"start", "inputs ready", "end"};
inline constexpr const char* kMoePersistentKinds[] = {
    "router logits",  "shared gate/up", "top-k",  "shared down",
    "routed gate/up", "routed down",    "combine"};

}  // namespace m3msa::cuda
