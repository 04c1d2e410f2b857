// m3msa soak --steps N [--gpu] [--ranks P] [--seed S]: randomized decode indexer steps, each
// checked, with memory sampled (soak.h). This file: the step source shared by both modes, the CPU
// mode (the CPU model of the CP exchange, cp.h, at P in {2, 4, 8} vs the single-rank CPU
// reference, bit for bit) and the subcommand itself (flags, progress, JSON).
#include "soak.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>

#include "commands.h"
#include "json_out.h"
#include "m3msa/cp_model.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/dtype.h"
#include "m3msa/error.h"
#include "progress.h"

namespace m3msa::cli {

using Clock = std::chrono::steady_clock;
using json = nlohmann::ordered_json;

// ---- Memory and results ----

void MemorySeries::add(int64_t bytes) {
  if (samples == 0) {
    first = min = max = bytes;
  } else {
    min = std::min(min, bytes);
    max = std::max(max, bytes);
  }
  last = bytes;
  ++samples;
}

int64_t host_rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t total_pages = 0;
  int64_t resident_pages = 0;
  if (!(statm >> total_pages >> resident_pages)) return 0;
  return resident_pages * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

MemorySeries host_rss_series() {
  MemorySeries rss;
  rss.what = "host rss";
  rss.slack = kHostMemorySlack;
#if defined(__SANITIZE_ADDRESS__)
  rss.checked = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
  rss.checked = false;
#endif
#endif
  if (!rss.checked) rss.what += " (not checked: AddressSanitizer quarantine)";
  return rss;
}

void SoakResult::record_mismatch(const std::string& what) {
  if (first_mismatches.size() < kMaxReported) first_mismatches.push_back(what);
}

bool SoakResult::memory_flat() const {
  return std::all_of(memory.begin(), memory.end(), [](const MemorySeries& m) { return m.flat(); });
}

bool SoakResult::passed() const {
  return error.empty() && !stopped_by_time_limit && steps_done == steps_requested &&
         mismatches == 0 && mismatched_steps == 0 && memory_flat();
}

// ---- Step source ----

TensorView cache_page(const TensorView& cache, int64_t page) {
  const int64_t page_elems = cache.shape[1] * cache.shape[2];
  auto* base = static_cast<uint8_t*>(cache.data) +
               page * page_elems * static_cast<int64_t>(dtype_size(cache.dtype));
  return TensorView::contiguous(base, cache.dtype, {1, cache.shape[1], cache.shape[2]},
                                cache.device);
}

StepSource::StepSource(const SparseConfig& config, int max_reqs, int max_q_len, int64_t max_blocks,
                       bool allow_empty_batch, bool hostile, uint64_t seed)
    : config_(config),
      max_reqs_(max_reqs),
      max_q_len_(max_q_len),
      max_blocks_(max_blocks),
      // Twice the pages one request can see, plus a few: tables draw pages uniformly, so pages
      // are shared within and across requests (aliasing is allowed, docs/spec.md section 3), which
      // makes exact ties between blocks common.
      pages_(2 * max_blocks + 8),
      allow_empty_(allow_empty_batch),
      hostile_(hostile),
      rng_(seed) {
  config_.validate();
  M3MSA_CHECK_ARG(max_reqs >= 1 && max_q_len >= 1 && max_blocks >= 1,
                  "soak: maxima must be >= 1 (requests ", max_reqs, ", q_len ", max_q_len,
                  ", blocks ", max_blocks, ")");
  const std::vector<int64_t> shape = {pages_, config_.block_size, config_.index_dim};
  cache_bf16_ = HostTensor(DType::kBF16, shape);
  cache_fp8_ = HostTensor(DType::kFP8E4M3, shape);
  for (int64_t p = 0; p < pages_; ++p) {
    fill_page(DType::kBF16, p, 1.0f);
    fill_page(DType::kFP8E4M3, p, 1.0f);
  }
}

void StepSource::fill_page(DType dtype, int64_t page, float scale) {
  const int64_t n = int64_t{config_.block_size} * config_.index_dim;
  if (dtype == DType::kBF16) {
    uint16_t* p = cache_bf16_.ptr<uint16_t>() + page * n;
    for (int64_t i = 0; i < n; ++i) p[i] = float_to_bf16(rng_.unit_variance() * scale);
  } else {
    uint8_t* p = cache_fp8_.ptr<uint8_t>() + page * n;
    for (int64_t i = 0; i < n; ++i) p[i] = float_to_fp8e4m3(rng_.unit_variance() * scale);
  }
}

int64_t StepSource::draw_context(int world_size) {
  const int64_t bs = config_.block_size;
  const int64_t k = config_.topk;
  const int64_t max_tokens = max_blocks_ * bs;
  auto range = [this](int64_t lo, int64_t hi) { return hi <= lo ? lo : rng_.range(lo, hi); };
  const double u = rng_.uniform01();
  int64_t tokens = 0;
  if (u < 0.08) {
    tokens = 1;
  } else if (u < 0.20) {
    tokens = range(1, std::max<int64_t>(1, world_size - 1) * bs);  // fewer blocks than ranks
  } else if (u < 0.30) {
    tokens = range((k - 1) * bs + 1, k * bs);  // exactly k blocks
  } else if (u < 0.38) {
    tokens = range(k * bs + 1, (k + 1) * bs);  // k + 1 blocks
  } else if (u < 0.46) {
    tokens = range(1, max_blocks_) * bs + range(-1, 1);  // a block edge
  } else {
    const double blocks =
        std::exp(rng_.uniform01() * std::log(static_cast<double>(max_blocks_) + 1.0));
    const int64_t nb = std::clamp<int64_t>(static_cast<int64_t>(blocks), 1, max_blocks_);
    tokens = range((nb - 1) * bs + 1, nb * bs);
  }
  return std::clamp<int64_t>(tokens, 1, max_tokens);
}

void StepSource::next(int world_size) {
  auto range = [this](int64_t lo, int64_t hi) { return rng_.range(lo, hi); };
  index_dtype_ = range(0, 1) ? DType::kFP8E4M3 : DType::kBF16;
  const int q_len = static_cast<int>(range(1, max_q_len_));
  int reqs = static_cast<int>(range(1, max_reqs_));
  if (allow_empty_ && range(0, 49) == 0) reqs = 0;

  seq_lens_ = HostTensor(DType::kI32, {reqs});
  int64_t needed_blocks = 1;
  for (int r = 0; r < reqs; ++r) {
    const bool padding = range(0, 5) == 0;
    const int64_t len = padding ? 0 : std::max<int64_t>(draw_context(world_size), q_len);
    seq_lens_.ptr<int32_t>()[r] = static_cast<int32_t>(len);
    needed_blocks = std::max(needed_blocks, (len + config_.block_size - 1) / config_.block_size);
  }
  // The table width moves within the plan: the engine's tables are as wide as its longest
  // request, at most the planned maximum.
  const int64_t width = range(0, 1) ? max_blocks_ : range(needed_blocks, max_blocks_);
  table_ = HostTensor(DType::kI32, {reqs, width});
  int32_t* table = table_.ptr<int32_t>();
  for (int64_t i = 0; i < int64_t{reqs} * width; ++i) {
    table[i] = static_cast<int32_t>(range(0, pages_ - 1));
  }
  const int64_t rows = int64_t{reqs} * q_len;
  index_q_ = HostTensor(DType::kBF16, {rows, config_.index_heads, config_.index_dim});
  uint16_t* q = index_q_.ptr<uint16_t>();
  for (int64_t i = 0; i < index_q_.numel(); ++i) q[i] = float_to_bf16(rng_.unit_variance());

  // Two fresh pages per step in the cache this step reads.
  touched_.clear();
  for (int i = 0; i < 2; ++i) {
    const auto page = static_cast<int32_t>(range(0, pages_ - 1));
    fill_page(index_dtype_, page, 1.0f);
    touched_.push_back(page);
  }
  if (hostile_) {
    const int64_t n = int64_t{config_.block_size} * config_.index_dim;
    const bool fp8 = index_dtype_ == DType::kFP8E4M3;
    const int event = static_cast<int>(range(0, 199));
    const auto page = static_cast<int32_t>(range(0, pages_ - 1));
    const int64_t at = page * n + range(0, n - 1);
    if (event < 4) {  // a constant page: every token of the block ties with every other
      const float value = rng_.unit_variance();
      for (int64_t i = 0; i < n; ++i) {
        if (fp8) {
          cache_fp8_.ptr<uint8_t>()[page * n + i] = float_to_fp8e4m3(value);
        } else {
          cache_bf16_.ptr<uint16_t>()[page * n + i] = float_to_bf16(value);
        }
      }
    } else if (event < 6) {  // a NaN key element: the block scores NaN and ranks last
      if (fp8) {
        cache_fp8_.ptr<uint8_t>()[at] = 0x7F;
      } else {
        cache_bf16_.ptr<uint16_t>()[at] = 0x7FC0;
      }
    } else if (event < 8) {  // +-inf (bf16) or the saturated fp8 maximum +-448
      const bool negative = range(0, 1) == 1;
      if (fp8) {
        cache_fp8_.ptr<uint8_t>()[at] = negative ? 0xFE : 0x7E;
      } else {
        cache_bf16_.ptr<uint16_t>()[at] = negative ? 0xFF80 : 0x7F80;
      }
    } else if (event < 9 && rows > 0) {  // a NaN query element: that (row, head) has no scores
      q[range(0, index_q_.numel() - 1)] = 0x7FC0;
    }
    if (event < 9) {
      ++hostile_events_;
      if (event < 8) touched_.push_back(page);
    }
  }

  batch_ = BatchMeta{};
  batch_.kind = BatchKind::kDecode;
  batch_.num_reqs = reqs;
  batch_.q_len = q_len;
  batch_.seq_lens = seq_lens_.view();
  batch_.index_block_table = table_.view();
}

IndexerArgs StepSource::args(const TensorView& topk_idx) const {
  IndexerArgs a;
  a.index_q = index_q_.view();
  a.index_cache = {index_dtype_ == DType::kBF16 ? cache_bf16_.view() : cache_fp8_.view()};
  a.batch = batch_;
  a.topk_idx = topk_idx;
  return a;
}

std::string StepSource::describe() const {
  std::string lens;
  for (int r = 0; r < batch_.num_reqs; ++r) {
    lens += (r ? "," : "") + std::to_string(seq_lens_.ptr<int32_t>()[r]);
  }
  return fmt::format("reqs {} q_len {} {} seq_lens [{}] width {}", batch_.num_reqs, batch_.q_len,
                     dtype_name(index_dtype_), lens, table_.shape()[1]);
}

// ---- CPU mode ----

namespace {

// The protocol does not care about the head dimension; small D and blocks let 100,000 steps run
// in minutes on two cores. Two shapes: M3's forced-block setting (own block only) at k = 8, and
// init + local forced blocks at k = 4.
std::vector<SparseConfig> cpu_soak_configs() {
  auto make = [](int topk, int init_blocks, int local_blocks, int block_size) {
    SparseConfig c;
    c.q_heads = 4;
    c.kv_heads = 4;
    c.index_heads = 4;
    c.head_dim = 8;
    c.index_dim = 16;
    c.rope_dim = 0;
    c.block_size = block_size;
    c.topk = topk;
    c.init_blocks = init_blocks;
    c.local_blocks = local_blocks;
    return c;
  };
  return {make(8, 0, 1, 16), make(4, 1, 2, 8)};
}

// Exact comparison of [rows, H, k] lists; returns the differing lists and describes the first.
int64_t count_list_mismatches(const HostTensor& want, const HostTensor& got, std::string* first) {
  const int64_t heads = want.shape()[1];
  const int64_t k = want.shape()[2];
  const int64_t lists = want.shape()[0] * heads;
  int64_t bad = 0;
  for (int64_t l = 0; l < lists; ++l) {
    const int32_t* a = want.ptr<int32_t>() + l * k;
    const int32_t* b = got.ptr<int32_t>() + l * k;
    if (std::memcmp(a, b, sizeof(int32_t) * static_cast<std::size_t>(k)) == 0) continue;
    if (bad++ == 0 && first != nullptr) {
      std::string wa, ga;
      for (int64_t i = 0; i < k; ++i) {
        wa += fmt::format(" {}", a[i]);
        ga += fmt::format(" {}", b[i]);
      }
      *first = fmt::format("row {} head {}: want [{} ], got [{} ]", l / heads, l % heads, wa, ga);
    }
  }
  return bad;
}

}  // namespace

SoakResult run_cpu_soak(const SoakOptions& o, Progress& progress) {
  const auto start = Clock::now();
  SoakResult result;
  result.mode = "cpu";
  result.steps_requested = o.steps;
  std::vector<int> world_sizes =
      o.ranks > 0 ? std::vector<int>{o.ranks} : std::vector<int>{2, 4, 8};
  const int64_t max_context = o.max_context > 0 ? o.max_context : 1536;
  const int threads = o.threads > 0 ? o.threads : 1;

  struct Shape {
    StepSource source;
    std::vector<std::unique_ptr<CpuCpGroup>> groups;  // one per world size
  };
  std::vector<std::unique_ptr<Shape>> shapes;
  json configs = json::array();
  uint64_t stream = 0;
  for (const SparseConfig& config : cpu_soak_configs()) {
    const int64_t max_blocks = (max_context + config.block_size - 1) / config.block_size;
    auto shape = std::make_unique<Shape>(
        Shape{StepSource(config, o.max_reqs, o.max_q_len, max_blocks, /*allow_empty_batch=*/true,
                         o.hostile, derive_seed(o.seed, 1, stream++)),
              {}});
    for (int p : world_sizes) {
      CpConfig cp;
      cp.world_size = p;
      cp.max_rows = shape->source.max_rows();
      // Generous: on a loaded two-core machine 8 rank threads share the cores; a stall still
      // ends in an error naming the rank, never a hang.
      cp.spin_budget = std::chrono::seconds(10);
      cp.threads = 1;
      shape->groups.push_back(std::make_unique<CpuCpGroup>(config, cp));
    }
    configs.push_back({{"config", config.to_string()},
                       {"max_blocks", max_blocks},
                       {"pages", shape->source.pages()}});
    shapes.push_back(std::move(shape));
  }
  result.setup = {{"configs", configs},         {"world_sizes", world_sizes},
                  {"max_reqs", o.max_reqs},     {"max_q_len", o.max_q_len},
                  {"max_context", max_context}, {"reference_threads", threads},
                  {"hostile", o.hostile}};
  for (int p : world_sizes) result.steps_by_world_size[std::to_string(p)] = 0;

  const int64_t sample_every =
      o.sample_every > 0 ? o.sample_every : std::max<int64_t>(100, o.steps / 100);
  const int64_t warmup = std::min<int64_t>(o.steps / 20, 1000);
  MemorySeries rss = host_rss_series();
  testkit::SplitMix64 pick(derive_seed(o.seed, 2));
  int64_t cp_lists_bad = 0;

  for (int64_t step = 0; step < o.steps; ++step) {
    if (o.max_seconds > 0 && seconds_since(start) > o.max_seconds) {
      result.stopped_by_time_limit = true;
      break;
    }
    Shape& shape = *shapes[pick.next() % shapes.size()];
    const std::size_t wi = pick.next() % world_sizes.size();
    const int world_size = world_sizes[wi];
    const int layer = static_cast<int>(pick.next() % 8);
    StepSource& source = shape.source;
    source.next(world_size);
    const SparseConfig& config = source.config();
    const int64_t rows = source.batch().num_rows();

    HostTensor want(DType::kI32, {rows, config.index_heads, config.topk});
    cpu::select_topk(config, source.args(want.view()), threads);
    HostTensor got(DType::kI32, {rows, config.index_heads, config.topk});
    got.fill_bytes(0xA5);  // an entry the merge forgets to write shows
    try {
      cp_select_all(*shape.groups[wi], layer, source.args(got.view()));
    } catch (const Error& e) {
      result.error =
          fmt::format("step {} (P={}, {}): {}", step, world_size, source.describe(), error_text(e));
      break;
    }
    if (step == o.inject_mismatch_step && got.numel() > 0) got.ptr<int32_t>()[0] ^= 1;
    std::string first;
    const int64_t bad = count_list_mismatches(want, got, &first);
    result.lists_compared += rows * config.index_heads;
    if (bad > 0) {
      ++result.mismatched_steps;
      result.mismatches += bad;
      cp_lists_bad += bad;
      result.record_mismatch(
          fmt::format("step {} P={} layer {} {} {}: CP model vs cpu::select_topk: {}", step,
                      world_size, layer, config.to_string(), source.describe(), first));
    }
    ++result.steps_done;
    result.steps_by_world_size[std::to_string(world_size)] =
        result.steps_by_world_size[std::to_string(world_size)].get<int64_t>() + 1;
    if (step >= warmup && (step - warmup) % sample_every == 0) rss.add(host_rss_bytes());
    progress.update(fmt::format("soak step {}/{} P={} mismatches {} ({:.0f} steps/s)", step + 1,
                                o.steps, world_size, result.mismatches,
                                (step + 1) / std::max(1e-9, seconds_since(start))));
  }
  rss.add(host_rss_bytes());
  result.memory.push_back(rss);
  result.mismatch_counts["cp_model_vs_cpu_reference"] = cp_lists_bad;
  result.hostile_events = 0;
  for (const auto& shape : shapes) result.hostile_events += shape->source.hostile_events();
  result.wall_s = seconds_since(start);
  return result;
}

// ---- The subcommand ----

namespace {

std::string mib(int64_t bytes) {
  return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1024.0 * 1024.0));
}

