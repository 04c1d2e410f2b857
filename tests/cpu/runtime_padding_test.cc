// begin_step(batch, pad_to_reqs) on the CPU backend: a step padded with empty requests (what
// StepGraphs does to replay one graph per bucket) gives the unpadded step's outputs bit for bit on
// the real rows and leaves the caches exactly as the unpadded step does; bad padding is an error.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "m3msa/comm.h"
#include "m3msa/error.h"
#include "m3msa/runtime.h"
#include "m3msa/testing/runtime_model.h"

namespace m3msa {
namespace {

struct StepRun {
  std::vector<uint16_t> hidden, residual;  // the real rows
  std::vector<HostTensor> caches;
};

StepRun run_step(const testkit::MasterModel& master, const RuntimeConfig& config,
                 const testkit::StepMeta& meta, int pad, const std::vector<uint16_t>& hidden_in,
                 const std::vector<uint16_t>& residual_in) {
  testkit::RankModel model = testkit::make_rank_model(master, 0, 1);
  auto comm = make_single_rank_communicator();
  Runtime rt([](const std::string&) {});
  M3MSA_CHECK_INTERNAL(rt.prepare(model.weights, config, *comm) == PrepareResult::kActive,
                       "prepare");
  M3MSA_CHECK_INTERNAL(rt.begin_step(meta.batch, pad),
                       "begin_step refused: ", rt.stats().last_refusal);
  const int64_t H = config.model.hidden;
  const int64_t rows = meta.batch.num_rows();
  const int64_t padded_rows = int64_t{pad} * meta.batch.q_len;
  EXPECT_EQ(rt.step_metadata().num_rows(), padded_rows);
  // Padding rows: arbitrary activations, position -1.
  std::vector<uint16_t> hidden(static_cast<std::size_t>(padded_rows * H), float_to_bf16(0.75f));
  std::vector<uint16_t> residual(hidden.size(), float_to_bf16(-0.5f));
  std::copy(hidden_in.begin(), hidden_in.end(), hidden.begin());
  std::copy(residual_in.begin(), residual_in.end(), residual.begin());
  HostTensor positions(DType::kI64, {padded_rows});
  for (int64_t r = 0; r < padded_rows; ++r) {
    positions.ptr<int64_t>()[r] = r < rows ? meta.positions.ptr<int64_t>()[r] : -1;
  }
  for (const LayerWeights& w : model.weights.layers) {
    rt.forward_layer(w.layer, TensorView::contiguous(hidden.data(), DType::kBF16, {padded_rows, H}),
                     TensorView::contiguous(residual.data(), DType::kBF16, {padded_rows, H}),
                     positions.view());
  }
  rt.close();
  StepRun out;
  out.hidden.assign(hidden.begin(), hidden.begin() + rows * H);
  out.residual.assign(residual.begin(), residual.begin() + rows * H);
  for (std::size_t l = 0; l < model.kv_caches.size(); ++l) {
    out.caches.push_back(model.kv_caches[l]);
    out.caches.push_back(model.index_caches[l]);
  }
  return out;
}

TEST(RuntimePadding, PaddedStepEqualsUnpaddedOnTheRealRows) {
  RuntimeConfig config = testkit::small_config();
  config.max_context = 256;
  const ModelConfig& m = config.model;
  const int64_t max_blocks = config.max_context / m.block_size;
  const int64_t pages = config.max_requests * max_blocks + 3;
  const testkit::MasterModel master = testkit::make_master(m, pages, 31, true);
  const auto index_perm = testkit::page_permutation(pages, 32);
  const auto kv_perm = testkit::page_permutation(pages, 33);
  // 3 requests of q_len 2 (6 rows) padded to 4 requests (bucket 8).
  const testkit::StepMeta meta =
      testkit::make_step({70, 150, 33}, 2, m.block_size, max_blocks, index_perm, kv_perm);
  testkit::SplitMix64 rng(34);
  const std::size_t n = static_cast<std::size_t>(meta.batch.num_rows() * m.hidden);
  std::vector<uint16_t> hidden(n), residual(n);
  for (std::size_t i = 0; i < n; ++i) {
    hidden[i] = float_to_bf16(rng.signed_unit());
    residual[i] = float_to_bf16(rng.signed_unit());
  }
  const StepRun plain = run_step(master, config, meta, 3, hidden, residual);
  const StepRun padded = run_step(master, config, meta, 4, hidden, residual);
  EXPECT_EQ(plain.hidden, padded.hidden);
  EXPECT_EQ(plain.residual, padded.residual);
  ASSERT_EQ(plain.caches.size(), padded.caches.size());
  for (std::size_t i = 0; i < plain.caches.size(); ++i) {
    EXPECT_EQ(
        std::memcmp(plain.caches[i].data(), padded.caches[i].data(), plain.caches[i].nbytes()), 0)
        << "cache " << i << " differs";
  }
}

TEST(RuntimePadding, BadPaddingIsAnError) {
  RuntimeConfig config = testkit::small_config();  // max_requests 4, buckets up to 8
  config.max_context = 256;
  const ModelConfig& m = config.model;
  const int64_t max_blocks = config.max_context / m.block_size;
  const int64_t pages = config.max_requests * max_blocks + 3;
  const testkit::MasterModel master = testkit::make_master(m, pages, 41, false);
  testkit::RankModel model = testkit::make_rank_model(master, 0, 1);
  const auto perm = testkit::page_permutation(pages, 42);
  const testkit::StepMeta meta =
      testkit::make_step({70, 150}, 2, m.block_size, max_blocks, perm, perm);
  auto comm = make_single_rank_communicator();
  Runtime rt([](const std::string&) {});
  ASSERT_EQ(rt.prepare(model.weights, config, *comm), PrepareResult::kActive);
  EXPECT_THROW(rt.begin_step(meta.batch, 1), Error);  // below num_reqs
  EXPECT_THROW(rt.begin_step(meta.batch, 5), Error);  // above max_requests (and 10 rows > 8)
  EXPECT_TRUE(rt.begin_step(meta.batch, 4));          // 8 rows: the largest bucket
  EXPECT_EQ(rt.step_metadata().num_reqs, 4);
  rt.close();
}

}  // namespace
}  // namespace m3msa
