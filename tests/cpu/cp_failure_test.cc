// When ranks break the one hard rule of docs/context_parallel.md (same calls, same shapes, same
// order), the CP model must fail fast with an error that names the culprit: never hang, never
// return garbage.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "cp_test_util.h"
#include "m3msa/cp_model.h"
#include "m3msa/error.h"
#include "m3msa/sort_key.h"
#include "m3msa/synthetic.h"

namespace m3msa {
namespace {

using cp_test::all_ranks;
using cp_test::on_ranks;
using cp_test::run_bounded;
using cp_test::small_config;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// The default budget: short enough for a quick test, long enough that the good calls before a
// skip never time out on a loaded machine.
constexpr std::chrono::microseconds kBudget = kDefaultCpSpinBudget;
constexpr milliseconds kBudgetMs = std::chrono::duration_cast<milliseconds>(kBudget);
// Scheduling slack on a loaded two-core machine; still far below "hung".
constexpr milliseconds kMargin{1500};
// For errors that must come without waiting out a budget: a budget far above the margin.
constexpr std::chrono::microseconds kLongBudget = std::chrono::seconds(10);
constexpr milliseconds kTestLimit{30000};

SyntheticCase small_case(const SparseConfig& config, int num_reqs, uint64_t seed) {
  SyntheticSpec spec;
  spec.config = config;
  spec.make_kv_cache = false;
  spec.num_reqs = num_reqs;
  spec.max_context = 300;
  spec.seed = seed;
  return make_synthetic_case(spec);
}

// What one rank's call ended with.
struct Outcome {
  std::optional<Error> error;
  milliseconds elapsed{0};
};

// Runs one select on each rank in `callers` (the others skip the call), one thread each; rank r
// passes the batch cases[r].
std::vector<Outcome> call_ranks(const std::vector<CpuCpRank*>& ranks,
                                const std::vector<int>& callers, int layer,
                                const std::vector<const SyntheticCase*>& cases) {
  std::vector<Outcome> outcomes(ranks.size());
  on_ranks(callers, [&](int r) {
    CpuCpRank& rank = *ranks[static_cast<std::size_t>(r)];
    const SyntheticCase& c = *cases[static_cast<std::size_t>(r)];
    HostTensor out(DType::kI32,
                   {c.num_rows(), static_cast<int64_t>(rank.merged_heads().size()), c.config.topk});
    const Clock::time_point start = Clock::now();
    try {
      rank.select(layer, c.indexer_args(out.view()));
    } catch (const Error& e) {
      outcomes[static_cast<std::size_t>(r)].error = e;
    }
    outcomes[static_cast<std::size_t>(r)].elapsed =
        std::chrono::duration_cast<milliseconds>(Clock::now() - start);
  });
  return outcomes;
}

// The same batch on every rank.
std::vector<Outcome> call_ranks(const std::vector<CpuCpRank*>& ranks,
                                const std::vector<int>& callers, int layer,
                                const SyntheticCase& c) {
  return call_ranks(ranks, callers, layer, std::vector<const SyntheticCase*>(ranks.size(), &c));
}

std::vector<CpuCpRank*> ranks_of(CpuCpGroup& group) {
  std::vector<CpuCpRank*> ranks;
  for (int r = 0; r < group.world_size(); ++r) ranks.push_back(&group.rank(r));
  return ranks;
}

// ---- Placement ----

TEST(CpPlacement, RejectsWorldSizesThatCannotPlaceHeads) {
  const SparseConfig config = small_config(4, 0, 1, 4);  // H = 4
  for (int world_size : {3, 6}) {
    try {
      CpuCpGroup group(config, {world_size, 4, kBudget, 1});
      ADD_FAILURE() << "P=" << world_size << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(e.message().find(detail::concat("world size ", world_size)), std::string::npos)
          << e.what();
      EXPECT_NE(e.message().find("cannot place its heads"), std::string::npos) << e.what();
    }
    EXPECT_THROW(cp_merged_heads(world_size, 4, 0), Error);
    EXPECT_THROW(cp_consumers(world_size, 4, 0), Error);
  }
  EXPECT_THROW(validate_cp_placement(0, 4), Error);
  EXPECT_NO_THROW(validate_cp_placement(16, 4));
  EXPECT_NO_THROW(validate_cp_placement(1, 4));
}

// ---- A rank that skips a call ----

void expect_skipped_rank_named(int world_size, int skipper) {
  const SparseConfig config = small_config(4, 0, 1, 4);
  CpuCpGroup group(config, {world_size, 4, kBudget, 1});
  const SyntheticCase c = small_case(config, 3, 11);
  std::vector<int> others;
  for (int r = 0; r < world_size; ++r) {
    if (r != skipper) others.push_back(r);
  }
  run_bounded(kTestLimit, [&] {
    // Two good calls (generations 1 and 2: both parities written), then the skip at generation 3.
    for (int call = 0; call < 2; ++call) {
      for (const Outcome& outcome : call_ranks(ranks_of(group), all_ranks(world_size), call, c)) {
        ASSERT_FALSE(outcome.error) << outcome.error->what();
      }
    }
    const std::vector<Outcome> outcomes = call_ranks(ranks_of(group), others, 5, c);
    for (int r : others) {
      const Outcome& outcome = outcomes[static_cast<std::size_t>(r)];
      ASSERT_TRUE(outcome.error) << "rank " << r << " returned without rank " << skipper;
      const Error& e = *outcome.error;
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
      EXPECT_EQ(e.rank(), r) << e.what();
      const std::string named = detail::concat("rank ", skipper, " never delivered layer 5");
      EXPECT_NE(e.message().find(named), std::string::npos) << e.what();
      EXPECT_NE(e.message().find("expected tag 4, saw tag 2"), std::string::npos) << e.what();
      EXPECT_GE(outcome.elapsed, kBudgetMs) << "rank " << r;
      EXPECT_LT(outcome.elapsed, kBudgetMs + kMargin) << "rank " << r;

      const std::optional<CpTimeoutRecord> record = group.rank(r).last_timeout();
      ASSERT_TRUE(record);
      EXPECT_EQ(record->layer, 5);
      EXPECT_EQ(record->row, 0);
      EXPECT_EQ(record->head, group.merged_heads(r).front());
      EXPECT_EQ(record->source, skipper);
      // Generation 3 writes tag 4 into parity 1, whose slots last held generation 1's tag 2.
      EXPECT_EQ(record->expected_tag, generation_tag(3));
      EXPECT_EQ(record->seen_tag, generation_tag(1));
    }
    EXPECT_FALSE(group.rank(skipper).last_timeout());

    // The waiting ranks are out of lockstep now and say so instead of exchanging garbage.
    HostTensor out(
        DType::kI32,
        {c.num_rows(), static_cast<int64_t>(group.merged_heads(others[0]).size()), config.topk});
    try {
      group.select(others[0], 6, c.indexer_args(out.view()));
      ADD_FAILURE() << "a failed rank accepted another call";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(e.message().find("out of lockstep"), std::string::npos) << e.what();
    }
  });
}

TEST(CpTimeout, SkippedCallNamesTheMissingRank) {
  expect_skipped_rank_named(4, 2);
}

TEST(CpTimeout, SkippedCallNamesTheMissingRankWhenRanksOutnumberHeads) {
  expect_skipped_rank_named(8, 5);
}

TEST(CpTimeout, SkippedCallOfTwoRanks) {
  expect_skipped_rank_named(2, 0);
}

// Every rank refuses the batch before touching shared state, so nobody waits for anybody.
TEST(CpValidation, SelectAllRejectsTooManyRows) {
  const SparseConfig config = small_config(4, 0, 1, 4);
  CpuCpGroup group(config, {2, 2, kBudget, 1});
  const SyntheticCase c = small_case(config, 3, 5);  // 3 rows > max_rows 2
  HostTensor out(DType::kI32, {c.num_rows(), config.index_heads, config.topk});
  run_bounded(kTestLimit, [&] {
    try {
      cp_select_all(group, 0, c.indexer_args(out.view()));
      ADD_FAILURE() << "3 rows accepted with max_rows 2";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(e.message().find("max_rows"), std::string::npos) << e.what();
      EXPECT_EQ(e.rank(), 0) << e.what();
    }
  });
}

// ---- Host agreement ----

// Every rank builds its own CpuCpRank, rank odd_rank with odd_config / odd_cp (and a batch of its
// shape), the others with config / cp. Every rank sees the odd one out in the setup step, so all
// of them must fail with kInvalidArgument naming `field`, at once.
void expect_setup_mismatch(int world_size, int odd_rank, const SparseConfig& config,
                           const CpConfig& cp, const SparseConfig& odd_config,
                           const CpConfig& odd_cp, const std::string& field) {
  auto world = std::make_shared<CpuCpWorld>(world_size);
  std::vector<CpuCpRank> ranks;
  for (int r = 0; r < world_size; ++r) {
    ranks.emplace_back(world, r, r == odd_rank ? odd_config : config, r == odd_rank ? odd_cp : cp);
  }
  std::vector<CpuCpRank*> pointers;
  for (CpuCpRank& rank : ranks) pointers.push_back(&rank);
  const SyntheticCase c = small_case(config, 2, 9);
  const SyntheticCase odd_c = small_case(odd_config, 2, 9);
  std::vector<const SyntheticCase*> cases(static_cast<std::size_t>(world_size), &c);
  cases[static_cast<std::size_t>(odd_rank)] = &odd_c;
  run_bounded(kTestLimit, [&] {
    const std::vector<Outcome> outcomes = call_ranks(pointers, all_ranks(world_size), 1, cases);
    for (int r = 0; r < world_size; ++r) {
      const Outcome& outcome = outcomes[static_cast<std::size_t>(r)];
      ASSERT_TRUE(outcome.error) << "rank " << r << " accepted a mismatched setup";
      const Error& e = *outcome.error;
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_EQ(e.rank(), r);
      EXPECT_NE(e.message().find(field), std::string::npos) << e.what();
      EXPECT_NE(e.message().find("setup"), std::string::npos) << e.what();
      // Detected as soon as every rank posted, not by waiting out the (long) budget.
      EXPECT_LT(outcome.elapsed, kMargin) << "rank " << r;
    }
    EXPECT_EQ(world->num_buffer_sets(), 0);
  });
}

TEST(CpAgreement, MismatchedMaxRowsIsAnError) {
  const SparseConfig config = small_config(4, 0, 1, 4);
  expect_setup_mismatch(4, 3, config, {4, 8, kLongBudget, 1}, config, {4, 6, kLongBudget, 1},
                        "max_rows=6");
}

TEST(CpAgreement, MismatchedTopkIsAnError) {
  const SparseConfig config = small_config(4, 0, 1, 4);
  const SparseConfig odd = small_config(8, 0, 1, 4);
  expect_setup_mismatch(2, 0, config, {2, 4, kLongBudget, 1}, odd, {2, 4, kLongBudget, 1},
                        "topk=8");
}

// Same buffer key (P > H, one merged head either way) but heads placed differently: still refused.
TEST(CpAgreement, MismatchedHeadCountIsAnError) {
  const SparseConfig config = small_config(4, 0, 1, 4);
  const SparseConfig odd = small_config(4, 0, 1, 4, /*heads=*/8);
  expect_setup_mismatch(8, 6, config, {8, 4, kLongBudget, 1}, odd, {8, 4, kLongBudget, 1},
                        "index_heads=8");
}

TEST(CpAgreement, RankThatNeverJoinsTimesOut) {
  const SparseConfig config = small_config(4, 0, 1, 4);
  CpuCpGroup group(config, {4, 4, kBudget, 1});
  const SyntheticCase c = small_case(config, 2, 4);
  run_bounded(kTestLimit, [&] {
    const std::vector<Outcome> outcomes = call_ranks(ranks_of(group), {0, 2, 3}, 0, c);
    for (int r : {0, 2, 3}) {
      const Outcome& outcome = outcomes[static_cast<std::size_t>(r)];
      ASSERT_TRUE(outcome.error) << "rank " << r;
      EXPECT_EQ(outcome.error->code(), ErrorCode::kTimeout) << outcome.error->what();
      EXPECT_EQ(outcome.error->rank(), r);
      EXPECT_NE(outcome.error->message().find("rank 1 never joined"), std::string::npos)
          << outcome.error->what();
      EXPECT_GE(outcome.elapsed, kBudgetMs) << "rank " << r;
      EXPECT_LT(outcome.elapsed, kBudgetMs + kMargin) << "rank " << r;
    }
  });
}

// ---- Arguments ----

TEST(CpValidation, BadArgumentsFailBeforeTheExchange) {
  const SparseConfig config = small_config(4, 0, 1, 4);
  CpuCpGroup group(config, {2, 2, kBudget, 1});
  const SyntheticCase big = small_case(config, 3, 1);
  const SyntheticCase ok = small_case(config, 2, 1);
  run_bounded(kTestLimit, [&] {
    // Too many rows: refused on the calling rank alone, immediately, with its rank.
    HostTensor three(DType::kI32, {3, 2, config.topk});
    try {
      group.select(1, 0, big.indexer_args(three.view()));
      ADD_FAILURE() << "3 rows accepted with max_rows 2";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_EQ(e.rank(), 1);
      EXPECT_NE(e.message().find("max_rows = 2"), std::string::npos) << e.what();
    }
    // Output with every head instead of the merged ones.
    HostTensor full(DType::kI32, {2, config.index_heads, config.topk});
    try {
      group.select(0, 0, ok.indexer_args(full.view()));
      ADD_FAILURE() << "a full-width topk_idx accepted on rank 0 of 2";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(e.message().find("topk_idx"), std::string::npos) << e.what();
    }
    // Nothing shared was touched: the group still works and is exact.
    const HostTensor expected = cp_test::reference_selection(ok);
    HostTensor got(DType::kI32, {2, config.index_heads, config.topk});
    cp_select_all(group, 0, ok.indexer_args(got.view()));
    EXPECT_TRUE(cp_test::same_selection(expected, got));
    EXPECT_EQ(group.rank(0).generation(), 1u);
  });
}

TEST(CpValidation, BadConfigurations) {
  const SparseConfig config = small_config(4, 0, 1, 4);
  auto world = std::make_shared<CpuCpWorld>(2);
  EXPECT_THROW(CpuCpRank(world, 2, config, {2, 4, kBudget, 1}), Error);  // rank
  EXPECT_THROW(CpuCpRank(world, 0, config, {4, 4, kBudget, 1}), Error);  // world size
  EXPECT_THROW(CpuCpRank(world, 0, config, {2, 0, kBudget, 1}), Error);  // max_rows
  EXPECT_THROW(CpuCpRank(world, 0, config, {2, 4, std::chrono::microseconds(0), 1}), Error);
  EXPECT_THROW(CpuCpWorld(0), Error);
}

}  // namespace
}  // namespace m3msa
