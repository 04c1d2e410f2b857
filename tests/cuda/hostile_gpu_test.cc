// Numerical hostility on the GPU, through the public CUDA backend, every result compared
// with the CPU reference (which docs/reliability.md pins down: NaN ranks below -inf, ties go to
// the lower block id, IEEE arithmetic inside selected blocks, fp8 saturates at +-448). What the
// other GPU suites already cover is not repeated: NaN in some index keys (CudaIndexer.
// NanScoresRankLast), contexts of 127 / 128 / 129 tokens in the indexer (CudaIndexer.
// PartlyFilledOwnBlocksAndBoundaries), one visible block (CudaIndexer.OneVisibleBlock...), the
// warp top-k on equal keys (CudaIndexerBlocks.WarpTopKeysMatchesSort). Added here:
//  - NaN and +-inf in index queries and keys (inf * 0 included), and an all-NaN index cache;
//  - all-equal scores end to end, across the multi-CTA merge of long contexts;
//  - NaN and inf in the KV cache and in q inside selected blocks (IEEE results, NaN positions
//    must match), and NaN / inf where neither the selection nor the sequence reaches (outputs
//    bit-identical to a clean run: never read, never multiplied by a zero weight);
//  - fp8 saturation of the cache insert (norm weights of 999, V of +-1000, scales 0.5 and 4);
//  - contexts of exactly 1, 127, 128, 129 tokens through selection and attention, with dense
//    attention as a second oracle;
//  - the block-id limit: 2^24 - 1 blocks (ids up to 2^24 - 2) accepted by attention and matching
//    the CPU; one token more rejected by the indexer and by attention naming batch.seq_lens[0].
//    Scoring all 2^24 - 1 blocks (2^31 tokens) takes tens of seconds, so it runs only with
//    M3MSA_TEST_FULL_LIMIT=1.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "indexer_test_util.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/cuda_backend.h"
#include "m3msa/dtype.h"
#include "m3msa/error.h"

