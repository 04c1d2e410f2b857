// The CUDA block-sparse attention against the CPU reference (docs/spec.md section 5): randomized
// decode shapes (batch 1..64, q_len 1..8, contexts 1..256K, padding requests, partly filled own
// blocks, bf16 and fp8 KV with scales != 1), prefill rows, dense causal attention, nb <= k ==
// dense, rows without keys, graph capture + replay with new metadata == eager, and run-to-run bit
// identity. Every output is poisoned first. Every test skips without a GPU.
//
// M3MSA_TEST_ATTENTION_TUNING (e.g. "splitp=1,cluster=0,pdl=1") runs the suite with other launcher
// knobs (attention.h); unset, the default tuning of launch_attention is tested.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "attention_test_util.h"
#include "cuda/attention.h"
#include "cuda/common.cuh"
#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "m3msa/synthetic.h"
#include "test_env.h"

namespace m3msa {
namespace {

using attntest::compare_bf16;
using attntest::DevAttention;
using attntest::device_sms;
using attntest::DevTensor;
using attntest::poisoned;
using attntest::random_selection;
using attntest::to_dev;
using attntest::to_host;

const cuda::AttentionTuning& test_tuning() {
  static const cuda::AttentionTuning tuning = [] {
    const char* text = std::getenv("M3MSA_TEST_ATTENTION_TUNING");
    return text != nullptr ? cuda::AttentionTuning::parse(text) : cuda::default_attention_tuning();
  }();
  return tuning;
}

void launch(const SparseConfig& cfg, const AttentionArgs& args, const cuda::DeviceBuffer& ws,
            cudaStream_t stream, const cuda::AttentionTuning& tuning = test_tuning()) {
  cuda::launch_attention_tuned(cfg, args, ws.data(), ws.bytes(), stream, tuning);
}

// One rank of M3 at TP 8: 8 query heads on one KV head, one index head.
SparseConfig tp8_rank_config() {
  SparseConfig cfg;
  cfg.q_heads = 8;
  cfg.kv_heads = 1;
  cfg.index_heads = 1;
  return cfg;
}

// A workspace for one device, zeroed once (the launcher's contract).
struct Workspace {
  cuda::DeviceBuffer buffer;
  explicit Workspace(const SparseConfig& config) {
    PlanLimits limits;
    limits.max_reqs = 64;
    limits.max_q_len = kMaxQueryLen;
    const size_t bytes = cuda::attention_workspace_size(config, limits);
    buffer = cuda::DeviceBuffer(bytes);
    CUDA_CHECK(cudaMemset(buffer.data(), 0, bytes));
  }
};

struct RunOut {
  HostTensor gpu;
  HostTensor ref;
};

// The GPU kernel (eager, default stream) on one case, into a poisoned output.
HostTensor run_gpu(const SyntheticCase& c, const HostTensor* topk,
                   const cuda::AttentionTuning& tuning = test_tuning()) {
  const SparseConfig& cfg = c.config;
  DevAttention dev(c);
  DevTensor topk_dev;
  if (topk != nullptr) topk_dev = to_dev(*topk);
  DevTensor out = poisoned(DType::kBF16, {c.num_rows(), cfg.q_heads, cfg.head_dim});
  Workspace ws(cfg);
  launch(cfg, dev.args(topk_dev.view, out.view), ws.buffer, nullptr, tuning);
  CUDA_CHECK(cudaDeviceSynchronize());
  return to_host(out.view);
}

// The CPU reference (sparse, or dense causal) on one case.
HostTensor run_ref(const SyntheticCase& c, const HostTensor* topk, bool dense_ref) {
  const SparseConfig& cfg = c.config;
  HostTensor ref(DType::kBF16, {c.num_rows(), cfg.q_heads, cfg.head_dim});
  ref.fill_bytes(0xFF);
  const AttentionArgs args =
      c.attention_args(topk != nullptr ? topk->view() : TensorView{}, ref.view());
  if (dense_ref) {
    cpu::dense_attention(cfg, args);
  } else {
    cpu::sparse_attention(cfg, args);
  }
  return ref;
}

// Runs the GPU kernel and the CPU reference on one case.
RunOut run_case(const SyntheticCase& c, const HostTensor* topk, bool dense_ref = false,
                const cuda::AttentionTuning& tuning = test_tuning()) {
  RunOut result;
  result.gpu = run_gpu(c, topk, tuning);
  result.ref = run_ref(c, topk, dense_ref);
  return result;
}

struct DecodeShape {
  int reqs;
  int q_len;
  int64_t min_context;
  int64_t max_context;
  int padding;
  DType kv;
  float k_scale;
  float v_scale;
  uint64_t seed;
};

std::string describe(const DecodeShape& s) {
  char buf[200];
  std::snprintf(buf, sizeof(buf),
                "reqs %d q_len %d context [%lld, %lld] padding %d kv %s "
                "k_scale %g v_scale %g seed %llu",
                s.reqs, s.q_len, static_cast<long long>(s.min_context),
                static_cast<long long>(s.max_context), s.padding, dtype_name(s.kv), s.k_scale,
                s.v_scale, static_cast<unsigned long long>(s.seed));
  return buf;
}

SyntheticCase decode_case(const DecodeShape& s, SparseConfig cfg = {}) {
  SyntheticSpec spec;
  spec.config = cfg;
  spec.num_reqs = s.reqs;
  spec.q_len = s.q_len;
  spec.min_context = s.min_context;
  spec.max_context = s.max_context;
  spec.padding_reqs = s.padding;
  spec.kv_dtype = s.kv;
  spec.k_scale = s.k_scale;
  spec.v_scale = s.v_scale;
  spec.make_index_cache = false;
  spec.seed = s.seed;
  return make_synthetic_case(spec);
}

void expect_close(const RunOut& r, const std::string& what) {
  const attntest::CompareResult cmp = compare_bf16(r.gpu, r.ref);
  EXPECT_TRUE(cmp.ok) << what << ": " << cmp.bad << " elements out of tolerance; worst "
                      << cmp.worst << " (" << cmp.worst_ratio << " x tol)";
  std::printf("[ info ] %s: worst %.3f x tol (%s)\n", what.c_str(), cmp.worst_ratio,
              cmp.worst.c_str());
}

TEST(CudaSparseAttention, RandomizedDecodeMatchesCpuReference) {
  M3MSA_REQUIRE_GPU();
  std::printf("[ info ] attention tuning under test: %s\n", test_tuning().name().c_str());
  const DType bf16 = DType::kBF16;
  const DType fp8 = DType::kFP8E4M3;
  const std::vector<DecodeShape> shapes = {
      {1, 1, 1, 1, 0, bf16, 1.0f, 1.0f, 1},            // one token: pos 0
      {1, 1, 262144, 262144, 0, fp8, 0.5f, 2.0f, 2},   // 256K, fp8, scales != 1
      {1, 4, 100000, 100000, 0, bf16, 1.0f, 1.0f, 3},  // long bf16, speculative rows
      {3, 8, 1, 300, 0, bf16, 1.0f, 1.0f, 4},          // q_len 8 across block edges
      {5, 1, 127, 130, 0, fp8, 1.0f, 1.0f, 5},         // own block partly filled at 128
      {8, 3, 1, 65536, 2, bf16, 1.0f, 1.0f, 6},        // padding requests
      {17, 2, 1, 20000, 0, fp8, 2.0f, 0.25f, 7},
      {64, 1, 1, 4096, 5, fp8, 0.75f, 1.5f, 8},  // one split per unit
      {64, 4, 100, 2000, 7, bf16, 1.0f, 1.0f, 9},
      {32, 1, 4000, 9000, 0, bf16, 1.0f, 1.0f, 10},
  };
  for (const DecodeShape& s : shapes) {
    const SyntheticCase c = decode_case(s);
    const HostTensor topk = random_selection(c, s.seed * 31 + 1);
    expect_close(run_case(c, &topk), describe(s));
  }
}

// TP = 8 leaves 8 query heads on one KV head: a partly used m16 tile.
TEST(CudaSparseAttention, SmallGroupMatchesCpuReference) {
  M3MSA_REQUIRE_GPU();
  const SparseConfig cfg = tp8_rank_config();
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    const DecodeShape s{6, 2, 1, 5000, 1, kv, 1.25f, 0.5f, 21};
    const SyntheticCase c = decode_case(s, cfg);
    const HostTensor topk = random_selection(c, 77);
    expect_close(run_case(c, &topk), "group 8: " + describe(s));
  }
}

// The plans of few rows: a unit's splits in one cluster of 2 .. 16 CTAs (each rank merging a
// share of the output dims) or merged through the workspace, at M3's TP 1 / 4 / 8 per-rank head
// shapes, with rows whose selection leaves splits empty (a short context) and padding requests.
TEST(CudaSparseAttention, ClusterPlansMatchCpuReference) {
  M3MSA_REQUIRE_GPU();
  struct Heads {
    int q, kv, topk;
  };
  // M3's ranks at TP 1 / 4 / 8, and a group of 4 heads with a top-4 selection (the runtime tests'
  // model at TP 1 and TP 2: four one-block splits per cluster).
  for (const Heads heads :
       {Heads{64, 4, 16}, Heads{16, 1, 16}, Heads{8, 1, 16}, Heads{8, 2, 4}, Heads{4, 1, 4}}) {
    SparseConfig cfg;
    cfg.q_heads = heads.q;
    cfg.kv_heads = heads.kv;
    cfg.index_heads = heads.kv;
    cfg.topk = heads.topk;
    for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
      for (const DecodeShape& s : {DecodeShape{1, 1, 40000, 40000, 0, kv, 1.0f, 1.0f, 61},
                                   DecodeShape{3, 1, 100, 1500, 1, kv, 0.75f, 1.5f, 62},
                                   DecodeShape{16, 1, 5, 2047, 0, kv, 1.0f, 1.0f, 63}}) {
        const SyntheticCase c = decode_case(s, cfg);
        const HostTensor topk = random_selection(c, s.seed * 7 + 3);
        const HostTensor ref = run_ref(c, &topk, false);
        for (int max_cluster : {0, 2, 4, 8, 16}) {
          cuda::AttentionTuning tuning;
          tuning.max_cluster = max_cluster;
          const cuda::AttentionPlanInfo plan =
              cuda::attention_plan_info(cfg, c.num_rows(), 1, false, kv == DType::kFP8E4M3, tuning);
          const std::string what =
              "heads " + std::to_string(heads.q) + "/" + std::to_string(heads.kv) + " " +
              describe(s) + " cluster " + std::to_string(max_cluster) + ": plan " +
              std::to_string(plan.splits) + " splits" + (plan.cluster ? " in a cluster" : "");
          EXPECT_LE(plan.splits, cfg.topk) << what;
          if (max_cluster < 2) {
            EXPECT_FALSE(plan.cluster) << what;
          }
          if (plan.cluster) {
            EXPECT_LE(plan.splits, max_cluster) << what;
          }
          expect_close(RunOut{run_gpu(c, &topk, tuning), ref}, what);
        }
      }
    }
  }
}

