// The CUDA indexer against the CPU reference (near-tie rule, indexer_test_util.h), plus its
// determinism, graph-replay, unfused-baseline, prefill and error-reporting contracts.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

#include "cuda/indexer_params.h"
#include "indexer_test_util.h"

namespace m3msa::idxtest {
namespace {

struct DecodeShape {
  int reqs;
  int q_len;
  int64_t min_ctx;
  int64_t max_ctx;
  DType dtype;
  int padding;
  int topk;
  int init_blocks;
  int local_blocks;
};

std::string describe_shape(const DecodeShape& s) {
  std::ostringstream out;
  out << "reqs " << s.reqs << " q_len " << s.q_len << " ctx [" << s.min_ctx << ", " << s.max_ctx
      << "] " << dtype_name(s.dtype) << " padding " << s.padding << " topk " << s.topk << " init "
      << s.init_blocks << " local " << s.local_blocks;
  return out.str();
}

// Checks one shape against the CPU reference; returns the case for further checks.
SyntheticCase check_decode_shape(const DecodeShape& shape, uint64_t seed) {
  SyntheticSpec spec = decode_spec(shape.reqs, shape.q_len, shape.min_ctx, shape.max_ctx,
                                   shape.dtype, shape.padding, seed, shape.topk);
  spec.config.init_blocks = shape.init_blocks;
  spec.config.local_blocks = shape.local_blocks;
  const SyntheticCase c = make_synthetic_case(spec);
  const CpuResult cpu = run_cpu(c);
  uint32_t status = 0;
  const HostTensor gpu = run_gpu(c, IndexerVariant::kFused, &status);
  EXPECT_EQ(status, 0u) << describe_shape(shape);
  const Comparison cmp = compare_selections(c, gpu, cpu);
  EXPECT_EQ(cmp.failures, 0) << describe_shape(shape) << ": " << cmp.summary();
  std::printf("  [%s] %s\n", describe_shape(shape).c_str(), cmp.summary().c_str());
  return c;
}

TEST(CudaIndexer, RandomizedDecodeMatchesCpu) {
  M3MSA_INDEXER_REQUIRE_GPU();
  const DType bf16 = DType::kBF16, fp8 = DType::kFP8E4M3;
  const std::vector<DecodeShape> shapes = {
      {1, 1, 1, 1, bf16, 0, 16, 0, 1},  // one token
      {1, 1, 1, 300, fp8, 0, 16, 0, 1},
      {4, 1, 1000, 5000, bf16, 0, 16, 0, 1},
      {4, 1, 1000, 5000, fp8, 1, 16, 0, 1},
      {16, 2, 1, 20000, bf16, 3, 16, 0, 1},  // padding rows
      {64, 1, 1, 4096, fp8, 5, 16, 0, 1},    // batch 64
      {64, 4, 1, 9000, bf16, 0, 16, 0, 1},
      {8, 4, 10000, 40000, fp8, 0, 16, 0, 1},
      {3, 8, 1, 3000, bf16, 0, 16, 0, 1},         // q_len 8: 32 query vectors
      {5, 3, 100, 70000, fp8, 1, 16, 0, 1},       // q_len 3: 12 vectors
      {6, 5, 1, 30000, bf16, 0, 8, 1, 2},         // other forced settings, k = 8
      {6, 2, 1, 30000, fp8, 0, 32, 2, 1},         // k = 32
      {2, 1, 200000, 262144, bf16, 0, 16, 0, 1},  // 256K
      {1, 4, 262144, 262144, fp8, 0, 16, 0, 1},
      {1, 1, 1 << 20, 1 << 20, bf16, 0, 16, 0, 1},  // 1M, one request: big merge
  };
  uint64_t seed = 11;
  for (const DecodeShape& shape : shapes) check_decode_shape(shape, seed++);
}

// The last CTA's merge of one request spread over the whole grid (indexer.cuh: warp_top_keys over
// every CTA's candidates; the counts hold for the 264-CTA grid of a 132-SM H200): 128 candidates
// per vector (one round trip), 1024 for 16 vectors (128K x q_len 4), ~4096 with k 32 (512K x
// q_len 2), and 264 x 32 (1.1M, k 32: every CTA fills its k slots). Each against the CPU
// reference and, bit for bit, against the unfused baseline's own top-k kernel.
TEST(CudaIndexer, OneLongRequestMergesTheWholeGridsCandidates) {
  M3MSA_INDEXER_REQUIRE_GPU();
  const DType bf16 = DType::kBF16, fp8 = DType::kFP8E4M3;
  const std::vector<DecodeShape> shapes = {
      {1, 1, 16384, 16384, bf16, 0, 16, 0, 1},
      {1, 4, 131072, 131072, bf16, 0, 16, 0, 1},
      {1, 2, 1 << 19, 1 << 19, fp8, 0, 32, 0, 1},
      {1, 1, 1100000, 1100000, fp8, 0, 32, 0, 1},
  };
  uint64_t seed = 71;
  for (const DecodeShape& shape : shapes) {
    const SyntheticCase c = check_decode_shape(shape, seed++);
    const HostTensor fused = run_gpu(c);
    const HostTensor unfused = run_gpu(c, IndexerVariant::kUnfused);
    EXPECT_EQ(std::memcmp(fused.data(), unfused.data(), fused.nbytes()), 0)
        << describe_shape(shape) << ": fused and unfused selections differ";
  }
}

TEST(CudaIndexer, PartlyFilledOwnBlocksAndBoundaries) {
  M3MSA_INDEXER_REQUIRE_GPU();
  // Lengths around block edges, so the own block holds 1, 2, 127 or 128 visible tokens and the
  // speculative rows of one request straddle a block boundary.
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    for (int q_len : {1, 4, 8}) {
      SyntheticSpec spec = decode_spec(10, q_len, 0, 0, dtype, 0, 77 + q_len);
      spec.seq_lens = {8, 127, 128, 129, 130, 255, 256, 257, 2048 + 3, 4096};
      for (int64_t& len : spec.seq_lens) len = std::max<int64_t>(len, q_len);
      const SyntheticCase c = make_synthetic_case(spec);
      const CpuResult cpu = run_cpu(c);
      const HostTensor gpu = run_gpu(c);
      const Comparison cmp = compare_selections(c, gpu, cpu);
      EXPECT_EQ(cmp.failures, 0) << dtype_name(dtype) << " q_len " << q_len << ": "
                                 << cmp.summary();
    }
  }
}

TEST(CudaIndexer, OneVisibleBlockGivesZeroThenMinusOnes) {
  M3MSA_INDEXER_REQUIRE_GPU();
  SyntheticSpec spec = decode_spec(3, 1, 0, 0, DType::kBF16, 0, 5);
  spec.seq_lens = {1, 64, 128};
  const SyntheticCase c = make_synthetic_case(spec);
  const HostTensor gpu = run_gpu(c);
  for (int64_t i = 0; i < gpu.numel(); ++i) {
    const int expect = i % c.config.topk == 0 ? 0 : -1;
    ASSERT_EQ(gpu.ptr<int32_t>()[i], expect) << "element " << i;
  }
}

TEST(CudaIndexer, AllPaddingRequestsGiveMinusOne) {
  M3MSA_INDEXER_REQUIRE_GPU();
  SyntheticSpec spec = decode_spec(5, 2, 10, 1000, DType::kFP8E4M3, 5, 6);
  const SyntheticCase c = make_synthetic_case(spec);
  const HostTensor gpu = run_gpu(c);
  for (int64_t i = 0; i < gpu.numel(); ++i) ASSERT_EQ(gpu.ptr<int32_t>()[i], -1) << i;
}

TEST(CudaIndexer, NanScoresRankLast) {
  M3MSA_INDEXER_REQUIRE_GPU();
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    SyntheticSpec spec = decode_spec(2, 2, 0, 0, dtype, 0, 21);
    spec.seq_lens = {40 * 128 + 5, 7 * 128};
    SyntheticCase c = make_synthetic_case(spec);
    // NaN in one visible token of several blocks of request 0 (all heads see it), and in the
    // last token of request 1, which only its second row can see.
    const int64_t row_elems = c.config.index_dim;
    auto poison_token = [&](int req, int64_t pos) {
      const int32_t page =
          c.index_block_table.ptr<int32_t>()[req * c.index_block_table.shape()[1] + pos / 128];
      const int64_t at = (int64_t{page} * 128 + pos % 128) * row_elems + 3;
      if (dtype == DType::kBF16) {
        c.index_cache.ptr<uint16_t>()[at] = 0x7FC0;
      } else {
        c.index_cache.ptr<uint8_t>()[at] = 0x7F;
      }
    };
    for (int b : {0, 3, 9, 17, 30}) poison_token(0, b * 128 + 11);
    poison_token(1, 7 * 128 - 1);
    const CpuResult cpu = run_cpu(c);
    const HostTensor gpu = run_gpu(c);
    const Comparison cmp = compare_selections(c, gpu, cpu);
    EXPECT_EQ(cmp.failures, 0) << dtype_name(dtype) << ": " << cmp.summary();
    // Exactly: the NaN blocks of request 0 (40 blocks > k) are never selected.
    for (int j = 0; j < 2; ++j) {
      for (int h = 0; h < c.config.index_heads; ++h) {
        const int32_t* g = gpu.ptr<int32_t>() + (j * c.config.index_heads + h) * c.config.topk;
        for (int i = 0; i < c.config.topk; ++i) {
          for (int b : {0, 3, 9, 17, 30}) EXPECT_NE(g[i], b) << "row " << j << " head " << h;
        }
      }
    }
  }
}