json soak_json(const SoakOptions& o, const SoakResult& r) {
  json memory = json::array();
  for (const MemorySeries& m : r.memory) {
    memory.push_back({{"what", m.what},
                      {"samples", m.samples},
                      {"first_bytes", m.first},
                      {"min_bytes", m.min},
                      {"max_bytes", m.max},
                      {"last_bytes", m.last},
                      {"slack_bytes", m.slack},
                      {"checked", m.checked},
                      {"flat", m.flat()}});
  }
  return json{{"command", command_line()},
              {"version", version_string()},
              {"mode", r.mode},
              {"seed", o.seed},
              {"steps_requested", r.steps_requested},
              {"steps", r.steps_done},
              {"lists_compared", r.lists_compared},
              {"mismatched_steps", r.mismatched_steps},
              {"mismatches", r.mismatches},
              {"mismatches_by_check", r.mismatch_counts},
              {"first_mismatches", r.first_mismatches},
              {"steps_by_world_size", r.steps_by_world_size},
              {"hostile_events", r.hostile_events},
              {"memory", memory},
              {"memory_flat", r.memory_flat()},
              {"stopped_by_time_limit", r.stopped_by_time_limit},
              {"error", r.error},
              {"setup", r.setup},
              {"wall_s", r.wall_s},
              {"steps_per_s", r.wall_s > 0 ? static_cast<double>(r.steps_done) / r.wall_s : 0.0},
              {"passed", r.passed()}};
}

