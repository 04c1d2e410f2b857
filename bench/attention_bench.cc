// m3msa bench attention: the CUDA block-sparse decode attention under CUDA-graph replay.
//
// Per configuration (batch x q_len x KV dtype x context): every request selects 16 distinct blocks
// per KV head (its own block plus 15 random ones; the rows of one request share them, as the
// speculative rows of M3 mostly do, or with --row-share N only N of the 15, each row drawing the
// rest), each selected (request, block) on its own page. Several input sets on disjoint pages
// rotate so that the data read per launch set exceeds the 60 MB L2 many times over. Timing, table
// and JSON come from the shared harness (harness.h): a graph of `launches` back-to-back launches
// cycling the sets, replayed; time per launch = replay time / launches; median and noise
// ((p90 - p10) / median) over the replays.
//
// Bytes (the floor): the K and V 64-token chunks the kernel must read (each (request, KV head,
// block) once, however many rows select it; the own block's second chunk only when a row reaches
// it), plus q, out and topk_idx. TB/s = bytes / median; % of the measured 4.57 TB/s read ceiling.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "bench_registry.h"
#include "cuda/attention.h"
#include "cuda/common.cuh"
#include "fill.h"
#include "harness.h"
#include "m3msa/batch.h"
#include "m3msa/dtype.h"
#include "m3msa/error.h"
#include "m3msa/ops.h"
#include "m3msa/testing/layouts.h"
#include "m3msa/testing/splitmix.h"
#include "timeline.h"

