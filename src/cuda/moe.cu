// Launchers of the moe family (moe_kernel.cuh has the kernels).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/moe.h"
#include "cuda/moe_kernel.cuh"
#include "cuda/timeline.h"
#include "m3msa/error.h"

namespace m3msa::cuda {

namespace {

std::size_t align256(std::size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

// The tensor-core kernels take K in 64-wide chunks: hidden (gate/up) and every intermediate (down).
bool use_tensor_cores(const MoeParams& p) {
  constexpr int kChunk = gemm::kChunk;
  return p.tensor_cores && p.hidden % kChunk == 0 && p.experts.inter % kChunk == 0 &&
         p.shared.inter % kChunk == 0;
}

// The streamed kernels (MoeParams::stream) where they are taken: MXFP8 weights of the MoE (with
// bf16 weights or in the dense MLP they measured slower than the register ring: the bf16 loop
// issues fewer instructions per byte, and the dense MLP's few long down rows wait on the short
// ring); bulk copies need 16-byte aligned scale rows (the weights' alignment is checked for every
// launch), and a K whose ring and scales fit the shared memory.
bool use_stream(const MoeParams& p) {
  if (!p.stream || !p.fp8 || p.num_experts == 0 || !use_tensor_cores(p)) return false;
  const int ks[] = {p.hidden, p.experts.inter, p.shared.inter};
  for (int k : ks) {
    if (k > kMoeStreamMaxK) return false;
  }
  const uint8_t* scales[] = {p.experts.w13_scale, p.experts.w2_scale, p.shared.w13_scale,
                             p.shared.w2_scale};
  for (const uint8_t* ptr : scales) {
    if (ptr != nullptr && !aligned16(ptr)) return false;
  }
  return true;
}

// MoeParams::down_combine where it is taken (streamed: use_stream(p)).
bool use_down_combine(const MoeParams& p, bool streamed) {
  return p.down_combine > 0 && p.rows <= p.down_combine_max_rows && streamed && !p.deep &&
         p.down_tiles == 1 && p.experts.inter <= moe::kDownCombineMaxK &&
         p.shared.inter <= moe::kDownCombineMaxK && p.hidden % gemm::kColsPerCta == 0;
}

// Dynamic shared memory of a streamed kernel with reduction dimension k (its limit raised once).
std::size_t stream_smem(void (*kernel)(MoeParams), int k, bool fp8) {
  const int bytes = gemm::stream_smem_bytes(k, fp8, fp8);
  raise_dynamic_smem_limit(reinterpret_cast<const void*>(kernel), bytes);
  return static_cast<std::size_t>(bytes);
}

// CTAs of `kernel` resident at once on the current device with `smem` bytes of dynamic shared
// memory each (its limit raised first); cached per device, kernel and size.
int64_t resident_ctas(void (*kernel)(MoeParams), int threads, std::size_t smem) {
  raise_dynamic_smem_limit(reinterpret_cast<const void*>(kernel), static_cast<int>(smem));
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, std::size_t>, int64_t> cache;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(device, reinterpret_cast<const void*>(kernel), smem);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return cache[key] = int64_t{per_sm} * sms;
}

// One launch of a moe kernel; with p.pdl as a programmatic dependent of the previous kernel in the
// stream (each kernel waits for it on the device before its first read).
void launch_kernel(void (*kernel)(MoeParams), dim3 grid, unsigned threads, const MoeParams& p,
                   cudaStream_t stream, std::size_t smem = 0) {
  launch_kernel_ex(kernel, grid, dim3(threads), smem, stream, p.pdl, p);
}

// One launch of the sequence (not the persistent kernel), its CTAs recorded as `name` on an active
// timeline recorder (kMoeLaunchMarks; kinds kMoeRouterKinds for the router's launch, else
// kMoeExpertKinds).
void launch_stage(const char* name, bool router, void (*kernel)(MoeParams), dim3 grid,
                  unsigned threads, MoeParams p, cudaStream_t stream, std::size_t smem = 0) {
  p.timeline = timeline::records_for(
      name, timeline::names(kMoeLaunchMarks), int64_t{grid.x} * grid.y * grid.z,
      router ? timeline::names(kMoeRouterKinds) : timeline::names(kMoeExpertKinds));
  launch_kernel(kernel, grid, threads, p, stream, smem);
}

// Whether the router launch's last CTA takes the top-k (MoeParams::router_picks_max_rows).
bool picks_in_router(const MoeParams& p) {
  return p.rows <= p.router_picks_max_rows;
}

// The gate/up and down launches over `routed` expert slots plus the shared expert's (or the dense
// MLP's) slot. shared_gate_up: the shared expert's gate/up tiles are in this gate/up launch (the
// last row of its grid); else they ran beside the router. streamed: use_stream(p). down_combine:
// use_down_combine(p, streamed): the down launch also combines (no combine launch follows).
void launch_expert_projections(const MoeParams& p, int routed, bool shared_gate_up, bool streamed,
                               bool down_combine, cudaStream_t stream) {
  M3MSA_CHECK_ARG(p.down_tiles == 1 || p.down_tiles == kMoeDownTiles,
                  "moe: down_tiles must be 1 or ", kMoeDownTiles, ", got ", p.down_tiles);
  const bool has_shared = p.shared.inter > 0;
  MoeParams gate_up = p;
  gate_up.shared_slot = has_shared && shared_gate_up ? 1 : 0;
  MoeParams down = p;
  down.shared_slot = has_shared ? 1 : 0;
  const int gate_up_sets = routed + gate_up.shared_slot;
  const int down_sets = routed + down.shared_slot;
  const int inter = std::max(p.experts.inter, gate_up.shared_slot ? p.shared.inter : 0);
  if (use_tensor_cores(p)) {
    const dim3 gate_up_grid((inter + moe::kMmaGateUpRows - 1) / moe::kMmaGateUpRows, gate_up_sets);
    // down_tiles: only where every CTA's tiles are whole (hidden a multiple of their columns).
    const bool down_tiled = p.down_tiles == kMoeDownTiles && p.hidden % moe::kDownGroupCols == 0;
    const int down_cols = (down_tiled ? kMoeDownTiles : 1) * gemm::kColsPerCta;
    const dim3 down_grid((p.hidden + down_cols - 1) / down_cols, down_sets);
    const auto gate_up_kernel = p.deep ? (p.fp8 ? moe::moe_gate_up_mma_kernel<true, true>
                                                : moe::moe_gate_up_mma_kernel<false, true>)
                                       : (p.fp8 ? moe::moe_gate_up_mma_kernel<true, false>
                                                : moe::moe_gate_up_mma_kernel<false, false>);
    const auto down_kernel =
        down_tiled ? (p.fp8 ? moe::moe_down_mma_kernel<true, true, kMoeDownTiles>
                            : moe::moe_down_mma_kernel<false, true, kMoeDownTiles>)
        : p.deep
            ? (p.fp8 ? moe::moe_down_mma_kernel<true, true> : moe::moe_down_mma_kernel<false, true>)
            : (p.fp8 ? moe::moe_down_mma_kernel<true, false>
                     : moe::moe_down_mma_kernel<false, false>);
    const bool stream_gate_up = streamed && !p.deep;
    const bool stream_down = streamed && !p.deep && !down_tiled;
    if (gate_up_sets > 0) {
      if (stream_gate_up) {
        // MXFP8 (use_stream). x staged in shared memory where it is one row of at most
        // kMoeStageXMaxBytes and the grid stays resident in one wave with the larger CTAs.
        const auto staged = moe::moe_gate_up_mma_kernel<true, false, true, true>;
        const std::size_t x_bytes = static_cast<std::size_t>(p.hidden) * 2;
        const std::size_t staged_smem = stream_smem(staged, p.hidden, p.fp8) + x_bytes;
        const bool stage_x = p.rows == 1 &&
                             x_bytes <= static_cast<std::size_t>(kMoeStageXMaxBytes) &&
                             int64_t{gate_up_grid.x} * gate_up_grid.y <=
                                 resident_ctas(staged, moe::kMmaThreads, staged_smem);
        const auto kernel = stage_x ? staged : moe::moe_gate_up_mma_kernel<true, false, true>;
        const std::size_t smem = stage_x ? staged_smem : stream_smem(kernel, p.hidden, p.fp8);
        raise_dynamic_smem_limit(reinterpret_cast<const void*>(kernel), static_cast<int>(smem));
        launch_stage("moe gate/up", false, kernel, gate_up_grid, moe::kMmaThreads, gate_up, stream,
                     smem);
      } else {
        launch_stage("moe gate/up", false, gate_up_kernel, gate_up_grid, moe::kMmaThreads, gate_up,
                     stream);
      }
    }
    if (down_combine) {
      // The activations staged in shared memory where they are small (one token row).
      const int max_k = std::max(p.experts.inter, p.shared.inter);
      const int segments = std::min(p.num_experts, p.rows * p.topk) + down.shared_slot;
      const int act_bytes = moe::down_combine_act_bytes(segments, p.rows, max_k);
      const bool stage = act_bytes <= moe::kDownCombineMaxActBytes;
      const auto kernel = p.down_combine == 2 ? (stage ? moe::moe_down_combine_kernel<2, true>
                                                       : moe::moe_down_combine_kernel<2, false>)
                                              : (stage ? moe::moe_down_combine_kernel<3, true>
                                                       : moe::moe_down_combine_kernel<3, false>);
      const int smem =
          moe::down_combine_smem_bytes(p.down_combine, p.rows, p.topk, stage ? act_bytes : 0);
      raise_dynamic_smem_limit(reinterpret_cast<const void*>(kernel), smem);
      launch_stage("moe down + combine", false, kernel,
                   dim3(static_cast<unsigned>(p.hidden / gemm::kColsPerCta)), moe::kMmaThreads,
                   down, stream, static_cast<std::size_t>(smem));
    } else if (stream_down) {
      const auto kernel = moe::moe_down_mma_kernel<true, false, 1, true>;
      const int k = std::max(routed > 0 ? p.experts.inter : 0,  // the slots' largest K
                             down.shared_slot ? p.shared.inter : 0);
      launch_stage("moe down", false, kernel, down_grid, moe::kMmaThreads, down, stream,
                   stream_smem(kernel, k, p.fp8));
    } else {
      launch_stage("moe down", false, down_kernel, down_grid, moe::kMmaThreads, down, stream);
    }
    return;
  }
  M3MSA_CHECK_INTERNAL(shared_gate_up || !has_shared,
                       "the FMA path takes the shared expert's gate/up");
  const dim3 gate_up_grid((inter + moe::kGateUpTile - 1) / moe::kGateUpTile, gate_up_sets);
  launch_stage("moe gate/up", false, moe::moe_gate_up_kernel, gate_up_grid, moe::kThreads, gate_up,
               stream);
  const dim3 down_grid((p.hidden + moe::kDownTile - 1) / moe::kDownTile, down_sets);
  launch_stage("moe down", false, moe::moe_down_kernel, down_grid, moe::kThreads, down, stream);
}

// MoeParams::persistent: one wave at most (a CTA past it would only draw an exit ticket), no more
// CTAs than items. The wave of each device and kernel is queried once, not on every launch.
void launch_persistent(MoeParams p, cudaStream_t stream) {
  const auto kernel = p.fp8 ? moe::moe_persistent_kernel<true> : moe::moe_persistent_kernel<false>;
  const int64_t wave = resident_ctas(kernel, moe::kMmaThreads, 0);
  const int items = moe::persistent_items(p).total;
  const int ctas = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(items, wave)));
  p.timeline = timeline::records_for("moe persistent", timeline::names(kMoePersistentMarks), items,
                                     timeline::names(kMoePersistentKinds));
  launch_kernel(kernel, dim3(static_cast<unsigned>(ctas)), moe::kMmaThreads, p, stream);
}

struct Layout {
  std::size_t route_s = 0, route_key = 0, ids = 0, weights = 0, slot_expert = 0, slot_count = 0,
              slot_picks = 0, act = 0, act_shared = 0, y = 0, sync = 0, total = 0;
};

Layout layout_of(const MoeConfig& c, int rows) {
  const std::size_t r = static_cast<std::size_t>(rows);
  const std::size_t k = static_cast<std::size_t>(c.experts_per_token);
  Layout l;
  // The persistent kernel's sync words first, at a place and size that do not depend on the rows:
  // the counters a launch of any row count finds must be the zeros the last one left.
  l.sync = 0;
  l.route_s =
      align256(static_cast<std::size_t>(moe::persistent_sync_words(c.num_experts, c.hidden)) *
               sizeof(uint32_t));
  l.route_key = l.route_s + align256(r * static_cast<std::size_t>(c.num_experts) * sizeof(float));
  l.ids = l.route_key + align256(r * static_cast<std::size_t>(c.num_experts) * sizeof(float));
  l.weights = l.ids + align256(r * k * sizeof(int32_t));
  const std::size_t slots =
      std::min(static_cast<std::size_t>(c.num_experts), r * k);  // distinct experts a step picks
  l.slot_expert = l.weights + align256(r * k * sizeof(float));
  l.slot_count = l.slot_expert + align256(slots * sizeof(int32_t));
  l.slot_picks = l.slot_count + align256(slots * sizeof(int32_t));
  l.act = l.slot_picks + align256(slots * kMoeMaxRows * sizeof(int32_t));
  l.act_shared = l.act + align256(r * k * static_cast<std::size_t>(c.intermediate) * 2);
  l.y = l.act_shared + align256(r * static_cast<std::size_t>(c.shared_intermediate) * 2);
  l.total = l.y + align256(r * (k + 1) * static_cast<std::size_t>(c.hidden) * sizeof(float));
  return l;
}

}  // namespace