int run_soak(const SoakOptions& o) {
  Progress progress(!o.quiet);
  SoakResult r = o.gpu ? run_gpu_soak(o, progress) : run_cpu_soak(o, progress);
  progress.finish();
  std::printf("m3msa soak (%s): %lld / %lld steps in %.1f s (%.0f steps/s), seed %llu\n",
              r.mode.c_str(), static_cast<long long>(r.steps_done),
              static_cast<long long>(r.steps_requested), r.wall_s,
              r.wall_s > 0 ? static_cast<double>(r.steps_done) / r.wall_s : 0.0,
              static_cast<unsigned long long>(o.seed));
  std::printf("  steps by world size: %s\n", r.steps_by_world_size.dump().c_str());
  std::printf("  selection lists compared: %lld; mismatches: %lld in %lld steps %s\n",
              static_cast<long long>(r.lists_compared), static_cast<long long>(r.mismatches),
              static_cast<long long>(r.mismatched_steps), r.mismatch_counts.dump().c_str());
  for (const std::string& m : r.first_mismatches) std::printf("  mismatch: %s\n", m.c_str());
  std::printf("  hostile values injected: %lld\n", static_cast<long long>(r.hostile_events));
  for (const MemorySeries& m : r.memory) {
    std::printf("  memory %s: %lld samples, first %s, min %s, max %s, last %s: %s (slack %s)\n",
                m.what.c_str(), static_cast<long long>(m.samples), mib(m.first).c_str(),
                mib(m.min).c_str(), mib(m.max).c_str(), mib(m.last).c_str(),
                !m.checked ? "not checked"
                : m.flat() ? "flat"
                           : "NOT FLAT",
                mib(m.slack).c_str());
  }
  if (r.stopped_by_time_limit) {
    std::printf("  stopped by --max-seconds %g after %lld steps\n", o.max_seconds,
                static_cast<long long>(r.steps_done));
  }
  if (!r.error.empty()) std::printf("  error: %s\n", r.error.c_str());
  std::printf("%s\n", r.passed() ? "PASS" : "FAIL");
  if (!o.json_path.empty()) write_json_file(o.json_path, soak_json(o, r));
  return r.passed() ? kExitOk : kExitCheckFailed;
}

}  // namespace