namespace m3msa {
namespace {

using idxtest::compare_selections;
using idxtest::Comparison;
using idxtest::CpuResult;
using idxtest::decode_spec;
using idxtest::expect_error;
using idxtest::kPoisonByte;
using idxtest::run_cpu;

constexpr uint16_t kBf16Nan = 0x7FC0;
constexpr uint16_t kBf16PosInf = 0x7F80;
constexpr uint16_t kBf16NegInf = 0xFF80;
constexpr uint8_t kFp8Nan = 0x7F;
constexpr uint8_t kFp8Max = 0x7E;     // +448: e4m3 has no infinity, +inf saturates here
constexpr uint8_t kFp8NegMax = 0xFE;  // -448

std::unique_ptr<CudaBackend> planned_backend(const SyntheticCase& c) {
  std::unique_ptr<CudaBackend> backend = make_cuda_backend(0);
  backend->plan(c.config, idxtest::limits_for(c));
  return backend;
}

HostTensor gpu_select(const SyntheticCase& c) {
  std::unique_ptr<CudaBackend> backend = planned_backend(c);
  DeviceCase d = upload(c);
  DeviceTensor topk(DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk});
  fill_device_bytes(topk.view(), kPoisonByte);
  backend->select_topk(c.config, d.indexer_args(topk.view()));
  backend->synchronize();
  HostTensor out;
  copy_to_host(topk.view(), out);
  return out;
}

HostTensor gpu_attention(const SyntheticCase& c, const HostTensor& topk) {
  std::unique_ptr<CudaBackend> backend = planned_backend(c);
  DeviceCase d = upload(c);
  DeviceTensor t = to_device(topk);
  DeviceTensor out(DType::kBF16, {c.num_rows(), c.config.q_heads, c.config.head_dim});
  fill_device_bytes(out.view(), 0xFF);
  backend->sparse_attention(c.config, d.attention_args(t.view(), out.view()));
  backend->synchronize();
  HostTensor host;
  copy_to_host(out.view(), host);
  return host;
}

HostTensor cpu_attention(const SyntheticCase& c, const HostTensor& topk, bool dense = false) {
  HostTensor out(DType::kBF16, {c.num_rows(), c.config.q_heads, c.config.head_dim});
  out.fill_bytes(0xFF);
  if (dense) {
    cpu::dense_attention(c.config, c.attention_args(TensorView{}, out.view()));
  } else {
    cpu::sparse_attention(c.config, c.attention_args(topk.view(), out.view()));
  }
  return out;
}

HostTensor clone_tensor(const HostTensor& t) {
  HostTensor copy(t.dtype(), t.shape());
  if (t.nbytes()) std::memcpy(copy.data(), t.data(), t.nbytes());
  return copy;
}

// The selection of the GPU vs the CPU: the near-tie rule everywhere, and exactly where a list's
// CPU scores hold a NaN or an infinity (the order of non-numbers is fixed, not rounding-prone).
void expect_selection_matches_cpu(const SyntheticCase& c, const HostTensor& gpu,
                                  const std::string& what) {
  const CpuResult cpu = run_cpu(c);
  const Comparison cmp = compare_selections(c, gpu, cpu);
  EXPECT_EQ(cmp.failures, 0) << what << ": " << cmp.summary();
  const SparseConfig& cfg = c.config;
  const int H = cfg.index_heads;
  const int k = cfg.topk;
  const int64_t cols = cpu.scores.shape()[2];
  const std::vector<RowPosition> rows = row_positions(c.batch);
  int64_t exact_lists = 0;
  for (int64_t row = 0; row < static_cast<int64_t>(rows.size()); ++row) {
    const int64_t nb = visible_blocks(rows[row].pos, cfg.block_size);
    for (int h = 0; h < H; ++h) {
      const float* s = cpu.scores.ptr<float>() + (row * H + h) * cols;
      bool non_finite = false;
      for (int64_t b = 0; b < nb; ++b) non_finite |= !std::isfinite(s[b]);
      if (!non_finite) continue;
      ++exact_lists;
      const int32_t* g = gpu.ptr<int32_t>() + (row * H + h) * k;
      const int32_t* r = cpu.topk.ptr<int32_t>() + (row * H + h) * k;
      std::string gs, rs;
      for (int i = 0; i < k; ++i) {
        gs += ' ';  // (not " " + to_string: GCC 12's -Wrestrict misfires on it)
        gs += std::to_string(g[i]);
        rs += ' ';
        rs += std::to_string(r[i]);
      }
      EXPECT_EQ(gs, rs) << what << ": row " << row << " head " << h
                        << " (non-finite scores: the order is exact)";
    }
  }
  std::printf("  [%s] %s; %lld lists with non-finite scores compared exactly\n", what.c_str(),
              cmp.summary().c_str(), static_cast<long long>(exact_lists));
}

int64_t index_element(const SyntheticCase& c, int req, int64_t pos, int dim) {
  const int64_t cols = c.index_block_table.shape()[1];
  const int bs = c.config.block_size;
  const int32_t page = c.index_block_table.ptr<int32_t>()[req * cols + pos / bs];
  return (int64_t{page} * bs + pos % bs) * c.config.index_dim + dim;
}

void set_index(SyntheticCase& c, int64_t at, uint16_t bf16_bits, uint8_t fp8_bits) {
  if (c.index_cache.dtype() == DType::kBF16) {
    c.index_cache.ptr<uint16_t>()[at] = bf16_bits;
  } else {
    c.index_cache.ptr<uint8_t>()[at] = fp8_bits;
  }
}

// Element (kv 0 = K, 1 = V) of token `pos` of request `req`, KV head `head`, dimension `dim`.
int64_t kv_element(const SyntheticCase& c, int req, int64_t pos, int head, int kv, int dim) {
  const int64_t cols = c.kv_block_table.shape()[1];
  const SparseConfig& cfg = c.config;
  const int32_t page = c.kv_block_table.ptr<int32_t>()[req * cols + pos / cfg.block_size];
  return (((int64_t{page} * cfg.kv_heads + head) * 2 + kv) * cfg.block_size +
          pos % cfg.block_size) *
             cfg.head_dim +
         dim;
}

void set_kv(SyntheticCase& c, int64_t at, uint16_t bf16_bits, uint8_t fp8_bits) {
  if (c.kv_cache.dtype() == DType::kBF16) {
    c.kv_cache.ptr<uint16_t>()[at] = bf16_bits;
  } else {
    c.kv_cache.ptr<uint8_t>()[at] = fp8_bits;
  }
}

// ---- Index queries and keys ----

TEST(HostileGpu, NanAndInfInIndexQueriesAndKeysMatchCpu) {
  M3MSA_INDEXER_REQUIRE_GPU();
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    SyntheticSpec spec = decode_spec(4, 2, 0, 0, dtype, 0, 301);
    spec.seq_lens = {40 * 128 + 5, 7 * 128, 300, 3000 * 128 + 77};
    SyntheticCase c = make_synthetic_case(spec);
    const int D = c.config.index_dim;
    // Request 0: NaN keys in blocks 1 and 5; +inf (fp8: +448) in block 8; -inf in block 12.
    set_index(c, index_element(c, 0, 1 * 128 + 3, 9), kBf16Nan, kFp8Nan);
    set_index(c, index_element(c, 0, 5 * 128 + 100, 0), kBf16Nan, kFp8Nan);
    set_index(c, index_element(c, 0, 8 * 128 + 64, 17), kBf16PosInf, kFp8Max);
    set_index(c, index_element(c, 0, 12 * 128 + 1, 17), kBf16NegInf, kFp8NegMax);
    // Request 1: every key of block 3 NaN.
    for (int t = 0; t < 128; ++t) {
      for (int d = 0; d < D; ++d)
        set_index(c, index_element(c, 1, 3 * 128 + t, d), kBf16Nan, kFp8Nan);
    }
    // Request 3 (3000 blocks, several CTAs and the merge): infinities in far-apart blocks.
    for (int64_t b : {7, 900, 1999, 2998}) {
      set_index(c, index_element(c, 3, b * 128 + 5, 3), kBf16PosInf, kFp8Max);
    }
    // Queries: row 2 (request 1) head 1 has a NaN; row 4 head 0 has +inf in the dimension the
    // +inf keys use (inf * key); row 5 head 2 is zero except +inf in dimension 17 (inf * 0 where
    // a key is 0 gives NaN); row 7 head 3 has -inf.
    uint16_t* q = c.index_q.ptr<uint16_t>();
    auto qat = [&](int64_t row, int head, int dim) -> uint16_t& {
      return q[(row * c.config.index_heads + head) * D + dim];
    };
    qat(2, 1, 5) = kBf16Nan;
    qat(4, 0, 3) = kBf16PosInf;
    for (int d = 0; d < D; ++d) qat(5, 2, d) = 0;
    qat(5, 2, 17) = kBf16PosInf;
    qat(7, 3, 3) = kBf16NegInf;
    expect_selection_matches_cpu(c, gpu_select(c),
                                 std::string("NaN/inf queries and keys, ") + dtype_name(dtype));
  }
}

