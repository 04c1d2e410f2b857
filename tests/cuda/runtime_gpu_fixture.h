// Shared pieces of the CUDA runtime suites (runtime_kernels_test.cc, runtime_gpu_test.cc): a model
// the CUDA kernels run, decode-step scenarios, device copies, and the bf16 comparisons.
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
//    the near-tie rule of docs/spec.md section 4 (testkit::compare_selection_near_tie: tolerance
//    1e-3 of the k-th score, scores from the CPU's index_q); a row whose selection swapped
//    near-tied blocks is excluded from the output check (counted; at most a quarter of the rows may
//    swap), any other difference fails.
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
#pragma once

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
#include "m3msa/testing/runtime_model.h"
#include "runtime/runtime_internal.h"

#define M3MSA_RUNTIME_REQUIRE_GPUS(n)                                                   \
  do {                                                                                  \
    const int visible_ = ::m3msa::cuda_device_count();                                  \
    if (visible_ < (n)) {                                                               \
      GTEST_SKIP() << "needs " << (n) << " CUDA device(s), " << visible_ << " visible"; \
    }                                                                                   \
  } while (0)

namespace m3msa::rtgpu {

using testkit::MasterModel;
using testkit::StepMeta;

inline constexpr double kAbsTol = 1.0 / 64;
inline constexpr double kMlpRowL2Tol = 1.0 / 32;
inline constexpr double kMlpAbsTol = 0.25;
inline constexpr double kRelTol = 1.0 / 32;
inline constexpr int64_t kMaxContext = 2048;

// ---- A model the CUDA kernels run: 128-d heads, blocks of 128 tokens ----

inline ModelConfig gpu_model(int intermediate = 256) {
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

inline RuntimeConfig gpu_config() {
  RuntimeConfig c;
  c.model = gpu_model();
  c.token_buckets = {1, 2, 4, 8, 16};
  c.query_lens = {1, 2, 4};
  c.max_requests = 16;
  c.max_context = kMaxContext;
  c.threads = 2;
  return c;
}

inline int64_t max_blocks() {
  return kMaxContext / 128;
}

inline int64_t num_pages(const RuntimeConfig& c) {
  return int64_t{c.max_requests} * max_blocks() + 3;
}

struct Shape {
  std::vector<int32_t> lens;
  int q_len;
};

// Decode steps: speculative rows with a padding request, plain decode with short and
// block-boundary contexts, 4 rows per request, and a full 16-row step.
inline std::vector<Shape> default_shapes() {
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

inline Scenario make_scenario(uint64_t seed, const std::vector<Shape>& shapes = default_shapes()) {
  Scenario s;
  s.config = gpu_config();
  const ModelConfig& m = s.config.model;
  const int64_t pages = num_pages(s.config);
  s.master = testkit::make_master(m, pages, seed, /*mlp_on_last_layer=*/true);
  s.index_perm = testkit::page_permutation(pages, seed + 1);
  s.kv_perm = testkit::page_permutation(pages, seed + 2);
  testkit::SplitMix64 rng(seed + 3);
  for (const Shape& shape : shapes) {
    s.steps.push_back(testkit::make_step(shape.lens, shape.q_len, m.block_size, max_blocks(),
                                         s.index_perm, s.kv_perm));
    const std::size_t n = shape.lens.size() * static_cast<std::size_t>(shape.q_len) * m.hidden;
    std::vector<uint16_t> h(n), r(n);
    for (std::size_t i = 0; i < n; ++i) {
      h[i] = float_to_bf16(rng.signed_unit());
      r[i] = float_to_bf16(rng.signed_unit());
    }
    s.hidden_in.push_back(h);
    s.residual_in.push_back(r);
  }
  return s;
}

// ---- Device copies ----

inline TensorView upload_view(std::vector<DeviceTensor>& keep, const TensorView& host, int device) {
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

inline DeviceModel upload_model(const testkit::RankModel& host, int device) {
  DeviceModel d;
  auto up = [&](const TensorView& v) { return upload_view(d.storage, v, device); };
  for (const LayerWeights& h : host.weights.layers) {
    d.weights.layers.push_back(map_tensors(h, up));
  }
  return d;
}

template <typename T>
inline std::vector<T> download(const TensorView& view) {
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
inline std::vector<T> host_values(const TensorView& view) {
  const T* p = view.ptr<const T>();
  return std::vector<T>(p, p + view.numel());
}

inline void upload_into(const TensorView& device_view, const void* host, std::size_t bytes) {
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

inline DeviceBatch device_batch(const BatchMeta& host, int device) {
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
inline void compare_bf16(Check& c, const uint16_t* got, const uint16_t* want, int64_t rows,
                         int64_t cols, double abs_tol, double rel_tol,
                         const std::vector<bool>& skip, const std::string& what) {
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
inline void compare_bf16_rows_l2(Check& c, const uint16_t* got, const uint16_t* want, int64_t rows,
                                 int64_t cols, const std::vector<bool>& skip,
                                 const std::string& what) {
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

// The slots a step writes, per cache: (page, offset) pairs from both slot mappings.
inline std::set<int64_t> written_slots(const std::vector<StepMeta>& steps, bool index) {
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
inline void compare_caches(const SparseConfig& sc, const testkit::RankModel& cpu,
                           const DeviceModel& gpu, const std::vector<StepMeta>& steps) {
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

}  // namespace m3msa::rtgpu
