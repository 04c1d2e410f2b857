// The CPU reference of the lightning indexer: block scores, per-shard nominations and the exact
// top-k block selection of docs/spec.md section 4.
//
// Block score rule (the GPU kernels must follow the same one):
//  - s(p) = sum over d = 0..D-1, in that order, of index_q[d] * index_k[p][d], accumulated in fp32
//    from the decoded bf16 / fp8 values. Each product of two bf16 values, or bf16 and fp8, or two
//    fp8 values (an fp8 index_q beside an fp8 cache) is exact in fp32, so fused and unfused
//    multiply-adds give the same sum; only the order matters.
//  - S(b) = max of s(p) over the visible tokens of b, taken in ascending p, with NaN propagating: a
//    block any of whose visible dot products is NaN scores NaN (and so ranks below every number,
//    docs/spec.md section 4). A plain fmaxf would instead drop the NaN and let the block compete on
//    its other tokens, which would make the answer depend on which tokens a kernel happened to
//    pair. Among equal maxima the first one is kept, so -0.0 vs +0.0 can differ in the raw score
//    but never in the sort key (ordered() maps both to the same image).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu/cache_access.h"
#include "cpu/thread_pool.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "m3msa/sort_key.h"

namespace m3msa::cpu {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// validate() insists on a topk_idx; the entries that do not write one take a stand-in view of the
// right shape (never dereferenced) so the shared validation still covers every other argument.
IndexerArgs with_placeholder_output(const SparseConfig& config, const IndexerArgs& args) {
  if (args.topk_idx.defined()) return args;
  static int32_t placeholder = 0;
  IndexerArgs copy = args;
  copy.topk_idx = TensorView::contiguous(&placeholder, DType::kI32,
                                         {args.batch.num_rows(), config.index_heads, config.topk});
  return copy;
}

// Full host validation of an indexer call; returns where every row sits.
std::vector<RowPosition> validate_indexer(const SparseConfig& config, const IndexerArgs& args) {
  validate(config, args, Device::cpu());
  // Only the index table is read here; the other batch fields must not be checked against
  // caches this call does not see.
  BatchMeta used = args.batch;
  used.kv_block_table = {};
  used.slot_mapping = {};
  used.index_slot_mapping = {};
  validate_batch_contents(used, config, args.index_cache.pages(), 0);
  std::vector<RowPosition> rows = row_positions(args.batch);
  for (std::size_t row = 0; row < rows.size(); ++row) {
    const int64_t nb = visible_blocks(rows[row].pos, config.block_size);
    M3MSA_CHECK_ARG(nb - 1 <= kMaxBlockId, "row ", row, " at position ", rows[row].pos,
                    " sees block ", nb - 1, ", past the block id cap ", kMaxBlockId);
  }
  return rows;
}

// Scores blocks first, first + step, ... (< blocks) of one live row for every head:
// scores[h * stride + b] = S(row, h, b). Other entries are left untouched.
void score_row(const SparseConfig& config, const IndexerArgs& args, int64_t row,
               const RowPosition& where, int64_t first, int64_t step, int64_t blocks,
               int64_t stride, float* scores) {
  const int heads = config.index_heads;
  const int dim = config.index_dim;
  const int64_t block_size = config.block_size;
  std::vector<float> query(static_cast<std::size_t>(heads) * dim);
  detail::load_vector(args.index_q, row * heads * dim, heads * dim, 1.0f, query.data());
  std::vector<float> key(static_cast<std::size_t>(dim));
  std::vector<float> best(static_cast<std::size_t>(heads));
  for (int64_t b = first; b < blocks; b += step) {
    std::fill(best.begin(), best.end(), kNegInf);
    const int64_t end = std::min(block_size * b + block_size, where.pos + 1);
    for (int64_t p = block_size * b; p < end; ++p) {
      const int64_t offset =
          detail::index_cache_offset(args.index_cache, args.batch.index_block_table, where.req, p);
      detail::load_vector(args.index_cache.data, offset, dim, 1.0f, key.data());
      for (int h = 0; h < heads; ++h) {
        const float* q = query.data() + static_cast<std::size_t>(h) * dim;
        float dot = 0.0f;
        for (int d = 0; d < dim; ++d) dot += q[d] * key[d];
        float& m = best[h];
        if (std::isnan(m)) continue;  // NaN is sticky
        if (std::isnan(dot) || dot > m) m = dot;
      }
    }
    for (int h = 0; h < heads; ++h) scores[h * stride + b] = best[h];
  }
}

// The k largest sort keys among blocks shard, shard + num_shards, ... (< nb) of one (row, head),
// descending, padded with kNoCandidate. head_scores[b] = S(b) for those blocks.
void shard_top_keys(const SparseConfig& config, const float* head_scores, int64_t nb, int shard,
                    int num_shards, uint64_t* out) {
  std::vector<uint64_t> keys;
  keys.reserve(static_cast<std::size_t>(nb / num_shards + 1));
  for (int64_t b = shard; b < nb; b += num_shards) {
    const uint32_t block = static_cast<uint32_t>(b);
    keys.push_back(is_forced_block(b, nb, config.init_blocks, config.local_blocks)
                       ? forced_key(block)
                       : scored_key(head_scores[b], block));
  }
  const std::size_t take =
      std::min<std::size_t>(keys.size(), static_cast<std::size_t>(config.topk));
  std::partial_sort(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(take), keys.end(),
                    std::greater<uint64_t>());
  for (int i = 0; i < config.topk; ++i) {
    out[i] = static_cast<std::size_t>(i) < take ? keys[static_cast<std::size_t>(i)] : kNoCandidate;
  }
}

}  // namespace