// The balanced plan (one wave of CTAs, each an equal share of the flattened (unit, entry) list, a
// unit cut by a share's boundary merged from its two parts) against the CPU reference and against
// the plans without it (balance 0), as the default takes it (balance 1: up to 4/3 of a wave of
// units) and beyond (balance 2): exactly one wave (never balanced), just beyond it, 1.1 / 1.35
// / 1.5 / 2 waves (2: every share whole units), 0.3 and 0.03 waves (never balanced), q_len 4 rows
// with their own selections, a top-7 selection (shares cut units at odd entries), short rows whose
// selections end early, and padding requests. Each balanced run is repeated: the arrival
// counters must be left at zero for the next launch (bit-identical).
TEST(CudaSparseAttention, BalancedPlanMatchesCpuReference) {
  M3MSA_REQUIRE_GPU();
  struct Case {
    int waves_x100;  // rows * kv heads = waves_x100 / 100 of the slots, rounded down,
    int extra_reqs;  // then this many requests more
    int q_len;
    int topk;
    int padding;  // requests of length 0 among them
  };
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    const bool fp8 = kv == DType::kFP8E4M3;
    for (const Case& k : {Case{100, 0, 1, 16, 0}, Case{100, 1, 1, 16, 1}, Case{110, 0, 1, 16, 0},
                          Case{135, 0, 1, 16, 0}, Case{150, 0, 1, 16, 3}, Case{200, 0, 1, 16, 0},
                          Case{130, 0, 4, 16, 0}, Case{130, 0, 1, 7, 2}, Case{30, 0, 1, 16, 1},
                          Case{30, 0, 4, 16, 0}, Case{60, 0, 1, 7, 0}, Case{3, 0, 1, 16, 0}}) {
      SparseConfig cfg;  // M3 at TP 1: 4 KV heads
      cfg.topk = k.topk;
      const int slots = cuda::attention_plan_info(cfg, 1, 1, false, fp8, {}).slots;
      ASSERT_GT(slots, 0);
      const int rows = std::max(1, slots * k.waves_x100 / 100 / cfg.kv_heads);
      const int reqs = (rows + k.q_len - 1) / k.q_len + k.extra_reqs;
      const DecodeShape s{reqs, k.q_len, 1100, 2200, k.padding, kv, 0.75f, 1.25f, 83};
      const SyntheticCase c = decode_case(s, cfg);
      const HostTensor topk = random_selection(c, 89);
      const HostTensor ref = run_ref(c, &topk, false);
      const int64_t units = c.num_rows() * cfg.kv_heads;
      // (balance, max_cluster): without the balanced plan, beyond one wave, two splits in
      // clusters of two up to 4/3 of a wave, else (or without clusters) one CTA per unit.
      for (const auto& [balance, max_cluster] :
           {std::pair{1, 16}, std::pair{2, 16}, std::pair{0, 16}, std::pair{0, 0}}) {
        cuda::AttentionTuning tuning;
        tuning.balance = balance;
        tuning.max_cluster = max_cluster;
        const cuda::AttentionPlanInfo plan =
            cuda::attention_plan_info(cfg, c.num_rows(), k.q_len, false, fp8, tuning);
        const std::string what = describe(s) + " topk " + std::to_string(k.topk) + " balance " +
                                 std::to_string(balance) + " cluster " +
                                 std::to_string(max_cluster) + ": " + std::to_string(units) +
                                 " units on " + std::to_string(slots) + " slots, " +
                                 (plan.balanced ? "balanced" : "not balanced") + ", " +
                                 std::to_string(plan.ctas) + " CTAs";
        const bool beyond = units > slots;
        const bool expect_balanced =
            beyond && (balance == 2 || (balance == 1 && 3 * units <= int64_t{4} * slots));
        EXPECT_EQ(plan.balanced, expect_balanced) << what;
        if (expect_balanced) {
          EXPECT_EQ(plan.ctas, slots) << what;  // exactly one wave
        }
        if (beyond && !expect_balanced) {
          const bool two = max_cluster >= 2 && k.topk >= 4 && 3 * units <= int64_t{4} * slots;
          EXPECT_EQ(plan.splits, two ? 2 : 1) << what;
          EXPECT_EQ(plan.cluster, two) << what;
        }
        const HostTensor gpu = run_gpu(c, &topk, tuning);
        expect_close(RunOut{gpu, ref}, what);
        if (plan.balanced) {
          EXPECT_TRUE(attntest::bitwise_equal(gpu, run_gpu(c, &topk, tuning)))
              << what << ": a second run";
        }
      }
    }
  }
}