TEST(HostileGpu, AllNanIndexCacheKeepsAFullPrefix) {
  M3MSA_INDEXER_REQUIRE_GPU();
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    for (int q_len : {1, 3}) {
      SyntheticSpec spec = decode_spec(5, q_len, 0, 0, dtype, 1, 302 + q_len);
      spec.config.init_blocks = 1;
      spec.config.local_blocks = 2;
      spec.seq_lens = {3, 129, 2000, 128 * 1500 + 7, 0};
      SyntheticCase c = make_synthetic_case(spec);
      if (dtype == DType::kBF16) {
        uint16_t* p = c.index_cache.ptr<uint16_t>();
        for (int64_t i = 0; i < c.index_cache.numel(); ++i) p[i] = kBf16Nan;
      } else {
        c.index_cache.fill_bytes(kFp8Nan);
      }
      const HostTensor gpu = gpu_select(c);
      const CpuResult cpu = run_cpu(c);
      EXPECT_TRUE(attntest::bitwise_equal(gpu, cpu.topk))
          << "all-NaN cache, " << dtype_name(dtype) << " q_len " << q_len
          << ": the GPU list differs from the CPU's (forced blocks, then the lowest ids)";
      // And it is a full prefix: min(k, nb) valid ids in every live list.
      const std::vector<RowPosition> rows = row_positions(c.batch);
      const int k = c.config.topk;
      for (std::size_t row = 0; row < rows.size(); ++row) {
        const int64_t nb = visible_blocks(rows[row].pos, c.config.block_size);
        for (int h = 0; h < c.config.index_heads; ++h) {
          const int32_t* g =
              gpu.ptr<int32_t>() + (static_cast<int64_t>(row) * c.config.index_heads + h) * k;
          for (int i = 0; i < k; ++i) {
            EXPECT_EQ(g[i] >= 0, i < std::min<int64_t>(k, nb)) << "row " << row << " entry " << i;
          }
        }
      }
    }
  }
}

TEST(HostileGpu, AllEqualScoresPickForcedThenLowestIds) {
  M3MSA_INDEXER_REQUIRE_GPU();
  struct Forced {
    int topk, init_blocks, local_blocks;
  };
  for (const Forced& f : {Forced{16, 0, 1}, Forced{8, 1, 2}, Forced{32, 2, 1}}) {
    for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
      SyntheticSpec spec = decode_spec(4, 2, 0, 0, dtype, 0, 303, f.topk);
      spec.config.init_blocks = f.init_blocks;
      spec.config.local_blocks = f.local_blocks;
      spec.seq_lens = {2, 130, 128 * 40 + 9, 128 * 2500};  // the last one spans many CTAs
      SyntheticCase c = make_synthetic_case(spec);
      c.index_cache.fill_bytes(dtype == DType::kBF16 ? 0x3C : 0x38);  // one value everywhere
      const HostTensor gpu = gpu_select(c);
      const CpuResult cpu = run_cpu(c);
      EXPECT_TRUE(attntest::bitwise_equal(gpu, cpu.topk))
          << "all-equal scores, k " << f.topk << " init " << f.init_blocks << " local "
          << f.local_blocks << " " << dtype_name(dtype);
      // Spot check the rule itself on request 3 row 1 head 0: forced, then 0, 1, 2, ...
      const int64_t nb = 2500;
      const int32_t* g = gpu.ptr<int32_t>() + (7 * c.config.index_heads + 0) * f.topk;
      std::vector<int32_t> want;
      for (int b = 0; b < f.init_blocks; ++b) want.push_back(b);
      for (int64_t b = nb - f.local_blocks; b < nb; ++b) want.push_back(static_cast<int32_t>(b));
      for (int32_t b = f.init_blocks; static_cast<int>(want.size()) < f.topk; ++b)
        want.push_back(b);
      std::set<int32_t> forced(want.begin(), want.begin() + f.init_blocks + f.local_blocks);
      for (int i = 0; i < f.topk; ++i) {
        if (i < f.init_blocks + f.local_blocks) {
          EXPECT_TRUE(forced.count(g[i])) << "entry " << i << " = " << g[i] << " not forced";
        } else {
          EXPECT_EQ(g[i], want[static_cast<std::size_t>(i)]) << "entry " << i;
        }
      }
    }
  }
}

// ---- KV cache and queries inside and outside the selection ----

