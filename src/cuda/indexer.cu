// Host launchers of the indexer kernels (indexer_kernel.cuh): planning, validation and dispatch.
#include "cuda/indexer.h"

#include <algorithm>
#include <cub/block/block_scan.cuh>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "cuda/common.cuh"
#include "cuda/indexer_kernel.cuh"
#include "cuda/indexer_params.h"
#include "cuda/timeline.h"
#include "m3msa/error.h"

namespace m3msa::cuda {

namespace indexer {

// ---------------------------------------------------------------------------------------------
// Unfused baseline, second kernel: one warp per (row, head) selects from the score tensor.
// Grid: ceil(rows * H / 8) CTAs of 256 threads. Decode only.
__global__ void __launch_bounds__(kThreads)
    indexer_topk_kernel(const __grid_constant__ IndexerParams p) {
  __shared__ __align__(16) uint64_t s_scratch[kWarps][kScratch];
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (item >= p.num_rows * p.heads) return;
  const int64_t row = item / p.heads;
  const int req = static_cast<int>(row / p.q_len);
  const int j = static_cast<int>(row % p.q_len);
  const int seq_len = p.seq_lens[req];
  const int pos = seq_len > 0 ? seq_len - p.q_len + j : -1;
  int blocks = row_blocks(pos);
  if (blocks > p.score_cols || blocks > p.table_cols) blocks = 0;  // flagged by the scorer
  const float* scores = p.scores + item * p.score_cols;
  auto get = [&](int b) -> uint64_t {
    const uint32_t block = static_cast<uint32_t>(b);
    return is_forced_block(b, blocks, p.init_blocks, p.local_blocks) ? forced_key(block)
                                                                     : scored_key(scores[b], block);
  };
  const uint64_t top = warp_top_keys(get, blocks, p.topk, &s_scratch[warp][0]);
  int32_t* out = answer_row(p, row, static_cast<int>(item % p.heads));
  write_key_answer(p, out, top);
}

// ---------------------------------------------------------------------------------------------
// Prefill preparation: split each request's rows into units of <= kPrefillUnitRows.
// Grid: 1 CTA of 1024 threads.
__global__ void __launch_bounds__(1024)
    indexer_prefill_units_kernel(const __grid_constant__ IndexerParams p) {
  __shared__ typename cub::BlockScan<int, 1024>::TempStorage s_scan;
  const int tid = static_cast<int>(threadIdx.x);
  const int per = (p.num_reqs + 1023) / 1024;
  const int r_begin = min(p.num_reqs, tid * per);
  const int r_end = min(p.num_reqs, r_begin + per);
  auto groups = [&](int r) {
    const int len = max(0, p.cu_seqlens_q[r + 1] - p.cu_seqlens_q[r]);
    return (len + kPrefillUnitRows - 1) / kPrefillUnitRows;
  };
  int local = 0;
  for (int r = r_begin; r < r_end; ++r) local += groups(r);
  int unit = 0;
  cub::BlockScan<int, 1024>(s_scan).ExclusiveSum(local, unit);
  for (int r = r_begin; r < r_end; ++r) {
    const int first = p.cu_seqlens_q[r];
    const int len = max(0, p.cu_seqlens_q[r + 1] - first);
    const int context = p.context_lens[r];
    for (int i = 0; i < len; i += kPrefillUnitRows, ++unit) {
      if (unit < p.max_units) {
        p.units[unit] = make_int4(r, first + i, min(kPrefillUnitRows, len - i), context + i);
      }
    }
  }
  if (tid == 1023) {
    if (unit > p.max_units) atomicOr(p.status, kStatusTooManyUnits);
    *p.num_units = min(unit, p.max_units);
  }
}

// ---------------------------------------------------------------------------------------------
// The split kernel's merge as a kernel of its own (IndexerVariant::kSplitMerge)
//
// Purpose: the exact top k of each query vector from the split kernel's candidates, every vector
// on its own CTA instead of the request's last CTA taking them one after another, and no arrival
// round trip. Launched programmatically dependent on the split kernel (which releases it at its
// start), so the CTAs are resident and wait in griddepcontrol.wait until the candidates are
// visible. Beyond kFewCandidates candidates the whole CTA merges by histogram
// (merge_by_histogram); where a bin holds too many keys (ties), each warp takes the top k of an
// eighth of the vector's candidates (warp_top_keys) and warp 0 the top k of those 8 x k. The keys
// are unique, so every path gives the in-kernel merge's answer.
// Grid: (unit_vectors, num_reqs); 256 threads. Requests the split kernel answered itself (dead,
// or all blocks on one CTA) are skipped.
__global__ void __launch_bounds__(kThreads, 2)
    indexer_split_merge_kernel(const __grid_constant__ IndexerParams p) {
  __shared__ __align__(16) uint64_t s_scratch[kWarps][kScratch];
  __shared__ uint64_t s_top[kWarps][kMaxTopk];
  enum { kStart, kSplitDone, kEnd };  // timeline marks (kIndexerMergeMarks)
  timeline::mark(p.timeline, kStart);
  const timeline::MarkOnExit end_mark{p.timeline, kEnd};
  // The request's shape before the wait: seq_lens are inputs, complete before the split kernel
  // (an ordinary launch) started, so only the candidates wait for it.
  const int n = static_cast<int>(blockIdx.x);
  const int r = static_cast<int>(blockIdx.y);
  const Unit unit = load_unit(p, r);
  const int nvec = unit.rows * p.heads;
  if (n >= nvec || unit.blocks == 0) return;
  const int splits = p.split_ctas;
  const int per = max(p.min_blocks_per_cta, (unit.blocks + splits - 1) / splits);
  const int active = (unit.blocks + per - 1) / per;
  if (active == 1) return;
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  // A dependent (an attention launched with pdl) is released once the split kernel is done, so
  // its CTAs start their prologue during this merge; released earlier, they would take SMs the
  // split kernel's CTAs still need. (CTAs that return above release it by exiting.)
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
  timeline::mark(p.timeline, kSplitDone);
  const int k = p.topk;
  const int count = active * min(k, per);
  const int64_t vec_stride = static_cast<int64_t>(splits) * k;
  const uint64_t* src = p.cand + static_cast<int64_t>(r) * p.unit_vectors * vec_stride +
                        static_cast<int64_t>(n) * vec_stride;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int lane = static_cast<int>(lane_id());
  if (count <= kFewCandidates) {  // a short context: one warp, one round trip
    if (warp == 0)
      write_top_of_few(p, src, count, answer_row(p, unit.row0 + n / p.heads, n % p.heads));
    return;
  }
  int32_t* out = answer_row(p, unit.row0 + n / p.heads, n % p.heads);
  static_assert(kHistSmemBytes <= sizeof(s_scratch), "the histogram merge fits the scratch");
  if (merge_by_histogram(p, src, count, reinterpret_cast<uint8_t*>(&s_scratch[0][0]), out)) {
    return;
  }
  __syncthreads();  // the scratch is the filtered path's again
  const int chunk = (count + kWarps - 1) / kWarps;
  const int lo = min(count, warp * chunk);
  const int hi = min(count, lo + chunk);
  const uint64_t mine =
      warp_top_keys([&](int j) { return __ldcg(src + lo + j); }, hi - lo, k, &s_scratch[warp][0]);
  if (lane < k) s_top[warp][lane] = mine;
  __syncthreads();
  if (warp != 0) return;
  const uint64_t top =
      warp_top_keys([&](int j) { return s_top[j / k][j % k]; }, kWarps * k, k, &s_scratch[0][0]);
  write_key_answer(p, out, top);
}

}  // namespace indexer

namespace {

// The kernel of one operand pair: a bf16 or fp8 cache against a bf16 index_q, or an fp8 cache
// against an fp8 index_q (q8, on the FP8 tensor cores).
template <int kMode, int kNT>
IndexerKernel scoring_kernel_of(bool fp8, bool q8) {
  if (q8) return indexer::indexer_span_kernel<true, kNT, kMode, true>;
  return fp8 ? indexer::indexer_span_kernel<true, kNT, kMode>
             : indexer::indexer_span_kernel<false, kNT, kMode>;
}

template <int kMode>
IndexerKernel scoring_kernel(bool fp8, bool q8, int n_tiles) {
  switch (n_tiles) {
    case 1: return scoring_kernel_of<kMode, 1>(fp8, q8);
    case 2: return scoring_kernel_of<kMode, 2>(fp8, q8);
    case 4: return scoring_kernel_of<kMode, 4>(fp8, q8);
    default: M3MSA_THROW(ErrorCode::kInternal, "indexer: no kernel for ", n_tiles, " n-tiles");
  }
}

template <int kNT>
IndexerKernel split_kernel_of(bool fp8, bool q8) {
  if (q8) return indexer::indexer_split_kernel<true, kNT, true>;
  return fp8 ? indexer::indexer_split_kernel<true, kNT> : indexer::indexer_split_kernel<false, kNT>;
}

// The merge of IndexerVariant::kSplitMerge, programmatically dependent on the split kernel just
// queued on `stream` (its CTAs may start early and wait for the candidates on the device).
void launch_split_merge(IndexerParams p, int num_reqs, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.unit_vectors), static_cast<unsigned>(num_reqs));
  p.timeline = timeline::records_for("indexer merge", timeline::names(kIndexerMergeMarks),
                                     int64_t{grid.x} * grid.y);
  launch_kernel_ex(indexer::indexer_split_merge_kernel, grid, dim3(indexer::kThreads), 0, stream,
                   /*pdl=*/true, p);
}

