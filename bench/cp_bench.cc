// m3msa bench cp: the context-parallel indexer (cp_cuda.h) on 1 or 2 GPUs of this host, ranks as
// threads, every transport side by side, under CUDA-graph replay.
//
// Per configuration (P, transport, batch, context, dtype, q_len) every rank holds the whole
// index cache (as under TP) with every request at seq_len = context. Each rank captures one graph
// of `copies` consecutive indexer calls over rotated input copies (several times the 60 MB L2
// together, see harness.h), the ranks replay their graphs together (a host barrier before each
// replay), and the time of one call is the replay time / copies. Reported per configuration: the
// whole step (score + select + exchange + merge) and the exchange + merge part alone (a second
// graph of exchange() calls only), the median over replays, max over ranks. "x repl" is the
// replicated transport's step time at the same P over this one's.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "bench_registry.h"
#include "cuda/common.cuh"
#include "fill.h"
#include "harness.h"
#include "m3msa/backend.h"
#include "m3msa/comm.h"
#include "m3msa/cp_cuda.h"
#include "m3msa/cuda_backend.h"
#include "m3msa/error.h"

namespace m3msa::bench {
namespace {

struct Options {
  std::vector<int> worlds = {1, 2};
  std::vector<std::string> transports = {"replicated", "peer", "nccl", "allreduce-max"};
  std::vector<int> batches = {1, 4, 32, 128};
  std::vector<int64_t> contexts = {4096, 32768, 131072, 1048576};
  std::vector<std::string> dtypes = {"fp8", "bf16"};
  std::vector<int> q_lens = {1, 4};
  bool quick = false;
  int reps = 20;
  int64_t rotate_bytes = 4 * kL2Bytes;
  int max_copies = 16;
  std::string json_path;
  std::string commit;
};

std::string fmt_context(int64_t context) {
  return context >= (1 << 20) && context % (1 << 20) == 0 ? fmt::format("{}M", context >> 20)
                                                          : fmt::format("{}K", context >> 10);
}

struct RankInputs {
  DeviceTensor pool;
  std::vector<DeviceTensor> tables, seqs, queries, outs;
};

// Inputs of one rank on its device: `copies` disjoint sets of pages, tables and queries.
RankInputs make_inputs(int device, int batch, int64_t context, DType dtype, int q_len, int copies,
                       int merged, cudaStream_t stream) {
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
    in.outs.emplace_back(DType::kI32, std::vector<int64_t>{int64_t{batch} * q_len, merged, 16},
                         device);
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return in;
}

struct Result {
  double step_us = 0, exchange_us = 0, step_noise = 0;
};

int run_cp_bench(int argc, char** argv) {
  Options opt;
  CLI::App app{"CP indexer benchmark: transports x P under graph replay (ranks as threads)"};
  app.add_option("--worlds", opt.worlds, "world sizes P (GPUs)")->delimiter(',');
  app.add_option("--transports", opt.transports, "peer, nccl, replicated, allreduce-max")
      ->delimiter(',');
  app.add_option("--batches", opt.batches, "batch sizes")->delimiter(',');
  app.add_option("--contexts", opt.contexts, "context lengths in tokens")->delimiter(',');
  app.add_option("--dtypes", opt.dtypes, "index-K cache dtypes: fp8, bf16")->delimiter(',');
  app.add_option("--q-lens", opt.q_lens, "query rows per request")->delimiter(',');
  app.add_flag("--quick", opt.quick, "batches 1,32 x contexts 4K,32K,128K x fp8 x q_len 1");
  app.add_option("--reps", opt.reps, "graph replays per measurement (at most)");
  app.add_option("--json", opt.json_path, "write the results as JSON here");
  app.add_option("--commit", opt.commit, "commit id recorded in the JSON");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (opt.quick) {
    opt.batches = {1, 32};
    opt.contexts = {4096, 32768, 131072};
    opt.dtypes = {"fp8"};
    opt.q_lens = {1};
  }
  const int visible = cuda_device_count();
  M3MSA_CHECK_SUPPORTED(visible > 0, "bench cp: no CUDA device visible");
  const std::string device = device_description();
  std::printf("m3msa bench cp on %d x %s\n\n", visible, device.c_str());

  Table table({"P", "transport", "batch", "context", "dtype", "q", "step us", "noise",
               "exch+merge us", "x repl"});
  std::map<std::tuple<int, int, int64_t, std::string, int>, double> replicated_us;
  for (int P : opt.worlds) {
    if (P > visible) {
      std::printf("skip P = %d: %d GPUs visible\n", P, visible);
      continue;
    }
    std::vector<int> devices(static_cast<size_t>(P));
    std::iota(devices.begin(), devices.end(), 0);
    std::vector<std::unique_ptr<NcclCommunicator>> nccl =
        make_nccl_communicators_in_process(devices);
    auto barrier_group = ThreadGroup::create(P);
    std::vector<std::unique_ptr<Communicator>> barriers;
    for (int r = 0; r < P; ++r) barriers.push_back(barrier_group->communicator(r));

    for (const std::string& dt : opt.dtypes) {
      const DType dtype = parse_dtype(dt, "--dtypes");
      for (int q : opt.q_lens) {
        for (int batch : opt.batches) {
          for (int64_t context : opt.contexts) {
            const int64_t nb = (context + 127) / 128;
            const int64_t page_bytes = 128 * 128 * int64_t(dtype_size(dtype));
            const int64_t bytes_per_call = int64_t{batch} * nb * page_bytes;
            const int copies = static_cast<int>(std::clamp<int64_t>(
                (opt.rotate_bytes + bytes_per_call - 1) / bytes_per_call, 1, opt.max_copies));
            size_t free_bytes = 0, total_bytes = 0;
            CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
            if (static_cast<double>(bytes_per_call) * copies > 0.6 * free_bytes) {
              std::printf("skip batch %d context %s: inputs too large\n", batch,
                          fmt_context(context).c_str());
              continue;
            }
            for (const std::string& tname : opt.transports) {
              const CpTransport transport = parse_cp_transport(tname);
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
                Communicator& comm = *nccl[static_cast<size_t>(r)];
                CudaCpIndexer ind(comm, r, SparseConfig{}, cp);
                const int merged = static_cast<int>(ind.merged_heads().size());
                RankInputs in =
                    make_inputs(r, batch, context, dtype, q, copies, merged, stream.get());
                auto args_for = [&](int c) {
                  IndexerArgs a;
                  a.index_q = in.queries[c].view();
                  a.index_cache = IndexCache{in.pool.view()};
                  a.batch.kind = BatchKind::kDecode;
                  a.batch.num_reqs = batch;
                  a.batch.q_len = q;
                  a.batch.seq_lens = in.seqs[c].view();
                  a.batch.index_block_table = in.tables[c].view();
                  a.topk_idx = in.outs[c].view();
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
                Communicator& bar = *barriers[static_cast<size_t>(r)];
                auto time_it = [&](const cuda::Graph& g) {
                  for (int w = 0; w < 2; ++w) {
                    bar.all_gather({}, "bench/warm");
                    g.launch(stream.get());
                    stream.synchronize();
                  }
                  cuda::Event start, stop;
                  std::vector<double> us;
                  for (int i = 0; i < opt.reps; ++i) {
                    bar.all_gather({}, "bench/rep");
                    start.record(stream.get());
                    g.launch(stream.get());
                    stop.record(stream.get());
                    us.push_back(stop.elapsed_ms_since(start) * 1000.0 / copies);
                  }
                  ind.check(stream.get());
                  return std::make_pair(percentile(us, 0.5),
                                        (percentile(us, 0.9) - percentile(us, 0.1)) /
                                            std::max(1e-9, percentile(us, 0.5)));
                };
                const auto [step_us, noise] = time_it(step);
                const auto [exch_us, exch_noise] = time_it(exch);
                (void)exch_noise;
                results[static_cast<size_t>(r)] = {step_us, exch_us, noise};
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
              std::string error;
              for (auto& e : errors) {
                if (!e) continue;
                try {
                  std::rethrow_exception(e);
                } catch (const std::exception& ex) {
                  error = ex.what();
                }
              }
              if (!error.empty()) {
                std::printf("P %d %s batch %d context %s: ERROR %s\n", P, tname.c_str(), batch,
                            fmt_context(context).c_str(), error.c_str());
                throw Error(ErrorCode::kInternal, "bench cp failed: " + error);
              }
              Result worst;
              for (const Result& res : results) {
                worst.step_us = std::max(worst.step_us, res.step_us);
                worst.exchange_us = std::max(worst.exchange_us, res.exchange_us);
                worst.step_noise = std::max(worst.step_noise, res.step_noise);
              }
              const auto key = std::make_tuple(P, batch, context, dt, q);
              if (transport == CpTransport::kReplicated) replicated_us[key] = worst.step_us;
              const auto it = replicated_us.find(key);
              const double x_repl = it == replicated_us.end() ? 0.0 : it->second / worst.step_us;
              nlohmann::json rec = {{"world_size", P},
                                    {"transport", tname},
                                    {"batch", batch},
                                    {"context", context},
                                    {"dtype", dt},
                                    {"q_len", q},
                                    {"step_us", worst.step_us},
                                    {"exchange_merge_us", worst.exchange_us},
                                    {"noise", worst.step_noise},
                                    {"copies", copies}};
              if (x_repl > 0) rec["speedup_vs_replicated"] = x_repl;
              table.add({std::to_string(P), tname, std::to_string(batch), fmt_context(context), dt,
                         std::to_string(q), fmt::format("{:.1f}", worst.step_us),
                         fmt::format("{:.0f}%", 100.0 * worst.step_noise),
                         fmt::format("{:.1f}", worst.exchange_us),
                         x_repl > 0 ? fmt::format("{:.2f}", x_repl) : "-"},
                        rec);
              std::printf(
                  "P %d %-13s batch %4d context %5s %-4s q %d: step %9.1f us, exch+merge "
                  "%7.1f us\n",
                  P, tname.c_str(), batch, fmt_context(context).c_str(), dt.c_str(), q,
                  worst.step_us, worst.exchange_us);
              std::fflush(stdout);
            }
          }
        }
      }
    }
  }
  std::printf("\n");
  table.print();
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", std::gmtime(&now));
  nlohmann::json doc = {{"benchmark", "cp"}, {"device", device},     {"gpus", visible},
                        {"date", date},      {"commit", opt.commit}, {"results", table.records()}};
  write_json(opt.json_path, doc);
  return 0;
}

const m3msa::cli::BenchRegistrar kRegistrar(
    "cp", "CP indexer: peer / nccl / replicated / allreduce-max on 1-2 GPUs, graph replay",
    run_cp_bench);

}  // namespace
}  // namespace m3msa::bench
