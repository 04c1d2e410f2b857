// Host side of the block-sparse attention kernel: validation, the split plan, the workspace layout
// and the launch (attention_kernel.cuh has the algorithm).
//
// Row groups (AttentionTuning::max_row_tiles > 1, off by default): the decode rows of one request
// (q_len > 1) share a CTA, 4 or 2 at a time (choose_row_tiles), so the blocks their selections
// have in common are read once; prefill, q_len 1 and a topk above kMaxGroupedTopk take one row
// per CTA.
//
// Split plan: a (row, kv head) "unit" is one CTA unless there are too few units to fill the GPU;
// then each unit's selected blocks are split over `splits` CTAs (for a selection a power of two,
// each split >= 2 blocks, aiming at one CTA per SM: choose_splits; for dense attention any count
// that fits one wave of resident CTAs). One row per CTA, a selection: between half the SMs' count
// of units and one unit per SM, one CTA per unit, with the deep pipeline (one CTA of 8 warps per
// SM, 192 KB of stages) where the units leave a third or more of the SMs idle (fp8; bf16 two
// fifths). More units than one wave (one row per CTA, a selection):
// the balanced plan, one wave of CTAs each taking an equal share of the units' selected blocks,
// a unit cut by a share's boundary merged from its two parts (attention_plan_info; with
// AttentionTuning::balance off, two splits per unit in clusters of two up to 4/3 of a wave). The
// plan depends only on host shapes (rows, kv heads, topk, whether topk_idx is given) and the
// device, never on device contents, so a captured graph replays any metadata. Partials through
// the workspace need at most one wave of slots (two per one-row CTA of the balanced plan), so the
// workspace does not grow with the batch.
//
// Merge: up to AttentionTuning::max_cluster splits (when the device can co-schedule them as one
// thread-block cluster, checked once per kernel and size with cudaOccupancyMaxActiveClusters)
// merge through distributed shared memory, each rank merging a share of the output; otherwise
// through the workspace with an arrival counter, the last CTA to arrive merging. Clusters of more
// than two CTAs only where the grid fills at most half the SMs; there the plan also takes more
// splits (up to max_cluster, one block each at 16). Optional programmatic dependent launch (PDL).
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string>

#include "cuda/attention.h"
#include "cuda/attention_kernel.cuh"
#include "cuda/attention_params.h"
#include "cuda/common.cuh"
#include "cuda/timeline.h"
#include "m3msa/error.h"

namespace m3msa::cuda {
namespace {

constexpr int kMaxDenseSplits = 64;
static_assert(kMaxDenseSplits <= attention::kMaxMergeSplits, "the merge handles at most 64 splits");
constexpr size_t kAlign = 256;

size_t align_up(size_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

constexpr int kMaxClusterSplits = 16;
static_assert(kMaxClusterSplits <= attention::kMaxClusterRanks, "the cluster merge's ranks");
constexpr int kMaxSelectionSplits = 8;  // the default plan's (choose_splits)
constexpr int kClusterSizes = 5;        // 1, 2, 4, 8, 16

// The three kernel kinds: bf16 split-P (default), bf16 single-P (bench), fp8; each in three
// instantiations of rows per CTA (1, 2, 4).
enum KernelId : int { kBf16SplitP = 0, kBf16SingleP = 1, kFp8Kernel = 2, kKernels = 3 };
constexpr int kTileVariants = 4;  // 1, 2, 4 rows per CTA; one row with the deep pipeline

int tile_variant(int tiles, bool deep = false) {
  return deep ? 3 : tiles >= 4 ? 2 : tiles == 2 ? 1 : 0;
}

// Per device: SMs, resident CTAs of each kernel (smem limits raised once), and which cluster
// sizes each kernel can be launched with.
struct DeviceShape {
  int sm_count = 0;
  int per_sm[kKernels][kTileVariants] = {};
  int balanced_per_sm[kKernels] = {};  // the balanced plan's kernel (one row per CTA)
  bool cluster_ok[kKernels][kTileVariants][kClusterSizes] = {};
};

// The balanced plan's kernel uses the shared memory of the one-row kernel's body, without the
// cluster receive area.
template <bool kFp8>
constexpr int balanced_smem_bytes() {
  return attention::KvLayout<kFp8, 1>::kSharedBytes;
}

template <bool kFp8, bool kSplitP, int kTiles, bool kDeep = false>
void configure_kernel(int sms, DeviceShape& shape, KernelId id) {
  using L = attention::KvLayout<kFp8, kTiles, kDeep>;
  auto kernel = attention::attention_sparse_kernel<kFp8, kSplitP, kTiles, kDeep>;
  const int smem = L::kSmemBytes;
  const int variant = tile_variant(kTiles, kDeep);
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int per_sm = 0;
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, L::kThreads, smem));
  M3MSA_CHECK_INTERNAL(per_sm > 0, "sparse attention kernel cannot be resident (smem ", smem,
                       " bytes)");
  shape.per_sm[id][variant] = per_sm;
  // Cluster sizes above 8 are "non-portable": allowed explicitly, then checked like the others.
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) !=
      cudaSuccess) {
    cudaGetLastError();
  }
  for (int i = 1; i < kClusterSizes; ++i) {
    const int cluster = 1 << i;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(cluster * sms));
    cfg.blockDim = dim3(L::kThreads);
    cfg.dynamicSmemBytes = static_cast<size_t>(smem);
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(cluster);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
      cudaGetLastError();
      clusters = 0;
    }
    shape.cluster_ok[id][variant][i] = clusters > 0;
  }
}

