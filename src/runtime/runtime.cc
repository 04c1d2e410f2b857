// The runtime's lifecycle (docs/runtime.md): the staged, collectively agreed prepare, begin_step
// into fixed metadata buffers, forward_layer (its checks and bookkeeping; the layer itself runs on
// the engine prepare built: cpu_engine.cc for host tensors, gpu_engine.cc for tensors on a GPU),
// detach and close. Everything a step needs is allocated in prepare; the step path allocates
// nothing.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "m3msa/error.h"
#include "m3msa/ops.h"
#include "m3msa/runtime.h"
#include "runtime/runtime_internal.h"

namespace m3msa {

using runtime_detail::Outcome;
using runtime_detail::OutcomeKind;
using runtime_detail::Problems;

const char* prepare_result_name(PrepareResult result) {
  switch (result) {
    case PrepareResult::kSkipped: return "skipped";
    case PrepareResult::kNotReady: return "not ready";
    case PrepareResult::kActive: return "active";
    case PrepareResult::kFallback: return "fallback";
  }
  return "unknown";
}

const char* runtime_state_name(RuntimeState state) {
  switch (state) {
    case RuntimeState::kIdle: return "idle";
    case RuntimeState::kActive: return "active";
    case RuntimeState::kFallback: return "fallback";
    case RuntimeState::kClosed: return "closed";
  }
  return "unknown";
}

const char* step_refusal_name(StepRefusal refusal) {
  switch (refusal) {
    case StepRefusal::kNotActive: return "not active";
    case StepRefusal::kPrefill: return "prefill or mixed batch";
    case StepRefusal::kTooManyRequests: return "too many requests";
    case StepRefusal::kQueryLen: return "unsupported query length";
    case StepRefusal::kTokenCount: return "token count outside the buckets";
    case StepRefusal::kContextTooLong: return "context longer than max_context";
  }
  return "unknown";
}

const char* tp_allreduce_name(TpAllReduce mode) {
  switch (mode) {
    case TpAllReduce::kAuto: return "auto";
    case TpAllReduce::kNccl: return "nccl";
    case TpAllReduce::kPeer: return "peer";
  }
  return "unknown";
}

TpAllReduce parse_tp_allreduce(const std::string& text) {
  for (TpAllReduce mode : {TpAllReduce::kAuto, TpAllReduce::kNccl, TpAllReduce::kPeer}) {
    if (text == tp_allreduce_name(mode)) return mode;
  }
  M3MSA_THROW(ErrorCode::kInvalidArgument, "tp_allreduce must be auto, nccl or peer, got '", text,
              "'");
}

const char* indexer_overlap_name(IndexerOverlap mode) {
  switch (mode) {
    case IndexerOverlap::kAuto: return "auto";
    case IndexerOverlap::kOff: return "off";
    case IndexerOverlap::kOn: return "on";
  }
  return "unknown";
}

IndexerOverlap parse_indexer_overlap(const std::string& text) {
  for (IndexerOverlap mode : {IndexerOverlap::kAuto, IndexerOverlap::kOff, IndexerOverlap::kOn}) {
    if (text == indexer_overlap_name(mode)) return mode;
  }
  M3MSA_THROW(ErrorCode::kInvalidArgument, "indexer_overlap must be auto, off or on, got '", text,
              "'");
}

std::string RuntimeConfig::to_string() const {
  std::ostringstream out;
  const ModelConfig& m = model;
  out << "hidden=" << m.hidden << " layers=" << m.num_layers
      << " first_sparse=" << m.first_sparse_layer << " q_heads=" << m.q_heads
      << " kv_heads=" << m.kv_heads << " head_dim=" << m.head_dim
      << " index_heads=" << m.index_heads << " index_dim=" << m.index_dim
      << " block_size=" << m.block_size << " topk=" << m.topk << " init=" << m.init_blocks
      << " local=" << m.local_blocks << " rope_dim=" << m.rope_dim << " theta=" << m.rope_theta
      << " eps=" << m.rms_eps << " intermediate=" << m.intermediate << " experts=" << m.num_experts
      << " experts_per_token=" << m.experts_per_token << " moe_intermediate=" << m.moe_intermediate
      << " shared_experts=" << m.shared_experts << " dense_intermediate=" << m.dense_intermediate
      << " routed_scaling=" << m.routed_scaling << " activation_limit=" << m.activation_limit
      << " pp=" << pipeline_parallel_size << " act=" << dtype_name(activation_dtype)
      << " cache_block=" << cache_block_size << " buckets=";
  for (std::size_t i = 0; i < token_buckets.size(); ++i) out << (i ? "," : "") << token_buckets[i];
  out << " q_lens=";
  for (std::size_t i = 0; i < query_lens.size(); ++i) out << (i ? "," : "") << query_lens[i];
  out << " max_requests=" << max_requests << " max_context=" << max_context
      << " cp=" << (context_parallel ? 1 : 0) << " cp_transport=" << static_cast<int>(cp_transport)
      << " cp_spin_us=" << cp_spin_budget.count() << " share_period=" << selection_share_period
      << " tp_allreduce=" << tp_allreduce_name(tp_allreduce) << " swiglu_limit=" << swiglu_limit;
  return out.str();
}

std::string RuntimeStats::to_json() const {
  nlohmann::json j;
  j["state"] = runtime_state_name(state);
  j["backend"] = backend;
  j["tp_rank"] = tp_rank;
  j["tp_size"] = tp_size;
  j["prepare_calls"] = prepare_calls;
  j["prepare_skipped"] = prepare_skipped;
  j["prepare_not_ready"] = prepare_not_ready;
  j["fallback_reasons"] = nlohmann::json::object();
  for (const auto& [reason, count] : fallback_reasons) j["fallback_reasons"][reason] = count;
  j["refusals"] = nlohmann::json::object();
  for (int i = 0; i < kNumStepRefusals; ++i) {
    j["refusals"][step_refusal_name(static_cast<StepRefusal>(i))] =
        refusals[static_cast<std::size_t>(i)];
  }
  j["last_refusal"] = last_refusal;
  j["steps_accepted"] = steps_accepted;
  j["buckets"] = buckets;
  j["bucket_steps"] = bucket_steps;
  j["graphs_captured"] = graphs_captured;
  j["graph_replays"] = graph_replays;
  j["launches_per_layer"] = launches_per_layer;
  j["context_parallel"] = context_parallel;
  j["tp_allreduce"] = tp_allreduce;
  j["indexer_layers_run"] = indexer_layers_run;
  j["sharing_layers_run"] = sharing_layers_run;
  j["bound_layers"] = bound_layers;
  j["layers_run"] = layers_run;
  return j.dump();
}

namespace {

void default_log(const std::string& line) {
  std::cerr << line << '\n';
}

// Runs one stage's check on this rank; nothing it throws escapes before the agreement, so a
// failing rank still arrives at the all-gather its peers wait in.
template <typename Check>
Outcome run_stage(Check&& check) {
  try {
    Problems problems;
    check(problems);
    return problems.outcome();
  } catch (const Error& e) {
    Outcome out;
    out.kind =
        e.code() == ErrorCode::kUnsupported ? OutcomeKind::kUnsupported : OutcomeKind::kError;
    out.code = e.code();
    out.message = e.message();
    return out;
  } catch (const std::exception& e) {
    Outcome out;
    out.kind = OutcomeKind::kError;
    out.code = ErrorCode::kInternal;
    out.message = e.what();
    return out;
  }
}

std::string list_outcomes(const std::vector<Outcome>& outcomes) {
  std::string text;
  for (std::size_t r = 0; r < outcomes.size(); ++r) {
    const Outcome& o = outcomes[r];
    text += (r ? "; " : "") + std::string("rank ") + std::to_string(r) + ": ";
    if (o.kind == OutcomeKind::kError) {
      text += std::string(error_code_name(o.code)) + ": " + o.message;
    } else if (o.kind == OutcomeKind::kOk) {
      text += "ok";
    } else {
      text += std::string(runtime_detail::outcome_kind_name(o.kind)) + ": " + o.message;
    }
  }
  return text;
}

}  // namespace

struct Runtime::Impl {
  LogSink log;
  RuntimeState state = RuntimeState::kIdle;
  RuntimeStats stats;

