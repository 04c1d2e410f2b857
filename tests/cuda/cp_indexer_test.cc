// The CUDA CP indexer (cp_cuda.h) against the one-GPU indexer: selections must be bit-identical
// for every transport (docs/context_parallel.md "Exactness"), also under CUDA-graph replay with
// changing metadata; a rank that skips a call makes its peer report kTimeout naming it within the
// spin budget; a mismatched configuration is caught by the host agreement at setup; a rank that
// passes another shape or layer for the same call makes its peers report kInvalidArgument naming
// it, without waiting and without merging its nominations. Ranks are threads, one GPU each; tests
// that need two GPUs skip (with the reason) on fewer. Ranks as processes: cp_multiprocess_test.cc.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cp_test_util.h"

namespace m3msa::cptest {
namespace {

using idxtest::decode_spec;
using idxtest::expect_error;
using idxtest::Rng;
using idxtest::run_gpu;

void check_transport(CpTransport transport, int P) {
  const std::vector<Case> cases = {
      {1, 1, 1, 1, DType::kBF16, 0, {}},                  // one token: fewer blocks than ranks
      {3, 1, 0, 0, DType::kFP8E4M3, 0, {100, 129, 257}},  // < P, = P, > P blocks
      {2, 4, 0, 0, DType::kBF16, 0, {16 * 128, 16 * 128 + 1}},  // exactly k blocks, k + 1
      {8, 1, 1, 40000, DType::kFP8E4M3, 2, {}},                 // padding rows
      {16, 4, 1, 70000, DType::kBF16, 3, {}},                   // q_len 4, padding
      {32, 1, 100000, 131072, DType::kFP8E4M3, 0, {}},          // batch 32, 128K
      {5, 4, 1, 9000, DType::kFP8E4M3, 0, {}},
      {1, 1, 1 << 20, 1 << 20, DType::kFP8E4M3, 0, {}},  // 1M
      {2, 4, 500000, 1 << 20, DType::kBF16, 1, {}},
  };
  const int max_reqs = 32;
  const int max_q_len = 4;
  const int64_t max_context = (1 << 20) + 128;
  World world(P, needs_nccl(transport));
  std::vector<std::unique_ptr<CudaCpIndexer>> indexers(static_cast<std::size_t>(P));
  world.run([&](int r) {
    indexers[static_cast<std::size_t>(r)] = std::make_unique<CudaCpIndexer>(
        *world.comms[static_cast<std::size_t>(r)], device_of(r), SparseConfig{},
        cp_config(P, transport, max_reqs, max_q_len, max_context));
  });
  uint64_t seed = 101;
  for (const Case& cs : cases) {
    const SyntheticCase c = make_case(cs, seed++);
    const HostTensor reference = run_gpu(c);  // one GPU, fused, device 0
    const int H = c.config.index_heads;
    const int k = c.config.topk;
    std::vector<int64_t> bad(static_cast<std::size_t>(P), 0);
    world.run([&](int r) {
      CudaCpIndexer& ind = *indexers[static_cast<std::size_t>(r)];
      DeviceCase d = upload(c, device_of(r));
      const int merged = static_cast<int>(ind.merged_heads().size());
      DeviceTensor out(DType::kI32, {c.num_rows(), merged, k}, device_of(r));
      fill_device_bytes(out.view(), kPoisonByte);
      cuda::Stream stream;
      // Twice: the second call uses the other parity and the next tag.
      for (int call = 0; call < 2; ++call) {
        ind.select(call, d.indexer_args(out.view()), stream.get());
        ind.check(stream.get());
      }
      HostTensor host;
      copy_to_host(out.view(), host);
      bad[static_cast<std::size_t>(r)] =
          count_mismatches(reference, host, H, ind.merged_heads().front(), merged, k);
    });
    for (int r = 0; r < P; ++r) {
      EXPECT_EQ(bad[static_cast<std::size_t>(r)], 0)
          << cp_transport_name(transport) << " P " << P << " rank " << r << ": reqs " << cs.reqs
          << " q_len " << cs.q_len << " ctx [" << cs.min_ctx << ", " << cs.max_ctx << "] "
          << dtype_name(cs.dtype);
    }
  }
}

TEST(CudaCp, PeerOneRankMatchesOneGpu) {
  M3MSA_REQUIRE_GPUS(1);
  check_transport(CpTransport::kPeer, 1);
}

TEST(CudaCp, PeerTwoRanksBitIdentical) {
  M3MSA_REQUIRE_GPUS(1);
  check_transport(CpTransport::kPeer, 2);
}

// The shard scoring on the span kernel (M3MSA_CP_SPAN_SCORING=1, read when an indexer is built)
// instead of the split kernel: the same block scores, so the same bits.
TEST(CudaCp, PeerTwoRanksSpanScoringBitIdentical) {
  M3MSA_REQUIRE_GPUS(1);
  ASSERT_EQ(setenv("M3MSA_CP_SPAN_SCORING", "1", 1), 0);
  check_transport(CpTransport::kPeer, 2);
  ASSERT_EQ(unsetenv("M3MSA_CP_SPAN_SCORING"), 0);
}

// P > H: one index head, both ranks merge it (each consumer merges for itself).
TEST(CudaCp, PeerMoreRanksThanHeads) {
  M3MSA_REQUIRE_GPUS(1);
  SyntheticSpec spec = decode_spec(12, 4, 1, 50000, DType::kFP8E4M3, 2, 808);
  spec.config.index_heads = 1;
  spec.config.kv_heads = 1;
  spec.config.q_heads = 16;
  const SyntheticCase c = make_synthetic_case(spec);
  const HostTensor reference = run_gpu(c);
  World world(2, false);
  std::vector<int64_t> bad(2, -1);
  world.run([&](int r) {
    CudaCpIndexer ind(*world.comms[static_cast<std::size_t>(r)], device_of(r), c.config,
                      cp_config(2, CpTransport::kPeer, 12, 4, 50000 + 128));
    EXPECT_EQ(ind.merged_heads(), std::vector<int>{0});
    DeviceCase d = upload(c, device_of(r));
    DeviceTensor out(DType::kI32, {c.num_rows(), 1, c.config.topk}, device_of(r));
    fill_device_bytes(out.view(), kPoisonByte);
    cuda::Stream stream;
    for (int call = 0; call < 3; ++call) {
      ind.select(call, d.indexer_args(out.view()), stream.get());
      ind.check(stream.get());
    }
    HostTensor host;
    copy_to_host(out.view(), host);
    bad[static_cast<std::size_t>(r)] = count_mismatches(reference, host, 1, 0, 1, c.config.topk);
  });
  EXPECT_EQ(bad[0], 0);
  EXPECT_EQ(bad[1], 0);
}

TEST(CudaCp, NcclTwoRanksBitIdentical) {
  M3MSA_REQUIRE_GPUS(2);
  check_transport(CpTransport::kNccl, 2);
}

TEST(CudaCp, ReplicatedTwoRanksBitIdentical) {
  M3MSA_REQUIRE_GPUS(1);
  check_transport(CpTransport::kReplicated, 2);
}

TEST(CudaCp, AllReduceMaxTwoRanksBitIdentical) {
  M3MSA_REQUIRE_GPUS(2);
  check_transport(CpTransport::kAllReduceMax, 2);
}

// One graph per rank, captured once, replayed 1000 times while seq_lens change underneath.
void check_graph_replay(CpTransport transport) {
  const int P = 2;
  Case cs{24, 4, 2000, 60000, DType::kFP8E4M3, 0, {}};
  const SyntheticCase base = make_case(cs, 4242);
  const int H = base.config.index_heads;
  const int k = base.config.topk;
  // Metadata variants: shorter lengths (tables stay valid) and padding requests.
  constexpr int kVariants = 5;
  std::vector<HostTensor> seqs;
  std::vector<HostTensor> refs;
  Rng rng(99);
  for (int v = 0; v < kVariants; ++v) {
    SyntheticCase c = base;
    HostTensor s(DType::kI32, {cs.reqs});
    for (int i = 0; i < cs.reqs; ++i) {
      const int32_t orig = base.seq_lens.ptr<int32_t>()[i];
      int32_t len = static_cast<int32_t>(rng.range(cs.q_len, orig));
      if (v > 0 && rng.range(0, 5) == 0) len = 0;  // padding request
      s.ptr<int32_t>()[i] = v == 0 ? orig : len;
    }
    c.seq_lens = s;
    c.batch.seq_lens = c.seq_lens.view();
    refs.push_back(run_gpu(c));
    seqs.push_back(s);
  }
  World world(P, needs_nccl(transport));
  constexpr int kReplays = 1000;
  std::vector<int64_t> bad(P, 0);
  world.run([&](int r) {
    CudaCpIndexer ind(*world.comms[static_cast<std::size_t>(r)], device_of(r), base.config,
                      cp_config(P, transport, cs.reqs, cs.q_len, 60000 + 256));
    DeviceCase d = upload(base, device_of(r));
    const int merged = static_cast<int>(ind.merged_heads().size());
    DeviceTensor out(DType::kI32, {base.num_rows(), merged, k}, device_of(r));
    cuda::Stream stream;
    const IndexerArgs args = d.indexer_args(out.view());
    cuda::Graph graph =
        cuda::Graph::capture(stream.get(), [&] { ind.select(7, args, stream.get()); });
    HostTensor host(DType::kI32, {base.num_rows(), merged, k});
    // Every rank's setup (copies, capture, instantiation) done before the first replay spins
    // on the peer: when the ranks share a GPU, a peer's setup could otherwise wait for it.
    world.comms[static_cast<std::size_t>(r)]->all_gather({}, "test/captured");
    for (int i = 0; i < kReplays; ++i) {
      const int v = i % kVariants;
      CUDA_CHECK(cudaMemcpyAsync(d.seq_lens.data(), seqs[v].data(), seqs[v].nbytes(),
                                 cudaMemcpyHostToDevice, stream.get()));
      CUDA_CHECK(cudaMemsetAsync(out.data(), kPoisonByte, out.nbytes(), stream.get()));
      graph.launch(stream.get());
      // The replay done before the copy is queued: a copy queued behind a kernel that spins on
      // the peer would hold the copy engine the peer's own copies need (ranks sharing a GPU).
      ind.check(stream.get());
      CUDA_CHECK(cudaMemcpyAsync(host.data(), out.data(), out.nbytes(), cudaMemcpyDeviceToHost,
                                 stream.get()));
      CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      bad[static_cast<std::size_t>(r)] +=
          count_mismatches(refs[v], host, H, ind.merged_heads().front(), merged, k);
    }
    if (transport == CpTransport::kPeer || transport == CpTransport::kNccl) {
      EXPECT_EQ(ind.generation(), static_cast<uint32_t>(kReplays));
    }
  });
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(bad[static_cast<std::size_t>(r)], 0)
        << cp_transport_name(transport) << " rank " << r << " graph replays";
  }
}

TEST(CudaCp, PeerGraphReplayedThousandTimes) {
  M3MSA_REQUIRE_GPUS(1);
  check_graph_replay(CpTransport::kPeer);
}

TEST(CudaCp, NcclAndAllReduceGraphReplays) {
  M3MSA_REQUIRE_GPUS(2);
  check_graph_replay(CpTransport::kNccl);
  check_graph_replay(CpTransport::kAllReduceMax);
}

TEST(CudaCp, SkippedCallTimesOutNamingTheRank) {
  M3MSA_REQUIRE_GPUS(1);
  const int P = 2;
  const SyntheticCase c = make_case({4, 1, 1000, 20000, DType::kBF16, 0, {}}, 7);
  World world(P, false);
  CudaCpConfig cp = cp_config(P, CpTransport::kPeer, 4, 1, 20000 + 128);
  cp.spin_budget = std::chrono::milliseconds(100);
  std::vector<std::string> messages(P);
  double waited_ms = 0.0;
  world.run([&](int r) {
    CudaCpIndexer ind(*world.comms[static_cast<std::size_t>(r)], device_of(r), c.config, cp);
    DeviceCase d = upload(c, device_of(r));
    DeviceTensor out(DType::kI32, {c.num_rows(), 2, c.config.topk}, device_of(r));
    cuda::Stream stream;
    ind.select(0, d.indexer_args(out.view()), stream.get());
    ind.check(stream.get());
    world.comms[static_cast<std::size_t>(r)]->all_gather({}, "test/after-first-call");
    // Rank 1 skips the second call; it keeps its buffers alive until rank 0 is done, since
    // rank 0's nominations still land in them.
    if (r == 1) {
      world.comms[1]->all_gather({}, "test/done");
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      ind.select(3, d.indexer_args(out.view()), stream.get());
      ind.check(stream.get());
      messages[0] = "no error";
    } catch (const Error& e) {
      waited_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      messages[0] = e.what();
      EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
      EXPECT_EQ(e.rank(), 0);
      ASSERT_TRUE(ind.last_timeout().has_value());
      EXPECT_EQ(ind.last_timeout()->source, 1);
      EXPECT_EQ(ind.last_timeout()->layer, 3);
      EXPECT_EQ(ind.last_timeout()->seen_tag, 0u);  // parity 0 was never written
    }
    // The rank is out of lockstep now: a further call is refused, not hung.
    expect_error([&] { ind.select(4, d.indexer_args(out.view()), stream.get()); },
                 ErrorCode::kInvalidArgument, "out of lockstep");
    world.comms[0]->all_gather({}, "test/done");
  });
  std::printf("  timeout after %.1f ms: %s\n", waited_ms, messages[0].c_str());
  EXPECT_NE(messages[0].find("rank 1 never delivered layer 3"), std::string::npos) << messages[0];
  EXPECT_LT(waited_ms, 2000.0);
}

TEST(CudaCp, MismatchedConfigsCaughtAtSetup) {
  M3MSA_REQUIRE_GPUS(1);
  World world(2, false);
  std::vector<std::string> messages(2);
  std::vector<ErrorCode> codes(2, ErrorCode::kInternal);
  world.run([&](int r) {
    try {
      CudaCpConfig cp = cp_config(2, CpTransport::kPeer, r == 0 ? 8 : 16, 1, 100000);
      CudaCpIndexer ind(*world.comms[static_cast<std::size_t>(r)], device_of(r), SparseConfig{},
                        cp);
      messages[static_cast<std::size_t>(r)] = "no error";
    } catch (const Error& e) {
      messages[static_cast<std::size_t>(r)] = e.what();
      codes[static_cast<std::size_t>(r)] = e.code();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(codes[r], ErrorCode::kInvalidArgument) << messages[r];
    EXPECT_NE(messages[r].find("max_reqs="), std::string::npos) << messages[r];
  }
}

TEST(CudaCp, LayersShareOneBufferSet) {
  M3MSA_REQUIRE_GPUS(1);
  World world(2, false);
  world.run([&](int r) {
    const CudaCpConfig cp = cp_config(2, CpTransport::kPeer, 4, 1, 10000);
    CudaCpIndexer a(*world.comms[static_cast<std::size_t>(r)], device_of(r), SparseConfig{}, cp);
    CudaCpIndexer b(*world.comms[static_cast<std::size_t>(r)], device_of(r), SparseConfig{}, cp);
    EXPECT_EQ(a.info().buffer_sets, 1);
    const CpBufferKey key = a.info().key;
    EXPECT_EQ(a.info().word_bytes_per_rank,
              std::size_t{2} * key.world_size * key.merged_heads * key.max_rows * 8);
    EXPECT_EQ(a.info().buffer_bytes_per_rank, key.bytes_per_rank() + a.info().word_bytes_per_rank);
  });
}

// ---- A rank that passes another shape (or layer) for the same call ----

struct MismatchOutcome {
  std::vector<std::string> messages;
  std::vector<ErrorCode> codes;
  std::vector<std::optional<CudaCpFault>> faults;
  std::vector<double> waited_ms;
};

// Both ranks make one good call, then call 1 with rank 1 passing `odd` (fewer requests, another
// q_len within the plan, or another layer). Both must throw at check() naming the other rank.
MismatchOutcome run_mismatch(CpTransport transport, const std::string& odd) {
  const int P = 2;
  const SyntheticCase c = make_case({8, 2, 1000, 30000, DType::kFP8E4M3, 0, {}}, 31);
  const SyntheticCase c1 = make_case({8, 1, 1000, 30000, DType::kFP8E4M3, 0, {}}, 31);
  World world(P, needs_nccl(transport));
  MismatchOutcome o;
  o.messages.assign(P, "no error");
  o.codes.assign(P, ErrorCode::kInternal);
  o.faults.assign(P, std::nullopt);
  o.waited_ms.assign(P, 0.0);
  world.run([&](int r) {
    const auto ur = static_cast<std::size_t>(r);
    CudaCpIndexer ind(*world.comms[ur], device_of(r), c.config,
                      cp_config(P, transport, 8, 2, 30000 + 128));
    const int merged = static_cast<int>(ind.merged_heads().size());
    const int k = c.config.topk;
    DeviceCase d = upload(c, device_of(r));
    DeviceCase d1 = upload(c1, device_of(r));
    DeviceTensor out(DType::kI32, {c.num_rows(), merged, k}, device_of(r));
    DeviceTensor out1(DType::kI32, {c1.num_rows(), merged, k}, device_of(r));
    // Allocated up front: a cudaMalloc / cudaFree while the peer's exchange spins would wait for
    // it when the ranks share a GPU.
    DeviceTensor small(DType::kI32, {int64_t{5} * c.batch.q_len, merged, k}, device_of(r));
    cuda::Stream stream;
    ind.select(0, d.indexer_args(out.view()), stream.get());
    ind.check(stream.get());
    IndexerArgs args = d.indexer_args(out.view());
    int layer = 1;
    if (r == 1) {
      if (odd == "num_reqs") {
        args = first_requests(args, 5, small.view());
      } else if (odd == "q_len") {
        args = d1.indexer_args(out1.view());
      } else {
        layer = 2;
      }
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      ind.select(layer, args, stream.get());
      ind.check(stream.get());
    } catch (const Error& e) {
      o.messages[ur] = e.what();
      o.codes[ur] = e.code();
    }
    o.waited_ms[ur] = ms_since(start);
    o.faults[ur] = ind.last_fault();
    // The set is failed now: further calls are refused on both ranks.
    if (o.codes[ur] == ErrorCode::kInvalidArgument) {
      expect_error([&] { ind.select(3, d.indexer_args(out.view()), stream.get()); },
                   ErrorCode::kInvalidArgument, "out of lockstep");
    }
    world.comms[ur]->all_gather({}, "test/done");  // peers stop storing before buffers go
  });
  return o;
}

void check_mismatch(CpTransport transport, const std::string& odd) {
  const MismatchOutcome o = run_mismatch(transport, odd);
  for (int r = 0; r < 2; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    const int other = 1 - r;
    std::printf("  %s, rank 1 passes another %s: rank %d after %.1f ms: %s\n",
                cp_transport_name(transport), odd.c_str(), r, o.waited_ms[ur],
                o.messages[ur].c_str());
    EXPECT_EQ(o.codes[ur], ErrorCode::kInvalidArgument) << o.messages[ur];
    EXPECT_NE(o.messages[ur].find("rank " + std::to_string(other) + " passed another shape"),
              std::string::npos)
        << o.messages[ur];
    ASSERT_TRUE(o.faults[ur].has_value());
    EXPECT_EQ(o.faults[ur]->kind, CudaCpFault::Kind::kShapeMismatch);
    EXPECT_EQ(o.faults[ur]->source, other);
    EXPECT_NE(o.faults[ur]->expected_word >> 32, o.faults[ur]->seen_word >> 32);
    // Found as soon as the nominations land, not after a timeout.
    EXPECT_LT(o.waited_ms[ur], 300.0);
  }
  if (odd == "num_reqs" && transport != CpTransport::kAllReduceMax) {
    // The plain bits of the word carry the shape: rank 0 saw 5 requests, rank 1 saw 8.
    EXPECT_EQ((o.faults[0]->seen_word >> 8) & 0xFFFFu, 5u);
    EXPECT_EQ((o.faults[1]->seen_word >> 8) & 0xFFFFu, 8u);
  }
}

TEST(CudaCpFaults, PeerShapeMismatchNamesTheRank) {
  M3MSA_REQUIRE_GPUS(1);
  for (const char* odd : {"num_reqs", "q_len", "layer"}) check_mismatch(CpTransport::kPeer, odd);
}

TEST(CudaCpFaults, NcclShapeMismatchNamesTheRank) {
  M3MSA_REQUIRE_GPUS(2);
  for (const char* odd : {"num_reqs", "layer"}) {
    check_mismatch(CpTransport::kNccl, odd);
    check_mismatch(CpTransport::kAllReduceMax, odd);
  }
}

}  // namespace
}  // namespace m3msa::cptest