std::size_t moe_workspace_bytes(const MoeConfig& config, int rows) {
  return layout_of(config, rows).total;
}

void moe_carve(const MoeConfig& config, int rows, void* workspace, MoeParams& p) {
  const Layout l = layout_of(config, rows);
  char* base = static_cast<char*>(workspace);
  p.route_s = reinterpret_cast<float*>(base + l.route_s);
  p.route_key = reinterpret_cast<float*>(base + l.route_key);
  p.topk_ids = reinterpret_cast<int32_t*>(base + l.ids);
  p.slot_expert = reinterpret_cast<int32_t*>(base + l.slot_expert);
  p.slot_count = reinterpret_cast<int32_t*>(base + l.slot_count);
  p.slot_picks = reinterpret_cast<int32_t*>(base + l.slot_picks);
  p.topk_weights = reinterpret_cast<float*>(base + l.weights);
  p.act = reinterpret_cast<uint16_t*>(base + l.act);
  p.act_shared = reinterpret_cast<uint16_t*>(base + l.act_shared);
  p.y = reinterpret_cast<float*>(base + l.y);
  p.sync = reinterpret_cast<uint32_t*>(base + l.sync);
}

const uint32_t* moe_status_word(const MoeParams& p) {
  return p.sync == nullptr ? nullptr : p.sync + moe::kSyncStatus;
}