template <bool kFp8, bool kSplitP>
void configure_kernels(int sms, DeviceShape& shape, KernelId id) {
  configure_kernel<kFp8, kSplitP, 1>(sms, shape, id);
  configure_kernel<kFp8, kSplitP, 2>(sms, shape, id);
  configure_kernel<kFp8, kSplitP, 4>(sms, shape, id);
  configure_kernel<kFp8, kSplitP, 1, true>(sms, shape, id);
  auto balanced = attention::attention_balanced_kernel<kFp8, kSplitP>;
  const int smem = balanced_smem_bytes<kFp8>();
  CUDA_CHECK(cudaFuncSetAttribute(balanced, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&shape.balanced_per_sm[id], balanced,
                                                           attention::kThreads, smem));
}

const DeviceShape& device_shape() {
  static std::mutex mutex;
  static std::array<DeviceShape, 64> shapes{};
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  M3MSA_CHECK_INTERNAL(device >= 0 && device < 64, "device ", device);
  std::lock_guard<std::mutex> lock(mutex);
  DeviceShape& shape = shapes[static_cast<size_t>(device)];
  if (shape.sm_count == 0) {
    int sms = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    configure_kernels<false, true>(sms, shape, kBf16SplitP);
    configure_kernels<false, false>(sms, shape, kBf16SingleP);
    configure_kernels<true, false>(sms, shape, kFp8Kernel);
    shape.sm_count = sms;
  }
  return shape;
}

int resident_slots(const DeviceShape& shape, KernelId id, int tiles, bool deep = false) {
  return shape.sm_count * shape.per_sm[id][tile_variant(tiles, deep)];
}

// Partials (one per split CTA and row of it) the workspace holds: a split plan keeps the grid
// within one wave of resident CTAs, each CTA publishing one partial per row; the balanced plan's
// one-row CTAs publish up to two (a unit's tail and the next one's head).
int max_partial_slots(const DeviceShape& shape) {
  int slots = 0;
  for (int id = 0; id < kKernels; ++id) {
    for (int tiles : {1, 2, 4}) {
      slots = std::max(slots, resident_slots(shape, static_cast<KernelId>(id), tiles) * tiles);
    }
    slots = std::max(slots, resident_slots(shape, static_cast<KernelId>(id), 1, true));
    slots = std::max(slots, 2 * shape.sm_count * shape.balanced_per_sm[id]);
  }
  return slots;
}

KernelId kernel_id(bool fp8, const AttentionTuning& tuning) {
  if (fp8) return kFp8Kernel;
  return tuning.split_p ? kBf16SplitP : kBf16SingleP;
}

