// Internals of the runtime shared by its translation units: the per-rank stage outcome that the
// host agreement exchanges, the checks of the prepare stages, and the two engines the lifecycle
// (runtime.cc) drives: the CPU backend (cpu_engine.cc) and the CUDA backend (gpu_engine.cc).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "m3msa/comm.h"
#include "m3msa/error.h"
#include "m3msa/runtime.h"
#include "m3msa/tensor.h"

namespace m3msa::runtime_detail {

// Blocks of `block_size` tokens that hold `tokens` (rounded up without overflowing near INT64_MAX).
inline int64_t blocks_for(int64_t tokens, int block_size) {
  return tokens / block_size + (tokens % block_size != 0 ? 1 : 0);
}

// Sizes of the fixed metadata buffers above which prepare refuses (unsupported) instead of
// allocating: 2^24 i32 entries = 64 MiB per block table (max_requests x max_blocks), far above
// any decode deployment (256 requests x 1M tokens / 128 = 2^21), and 2^16 requests.
inline constexpr int64_t kMaxTableEntries = int64_t{1} << 24;
inline constexpr int kMaxRequests = 1 << 16;

// Tensors and how many elements they hold, or why they cannot be counted (a hostile view whose
// rank, extents or byte size is out of range): the message names `name`, empty when valid.
std::string invalid_extents(const TensorView& view, const std::string& name);

// ---- Stage outcomes and the host agreement ----

enum class OutcomeKind : uint8_t { kOk = 0, kNotReady = 1, kUnsupported = 2, kError = 3 };
const char* outcome_kind_name(OutcomeKind kind);

struct Outcome {
  OutcomeKind kind = OutcomeKind::kOk;
  ErrorCode code = ErrorCode::kInternal;  // for kError: the code every rank rethrows with
  std::string message;                    // why (empty when ok)
  std::string fingerprint;                // model stage: the agreed configuration
};

ByteRecord encode(const Outcome& outcome);
Outcome decode(const ByteRecord& record, int rank);

// Problems found by one stage on one rank. Each is "unsupported" (a valid setup the runtime does
// not run: the engine falls back) or an error (a contradiction: a bug in the caller).
class Problems {
 public:
  void unsupported(std::string message);
  void error(ErrorCode code, std::string message);
  void not_ready(std::string message);
  // Error beats unsupported beats not ready; the message lists every problem of the worst kind
  // (up to a cap), so one prepare names every refused tensor.
  Outcome outcome() const;
  bool empty() const { return items_.empty(); }

 private:
  struct Item {
    OutcomeKind kind;
    ErrorCode code;
    std::string message;
  };
  std::vector<Item> items_;
};

// ---- Stage checks (binding.cc) ----

// Stage 1: configuration vs what the CPU backend runs, for a TP group of `tp_size` ranks.
void check_model_support(const RuntimeConfig& config, int tp_size, Problems& problems);
// Stage 2: every bound layer's caches are given and non-empty (a dense layer has no index cache).
void check_readiness(const ModelConfig& config, const ModelWeights& model, Problems& problems);
// Stage 3: every sparse layer bound once, the dense layers all bound once or none, every tensor's
// dtype, shape, layout and device (all on one device: the first bound layer's qkv_proj's, written
// to `device`). Fills `by_layer` with the bound layers in ascending order (index = layer -
// the first bound layer: 0 with the dense layers, else first_sparse_layer) when there is no
// problem.
void check_weights(const RuntimeConfig& config, int tp_size, const ModelWeights& model,
                   Problems& problems, std::vector<LayerWeights>& by_layer, Device& device);

// ---- The CUDA backend (gpu_engine.cc; stubs without CUDA) ----

// Stage 3 on a CUDA device: what the kernels, the row buckets and the TP reduce support
// (unsupported outcomes naming the value), and the communicator's device (an error on mismatch).
// Without CUDA: unsupported ("this build has no CUDA backend").
void check_gpu_support(const RuntimeConfig& config, int tp_size, Communicator& comm,
                       const std::vector<LayerWeights>& layers, Device device, Problems& problems);

// Whether `stream` (a cudaStream_t; null = none given) is capturing. False without CUDA.
bool stream_is_capturing(void* stream);

// One rank's device state: fixed metadata buffers, scratch, plans, the stream, the NCCL handle.
// Everything is allocated by make_gpu_engine() (prepare) and freed by the destructor (close),
// which synchronizes the stream first.
class GpuEngine {
 public:
  virtual ~GpuEngine() = default;
  // Copies one step's metadata (host tensors, or tensors on the engine's device) into the fixed
  // buffers, padded to `padded_reqs` requests; returns views over them.
  virtual BatchMeta stage_step(const BatchMeta& batch, int padded_reqs) = 0;
  // One bound layer on the stream (tensors on the engine's device; shapes checked by the caller;
  // a dense layer below first_sparse_layer: no index part, dense attention, the dense MLP).
  // run_indexer false: the layer shares the selection left in the engine's top-k buffer by the
  // last layer that ran its indexer (docs/spec.md section 7).
  virtual void forward_layer(const LayerWeights& w, const BatchMeta& step, const TensorView& hidden,
                             const TensorView& residual, const TensorView& positions,
                             bool run_indexer) = 0;
  virtual void* stream() const = 0;
  virtual int64_t launches_per_layer() const = 0;
  virtual Runtime::LayerTrace trace(int64_t rows) const = 0;
  virtual void refresh_plans() = 0;
  // The last prepare stage, after every rank bound its engine (a collective on every rank): the
  // ranks exchange where they run (host, process, device, communicator kind), agree on the TP
  // all-reduce and the CP exchange (every rank derives the same choice from the same facts; what
  // cannot run is an "unsupported" problem), then build them: the CP indexer's buffer set, the
  // peer all-reduce's mapped buffers, or one small NCCL all-reduce (so NCCL's lazy setup never
  // happens inside a capture).
  virtual void connect(Communicator& comm, Problems& problems) = 0;
  // What a device-side exchange recorded (waits for the stream, bounded); throws as
  // Runtime::check() says.
  virtual void check() = 0;
  // "none" (TP 1), "nccl" or "peer" (valid after connect).
  virtual std::string tp_allreduce_name() const = 0;
  // Waits until the stream is idle (bounded by the NCCL communicator's timeout at TP > 1, which
  // aborts it on expiry), so host collectives on the same communicator never overlap the layers'.
  virtual void drain(Communicator& comm) = 0;
};

std::unique_ptr<GpuEngine> make_gpu_engine(const RuntimeConfig& config, int tp_size,
                                           Communicator& comm,
                                           const std::vector<LayerWeights>& layers, Device device);

// ---- The CPU backend (cpu_engine.cc) ----

// One rank's host state: the fixed metadata buffers and the scratch of forward_layer, all
// allocated by the constructor (prepare) for the largest bucket; the step path allocates nothing.
class CpuEngine {
 public:
  CpuEngine(const RuntimeConfig& config, const RankLayout& layout, Communicator& comm,
            const std::vector<LayerWeights>& layers);
  // Copies one step's host metadata (validated by the caller) into the fixed buffers, padded to
  // `padded_reqs` requests; returns views over them.
  BatchMeta stage_step(const BatchMeta& batch, int padded_reqs);
  // One bound layer with the CPU reference (the numerics of runtime.h), in place on hidden and
  // residual (host tensors; shapes checked by the caller); counts into `stats` and records the
  // layer in `selection_layer` once its indexer ran. run_indexer false: the layer shares the
  // selection left in the top-k buffer by the last layer that ran its indexer.
  void forward_layer(int layer, const LayerWeights& w, const BatchMeta& step,
                     const TensorView& hidden, const TensorView& residual,
                     const TensorView& positions, bool run_indexer, RuntimeStats& stats,
                     int& selection_layer);
  Runtime::LayerTrace trace(int64_t rows) const;