MoeParams moe_params(const MoeConfig& c, const MoeArgs& a, void* workspace) {
  validate(c, a);
  const Device device = a.x.device;
  M3MSA_CHECK_ARG(device.type == DeviceType::kCUDA, "x: expected a tensor on a GPU, got one on ",
                  device_name(device));
  const std::pair<const TensorView*, const char*> tensors[] = {
      {&a.router_weight, "router_weight"},
      {&a.router_bias, "router_bias"},
      {&a.experts.w13, "experts.w13"},
      {&a.experts.w13_scale, "experts.w13_scale"},
      {&a.experts.w2, "experts.w2"},
      {&a.experts.w2_scale, "experts.w2_scale"},
      {&a.shared.w13, "shared.w13"},
      {&a.shared.w13_scale, "shared.w13_scale"},
      {&a.shared.w2, "shared.w2"},
      {&a.shared.w2_scale, "shared.w2_scale"},
      {&a.out, "out"}};
  for (const auto& [view, name] : tensors) {
    if (view->defined()) check_device(*view, name, device);
  }
  MoeParams p;
  p.x = a.x.ptr<const uint16_t>();
  p.router_weight = a.router_weight.ptr<const float>();
  p.router_bias = a.router_bias.defined() ? a.router_bias.ptr<const float>() : nullptr;
  p.fp8 = a.experts.w13.dtype == DType::kFP8E4M3;
  M3MSA_CHECK_ARG(c.shared_intermediate == 0 || a.shared.w13.dtype == a.experts.w13.dtype,
                  "shared.w13: expected dtype ", dtype_name(a.experts.w13.dtype),
                  " (as experts.w13: the kernels take one format per layer), got ",
                  dtype_name(a.shared.w13.dtype));
  p.experts = {a.experts.w13.data, a.experts.w13_scale.ptr<const uint8_t>(), a.experts.w2.data,
               a.experts.w2_scale.ptr<const uint8_t>(), c.intermediate};
  if (c.shared_intermediate > 0) {
    p.shared = {a.shared.w13.data, a.shared.w13_scale.ptr<const uint8_t>(), a.shared.w2.data,
                a.shared.w2_scale.ptr<const uint8_t>(), c.shared_intermediate};
  }
  p.rows = narrow_int(a.x.shape[0], "x rows");
  p.hidden = c.hidden;
  p.num_experts = c.num_experts;
  p.topk = c.experts_per_token;
  p.routed_scaling = c.routed_scaling;
  p.limit = c.activation_limit;
  p.out = a.out.ptr<float>();
  moe_carve(c, p.rows, workspace, p);
  return p;
}