// The deep pipeline (one row per CTA, one CTA of 8 warps per SM, 192 KB of stages) forced, against
// the CPU reference: about one CTA per SM (whole units), fewer units (clustered splits), two waves
// of units, q_len 4 rows with their own selections, short rows, padding requests; each twice,
// bit-identical.
TEST(CudaSparseAttention, DeepPipelinePlansMatchCpuReference) {
  M3MSA_REQUIRE_GPU();
  cuda::AttentionTuning tuning;
  tuning.deep = 1;
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    const bool fp8 = kv == DType::kFP8E4M3;
    SparseConfig cfg;  // M3 at TP 1: 4 KV heads
    const int sms = device_sms();
    for (const DecodeShape& s : {DecodeShape{sms / 4, 1, 1100, 40000, 0, kv, 0.75f, 1.25f, 91},
                                 DecodeShape{3, 1, 100, 1500, 1, kv, 1.0f, 1.0f, 92},
                                 DecodeShape{sms / 2 + 1, 1, 5, 3000, 2, kv, 1.0f, 1.5f, 93},
                                 DecodeShape{sms / 16, 4, 600, 9000, 0, kv, 0.75f, 1.25f, 94}}) {
      const SyntheticCase c = decode_case(s, cfg);
      const HostTensor topk = random_selection(c, s.seed * 5 + 1);
      const cuda::AttentionPlanInfo plan =
          cuda::attention_plan_info(cfg, c.num_rows(), s.q_len, false, fp8, tuning);
      const std::string what = describe(s) + ": " + std::to_string(plan.splits) + " splits" +
                               (plan.cluster ? " in a cluster" : "") + ", " +
                               std::to_string(plan.ctas) + " CTAs";
      EXPECT_TRUE(plan.deep) << what;
      EXPECT_FALSE(plan.balanced) << what;
      EXPECT_EQ(plan.slots, sms) << what;  // one CTA per SM
      const HostTensor gpu = run_gpu(c, &topk, tuning);
      expect_close(RunOut{gpu, run_ref(c, &topk, false)}, what);
      EXPECT_TRUE(attntest::bitwise_equal(gpu, run_gpu(c, &topk, tuning)))
          << what << ": a second run";
    }
  }
}