// Writes [rows, H, max_blocks] scores; -inf for blocks a row cannot see and for dead rows, so a
// consumer must use visible_blocks() to tell a real -inf score from "not visible".
void score_blocks(const SparseConfig& config, const IndexerArgs& args, TensorView scores,
                  int threads) {
  const IndexerArgs checked = with_placeholder_output(config, args);
  const std::vector<RowPosition> rows = validate_indexer(config, checked);
  check_tensor(scores, "scores", DType::kF32, {args.batch.num_rows(), config.index_heads, -1});
  check_device(scores, "scores", Device::cpu());
  const int64_t max_blocks = scores.shape[2];
  const int64_t per_row = int64_t{config.index_heads} * max_blocks;
  detail::parallel_for(static_cast<int64_t>(rows.size()), threads, [&](int64_t row) {
    float* out = scores.ptr<float>() + row * per_row;
    std::fill(out, out + per_row, kNegInf);
    const RowPosition& where = rows[static_cast<std::size_t>(row)];
    if (where.pos < 0) return;
    const int64_t blocks = std::min(visible_blocks(where.pos, config.block_size), max_blocks);
    score_row(config, checked, row, where, 0, 1, blocks, max_blocks, out);
  });
}

// Scores only the shard's own blocks (the point of sharding), then keeps its top k per head.
void nominate(const SparseConfig& config, const IndexerArgs& args, int shard, int num_shards,
              TensorView keys, int threads) {
  const IndexerArgs checked = with_placeholder_output(config, args);
  const std::vector<RowPosition> rows = validate_indexer(config, checked);
  M3MSA_CHECK_ARG(num_shards >= 1, "num_shards must be >= 1, got ", num_shards);
  M3MSA_CHECK_ARG(shard >= 0 && shard < num_shards,
                  "shard must be in [0, num_shards = ", num_shards, "), got ", shard);
  check_tensor(keys, "keys", DType::kU64, {args.batch.num_rows(), config.index_heads, config.topk});
  check_device(keys, "keys", Device::cpu());
  const int heads = config.index_heads;
  detail::parallel_for(static_cast<int64_t>(rows.size()), threads, [&](int64_t row) {
    uint64_t* out = keys.ptr<uint64_t>() + row * heads * config.topk;
    const RowPosition& where = rows[static_cast<std::size_t>(row)];
    if (where.pos < 0) {
      std::fill(out, out + heads * config.topk, kNoCandidate);
      return;
    }
    const int64_t nb = visible_blocks(where.pos, config.block_size);
    std::vector<float> row_scores(static_cast<std::size_t>(heads * nb), kNegInf);
    score_row(config, checked, row, where, shard, num_shards, nb, nb, row_scores.data());
    for (int h = 0; h < heads; ++h) {
      shard_top_keys(config, row_scores.data() + h * nb, nb, shard, num_shards,
                     out + h * config.topk);
    }
  });
}

