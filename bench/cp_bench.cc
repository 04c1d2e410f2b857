// m3msa bench cp: the context-parallel indexer (cp_cuda.h) on 1 or 2 GPUs of this host, ranks as
// threads, every transport side by side, under CUDA-graph replay.
//
// Grid: P {1, 2} x transport {replicated, peer, nccl, allreduce-max} x batch
// {1, 4, 32, 128} x context {4K, 32K, 128K, 1M} x index cache {fp8, bf16} x q_len {1, 4};
// `--quick`: batch {1, 32} x context {4K, 32K, 128K} x fp8 x q_len 1. A configuration whose inputs
// do not fit the free memory is skipped with a note (in the table, the JSON and on stderr).
//
// Per configuration (P, dtype, q_len, batch, context) every rank holds the whole index cache (as
// under TP) with every request at seq_len = context, built once and shared by the transports.
// Each rank captures one graph of `copies` consecutive indexer calls over rotated input copies
// (together several times the 60 MB L2, see harness.h), the ranks replay their graphs together (a
// host barrier before each replay), and the time of one call is the replay time / copies.
// Reported per configuration: the whole step (score + select + exchange + merge) and the exchange
// + merge part alone (a second graph of exchange() calls only), median over replays, max over
// ranks; the index-K bytes one rank reads per call (its shard, or everything for replicated) and
// that read's share of the 4.57 TB/s HBM ceiling; "x repl" = replicated's step at the same P over
// this one's; for peer, "x nccl" and "x ar-max" = those transports' steps over peer's.
// A progress line per configuration goes to stderr; the JSON is rewritten after every
// configuration, so a run stopped by a time limit keeps what it measured.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "bench_registry.h"
#include "cuda/common.cuh"
#include "fill.h"
#include "harness.h"
#include "m3msa/backend.h"
#include "m3msa/batch.h"
#include "m3msa/comm.h"
#include "m3msa/cp_cuda.h"
#include "m3msa/cuda_backend.h"
#include "m3msa/error.h"

namespace m3msa::bench {
namespace {

struct Options {
  // The comma lists as given; parsed (and checked) into the vectors below.
  std::string worlds_text = "1,2";
  std::string transports_text = "replicated,peer,nccl,allreduce-max";
  std::string batches_text = "1,4,32,128";
  std::string contexts_text = "4096,32768,131072,1048576";
  std::string dtypes_text = "fp8,bf16";
  std::string q_lens_text = "1,4";
  std::vector<int> worlds;
  std::vector<CpTransport> transports;
  std::vector<int> batches;
  std::vector<int64_t> contexts;
  std::vector<DType> dtypes;
  std::vector<int> q_lens;
  bool quick = false;
  int reps = 20;
  int64_t rotate_bytes = 4 * kL2Bytes;
  int max_copies = 16;
  double memory_fraction = 0.6;  // of the free device memory the inputs may take
  std::string json_path;
  std::string commit;
};

std::string fmt_context(int64_t context) {
  return context >= (1 << 20) && context % (1 << 20) == 0 ? fmt::format("{}M", context >> 20)
                                                          : fmt::format("{}K", context >> 10);
}

struct RankInputs {
  DeviceTensor pool;
  std::vector<DeviceTensor> tables, seqs, queries;
};

// Inputs of one rank on its device: `copies` disjoint sets of pages, tables and queries.
RankInputs make_inputs(int device, int batch, int64_t context, DType dtype, int q_len, int copies,
                       cudaStream_t stream) {
  cuda::DeviceGuard guard(device);
  RankInputs in;
  const int64_t nb = (context + 127) / 128;
  const int64_t pages = int64_t{batch} * nb;
  in.pool = DeviceTensor(dtype, {pages * copies, 128, 128}, device);
  fill_random(in.pool.data(), in.pool.numel(), dtype == DType::kFP8E4M3, 99 + batch + context,
              stream);
  uint64_t state = 12345 + static_cast<uint64_t>(context);
  for (int c = 0; c < copies; ++c) {
    HostTensor t(DType::kI32, {batch, nb});
    std::vector<int32_t> order(static_cast<size_t>(pages));
    std::iota(order.begin(), order.end(), static_cast<int32_t>(c * pages));
    for (int64_t i = pages - 1; i > 0; --i) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      std::swap(order[static_cast<size_t>(i)], order[(state >> 33) % static_cast<uint64_t>(i + 1)]);
    }
    std::memcpy(t.data(), order.data(), order.size() * sizeof(int32_t));
    in.tables.push_back(to_device(t, device));
    HostTensor s(DType::kI32, {batch});
    for (int r = 0; r < batch; ++r) s.ptr<int32_t>()[r] = static_cast<int32_t>(context);
    in.seqs.push_back(to_device(s, device));
    DeviceTensor q(DType::kBF16, {int64_t{batch} * q_len, 4, 128}, device);
    fill_random(q.data(), q.numel(), false, 777 + c, stream);
    in.queries.push_back(std::move(q));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return in;
}

struct Result {
  double step_us = 0, exchange_us = 0, step_noise = 0;
};

struct Communicators {
  std::vector<std::unique_ptr<NcclCommunicator>> nccl;
  std::vector<std::unique_ptr<Communicator>> barriers;

