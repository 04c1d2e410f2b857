// m3msa demo (default mode): decode steps of a synthetic model through the fused decode runtime
// (runtime.h): prepare -> begin_step / forward_layer per step -> detach, with tensor parallelism
// over the GPUs present (ranks as threads; NCCL on the GPU, a ThreadGroup on the CPU), timed, and
// checked against a CPU oracle on a small configuration. The model: M3's attention dimensions
// (64 q heads, 4 KV / index heads of 128, blocks of 128, top-16) and a dense SwiGLU-OAI MLP
// standing in for the FFN, seeded random weights and caches (the test kit's demo model).
//
// The pieces shared by the CPU path (demo_runtime.cc) and the CUDA path (demo_runtime_gpu.cc).
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "m3msa/batch.h"
#include "m3msa/config.h"
#include "m3msa/runtime.h"
#include "m3msa/tensor.h"
#include "m3msa/testing/demo_model.h"

namespace m3msa::cli {

struct RuntimeDemoOptions {
  int batch = 4;
  int64_t context = 8192;
  int q_len = 2;
  int layers = 2;
  int steps = 3;
  int tp = 0;                         // 0: the GPUs present (1 or 2); on the CPU 2 rank threads
  bool cp = false;                    // RuntimeConfig::context_parallel
  std::string weights = "bf16";       // qkv_proj and o_proj dtype: bf16 | fp8
  int hidden = 0;                     // 0: 6144 on the GPU, kCpuDefaultHidden on the CPU
  int intermediate = 0;               // MLP width; 0: = hidden
  bool moe = false;                   // the mixture of experts instead of the dense MLP
  std::string moe_weights = "mxfp8";  // the experts' format: mxfp8 | bf16
  std::string backend = "auto";
  std::string check = "auto";  // auto | none
  int threads = 0;
  uint64_t seed = 1;
  std::string json_path;
  bool quiet = false;
};

// The CPU default hidden size: with M3's 6144 the plain CPU projections (one thread per rank) take
// ~1.5 s per step of 8 rows and the whole default demo ~8 s on 2 cores (measured); the attention
// dimensions stay M3's.
inline constexpr int kCpuDefaultHidden = 1024;
inline constexpr int kM3Hidden = 6144;
// The demo's mixture of experts: M3's router and expert function (sigmoid router with a
// selection-only bias, top-4, one shared expert), fewer and narrower experts than M3's 128 x 3072
// so the host can draw the weights and the oracle can replay them.
inline constexpr int kDemoExperts = 16;
inline constexpr int kDemoExpertsPerToken = 4;
inline constexpr int kDemoExpertWidth = 256;
// The dense layers' MLP with --moe: 4 expert widths, as M3's 12288 is 4 x 3072.
inline constexpr int kDemoDenseWidth = 4 * kDemoExpertWidth;

int run_runtime_demo(const RuntimeDemoOptions& options);

namespace demo_rt {

// The model, its weights and steps come from the test kit (m3msa/testing/demo_model.h).
using testkit::demo::HostModel;
using testkit::demo::make_host_model;
using testkit::demo::make_spec;
using testkit::demo::make_step;
using testkit::demo::make_steps;
using testkit::demo::Spec;
using testkit::demo::Step;

// What a run records per step and layer when asked to (the check run).
struct LayerRecord {
  std::vector<uint16_t> in_hidden, in_residual, out_hidden, out_residual;
  std::vector<int32_t> topk;  // [rows, index_heads (global), topk], assembled over the ranks
};

struct RunResult {
  std::string backend;  // "cpu" | "cuda"
  int tp = 1;
  PrepareResult prepared = PrepareResult::kSkipped;
  RuntimeStats stats;           // rank 0, before detach
  std::vector<double> step_ms;  // wall time of each step (begin_step .. last layer done)
  std::vector<std::vector<LayerRecord>> records;  // [step][layer] (record runs only)
  int64_t rank_mismatches = 0;  // elements where a rank's output differs from rank 0's
  double setup_s = 0;           // building and binding the weights and caches
};

// A run's result before its first step (backend, tp, and when `record`, an empty record per
// step and layer with its selections at -1): shared by both backends.
RunResult start_run(const Spec& spec, const char* backend, int tp, bool record);

// What the ranks of a recorded run keep, shared by both backends: each rank's KV heads of every
// layer's selection go into the layer's record, every rank's outputs are kept to compare them
// with rank 0's, and rank 0's outputs are the record's.
class RankOutputs {
 public:
  explicit RankOutputs(int tp) : outputs_(static_cast<std::size_t>(tp)) {}
  // Rank `rank` ran the layer of `rec` into `hidden` / `residual`; `topk` is its selection
  // [rows, its KV heads, topk] (null for a dense layer). Thread-safe; a rank's layers in order.
  void keep(const Spec& spec, int rank, int tp, const int32_t* topk,
            const std::vector<uint16_t>& hidden, const std::vector<uint16_t>& residual,
            LayerRecord& rec);
  // Elements where a rank's outputs differ from rank 0's (a missing output counts one).
  int64_t mismatches() const;

 private:
  std::mutex mutex_;
  std::vector<std::vector<std::vector<uint16_t>>> outputs_;  // [rank][layer run] outputs
};

// Runs the spec through the runtime at TP = `tp`. record: every layer's inputs / outputs /
// selections are kept (and ranks compared bit for bit).
RunResult run_cpu(const Spec& spec, int tp, int threads, bool record,
                  const std::function<void(const std::string&)>& progress);
// The CUDA path (demo_runtime_gpu.cc): ranks as threads, rank r on GPU r, NCCL communicators
// between them (the TP all-reduce: the runtime's default, peer stores on one host).
// Without CUDA in the build: Error(kUnsupported).
RunResult run_cuda(const Spec& spec, int tp, int threads, bool record,
                   const std::function<void(const std::string&)>& progress);
int cuda_devices();

}  // namespace demo_rt
}  // namespace m3msa::cli
