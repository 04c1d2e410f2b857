// The checks of the three prepare stages. Each stage records every problem it finds (not only the
// first), classified as "unsupported" (a valid setup the runtime does not run: fall back) or an
// error (the binding contradicts the configuration: a bug in the caller). Refusals name the
// tensor, and the expected and the found dtype, shape, stride or device.
#include <cmath>
#include <functional>
#include <sstream>

#include "m3msa/sort_key.h"
#include "runtime/runtime_internal.h"

namespace m3msa::runtime_detail {

const char* outcome_kind_name(OutcomeKind kind) {
  switch (kind) {
    case OutcomeKind::kOk: return "ok";
    case OutcomeKind::kNotReady: return "not ready";
    case OutcomeKind::kUnsupported: return "unsupported";
    case OutcomeKind::kError: return "error";
  }
  return "unknown";
}

ByteRecord encode(const Outcome& outcome) {
  return RecordWriter()
      .u8(static_cast<uint8_t>(outcome.kind))
      .u8(static_cast<uint8_t>(outcome.code))
      .str(outcome.message)
      .str(outcome.fingerprint)
      .take();
}

Outcome decode(const ByteRecord& record, int rank) {
  RecordReader reader(record, "prepare outcome of rank " + std::to_string(rank));
  Outcome out;
  const uint8_t kind = reader.u8();
  const uint8_t code = reader.u8();
  M3MSA_CHECK_INTERNAL(kind <= static_cast<uint8_t>(OutcomeKind::kError) &&
                           code <= static_cast<uint8_t>(ErrorCode::kInternal),
                       "malformed outcome record of rank ", rank);
  out.kind = static_cast<OutcomeKind>(kind);
  out.code = static_cast<ErrorCode>(code);
  out.message = reader.str();
  out.fingerprint = reader.str();
  M3MSA_CHECK_INTERNAL(reader.done(), "trailing bytes in the outcome record of rank ", rank);
  return out;
}

void Problems::unsupported(std::string message) {
  items_.push_back({OutcomeKind::kUnsupported, ErrorCode::kUnsupported, std::move(message)});
}

void Problems::error(ErrorCode code, std::string message) {
  items_.push_back({OutcomeKind::kError, code, std::move(message)});
}

void Problems::not_ready(std::string message) {
  items_.push_back({OutcomeKind::kNotReady, ErrorCode::kInternal, std::move(message)});
}

Outcome Problems::outcome() const {
  constexpr int kMaxListed = 8;
  Outcome out;
  for (const Item& item : items_) {
    if (static_cast<int>(item.kind) > static_cast<int>(out.kind)) {
      out.kind = item.kind;
      out.code = item.code;
    }
  }
  if (out.kind == OutcomeKind::kOk) return out;
  int listed = 0;
  int left = 0;
  std::string text;
  for (const Item& item : items_) {
    if (item.kind != out.kind) continue;
    if (listed == kMaxListed) {
      ++left;
      continue;
    }
    text += (listed++ ? "; " : "") + item.message;
  }
  if (left > 0) text += "; ... and " + std::to_string(left) + " more";
  out.message = text;
  return out;
}

std::string invalid_extents(const TensorView& view, const std::string& name) {
  try {
    check_extents(view, name.c_str());
  } catch (const Error& e) {
    return e.message();
  }
  return {};
}

namespace {

std::string expected_shape(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) {
    out << (i ? ", " : "");
    if (shape[i] < 0) {
      out << '*';
    } else {
      out << shape[i];
    }
  }
  out << ']';
  return out.str();
}

std::string dtype_list(const std::vector<DType>& dtypes) {
  std::string out;
  for (DType d : dtypes) out += (out.empty() ? "" : " or ") + std::string(dtype_name(d));
  return out;
}

std::vector<int64_t> contiguous_strides(const TensorView& t) {
  std::vector<int64_t> strides(static_cast<std::size_t>(t.ndim));
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    strides[static_cast<std::size_t>(d)] = stride;
    stride *= t.shape[d];
  }
  return strides;
}

