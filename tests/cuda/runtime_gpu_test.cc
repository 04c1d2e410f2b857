// The CUDA backend of the runtime (runtime.h, src/runtime/gpu_layer.cc) and its kernels
// (src/cuda/gemm.h, norm.h). Every test skips without a GPU (TP = 2 ones without two).
//
// Oracles:
//  - the runtime's kernels against double-precision / CPU references (exact where the maths is
//    the same: the residual add);
//  - forward_layer against the CPU runtime on the same inputs, layer by layer (teacher forcing:
//    both backends get the CPU's input of every layer, so differences do not compound);
//  - StepGraphs replay against the same step run eagerly (bit-for-bit, caches included);
//  - TP = 2 (ranks as threads on two GPUs, NCCL) against TP = 1 on one GPU.
//
// Tolerances (bf16 outputs of O(1)): |gpu - want| <= kAbsTol + kRelTol * |want|.
//  - GPU vs CPU runtime: every fp32 sum runs in another order (the GEMM's tensor-core tree, the
//    norms' block tree, the attention's split merge), so any bf16 rounding along the chain
//    (normed -> qkv -> q/k -> attention -> o -> x2 -> h2 -> MLP) can flip: kRelTol = 2^-5,
//    kAbsTol = 2^-6 (those of the CPU runtime's own double-precision check). Selections follow
//    the near-tie rule of method.md (tolerance 1e-3 of the k-th score, scores from the CPU's
//    index_q); a row whose selection swapped near-tied blocks is excluded from the output check
//    (counted; at most a quarter of the rows may swap), any other difference fails.
//  - TP = 2 vs TP = 1: the projections of q/k/v/index are computed per output column in the same
//    order whatever the column count, so selections must be identical; only the o_proj /
//    mlp_down sums are split across ranks: kRelTol = 2^-6, kAbsTol = 2^-8 (the CPU runtime's TP
//    tolerance). Ranks' outputs are bit-identical to each other.
//  - Caches: slots written by the step within the GPU-vs-CPU tolerance, every other byte exact.
//  - The MLP output (hidden, when MLP weights are bound) is a 2-GEMM function of h2: a one-ulp
//    flip of a bf16 gate/up/act value (from any upstream flip) moves an output element by
//    |w_down * act| ~ 2^-8 * |act| with act up to limit * (limit + 1), so elementwise bounds of
//    O(1) outputs do not apply. It is checked per row by relative L2 error <= 2^-5 (a wrong
//    column, row or scale gives O(1)), and elementwise within kMlpAbsTol to catch single garbage
//    elements and NaN / inf positions.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "cpu/runtime_test_fixture.h"
#include "cuda/common.cuh"
#include "cuda/gemm.h"
#include "cuda/norm.h"
#include "m3msa/backend.h"
#include "m3msa/cp_cuda.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/cuda_backend.h"
#include "m3msa/error.h"
#include "m3msa/runtime.h"
#include "m3msa/sort_key.h"
#include "runtime/runtime_internal.h"