  // Bound at prepare (views only; the engine owns the storage).
  Communicator* comm = nullptr;
  RuntimeConfig config;
  SparseConfig sparse;
  std::vector<LayerWeights> layers;  // ascending; index: layer - first_layer
  int first_layer = 0;               // 0 with the dense layers bound, else first_sparse_layer
  RankLayout layout;
  int max_rows = 0;
  int64_t max_blocks = 0;
  Device device = Device::cpu();                   // where the bound tensors are
  std::unique_ptr<runtime_detail::CpuEngine> cpu;  // the CPU backend's host state
  std::unique_ptr<runtime_detail::GpuEngine> gpu;  // the CUDA backend's device state
  int64_t last_rows = 0;                           // rows of the last forward_layer

  BatchMeta step;  // the open step's metadata: views over the engine's fixed buffers
  bool step_open = false;
  int selection_layer = -1;  // the last layer of the open step that ran its indexer

  HostTensor meta_positions;  // [max_rows] i64: rows' positions from host metadata
  int64_t kv_pages = 0;       // pages of every bound KV cache / index-K cache
  int64_t index_pages = 0;

  void emit(const std::string& line) const {
    const std::string text = "m3msa runtime (rank " + std::to_string(stats.tp_rank) + "): " + line;
    if (log) {
      log(text);
    } else {
      default_log(text);
    }
  }

