// Helpers of the CUDA attention and preprocessing tests: device copies of host tensors, random
// valid selections, and the bf16 comparison that prints the worst element.
//
// Tolerance (written in bf16 units): |gpu - ref| <= 2 ulp_bf16(max(|ref|, m / 4)), where m is the
// largest |ref| of the same (row, head) vector. The floor m / 4 exists because an element near
// zero has an ulp far below the rounding noise of its 2048-term sum; the fp8 path multiplies f16
// weights (2^-11 relative), whose noise stays below 2^-9 m at 6 sigma.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "cuda/attention.h"
#include "cuda/common.cuh"
#include "m3msa/backend.h"
#include "m3msa/dtype.h"
#include "m3msa/synthetic.h"
#include "m3msa/tensor.h"
#include "m3msa/testing/splitmix.h"

namespace m3msa::attntest {

#define M3MSA_REQUIRE_GPU()                                                                  \
  do {                                                                                       \
    if (::m3msa::cuda_device_count() == 0) {                                                 \
      GTEST_SKIP() << "no CUDA device visible (cuda_device_count() == 0): GPU test skipped"; \
    }                                                                                        \
  } while (0)

// The suite's stream of the test kit's splitmix64.
using Rng = testkit::SaltedRng<7>;

// A device copy of a host tensor; `view` is the device view with the host's shape and dtype.
struct DevTensor {
  cuda::DeviceBuffer buffer;
  TensorView view;
};

// The current device's SM count, from the driver (not from a plan under test).
inline int device_sms() {
  int device = 0;
  int sms = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

inline DevTensor to_dev(const HostTensor& host) {
  DevTensor d;
  if (host.empty()) return d;
  d.buffer = cuda::DeviceBuffer(std::max<size_t>(host.nbytes(), 1));
  CUDA_CHECK(cudaMemcpy(d.buffer.data(), host.data(), host.nbytes(), cudaMemcpyHostToDevice));
  d.view = host.view();
  d.view.data = d.buffer.data();
  d.view.device = Device::cuda(0);
  return d;
}

inline void copy_into(const HostTensor& host, const DevTensor& dev) {
  ASSERT_EQ(host.nbytes(), dev.view.nbytes());
  CUDA_CHECK(cudaMemcpy(dev.view.data, host.data(), host.nbytes(), cudaMemcpyHostToDevice));
}

inline HostTensor to_host(const TensorView& view) {
  HostTensor host(view.dtype, view.sizes());
  CUDA_CHECK(cudaMemcpy(host.data(), view.data, host.nbytes(), cudaMemcpyDeviceToHost));
  return host;
}

// A device output tensor filled with 0xFF bytes (bf16 NaN): any element the kernel leaves unwritten
// fails the comparison.
inline DevTensor poisoned(DType dtype, const std::vector<int64_t>& shape) {
  HostTensor host(dtype, shape);
  host.fill_bytes(0xFF);
  return to_dev(host);
}

// The device side of the attention inputs of a SyntheticCase.
struct DevAttention {
  DevTensor seq_lens, cu_seqlens_q, context_lens, kv_table, q, kv_cache;
  BatchMeta batch;
  KVCache kv;

  explicit DevAttention(const SyntheticCase& c) {
    seq_lens = to_dev(c.seq_lens);
    cu_seqlens_q = to_dev(c.cu_seqlens_q);
    context_lens = to_dev(c.context_lens);
    kv_table = to_dev(c.kv_block_table);
    q = to_dev(c.q);
    kv_cache = to_dev(c.kv_cache);
    batch = c.batch;
    batch.seq_lens = seq_lens.view;
    batch.cu_seqlens_q = cu_seqlens_q.view;
    batch.context_lens = context_lens.view;
    batch.kv_block_table = kv_table.view;
    batch.index_block_table = {};
    batch.slot_mapping = {};
    batch.index_slot_mapping = {};
    kv = {kv_cache.view, c.k_scale, c.v_scale};
  }
  AttentionArgs args(const TensorView& topk, const TensorView& out) const {
    AttentionArgs a;
    a.q = q.view;
    a.kv_cache = kv;
    a.batch = batch;
    a.topk_idx = topk;
    a.out = out;
    return a;
  }
};

// A valid random selection [rows, kv_heads, k]: min(k, nb) distinct visible blocks (the row's own
// block always among them), in random order, then -1. Dead rows get all -1. With `cover_all` every
// row whose nb <= k gets all of its blocks (the dense-equivalence case).
inline HostTensor random_selection(const SyntheticCase& c, uint64_t seed) {
  const SparseConfig& cfg = c.config;
  const std::vector<RowPosition> rows = row_positions(c.batch);
  HostTensor topk(DType::kI32, {static_cast<int64_t>(rows.size()), cfg.kv_heads, cfg.topk});
  int32_t* out = topk.ptr<int32_t>();
  Rng rng(seed);
  std::vector<int32_t> pool;
  for (size_t r = 0; r < rows.size(); ++r) {
    const int64_t nb = visible_blocks(rows[r].pos, cfg.block_size);
    for (int h = 0; h < cfg.kv_heads; ++h) {
      int32_t* e = out + (r * cfg.kv_heads + h) * cfg.topk;
      std::fill(e, e + cfg.topk, -1);
      if (nb == 0) continue;
      const int take = static_cast<int>(std::min<int64_t>(cfg.topk, nb));
      std::vector<int32_t> chosen{static_cast<int32_t>(nb - 1)};
      if (nb <= 4 * cfg.topk) {
        pool.resize(static_cast<size_t>(nb - 1));
        std::iota(pool.begin(), pool.end(), 0);
        for (int i = 0; i + 1 < take; ++i) {
          const int64_t j = rng.range(i, static_cast<int64_t>(pool.size()) - 1);
          std::swap(pool[static_cast<size_t>(i)], pool[static_cast<size_t>(j)]);
          chosen.push_back(pool[static_cast<size_t>(i)]);
        }
      } else {
        while (static_cast<int>(chosen.size()) < take) {
          const auto b = static_cast<int32_t>(rng.range(0, nb - 2));
          if (std::find(chosen.begin(), chosen.end(), b) == chosen.end()) chosen.push_back(b);
        }
      }
      for (int i = take - 1; i > 0; --i) {
        std::swap(chosen[static_cast<size_t>(i)], chosen[static_cast<size_t>(rng.range(0, i))]);
      }
      std::copy(chosen.begin(), chosen.end(), e);
    }
  }
  return topk;
}

inline float bf16_ulp(float x) {
  x = std::fabs(x);
  if (x < 1e-30f) return std::ldexp(1.0f, -133);
  int exponent = 0;
  std::frexp(x, &exponent);  // x = f * 2^exponent, f in [0.5, 1)
  return std::ldexp(1.0f, exponent - 8);
}

struct CompareResult {
  bool ok = true;
  int64_t bad = 0;
  double worst_ratio = 0.0;  // max |diff| / tol
  std::string worst;         // coordinates and values of the worst element
};

// Compares [rows, heads, dim] bf16 tensors with the tolerance of this file's header.
inline CompareResult compare_bf16(const HostTensor& gpu, const HostTensor& ref, double ulps = 2.0,
                                  double floor_fraction = 0.25) {
  CompareResult result;
  const int64_t rows = ref.shape()[0];
  const int64_t heads = ref.shape()[1];
  const int64_t dim = ref.shape()[2];
  const uint16_t* g = gpu.ptr<uint16_t>();
  const uint16_t* r = ref.ptr<uint16_t>();
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = (row * heads + h) * dim;
      float vec_max = 0.0f;
      for (int64_t d = 0; d < dim; ++d)
        vec_max = std::max(vec_max, std::fabs(bf16_to_float(r[base + d])));
      for (int64_t d = 0; d < dim; ++d) {
        const float rv = bf16_to_float(r[base + d]);
        const float gv = bf16_to_float(g[base + d]);
        const double tol =
            ulps * bf16_ulp(std::max(std::fabs(rv), static_cast<float>(floor_fraction * vec_max)));
        const double diff = std::isnan(gv) || std::isnan(rv)
                                ? (std::isnan(gv) && std::isnan(rv) ? 0.0 : INFINITY)
                                : std::fabs(static_cast<double>(gv) - rv);
        const double ratio = tol > 0 ? diff / tol : (diff > 0 ? INFINITY : 0.0);
        if (ratio > 1.0) {
          result.ok = false;
          ++result.bad;
        }
        if (ratio > result.worst_ratio || (std::isinf(ratio) && result.worst.empty())) {
          result.worst_ratio = ratio;
          char buf[256];
          std::snprintf(buf, sizeof(buf),
                        "row %lld head %lld dim %lld: gpu %.8g ref %.8g |diff| %.3g tol %.3g",
                        static_cast<long long>(row), static_cast<long long>(h),
                        static_cast<long long>(d), gv, rv, diff, tol);
          result.worst = buf;
        }
      }
    }
  }
  return result;
}

// A zeroed workspace of the CUDA attention for up to 64 requests of up to kMaxQueryLen rows.
inline cuda::DeviceBuffer attention_workspace(const SparseConfig& cfg) {
  PlanLimits limits;
  limits.max_reqs = 64;
  limits.max_q_len = kMaxQueryLen;
  const size_t bytes = cuda::attention_workspace_size(cfg, limits);
  cuda::DeviceBuffer ws(bytes);
  CUDA_CHECK(cudaMemset(ws.data(), 0, bytes));
  return ws;
}

inline bool bitwise_equal(const HostTensor& a, const HostTensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

}  // namespace m3msa::attntest
