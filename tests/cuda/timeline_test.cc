// The stage timeline (cuda/timeline.h): the summary of hand-made records; and on the GPU, that a
// recorded launch gives the same bits as an unrecorded one and that its records are whole: every
// CTA (or work item) stamped its start and end, marks in program order, kinds where the kernel
// puts them, and causality across SMs (no CTA's stage before the merging CTA's end ... after it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "cuda/attention.h"
#include "cuda/timeline.h"
#include "indexer_test_util.h"

namespace m3msa {
namespace {

using cuda::timeline::kMarks;
using cuda::timeline::kWords;
using cuda::timeline::Launch;

// ---- the summary (no device) ----

// One record: marks in ns (0: not reached), SM, kind.
std::vector<uint64_t> record(std::vector<uint64_t> marks, uint32_t sm, uint32_t kind) {
  marks.resize(kMarks, 0);
  marks.push_back((uint64_t{kind} << 32) | sm);
  return marks;
}

TEST(Timeline, SummaryGivesStagesPerKindAfterTheFirstStart) {
  Launch a;
  a.kernel = "a";
  a.marks = {"start", "mid", "end"};
  a.kinds = {"cta", "merging cta"};
  a.units = 3;
  a.first = 0;
  Launch b;
  b.kernel = "b";
  b.marks = {"start", "end"};
  b.kinds = {"cta"};
  b.units = 1;
  b.first = 3;
  std::vector<uint64_t> words;
  for (const auto& r : {record({1000, 3000, 4000}, 5, 0), record({2000, 0, 6000}, 7, 0),
                        record({1500, 2500, 9000}, 5, 1), record({8000, 10000}, 1, 0)}) {
    words.insert(words.end(), r.begin(), r.end());
  }
  const auto rows = cuda::timeline::summarize({a, b}, words);
  // a/cta: start, mid, end; a/merging cta: start, mid, end; b/cta: start, end.
  ASSERT_EQ(rows.size(), 8u);
  EXPECT_EQ(rows[0].kernel, "a");
  EXPECT_EQ(rows[0].kind, "cta");
  EXPECT_EQ(rows[0].mark, "start");
  EXPECT_EQ(rows[0].units, 2);
  EXPECT_EQ(rows[0].reached, 2);
  EXPECT_EQ(rows[0].sms, 2);
  EXPECT_DOUBLE_EQ(rows[0].first_us, 0.0);  // t0 = the earliest stamp, 1000 ns
  EXPECT_DOUBLE_EQ(rows[0].last_us, 1.0);
  EXPECT_DOUBLE_EQ(rows[0].median_us, 0.5);
  EXPECT_EQ(rows[1].mark, "mid");
  EXPECT_EQ(rows[1].reached, 1);  // the second record never stamped it
  EXPECT_DOUBLE_EQ(rows[1].first_us, 2.0);
  EXPECT_DOUBLE_EQ(rows[1].median_since_start_us, 2.0);
  EXPECT_EQ(rows[2].mark, "end");
  EXPECT_DOUBLE_EQ(rows[2].median_us, 4.0);              // (3 + 5) / 2
  EXPECT_DOUBLE_EQ(rows[2].median_since_start_us, 3.5);  // (3 + 4) / 2
  // Stages within a record: from its latest earlier stamp (the second record skipped "mid").
  EXPECT_DOUBLE_EQ(rows[0].median_stage_us, 0.0);
  EXPECT_DOUBLE_EQ(rows[1].median_stage_us, 2.0);
  EXPECT_DOUBLE_EQ(rows[2].median_stage_us, 2.5);  // (1 + 4) / 2
  EXPECT_DOUBLE_EQ(rows[5].median_stage_us, 6.5);  // merging cta: 9000 - 2500
  EXPECT_EQ(rows[3].kind, "merging cta");
  EXPECT_EQ(rows[3].units, 1);
  EXPECT_DOUBLE_EQ(rows[5].last_us, 8.0);
  EXPECT_EQ(rows[6].kernel, "b");
  EXPECT_EQ(rows[6].launch, 1);
  EXPECT_DOUBLE_EQ(rows[6].first_us, 7.0);
  EXPECT_DOUBLE_EQ(rows[7].median_since_start_us, 2.0);
}

TEST(Timeline, SummaryOfNothingStampedIsEmptyAndShortRecordsAreRefused) {
  Launch a;
  a.kernel = "a";
  a.marks = {"start"};
  a.kinds = {"cta"};
  a.units = 2;
  std::vector<uint64_t> words(2 * kWords, 0);
  EXPECT_TRUE(cuda::timeline::summarize({a}, words).empty());
  words.resize(kWords);
  EXPECT_THROW(cuda::timeline::summarize({a}, words), Error);
}

// ---- recorded launches on the GPU ----

// Every record of every launch: start and end stamped, stamps in mark order, a kind of the
// launch's list, an SM of the device. Returns the records of launch `l` as [units][kWords].
void expect_whole(const cuda::timeline::Recorder& rec, const std::vector<uint64_t>& words) {
  const int sms = attntest::device_sms();
  for (const Launch& l : rec.launches()) {
    SCOPED_TRACE(l.kernel);
    const int last = static_cast<int>(l.marks.size()) - 1;
    ASSERT_EQ(l.marks.back(), "end");
    for (int64_t u = 0; u < l.units; ++u) {
      const uint64_t* r = words.data() + (l.first + u) * kWords;
      ASSERT_NE(r[0], 0u) << "record " << u << " has no start";
      ASSERT_NE(r[last], 0u) << "record " << u << " has no end";
      uint64_t prev = 0;
      for (int m = 0; m <= last; ++m) {
        if (r[m] == 0) continue;
        EXPECT_GE(r[m], prev) << "record " << u << " mark " << l.marks[static_cast<size_t>(m)];
        prev = r[m];
      }
      for (int m = last + 1; m < kMarks; ++m) EXPECT_EQ(r[m], 0u) << "record " << u;
      EXPECT_LT(r[kMarks] >> 32, l.kinds.size()) << "record " << u;
      EXPECT_LT(static_cast<int>(r[kMarks] & 0xFFFFFFFFu), sms) << "record " << u;
    }
  }
}

const uint64_t* record_of(const Launch& l, const std::vector<uint64_t>& words, int64_t u) {
  return words.data() + (l.first + u) * kWords;
}
uint32_t kind_of(const uint64_t* r) {
  return static_cast<uint32_t>(r[kMarks] >> 32);
}

int mark_index(const Launch& l, const std::string& name) {
  const auto it = std::find(l.marks.begin(), l.marks.end(), name);
  EXPECT_NE(it, l.marks.end()) << l.kernel << " has no mark " << name;
  return static_cast<int>(it - l.marks.begin());
}

// One decode case of `reqs` requests at `context` tokens with a random selection, on the device
// with a zeroed attention workspace; run() launches the attention (under `recorder` when given)
// into a poisoned output and returns it.
struct AttentionCase {
  SyntheticCase c;
  HostTensor topk;
  attntest::DevAttention dev;
  attntest::DevTensor topk_dev;
  cuda::DeviceBuffer ws;

