// Device memory must not leak over repeated plan / run / destroy cycles (cudaMemGetInfo
// stable over 1000 cycles). Two objects own device memory across calls: the CUDA backend
// (workspaces sized by plan(), its stream) and the CUDA CP indexer (the peer buffer set, shard
// tables, its communicator state). Each test runs one cycle to let the driver and the library
// make their one-time allocations (module loading, cached buffer sets), takes cudaMemGetInfo's
// free bytes as the baseline, runs the remaining cycles, and requires free memory after every
// sampled cycle to be within kSlack of the baseline. Each cycle also checks its result against
// the first cycle's, bit for bit, so the cycles are real work.
//
// kSlack = 2 MiB: the driver hands out memory in 2 MiB pages, so a leak of any size shows as at
// least one page within a few cycles of 1000; nothing smaller can be measured by cudaMemGetInfo.
// M3MSA_TEST_SMALL=1 (the compute-sanitizer run) does 20 cycles instead of 1000.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "indexer_test_util.h"
#include "m3msa/comm.h"
#include "m3msa/cp_cuda.h"

namespace m3msa::idxtest {
namespace {

constexpr int64_t kSlack = int64_t{2} << 20;

int cycles() {
  return test_small() ? 20 : 1000;
}

int64_t free_bytes(int device) {
  int previous = 0;
  CUDA_CHECK(cudaGetDevice(&previous));
  CUDA_CHECK(cudaSetDevice(device));
  CUDA_CHECK(cudaDeviceSynchronize());
  size_t free = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free, &total));
  CUDA_CHECK(cudaSetDevice(previous));
  return static_cast<int64_t>(free);
}

// Free bytes per device: the baseline and the lowest seen after it.
struct Watch {
  std::vector<int> devices;
  std::vector<int64_t> before_first, baseline, lowest, highest;
  explicit Watch(std::vector<int> devs) : devices(std::move(devs)) {
    for (int d : devices) before_first.push_back(free_bytes(d));
  }
  void set_baseline() {
    baseline.clear();
    for (int d : devices) baseline.push_back(free_bytes(d));
    lowest = highest = baseline;
  }
  void sample() {
    for (std::size_t i = 0; i < devices.size(); ++i) {
      const int64_t f = free_bytes(devices[i]);
      lowest[i] = std::min(lowest[i], f);
      highest[i] = std::max(highest[i], f);
    }
  }
  void expect_flat(const char* what, int n) const {
    for (std::size_t i = 0; i < devices.size(); ++i) {
      const double mib = 1.0 / (1024.0 * 1024.0);
      std::printf(
          "  [%s] device %d: free before the first cycle %.1f MiB, baseline after it %.1f MiB, "
          "over %d more cycles min %.1f max %.1f MiB (drop %.2f MiB, slack %.0f MiB)\n",
          what, devices[i], before_first[i] * mib, baseline[i] * mib, n, lowest[i] * mib,
          highest[i] * mib, (baseline[i] - lowest[i]) * mib, kSlack * mib);
      EXPECT_LE(baseline[i] - lowest[i], kSlack)
          << what << ": device " << devices[i] << " lost " << (baseline[i] - lowest[i]) * mib
          << " MiB of free memory over " << n << " cycles";
    }
  }
};

// A small decode case with both caches: enough for every workspace to be used.
SyntheticCase small_case(uint64_t seed) {
  SyntheticSpec spec = decode_spec(6, 2, 1, 20000, DType::kFP8E4M3, 1, seed);
  spec.make_kv_cache = true;
  spec.kv_dtype = DType::kBF16;
  return make_synthetic_case(spec);
}

