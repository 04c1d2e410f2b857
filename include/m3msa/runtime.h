// The fused decode runtime ("mono", ../shared/docs/mono.md is the contract): an engine hands each
// sparse layer of the decode steps it can serve to this runtime.
//
// Lifecycle (every rank of the TP group calls the same functions in the same order):
//   prepare(model, config, comm, step)  eager steps only; staged, every stage agreed by all ranks:
//       no metadata -> kSkipped; model support -> readiness -> weight support; unanimous
//       "unsupported" -> kFallback on every rank (final until a new Runtime), any other failure ->
//       the same Error on every rank listing every rank's message; a rank not ready -> kNotReady
//       everywhere (retry on a later step); otherwise kActive.
//   begin_step(batch)   per step; false (a counted refusal) for shapes outside the buckets,
//       otherwise the metadata is copied into fixed buffers whose addresses never change.
//   forward_layer(i, hidden, residual, positions)   one sparse layer, in place.
//   detach(replacement) all ranks; the replacement cache storage must be empty; then close().
//   close()             idempotent, agreed across ranks, never run from the destructor.
//
// The CPU backend (this file's implementation) runs forward_layer with the CPU reference
// (cpu::preprocess / select_topk / sparse_attention) and plain fp32-accumulating matmuls, and the
// TP reduce through the Communicator. Its numerics (the contract the GPU path approximates):
//   x   = bf16(hidden + residual)                               (the new residual)
//   h   = bf16(gemma_rmsnorm(x, input_norm))                     fp32 math
//   qkv = bf16(h @ qkv_proj^T [* scale])                         fp32 accumulation, k in order
//   q, index_q, caches <- cpu::preprocess; topk <- cpu::select_topk; a <- cpu::sparse_attention
//   o   = bf16(all_reduce_sum_fp32(a @ o_proj^T [* scale]))      ranks added in rank order
//   x2  = bf16(x + o);  h2 = bf16(gemma_rmsnorm(x2, post_attention_norm))
//   without MLP weights: hidden <- h2, residual <- x2 (the engine runs the FFN on h2)
//   with MLP weights:    g|u = bf16(h2 @ mlp_gate_up^T); g = min(g, limit);
//                        u = clamp(u, -limit, limit); act = bf16(g * sigmoid(1.702 g) * (u + 1));
//                        hidden <- bf16(all_reduce_sum_fp32(act @ mlp_down^T)), residual <- x2
//   (the engine's convention: the next layer's input is hidden + residual).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "m3msa/batch.h"
#include "m3msa/cache.h"
#include "m3msa/comm.h"
#include "m3msa/config.h"
#include "m3msa/tensor.h"

namespace m3msa {

// What every rank must agree on (the host agreement compares to_string() across ranks), plus a
// few rank-local knobs marked as such.
struct RuntimeConfig {
  ModelConfig model;
  int pipeline_parallel_size = 1;         // only 1 is supported (PP > 1: unsupported)
  DType activation_dtype = DType::kBF16;  // only bf16 is supported
  int cache_block_size = 0;  // tokens per page of the engine's caches; 0: model.block_size
  std::vector<int> token_buckets{1, 2, 4, 8, 16};  // decode rows (num_reqs * q_len) served
  std::vector<int> query_lens{1, 2, 4};            // decode query lengths served
  int max_requests = 16;
  int64_t max_context = 131072;    // tokens; sizes the fixed block-table buffers
  bool context_parallel = false;   // CP indexer (cp.md); not on the CPU backend yet
  int selection_share_period = 1;  // spec.md section 7; only 1 on the CPU backend yet
  float swiglu_limit = 7.0f;       // clamping limit of the SwiGLU-OAI MLP
  // Rank-local: CPU threads one rank uses (0 = hardware concurrency). Not agreed.
  int threads = 1;