bool moe_runs_persistent(const MoeParams& p) {
  return p.persistent && use_tensor_cores(p) && p.hidden % moe::kDownGroupCols == 0;
}

int moe_launches(const MoeParams& p) {
  if (p.rows == 0) return 0;
  if (moe_runs_persistent(p)) return 1;
  return (picks_in_router(p) ? 4 : 5) - (use_down_combine(p, use_stream(p)) ? 1 : 0);
}

void launch_moe(const MoeParams& p, cudaStream_t stream) {
  M3MSA_CHECK_ARG(p.rows >= 0 && p.rows <= kMoeMaxRows, "moe: rows must be in [0, ", kMoeMaxRows,
                  "], got ", p.rows);
  M3MSA_CHECK_ARG(p.topk > 0 && p.topk <= kMoeMaxTopk && p.topk <= p.num_experts,
                  "moe: experts_per_token must be in [1, ", kMoeMaxTopk, "], got ", p.topk);
  M3MSA_CHECK_ARG(p.num_experts > 0 && p.num_experts <= kMoeMaxExperts,
                  "moe: num_experts must be in [1, ", kMoeMaxExperts, "], got ", p.num_experts);
  M3MSA_CHECK_ARG(p.hidden > 0 && p.hidden % 8 == 0, "moe: hidden must be a multiple of 8, got ",
                  p.hidden);
  M3MSA_CHECK_ARG(p.shared_with_router_min_rows >= 0,
                  "moe: shared_with_router_min_rows must be >= 0, got ",
                  p.shared_with_router_min_rows);
  M3MSA_CHECK_ARG(p.down_combine == 0 || p.down_combine == 2 || p.down_combine == 3,
                  "moe: down_combine must be 0, 2 or 3 ring slots, got ", p.down_combine);
  M3MSA_CHECK_ARG(p.experts.inter > 0 && p.experts.inter % 8 == 0 && p.shared.inter % 8 == 0,
                  "moe: the intermediates must be multiples of 8, got ", p.experts.inter, " and ",
                  p.shared.inter);
  M3MSA_CHECK_ARG(p.x && p.router_weight && p.experts.w13 && p.experts.w2 && p.out && p.y &&
                      p.act && p.topk_ids && p.topk_weights && p.route_s && p.route_key &&
                      p.slot_expert && p.slot_count && p.slot_picks && p.sync,
                  "moe: null pointer");
  M3MSA_CHECK_ARG(!p.fp8 || (p.experts.w13_scale && p.experts.w2_scale),
                  "moe: MXFP8 weights without scales");
  const void* aligned[] = {p.x,          p.router_weight, p.experts.w13, p.experts.w2,
                           p.shared.w13, p.shared.w2,     p.act,         p.act_shared};
  for (const void* ptr : aligned) {
    M3MSA_CHECK_ARG(ptr == nullptr || aligned16(ptr),
                    "moe: the activations, weights and workspace must be 16-byte aligned");
  }
  if (p.rows == 0) return;
  if (moe_runs_persistent(p)) {
    launch_persistent(p, stream);
    return;
  }
  // One slot per distinct expert the step can pick.
  const int routed = std::min(p.num_experts, p.rows * p.topk);
  // On tensor cores the shared expert's gate/up tiles run in the router's launch from
  // MoeParams::shared_with_router_min_rows rows, else in the gate/up launch.
  const bool shared_beside_router =
      use_tensor_cores(p) && p.shared.inter > 0 && p.rows >= p.shared_with_router_min_rows;
  const bool pick = picks_in_router(p);
  const bool streamed = use_stream(p);
  if (shared_beside_router) {
    const int shared_ctas = (p.shared.inter + moe::kMmaGateUpRows - 1) / moe::kMmaGateUpRows;
    const dim3 grid(static_cast<unsigned>(p.num_experts + shared_ctas));
    if (streamed) {
      const auto kernel = pick ? moe::moe_route_and_shared_kernel<true, true, true>
                               : moe::moe_route_and_shared_kernel<true, true, false>;
      launch_stage("moe router", true, kernel, grid, moe::kMmaThreads, p, stream,
                   stream_smem(kernel, p.hidden, p.fp8));
    } else {
      const auto kernel = p.fp8 ? (pick ? moe::moe_route_and_shared_kernel<true, false, true>
                                        : moe::moe_route_and_shared_kernel<true, false, false>)
                                : (pick ? moe::moe_route_and_shared_kernel<false, false, true>
                                        : moe::moe_route_and_shared_kernel<false, false, false>);
      launch_stage("moe router", true, kernel, grid, moe::kMmaThreads, p, stream);
    }
  } else {
    launch_stage("moe router", true,
                 pick ? moe::moe_route_logits_kernel<true> : moe::moe_route_logits_kernel<false>,
                 dim3(static_cast<unsigned>(p.num_experts)), moe::kRouteThreads, p, stream);
  }
  if (!pick) {
    launch_stage("moe top-k", true, moe::moe_route_topk_kernel, dim3(1), moe::kThreads, p, stream);
  }
  const bool down_combine = use_down_combine(p, streamed);
  launch_expert_projections(p, routed, !shared_beside_router, streamed, down_combine, stream);
  if (down_combine) return;
  const int64_t total = static_cast<int64_t>(p.rows) * p.hidden;
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, 1024);
  launch_stage("moe combine", false, moe::moe_combine_kernel, dim3(static_cast<unsigned>(blocks)),
               256, p, stream);
}