TEST(CudaIndexer, TwoRunsAreBitIdenticalAndUnfusedAgrees) {
  M3MSA_INDEXER_REQUIRE_GPU();
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    const SyntheticCase c = make_synthetic_case(decode_spec(24, 4, 1, 60000, dtype, 2, 31));
    const HostTensor a = run_gpu(c);
    const HostTensor b = run_gpu(c);
    const HostTensor u = run_gpu(c, IndexerVariant::kUnfused);
    ASSERT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0) << "fused runs differ";
    // Same scoring code, same keys: the baseline must select exactly the same blocks.
    ASSERT_EQ(std::memcmp(a.data(), u.data(), a.nbytes()), 0) << "fused and unfused differ";
  }
}

// The span split over CTAs changes with the batch; a request's block scores must not.
TEST(CudaIndexer, ScoresDoNotDependOnTheBatch) {
  M3MSA_INDEXER_REQUIRE_GPU();
  const SyntheticCase c = make_synthetic_case(decode_spec(6, 2, 5000, 90000, DType::kBF16, 0, 41));
  auto scores_of = [](const SyntheticCase& sc) {
    DeviceCase d = upload(sc);
    DeviceTensor topk(DType::kI32, {sc.num_rows(), sc.config.index_heads, sc.config.topk});
    GpuIndexer gpu(sc.config, limits_for(sc));
    const cuda::IndexerPlan& plan = gpu.plan();
    const int64_t n = sc.num_rows() * sc.config.index_heads * plan.score_cols;
    // The kernel writes only the visible blocks' columns; the rest is copied back but never
    // compared: define it, so the copy reads no uninitialized memory (compute-sanitizer
    // initcheck).
    CUDA_CHECK(
        cudaMemset(static_cast<uint8_t*>(gpu.workspace()) + plan.off_scores, 0, n * sizeof(float)));
    CUDA_CHECK(cudaDeviceSynchronize());
    gpu.launch(sc.config, d.indexer_args(topk.view()), IndexerVariant::kUnfused);
    gpu.sync();
    std::vector<float> s(static_cast<size_t>(n));
    CUDA_CHECK(cudaMemcpy(s.data(), static_cast<uint8_t*>(gpu.workspace()) + plan.off_scores,
                          n * sizeof(float), cudaMemcpyDeviceToHost));
    return std::make_pair(s, plan.score_cols);
  };
  const auto [all, cols_all] = scores_of(c);
  // Request 3 alone: same cache, table row and queries.
  SyntheticCase one = make_synthetic_case(decode_spec(6, 2, 5000, 90000, DType::kBF16, 0, 41));
  const int req = 3;
  const int q = c.batch.q_len;
  const int H = c.config.index_heads;
  const int64_t cols = c.index_block_table.shape()[1];
  one.seq_lens = HostTensor(DType::kI32, {1});
  one.seq_lens.ptr<int32_t>()[0] = c.seq_lens.ptr<int32_t>()[req];
  one.index_block_table = HostTensor(DType::kI32, {1, cols});
  std::memcpy(one.index_block_table.data(), c.index_block_table.ptr<int32_t>() + req * cols,
              cols * sizeof(int32_t));
  one.index_q = HostTensor(DType::kBF16, {q, H, 128});
  std::memcpy(one.index_q.data(), c.index_q.ptr<uint16_t>() + int64_t{req} * q * H * 128,
              one.index_q.nbytes());
  one.batch.num_reqs = 1;
  one.batch.seq_lens = one.seq_lens.view();
  one.batch.index_block_table = one.index_block_table.view();
  one.batch.kv_block_table = {};
  one.batch.slot_mapping = {};
  one.batch.index_slot_mapping = {};
  one.kv_block_table = HostTensor();
  one.slot_mapping = HostTensor();
  one.index_slot_mapping = HostTensor();
  const auto [alone, cols_alone] = scores_of(one);
  const int64_t nb = visible_blocks(c.seq_lens.ptr<int32_t>()[req] - 1, 128);
  for (int j = 0; j < q; ++j) {
    for (int h = 0; h < H; ++h) {
      for (int64_t b = 0; b < nb - (j + 1 < q ? 1 : 0); ++b) {
        const float x = all[((int64_t{req} * q + j) * H + h) * cols_all + b];
        const float y = alone[(int64_t{j} * H + h) * cols_alone + b];
        ASSERT_EQ(std::memcmp(&x, &y, 4), 0) << "row " << j << " head " << h << " block " << b;
      }
    }
  }
}