// The default plan from half the SMs' count of units to one per SM (one row per CTA, a selection):
// one CTA per unit, the deep pipeline up to 2/3 of the SMs (fp8) or 3/5 (bf16); below, two or
// more splits; above one unit per SM, not deep. M3's ranks at TP 1 (4 KV heads) and TP 8 (one),
// against the CPU reference.
TEST(CudaSparseAttention, OneCtaPerUnitUpToOnePerSmMatchesCpuReference) {
  M3MSA_REQUIRE_GPU();
  for (const SparseConfig& cfg : {SparseConfig{}, tp8_rank_config()}) {
    for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
      const bool fp8 = kv == DType::kFP8E4M3;
      const int sms = device_sms();
      for (const int units :
           {sms / 2, sms / 2 + 2, sms * 3 / 5, sms * 2 / 3, sms * 3 / 4, sms, sms + cfg.kv_heads}) {
        const int reqs = std::max(1, units / cfg.kv_heads);
        const int64_t u = int64_t{reqs} * cfg.kv_heads;
        const cuda::AttentionPlanInfo plan =
            cuda::attention_plan_info(cfg, reqs, 1, false, fp8, {});
        const std::string what = std::string(dtype_name(kv)) + " " + std::to_string(u) +
                                 " units on " + std::to_string(sms) +
                                 " SMs: " + std::to_string(plan.splits) + " splits" +
                                 (plan.deep ? ", deep" : "");
        const bool one = 2 * u > sms && u <= sms;
        const bool deep = one && (fp8 ? 3 * u <= 2 * int64_t{sms} : 5 * u <= 3 * int64_t{sms});
        EXPECT_EQ(plan.deep, deep) << what;
        if (one) {
          EXPECT_EQ(plan.splits, 1) << what;
        } else if (u <= sms) {
          EXPECT_GE(plan.splits, 2) << what;
        }
        const DecodeShape s{reqs, 1, 2100, 4000, 0, kv, 0.75f, 1.25f, 97};
        const SyntheticCase c = decode_case(s, cfg);
        const HostTensor topk = random_selection(c, 101);
        expect_close(
            RunOut{run_gpu(c, &topk, cuda::default_attention_tuning()), run_ref(c, &topk, false)},
            what);
      }
    }
  }
}

