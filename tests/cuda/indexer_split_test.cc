// The split decode indexer (the default, IndexerVariant::kFused) against the span kernel
// (IndexerVariant::kSpan) and against its merge in a kernel of its own (kSplitMerge) bit for bit
// (same scoring order, same keys) and against the CPU reference (near-tie rule), over the shapes
// that stress its own parts: ranges of one block per CTA, ranges longer than the ring, requests one
// CTA finishes alone, merges of many slices per vector, all-equal scores (every candidate ties on
// the score bits) and other range splits. The contracts every decode path keeps (NaN ranking, graph
// replay with new metadata, device guards) are tested on the default path, this kernel, in
// indexer_test.cc.
#include <gtest/gtest.h>

#include <cstring>
#include <utility>
#include <vector>

#include "cuda/indexer_params.h"
#include "indexer_test_util.h"

namespace m3msa::idxtest {
namespace {

struct Shape {
  int reqs;
  int q_len;
  int64_t min_ctx;
  int64_t max_ctx;
  DType dtype;
  int padding;
  int topk;
};

std::string describe(const Shape& s) {
  std::ostringstream out;
  out << "reqs " << s.reqs << " q_len " << s.q_len << " ctx [" << s.min_ctx << ", " << s.max_ctx
      << "] " << dtype_name(s.dtype) << " padding " << s.padding << " topk " << s.topk;
  return out.str();
}

void expect_split_equals_span_and_cpu(const SyntheticCase& c, const std::string& what,
                                      bool check_cpu = true) {
  uint32_t status = 0;
  const HostTensor split = run_gpu(c, IndexerVariant::kFused, &status);
  EXPECT_EQ(status, 0u) << what;
  const HostTensor span = run_gpu(c, IndexerVariant::kSpan);
  EXPECT_EQ(std::memcmp(split.data(), span.data(), split.nbytes()), 0)
      << what << ": split and span selections differ";
  uint32_t merge_status = 0;
  const HostTensor merged = run_gpu(c, IndexerVariant::kSplitMerge, &merge_status);
  EXPECT_EQ(merge_status, 0u) << what;
  EXPECT_EQ(std::memcmp(split.data(), merged.data(), split.nbytes()), 0)
      << what << ": the separate merge (kSplitMerge) differs from the default";
  uint32_t last_status = 0;
  const HostTensor last_cta = run_gpu(c, IndexerVariant::kLastCtaMerge, &last_status);
  EXPECT_EQ(last_status, 0u) << what;
  EXPECT_EQ(std::memcmp(split.data(), last_cta.data(), split.nbytes()), 0)
      << what << ": the last CTA's merge (kLastCtaMerge) differs from the default";
  if (check_cpu) {
    const Comparison cmp = compare_selections(c, split, run_cpu(c));
    EXPECT_EQ(cmp.failures, 0) << what << ": " << cmp.summary();
  }
}

TEST(CudaIndexerSplit, RandomizedDecodeEqualsSpanAndCpu) {
  M3MSA_INDEXER_REQUIRE_GPU();
  const DType bf16 = DType::kBF16, fp8 = DType::kFP8E4M3;
  const std::vector<Shape> shapes = {
      {1, 1, 1, 1, bf16, 0, 16},            // one token
      {1, 1, 4096, 4096, bf16, 0, 16},      // 32 blocks: one block per CTA
      {1, 1, 1200, 1200, bf16, 0, 16},      // 10 candidates: fewer than k, the answer padded
      {1, 1, 8192, 8192, fp8, 0, 16},       // 64 candidates: the short merge at its capacity
      {1, 2, 8320, 8320, bf16, 0, 16},      // 65: just past it
      {1, 1, 5000, 5000, bf16, 0, 32},      // k 32 of 40 candidates
      {1, 4, 4096, 4096, fp8, 0, 16},       // q_len 4
      {1, 1, 131072, 131072, bf16, 0, 16},  // 1024 blocks over the grid, staged merge
      {1, 4, 131072, 131072, fp8, 0, 16},   // 16 vectors x 1024 candidates: two staging rounds
      {1, 2, 600000, 600000, bf16, 0, 32},  // k 32, long ranges (ring wraps many times)
      {1, 1, 262144, 262144, fp8, 0, 32},   // k 32 of 2048: the histogram's 8 keys a thread
      {2, 1, 524288, 524288, bf16, 0, 16},  // ~2040 candidates a vector at 2 requests
      {1, 1, 524288, 524288, bf16, 0, 16},  // 4080: the histogram's 16 keys a thread
      {4, 1, 1000, 5000, fp8, 1, 16},       // padding request
      {16, 2, 1, 20000, bf16, 3, 16},
      {32, 4, 100, 50000, fp8, 0, 16},
      {64, 1, 1, 4096, bf16, 5, 16},
      {128, 1, 1000, 40000, fp8, 0, 16},  // more requests than half the grid: one CTA each
      {3, 8, 1, 3000, bf16, 0, 16},       // q_len 8: 32 vectors
      {5, 3, 100, 70000, fp8, 1, 8},      // q_len 3, k 8
      // More query vectors per request than the split kernel has CTAs for it (8 and 11): the
      // merge kernel's most CTAs, short and long requests side by side.
      {32, 8, 100, 60000, bf16, 2, 16},
      {24, 8, 1, 140000, fp8, 0, 16},
  };
  uint64_t seed = 301;
  for (const Shape& s : shapes) {
    const SyntheticCase c = make_synthetic_case(
        decode_spec(s.reqs, s.q_len, s.min_ctx, s.max_ctx, s.dtype, s.padding, seed++, s.topk));
    expect_split_equals_span_and_cpu(c, describe(s));
  }
}

// Lengths of 1, 127, 128, 129 tokens and around later block edges, for every q_len up to 8.
TEST(CudaIndexerSplit, BlockEdgesAndShortRequests) {
  M3MSA_INDEXER_REQUIRE_GPU();
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    for (int q_len : {1, 2, 4, 8}) {
      SyntheticSpec spec = decode_spec(12, q_len, 0, 0, dtype, 0, 311 + q_len);
      spec.seq_lens = {1, 127, 128, 129, 130, 255, 256, 257, 2048 + 3, 4096, 16385, 40000};
      for (int64_t& len : spec.seq_lens) len = std::max<int64_t>(len, q_len);
      const SyntheticCase c = make_synthetic_case(spec);
      expect_split_equals_span_and_cpu(
          c, std::string(dtype_name(dtype)) + " q_len " + std::to_string(q_len));
    }
  }
}

// Every token row the same vector: every block scores the same, so only the block-id bits of the
// keys order them (lower id first) and every CTA's candidates tie on the score bits.
TEST(CudaIndexerSplit, AllEqualScoresPreferLowerBlocks) {
  M3MSA_INDEXER_REQUIRE_GPU();
  // q_len 1 and 2 (3 requests: the default merges in a kernel of its own, where the histogram
  // finds every key in one bin and hands over to the warps' merge); q_len 4 at 30 requests (more
  // query vectors per request than the split kernel has CTAs for it).
  struct Case {
    DType dtype;
    int q_len;
    int reqs;
  };
  for (const Case& e : {Case{DType::kBF16, 2, 3}, Case{DType::kFP8E4M3, 2, 3},
                        Case{DType::kBF16, 1, 3}, Case{DType::kFP8E4M3, 4, 30}}) {
    const DType dtype = e.dtype;
    SCOPED_TRACE(testing::Message() << "q_len " << e.q_len << ", " << e.reqs << " requests");
    SyntheticSpec spec = decode_spec(e.reqs, e.q_len, 0, 0, dtype, 0, 321);
    spec.seq_lens.clear();
    const int64_t lens[] = {100000, 3000, 129};
    for (int i = 0; i < e.reqs; ++i) spec.seq_lens.push_back(lens[i % 3]);
    SyntheticCase c = make_synthetic_case(spec);
    const int64_t row_bytes = c.index_cache.nbytes() / c.index_cache.shape()[0] / 128;
    auto* bytes = static_cast<uint8_t*>(c.index_cache.data());
    const int64_t rows = c.index_cache.nbytes() / row_bytes;
    for (int64_t r = 1; r < rows; ++r) std::memcpy(bytes + r * row_bytes, bytes, row_bytes);
    const HostTensor split = run_gpu(c, IndexerVariant::kFused);
    const HostTensor span = run_gpu(c, IndexerVariant::kSpan);
    const HostTensor merged = run_gpu(c, IndexerVariant::kSplitMerge);
    const HostTensor last_cta = run_gpu(c, IndexerVariant::kLastCtaMerge);
    ASSERT_EQ(std::memcmp(split.data(), span.data(), split.nbytes()), 0) << dtype_name(dtype);
    ASSERT_EQ(std::memcmp(split.data(), merged.data(), split.nbytes()), 0)
        << dtype_name(dtype) << ": the separate merge";
    ASSERT_EQ(std::memcmp(split.data(), last_cta.data(), split.nbytes()), 0)
        << dtype_name(dtype) << ": the last CTA's merge";
    // Row 0 of request 0 (pos 99998 or 99999, 782 visible blocks): its own block forced, then
    // 0..14.
    const int k = c.config.topk;
    for (int h = 0; h < c.config.index_heads; ++h) {
      const int32_t* sel = split.ptr<int32_t>() + h * k;
      EXPECT_EQ(sel[0], 781) << "head " << h;
      for (int i = 1; i < k; ++i) EXPECT_EQ(sel[i], i - 1) << "head " << h << " entry " << i;
    }
  }
}

// A plan's minimum range (IndexerPlan::min_blocks_per_cta) changes the split, never the answer,
// with the merge in the split kernel or in a kernel of its own.
TEST(CudaIndexerSplit, MinimumRangeChangesNothing) {
  M3MSA_INDEXER_REQUIRE_GPU();
  const SyntheticCase c =
      make_synthetic_case(decode_spec(3, 2, 20000, 140000, DType::kBF16, 0, 361));
  const HostTensor span = run_gpu(c, IndexerVariant::kSpan);
  for (int min_blocks : {1, 4, 16, 64}) {
    for (IndexerVariant variant :
         {IndexerVariant::kFused, IndexerVariant::kSplitMerge, IndexerVariant::kLastCtaMerge}) {
      DeviceCase d = upload(c);
      DeviceTensor topk(DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk});
      fill_device_bytes(topk.view(), kPoisonByte);
      cuda::IndexerPlan plan = cuda::plan_indexer(c.config, limits_for(c), 0);
      plan.min_blocks_per_cta = min_blocks;
      cuda::DeviceBuffer ws(plan.workspace_bytes);
      cuda::Stream stream;
      cuda::init_indexer_workspace(plan, ws.data(), stream.get());
      cuda::launch_indexer(plan, c.config, d.indexer_args(topk.view()), variant, ws.data(),
                           stream.get());
      stream.synchronize();
      HostTensor out;
      copy_to_host(topk.view(), out);
      EXPECT_EQ(std::memcmp(out.data(), span.data(), out.nbytes()), 0)
          << "min_blocks_per_cta " << min_blocks << " variant " << static_cast<int>(variant);
    }
  }
}

}  // namespace
}  // namespace m3msa::idxtest