// Capture with one batch's buffers, then replay after writing another batch's metadata and
// queries into them: must equal an eager run of the second batch. The second and third shapes
// spread each long request over half or all of the grid, so a last CTA merges ~1000 candidates
// per query vector and the arrival counters must be left at zero across replays.
TEST(CudaIndexer, GraphReplayWithNewMetadataEqualsEager) {
  M3MSA_INDEXER_REQUIRE_GPU();
  struct Shape {
    int reqs, q_len;
    int64_t min_ctx, max_ctx;
  };
  for (const Shape& shape :
       {Shape{32, 4, 100, 50000}, Shape{2, 1, 100000, 140000}, Shape{1, 2, 200000, 200000}})
    for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
      const SyntheticCase a = make_synthetic_case(
          decode_spec(shape.reqs, shape.q_len, shape.min_ctx, shape.max_ctx, dtype, 0, 51));
      // Batch B: same shapes; rows of A's table permuted, shorter lengths, some padding, new q.
      SyntheticCase b = make_synthetic_case(
          decode_spec(shape.reqs, shape.q_len, shape.min_ctx, shape.max_ctx, dtype, 0, 51));
      Rng rng(99);
      const int reqs = a.batch.num_reqs;
      const int64_t cols = a.index_block_table.shape()[1];
      std::vector<int> perm(reqs);
      std::iota(perm.begin(), perm.end(), 0);
      for (int i = reqs - 1; i > 0; --i) std::swap(perm[i], perm[rng.range(0, i)]);
      for (int r = 0; r < reqs; ++r) {
        const int src = perm[r];
        const int32_t cap = a.seq_lens.ptr<int32_t>()[src];
        b.seq_lens.ptr<int32_t>()[r] = r % 7 == 3 ? 0 : static_cast<int32_t>(rng.range(4, cap));
        std::memcpy(b.index_block_table.ptr<int32_t>() + r * cols,
                    a.index_block_table.ptr<int32_t>() + src * cols, cols * sizeof(int32_t));
      }
      for (int64_t i = 0; i < b.index_q.numel(); ++i) {
        b.index_q.ptr<uint16_t>()[i] = float_to_bf16(static_cast<float>(rng.uniform(-2, 2)));
      }
      std::memcpy(b.index_cache.data(), a.index_cache.data(), a.index_cache.nbytes());

      const HostTensor eager = run_gpu(b);
      // The separate merge's programmatic dependency is captured as a graph edge too.
      for (IndexerVariant variant :
           {IndexerVariant::kFused, IndexerVariant::kSplitMerge, IndexerVariant::kLastCtaMerge}) {
        GpuIndexer gpu(a.config, limits_for(a));
        DeviceCase da = upload(a);
        DeviceTensor out(DType::kI32, {a.num_rows(), a.config.index_heads, a.config.topk});
        const IndexerArgs args_a = da.indexer_args(out.view());
        cuda::Graph graph =
            cuda::Graph::capture(gpu.stream(), [&] { gpu.launch(a.config, args_a, variant); });
        graph.launch(gpu.stream());  // replay on A first (also exercises counter reuse)
        gpu.sync();
        // Overwrite A's metadata with B's and replay.
        copy_to_device(b.seq_lens, da.seq_lens.view());
        copy_to_device(b.index_block_table, da.index_block_table.view());
        copy_to_device(b.index_q, da.index_q.view());
        fill_device_bytes(out.view(), kPoisonByte);
        graph.launch(gpu.stream());
        gpu.sync();
        HostTensor replayed;
        copy_to_host(out.view(), replayed);
        ASSERT_EQ(std::memcmp(replayed.data(), eager.data(), eager.nbytes()), 0)
            << dtype_name(dtype) << ", " << shape.reqs << " requests, variant "
            << static_cast<int>(variant);
        EXPECT_EQ(gpu.status(), 0u);
      }
      // And B is right.
      const Comparison cmp = compare_selections(b, eager, run_cpu(b));
      EXPECT_EQ(cmp.failures, 0) << cmp.summary();
    }
}

