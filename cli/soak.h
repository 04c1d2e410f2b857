// m3msa soak: many randomized decode indexer steps, each checked, with memory sampled throughout.
// Shared by the CPU mode (soak.cc: the CPU model of the CP exchange vs the
// single-rank CPU reference) and the GPU mode (soak_gpu.cc: the CUDA CP indexer vs the one-GPU
// CUDA backend vs the CPU reference).
//
// Every step draws a decode batch within fixed planned maxima (requests, query length, context,
// table width), so a real engine's plan would cover it: padding requests, contexts picked to hit
// what sharding makes special (one token, fewer blocks than ranks, exactly k and k + 1 blocks,
// block edges) and a long log-uniform tail, either index cache dtype, aliased pages. A few cache
// pages are rewritten every step, and now and then a hostile value lands in them (a constant page:
// exact ties; a NaN; an infinity or the fp8 maximum; a NaN in a query), so selections change
// and the tie / NaN orders of docs/spec.md section 4 are exercised for as long as the soak runs.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common.h"
#include "m3msa/config.h"
#include "m3msa/ops.h"
#include "m3msa/tensor.h"

namespace m3msa::cli {

class Progress;

struct SoakOptions {
  int64_t steps = 10000;
  bool gpu = false;
  int ranks = 0;  // 0: CPU {2, 4, 8} in turn; GPU max(2, visible devices)
  uint64_t seed = 1;
  int max_reqs = 4;          // requests per step (padding included)
  int max_q_len = 4;         // rows per request
  int64_t max_context = 0;   // tokens per request; 0: 1536 (CPU) / 4096 (GPU)
  int threads = 0;           // CPU reference threads; 0: 1 (CPU mode) / min(8, hardware) (GPU)
  bool hostile = true;       // NaN / inf / ties injected now and then
  double max_seconds = 0;    // stop (and fail) after this long; 0 = no limit
  int64_t sample_every = 0;  // memory sample period in steps; 0: max(100, steps / 100)
  std::string json_path;
  bool quiet = false;
  int64_t inject_mismatch_step = -1;  // corrupt the CP result of this step (tests the soak)
};

// Memory allowed to move between the first and the last sample after warm-up. Nothing in the
// step loop allocates device memory, so the device bound is two 2 MiB driver pages; the host
// bound covers malloc arenas of the rank threads.
inline constexpr int64_t kDeviceMemorySlack = int64_t{4} << 20;
inline constexpr int64_t kHostMemorySlack = int64_t{32} << 20;

struct MemorySeries {
  std::string what;  // "host rss" or "device N free"
  int64_t samples = 0;
  int64_t first = 0, min = 0, max = 0, last = 0;  // bytes
  int64_t slack = 0;
  bool checked = true;  // false: reported only (host RSS under AddressSanitizer, see host_rss)
  void add(int64_t bytes);
  bool flat() const { return !checked || samples == 0 || max - min <= slack; }
};

// The host RSS series: under AddressSanitizer freed memory sits in its quarantine (up to 256 MiB),
// so RSS climbs without a leak; there the series is reported and not checked (LeakSanitizer
// checks leaks instead).
MemorySeries host_rss_series();

struct SoakResult {
  std::string mode;  // "cpu" or "gpu"
  int64_t steps_requested = 0;
  int64_t steps_done = 0;
  int64_t lists_compared = 0;    // (row, head) selection lists compared, all checks together
  int64_t mismatched_steps = 0;  // steps with any mismatch
  int64_t mismatches = 0;        // (row, head) lists that differ, all checks together
  nlohmann::ordered_json mismatch_counts = nlohmann::ordered_json::object();  // per check
  std::vector<std::string> first_mismatches;  // up to kMaxReported, with step and seed
  std::vector<MemorySeries> memory;
  nlohmann::ordered_json steps_by_world_size = nlohmann::ordered_json::object();
  nlohmann::ordered_json setup = nlohmann::ordered_json::object();  // configs, maxima, devices
  int64_t hostile_events = 0;
  std::string error;  // a library error that stopped the soak
  bool stopped_by_time_limit = false;
  double wall_s = 0;

  static constexpr std::size_t kMaxReported = 5;
  void record_mismatch(const std::string& what);
  bool memory_flat() const;
  bool passed() const;
};

// ---- Drawing steps (shared by both modes) ----

// Host caches of one configuration (a bf16 and an fp8 index cache over one page pool) and the
// batch of the current step. Deterministic in (seed, step sequence).
class StepSource {
 public:
  StepSource(const SparseConfig& config, int max_reqs, int max_q_len, int64_t max_blocks,
             bool allow_empty_batch, bool hostile, uint64_t seed);

  // Draws the next step's batch and rewrites a few pages of the cache it uses. `world_size`
  // shapes the context distribution (fewer blocks than ranks).
  void next(int world_size);

  const SparseConfig& config() const { return config_; }
  int64_t max_blocks() const { return max_blocks_; }
  int64_t pages() const { return pages_; }
  int max_rows() const { return max_reqs_ * max_q_len_; }
  HostTensor& cache(DType dtype) { return dtype == DType::kBF16 ? cache_bf16_ : cache_fp8_; }
  const HostTensor& cache(DType dtype) const {
    return dtype == DType::kBF16 ? cache_bf16_ : cache_fp8_;
  }

  // The current step.
  DType index_dtype() const { return index_dtype_; }
  const BatchMeta& batch() const { return batch_; }
  const HostTensor& seq_lens() const { return seq_lens_; }
  const HostTensor& table() const { return table_; }
  const HostTensor& index_q() const { return index_q_; }
  // Pages of cache(index_dtype()) rewritten by the last next() (device copies must follow).
  const std::vector<int32_t>& touched_pages() const { return touched_; }
  int64_t hostile_events() const { return hostile_events_; }
  std::string describe() const;  // "reqs 3 q_len 2 fp8 seq_lens [..] width 40"
  IndexerArgs args(const TensorView& topk_idx) const;

 private:
  void fill_page(DType dtype, int64_t page, float scale);
  int64_t draw_context(int world_size);

  SparseConfig config_;
  int max_reqs_, max_q_len_;
  int64_t max_blocks_, pages_;
  bool allow_empty_, hostile_;
  testkit::SplitMix64 rng_;
  HostTensor cache_bf16_, cache_fp8_;
  DType index_dtype_ = DType::kBF16;
  BatchMeta batch_;
  HostTensor seq_lens_, table_, index_q_;
  std::vector<int32_t> touched_;
  int64_t hostile_events_ = 0;
};

// A page of a [pages, block_size, D] cache as a contiguous view.
TensorView cache_page(const TensorView& cache, int64_t page);

// Host resident set size in bytes (0 where /proc is missing).
int64_t host_rss_bytes();

// The modes. Both throw m3msa::Error for setup problems; mismatches are counted, not thrown.
SoakResult run_cpu_soak(const SoakOptions& options, Progress& progress);
SoakResult run_gpu_soak(const SoakOptions& options, Progress& progress);  // soak_gpu.cc

}  // namespace m3msa::cli
