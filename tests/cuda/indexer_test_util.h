// Helpers of the CUDA indexer tests: running the CPU oracle, running the GPU indexer through the
// low-level plan/run API, and the near-tie comparison of docs/spec.md section 4.
//
// Near-tie rule. The GPU sums each token's 128 products in tensor-core order, the CPU in dimension
// order, so two blocks whose scores differ by a few fp32 roundings may swap across the k-th place.
// Selections are compared as sets; a block that is in one set and not the other is accepted only
// when its CPU score is within kTieTolerance * max(1, |S_k|) of the CPU's k-th selected score S_k
// (testkit::near_tie; 1e-3: the fp32 reordering error of a 128-term dot product of unit-scale
// inputs is ~1e-5 relative; the margin covers heavy-tailed sums). Such swaps are counted and
// reported; any other difference fails, as does anything structural: unwritten entries, ids outside
// [0, nb), repeats, -1 inside the valid prefix, a missing forced block, a wrong count of valid
// entries.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/indexer.h"
#include "m3msa/backend.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/cuda_backend.h"
#include "m3msa/error.h"
#include "m3msa/sort_key.h"
#include "m3msa/synthetic.h"
#include "m3msa/testing/checks.h"
#include "m3msa/testing/splitmix.h"
#include "test_env.h"

namespace m3msa::idxtest {

#define M3MSA_INDEXER_REQUIRE_GPU()                                                          \
  do {                                                                                       \
    if (::m3msa::cuda_device_count() == 0) {                                                 \
      GTEST_SKIP() << "no CUDA device visible (cuda_device_count() == 0): GPU test skipped"; \
    }                                                                                        \
  } while (0)

// The suite's stream of the test kit's splitmix64.
using Rng = testkit::SaltedRng<5>;

inline constexpr double kTieTolerance = testkit::kSelectionTieTolerance;
inline constexpr uint8_t kPoisonByte = 0x5A;  // int32 0x5A5A5A5A: never a valid entry

// test_small() (test_env.h): only the range decode_spec draws contexts from shrinks; explicit
// seq_lens, the number of requests and every check stay as they are.

inline SyntheticSpec decode_spec(int reqs, int q_len, int64_t min_ctx, int64_t max_ctx, DType dtype,
                                 int padding, uint64_t seed, int topk = 16) {
  if (test_small()) {
    min_ctx = std::min(min_ctx, kSmallTestContext);
    max_ctx = std::min(max_ctx, kSmallTestContext);
  }
  SyntheticSpec spec;
  spec.config.topk = topk;
  spec.kind = BatchKind::kDecode;
  spec.num_reqs = reqs;
  spec.q_len = q_len;
  spec.min_context = min_ctx;
  spec.max_context = max_ctx;
  spec.padding_reqs = padding;
  spec.index_dtype = dtype;
  spec.make_kv_cache = false;  // the indexer never reads the main cache
  spec.seed = seed;
  return spec;
}

// CPU oracle: selection [rows, H, k] and scores [rows, H, table_cols].
struct CpuResult {
  HostTensor topk;
  HostTensor scores;
};

inline CpuResult run_cpu(const SyntheticCase& c) {
  CpuResult r;
  const int64_t rows = c.num_rows();
  const SparseConfig& cfg = c.config;
  r.topk = HostTensor(DType::kI32, {rows, cfg.index_heads, cfg.topk});
  cpu::select_topk(cfg, c.indexer_args(r.topk.view()));
  r.scores = HostTensor(DType::kF32, {rows, cfg.index_heads, c.index_block_table.shape()[1]});
  cpu::score_blocks(cfg, c.indexer_args(r.topk.view()), r.scores.view());
  return r;
}

// Low-level GPU runner: one plan, one workspace, the launch on a stream.
class GpuIndexer {
 public:
  GpuIndexer(const SparseConfig& config, const PlanLimits& limits)
      : plan_(cuda::plan_indexer(config, limits, 0)), workspace_(plan_.workspace_bytes) {
    cuda::init_indexer_workspace(plan_, workspace_.data(), stream_.get());
    stream_.synchronize();
  }
  void launch(const SparseConfig& config, const IndexerArgs& args,
              IndexerVariant variant = IndexerVariant::kFused) {
    cuda::launch_indexer(plan_, config, args, variant, workspace_.data(), stream_.get());
  }
  void sync() { stream_.synchronize(); }
  uint32_t status(bool clear = true) {
    return cuda::read_indexer_status(plan_, workspace_.data(), stream_.get(), clear);
  }
  const cuda::IndexerPlan& plan() const { return plan_; }
  cudaStream_t stream() const { return stream_.get(); }
  void* workspace() const { return workspace_.data(); }