namespace m3msa {
namespace {

#define M3MSA_RUNTIME_REQUIRE_GPUS(n)                                                   \
  do {                                                                                  \
    const int visible_ = ::m3msa::cuda_device_count();                                  \
    if (visible_ < (n)) {                                                               \
      GTEST_SKIP() << "needs " << (n) << " CUDA device(s), " << visible_ << " visible"; \
    }                                                                                   \
  } while (0)

using rt_test::MasterModel;
using rt_test::StepMeta;

constexpr double kAbsTol = 1.0 / 64;
constexpr double kMlpRowL2Tol = 1.0 / 32;
constexpr double kMlpAbsTol = 0.25;
constexpr double kRelTol = 1.0 / 32;
constexpr double kTpAbsTol = 1.0 / 256;
constexpr double kTpRelTol = 1.0 / 64;
constexpr double kTieTolerance = 1e-3;
constexpr int64_t kMaxContext = 2048;

// ---- A model the CUDA kernels run: 128-d heads, blocks of 128 tokens ----

ModelConfig gpu_model(int intermediate = 256) {
  ModelConfig m;
  m.hidden = 512;
  m.num_layers = 3;
  m.first_sparse_layer = 1;
  m.q_heads = 8;
  m.kv_heads = 2;
  m.head_dim = 128;
  m.index_heads = 2;
  m.index_dim = 128;
  m.block_size = 128;
  m.topk = 4;  // of up to 16 blocks: a real selection
  m.init_blocks = 0;
  m.local_blocks = 1;
  m.rope_dim = 64;
  m.rope_theta = 10000.0;
  m.intermediate = intermediate;
  return m;
}

RuntimeConfig gpu_config() {
  RuntimeConfig c;
  c.model = gpu_model();
  c.token_buckets = {1, 2, 4, 8, 16};
  c.query_lens = {1, 2, 4};
  c.max_requests = 16;
  c.max_context = kMaxContext;
  c.threads = 2;
  return c;
}

int64_t max_blocks() {
  return kMaxContext / 128;
}

int64_t num_pages(const RuntimeConfig& c) {
  return int64_t{c.max_requests} * max_blocks() + 3;
}

struct Shape {
  std::vector<int32_t> lens;
  int q_len;
};

// Decode steps: speculative rows with a padding request, plain decode with short and
// block-boundary contexts, 4 rows per request, and a full 16-row step.
std::vector<Shape> default_shapes() {
  return {
      {{700, 1500, 0, 2000}, 2},
      {{702, 1502, 0, 2002}, 2},
      {{703, 1503, 90, 0, 2003, 1024, 129, 128}, 1},
      {{1000, 2040}, 4},
      {{5, 130, 257, 400, 555, 600, 777, 800, 901, 1111, 1200, 1333, 1500, 1600, 1800, 2047}, 1}};
}

struct Scenario {
  RuntimeConfig config;
  MasterModel master;
  std::vector<int32_t> index_perm, kv_perm;
  std::vector<StepMeta> steps;
  std::vector<std::vector<uint16_t>> hidden_in, residual_in;  // per step
};

Scenario make_scenario(uint64_t seed, const std::vector<Shape>& shapes = default_shapes()) {
  Scenario s;
  s.config = gpu_config();
  const ModelConfig& m = s.config.model;
  const int64_t pages = num_pages(s.config);
  s.master = rt_test::make_master(m, pages, seed, /*mlp_on_last_layer=*/true);
  s.index_perm = rt_test::page_permutation(pages, seed + 1);
  s.kv_perm = rt_test::page_permutation(pages, seed + 2);
  rt_test::Rng rng(seed + 3);
  for (const Shape& shape : shapes) {
    s.steps.push_back(rt_test::make_step(shape.lens, shape.q_len, m.block_size, max_blocks(),
                                         s.index_perm, s.kv_perm));
    const std::size_t n = shape.lens.size() * static_cast<std::size_t>(shape.q_len) * m.hidden;
    std::vector<uint16_t> h(n), r(n);
    for (std::size_t i = 0; i < n; ++i) {
      h[i] = float_to_bf16(rng.unit());
      r[i] = float_to_bf16(rng.unit());
    }
    s.hidden_in.push_back(h);
    s.residual_in.push_back(r);
  }
  return s;
}

// ---- Device copies ----

TensorView upload_view(std::vector<DeviceTensor>& keep, const TensorView& host, int device) {
  if (!host.defined()) return {};
  DeviceTensor t(host.dtype, host.sizes(), device);
  if (host.nbytes()) {
    cuda::DeviceGuard guard(device);
    CUDA_CHECK(cudaMemcpy(t.data(), host.data, host.nbytes(), cudaMemcpyHostToDevice));
    // The runtime's streams do not synchronize with the legacy stream: land the copy first.
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  keep.push_back(t);
  return t.view();
}

// One rank's model on a GPU: every tensor of the host RankModel copied (caches included).
struct DeviceModel {
  std::vector<DeviceTensor> storage;
  ModelWeights weights;
};

DeviceModel upload_model(const rt_test::RankModel& host, int device) {
  DeviceModel d;
  auto up = [&](const TensorView& v) { return upload_view(d.storage, v, device); };
  for (const LayerWeights& h : host.weights.layers) {
    d.weights.layers.push_back(map_tensors(h, up));
  }
  return d;
}

template <typename T>
std::vector<T> download(const TensorView& view) {
  // Sized by bytes, so a byte-wise download of a wider dtype gets all of it.
  M3MSA_CHECK_INTERNAL(view.nbytes() % static_cast<int64_t>(sizeof(T)) == 0,
                       "download: ", view.nbytes(), " bytes is not a whole number of elements");
  std::vector<T> out(static_cast<std::size_t>(view.nbytes()) / sizeof(T));
  if (!out.empty()) {
    cuda::DeviceGuard guard(view.device.index);
    CUDA_CHECK(cudaMemcpy(out.data(), view.data, view.nbytes(), cudaMemcpyDeviceToHost));
  }
  return out;
}

template <typename T>
std::vector<T> host_values(const TensorView& view) {
  const T* p = view.ptr<const T>();
  return std::vector<T>(p, p + view.numel());
}

void upload_into(const TensorView& device_view, const void* host, std::size_t bytes) {
  if (bytes == 0) return;
  cuda::DeviceGuard guard(device_view.device.index);
  CUDA_CHECK(cudaMemcpy(device_view.data, host, bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaDeviceSynchronize());  // see upload_view
}

// The batch with every tensor on `device` (the engine's usual case).
struct DeviceBatch {
  std::vector<DeviceTensor> keep;
  BatchMeta batch;
};

DeviceBatch device_batch(const BatchMeta& host, int device) {
  DeviceBatch d;
  d.batch = host;
  d.batch.seq_lens = upload_view(d.keep, host.seq_lens, device);
  d.batch.index_block_table = upload_view(d.keep, host.index_block_table, device);
  d.batch.kv_block_table = upload_view(d.keep, host.kv_block_table, device);
  d.batch.slot_mapping = upload_view(d.keep, host.slot_mapping, device);
  d.batch.index_slot_mapping = upload_view(d.keep, host.index_slot_mapping, device);
  return d;
}

// ---- Comparisons ----

struct Check {
  int64_t checked = 0;
  int64_t bad = 0;
  double worst = 0.0;  // largest |got - want| / (abs + rel |want|)
  std::string first;
};

// [rows, cols] bf16; rows in `skip` are not compared.
void compare_bf16(Check& c, const uint16_t* got, const uint16_t* want, int64_t rows, int64_t cols,
                  double abs_tol, double rel_tol, const std::vector<bool>& skip,
                  const std::string& what) {
  for (int64_t r = 0; r < rows; ++r) {
    if (!skip.empty() && skip[static_cast<std::size_t>(r)]) continue;
    for (int64_t i = 0; i < cols; ++i) {
      const double g = bf16_to_float(got[r * cols + i]);
      const double w = bf16_to_float(want[r * cols + i]);
      ++c.checked;
      const bool nan_ok = std::isnan(g) == std::isnan(w);
      const double bound = abs_tol + rel_tol * std::fabs(w);
      const double ratio = std::isnan(g) || std::isnan(w) ? 0.0 : std::fabs(g - w) / bound;
      if (!nan_ok || ratio > 1.0 || (std::isinf(g) != std::isinf(w))) {
        if (c.bad++ == 0) {
          std::ostringstream out;
          out << what << " [" << r << ", " << i << "]: got " << g << ", want " << w;
          c.first = out.str();
        }
      }
      c.worst = std::max(c.worst, ratio);
    }
  }
}

// Per-row relative L2 error (the MLP output; see the tolerance notes at the top), plus an
// elementwise bound against garbage elements. Check::worst is the worst L2 ratio / tolerance.
void compare_bf16_rows_l2(Check& c, const uint16_t* got, const uint16_t* want, int64_t rows,
                          int64_t cols, const std::vector<bool>& skip, const std::string& what) {
  for (int64_t r = 0; r < rows; ++r) {
    if (!skip.empty() && skip[static_cast<std::size_t>(r)]) continue;
    double err2 = 0.0, ref2 = 0.0;
    bool elements_ok = true;
    for (int64_t i = 0; i < cols; ++i) {
      const double g = bf16_to_float(got[r * cols + i]);
      const double w = bf16_to_float(want[r * cols + i]);
      ++c.checked;
      if (std::isnan(g) != std::isnan(w) || std::isinf(g) != std::isinf(w)) {
        elements_ok = false;
        continue;
      }
      if (std::isnan(w) || std::isinf(w)) continue;
      elements_ok = elements_ok && std::fabs(g - w) <= kMlpAbsTol;
      err2 += (g - w) * (g - w);
      ref2 += w * w;
    }
    const double ratio = std::sqrt(err2 / std::max(ref2, 1e-30)) / kMlpRowL2Tol;
    c.worst = std::max(c.worst, ratio);
    if (!elements_ok || ratio > 1.0) {
      if (c.bad++ == 0) {
        std::ostringstream out;
        out << what << " row " << r << ": relative L2 error " << ratio * kMlpRowL2Tol
            << (elements_ok ? "" : ", an element off by more than kMlpAbsTol or NaN/inf moved");
        c.first = out.str();
      }
    }
  }
}

// GPU selection vs the CPU's under the near-tie rule. Marks rows whose selection differs (by
// near ties only) in `swapped`; returns the number of (row, head) failures.
int64_t compare_selection(const SparseConfig& sc, const std::vector<int32_t>& gpu,
                          const std::vector<int32_t>& cpu, const HostTensor& scores,
                          const BatchMeta& batch, std::vector<bool>& swapped, std::string& first) {
  const int H = sc.index_heads;
  const int k = sc.topk;
  const int64_t cols = scores.shape()[2];
  const std::vector<RowPosition> rows = row_positions(batch);
  int64_t failures = 0;
  auto fail = [&](const std::string& what) {
    if (failures++ == 0) first = what;
  };
  for (int64_t row = 0; row < static_cast<int64_t>(rows.size()); ++row) {
    const int64_t nb = visible_blocks(rows[row].pos, sc.block_size);
    const int64_t expect = std::min<int64_t>(k, nb);
    for (int h = 0; h < H; ++h) {
      const int32_t* g = gpu.data() + (row * H + h) * k;
      const int32_t* c = cpu.data() + (row * H + h) * k;
      const float* s = scores.ptr<float>() + (row * H + h) * cols;
      std::set<int32_t> gs, cs;
      std::ostringstream where;
      where << "row " << row << " (pos " << rows[row].pos << ") head " << h << ": ";
      bool structure = true;
      for (int i = 0; i < k; ++i) {
        if (i < expect) {
          if (g[i] < 0 || g[i] >= nb || !gs.insert(g[i]).second) structure = false;
          cs.insert(c[i]);
        } else if (g[i] != -1) {
          structure = false;
        }
      }
      if (!structure) {
        fail(where.str() + "malformed GPU selection");
        continue;
      }
      if (gs == cs) continue;
      double kth = INFINITY;
      for (int32_t b : cs) {
        if (!is_forced_block(b, nb, sc.init_blocks, sc.local_blocks))
          kth = std::min<double>(kth, s[b]);
      }
      bool near = std::isfinite(kth);
      for (int32_t b : gs) {
        if (!cs.count(b))
          near = near && std::fabs(s[b] - kth) <= kTieTolerance * std::max(1.0, std::fabs(kth));
      }
      for (int32_t b : cs) {
        if (!gs.count(b))
          near = near && std::fabs(s[b] - kth) <= kTieTolerance * std::max(1.0, std::fabs(kth));
      }
      if (near) {
        swapped[static_cast<std::size_t>(row)] = true;
      } else {
        fail(where.str() + "selections differ beyond a near tie (CPU k-th score " +
             std::to_string(kth) + ")");
      }
    }
  }
  return failures;
}

// The slots a step writes, per cache: (page, offset) pairs from both slot mappings.
std::set<int64_t> written_slots(const std::vector<StepMeta>& steps, bool index) {
  std::set<int64_t> out;
  for (const StepMeta& m : steps) {
    const HostTensor& t = index ? m.index_slots : m.slots;
    for (int64_t i = 0; i < t.numel(); ++i) {
      if (t.ptr<int64_t>()[i] >= 0) out.insert(t.ptr<int64_t>()[i]);
    }
  }
  return out;
}

// Caches: written slots within tolerance, everything else exact.
void compare_caches(const SparseConfig& sc, const rt_test::RankModel& cpu, const DeviceModel& gpu,
                    const std::vector<StepMeta>& steps) {
  const std::set<int64_t> kv_slots = written_slots(steps, false);
  const std::set<int64_t> index_slots = written_slots(steps, true);
  for (std::size_t l = 0; l < cpu.weights.layers.size(); ++l) {
    const LayerWeights& want = cpu.weights.layers[l];
    const LayerWeights& got = gpu.weights.layers[l];
    const std::vector<uint16_t> kv = download<uint16_t>(got.kv_cache.data);
    const std::vector<uint16_t> ix = download<uint16_t>(got.index_cache.data);
    const auto* kv_want = want.kv_cache.data.ptr<const uint16_t>();
    const auto* ix_want = want.index_cache.data.ptr<const uint16_t>();
    const int64_t bs = sc.block_size;
    const int64_t hd = sc.head_dim;
    Check written;
    int64_t stray = 0;
    const int64_t pages = want.kv_cache.pages();
    for (int64_t p = 0; p < pages; ++p) {
      for (int64_t off = 0; off < bs; ++off) {
        const bool wrote_kv = kv_slots.count(p * bs + off) > 0;
        const bool wrote_ix = index_slots.count(p * bs + off) > 0;
        for (int h = 0; h < sc.kv_heads; ++h) {
          for (int part = 0; part < 2; ++part) {
            const int64_t at = (((p * sc.kv_heads + h) * 2 + part) * bs + off) * hd;
            if (wrote_kv) {
              compare_bf16(written, kv.data() + at, kv_want + at, 1, hd, kAbsTol, kRelTol, {},
                           "kv cache");
            } else {
              stray += std::memcmp(kv.data() + at, kv_want + at, 2 * hd) != 0;
            }
          }
        }
        const int64_t at = (p * bs + off) * sc.index_dim;
        if (wrote_ix) {
          compare_bf16(written, ix.data() + at, ix_want + at, 1, sc.index_dim, kAbsTol, kRelTol, {},
                       "index cache");
        } else {
          stray += std::memcmp(ix.data() + at, ix_want + at, 2 * sc.index_dim) != 0;
        }
      }
    }
    EXPECT_EQ(written.bad, 0) << "layer " << want.layer << ": " << written.first;
    EXPECT_EQ(stray, 0) << "layer " << want.layer
                        << ": cache rows changed outside the steps' slots";
  }
}

// ---- GPU forward_layer vs the CPU runtime, layer by layer ----

struct AgainstCpu {
  bool fp8_qkv = false;
  bool device_metadata = false;
  bool context_parallel = false;  // TP = 1: the CP indexer at P = 1 (exchange with itself)
  int share_period = 1;
};

void run_against_cpu(uint64_t seed, const AgainstCpu& opt = {}) {
  Scenario s = make_scenario(seed);
  s.config.context_parallel = opt.context_parallel;
  s.config.selection_share_period = opt.share_period;
  const ModelConfig& m = s.config.model;
  const SparseConfig sc = m.sparse(1);
  rt_test::RankModel host = rt_test::make_rank_model(s.master, 0, 1, opt.fp8_qkv);
  rt_test::RankModel host_for_gpu = rt_test::make_rank_model(s.master, 0, 1, opt.fp8_qkv);
  DeviceModel dev = upload_model(host_for_gpu, 0);
  auto comm_cpu = make_single_rank_communicator();
  auto comm_gpu = make_single_rank_communicator();
  Runtime cpu([](const std::string&) {});
  Runtime gpu([](const std::string&) {});
  ASSERT_EQ(cpu.prepare(host.weights, s.config, *comm_cpu), PrepareResult::kActive);
  ASSERT_EQ(gpu.prepare(dev.weights, s.config, *comm_gpu), PrepareResult::kActive)
      << gpu.stats().to_json();
  EXPECT_EQ(gpu.stats().context_parallel, opt.context_parallel);
  EXPECT_EQ(gpu.stats().backend, "cuda");
  EXPECT_EQ(gpu.device(), Device::cuda(0));
  const int64_t H = m.hidden;
  DeviceTensor d_hidden(DType::kBF16, {16, H}), d_residual(DType::kBF16, {16, H});
  DeviceTensor d_positions(DType::kI64, {16});
  cudaStream_t stream = static_cast<cudaStream_t>(gpu.cuda_stream());
  ASSERT_NE(stream, nullptr);

  Check out_check, res_check, mlp_check;
  int64_t selection_failures = 0, swapped_rows = 0, rows_total = 0, shared_mismatches = 0;
  std::string selection_first;
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    const StepMeta& meta = s.steps[step];
    const int64_t rows = meta.batch.num_rows();
    ASSERT_TRUE(cpu.begin_step(meta.batch)) << cpu.stats().last_refusal;
    DeviceBatch db;
    if (opt.device_metadata) db = device_batch(meta.batch, 0);
    ASSERT_TRUE(gpu.begin_step(opt.device_metadata ? db.batch : meta.batch))
        << gpu.stats().last_refusal;
    // Rows whose selection swapped near-tied blocks in the step's last indexer layer (a sharing
    // layer inherits them).
    std::vector<bool> swapped(static_cast<std::size_t>(rows), false);
    std::vector<int32_t> last_gpu_topk;
    std::vector<uint16_t> hidden = s.hidden_in[step];
    std::vector<uint16_t> residual = s.residual_in[step];
    const TensorView hv =
        TensorView::contiguous(d_hidden.data(), DType::kBF16, {rows, H}, Device::cuda(0));
    const TensorView rv =
        TensorView::contiguous(d_residual.data(), DType::kBF16, {rows, H}, Device::cuda(0));
    const TensorView pv =
        TensorView::contiguous(d_positions.data(), DType::kI64, {rows}, Device::cuda(0));
    upload_into(pv, meta.positions.data(), meta.positions.nbytes());
    for (std::size_t l = 0; l < s.master.layers.size(); ++l) {
      const int layer = s.master.layers[l].layer;
      // Both backends start the layer from the CPU's input.
      upload_into(hv, hidden.data(), hidden.size() * 2);
      upload_into(rv, residual.data(), residual.size() * 2);
      gpu.forward_layer(layer, hv, rv, pv);
      CUDA_CHECK(cudaStreamSynchronize(stream));
      const Runtime::LayerTrace gt = gpu.last_layer_trace();
      const std::vector<int32_t> gpu_topk = download<int32_t>(gt.topk);
      const std::vector<uint16_t> gpu_hidden = download<uint16_t>(hv);
      const std::vector<uint16_t> gpu_residual = download<uint16_t>(rv);

      cpu.forward_layer(layer, TensorView::contiguous(hidden.data(), DType::kBF16, {rows, H}),
                        TensorView::contiguous(residual.data(), DType::kBF16, {rows, H}),
                        meta.positions.view());
      const Runtime::LayerTrace ct = cpu.last_layer_trace();
      const bool shares = (layer - m.first_sparse_layer) % opt.share_period != 0;
      if (shares) {
        // No indexer ran: the GPU attends with its own last selection, bit for bit.
        shared_mismatches += gpu_topk != last_gpu_topk;
      } else {
        // Scores of the CPU's index_q over the CPU's caches (the near-tie rule's reference).
        IndexerArgs idx;
        idx.index_q = ct.index_q;
        idx.index_cache = host.weights.layers[l].index_cache;
        idx.batch = cpu.step_metadata();
        idx.topk_idx = ct.topk;
        HostTensor scores(DType::kF32, {rows, sc.index_heads, max_blocks()});
        cpu::score_blocks(sc, idx, scores.view());
        std::fill(swapped.begin(), swapped.end(), false);
        selection_failures += compare_selection(sc, gpu_topk, host_values<int32_t>(ct.topk), scores,
                                                meta.batch, swapped, selection_first);
        for (bool b : swapped) swapped_rows += b;
        rows_total += rows;
        last_gpu_topk = gpu_topk;
      }
      const std::string where = "step " + std::to_string(step) + " layer " + std::to_string(layer);
      compare_bf16(res_check, gpu_residual.data(), residual.data(), rows, H, kAbsTol, kRelTol,
                   swapped, where + " residual");
      if (host.weights.layers[l].mlp_down.defined()) {
        compare_bf16_rows_l2(mlp_check, gpu_hidden.data(), hidden.data(), rows, H, swapped,
                             where + " MLP output");
      } else {
        compare_bf16(out_check, gpu_hidden.data(), hidden.data(), rows, H, kAbsTol, kRelTol,
                     swapped, where + " hidden");
      }
    }
  }
  EXPECT_EQ(mlp_check.bad, 0) << mlp_check.first << " (worst " << mlp_check.worst << ")";
  EXPECT_GT(mlp_check.checked, 0);
  std::printf("[ info ] MLP output: worst relative L2 error / tolerance %.3f\n", mlp_check.worst);
  EXPECT_EQ(selection_failures, 0) << selection_first;
  EXPECT_LE(swapped_rows * 4, rows_total)
      << swapped_rows << " of " << rows_total << " rows swapped near-tied blocks";
  EXPECT_EQ(res_check.bad, 0) << res_check.first << " (worst " << res_check.worst << " of the "
                              << "tolerance)";
  EXPECT_EQ(out_check.bad, 0) << out_check.first << " (worst " << out_check.worst << ")";
  EXPECT_GT(out_check.checked, 0);
  std::printf(
      "[ info ] %lld rows, %lld near-tie rows; worst error / tolerance: residual %.3f, "
      "hidden %.3f; launches per layer %lld\n",
      static_cast<long long>(rows_total), static_cast<long long>(swapped_rows), res_check.worst,
      out_check.worst, static_cast<long long>(gpu.stats().launches_per_layer));
  EXPECT_EQ(shared_mismatches, 0) << "a sharing layer did not attend with the last selection";
  EXPECT_EQ(gpu.stats().layers_run, cpu.stats().layers_run);
  EXPECT_EQ(gpu.stats().sharing_layers_run, cpu.stats().sharing_layers_run);
  if (opt.share_period > 1) {
    EXPECT_GT(gpu.stats().sharing_layers_run, 0);
  }
  compare_caches(sc, host, dev, s.steps);
  gpu.close();
  cpu.close();
  EXPECT_EQ(gpu.state(), RuntimeState::kClosed);
}

// ---- Kernels ----

TEST(RuntimeKernels, SkinnyGemmMatchesDoubleReference) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  rt_test::Rng rng(11);
  struct Case {
    int n, k;
  };
  for (const Case c : {Case{40, 64}, Case{1920, 512}, Case{136, 6144}, Case{24, 192}}) {
    for (int rows : {1, 3, 8, 9, 16}) {
      for (bool fp8 : {false, true}) {
        // bf16 / f32 out, then deep (bf16), then 8 warps over K (f32; its own reduction order)
        for (int variant = 0; variant < 4; ++variant) {
          const bool f32 = variant == 1 || variant == 3;
          const int deep = variant == 2 ? 1 : 0;
          std::vector<uint16_t> x(static_cast<std::size_t>(16) * c.k);
          for (auto& v : x) v = float_to_bf16(rng.unit() * 2.0f);
          std::vector<uint8_t> w(static_cast<std::size_t>(c.n) * c.k * (fp8 ? 1 : 2));
          std::vector<double> wv(static_cast<std::size_t>(c.n) * c.k);
          for (std::size_t i = 0; i < wv.size(); ++i) {
            if (fp8) {
              w[i] = float_to_fp8e4m3(rng.unit() * 300.0f);
              wv[i] = fp8e4m3_to_float(w[i]);
            } else {
              const uint16_t b = float_to_bf16(rng.unit() * 0.1f);
              std::memcpy(&w[2 * i], &b, 2);
              wv[i] = bf16_to_float(b);
            }
          }
          std::vector<float> scale(static_cast<std::size_t>(c.n));
          for (auto& v : scale) v = 1e-3f * (1.5f + rng.unit());
          DeviceTensor dx(DType::kBF16, {16, c.k}), dw(DType::kU8, {int64_t(w.size())});
          DeviceTensor ds(DType::kF32, {c.n}), dout(DType::kF32, {17, c.n});
          upload_into(dx.view(), x.data(), x.size() * 2);
          upload_into(dw.view(), w.data(), w.size());
          upload_into(ds.view(), scale.data(), scale.size() * 4);
          fill_device_bytes(dout.view(), 0x7F);  // poison (NaN as f32 / bf16 pairs)
          cuda::GemmSkinnyParams p;
          p.x = static_cast<const uint16_t*>(dx.data());
          p.x_stride = c.k;
          p.w = dw.data();
          p.scale = fp8 ? static_cast<const float*>(ds.data()) : nullptr;
          p.out = dout.data();
          p.out_stride = c.n;
          p.rows = rows;
          p.n = c.n;
          p.k = c.k;
          p.w_fp8 = fp8;
          p.out_f32 = f32;
          p.deep = deep;
          p.split_k8 = variant == 3;
          cuda::launch_gemm_skinny(p, nullptr);
          CUDA_CHECK(cudaDeviceSynchronize());
          const std::vector<uint8_t> raw = download<uint8_t>(dout.view());
          // Again with the other loops (deep, ring): the same bits (also: run to run determinism).
          const std::vector<uint8_t> raw2 = [&] {
            cuda::GemmSkinnyParams other = p;
            other.deep = 1 - p.deep;
            cuda::launch_gemm_skinny(other, nullptr);
            CUDA_CHECK(cudaDeviceSynchronize());
            return download<uint8_t>(dout.view());
          }();
          EXPECT_EQ(raw, raw2) << "deep = 0 and deep = 1 differ";
          // And through the ring loop (these grids are too small to take it by themselves).
          const std::vector<uint8_t> raw3 = [&] {
            cuda::GemmSkinnyParams other = p;
            other.deep = 0;
            other.force_ring = 1;
            cuda::launch_gemm_skinny(other, nullptr);
            CUDA_CHECK(cudaDeviceSynchronize());
            return download<uint8_t>(dout.view());
          }();
          EXPECT_EQ(raw, raw3) << "the ring and the group loops differ";
          int64_t bad = 0;
          std::string first;
          const std::size_t elem = f32 ? 4 : 2;
          for (int r = 0; r < 17; ++r) {
            for (int n = 0; n < c.n; ++n) {
              const uint8_t* at = raw.data() + (static_cast<std::size_t>(r) * c.n + n) * elem;
              if (r >= rows) {  // untouched: still poisoned
                bad += !std::all_of(at, at + elem, [](uint8_t b) { return b == 0x7F; });
                continue;
              }
              double ref = 0.0, mag = 0.0;
              for (int kk = 0; kk < c.k; ++kk) {
                const double t = bf16_to_float(x[static_cast<std::size_t>(r) * c.k + kk]) *
                                 wv[static_cast<std::size_t>(n) * c.k + kk];
                ref += t;
                mag += std::fabs(t);
              }
              const double sc = fp8 ? scale[static_cast<std::size_t>(n)] : 1.0;
              ref *= sc;
              mag *= sc;
              double got;
              if (f32) {
                float v;
                std::memcpy(&v, at, 4);
                got = v;
              } else {
                uint16_t v;
                std::memcpy(&v, at, 2);
                got = bf16_to_float(v);
              }
              // fp32 accumulation: ~1e-6 of the magnitude; bf16 output: half an ulp more.
              const double tol = 2e-6 * mag + (f32 ? 0.0 : std::fabs(ref) / 256.0) + 1e-30;
              if (!(std::fabs(got - ref) <= tol)) {
                if (bad++ == 0) {
                  first = "row " + std::to_string(r) + " col " + std::to_string(n) + ": got " +
                          std::to_string(got) + ", want " + std::to_string(ref);
                }
              }
            }
          }
          EXPECT_EQ(bad, 0) << "n " << c.n << " k " << c.k << " rows " << rows << " fp8 " << fp8
                            << " f32 " << f32 << " deep " << deep << " split_k8 " << (variant == 3)
                            << ": " << first;
        }
      }
    }
  }
}

// A skinny GEMM of contiguous x [*, k] and w [n, k] into f32 out [*, n], no scale; rows unset.
cuda::GemmSkinnyParams f32_gemm(const DeviceTensor& x, const DeviceTensor& w,
                                const DeviceTensor& out, int n, int k, bool fp8) {
  cuda::GemmSkinnyParams p;
  p.x = static_cast<const uint16_t*>(x.data());
  p.x_stride = k;
  p.w = w.data();
  p.out = out.data();
  p.out_stride = n;
  p.n = n;
  p.k = k;
  p.w_fp8 = fp8 ? 1 : 0;
  p.out_f32 = 1;
  return p;
}

// Every e4m3 code through the fp8 GEMM, exactly: column n holds code n % 256 at every k, row r of
// x is 1 at k = 5 r + 1 and 0 elsewhere, so out[r, n] must be the decoded code itself (f32 out, no
// scale). Covers +-0, the subnormals, the largest normals and the two NaN codes, which must make
// their whole column NaN; so must one NaN weight met only by zero activations (columns 256 ..
// 271: random codes, one NaN at a k no row selects, in the odd columns).
TEST(RuntimeKernels, SkinnyGemmDecodesEveryFp8CodeExactly) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  rt_test::Rng rng(29);
  constexpr int kN = 272, kK = 128, kRows = 16, kHiddenNanK = 2;
  std::vector<uint16_t> x(static_cast<std::size_t>(kRows) * kK, float_to_bf16(0.0f));
  for (int r = 0; r < kRows; ++r)
    x[static_cast<std::size_t>(r) * kK + 5 * r + 1] = float_to_bf16(1.0f);
  std::vector<uint8_t> w(static_cast<std::size_t>(kN) * kK);
  for (int n = 0; n < kN; ++n) {
    for (int k = 0; k < kK; ++k) {
      uint8_t code = static_cast<uint8_t>(n % 256);
      if (n >= 256) {
        do {
          code = static_cast<uint8_t>(rng.next() & 0xFFu);
        } while ((code & 0x7Fu) == 0x7Fu);
        if (n % 2 == 1 && k == kHiddenNanK) code = 0xFF;
      }
      w[static_cast<std::size_t>(n) * kK + k] = code;
    }
  }
  DeviceTensor dx(DType::kBF16, {kRows, kK}), dw(DType::kU8, {int64_t(w.size())});
  DeviceTensor dout(DType::kF32, {kRows, kN});
  upload_into(dx.view(), x.data(), x.size() * 2);
  upload_into(dw.view(), w.data(), w.size());
  for (int variant = 0; variant < 6; ++variant) {
    const int loop = variant % 3;  // group, deep, ring (128-byte fp8 chunks: k = 128)
    const int rows = variant < 3 ? kRows : 8;
    fill_device_bytes(dout.view(), 0x5A);
    cuda::GemmSkinnyParams p = f32_gemm(dx, dw, dout, kN, kK, /*fp8=*/true);
    p.rows = rows;
    p.deep = loop == 1;
    p.force_ring = loop == 2;
    cuda::launch_gemm_skinny(p, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> out = download<float>(dout.view());
    int64_t bad = 0;
    std::string first;
    for (int r = 0; r < rows; ++r) {
      for (int n = 0; n < kN; ++n) {
        const int k = 5 * r + 1;
        const uint8_t code = w[static_cast<std::size_t>(n) * kK + k];
        const bool want_nan = (code & 0x7Fu) == 0x7Fu || (n >= 256 && n % 2 == 1);
        const float want = fp8e4m3_to_float(code);
        const float got = out[static_cast<std::size_t>(r) * kN + n];
        // == (not the bits): a -0 weight's products sum to +0 from the +0 accumulator.
        const bool ok = want_nan ? std::isnan(got) : got == want;
        if (!ok && bad++ == 0) {
          first = "row " + std::to_string(r) + " col " + std::to_string(n) + " code " +
                  std::to_string(code) + ": got " + std::to_string(got) + ", want " +
                  (want_nan ? std::string("NaN") : std::to_string(want));
        }
      }
    }
    EXPECT_EQ(bad, 0) << "loop " << loop << " (group, deep, ring), rows " << rows << ": " << first;
  }
}

// A row's output does not depend on how many rows its launch has: the loop may follow the row
// count (fp8 takes the ring from 2 rows, on grids of >= 4 CTAs per SM, as M3's q/k/v projection
// is), and every loop reduces a column in the same order. Rows 1, 2, 5 and 16 of the same inputs,
// bf16 and fp8 (128-byte chunks: k % 128 == 0; 64-byte: k = 192), bit for bit.
TEST(RuntimeKernels, SkinnyGemmRowResultIsIndependentOfTheBatch) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  rt_test::Rng rng(31);
  constexpr int kN = 9856;  // 616 CTAs
  for (int k : {512, 192}) {
    for (bool fp8 : {false, true}) {
      std::vector<uint16_t> x(static_cast<std::size_t>(16) * k);
      for (auto& v : x) v = float_to_bf16(rng.unit() * 2.0f);
      std::vector<uint8_t> w(static_cast<std::size_t>(kN) * k * (fp8 ? 1 : 2));
      for (std::size_t i = 0; i < w.size(); ++i) {
        w[i] = static_cast<uint8_t>(rng.next() & (fp8 ? 0x7Eu : 0x3Fu));  // no NaN, no huge bf16
      }
      DeviceTensor dx(DType::kBF16, {16, k}), dw(DType::kU8, {int64_t(w.size())});
      DeviceTensor dout(DType::kF32, {16, kN});
      upload_into(dx.view(), x.data(), x.size() * 2);
      upload_into(dw.view(), w.data(), w.size());
      cuda::GemmSkinnyParams p = f32_gemm(dx, dw, dout, kN, k, fp8);
      const auto run = [&](int rows) {
        fill_device_bytes(dout.view(), 0x7F);
        p.rows = rows;
        cuda::launch_gemm_skinny(p, nullptr);
        CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<float> out = download<float>(dout.view());
        out.resize(static_cast<std::size_t>(rows) * kN);
        return out;
      };
      const std::vector<float> all = run(16);
      for (int rows : {1, 2, 5}) {
        const std::vector<float> some = run(rows);
        const std::vector<float> head(all.begin(), all.begin() + static_cast<int64_t>(some.size()));
        EXPECT_EQ(0, std::memcmp(some.data(), head.data(), some.size() * sizeof(float)))
            << "k " << k << " fp8 " << fp8 << ": rows 0.." << rows - 1 << " of a " << rows
            << "-row launch differ from the same rows of a 16-row launch";
      }
    }
  }
}

TEST(RuntimeKernels, SkinnyGemmRefusesUnsupportedShapes) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  DeviceTensor buf(DType::kU8, {1 << 20});
  cuda::GemmSkinnyParams p;
  p.x = static_cast<const uint16_t*>(buf.data());
  p.w = buf.data();
  p.out = buf.data();
  p.n = 16;
  p.k = 96;  // not a multiple of 64
  p.x_stride = 96;
  p.out_stride = 16;
  p.rows = 1;
  EXPECT_THROW(cuda::launch_gemm_skinny(p, nullptr), Error);
  p.k = 64;
  p.x_stride = 64;
  p.rows = 17;
  EXPECT_THROW(cuda::launch_gemm_skinny(p, nullptr), Error);
}

