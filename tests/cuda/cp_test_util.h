// Helpers of the CUDA CP tests (cp_indexer_test.cc: ranks as threads; cp_multiprocess_test.cc:
// ranks as processes under `m3msa launch`): communicators of in-process ranks, synthetic cases,
// the one-GPU reference on any device, and the comparison of a rank's heads with it.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/indexer.h"
#include "indexer_test_util.h"
#include "m3msa/comm.h"
#include "m3msa/cp_cuda.h"

namespace m3msa::cptest {

using idxtest::kPoisonByte;

#define M3MSA_REQUIRE_GPUS(n)                                          \
  do {                                                                 \
    const int visible_ = ::m3msa::cuda_device_count();                 \
    if (visible_ < (n)) {                                              \
      GTEST_SKIP() << "needs " << (n) << " CUDA devices, " << visible_ \
                   << " visible: multi-GPU CP test skipped";           \
    }                                                                  \
  } while (0)

// Rank r runs on device r % visible devices: on one GPU the ranks of the peer and replicated
// transports share it (NCCL needs one device per rank, so its tests need P GPUs).
inline int device_of(int r) {
  return r % std::max(1, ::m3msa::cuda_device_count());
}

inline bool needs_nccl(CpTransport t) {
  return t == CpTransport::kNccl || t == CpTransport::kAllReduceMax;
}

// Communicators of P in-process ranks (NCCL for the NCCL transports, threads otherwise).
struct World {
  std::vector<std::unique_ptr<Communicator>> comms;
  World(int P, bool nccl) {
    if (nccl) {
      std::vector<int> devices;
      for (int r = 0; r < P; ++r) devices.push_back(r);
      for (auto& c : make_nccl_communicators_in_process(devices)) comms.push_back(std::move(c));
    } else {
      auto group = ThreadGroup::create(P, std::chrono::milliseconds(20000));
      for (int r = 0; r < P; ++r) comms.push_back(group->communicator(r));
    }
  }
  // Runs body(rank) on one thread per rank (device = device_of(rank)); rethrows the first error.
  void run(const std::function<void(int)>& body) {
    const int P = static_cast<int>(comms.size());
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(P));
    std::vector<std::thread> threads;
    for (int r = 0; r < P; ++r) {
      threads.emplace_back([&, r] {
        try {
          CUDA_CHECK(cudaSetDevice(device_of(r)));
          body(r);
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
  }
};

struct Case {
  int reqs;
  int q_len;
  int64_t min_ctx;
  int64_t max_ctx;
  DType dtype;
  int padding;
  std::vector<int64_t> seq_lens;
};

inline SyntheticCase make_case(const Case& cs, uint64_t seed) {
  SyntheticSpec spec =
      idxtest::decode_spec(cs.reqs, cs.q_len, cs.min_ctx, cs.max_ctx, cs.dtype, cs.padding, seed);
  spec.seq_lens = cs.seq_lens;
  return make_synthetic_case(spec);
}

// The one-GPU fused indexer on `device` (the reference every transport must equal bit for bit).
inline HostTensor run_reference(const SyntheticCase& c, int device) {
  cuda::DeviceGuard guard(device);
  DeviceCase d = upload(c, device);
  DeviceTensor topk(DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk}, device);
  fill_device_bytes(topk.view(), kPoisonByte);
  const cuda::IndexerPlan plan = cuda::plan_indexer(c.config, idxtest::limits_for(c), device);
  cuda::DeviceBuffer workspace(plan.workspace_bytes);
  cuda::Stream stream;
  cuda::init_indexer_workspace(plan, workspace.data(), stream.get());
  cuda::launch_indexer(plan, c.config, d.indexer_args(topk.view()), IndexerVariant::kFused,
                       workspace.data(), stream.get());
  stream.synchronize();
  HostTensor out;
  copy_to_host(topk.view(), out);
  return out;
}

// The heads [head0, head0 + merged) of a full selection [rows, H, k] equal `part`?
inline int64_t count_mismatches(const HostTensor& full, const HostTensor& part, int H, int head0,
                                int merged, int k) {
  const int64_t rows = full.shape()[0];
  int64_t bad = 0;
  for (int64_t row = 0; row < rows; ++row) {
    for (int lh = 0; lh < merged; ++lh) {
      const int32_t* a = full.ptr<int32_t>() + (row * H + head0 + lh) * k;
      const int32_t* b = part.ptr<int32_t>() + (row * merged + lh) * k;
      if (std::memcmp(a, b, sizeof(int32_t) * k) != 0) {
        if (bad == 0) {
          std::printf(
              "    first mismatch: row %ld head %d: one GPU [%d %d %d ...], CP [%d %d %d ...]\n",
              static_cast<long>(row), head0 + lh, a[0], a[1], a[2], b[0], b[1], b[2]);
        }
        ++bad;
      }
    }
  }
  return bad;
}

inline CudaCpConfig cp_config(int P, CpTransport t, int max_reqs, int max_q_len,
                              int64_t max_context) {
  CudaCpConfig cp;
  cp.world_size = P;
  cp.max_reqs = max_reqs;
  cp.max_q_len = max_q_len;
  cp.max_context = max_context;
  cp.transport = t;
  cp.spin_budget = std::chrono::milliseconds(300);
  return cp;
}

// `args` cut to its first `num_reqs` requests (rows, tables, lengths), writing into `topk_idx`:
// what a rank that passes a smaller batch for the same call hands over.
inline IndexerArgs first_requests(IndexerArgs args, int num_reqs, const TensorView& topk_idx) {
  const int64_t rows = int64_t{num_reqs} * args.batch.q_len;
  args.batch.num_reqs = num_reqs;
  args.batch.seq_lens.shape[0] = num_reqs;
  args.batch.index_block_table.shape[0] = num_reqs;
  if (args.batch.kv_block_table.defined()) args.batch.kv_block_table.shape[0] = num_reqs;
  if (args.batch.slot_mapping.defined()) args.batch.slot_mapping.shape[0] = rows;
  if (args.batch.index_slot_mapping.defined()) args.batch.index_slot_mapping.shape[0] = rows;
  args.index_q.shape[0] = rows;
  args.topk_idx = topk_idx;
  return args;
}

inline double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace m3msa::cptest