 private:
  cuda::Stream stream_;
  cuda::IndexerPlan plan_;
  cuda::DeviceBuffer workspace_;
};

inline PlanLimits limits_for(const SyntheticCase& c, int64_t extra_context = 0) {
  PlanLimits l;
  l.max_reqs = std::max(1, c.batch.num_reqs);
  l.max_q_len = c.batch.kind == BatchKind::kDecode ? c.batch.q_len : 1;
  l.max_rows = std::max<int64_t>(c.num_rows(), int64_t{l.max_reqs} * l.max_q_len);
  l.max_context = c.index_block_table.shape()[1] * int64_t{c.config.block_size} + extra_context;
  return l;
}

// Runs the GPU indexer on a device copy of `c` with a poisoned output; returns the host result.
inline HostTensor run_gpu(const SyntheticCase& c, IndexerVariant variant = IndexerVariant::kFused,
                          uint32_t* status = nullptr) {
  DeviceCase d = upload(c);
  DeviceTensor topk(DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk});
  fill_device_bytes(topk.view(), kPoisonByte);
  GpuIndexer gpu(c.config, limits_for(c));
  gpu.launch(c.config, d.indexer_args(topk.view()), variant);
  gpu.sync();
  const uint32_t st = gpu.status();
  if (status) *status = st;
  HostTensor out;
  copy_to_host(topk.view(), out);
  return out;
}

struct Comparison {
  int64_t rows_checked = 0;
  int64_t swaps = 0;     // accepted near-tie differences (pairs)
  int64_t failures = 0;  // everything else
  std::string first_failure;
  double worst_swap_gap = 0.0;  // largest |S(b) - S_k| / max(1, |S_k|) among accepted swaps

  void fail(const std::string& what) {
    if (failures++ == 0) first_failure = what;
  }
  std::string summary() const {
    std::ostringstream out;
    out << rows_checked << " (row, head) checked, " << swaps << " near-tie swaps (worst gap "
        << worst_swap_gap << "), " << failures << " failures";
    if (failures) out << "; first: " << first_failure;
    return out.str();
  }
};