SyntheticCase attention_case(DType kv, int q_len, const std::vector<int64_t>& seq_lens,
                             uint64_t seed) {
  SyntheticSpec spec;
  spec.num_reqs = static_cast<int>(seq_lens.size());
  spec.q_len = q_len;
  spec.seq_lens = seq_lens;
  spec.kv_dtype = kv;
  spec.index_dtype = DType::kBF16;
  spec.k_scale = kv == DType::kFP8E4M3 ? 0.5f : 1.0f;
  spec.v_scale = kv == DType::kFP8E4M3 ? 2.0f : 1.0f;
  spec.seed = seed;
  return make_synthetic_case(spec);
}

TEST(HostileGpu, NanAndInfInsideSelectedBlocksFollowIeee) {
  M3MSA_REQUIRE_GPU();
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    SyntheticCase c = attention_case(kv, 1, {3000, 1000, 700, 129}, 304);
    const HostTensor topk = run_cpu(c).topk;  // selection on the clean case
    const SparseConfig& cfg = c.config;
    // Each poisoned token is in the request's own block, which every selection holds.
    const int64_t own0 = 3000 - 2, own1 = 1000 - 3, own2 = 700 - 1, own3 = 129 - 1;
    set_kv(c, kv_element(c, 0, own0, 0, 0, 11), kBf16Nan, kFp8Nan);  // NaN in K: head group 0 NaN
    set_kv(c, kv_element(c, 1, own1, 1, 1, 7), kBf16Nan, kFp8Nan);   // NaN in V: element 7 NaN
    if (kv == DType::kBF16) {
      // +inf in K dimension 5 of KV head 2: q[5] > 0 -> +inf logit -> NaN; < 0 -> weight 0.
      set_kv(c, kv_element(c, 2, own2, 2, 0, 5), kBf16PosInf, 0);
    } else {
      set_kv(c, kv_element(c, 2, own2, 2, 0, 5), 0, kFp8Max);  // saturated key, finite
    }
    // NaN in q of head 3 of row 3: that head's outputs NaN, the rest of its group unchanged.
    c.q.ptr<uint16_t>()[(3 * cfg.q_heads + 3) * cfg.head_dim + 40] = kBf16Nan;
    (void)own3;
    const HostTensor gpu = gpu_attention(c, topk);
    const HostTensor ref = cpu_attention(c, topk);
    const attntest::CompareResult cmp = attntest::compare_bf16(gpu, ref);
    EXPECT_TRUE(cmp.ok) << dtype_name(kv) << ": " << cmp.bad << " elements differ (NaN positions "
                        << "must match); worst " << cmp.worst;
    int64_t nans = 0;
    for (int64_t i = 0; i < ref.numel(); ++i)
      nans += std::isnan(bf16_to_float(ref.ptr<uint16_t>()[i]));
    EXPECT_GT(nans, 0) << "the poison reached no output: the test is not testing";
    std::printf("  [%s] %lld NaN outputs in the reference, GPU worst %.3f x tol\n", dtype_name(kv),
                static_cast<long long>(nans), cmp.worst_ratio);
  }
}