  std::vector<Outcome> agree(const std::string& tag, const Outcome& mine) {
    const std::vector<ByteRecord> records = comm->all_gather(runtime_detail::encode(mine), tag);
    std::vector<Outcome> all;
    all.reserve(records.size());
    for (std::size_t r = 0; r < records.size(); ++r) {
      all.push_back(runtime_detail::decode(records[r], static_cast<int>(r)));
    }
    return all;
  }

  // Every rank sees the same outcomes and so reaches the same decision. Returns the worst kind;
  // throws the one error every rank raises when any rank failed for a reason other than
  // "unsupported"; records and logs the fallback reasons.
  OutcomeKind decide(const std::string& stage, const std::vector<Outcome>& all) {
    OutcomeKind worst = OutcomeKind::kOk;
    const Outcome* first_error = nullptr;
    for (const Outcome& o : all) {
      if (static_cast<int>(o.kind) > static_cast<int>(worst)) worst = o.kind;
      if (o.kind == OutcomeKind::kError && first_error == nullptr) first_error = &o;
    }
    if (first_error != nullptr) {
      throw Error(first_error->code,
                  "prepare failed at stage '" + stage + "': " + list_outcomes(all), __FILE__,
                  __LINE__, comm->rank());
    }
    if (worst == OutcomeKind::kUnsupported) {
      std::string reasons;
      for (std::size_t r = 0; r < all.size(); ++r) {
        if (all[r].kind != OutcomeKind::kUnsupported) continue;
        const std::string reason =
            "rank " + std::to_string(r) + ": " + stage + ": " + all[r].message;
        ++stats.fallback_reasons[reason];
        reasons += (reasons.empty() ? "" : "; ") + reason;
      }
      emit("falling back to native execution for good: " + reasons);
    } else if (worst == OutcomeKind::kNotReady) {
      std::string reasons;
      for (std::size_t r = 0; r < all.size(); ++r) {
        if (all[r].kind != OutcomeKind::kNotReady) continue;
        reasons +=
            (reasons.empty() ? "rank " : "; rank ") + std::to_string(r) + ": " + all[r].message;
      }
      emit("not ready, retrying on a later step: " + reasons);
    }
    return worst;
  }