// A block-table row longer than the 64 lines (2048 blocks) the cluster plan prefetches into L2
// beside the selection's read: 300,000 tokens, 2344 blocks, the own block 2343 always selected,
// so a lookup reads past the prefetched lines. One TP 8 rank (one KV head) keeps the cache small.
TEST(CudaSparseAttention, ClusterPlanWithALongTableRowMatchesCpuReference) {
  M3MSA_REQUIRE_GPU();
  const SparseConfig cfg = tp8_rank_config();
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    const DecodeShape s{1, 1, 300000, 300000, 0, kv, 0.5f, 0.25f, 67};
    const SyntheticCase c = decode_case(s, cfg);
    ASSERT_GT(c.kv_block_table.shape()[1], 2048) << describe(s);
    const HostTensor topk = random_selection(c, 71);
    const HostTensor ref = run_ref(c, &topk, false);
    for (int max_cluster : {0, 16}) {
      cuda::AttentionTuning tuning;
      tuning.max_cluster = max_cluster;
      expect_close(RunOut{run_gpu(c, &topk, tuning), ref},
                   describe(s) + " cluster " + std::to_string(max_cluster));
    }
  }
}

// The selection `topk` [rows, kv_heads, k] copied into a head-major device buffer [kv_heads,
// rows, k] and passed as the permuted view of it (read in place).
struct HeadMajorSelection {
  DevTensor buffer;
  TensorView view;
  explicit HeadMajorSelection(const HostTensor& topk) {
    const int64_t rows = topk.shape()[0];
    const int64_t heads = topk.shape()[1];
    const int64_t k = topk.shape()[2];
    HostTensor hm(DType::kI32, {heads, rows, k});
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < k; ++i) {
          hm.ptr<int32_t>()[(h * rows + r) * k + i] = topk.ptr<int32_t>()[(r * heads + h) * k + i];
        }
      }
    }
    buffer = to_dev(hm);
    view = buffer.view;
    view.shape[0] = rows;
    view.shape[1] = heads;
    view.shape[2] = k;
    view.strides[0] = k;
    view.strides[1] = rows * k;
    view.strides[2] = 1;
  }
};