// Union semantics: tags are stripped, empty keys dropped and duplicates merged before ranking,
// so merging the same nomination twice cannot produce a repeated block.
std::vector<uint64_t> top_keys(const std::vector<uint64_t>& candidates, int k) {
  M3MSA_CHECK_ARG(k >= 0, "k must be >= 0, got ", k);
  std::vector<uint64_t> keys;
  keys.reserve(candidates.size());
  for (uint64_t key : candidates) {
    const uint64_t stripped = with_tag(key, 0);
    if (stripped != kNoCandidate) keys.push_back(stripped);
  }
  std::sort(keys.begin(), keys.end(), std::greater<uint64_t>());
  keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
  if (keys.size() > static_cast<std::size_t>(k)) keys.resize(static_cast<std::size_t>(k));
  return keys;
}

// Non-empty keys keep their order (the caller's, normally descending); empty ones anywhere in
// the list are skipped, so the valid ids always form a prefix.
void keys_to_indices(const uint64_t* keys, int n, int32_t* out, int k) {
  M3MSA_CHECK_ARG(n >= 0, "n must be >= 0, got ", n);
  M3MSA_CHECK_ARG(k >= 0, "k must be >= 0, got ", k);
  M3MSA_CHECK_ARG(keys != nullptr || n == 0, "keys is null with n = ", n);
  M3MSA_CHECK_ARG(out != nullptr || k == 0, "out is null with k = ", k);
  int written = 0;
  for (int i = 0; i < n; ++i) {
    if (with_tag(keys[i], 0) == kNoCandidate) continue;
    M3MSA_CHECK_ARG(written < k, "keys holds more than k = ", k, " non-empty keys");
    out[written++] = key_block(keys[i]);
  }
  for (int i = written; i < k; ++i) out[i] = -1;
}

void select_topk(const SparseConfig& config, const IndexerArgs& args, int threads) {
  const std::vector<RowPosition> rows = validate_indexer(config, args);
  const int heads = config.index_heads;
  const int k = config.topk;
  // Where each (row, head) answer goes (SelectionOptions): token- or head-major, any capacity.
  const bool head_major = args.selection.major == SelectionMajor::kHeadMajor;
  const int64_t row_stride = args.topk_idx.strides[head_major ? 1 : 0];
  const int64_t head_stride = args.topk_idx.strides[head_major ? 0 : 1];
  const bool ascending = args.selection.order == SelectionOrder::kAscendingBlock;
  detail::parallel_for(static_cast<int64_t>(rows.size()), threads, [&](int64_t row) {
    auto answer = [&](int h) {
      return args.topk_idx.ptr<int32_t>() + row * row_stride + h * head_stride;
    };
    const RowPosition& where = rows[static_cast<std::size_t>(row)];
    if (where.pos < 0) {
      for (int h = 0; h < heads; ++h) std::fill(answer(h), answer(h) + k, -1);
      return;
    }
    const int64_t nb = visible_blocks(where.pos, config.block_size);
    std::vector<float> row_scores(static_cast<std::size_t>(heads * nb), kNegInf);
    score_row(config, args, row, where, 0, 1, nb, nb, row_scores.data());
    std::vector<uint64_t> keys(static_cast<std::size_t>(k));
    for (int h = 0; h < heads; ++h) {
      shard_top_keys(config, row_scores.data() + h * nb, nb, 0, 1, keys.data());
      int32_t* out = answer(h);
      keys_to_indices(keys.data(), k, out, k);
      if (ascending) std::sort(out, std::find(out, out + k, -1));
    }
  });
}

}  // namespace m3msa::cpu