  void release() {
    gpu.reset();  // synchronizes its stream, then frees the device buffers
    cpu.reset();
    device = Device::cpu();
    last_rows = 0;
    layers.clear();
    meta_positions = {};
    step = {};
    step_open = false;
    stats.bound_layers.clear();
  }

  bool refuse(StepRefusal why, const std::string& detail) {
    ++stats.refusals[static_cast<std::size_t>(why)];
    stats.last_refusal = std::string(step_refusal_name(why)) + ": " + detail;
    step_open = false;
    return false;
  }
};

Runtime::Runtime(LogSink log) : impl_(std::make_unique<Impl>()) {
  impl_->log = std::move(log);
}

Runtime::~Runtime() = default;

RuntimeState Runtime::state() const {
  return impl_->state;
}

RuntimeStats Runtime::stats() const {
  RuntimeStats out = impl_->stats;
  out.state = impl_->state;
  return out;
}

const BatchMeta& Runtime::step_metadata() const {
  return impl_->step;
}

Device Runtime::device() const {
  return impl_->device;
}

void* Runtime::cuda_stream() const {
  return impl_->gpu ? impl_->gpu->stream() : nullptr;
}

const RuntimeConfig& Runtime::config() const {
  return impl_->config;
}

Runtime::LayerTrace Runtime::last_layer_trace() const {
  const Impl& s = *impl_;
  const int64_t rows = s.last_rows;
  if (s.gpu) return s.gpu->trace(rows);
  if (s.state != RuntimeState::kActive || !s.cpu) return {};
  return s.cpu->trace(rows);
}

void Runtime::note_graph_captured() {
  ++impl_->stats.graphs_captured;
}

void Runtime::note_graph_replayed(int layers) {
  ++impl_->stats.graph_replays;
  impl_->stats.layers_run += layers;
}

void Runtime::refresh_device_plans() {
  if (impl_->gpu) impl_->gpu->refresh_plans();
}

PrepareResult Runtime::prepare(const ModelWeights& model, const RuntimeConfig& config,
                               Communicator& comm, const StepContext& step) {
  Impl& s = *impl_;
  M3MSA_CHECK_ARG(!step.capturing,
                  "prepare: called while a stream is capturing; prepare runs only in an eager "
                  "step (docs/runtime.md lifecycle 1)");
  M3MSA_CHECK_ARG(!runtime_detail::stream_is_capturing(config.cuda_stream),
                  "prepare: config.cuda_stream is capturing a graph; prepare runs only in an "
                  "eager step (docs/runtime.md lifecycle 1)");
  if (s.state == RuntimeState::kFallback) return PrepareResult::kFallback;  // final
  if (s.state == RuntimeState::kActive) return PrepareResult::kActive;
  if (!step.has_metadata) {
    ++s.stats.prepare_skipped;
    return PrepareResult::kSkipped;
  }
  ++s.stats.prepare_calls;
  s.comm = &comm;
  s.stats.tp_rank = comm.rank();
  s.stats.tp_size = comm.world_size();
  const int tp = comm.world_size();

  // Stage 1: model support, plus the configuration every rank must share.
  Outcome mine = run_stage(
      [&](Problems& problems) { runtime_detail::check_model_support(config, tp, problems); });
  mine.fingerprint = config.to_string();
  std::vector<Outcome> all = s.agree("prepare/model support", mine);
  OutcomeKind decision = s.decide("model support", all);
  if (decision == OutcomeKind::kUnsupported) {
    s.state = RuntimeState::kFallback;
    return PrepareResult::kFallback;
  }
  for (std::size_t r = 1; r < all.size(); ++r) {
    if (all[r].fingerprint == all[0].fingerprint) continue;
    std::string text = "prepare failed at stage 'model support': the ranks' configurations differ:";
    for (std::size_t i = 0; i < all.size(); ++i) {
      text += (i ? "; rank " : " rank ") + std::to_string(i) + ": " + all[i].fingerprint;
    }
    throw Error(ErrorCode::kInvalidArgument, text, __FILE__, __LINE__, comm.rank());
  }

  // Stage 2: readiness (temporary profiling caches are a normal case: retry later).
  mine = run_stage(
      [&](Problems& problems) { runtime_detail::check_readiness(config.model, model, problems); });
  all = s.agree("prepare/readiness", mine);
  decision = s.decide("readiness", all);
  if (decision == OutcomeKind::kNotReady) {
    ++s.stats.prepare_not_ready;
    return PrepareResult::kNotReady;
  }

  // Stage 3: weight support; binds views and allocates every buffer a step needs.
  std::vector<LayerWeights> bound;
  mine = run_stage([&](Problems& problems) {
    Device device = Device::cpu();
    runtime_detail::check_weights(config, tp, model, problems, bound, device);
    if (!problems.empty()) return;
    const bool cuda = device.type == DeviceType::kCUDA;
    if (cuda) {
      runtime_detail::check_gpu_support(config, tp, comm, bound, device, problems);
      if (!problems.empty()) return;
    }
    s.config = config;
    s.sparse = config.model.sparse(tp, config.context_parallel);
    s.layout = rank_layout(config.model, comm.rank(), tp, config.context_parallel);
    s.layers = bound;
    s.first_layer = bound.front().layer;
    s.kv_pages = bound.front().kv_cache.pages();  // every layer's (check_weights)
    // Every sparse layer's; the dense layers have no index cache.
    s.index_pages = bound[static_cast<std::size_t>(config.model.first_sparse_layer - s.first_layer)]
                        .index_cache.pages();
    s.meta_positions = HostTensor(DType::kI64, {int64_t{config.token_buckets.back()}});
    s.device = device;
    s.stats.backend = cuda ? "cuda" : "cpu";
    s.max_rows = config.token_buckets.back();
    s.max_blocks = runtime_detail::blocks_for(config.max_context, config.model.block_size);
    if (cuda) {
      s.gpu = runtime_detail::make_gpu_engine(config, tp, comm, bound, device);
    } else {
      s.cpu = std::make_unique<runtime_detail::CpuEngine>(config, s.layout, comm, bound);
    }
  });
  // The stages after binding agree like the others, and release what was bound on any
  // outcome but ok (an error on every rank, or a unanimous fallback).
  auto agreed_or_released = [&](const std::string& stage) {
    try {
      all = s.agree("prepare/" + stage, mine);
      decision = s.decide(stage, all);
    } catch (...) {
      s.release();
      throw;
    }
    if (decision != OutcomeKind::kUnsupported) return true;
    s.release();
    s.state = RuntimeState::kFallback;
    return false;
  };
  if (!agreed_or_released("weight support")) return PrepareResult::kFallback;

  // Stage 4: connect (every rank is here: the weight stage was agreed). The CUDA backend agrees
  // on its TP all-reduce and CP exchange and builds them (collectives); the CPU backend's
  // exchanges go through the communicator and need no setup.
  mine = run_stage([&](Problems& problems) {
    if (s.gpu) s.gpu->connect(comm, problems);
  });
  if (!agreed_or_released("connect")) return PrepareResult::kFallback;
  s.stats.context_parallel = config.context_parallel;
  s.stats.tp_allreduce = s.gpu ? s.gpu->tp_allreduce_name() : tp > 1 ? "communicator" : "none";
  s.stats.buckets = config.token_buckets;
  s.stats.bucket_steps.assign(config.token_buckets.size(), 0);
  s.stats.bound_layers.clear();
  for (const LayerWeights& w : s.layers) s.stats.bound_layers.push_back(w.layer);
  s.state = RuntimeState::kActive;
  return PrepareResult::kActive;
}

bool Runtime::begin_step(const BatchMeta& batch) {
  return begin_step(batch, batch.num_reqs);
}

bool Runtime::begin_step(const BatchMeta& batch, int pad_to_reqs) {
  Impl& s = *impl_;
  s.step_open = false;
  if (s.state != RuntimeState::kActive) {
    return s.refuse(StepRefusal::kNotActive,
                    std::string("the runtime is ") + runtime_state_name(s.state));
  }
  if (batch.kind != BatchKind::kDecode) {
    return s.refuse(StepRefusal::kPrefill, "the batch is not a pure decode batch");
  }
  // Host metadata everywhere; the CUDA backend also takes metadata on its own device.
  const Device meta_device = batch.seq_lens.defined() ? batch.seq_lens.device : Device::cpu();
  M3MSA_CHECK_ARG(meta_device.type == DeviceType::kCPU || meta_device == s.device,
                  "begin_step: the metadata is on ", device_name(meta_device),
                  "; expected host tensors", (s.gpu ? " or tensors on " : ""),
                  (s.gpu ? device_name(s.device) : std::string()));
  validate_batch_shapes(batch, meta_device);
  M3MSA_CHECK_ARG(pad_to_reqs >= batch.num_reqs, "begin_step: pad_to_reqs ", pad_to_reqs,
                  " is below num_reqs ", batch.num_reqs);
  M3MSA_CHECK_ARG(batch.index_block_table.defined() && batch.kv_block_table.defined(),
                  "begin_step: both block tables are required");
  M3MSA_CHECK_ARG(batch.slot_mapping.defined() && batch.index_slot_mapping.defined(),
                  "begin_step: both slot mappings are required");
  const RuntimeConfig& c = s.config;
  if (batch.num_reqs > c.max_requests) {
    return s.refuse(StepRefusal::kTooManyRequests, "num_reqs " + std::to_string(batch.num_reqs) +
                                                       " > max_requests " +
                                                       std::to_string(c.max_requests));
  }
  if (std::find(c.query_lens.begin(), c.query_lens.end(), batch.q_len) == c.query_lens.end()) {
    return s.refuse(StepRefusal::kQueryLen, "q_len " + std::to_string(batch.q_len));
  }
  const int64_t rows = batch.num_rows();
  const auto bucket = std::lower_bound(c.token_buckets.begin(), c.token_buckets.end(), rows);
  if (rows == 0 || bucket == c.token_buckets.end()) {
    return s.refuse(StepRefusal::kTokenCount, std::to_string(rows) + " tokens (largest bucket " +
                                                  std::to_string(c.token_buckets.back()) + ")");
  }
  const int n = batch.num_reqs;
  const int pad = pad_to_reqs;
  const int64_t padded_rows = int64_t{pad} * batch.q_len;
  M3MSA_CHECK_ARG(pad <= c.max_requests && padded_rows <= s.max_rows, "begin_step: pad_to_reqs ",
                  pad, " x q_len ", batch.q_len, " exceeds max_requests ", c.max_requests,
                  " or the largest token bucket ", s.max_rows);
  // Host seq_lens can be checked here; device metadata cannot be read on the step path, so a
  // device backend relies on the engine's maximum model length being <= max_context instead.
  if (meta_device.type == DeviceType::kCPU) {
    const int32_t* lens = batch.seq_lens.ptr<const int32_t>();
    for (int r = 0; r < n; ++r) {
      if (lens[r] > c.max_context) {
        return s.refuse(StepRefusal::kContextTooLong,
                        "request " + std::to_string(r) + " has " + std::to_string(lens[r]) +
                            " tokens > max_context " + std::to_string(c.max_context));
      }
    }
  }

  if (meta_device.type == DeviceType::kCPU) {
    // What the layers rely on, before the step is accepted (device metadata cannot be read on
    // the step path): lengths, table entries and slots inside the bound caches, and no two live
    // rows writing one slot.
    validate_batch_contents(batch, s.sparse, s.index_pages, s.kv_pages);
    const std::vector<RowPosition> where = row_positions(batch);
    int64_t* pos = s.meta_positions.ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) pos[r] = where[static_cast<std::size_t>(r)].pos;
    const TensorView positions = TensorView::contiguous(pos, DType::kI64, {rows});
    check_unique_slots(batch.slot_mapping, positions, "batch.slot_mapping");
    check_unique_slots(batch.index_slot_mapping, positions, "batch.index_slot_mapping");
  }
  if (s.gpu) {
    s.step = s.gpu->stage_step(batch, pad);
  } else {
    s.step = s.cpu->stage_step(batch, pad);
  }
  ++s.stats.steps_accepted;
  ++s.stats.bucket_steps[static_cast<std::size_t>(bucket - c.token_buckets.begin())];
  s.step_open = true;
  s.selection_layer = -1;
  return true;
}