// Speculative rows of one request share a CTA (up to 4 rows, the union of their selections read
// once): each row's own selection, one selection shared by the request's rows, groups with dead
// rows (q_len 3, 5) next to another request's rows, dense rows, top-32 selections (a union of 128
// candidates, two rounds of pages), a head-major selection view; the plans a tuning can reach
// (one CTA, split over the workspace or a 2- or 16-CTA cluster, the wave plan) and one row per
// CTA as a second oracle.
TEST(CudaSparseAttention, SpeculativeRowGroupsMatchCpuReference) {
  M3MSA_REQUIRE_GPU();
  std::vector<cuda::AttentionTuning> tunings(7);
  // Row groups are opt-in: tunings 0-4 take 4 rows per CTA.
  for (int i = 0; i < 5; ++i) tunings[i].max_row_tiles = 4;
  tunings[1].max_cluster = 0;  // split merge through the workspace
  tunings[2].max_splits = 16;  // the wave plan: many splits
  tunings[3].max_splits = 2;   // two splits, in a cluster where the device allows
  tunings[3].max_cluster = 2;
  tunings[4].max_splits = 16;  // many splits, in one cluster where the device allows
  tunings[4].max_cluster = 16;
  tunings[5].max_row_tiles = 2;
  tunings[6].max_row_tiles = 1;  // one row per CTA (the default)
  struct Shape {
    int topk;
    int q_len;
    int reqs;
  };
  std::vector<Shape> shapes;
  for (int q_len : {2, 3, 4, 5, 8}) {
    for (int reqs : {1, 3, 40}) {
      // Under compute-sanitizer: q_len 3 and 5 (groups with dead tiles), no 40-request batches.
      if (!test_small() || ((q_len == 3 || q_len == 5) && reqs < 40)) {
        shapes.push_back({16, q_len, reqs});
      }
    }
  }
  shapes.push_back({32, 4, 3});
  shapes.push_back({32, 3, 1});
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    for (const Shape& shape : shapes) {
      const int q_len = shape.q_len;
      const int reqs = shape.reqs;
      SparseConfig cfg;
      cfg.topk = shape.topk;
      // 40 requests stay short (the cache is uploaded once per case, the reference is on the CPU).
      const DecodeShape s{reqs,
                          q_len,
                          1,
                          reqs > 8 ? 6000 : (test_small() ? 4000 : 40000),
                          reqs > 1 ? 1 : 0,
                          kv,
                          1.5f,
                          0.75f,
                          static_cast<uint64_t>(100 + q_len * 7 + reqs + shape.topk)};
      const SyntheticCase c = decode_case(s, cfg);
      const HostTensor own = random_selection(c, s.seed);
      // Every row takes its request's first row's selection (later rows see every block the
      // first one does, so the selection stays well formed).
      HostTensor shared = own;
      {
        const int64_t per_row = int64_t{c.config.kv_heads} * c.config.topk;
        int32_t* e = shared.ptr<int32_t>();
        for (int64_t row = 0; row < c.num_rows(); ++row) {
          const int64_t first = row / q_len * q_len;
          std::copy(e + first * per_row, e + (first + 1) * per_row, e + row * per_row);
        }
      }
      const std::string name = describe(s) + " topk " + std::to_string(shape.topk);
      DevAttention dev(c);
      Workspace ws(cfg);
      // One launch on the case's device inputs (`topk` null: dense), into a poisoned output.
      auto gpu = [&](const TensorView& topk, const cuda::AttentionTuning& tuning) {
        DevTensor out = poisoned(DType::kBF16, {c.num_rows(), cfg.q_heads, cfg.head_dim});
        launch(cfg, dev.args(topk, out.view), ws.buffer, nullptr, tuning);
        CUDA_CHECK(cudaDeviceSynchronize());
        return to_host(out.view);
      };
      for (const HostTensor* topk : std::vector<const HostTensor*>{&own, &shared}) {
        const std::string what = name + (topk == &own ? " own" : " shared");
        const HostTensor ref = run_ref(c, topk, false);
        const DevTensor topk_dev = to_dev(*topk);
        HostTensor grouped;
        HostTensor one_row;
        for (const cuda::AttentionTuning& tuning : tunings) {
          RunOut r{gpu(topk_dev.view, tuning), ref};
          expect_close(r, what + " " + tuning.name());
          if (tuning.max_row_tiles == 1) one_row = std::move(r.gpu);
          if (&tuning == &tunings[0]) {
            grouped = std::move(r.gpu);
          }
        }
        expect_close(RunOut{grouped, one_row}, what + ": grouped vs one row per CTA");
        if (topk == &own) {
          const HeadMajorSelection head_major(own);
          expect_close(RunOut{gpu(head_major.view, test_tuning()), ref},
                       what + ": head-major selection view");
        }
      }
      if (reqs == 3 && (q_len == 3 || q_len == 5)) {  // dense rows, groups with dead tiles
        const HostTensor ref = run_ref(c, nullptr, true);
        for (const cuda::AttentionTuning& tuning : tunings) {
          expect_close(RunOut{gpu(TensorView{}, tuning), ref},
                       "dense " + name + " " + tuning.name());
        }
      }
    }
  }
}