bool cluster_usable(const DeviceShape& shape, KernelId id, int tiles, int splits,
                    bool deep = false) {
  if (splits <= 1 || splits > kMaxClusterSplits || (splits & (splits - 1)) != 0) return false;
  int log2 = 0;
  while ((1 << log2) < splits) ++log2;
  return shape.cluster_ok[id][tile_variant(tiles, deep)][log2];
}

// Rows per CTA for these shapes (q_len 0: prefill rows, never grouped): 4 or 2, whichever leaves
// fewer dead tiles in the request's last group (4 on a tie), so q_len 5 or 6 do not end in a
// group of one or two busy warps and three or two idle ones.
int choose_row_tiles(int64_t q_len, int topk, bool dense, int max_tiles) {
  if (q_len <= 1 || max_tiles < 2) return 1;
  if (!dense && topk > attention::kMaxGroupedTopk) return 1;
  if (max_tiles < 4 || q_len == 2) return 2;
  const int64_t dead4 = (4 - q_len % 4) % 4;
  const int64_t dead2 = q_len % 2;
  return dead4 <= dead2 ? 4 : 2;
}

template <bool kFp8, bool kSplitP, int kTiles, bool kDeep = false>
void launch_kernel(const AttentionParams& p, unsigned ctas, bool pdl, cudaStream_t stream) {
  using L = attention::KvLayout<kFp8, kTiles, kDeep>;
  auto kernel = attention::attention_sparse_kernel<kFp8, kSplitP, kTiles, kDeep>;
  const size_t smem = L::kSmemBytes;
  if (!p.cluster_merge && !pdl) {
    kernel<<<dim3(ctas), L::kThreads, smem, stream>>>(p);
    CUDA_CHECK_LAUNCH();
    return;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(L::kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[2]{};
  unsigned count = 0;
  if (p.cluster_merge) {
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count].val.clusterDim.x = static_cast<unsigned>(p.num_splits);
    attrs[count].val.clusterDim.y = 1;
    attrs[count].val.clusterDim.z = 1;
    ++count;
  }
  if (pdl) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  cfg.attrs = attrs;
  cfg.numAttrs = count;
  CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, p));
}

template <bool kFp8, bool kSplitP>
void launch_balanced(const AttentionParams& p, unsigned ctas, bool pdl, cudaStream_t stream) {
  launch_kernel_ex(attention::attention_balanced_kernel<kFp8, kSplitP>, dim3(ctas),
                   dim3(attention::kThreads), balanced_smem_bytes<kFp8>(), stream, pdl, p);
}

template <int kTiles, bool kDeep = false>
void launch_kind(KernelId id, const AttentionParams& p, unsigned ctas, bool pdl,
                 cudaStream_t stream) {
  switch (id) {
    case kFp8Kernel: launch_kernel<true, false, kTiles, kDeep>(p, ctas, pdl, stream); break;
    case kBf16SingleP: launch_kernel<false, false, kTiles, kDeep>(p, ctas, pdl, stream); break;
    default: launch_kernel<false, true, kTiles, kDeep>(p, ctas, pdl, stream); break;
  }
}

// A selection's splits. Default: each split takes >= 2 of the topk blocks (at most
// kMaxSelectionSplits), as many as keep the grid within one CTA per SM, and 2 while two CTAs per
// unit fit in one wave of resident CTAs (one row per CTA: attention_plan_info keeps one split
// from half the SMs up to one CTA per SM). Measured on H200: one block per split and a full wave of
// CTAs (the wave plan) cost up to 4 us at 4-16 rows, where the fixed per-CTA chain and the merge
// of 16 partials outweigh the extra parallelism. A tuning's max_splits (> 0) selects the wave
// plan, capped at that count (splits=16: the wave plan uncapped), for comparisons.
int choose_splits(int64_t units, int topk, bool dense, int sms, int slots, int max_splits) {
  if (units <= 0) return 1;
  if (dense) {
    return static_cast<int>(std::clamp<int64_t>(slots / units, 1, kMaxDenseSplits));
  }
  int splits = 1;
  if (max_splits > 0) {
    const int cap = std::min(topk, max_splits);
    while (splits * 2 <= cap && units * splits * 2 <= slots) splits *= 2;
    return splits;
  }
  const int cap = std::min(kMaxSelectionSplits, std::max(1, topk / 2));
  while (splits * 2 <= cap && units * splits * 2 <= sms) splits *= 2;
  if (splits == 1 && cap >= 2 && units * 2 <= slots) splits = 2;
  return splits;
}