std::size_t dense_mlp_workspace_bytes(int intermediate, int rows) {
  return align256(static_cast<std::size_t>(rows) * static_cast<std::size_t>(intermediate) * 2);
}

MoeParams dense_mlp_params(const DenseMlpArgs& a, void* workspace) {
  validate(a);
  const Device device = a.x.device;
  M3MSA_CHECK_ARG(device.type == DeviceType::kCUDA, "x: expected a tensor on a GPU, got one on ",
                  device_name(device));
  const std::pair<const TensorView*, const char*> tensors[] = {{&a.mlp.w13, "mlp.w13"},
                                                               {&a.mlp.w13_scale, "mlp.w13_scale"},
                                                               {&a.mlp.w2, "mlp.w2"},
                                                               {&a.mlp.w2_scale, "mlp.w2_scale"},
                                                               {&a.out, "out"}};
  for (const auto& [view, name] : tensors) {
    if (view->defined()) check_device(*view, name, device);
  }
  // The shared-expert slot of the moe kernels with no routed expert (num_experts 0, topk 0): the
  // expert CTAs take every row, and y, whose one slot per row is then [rows, hidden], is out.
  MoeParams p;
  p.x = a.x.ptr<const uint16_t>();
  p.fp8 = a.mlp.w13.dtype == DType::kFP8E4M3;
  p.shared = {a.mlp.w13.data, a.mlp.w13_scale.ptr<const uint8_t>(), a.mlp.w2.data,
              a.mlp.w2_scale.ptr<const uint8_t>(), narrow_int(a.mlp.w2.shape[1], "mlp width")};
  p.rows = narrow_int(a.x.shape[0], "x rows");
  p.hidden = narrow_int(a.x.shape[1], "hidden");
  p.num_experts = 0;
  p.topk = 0;
  p.limit = a.activation_limit;
  p.act_shared = static_cast<uint16_t*>(workspace);
  p.out = a.out.ptr<float>();
  p.y = p.out;
  return p;
}

