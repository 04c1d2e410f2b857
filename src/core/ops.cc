#include "m3msa/ops.h"

#include "m3msa/error.h"

namespace m3msa {

const char* selection_order_name(SelectionOrder order) {
  return order == SelectionOrder::kAscendingBlock ? "ascending" : "descending";
}

const char* selection_major_name(SelectionMajor major) {
  return major == SelectionMajor::kHeadMajor ? "head" : "token";
}

SelectionOrder parse_selection_order(const std::string& text, const char* what) {
  if (text == "descending") return SelectionOrder::kDescendingKey;
  if (text == "ascending") return SelectionOrder::kAscendingBlock;
  M3MSA_THROW(ErrorCode::kInvalidArgument, what,
              ": expected \"descending\" or \"ascending\", got \"", text, "\"");
}

SelectionMajor parse_selection_major(const std::string& text, const char* what) {
  if (text == "token") return SelectionMajor::kTokenMajor;
  if (text == "head") return SelectionMajor::kHeadMajor;
  M3MSA_THROW(ErrorCode::kInvalidArgument, what, ": expected \"token\" or \"head\", got \"", text,
              "\"");
}

namespace {

// topk_idx as the selection options place it; the (row, head) answers of k entries must not
// overlap, whatever the strides of the two outer axes.
void check_selection_output(const TensorView& topk, const SelectionOptions& options, int64_t rows,
                            int64_t heads, int64_t k) {
  M3MSA_CHECK_ARG(options.order == SelectionOrder::kDescendingKey ||
                      options.order == SelectionOrder::kAscendingBlock,
                  "selection.order: unknown value ", static_cast<int>(options.order));
  M3MSA_CHECK_ARG(
      options.major == SelectionMajor::kTokenMajor || options.major == SelectionMajor::kHeadMajor,
      "selection.major: unknown value ", static_cast<int>(options.major));
  const bool head_major = options.major == SelectionMajor::kHeadMajor;
  if (head_major) {
    check_strided_tensor(topk, "topk_idx (head-major)", {DType::kI32}, {heads, rows, k});
  } else {
    check_strided_tensor(topk, "topk_idx", {DType::kI32}, {rows, heads, k});
  }
  if (topk.numel() == 0) return;
  // The inner of the two outer axes (by stride) holds k-entry answers; the outer one whole runs.
  const int inner = topk.strides[0] <= topk.strides[1] ? 0 : 1;
  const int outer = 1 - inner;
  const bool inner_ok = topk.shape[inner] <= 1 || topk.strides[inner] >= k;
  const bool outer_ok = topk.shape[outer] <= 1 ||
                        topk.strides[outer] >= (topk.shape[inner] - 1) * topk.strides[inner] + k;
  M3MSA_CHECK_ARG(inner_ok && outer_ok, "topk_idx: strides ", topk.strides[0], ", ",
                  topk.strides[1], " for shape ", shape_string(topk.sizes()),
                  " make (row, head) answers of ", k, " entries overlap");
}

}  // namespace

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
                                   {args.kv_cache.keys(), "kv_cache"},
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
  check_selection_output(args.topk_idx, args.selection, rows, config.index_heads, config.topk);
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
    // Read only, so any strides of the two outer axes serve: a head-major buffer of larger
    // capacity is passed as a permuted view, with no copy.
    check_strided_tensor(args.topk_idx, "topk_idx", {DType::kI32},
                         {rows, config.kv_heads, config.topk});
    check_device(args.topk_idx, "topk_idx", device);
  }
  check_tensor(args.out, "out", DType::kBF16, {rows, config.q_heads, config.head_dim});
  check_device(args.q, "q", device);
  check_device(args.kv_cache.keys(), "kv_cache", device);
  check_device(args.out, "out", device);
}

}  // namespace m3msa