struct WorkspaceLayout {
  size_t partial_o = 0;
  size_t partial_ml = 0;
  size_t counters = 0;
  size_t total = 0;
};

WorkspaceLayout workspace_layout(int slots) {
  WorkspaceLayout layout;
  const size_t s = static_cast<size_t>(slots);
  layout.partial_o = 0;
  layout.partial_ml = align_up(s * attention::kTileHeads * attention::kHeadDim * sizeof(float));
  layout.counters = layout.partial_ml + align_up(s * attention::kTileHeads * 2 * sizeof(float));
  layout.total = layout.counters + align_up(s * sizeof(uint32_t));
  return layout;
}

void check_supported(const SparseConfig& config) {
  M3MSA_CHECK_SUPPORTED(config.head_dim == attention::kHeadDim,
                        "CUDA sparse attention supports head_dim 128, got ", config.head_dim);
  M3MSA_CHECK_SUPPORTED(config.block_size == attention::kBlockTokens,
                        "CUDA sparse attention supports block_size 128, got ", config.block_size);
  M3MSA_CHECK_SUPPORTED(config.group_size() <= attention::kTileHeads,
                        "CUDA sparse attention supports up to 16 query heads per KV head, got ",
                        config.group_size());
}

void check_contiguous(const TensorView& view, const char* name) {
  M3MSA_CHECK_ARG(view.is_contiguous(), name, " must be contiguous, got ", describe(view));
}

}  // namespace

size_t attention_workspace_size(const SparseConfig& config, const PlanLimits& limits) {
  config.validate();
  check_supported(config);
  (void)limits;  // the partials never need more than one wave of CTAs, whatever the batch
  return workspace_layout(max_partial_slots(device_shape())).total;
}

std::string AttentionTuning::name() const {
  return "splitp" + std::to_string(split_p ? 1 : 0) + "-cluster" + std::to_string(max_cluster) +
         "-pdl" + std::to_string(pdl ? 1 : 0) +
         (max_splits > 0 ? "-splits" + std::to_string(max_splits) : std::string()) +
         (max_row_tiles != 1 ? "-rows" + std::to_string(max_row_tiles) : std::string()) +
         (early_prologue ? "-early" : "") +
         (balance != 1 ? "-balance" + std::to_string(balance) : std::string()) +
         (deep >= 0 ? "-deep" + std::to_string(deep) : std::string());
}

AttentionTuning AttentionTuning::parse(const std::string& text) {
  AttentionTuning t;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find(',', at);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(at, end - at);
    const size_t eq = item.find('=');
    M3MSA_CHECK_ARG(eq != std::string::npos, "attention tuning '", text, "': item '", item,
                    "' is not key=value");
    const std::string key = item.substr(0, eq);
    const std::string digits = item.substr(eq + 1);
    int value = 0;
    const auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
    M3MSA_CHECK_ARG(!digits.empty() && ec == std::errc() && ptr == digits.data() + digits.size(),
                    "attention tuning '", text, "': ", key, " takes an integer, got '", digits,
                    "'");
    // A switch is 0 or 1.
    auto flag = [&] {
      M3MSA_CHECK_ARG(value == 0 || value == 1, "attention tuning '", text, "': ", key,
                      " must be 0 or 1, got ", value);
      return value == 1;
    };
    if (key == "splitp") {
      t.split_p = flag();
    } else if (key == "cluster") {
      M3MSA_CHECK_ARG(value >= 0, "attention tuning '", text, "': cluster must be >= 0, got ",
                      value);
      t.max_cluster = value;
    } else if (key == "pdl") {
      t.pdl = flag();
    } else if (key == "splits") {
      M3MSA_CHECK_ARG(value >= 0, "attention tuning '", text, "': splits must be >= 0, got ",
                      value);
      t.max_splits = value;
    } else if (key == "rows") {
      M3MSA_CHECK_ARG(value == 1 || value == 2 || value == 4, "attention tuning '", text,
                      "': rows must be 1, 2 or 4, got ", value);
      t.max_row_tiles = value;
    } else if (key == "early") {
      t.early_prologue = flag();
    } else if (key == "deep") {
      M3MSA_CHECK_ARG(value >= -1 && value <= 1, "attention tuning '", text,
                      "': deep must be -1 (the plan's rule), 0 or 1, got ", value);
      t.deep = value;
    } else if (key == "balance") {
      M3MSA_CHECK_ARG(value >= 0 && value <= 2, "attention tuning '", text,
                      "': balance must be 0, 1 or 2, got ", value);
      t.balance = value;
    } else {
      M3MSA_THROW(ErrorCode::kInvalidArgument, "attention tuning '", text, "': unknown key '", key,
                  "' (splitp, cluster, pdl, splits, rows, early, balance, deep)");
    }
    at = end + 1;
  }
  return t;
}

