#include "m3msa/ops.h"

#include <cmath>

#include "m3msa/error.h"

namespace m3msa {

void validate_index_cache(const IndexCache& cache, const SparseConfig& config, const char* name) {
  check_tensor(cache.data, name, {DType::kBF16, DType::kFP8E4M3},
               {-1, config.block_size, config.index_dim});
}

void validate_kv_cache(const KVCache& cache, const SparseConfig& config, const char* name) {
  check_tensor(cache.data, name, {DType::kBF16, DType::kFP8E4M3},
               {-1, config.kv_heads, 2, config.block_size, config.head_dim});
  M3MSA_CHECK_ARG(std::isfinite(cache.k_scale) && cache.k_scale > 0 &&
                      std::isfinite(cache.v_scale) && cache.v_scale > 0,
                  name, ": k_scale and v_scale must be finite and > 0, got ", cache.k_scale,
                  " and ", cache.v_scale);
}

void validate(const SparseConfig& config, const PreprocessArgs& args, Device device) {
  config.validate();
  validate_batch_shapes(args.batch, device);
  const int64_t rows = args.batch.num_rows();
  check_tensor(args.qkv, "qkv", DType::kBF16, {rows, config.qkv_width()});
  check_tensor(args.q_norm, "q_norm", DType::kBF16, {config.head_dim});
  check_tensor(args.k_norm, "k_norm", DType::kBF16, {config.head_dim});
  check_tensor(args.positions, "positions", DType::kI64, {rows});
  M3MSA_CHECK_ARG(args.batch.slot_mapping.defined(), "batch.slot_mapping is required");
  validate_kv_cache(args.kv_cache, config, "kv_cache");
  check_tensor(args.q_out, "q_out", DType::kBF16, {rows, config.q_heads, config.head_dim});
  for (const auto& [view, name] : {std::pair{args.qkv, "qkv"},
                                   {args.q_norm, "q_norm"},
                                   {args.k_norm, "k_norm"},
                                   {args.positions, "positions"},
                                   {args.kv_cache.data, "kv_cache"},
                                   {args.q_out, "q_out"}}) {
    check_device(view, name, device);
  }
  if (!args.has_index_part()) return;  // a layer sharing another layer's selection
  M3MSA_CHECK_ARG(args.index_q_out.defined() && args.index_cache.data.defined(),
                  "index_q_out and index_cache must be given together (neither: a layer that "
                  "shares another layer's selection), got index_q_out ",
                  describe(args.index_q_out), " and index_cache ", describe(args.index_cache.data));
  check_tensor(args.index_q_norm, "index_q_norm", DType::kBF16, {config.index_dim});
  check_tensor(args.index_k_norm, "index_k_norm", DType::kBF16, {config.index_dim});
  M3MSA_CHECK_ARG(args.batch.index_slot_mapping.defined(), "batch.index_slot_mapping is required");
  validate_index_cache(args.index_cache, config, "index_cache");
  check_tensor(args.index_q_out, "index_q_out", DType::kBF16,
               {rows, config.index_heads, config.index_dim});
  for (const auto& [view, name] : {std::pair{args.index_q_norm, "index_q_norm"},
                                   {args.index_k_norm, "index_k_norm"},
                                   {args.index_cache.data, "index_cache"},
                                   {args.index_q_out, "index_q_out"}}) {
    check_device(view, name, device);
  }
}

void validate(const SparseConfig& config, const IndexerArgs& args, Device device) {
  config.validate();
  validate_batch_shapes(args.batch, device);
  M3MSA_CHECK_ARG(args.batch.index_block_table.defined(), "batch.index_block_table is required");
  const int64_t rows = args.batch.num_rows();
  validate_index_cache(args.index_cache, config, "index_cache");
  // bf16, or fp8 e4m3 beside an fp8 index cache (engines that quantize index_q while
  // preprocessing pass it in the cache's dtype): the products are exact in fp32 either way.
  const bool fp8_cache = args.index_cache.data.dtype == DType::kFP8E4M3;
  M3MSA_CHECK_ARG(args.index_q.dtype != DType::kFP8E4M3 || fp8_cache,
                  "index_q: an fp8_e4m3 index_q needs an fp8_e4m3 index_cache, got index_cache ",
                  dtype_name(args.index_cache.data.dtype));
  check_tensor(args.index_q, "index_q",
               fp8_cache && args.index_q.dtype == DType::kFP8E4M3 ? DType::kFP8E4M3 : DType::kBF16,
               {rows, config.index_heads, config.index_dim});
  check_tensor(args.topk_idx, "topk_idx", DType::kI32, {rows, config.index_heads, config.topk});
  check_device(args.index_q, "index_q", device);
  check_device(args.index_cache.data, "index_cache", device);
  check_device(args.topk_idx, "topk_idx", device);
}

void validate(const SparseConfig& config, const AttentionArgs& args, Device device) {
  config.validate();
  validate_batch_shapes(args.batch, device);
  M3MSA_CHECK_ARG(args.batch.kv_block_table.defined(), "batch.kv_block_table is required");
  const int64_t rows = args.batch.num_rows();
  check_tensor(args.q, "q", DType::kBF16, {rows, config.q_heads, config.head_dim});
  validate_kv_cache(args.kv_cache, config, "kv_cache");
  if (args.topk_idx.defined()) {
    check_tensor(args.topk_idx, "topk_idx", DType::kI32, {rows, config.kv_heads, config.topk});
    check_device(args.topk_idx, "topk_idx", device);
  }
  check_tensor(args.out, "out", DType::kBF16, {rows, config.q_heads, config.head_dim});
  check_device(args.q, "q", device);
  check_device(args.kv_cache.data, "kv_cache", device);
  check_device(args.out, "out", device);
}

}  // namespace m3msa