// NaN and inf where no row may look: cache tokens after each sequence (the own block's tail),
// blocks no list selected, pages no table uses. Selection and attention must equal the clean
// run's bit for bit: a kernel that loads a whole block and masks by multiplying with a zero
// weight turns NaN * 0 into NaN and fails here.
TEST(HostileGpu, NanAndInfWhereNothingMayReadChangeNothing) {
  M3MSA_INDEXER_REQUIRE_GPU();
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    for (int q_len : {1, 4}) {
      SyntheticSpec spec;
      spec.num_reqs = 4;
      spec.q_len = q_len;
      spec.seq_lens = {3000 + 5, 128 * 20, 129, 4};
      spec.kv_dtype = dtype;
      spec.index_dtype = dtype;
      spec.seed = 305 + q_len;
      const SyntheticCase clean = make_synthetic_case(spec);
      const HostTensor clean_topk = gpu_select(clean);
      const HostTensor clean_out = gpu_attention(clean, clean_topk);

      SyntheticCase dirty = clean;  // shares the metadata; the caches are copied below
      dirty.index_cache = clone_tensor(clean.index_cache);
      dirty.kv_cache = clone_tensor(clean.kv_cache);
      const SparseConfig& cfg = clean.config;
      const int bs = cfg.block_size;
      // Pages some selected list reads (kv) or some visible token lives on (index).
      std::set<int32_t> kv_needed, index_needed;
      const std::vector<RowPosition> rows = row_positions(clean.batch);
      const int64_t cols = clean.kv_block_table.shape()[1];
      const int64_t icols = clean.index_block_table.shape()[1];
      for (std::size_t row = 0; row < rows.size(); ++row) {
        if (rows[row].pos < 0) continue;
        const int req = rows[row].req;
        for (int h = 0; h < cfg.kv_heads; ++h) {
          for (int i = 0; i < cfg.topk; ++i) {
            const int32_t b =
                clean_topk
                    .ptr<int32_t>()[(static_cast<int64_t>(row) * cfg.kv_heads + h) * cfg.topk + i];
            if (b >= 0) kv_needed.insert(clean.kv_block_table.ptr<int32_t>()[req * cols + b]);
          }
        }
        for (int64_t b = 0; b < visible_blocks(rows[row].pos, bs); ++b) {
          index_needed.insert(clean.index_block_table.ptr<int32_t>()[req * icols + b]);
        }
      }
      auto poison = [&](HostTensor& cache, int64_t from, int64_t count, int64_t i) {
        // Alternate NaN and +inf (fp8: NaN and the saturated maximum).
        for (int64_t e = from; e < from + count; ++e) {
          if (cache.dtype() == DType::kBF16) {
            cache.ptr<uint16_t>()[e] = (e + i) % 2 ? kBf16Nan : kBf16PosInf;
          } else {
            cache.ptr<uint8_t>()[e] = (e + i) % 2 ? kFp8Nan : kFp8Max;
          }
        }
      };
      const int64_t index_page = int64_t{bs} * cfg.index_dim;
      const int64_t kv_token = cfg.head_dim;
      const int64_t kv_page = int64_t{cfg.kv_heads} * 2 * bs * cfg.head_dim;
      int64_t poisoned_pages = 0;
      for (int64_t p = 0; p < clean.index_cache.shape()[0]; ++p) {
        if (!index_needed.count(static_cast<int32_t>(p))) {
          poison(dirty.index_cache, p * index_page, index_page, p);
          ++poisoned_pages;
        }
      }
      for (int64_t p = 0; p < clean.kv_cache.shape()[0]; ++p) {
        if (!kv_needed.count(static_cast<int32_t>(p))) {
          poison(dirty.kv_cache, p * kv_page, kv_page, p);
          ++poisoned_pages;
        }
      }
      // The tail of each live request's last block, after its last token.
      for (int req = 0; req < spec.num_reqs; ++req) {
        const int64_t len = clean.seq_lens.ptr<int32_t>()[req];
        if (len % bs == 0) continue;
        const int64_t last = (len - 1) / bs;
        const int32_t ipage = clean.index_block_table.ptr<int32_t>()[req * icols + last];
        poison(dirty.index_cache, (int64_t{ipage} * bs + len % bs) * cfg.index_dim,
               (bs - len % bs) * cfg.index_dim, req);
        const int32_t kpage = clean.kv_block_table.ptr<int32_t>()[req * cols + last];
        for (int h = 0; h < cfg.kv_heads; ++h) {
          for (int kv = 0; kv < 2; ++kv) {
            poison(dirty.kv_cache,
                   (((int64_t{kpage} * cfg.kv_heads + h) * 2 + kv) * bs + len % bs) * kv_token,
                   (bs - len % bs) * kv_token, req + h);
          }
        }
      }
      const HostTensor dirty_topk = gpu_select(dirty);
      const HostTensor dirty_out = gpu_attention(dirty, clean_topk);
      EXPECT_TRUE(attntest::bitwise_equal(clean_topk, dirty_topk))
          << dtype_name(dtype) << " q_len " << q_len
          << ": the selection changed when only unreachable cache bytes did";
      EXPECT_TRUE(attntest::bitwise_equal(clean_out, dirty_out))
          << dtype_name(dtype) << " q_len " << q_len
          << ": attention changed when only unreachable cache bytes did";
      // The CPU reference agrees on the dirty case too.
      expect_selection_matches_cpu(dirty, dirty_topk,
                                   std::string("unreachable poison, ") + dtype_name(dtype));
      const attntest::CompareResult cmp =
          attntest::compare_bf16(dirty_out, cpu_attention(dirty, clean_topk));
      EXPECT_TRUE(cmp.ok) << cmp.worst;
      std::printf("  [%s q_len %d] %lld pages and every sequence tail poisoned\n",
                  dtype_name(dtype), q_len, static_cast<long long>(poisoned_pages));
    }
  }
}

// ---- fp8 saturation of the cache insert ----

// Counts fp8 bytes that differ between the GPU and the CPU cache; every difference must be one
// code (cos / sin of the RoPE angle come from two libms, see preprocess_kernel_test.cc) and rare.
void expect_fp8_close(const HostTensor& gpu, const HostTensor& cpu, const std::string& what) {
  ASSERT_EQ(gpu.nbytes(), cpu.nbytes());
  const uint8_t* g = gpu.ptr<uint8_t>();
  const uint8_t* r = cpu.ptr<uint8_t>();
  int64_t differ = 0, far = 0;
  for (int64_t i = 0; i < gpu.numel(); ++i) {
    if (g[i] == r[i]) continue;
    ++differ;
    const bool same_sign = (g[i] & 0x80) == (r[i] & 0x80);
    const int step = std::abs(static_cast<int>(g[i] & 0x7F) - static_cast<int>(r[i] & 0x7F));
    if (!same_sign || step > 1 || (g[i] & 0x7F) == 0x7F || (r[i] & 0x7F) == 0x7F) ++far;
  }
  EXPECT_EQ(far, 0) << what << ": " << far << " bytes differ by more than one code (or in NaN)";
  EXPECT_LE(differ, std::max<int64_t>(2, gpu.numel() / 10000)) << what;
}