TEST(RuntimeKernels, AddRmsNormMatchesCpu) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  rt_test::Rng rng(5);
  // One pass with 1, 2 and 4 chunks per thread (6144, 8200, 24576), the loop beyond (40000).
  for (int n : {512, 6144, 8200, 24576, 40000}) {
    for (int rows : {1, 7, 16}) {
      for (bool f32 : {false, true}) {
        const std::size_t count = static_cast<std::size_t>(rows) * n;
        std::vector<uint16_t> res(count), w(static_cast<std::size_t>(n));
        std::vector<float> delta(count);
        std::vector<uint16_t> delta16(count);
        for (std::size_t i = 0; i < count; ++i) {
          res[i] = float_to_bf16(rng.unit() * 3.0f);
          delta[i] = rng.unit() * 2.0f;
          delta16[i] = float_to_bf16(delta[i]);
        }
        for (auto& v : w) v = float_to_bf16(rng.unit() * 0.3f);
        DeviceTensor dres(DType::kBF16, {rows, n}), dw(DType::kBF16, {n}),
            dd(f32 ? DType::kF32 : DType::kBF16, {rows, n}), dout(DType::kBF16, {rows, n});
        upload_into(dres.view(), res.data(), count * 2);
        upload_into(dw.view(), w.data(), w.size() * 2);
        if (f32) {
          upload_into(dd.view(), delta.data(), count * 4);
        } else {
          upload_into(dd.view(), delta16.data(), count * 2);
        }
        cuda::NormResidualParams p;
        p.delta = dd.data();
        p.residual = static_cast<uint16_t*>(dres.data());
        p.weight = static_cast<const uint16_t*>(dw.data());
        p.out = static_cast<uint16_t*>(dout.data());
        p.rows = rows;
        p.n = n;
        p.delta_f32 = f32;
        p.eps = 1e-6f;
        cuda::launch_norm_residual(p, nullptr);
        CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<uint16_t> got_res = download<uint16_t>(dres.view());
        const std::vector<uint16_t> got_out = download<uint16_t>(dout.view());
        std::vector<uint16_t> want_res(count), want_out(count);
        for (std::size_t i = 0; i < count; ++i) {
          const float d = f32 ? round_to_bf16(delta[i]) : bf16_to_float(delta16[i]);
          want_res[i] = float_to_bf16(bf16_to_float(res[i]) + d);
        }
        for (int r = 0; r < rows; ++r) {
          runtime_detail::gemma_rmsnorm_row(&want_res[static_cast<std::size_t>(r) * n], w.data(), n,
                                            1e-6f, &want_out[static_cast<std::size_t>(r) * n]);
        }
        EXPECT_EQ(got_res, want_res) << "the residual add is exact maths";
        Check c;
        // Only the sum-of-squares order differs: one bf16 rounding of the output can flip.
        compare_bf16(c, got_out.data(), want_out.data(), rows, n, 1e-6, 1.0 / 128, {}, "normed");
        EXPECT_EQ(c.bad, 0) << c.first;
      }
    }
  }
}

