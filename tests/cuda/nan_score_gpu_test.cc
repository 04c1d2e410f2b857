// The NaN rule of docs/spec.md section 4 on the CUDA backend: the decode indexer (fused default
// and the unfused scores-then-top-k path), the prefill indexer, and the CUDA CP indexer (peer
// transport, one rank and two ranks on device 0). A block with a NaN dot product among its
// visible tokens scores NaN and ranks below every number but above "no candidate"; a NaN after a
// row's position changes nothing; dead rows are all -1. The scores of these cases are exact small
// integers, so every path must give the rule's selection bit for bit (no near-tie allowance).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <barrier>
#include <chrono>
#include <exception>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "m3msa/comm.h"
#include "m3msa/cp_cuda.h"
#include "m3msa/cuda_backend.h"
#include "nan_score_case.h"

namespace m3msa {
namespace {

using nantest::check_masked_nan;
using nantest::check_visible_nan;

constexpr uint8_t kPoisonByte = 0x5A;  // int32 0x5A5A5A5A: never a valid entry

#define M3MSA_NAN_REQUIRE_GPU()                                                              \
  do {                                                                                       \
    if (::m3msa::cuda_device_count() == 0) {                                                 \
      GTEST_SKIP() << "no CUDA device visible (cuda_device_count() == 0): GPU test skipped"; \
    }                                                                                        \
  } while (0)

nantest::SelectFn backend_select(IndexerVariant variant) {
  return [variant](const SyntheticCase& c) {
    std::unique_ptr<CudaBackend> backend = make_cuda_backend(0);
    backend->set_indexer_variant(variant);
    DeviceCase d = upload(c, 0);
    DeviceTensor topk(DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk}, 0);
    fill_device_bytes(topk.view(), kPoisonByte);
    backend->select_topk(c.config, d.indexer_args(topk.view()));
    backend->synchronize();
    HostTensor out;
    copy_to_host(topk.view(), out);
    return out;
  };
}

// P ranks as threads on device 0 (the peer transport maps a rank's own device), each with its
// own stream; the heads each rank merges are assembled into one [rows, H, k] selection. The
// indexers and device tensors outlive every rank's thread, so no rank frees memory while a peer
// may still be inside the exchange.
nantest::SelectFn cp_select(int world_size) {
  return [world_size](const SyntheticCase& c) {
    const int H = c.config.index_heads;
    const int k = c.config.topk;
    const auto P = static_cast<std::size_t>(world_size);
    HostTensor full(DType::kI32, {c.num_rows(), H, k});
    full.fill_bytes(kPoisonByte);
    CudaCpConfig cp;
    cp.world_size = world_size;
    cp.max_reqs = c.batch.num_reqs;
    cp.max_q_len = c.batch.q_len;
    cp.max_context = c.index_block_table.shape()[1] * int64_t{c.config.block_size};
    cp.transport = CpTransport::kPeer;
    cp.spin_budget = std::chrono::milliseconds(300);
    auto group = ThreadGroup::create(world_size, std::chrono::milliseconds(20000));
    std::vector<std::unique_ptr<Communicator>> comms;
    for (int r = 0; r < world_size; ++r) comms.push_back(group->communicator(r));
    std::vector<std::unique_ptr<CudaCpIndexer>> indexers(P);
    std::vector<DeviceCase> cases(P);
    std::vector<DeviceTensor> outs(P);
    std::vector<std::exception_ptr> errors(P);
    std::barrier set_up(static_cast<std::ptrdiff_t>(world_size));
    std::vector<std::thread> threads;
    for (std::size_t r = 0; r < P; ++r) {
      threads.emplace_back([&, r] {
        cudaStream_t stream = nullptr;
        try {
          if (cudaSetDevice(0) != cudaSuccess) throw std::runtime_error("cudaSetDevice(0)");
          indexers[r] = std::make_unique<CudaCpIndexer>(*comms[r], 0, c.config, cp);
          cases[r] = upload(c, 0);
          const auto merged = static_cast<int64_t>(indexers[r]->merged_heads().size());
          outs[r] = DeviceTensor(DType::kI32, {c.num_rows(), merged, k}, 0);
          fill_device_bytes(outs[r].view(), kPoisonByte);
          if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
            throw std::runtime_error("cudaStreamCreateWithFlags");
          }
        } catch (...) {
          errors[r] = std::current_exception();
        }
        // No rank launches its exchange before every rank is set up: a peer's allocation or
        // synchronous copy would wait for the spinning kernel it is meant to feed.
        set_up.arrive_and_wait();
        try {
          if (errors[r]) throw std::runtime_error("set-up failed");
          const std::vector<int>& heads = indexers[r]->merged_heads();
          const int merged = static_cast<int>(heads.size());
          indexers[r]->select(0, cases[r].indexer_args(outs[r].view()), stream);
          indexers[r]->check(stream);
          HostTensor part;
          copy_to_host(outs[r].view(), part);
          for (int64_t row = 0; row < c.num_rows(); ++row) {
            for (int lh = 0; lh < merged; ++lh) {
              for (int i = 0; i < k; ++i) {
                full.ptr<int32_t>()[(row * H + heads[static_cast<std::size_t>(lh)]) * k + i] =
                    part.ptr<int32_t>()[(row * merged + lh) * k + i];
              }
            }
          }
        } catch (...) {
          if (!errors[r]) errors[r] = std::current_exception();
        }
        if (stream != nullptr) cudaStreamDestroy(stream);
      });
    }
    for (auto& t : threads) t.join();
    for (auto& e : errors) {
      if (e) std::rethrow_exception(e);
    }
    return full;
  };
}

