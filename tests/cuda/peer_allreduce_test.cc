// The one-shot peer all-reduce (src/comm/peer_allreduce.h) against the CPU rank-order sum, bit for
// bit: ranks as threads (ThreadGroup communicators, one stream each), P = 2 and 4 sharing one GPU,
// P = 2 on two GPUs; counts from 0 to max_count, aligned and misaligned data, both parities; the
// region past count is poisoned and must stay untouched. A CUDA graph of one call per rank is
// replayed 200 times with new inputs. Faults: a rank that skips a call makes its peer's check()
// throw kTimeout naming it within about the spin budget; a rank that passes another count or call
// id makes every rank's check() throw kInvalidArgument naming it and both counts, without waiting
// for the budget; further calls are refused; a mismatched config is refused at setup on every
// rank. Every test skips (with the reason) where there are not enough GPUs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "comm/peer_allreduce.h"
#include "cuda/common.cuh"
#include "m3msa/backend.h"
#include "m3msa/comm.h"
#include "m3msa/error.h"

namespace m3msa::artest {
namespace {

#define M3MSA_AR_REQUIRE_GPUS(n)                                       \
  do {                                                                 \
    const int visible_ = ::m3msa::cuda_device_count();                 \
    if (visible_ < (n)) {                                              \
      GTEST_SKIP() << "needs " << (n) << " CUDA devices, " << visible_ \
                   << " visible: peer all-reduce test skipped";        \
    }                                                                  \
  } while (0)

constexpr int64_t kHidden = 6144;
constexpr int64_t kMaxCount = 16 * kHidden + 3;  // odd: the last slot pair is half used
constexpr int64_t kGuard = 1024;                 // poisoned floats after the largest call
constexpr uint32_t kPoisonBits = 0x7FA5A5A5u;    // a NaN no sum produces

uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return b;
}

float poison() {
  float v;
  std::memcpy(&v, &kPoisonBits, sizeof(v));
  return v;
}

// Rank r's input element i of call `seed`: k * 2^e with |k| <= 1000, e in [-4, 4], so every sum
// of up to 8 of them is a multiple of 2^-4 below 2^17: exact in fp32 whatever the order.
float input(uint64_t seed, int rank, int64_t i) {
  uint64_t x =
      seed * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(rank) << 40) ^ static_cast<uint64_t>(i);
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ull;
  x ^= x >> 33;
  const int k = static_cast<int>(x % 2001) - 1000;
  const int e = static_cast<int>((x >> 20) % 9) - 4;
  return std::ldexp(static_cast<float>(k), e);
}

// The CPU reference: the rank-order fp32 sum.
float expected(uint64_t seed, int world, int64_t i) {
  float s = input(seed, 0, i);
  for (int r = 1; r < world; ++r) s += input(seed, r, i);
  return s;
}

// Runs body(comm) on one thread per rank of a new ThreadGroup; rethrows the first rank's error.
void run_all(int world, const std::function<void(Communicator&)>& body) {
  auto group = ThreadGroup::create(world, std::chrono::milliseconds(20000));
  for (const std::exception_ptr& e : run_ranks(group, body)) {
    if (e) std::rethrow_exception(e);
  }
}

PeerAllReduceConfig config_for(int64_t max_count) {
  PeerAllReduceConfig c;
  c.max_count = max_count;
  c.spin_budget = std::chrono::milliseconds(300);
  return c;
}

