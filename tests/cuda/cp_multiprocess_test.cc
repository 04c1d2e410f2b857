// The CUDA CP indexer with ranks as processes, one GPU each, peer buffers mapped through CUDA IPC
// handles. Run under the launcher (every test skips otherwise):
//
//   m3msa launch -n 2 -- m3msa_cuda_tests --gtest_filter='CudaCpMultiProcess.*'
//   M3MSA_CP_TEST_DIE_RANK=1 m3msa launch -n 2 --log-dir logs -- m3msa_cuda_tests
//       --gtest_filter='CudaCpMultiProcessDeath.*'   (one command line)
//
// - every transport bit-identical to one GPU over several calls and layers (both parities, tags
//   advancing), and a graph replayed with changing metadata;
// - a rank that passes another shape or layer: the others throw kInvalidArgument naming it;
// - a rank whose process dies inside a step (M3MSA_CP_TEST_DIE_RANK=r: it _exits with status 42
//   between its scoring and its exchange): the survivors throw kTimeout naming it within the
//   watchdog budget and leave without waiting for it (the launch then exits 42).
// Output is unbuffered and every stage is printed with the rank, so a run that stops shows where
// (with M3MSA_CP_DEBUG=1, also every call's generation, tag and the words each rank saw).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cp_test_util.h"