// ---- The layer ----

TEST(RuntimeGpu, LayerMatchesCpuBf16) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  run_against_cpu(101);
}

TEST(RuntimeGpu, LayerMatchesCpuFp8) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  run_against_cpu(202, {.fp8_qkv = true});
}

TEST(RuntimeGpu, LayerMatchesCpuDeviceMetadata) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  run_against_cpu(303, {.device_metadata = true});
}

// The CP indexer inside forward_layer (P = 1) and cross-layer selection sharing (period 2:
// layer 2 shares layer 1's selection), against the CPU runtime with the same options.
TEST(RuntimeGpu, LayerMatchesCpuContextParallel) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  run_against_cpu(313, {.context_parallel = true});
}

TEST(RuntimeGpu, LayerMatchesCpuSelectionSharing) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  run_against_cpu(323, {.fp8_qkv = true, .share_period = 2});
}

// One GPU runtime with StepGraphs: the same step (caches restored, same inputs) run eagerly and
// replayed gives bit-identical outputs and caches, for several shapes, padded steps, and a
// captured graph replayed with another step's metadata.
TEST(RuntimeGpu, GraphReplayEqualsEager) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  const std::vector<Shape> shapes = {{{700, 1500, 0, 2000}, 2},     // 8 rows: bucket 8
                                     {{702, 1502, 0, 2002}, 2},     // same graph, new metadata
                                     {{703, 1503, 90}, 1},          // 3 rows padded to 4
                                     {{1000, 2040}, 4},             // 8 rows of q_len 4
                                     {{5, 130, 257, 400, 555}, 1},  // 5 rows padded to 8
                                     {{77, 1900, 1234}, 1}};        // bucket 4 again
  const Scenario s = make_scenario(404, shapes);
  const ModelConfig& m = s.config.model;
  rt_test::RankModel host = rt_test::make_rank_model(s.master, 0, 1, false);
  DeviceModel dev = upload_model(host, 0);
  // Pristine caches to restore before each run.
  std::vector<DeviceTensor> pristine;
  for (const LayerWeights& w : dev.weights.layers) {
    for (const TensorView& v : {w.kv_cache.data, w.index_cache.data}) {
      DeviceTensor copy(v.dtype, v.sizes());
      CUDA_CHECK(cudaMemcpy(copy.data(), v.data, v.nbytes(), cudaMemcpyDeviceToDevice));
      pristine.push_back(copy);
    }
  }
  auto restore = [&] {
    std::size_t i = 0;
    for (const LayerWeights& w : dev.weights.layers) {
      for (const TensorView& v : {w.kv_cache.data, w.index_cache.data}) {
        CUDA_CHECK(cudaMemcpy(v.data, pristine[i++].data(), v.nbytes(), cudaMemcpyDeviceToDevice));
      }
    }
    CUDA_CHECK(cudaDeviceSynchronize());  // device-to-device cudaMemcpy is asynchronous
  };
  auto comm = make_single_rank_communicator();
  Runtime rt([](const std::string&) {});
  ASSERT_EQ(rt.prepare(dev.weights, s.config, *comm), PrepareResult::kActive);
  StepGraphs graphs(rt);
  cudaStream_t stream = static_cast<cudaStream_t>(rt.cuda_stream());
  const int64_t H = m.hidden;

  struct Result {
    std::vector<uint16_t> hidden, residual;
    std::vector<std::vector<uint8_t>> caches;
  };
  auto run_one = [&](std::size_t step, bool graph) {
    restore();
    fill_device_bytes(graphs.hidden(), 0);
    fill_device_bytes(graphs.residual(), 0);
    const StepMeta& meta = s.steps[step];
    const int64_t rows = meta.batch.num_rows();
    upload_into(graphs.hidden(), s.hidden_in[step].data(), s.hidden_in[step].size() * 2);
    upload_into(graphs.residual(), s.residual_in[step].data(), s.residual_in[step].size() * 2);
    upload_into(graphs.positions(), meta.positions.data(), meta.positions.nbytes());
    const bool ran = graph ? graphs.run(meta.batch) : graphs.run_eager(meta.batch);
    EXPECT_TRUE(ran) << rt.stats().last_refusal;
    CUDA_CHECK(cudaStreamSynchronize(stream));
    Result r;
    r.hidden = download<uint16_t>(graphs.hidden());
    r.residual = download<uint16_t>(graphs.residual());
    r.hidden.resize(static_cast<std::size_t>(rows * H));
    r.residual.resize(static_cast<std::size_t>(rows * H));
    for (const LayerWeights& w : dev.weights.layers) {
      r.caches.push_back(download<uint8_t>(w.kv_cache.data));
      r.caches.push_back(download<uint8_t>(w.index_cache.data));
    }
    return r;
  };
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    const Result eager = run_one(step, false);
    const Result replay = run_one(step, true);
    EXPECT_EQ(eager.hidden, replay.hidden) << "step " << step;
    EXPECT_EQ(eager.residual, replay.residual) << "step " << step;
    EXPECT_TRUE(eager.caches == replay.caches) << "step " << step << ": caches differ";
    // The step really ran: its outputs are not the inputs.
    EXPECT_NE(eager.residual, s.residual_in[step]) << "step " << step;
  }
  // Shapes (padded requests x q_len): (4, 2), (4, 1), (2, 4), (8, 1) -> 4 graphs.
  EXPECT_EQ(graphs.graphs(), 4);
  EXPECT_EQ(graphs.padded_requests(3, 1), 4);
  EXPECT_EQ(graphs.padded_requests(5, 1), 8);
  const RuntimeStats st = rt.stats();
  EXPECT_EQ(st.graphs_captured, 4);
  EXPECT_EQ(st.graph_replays, static_cast<int64_t>(s.steps.size()));
  EXPECT_EQ(st.layers_run, static_cast<int64_t>(2 * s.steps.size() * s.master.layers.size()));
  EXPECT_GT(st.launches_per_layer, 6);
  graphs.reset();
  rt.close();
}