TEST(HostileGpu, Fp8SaturationOfTheCacheInsertMatchesCpu) {
  M3MSA_REQUIRE_GPU();
  SyntheticSpec spec;
  spec.num_reqs = 6;
  spec.q_len = 2;
  spec.seq_lens = {5, 130, 700, 2, 0, 4000};
  spec.kv_dtype = DType::kFP8E4M3;
  spec.index_dtype = DType::kFP8E4M3;
  for (const auto& [k_scale, v_scale] : {std::pair{0.5f, 4.0f}, std::pair{4.0f, 0.5f}}) {
    spec.k_scale = k_scale;
    spec.v_scale = v_scale;
    spec.seed = 306;
    const SyntheticCase c = make_synthetic_case(spec);
    const SparseConfig& cfg = c.config;
    const int64_t rows = c.num_rows();
    // qkv: q, k, index_q, index_k of unit scale, V of +-1000; k and index_k norm weights of 999
    // make the normed keys ~1000 too. After dividing by the scale every one of them is far
    // beyond 448: the stored byte must be +-448, never NaN.
    HostTensor qkv(DType::kBF16, {rows, cfg.qkv_width()});
    attntest::Rng rng(307);
    const int64_t v_begin = int64_t{cfg.q_heads + cfg.kv_heads} * cfg.head_dim;
    const int64_t v_end = v_begin + int64_t{cfg.kv_heads} * cfg.head_dim;
    for (int64_t row = 0; row < rows; ++row) {
      for (int64_t i = 0; i < cfg.qkv_width(); ++i) {
        const float u = static_cast<float>(rng.uniform(-1.0, 1.0));
        const bool v = i >= v_begin && i < v_end;
        qkv.ptr<uint16_t>()[row * cfg.qkv_width() + i] =
            float_to_bf16(v ? (u < 0 ? -1000.0f : 1000.0f) * (0.5f + std::fabs(u)) : u);
      }
    }
    auto weights = [](int n, float value) {
      HostTensor w(DType::kBF16, {n});
      for (int i = 0; i < n; ++i) w.ptr<uint16_t>()[i] = float_to_bf16(value);
      return w;
    };
    const HostTensor q_norm = weights(cfg.head_dim, 0.5f);
    const HostTensor k_norm = weights(cfg.head_dim, 999.0f);
    const HostTensor iq_norm = weights(cfg.index_dim, 0.5f);
    const HostTensor ik_norm = weights(cfg.index_dim, 999.0f);

    // CPU.
    HostTensor cpu_kv = clone_tensor(c.kv_cache), cpu_index = clone_tensor(c.index_cache);
    HostTensor cpu_q(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
    HostTensor cpu_iq(DType::kBF16, {rows, cfg.index_heads, cfg.index_dim});
    PreprocessArgs a;
    a.qkv = qkv.view();
    a.q_norm = q_norm.view();
    a.k_norm = k_norm.view();
    a.index_q_norm = iq_norm.view();
    a.index_k_norm = ik_norm.view();
    a.positions = c.positions.view();
    a.batch = c.batch;
    a.kv_cache = {cpu_kv.view(), c.k_scale, c.v_scale};
    a.index_cache = {cpu_index.view()};
    a.q_out = cpu_q.view();
    a.index_q_out = cpu_iq.view();
    cpu::preprocess(cfg, a);

    // GPU, through the backend.
    DeviceCase d = upload(c);
    DeviceTensor d_qkv = to_device(qkv), d_qn = to_device(q_norm), d_kn = to_device(k_norm),
                 d_iqn = to_device(iq_norm), d_ikn = to_device(ik_norm);
    DeviceTensor d_q(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
    DeviceTensor d_iq(DType::kBF16, {rows, cfg.index_heads, cfg.index_dim});
    PreprocessArgs g = a;
    g.qkv = d_qkv.view();
    g.q_norm = d_qn.view();
    g.k_norm = d_kn.view();
    g.index_q_norm = d_iqn.view();
    g.index_k_norm = d_ikn.view();
    g.positions = d.positions.view();
    g.batch = d.batch;
    g.kv_cache = d.kv_cache_view();
    g.index_cache = d.index_cache_view();
    g.q_out = d_q.view();
    g.index_q_out = d_iq.view();
    std::unique_ptr<CudaBackend> backend = make_cuda_backend(0);
    backend->preprocess(cfg, g);
    backend->synchronize();
    HostTensor gpu_kv, gpu_index;
    copy_to_host(d.kv_cache.view(), gpu_kv);
    copy_to_host(d.index_cache.view(), gpu_index);

    const std::string what =
        "k_scale " + std::to_string(k_scale) + " v_scale " + std::to_string(v_scale);
    expect_fp8_close(gpu_kv, cpu_kv, what + " kv_cache");
    expect_fp8_close(gpu_index, cpu_index, what + " index_cache");
    // Saturation happened, and no written slot became NaN.
    int64_t saturated = 0, nan_written = 0;
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t slot = c.slot_mapping.ptr<int64_t>()[row];
      if (slot < 0) continue;
      const int64_t page = slot / cfg.block_size, off = slot % cfg.block_size;
      for (int h = 0; h < cfg.kv_heads; ++h) {
        for (int kv = 0; kv < 2; ++kv) {
          const uint8_t* e =
              gpu_kv.ptr<uint8_t>() +
              (((page * cfg.kv_heads + h) * 2 + kv) * cfg.block_size + off) * cfg.head_dim;
          for (int dd = 0; dd < cfg.head_dim; ++dd) {
            saturated += (e[dd] & 0x7F) == kFp8Max;
            nan_written += (e[dd] & 0x7F) == kFp8Nan;
          }
        }
      }
    }
    EXPECT_GT(saturated, 0) << what << ": nothing saturated: the test is not testing";
    EXPECT_EQ(nan_written, 0) << what << ": a saturating insert wrote NaN";
    std::printf("  [%s] %lld saturated fp8 elements in written KV slots, 0 NaN\n", what.c_str(),
                static_cast<long long>(saturated));
  }
}

// ---- Contexts around one block ----

TEST(HostileGpu, ContextsAroundOneBlockSelectionAndAttention) {
  M3MSA_INDEXER_REQUIRE_GPU();
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    for (int q_len : {1, 4}) {
      SyntheticSpec spec;
      spec.num_reqs = 4;
      spec.q_len = q_len;
      spec.seq_lens = {q_len == 1 ? 1 : 4, 127, 128, 129};
      spec.index_dtype = dtype;
      spec.kv_dtype = dtype;
      spec.seed = 308 + q_len;
      const SyntheticCase c = make_synthetic_case(spec);
      const HostTensor gpu_topk = gpu_select(c);
      const CpuResult cpu = run_cpu(c);
      // nb <= 2 everywhere: every visible block is selected, own block first, then block 0.
      EXPECT_TRUE(attntest::bitwise_equal(gpu_topk, cpu.topk))
          << dtype_name(dtype) << " q_len " << q_len;
      const std::vector<RowPosition> rows = row_positions(c.batch);
      for (std::size_t row = 0; row < rows.size(); ++row) {
        const int32_t* g = gpu_topk.ptr<int32_t>() + row * c.config.index_heads * c.config.topk;
        if (rows[row].pos < 128) {
          EXPECT_EQ(g[0], 0) << "row " << row;
          EXPECT_EQ(g[1], -1) << "row " << row;
        } else {
          EXPECT_EQ(g[0], 1) << "row " << row;
          EXPECT_EQ(g[1], 0) << "row " << row;
        }
      }
      const HostTensor gpu_out = gpu_attention(c, gpu_topk);
      const attntest::CompareResult sparse =
          attntest::compare_bf16(gpu_out, cpu_attention(c, cpu.topk));
      EXPECT_TRUE(sparse.ok) << dtype_name(dtype) << " q_len " << q_len << ": " << sparse.worst;
      const attntest::CompareResult dense =
          attntest::compare_bf16(gpu_out, cpu_attention(c, cpu.topk, /*dense=*/true));
      EXPECT_TRUE(dense.ok) << dtype_name(dtype) << " q_len " << q_len
                            << " vs dense: " << dense.worst;
    }
  }
}