void Runtime::forward_layer(int layer, TensorView hidden, TensorView residual,
                            TensorView positions) {
  Impl& s = *impl_;
  M3MSA_CHECK_ARG(s.state == RuntimeState::kActive, "forward_layer: the runtime is ",
                  runtime_state_name(s.state), ", not active");
  M3MSA_CHECK_ARG(s.step_open,
                  "forward_layer: no accepted step (begin_step must return true "
                  "first)");
  const ModelConfig& m = s.config.model;
  M3MSA_CHECK_ARG(layer >= 0 && layer < m.num_layers, "forward_layer: layer ", layer,
                  " is not a layer of the model [0, ", m.num_layers, ")");
  M3MSA_CHECK_ARG(layer >= s.first_layer, "forward_layer: layer ", layer, " is a dense layer [0, ",
                  m.first_sparse_layer,
                  ") and the dense layers are not bound (the engine runs them)");
  const LayerWeights& w = s.layers[static_cast<std::size_t>(layer - s.first_layer)];
  const bool dense = layer < m.first_sparse_layer;
  const int64_t rows = s.step.num_rows();
  const int64_t H = m.hidden;
  check_tensor(hidden, "forward_layer: hidden", DType::kBF16, {rows, H});
  check_tensor(residual, "forward_layer: residual", DType::kBF16, {rows, H});
  check_tensor(positions, "forward_layer: positions", DType::kI64, {rows});
  M3MSA_CHECK_ARG(hidden.data != residual.data || rows == 0,
                  "forward_layer: hidden and residual must be distinct buffers");
  for (const auto& [view, name] : {std::pair{hidden, "forward_layer: hidden"},
                                   {residual, "forward_layer: residual"},
                                   {positions, "forward_layer: positions"}}) {
    check_device(view, name, s.device);
    M3MSA_CHECK_ARG(view.is_contiguous(), name, " must be contiguous, got ", describe(view));
  }
  // Cross-layer selection sharing (docs/spec.md section 7): ordinals that are not multiples of the
  // period attend with the selection of the step's last layer that ran its indexer. A dense layer
  // neither selects nor uses a selection.
  const int period = s.config.selection_share_period;
  const bool run_indexer = !dense && (layer - m.first_sparse_layer) % period == 0;
  M3MSA_CHECK_ARG(dense || run_indexer || s.selection_layer >= 0, "forward_layer: layer ", layer,
                  " shares the selection of the last layer that ran its indexer (period ", period,
                  "), but no such layer ran in this step since begin_step");
  s.last_rows = rows;
  if (s.gpu) {
    for (const auto& [view, name] :
         {std::pair{hidden, "forward_layer: hidden"}, {residual, "forward_layer: residual"}}) {
      M3MSA_CHECK_ARG(reinterpret_cast<uintptr_t>(view.data) % 16 == 0, name,
                      " must be 16-byte aligned on the CUDA backend, got address ", view.data);
    }
    s.gpu->forward_layer(w, s.step, hidden, residual, positions, run_indexer);
    if (run_indexer) s.selection_layer = layer;
    s.stats.launches_per_layer = s.gpu->launches_per_layer();
    // Inside a capture nothing ran yet: replays are counted by StepGraphs.
    if (!runtime_detail::stream_is_capturing(s.gpu->stream())) {
      ++s.stats.layers_run;
      if (!dense) ++(run_indexer ? s.stats.indexer_layers_run : s.stats.sharing_layers_run);
    }
    return;
  }
  s.cpu->forward_layer(layer, w, s.step, hidden, residual, positions, run_indexer, s.stats,
                       s.selection_layer);
}

