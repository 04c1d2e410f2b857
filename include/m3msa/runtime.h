// The fused decode runtime (docs/runtime.md is the contract): an engine hands each
// sparse layer of the decode steps it can serve to this runtime, and optionally the dense layers
// [0, first_sparse_layer) before them (all of them or none).
//
// Lifecycle (every rank of the TP group calls the same functions in the same order):
//   prepare(model, config, comm, step)  eager steps only; staged, every stage agreed by all ranks:
//       no metadata -> kSkipped; model support -> readiness -> weight support; unanimous
//       "unsupported" -> kFallback on every rank (final until a new Runtime), any other failure ->
//       the same Error on every rank listing every rank's message; a rank not ready -> kNotReady
//       everywhere (retry on a later step); otherwise kActive.
//   begin_step(batch)   per step; false (a counted refusal) for shapes outside the buckets,
//       otherwise the metadata is copied into fixed buffers whose addresses never change.
//   forward_layer(i, hidden, residual, positions)   one bound layer, in place.
//   detach(replacement) all ranks; the replacement cache storage must be empty; then close().
//   close()             idempotent, agreed across ranks, never run from the destructor.
//
// Backends: the device of the bound tensors picks one at prepare (every tensor of every layer on
// that one device, else an error).
//  - CPU (host tensors; src/runtime/cpu_engine.cc): forward_layer with the CPU reference
//    (cpu::preprocess / select_topk / sparse_attention), plain fp32-accumulating matmuls, the TP
//    reduce through the Communicator.
//  - CUDA (tensors on one GPU; src/runtime/gpu_engine.cc): the same steps as kernels queued on one
//    stream (RuntimeConfig::cuda_stream or the runtime's own): fused residual add + Gemma RMSNorm,
//    a skinny tensor-core GEMM for the projections (bf16, or fp8 e4m3 converted exactly in
//    registers, then * scale), the CUDA preprocessing, decode indexer (replicated, or the CUDA
//    CP indexer of cp_cuda.h) and sparse attention, the TP all-reduce in fp32 (the one-shot
//    peer all-reduce of src/comm/peer_allreduce.h, or NCCL: RuntimeConfig::tp_allreduce).
//    begin_step copies the metadata (host or device tensors) into
//    fixed device buffers; forward_layer allocates nothing, never synchronizes the host and can
//    be captured (StepGraphs below captures whole steps). Support beyond the CPU backend's: head
//    and index dims 128, block size 128, <= 16 query heads per KV head, topk <= 32, token
//    buckets <= 16 rows, q_len * index heads <= 32, widths multiple of 64; anything else is an
//    "unsupported" outcome of the weight stage naming the value.
// Context parallelism (RuntimeConfig::context_parallel, docs/context_parallel.md): the indexer
// alone is spread over the P = TP ranks. Every rank projects all H index heads (its qkv_proj has H
// index_q heads, see LayerWeights), scores its round-robin shard of the blocks for every head and
// nominates its top-k; the nominations are exchanged (CUDA: CpTransport kPeer or kNccl; CPU: an
// all-gather through the communicator) and each rank merges the heads of its KV heads. The
// selections are bit-identical to CP off; everything else is the same as CP off. Cross-layer
// selection sharing (RuntimeConfig::selection_share_period F, docs/spec.md section 7): a sparse
// layer whose ordinal (layer - first_sparse_layer) is not a multiple of F projects no index_q /
// index_k (the GEMM stops before those columns), writes nothing to its index cache, runs no indexer
// and attends with the selection of the last layer of the step that ran one (forward_layer refuses
// a sharing layer before any indexer layer of the step ran). The CPU numerics (the contract the
// CUDA path approximates: different fp32 summation orders, so bf16 outputs agree within a few ulps
// and selections within the near-tie rule of docs/spec.md section 4):
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
//   with MoE weights:    p = cpu::moe(h2) (router, routed and shared experts, docs/spec.md
//                        section 8); hidden <- bf16(all_reduce_sum_fp32(p)), residual <- x2
//   (the engine's convention: the next layer's input is hidden + residual).
// A dense layer (id < first_sparse_layer, LayerWeights::dense_mlp bound) is the same chain without
// the index part: qkv = [q | k | v], cpu::preprocess without index_q or an index-K insert, dense
// causal attention over every visible key (cpu::sparse_attention without topk_idx), o_proj, the
// reduce and the post-attention norm as above, then
//   dense MLP:           p = cpu::dense_mlp(h2) (activation_limit = model.activation_limit);
//                        hidden <- bf16(all_reduce_sum_fp32(p)), residual <- x2
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
#include "m3msa/cp_cuda.h"
#include "m3msa/moe.h"
#include "m3msa/tensor.h"