 private:
  void cp_select(int layer, const IndexerArgs& idx);

  RuntimeConfig config_;
  SparseConfig sparse_;
  RankLayout layout_;
  Communicator* comm_ = nullptr;
  int max_rows_ = 0;
  int64_t max_blocks_ = 0;

  // Fixed metadata buffers: addresses stable until the engine is destroyed.
  HostTensor seq_lens_;            // [max_requests] i32
  HostTensor index_block_table_;   // [max_requests, max_blocks_] i32
  HostTensor kv_block_table_;      // [max_requests, max_blocks_] i32
  HostTensor slot_mapping_;        // [max_rows_] i64
  HostTensor index_slot_mapping_;  // [max_rows_] i64

  // Scratch, sized for max_rows_.
  HostTensor normed_;              // [max_rows_, hidden] bf16
  HostTensor hidden_out_;          // [max_rows_, hidden] bf16: the layer's outputs before they are
  HostTensor residual_out_;        // [max_rows_, hidden] bf16  written back
  HostTensor qkv_;                 // [max_rows_, qkv_width] bf16
  HostTensor q_;                   // [max_rows_, QH, HD] bf16
  HostTensor index_q_;             // [max_rows_, H, D] bf16
  HostTensor topk_;                // [max_rows_, H, k] i32
  HostTensor attn_;                // [max_rows_, QH, HD] bf16
  HostTensor mlp_gu_;              // [max_rows_, 2 I] bf16 (when a layer has an MLP)
  HostTensor mlp_act_;             // [max_rows_, I] bf16
  std::vector<float> f32_out_;     // [max_rows_ * max(width, hidden, 2 I)]
  std::vector<float> x_row_;       // [max(hidden, QH*HD, I)]
  std::vector<uint64_t> cp_keys_;  // [max_rows_, H, k] this rank's CP nominations
};

// ---- CPU layer math (cpu_engine_math.cc) ----

// out[r, n] = sum_k x[r, k] * w[n, k] (* scale[n]) for r < rows: fp32, k ascending.
// x: [rows, in] bf16 (row stride in); w: [out, in] bf16 | fp8_e4m3; scale: [out] f32 or not given.
// x_row: scratch of at least `in` floats.
void linear(const uint16_t* x, int64_t rows, int64_t in, const TensorView& w,
            const TensorView& scale, float* out, float* x_row);

// y = bf16(x * rsqrt(mean(x^2) + eps) * (1 + w)), fp32 math, sum of squares in order.
void gemma_rmsnorm_row(const uint16_t* x, const uint16_t* weight, int64_t n, float eps,
                       uint16_t* y);

// SwiGLU-OAI on one value pair: min(g, limit) * sigmoid(1.702 min(g, limit)) *
// (clamp(u, -limit, limit) + 1).
float swiglu_oai(float gate, float up, float limit);

}  // namespace m3msa::runtime_detail