// ---- The block-id limit ----

// One decode request of `seq_len` tokens whose table has `columns` columns cycling over `pages`
// pages; bf16 index cache and KV cache of `pages` random pages.
struct LimitCase {
  SparseConfig config;
  HostTensor seq_lens, table, index_q, q, index_cache, kv_cache;
  BatchMeta batch;
  LimitCase(int64_t seq_len, int64_t columns, int pages) {
    const SparseConfig& cfg = config;
    seq_lens = HostTensor(DType::kI32, {1});
    seq_lens.ptr<int32_t>()[0] = static_cast<int32_t>(seq_len);
    table = HostTensor(DType::kI32, {1, columns});
    for (int64_t b = 0; b < columns; ++b) table.ptr<int32_t>()[b] = static_cast<int32_t>(b % pages);
    attntest::Rng rng(309);
    auto fill = [&rng](HostTensor& t) {
      for (int64_t i = 0; i < t.numel(); ++i) {
        t.ptr<uint16_t>()[i] = float_to_bf16(static_cast<float>(rng.uniform(-1.7, 1.7)));
      }
    };
    index_q = HostTensor(DType::kBF16, {1, cfg.index_heads, cfg.index_dim});
    q = HostTensor(DType::kBF16, {1, cfg.q_heads, cfg.head_dim});
    index_cache = HostTensor(DType::kBF16, {pages, cfg.block_size, cfg.index_dim});
    kv_cache = HostTensor(DType::kBF16, {pages, cfg.kv_heads, 2, cfg.block_size, cfg.head_dim});
    fill(index_q);
    fill(q);
    fill(index_cache);
    fill(kv_cache);
    batch.kind = BatchKind::kDecode;
    batch.num_reqs = 1;
    batch.q_len = 1;
    batch.seq_lens = seq_lens.view();
    batch.index_block_table = table.view();
    batch.kv_block_table = table.view();
  }
};

struct DeviceLimitCase {
  DeviceTensor seq_lens, table, index_q, q, index_cache, kv_cache;
  BatchMeta batch;
  explicit DeviceLimitCase(const LimitCase& h)
      : seq_lens(to_device(h.seq_lens)),
        table(to_device(h.table)),
        index_q(to_device(h.index_q)),
        q(to_device(h.q)),
        index_cache(to_device(h.index_cache)),
        kv_cache(to_device(h.kv_cache)) {
    batch = h.batch;
    batch.seq_lens = seq_lens.view();
    batch.index_block_table = table.view();
    batch.kv_block_table = table.view();
  }
  IndexerArgs indexer_args(const TensorView& topk) const {
    return {index_q.view(), {index_cache.view()}, batch, topk};
  }
  AttentionArgs attention_args(const TensorView& topk, const TensorView& out) const {
    return {q.view(), {kv_cache.view(), 1.0f, 1.0f}, batch, topk, out};
  }
};

