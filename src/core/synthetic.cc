#include "m3msa/synthetic.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <thread>

#include "m3msa/error.h"
#include "m3msa/testing/splitmix.h"

namespace m3msa {

namespace {

// Seedable per element range, so fills are deterministic under any threading.
using Rng = testkit::SplitMix64;

uint64_t mix(uint64_t seed, uint64_t stream) {
  return Rng(seed ^ (stream * 0xD1B54A32D192ED03ull)).next();
}

// Fills `count` elements of bf16 or fp8 with unit-variance values times `scale`, in parallel
// chunks each seeded by its index.
void fill_random(void* data, DType dtype, int64_t count, float scale, uint64_t seed) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (count + kChunk - 1) / kChunk;
  auto work = [&](int64_t first_chunk, int64_t step) {
    for (int64_t c = first_chunk; c < chunks; c += step) {
      Rng rng(mix(seed, static_cast<uint64_t>(c)));
      const int64_t end = std::min(count, (c + 1) * kChunk);
      for (int64_t i = c * kChunk; i < end; ++i) {
        const float value = rng.unit_variance() * scale;
        if (dtype == DType::kBF16) {
          static_cast<uint16_t*>(data)[i] = float_to_bf16(value);
        } else {
          static_cast<uint8_t*>(data)[i] = float_to_fp8e4m3(value);
        }
      }
    }
  };
  const int threads = static_cast<int>(
      std::min<int64_t>(chunks, std::max(1u, std::thread::hardware_concurrency())));
  if (threads <= 1) {
    work(0, 1);
    return;
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(work, t, threads);
  for (auto& thread : pool) thread.join();
}

}  // namespace

IndexerArgs SyntheticCase::indexer_args(const TensorView& topk_idx) const {
  IndexerArgs args;
  args.index_q = index_q.view();
  args.index_cache = index_cache_view();
  args.batch = batch;
  args.topk_idx = topk_idx;
  return args;
}

AttentionArgs SyntheticCase::attention_args(const TensorView& topk_idx,
                                            const TensorView& out) const {
  AttentionArgs args;
  args.q = q.view();
  args.kv_cache = kv_cache_view();
  args.batch = batch;
  args.topk_idx = topk_idx;
  args.out = out;
  return args;
}

SyntheticCase make_synthetic_case(const SyntheticSpec& spec) {
  spec.config.validate();
  const SparseConfig& cfg = spec.config;
  M3MSA_CHECK_ARG(spec.num_reqs >= 0, "spec.num_reqs must be >= 0, got ", spec.num_reqs);
  M3MSA_CHECK_ARG(spec.min_context >= 0 && spec.min_context <= spec.max_context,
                  "spec.min_context/max_context: need 0 <= min <= max, got ", spec.min_context,
                  " and ", spec.max_context);
  M3MSA_CHECK_ARG(spec.index_dtype == DType::kBF16 || spec.index_dtype == DType::kFP8E4M3,
                  "spec.index_dtype must be bf16 or fp8, got ", dtype_name(spec.index_dtype));
  M3MSA_CHECK_ARG(spec.kv_dtype == DType::kBF16 || spec.kv_dtype == DType::kFP8E4M3,
                  "spec.kv_dtype must be bf16 or fp8, got ", dtype_name(spec.kv_dtype));
  Rng rng(spec.seed);
  const int reqs = spec.num_reqs;
  const int bs = cfg.block_size;

  SyntheticCase c;
  c.config = cfg;
  c.k_scale = spec.k_scale;
  c.v_scale = spec.v_scale;
  c.batch.kind = spec.kind;
  c.batch.num_reqs = reqs;
  c.batch.q_len = spec.q_len;

  // Per request: first position of its new tokens and how many there are.
  std::vector<int64_t> first_new(reqs), new_tokens(reqs), end(reqs);
  if (spec.kind == BatchKind::kDecode) {
    M3MSA_CHECK_ARG(spec.q_len >= 1 && spec.q_len <= kMaxQueryLen, "spec.q_len must be in [1, ",
                    kMaxQueryLen, "], got ", spec.q_len);
    M3MSA_CHECK_ARG(spec.seq_lens.empty() || static_cast<int>(spec.seq_lens.size()) == reqs,
                    "spec.seq_lens has ", spec.seq_lens.size(), " entries for ", reqs, " requests");
    M3MSA_CHECK_ARG(spec.padding_reqs >= 0 && spec.padding_reqs <= reqs,
                    "spec.padding_reqs must be in [0, num_reqs], got ", spec.padding_reqs);
    c.seq_lens = HostTensor(DType::kI32, {reqs});
    for (int r = 0; r < reqs; ++r) {
      int64_t len = spec.seq_lens.empty()
                        ? rng.range(std::max<int64_t>(spec.min_context, spec.q_len),
                                    std::max<int64_t>(spec.max_context, spec.q_len))
                        : spec.seq_lens[r];
      if (r >= reqs - spec.padding_reqs) len = 0;
      M3MSA_CHECK_ARG(len == 0 || len >= spec.q_len, "spec.seq_lens[", r, "] = ", len,
                      " must be 0 or >= q_len");
      M3MSA_CHECK_ARG(len <= INT32_MAX, "spec.seq_lens[", r, "] = ", len, " does not fit i32");
      c.seq_lens.ptr<int32_t>()[r] = static_cast<int32_t>(len);
      end[r] = len;
      new_tokens[r] = len == 0 ? 0 : spec.q_len;
      first_new[r] = len - new_tokens[r];
    }
  } else {
    c.cu_seqlens_q = HostTensor(DType::kI32, {reqs + 1});
    c.context_lens = HostTensor(DType::kI32, {reqs});
    int32_t* cu = c.cu_seqlens_q.ptr<int32_t>();
    cu[0] = 0;
    for (int r = 0; r < reqs; ++r) {
      const int64_t chunk = spec.chunk_lens.empty() ? rng.range(1, 64) : spec.chunk_lens.at(r);
      const int64_t context = spec.context_lens.empty()
                                  ? rng.range(spec.min_context, spec.max_context)
                                  : spec.context_lens.at(r);
      M3MSA_CHECK_ARG(chunk >= 0 && context >= 0, "spec: negative chunk or context length");
      c.context_lens.ptr<int32_t>()[r] = static_cast<int32_t>(context);
      cu[r + 1] = static_cast<int32_t>(cu[r] + chunk);
      first_new[r] = context;
      new_tokens[r] = chunk;
      end[r] = context + chunk;
    }
    c.batch.num_tokens = cu[reqs];
  }
  const int64_t rows = c.batch.num_rows();

  // Page tables: each cache gets its own shuffled pages plus a few unused ones.
  int64_t max_blocks = 1;
  int64_t used_pages = 0;
  for (int r = 0; r < reqs; ++r) {
    const int64_t blocks = (end[r] + bs - 1) / bs;
    max_blocks = std::max(max_blocks, blocks);
    used_pages += blocks;
  }
  const int64_t pages = used_pages + spec.extra_pages;
  auto make_table = [&](HostTensor& table) {
    std::vector<int32_t> order(static_cast<std::size_t>(pages));
    std::iota(order.begin(), order.end(), 0);
    for (int64_t i = pages - 1; i > 0; --i) std::swap(order[i], order[rng.range(0, i)]);
    table = HostTensor(DType::kI32, {reqs, max_blocks});
    int32_t* data = table.ptr<int32_t>();
    std::fill(data, data + table.numel(), -1);  // unused entries: reading one is a bug
    std::size_t next = 0;
    for (int r = 0; r < reqs; ++r) {
      for (int64_t b = 0; b < (end[r] + bs - 1) / bs; ++b) data[r * max_blocks + b] = order[next++];
    }
  };
  make_table(c.index_block_table);
  make_table(c.kv_block_table);

  c.positions = HostTensor(DType::kI64, {rows});
  c.slot_mapping = HostTensor(DType::kI64, {rows});
  c.index_slot_mapping = HostTensor(DType::kI64, {rows});
  {
    int64_t row = 0;
    for (int r = 0; r < reqs; ++r) {
      const int64_t row_count = spec.kind == BatchKind::kDecode ? spec.q_len : new_tokens[r];
      for (int64_t j = 0; j < row_count; ++j, ++row) {
        const bool live = new_tokens[r] > 0;
        const int64_t pos = live ? first_new[r] + j : -1;
        c.positions.ptr<int64_t>()[row] = pos;
        auto slot = [&](const HostTensor& table) -> int64_t {
          if (!live) return -1;
          return int64_t{table.ptr<int32_t>()[r * max_blocks + pos / bs]} * bs + pos % bs;
        };
        c.slot_mapping.ptr<int64_t>()[row] = slot(c.kv_block_table);
        c.index_slot_mapping.ptr<int64_t>()[row] = slot(c.index_block_table);
      }
    }
  }

  c.index_q = HostTensor(DType::kBF16, {rows, cfg.index_heads, cfg.index_dim});
  fill_random(c.index_q.data(), DType::kBF16, c.index_q.numel(), spec.query_scale,
              mix(spec.seed, 1));
  c.q = HostTensor(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
  fill_random(c.q.data(), DType::kBF16, c.q.numel(), spec.query_scale, mix(spec.seed, 2));
  // Caches: every slot random, including the garbage after each sequence's end.
  c.index_cache =
      HostTensor(spec.index_dtype, {spec.make_index_cache ? pages : 0, bs, cfg.index_dim});
  fill_random(c.index_cache.data(), spec.index_dtype, c.index_cache.numel(), 1.0f,
              mix(spec.seed, 3));
  c.kv_cache = HostTensor(spec.kv_dtype,
                          {spec.make_kv_cache ? pages : 0, cfg.kv_heads, 2, bs, cfg.head_dim});
  // fp8 stores value / scale: draw the stored values so the read values have unit variance.
  const float kv_fill_scale =
      spec.kv_dtype == DType::kFP8E4M3 ? 1.0f / std::sqrt(spec.k_scale * spec.v_scale) : 1.0f;
  fill_random(c.kv_cache.data(), spec.kv_dtype, c.kv_cache.numel(), kv_fill_scale,
              mix(spec.seed, 4));

  c.batch.seq_lens = c.seq_lens.empty() ? TensorView{} : c.seq_lens.view();
  c.batch.cu_seqlens_q = c.cu_seqlens_q.empty() ? TensorView{} : c.cu_seqlens_q.view();
  c.batch.context_lens = c.context_lens.empty() ? TensorView{} : c.context_lens.view();
  c.batch.index_block_table = c.index_block_table.view();
  c.batch.kv_block_table = c.kv_block_table.view();
  c.batch.slot_mapping = c.slot_mapping.view();
  c.batch.index_slot_mapping = c.index_slot_mapping.view();
  return c;
}

}  // namespace m3msa