// Checks one bound tensor; true when it can be used as is. A negative expected extent matches
// any extent.
// Every tensor lives on `device` (the first bound qkv_proj's): one backend runs the layers.
bool check_bound(Problems& problems, const TensorView& t, const std::string& name,
                 const std::vector<DType>& dtypes, const std::vector<int64_t>& shape,
                 const Device& device) {
  const std::string expected = dtype_list(dtypes) + expected_shape(shape);
  if (!t.defined()) {
    problems.error(ErrorCode::kInvalidArgument, name + ": not bound (expected " + expected + ")");
    return false;
  }
  if (const std::string bad = invalid_extents(t, name); !bad.empty()) {
    problems.error(ErrorCode::kInvalidArgument, bad + " (expected " + expected + ")");
    return false;
  }
  bool ok = true;
  if (!(t.device == device)) {
    problems.error(ErrorCode::kInvalidArgument,
                   name + ": expected a tensor on " + device_name(device) +
                       " (where the first bound qkv_proj is; every tensor must be on one "
                       "device), found one on " +
                       device_name(t.device));
    ok = false;
  }
  bool dtype_ok = false;
  for (DType d : dtypes) dtype_ok = dtype_ok || d == t.dtype;
  if (!dtype_ok) {
    problems.unsupported(name + ": expected dtype " + dtype_list(dtypes) + ", found " +
                         dtype_name(t.dtype));
    ok = false;
  }
  bool shape_ok = t.ndim == static_cast<int>(shape.size());
  for (int d = 0; shape_ok && d < t.ndim; ++d) {
    shape_ok =
        shape[static_cast<std::size_t>(d)] < 0 || shape[static_cast<std::size_t>(d)] == t.shape[d];
  }
  if (!shape_ok) {
    problems.error(ErrorCode::kInvalidArgument, name + ": expected shape " + expected_shape(shape) +
                                                    ", found " + shape_string(t.sizes()));
    return false;
  }
  if (t.data == nullptr && t.numel() > 0) {
    problems.error(ErrorCode::kInvalidArgument, name + ": null data pointer for " + describe(t));
    return false;
  }
  if (!t.is_contiguous()) {
    problems.unsupported(
        name + ": expected contiguous strides " + shape_string(contiguous_strides(t)) + ", found " +
        shape_string({t.strides.begin(), t.strides.begin() + t.ndim}) + " for " + describe(t));
    ok = false;
  }
  return ok;
}

// A projection weight and, for fp8, its per-output-channel scale.
void check_projection(Problems& problems, const TensorView& weight, const TensorView& scale,
                      const std::string& name, int64_t out_features, int64_t in_features,
                      const Device& device) {
  const bool ok = check_bound(problems, weight, name, {DType::kBF16, DType::kFP8E4M3},
                              {out_features, in_features}, device);
  if (!ok) return;
  if (weight.dtype == DType::kFP8E4M3) {
    check_bound(problems, scale, name + "_scale", {DType::kF32}, {out_features}, device);
  } else if (scale.defined()) {
    problems.error(ErrorCode::kInvalidArgument,
                   name + "_scale: given for a bf16 weight (scales go with fp8 weights only)");
  }
}

bool positive_finite(float v) {
  return std::isfinite(v) && v > 0.0f;
}

}  // namespace