TEST(CudaIndexer, RandomizedPrefillMatchesCpu) {
  M3MSA_INDEXER_REQUIRE_GPU();
  struct Prefill {
    int reqs;
    int64_t max_chunk;
    int64_t max_context;
    DType dtype;
  };
  uint64_t seed = 61;
  for (const Prefill& pf :
       {Prefill{1, 1, 0, DType::kBF16}, Prefill{3, 40, 3000, DType::kFP8E4M3},
        Prefill{6, 300, 20000, DType::kBF16}, Prefill{2, 700, 70000, DType::kFP8E4M3}}) {
    SyntheticSpec spec;
    spec.kind = BatchKind::kPrefill;
    spec.num_reqs = pf.reqs;
    spec.min_context = 0;
    spec.max_context = pf.max_context;
    spec.index_dtype = pf.dtype;
    spec.make_kv_cache = false;
    spec.seed = seed++;
    Rng rng(spec.seed);
    for (int r = 0; r < pf.reqs; ++r) spec.chunk_lens.push_back(rng.range(1, pf.max_chunk));
    const SyntheticCase c = make_synthetic_case(spec);
    const CpuResult cpu = run_cpu(c);
    uint32_t status = 0;
    const HostTensor gpu = run_gpu(c, IndexerVariant::kFused, &status);
    EXPECT_EQ(status, 0u);
    const Comparison cmp = compare_selections(c, gpu, cpu);
    EXPECT_EQ(cmp.failures, 0) << "prefill reqs " << pf.reqs << ": " << cmp.summary();
    std::printf("  [prefill reqs %d chunk <= %ld ctx <= %ld %s] %s\n", pf.reqs,
                static_cast<long>(pf.max_chunk), static_cast<long>(pf.max_context),
                dtype_name(pf.dtype), cmp.summary().c_str());
  }
}

