// One layer's sparse step on one stream: the indexer, then the attention on its selection. With
// AttentionTuning::early_prologue (and pdl) the attention reads q, the lengths and the block table
// while the indexer still runs and waits only before the selection; these tests run the pair back
// to back (eager and as a replayed graph, after the last-CTA merge and after the merge kernel)
// over a poisoned selection and output, and require the bits of the two launches run one after
// the other with a synchronization between them.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "cuda/attention.h"
#include "cuda/common.cuh"
#include "indexer_test_util.h"

namespace m3msa {
namespace {

struct StepOut {
  HostTensor topk;
  HostTensor out;
};

class SparseStep {
 public:
  explicit SparseStep(const SyntheticCase& c)
      : c_(c),
        d_(upload(c)),
        topk_(DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk}),
        out_(DType::kBF16, {c.num_rows(), c.config.q_heads, c.config.head_dim}),
        indexer_(c.config, idxtest::limits_for(c)) {
    PlanLimits limits = idxtest::limits_for(c);
    ws_ = cuda::DeviceBuffer(cuda::attention_workspace_size(c.config, limits));
    CUDA_CHECK(cudaMemset(ws_.data(), 0, ws_.bytes()));
  }

  // The indexer, then the attention with `tuning`, on one stream; `sync_between`: the stream is
  // synchronized between them (the reference order).
  void launch(IndexerVariant variant, const cuda::AttentionTuning& tuning, bool sync_between) {
    indexer_.launch(c_.config, d_.indexer_args(topk_.view()), variant);
    if (sync_between) indexer_.sync();
    cuda::launch_attention_tuned(c_.config, d_.attention_args(topk_.view(), out_.view()),
                                 ws_.data(), ws_.bytes(), indexer_.stream(), tuning);
  }
  void poison() {
    fill_device_bytes(topk_.view(), idxtest::kPoisonByte);
    fill_device_bytes(out_.view(), 0xFF);
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  StepOut read() {
    indexer_.sync();
    EXPECT_EQ(indexer_.status(), 0u);
    StepOut r;
    copy_to_host(topk_.view(), r.topk);
    copy_to_host(out_.view(), r.out);
    return r;
  }
  cudaStream_t stream() const { return indexer_.stream(); }

 private:
  const SyntheticCase& c_;
  DeviceCase d_;
  DeviceTensor topk_, out_;
  idxtest::GpuIndexer indexer_;
  cuda::DeviceBuffer ws_;
};

void expect_same(const StepOut& a, const StepOut& b, const std::string& what) {
  ASSERT_EQ(a.topk.nbytes(), b.topk.nbytes());
  EXPECT_EQ(std::memcmp(a.topk.data(), b.topk.data(), a.topk.nbytes()), 0)
      << what << ": selection differs";
  ASSERT_EQ(a.out.nbytes(), b.out.nbytes());
  EXPECT_EQ(std::memcmp(a.out.data(), b.out.data(), a.out.nbytes()), 0)
      << what << ": attention output differs";
}

TEST(CudaSparseStep, SelectionOnlyWaitGivesTheSequentialBits) {
  M3MSA_INDEXER_REQUIRE_GPU();
  const cuda::AttentionTuning early = cuda::AttentionTuning::parse("pdl=1,early=1");
  ASSERT_TRUE(early.early_prologue);
  struct Shape {
    int reqs, q_len;
    int64_t min_ctx, max_ctx;
    DType kv;
  };
  for (const Shape& s :
       {Shape{1, 1, 131072, 131072, DType::kBF16}, Shape{1, 4, 40000, 40000, DType::kFP8E4M3},
        Shape{3, 2, 5000, 70000, DType::kBF16}, Shape{8, 1, 1, 9000, DType::kFP8E4M3}}) {
    SyntheticSpec spec = idxtest::decode_spec(s.reqs, s.q_len, s.min_ctx, s.max_ctx, DType::kBF16,
                                              0, 41 + static_cast<uint64_t>(s.reqs));
    spec.make_kv_cache = true;
    spec.kv_dtype = s.kv;
    const SyntheticCase c = make_synthetic_case(spec);
    SparseStep step(c);
    for (IndexerVariant variant : {IndexerVariant::kLastCtaMerge, IndexerVariant::kSplitMerge}) {
      const std::string what =
          "reqs " + std::to_string(s.reqs) + " q_len " + std::to_string(s.q_len) + " " +
          dtype_name(s.kv) +
          (variant == IndexerVariant::kSplitMerge ? " merge kernel" : " last-CTA merge");
      step.poison();
      step.launch(variant, cuda::default_attention_tuning(), /*sync_between=*/true);
      const StepOut want = step.read();
      for (int i = 0; i < 3; ++i) {  // a read before the selection is ready would be racy
        step.poison();
        step.launch(variant, early, /*sync_between=*/false);
        expect_same(want, step.read(), what + ", eager run " + std::to_string(i));
      }
      // Captured: the attention's programmatic edge to the indexer's last kernel in the graph.
      cudaGraph_t graph = nullptr;
      CUDA_CHECK(cudaStreamBeginCapture(step.stream(), cudaStreamCaptureModeThreadLocal));
      step.launch(variant, early, /*sync_between=*/false);
      CUDA_CHECK(cudaStreamEndCapture(step.stream(), &graph));
      cudaGraphExec_t exec = nullptr;
      CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int i = 0; i < 3; ++i) {
        step.poison();
        CUDA_CHECK(cudaGraphLaunch(exec, step.stream()));
        expect_same(want, step.read(), what + ", graph replay " + std::to_string(i));
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
    }
  }
}

TEST(CudaSparseStep, EarlyIsAParsedNamedAndCheckedTuning) {
  const cuda::AttentionTuning t = cuda::AttentionTuning::parse("pdl=1,early=1");
  EXPECT_TRUE(t.pdl);
  EXPECT_TRUE(t.early_prologue);
  EXPECT_NE(t.name().find("-early"), std::string::npos);
  EXPECT_FALSE(cuda::default_attention_tuning().early_prologue);
  // Values are integers, switches 0 or 1; anything else is refused naming the tuning.
  for (const char* bad :
       {"early=x", "pdl=2", "splitp=", "cluster=-1", "rows=3", "splits=1.5", "early", "speed=1"}) {
    EXPECT_THROW(cuda::AttentionTuning::parse(bad), Error) << bad;
  }
  EXPECT_EQ(cuda::default_attention_tuning().name().find("early"), std::string::npos);
}

}  // namespace
}  // namespace m3msa