// prepare while the runtime's stream captures is refused (the flag and the stream itself), and so
// is begin_step (its copies would be captured with stale metadata).
TEST(RuntimeGpu, PrepareAndBeginStepRefusedWhileCapturing) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  const Scenario s = make_scenario(505, {{{300, 900}, 1}});
  rt_test::RankModel host = rt_test::make_rank_model(s.master, 0, 1, false);
  DeviceModel dev = upload_model(host, 0);
  cuda::Stream stream;
  RuntimeConfig config = s.config;
  config.cuda_stream = stream.get();
  auto comm = make_single_rank_communicator();
  Runtime rt([](const std::string&) {});

  StepContext capturing;
  capturing.capturing = true;
  try {
    rt.prepare(dev.weights, config, *comm, capturing);
    ADD_FAILURE() << "prepare with StepContext::capturing succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  }

  CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  bool threw = false;
  try {
    rt.prepare(dev.weights, config, *comm);
  } catch (const Error& e) {
    threw = true;
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(e.message().find("capturing"), std::string::npos) << e.what();
  }
  cudaGraph_t graph = nullptr;
  CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  if (graph) cudaGraphDestroy(graph);
  EXPECT_TRUE(threw) << "prepare ran while config.cuda_stream was capturing";
  EXPECT_EQ(rt.state(), RuntimeState::kIdle);

  ASSERT_EQ(rt.prepare(dev.weights, config, *comm), PrepareResult::kActive);
  EXPECT_EQ(rt.cuda_stream(), static_cast<void*>(stream.get()));
  CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
  threw = false;
  try {
    rt.begin_step(s.steps[0].batch);
  } catch (const Error& e) {
    threw = true;
    EXPECT_NE(e.message().find("capturing"), std::string::npos) << e.what();
  }
  graph = nullptr;
  CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
  if (graph) cudaGraphDestroy(graph);
  EXPECT_TRUE(threw) << "begin_step ran while the stream was capturing";
  // Eager again: accepted.
  EXPECT_TRUE(rt.begin_step(s.steps[0].batch));
  rt.close();
}