void launch_dense_mlp(const MoeParams& p, cudaStream_t stream) {
  M3MSA_CHECK_ARG(p.rows >= 0 && p.rows <= kMoeMaxRows, "dense mlp: rows must be in [0, ",
                  kMoeMaxRows, "], got ", p.rows);
  M3MSA_CHECK_ARG(p.num_experts == 0 && p.topk == 0 && p.y == p.out,
                  "dense mlp: expected the params of dense_mlp_params");
  M3MSA_CHECK_ARG(p.hidden > 0 && p.hidden % 8 == 0,
                  "dense mlp: hidden must be a multiple of 8, got ", p.hidden);
  M3MSA_CHECK_ARG(p.shared.inter > 0 && p.shared.inter % 8 == 0,
                  "dense mlp: the intermediate must be a multiple of 8, got ", p.shared.inter);
  M3MSA_CHECK_ARG(p.x && p.shared.w13 && p.shared.w2 && p.out && p.act_shared,
                  "dense mlp: null pointer");
  M3MSA_CHECK_ARG(!p.fp8 || (p.shared.w13_scale && p.shared.w2_scale),
                  "dense mlp: MXFP8 weights without scales");
  const void* aligned[] = {p.x, p.shared.w13, p.shared.w2, p.act_shared};
  for (const void* ptr : aligned) {
    M3MSA_CHECK_ARG(aligned16(ptr),
                    "dense mlp: the activations and weights must be 16-byte aligned");
  }
  if (p.rows == 0) return;
  launch_expert_projections(p, 0, true, use_stream(p), false, stream);
}

}  // namespace m3msa::cuda