TEST(CudaIndexer, BackendMatchesCpuBackend) {
  M3MSA_INDEXER_REQUIRE_GPU();
  const SyntheticCase c = make_synthetic_case(decode_spec(9, 2, 1, 30000, DType::kBF16, 1, 71));
  auto backend = make_cuda_backend(0);
  DeviceCase d = upload(c);
  DeviceTensor topk(DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk});
  fill_device_bytes(topk.view(), kPoisonByte);
  backend->select_topk(c.config, d.indexer_args(topk.view()));
  backend->synchronize();
  EXPECT_EQ(backend->indexer_device_status(true), 0u);
  HostTensor gpu;
  copy_to_host(topk.view(), gpu);
  const Comparison cmp = compare_selections(c, gpu, run_cpu(c));
  EXPECT_EQ(cmp.failures, 0) << cmp.summary();
  // A bigger batch than the first call re-plans on the fly.
  const SyntheticCase c2 = make_synthetic_case(decode_spec(40, 4, 1, 8000, DType::kFP8E4M3, 0, 72));
  DeviceCase d2 = upload(c2);
  DeviceTensor topk2(DType::kI32, {c2.num_rows(), c2.config.index_heads, c2.config.topk});
  backend->select_topk(c2.config, d2.indexer_args(topk2.view()));
  backend->synchronize();
  HostTensor gpu2;
  copy_to_host(topk2.view(), gpu2);
  const Comparison cmp2 = compare_selections(c2, gpu2, run_cpu(c2));
  EXPECT_EQ(cmp2.failures, 0) << cmp2.summary();
}