  explicit Communicators(int P) {
    std::vector<int> devices(static_cast<size_t>(P));
    std::iota(devices.begin(), devices.end(), 0);
    nccl = make_nccl_communicators_in_process(devices);
    auto group = ThreadGroup::create(P);
    for (int r = 0; r < P; ++r) barriers.push_back(group->communicator(r));
  }
  bool broken() const {
    return std::any_of(nccl.begin(), nccl.end(), [](const auto& c) { return c->broken(); });
  }
  // After a failure: leave the NCCL communicators behind without waiting on them.
  void abandon() {
    for (auto& c : nccl) c->abandon();
  }
};

// One transport at one configuration: every rank builds its indexer, captures the two graphs
// and times them; returns the worst rank's numbers, or throws the first rank's error.
Result measure(Communicators& comms, CpTransport transport, int P, int batch, int64_t context,
               int q, int copies, std::vector<RankInputs>& inputs, const Options& opt) {
  std::vector<Result> results(static_cast<size_t>(P));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(P));
  auto body = [&](int r) {
    CUDA_CHECK(cudaSetDevice(r));
    cuda::Stream stream;
    CudaCpConfig cp;
    cp.world_size = P;
    cp.max_reqs = batch;
    cp.max_q_len = q;
    cp.max_context = context;
    cp.transport = transport;
    CudaCpIndexer ind(*comms.nccl[static_cast<size_t>(r)], r, SparseConfig{}, cp);
    const int merged = static_cast<int>(ind.merged_heads().size());
    RankInputs& in = inputs[static_cast<size_t>(r)];
    std::vector<DeviceTensor> outs;
    for (int c = 0; c < copies; ++c) {
      outs.emplace_back(DType::kI32, std::vector<int64_t>{int64_t{batch} * q, merged, 16}, r);
    }
    auto args_for = [&](int c) {
      IndexerArgs a;
      a.index_q = in.queries[static_cast<size_t>(c)].view();
      a.index_cache = IndexCache{in.pool.view()};
      a.batch.kind = BatchKind::kDecode;
      a.batch.num_reqs = batch;
      a.batch.q_len = q;
      a.batch.seq_lens = in.seqs[static_cast<size_t>(c)].view();
      a.batch.index_block_table = in.tables[static_cast<size_t>(c)].view();
      a.topk_idx = outs[static_cast<size_t>(c)].view();
      return a;
    };
    // Warm-up call outside the graphs (sets up NCCL's and the kernels' state).
    ind.select(0, args_for(0), stream.get());
    ind.check(stream.get());
    cuda::Graph step = cuda::Graph::capture(stream.get(), [&] {
      for (int c = 0; c < copies; ++c) ind.select(c, args_for(c), stream.get());
    });
    cuda::Graph exch = cuda::Graph::capture(stream.get(), [&] {
      for (int c = 0; c < copies; ++c) ind.exchange(c, args_for(c), stream.get());
    });
    Communicator& bar = *comms.barriers[static_cast<size_t>(r)];
    auto time_it = [&](const cuda::Graph& g) {
      for (int w = 0; w < 2; ++w) {
        bar.all_gather({}, "bench/warm");
        g.launch(stream.get());
        ind.check(stream.get());
      }
      cuda::Event start, stop;
      std::vector<double> us;
      for (int i = 0; i < opt.reps; ++i) {
        bar.all_gather({}, "bench/rep");
        start.record(stream.get());
        g.launch(stream.get());
        stop.record(stream.get());
        ind.check(stream.get());  // bounded wait; the events are complete afterwards
        us.push_back(stop.elapsed_ms_since(start) * 1000.0 / copies);
      }
      const double median = percentile(us, 0.5);
      return std::make_pair(median,
                            (percentile(us, 0.9) - percentile(us, 0.1)) / std::max(1e-9, median));
    };
    const auto [step_us, noise] = time_it(step);
    const auto [exch_us, exch_noise] = time_it(exch);
    (void)exch_noise;
    results[static_cast<size_t>(r)] = {step_us, exch_us, noise};
    bar.all_gather({}, "bench/done");  // no rank frees a buffer a peer still stores into
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  Result worst;
  for (const Result& res : results) {
    worst.step_us = std::max(worst.step_us, res.step_us);
    worst.exchange_us = std::max(worst.exchange_us, res.exchange_us);
    worst.step_noise = std::max(worst.step_noise, res.step_noise);
  }
  return worst;
}

int run_cp_bench(int argc, char** argv) {
  Options opt;
  CLI::App app{"CP indexer benchmark: transports x P under graph replay (ranks as threads)"};
  app.add_option("--worlds", opt.worlds_text, "comma-separated world sizes P (GPUs)");
  app.add_option("--transports", opt.transports_text,
                 "comma-separated: peer, nccl, replicated, allreduce-max");
  app.add_option("--batches", opt.batches_text, "comma-separated batch sizes");
  app.add_option("--contexts", opt.contexts_text, "comma-separated context lengths in tokens");
  app.add_option("--dtypes", opt.dtypes_text, "comma-separated index-K cache dtypes: fp8, bf16");
  app.add_option("--q-lens", opt.q_lens_text, "comma-separated query rows per request");
  app.add_flag("--quick", opt.quick, "batches 1,32 x contexts 4K,32K,128K x fp8 x q_len 1");
  app.add_option("--reps", opt.reps, "graph replays per measurement");
  app.add_option("--max-copies", opt.max_copies, "input copies rotated through (at most)");
  app.add_option("--json", opt.json_path, "write the results as JSON here (after every config)");
  app.add_option("--commit", opt.commit, "commit id recorded in the JSON (default $M3MSA_COMMIT)");
  if (auto code = parse_flags(app, argc, argv)) return *code;
  // Every value is checked here, before the device and the first measurement.
  opt.worlds = int_list("--worlds", opt.worlds_text, 1);
  opt.transports = parsed_list("--transports", opt.transports_text, parse_cp_transport);
  opt.batches = int_list("--batches", opt.batches_text, 1);
  opt.contexts =
      int_list<int64_t>("--contexts", opt.contexts_text, 1, std::numeric_limits<int32_t>::max());
  opt.dtypes = dtype_list("--dtypes", opt.dtypes_text, {DType::kFP8E4M3, DType::kBF16});
  opt.q_lens = int_list("--q-lens", opt.q_lens_text, 1, kMaxQueryLen);
  require_range("--reps", opt.reps, 1);
  require_range("--max-copies", opt.max_copies, 1);
  if (opt.quick) {
    opt.batches = {1, 32};
    opt.contexts = {4096, 32768, 131072};
    opt.dtypes = {DType::kFP8E4M3};
    opt.q_lens = {1};
  }
  std::vector<CpTransport> transports = opt.transports;
  // Replicated first, so the speedup columns of the others have their reference.
  std::stable_sort(transports.begin(), transports.end(), [](CpTransport a, CpTransport b) {
    return (a == CpTransport::kReplicated) > (b == CpTransport::kReplicated);
  });
  require_output_path("--json", opt.json_path);
  require_device("bench cp");
  const int visible = cuda_device_count();
  const std::string device = device_description();
  std::printf("m3msa bench cp on %d x %s\n\n", visible, device.c_str());
  std::vector<int> worlds;
  for (int P : opt.worlds) {
    if (P > visible) {
      std::fprintf(stderr, "bench cp: skip P = %d: only %d GPU(s) visible\n", P, visible);
    } else {
      worlds.push_back(P);
    }
  }
  const std::size_t total = worlds.size() * opt.dtypes.size() * opt.q_lens.size() *
                            opt.batches.size() * opt.contexts.size() * transports.size();

  Table table({"P", "transport", "batch", "context", "dtype", "q", "step us", "noise",
               "exch+merge us", "MB/rank", "% roof", "x repl", "x nccl", "x ar-max"});
  std::vector<std::string> skipped;
  ResultFile results("cp", argc, argv, opt.json_path, opt.commit);
  auto save = [&](bool complete) {
    results.meta()["skipped"] = skipped;
    results.write(table.records(), complete);
  };
  std::size_t done = 0;
  const auto started = std::chrono::steady_clock::now();
  auto progress = [&](const std::string& text) {
    ++done;
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::fprintf(stderr, "[%zu/%zu, %.0f s] %s\n", done, total, s, text.c_str());
  };

  for (int P : worlds) {
    auto comms = std::make_unique<Communicators>(P);
    for (const DType dtype : opt.dtypes) {
      const std::string dt = dtype_label(dtype);
      for (int q : opt.q_lens) {
        for (int batch : opt.batches) {
          for (int64_t context : opt.contexts) {
            const std::string where = fmt::format("P {} batch {} context {} {} q {}", P, batch,
                                                  fmt_context(context), dt, q);
            const int64_t nb = (context + 127) / 128;
            const int64_t page_bytes = 128 * 128 * static_cast<int64_t>(dtype_size(dtype));
            const int64_t bytes_per_call = int64_t{batch} * nb * page_bytes;
            const int copies = static_cast<int>(std::clamp<int64_t>(
                (opt.rotate_bytes + bytes_per_call - 1) / bytes_per_call, 1, opt.max_copies));
            size_t free_bytes = 0, total_bytes = 0;
            CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
            const double need = static_cast<double>(bytes_per_call) * copies;
            if (need > opt.memory_fraction * static_cast<double>(free_bytes)) {
              const std::string note =
                  fmt::format("{}: inputs need {:.1f} GB per GPU, {:.1f} GB free: skipped", where,
                              need / 1e9, free_bytes / 1e9);
              skipped.push_back(note);
              for (std::size_t i = 0; i < transports.size(); ++i) progress("skip " + note);
              save(false);
              continue;
            }
            std::vector<RankInputs> inputs;
            for (int r = 0; r < P; ++r) {
              cuda::DeviceGuard guard(r);
              cuda::Stream stream;
              inputs.push_back(make_inputs(r, batch, context, dtype, q, copies, stream.get()));
            }
            // Index-K bytes one rank reads per call: its shard's pages (all pages when replicated).
            const int64_t shard_blocks = (nb + P - 1) / P;
            std::map<CpTransport, double> step_of;
            struct Row {
              CpTransport transport;
              std::vector<std::string> cells;
              nlohmann::json rec;
            };
            std::vector<Row> rows;
            for (CpTransport transport : transports) {
              const std::string tname = cp_transport_name(transport);
              const int64_t read_bytes =
                  int64_t{batch} * page_bytes *
                  (transport == CpTransport::kReplicated ? nb : shard_blocks);
              nlohmann::json rec = {{"world_size", P},    {"transport", tname}, {"batch", batch},
                                    {"context", context}, {"dtype", dt},        {"q_len", q}};
              Result res;
              std::string error;
              try {
                res = measure(*comms, transport, P, batch, context, q, copies, inputs, opt);
              } catch (const std::exception& e) {
                error = e.what();
              }
              if (!error.empty()) {
                progress(fmt::format("{} {}: ERROR {}", tname, where, error));
                rec["error"] = error;
                rows.push_back(
                    {transport,
                     {std::to_string(P), tname, std::to_string(batch), fmt_context(context), dt,
                      std::to_string(q), "ERROR", "-", "-", "-", "-", "-", "-", "-"},
                     rec});
                if (comms->broken()) {
                  // A broken NCCL communicator cannot be destroyed safely: leave it, start anew.
                  comms->abandon();
                  (void)comms.release();
                  comms = std::make_unique<Communicators>(P);
                }
                continue;
              }
              step_of[transport] = res.step_us;
              const double tbs = static_cast<double>(read_bytes) / (res.step_us * 1e-6) / 1e12;
              rec["step_us"] = res.step_us;
              rec["exchange_merge_us"] = res.exchange_us;
              rec["noise"] = res.step_noise;
              rec["read_bytes_per_rank"] = read_bytes;
              rec["tb_per_s"] = tbs;
              rec["pct_of_read_ceiling"] = 100.0 * tbs / kReadCeilingTBs;
              rec["copies"] = copies;
              rec["median_us"] = res.step_us;
              rec.update(floor_fields(res.step_us, static_cast<double>(read_bytes)));
              rows.push_back(
                  {transport,
                   {std::to_string(P), tname, std::to_string(batch), fmt_context(context), dt,
                    std::to_string(q), fmt::format("{:.1f}", res.step_us),
                    fmt::format("{:.0f}%", 100.0 * res.step_noise),
                    fmt::format("{:.1f}", res.exchange_us), fmt::format("{:.1f}", read_bytes / 1e6),
                    fmt::format("{:.0f}%", 100.0 * tbs / kReadCeilingTBs), "-", "-", "-"},
                   rec});
              progress(fmt::format("{:<13} {}: step {:.1f} us, exch+merge {:.1f} us", tname, where,
                                   res.step_us, res.exchange_us));
            }
            // Speedups once the whole group is measured: every transport over replicated; peer
            // over nccl and allreduce-max (the targets).
            auto speedup = [&](CpTransport slower, CpTransport faster) -> std::optional<double> {
              const auto a = step_of.find(slower);
              const auto b = step_of.find(faster);
              if (a == step_of.end() || b == step_of.end()) return std::nullopt;
              return a->second / b->second;
            };
            for (Row& row : rows) {
              if (!step_of.count(row.transport)) continue;
              const struct {
                CpTransport slower;
                std::size_t cell;
                const char* key;
                bool peer_only;
              } columns[] = {{CpTransport::kReplicated, 11, "speedup_vs_replicated", false},
                             {CpTransport::kNccl, 12, "speedup_vs_nccl", true},
                             {CpTransport::kAllReduceMax, 13, "speedup_vs_allreduce_max", true}};
              for (const auto& col : columns) {
                if (col.slower == row.transport) continue;
                if (col.peer_only && row.transport != CpTransport::kPeer) continue;
                if (const auto x = speedup(col.slower, row.transport)) {
                  row.cells[col.cell] = fmt::format("{:.2f}", *x);
                  row.rec[col.key] = *x;
                }
              }
            }
            for (Row& row : rows) table.add(std::move(row.cells), std::move(row.rec));
            save(false);
          }
        }
      }
    }
  }
  std::printf("\n");
  table.print();
  if (!skipped.empty()) {
    std::printf("\nSkipped (memory):\n");
    for (const std::string& s : skipped) std::printf("  %s\n", s.c_str());
  }
  save(true);
  return 0;
}

const m3msa::cli::BenchRegistrar kRegistrar(
    "cp", "CP indexer: peer / nccl / replicated / allreduce-max on 1-2 GPUs, graph replay",
    run_cp_bench);

}  // namespace
}  // namespace m3msa::bench