TEST(NanScoreGpu, DecodeIndexerRanksANanBlockBelowEveryNumber) {
  M3MSA_NAN_REQUIRE_GPU();
  for (IndexerVariant variant : {IndexerVariant::kFused, IndexerVariant::kUnfused}) {
    SCOPED_TRACE(variant == IndexerVariant::kFused ? "fused" : "unfused");
    for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
      for (int local_blocks : {0, 1}) {
        check_visible_nan(backend_select(variant), dtype, local_blocks, BatchKind::kDecode);
      }
    }
  }
}

TEST(NanScoreGpu, DecodeIndexerIgnoresANanAfterThePosition) {
  M3MSA_NAN_REQUIRE_GPU();
  for (IndexerVariant variant : {IndexerVariant::kFused, IndexerVariant::kUnfused}) {
    SCOPED_TRACE(variant == IndexerVariant::kFused ? "fused" : "unfused");
    for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
      for (int local_blocks : {0, 1}) {
        check_masked_nan(backend_select(variant), dtype, local_blocks, BatchKind::kDecode);
      }
    }
  }
}

TEST(NanScoreGpu, PrefillIndexerFollowsTheRule) {
  M3MSA_NAN_REQUIRE_GPU();
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    for (int local_blocks : {0, 1}) {
      check_visible_nan(backend_select(IndexerVariant::kFused), dtype, local_blocks,
                        BatchKind::kPrefill);
      check_masked_nan(backend_select(IndexerVariant::kFused), dtype, local_blocks,
                       BatchKind::kPrefill);
    }
  }
}

// An fp8 index_q beside the fp8 cache is scored on the FP8 tensor cores: a NaN in the cache
// times a zero query weight must still make the block's score NaN there, in every kernel.
TEST(NanScoreGpu, Fp8QueryFollowsTheRule) {
  M3MSA_NAN_REQUIRE_GPU();
  for (IndexerVariant variant : {IndexerVariant::kFused, IndexerVariant::kUnfused,
                                 IndexerVariant::kSpan, IndexerVariant::kSplitMerge}) {
    SCOPED_TRACE(testing::Message() << "variant " << static_cast<int>(variant));
    for (int local_blocks : {0, 1}) {
      check_visible_nan(backend_select(variant), DType::kFP8E4M3, local_blocks, BatchKind::kDecode,
                        DType::kFP8E4M3);
      check_masked_nan(backend_select(variant), DType::kFP8E4M3, local_blocks, BatchKind::kDecode,
                       DType::kFP8E4M3);
    }
  }
  for (int local_blocks : {0, 1}) {
    check_visible_nan(backend_select(IndexerVariant::kFused), DType::kFP8E4M3, local_blocks,
                      BatchKind::kPrefill, DType::kFP8E4M3);
  }
  for (int world_size : {1, 2}) {
    SCOPED_TRACE(testing::Message() << "CP peer, P = " << world_size);
    check_visible_nan(cp_select(world_size), DType::kFP8E4M3, 1, BatchKind::kDecode,
                      DType::kFP8E4M3);
    check_masked_nan(cp_select(world_size), DType::kFP8E4M3, 1, BatchKind::kDecode,
                     DType::kFP8E4M3);
  }
}

// The peer transport needs a forced own block (local_blocks >= 1).
TEST(NanScoreGpu, CpIndexerFollowsTheRule) {
  M3MSA_NAN_REQUIRE_GPU();
  for (int world_size : {1, 2}) {
    SCOPED_TRACE(testing::Message() << "CP peer, P = " << world_size);
    for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
      check_visible_nan(cp_select(world_size), dtype, 1, BatchKind::kDecode);
      check_masked_nan(cp_select(world_size), dtype, 1, BatchKind::kDecode);
    }
  }
}

}  // namespace
}  // namespace m3msa
