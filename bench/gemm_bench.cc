// m3msa bench gemm: the runtime's skinny projection GEMM (src/cuda/gemm.h) at M3's
// projection shapes, under CUDA-graph replay with rotated weights, against the vendor library
// through PyTorch (bench/torch_gemm.py: cuBLAS / cuBLASLt for bf16, torch._scaled_mm for fp8),
// whose results are merged from --torch-json.
//
// out[r, n] = x[r, :] . w[n, :] (* scale[n] for fp8 weights), x bf16 [rows, k], w [n, k] bf16 or
// fp8 e4m3 with per-output-channel f32 scales, out bf16. Shapes (ModelConfig{} defaults, per TP
// rank): qkv_proj [sparse(tp).qkv_width(), hidden] and o_proj [hidden, q_heads / tp * head_dim]
// at TP 1 and 2; the MLP is not measured.
//
// Timing (docs/benchmarks.md "Method"): `copies` weight copies (with their own x, scales and
// outputs) on disjoint memory, together more than --rotate-bytes (4 x the 60 MB L2); one graph
// holds `launches` (a multiple of copies, >= --min-launches) back-to-back launches cycling through
// them, so every launch streams its weights from HBM. Median over replays; noise = p10..p90.
// Bytes = weights (+ scales) + x + out, each once; floor = bytes / 4.57 TB/s.
//
// Check (once per configuration, before timing): every output poisoned (0xFFFF, a bf16 NaN), one
// eager launch on copy 0, then for --check-cols columns (both ends and spread over n) x every row
// a double-precision host reference of the same bf16 / fp8 inputs: |got - ref| <= 4e-6 *
// sum_k |x w| (* scale) + |ref| / 256 (fp32 accumulation, then one bf16 rounding: half an ulp is
// <= |ref| / 256); a guard row after the output must stay poisoned; after timing, copy 0's output
// of the graph replays must be bit-identical to the eager one (the kernel is deterministic).
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_registry.h"
#include "cuda/common.cuh"
#include "cuda/gemm.h"
#include "fill.h"
#include "harness.h"
#include "m3msa/backend.h"
#include "m3msa/config.h"
#include "m3msa/dtype.h"
#include "m3msa/error.h"
#include "m3msa/testing/splitmix.h"