void check_model_support(const RuntimeConfig& config, int tp_size, Problems& problems) {
  const ModelConfig& model = config.model;
  try {
    model.validate();
  } catch (const Error& e) {
    problems.error(e.code() == ErrorCode::kUnsupported ? ErrorCode::kInvalidArgument : e.code(),
                   e.message());
    return;
  }
  // Contradictions in the options: errors.
  auto error = [&](bool ok, const std::string& message) {
    if (!ok) problems.error(ErrorCode::kInvalidArgument, message);
  };
  error(!config.token_buckets.empty(), "config.token_buckets is empty");
  for (std::size_t i = 0; i < config.token_buckets.size(); ++i) {
    error(config.token_buckets[i] > 0 &&
              (i == 0 || config.token_buckets[i] > config.token_buckets[i - 1]),
          "config.token_buckets must be positive and strictly ascending, got " +
              std::to_string(config.token_buckets[i]) + " at index " + std::to_string(i));
  }
  error(!config.query_lens.empty(), "config.query_lens is empty");
  for (int q : config.query_lens) {
    error(q > 0, "config.query_lens: query length must be > 0, got " + std::to_string(q));
  }
  error(config.max_requests > 0,
        "config.max_requests must be > 0, got " + std::to_string(config.max_requests));
  error(config.max_context > 0,
        "config.max_context must be > 0, got " + std::to_string(config.max_context));
  error(config.pipeline_parallel_size >= 1, "config.pipeline_parallel_size must be >= 1, got " +
                                                std::to_string(config.pipeline_parallel_size));
  error(config.selection_share_period >= 1, "config.selection_share_period must be >= 1, got " +
                                                std::to_string(config.selection_share_period));
  error(config.cache_block_size >= 0,
        "config.cache_block_size must be >= 0, got " + std::to_string(config.cache_block_size));
  error(std::isfinite(config.swiglu_limit) && config.swiglu_limit > 0,
        "config.swiglu_limit must be finite and > 0, got " + std::to_string(config.swiglu_limit));
  error(config.threads >= 0, "config.threads must be >= 0, got " + std::to_string(config.threads));
  error(config.cp_spin_budget.count() > 0, "config.cp_spin_budget must be > 0 us, got " +
                                               std::to_string(config.cp_spin_budget.count()));
  error(config.cp_transport == CpTransport::kPeer || config.cp_transport == CpTransport::kNccl ||
            config.cp_transport == CpTransport::kReplicated ||
            config.cp_transport == CpTransport::kAllReduceMax,
        "config.cp_transport has no valid value (" +
            std::to_string(static_cast<int>(config.cp_transport)) + ")");
  error(config.indexer_overlap == IndexerOverlap::kAuto ||
            config.indexer_overlap == IndexerOverlap::kOff ||
            config.indexer_overlap == IndexerOverlap::kOn,
        "config.indexer_overlap has no valid value (" +
            std::to_string(static_cast<int>(config.indexer_overlap)) + ")");
  error(config.tp_allreduce == TpAllReduce::kAuto || config.tp_allreduce == TpAllReduce::kNccl ||
            config.tp_allreduce == TpAllReduce::kPeer,
        "config.tp_allreduce has no valid value (" +
            std::to_string(static_cast<int>(config.tp_allreduce)) + ")");
  error(tp_size >= 1, "tensor parallel size must be >= 1, got " + std::to_string(tp_size));
  if (!problems.empty()) return;

  // Valid, but not what this backend runs: unsupported.
  if (config.pipeline_parallel_size != 1) {
    problems.unsupported("pipeline parallelism (pipeline_parallel_size " +
                         std::to_string(config.pipeline_parallel_size) + ") is not supported");
  }
  if (config.activation_dtype != DType::kBF16) {
    problems.unsupported(std::string("activation dtype ") + dtype_name(config.activation_dtype) +
                         " is not supported (expected bf16)");
  }
  if (config.cache_block_size != 0 && config.cache_block_size != model.block_size) {
    problems.unsupported("cache block size " + std::to_string(config.cache_block_size) +
                         " differs from the sparse block size " + std::to_string(model.block_size) +
                         " (one block must be one page)");
  }
  if (model.q_heads % tp_size != 0) {
    problems.unsupported("tensor parallel size " + std::to_string(tp_size) +
                         " does not divide q_heads " + std::to_string(model.q_heads));
  }
  if (model.kv_heads % tp_size != 0 && tp_size % model.kv_heads != 0) {
    problems.unsupported("tensor parallel size " + std::to_string(tp_size) +
                         " neither divides kv_heads " + std::to_string(model.kv_heads) +
                         " nor is a multiple of it");
  }
  if (model.intermediate % tp_size != 0) {
    problems.unsupported("tensor parallel size " + std::to_string(tp_size) +
                         " does not divide the MLP width " + std::to_string(model.intermediate));
  }
  for (int q : config.query_lens) {
    if (q > kMaxQueryLen) {
      problems.unsupported("query length " + std::to_string(q) + " is above the maximum " +
                           std::to_string(kMaxQueryLen));
    }
  }
  const int64_t max_blocks = blocks_for(config.max_context, model.block_size);
  if (max_blocks > kMaxBlockId + 1) {
    problems.unsupported("max_context " + std::to_string(config.max_context) +
                         " needs block ids above " + std::to_string(kMaxBlockId));
  } else if (config.max_requests > kMaxRequests) {
    problems.unsupported("max_requests " + std::to_string(config.max_requests) + " is above " +
                         std::to_string(kMaxRequests));
  } else if (int64_t{config.max_requests} * max_blocks > kMaxTableEntries) {
    // The fixed block-table buffers are allocated for the maxima: refuse what would not fit.
    problems.unsupported("max_requests " + std::to_string(config.max_requests) + " x max_context " +
                         std::to_string(config.max_context) + " (" + std::to_string(max_blocks) +
                         " blocks) needs block tables of more than " +
                         std::to_string(kMaxTableEntries) + " entries");
  }
  constexpr int kMaxBucketRows = 1 << 16;  // token rows of one decode step
  if (!config.token_buckets.empty() && config.token_buckets.back() > kMaxBucketRows) {
    problems.unsupported("token bucket " + std::to_string(config.token_buckets.back()) +
                         " is above " + std::to_string(kMaxBucketRows) + " rows per step");
  }
  // Context parallelism places the index heads as TP places the KV heads (checked above), so
  // there is nothing more to refuse here; the exchange itself is agreed when the ranks connect.
}