TEST(CudaSparseAttention, DenseMatchesCpuDense) {
  M3MSA_REQUIRE_GPU();
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    const DecodeShape s{4, 2, 1, 20000, 1, kv, 1.0f, 2.0f, 31};
    const SyntheticCase c = decode_case(s);
    expect_close(run_case(c, nullptr, /*dense_ref=*/true), "dense: " + describe(s));
  }
}

// With nb <= k every visible block is selected: the sparse result must match dense attention,
// on the GPU (both paths) and against the CPU's dense oracle.
TEST(CudaSparseAttention, FullSelectionEqualsDense) {
  M3MSA_REQUIRE_GPU();
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    const DecodeShape s{6, 3, 1, 2048, 1, kv, 1.0f, 1.0f, 41};
    const SyntheticCase c = decode_case(s);
    const HostTensor topk = random_selection(c, 5);  // nb <= 16 = k: all blocks, shuffled
    RunOut sparse = run_case(c, &topk, /*dense_ref=*/true);
    expect_close(sparse, "sparse vs CPU dense: " + describe(s));
    RunOut dense = run_case(c, nullptr, /*dense_ref=*/true);
    RunOut cross{sparse.gpu, dense.gpu};
    expect_close(cross, "GPU sparse vs GPU dense: " + describe(s));
  }
}

// Rows with no keys (padding requests, and live rows whose selection is empty) output zeros.
TEST(CudaSparseAttention, RowsWithoutKeysGiveZeros) {
  M3MSA_REQUIRE_GPU();
  const DecodeShape s{4, 2, 200, 900, 2, DType::kBF16, 1.0f, 1.0f, 51};
  const SyntheticCase c = decode_case(s);
  HostTensor topk = random_selection(c, 9);
  // Empty selection for the first row's second KV head (a -1 prefix of length 0).
  int32_t* e = topk.ptr<int32_t>() + (0 * c.config.kv_heads + 1) * c.config.topk;
  std::fill(e, e + c.config.topk, -1);
  const RunOut r = run_case(c, &topk);
  expect_close(r, "rows without keys");
  const uint16_t* out = r.gpu.ptr<uint16_t>();
  const int64_t group_elems = int64_t{c.config.group_size()} * c.config.head_dim;
  for (int64_t i = 0; i < group_elems; ++i) {
    ASSERT_EQ(out[group_elems + i], 0) << "row 0 kv head 1 element " << i;
  }
  const int64_t row_elems = int64_t{c.config.q_heads} * c.config.head_dim;
  for (int64_t row = c.num_rows() - 2 * s.q_len; row < c.num_rows(); ++row) {
    for (int64_t i = 0; i < row_elems; ++i) {
      ASSERT_EQ(out[row * row_elems + i], 0) << "padding row " << row << " element " << i;
    }
  }
}

TEST(CudaSparseAttention, PrefillMatchesCpuReference) {
  M3MSA_REQUIRE_GPU();
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    SyntheticSpec spec;
    spec.kind = BatchKind::kPrefill;
    spec.num_reqs = 4;
    spec.chunk_lens = {37, 0, 130, 5};
    spec.context_lens = {0, 500, 3000, 127};
    spec.kv_dtype = kv;
    spec.k_scale = 1.5f;
    spec.v_scale = 0.75f;
    spec.make_index_cache = false;
    spec.seed = 61;
    const SyntheticCase c = make_synthetic_case(spec);
    const HostTensor topk = random_selection(c, 13);
    expect_close(run_case(c, &topk), std::string("prefill ") + dtype_name(kv));
    expect_close(run_case(c, nullptr, true), std::string("prefill dense ") + dtype_name(kv));
  }
}