namespace m3msa::bench {
namespace {

struct Shape {
  std::string name;  // qkv_tp1, o_tp1, qkv_tp2, o_tp2
  int tp;
  int64_t n;
  int64_t k;
};

std::vector<Shape> m3_shapes() {
  const ModelConfig m;  // M3 defaults
  std::vector<Shape> out;
  for (int tp : {1, 2}) {
    const SparseConfig sc = m.sparse(tp);
    out.push_back({fmt::format("qkv_tp{}", tp), tp, sc.qkv_width(), m.hidden});
    out.push_back({fmt::format("o_tp{}", tp), tp, m.hidden, int64_t{sc.q_heads} * sc.head_dim});
  }
  return out;
}

struct Options {
  // The comma lists as given (checked and parsed after the flags).
  std::string shapes = "qkv_tp1,o_tp1,qkv_tp2,o_tp2";
  std::string rows = "1,2,4,8,16";
  std::string dtypes = "bf16,fp8";
  bool quick = false;
  int reps = 50;
  int64_t rotate_bytes = 4 * kL2Bytes;
  int max_copies = 256;
  int min_launches = 64;
  int check_cols = 128;
  uint64_t seed = 1;
  std::string json_path;
  std::string torch_json;
  std::string commit = "unknown";
};

// The columns checked: 0, n - 1 and `count` spread over n (deterministic, not only CTA starts).
std::vector<int64_t> check_columns(int64_t n, int count) {
  std::vector<int64_t> cols = {0, n - 1};
  for (int i = 0; i < count; ++i) {
    const int64_t base = static_cast<int64_t>(i) * n / std::max(count, 1);
    const int64_t span = std::max<int64_t>(1, n / std::max(count, 1));
    cols.push_back(std::min(n - 1, base + (static_cast<int64_t>(i) * 7919 + 3) % span));
  }
  std::sort(cols.begin(), cols.end());
  cols.erase(std::unique(cols.begin(), cols.end()), cols.end());
  return cols;
}

// splitmix64, for the host-side scales.
using Rng = testkit::SplitMix64;

struct CheckResult {
  int64_t checked = 0;
  int64_t bad = 0;
  double worst = 0.0;  // max |got - ref| / tolerance
  std::string first;   // the first failure
  bool guard_ok = true;
};

int run_gemm_bench(int argc, char** argv) {
  Options opt;
  CLI::App app{
      "The runtime's skinny projection GEMM (bf16 / fp8 weights) at M3 shapes, graph replay with "
      "rotated weights; --torch-json merges the cuBLAS(Lt) baseline of bench/torch_gemm.py"};
  app.option_defaults()->always_capture_default();
  std::string shape_help = "projection shapes:";
  for (const Shape& s : m3_shapes()) shape_help += fmt::format(" {} [{}, {}]", s.name, s.n, s.k);
  app.add_option("--shapes", opt.shapes, "comma-separated " + shape_help);
  app.add_option("--rows", opt.rows,
                 fmt::format("comma-separated token rows (1..{})", cuda::kSkinnyMaxRows));
  app.add_option("--dtypes", opt.dtypes,
                 "comma-separated weight dtypes: bf16, fp8 (per-channel scales)");
  app.add_flag("--quick", opt.quick, "rows 1,16 only (every shape and dtype), at most 20 reps");
  app.add_option("--reps", opt.reps, "graph replays per measurement (at most)");
  app.add_option("--rotate-bytes", opt.rotate_bytes,
                 "weight bytes one graph cycles through (more than this; default 4 x L2)");
  app.add_option("--max-copies", opt.max_copies, "at most this many weight copies");
  app.add_option("--min-launches", opt.min_launches,
                 "at least this many launches per graph (a multiple of the copies)");
  app.add_option("--check-cols", opt.check_cols,
                 "output columns checked against the double reference (x every row)");
  app.add_option("--seed", opt.seed, "random seed of the inputs");
  app.add_option("--json", opt.json_path, "write the results as JSON here");
  app.add_option("--torch-json", opt.torch_json, "PyTorch baseline results (torch_gemm.py)");
  app.add_option("--commit", opt.commit, "commit id recorded in the JSON (default $M3MSA_COMMIT)");
  if (auto code = parse_flags(app, argc, argv)) return *code;
  // Every value is checked here, before the device and the first measurement.
  const std::vector<Shape> all_shapes = m3_shapes();
  std::vector<std::string> shape_names;
  for (const Shape& s : all_shapes) shape_names.push_back(s.name);
  std::vector<Shape> shapes;
  for (const std::string& name : choice_list("--shapes", opt.shapes, shape_names)) {
    shapes.push_back(*std::find_if(all_shapes.begin(), all_shapes.end(),
                                   [&](const Shape& s) { return s.name == name; }));
  }
  std::vector<int> row_list = int_list("--rows", opt.rows, 1, cuda::kSkinnyMaxRows);
  std::vector<bool> fp8s;
  for (const std::string& d : choice_list("--dtypes", opt.dtypes, {"bf16", "fp8"})) {
    fp8s.push_back(d == "fp8");
  }
  require_range("--reps", opt.reps, 1);
  require_range("--rotate-bytes", opt.rotate_bytes, 0);
  require_range("--max-copies", opt.max_copies, 1);
  require_range("--min-launches", opt.min_launches, 1);
  require_range("--check-cols", opt.check_cols, 0);
  if (opt.quick) {
    row_list = {1, 16};
    opt.reps = std::min(opt.reps, 20);
  }
  require_output_path("--json", opt.json_path);
  require_device("bench gemm");
  const TorchBaseline torch =
      TorchBaseline::read(opt.torch_json, {"n", "k", "rows", "dtype"}, "bench gemm");

  cuda::Stream stream;
  const std::string device = device_description();
  std::printf("m3msa bench gemm on %s\n", device.c_str());
  std::printf(
      "bytes = weights (+ fp8 scales) + x + out, once each; roof = 4.57 TB/s read; floor = bytes "
      "/ 4.57 TB/s\n");
  if (!torch.meta().is_null()) {
    std::printf("torch baseline: torch %s on %s; fp8: %s\n",
                torch.meta().value("torch", std::string("?")).c_str(),
                torch.meta().value("device", std::string("?")).c_str(),
                torch.meta().value("fp8_support", std::string("?")).c_str());
  }
  std::printf("\n");

  Table table({"shape", "n", "k", "rows", "dtype", "us", "noise", "MB", "TB/s", "% roof",
               "floor us", "torch us", "x torch", "torch op", "check"});
  const char* tolerance =
      "|got - ref| <= 4e-6 * sum|x w| (* scale) + |ref| / 256 vs a double host reference";
  ResultFile results("gemm", argc, argv, opt.json_path, opt.commit);
  results.meta()["check_tolerance"] = tolerance;
  results.meta()["torch"] = torch.meta();
  auto save = [&](bool complete) { results.write(table.records(), complete); };

  bool all_ok = true;
  for (bool fp8 : fp8s) {
    for (const Shape& shape : shapes) {
      for (int rows : row_list) {
        const int64_t n = shape.n, k = shape.k;
        const int64_t elem = fp8 ? 1 : 2;
        const int64_t w_bytes = n * k * elem + (fp8 ? n * 4 : 0);
        const int64_t x_elems = int64_t{rows} * k;
        const int64_t out_elems = int64_t{rows + 1} * n;  // + one guard row
        const int64_t bytes = w_bytes + x_elems * 2 + int64_t{rows} * n * 2;
        const int copies = static_cast<int>(
            std::clamp<int64_t>(opt.rotate_bytes / w_bytes + 1, 1, opt.max_copies));
        const int launches = copies * ((opt.min_launches + copies - 1) / copies);
        const char* dtype = fp8 ? "fp8" : "bf16";

        size_t free_bytes = 0, total_bytes = 0;
        CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
        const double need = static_cast<double>(copies) * (w_bytes + x_elems * 2 + out_elems * 2) +
                            static_cast<double>(1 << 28);
        if (need > 0.85 * static_cast<double>(free_bytes)) {
          std::printf("skip %s rows %d %s: needs %.1f GB, %.1f GB free\n", shape.name.c_str(), rows,
                      dtype, need / 1e9, free_bytes / 1e9);
          continue;
        }

        // Inputs: per copy its weights (unit-variance uniform, bf16 or e4m3), per-channel scales
        // (fp8), x rows; outputs [rows + 1, n] per copy.
        cuda::DeviceBuffer w(static_cast<size_t>(copies * n * k * elem));
        cuda::DeviceBuffer x(static_cast<size_t>(copies * x_elems * 2));
        cuda::DeviceBuffer out(static_cast<size_t>(copies * out_elems * 2));
        cuda::DeviceBuffer scale(fp8 ? static_cast<size_t>(copies * n * 4) : 0);
        const uint64_t seed = opt.seed * 1000003u + static_cast<uint64_t>(n * 31 + k + rows);
        fill_random(w.data(), copies * n * k, fp8, seed, stream.get());
        fill_random(x.data(), copies * x_elems, false, seed + 17, stream.get());
        std::vector<float> h_scale;
        if (fp8) {
          Rng rng(seed + 29);
          h_scale.resize(static_cast<size_t>(copies * n));
          // In [0.015, 0.025): the order of amax / 448 of a real layer's rows.
          for (float& s : h_scale) s = static_cast<float>(0.015 + 0.01 * rng.uniform01());
          CUDA_CHECK(cudaMemcpyAsync(scale.data(), h_scale.data(), h_scale.size() * 4,
                                     cudaMemcpyHostToDevice, stream.get()));
        }
        CUDA_CHECK(cudaMemsetAsync(out.data(), 0xFF, out.bytes(), stream.get()));  // poison
        // The K split the runtime would use for this projection on this device.
        const bool split_k8 = cuda::gemm_skinny_prefers_split_k8(static_cast<int>(n));
        auto params = [&](int c) {
          cuda::GemmSkinnyParams p;
          p.x = x.as<const uint16_t>() + c * x_elems;
          p.x_stride = k;
          p.w = w.as<const uint8_t>() + c * n * k * elem;
          p.scale = fp8 ? scale.as<const float>() + c * n : nullptr;
          p.out = out.as<uint16_t>() + c * out_elems;
          p.out_stride = n;
          p.rows = rows;
          p.n = static_cast<int>(n);
          p.k = static_cast<int>(k);
          p.w_fp8 = fp8 ? 1 : 0;
          p.out_f32 = 0;
          p.split_k8 = split_k8 ? 1 : 0;
          return p;
        };

        // ---- Correctness: one eager launch on copy 0 vs the double reference ----
        cuda::launch_gemm_skinny(params(0), stream.get());
        stream.synchronize();
        std::vector<uint16_t> h_out(static_cast<size_t>(out_elems));
        std::vector<uint16_t> h_x(static_cast<size_t>(x_elems));
        CUDA_CHECK(cudaMemcpy(h_out.data(), out.data(), h_out.size() * 2, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(h_x.data(), x.data(), h_x.size() * 2, cudaMemcpyDeviceToHost));
        CheckResult chk;
        std::vector<uint8_t> w_row(static_cast<size_t>(k * elem));
        std::vector<double> wv(static_cast<size_t>(k));
        for (int64_t col : check_columns(n, opt.check_cols)) {
          CUDA_CHECK(cudaMemcpy(w_row.data(), w.as<const uint8_t>() + col * k * elem, w_row.size(),
                                cudaMemcpyDeviceToHost));
          for (int64_t i = 0; i < k; ++i) {
            if (fp8) {
              wv[i] = fp8e4m3_to_float(w_row[i]);
            } else {
              uint16_t b;
              std::memcpy(&b, &w_row[2 * i], 2);
              wv[i] = bf16_to_float(b);
            }
          }
          const double sc = fp8 ? h_scale[static_cast<size_t>(col)] : 1.0;
          for (int r = 0; r < rows; ++r) {
            double ref = 0.0, mag = 0.0;
            for (int64_t i = 0; i < k; ++i) {
              const double t = bf16_to_float(h_x[static_cast<size_t>(r * k + i)]) * wv[i];
              ref += t;
              mag += std::fabs(t);
            }
            ref *= sc;
            mag *= sc;
            const double got = bf16_to_float(h_out[static_cast<size_t>(r * n + col)]);
            const double tol = 4e-6 * mag + std::fabs(ref) / 256.0 + 1e-30;
            const double err = std::fabs(got - ref);
            ++chk.checked;
            if (std::isfinite(got)) chk.worst = std::max(chk.worst, err / tol);
            if (!(err <= tol)) {
              if (chk.bad++ == 0) {
                chk.first = fmt::format("row {} col {}: got {}, want {}", r, col, got, ref);
              }
            }
          }
        }
        for (int64_t i = int64_t{rows} * n; i < out_elems; ++i) {
          chk.guard_ok = chk.guard_ok && h_out[static_cast<size_t>(i)] == 0xFFFF;
        }

        // ---- Timing ----
        cuda::Graph graph = cuda::Graph::capture(stream.get(), [&] {
          for (int i = 0; i < launches; ++i)
            cuda::launch_gemm_skinny(params(i % copies), stream.get());
        });
        const Timing t = time_graph(graph, stream.get(), launches, 2, opt.reps);
        std::vector<uint16_t> h_out2(static_cast<size_t>(int64_t{rows} * n));
        CUDA_CHECK(
            cudaMemcpy(h_out2.data(), out.data(), h_out2.size() * 2, cudaMemcpyDeviceToHost));
        const bool same = std::memcmp(h_out2.data(), h_out.data(), h_out2.size() * 2) == 0;

        std::string check = "ok";
        if (chk.bad > 0) check = fmt::format("BAD {}/{}", chk.bad, chk.checked);
        if (!chk.guard_ok) check += " guard";
        if (!same) check += " replay!=eager";
        const bool ok = chk.bad == 0 && chk.guard_ok && same;
        all_ok = all_ok && ok;

        const double tbs = static_cast<double>(bytes) / (t.median_us * 1e-6) / 1e12;
        const double floor_us = static_cast<double>(bytes) / (kReadCeilingTBs * 1e12) * 1e6;
        const double roof = 100.0 * floor_us / t.median_us;
        const std::vector<nlohmann::json> key = {n, k, rows, dtype};
        const double torch_us = torch.median_us(key);
        const nlohmann::json* trec = torch.find(key);
        std::string torch_op = "-";
        if (trec != nullptr) {
          torch_op = trec->value("op", std::string("?"));
          if (torch_us <= 0) torch_op = "skip";
        }
        nlohmann::json rec = {{"shape", shape.name},
                              {"tp", shape.tp},
                              {"n", n},
                              {"k", k},
                              {"rows", rows},
                              {"dtype", dtype},
                              {"us", t.median_us},
                              {"p10_us", t.p10_us},
                              {"p90_us", t.p90_us},
                              {"noise", t.noise()},
                              {"bytes", bytes},
                              {"weight_bytes", w_bytes},
                              {"tb_per_s", tbs},
                              {"pct_roof", roof},
                              {"floor_us", floor_us},
                              {"ctas", cuda::gemm_skinny_ctas(static_cast<int>(n))},
                              {"split_k8", split_k8},
                              {"copies", copies},
                              {"launches", launches},
                              {"reps", t.reps},
                              {"check", check},
                              {"checked_outputs", chk.checked},
                              {"worst_err_over_tol", chk.worst}};
        rec.update(measured_fields(t, static_cast<double>(bytes)));
        if (!chk.first.empty()) rec["first_failure"] = chk.first;
        if (trec != nullptr) {
          rec["torch_op"] = torch_op;
          rec["torch"] = *trec;  // its record as written (kernels, library, check, note, ...)
        }
        if (torch_us > 0) {
          rec["torch_us"] = torch_us;
          rec["speedup_vs_torch"] = torch_us / t.median_us;
        }
        table.add(
            {shape.name, std::to_string(n), std::to_string(k), std::to_string(rows), dtype,
             fmt::format("{:.2f}", t.median_us), fmt::format("{:.1f}%", 100.0 * t.noise()),
             fmt::format("{:.1f}", bytes / 1e6), fmt::format("{:.2f}", tbs),
             fmt::format("{:.0f}%", roof), fmt::format("{:.2f}", floor_us),
             torch_us > 0 ? fmt::format("{:.2f}", torch_us) : "-",
             torch_us > 0 ? fmt::format("{:.2f}", torch_us / t.median_us) : "-", torch_op, check},
            rec);
        std::printf(
            "%-8s rows %2d %-4s: %8.2f us (%3.0f%% roof, floor %.2f us), %d copies x %d "
            "launches, torch %s [%s%s%s]\n",
            shape.name.c_str(), rows, dtype, t.median_us, roof, floor_us, copies, launches,
            torch_us > 0 ? fmt::format("{:.2f} us", torch_us).c_str() : "-", check.c_str(),
            chk.first.empty() ? "" : ": ", chk.first.c_str());
        std::fflush(stdout);
        save(false);
      }
    }
  }
  std::printf("\n");
  table.print();
  std::printf(
      "\ncheck: %s, poisoned outputs, a guard row, graph replay == eager.\n"
      "x torch = torch us / ours (> 1: ours is faster).\n",
      tolerance);
  save(true);
  if (!all_ok) {
    std::fprintf(stderr, "m3msa bench gemm: a correctness check failed (see the check column)\n");
    return 1;
  }
  return 0;
}

const m3msa::cli::BenchRegistrar kRegistrar(
    "gemm", "runtime skinny projection GEMM vs cuBLAS(Lt) via torch, graph replay", run_gemm_bench);

}  // namespace
}  // namespace m3msa::bench