void check_readiness(const ModelConfig& config, const ModelWeights& model, Problems& problems) {
  for (const LayerWeights& layer : model.layers) {
    const std::string prefix = "layer " + std::to_string(layer.layer) + " ";
    // A dense layer has no index cache (check_weights refuses one that binds it).
    const bool dense = layer.layer >= 0 && layer.layer < config.first_sparse_layer;
    const std::pair<const TensorView*, const char*> caches[] = {
        {&layer.kv_cache.data, "kv_cache"}, {&layer.index_cache.data, "index_cache"}};
    for (const auto& [view, name] : caches) {
      if (dense && view == &layer.index_cache.data) continue;
      if (!view->defined()) {
        problems.not_ready(prefix + name + " is not bound");
      } else if (const std::string bad = invalid_extents(*view, prefix + name); !bad.empty()) {
        problems.error(ErrorCode::kInvalidArgument, bad);
      } else if (view->numel() == 0) {
        problems.not_ready(prefix + name + " is empty (" + describe(*view) + ")");
      }
    }
  }
}

namespace {

// The MoE tensors of one layer (docs/spec.md section 8): the router on every rank, this rank's
// slice of the routed and shared experts, bf16 or MXFP8.
void check_moe(const ModelConfig& m, int tp_size, const LayerWeights& w, const std::string& prefix,
               Device device, Problems& problems) {
  if (w.mlp_gate_up.defined() || w.mlp_down.defined()) {
    problems.error(ErrorCode::kInvalidArgument,
                   prefix +
                       "moe: MoE weights and the dense MLP (mlp_gate_up / mlp_down) are "
                       "exclusive; both are bound");
    return;
  }
  if (m.moe_intermediate % tp_size != 0) {
    problems.unsupported(prefix + "moe: tensor parallel size " + std::to_string(tp_size) +
                         " does not divide model.moe_intermediate " +
                         std::to_string(m.moe_intermediate));
    return;
  }
  const MoeConfig c = m.moe(tp_size);
  auto guarded = [&](const std::function<void()>& check) {
    try {
      check();
    } catch (const Error& e) {
      problems.error(ErrorCode::kInvalidArgument, prefix + e.message());
    }
  };
  if (!w.router_weight.defined()) {
    problems.error(ErrorCode::kInvalidArgument, prefix + "router_weight: expected f32" +
                                                    shape_string({c.num_experts, c.hidden}) +
                                                    " (the experts are bound), found none");
  } else {
    check_bound(problems, w.router_weight, prefix + "router_weight", {DType::kF32},
                {c.num_experts, c.hidden}, device);
  }
  if (w.router_bias.defined()) {
    check_bound(problems, w.router_bias, prefix + "router_bias", {DType::kF32}, {c.num_experts},
                device);
  }
  guarded([&] {
    validate_expert_weights(w.experts, "experts", c.num_experts, c.intermediate, c.hidden, &device);
  });
  if (c.shared_intermediate > 0) {
    guarded([&] {
      validate_expert_weights(w.shared_expert, "shared_expert", 0, c.shared_intermediate, c.hidden,
                              &device);
    });
  } else if (w.shared_expert.defined()) {
    problems.error(ErrorCode::kInvalidArgument,
                   prefix + "shared_expert: bound but model.shared_experts is 0");
  }
}

// The weights of a dense layer's MLP (the shared expert's format) and nothing of a sparse layer's
// index part or FFN.
void check_dense_layer(const ModelConfig& m, int tp_size, const LayerWeights& w,
                       const std::string& prefix, Device device, Problems& problems) {
  const std::pair<const TensorView*, const char*> sparse_only[] = {
      {&w.index_q_norm, "index_q_norm"},
      {&w.index_k_norm, "index_k_norm"},
      {&w.index_cache.data, "index_cache"},
      {&w.mlp_gate_up, "mlp_gate_up"},
      {&w.mlp_down, "mlp_down"},
      {&w.router_weight, "router_weight"},
      {&w.router_bias, "router_bias"},
      {&w.experts.w13, "experts.w13"},
      {&w.experts.w2, "experts.w2"},
      {&w.shared_expert.w13, "shared_expert.w13"},
      {&w.shared_expert.w2, "shared_expert.w2"}};
  for (const auto& [view, name] : sparse_only) {
    if (view->defined()) {
      problems.error(ErrorCode::kInvalidArgument,
                     prefix + name + ": bound on a dense layer (layers [0, " +
                         std::to_string(m.first_sparse_layer) +
                         ") have no index part and their FFN is dense_mlp), found " +
                         describe(*view));
    }
  }
  if (m.dense_intermediate == 0) {
    problems.error(ErrorCode::kInvalidArgument,
                   prefix + "dense_mlp: a dense layer is bound but model.dense_intermediate is 0");
    return;
  }
  if (m.dense_intermediate % tp_size != 0) {
    problems.unsupported(prefix + "dense_mlp: tensor parallel size " + std::to_string(tp_size) +
                         " does not divide model.dense_intermediate " +
                         std::to_string(m.dense_intermediate));
    return;
  }
  if (!w.dense_mlp.defined()) {
    problems.error(ErrorCode::kInvalidArgument,
                   prefix + "dense_mlp: not bound (expected w13 [" +
                       std::to_string(2 * (m.dense_intermediate / tp_size)) + ", " +
                       std::to_string(m.hidden) + "] and w2 [" + std::to_string(m.hidden) + ", " +
                       std::to_string(m.dense_intermediate / tp_size) + "], bf16 or MXFP8)");
    return;
  }
  try {
    validate_expert_weights(w.dense_mlp, "dense_mlp", 0, m.dense_intermediate / tp_size, m.hidden,
                            &device);
  } catch (const Error& e) {
    problems.error(ErrorCode::kInvalidArgument, prefix + e.message());
  }
}

// Layer ids as "a, b, c" (at most 8, then "...").
std::string list_ids(const std::vector<int>& ids) {
  constexpr std::size_t kListed = 8;
  std::string out;
  for (std::size_t i = 0; i < ids.size() && i < kListed; ++i) {
    out += (i ? ", " : "") + std::to_string(ids[i]);
  }
  if (ids.size() > kListed) out += ", ...";
  return out;
}

// The pages of every bound cache of one kind must agree: one block table addresses them all.
struct PageAgreement {
  const char* name;
  int64_t pages = -1;
  int layer = -1;
  void check(int64_t found, int id, const std::string& prefix, Problems& problems) {
    if (pages < 0) {
      pages = found;
      layer = id;
    } else if (found != pages) {
      problems.error(ErrorCode::kInvalidArgument,
                     prefix + name + ": expected " + std::to_string(pages) + " pages (as layer " +
                         std::to_string(layer) + "), found " + std::to_string(found));
    }
  }
};

}  // namespace