namespace m3msa::cptest {
namespace {

bool launched() {
  return std::getenv("WORLD_SIZE") != nullptr;
}

#define M3MSA_REQUIRE_LAUNCH()                                                                \
  do {                                                                                        \
    if (!launched()) {                                                                        \
      GTEST_SKIP() << "not started by `m3msa launch` (WORLD_SIZE unset): multi-process test " \
                      "skipped";                                                              \
    }                                                                                         \
    M3MSA_REQUIRE_GPUS(1);                                                                    \
  } while (0)

// Stage markers: "[mp rank 1, 2.317 s] peer call 2" (seconds since the first marker; stdout is
// unbuffered in these tests).
void stage(int rank, const std::string& what) {
  static const auto t0 = std::chrono::steady_clock::now();
  std::printf("[mp rank %d, %.3f s] %s\n", rank, ms_since(t0) / 1000.0, what.c_str());
}

std::unique_ptr<NcclCommunicator> launched_communicator() {
  std::setvbuf(stdout, nullptr, _IONBF, 0);
  // Short enough that a lost rank fails the test well inside the launcher's grace period.
  return make_nccl_communicator_from_env(std::chrono::milliseconds(8000));
}

// Whether transport `t` can run with this world (NCCL needs one device per rank).
bool transport_runs(CpTransport t, const NcclCommunicator& comm) {
  return !needs_nccl(t) || cuda_device_count() >= comm.world_size();
}

TEST(CudaCpMultiProcess, PeerViaIpcBitIdentical) {
  M3MSA_REQUIRE_LAUNCH();
  std::unique_ptr<NcclCommunicator> comm = launched_communicator();
  const int P = comm->world_size();
  const int r = comm->rank();
  const int device = comm->device();
  stage(r, "communicator up on device " + std::to_string(device));
  const SyntheticCase c = make_case({16, 4, 1, 70000, DType::kFP8E4M3, 2, {}}, 555);
  const HostTensor reference = run_reference(c, device);  // on this rank's own device
  stage(r, "reference done");
  for (CpTransport transport : {CpTransport::kPeer, CpTransport::kNccl, CpTransport::kAllReduceMax,
                                CpTransport::kReplicated}) {
    const std::string name = cp_transport_name(transport);
    if (!transport_runs(transport, *comm)) {
      stage(r, name + " skipped: fewer devices than ranks");
      continue;
    }
    CUDA_CHECK(cudaSetDevice(device));
    {
      CudaCpIndexer ind(*comm, device, c.config, cp_config(P, transport, 16, 4, 70000 + 128));
      stage(r, name + " indexer built");
      if (transport == CpTransport::kPeer && P > 1) {
        EXPECT_TRUE(ind.info().peer_mapped_by_ipc);
      }
      DeviceCase d = upload(c, device);
      const int merged = static_cast<int>(ind.merged_heads().size());
      DeviceTensor out(DType::kI32, {c.num_rows(), merged, c.config.topk}, device);
      cuda::Stream stream;
      // Six calls over three layers: both parities twice, tags 2..7.
      for (int call = 0; call < 6; ++call) {
        fill_device_bytes(out.view(), kPoisonByte);
        stage(r, name + " call " + std::to_string(call));
        ind.select(call % 3, d.indexer_args(out.view()), stream.get());
        ind.check(stream.get());
        HostTensor host;
        copy_to_host(out.view(), host);
        EXPECT_EQ(count_mismatches(reference, host, c.config.index_heads,
                                   ind.merged_heads().front(), merged, c.config.topk),
                  0)
            << name << " rank " << r << " of " << P << " call " << call;
      }
      stage(r, name + " calls done");
      comm->all_gather({}, "test/done");  // peers stop storing before buffers go
      stage(r, name + " releasing the indexer");
    }
    stage(r, name + " released");
  }
}

// A graph captured once per rank and replayed with changing seq_lens, peer buffers through IPC.
TEST(CudaCpMultiProcess, PeerGraphReplays) {
  M3MSA_REQUIRE_LAUNCH();
  std::unique_ptr<NcclCommunicator> comm = launched_communicator();
  const int P = comm->world_size();
  const int r = comm->rank();
  const int device = comm->device();
  const Case cs{12, 2, 2000, 40000, DType::kBF16, 0, {}};
  const SyntheticCase base = make_case(cs, 909);
  constexpr int kVariants = 3;
  std::vector<HostTensor> seqs, refs;
  idxtest::Rng rng(5);
  for (int v = 0; v < kVariants; ++v) {
    SyntheticCase c = base;
    HostTensor s(DType::kI32, {cs.reqs});
    for (int i = 0; i < cs.reqs; ++i) {
      const int32_t orig = base.seq_lens.ptr<int32_t>()[i];
      s.ptr<int32_t>()[i] = v == 0 ? orig : static_cast<int32_t>(rng.range(cs.q_len, orig));
    }
    c.seq_lens = s;
    c.batch.seq_lens = c.seq_lens.view();
    refs.push_back(run_reference(c, device));
    seqs.push_back(s);
  }
  CUDA_CHECK(cudaSetDevice(device));
  {
    CudaCpIndexer ind(*comm, device, base.config,
                      cp_config(P, CpTransport::kPeer, cs.reqs, cs.q_len, 40000 + 256));
    DeviceCase d = upload(base, device);
    const int merged = static_cast<int>(ind.merged_heads().size());
    const int k = base.config.topk;
    DeviceTensor out(DType::kI32, {base.num_rows(), merged, k}, device);
    cuda::Stream stream;
    const IndexerArgs args = d.indexer_args(out.view());
    cuda::Graph graph =
        cuda::Graph::capture(stream.get(), [&] { ind.select(4, args, stream.get()); });
    stage(r, "graph captured");
    constexpr int kReplays = 300;
    HostTensor host(DType::kI32, {base.num_rows(), merged, k});
    int64_t bad = 0;
    for (int i = 0; i < kReplays; ++i) {
      const int v = i % kVariants;
      CUDA_CHECK(cudaMemcpyAsync(d.seq_lens.data(), seqs[v].data(), seqs[v].nbytes(),
                                 cudaMemcpyHostToDevice, stream.get()));
      CUDA_CHECK(cudaMemsetAsync(out.data(), kPoisonByte, out.nbytes(), stream.get()));
      graph.launch(stream.get());
      CUDA_CHECK(cudaMemcpyAsync(host.data(), out.data(), out.nbytes(), cudaMemcpyDeviceToHost,
                                 stream.get()));
      ind.check(stream.get());
      bad += count_mismatches(refs[v], host, base.config.index_heads, ind.merged_heads().front(),
                              merged, k);
    }
    stage(r, "replays done");
    EXPECT_EQ(bad, 0) << "rank " << r;
    EXPECT_EQ(ind.generation(), static_cast<uint32_t>(kReplays));
    comm->all_gather({}, "test/done");
  }
  stage(r, "released");
}

// Call 1: the last rank passes `odd` (fewer requests, or another layer); every rank must throw
// kInvalidArgument naming the other side, without waiting out the spin budget.
TEST(CudaCpMultiProcess, ShapeMismatchNamesTheRank) {
  M3MSA_REQUIRE_LAUNCH();
  std::unique_ptr<NcclCommunicator> comm = launched_communicator();
  const int P = comm->world_size();
  const int r = comm->rank();
  const int device = comm->device();
  const int odd_rank = P - 1;
  const SyntheticCase c = make_case({8, 1, 1000, 30000, DType::kBF16, 0, {}}, 77);
  for (CpTransport transport :
       {CpTransport::kPeer, CpTransport::kNccl, CpTransport::kAllReduceMax}) {
    if (!transport_runs(transport, *comm)) continue;
    for (const char* odd_name : {"num_reqs", "layer"}) {
      const std::string odd = odd_name;
      const std::string name = std::string(cp_transport_name(transport)) + "/" + odd;
      CUDA_CHECK(cudaSetDevice(device));
      CudaCpIndexer ind(*comm, device, c.config, cp_config(P, transport, 8, 1, 30000 + 128));
      const int merged = static_cast<int>(ind.merged_heads().size());
      const int k = c.config.topk;
      DeviceCase d = upload(c, device);
      DeviceTensor out(DType::kI32, {c.num_rows(), merged, k}, device);
      DeviceTensor small(DType::kI32, {3, merged, k}, device);
      cuda::Stream stream;
      ind.select(0, d.indexer_args(out.view()), stream.get());
      ind.check(stream.get());
      IndexerArgs args = d.indexer_args(out.view());
      int layer = 1;
      if (r == odd_rank) {
        if (odd == "num_reqs") {
          args = first_requests(args, 3, small.view());
        } else {
          layer = 2;
        }
      }
      stage(r, name + ": mismatched call");
      const auto start = std::chrono::steady_clock::now();
      std::string message = "no error";
      ErrorCode code = ErrorCode::kInternal;
      try {
        ind.select(layer, args, stream.get());
        ind.check(stream.get());
      } catch (const Error& e) {
        message = e.what();
        code = e.code();
      }
      const double waited = ms_since(start);
      stage(r, name + ": after " + std::to_string(waited) + " ms: " + message);
      EXPECT_EQ(code, ErrorCode::kInvalidArgument) << name << ": " << message;
      const int named = r == odd_rank ? 0 : odd_rank;
      EXPECT_NE(message.find("rank " + std::to_string(named) + " passed another shape"),
                std::string::npos)
          << name << ": " << message;
      EXPECT_LT(waited, 300.0) << name;
      ASSERT_TRUE(ind.last_fault().has_value()) << name;
      EXPECT_EQ(ind.last_fault()->kind, CudaCpFault::Kind::kShapeMismatch) << name;
      comm->all_gather({}, "test/mismatch-done");  // the communicator itself is still healthy
      // Leaving the scope frees nothing of the failed set (a peer may still store into it).
    }
  }
}

// ---- Process death (only when M3MSA_CP_TEST_DIE_RANK names the rank that dies) ----

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

TEST(CudaCpMultiProcessDeath, RankDiesMidStep) {
  M3MSA_REQUIRE_LAUNCH();
  const int die_rank = env_int("M3MSA_CP_TEST_DIE_RANK", -1);
  if (die_rank < 0) {
    GTEST_SKIP() << "M3MSA_CP_TEST_DIE_RANK unset: the process-death test kills a rank on purpose "
                    "and only runs when asked (scripts/gpu_steps/cp-tests.sh)";
  }
  const char* transport_env = std::getenv("M3MSA_CP_TEST_TRANSPORT");
  const CpTransport transport =
      parse_cp_transport(transport_env != nullptr ? transport_env : "peer");
  std::unique_ptr<NcclCommunicator> comm = launched_communicator();
  const int P = comm->world_size();
  const int r = comm->rank();
  const int device = comm->device();
  ASSERT_LT(die_rank, P);
  if (!transport_runs(transport, *comm)) GTEST_SKIP() << "fewer devices than ranks";
  const SyntheticCase c = make_case({8, 2, 1000, 30000, DType::kFP8E4M3, 0, {}}, 4242);
  CUDA_CHECK(cudaSetDevice(device));
  CudaCpConfig cp = cp_config(P, transport, 8, 2, 30000 + 128);
  cp.spin_budget = std::chrono::milliseconds(200);
  cp.host_timeout = std::chrono::milliseconds(3000);  // bounds the NCCL transports' collective
  auto ind = std::make_unique<CudaCpIndexer>(*comm, device, c.config, cp);
  const int merged = static_cast<int>(ind->merged_heads().size());
  DeviceCase d = upload(c, device);
  DeviceTensor out(DType::kI32, {c.num_rows(), merged, c.config.topk}, device);
  cuda::Stream stream;
  const IndexerArgs args = d.indexer_args(out.view());
  constexpr int kDeathCall = 3;
  for (int call = 0; call < kDeathCall; ++call) {
    ind->select(call, args, stream.get());
    ind->check(stream.get());
  }
  comm->all_gather({}, "test/before-death");
  stage(r, "healthy calls done");
  if (r == die_rank) {
    // Inside the step: the scoring is queued, the exchange never is.
    ind->score(args, stream.get());
    stage(r, "dying now (status 42)");
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(42);
  }
  const auto start = std::chrono::steady_clock::now();
  std::string message = "no error";
  ErrorCode code = ErrorCode::kInternal;
  try {
    ind->select(kDeathCall, args, stream.get());
    stage(r, "survivor: call queued, checking");
    ind->check(stream.get());
  } catch (const Error& e) {
    message = e.what();
    code = e.code();
  }
  const double waited = ms_since(start);
  stage(r, "survivor after " + std::to_string(waited) + " ms: " + message);
  EXPECT_EQ(code, ErrorCode::kTimeout) << message;
  if (transport == CpTransport::kPeer || P == 2) {
    EXPECT_NE(message.find("rank " + std::to_string(die_rank)), std::string::npos) << message;
    ASSERT_TRUE(ind->last_fault().has_value());
    EXPECT_EQ(ind->last_fault()->source, die_rank);
  }
  // Within the watchdog budget: the spin budget for peer, host_timeout for the NCCL transports
  // (plus the launch's scheduling noise).
  const double budget_ms = transport == CpTransport::kPeer ? 200.0 : 3000.0;
  EXPECT_LT(waited, budget_ms + 1500.0) << message;
  // Leave without waiting for the dead rank: no collective, no NCCL destroy.
  comm->abandon();
  ind.reset();  // a failed set frees nothing and meets nobody
  stage(r, "survivor leaving");
}

}  // namespace
}  // namespace m3msa::cptest