TEST(CudaIndexer, BadInputsNameTheArgument) {
  M3MSA_INDEXER_REQUIRE_GPU();
  const SyntheticCase c = make_synthetic_case(decode_spec(3, 1, 100, 2000, DType::kBF16, 0, 81));
  auto backend = make_cuda_backend(0);
  DeviceCase d = upload(c);
  DeviceTensor topk(DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk});
  const IndexerArgs good = d.indexer_args(topk.view());

  IndexerArgs bad = good;
  bad.index_q.dtype = DType::kF32;
  expect_error([&] { backend->select_topk(c.config, bad); }, ErrorCode::kInvalidArgument,
               "index_q");
  bad = good;
  bad.topk_idx.shape[2] = c.config.topk + 1;
  expect_error([&] { backend->select_topk(c.config, bad); }, ErrorCode::kInvalidArgument,
               "topk_idx");
  bad = good;
  bad.index_cache.data = c.index_cache.view();  // a host tensor
  expect_error([&] { backend->select_topk(c.config, bad); }, ErrorCode::kInvalidArgument,
               "index_cache");
  // Table contents (validated on the host by default).
  {
    SyntheticCase broken = make_synthetic_case(decode_spec(3, 1, 100, 2000, DType::kBF16, 0, 81));
    broken.index_block_table.ptr<int32_t>()[0] = 1 << 20;
    DeviceCase db = upload(broken);
    expect_error([&] { backend->select_topk(c.config, db.indexer_args(topk.view())); },
                 ErrorCode::kInvalidArgument, "batch.index_block_table");
  }
  {
    SyntheticCase broken = make_synthetic_case(decode_spec(3, 2, 100, 2000, DType::kBF16, 0, 82));
    broken.seq_lens.ptr<int32_t>()[1] = 1;  // < q_len
    DeviceCase db = upload(broken);
    DeviceTensor t2(DType::kI32, {broken.num_rows(), c.config.index_heads, c.config.topk});
    expect_error([&] { backend->select_topk(c.config, db.indexer_args(t2.view())); },
                 ErrorCode::kInvalidArgument, "batch.seq_lens");
  }
  // Unsupported configuration.
  {
    SparseConfig odd = c.config;
    odd.topk = 64;
    expect_error([&] { backend->select_topk(odd, good); }, ErrorCode::kInvalidArgument,
                 "topk_idx");  // shape check comes first: [rows, H, 64] expected
    DeviceTensor t64(DType::kI32, {c.num_rows(), c.config.index_heads, 64});
    expect_error([&] { backend->select_topk(odd, d.indexer_args(t64.view())); },
                 ErrorCode::kUnsupported, "topk");
  }
  // Outside the plan on the low-level API.
  {
    GpuIndexer gpu(c.config, PlanLimits{1, 1, 0, 0});
    expect_error([&] { gpu.launch(c.config, good); }, ErrorCode::kInvalidArgument, "max_reqs");
  }
}

// With host validation off (graph replays), a bad table entry must not crash or read outside
// the cache: the guard reads page 0 and raises a status bit.
TEST(CudaIndexer, DeviceGuardsCatchBadTables) {
  M3MSA_INDEXER_REQUIRE_GPU();
  SyntheticCase c = make_synthetic_case(decode_spec(4, 1, 3000, 6000, DType::kFP8E4M3, 0, 91));
  c.index_block_table.ptr<int32_t>()[c.index_block_table.shape()[1] + 2] = 1 << 28;
  uint32_t status = 0;
  const HostTensor gpu = run_gpu(c, IndexerVariant::kFused, &status);
  EXPECT_EQ(status & cuda::kStatusBadPage, cuda::kStatusBadPage);
  for (int64_t i = 0; i < gpu.numel(); ++i) {
    const int32_t v = gpu.ptr<int32_t>()[i];
    ASSERT_TRUE(v >= -1 && v < 64) << "element " << i << " = " << v;
  }
}

}  // namespace
}  // namespace m3msa::idxtest