Command add_soak_command(CLI::App& parent) {
  auto o = std::make_shared<SoakOptions>();
  CLI::App* app = parent.add_subcommand(
      "soak", "Randomized decode indexer steps, each checked; memory sampled (reliability)");
  app->footer(
      "CPU (default): the CPU model of the CP exchange (cp.h) at P in {2, 4, 8} (or --ranks) vs "
      "the single-rank CPU reference, bit for bit. --gpu: the CUDA CP indexer (peer transport, "
      "ranks as threads, rank r on GPU r % visible) vs the one-GPU CUDA backend (bit for bit) "
      "and the CPU reference (up to near-ties), with cudaMemGetInfo sampled on every device. "
      "Every step draws a batch within the planned maxima (docs/reliability.md, Soak).\n"
      "Exit codes: 0 every step matched and memory stayed flat, 1 a mismatch, memory growth or "
      "--max-seconds reached, 2 bad flags, 3 a library error.");
  app->add_option("--steps", o->steps, "decode steps")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  app->add_flag("--gpu", o->gpu, "run the CUDA CP indexer and backend (needs a CUDA build)");
  app->add_option("--ranks", o->ranks,
                  "CP ranks P (0: CPU 2, 4 and 8 in turn; GPU max(2, visible devices)); must "
                  "divide the 4 index heads or be a multiple of 4")
      ->check(CLI::Range(0, 64))
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            int p = 0;
            if (!CLI::detail::lexical_cast(text, p)) return "P = " + text + " is not an integer";
            if (p == 0 || (p > 0 && (4 % p == 0 || p % 4 == 0))) return {};
            return "P = " + text + " must divide the 4 index heads or be a multiple of 4";
          },
          "P | 4 or 4 | P", "placement"));
  app->add_option("--seed", o->seed, "seed of every random draw");
  app->add_option("--max-reqs", o->max_reqs, "planned maximum of requests per step")
      ->check(CLI::Range(1, 64));
  app->add_option("--max-q-len", o->max_q_len, "planned maximum of rows per request")
      ->check(CLI::Range(1, 8));
  app->add_option("--max-context", o->max_context,
                  "planned maximum context in tokens (0: 1536 on the CPU, 4096 on the GPU)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  app->add_option("--threads", o->threads,
                  "CPU reference threads (0: 1 on the CPU path, min(8, hardware) with --gpu)")
      ->check(CLI::Range(0, 4096));
  app->add_flag(
      "--hostile,!--no-hostile", o->hostile,
      "inject NaN / inf / fp8-maximum values, constant pages and NaN queries now and then "
      "(default on)");
  app->add_option("--max-seconds", o->max_seconds,
                  "stop after this many seconds (the run then fails: fewer steps than asked)")
      ->check(CLI::Range(0.0, 1e7));
  app->add_option("--sample-every", o->sample_every,
                  "memory sample period in steps (0: max(100, steps / 100))")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app->add_option("--json", o->json_path, "also write the summary as JSON to this file");
  app->add_flag("-q,--quiet", o->quiet, "no progress line on stderr");
  // Visible on purpose: CLI11 drops the name of a hidden option from its error messages.
  app->add_option("--inject-mismatch-at", o->inject_mismatch_step,
                  "for tests of the soak itself: corrupt the CP result of this step (-1: never)")
      ->check(CLI::Range(int64_t{-1}, int64_t{1} << 40));
  return {app, [o]() { return run_soak(*o); }};
}

}  // namespace m3msa::cli