namespace m3msa {

// How the CUDA backend sums the TP partial outputs (o_proj, MLP down) across ranks.
enum class TpAllReduce : int {
  kAuto = 0,  // the one-shot peer all-reduce when every rank can map every other rank's memory
              // (agreed by all ranks at prepare), else NCCL
  kNccl = 1,  // ncclAllReduce (needs an NcclCommunicator)
  kPeer = 2,  // the one-shot peer all-reduce (unsupported where a rank cannot map a peer)
};
const char* tp_allreduce_name(TpAllReduce mode);
TpAllReduce parse_tp_allreduce(const std::string& text);  // kInvalidArgument naming the value

// CUDA backend without CP: whether the indexer runs beside the q/k/v projection. With it the
// index columns are projected first (a launch of their own; the same bits as inside the whole
// projection) and preprocessed, then the indexer runs on a second, high-priority stream, at one
// CTA per SM, while the projection's CTAs fill the rest of every SM. It changes no result; it
// pays where the indexer is long next to the projection (several query rows per request, long
// contexts) and costs ~2-5 % at q_len 1 (docs/benchmarks.md).
enum class IndexerOverlap : int {
  kAuto = 0,  // on for steps with q_len >= 2 (speculative rows), off for q_len 1
  kOff = 1,
  kOn = 2,
};
const char* indexer_overlap_name(IndexerOverlap mode);
IndexerOverlap parse_indexer_overlap(const std::string& text);  // kInvalidArgument naming it

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
  int64_t max_context = 131072;   // tokens; sizes the fixed block-table buffers
  bool context_parallel = false;  // indexer-only CP over the TP ranks (see above)
  // The CUDA backend's CP exchange: kPeer or kNccl (kReplicated / kAllReduceMax are benchmark
  // comparisons, refused here). The CPU backend exchanges through the communicator.
  CpTransport cp_transport = CpTransport::kPeer;
  std::chrono::microseconds cp_spin_budget = kDefaultCpSpinBudget;  // bound on device waits
  int selection_share_period = 1;  // F of docs/spec.md section 7 (1: every layer runs its indexer)
  TpAllReduce tp_allreduce = TpAllReduce::kAuto;  // CUDA backend at TP > 1
  float swiglu_limit = 7.0f;                      // clamping limit of the SwiGLU-OAI MLP
  // Rank-local: CPU threads one rank uses (0 = hardware concurrency). Not agreed.
  int threads = 1;
  // Rank-local, CUDA backend without CP (see IndexerOverlap). Engines that capture the runtime
  // into their own graphs should instantiate them with cudaGraphInstantiateFlagUseNodePriority
  // (StepGraphs does), so the indexer keeps its stream's priority. Not agreed.
  IndexerOverlap indexer_overlap = IndexerOverlap::kAuto;
  // Rank-local, CUDA backend: the cudaStream_t every kernel is queued on (the engine's stream, so
  // an engine capture records them); null: a stream the runtime owns (Runtime::cuda_stream()).
  // prepare() refuses to run while this stream is capturing. Not agreed.
  void* cuda_stream = nullptr;

  // The agreed fields, one line: what the host agreement compares.
  std::string to_string() const;
};

// Which part of the model one rank holds under tensor parallelism of tp_size ranks, with or
// without indexer-only context parallelism (the split ModelConfig::sparse counts): global head
// ranges, and the rows / columns of the global weight matrices that make up this rank's
// LayerWeights. q heads are split evenly. KV heads are split evenly, or replicated when tp_size
// > kv_heads (rank r holds KV head r / (tp_size / kv_heads)); index head h belongs with KV head h
// and is split alike, except under CP, where every rank projects every index head and keeps the
// selections of its own KV heads (cp_merged_heads). The index-K head is replicated.
struct RowRange {
  int64_t first = 0;
  int64_t count = 0;
};

struct RankLayout {
  int tp_rank = 0;
  int tp_size = 1;
  bool context_parallel = false;
  int first_q_head = 0;  // global query heads [first_q_head, first_q_head + q_heads)
  int q_heads = 0;
  int first_kv_head = 0;  // global KV heads [first_kv_head, first_kv_head + kv_heads)
  int kv_heads = 0;
  int first_index_head = 0;  // global index heads this rank projects and scores
  int index_heads = 0;
  // The fused projection [q | k | v | index_q | index_k] of this rank: for each segment, the rows
  // of the global per-segment matrix (q: [q_heads * head_dim, hidden] of the model, k and v:
  // [kv_heads * head_dim, hidden], index_q: [index_heads * index_dim, hidden], index_k:
  // [index_dim, hidden]) it stacks.
  RowRange q_rows, k_rows, v_rows, index_q_rows, index_k_rows;
  RowRange o_proj_cols;  // columns of the global o_proj [hidden, q_heads * head_dim]
  RowRange mlp_rows;     // rows of the global MLP gate and up [intermediate, hidden] (each), and
                         // columns of the global mlp_down [hidden, intermediate]
  // A dense layer (no index segments): its qkv_proj stacks q_rows, k_rows and v_rows only, this
  // many rows; its MLP's gate and up rows (each) of the global [dense_intermediate, hidden], and
  // the columns of the global down [hidden, dense_intermediate].
  int64_t dense_qkv_width = 0;
  RowRange dense_mlp_rows;
};

