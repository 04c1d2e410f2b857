// The in-process communicator: all-gather of byte records and the fp32 all-reduce, checked
// exactly (inputs are small integers, so every sum is exact); bounded waits that name the ranks
// that never arrived; lockstep violations caught on every rank.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "m3msa/comm.h"
#include "m3msa/error.h"

namespace m3msa {
namespace {

using namespace std::chrono_literals;

std::string what_of(const std::exception_ptr& error) {
  if (!error) return "";
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

ErrorCode code_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    return e.code();
  } catch (...) {
  }
  ADD_FAILURE() << "not an m3msa::Error";
  return ErrorCode::kInternal;
}

void expect_no_errors(const std::vector<std::exception_ptr>& errors) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    EXPECT_FALSE(errors[r]) << "rank " << r << ": " << what_of(errors[r]);
  }
}

TEST(CommThreadGroup, AllGatherReturnsEveryRanksRecordInRankOrder) {
  constexpr int kWorld = 3;
  constexpr int kRounds = 200;  // fast ranks re-enter while slow ones still read: no mix-ups
  auto group = ThreadGroup::create(kWorld, 20s);
  std::vector<int> wrong(kWorld, 0);
  expect_no_errors(run_ranks(group, [&](Communicator& comm) {
    EXPECT_EQ(comm.world_size(), kWorld);
    for (int round = 0; round < kRounds; ++round) {
      // Rank r sends r + round bytes (rank 0 of round 0: an empty record).
      ByteRecord mine(static_cast<std::size_t>(comm.rank() + round % 5));
      for (std::size_t i = 0; i < mine.size(); ++i) {
        mine[i] = static_cast<uint8_t>(comm.rank() * 31 + round + static_cast<int>(i));
      }
      const auto all = comm.all_gather(mine, "gather");
      mine.assign(mine.size(), 0xEE);  // reusing the buffer after return is allowed
      for (int r = 0; r < kWorld; ++r) {
        const ByteRecord& got = all[static_cast<std::size_t>(r)];
        bool ok = got.size() == static_cast<std::size_t>(r + round % 5);
        for (std::size_t i = 0; ok && i < got.size(); ++i) {
          ok = got[i] == static_cast<uint8_t>(r * 31 + round + static_cast<int>(i));
        }
        wrong[static_cast<std::size_t>(comm.rank())] += ok ? 0 : 1;
      }
    }
  }));
  EXPECT_EQ(wrong, std::vector<int>(kWorld, 0));
  EXPECT_FALSE(group->broken());
}

TEST(CommThreadGroup, AllReduceSumIsExactAndBitIdenticalOnEveryRank) {
  constexpr int kWorld = 4;
  constexpr std::size_t kCount = 1000;
  auto group = ThreadGroup::create(kWorld, 20s);
  std::vector<std::vector<float>> results(kWorld);
  std::vector<int64_t> wrong(kWorld, 0);
  expect_no_errors(run_ranks(group, [&](Communicator& comm) {
    const int r = comm.rank();
    for (int round = 0; round < 50; ++round) {
      std::vector<float> data(kCount);
      for (std::size_t i = 0; i < kCount; ++i) {
        data[i] = static_cast<float>((r + 1) * static_cast<int>(i % 97) - round);
      }
      comm.all_reduce_sum(data.data(), kCount, "reduce");
      for (std::size_t i = 0; i < kCount; ++i) {
        // sum over r of (r + 1) * (i % 97) - round = 10 * (i % 97) - 4 * round
        const float want = static_cast<float>(10 * static_cast<int>(i % 97) - kWorld * round);
        wrong[static_cast<std::size_t>(r)] += data[i] != want;
      }
      results[static_cast<std::size_t>(r)] = data;
    }
    // Non-integers: every rank must still get the same bits (rank-order summation).
    std::vector<float> data(kCount);
    for (std::size_t i = 0; i < kCount; ++i) data[i] = 0.1f * static_cast<float>(r + 1) / (i + 1);
    comm.all_reduce_sum(data.data(), kCount, "reduce");
    results[static_cast<std::size_t>(r)] = data;
  }));
  EXPECT_EQ(wrong, std::vector<int64_t>(kWorld, 0));
  for (int r = 1; r < kWorld; ++r) EXPECT_EQ(results[static_cast<std::size_t>(r)], results[0]);
}