// What the CUDA path does not run falls back (every rank "unsupported", reason named); tensors
// on two devices are an error.
TEST(RuntimeGpu, UnsupportedFallsBackAndMixedDevicesFail) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  {
    RuntimeConfig c = rt_test::small_config();  // 32-d heads, blocks of 16
    const MasterModel master = rt_test::make_master(c.model, 20, 7, true);
    rt_test::RankModel host = rt_test::make_rank_model(master, 0, 1, false);
    DeviceModel dev = upload_model(host, 0);
    auto comm = make_single_rank_communicator();
    Runtime rt([](const std::string&) {});
    EXPECT_EQ(rt.prepare(dev.weights, c, *comm), PrepareResult::kFallback);
    const RuntimeStats st = rt.stats();
    ASSERT_FALSE(st.fallback_reasons.empty());
    const std::string reason = st.fallback_reasons.begin()->first;
    EXPECT_NE(reason.find("CUDA backend: head_dim must be 128"), std::string::npos) << reason;
    EXPECT_NE(reason.find("block_size must be 128"), std::string::npos) << reason;
  }
  {
    const Scenario s = make_scenario(606, {{{300}, 1}});
    rt_test::RankModel host = rt_test::make_rank_model(s.master, 0, 1, false);
    DeviceModel dev = upload_model(host, 0);
    dev.weights.layers[0].input_norm = host.weights.layers[0].input_norm;  // a host tensor
    auto comm = make_single_rank_communicator();
    Runtime rt([](const std::string&) {});
    try {
      rt.prepare(dev.weights, s.config, *comm);
      ADD_FAILURE() << "prepare accepted tensors on two devices";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(e.message().find("input_norm: expected a tensor on cuda:0"), std::string::npos)
          << e.what();
    }
  }
  {
    // TP = 2 through a ThreadGroup with the all-reduce on NCCL: unsupported on both ranks ->
    // fallback (the default, auto, would use peer stores into the other rank's memory).
    Scenario s = make_scenario(707, {{{300}, 1}});
    s.config.tp_allreduce = TpAllReduce::kNccl;
    std::vector<DeviceModel> devs;
    std::vector<rt_test::RankModel> hosts;
    for (int r = 0; r < 2; ++r) {
      hosts.push_back(rt_test::make_rank_model(s.master, r, 2, false));
      devs.push_back(upload_model(hosts.back(), 0));
    }
    auto group = ThreadGroup::create(2, std::chrono::seconds(60));
    std::vector<PrepareResult> results(2);
    std::vector<std::string> reasons(2);
    const auto errors = run_ranks(group, [&](Communicator& comm) {
      Runtime rt([](const std::string&) {});
      results[static_cast<std::size_t>(comm.rank())] =
          rt.prepare(devs[static_cast<std::size_t>(comm.rank())].weights, s.config, comm);
      const auto st = rt.stats();
      if (!st.fallback_reasons.empty()) {
        reasons[static_cast<std::size_t>(comm.rank())] = st.fallback_reasons.begin()->first;
      }
    });
    for (const auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(results[static_cast<std::size_t>(r)], PrepareResult::kFallback);
      EXPECT_NE(reasons[static_cast<std::size_t>(r)].find("needs an NcclCommunicator"),
                std::string::npos)
          << reasons[static_cast<std::size_t>(r)];
    }
  }
}

// 1000 prepare / step / detach cycles (every 100th with a captured graph): the device memory in
// use does not grow.
TEST(RuntimeGpu, DetachPrepareCyclesKeepDeviceMemoryStable) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  const Scenario s = make_scenario(808, {{{700, 1500, 0, 2000}, 2}});
  rt_test::RankModel host = rt_test::make_rank_model(s.master, 0, 1, false);
  DeviceModel dev = upload_model(host, 0);
  auto comm = make_single_rank_communicator();
  Runtime rt([](const std::string&) {});
  const StepMeta& meta = s.steps[0];
  const int64_t rows = meta.batch.num_rows();
  const int64_t H = s.config.model.hidden;
  DeviceTensor hidden(DType::kBF16, {rows, H}), residual(DType::kBF16, {rows, H});
  DeviceTensor positions(DType::kI64, {rows});
  upload_into(positions.view(), meta.positions.data(), meta.positions.nbytes());
  fill_device_bytes(hidden.view(), 0);
  fill_device_bytes(residual.view(), 0);
  std::vector<LayerCaches> empty;
  for (const LayerWeights& w : dev.weights.layers) empty.push_back(LayerCaches{w.layer, {}, {}});
  std::size_t free_early = 0, free_end = 0, total = 0;
  constexpr int kCycles = 1000;
  for (int cycle = 0; cycle < kCycles; ++cycle) {
    ASSERT_EQ(rt.prepare(dev.weights, s.config, *comm), PrepareResult::kActive)
        << "cycle " << cycle;
    if (cycle % 100 == 0) {
      StepGraphs graphs(rt);
      upload_into(graphs.positions(), meta.positions.data(), meta.positions.nbytes());
      ASSERT_TRUE(graphs.run(meta.batch));
      CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(rt.cuda_stream())));
    } else {
      ASSERT_TRUE(rt.begin_step(meta.batch));
      for (const LayerWeights& w : dev.weights.layers) {
        rt.forward_layer(w.layer, hidden.view(), residual.view(), positions.view());
      }
    }
    rt.detach(empty);
    ASSERT_EQ(rt.state(), RuntimeState::kClosed);
    if (cycle == 9) CUDA_CHECK(cudaMemGetInfo(&free_early, &total));
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemGetInfo(&free_end, &total));
  // Allocator granularity may move a few MiB; a leak of one prepare's buffers per cycle would be
  // hundreds of MiB over 990 cycles.
  EXPECT_GE(free_end + (8u << 20), free_early)
      << "device memory in use grew by " << (free_early - free_end) / 1048576.0 << " MiB over "
      << kCycles - 10 << " cycles";
  // A non-empty replacement is refused (after a fresh prepare).
  ASSERT_EQ(rt.prepare(dev.weights, s.config, *comm), PrepareResult::kActive);
  std::vector<LayerCaches> full = {
      LayerCaches{dev.weights.layers[0].layer, dev.weights.layers[0].kv_cache, {}}};
  EXPECT_THROW(rt.detach(full), Error);
  rt.close();
}

// ---- Tensor parallelism: ranks as threads ----

// Per step and layer: the input (hidden, residual) and output of TP = 1, and its selections.
struct LayerRecord {
  std::vector<uint16_t> in_hidden, in_residual, out_hidden, out_residual;
  std::vector<int32_t> topk;  // [rows, H, k]
};

// TP = 1 on GPU 0, chained through the layers; every layer recorded.
std::vector<std::vector<LayerRecord>> record_tp1(const Scenario& s) {
  const int64_t H = s.config.model.hidden;
  std::vector<std::vector<LayerRecord>> records(s.steps.size());
  rt_test::RankModel host = rt_test::make_rank_model(s.master, 0, 1, false);
  DeviceModel dev = upload_model(host, 0);
  auto comm = make_single_rank_communicator();
  Runtime rt([](const std::string&) {});
  M3MSA_CHECK_INTERNAL(rt.prepare(dev.weights, s.config, *comm) == PrepareResult::kActive,
                       "TP = 1 prepare: ", rt.stats().to_json());
  DeviceTensor hidden(DType::kBF16, {16, H}), residual(DType::kBF16, {16, H});
  DeviceTensor positions(DType::kI64, {16});
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    const StepMeta& meta = s.steps[step];
    const int64_t rows = meta.batch.num_rows();
    const TensorView hv =
        TensorView::contiguous(hidden.data(), DType::kBF16, {rows, H}, Device::cuda(0));
    const TensorView rv =
        TensorView::contiguous(residual.data(), DType::kBF16, {rows, H}, Device::cuda(0));
    const TensorView pv =
        TensorView::contiguous(positions.data(), DType::kI64, {rows}, Device::cuda(0));
    upload_into(pv, meta.positions.data(), meta.positions.nbytes());
    upload_into(hv, s.hidden_in[step].data(), s.hidden_in[step].size() * 2);
    upload_into(rv, s.residual_in[step].data(), s.residual_in[step].size() * 2);
    M3MSA_CHECK_INTERNAL(rt.begin_step(meta.batch), "TP = 1 refused step ", step);
    for (const rt_test::MasterLayer& layer : s.master.layers) {
      LayerRecord rec;
      rec.in_hidden = download<uint16_t>(hv);
      rec.in_residual = download<uint16_t>(rv);
      rt.forward_layer(layer.layer, hv, rv, pv);
      CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(rt.cuda_stream())));
      rec.out_hidden = download<uint16_t>(hv);
      rec.out_residual = download<uint16_t>(rv);
      rec.topk = download<int32_t>(rt.last_layer_trace().topk);
      records[step].push_back(rec);
    }
  }
  rt.close();
  return records;
}

