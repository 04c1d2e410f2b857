// m3msa bench allreduce: the TP all-reduce of the fused decode runtime, [rows, hidden] fp32 sum,
// one-shot over peer-mapped buffers (src/comm/peer_allreduce.h) vs ncclAllReduce, side by side in
// one process, ranks as threads, under CUDA-graph replay.
//
// Grid: rows {1, 2, 4, 8, 16} x hidden 6144 at TP = 2 (--rows, --hidden, --tp). Mode "nvlink":
// one GPU per rank (when --tp GPUs are visible), both transports. Mode "same-gpu" (fewer GPUs, or
// --same-gpu): every rank on GPU 0, one-shot only (NCCL needs a GPU per rank); its peer stores
// never leave the GPU, so it measures the protocol's overhead, not NVLink.
//
// Method: each rank captures one graph per (transport, rows): one call that lines the ranks up
// (the ranks' host threads reach the graph launch microseconds apart; the first collective of the
// graph absorbs that), an event record node, `launches` back-to-back calls, an event record node.
// The time of one call is the time between the two events / launches, so host launch overhead and
// the ranks' skew are not in it; a host barrier precedes every replay; the data is reset from a
// pristine copy before every replay (outside the timed part). Reported: the median over `reps`
// replays (max over ranks) and the noise (p90 - p10) / median. Every transport's result is checked
// bit for bit against the CPU rank-order sum once before timing (exact inputs), exit 1 otherwise.
//
// Floor (nvlink): the fp32 payload one rank must receive, (P - 1) * rows * hidden * 4 bytes,
// over the measured 397 GB/s NVLink peer copy, plus the measured 0.63 us one-way peer store
// latency (docs/benchmarks.md). The one-shot moves twice those bytes (8-byte tagged words).
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "bench_registry.h"
#include "comm/nccl_check.h"
#include "comm/peer_allreduce.h"
#include "cuda/common.cuh"
#include "harness.h"
#include "m3msa/backend.h"
#include "m3msa/comm.h"
#include "m3msa/cp_cuda.h"
#include "m3msa/error.h"