void check_weights(const RuntimeConfig& config, int tp_size, const ModelWeights& model,
                   Problems& problems, std::vector<LayerWeights>& by_layer, Device& device) {
  const ModelConfig& m = config.model;
  const SparseConfig sc = m.sparse(tp_size, config.context_parallel);
  const int first = m.first_sparse_layer;
  const int count = m.num_sparse_layers();
  std::vector<const LayerWeights*> slots(static_cast<std::size_t>(m.num_layers), nullptr);
  for (const LayerWeights& layer : model.layers) {
    if (layer.layer < 0 || layer.layer >= m.num_layers) {
      problems.error(ErrorCode::kInvalidArgument,
                     "layer " + std::to_string(layer.layer) +
                         ": not a layer of the model (expected dense layers [0, " +
                         std::to_string(first) + ") or sparse layers [" + std::to_string(first) +
                         ", " + std::to_string(m.num_layers) + "))");
      continue;
    }
    const LayerWeights*& slot = slots[static_cast<std::size_t>(layer.layer)];
    if (slot != nullptr) {
      problems.error(ErrorCode::kInvalidArgument,
                     "layer " + std::to_string(layer.layer) + ": bound twice");
      continue;
    }
    slot = &layer;
  }

  device = Device::cpu();
  for (const LayerWeights* w : slots) {
    if (w != nullptr && w->qkv_proj.defined()) {
      device = w->qkv_proj.device;
      break;
    }
  }
  // The host (index 0) or a GPU: anything else is no device a backend runs on.
  const bool known_device = (device.type == DeviceType::kCPU && device.index == 0) ||
                            (device.type == DeviceType::kCUDA && device.index >= 0);
  if (!known_device) {
    problems.error(ErrorCode::kInvalidArgument, "qkv_proj: the bound tensors are on device type " +
                                                    std::to_string(static_cast<int>(device.type)) +
                                                    " index " + std::to_string(device.index) +
                                                    ", neither the host (cpu) nor a GPU (cuda:N)");
    return;
  }

  // The dense layers: all of [0, first) or none.
  std::vector<int> dense_missing;
  for (int id = 0; id < first; ++id) {
    if (slots[static_cast<std::size_t>(id)] == nullptr) dense_missing.push_back(id);
  }
  if (static_cast<int>(dense_missing.size()) < first && !dense_missing.empty()) {
    problems.error(ErrorCode::kInvalidArgument,
                   std::to_string(first - static_cast<int>(dense_missing.size())) + " of the " +
                       std::to_string(first) +
                       " dense layers are bound (all of them or none): missing layer " +
                       list_ids(dense_missing));
  }

  const RankLayout layout = rank_layout(m, 0, tp_size, config.context_parallel);
  const int64_t hidden = m.hidden;
  const int64_t attn_width = int64_t{sc.q_heads} * sc.head_dim;
  const int64_t mlp_width = m.intermediate / tp_size;
  PageAgreement kv_pages{"kv_cache"};
  PageAgreement index_pages{"index_cache"};
  std::vector<int> missing;  // sparse layers not bound (reported once, whatever their number)
  for (int id = 0; id < m.num_layers; ++id) {
    const std::string prefix = "layer " + std::to_string(id) + " ";
    const LayerWeights* w = slots[static_cast<std::size_t>(id)];
    const bool dense = id < first;
    if (w == nullptr) {
      if (!dense) missing.push_back(id);
      continue;
    }
    // With CP the width counts every index_q head (runtime.h, LayerWeights); a dense layer has no
    // index segments.
    check_projection(problems, w->qkv_proj, w->qkv_proj_scale, prefix + "qkv_proj",
                     dense ? layout.dense_qkv_width : sc.qkv_width(), hidden, device);
    check_bound(problems, w->q_norm, prefix + "q_norm", {DType::kBF16}, {sc.head_dim}, device);
    check_bound(problems, w->k_norm, prefix + "k_norm", {DType::kBF16}, {sc.head_dim}, device);
    check_bound(problems, w->input_norm, prefix + "input_norm", {DType::kBF16}, {hidden}, device);
    check_bound(problems, w->post_attention_norm, prefix + "post_attention_norm", {DType::kBF16},
                {hidden}, device);
    check_projection(problems, w->o_proj, w->o_proj_scale, prefix + "o_proj", hidden, attn_width,
                     device);

    // The runtime binds the packed cache and float scales (what both engines read); the other
    // forms of KVCache are taken by the operations, not bound here.
    if (w->kv_cache.k.defined() || w->kv_cache.v.defined()) {
      problems.unsupported(prefix +
                           "kv_cache: the runtime binds the packed layout (KVCache::data); K / V "
                           "views are taken by the operations only");
    }
    if (w->kv_cache.k_scale_tensor.defined() || w->kv_cache.v_scale_tensor.defined()) {
      problems.unsupported(prefix +
                           "kv_cache.k_scale_tensor / v_scale_tensor: the runtime takes k_scale "
                           "and v_scale as floats");
    }
    if (check_bound(problems, w->kv_cache.data, prefix + "kv_cache",
                    {DType::kBF16, DType::kFP8E4M3},
                    {-1, sc.kv_heads, 2, sc.block_size, sc.head_dim}, device)) {
      if (!positive_finite(w->kv_cache.k_scale) || !positive_finite(w->kv_cache.v_scale)) {
        problems.error(ErrorCode::kInvalidArgument,
                       prefix + "kv_cache: k_scale and v_scale must be finite and > 0, found " +
                           std::to_string(w->kv_cache.k_scale) + " and " +
                           std::to_string(w->kv_cache.v_scale));
      }
      kv_pages.check(w->kv_cache.pages(), id, prefix, problems);
    }
    if (dense) {
      check_dense_layer(m, tp_size, *w, prefix, device, problems);
      continue;
    }

    check_bound(problems, w->index_q_norm, prefix + "index_q_norm", {DType::kBF16}, {sc.index_dim},
                device);
    check_bound(problems, w->index_k_norm, prefix + "index_k_norm", {DType::kBF16}, {sc.index_dim},
                device);
    if (check_bound(problems, w->index_cache.data, prefix + "index_cache",
                    {DType::kBF16, DType::kFP8E4M3}, {-1, sc.block_size, sc.index_dim}, device)) {
      index_pages.check(w->index_cache.pages(), id, prefix, problems);
    }
    if (w->dense_mlp.defined()) {
      problems.error(ErrorCode::kInvalidArgument,
                     prefix + "dense_mlp: bound on a sparse layer (only the dense layers [0, " +
                         std::to_string(first) + ") have it)");
    }

    const bool has_gate_up = w->mlp_gate_up.defined();
    const bool has_down = w->mlp_down.defined();
    if (has_gate_up != has_down) {
      problems.error(ErrorCode::kInvalidArgument,
                     prefix + "mlp: mlp_gate_up and mlp_down must be bound together (found " +
                         (has_gate_up ? "only mlp_gate_up" : "only mlp_down") + ")");
    } else if (has_gate_up && m.intermediate == 0) {
      problems.error(ErrorCode::kInvalidArgument,
                     prefix + "mlp: MLP weights are bound but model.intermediate is 0");
    } else if (has_gate_up) {
      check_bound(problems, w->mlp_gate_up, prefix + "mlp_gate_up", {DType::kBF16},
                  {2 * mlp_width, hidden}, device);
      check_bound(problems, w->mlp_down, prefix + "mlp_down", {DType::kBF16}, {hidden, mlp_width},
                  device);
    }
    if (w->has_moe()) check_moe(m, tp_size, *w, prefix, device, problems);
  }
  if (!missing.empty()) {
    problems.error(ErrorCode::kInvalidArgument,
                   std::to_string(missing.size()) + " of the " + std::to_string(count) +
                       " sparse layers are not bound (every sparse layer must be): layer " +
                       list_ids(missing));
  }
  if (!problems.empty()) return;
  by_layer.clear();
  for (const LayerWeights* w : slots) {
    if (w != nullptr) by_layer.push_back(*w);
  }
}

}  // namespace m3msa::runtime_detail