// The indexer beside the q/k/v projection (RuntimeConfig::indexer_overlap) only moves when
// kernels run: off, on and auto (on for the q_len >= 2 steps) give every layer the same bits.
TEST(RuntimeGpu, IndexerOverlapChangesNoResult) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  Scenario s = make_scenario(611);
  s.config.indexer_overlap = IndexerOverlap::kOff;
  const auto serial = record_tp1(s);
  for (IndexerOverlap mode : {IndexerOverlap::kOn, IndexerOverlap::kAuto}) {
    s.config.indexer_overlap = mode;
    const auto overlapped = record_tp1(s);
    ASSERT_EQ(overlapped.size(), serial.size());
    for (std::size_t step = 0; step < serial.size(); ++step) {
      for (std::size_t l = 0; l < serial[step].size(); ++l) {
        const LayerRecord& a = overlapped[step][l];
        const LayerRecord& b = serial[step][l];
        const std::string where = std::string(indexer_overlap_name(mode)) + ", step " +
                                  std::to_string(step) + ", layer " + std::to_string(l);
        EXPECT_EQ(a.out_hidden, b.out_hidden) << where;
        EXPECT_EQ(a.out_residual, b.out_residual) << where;
        EXPECT_EQ(a.topk, b.topk) << where;
        EXPECT_NE(a.out_residual, a.in_residual) << where << ": the layer did not run";
      }
    }
  }
}

// What each rank of a TP = 2 run produced, [rank][step * layers + layer].
struct TpRun {
  std::vector<std::vector<std::vector<uint16_t>>> hidden{2}, residual{2};
  std::vector<std::vector<std::vector<int32_t>>> topk{2};
  std::vector<std::vector<uint16_t>> graph_eager{2}, graph_replay{2};
  std::vector<RuntimeStats> stats{2};
};