// The layout of rank `tp_rank` of `tp_size`. kInvalidArgument where ModelConfig::sparse refuses
// the split or tp_rank is outside [0, tp_size).
RankLayout rank_layout(const ModelConfig& model, int tp_rank, int tp_size,
                       bool context_parallel = false);

// One sparse layer's tensors for this rank, bound without copies (views stay the engine's).
// With P = TP ranks, sc = model.sparse(P, config.context_parallel) and the rows and columns of
// rank_layout(model, rank, P, config.context_parallel): W = sc.qkv_width(),
// QH = sc.q_heads, KVH = sc.kv_heads, and sc.index_heads index_q heads (H / P without CP, all H
// with CP). The index-K head is replicated (every rank projects it and holds the whole index-K
// cache).
// A dense layer (id in [0, first_sparse_layer)) binds qkv_proj [RankLayout::dense_qkv_width,
// hidden] rows [q | k | v] (no index segments), q_norm, k_norm, input_norm, post_attention_norm,
// o_proj, kv_cache and dense_mlp; nothing else (no index norms, no index cache, no MLP, no MoE).
struct LayerWeights {
  int layer = -1;             // model layer id in [0, num_layers)
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
  // Optional mixture of experts (docs/spec.md section 8), exclusive with the MLP above: the
  // router (replicated on every rank), the routed experts and, when model.shared_experts > 0,
  // the shared expert; all or none. I_r = model.moe_intermediate / P, S_r = shared_experts * I_r;
  // bf16, or MXFP8 (fp8_e4m3 codes + u8 e8m0 scales per 32 elements along K).
  TensorView router_weight;     // [E, hidden] f32
  TensorView router_bias;       // [E] f32 e_score_correction_bias (used only to pick)
  ExpertWeights experts;        // w13 [E, 2 I_r, hidden] rows [gate | up], w2 [E, hidden, I_r]
  ExpertWeights shared_expert;  // w13 [2 S_r, hidden], w2 [hidden, S_r]
  // The dense layers' SwiGLU-OAI MLP (docs/spec.md section 8, "Dense MLP"), in the format of the
  // shared expert: D_r = model.dense_intermediate / P; bf16, or MXFP8 (+ e8m0 scales).
  ExpertWeights dense_mlp;  // w13 [2 D_r, hidden] rows [gate | up], w2 [hidden, D_r]
  bool has_moe() const { return router_weight.defined() || experts.defined(); }
};

// A copy of `layer` whose every tensor is fn(that tensor), ids and cache scales kept (e.g. to
// upload a host model's layer to a device).
LayerWeights map_tensors(const LayerWeights& layer,
                         const std::function<TensorView(const TensorView&)>& fn);

struct ModelWeights {
  // Exactly one entry per sparse layer, and either one per dense layer [0, first_sparse_layer) or
  // none (the engine then runs the dense layers itself); any order.
  std::vector<LayerWeights> layers;
};

// New cache storage handed to detach(): it must be empty (not given, or zero elements).
struct LayerCaches {
  int layer = -1;
  KVCache kv_cache;
  IndexCache index_cache;  // none for a dense layer
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
  int64_t graphs_captured = 0;        // StepGraphs captures (0 on the CPU backend)
  int64_t graph_replays = 0;          // StepGraphs replays
  int64_t launches_per_layer = 0;     // kernel + NCCL launches of the last layer (0 on the CPU)
  bool context_parallel = false;      // the CP indexer is on
  std::string tp_allreduce;           // "none" (TP 1), "communicator" (CPU), "nccl" or "peer"
  int64_t indexer_layers_run = 0;     // eager forward_layer calls that ran their indexer
  int64_t sharing_layers_run = 0;     // eager forward_layer calls that shared a selection
  std::vector<int> bound_layers;      // ascending
  int64_t layers_run = 0;             // eager forward_layer calls + layers of StepGraphs replays

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