namespace m3msa::bench {
namespace {

constexpr double kNvlinkGBs = 397.0;       // NVLink peer copy (docs/benchmarks.md)
constexpr double kOneWayLatencyUs = 0.63;  // NVLink peer store, one way (docs/benchmarks.md)

struct Options {
  std::string rows_text = "1,2,4,8,16";
  std::vector<int> rows;
  int hidden = 6144;
  int tp = 2;
  int launches = 20;
  int reps = 200;
  int warmup = 10;
  int ctas = 0;
  bool same_gpu = false;
  bool no_nccl = false;
  std::string json_path;
  std::string commit;
};

struct Spread {
  double median = 0, p10 = 0, p90 = 0;
};

// Per rank and rows: one-shot and NCCL timings, and whether each result was right.
struct RankResult {
  std::vector<Spread> oneshot, nccl;
  std::vector<int64_t> oneshot_wrong, nccl_wrong;
  int ctas = 0;
};

// Exact inputs: small integers, so the sum is the same in any order.
float input(int rank, int64_t i) {
  return static_cast<float>((i * 7 + rank * 13) % 2001 - 1000);
}

int64_t count_wrong(const std::vector<float>& got, int world) {
  int64_t wrong = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    float s = input(0, static_cast<int64_t>(i));
    for (int r = 1; r < world; ++r) s += input(r, static_cast<int64_t>(i));
    uint32_t a, b;
    std::memcpy(&a, &got[i], 4);
    std::memcpy(&b, &s, 4);
    wrong += a != b;
  }
  return wrong;
}

Spread summarize(const std::vector<double>& us) {
  return {percentile(us, 0.5), percentile(us, 0.1), percentile(us, 0.9)};
}

int run_allreduce_bench(int argc, char** argv) {
  Options opt;
  CLI::App app{
      "TP all-reduce benchmark: one-shot over peer-mapped buffers vs NCCL, [rows, hidden] fp32, "
      "ranks as threads, graph replay"};
  app.add_option("--rows", opt.rows_text,
                 "comma-separated rows (tokens) per call, the message is rows x hidden fp32")
      ->capture_default_str();
  app.add_option("--hidden", opt.hidden, "hidden size")->capture_default_str();
  app.add_option("--tp", opt.tp, "ranks (threads; one GPU each when that many are visible)")
      ->capture_default_str();
  app.add_option("--launches", opt.launches, "timed calls per graph replay")->capture_default_str();
  app.add_option("--reps", opt.reps, "graph replays measured")->capture_default_str();
  app.add_option("--warmup", opt.warmup, "graph replays before measuring")->capture_default_str();
  app.add_option("--ctas", opt.ctas, "one-shot CTAs per launch (0: one per SM)")
      ->capture_default_str();
  app.add_flag("--same-gpu", opt.same_gpu, "every rank on GPU 0 (one-shot only)");
  app.add_flag("--no-nccl", opt.no_nccl, "skip the NCCL baseline");
  app.add_option("--json", opt.json_path, "write the results as JSON here");
  app.add_option("--commit", opt.commit, "commit id recorded in the JSON (default $M3MSA_COMMIT)");
  if (auto code = parse_flags(app, argc, argv)) return *code;
  opt.rows = int_list("--rows", opt.rows_text, 1);
  require_range("--hidden", opt.hidden, 1);
  require_range("--tp", opt.tp, 2, 8);
  require_range("--launches", opt.launches, 1);
  require_range("--reps", opt.reps, 1);
  require_range("--warmup", opt.warmup, 0);
  require_range("--ctas", opt.ctas, 0);
  require_output_path("--json", opt.json_path);
  require_device("bench allreduce");

  const int visible = cuda_device_count();
  const int P = opt.tp;
  const bool same_gpu = opt.same_gpu || visible < P;
  const bool with_nccl = !same_gpu && !opt.no_nccl;
  const std::string mode = same_gpu ? "same-gpu" : "nvlink";
  const std::string device = device_description();
  ResultFile result_file("allreduce", argc, argv, opt.json_path, opt.commit);
  std::printf("m3msa bench allreduce: TP %d, mode %s, on %d x %s\n", P, mode.c_str(), visible,
              device.c_str());
  if (same_gpu) {
    std::printf(
        "  %s: all %d ranks share GPU 0, so the peer stores never cross NVLink and NCCL (one GPU "
        "per rank) is not run; this measures the protocol, not the link\n",
        visible < P ? fmt::format("only {} GPU(s) visible", visible).c_str() : "--same-gpu", P);
  }
  std::printf("\n");

  const int64_t max_rows = *std::max_element(opt.rows.begin(), opt.rows.end());
  const int64_t max_count = max_rows * opt.hidden;
  std::vector<int> devices(static_cast<std::size_t>(P));
  for (int r = 0; r < P; ++r) devices[static_cast<std::size_t>(r)] = same_gpu ? 0 : r;
  std::vector<std::unique_ptr<NcclCommunicator>> nccl;
  if (with_nccl) nccl = make_nccl_communicators_in_process(devices);
  auto group = ThreadGroup::create(P);
  std::vector<RankResult> results(static_cast<std::size_t>(P));
  const std::size_t nrows = opt.rows.size();

  auto body = [&](Communicator& comm) {
    const int r = comm.rank();
    const int dev = devices[static_cast<std::size_t>(r)];
    CUDA_CHECK(cudaSetDevice(dev));
    RankResult& res = results[static_cast<std::size_t>(r)];
    res.oneshot.resize(nrows);
    res.nccl.resize(nrows);
    res.oneshot_wrong.assign(nrows, 0);
    res.nccl_wrong.assign(nrows, 0);
    cuda::Stream stream;
    PeerAllReduceConfig config;
    config.max_count = max_count;
    config.max_ctas = opt.ctas;
    PeerAllReduce ar(comm, dev, config);
    res.ctas = ar.ctas();
    NcclCommunicator* nc = with_nccl ? nccl[static_cast<std::size_t>(r)].get() : nullptr;
    cuda::DeviceBuffer data(sizeof(float) * static_cast<std::size_t>(max_count));
    cuda::DeviceBuffer pristine(sizeof(float) * static_cast<std::size_t>(max_count));
    std::vector<float> host(static_cast<std::size_t>(max_count));
    for (int64_t i = 0; i < max_count; ++i) host[static_cast<std::size_t>(i)] = input(r, i);
    CUDA_CHECK(cudaMemcpy(pristine.data(), host.data(), pristine.bytes(), cudaMemcpyHostToDevice));
    cuda::Event start, stop;
    float* d = data.as<float>();

    for (std::size_t k = 0; k < nrows; ++k) {
      const int64_t count = int64_t{opt.rows[k]} * opt.hidden;
      const std::size_t bytes = sizeof(float) * static_cast<std::size_t>(count);
      auto reset = [&] {
        CUDA_CHECK(
            cudaMemcpyAsync(d, pristine.data(), bytes, cudaMemcpyDeviceToDevice, stream.get()));
      };
      auto oneshot = [&](int call_id) { ar.run(d, count, call_id, stream.get()); };
      auto nccl_call = [&] {
        M3MSA_NCCL_CHECK(ncclAllReduce(d, d, static_cast<std::size_t>(count), ncclFloat32, ncclSum,
                                       static_cast<ncclComm_t>(nc->nccl_comm()), stream.get()));
      };
      auto wait_for = [&](bool is_nccl) {
        if (is_nccl) {
          nc->wait(stream.get(), "bench allreduce: NCCL");
        } else {
          ar.check(stream.get());
        }
      };
      // Correctness, once, eagerly.
      for (bool is_nccl : {false, true}) {
        if (is_nccl && !with_nccl) continue;
        comm.all_gather({}, "bench/check");
        reset();
        if (is_nccl) {
          nccl_call();
        } else {
          oneshot(0);
        }
        wait_for(is_nccl);
        std::vector<float> got(static_cast<std::size_t>(count));
        CUDA_CHECK(cudaMemcpy(got.data(), d, bytes, cudaMemcpyDeviceToHost));
        (is_nccl ? res.nccl_wrong : res.oneshot_wrong)[k] = count_wrong(got, P);
      }
      // Timing.
      for (bool is_nccl : {false, true}) {
        if (is_nccl && !with_nccl) continue;
        cuda::Graph graph = cuda::Graph::capture(stream.get(), [&] {
          if (is_nccl) {
            nccl_call();
          } else {
            oneshot(1);
          }
          CUDA_CHECK(cudaEventRecordWithFlags(start.get(), stream.get(), cudaEventRecordExternal));
          for (int i = 0; i < opt.launches; ++i) {
            if (is_nccl) {
              nccl_call();
            } else {
              oneshot(2 + i);
            }
          }
          CUDA_CHECK(cudaEventRecordWithFlags(stop.get(), stream.get(), cudaEventRecordExternal));
        });
        std::vector<double> us;
        for (int i = 0; i < opt.warmup + opt.reps; ++i) {
          reset();
          comm.all_gather({}, "bench/rep");
          graph.launch(stream.get());
          wait_for(is_nccl);
          float ms = 0.0f;
          CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
          if (i >= opt.warmup) us.push_back(ms * 1000.0 / opt.launches);
        }
        (is_nccl ? res.nccl : res.oneshot)[k] = summarize(us);
      }
      if (r == 0) {
        std::fprintf(stderr, "[%zu/%zu] rows %d: one-shot %.2f us%s\n", k + 1, nrows, opt.rows[k],
                     res.oneshot[k].median,
                     with_nccl ? fmt::format(", nccl {:.2f} us", res.nccl[k].median).c_str() : "");
      }
    }
    comm.all_gather({}, "bench/done");  // no rank frees a buffer a peer still stores into
  };
  for (const std::exception_ptr& e : run_ranks(group, body)) {
    if (e) std::rethrow_exception(e);
  }

  Table table({"mode", "rows", "KiB/rank", "one-shot us", "noise", "nccl us", "nccl noise",
               "nccl/one-shot", "floor us", "one-shot/floor"});
  bool all_right = true;
  for (std::size_t k = 0; k < nrows; ++k) {
    const int rows = opt.rows[k];
    const int64_t count = int64_t{rows} * opt.hidden;
    const double kb = static_cast<double>(count) * 4.0 / 1024.0;
    Spread one, nc;
    int64_t one_wrong = 0, nccl_wrong = 0;
    for (const RankResult& res : results) {
      one.median = std::max(one.median, res.oneshot[k].median);
      one.p10 = std::max(one.p10, res.oneshot[k].p10);
      one.p90 = std::max(one.p90, res.oneshot[k].p90);
      nc.median = std::max(nc.median, res.nccl[k].median);
      nc.p10 = std::max(nc.p10, res.nccl[k].p10);
      nc.p90 = std::max(nc.p90, res.nccl[k].p90);
      one_wrong += res.oneshot_wrong[k];
      nccl_wrong += res.nccl_wrong[k];
    }
    all_right = all_right && one_wrong == 0 && nccl_wrong == 0;
    auto noise = [](const Spread& t) { return t.median > 0 ? (t.p90 - t.p10) / t.median : 0.0; };
    const double floor_us =
        static_cast<double>(P - 1) * static_cast<double>(count) * 4.0 / (kNvlinkGBs * 1e3) +
        kOneWayLatencyUs;
    nlohmann::json rec = {{"mode", mode},
                          {"tp", P},
                          {"rows", rows},
                          {"hidden", opt.hidden},
                          {"count", count},
                          {"kib_per_rank", kb},
                          {"oneshot_us", one.median},
                          {"oneshot_p10_us", one.p10},
                          {"oneshot_p90_us", one.p90},
                          {"oneshot_noise", noise(one)},
                          {"oneshot_wrong", one_wrong},
                          {"oneshot_ctas", results[0].ctas},
                          {"launches", opt.launches},
                          {"reps", opt.reps}};
    std::vector<std::string> cells = {mode,
                                      std::to_string(rows),
                                      fmt::format("{:.0f}", kb),
                                      fmt::format("{:.2f}", one.median),
                                      fmt::format("{:.0f}%", 100.0 * noise(one)),
                                      "-",
                                      "-",
                                      "-",
                                      "-",
                                      "-"};
    if (one_wrong != 0) cells[3] = fmt::format("WRONG ({})", one_wrong);
    if (with_nccl) {
      rec["nccl_us"] = nc.median;
      rec["nccl_p10_us"] = nc.p10;
      rec["nccl_p90_us"] = nc.p90;
      rec["nccl_noise"] = noise(nc);
      rec["nccl_wrong"] = nccl_wrong;
      rec["nccl_over_oneshot"] = nc.median / one.median;
      cells[5] = nccl_wrong != 0 ? fmt::format("WRONG ({})", nccl_wrong)
                                 : fmt::format("{:.2f}", nc.median);
      cells[6] = fmt::format("{:.0f}%", 100.0 * noise(nc));
      cells[7] = fmt::format("{:.2f}", nc.median / one.median);
    }
    // median_us and the floor columns are the one-shot's; bytes = the fp32 payload one rank
    // receives, the floor's bytes.
    rec.update(measured_fields(Timing{one.median, one.p10, one.p90, opt.reps},
                               static_cast<double>(P - 1) * static_cast<double>(count) * 4.0,
                               same_gpu ? 0.0 : floor_us));
    if (!same_gpu) {
      rec["floor_us"] = floor_us;
      rec["oneshot_over_floor"] = one.median / floor_us;
      cells[8] = fmt::format("{:.2f}", floor_us);
      cells[9] = fmt::format("{:.2f}", one.median / floor_us);
    }
    table.add(std::move(cells), std::move(rec));
  }
  table.print();
  std::printf(
      "\none-shot: %d CTAs per launch; %d calls per replay, median of %d replays (max over "
      "ranks); floor = (P - 1) x fp32 payload / %.0f GB/s + %.2f us\n",
      results[0].ctas, opt.launches, opt.reps, kNvlinkGBs, kOneWayLatencyUs);
  result_file.meta() = {{"mode", mode}, {"tp", P}};
  result_file.write(table.records());
  if (!all_right) {
    std::fprintf(stderr, "bench allreduce: a result differs from the CPU rank-order sum\n");
    return 1;
  }
  return 0;
}

const m3msa::cli::BenchRegistrar kRegistrar(
    "allreduce", "TP all-reduce: one-shot peer stores vs NCCL, rows x 6144 fp32, graph replay",
    run_allreduce_bench);

}  // namespace
}  // namespace m3msa::bench
