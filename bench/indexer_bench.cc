// m3msa bench indexer: the CUDA decode indexer (the default, the span kernel, the unfused baseline
// and, with --split-merge, both merge placements) under CUDA-graph replay, swept over batch x
// context x index dtype x query length.
//
// Per configuration every request has seq_len = context (nb = context / 128 blocks, all on their
// own shuffled pages). Input copies on disjoint pages (own tables and queries) rotate so that one
// graph's launches read several times the 60 MB L2 (harness.h). Both variants run on the same
// copies in the same process; their selections are compared (they must be bit-identical).
//
// Bytes (the floor): every visible index-K token row once (B * nb * 128 * 128 * elem), plus the
// queries, the table entries, seq_lens and topk_idx. TB/s = bytes / median time; "% roof" is that
// over the measured 4.57 TB/s read ceiling. The PyTorch eager baseline (bench/torch_indexer.py)
// is read from --torch-json when given and matched by (batch, context, dtype, q_len).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <vector>

#include "bench_registry.h"
#include "cuda/common.cuh"
#include "cuda/indexer.h"
#include "fill.h"
#include "harness.h"
#include "m3msa/batch.h"
#include "m3msa/cuda_backend.h"
#include "m3msa/dtype.h"
#include "m3msa/error.h"
#include "m3msa/ops.h"
#include "m3msa/testing/splitmix.h"
#include "timeline.h"