namespace m3msa::bench {
namespace {

using Rng = testkit::SaltedRng<3>;

struct Config {
  int batch;
  int q_len;
  DType kv;
  int64_t context;
  cuda::AttentionTuning tuning;
  KVLayout layout = KVLayout::kOurs;
  // Random blocks a request's rows share besides the own block (the rest each row draws itself);
  // -1: all of them (one selection per request and KV head).
  int row_share = -1;
  int tp = 1;  // one rank's shape under this tensor parallelism (M3: 16 q / 1 KV heads at TP 4)
};

struct Result {
  Config cfg;
  int splits = 0;
  int row_tiles = 1;
  bool cluster = false;
  bool balanced = false;  // one wave of CTAs, each an equal share of the units' blocks
  int sets = 0;
  Timing timing;
  double bytes = 0;
  nlohmann::json timeline;          // --timeline: the recorded launch's stage table
  nlohmann::json timeline_records;  // --timeline-records: its every CTA
};

std::string kv_name(const Config& c) {
  return c.kv == DType::kFP8E4M3 ? "fp8" : "bf16";
}

Result run_config(const Config& c, int launches_min, int reps, uint64_t seed, bool timeline,
                  bool timeline_records) {
  // M3 per rank: 64 q heads, 4 KV heads at TP 1; 128-d heads, topk 16.
  const SparseConfig sc = ModelConfig{}.sparse(c.tp);
  const int kvh = sc.kv_heads;
  const int k = sc.topk;
  const int64_t rows = int64_t{c.batch} * c.q_len;
  const int64_t nb = (c.context + sc.block_size - 1) / sc.block_size;
  const int64_t elem = c.kv == DType::kBF16 ? 2 : 1;
  const int64_t page_elems = int64_t{kvh} * 2 * sc.block_size * sc.head_dim;
  const int64_t page_bytes = page_elems * elem;
  const int64_t chunk_bytes = 64 * sc.head_dim * elem;

  // One set's bytes (every set has the same shape, on other pages): both chunks of every
  // selected (request, KV head, block), except the own block's second chunk when no row reaches it.
  const int64_t own = nb - 1;
  const int64_t last_pos = c.context - 1;
  // K and V, 2 chunks each, of `blocks` distinct selected (request, KV head, block) triples.
  auto tiles_of = [&](double blocks) {
    double t = 2.0 * 2.0 * chunk_bytes * blocks;
    if (last_pos % sc.block_size < 64) t -= 2.0 * chunk_bytes * c.batch * kvh;
    return t;
  };
  const double tile_bytes =
      tiles_of(double{1.0} * c.batch * kvh * k);  // rows sharing: a lower bound
  const double io_bytes = rows * sc.q_heads * sc.head_dim * 2.0 * 2 + rows * kvh * k * 4.0;
  const int shared = c.row_share < 0 ? k - 1 : std::min(c.row_share, k - 1);
  const int distinct_per_head =
      static_cast<int>(std::min<int64_t>(nb, 1 + shared + int64_t{k - 1 - shared} * c.q_len));

  const int sets = static_cast<int>(std::clamp<int64_t>(
      (4 * kL2Bytes + static_cast<int64_t>(tile_bytes) - 1) / static_cast<int64_t>(tile_bytes), 2,
      64));
  const int64_t pages_per_set =
      int64_t{c.batch} * std::min<int64_t>(nb, int64_t{kvh} * distinct_per_head);  // heads disjoint
  const int64_t pages = pages_per_set * sets;

  cuda::DeviceBuffer cache(static_cast<size_t>(pages * page_bytes));
  fill_random(cache.data(), pages * page_elems, c.kv == DType::kFP8E4M3, seed, nullptr);
  cuda::DeviceBuffer q(static_cast<size_t>(sets * rows * sc.q_heads * sc.head_dim * 2));
  fill_random(q.data(), sets * rows * sc.q_heads * sc.head_dim, false, seed + 1, nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  cuda::DeviceBuffer out(static_cast<size_t>(sets * rows * sc.q_heads * sc.head_dim * 2));
  cuda::DeviceBuffer seq_lens(static_cast<size_t>(c.batch) * 4);
  std::vector<int32_t> lens(static_cast<size_t>(c.batch), static_cast<int32_t>(c.context));
  CUDA_CHECK(cudaMemcpy(seq_lens.data(), lens.data(), seq_lens.bytes(), cudaMemcpyHostToDevice));
  cuda::DeviceBuffer tables(static_cast<size_t>(sets * c.batch * nb * 4));
  cuda::DeviceBuffer topk(static_cast<size_t>(sets * rows * kvh * k * 4));

  Rng rng(seed + 2);
  std::vector<int32_t> table(static_cast<size_t>(c.batch * nb));
  std::vector<int32_t> sel(static_cast<size_t>(rows * kvh * k));
  double union_blocks = 0;  // distinct (request, KV head, block) over every set
  auto draw_until = [&](std::vector<int32_t>& blocks, std::size_t size) {
    while (blocks.size() < size) {
      const auto b = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(nb - 1));
      if (std::find(blocks.begin(), blocks.end(), b) == blocks.end()) blocks.push_back(b);
    }
  };
  for (int s = 0; s < sets; ++s) {
    std::fill(table.begin(), table.end(), static_cast<int32_t>(s * pages_per_set));
    int64_t next_page = s * pages_per_set;
    for (int r = 0; r < c.batch; ++r) {
      std::set<int64_t> used;
      for (int h = 0; h < kvh; ++h) {
        std::vector<int32_t> common{static_cast<int32_t>(own)};
        draw_until(common, static_cast<std::size_t>(1 + shared));
        std::set<int32_t> head_union;
        for (int j = 0; j < c.q_len; ++j) {
          std::vector<int32_t> blocks = common;
          draw_until(blocks, static_cast<std::size_t>(k));
          for (int32_t b : blocks) {
            head_union.insert(b);
            if (used.insert(b).second)
              table[static_cast<size_t>(r * nb + b)] = static_cast<int32_t>(next_page++);
          }
          std::copy(blocks.begin(), blocks.end(),
                    sel.begin() + ((int64_t{r} * c.q_len + j) * kvh + h) * k);
        }
        union_blocks += static_cast<double>(head_union.size());
      }
    }
    CUDA_CHECK(cudaMemcpy(tables.as<int32_t>() + s * c.batch * nb, table.data(), table.size() * 4,
                          cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(topk.as<int32_t>() + s * rows * kvh * k, sel.data(), sel.size() * 4,
                          cudaMemcpyHostToDevice));
  }

  // The floor counts each distinct (request, KV head, block) once, however many rows select it.
  const double bytes = tiles_of(union_blocks / sets) + io_bytes;

  PlanLimits limits;
  limits.max_reqs = c.batch;
  limits.max_q_len = c.q_len;
  const size_t ws_bytes = cuda::attention_workspace_size(sc, limits);
  cuda::DeviceBuffer ws(ws_bytes);
  CUDA_CHECK(cudaMemset(ws.data(), 0, ws_bytes));

  auto args_for = [&](int s) {
    AttentionArgs a;
    const Device dev = Device::cuda(0);
    a.q = TensorView::contiguous(
        static_cast<uint8_t*>(q.data()) + s * rows * sc.q_heads * sc.head_dim * 2, DType::kBF16,
        {rows, sc.q_heads, sc.head_dim}, dev);
    a.out = TensorView::contiguous(
        static_cast<uint8_t*>(out.data()) + s * rows * sc.q_heads * sc.head_dim * 2, DType::kBF16,
        {rows, sc.q_heads, sc.head_dim}, dev);
    // Every layout holds the same elements per page, so one buffer serves all three: only the
    // addressing differs (vLLM: a token's heads side by side; FlashInfer: K and V in one row).
    a.kv_cache = kv_cache_from_layout(
        TensorView::contiguous(
            cache.data(), c.kv,
            testkit::kv_layout_shape(c.layout, pages, kvh, sc.block_size, sc.head_dim), dev),
        c.layout, c.kv == DType::kFP8E4M3 ? 0.5f : 1.0f, c.kv == DType::kFP8E4M3 ? 0.25f : 1.0f);
    a.batch.kind = BatchKind::kDecode;
    a.batch.num_reqs = c.batch;
    a.batch.q_len = c.q_len;
    a.batch.seq_lens = TensorView::contiguous(seq_lens.data(), DType::kI32, {c.batch}, dev);
    a.batch.kv_block_table = TensorView::contiguous(tables.as<int32_t>() + s * c.batch * nb,
                                                    DType::kI32, {c.batch, nb}, dev);
    a.topk_idx = TensorView::contiguous(topk.as<int32_t>() + s * rows * kvh * k, DType::kI32,
                                        {rows, kvh, k}, dev);
    return a;
  };

  cuda::Stream stream;
  const int launches = std::max(launches_min, sets);
  // Warm-up eagerly (also configures the kernel), then capture.
  for (int s = 0; s < sets; ++s) {
    cuda::launch_attention_tuned(sc, args_for(s), ws.data(), ws_bytes, stream.get(), c.tuning);
  }
  stream.synchronize();
  cuda::Graph graph = cuda::Graph::capture(stream.get(), [&] {
    for (int i = 0; i < launches; ++i) {
      cuda::launch_attention_tuned(sc, args_for(i % sets), ws.data(), ws_bytes, stream.get(),
                                   c.tuning);
    }
  });
  const Timing timing = time_graph(graph, stream.get(), launches, /*warmup=*/2, reps);
  Result res;
  if (timeline) {
    graph.launch(stream.get());
    res.timeline = record_timeline(
        fmt::format("attention {} tp {} batch {} q_len {} context {} tuning {}", kv_name(c), c.tp,
                    c.batch, c.q_len, c.context, c.tuning.name()),
        [&] {
          cuda::launch_attention_tuned(sc, args_for(launches % sets), ws.data(), ws_bytes,
                                       stream.get(), c.tuning);
        },
        timeline_records ? &res.timeline_records : nullptr);
  }
  res.cfg = c;
  const cuda::AttentionPlanInfo plan =
      cuda::attention_plan_info(sc, rows, c.q_len, false, c.kv == DType::kFP8E4M3, c.tuning);
  res.splits = plan.splits;
  res.row_tiles = plan.row_tiles;
  res.cluster = plan.cluster;
  res.balanced = plan.balanced;
  res.sets = sets;
  res.timing = timing;
  res.bytes = bytes;
  return res;
}

int run_attention_bench(int argc, char** argv) {
  CLI::App app{"CUDA block-sparse decode attention (graph replay, rotated inputs)"};
  std::string batches = "1,4,32,128";
  std::string q_lens = "1,4";
  std::string contexts = "32768,131072";
  std::string kvs = "bf16,fp8";
  std::string layouts = "ours";
  int reps = 20;
  int launches = 20;
  std::string tunings =
      "default;cluster=0,pdl=0;cluster=0,pdl=1;cluster=2,pdl=0;cluster=2,pdl=1;"
      "splitp=0,cluster=2,pdl=1";
  std::string json_path;
  uint64_t seed = 1;
  app.add_option("--batch", batches, "comma-separated batch sizes (requests)");
  app.add_option("--q-len", q_lens, "comma-separated query lengths");
  app.add_option("--context", contexts, "comma-separated context lengths (tokens)");
  app.add_option("--kv", kvs, "comma-separated KV dtypes: bf16, fp8");
  std::string tps = "1";
  app.add_option("--tp", tps,
                 "comma-separated tensor-parallel sizes: one rank's shape each (M3: 64 q / 4 KV "
                 "heads at TP 1, 16 / 1 at TP 4, 8 / 1 at TP 8)");
  int row_share = -1;
  app.add_option("--row-share", row_share,
                 "random blocks (of 15) a request's rows share besides their own block; each row "
                 "draws the rest itself (per-row selections, as speculative rows have); the floor "
                 "counts every distinct block once. Default: all (one selection per request)");
  app.add_option("--layout", layouts,
                 "comma-separated main-cache layouts timed side by side: ours [pages, kv_heads, 2, "
                 "128, hd], vllm [pages, 2, 128, kv_heads, hd], flashinfer [pages, kv_heads, 128, "
                 "2 hd] (docs/spec.md section 3)");
  app.add_option("--reps", reps, "graph replays per configuration (median over them)");
  app.add_option("--launches", launches, "launches per graph (at least the number of input sets)");
  app.add_option(
      "--tunings", tunings,
      "';'-separated launcher tunings to time side by side (attention.h: "
      "splitp, cluster, pdl, splits, rows, early, balance, deep; 'default' = the "
      "library default); configurations where two tunings give the same launch are timed "
      "once");
  bool quick = false;
  app.add_flag("--quick", quick, "subset: batch 1,32 x q_len 1 x 128K, default tuning only");
  app.add_option("--json", json_path, "write the results as JSON here");
  app.add_option("--seed", seed, "random seed");
  bool timeline = false;
  app.add_flag("--timeline", timeline,
               "after timing each configuration, record one more launch's stage stamps (per CTA: "
               "pages looked up, first chunk in, chunks done, partials published, end) and print "
               "when each stage ended (bench/timeline.h); also in the JSON");
  bool timeline_records = false;
  app.add_flag("--timeline-records", timeline_records,
               "--timeline, and every CTA's SM, kind and stamps in the JSON (`timeline_records`)");
  if (auto code = parse_flags(app, argc, argv)) return *code;
  timeline = timeline || timeline_records;
  // Every value is checked here, before the device and the first measurement.
  const SparseConfig m3 = ModelConfig{}.sparse();  // block size and topk: the same at every TP
  std::vector<int> batch_list = int_list("--batch", batches, 1);
  std::vector<int> q_len_list = int_list("--q-len", q_lens, 1, kMaxQueryLen);
  std::vector<int64_t> context_list =
      int_list<int64_t>("--context", contexts, 1, std::numeric_limits<int32_t>::max());
  // A request selects topk distinct blocks (its own and topk - 1 others).
  const int64_t min_context = int64_t{m3.topk - 1} * m3.block_size + 1;
  for (int64_t context : context_list) {
    require_flag(context >= min_context, "--context",
                 fmt::format("{} tokens are fewer than the {} blocks of {} a request selects (at "
                             "least {})",
                             context, m3.topk, m3.block_size, min_context));
  }
  const std::vector<DType> dtypes = dtype_list("--kv", kvs, {DType::kBF16, DType::kFP8E4M3});
  const std::vector<int> tp_list = int_list("--tp", tps, 1);
  for (int tp : tp_list) with_flag("--tp", [&] { return ModelConfig{}.sparse(tp); });
  require_flag(row_share >= -1 && row_share <= m3.topk - 1, "--row-share",
               fmt::format("expected -1 (all) or 0..{}, got {}", m3.topk - 1, row_share));
  const std::vector<KVLayout> layout_list =
      parsed_list("--layout", layouts,
                  [](const std::string& item) { return parse_kv_layout(item, "--layout"); });
  require_range("--reps", reps, 1);
  require_range("--launches", launches, 1);
  std::vector<cuda::AttentionTuning> tuning_list = parsed_list(
      "--tunings", tunings,
      [](const std::string& item) {
        return item == "default" ? cuda::default_attention_tuning()
                                 : cuda::AttentionTuning::parse(item);
      },
      ';');
  if (quick) {
    batch_list = {1, 32};
    q_len_list = {1};
    context_list = {131072};
    tuning_list = {cuda::default_attention_tuning()};
  }
  require_output_path("--json", json_path);
  require_device("bench attention");
  const std::string device = device_description();
  ResultFile results("attention", argc, argv, json_path);
  std::printf(
      "m3msa bench attention on %s; read ceiling %.2f TB/s; M3 shapes (one rank's under --tp): "
      "64 q heads, 4 KV heads, head_dim 128, topk 16; graph replay, inputs rotated over > 4x "
      "L2\n",
      device.c_str(), kReadCeilingTBs);
  Table table({"tp", "kv", "layout", "batch", "q_len", "context", "rows/cta", "splits", "merge",
               "median us", "noise", "MB", "TB/s", "% roof"});
  for (DType kv : dtypes) {
    for (int tp : tp_list) {
      for (int64_t context : context_list) {
        for (int q_len : q_len_list) {
          for (int batch : batch_list) {
            std::set<std::string> seen;  // launches already timed for this configuration
            for (const cuda::AttentionTuning& tuning : tuning_list) {
              for (KVLayout layout : layout_list) {
                const Config c{batch, q_len, kv, context, tuning, layout, row_share, tp};
                const cuda::AttentionPlanInfo plan =
                    cuda::attention_plan_info(ModelConfig{}.sparse(tp), int64_t{batch} * q_len,
                                              q_len, false, kv == DType::kFP8E4M3, tuning);
                const std::string key = fmt::format(
                    "{}{}{}{}r{}{}{}{}", kv == DType::kBF16 && !tuning.split_p ? "1P" : "2P",
                    plan.cluster ? "c" : "g", tuning.pdl ? "p" : "-", plan.splits, plan.row_tiles,
                    plan.balanced ? "b" : "", plan.deep ? "d" : "", kv_layout_name(layout));
                if (!seen.insert(key).second) continue;
                const Result r = run_config(c, launches, reps, seed, timeline, timeline_records);
                const double us = r.timing.median_us;
                const double tbs = r.bytes / (us * 1e-6) / 1e12;
                const std::string merge =
                    r.balanced ? "balanced"
                               : (r.splits == 1 ? "-" : (r.cluster ? "cluster" : "global"));
                const std::string label =
                    (kv == DType::kBF16 && !tuning.split_p ? "bf16-1P" : kv_name(c)) +
                    (tuning.pdl ? "+pdl" : "");
                std::vector<std::string> cells = {
                    fmt::format("{}", c.tp),
                    label,
                    kv_layout_name(layout),
                    fmt::format("{}", c.batch),
                    fmt::format("{}", c.q_len),
                    fmt::format("{}", context),
                    fmt::format("{}", r.row_tiles),
                    fmt::format("{}", r.splits),
                    merge,
                    fmt::format("{:.2f}", us),
                    fmt::format("{:.1f}%", 100.0 * r.timing.noise()),
                    fmt::format("{:.1f}", r.bytes / 1e6),
                    fmt::format("{:.2f}", tbs),
                    fmt::format("{:.1f}%", 100.0 * tbs / kReadCeilingTBs)};
                std::fprintf(stderr, "%s\n", fmt::format("{}", fmt::join(cells, " ")).c_str());
                table.add(cells, {{"bench", "attention"},
                                  {"kv", kv_name(c)},
                                  {"tuning", tuning.name()},
                                  {"layout", kv_layout_name(layout)},
                                  {"row_share", row_share},
                                  {"tp", c.tp},
                                  {"q_heads", ModelConfig{}.sparse(c.tp).q_heads},
                                  {"kv_heads", ModelConfig{}.sparse(c.tp).kv_heads},
                                  {"label", label},
                                  {"batch", c.batch},
                                  {"q_len", c.q_len},
                                  {"context", context},
                                  {"splits", r.splits},
                                  {"row_tiles", r.row_tiles},
                                  {"merge", merge},
                                  {"input_sets", r.sets},
                                  {"median_us", us},
                                  {"p10_us", r.timing.p10_us},
                                  {"p90_us", r.timing.p90_us},
                                  {"noise", r.timing.noise()},
                                  {"bytes", r.bytes},
                                  {"tb_per_s", tbs},
                                  {"pct_of_read_ceiling", 100.0 * tbs / kReadCeilingTBs},
                                  {"device", device}});
                table.last_record().update(measured_fields(r.timing, r.bytes));
                if (!r.timeline.is_null()) table.last_record()["timeline"] = r.timeline;
                if (!r.timeline_records.is_null()) {
                  table.last_record()["timeline_records"] = r.timeline_records;
                }
                results.write(table.records(), false);
              }
            }
          }
        }
      }
    }
  }
  table.print();
  results.write(table.records());
  return 0;
}

const m3msa::cli::BenchRegistrar kRegistrar("attention",
                                            "block-sparse decode attention (graph replay)",
                                            run_attention_bench);

}  // namespace
}  // namespace m3msa::bench