// Compares a GPU selection with the CPU one under the near-tie rule (header comment).
inline Comparison compare_selections(const SyntheticCase& c, const HostTensor& gpu,
                                     const CpuResult& cpu) {
  Comparison cmp;
  const SparseConfig& cfg = c.config;
  const int H = cfg.index_heads;
  const int k = cfg.topk;
  const int64_t cols = cpu.scores.shape()[2];
  const std::vector<RowPosition> rows = row_positions(c.batch);
  for (int64_t row = 0; row < static_cast<int64_t>(rows.size()); ++row) {
    const int64_t nb = visible_blocks(rows[row].pos, cfg.block_size);
    const int64_t expect = std::min<int64_t>(k, nb);
    for (int h = 0; h < H; ++h) {
      ++cmp.rows_checked;
      const int32_t* g = gpu.ptr<int32_t>() + (row * H + h) * k;
      const int32_t* r = cpu.topk.ptr<int32_t>() + (row * H + h) * k;
      const float* s = cpu.scores.ptr<float>() + (row * H + h) * cols;
      std::ostringstream where;
      where << "row " << row << " (req " << rows[row].req << ", pos " << rows[row].pos << ", nb "
            << nb << ") head " << h << ": ";
      // Structure.
      std::set<int32_t> gset, rset;
      bool ok = true;
      for (int i = 0; i < k; ++i) {
        if (i < expect) {
          if (g[i] < 0 || g[i] >= nb || !gset.insert(g[i]).second) {
            cmp.fail(where.str() + "entry " + std::to_string(i) + " = " + std::to_string(g[i]) +
                     " is not a new block id in [0, nb)");
            ok = false;
            break;
          }
          rset.insert(r[i]);
        } else if (g[i] != -1) {
          cmp.fail(where.str() + "entry " + std::to_string(i) + " = " + std::to_string(g[i]) +
                   " should be -1 (valid count " + std::to_string(expect) + ")");
          ok = false;
          break;
        }
      }
      if (!ok) continue;
      for (int64_t b = 0; b < nb; ++b) {
        if (is_forced_block(b, nb, cfg.init_blocks, cfg.local_blocks) && !gset.count(b)) {
          cmp.fail(where.str() + "forced block " + std::to_string(b) + " missing");
          ok = false;
        }
      }
      if (!ok) continue;
      // The CPU's k-th selected scored (non-forced) block.
      double kth = 0.0;
      bool have_kth = false;
      for (int i = static_cast<int>(expect) - 1; i >= 0; --i) {
        if (!is_forced_block(r[i], nb, cfg.init_blocks, cfg.local_blocks)) {
          kth = s[r[i]];
          have_kth = true;
          break;
        }
      }
      for (int32_t b : gset) {
        if (rset.count(b)) continue;
        // b (GPU only) must tie with the k-th, and so must some CPU-only block (counted below).
        const double sb = s[b];
        const double gap = std::fabs(sb - kth) / std::max(1.0, std::fabs(kth));
        if (!have_kth || !testkit::near_tie(sb, kth)) {
          std::ostringstream msg;
          msg << where.str() << "GPU selected block " << b << " (CPU score " << sb
              << ") instead of a CPU block; CPU k-th score " << kth << ", gap " << gap;
          cmp.fail(msg.str());
          ok = false;
        } else {
          ++cmp.swaps;
          cmp.worst_swap_gap = std::max(cmp.worst_swap_gap, gap);
        }
      }
      for (int32_t b : rset) {
        if (gset.count(b)) continue;
        const double sb = s[b];
        const double gap = std::fabs(sb - kth) / std::max(1.0, std::fabs(kth));
        if (!testkit::near_tie(sb, kth)) {
          std::ostringstream msg;
          msg << where.str() << "GPU dropped CPU block " << b << " (score " << sb
              << "), CPU k-th score " << kth << ", gap " << gap;
          cmp.fail(msg.str());
          ok = false;
        }
      }
      if (!ok) continue;
      // Order: forced blocks first, then non-increasing CPU score (up to the tolerance).
      for (int i = 0; i + 1 < expect; ++i) {
        const bool f0 = is_forced_block(g[i], nb, cfg.init_blocks, cfg.local_blocks);
        const bool f1 = is_forced_block(g[i + 1], nb, cfg.init_blocks, cfg.local_blocks);
        if (!f0 && f1) {
          cmp.fail(where.str() + "a forced block follows a scored one");
          break;
        }
        if (f0 || f1) continue;
        const double a = s[g[i]], b = s[g[i + 1]];
        if (std::isnan(a) && !std::isnan(b)) {
          cmp.fail(where.str() + "a NaN-scored block precedes a scored one");
          break;
        }
        if (!std::isnan(a) && !std::isnan(b) &&
            a < b - kTieTolerance * std::max(1.0, std::fabs(b))) {
          std::ostringstream msg;
          msg << where.str() << "entries " << i << ", " << i + 1 << " out of order (" << a << " < "
              << b << ")";
          cmp.fail(msg.str());
          break;
        }
      }
    }
  }
  return cmp;
}

// Expects `body` to throw m3msa::Error with `code` and a message containing `needle`.
template <typename Body>
void expect_error(Body&& body, ErrorCode code, const std::string& needle) {
  try {
    body();
    ADD_FAILURE() << "expected an Error mentioning '" << needle << "', got none";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message does not mention '" << needle << "': " << e.what();
  }
}

}  // namespace m3msa::idxtest