  static SyntheticCase make(int reqs, int64_t context, DType kv, uint64_t seed) {
    SyntheticSpec spec;
    spec.num_reqs = reqs;
    spec.min_context = spec.max_context = context;
    spec.kv_dtype = kv;
    spec.make_index_cache = false;
    spec.seed = seed;
    return make_synthetic_case(spec);
  }
  AttentionCase(int reqs, int64_t context, DType kv, uint64_t seed)
      : c(make(reqs, context, kv, seed)),
        topk(attntest::random_selection(c, seed + 1)),
        dev(c),
        topk_dev(attntest::to_dev(topk)) {
    PlanLimits limits;
    limits.max_reqs = reqs;
    ws = cuda::DeviceBuffer(cuda::attention_workspace_size(c.config, limits));
    CUDA_CHECK(cudaMemset(ws.data(), 0, ws.bytes()));
  }
  HostTensor run(cuda::timeline::Recorder* recorder) const {
    const SparseConfig& cfg = c.config;
    attntest::DevTensor out =
        attntest::poisoned(DType::kBF16, {c.num_rows(), cfg.q_heads, cfg.head_dim});
    std::optional<cuda::timeline::Scope> scope;
    if (recorder != nullptr) scope.emplace(*recorder);
    cuda::launch_attention(cfg, dev.args(topk_dev.view, out.view), ws.data(), ws.bytes(), nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    return attntest::to_host(out.view);
  }
};

TEST(TimelineGpu, AttentionRecordsEveryCtaAndChangesNoBit) {
  M3MSA_REQUIRE_GPU();
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    SCOPED_TRACE(dtype_name(kv));
    const AttentionCase a(1, 100000, kv, 11);
    const SparseConfig& cfg = a.c.config;
    const HostTensor plain = a.run(nullptr);
    cuda::timeline::Recorder rec;
    const HostTensor recorded = a.run(&rec);
    EXPECT_TRUE(attntest::bitwise_equal(plain, recorded)) << "a recorded launch changed the output";
    ASSERT_EQ(rec.launches().size(), 1u);
    const Launch& l = rec.launches()[0];
    EXPECT_EQ(l.kernel, "attention");
    const cuda::AttentionPlanInfo plan = cuda::attention_plan_info(
        cfg, 1, 1, false, kv == DType::kFP8E4M3, cuda::default_attention_tuning());
    EXPECT_EQ(l.units, plan.ctas);
    const std::vector<uint64_t> words = rec.read();
    expect_whole(rec, words);
    // One request, each KV head's selection split over several CTAs (CTA = head * splits +
    // split): every CTA streamed its chunks; the merging CTAs of a head (every rank of a
    // cluster, or the last to arrive) ended after each of the head's CTAs had finished its chunks
    // (the clock is global, so this holds across SMs).
    ASSERT_GT(plan.splits, 1) << "the default plan of one request splits";
    ASSERT_EQ(l.units, int64_t{cfg.kv_heads} * plan.splits);
    const int chunks = mark_index(l, "chunks done");
    const int end = mark_index(l, "end");
    for (int h = 0; h < cfg.kv_heads; ++h) {
      int merging = 0;
      uint64_t latest_chunks = 0;
      uint64_t merge_end = 0;
      for (int sp = 0; sp < plan.splits; ++sp) {
        const int64_t u = int64_t{h} * plan.splits + sp;
        const uint64_t* r = record_of(l, words, u);
        for (const char* m : {"pages looked up", "first chunk in", "chunks done", "published"}) {
          EXPECT_NE(r[mark_index(l, m)], 0u) << "CTA " << u << " " << m;
        }
        latest_chunks = std::max(latest_chunks, r[chunks]);
        if (kind_of(r) == 1) {
          ++merging;
          merge_end = std::max(merge_end, r[end]);
        }
      }
      // A cluster's ranks each merge a share of the output; the workspace merge is one CTA's.
      EXPECT_EQ(merging, plan.cluster ? plan.splits : 1) << "KV head " << h;
      EXPECT_GE(merge_end, latest_chunks) << "KV head " << h << " merged before a split's chunks";
    }
    const auto rows = cuda::timeline::summarize(rec.launches(), words);
    EXPECT_FALSE(rows.empty());
  }
}

TEST(TimelineGpu, LaunchesOutsideAScopeOrBeyondTheCapacityAreNotRecorded) {
  M3MSA_REQUIRE_GPU();
  const AttentionCase a(2, 5000, DType::kBF16, 12);
  const SparseConfig& cfg = a.c.config;
  cuda::timeline::Recorder small(1);  // fewer records than the launch has CTAs
  const HostTensor recorded = a.run(&small);
  const HostTensor got = a.run(nullptr);
  EXPECT_TRUE(small.launches().empty());
  EXPECT_EQ(small.dropped(), 1);
  EXPECT_EQ(cuda::timeline::records_for("attention", {"start"}, 4), nullptr)
      << "no recorder is active outside a scope";
  EXPECT_TRUE(attntest::bitwise_equal(recorded, got));
  HostTensor want(DType::kBF16, {2, cfg.q_heads, cfg.head_dim});
  cpu::sparse_attention(cfg, a.c.attention_args(a.topk.view(), want.view()));
  const attntest::CompareResult cmp = attntest::compare_bf16(got, want);
  EXPECT_TRUE(cmp.ok) << cmp.bad << " elements out of tolerance";
}

// The split indexer at one request, both merge placements: the same selection with and without
// the recorder, every CTA's record whole, the merge after every CTA's candidates.
TEST(TimelineGpu, SplitIndexerRecordsEveryCtaAndChangesNoBit) {
  M3MSA_INDEXER_REQUIRE_GPU();
  const SyntheticCase c =
      make_synthetic_case(idxtest::decode_spec(1, 1, 40000, 40000, DType::kBF16, 0, 21));
  for (IndexerVariant variant : {IndexerVariant::kLastCtaMerge, IndexerVariant::kSplitMerge}) {
    SCOPED_TRACE(variant == IndexerVariant::kSplitMerge ? "merge kernel" : "last-CTA merge");
    const HostTensor plain = idxtest::run_gpu(c, variant);
    cuda::timeline::Recorder rec;
    HostTensor recorded;
    {
      cuda::timeline::Scope scope(rec);
      recorded = idxtest::run_gpu(c, variant);
    }
    ASSERT_EQ(plain.nbytes(), recorded.nbytes());
    EXPECT_EQ(std::memcmp(plain.data(), recorded.data(), plain.nbytes()), 0)
        << "a recorded launch changed the selection";
    const bool merge_kernel = variant == IndexerVariant::kSplitMerge;
    ASSERT_EQ(rec.launches().size(), merge_kernel ? 2u : 1u);
    const std::vector<uint64_t> words = rec.read();
    expect_whole(rec, words);
    const Launch& split = rec.launches()[0];
    EXPECT_EQ(split.kernel, "indexer split");
    const int scored = mark_index(split, "scored");
    int merging = 0;
    int working = 0;
    uint64_t latest_scored = 0;
    uint64_t merge_end = 0;
    for (int64_t u = 0; u < split.units; ++u) {
      const uint64_t* r = record_of(split, words, u);
      if (kind_of(r) == 2) continue;  // no blocks in its range
      ++working;
      EXPECT_NE(r[mark_index(split, "first page in")], 0u) << "CTA " << u;
      EXPECT_NE(r[scored], 0u) << "CTA " << u;
      EXPECT_NE(r[mark_index(split, "candidates out")], 0u) << "CTA " << u;
      latest_scored = std::max(latest_scored, r[scored]);
      if (kind_of(r) == 1) {
        ++merging;
        merge_end = r[mark_index(split, "end")];
      }
    }
    EXPECT_GT(working, 1) << "one request of 40K tokens spreads over many CTAs";
    if (merge_kernel) {
      EXPECT_EQ(merging, 0);
      const Launch& merge = rec.launches()[1];
      EXPECT_EQ(merge.kernel, "indexer merge");
      const int done = mark_index(merge, "split kernel done");
      for (int64_t u = 0; u < merge.units; ++u) {
        const uint64_t* r = record_of(merge, words, u);
        EXPECT_GE(r[done], latest_scored) << "merge CTA " << u << " passed its wait too early";
      }
    } else {
      EXPECT_EQ(merging, 1);
      EXPECT_GE(merge_end, latest_scored);
    }
  }
}

}  // namespace
}  // namespace m3msa