TEST(CudaSparseAttention, TwoRunsBitIdentical) {
  M3MSA_REQUIRE_GPU();
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    for (int q_len : {1, 4}) {  // q_len 4: the rows of a request share a CTA
      const DecodeShape s{2, q_len, 30000, 60000, 0, kv, 1.0f, 1.0f, 71};  // split over many CTAs
      const SyntheticCase c = decode_case(s);
      const HostTensor topk = random_selection(c, 3);
      const RunOut a = run_case(c, &topk);
      const RunOut b = run_case(c, &topk);
      EXPECT_TRUE(attntest::bitwise_equal(a.gpu, b.gpu)) << describe(s);
      const RunOut da = run_case(c, nullptr, true);
      const RunOut db = run_case(c, nullptr, true);
      EXPECT_TRUE(attntest::bitwise_equal(da.gpu, db.gpu)) << "dense " << describe(s);
    }
  }
}

// One graph captured on case A's buffers, replayed after case B's metadata and contents were
// copied into the same buffers, must equal an eager launch on B (bit for bit) and the reference.
TEST(CudaSparseAttention, GraphReplayWithNewMetadataEqualsEager) {
  M3MSA_REQUIRE_GPU();
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    for (int reqs : {1, 24}) {
      DecodeShape sa{reqs, 2, 1, 30000, 0, kv, 1.0f, 1.0f, 81};
      SyntheticCase a = decode_case(sa);
      // B: the same lengths permuted (same page count and table width), new everything else.
      std::vector<int64_t> lens;
      for (int r = 0; r < reqs; ++r) lens.push_back(a.seq_lens.ptr<int32_t>()[r]);
      std::reverse(lens.begin(), lens.end());
      SyntheticSpec spec_b;
      spec_b.num_reqs = reqs;
      spec_b.q_len = sa.q_len;
      spec_b.seq_lens = lens;
      spec_b.kv_dtype = kv;
      spec_b.make_index_cache = false;
      spec_b.seed = 82;
      const SyntheticCase b = make_synthetic_case(spec_b);
      ASSERT_EQ(a.kv_cache.nbytes(), b.kv_cache.nbytes());
      ASSERT_EQ(a.kv_block_table.nbytes(), b.kv_block_table.nbytes());

      const HostTensor topk_a = random_selection(a, 1);
      const HostTensor topk_b = random_selection(b, 2);
      DevAttention dev(a);
      DevTensor topk_dev = to_dev(topk_a);
      const SparseConfig& cfg = a.config;
      const int64_t rows = a.num_rows();
      DevTensor out_graph = poisoned(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
      DevTensor out_eager = poisoned(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
      Workspace ws(cfg);
      cuda::Stream stream;
      cuda::Graph graph = cuda::Graph::capture(stream.get(), [&] {
        launch(cfg, dev.args(topk_dev.view, out_graph.view), ws.buffer, stream.get());
      });
      graph.launch(stream.get());  // on A
      stream.synchronize();
      // New metadata and contents, same buffers.
      attntest::copy_into(b.seq_lens, dev.seq_lens);
      attntest::copy_into(b.kv_block_table, dev.kv_table);
      attntest::copy_into(b.q, dev.q);
      attntest::copy_into(b.kv_cache, dev.kv_cache);
      attntest::copy_into(topk_b, topk_dev);
      CUDA_CHECK(cudaMemset(out_graph.view.data, 0xFF, out_graph.view.nbytes()));
      graph.launch(stream.get());
      launch(cfg, dev.args(topk_dev.view, out_eager.view), ws.buffer, stream.get());
      stream.synchronize();
      const HostTensor g = to_host(out_graph.view);
      const HostTensor e = to_host(out_eager.view);
      EXPECT_TRUE(attntest::bitwise_equal(g, e))
          << "graph replay differs from eager: reqs " << reqs << " " << dtype_name(kv);
      RunOut check;
      check.gpu = g;
      check.ref = HostTensor(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
      cpu::sparse_attention(cfg, b.attention_args(topk_b.view(), check.ref.view()));
      expect_close(check, "graph replay on B, reqs " + std::to_string(reqs) + " " + dtype_name(kv));
    }
  }
}

TEST(CudaSparseAttention, RefusesUnsupportedShapes) {
  M3MSA_REQUIRE_GPU();
  SparseConfig cfg;
  cfg.head_dim = 64;
  PlanLimits limits;
  try {
    cuda::attention_workspace_size(cfg, limits);
    FAIL() << "head_dim 64 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported) << e.what();
  }
}

}  // namespace
}  // namespace m3msa