namespace m3msa {

LayerWeights map_tensors(const LayerWeights& layer,
                         const std::function<TensorView(const TensorView&)>& fn) {
  LayerWeights w;
  w.layer = layer.layer;
  w.qkv_proj = fn(layer.qkv_proj);
  w.qkv_proj_scale = fn(layer.qkv_proj_scale);
  w.q_norm = fn(layer.q_norm);
  w.k_norm = fn(layer.k_norm);
  w.index_q_norm = fn(layer.index_q_norm);
  w.index_k_norm = fn(layer.index_k_norm);
  w.input_norm = fn(layer.input_norm);
  w.post_attention_norm = fn(layer.post_attention_norm);
  w.o_proj = fn(layer.o_proj);
  w.o_proj_scale = fn(layer.o_proj_scale);
  w.mlp_gate_up = fn(layer.mlp_gate_up);
  w.mlp_down = fn(layer.mlp_down);
  w.router_weight = fn(layer.router_weight);
  w.router_bias = fn(layer.router_bias);
  for (auto [in, out] :
       {std::pair{&layer.experts, &w.experts}, std::pair{&layer.shared_expert, &w.shared_expert},
        std::pair{&layer.dense_mlp, &w.dense_mlp}}) {
    out->w13 = fn(in->w13);
    out->w13_scale = fn(in->w13_scale);
    out->w2 = fn(in->w2);
    out->w2_scale = fn(in->w2_scale);
  }
  w.kv_cache = {fn(layer.kv_cache.data), layer.kv_cache.k_scale, layer.kv_cache.v_scale};
  w.index_cache = {fn(layer.index_cache.data)};
  return w;
}

}  // namespace m3msa
