// An fp8 index_q against an fp8 index cache on the FP8 tensor cores: the split kernel equals the
// span kernel, the unfused baseline and the split kernel with its merge in a kernel of its own bit
// for bit (one scoring order), and the CPU reference
// (which scores the same decoded values in dimension order) under the near-tie rule.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "indexer_test_util.h"

namespace m3msa::idxtest {
namespace {

// The case's bf16 queries, scaled into fp8's range and cast (saturating) to fp8 e4m3.
void use_fp8_queries(SyntheticCase& c) {
  HostTensor q8(DType::kFP8E4M3, c.index_q.shape());
  const uint16_t* q = c.index_q.ptr<uint16_t>();
  for (int64_t i = 0; i < q8.numel(); ++i) {
    q8.ptr<uint8_t>()[i] = float_to_fp8e4m3(4.0f * bf16_to_float(q[i]));
  }
  c.index_q = std::move(q8);
}

TEST(CudaIndexerFp8Query, SplitSpanAndUnfusedAgreeAndMatchTheCpu) {
  M3MSA_INDEXER_REQUIRE_GPU();
  struct Shape {
    int reqs, q_len;
    int64_t min_ctx, max_ctx;
    int padding;
  };
  const Shape shapes[] = {
      {1, 1, 4096, 4096, 0}, {1, 4, 131072, 131072, 0}, {4, 1, 1000, 5000, 1},
      {16, 2, 1, 20000, 3},  {32, 4, 100, 50000, 0},    {3, 8, 1, 3000, 0},
  };
  uint64_t seed = 901;
  for (const Shape& s : shapes) {
    SyntheticCase c = make_synthetic_case(
        decode_spec(s.reqs, s.q_len, s.min_ctx, s.max_ctx, DType::kFP8E4M3, s.padding, seed++));
    use_fp8_queries(c);
    const std::string what = "reqs " + std::to_string(s.reqs) + " q_len " + std::to_string(s.q_len);
    uint32_t status = 1;
    const HostTensor split = run_gpu(c, IndexerVariant::kFused, &status);
    EXPECT_EQ(status, 0u) << what;
    const HostTensor span = run_gpu(c, IndexerVariant::kSpan);
    const HostTensor unfused = run_gpu(c, IndexerVariant::kUnfused);
    const HostTensor merged = run_gpu(c, IndexerVariant::kSplitMerge);
    const HostTensor last_cta = run_gpu(c, IndexerVariant::kLastCtaMerge);
    EXPECT_EQ(std::memcmp(split.data(), span.data(), split.nbytes()), 0) << what;
    EXPECT_EQ(std::memcmp(split.data(), merged.data(), split.nbytes()), 0) << what;
    EXPECT_EQ(std::memcmp(split.data(), last_cta.data(), split.nbytes()), 0) << what;
    EXPECT_EQ(std::memcmp(split.data(), unfused.data(), split.nbytes()), 0) << what;
    const Comparison cmp = compare_selections(c, split, run_cpu(c));
    EXPECT_EQ(cmp.failures, 0) << what << ": " << cmp.summary();
  }
}

}  // namespace
}  // namespace m3msa::idxtest