TEST(CommThreadGroup, DifferentCountsAreAnErrorOnEveryRank) {
  auto group = ThreadGroup::create(2, 20s);
  const auto errors = run_ranks(group, [&](Communicator& comm) {
    std::vector<float> data(comm.rank() == 0 ? 8 : 6, 1.0f);
    comm.all_reduce_sum(data.data(), data.size(), "layer 3 o_proj");
  });
  for (const auto& e : errors) {
    ASSERT_TRUE(e);
    EXPECT_EQ(code_of(e), ErrorCode::kInvalidArgument);
    EXPECT_NE(what_of(e).find("rank 0 8 rank 1 6"), std::string::npos) << what_of(e);
    EXPECT_NE(what_of(e).find("layer 3 o_proj"), std::string::npos) << what_of(e);
  }
}

TEST(CommThreadGroup, AMissingRankIsNamedWithinTheTimeoutAndBreaksTheGroup) {
  auto group = ThreadGroup::create(4, 200ms);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks(group, [&](Communicator& comm) {
    if (comm.rank() == 1 || comm.rank() == 3) return;  // never arrive
    comm.all_gather({1, 2, 3}, "prepare/model support");
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  EXPECT_FALSE(errors[1]);
  EXPECT_FALSE(errors[3]);
  for (int r : {0, 2}) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)]);
    EXPECT_EQ(code_of(errors[static_cast<std::size_t>(r)]), ErrorCode::kTimeout);
    const std::string text = what_of(errors[static_cast<std::size_t>(r)]);
    EXPECT_NE(text.find("ranks 1, 3 did not arrive (2 of 4 ranks arrived)"), std::string::npos)
        << text;
    EXPECT_NE(text.find("prepare/model support"), std::string::npos) << text;
  }
  ASSERT_TRUE(group->broken());
  // A late rank fails at once instead of waiting for peers that already gave up.
  auto late = group->communicator(1);
  const auto before = std::chrono::steady_clock::now();
  try {
    late->all_gather({}, "prepare/model support");
    ADD_FAILURE() << "a broken group accepted a collective";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_EQ(e.rank(), 1);
    EXPECT_NE(std::string(e.what()).find("broken"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - before, 100ms);
}

TEST(CommThreadGroup, RanksCallingDifferentCollectivesFailOnEveryRank) {
  auto group = ThreadGroup::create(3, 20s);
  const auto errors = run_ranks(group, [&](Communicator& comm) {
    float x = 1.0f;
    comm.all_reduce_sum(&x, 1, comm.rank() == 2 ? "layer 4 o_proj" : "layer 3 o_proj");
  });
  for (const auto& e : errors) {
    ASSERT_TRUE(e);
    EXPECT_EQ(code_of(e), ErrorCode::kInternal);
    const std::string text = what_of(e);
    EXPECT_NE(text.find("rank 2 'layer 4 o_proj'"), std::string::npos) << text;
    EXPECT_NE(text.find("rank 0 'layer 3 o_proj'"), std::string::npos) << text;
  }
  EXPECT_TRUE(group->broken());
}

TEST(CommThreadGroup, SingleRankAndArgumentChecks) {
  auto single = make_single_rank_communicator();
  EXPECT_EQ(single->world_size(), 1);
  EXPECT_EQ(single->rank(), 0);
  const auto all = single->all_gather({7, 8}, "x");
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0], (ByteRecord{7, 8}));
  float v = 3.0f;
  single->all_reduce_sum(&v, 1, "x");
  EXPECT_EQ(v, 3.0f);

  auto one = ThreadGroup::create(1, 1s);  // a one-rank group never waits
  auto comm = one->communicator(0);
  EXPECT_EQ(comm->all_gather({5}, "x")[0], ByteRecord{5});
  comm->all_reduce_sum(&v, 1, "x");
  EXPECT_EQ(v, 3.0f);

  EXPECT_THROW(ThreadGroup::create(0), Error);
  EXPECT_THROW(ThreadGroup::create(2, 0ms), Error);
  EXPECT_THROW(one->communicator(1), Error);
  EXPECT_THROW(one->communicator(-1), Error);
}

TEST(CommRecord, RoundTripsAndRefusesTruncatedRecords) {
  const ByteRecord record = RecordWriter().u8(3).i64(-42).str("hello").str("").take();
  RecordReader reader(record, "test record");
  EXPECT_EQ(reader.u8(), 3);
  EXPECT_EQ(reader.i64(), -42);
  EXPECT_EQ(reader.str(), "hello");
  EXPECT_EQ(reader.str(), "");
  EXPECT_TRUE(reader.done());

  const ByteRecord truncated(record.begin(), record.begin() + 12);
  RecordReader bad(truncated, "test record");
  bad.u8();
  bad.i64();
  try {
    bad.str();
    ADD_FAILURE() << "truncated record accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInternal);
    EXPECT_NE(std::string(e.what()).find("test record: record truncated"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace m3msa
