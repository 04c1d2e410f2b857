// m3msa bench sparse-step: one sparse layer's selection + attention as a decode step runs them,
// under CUDA-graph replay: the indexer writes topk_idx, the sparse attention reads it.
//
// Per configuration every request has seq_len = context; index-K and main-KV pages of a block
// share the page id (one table serves both caches). Input copies on disjoint pages (own tables,
// queries and outputs) rotate so that one graph's launches read several times the 60 MB L2.
//
// Each configuration's data is timed under every pair of --indexer variant (default: the split
// kernel with the merge placement the library picks; split-merge: the merge as a second,
// programmatically dependent kernel; last-cta: the merge in the request's last CTA)
// and --attention-tunings entry (attention.h, e.g. "default;pdl=1"; "default" is the runtime's
// pick after the indexer, attention_tuning_after_indexer); --tp times one rank's shapes
// under tensor parallelism (ModelConfig::sparse(tp): one index and one KV head from TP 4).
//
// Bytes (the floor): the indexer's (every visible index-K row once + queries + table + output, as
// in `bench indexer`) plus the attention's: the K and V tiles of every distinct (request, KV head,
// block) the step selected, counted from the selections it actually made, plus q and out. Floor =
// bytes / 4.57 TB/s.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "bench_registry.h"
#include "cuda/attention.h"
#include "cuda/common.cuh"
#include "cuda/indexer.h"
#include "fill.h"
#include "harness.h"
#include "m3msa/batch.h"
#include "m3msa/config.h"
#include "m3msa/cuda_backend.h"
#include "m3msa/dtype.h"
#include "m3msa/error.h"
#include "m3msa/ops.h"
#include "timeline.h"