  // The agreed fields, one line: what the host agreement compares.
  std::string to_string() const;
};

// One sparse layer's tensors for this rank, bound without copies (views stay the engine's).
// With P = TP ranks, sc = model.sparse(P): W = sc.qkv_width(), QH = sc.q_heads, KVH = sc.kv_heads.
// The index-K head is replicated (every rank projects it and holds the whole index-K cache).
struct LayerWeights {
  int layer = -1;             // model layer id in [first_sparse_layer, num_layers)
  TensorView qkv_proj;        // [W, hidden] bf16 | fp8_e4m3, rows [q | k | v | index_q | index_k]
  TensorView qkv_proj_scale;  // [W] f32 per output channel, fp8 only (value = stored * scale)
  TensorView q_norm;          // [head_dim] bf16
  TensorView k_norm;          // [head_dim] bf16
  TensorView index_q_norm;    // [index_dim] bf16
  TensorView index_k_norm;    // [index_dim] bf16
  TensorView input_norm;      // [hidden] bf16, Gemma RMSNorm weights (y = x * rms * (1 + w))
  TensorView post_attention_norm;  // [hidden] bf16
  TensorView o_proj;               // [hidden, QH * head_dim] bf16 | fp8_e4m3 (this rank's columns)
  TensorView o_proj_scale;         // [hidden] f32 per output channel, fp8 only
  KVCache kv_cache;                // [pages, KVH, 2, block_size, head_dim] bf16 | fp8 + k/v scales
  IndexCache index_cache;          // [pages, block_size, index_dim] bf16 | fp8
  // Optional dense SwiGLU-OAI MLP (the demo's FFN stand-in): both or neither.
  // I = model.intermediate / P.
  TensorView mlp_gate_up;  // [2 * I, hidden] bf16, rows [gate | up]
  TensorView mlp_down;     // [hidden, I] bf16 (this rank's columns)
};

struct ModelWeights {
  std::vector<LayerWeights> layers;  // exactly one entry per sparse layer, any order
};

// New cache storage handed to detach(): it must be empty (not given, or zero elements).
struct LayerCaches {
  int layer = -1;
  KVCache kv_cache;
  IndexCache index_cache;
};

// The engine's state at a prepare call.
struct StepContext {
  bool capturing = false;    // a stream is capturing a graph: prepare is an error
  bool has_metadata = true;  // false in a memory-profiling pass: prepare does nothing
};

enum class PrepareResult : int {
  kSkipped = 0,   // no batch metadata: nothing done
  kNotReady = 1,  // some rank's caches are not bound yet: retry on a later step
  kActive = 2,    // bound; begin_step / forward_layer may run
  kFallback = 3,  // unsupported on every failing rank: the engine runs natively, for good
};
const char* prepare_result_name(PrepareResult result);

enum class RuntimeState : int {
  kIdle = 0,  // not prepared (never, or not ready yet)
  kActive = 1,
  kFallback = 2,  // final for this Runtime object
  kClosed = 3,    // closed or detached; the next prepare binds afresh
};
const char* runtime_state_name(RuntimeState state);

// Why begin_step said "native step".
enum class StepRefusal : int {
  kNotActive = 0,        // the runtime is not active (not prepared, fallen back or closed)
  kPrefill = 1,          // a prefill or mixed batch
  kTooManyRequests = 2,  // num_reqs > max_requests
  kQueryLen = 3,         // q_len not in query_lens
  kTokenCount = 4,       // num_reqs * q_len is 0 or above the largest bucket
  kContextTooLong =
      5,  // a request longer than max_context (checked where seq_lens are on the host)
};
inline constexpr int kNumStepRefusals = 6;
const char* step_refusal_name(StepRefusal refusal);

struct RuntimeStats {
  RuntimeState state = RuntimeState::kIdle;
  std::string backend = "cpu";
  int tp_rank = 0;
  int tp_size = 1;
  int64_t prepare_calls = 0;      // calls that got past the capture check
  int64_t prepare_skipped = 0;    // no metadata
  int64_t prepare_not_ready = 0;  // readiness retries
  // Fallback reasons of every failing rank ("rank 1: model support: ..."), with how many
  // prepare decisions each caused (a fallback is final, so 1 each unless the engine rebinds).
  std::map<std::string, int64_t> fallback_reasons;
  std::array<int64_t, kNumStepRefusals> refusals{};  // indexed by StepRefusal
  std::string last_refusal;                          // the last refusal, with its numbers
  int64_t steps_accepted = 0;
  std::vector<int> buckets;           // the token buckets
  std::vector<int64_t> bucket_steps;  // accepted steps per bucket
  int64_t graphs_captured = 0;        // 0 on the CPU backend
  int64_t launches_per_layer = 0;     // 0 on the CPU backend
  std::vector<int> bound_layers;      // ascending
  int64_t layers_run = 0;

  int64_t refusal_count(StepRefusal refusal) const {
    return refusals[static_cast<std::size_t>(refusal)];
  }
  std::string to_json() const;
};

// One rank's runtime. Not thread-safe: one thread drives one rank.
class Runtime {
 public:
  using LogSink = std::function<void(const std::string&)>;
  // `log` receives fallback decisions and readiness retries (default: one line on stderr).
  explicit Runtime(LogSink log = {});
  // Frees host memory only: never runs a collective (call close() first on every rank).
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  // See the lifecycle above. `comm` must outlive the runtime until close(); its world size is
  // the TP size and its rank this rank. Errors (kInvalidArgument / kInternal / kTimeout) carry
  // every rank's message and leave the runtime idle. An active runtime returns kActive at once
  // (detach first to bind new caches); a fallen-back one returns kFallback at once.
  PrepareResult prepare(const ModelWeights& model, const RuntimeConfig& config, Communicator& comm,
                        const StepContext& step = {});

  // Decode metadata of one step (host tensors on the CPU backend). Returns false and counts the
  // reason for a step the runtime does not serve; throws for malformed metadata.
  bool begin_step(const BatchMeta& batch);

  // Runs sparse layer `layer` of the accepted step, in place:
  //   hidden   [rows, hidden] bf16: in, the layer input; out, h2 (or the MLP output)
  //   residual [rows, hidden] bf16: in, the residual (zeros for the first layer); out, x2
  //   positions [rows] i64: each row's position (< 0: padding row)
  // rows = num_reqs * q_len of the step. Every rank runs the same layers in the same order.
  void forward_layer(int layer, TensorView hidden, TensorView residual, TensorView positions);

  // All ranks together, after the engine destroyed every graph that uses the runtime and before
  // it binds new caches: every entry of `replacement` must be empty storage (else every rank
  // throws one error listing the offending tensors), then close().
  void detach(const std::vector<LayerCaches>& replacement);

  // Agrees across ranks and releases everything; idempotent (a second call does nothing). A
  // fallen-back runtime stays fallen back.
  void close();

  RuntimeStats stats() const;
  RuntimeState state() const;
  // The fixed metadata buffers as the current step's BatchMeta (views whose data pointers never
  // change between prepare and close; shapes follow the step).
  const BatchMeta& step_metadata() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3msa