TEST(MemoryStability, CudaBackendPlanRunDestroyCycles) {
  M3MSA_INDEXER_REQUIRE_GPU();
  const SyntheticCase c = small_case(4711);
  const SparseConfig& cfg = c.config;
  DeviceCase d = upload(c);  // inputs live across cycles: they are not what is tested
  DeviceTensor topk(DType::kI32, {c.num_rows(), cfg.index_heads, cfg.topk});
  DeviceTensor out(DType::kBF16, {c.num_rows(), cfg.q_heads, cfg.head_dim});
  HostTensor first_topk, first_out, topk_host, out_host;
  auto cycle = [&](HostTensor& topk_result, HostTensor& out_result) {
    std::unique_ptr<CudaBackend> backend = make_cuda_backend(0);
    backend->plan(cfg, limits_for(c));
    fill_device_bytes(topk.view(), kPoisonByte);
    fill_device_bytes(out.view(), 0xFF);
    backend->select_topk(cfg, d.indexer_args(topk.view()));
    backend->sparse_attention(cfg, d.attention_args(topk.view(), out.view()));
    backend->synchronize();
    copy_to_host(topk.view(), topk_result);
    copy_to_host(out.view(), out_result);
  };  // the backend (workspaces, stream) is destroyed here

  Watch watch({0});
  cycle(first_topk, first_out);
  // The first cycle's selection is the CPU's (up to near-ties): the cycles do real work.
  const Comparison cmp = compare_selections(c, first_topk, run_cpu(c));
  EXPECT_EQ(cmp.failures, 0) << cmp.summary();
  watch.set_baseline();
  const int n = cycles() - 1;
  int64_t differing = 0;
  for (int i = 0; i < n; ++i) {
    cycle(topk_host, out_host);
    differing += std::memcmp(topk_host.data(), first_topk.data(), first_topk.nbytes()) != 0;
    differing += std::memcmp(out_host.data(), first_out.data(), first_out.nbytes()) != 0;
    if (i % 10 == 0 || i + 1 == n) watch.sample();
  }
  EXPECT_EQ(differing, 0) << "cycles gave outputs different from the first cycle's";
  watch.expect_flat("CudaBackend plan/run/destroy", n);
}

// P = 2 ranks as threads when two GPUs are visible (rank r on GPU r), else one rank.
TEST(MemoryStability, CudaCpIndexerSetupRunDestroyCycles) {
  M3MSA_INDEXER_REQUIRE_GPU();
  const int P = cuda_device_count() >= 2 ? 2 : 1;
  std::printf("  CP indexer cycles with %d rank%s\n", P, P == 1 ? "" : "s (one per GPU)");
  const SyntheticCase c = small_case(4712);
  const SparseConfig& cfg = c.config;
  const HostTensor reference = run_gpu(c);  // one GPU, [rows, H, k]
  std::vector<int> devices;
  for (int r = 0; r < P; ++r) devices.push_back(r);
  std::vector<DeviceCase> inputs;
  for (int r = 0; r < P; ++r) inputs.push_back(upload(c, r));
  std::shared_ptr<ThreadGroup> group = ThreadGroup::create(P, std::chrono::milliseconds(20000));
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < P; ++r) comms.push_back(group->communicator(r));
  CudaCpConfig cp;
  cp.world_size = P;
  cp.max_reqs = c.batch.num_reqs;
  cp.max_q_len = c.batch.q_len;
  cp.max_context = c.index_block_table.shape()[1] * int64_t{cfg.block_size};
  cp.transport = CpTransport::kPeer;
  std::vector<int64_t> differing(static_cast<std::size_t>(P), 0);

  auto cycle = [&] {
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(P));
    std::vector<std::thread> threads;
    for (int r = 0; r < P; ++r) {
      threads.emplace_back([&, r] {
        try {
          CUDA_CHECK(cudaSetDevice(r));
          cuda::Stream stream;
          CudaCpIndexer ind(*comms[static_cast<std::size_t>(r)], r, cfg, cp);
          const auto merged = static_cast<int>(ind.merged_heads().size());
          DeviceTensor out(DType::kI32, {c.num_rows(), merged, cfg.topk}, r);
          fill_device_bytes(out.view(), kPoisonByte);
          ind.select(0, inputs[static_cast<std::size_t>(r)].indexer_args(out.view()), stream.get());
          ind.check(stream.get());
          HostTensor host;
          copy_to_host(out.view(), host);
          const int H = cfg.index_heads;
          const int k = cfg.topk;
          for (int64_t row = 0; row < c.num_rows(); ++row) {
            for (int lh = 0; lh < merged; ++lh) {
              const int head = ind.merged_heads()[static_cast<std::size_t>(lh)];
              differing[static_cast<std::size_t>(r)] +=
                  std::memcmp(reference.ptr<int32_t>() + (row * H + head) * k,
                              host.ptr<int32_t>() + (row * merged + lh) * k,
                              sizeof(int32_t) * k) != 0;
            }
          }
          // Peers stop storing into each other's buffers before either set is freed.
          comms[static_cast<std::size_t>(r)]->all_gather({}, "memory-test/done");
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (const std::exception_ptr& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  };

  Watch watch(devices);
  cycle();
  watch.set_baseline();
  const int n = cycles() - 1;
  for (int i = 0; i < n; ++i) {
    cycle();
    if (i % 10 == 0 || i + 1 == n) watch.sample();
  }
  for (int r = 0; r < P; ++r) {
    EXPECT_EQ(differing[static_cast<std::size_t>(r)], 0)
        << "rank " << r << ": CP selections differ from one GPU's in some cycles";
  }
  watch.expect_flat("CudaCpIndexer setup/run/destroy", n);
}

}  // namespace
}  // namespace m3msa::idxtest