// One call on this rank: inputs of `seed` at data[offset, offset + count), poison everywhere else
// of the buffer; returns the number of wrong elements after the call (and prints the first).
int64_t call_and_compare(PeerAllReduce& ar, float* buffer, int64_t buffer_len, int64_t offset,
                         int64_t count, int call_id, uint64_t seed, cudaStream_t stream,
                         std::vector<float>& host) {
  const int rank = ar.rank();
  const int world = ar.world_size();
  host.assign(static_cast<std::size_t>(buffer_len), poison());
  for (int64_t i = 0; i < count; ++i)
    host[static_cast<std::size_t>(offset + i)] = input(seed, rank, i);
  CUDA_CHECK(cudaMemcpyAsync(buffer, host.data(), sizeof(float) * host.size(),
                             cudaMemcpyHostToDevice, stream));
  ar.run(buffer + offset, count, call_id, stream);
  ar.check(stream);
  CUDA_CHECK(cudaMemcpyAsync(host.data(), buffer, sizeof(float) * host.size(),
                             cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  int64_t bad = 0;
  for (int64_t i = 0; i < buffer_len; ++i) {
    const bool inside = i >= offset && i < offset + count;
    const uint32_t want = inside ? bits_of(expected(seed, world, i - offset)) : kPoisonBits;
    const uint32_t got = bits_of(host[static_cast<std::size_t>(i)]);
    if (got != want) {
      if (bad == 0) {
        std::printf(
            "    rank %d call %d (offset %lld, count %lld): first wrong element %lld (%s): "
            "got 0x%08x, want 0x%08x\n",
            rank, call_id, static_cast<long long>(offset), static_cast<long long>(count),
            static_cast<long long>(i), inside ? "summed" : "guard", got, want);
      }
      ++bad;
    }
  }
  return bad;
}

// Every rank on device devices[r % devices.size()]: the sequence of cases twice (the second pass
// has the other parity for every case and new inputs).
void check_exact(int world, const std::vector<int>& devices) {
  struct Case {
    int64_t offset, count;
  };
  const std::vector<Case> cases = {
      {0, 0},           {0, 1},
      {0, 7},           {0, kHidden},
      {1, kHidden + 1}, {0, 16 * kHidden},
      {0, kMaxCount},   {1, kMaxCount - 1},
      {0, 2},
  };
  std::vector<int64_t> bad(static_cast<std::size_t>(world), 0);
  std::vector<uint32_t> generations(static_cast<std::size_t>(world), 0);
  std::vector<int> ctas(static_cast<std::size_t>(world), 0);
  run_all(world, [&](Communicator& comm) {
    const int r = comm.rank();
    const int device = devices[static_cast<std::size_t>(r) % devices.size()];
    CUDA_CHECK(cudaSetDevice(device));
    PeerAllReduce ar(comm, device, config_for(kMaxCount));
    EXPECT_GE(ar.buffer_bytes_per_rank(),
              static_cast<std::size_t>(2 * world * (kMaxCount + 1) * sizeof(uint64_t)));
    EXPECT_FALSE(ar.mapped_by_ipc());
    cuda::Stream stream;
    const int64_t len = kMaxCount + kGuard;
    cuda::DeviceBuffer buffer(sizeof(float) * static_cast<std::size_t>(len));
    std::vector<float> host;
    int call = 0;
    for (int pass = 0; pass < 2; ++pass) {
      for (const Case& c : cases) {
        bad[static_cast<std::size_t>(r)] += call_and_compare(
            ar, buffer.as<float>(), len, c.offset, c.count, call,
            1000u * static_cast<uint64_t>(pass) + static_cast<uint64_t>(call), stream.get(), host);
        ++call;
      }
    }
    generations[static_cast<std::size_t>(r)] = ar.generation();
    ctas[static_cast<std::size_t>(r)] = ar.ctas();
    comm.all_gather({}, "test/done");  // no rank frees its buffer while a peer may store into it
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(bad[static_cast<std::size_t>(r)], 0) << "P " << world << " rank " << r;
    EXPECT_EQ(generations[static_cast<std::size_t>(r)], 2 * cases.size()) << "rank " << r;
    EXPECT_EQ(ctas[static_cast<std::size_t>(r)], ctas[0]) << "rank " << r;
  }
  std::printf("  P %d: %d CTAs per launch\n", world, ctas[0]);
}

TEST(PeerAllReduce, ExactTwoRanksOneGpu) {
  M3MSA_AR_REQUIRE_GPUS(1);
  check_exact(2, {0});
}

TEST(PeerAllReduce, ExactFourRanksOneGpu) {
  M3MSA_AR_REQUIRE_GPUS(1);
  check_exact(4, {0});
}

TEST(PeerAllReduce, ExactTwoGpus) {
  M3MSA_AR_REQUIRE_GPUS(2);
  check_exact(2, {0, 1});
}

TEST(PeerAllReduce, OneRankIsTheIdentity) {
  M3MSA_AR_REQUIRE_GPUS(1);
  auto comm = make_single_rank_communicator();
  CUDA_CHECK(cudaSetDevice(0));
  PeerAllReduce ar(*comm, 0, config_for(kMaxCount));
  cuda::Stream stream;
  cuda::DeviceBuffer buffer(sizeof(float) * (kMaxCount + kGuard));
  std::vector<float> host;
  EXPECT_EQ(call_and_compare(ar, buffer.as<float>(), kMaxCount + kGuard, 0, kMaxCount, 0, 7,
                             stream.get(), host),
            0);
  EXPECT_EQ(ar.generation(), 1u);
}

// One graph of one call per rank, replayed 200 times; the inputs change between replays (queued
// eagerly on the same stream). One GPU per rank when two are visible, else both on one.
TEST(PeerAllReduce, GraphReplayedTwoHundredTimes) {
  M3MSA_AR_REQUIRE_GPUS(1);
  constexpr int kWorld = 2;
  constexpr int kReplays = 200;
  const int64_t count = 16 * kHidden;
  const int visible = cuda_device_count();
  std::vector<int64_t> bad(kWorld, 0);
  std::vector<uint32_t> generations(kWorld, 0);
  run_all(kWorld, [&](Communicator& comm) {
    const int r = comm.rank();
    const int device = r % visible;
    CUDA_CHECK(cudaSetDevice(device));
    PeerAllReduce ar(comm, device, config_for(count));
    cuda::Stream stream;
    cuda::DeviceBuffer buffer(sizeof(float) * static_cast<std::size_t>(count));
    std::vector<float> host(static_cast<std::size_t>(count));
    cuda::Graph graph = cuda::Graph::capture(
        stream.get(), [&] { ar.run(buffer.as<float>(), count, 5, stream.get()); });
    for (int rep = 0; rep < kReplays; ++rep) {
      const uint64_t seed = 7000u + static_cast<uint64_t>(rep);
      for (int64_t i = 0; i < count; ++i) host[static_cast<std::size_t>(i)] = input(seed, r, i);
      CUDA_CHECK(cudaMemcpyAsync(buffer.data(), host.data(), sizeof(float) * host.size(),
                                 cudaMemcpyHostToDevice, stream.get()));
      graph.launch(stream.get());
      CUDA_CHECK(cudaMemcpyAsync(host.data(), buffer.data(), sizeof(float) * host.size(),
                                 cudaMemcpyDeviceToHost, stream.get()));
      ar.check(stream.get());  // waits (bounded) for the copy too
      int64_t wrong = 0;
      for (int64_t i = 0; i < count; ++i) {
        wrong += bits_of(host[static_cast<std::size_t>(i)]) != bits_of(expected(seed, kWorld, i));
      }
      if (wrong != 0 && bad[static_cast<std::size_t>(r)] == 0) {
        std::printf("    rank %d replay %d: %lld wrong elements\n", r, rep,
                    static_cast<long long>(wrong));
      }
      bad[static_cast<std::size_t>(r)] += wrong;
    }
    generations[static_cast<std::size_t>(r)] = ar.generation();
    comm.all_gather({}, "test/done");
  });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(bad[static_cast<std::size_t>(r)], 0) << "rank " << r;
    EXPECT_EQ(generations[static_cast<std::size_t>(r)], static_cast<uint32_t>(kReplays));
  }
}

// Arguments refused before anything is launched leave the ranks in lockstep.
TEST(PeerAllReduce, BadArgumentsRefusedWithoutBreakingLockstep) {
  M3MSA_AR_REQUIRE_GPUS(1);
  std::vector<int64_t> bad(2, 0);
  run_all(2, [&](Communicator& comm) {
    CUDA_CHECK(cudaSetDevice(0));
    PeerAllReduce ar(comm, 0, config_for(1000));
    cuda::Stream stream;
    cuda::DeviceBuffer buffer(sizeof(float) * (1000 + kGuard));
    std::vector<float> host_data(1000, 1.0f);
    auto expect_refused = [&](const std::function<void()>& body, const std::string& needle) {
      try {
        body();
        ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
        EXPECT_EQ(e.rank(), comm.rank());
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    expect_refused([&] { ar.run(buffer.as<float>(), 1001, 0, stream.get()); }, "count = 1001");
    expect_refused([&] { ar.run(buffer.as<float>(), -1, 0, stream.get()); }, "count = -1");
    expect_refused([&] { ar.run(nullptr, 10, 0, stream.get()); }, "null");
    expect_refused([&] { ar.run(host_data.data(), 10, 0, stream.get()); }, "not device memory");
    std::vector<float> host;
    bad[static_cast<std::size_t>(comm.rank())] =
        call_and_compare(ar, buffer.as<float>(), 1000 + kGuard, 0, 1000, 0, 3, stream.get(), host);
    comm.all_gather({}, "test/done");
  });
  EXPECT_EQ(bad[0], 0);
  EXPECT_EQ(bad[1], 0);
}

TEST(PeerAllReduce, MismatchedConfigRefusedOnEveryRank) {
  M3MSA_AR_REQUIRE_GPUS(1);
  std::vector<std::string> messages(2, "no error");
  std::vector<std::optional<ErrorCode>> codes(2);
  run_all(2, [&](Communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    CUDA_CHECK(cudaSetDevice(0));
    try {
      PeerAllReduce ar(comm, 0, config_for(comm.rank() == 0 ? 1000 : 2000));
    } catch (const Error& e) {
      messages[r] = e.what();
      codes[r] = e.code();
    }
  });
  for (int r = 0; r < 2; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    EXPECT_EQ(codes[ur], ErrorCode::kInvalidArgument) << messages[ur];
    EXPECT_NE(messages[ur].find("max_count=1000"), std::string::npos) << messages[ur];
    EXPECT_NE(messages[ur].find("max_count=2000"), std::string::npos) << messages[ur];
  }
}

// ---- A rank out of lockstep ----

TEST(PeerAllReduceFaults, SkippedCallTimesOutNamingTheRank) {
  M3MSA_AR_REQUIRE_GPUS(1);
  PeerAllReduceConfig config = config_for(1000);
  config.spin_budget = std::chrono::milliseconds(50);
  std::string message = "no error";
  std::optional<ErrorCode> code;
  std::optional<PeerAllReduceFault> fault;
  double waited_ms = 0.0;
  run_all(2, [&](Communicator& comm) {
    const int r = comm.rank();
    CUDA_CHECK(cudaSetDevice(0));
    PeerAllReduce ar(comm, 0, config);
    cuda::Stream stream;
    cuda::DeviceBuffer buffer(sizeof(float) * (1000 + kGuard));
    std::vector<float> host;
    EXPECT_EQ(
        call_and_compare(ar, buffer.as<float>(), 1000 + kGuard, 0, 1000, 0, 1, stream.get(), host),
        0);
    comm.all_gather({}, "test/after-first-call");
    // Rank 1 skips call 1; it keeps its buffer alive until rank 0 is done, since rank 0's stores
    // still land in it.
    if (r == 1) {
      comm.all_gather({}, "test/done");
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      ar.run(buffer.as<float>(), 1000, 1, stream.get());
      ar.check(stream.get());
    } catch (const Error& e) {
      message = e.what();
      code = e.code();
      EXPECT_EQ(e.rank(), 0);
    }
    waited_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    fault = ar.last_fault();
    // Out of lockstep: a further call is refused (not hung), check() reports the fault again.
    try {
      ar.run(buffer.as<float>(), 1000, 2, stream.get());
      ADD_FAILURE() << "a call after the fault was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("out of lockstep"), std::string::npos) << e.what();
    }
    try {
      ar.check(stream.get());
      ADD_FAILURE() << "check() after the fault returned";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    }
    comm.all_gather({}, "test/done");
  });
  std::printf("  timeout after %.1f ms: %s\n", waited_ms, message.c_str());
  EXPECT_EQ(code, ErrorCode::kTimeout) << message;
  EXPECT_NE(message.find("rank 1 never delivered"), std::string::npos) << message;
  ASSERT_TRUE(fault.has_value());
  EXPECT_EQ(fault->kind, PeerAllReduceFault::Kind::kTimeout);
  EXPECT_EQ(fault->source, 1);
  EXPECT_EQ(fault->call_id, 1);
  EXPECT_EQ(fault->seen_tag, 0u);  // parity 1 was never written by rank 1
  EXPECT_GE(waited_ms, 40.0);
  EXPECT_LT(waited_ms, 2000.0);
}

// Rank 1 passes `count1` / `call_id1` for call 1, rank 0 passes 100 / 1: both must throw
// kInvalidArgument naming the other rank and both counts, long before the (2 s) spin budget.
void check_mismatch(int64_t count1, int call_id1) {
  PeerAllReduceConfig config = config_for(1000);
  config.spin_budget = std::chrono::milliseconds(2000);
  std::vector<std::string> messages(2, "no error");
  std::vector<std::optional<ErrorCode>> codes(2);
  std::vector<std::optional<PeerAllReduceFault>> faults(2);
  std::vector<double> waited_ms(2, 0.0);
  run_all(2, [&](Communicator& comm) {
    const int r = comm.rank();
    const auto ur = static_cast<std::size_t>(r);
    CUDA_CHECK(cudaSetDevice(0));
    PeerAllReduce ar(comm, 0, config);
    cuda::Stream stream;
    cuda::DeviceBuffer buffer(sizeof(float) * (1000 + kGuard));
    std::vector<float> host;
    EXPECT_EQ(
        call_and_compare(ar, buffer.as<float>(), 1000 + kGuard, 0, 1000, 0, 1, stream.get(), host),
        0);
    const auto start = std::chrono::steady_clock::now();
    try {
      ar.run(buffer.as<float>(), r == 0 ? 100 : count1, r == 0 ? 1 : call_id1, stream.get());
      ar.check(stream.get());
    } catch (const Error& e) {
      messages[ur] = e.what();
      codes[ur] = e.code();
      EXPECT_EQ(e.rank(), r);
    }
    waited_ms[ur] =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    faults[ur] = ar.last_fault();
    try {
      ar.run(buffer.as<float>(), 100, 2, stream.get());
      ADD_FAILURE() << "rank " << r << ": a call after the fault was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("out of lockstep"), std::string::npos) << e.what();
    }
    comm.all_gather({}, "test/done");  // peers stop storing before buffers go
  });
  const int64_t counts[2] = {100, count1};
  const int call_ids[2] = {1, call_id1};
  for (int r = 0; r < 2; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    const int other = 1 - r;
    std::printf("  rank %d after %.1f ms: %s\n", r, waited_ms[ur], messages[ur].c_str());
    EXPECT_EQ(codes[ur], ErrorCode::kInvalidArgument) << messages[ur];
    const std::string named = "rank " + std::to_string(other) + " passed count " +
                              std::to_string(counts[other]) + " (call id " +
                              std::to_string(call_ids[other]) + ")";
    EXPECT_NE(messages[ur].find(named), std::string::npos) << messages[ur];
    const std::string own = "this rank passed count " + std::to_string(counts[r]) + " (call id " +
                            std::to_string(call_ids[r]) + ")";
    EXPECT_NE(messages[ur].find(own), std::string::npos) << messages[ur];
    ASSERT_TRUE(faults[ur].has_value());
    EXPECT_EQ(faults[ur]->kind, PeerAllReduceFault::Kind::kCountMismatch);
    EXPECT_EQ(faults[ur]->source, other);
    EXPECT_EQ(faults[ur]->seen_count, counts[other]);
    EXPECT_EQ(faults[ur]->count, counts[r]);
    EXPECT_LT(waited_ms[ur], 1000.0);  // found when the call word landed, not by a timeout
  }
}

TEST(PeerAllReduceFaults, OtherCountNamesTheRankAndBothCounts) {
  M3MSA_AR_REQUIRE_GPUS(1);
  check_mismatch(200, 1);  // more elements than rank 0 sends
  check_mismatch(40, 1);   // fewer
}

TEST(PeerAllReduceFaults, OtherCallIdNamesTheRank) {
  M3MSA_AR_REQUIRE_GPUS(1);
  check_mismatch(100, 3);
}

}  // namespace
}  // namespace m3msa::artest