// Under kFused, whether the split kernel's merge runs as a kernel of its own. The last CTA merges
// its request's query vectors a few at a time; the merge kernel gives every vector a CTA and merges
// it by histogram, which costs a launch but no arrival round trip. Measured with bench indexer
// --split-merge on H100 (docs/benchmarks.md): up to 32 requests the merge kernel is as fast or
// faster at every context, q_len and dtype (1 request / 128K: 17.4 vs 20.6 us bf16; 32 requests /
// 32K / q_len 4 fp8: 62.1 vs 68.6 us); at 128 requests the last CTA is as fast or faster (128 /
// 4K / q_len 4 fp8: 36.8 vs 44.3 us), so from there it keeps them (no second launch).
bool prefer_merge_kernel(int64_t num_reqs) {
  return num_reqs <= 32;
}

}  // namespace

IndexerKernel split_indexer_kernel(bool fp8, bool q8, int n_tiles) {
  switch (n_tiles) {
    case 1: return split_kernel_of<1>(fp8, q8);
    case 2: return split_kernel_of<2>(fp8, q8);
    case 4: return split_kernel_of<4>(fp8, q8);
    default:
      M3MSA_THROW(ErrorCode::kInternal, "indexer: no split kernel for ", n_tiles, " n-tiles");
  }
}