namespace m3msa::bench {
namespace {

using Rng = testkit::SaltedRng<9>;

struct Config {
  int batch;
  int64_t context;
  DType dtype;
  int q_len;
  int min_blocks;  // IndexerPlan::min_blocks_per_cta
  int tp;          // tensor-parallel size whose per-rank shape is timed
  bool fp8_query;  // index_q in fp8 e4m3 (fp8 cache only: scored on the FP8 tensor cores)
};

std::string fmt_context(int64_t context) {
  return context >= (1 << 20) && context % (1 << 20) == 0 ? fmt::format("{}M", context >> 20)
                                                          : fmt::format("{}K", context >> 10);
}

struct Options {
  // The comma lists as given; parsed (and checked) into the vectors below.
  std::string batches_text = "1,4,32,128";
  std::string contexts_text = "4096,32768,131072,524288,1048576";
  std::string dtypes_text = "bf16,fp8";
  std::string q_lens_text = "1,4";
  std::string tps_text = "1";
  std::string q_dtypes_text = "bf16";
  std::string min_blocks_text = "1";
  std::vector<int> batches;
  std::vector<int64_t> contexts;
  std::vector<DType> dtypes;
  std::vector<int> q_lens;
  std::vector<int> tps;
  std::vector<DType> q_dtypes;
  std::vector<int> min_blocks;
  bool quick = false;
  bool no_unfused = false;
  bool split_merge = false;
  bool timeline = false;
  int reps = 30;
  int64_t rotate_bytes = 4 * kL2Bytes;
  int max_copies = 256;
  std::string json_path;
  std::string torch_json;
  std::string commit;
};

int run_indexer_bench(int argc, char** argv) {
  Options opt;
  CLI::App app{"CUDA decode indexer benchmark (graph replay, rotated inputs)"};
  app.add_option("--batches", opt.batches_text, "comma-separated batch sizes");
  app.add_option("--contexts", opt.contexts_text, "comma-separated context lengths in tokens");
  app.add_option("--dtypes", opt.dtypes_text, "comma-separated index-K cache dtypes: bf16, fp8");
  app.add_option("--q-lens", opt.q_lens_text, "comma-separated query rows per request");
  app.add_option("--tp", opt.tps_text,
                 "comma-separated tensor-parallel sizes: one rank's shape each (M3: 4 index heads "
                 "at TP 1, one at TP 4 and 8)");
  app.add_option("--q-dtypes", opt.q_dtypes_text,
                 "comma-separated index_q dtypes: bf16, fp8 (fp8 runs with the fp8 index cache "
                 "only)");
  app.add_flag("--quick", opt.quick, "batches 1,32 x contexts 4K,128K only");
  app.add_flag("--no-unfused", opt.no_unfused, "skip the unfused baseline");
  app.add_flag("--split-merge", opt.split_merge,
               "also time the two merge placements the default picks between: the merge as a "
               "separate, programmatically dependent kernel (IndexerVariant::kSplitMerge) and in "
               "the request's last CTA (kLastCtaMerge)");
  app.add_option("--min-blocks", opt.min_blocks_text,
                 "comma-separated IndexerPlan::min_blocks_per_cta values to time side by side "
                 "(>= 1)");
  app.add_flag(
      "--timeline", opt.timeline,
      "after timing, record one more launch of each timed variant but span and unfused "
      "with its stage stamps (split kernel per CTA: first page in, scored, candidates "
      "out, arrived, survivors listed, end; the merge kernel's) and print when each stage ended "
      "(bench/timeline.h); also in the JSON");
  app.add_option("--reps", opt.reps, "graph replays per measurement (at most)");
  app.add_option("--rotate-bytes", opt.rotate_bytes,
                 "bytes of distinct inputs one graph cycles through (default 4 x L2)");
  app.add_option("--json", opt.json_path, "write the results as JSON here");
  app.add_option("--torch-json", opt.torch_json, "PyTorch baseline results (torch_indexer.py)");
  app.add_option("--commit", opt.commit, "commit id recorded in the JSON (default $M3MSA_COMMIT)");
  if (auto code = parse_flags(app, argc, argv)) return *code;
  // Every value is checked here, before the device and the first measurement.
  const ModelConfig model;  // M3: 4 index heads, dim 128, block 128, top-16, forced own block
  const std::vector<DType> cache_dtypes = {DType::kBF16, DType::kFP8E4M3};
  opt.batches = int_list("--batches", opt.batches_text, 1);
  opt.contexts =
      int_list<int64_t>("--contexts", opt.contexts_text, 1, std::numeric_limits<int32_t>::max());
  opt.dtypes = dtype_list("--dtypes", opt.dtypes_text, cache_dtypes);
  opt.q_lens = int_list("--q-lens", opt.q_lens_text, 1, kMaxQueryLen);
  opt.tps = int_list("--tp", opt.tps_text, 1);
  // A size that does not split M3's heads is refused here.
  for (int tp : opt.tps) with_flag("--tp", [&] { return model.sparse(tp); });
  opt.q_dtypes = dtype_list("--q-dtypes", opt.q_dtypes_text, cache_dtypes);
  opt.min_blocks = int_list("--min-blocks", opt.min_blocks_text, 1);
  require_range("--reps", opt.reps, 1);
  require_range("--rotate-bytes", opt.rotate_bytes, 0);
  if (opt.quick) {
    opt.batches = {1, 32};
    opt.contexts = {4096, 131072};
  }
  require_output_path("--json", opt.json_path);
  require_device("bench indexer");
  ResultFile results("indexer", argc, argv, opt.json_path, opt.commit);
  const TorchBaseline torch =
      TorchBaseline::read(opt.torch_json, {"batch", "context", "dtype", "q_len"}, "bench indexer");

  cuda::Stream stream;
  const std::string device = device_description();
  std::printf("m3msa bench indexer on %s\n", device.c_str());
  std::printf("bytes = index-K rows read once + queries + tables + output; roof = 4.57 TB/s\n\n");

  Table table({"tp", "batch", "context", "dtype", "q", "min blk", "default us", "noise", "MB",
               "TB/s", "% roof", "span us", "x span", "unfused us", "x unfused", "torch us",
               "x torch", "check"});
  std::vector<Config> configs;
  for (const DType dtype : opt.dtypes) {
    for (int q : opt.q_lens) {
      for (int b : opt.batches) {
        for (int64_t ctx : opt.contexts) {
          for (int mb : opt.min_blocks) {
            for (int tp : opt.tps) {
              for (const DType q_dtype : opt.q_dtypes) {
                const bool q8 = q_dtype == DType::kFP8E4M3;
                if (q8 && dtype != DType::kFP8E4M3) continue;  // fp8 queries need an fp8 cache
                configs.push_back({b, ctx, dtype, q, mb, tp, q8});
              }
            }
          }
        }
      }
    }
  }

  for (const Config& cfg : configs) {
    const bool fp8 = cfg.dtype == DType::kFP8E4M3;
    const SparseConfig config = model.sparse(cfg.tp);
    // The table's dtype column: the cache's, with "+q8" for fp8 queries on the FP8 tensor cores.
    const char* shown_dtype = !fp8 ? "bf16" : cfg.fp8_query ? "fp8+q8" : "fp8";
    const int H = config.index_heads;
    const int k = config.topk;
    const int64_t nb = (cfg.context + 127) / 128;
    const int64_t rows = int64_t{cfg.batch} * cfg.q_len;
    const int64_t page_bytes = 128 * 128 * (fp8 ? 1 : 2);
    const int64_t pages_per_copy = cfg.batch * nb;
    const int64_t bytes_per_launch = pages_per_copy * page_bytes +
                                     rows * H * 128 * (cfg.fp8_query ? 1 : 2) + pages_per_copy * 4 +
                                     cfg.batch * 4 + rows * H * k * 4;
    const int copies = static_cast<int>(std::clamp<int64_t>(
        (opt.rotate_bytes + pages_per_copy * page_bytes - 1) / (pages_per_copy * page_bytes), 1,
        opt.max_copies));
    const int64_t pool_pages = pages_per_copy * copies;
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const double need = static_cast<double>(pool_pages) * page_bytes +
                        static_cast<double>(rows) * H * nb * 4 + (1 << 28);
    if (need > 0.85 * static_cast<double>(free_bytes)) {
      std::printf("skip batch %d context %s %s q %d: needs %.1f GB, %.1f GB free\n", cfg.batch,
                  fmt_context(cfg.context).c_str(), dtype_name(cfg.dtype), cfg.q_len, need / 1e9,
                  free_bytes / 1e9);
      continue;
    }

    // Inputs: the page pool, then per copy a shuffled table, seq_lens and queries.
    DeviceTensor pool(cfg.dtype, {pool_pages, 128, 128});
    fill_random(pool.data(), pool.numel(), fp8, 1234 + cfg.batch * 7 + cfg.context, stream.get());
    Rng rng(static_cast<uint64_t>(cfg.batch) * 1000003u + static_cast<uint64_t>(cfg.context));
    std::vector<DeviceTensor> tables, seqs, queries;
    for (int c = 0; c < copies; ++c) {
      HostTensor t(DType::kI32, {cfg.batch, nb});
      std::vector<int32_t> order(static_cast<size_t>(pages_per_copy));
      std::iota(order.begin(), order.end(), static_cast<int32_t>(c * pages_per_copy));
      for (int64_t i = pages_per_copy - 1; i > 0; --i) {
        std::swap(order[i], order[rng.next() % static_cast<uint64_t>(i + 1)]);
      }
      std::memcpy(t.data(), order.data(), order.size() * sizeof(int32_t));
      tables.push_back(to_device(t));
      HostTensor s(DType::kI32, {cfg.batch});
      for (int r = 0; r < cfg.batch; ++r) s.ptr<int32_t>()[r] = static_cast<int32_t>(cfg.context);
      seqs.push_back(to_device(s));
      DeviceTensor q(cfg.fp8_query ? DType::kFP8E4M3 : DType::kBF16, {rows, H, 128});
      fill_random(q.data(), q.numel(), cfg.fp8_query, 777 + c, stream.get());
      queries.push_back(std::move(q));
    }
    DeviceTensor out_fused(DType::kI32, {rows, H, k});
    DeviceTensor out_unfused(DType::kI32, {rows, H, k});
    DeviceTensor out_span(DType::kI32, {rows, H, k});
    DeviceTensor out_merge(DType::kI32, {rows, H, k});
    DeviceTensor out_last_cta(DType::kI32, {rows, H, k});
    auto args_for = [&](int c, const DeviceTensor& out) {
      IndexerArgs a;
      a.index_q = queries[c].view();
      a.index_cache = IndexCache{pool.view()};
      a.batch.kind = BatchKind::kDecode;
      a.batch.num_reqs = cfg.batch;
      a.batch.q_len = cfg.q_len;
      a.batch.seq_lens = seqs[c].view();
      a.batch.index_block_table = tables[c].view();
      a.topk_idx = out.view();
      return a;
    };
    PlanLimits limits;
    limits.max_reqs = cfg.batch;
    limits.max_q_len = cfg.q_len;
    limits.max_context = opt.no_unfused ? 0 : cfg.context;
    cuda::IndexerPlan plan = cuda::plan_indexer(config, limits, 0);
    plan.min_blocks_per_cta = cfg.min_blocks;
    cuda::DeviceBuffer workspace(plan.workspace_bytes);
    cuda::init_indexer_workspace(plan, workspace.data(), stream.get());
    stream.synchronize();

    // With `timeline` (--timeline): one more launch recorded after a replay, on copy 0 (the one
    // the replay read longest ago).
    auto measure = [&](IndexerVariant variant, const DeviceTensor& out,
                       nlohmann::json* timeline = nullptr) {
      cuda::Graph graph = cuda::Graph::capture(stream.get(), [&] {
        for (int c = 0; c < copies; ++c) {
          cuda::launch_indexer(plan, config, args_for(c, out), variant, workspace.data(),
                               stream.get());
        }
      });
      const Timing t = time_graph(graph, stream.get(), copies, 2, opt.reps);
      if (timeline != nullptr && opt.timeline) {
        graph.launch(stream.get());
        *timeline = record_timeline(
            fmt::format("indexer {} tp {} batch {} context {} q_len {} {}", shown_dtype, cfg.tp,
                        cfg.batch, fmt_context(cfg.context), cfg.q_len,
                        variant == IndexerVariant::kSplitMerge     ? "merge kernel"
                        : variant == IndexerVariant::kLastCtaMerge ? "last-CTA merge"
                                                                   : "default"),
            [&] {
              cuda::launch_indexer(plan, config, args_for(0, out), variant, workspace.data(),
                                   stream.get());
            });
        // `out` holds the last copy's answer again: the checks compare it across variants.
        cuda::launch_indexer(plan, config, args_for(copies - 1, out), variant, workspace.data(),
                             stream.get());
        stream.synchronize();
      }
      return t;
    };
    nlohmann::json fused_timeline, merge_timeline, last_cta_timeline;
    const Timing fused = measure(IndexerVariant::kFused, out_fused, &fused_timeline);
    const Timing span = measure(IndexerVariant::kSpan, out_span);
    Timing unfused;
    std::string check;
    {
      HostTensor a, b;
      copy_to_host(out_fused.view(), a);
      copy_to_host(out_span.view(), b);
      check = std::memcmp(a.data(), b.data(), a.nbytes()) == 0 ? "span same" : "span DIFF";
    }
    if (!opt.no_unfused) {
      unfused = measure(IndexerVariant::kUnfused, out_unfused);
      HostTensor a, b;
      copy_to_host(out_fused.view(), a);
      copy_to_host(out_unfused.view(), b);
      check +=
          std::memcmp(a.data(), b.data(), a.nbytes()) == 0 ? ", unfused same" : ", unfused DIFF";
    }
    Timing merge, last_cta;
    if (opt.split_merge) {
      merge = measure(IndexerVariant::kSplitMerge, out_merge, &merge_timeline);
      last_cta = measure(IndexerVariant::kLastCtaMerge, out_last_cta, &last_cta_timeline);
      HostTensor a, b, c;
      copy_to_host(out_fused.view(), a);
      copy_to_host(out_merge.view(), b);
      copy_to_host(out_last_cta.view(), c);
      check += std::memcmp(a.data(), b.data(), a.nbytes()) == 0 ? ", merge kernel same"
                                                                : ", merge kernel DIFF";
      check += std::memcmp(a.data(), c.data(), a.nbytes()) == 0 ? ", last-CTA merge same"
                                                                : ", last-CTA merge DIFF";
    }
    const uint32_t status = cuda::read_indexer_status(plan, workspace.data(), stream.get(), true);
    if (status != 0) check += fmt::format(" status {}", status);

    const double tbs = static_cast<double>(bytes_per_launch) / (fused.median_us * 1e-6) / 1e12;
    const double roof = 100.0 * tbs / kReadCeilingTBs;
    const double torch_us =
        cfg.tp == 1 && !cfg.fp8_query
            ? torch.median_us({cfg.batch, cfg.context, fp8 ? "fp8" : "bf16", cfg.q_len})
            : 0.0;
    nlohmann::json rec = {{"tp", cfg.tp},
                          {"q_dtype", cfg.fp8_query ? "fp8" : "bf16"},
                          {"index_heads", H},
                          {"batch", cfg.batch},
                          {"context", cfg.context},
                          {"dtype", fp8 ? "fp8" : "bf16"},
                          {"q_len", cfg.q_len},
                          {"min_blocks_per_cta", cfg.min_blocks},
                          {"fused_us", fused.median_us},
                          {"fused_p10_us", fused.p10_us},
                          {"fused_p90_us", fused.p90_us},
                          {"bytes", bytes_per_launch},
                          {"tb_per_s", tbs},
                          {"pct_roof", roof},
                          {"floor_us", bytes_per_launch / (kReadCeilingTBs * 1e12) * 1e6},
                          {"span_us", span.median_us},
                          {"speedup_vs_span", span.median_us / fused.median_us},
                          {"copies", copies},
                          {"reps", fused.reps},
                          {"check", check}};
    rec.update(measured_fields(fused, static_cast<double>(bytes_per_launch)));
    if (!opt.no_unfused) {
      rec["unfused_us"] = unfused.median_us;
      rec["speedup_vs_unfused"] = unfused.median_us / fused.median_us;
    }
    if (opt.split_merge) {
      rec["split_merge_us"] = merge.median_us;
      rec["split_merge_vs_fused"] = merge.median_us / fused.median_us;
      rec["last_cta_merge_us"] = last_cta.median_us;
    }
    if (!fused_timeline.is_null()) rec["timeline"] = fused_timeline;
    if (!merge_timeline.is_null()) rec["timeline_split_merge"] = merge_timeline;
    if (!last_cta_timeline.is_null()) rec["timeline_last_cta_merge"] = last_cta_timeline;
    if (torch_us > 0) {
      rec["torch_us"] = torch_us;
      rec["speedup_vs_torch"] = torch_us / fused.median_us;
    }
    table.add(
        {std::to_string(cfg.tp), std::to_string(cfg.batch), fmt_context(cfg.context), shown_dtype,
         std::to_string(cfg.q_len), std::to_string(cfg.min_blocks),
         fmt::format("{:.1f}", fused.median_us), fmt::format("{:.0f}%", 100.0 * fused.noise()),
         fmt::format("{:.1f}", bytes_per_launch / 1e6), fmt::format("{:.2f}", tbs),
         fmt::format("{:.0f}%", roof), fmt::format("{:.1f}", span.median_us),
         fmt::format("{:.2f}", span.median_us / fused.median_us),
         opt.no_unfused ? "-" : fmt::format("{:.1f}", unfused.median_us),
         opt.no_unfused ? "-" : fmt::format("{:.2f}", unfused.median_us / fused.median_us),
         torch_us > 0 ? fmt::format("{:.0f}", torch_us) : "-",
         torch_us > 0 ? fmt::format("{:.1f}", torch_us / fused.median_us) : "-", check},
        rec);
    results.write(table.records(), false);
    std::printf(
        "tp %d batch %4d context %5s %-4s q %d min blocks %d: default %9.1f us (%3.0f%% roof), span"
        " %9.1f us, unfused %9.1f us, merge kernel %9.1f us, last-CTA merge %9.1f us [%s]\n",
        cfg.tp, cfg.batch, fmt_context(cfg.context).c_str(), shown_dtype, cfg.q_len, cfg.min_blocks,
        fused.median_us, roof, span.median_us, unfused.median_us, merge.median_us,
        last_cta.median_us, check.c_str());
    std::fflush(stdout);
  }
  std::printf("\n");
  table.print();

  if (!torch.meta().is_null()) results.meta()["torch"] = torch.meta();
  results.write(table.records());
  return 0;
}

const m3msa::cli::BenchRegistrar kRegistrar(
    "indexer", "decode indexer: fused vs unfused (and PyTorch), graph replay", run_indexer_bench);

}  // namespace
}  // namespace m3msa::bench