  // Decode metadata of one step (host tensors on the CPU backend; host tensors or tensors on the
  // runtime's GPU on the CUDA backend). Returns false and counts the reason for a step the
  // runtime does not serve; throws for malformed metadata. On the CUDA backend with host
  // metadata, the copy goes through one of two pinned staging buffers: the host waits only when
  // it is two steps ahead of the stream. Not while the stream is capturing (an error).
  bool begin_step(const BatchMeta& batch);
  // The same, padded to `pad_to_reqs` >= batch.num_reqs requests (padding requests: seq_len 0,
  // no slots, no pages), so a captured graph of that shape can replay the step; forward_layer
  // then takes pad_to_reqs * q_len rows (padding rows: position -1). The refusal checks use the
  // unpadded batch; pad_to_reqs * q_len must fit the largest token bucket.
  bool begin_step(const BatchMeta& batch, int pad_to_reqs);

  // Runs bound layer `layer` (a sparse layer, or a dense one when the dense layers are bound) of
  // the accepted step, in place:
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

  // Waits for this rank's queued layers (bounded: the CP / all-reduce host timeouts) and throws
  // what a device-side exchange recorded: kTimeout naming the rank whose CP nominations or
  // all-reduce partials never arrived, kInvalidArgument naming a rank that passed another shape.
  // After a fault the runtime refuses further layers; close() still releases. Nothing to check
  // on the CPU backend (its exchanges throw where they fail). Not while the stream is capturing.
  void check();

  RuntimeStats stats() const;
  RuntimeState state() const;
  // The fixed metadata buffers as the current step's BatchMeta (views whose data pointers never
  // change between prepare and close; shapes follow the step). On the CUDA backend they are
  // device tensors.
  const BatchMeta& step_metadata() const;

  // Where the bound tensors live (valid while active; CPU otherwise).
  Device device() const;
  // The cudaStream_t the CUDA backend queues on (null on the CPU backend or when not active).
  void* cuda_stream() const;
  // The configuration of the last successful prepare.
  const RuntimeConfig& config() const;

  // The intermediates of the last forward_layer, for tests and tools: views of the runtime's
  // scratch (host or device per backend, rows of the step), overwritten by the next layer.
  struct LayerTrace {
    TensorView normed;   // [rows, hidden] bf16, input_norm(hidden + residual)
    TensorView qkv;      // [rows, qkv_width] bf16
    TensorView q;        // [rows, QH, HD] bf16 after norm + RoPE
    TensorView index_q;  // [rows, H, D] bf16 after norm + RoPE (not written by a dense layer)
    TensorView topk;     // [rows, H, k] i32 selected blocks (not written by a dense layer)
    TensorView attn;     // [rows, QH, HD] bf16 attention output
  };
  LayerTrace last_layer_trace() const;

 private:
  friend class StepGraphs;
  // StepGraphs' bookkeeping: a capture (graphs_captured), a replay of `layers` layers.
  void note_graph_captured();
  void note_graph_replayed(int layers);
  // CUDA backend: re-applies the kernels' launch attributes of this runtime's plans (another plan
  // in the process may have changed them) before a capture.
  void refresh_device_plans();

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// CUDA graphs of whole decode steps (CUDA backend): one graph per padded shape (requests x q_len)
// holding forward_layer of every bound layer (dense, then sparse) in ascending order, over fixed
// device buffers that this object owns, so the graph replays any step's metadata staged by
// begin_step. Layers are chained through the engine's convention (the next layer's input is hidden
// + residual).
//
// Per step: write the step's rows into hidden() / residual() / positions() (rows
// [0, batch.num_rows())), call run(batch): it pads the step to the token bucket (when the bucket
// is a multiple of q_len and the padded requests fit max_requests), stages the metadata
// (begin_step), sets the padding rows' positions to -1, then replays the graph of that shape,
// capturing it on first use. Outputs are in hidden() / residual() when the stream is done.
// Destroy (or reset()) every StepGraphs before detach / close of its runtime. Every rank of a TP
// group must run the same steps (the graphs hold the NCCL all-reduces).
class StepGraphs {
 public:
  // `runtime` must be active on the CUDA backend and outlive this object.
  explicit StepGraphs(Runtime& runtime);
  ~StepGraphs();
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;

  TensorView hidden() const;     // [max_rows, hidden] bf16 on the runtime's device
  TensorView residual() const;   // [max_rows, hidden] bf16
  TensorView positions() const;  // [max_rows] i64

  // One decode step through a graph. Returns false (nothing run) where begin_step refused.
  bool run(const BatchMeta& batch);
  // The same step run eagerly (forward_layer calls, no graph) over the same buffers and padding.
  bool run_eager(const BatchMeta& batch);
  // Replays the graph of the last run() once more on the metadata that run() staged, without
  // begin_step (benchmarks: the layers alone). Throws when run() has not succeeded yet.
  void replay_last();
  // The padded request count run() uses for this batch shape.
  int padded_requests(int num_reqs, int q_len) const;
  int64_t graphs() const;
  // Destroys every graph (the buffers stay).
  void reset();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3msa