AttentionTuning default_attention_tuning() {
  return AttentionTuning{};
}

AttentionTuning attention_tuning_after_indexer(int64_t rows) {
  AttentionTuning t = default_attention_tuning();
  if (rows == 1) {
    t.pdl = true;
    t.early_prologue = true;
  }
  return t;
}

AttentionPlanInfo attention_plan_info(const SparseConfig& config, int64_t rows, int64_t q_len,
                                      bool dense, bool fp8_kv, const AttentionTuning& tuning) {
  const DeviceShape& shape = device_shape();
  const KernelId id = kernel_id(fp8_kv, tuning);
  AttentionPlanInfo info;
  info.row_tiles = choose_row_tiles(q_len, config.topk, dense, tuning.max_row_tiles);
  int64_t groups = rows;
  if (info.row_tiles > 1) {
    info.groups_per_req = static_cast<int>((q_len + info.row_tiles - 1) / info.row_tiles);
    groups = rows / q_len * info.groups_per_req;
  }
  const int64_t units = groups * config.kv_heads;
  // Between half a wave of one CTA per SM and one per SM (a selection, one row per CTA), one CTA
  // per unit: two splits per unit would put two CTAs on some SMs, which then take twice as long
  // as the rest; where the units leave SMs idle (up to 2/3 of them fp8, 3/5 bf16), the deep
  // pipeline, whose lone CTA keeps more bytes in flight. Measured on an H100 at 72-132 units of
  // 16 blocks (128K): one split 3-15 % faster than two clustered ones from ~80 units; the deep
  // pipeline 5-12 % faster than both at 72-88 units fp8 and 72 bf16, 2-5 % slower than one split
  // beyond (docs/benchmarks.md, "One CTA per unit up to one per SM").
  const int sms = shape.sm_count;
  const bool one_per_sm =
      !dense && tuning.max_splits == 0 && info.row_tiles == 1 && units * 2 > sms && units <= sms;
  const bool deep_rule =
      one_per_sm && (fp8_kv ? units * 3 <= int64_t{2} * sms : units * 5 <= int64_t{3} * sms);
  info.deep = info.row_tiles == 1 && (tuning.deep == 1 || (tuning.deep < 0 && deep_rule));
  const bool deep = info.deep;
  info.slots = resident_slots(shape, id, info.row_tiles, deep);
  info.splits =
      choose_splits(units, config.topk, dense, shape.sm_count, info.slots, tuning.max_splits);
  if (one_per_sm && tuning.deep != 1) info.splits = 1;
  // More units than one wave of resident CTAs, up to 4/3 of it: one wave, each CTA an equal share
  // of the units' blocks, so no CTA waits for a mostly empty last wave (300 units x 16 blocks on
  // 264 slots: 18-19 blocks each where whole units take two rounds of 16 and clustered halves
  // three of 8). Measured on an H100 against two clustered splits: -6 to -10 % at 1.09 waves, -2 %
  // at 1.29; against whole units: +1.2 % at 1.52, +2.6 % at 1.64 (a fuller last wave's CTAs run
  // faster; the balanced shares pay the cut units' merges). balance 2 takes it at any count beyond
  // one wave, for comparisons.
  const int balanced_slots = shape.sm_count * shape.balanced_per_sm[id];
  if (!dense && !deep && tuning.balance >= 1 && tuning.max_splits == 0 && info.row_tiles == 1 &&
      balanced_slots > 0 && units > info.slots && units > balanced_slots &&
      (tuning.balance == 2 || 3 * units <= int64_t{4} * info.slots)) {
    info.balanced = true;
    info.ctas = balanced_slots;  // fewer CTAs than units: a unit has at most two parts
    return info;
  }
  // More units than one wave of resident CTAs with the second wave at most a third full (300
  // units on 264 slots): two splits per unit in clusters of two, so the grid ends in fuller waves.
  // Measured on an H100: 4-7 % faster at 1.1-1.3 waves of units, 2.4 % slower at 1.45 (bf16, 96
  // requests). Only the cluster merge: the workspace holds one wave of partials.
  if (!dense && tuning.max_splits == 0 && info.splits == 1 && info.row_tiles == 1 &&
      config.topk >= 4 && tuning.max_cluster >= 2 && cluster_usable(shape, id, 1, 2, deep) &&
      units > info.slots && 3 * units <= int64_t{4} * info.slots) {
    info.splits = 2;
  }
  // Clusters of more than two CTAs only where the grid fills at most half the SMs: on an H100,
  // 8 and 16 CTA clusters beat the workspace merge at 32-64 CTAs (1 request / 128K: 11.1 and
  // 11.8 vs 12.9 us) and lost at 128 (4 requests: 16.1 vs 15.5 us; 32 requests at TP 4: 21.7 vs
  // 20.4 us), where the clusters no longer find their SMs free together.
  const int64_t few_ctas = shape.sm_count / 2;
  if (!dense && tuning.max_splits == 0) {
    // Few units: more splits (down to one block each), all of a unit's splits in one cluster.
    for (int c = std::min(kMaxClusterSplits, tuning.max_cluster); c > info.splits; c /= 2) {
      if (c <= config.topk && units * c <= few_ctas &&
          cluster_usable(shape, id, info.row_tiles, c, deep)) {
        info.splits = c;
        break;
      }
    }
  }
  info.cluster = info.splits <= tuning.max_cluster &&
                 (info.splits <= 2 || units * info.splits <= few_ctas) &&
                 cluster_usable(shape, id, info.row_tiles, info.splits, deep);
  info.ctas = units * info.splits;
  return info;
}