IndexerKernel span_indexer_kernel(bool fp8, bool q8, int n_tiles, bool scores_only) {
  return scores_only ? scoring_kernel<indexer::kModeScores>(fp8, q8, n_tiles)
                     : scoring_kernel<indexer::kModeTopk>(fp8, q8, n_tiles);
}

namespace {

// n8 tiles for `vectors` query vectors (1, 2 or 4).
int n_tiles_for(int vectors) {
  const int tiles = (vectors + 7) / 8;
  return tiles <= 1 ? 1 : tiles <= 2 ? 2 : 4;
}

std::size_t align_up(std::size_t value, std::size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// The dynamic shared-memory limit set on the scoring kernels of each device. Plans of different
// sizes coexist (and run on any stream), so the attribute is only ever raised, never lowered.
std::mutex g_smem_mutex;
std::map<int, std::size_t> g_smem_limit;

}  // namespace

// The units' prefix sums (the kernels' only dynamic shared memory).
std::size_t span_indexer_smem_bytes(int max_units) {
  return static_cast<std::size_t>(max_units + 1) * sizeof(int32_t);
}

void raise_indexer_smem_limit(int device, std::size_t smem) {
  std::lock_guard<std::mutex> lock(g_smem_mutex);
  std::size_t& limit = g_smem_limit[device];
  if (smem <= limit) return;
  for (auto [fp8, q8] : {std::pair{false, false}, {true, false}, {true, true}}) {
    for (int tiles : {1, 2, 4}) {
      for (bool scores_only : {false, true}) {
        CUDA_CHECK(cudaFuncSetAttribute(span_indexer_kernel(fp8, q8, tiles, scores_only),
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
      }
      if (limit == 0) {  // the split kernel's ring is fixed: set once per device
        CUDA_CHECK(cudaFuncSetAttribute(split_indexer_kernel(fp8, q8, tiles),
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        indexer::kSplitRingBytes));
      }
    }
  }
  limit = smem;
}

void check_indexer_supported(const SparseConfig& config) {
  M3MSA_CHECK_SUPPORTED(config.index_dim == indexer::kDim,
                        "CUDA indexer: config.index_dim must be ", indexer::kDim, ", got ",
                        config.index_dim);
  M3MSA_CHECK_SUPPORTED(config.block_size == indexer::kBlockTokens,
                        "CUDA indexer: config.block_size must be ", indexer::kBlockTokens, ", got ",
                        config.block_size);
  M3MSA_CHECK_SUPPORTED(config.topk <= indexer::kMaxTopk,
                        "CUDA indexer: config.topk must be <= ", indexer::kMaxTopk, ", got ",
                        config.topk);
  M3MSA_CHECK_SUPPORTED(config.index_heads <= indexer::kMaxVectors,
                        "CUDA indexer: config.index_heads must be <= ", indexer::kMaxVectors,
                        ", got ", config.index_heads);
}

IndexerPlan plan_indexer(const SparseConfig& config, const PlanLimits& limits, int device) {
  config.validate();
  check_indexer_supported(config);
  M3MSA_CHECK_ARG(limits.max_reqs >= 1, "limits.max_reqs must be >= 1, got ", limits.max_reqs);
  M3MSA_CHECK_ARG(limits.max_q_len >= 1 && limits.max_q_len <= kMaxQueryLen,
                  "limits.max_q_len must be in [1, ", kMaxQueryLen, "], got ", limits.max_q_len);
  M3MSA_CHECK_ARG(limits.max_rows >= 0, "limits.max_rows must be >= 0, got ", limits.max_rows);
  M3MSA_CHECK_ARG(limits.max_context >= 0, "limits.max_context must be >= 0, got ",
                  limits.max_context);
  const int H = config.index_heads;
  M3MSA_CHECK_SUPPORTED(limits.max_q_len * H <= indexer::kMaxVectors,
                        "CUDA indexer: limits.max_q_len (", limits.max_q_len, ") * index_heads (",
                        H, ") must be <= ", indexer::kMaxVectors);

  IndexerPlan plan;
  plan.config = config;
  plan.limits = limits;
  plan.device = device;
  const int64_t decode_max_rows = int64_t{limits.max_reqs} * limits.max_q_len;
  if (plan.limits.max_rows == 0) plan.limits.max_rows = decode_max_rows;
  // Prefill capacity (row groups of 8) costs little, so every plan has it where supported.
  const bool prefill = H * indexer::kPrefillUnitRows <= indexer::kMaxVectors;
  const int64_t max_units =
      int64_t{limits.max_reqs} +
      (plan.limits.max_rows + indexer::kPrefillUnitRows - 1) / indexer::kPrefillUnitRows;
  plan.max_units = narrow_int(max_units, "indexer plan: units (max_reqs + max_rows / 8)");
  plan.unit_vectors =
      H * (prefill ? std::max(limits.max_q_len, indexer::kPrefillUnitRows) : limits.max_q_len);
  plan.unit_vectors = std::min(plan.unit_vectors, indexer::kMaxVectors);

  DeviceGuard guard(device);
  int sm_count = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  plan.grid = 2 * sm_count;

  const std::size_t smem = span_indexer_smem_bytes(plan.max_units);
  int smem_optin = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  M3MSA_CHECK_SUPPORTED(smem + 28 * 1024 <= static_cast<std::size_t>(smem_optin),
                        "CUDA indexer: ", plan.max_units,
                        " units (limits.max_reqs + max_rows / 8) need more shared memory than "
                        "the device has");
  raise_indexer_smem_limit(device, smem);

  if (limits.max_context > 0) {
    plan.score_cols = (limits.max_context + config.block_size - 1) / config.block_size;
  }
  const int k = config.topk;
  std::size_t offset = 0;
  plan.off_status = offset;
  offset += 16;
  plan.off_num_units = offset;
  offset += 16;
  plan.off_counters = offset;
  offset = align_up(offset + sizeof(uint32_t) * plan.max_units, 16);
  plan.off_units = offset;
  offset = align_up(offset + sizeof(int4) * (prefill ? plan.max_units : 0), 16);
  plan.off_cand = offset;
  offset =
      align_up(offset + sizeof(uint64_t) * (static_cast<std::size_t>(plan.grid) + plan.max_units) *
                            k * plan.unit_vectors,
               16);
  plan.off_scores = offset;
  offset = align_up(
      offset + sizeof(float) * static_cast<std::size_t>(plan.limits.max_rows) * H * plan.score_cols,
      256);
  plan.workspace_bytes = offset;
  return plan;
}

void init_indexer_workspace(const IndexerPlan& plan, void* workspace, cudaStream_t stream) {
  M3MSA_CHECK_ARG(workspace != nullptr, "indexer workspace is null");
  DeviceGuard guard(plan.device);
  // Status, unit count and counters are contiguous at the front.
  CUDA_CHECK(cudaMemsetAsync(workspace, 0, plan.off_units, stream));
}

bool indexer_fits_plan(const IndexerPlan& plan, const SparseConfig& config, const IndexerArgs& args,
                       IndexerVariant variant, std::string* why) {
  auto fail = [&](const std::string& reason) {
    if (why) *why = reason;
    return false;
  };
  const BatchMeta& batch = args.batch;
  if (config.index_heads != plan.config.index_heads || config.topk != plan.config.topk) {
    return fail("the config's index_heads / topk differ from the plan's");
  }
  if (batch.num_reqs > plan.limits.max_reqs) {
    return fail("batch.num_reqs = " + std::to_string(batch.num_reqs) +
                " > limits.max_reqs = " + std::to_string(plan.limits.max_reqs));
  }
  if (batch.num_rows() > plan.limits.max_rows) {
    return fail("batch rows = " + std::to_string(batch.num_rows()) +
                " > limits.max_rows = " + std::to_string(plan.limits.max_rows));
  }
  if (batch.kind == BatchKind::kDecode) {
    if (batch.q_len * config.index_heads > plan.unit_vectors) {
      return fail("batch.q_len = " + std::to_string(batch.q_len) +
                  " > limits.max_q_len = " + std::to_string(plan.limits.max_q_len));
    }
  } else {
    if (config.index_heads * indexer::kPrefillUnitRows > plan.unit_vectors ||
        plan.off_cand == plan.off_units) {
      return fail("prefill needs index_heads <= 4 (row groups of 8 rows)");
    }
  }
  if (variant == IndexerVariant::kUnfused) {
    if (batch.kind != BatchKind::kDecode) return fail("the unfused baseline is decode only");
    if (plan.score_cols == 0) return fail("the unfused baseline needs limits.max_context > 0");
    if (batch.index_block_table.defined() && batch.index_block_table.shape[1] > plan.score_cols) {
      return fail("batch.index_block_table has more columns than limits.max_context allows");
    }
  }
  return true;
}

void check_indexer_args_supported(const IndexerArgs& args) {
  check_index_cache_cuda(args.index_cache, "index_cache");
}

void launch_indexer(const IndexerPlan& plan, const SparseConfig& config, const IndexerArgs& args,
                    IndexerVariant variant, void* workspace, cudaStream_t stream) {
  check_indexer_supported(config);
  const Device device = Device::cuda(plan.device);
  validate(config, args, device);
  check_indexer_args_supported(args);
  const BatchMeta& batch = args.batch;
  M3MSA_CHECK_ARG(batch.index_block_table.defined(), "batch.index_block_table is required");
  if (batch.kind == BatchKind::kDecode) {
    M3MSA_CHECK_SUPPORTED(batch.q_len * config.index_heads <= indexer::kMaxVectors,
                          "CUDA indexer: batch.q_len (", batch.q_len, ") * index_heads (",
                          config.index_heads, ") must be <= ", indexer::kMaxVectors);
  } else {
    M3MSA_CHECK_SUPPORTED(config.index_heads * indexer::kPrefillUnitRows <= indexer::kMaxVectors,
                          "CUDA prefill indexer: index_heads must be <= ",
                          indexer::kMaxVectors / indexer::kPrefillUnitRows, ", got ",
                          config.index_heads);
  }
  // 16-byte vector loads and cp.async need 16-byte aligned rows (the cache's: above).
  M3MSA_CHECK_ARG(reinterpret_cast<uintptr_t>(args.index_q.data) % 16 == 0,
                  "index_q: the CUDA indexer needs 16-byte aligned data, got address ",
                  args.index_q.data);
  std::string why;
  M3MSA_CHECK_ARG(indexer_fits_plan(plan, config, args, variant, &why),
                  "indexer call outside its plan: ", why);
  M3MSA_CHECK_ARG(workspace != nullptr, "indexer workspace is null");
  const int64_t rows = batch.num_rows();
  if (batch.num_reqs == 0 || rows == 0) return;

  IndexerParams p;
  p.index_q = args.index_q.data;
  p.index_cache = args.index_cache.data.data;
  p.block_table = batch.index_block_table.ptr<const int32_t>();
  p.topk_idx = args.topk_idx.ptr<int32_t>();
  const bool head_major = args.selection.major == SelectionMajor::kHeadMajor;
  p.out_row_stride = args.topk_idx.strides[head_major ? 1 : 0];
  p.out_head_stride = args.topk_idx.strides[head_major ? 0 : 1];
  p.out_ascending = args.selection.order == SelectionOrder::kAscendingBlock ? 1 : 0;
  auto* ws = static_cast<uint8_t*>(workspace);
  p.status = reinterpret_cast<uint32_t*>(ws + plan.off_status);
  p.num_units = reinterpret_cast<int32_t*>(ws + plan.off_num_units);
  p.counters = reinterpret_cast<uint32_t*>(ws + plan.off_counters);
  p.units = reinterpret_cast<int4*>(ws + plan.off_units);
  p.cand = reinterpret_cast<uint64_t*>(ws + plan.off_cand);
  p.scores = reinterpret_cast<float*>(ws + plan.off_scores);
  p.num_pages = args.index_cache.pages();
  p.page_bytes = args.index_cache.data.strides[0] *
                 static_cast<int64_t>(dtype_size(args.index_cache.data.dtype));
  M3MSA_CHECK_ARG(plan.min_blocks_per_cta >= 1,
                  "indexer plan: min_blocks_per_cta must be >= 1, got ", plan.min_blocks_per_cta);
  p.min_blocks_per_cta = plan.min_blocks_per_cta;
  p.table_cols = batch.index_block_table.shape[1];
  p.num_rows = rows;
  p.score_cols = plan.score_cols;
  p.num_reqs = batch.num_reqs;
  p.q_len = batch.kind == BatchKind::kDecode ? batch.q_len : 1;
  p.heads = config.index_heads;
  p.topk = config.topk;
  p.init_blocks = config.init_blocks;
  p.local_blocks = config.local_blocks;
  p.max_units = plan.max_units;
  p.is_prefill = batch.kind == BatchKind::kPrefill ? 1 : 0;
  const bool fp8 = args.index_cache.data.dtype == DType::kFP8E4M3;
  const bool q8 = args.index_q.dtype == DType::kFP8E4M3;  // validate(): only beside an fp8 cache

  DeviceGuard guard(plan.device);
  const std::size_t smem = span_indexer_smem_bytes(plan.max_units);
  if (batch.kind == BatchKind::kDecode) {
    p.seq_lens = batch.seq_lens.ptr<const int32_t>();
    p.unit_vectors = batch.q_len * config.index_heads;
    const int tiles = n_tiles_for(p.unit_vectors);
    const bool unfused = variant == IndexerVariant::kUnfused;
    const bool split = variant == IndexerVariant::kFused ||
                       variant == IndexerVariant::kSplitMerge ||
                       variant == IndexerVariant::kLastCtaMerge;
    if (split && batch.num_reqs <= 65535) {  // grid.y limit
      // Every request gets an equal share of the plan's CTAs (the grid depends on num_reqs and
      // the plan only, so a captured graph replays any lengths); the workspace holds
      // splits * num_reqs <= grid + max_units CTAs' candidates.
      const int splits = std::max(1, plan.grid / batch.num_reqs);
      const bool split_merge =
          variant == IndexerVariant::kSplitMerge ||
          (variant == IndexerVariant::kFused && prefer_merge_kernel(batch.num_reqs));
      // One CTA per request answers by itself: no merge kernel to launch.
      const bool separate_merge = split_merge && splits > 1;
      p.separate_merge = separate_merge ? 1 : 0;
      p.split_ctas = splits;
      const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(batch.num_reqs));
      p.timeline =
          timeline::records_for("indexer split", timeline::names(kIndexerSplitMarks),
                                int64_t{grid.x} * grid.y, timeline::names(kIndexerSplitKinds));
      split_indexer_kernel(fp8, q8,
                           tiles)<<<grid, indexer::kThreads, indexer::kSplitRingBytes, stream>>>(p);
      CUDA_CHECK_LAUNCH();
      p.timeline = nullptr;
      if (separate_merge) launch_split_merge(p, batch.num_reqs, stream);
      return;
    }
    span_indexer_kernel(fp8, q8, tiles, unfused)<<<plan.grid, indexer::kThreads, smem, stream>>>(p);
    CUDA_CHECK_LAUNCH();
    if (unfused) {
      const int64_t items = rows * config.index_heads;
      const int64_t ctas = (items + indexer::kWarps - 1) / indexer::kWarps;
      indexer::indexer_topk_kernel<<<narrow_int(ctas, "unfused top-k CTAs"), indexer::kThreads, 0,
                                     stream>>>(p);
      CUDA_CHECK_LAUNCH();
    }
  } else {
    p.cu_seqlens_q = batch.cu_seqlens_q.ptr<const int32_t>();
    p.context_lens = batch.context_lens.ptr<const int32_t>();
    p.unit_vectors = indexer::kPrefillUnitRows * config.index_heads;
    indexer::indexer_prefill_units_kernel<<<1, 1024, 0, stream>>>(p);
    CUDA_CHECK_LAUNCH();
    const int tiles = n_tiles_for(p.unit_vectors);
    span_indexer_kernel(fp8, q8, tiles, false)<<<plan.grid, indexer::kThreads, smem, stream>>>(p);
    CUDA_CHECK_LAUNCH();
  }
}

uint32_t read_indexer_status(const IndexerPlan& plan, const void* workspace, cudaStream_t stream,
                             bool clear) {
  DeviceGuard guard(plan.device);
  uint32_t status = 0;
  const auto* ws = static_cast<const uint8_t*>(workspace);
  CUDA_CHECK(cudaMemcpyAsync(&status, ws + plan.off_status, sizeof(status), cudaMemcpyDeviceToHost,
                             stream));
  if (clear) {
    CUDA_CHECK(
        cudaMemsetAsync(const_cast<uint8_t*>(ws) + plan.off_status, 0, sizeof(uint32_t), stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return status;
}

}  // namespace m3msa::cuda