void Runtime::check() {
  Impl& s = *impl_;
  if (s.state != RuntimeState::kActive || !s.gpu) return;
  s.gpu->check();
}

void Runtime::detach(const std::vector<LayerCaches>& replacement) {
  Impl& s = *impl_;
  Outcome mine = run_stage([&](Problems& problems) {
    for (const LayerCaches& c : replacement) {
      const std::string prefix = "layer " + std::to_string(c.layer) + " ";
      bool countable = true;
      for (const auto& [view, name] :
           {std::pair{&c.kv_cache.data, "kv_cache"}, {&c.index_cache.data, "index_cache"}}) {
        if (const std::string bad = runtime_detail::invalid_extents(*view, prefix + name);
            !bad.empty()) {
          problems.error(ErrorCode::kInvalidArgument, "replacement " + bad);
          countable = false;
        }
      }
      if (!countable) continue;
      if (c.kv_cache.data.numel() > 0) {
        problems.error(ErrorCode::kInvalidArgument,
                       prefix + "kv_cache: the replacement must be empty storage, found " +
                           describe(c.kv_cache.data));
      }
      if (c.index_cache.data.numel() > 0) {
        problems.error(ErrorCode::kInvalidArgument,
                       prefix + "index_cache: the replacement must be empty storage, found " +
                           describe(c.index_cache.data));
      }
    }
  });
  if (s.state == RuntimeState::kActive) {
    // All ranks detach together: agree, so a bad replacement on one rank fails every rank. When
    // the agreement itself fails (a peer gone or out of lockstep) the runtime still lets go of
    // the caches the engine is about to free, as close() does.
    std::vector<Outcome> all;
    try {
      if (s.gpu) s.gpu->drain(*s.comm);
      all = s.agree("detach", mine);
    } catch (...) {
      s.release();
      s.state = RuntimeState::kClosed;
      throw;
    }
    for (const Outcome& o : all) {
      if (o.kind != OutcomeKind::kOk) {
        throw Error(o.code, "detach refused: " + list_outcomes(all), __FILE__, __LINE__,
                    s.comm->rank());
      }
    }
  } else if (mine.kind != OutcomeKind::kOk) {
    throw Error(mine.code, "detach refused: " + mine.message, __FILE__, __LINE__,
                s.comm ? s.comm->rank() : -1);
  }
  close();
}

void Runtime::close() {
  Impl& s = *impl_;
  if (s.state != RuntimeState::kActive) return;  // idempotent; a fallback stays a fallback
  // Agree that every rank ran the same steps and layers (the lockstep rule), then release even if
  // the agreement fails: close must leave nothing bound.
  Outcome mine;
  mine.fingerprint = "steps_accepted=" + std::to_string(s.stats.steps_accepted) +
                     " layers_run=" + std::to_string(s.stats.layers_run);
  std::vector<Outcome> all;
  try {
    if (s.gpu) s.gpu->drain(*s.comm);
    all = s.agree("close", mine);
  } catch (...) {
    s.release();
    s.state = RuntimeState::kClosed;
    throw;
  }
  s.release();
  s.state = RuntimeState::kClosed;
  for (const Outcome& o : all) {
    if (o.fingerprint != all[0].fingerprint) {
      std::string text = "close: the ranks ran different work (out of lockstep):";
      for (std::size_t r = 0; r < all.size(); ++r) {
        text += (r ? "; rank " : " rank ") + std::to_string(r) + ": " + all[r].fingerprint;
      }
      throw Error(ErrorCode::kInternal, text, __FILE__, __LINE__, s.comm->rank());
    }
  }
}

}  // namespace m3msa