void launch_attention(const SparseConfig& config, const AttentionArgs& args, void* workspace,
                      size_t workspace_bytes, cudaStream_t stream) {
  launch_attention_tuned(config, args, workspace, workspace_bytes, stream,
                         default_attention_tuning());
}

void launch_attention_tuned(const SparseConfig& config, const AttentionArgs& args, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream,
                            const AttentionTuning& tuning) {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  validate(config, args, Device::cuda(device));
  check_kv_cache_cuda(args.kv_cache, "kv_cache");
  check_supported(config);
  check_contiguous(args.q, "q");
  check_contiguous(args.out, "out");
  check_contiguous(args.batch.kv_block_table, "batch.kv_block_table");
  const bool dense = !args.topk_idx.defined();
  const bool fp8 = args.kv_cache.dtype() == DType::kFP8E4M3;

  const int64_t rows = args.batch.num_rows();
  if (rows == 0) return;

  AttentionParams p;
  p.q = static_cast<const uint16_t*>(args.q.data);
  const TensorView keys = args.kv_cache.keys();
  const TensorView values = args.kv_cache.values();
  p.k_cache = keys.data;
  p.v_cache = values.data;
  p.k_page_stride = keys.strides[0];
  p.k_head_stride = keys.strides[1];
  p.k_token_stride = keys.strides[2];
  p.v_page_stride = values.strides[0];
  p.v_head_stride = values.strides[1];
  p.v_token_stride = values.strides[2];
  p.topk_idx = dense ? nullptr : static_cast<const int32_t*>(args.topk_idx.data);
  p.topk_row_stride = dense ? 0 : args.topk_idx.strides[0];
  p.topk_head_stride = dense ? 0 : args.topk_idx.strides[1];
  p.kv_block_table = static_cast<const int32_t*>(args.batch.kv_block_table.data);
  p.out = static_cast<uint16_t*>(args.out.data);
  p.rows_layout.is_prefill = args.batch.kind == BatchKind::kPrefill ? 1 : 0;
  p.rows_layout.num_reqs = args.batch.num_reqs;
  p.rows_layout.q_len = args.batch.q_len;
  p.rows_layout.seq_lens = static_cast<const int32_t*>(args.batch.seq_lens.data);
  p.rows_layout.cu_seqlens_q = static_cast<const int32_t*>(args.batch.cu_seqlens_q.data);
  p.rows_layout.context_lens = static_cast<const int32_t*>(args.batch.context_lens.data);
  p.num_rows = rows;
  p.num_pages = args.kv_cache.pages();
  p.table_cols = args.batch.kv_block_table.shape[1];
  p.q_heads = config.q_heads;
  p.kv_heads = config.kv_heads;
  p.group = config.group_size();
  p.topk = config.topk;
  const float k_scale = fp8 ? args.kv_cache.k_scale : 1.0f;
  p.scale_log2 = static_cast<float>(static_cast<double>(config.softmax_scale()) * k_scale *
                                    1.4426950408889634);
  p.v_scale = fp8 ? args.kv_cache.v_scale : 1.0f;
  p.softmax_scale = config.softmax_scale();
  p.early_prologue = tuning.pdl && tuning.early_prologue ? 1 : 0;
  if (fp8) {
    p.k_scale_ptr = static_cast<const float*>(args.kv_cache.k_scale_tensor.data);
    p.v_scale_ptr = static_cast<const float*>(args.kv_cache.v_scale_tensor.data);
  }

  const DeviceShape& shape = device_shape();
  const KernelId id = kernel_id(fp8, tuning);
  const bool prefill = args.batch.kind == BatchKind::kPrefill;
  const AttentionPlanInfo plan =
      attention_plan_info(config, rows, prefill ? 0 : args.batch.q_len, dense, fp8, tuning);
  p.groups_per_req = plan.groups_per_req;
  p.num_splits = plan.splits;
  p.cluster_merge = plan.cluster ? 1 : 0;
  const int64_t ctas = plan.ctas;
  narrow_int(ctas, "sparse attention grid (rows * kv_heads * splits)");
  if (plan.balanced || (p.num_splits > 1 && !p.cluster_merge)) {
    const WorkspaceLayout layout = workspace_layout(max_partial_slots(shape));
    M3MSA_CHECK_ARG(workspace != nullptr && workspace_bytes >= layout.total,
                    "sparse attention workspace: need ", layout.total, " bytes, got ",
                    workspace_bytes, (workspace == nullptr ? " (null)" : ""));
    auto* base = static_cast<uint8_t*>(workspace);
    p.partial_o = reinterpret_cast<float*>(base + layout.partial_o);
    p.partial_ml = reinterpret_cast<float*>(base + layout.partial_ml);
    p.counters = reinterpret_cast<uint32_t*>(base + layout.counters);
  }

  p.timeline = timeline::records_for("attention", timeline::names(kAttentionMarks), ctas,
                                     timeline::names(kAttentionKinds));

  const auto grid = static_cast<unsigned>(ctas);
  if (plan.balanced) {
    switch (id) {
      case kFp8Kernel: launch_balanced<true, false>(p, grid, tuning.pdl, stream); break;
      case kBf16SingleP: launch_balanced<false, false>(p, grid, tuning.pdl, stream); break;
      default: launch_balanced<false, true>(p, grid, tuning.pdl, stream); break;
    }
    return;
  }
  switch (plan.row_tiles) {
    case 4: launch_kind<4>(id, p, grid, tuning.pdl, stream); break;
    case 2: launch_kind<2>(id, p, grid, tuning.pdl, stream); break;
    default:
      if (plan.deep) {
        launch_kind<1, true>(id, p, grid, tuning.pdl, stream);
      } else {
        launch_kind<1>(id, p, grid, tuning.pdl, stream);
      }
      break;
  }
}

}  // namespace m3msa::cuda
