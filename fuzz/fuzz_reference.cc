// fuzz_reference: a fuzz-chosen tiny config, decode or prefill batch, page tables and cache
// contents (any bf16 / fp8 bit pattern: NaN, inf, -0.0, subnormals, saturated values) ->
// cpu::select_topk. Checks the output contract of docs/spec.md section 4 on every accepted input:
//  - each (row, head) holds min(k, nb) valid block ids as a prefix, then -1; dead rows all -1;
//  - the ids are distinct and visible (< nb), and never -1 inside the prefix, whatever the NaNs;
//  - forced blocks come first (in ascending id order), then descending sort key recomputed from
//    cpu::score_blocks, and no unselected block has a bigger key than the last selected one;
//  - cpu::score_blocks equals an independent recomputation (fp32 dot in dimension order, max
//    over the visible tokens, NaN sticky) up to the sort-key image (so -0.0 == +0.0);
//  - shard nominations merged with cpu::top_keys give the same selection (the CP property), and
//    a two-thread run is bit-identical to a one-thread run.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "fuzz_common.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/sort_key.h"
#include "m3msa/testing/splitmix.h"

namespace m3msa::fuzz {
namespace {

// Fills what the fuzz input is too short to spell out.
using Rng = testkit::SplitMix64;

// One element's bits: raw from the input while it lasts, else drawn, with a fuzz-chosen rate of
// special values so NaN / inf / saturation show up in most runs.
struct ElementSource {
  FuzzedDataProvider& in;
  Rng rng;
  int special_rate;  // out of 64
  uint32_t next_float_bits() {
    if (in.remaining_bytes() > 4 && in.ConsumeIntegralInRange<int>(0, 3) == 0) {
      return float_bits(hostile_float(in));
    }
    const uint64_t r = rng.next();
    if (static_cast<int>(r & 63) < special_rate) {
      static constexpr uint32_t kSpecial[] = {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0x7F800000u,
                                              0xFF800000u, 0x80000000u, 0x00000000u, 0x43E00000u,
                                              0xC3E00000u, 0x7F7F0000u, 0x00010000u};
      return kSpecial[(r >> 8) % std::size(kSpecial)];
    }
    // A small value on a coarse grid, so equal scores (ties) are common.
    return float_bits(static_cast<float>(static_cast<int>((r >> 8) % 9) - 4) * 0.5f);
  }
  void fill(HostTensor& t) {
    for (int64_t i = 0; i < t.numel(); ++i) {
      const float value = bits_float(next_float_bits());
      if (t.dtype() == DType::kBF16) {
        // bf16 from a float: the raw top half, so every bf16 pattern (NaN payloads too) occurs.
        t.ptr<uint16_t>()[i] = static_cast<uint16_t>(float_bits(value) >> 16);
      } else {
        t.ptr<uint8_t>()[i] =
            (rng.next() & 7) == 0 ? static_cast<uint8_t>(rng.next()) : float_to_fp8e4m3(value);
      }
    }
  }
};

float element(const HostTensor& t, int64_t i) {
  return t.dtype() == DType::kBF16 ? bf16_to_float(t.ptr<uint16_t>()[i])
                                   : fp8e4m3_to_float(t.ptr<uint8_t>()[i]);
}

}  // namespace
}  // namespace m3msa::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace m3msa;
  using namespace m3msa::fuzz;
  FuzzedDataProvider in(data, size);

  SparseConfig c;
  c.kv_heads = c.index_heads = in.ConsumeIntegralInRange<int>(1, 3);
  c.q_heads = c.kv_heads;
  c.head_dim = 8;
  c.index_dim = in.PickValueInArray<int>({8, 16});
  c.rope_dim = 8;
  c.block_size = in.PickValueInArray<int>({1, 2, 3, 4, 8});
  c.topk = in.ConsumeIntegralInRange<int>(1, 6);
  c.init_blocks = in.ConsumeIntegralInRange<int>(0, 2);
  c.local_blocks = in.ConsumeIntegralInRange<int>(0, 2);
  const int bs = c.block_size;

  // Batch: decode (q_len rows per request, 0 = padding) or prefill (context + chunk).
  const bool decode = in.ConsumeBool();
  const int reqs = in.ConsumeIntegralInRange<int>(1, 3);
  BatchMeta b;
  b.num_reqs = reqs;
  std::vector<int64_t> end(static_cast<std::size_t>(reqs));
  HostTensor seq_lens(DType::kI32, {reqs}), cu(DType::kI32, {reqs + 1}),
      context(DType::kI32, {reqs});
  if (decode) {
    b.kind = BatchKind::kDecode;
    b.q_len = in.ConsumeIntegralInRange<int>(1, 3);
    for (int r = 0; r < reqs; ++r) {
      const int32_t len = in.ConsumeIntegralInRange<int>(0, 5) == 0
                              ? 0
                              : in.ConsumeIntegralInRange<int32_t>(b.q_len, 48);
      seq_lens.ptr<int32_t>()[r] = len;
      end[static_cast<std::size_t>(r)] = len;
    }
    b.seq_lens = seq_lens.view();
  } else {
    b.kind = BatchKind::kPrefill;
    cu.ptr<int32_t>()[0] = 0;
    for (int r = 0; r < reqs; ++r) {
      const int32_t ctx = in.ConsumeIntegralInRange<int32_t>(0, 40);
      const int32_t chunk = in.ConsumeIntegralInRange<int32_t>(0, 6);
      context.ptr<int32_t>()[r] = ctx;
      cu.ptr<int32_t>()[r + 1] = cu.ptr<int32_t>()[r] + chunk;
      end[static_cast<std::size_t>(r)] = ctx + chunk;
    }
    b.cu_seqlens_q = cu.view();
    b.context_lens = context.view();
    b.num_tokens = cu.ptr<int32_t>()[reqs];
  }
  const int64_t rows = b.num_rows();
  int64_t columns = 1;
  for (int64_t e : end) columns = std::max(columns, (e + bs - 1) / bs);
  const int64_t pages = in.ConsumeIntegralInRange<int64_t>(1, 24);
  // Table entries: any page (aliasing allowed), now and then one outside the cache (rejected).
  HostTensor table(DType::kI32, {reqs, columns});
  for (int64_t i = 0; i < table.numel(); ++i) {
    table.ptr<int32_t>()[i] =
        in.ConsumeIntegralInRange<int>(0, 63) == 0
            ? hostile_int(in)
            : in.ConsumeIntegralInRange<int32_t>(0, static_cast<int32_t>(pages - 1));
  }
  b.index_block_table = table.view();

  const DType cache_dtype = in.ConsumeBool() ? DType::kBF16 : DType::kFP8E4M3;
  HostTensor cache(cache_dtype, {pages, bs, c.index_dim});
  HostTensor index_q(DType::kBF16, {rows, c.index_heads, c.index_dim});
  ElementSource source{in, Rng{in.ConsumeIntegral<uint64_t>()},
                       in.ConsumeIntegralInRange<int>(0, 24)};
  source.fill(index_q);
  source.fill(cache);

  HostTensor topk(DType::kI32, {rows, c.index_heads, c.topk});
  topk.fill_bytes(0x7F);  // poison: every entry must be written
  IndexerArgs args;
  args.index_q = index_q.view();
  args.index_cache = IndexCache{cache.view()};
  args.batch = b;
  args.topk_idx = topk.view();
  if (!accepts([&] { cpu::select_topk(c, args, 1); })) return 0;

  const std::vector<RowPosition> where = row_positions(b);
  const int64_t max_blocks = std::max<int64_t>(columns, 1);
  HostTensor scores(DType::kF32, {rows, c.index_heads, max_blocks});
  FUZZ_CHECK(accepts([&] { cpu::score_blocks(c, args, scores.view(), 1); }));

  const int k = c.topk;
  const int heads = c.index_heads;
  for (int64_t row = 0; row < rows; ++row) {
    const RowPosition& at = where[static_cast<std::size_t>(row)];
    const int64_t nb = visible_blocks(at.pos, bs);
    for (int h = 0; h < heads; ++h) {
      const int32_t* out = topk.ptr<int32_t>() + (row * heads + h) * k;
      const float* s = scores.ptr<float>() + (row * heads + h) * max_blocks;
      const int valid = static_cast<int>(std::min<int64_t>(k, nb));
      for (int i = 0; i < k; ++i) {
        if (i < valid) {
          FUZZ_CHECK(out[i] >= 0 && out[i] < nb, "row %lld head %d entry %d = %d, nb %lld",
                     (long long)row, h, i, out[i], (long long)nb);
        } else {
          FUZZ_CHECK(out[i] == -1, "row %lld head %d entry %d = %d past the prefix of %d",
                     (long long)row, h, i, out[i], valid);
        }
      }
      if (nb == 0) continue;
      // Independent scores: dot in dimension order, max over the visible tokens, NaN sticky.
      for (int64_t blk = 0; blk < nb; ++blk) {
        float best = -std::numeric_limits<float>::infinity();
        bool nan = false;
        for (int64_t p = blk * bs; p < std::min<int64_t>(blk * bs + bs, at.pos + 1); ++p) {
          const int64_t page = table.ptr<int32_t>()[int64_t{at.req} * columns + p / bs];
          float dot = 0.0f;
          for (int d = 0; d < c.index_dim; ++d) {
            dot += element(index_q, (row * heads + h) * c.index_dim + d) *
                   element(cache, (page * bs + p % bs) * c.index_dim + d);
          }
          nan = nan || std::isnan(dot);
          best = std::max(best, dot);
        }
        const float expected = nan ? std::numeric_limits<float>::quiet_NaN() : best;
        FUZZ_CHECK(ordered_score(expected) == ordered_score(s[blk]),
                   "score of row %lld head %d block %lld: %g, expected %g", (long long)row, h,
                   (long long)blk, static_cast<double>(s[blk]), static_cast<double>(expected));
      }
      auto key_of = [&](int64_t blk) {
        return is_forced_block(blk, nb, c.init_blocks, c.local_blocks)
                   ? forced_key(static_cast<uint32_t>(blk))
                   : scored_key(s[blk], static_cast<uint32_t>(blk));
      };
      std::vector<bool> chosen(static_cast<std::size_t>(nb), false);
      int64_t forced_count = 0;
      for (int64_t blk = 0; blk < nb; ++blk) {
        forced_count += is_forced_block(blk, nb, c.init_blocks, c.local_blocks);
      }
      for (int i = 0; i < valid; ++i) {
        FUZZ_CHECK(!chosen[static_cast<std::size_t>(out[i])], "block %d selected twice", out[i]);
        chosen[static_cast<std::size_t>(out[i])] = true;
        const bool forced = is_forced_block(out[i], nb, c.init_blocks, c.local_blocks);
        FUZZ_CHECK(forced == (i < std::min<int64_t>(forced_count, valid)),
                   "forced blocks must come first (entry %d, block %d)", i, out[i]);
        if (i > 0) {
          FUZZ_CHECK(key_of(out[i - 1]) > key_of(out[i]), "entries %d and %d out of key order",
                     i - 1, i);
        }
      }
      for (int64_t blk = 0; blk < nb; ++blk) {
        if (!chosen[static_cast<std::size_t>(blk)]) {
          FUZZ_CHECK(key_of(blk) < key_of(out[valid - 1]),
                     "unselected block %lld outranks selected block %d", (long long)blk,
                     out[valid - 1]);
        }
      }
    }
  }

  // Sharded nominations merge to the same selection (what the CP path relies on).
  const int shards = in.ConsumeIntegralInRange<int>(1, 4);
  std::vector<HostTensor> nominations;
  for (int shard = 0; shard < shards; ++shard) {
    nominations.emplace_back(DType::kU64, std::vector<int64_t>{rows, heads, k});
    FUZZ_CHECK(
        accepts([&] { cpu::nominate(c, args, shard, shards, nominations.back().view(), 1); }));
  }
  for (int64_t i = 0; i < rows * heads; ++i) {
    std::vector<uint64_t> all;
    for (const HostTensor& n : nominations) {
      all.insert(all.end(), n.ptr<uint64_t>() + i * k, n.ptr<uint64_t>() + (i + 1) * k);
    }
    const std::vector<uint64_t> merged = cpu::top_keys(all, k);
    std::vector<int32_t> ids(static_cast<std::size_t>(k));
    cpu::keys_to_indices(merged.data(), static_cast<int>(merged.size()), ids.data(), k);
    FUZZ_CHECK(std::equal(ids.begin(), ids.end(), topk.ptr<int32_t>() + i * k),
               "%d-shard merge differs from the selection at (row, head) %lld", shards,
               (long long)i);
  }

  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) {
    HostTensor again(DType::kI32, {rows, heads, k});
    args.topk_idx = again.view();
    cpu::select_topk(c, args, 2);
    FUZZ_CHECK(
        std::equal(again.ptr<int32_t>(), again.ptr<int32_t>() + again.numel(), topk.ptr<int32_t>()),
        "two threads and one thread disagree");
  }
  return 0;
}