namespace m3msa::bench {
namespace {

struct StepOptions {
  // The lists as given; parsed (and checked) into the vectors below.
  std::string batches_text = "1,4,32";
  std::string contexts_text = "16384,131072";
  std::string dtypes_text = "bf16,fp8";
  std::string q_lens_text = "1,4";
  std::string tps_text = "1";
  std::string indexers_text = "default";
  std::string attention_tunings_text = "default";
  std::vector<int> batches;
  std::vector<int64_t> contexts;
  std::vector<DType> dtypes;
  std::vector<int> q_lens;
  std::vector<int> tps;
  std::vector<IndexerVariant> variants;
  std::vector<std::optional<cuda::AttentionTuning>> tunings;  // none: the library's pick
  bool quick = false;
  bool timeline = false;
  int reps = 30;
  int64_t rotate_bytes = 4 * kL2Bytes;
  int max_copies = 64;
  std::string json_path;
  std::string commit;
};

std::string context_label(int64_t context) {
  return context >= (1 << 20) && context % (1 << 20) == 0 ? fmt::format("{}M", context >> 20)
                                                          : fmt::format("{}K", context >> 10);
}

int run_sparse_step_bench(int argc, char** argv) {
  StepOptions opt;
  CLI::App app{"one sparse layer's indexer + sparse attention (graph replay, rotated inputs)"};
  app.add_option("--batches", opt.batches_text, "comma-separated batch sizes");
  app.add_option("--contexts", opt.contexts_text, "comma-separated context lengths in tokens");
  app.add_option("--dtypes", opt.dtypes_text,
                 "comma-separated cache dtypes (index-K and KV): bf16, fp8");
  app.add_option("--q-lens", opt.q_lens_text, "comma-separated query rows per request");
  app.add_option("--tp", opt.tps_text,
                 "comma-separated: one rank's shapes under tensor parallelism: 1, 2, 4, 8");
  app.add_option("--indexer", opt.indexers_text,
                 "comma-separated indexer variants: default (the library's pick of the two merge "
                 "placements), split-merge (the merge as a second, programmatically dependent "
                 "kernel), last-cta (the merge in the request's last CTA)");
  app.add_option("--attention-tunings", opt.attention_tunings_text,
                 "';'-separated attention launcher tunings (attention.h: splitp, cluster, pdl, "
                 "splits, rows, early; 'default' = the runtime's pick after the indexer)");
  app.add_flag("--quick", opt.quick, "batch 1, 128K, q 1 only (the target point)");
  app.add_flag("--timeline", opt.timeline,
               "after timing, record one more step's stage stamps (the indexer's split and merge "
               "kernels, the attention's CTAs, on one clock) and print when each stage ended "
               "(bench/timeline.h); also in the JSON");
  app.add_option("--reps", opt.reps, "graph replays per measurement (at most)");
  app.add_option("--json", opt.json_path, "write the results as JSON here");
  app.add_option("--commit", opt.commit, "commit id recorded in the JSON (default $M3MSA_COMMIT)");
  if (auto code = parse_flags(app, argc, argv)) return *code;
  // Every value is checked here, before the device and the first measurement.
  opt.batches = int_list("--batches", opt.batches_text, 1);
  opt.contexts =
      int_list<int64_t>("--contexts", opt.contexts_text, 1, std::numeric_limits<int32_t>::max());
  opt.dtypes = dtype_list("--dtypes", opt.dtypes_text, {DType::kBF16, DType::kFP8E4M3});
  opt.q_lens = int_list("--q-lens", opt.q_lens_text, 1, kMaxQueryLen);
  opt.tps = int_choice_list("--tp", opt.tps_text, {1, 2, 4, 8});
  for (const std::string& name :
       choice_list("--indexer", opt.indexers_text, {"default", "split-merge", "last-cta"})) {
    opt.variants.push_back(name == "split-merge" ? IndexerVariant::kSplitMerge
                           : name == "last-cta"  ? IndexerVariant::kLastCtaMerge
                                                 : IndexerVariant::kFused);
  }
  opt.tunings = parsed_list(
      "--attention-tunings", opt.attention_tunings_text,
      [](const std::string& item) {
        return item == "default" ? std::optional<cuda::AttentionTuning>{}
                                 : cuda::AttentionTuning::parse(item);
      },
      ';');
  require_range("--reps", opt.reps, 1);
  if (opt.quick) {
    opt.batches = {1};
    opt.contexts = {131072};
    opt.q_lens = {1};
  }
  require_output_path("--json", opt.json_path);
  require_device("bench sparse-step");
  ResultFile results("sparse-step", argc, argv, opt.json_path, opt.commit);

  cuda::Stream stream;
  const std::string device = device_description();
  std::printf("m3msa bench sparse-step on %s\n", device.c_str());
  std::printf("indexer -> sparse attention, one graph; roof = 4.57 TB/s\n\n");

  Table table({"tp", "batch", "context", "dtype", "q", "indexer", "attention", "step us", "noise",
               "MB", "floor us", "% roof", "target"});
  const size_t total_configs = opt.tps.size() * opt.dtypes.size() * opt.q_lens.size() *
                               opt.batches.size() * opt.contexts.size();
  size_t done = 0;
  for (int tp : opt.tps) {
    // M3 per rank: at TP 1 64 q heads, 4 KV heads, 4 index heads; top-16.
    const SparseConfig config = ModelConfig{}.sparse(tp);
    const int H = config.index_heads;
    const int KVH = config.kv_heads;
    const int QH = config.q_heads;
    const int HD = config.head_dim;
    const int k = config.topk;
    for (const DType dtype : opt.dtypes) {
      const std::string dt = dtype_label(dtype);
      const bool fp8 = dtype == DType::kFP8E4M3;
      const int elem = fp8 ? 1 : 2;
      for (int q_len : opt.q_lens) {
        for (int batch : opt.batches) {
          for (int64_t context : opt.contexts) {
            ++done;
            std::fprintf(stderr, "[%zu/%zu] tp %d batch %d context %s %s q %d\n", done,
                         total_configs, tp, batch, context_label(context).c_str(), dt.c_str(),
                         q_len);
            const int64_t nb = (context + 127) / 128;
            const int64_t rows = int64_t{batch} * q_len;
            const int64_t index_page = int64_t{128} * config.index_dim * elem;
            const int64_t kv_page = int64_t{KVH} * 2 * 128 * HD * elem;
            const int64_t pages_per_copy = batch * nb;
            const int copies = static_cast<int>(
                std::clamp<int64_t>((opt.rotate_bytes + pages_per_copy * index_page - 1) /
                                        (pages_per_copy * index_page),
                                    1, opt.max_copies));
            const int64_t pool_pages = pages_per_copy * copies;
            size_t free_bytes = 0, total_bytes = 0;
            CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
            const double need =
                static_cast<double>(pool_pages) * (index_page + kv_page) + (1 << 28);
            if (need > 0.85 * static_cast<double>(free_bytes)) {
              std::printf("skip batch %d context %s %s q %d: needs %.1f GB\n", batch,
                          context_label(context).c_str(), dt.c_str(), q_len, need / 1e9);
              continue;
            }
            DeviceTensor index_pool(dtype, {pool_pages, 128, config.index_dim});
            DeviceTensor kv_pool(dtype, {pool_pages, KVH, 2, 128, HD});
            fill_random(index_pool.data(), index_pool.numel(), fp8, 11 + batch, stream.get());
            fill_random(kv_pool.data(), kv_pool.numel(), fp8, 13 + batch, stream.get());

            std::vector<DeviceTensor> tables, seqs, index_q, q, out, topk;
            uint64_t state = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(batch + context);
            auto next = [&] {
              state ^= state << 13;
              state ^= state >> 7;
              state ^= state << 17;
              return state;
            };
            for (int c = 0; c < copies; ++c) {
              HostTensor t(DType::kI32, {batch, nb});
              std::vector<int32_t> order(static_cast<size_t>(pages_per_copy));
              std::iota(order.begin(), order.end(), static_cast<int32_t>(c * pages_per_copy));
              for (int64_t i = pages_per_copy - 1; i > 0; --i) {
                std::swap(order[i], order[next() % static_cast<uint64_t>(i + 1)]);
              }
              std::copy(order.begin(), order.end(), t.ptr<int32_t>());
              tables.push_back(to_device(t));
              HostTensor s(DType::kI32, {batch});
              for (int r = 0; r < batch; ++r) s.ptr<int32_t>()[r] = static_cast<int32_t>(context);
              seqs.push_back(to_device(s));
              index_q.emplace_back(DType::kBF16, std::vector<int64_t>{rows, H, config.index_dim});
              fill_random(index_q.back().data(), index_q.back().numel(), false, 100 + c,
                          stream.get());
              q.emplace_back(DType::kBF16, std::vector<int64_t>{rows, QH, HD});
              fill_random(q.back().data(), q.back().numel(), false, 200 + c, stream.get());
              out.emplace_back(DType::kBF16, std::vector<int64_t>{rows, QH, HD});
              topk.emplace_back(DType::kI32, std::vector<int64_t>{rows, H, k});
            }
            auto batch_of = [&](int c) {
              BatchMeta b;
              b.kind = BatchKind::kDecode;
              b.num_reqs = batch;
              b.q_len = q_len;
              b.seq_lens = seqs[c].view();
              b.index_block_table = tables[c].view();
              b.kv_block_table = tables[c].view();
              return b;
            };
            PlanLimits limits;
            limits.max_reqs = batch;
            limits.max_q_len = q_len;
            limits.max_context = 0;  // the split kernel needs no score tensor
            const cuda::IndexerPlan plan = cuda::plan_indexer(config, limits, 0);
            cuda::DeviceBuffer index_ws(plan.workspace_bytes);
            cuda::init_indexer_workspace(plan, index_ws.data(), stream.get());
            PlanLimits attn_limits = limits;
            attn_limits.max_context = context;
            const size_t attn_bytes = cuda::attention_workspace_size(config, attn_limits);
            cuda::DeviceBuffer attn_ws(std::max<size_t>(attn_bytes, 16));
            CUDA_CHECK(cudaMemsetAsync(attn_ws.data(), 0, attn_ws.bytes(), stream.get()));
            stream.synchronize();

            for (IndexerVariant variant : opt.variants) {
              for (const std::optional<cuda::AttentionTuning>& entry : opt.tunings) {
                // "default": what the runtime launches after the indexer at these shapes.
                const cuda::AttentionTuning tuning =
                    entry ? *entry : cuda::attention_tuning_after_indexer(int64_t{batch} * q_len);
                const std::string indexer_name =
                    variant == IndexerVariant::kSplitMerge     ? "split-merge"
                    : variant == IndexerVariant::kLastCtaMerge ? "last-cta"
                                                               : "default";
                const std::string tuning_name = tuning.name();
                // One step on input copy c: the indexer, then the attention on its selection.
                auto step = [&](int c) {
                  IndexerArgs ia;
                  ia.index_q = index_q[c].view();
                  ia.index_cache = IndexCache{index_pool.view()};
                  ia.batch = batch_of(c);
                  ia.topk_idx = topk[c].view();
                  cuda::launch_indexer(plan, config, ia, variant, index_ws.data(), stream.get());
                  AttentionArgs aa;
                  aa.q = q[c].view();
                  aa.kv_cache = KVCache{kv_pool.view(), fp8 ? 0.5f : 1.0f, fp8 ? 0.25f : 1.0f};
                  aa.batch = batch_of(c);
                  aa.topk_idx = topk[c].view();
                  aa.out = out[c].view();
                  cuda::launch_attention_tuned(config, aa, attn_ws.data(), attn_ws.bytes(),
                                               stream.get(), tuning);
                };
                cuda::Graph graph = cuda::Graph::capture(stream.get(), [&] {
                  for (int c = 0; c < copies; ++c) step(c);
                });
                const Timing timing = time_graph(graph, stream.get(), copies, 2, opt.reps);
                nlohmann::json timeline;
                if (opt.timeline) {  // copy 0: the one the replay read longest ago
                  graph.launch(stream.get());
                  timeline = record_timeline(
                      fmt::format("sparse-step {} tp {} batch {} context {} q_len {} indexer {} "
                                  "attention {}",
                                  dt, tp, batch, context_label(context), q_len, indexer_name,
                                  tuning_name),
                      [&] { step(0); });
                }
                const uint32_t status =
                    cuda::read_indexer_status(plan, index_ws.data(), stream.get(), true);

                // The floor, from the selections the step made (copy 0).
                HostTensor sel;
                copy_to_host(topk[0].view(), sel);
                int64_t kv_tiles = 0;
                for (int r = 0; r < batch; ++r) {
                  for (int h = 0; h < KVH; ++h) {
                    std::set<int32_t> blocks;
                    for (int row = 0; row < q_len; ++row) {
                      const int32_t* s =
                          sel.ptr<int32_t>() + ((int64_t{r} * q_len + row) * H + h) * k;
                      for (int j = 0; j < k; ++j) {
                        if (s[j] >= 0) blocks.insert(s[j]);
                      }
                    }
                    kv_tiles += static_cast<int64_t>(blocks.size());
                  }
                }
                const int64_t index_bytes = pages_per_copy * index_page + rows * H * 128 * 2 +
                                            pages_per_copy * 4 + batch * 4 + rows * H * k * 4;
                const int64_t attn_bytes_read =
                    kv_tiles * 2 * 128 * HD * elem + 2 * rows * QH * HD * 2 + rows * H * k * 4;
                const int64_t bytes = index_bytes + attn_bytes_read;
                const double floor_us = static_cast<double>(bytes) / (kReadCeilingTBs * 1e12) * 1e6;
                const double roof = 100.0 * floor_us / timing.median_us;
                const bool target_point = tp == 1 && batch == 1 && q_len == 1 && context == 131072;
                const std::string target =
                    target_point ? (timing.median_us <= 16.0 ? "<= 16 us: met" : "<= 16 us: missed")
                                 : "-";
                nlohmann::json rec = {{"tp", tp},
                                      {"q_heads", QH},
                                      {"kv_heads", KVH},
                                      {"index_heads", H},
                                      {"indexer", indexer_name},
                                      {"attention_tuning", tuning_name},
                                      {"batch", batch},
                                      {"context", context},
                                      {"dtype", dt},
                                      {"q_len", q_len},
                                      {"step_us", timing.median_us},
                                      {"p10_us", timing.p10_us},
                                      {"p90_us", timing.p90_us},
                                      {"bytes", bytes},
                                      {"floor_us", floor_us},
                                      {"pct_roof", roof},
                                      {"copies", copies},
                                      {"indexer_status", status}};
                rec.update(measured_fields(timing, static_cast<double>(bytes)));
                if (!timeline.is_null()) rec["timeline"] = timeline;
                table.add({std::to_string(tp), std::to_string(batch), context_label(context), dt,
                           std::to_string(q_len), indexer_name, tuning_name,
                           fmt::format("{:.1f}", timing.median_us),
                           fmt::format("{:.0f}%", 100.0 * timing.noise()),
                           fmt::format("{:.1f}", bytes / 1e6), fmt::format("{:.1f}", floor_us),
                           fmt::format("{:.0f}%", roof), target},
                          rec);
                results.write(table.records(), false);
                std::printf(
                    "tp %d batch %3d context %5s %-4s q %d %s / %s: %8.1f us (floor %.1f us)%s\n",
                    tp, batch, context_label(context).c_str(), dt.c_str(), q_len,
                    indexer_name.c_str(), tuning_name.c_str(), timing.median_us, floor_us,
                    status ? " [indexer status set]" : "");
                std::fflush(stdout);
              }
            }
          }
        }
      }
    }
  }
  std::printf("\n");
  table.print();
  results.write(table.records());
  return 0;
}

const m3msa::cli::BenchRegistrar kRegistrar(
    "sparse-step", "one sparse layer's indexer + attention (the step's selection and attention)",
    run_sparse_step_bench);

}  // namespace
}  // namespace m3msa::bench