// TP = 2 with ranks as threads on `devices`: {0, 1} over NCCL communicators, or {0, 0} (one GPU
// twice) over a ThreadGroup, where the TP all-reduce and the CP exchange use peer stores into
// the other rank's allocation. Every layer starts from the TP = 1 input (teacher forcing); a
// whole step also runs eagerly and through a graph. Copies are stream-ordered on each rank's
// runtime stream: a device-wide synchronize on one rank could wait on the other rank's kernel
// spinning for this rank's next exchange.
TpRun run_tp2(const Scenario& s, const std::vector<std::vector<LayerRecord>>& records,
              const std::vector<int>& devices, const RuntimeConfig& config) {
  const int64_t H = s.config.model.hidden;
  TpRun out;
  std::vector<rt_test::RankModel> hosts;
  std::vector<DeviceModel> devs;
  for (int r = 0; r < 2; ++r) {
    hosts.push_back(rt_test::make_rank_model(s.master, r, 2, false, config.context_parallel));
    devs.push_back(upload_model(hosts.back(), devices[static_cast<std::size_t>(r)]));
  }
  auto body = [&](Communicator& comm) {
    const int r = comm.rank();
    const auto ur = static_cast<std::size_t>(r);
    const int device = devices[ur];
    cuda::DeviceGuard guard(device);
    Runtime rt([](const std::string&) {});
    M3MSA_CHECK_INTERNAL(rt.prepare(devs[ur].weights, config, comm) == PrepareResult::kActive,
                         "rank ", r, " prepare: ", rt.stats().to_json());
    cudaStream_t stream = static_cast<cudaStream_t>(rt.cuda_stream());
    auto put = [&](const TensorView& v, const void* host, std::size_t bytes) {
      CUDA_CHECK(cudaMemcpyAsync(v.data, host, bytes, cudaMemcpyHostToDevice, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
    };
    auto get16 = [&](const TensorView& v, int64_t count) {
      std::vector<uint16_t> h(static_cast<std::size_t>(count));
      CUDA_CHECK(cudaMemcpyAsync(h.data(), v.data, h.size() * 2, cudaMemcpyDeviceToHost, stream));
      CUDA_CHECK(cudaStreamSynchronize(stream));
      return h;
    };
    DeviceTensor hidden(DType::kBF16, {16, H}, device), residual(DType::kBF16, {16, H}, device);
    DeviceTensor positions(DType::kI64, {16}, device);
    for (std::size_t step = 0; step < s.steps.size(); ++step) {
      const StepMeta& meta = s.steps[step];
      const int64_t rows = meta.batch.num_rows();
      const Device dev = Device::cuda(device);
      const TensorView hv = TensorView::contiguous(hidden.data(), DType::kBF16, {rows, H}, dev);
      const TensorView rv = TensorView::contiguous(residual.data(), DType::kBF16, {rows, H}, dev);
      const TensorView pv = TensorView::contiguous(positions.data(), DType::kI64, {rows}, dev);
      put(pv, meta.positions.data(), meta.positions.nbytes());
      M3MSA_CHECK_INTERNAL(rt.begin_step(meta.batch), "rank ", r, " refused step ", step);
      for (std::size_t l = 0; l < s.master.layers.size(); ++l) {
        const LayerRecord& rec = records[step][l];
        put(hv, rec.in_hidden.data(), rec.in_hidden.size() * 2);
        put(rv, rec.in_residual.data(), rec.in_residual.size() * 2);
        rt.forward_layer(s.master.layers[l].layer, hv, rv, pv);
        CUDA_CHECK(cudaStreamSynchronize(stream));
        out.hidden[ur].push_back(get16(hv, rows * H));
        out.residual[ur].push_back(get16(rv, rows * H));
        const TensorView topk = rt.last_layer_trace().topk;
        std::vector<int32_t> t(static_cast<std::size_t>(topk.numel()));
        CUDA_CHECK(
            cudaMemcpyAsync(t.data(), topk.data, t.size() * 4, cudaMemcpyDeviceToHost, stream));
        CUDA_CHECK(cudaStreamSynchronize(stream));
        out.topk[ur].push_back(t);
      }
    }
    rt.check();  // nothing recorded by the exchanges
    // A whole step through a graph at TP = 2 (the all-reduces inside): replay == eager. The same
    // step twice writes the same cache slots with the same values, so the second pass sees the
    // caches the first one left: eager first, then the graph.
    {
      StepGraphs graphs(rt);
      const StepMeta& meta = s.steps[0];
      const int64_t rows = meta.batch.num_rows();
      for (int pass = 0; pass < 2; ++pass) {
        put(graphs.hidden(), s.hidden_in[0].data(), s.hidden_in[0].size() * 2);
        put(graphs.residual(), s.residual_in[0].data(), s.residual_in[0].size() * 2);
        put(graphs.positions(), meta.positions.data(), meta.positions.nbytes());
        M3MSA_CHECK_INTERNAL(pass == 0 ? graphs.run_eager(meta.batch) : graphs.run(meta.batch),
                             "rank ", r, " graph step refused");
        CUDA_CHECK(cudaStreamSynchronize(stream));
        (pass == 0 ? out.graph_eager : out.graph_replay)[ur] = get16(graphs.hidden(), rows * H);
      }
    }
    rt.check();
    out.stats[ur] = rt.stats();
    rt.close();
  };
  if (devices[0] != devices[1]) {
    auto comms = make_nccl_communicators_in_process(devices, std::chrono::seconds(60));
    run_threads(2, [&](int r) { body(*comms[static_cast<std::size_t>(r)]); });
  } else {
    auto group = ThreadGroup::create(2, std::chrono::seconds(60));
    const auto errors = run_ranks(group, body);
    for (const auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  }
  return out;
}

// TP = 2 against TP = 1: ranks bit-identical to each other, outputs within the TP tolerance,
// each rank's selection == TP = 1's selection of its head, graph replay == eager.
void expect_tp2_matches_tp1(const Scenario& s, const std::vector<std::vector<LayerRecord>>& records,
                            const TpRun& tp, const std::string& name) {
  const ModelConfig& m = s.config.model;
  const int64_t H = m.hidden;
  const SparseConfig sc1 = m.sparse(1);
  Check c;
  std::vector<int64_t> selection_mismatches(2, 0);
  std::size_t i = 0;
  for (std::size_t step = 0; step < s.steps.size(); ++step) {
    const int64_t rows = s.steps[step].batch.num_rows();
    for (std::size_t l = 0; l < s.master.layers.size(); ++l, ++i) {
      const LayerRecord& rec = records[step][l];
      EXPECT_EQ(tp.hidden[0][i], tp.hidden[1][i])
          << name << ": ranks differ: step " << step << " layer " << l;
      EXPECT_EQ(tp.residual[0][i], tp.residual[1][i]) << name << ": ranks differ: step " << step;
      const std::string where = "step " + std::to_string(step) + " layer " + std::to_string(l);
      compare_bf16(c, tp.residual[0][i].data(), rec.out_residual.data(), rows, H, kTpAbsTol,
                   kTpRelTol, {}, where + " residual");
      compare_bf16(c, tp.hidden[0][i].data(), rec.out_hidden.data(), rows, H, kTpAbsTol, kTpRelTol,
                   {}, where + " hidden");
      // Rank r attends KV head r: TP = 1's head r.
      for (int r = 0; r < 2; ++r) {
        const std::vector<int32_t>& topk = tp.topk[static_cast<std::size_t>(r)][i];
        for (int64_t row = 0; row < rows; ++row) {
          for (int j = 0; j < sc1.topk; ++j) {
            const int32_t want =
                rec.topk[static_cast<std::size_t>((row * sc1.index_heads + r) * sc1.topk + j)];
            selection_mismatches[static_cast<std::size_t>(r)] +=
                want != topk[static_cast<std::size_t>(row * sc1.topk + j)];
          }
        }
      }
    }
  }
  EXPECT_EQ(c.bad, 0) << name << ": " << c.first << " (worst " << c.worst << " of the tolerance)";
  EXPECT_EQ(selection_mismatches[0], 0) << name << ": rank 0 selections differ from TP=1 head 0";
  EXPECT_EQ(selection_mismatches[1], 0) << name << ": rank 1 selections differ from TP=1 head 1";
  EXPECT_EQ(tp.graph_eager[0], tp.graph_replay[0]) << name << ": graph replay differs from eager";
  EXPECT_EQ(tp.graph_eager[0], tp.graph_eager[1]) << name << ": ranks differ in the graph step";
  std::printf("[ info ] %s vs TP = 1: worst error / tolerance %.3f, all-reduce %s, launches %lld\n",
              name.c_str(), c.worst, tp.stats[0].tp_allreduce.c_str(),
              static_cast<long long>(tp.stats[0].launches_per_layer));
}

// CP on vs CP off at the same TP: selections and outputs bit-identical (cp.md "Exactness").
void expect_cp_equals_no_cp(const TpRun& cp, const TpRun& no_cp, const std::string& name) {
  for (std::size_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(cp.stats[r].context_parallel) << name;
    EXPECT_EQ(cp.topk[r], no_cp.topk[r]) << name << ": rank " << r << " selections differ";
    EXPECT_EQ(cp.hidden[r], no_cp.hidden[r]) << name << ": rank " << r << " outputs differ";
    EXPECT_EQ(cp.graph_replay[r], no_cp.graph_replay[r]) << name << ": rank " << r << " graph";
  }
}

TEST(RuntimeGpu, TensorParallel2MatchesTp1) {
  M3MSA_RUNTIME_REQUIRE_GPUS(2);
  const Scenario s = make_scenario(909);
  ASSERT_EQ(s.config.model.sparse(2).index_heads, 1);
  const auto records = record_tp1(s);
  RuntimeConfig nccl = s.config;
  nccl.tp_allreduce = TpAllReduce::kNccl;
  const TpRun tp_nccl = run_tp2(s, records, {0, 1}, nccl);
  expect_tp2_matches_tp1(s, records, tp_nccl, "TP=2 nccl");
  EXPECT_EQ(tp_nccl.stats[0].tp_allreduce, "nccl");
  RuntimeConfig peer = s.config;  // auto: peer stores over NVLink
  const TpRun tp_peer = run_tp2(s, records, {0, 1}, peer);
  expect_tp2_matches_tp1(s, records, tp_peer, "TP=2 peer");
  EXPECT_EQ(tp_peer.stats[0].tp_allreduce, "peer");
  // Two ranks' partials summed in rank order: the same bits whichever transport carried them.
  for (std::size_t r = 0; r < 2; ++r) EXPECT_EQ(tp_peer.hidden[r], tp_nccl.hidden[r]) << r;
  for (CpTransport transport : {CpTransport::kPeer, CpTransport::kNccl}) {
    RuntimeConfig cp = peer;
    cp.context_parallel = true;
    cp.cp_transport = transport;
    const TpRun tp_cp = run_tp2(s, records, {0, 1}, cp);
    expect_cp_equals_no_cp(tp_cp, tp_peer, std::string("TP=2 CP ") + cp_transport_name(transport));
  }
}

// The same TP = 2 runs with both ranks on one GPU (the peer all-reduce and the CP peer exchange
// into the other rank's allocation; no NCCL): what a one-GPU machine can check of TP = 2.
TEST(RuntimeGpu, TensorParallel2OnOneGpuMatchesTp1) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  const Scenario s = make_scenario(919);
  const auto records = record_tp1(s);
  const TpRun tp = run_tp2(s, records, {0, 0}, s.config);
  expect_tp2_matches_tp1(s, records, tp, "TP=2 on one GPU");
  EXPECT_EQ(tp.stats[0].tp_allreduce, "peer");
  RuntimeConfig cp = s.config;
  cp.context_parallel = true;
  const TpRun tp_cp = run_tp2(s, records, {0, 0}, cp);
  expect_cp_equals_no_cp(tp_cp, tp, "TP=2 CP peer on one GPU");
  RuntimeConfig share = cp;
  share.selection_share_period = 2;
  const TpRun tp_share = run_tp2(s, records, {0, 0}, share);
  // Layer 2 (ordinal 1) attends with layer 1's selection on every rank.
  for (std::size_t r = 0; r < 2; ++r) {
    for (std::size_t i = 1; i < tp_share.topk[r].size(); i += 2) {
      EXPECT_EQ(tp_share.topk[r][i], tp_share.topk[r][i - 1]) << "rank " << r << " layer " << i;
    }
    EXPECT_GT(tp_share.stats[r].sharing_layers_run, 0);
  }
}

// ---- Faults of one rank at TP = 2 (ranks as threads on one GPU, peer all-reduce) ----

// Two runtimes prepared on GPU 0 with a short spin budget, and a runner that gives each rank its
// own script; each rank's error (or none) is returned with the time it took to arrive.
struct FaultRun {
  std::vector<std::string> errors{2};  // "" where the rank returned normally
  std::vector<ErrorCode> codes{2, ErrorCode::kInternal};
  std::vector<double> seconds{2, 0.0};
};

FaultRun run_fault(
    const Scenario& s,
    const std::function<void(int rank, Runtime& rt, const StepMeta& meta, const TensorView& h,
                             const TensorView& r, const TensorView& p)>& script) {
  std::vector<rt_test::RankModel> hosts;
  std::vector<DeviceModel> devs;
  for (int r = 0; r < 2; ++r) {
    hosts.push_back(rt_test::make_rank_model(s.master, r, 2, false));
    devs.push_back(upload_model(hosts.back(), 0));
  }
  RuntimeConfig config = s.config;
  config.cp_spin_budget = std::chrono::milliseconds(50);
  auto group = ThreadGroup::create(2, std::chrono::milliseconds(1500));
  FaultRun out;
  const int64_t H = s.config.model.hidden;
  run_ranks(group, [&](Communicator& comm) {
    const auto ur = static_cast<std::size_t>(comm.rank());
    Runtime rt([](const std::string&) {});
    const StepMeta& meta = s.steps[0];
    const int64_t rows = meta.batch.num_rows();
    DeviceTensor hidden(DType::kBF16, {rows, H}), residual(DType::kBF16, {rows, H});
    DeviceTensor positions(DType::kI64, {rows});
    M3MSA_CHECK_INTERNAL(rt.prepare(devs[ur].weights, config, comm) == PrepareResult::kActive,
                         "prepare: ", rt.stats().to_json());
    cudaStream_t stream = static_cast<cudaStream_t>(rt.cuda_stream());
    CUDA_CHECK(cudaMemcpyAsync(positions.data(), meta.positions.data(), meta.positions.nbytes(),
                               cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaMemsetAsync(hidden.data(), 0, hidden.view().nbytes(), stream));
    CUDA_CHECK(cudaMemsetAsync(residual.data(), 0, residual.view().nbytes(), stream));
    // One healthy step first.
    M3MSA_CHECK_INTERNAL(rt.begin_step(meta.batch), "step refused");
    for (const rt_test::MasterLayer& layer : s.master.layers) {
      rt.forward_layer(layer.layer, hidden.view(), residual.view(), positions.view());
    }
    rt.check();
    comm.all_gather({}, "test: healthy step done");
    const auto t0 = std::chrono::steady_clock::now();
    try {
      script(comm.rank(), rt, meta, hidden.view(), residual.view(), positions.view());
    } catch (const Error& e) {
      out.errors[ur] = e.what();
      out.codes[ur] = e.code();
    }
    out.seconds[ur] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    try {
      rt.close();  // releases whatever happened (its agreement may fail: the peer is gone)
    } catch (const Error&) {
    }
  });
  return out;
}

// A rank that skips a layer: the peer's all-reduce of that layer never gets its partial, and the
// peer's check() names it within the spin budget; a rank whose caches are detached while the
// other steps: the stepping rank's check() names it, the detaching rank's detach() names the
// stepping rank (it never arrives at the agreement), both within the timeouts; no hang.
TEST(RuntimeGpu, FaultsOfOneRankAreNamedOnTheOther) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  const Scenario s = make_scenario(929, {{{700, 1500}, 1}});
  const int last_layer = s.master.layers.back().layer;
  {
    const FaultRun run =
        run_fault(s, [&](int rank, Runtime& rt, const StepMeta& meta, const TensorView& h,
                         const TensorView& r, const TensorView& p) {
          M3MSA_CHECK_INTERNAL(rt.begin_step(meta.batch), "step refused");
          for (const rt_test::MasterLayer& layer : s.master.layers) {
            if (rank == 1 && layer.layer == last_layer) continue;  // the fault
            rt.forward_layer(layer.layer, h, r, p);
          }
          rt.check();
        });
    EXPECT_EQ(run.errors[1], "") << "the skipping rank's own calls all matched";
    EXPECT_EQ(run.codes[0], ErrorCode::kTimeout) << run.errors[0];
    EXPECT_NE(run.errors[0].find("rank 1"), std::string::npos) << run.errors[0];
    EXPECT_LT(run.seconds[0], 5.0);
    std::printf("[ info ] skipped layer: rank 0 after %.3f s: %s\n", run.seconds[0],
                run.errors[0].c_str());
  }
  {
    const FaultRun run =
        run_fault(s, [&](int rank, Runtime& rt, const StepMeta& meta, const TensorView& h,
                         const TensorView& r, const TensorView& p) {
          if (rank == 1) {
            std::vector<LayerCaches> empty;
            for (const rt_test::MasterLayer& layer : s.master.layers) {
              empty.push_back(LayerCaches{layer.layer, {}, {}});
            }
            rt.detach(empty);  // while rank 0 steps
            return;
          }
          M3MSA_CHECK_INTERNAL(rt.begin_step(meta.batch), "step refused");
          for (const rt_test::MasterLayer& layer : s.master.layers) {
            rt.forward_layer(layer.layer, h, r, p);
          }
          rt.check();
        });
    EXPECT_EQ(run.codes[0], ErrorCode::kTimeout) << run.errors[0];
    EXPECT_NE(run.errors[0].find("rank 1"), std::string::npos) << run.errors[0];
    EXPECT_NE(run.errors[1], "") << "detach agreed with a rank that never came";
    EXPECT_NE(run.errors[1].find("rank 0"), std::string::npos) << run.errors[1];
    EXPECT_LT(run.seconds[0], 5.0);
    EXPECT_LT(run.seconds[1], 5.0);
    std::printf(
        "[ info ] detach while stepping: rank 0 after %.3f s: %s; rank 1 after %.3f s: %s\n",
        run.seconds[0], run.errors[0].c_str(), run.seconds[1], run.errors[1].c_str());
  }
}

}  // namespace
}  // namespace m3msa
