// The CP model must select exactly what one GPU selects (docs/context_parallel.md "Exactness"), for
// every world size that can place the heads, on every kind of batch, and across many calls with no
// barrier.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <random>
#include <vector>

#include "cp_test_util.h"
#include "m3msa/cp_model.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "m3msa/sort_key.h"
#include "m3msa/synthetic.h"

namespace m3msa {
namespace {

using cp_test::all_ranks;
using cp_test::on_ranks;
using cp_test::run_bounded;
using cp_test::same_selection;
using cp_test::small_config;

// Long enough that a healthy peer on a loaded two-core machine never trips it.
constexpr std::chrono::microseconds kGenerousBudget = std::chrono::seconds(20);
constexpr std::chrono::milliseconds kTestLimit = std::chrono::seconds(120);

TEST(CpPlacement, EveryHeadHasItsConsumers) {
  const int heads = 4;
  for (int world_size : {1, 2, 4, 8}) {
    std::vector<int> merges(heads, 0);
    for (int rank = 0; rank < world_size; ++rank) {
      const std::vector<int> merged = cp_merged_heads(world_size, heads, rank);
      EXPECT_EQ(static_cast<int>(merged.size()), world_size <= heads ? heads / world_size : 1);
      for (int head : merged) {
        ++merges[static_cast<std::size_t>(head)];
        const std::vector<int> consumers = cp_consumers(world_size, heads, head);
        EXPECT_NE(std::find(consumers.begin(), consumers.end(), rank), consumers.end())
            << "P=" << world_size << " rank " << rank << " head " << head;
      }
    }
    // P <= H: one merger per head; P > H: P/H consumers per head, each merging for itself.
    for (int head = 0; head < heads; ++head) {
      EXPECT_EQ(merges[static_cast<std::size_t>(head)],
                world_size <= heads ? 1 : world_size / heads)
          << "P=" << world_size << " head " << head;
    }
  }
  EXPECT_EQ(cp_merged_heads(2, 4, 1), (std::vector<int>{2, 3}));
  EXPECT_EQ(cp_merged_heads(8, 4, 5), (std::vector<int>{2}));
  EXPECT_EQ(cp_consumers(8, 4, 3), (std::vector<int>{6, 7}));
}

TEST(CpPlacement, BufferKeyFollowsPlacement) {
  const SparseConfig config = small_config(8, 0, 1, 4);
  CpuCpGroup two(config, {2, 16, kGenerousBudget, 1});
  EXPECT_EQ(two.rank(1).buffer_key(), (CpBufferKey{2, 2, 16, 8}));
  CpuCpGroup eight(config, {8, 16, kGenerousBudget, 1});
  EXPECT_EQ(eight.rank(3).buffer_key(), (CpBufferKey{8, 1, 16, 8}));
  // [2 parities][8 sources][1 head][16 rows][8 keys] of 8 bytes.
  EXPECT_EQ(eight.rank(3).buffer_key().bytes_per_rank(), 2u * 8 * 1 * 16 * 8 * 8);
}

// ---- Random cases: bit-identical to P = 1 ----

// "P4" (a named function: gtest's macro already has a parameter called info).
std::string WorldSizeName(const ::testing::TestParamInfo<int>& param) {
  return detail::concat("P", param.param);
}

class CpRandom : public ::testing::TestWithParam<int> {};

TEST_P(CpRandom, MatchesOneGpuSelection) {
  const int world_size = GetParam();
  constexpr int kMaxRows = 16;
  constexpr int kCasesPerConfig = 64;
  // (topk, init_blocks, local_blocks, block_size): M3's (16, 0, 1) shape scaled down, both kinds
  // of forced blocks, no forced blocks, k = 1 and one-token blocks.
  const SparseConfig configs[] = {small_config(8, 0, 1, 4),  small_config(4, 1, 2, 2),
                                  small_config(16, 2, 0, 8), small_config(2, 0, 0, 16),
                                  small_config(3, 1, 1, 1),  small_config(1, 0, 1, 4)};
  std::mt19937_64 rng(1000 + static_cast<uint64_t>(world_size));
  int layer = 0;
  int compared = 0;
  run_bounded(kTestLimit, [&] {
    for (const SparseConfig& config : configs) {
      // One group per configuration for all its cases: the counters run on across calls.
      CpuCpGroup group(config, {world_size, kMaxRows, kGenerousBudget, 1});
      for (int i = 0; i < kCasesPerConfig; ++i) {
        const SyntheticSpec spec = cp_test::draw_spec(rng, config, world_size, kMaxRows);
        const SyntheticCase c = cp_test::make_case(spec);
        const HostTensor expected = cp_test::reference_selection(c);
        HostTensor got(DType::kI32, {c.num_rows(), config.index_heads, config.topk});
        got.fill_bytes(0xA5);  // poison: an entry the merge forgets to write shows up
        cp_select_all(group, layer++ % 60, c.indexer_args(got.view()));
        ASSERT_TRUE(same_selection(expected, got))
            << "P=" << world_size << " case " << i << ": " << cp_test::describe_spec(spec);
        ++compared;
      }
      for (int r = 0; r < world_size; ++r) {
        EXPECT_EQ(group.rank(r).generation(), static_cast<uint32_t>(kCasesPerConfig));
      }
    }
  });
  EXPECT_EQ(compared, kCasesPerConfig * static_cast<int>(std::size(configs)));
}

INSTANTIATE_TEST_SUITE_P(Cp, CpRandom, ::testing::Values(1, 2, 4, 8), WorldSizeName);

// ---- Corner cases, each named ----

struct Corner {
  const char* name;
  std::vector<int64_t> seq_lens;  // decode, q_len 1
};

TEST(CpExactness, CornerContexts) {
  const SparseConfig config = small_config(4, 1, 1, 4);  // k = 4 blocks of 4 tokens
  const Corner corners[] = {
      {"one token", {1}},
      {"fewer blocks than ranks", {5, 9}},  // 2 and 3 blocks
      {"exactly k blocks", {13, 16}},       // 4 blocks
      {"k + 1 blocks", {17, 20}},           // 5 blocks
      {"all padding", {0, 0, 0}},
      {"padding between live", {0, 33, 0, 1}},
      {"one shard holds all of G", {4 * 8 * 4}},  // 32 blocks
      {"thousands of blocks", {4 * 3000 - 3, 4 * 2048}},
  };
  run_bounded(kTestLimit, [&] {
    for (int world_size : {1, 2, 4, 8}) {
      CpuCpGroup group(config, {world_size, 4, kGenerousBudget, 1});
      for (const Corner& corner : corners) {
        for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
          SyntheticSpec spec;
          spec.config = config;
          spec.make_kv_cache = false;
          spec.num_reqs = static_cast<int>(corner.seq_lens.size());
          spec.seq_lens = corner.seq_lens;
          spec.index_dtype = dtype;
          spec.seed = 7;
          const SyntheticCase c = cp_test::make_case(spec);
          const HostTensor expected = cp_test::reference_selection(c);
          HostTensor got(DType::kI32, {c.num_rows(), config.index_heads, config.topk});
          got.fill_bytes(0xA5);
          cp_select_all(group, 3, c.indexer_args(got.view()));
          ASSERT_TRUE(same_selection(expected, got))
              << "P=" << world_size << " " << corner.name << " " << dtype_name(dtype);
        }
      }
    }
  });
}

// Scores that tie exactly everywhere (a constant cache) leave only the block-id part of the key to
// order blocks: the union of shards must still give the lowest ids, as one GPU does.
TEST(CpExactness, AllScoresEqual) {
  const SparseConfig config = small_config(5, 0, 1, 2);
  run_bounded(kTestLimit, [&] {
    for (int world_size : {1, 2, 4, 8}) {
      CpuCpGroup group(config, {world_size, 2, kGenerousBudget, 1});
      SyntheticSpec spec;
      spec.config = config;
      spec.make_kv_cache = false;
      spec.num_reqs = 2;
      spec.seq_lens = {41, 2};
      SyntheticCase c = cp_test::make_case(spec);
      c.index_cache.fill_bytes(0x3C);  // every bf16 element 0x3C3C (about 0.0115)
      const HostTensor expected = cp_test::reference_selection(c);
      HostTensor got(DType::kI32, {c.num_rows(), config.index_heads, config.topk});
      cp_select_all(group, 0, c.indexer_args(got.view()));
      ASSERT_TRUE(same_selection(expected, got)) << "P=" << world_size;
      // Own block (20) forced first, then the lowest ids.
      EXPECT_EQ(got.ptr<int32_t>()[0], 20);
      EXPECT_EQ(got.ptr<int32_t>()[1], 0);
      EXPECT_EQ(got.ptr<int32_t>()[4], 3);
    }
  });
}

// ---- Many calls without a barrier ----

// Every rank runs its own sequence of calls as fast as it can, never waiting for the others
// between calls (only the exchange itself synchronizes), for more than 2 * 255 generations so
// both parities see the tag wrap twice. Batch sizes vary, so rows past the live batch keep
// exchanging empty nominations.
class CpSequence : public ::testing::TestWithParam<int> {};

TEST_P(CpSequence, ManyCallsWithoutBarrierStayExact) {
  const int world_size = GetParam();
  constexpr int kCalls = 560;  // > 2 * 255
  constexpr int kPool = 24;
  constexpr int kMaxRows = 8;
  const SparseConfig config = small_config(4, 0, 1, 4);
  std::mt19937_64 rng(77 + static_cast<uint64_t>(world_size));
  std::vector<SyntheticCase> pool;
  std::vector<HostTensor> expected;
  for (int i = 0; i < kPool; ++i) {
    SyntheticSpec spec;
    spec.config = config;
    spec.make_kv_cache = false;
    spec.q_len = static_cast<int>(rng() % 2) + 1;
    spec.num_reqs = static_cast<int>(rng() % (kMaxRows / spec.q_len + 1));
    spec.min_context = 1;
    spec.max_context = 1 + static_cast<int64_t>(rng() % 400);
    spec.padding_reqs = spec.num_reqs > 0 ? static_cast<int>(rng() % 2) : 0;
    spec.index_dtype = i % 2 ? DType::kFP8E4M3 : DType::kBF16;
    spec.seed = rng();
    pool.push_back(cp_test::make_case(spec));
    expected.push_back(cp_test::reference_selection(pool.back()));
  }

  CpuCpGroup group(config, {world_size, kMaxRows, kGenerousBudget, 1});
  // outputs[rank][call]: that rank's [rows, merged heads, k] of that call.
  std::vector<std::vector<HostTensor>> outputs(static_cast<std::size_t>(world_size));
  std::atomic<int> failures{0};
  run_bounded(kTestLimit, [&] {
    on_ranks(all_ranks(world_size), [&](int rank) {
      const int merged = static_cast<int>(group.merged_heads(rank).size());
      try {
        for (int call = 0; call < kCalls; ++call) {
          const SyntheticCase& c = pool[static_cast<std::size_t>(call % kPool)];
          HostTensor out(DType::kI32, {c.num_rows(), merged, config.topk});
          group.select(rank, call % 60, c.indexer_args(out.view()));
          outputs[static_cast<std::size_t>(rank)].push_back(std::move(out));
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        ++failures;
      }
    });
  });
  ASSERT_EQ(failures.load(), 0);

  for (int rank = 0; rank < world_size; ++rank) {
    EXPECT_EQ(group.rank(rank).generation(), static_cast<uint32_t>(kCalls));
    const std::vector<int>& heads = group.merged_heads(rank);
    const int merged = static_cast<int>(heads.size());
    for (int call = 0; call < kCalls; ++call) {
      const HostTensor& want = expected[static_cast<std::size_t>(call % kPool)];
      const HostTensor& got =
          outputs[static_cast<std::size_t>(rank)][static_cast<std::size_t>(call)];
      const int64_t rows = want.shape()[0];
      const int k = config.topk;
      for (int64_t row = 0; row < rows; ++row) {
        for (int j = 0; j < merged; ++j) {
          const int head = heads[static_cast<std::size_t>(j)];
          for (int i = 0; i < k; ++i) {
            const int32_t w = want.ptr<int32_t>()[(row * config.index_heads + head) * k + i];
            const int32_t g = got.ptr<int32_t>()[(row * merged + j) * k + i];
            ASSERT_EQ(w, g) << "P=" << world_size << " rank " << rank << " call " << call << " row "
                            << row << " head " << head << " entry " << i;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cp, CpSequence, ::testing::Values(1, 2, 4, 8), WorldSizeName);

// ---- Buffer sets are shared by key ----

TEST(CpExchange, LayersShareOneBufferSetPerKey) {
  const SparseConfig config = small_config(4, 0, 1, 4);
  const int world_size = 2;
  auto world = std::make_shared<CpuCpWorld>(world_size);
  const CpConfig cp{world_size, 4, kGenerousBudget, 1};
  const CpConfig other_rows{world_size, 6, kGenerousBudget, 1};
  // Per rank: two layers with one key, one layer with another max_rows (a second set).
  std::vector<std::vector<CpuCpRank>> layers(world_size);
  for (int r = 0; r < world_size; ++r) {
    layers[static_cast<std::size_t>(r)].emplace_back(world, r, config, cp);
    layers[static_cast<std::size_t>(r)].emplace_back(world, r, config, cp);
    layers[static_cast<std::size_t>(r)].emplace_back(world, r, config, other_rows);
  }
  SyntheticSpec spec;
  spec.config = config;
  spec.make_kv_cache = false;
  spec.num_reqs = 3;
  spec.seed = 3;
  const SyntheticCase c = cp_test::make_case(spec);
  const HostTensor expected = cp_test::reference_selection(c);
  constexpr int kSteps = 5;
  std::atomic<int> failures{0};
  run_bounded(kTestLimit, [&] {
    on_ranks(all_ranks(world_size), [&](int r) {
      try {
        for (int step = 0; step < kSteps; ++step) {
          for (int layer = 0; layer < 3; ++layer) {
            CpuCpRank& rank = layers[static_cast<std::size_t>(r)][static_cast<std::size_t>(layer)];
            HostTensor out(DType::kI32, {c.num_rows(), 2, config.topk});
            rank.select(layer, c.indexer_args(out.view()));
            for (int64_t row = 0; row < c.num_rows(); ++row) {
              for (int j = 0; j < 2; ++j) {
                for (int i = 0; i < config.topk; ++i) {
                  const int head = rank.merged_heads()[static_cast<std::size_t>(j)];
                  if (out.ptr<int32_t>()[(row * 2 + j) * config.topk + i] !=
                      expected.ptr<int32_t>()[(row * 4 + head) * config.topk + i]) {
                    ++failures;
                  }
                }
              }
            }
          }
        }
      } catch (const std::exception& e) {
        ADD_FAILURE() << e.what();
        ++failures;
      }
    });
  });
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(world->num_buffer_sets(), 2);
  // The two layers of one key share one generation counter; the third has its own set.
  EXPECT_EQ(layers[0][0].generation(), 2u * kSteps);
  EXPECT_EQ(layers[1][1].generation(), 2u * kSteps);
  EXPECT_EQ(layers[0][2].generation(), static_cast<uint32_t>(kSteps));
}

}  // namespace
}  // namespace m3msa