constexpr int64_t kBlockLimit = (int64_t{1} << 24) - 1;  // blocks per sequence: ids 0 .. 2^24 - 2

TEST(HostileGpu, BlockIdLimitOnTheGpu) {
  M3MSA_REQUIRE_GPU();
  const SparseConfig cfg;
  const int64_t limit_tokens = kBlockLimit * cfg.block_size;  // 2^31 - 128: fits int32
  std::unique_ptr<CudaBackend> backend = make_cuda_backend(0);
  PlanLimits limits;  // max_context 0: the decode workspaces do not depend on it
  backend->plan(cfg, limits);

  // One token more than the limit: refused by the indexer and by attention, naming seq_lens.
  {
    const LimitCase h(limit_tokens + 1, kBlockLimit + 1, 4);
    const DeviceLimitCase d(h);
    DeviceTensor topk(DType::kI32, {1, cfg.index_heads, cfg.topk});
    DeviceTensor out(DType::kBF16, {1, cfg.q_heads, cfg.head_dim});
    expect_error([&] { backend->select_topk(cfg, d.indexer_args(topk.view())); },
                 ErrorCode::kInvalidArgument, "batch.seq_lens[0]");
    fill_device_bytes(topk.view(), 0);
    expect_error([&] { backend->sparse_attention(cfg, d.attention_args(topk.view(), out.view())); },
                 ErrorCode::kInvalidArgument, "batch.seq_lens[0]");
  }

  // At the limit: attention over blocks near 2^24 (positions near 2^31) equals the CPU's. The
  // table cycles over 4 pages, so the selected blocks differ in content.
  const LimitCase h(limit_tokens, kBlockLimit, 4);
  const DeviceLimitCase d(h);
  HostTensor selection(DType::kI32, {1, cfg.kv_heads, cfg.topk});
  for (int kvh = 0; kvh < cfg.kv_heads; ++kvh) {
    const int32_t last = static_cast<int32_t>(kBlockLimit - 1);  // 2^24 - 2, the own block
    const std::vector<int32_t> ids = {last,           0, last - 1,      1 << 23,
                                      last - 2 - kvh, 7, (1 << 24) - 9, 123456 + kvh};
    int32_t* e = selection.ptr<int32_t>() + kvh * cfg.topk;
    for (int i = 0; i < cfg.topk; ++i) e[i] = i < static_cast<int>(ids.size()) ? ids[i] : -1;
  }
  DeviceTensor topk = to_device(selection);
  DeviceTensor out(DType::kBF16, {1, cfg.q_heads, cfg.head_dim});
  fill_device_bytes(out.view(), 0xFF);
  backend->sparse_attention(cfg, d.attention_args(topk.view(), out.view()));
  backend->synchronize();
  HostTensor gpu_out;
  copy_to_host(out.view(), gpu_out);
  HostTensor cpu_out(DType::kBF16, {1, cfg.q_heads, cfg.head_dim});
  AttentionArgs ca{
      h.q.view(), {h.kv_cache.view(), 1.0f, 1.0f}, h.batch, selection.view(), cpu_out.view()};
  cpu::sparse_attention(cfg, ca);
  const attntest::CompareResult cmp = attntest::compare_bf16(gpu_out, cpu_out);
  EXPECT_TRUE(cmp.ok) << "attention at the block-id limit: " << cmp.worst;

  // Scoring every one of the 2^24 - 1 blocks (opt-in: tens of seconds). All pages equal, so all
  // scores tie: the own block (forced) then ids 0, 1, 2, ...
  const char* full = std::getenv("M3MSA_TEST_FULL_LIMIT");
  if (full == nullptr || full[0] == '\0' || full[0] == '0') {
    std::printf("  indexer over all 2^24 - 1 blocks not run (set M3MSA_TEST_FULL_LIMIT=1)\n");
    return;
  }
  LimitCase same(limit_tokens, kBlockLimit, 1);
  const DeviceLimitCase ds(same);
  DeviceTensor sel(DType::kI32, {1, cfg.index_heads, cfg.topk});
  fill_device_bytes(sel.view(), kPoisonByte);
  const auto start = std::chrono::steady_clock::now();
  backend->select_topk(cfg, ds.indexer_args(sel.view()));
  backend->synchronize();
  std::printf("  indexer over 2^24 - 1 blocks: %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  EXPECT_EQ(backend->indexer_device_status(true), 0u);
  HostTensor got;
  copy_to_host(sel.view(), got);
  for (int hh = 0; hh < cfg.index_heads; ++hh) {
    const int32_t* g = got.ptr<int32_t>() + hh * cfg.topk;
    EXPECT_EQ(g[0], static_cast<int32_t>(kBlockLimit - 1)) << "head " << hh;
    for (int i = 1; i < cfg.topk; ++i) EXPECT_EQ(g[i], i - 1) << "head " << hh << " entry " << i;
  }
}

}  // namespace
}  // namespace m3msa
