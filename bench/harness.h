// The GPU benchmark harness shared by `m3msa bench ...` handlers: CUDA-graph replay timing with
// CUDA events, order statistics, and one table format printed as text and written as JSON.
//
// Method (docs/benchmarks.md, "Method"): a graph holds `launches` back-to-back launches that cycle
// through input copies whose total size is several times the 60 MB L2, so no launch finds its
// inputs in L2; the graph is replayed `reps` times after `warmup` replays; the time of one launch
// is the replay time / launches. Reported: the median over replays, and the noise as p10..p90.
// The flag convention of the handlers (parse_flags, checks that name the flag) is flags.h's.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "cuda/common.cuh"
#include "flags.h"
#include "m3msa/error.h"

namespace m3msa::bench {

inline constexpr double kReadCeilingTBs =
    4.57;  // measured HBM read-only ceiling (docs/benchmarks.md)
inline constexpr int64_t kL2Bytes = 60ll << 20;

struct Timing {
  double median_us = 0.0;
  double p10_us = 0.0;
  double p90_us = 0.0;
  int reps = 0;
  double noise() const { return median_us > 0 ? (p90_us - p10_us) / median_us : 0.0; }
};

inline double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const double pos = q * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(v.size() - 1, lo + 1);
  return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
}

// Times `graph` (holding `launches` launches) by replays; stops early once `budget_ms` of
// measured time is spent (at least 5 replays).
inline Timing time_graph(const cuda::Graph& graph, cudaStream_t stream, int launches, int warmup,
                         int reps, double budget_ms = 400.0) {
  for (int i = 0; i < warmup; ++i) graph.launch(stream);
  CUDA_CHECK(cudaStreamSynchronize(stream));
  cuda::Event start, stop;
  std::vector<double> per_launch_us;
  double spent_ms = 0.0;
  for (int i = 0; i < reps; ++i) {
    start.record(stream);
    graph.launch(stream);
    stop.record(stream);
    const double ms = stop.elapsed_ms_since(start);
    per_launch_us.push_back(ms * 1000.0 / launches);
    spent_ms += ms;
    if (i >= 4 && spent_ms > budget_ms) break;
  }
  Timing t;
  t.median_us = percentile(per_launch_us, 0.5);
  t.p10_us = percentile(per_launch_us, 0.1);
  t.p90_us = percentile(per_launch_us, 0.9);
  t.reps = static_cast<int>(per_launch_us.size());
  return t;
}

// A results table: fixed columns, rows of cells; printed aligned, saved as a JSON array.
class Table {
 public:
  explicit Table(std::vector<std::string> columns) : columns_(std::move(columns)) {}
  void add(std::vector<std::string> cells, nlohmann::json record) {
    rows_.push_back(std::move(cells));
    records_.push_back(std::move(record));
  }
  void print(std::FILE* out = stdout) const {
    std::vector<size_t> width(columns_.size());
    for (size_t c = 0; c < columns_.size(); ++c) {
      width[c] = columns_[c].size();
      for (const auto& row : rows_) width[c] = std::max(width[c], row[c].size());
    }
    auto line = [&](const std::vector<std::string>& cells) {
      for (size_t c = 0; c < cells.size(); ++c) {
        std::fprintf(out, "%s%*s", c ? " | " : "| ", static_cast<int>(width[c]), cells[c].c_str());
      }
      std::fprintf(out, " |\n");
    };
    line(columns_);
    std::string rule = "|";
    for (size_t c = 0; c < columns_.size(); ++c) rule += std::string(width[c] + 2, '-') + "|";
    std::fprintf(out, "%s\n", rule.c_str());
    for (const auto& row : rows_) line(row);
    std::fflush(out);
  }
  const nlohmann::json& records() const { return records_; }
  // The record of the row added last, for columns computed after add().
  nlohmann::json& last_record() { return records_.back(); }

 private:
  std::vector<std::string> columns_;
  std::vector<std::vector<std::string>> rows_;
  nlohmann::json records_ = nlohmann::json::array();
};

inline std::string device_description() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  char numbers[96];
  std::snprintf(numbers, sizeof(numbers), ", %d SMs, %.0f MB L2, %.0f GiB",
                prop.multiProcessorCount, prop.l2CacheSize / 1048576.0,
                prop.totalGlobalMem / 1073741824.0);
  return std::string(prop.name) + numbers;
}

// A PyTorch baseline's results (bench/torch_*.py write {"results": [{...fields...,
// "median_us": x | null, ...}], ...}), for the "torch us" / "x torch" columns of a benchmark.
// Records are keyed by the values of `key_fields`, in that order; a benchmark looks up its
// configuration with the same values (find / median_us take them in key_fields order).
class TorchBaseline {
 public:
  TorchBaseline() = default;
  // An empty path: no baseline. A missing, unreadable or malformed file: a note on stderr naming
  // `who` (e.g. "bench indexer"), and no records (the columns stay empty).
  static TorchBaseline read(const std::string& path, std::vector<std::string> key_fields,
                            const std::string& who) {
    TorchBaseline out;
    out.key_fields_ = std::move(key_fields);
    if (path.empty()) return out;
    std::ifstream in(path);
    if (!in) {
      std::fprintf(stderr, "%s: no torch results at %s (columns left empty)\n", who.c_str(),
                   path.c_str());
      return out;
    }
    try {
      nlohmann::json doc;
      in >> doc;
      for (const auto& r : doc.at("results")) {
        nlohmann::json key = nlohmann::json::array();
        for (const std::string& f : out.key_fields_) {
          if (r.contains(f)) key.push_back(r[f]);
        }
        if (key.size() == out.key_fields_.size()) out.records_[key.dump()] = r;  // else not ours
      }
      doc.erase("results");
      out.meta_ = std::move(doc);
    } catch (const nlohmann::json::exception& e) {
      std::fprintf(stderr, "%s: cannot read torch results %s: %s (columns left empty)\n",
                   who.c_str(), path.c_str(), e.what());
      out.records_.clear();
    }
    return out;
  }

  // The record of one configuration, or null.
  const nlohmann::json* find(const std::vector<nlohmann::json>& key_values) const {
    nlohmann::json key = nlohmann::json::array();
    for (const auto& v : key_values) key.push_back(v);
    const auto it = records_.find(key.dump());
    return it == records_.end() ? nullptr : &it->second;
  }
  // Its median_us; 0 when there is no record or the baseline did not measure it (null).
  double median_us(const std::vector<nlohmann::json>& key_values) const {
    const nlohmann::json* r = find(key_values);
    if (r == nullptr || !r->contains("median_us") || !(*r)["median_us"].is_number()) return 0.0;
    return (*r)["median_us"].get<double>();
  }
  bool empty() const { return records_.empty(); }
  size_t size() const { return records_.size(); }
  // The document without its results (torch version, device, ...); null without a baseline.
  const nlohmann::json& meta() const { return meta_; }

 private:
  std::vector<std::string> key_fields_;
  std::map<std::string, nlohmann::json> records_;
  nlohmann::json meta_;
};

// The floor columns of a result row: bytes and, when there is a floor, floor_us and pct_of_floor
// (floor / median, in %). The floor defaults to bytes / the read ceiling; a benchmark whose floor
// counts more than HBM bytes (the layer's all-reduce, the all-reduce's NVLink payload) passes its
// own, and floor_us == 0 leaves it out.
inline nlohmann::json floor_fields(double median_us, double bytes, double floor_us = -1.0) {
  nlohmann::json out = nlohmann::json::object();
  if (bytes > 0) out["bytes"] = bytes;
  if (floor_us < 0) floor_us = bytes > 0 ? bytes / (kReadCeilingTBs * 1e12) * 1e6 : 0.0;
  if (floor_us > 0) {
    out["floor_us"] = floor_us;
    if (median_us > 0) out["pct_of_floor"] = 100.0 * floor_us / median_us;
  }
  return out;
}

// The standard measurement columns of a result row: median_us, p10_us, p90_us, noise, reps, and
// floor_fields().
inline nlohmann::json measured_fields(const Timing& t, double bytes, double floor_us = -1.0) {
  nlohmann::json out = {
      {"median_us", t.median_us}, {"p10_us", t.p10_us}, {"p90_us", t.p90_us}, {"noise", t.noise()}};
  if (t.reps > 0) out["reps"] = t.reps;
  out.update(floor_fields(t.median_us, bytes, floor_us));
  return out;
}

inline std::string card_name() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return prop.name;
}

// argv joined into one shell line (arguments with spaces or shell characters single-quoted).
inline std::string command_line(int argc, char** argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) {
    std::string arg = argv[i];
    // argv[0] is "m3msa bench NAME" (cli/bench.cc): one word list, never quoted.
    const bool plain =
        i == 0 || (!arg.empty() && arg.find_first_of(" \t'\"$;&|<>()*?`\\") == std::string::npos);
    if (!plain) {
      std::string quoted = "'";
      for (char c : arg) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
      arg = quoted + "'";
    }
    out += (i ? " " : "") + arg;
  }
  return out;
}

// The one result file format of every `m3msa bench NAME --json FILE` (docs/benchmarks.md,
// "Result files"):
//   {"benchmark", "commit", "card", "card_detail", "gpus", "date", "command",
//    "read_ceiling_tb_per_s", "complete", "meta": {...}, "rows": [...]}
// commit: the --commit flag where a benchmark has one, else $M3MSA_COMMIT, else "unknown";
// card: the CUDA device name; date: when the run started, UTC, ISO 8601; meta: what a benchmark
// records beside its rows (skipped configurations, the PyTorch baseline's versions, ...).
// write() may be called after every configuration (complete = false), so a run stopped by a time
// limit leaves the rows it measured.
class ResultFile {
 public:
  ResultFile(std::string benchmark, int argc, char** argv, std::string path,
             const std::string& commit = "")
      : benchmark_(std::move(benchmark)), path_(std::move(path)) {
    command_ = command_line(argc, argv);
    commit_ = commit;
    if (commit_.empty() || commit_ == "unknown") {
      const char* env = std::getenv("M3MSA_COMMIT");
      commit_ = env != nullptr && *env != '\0' ? env : "unknown";
    }
    char date[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    date_ = date;
  }

  nlohmann::json& meta() { return meta_; }
  const std::string& commit() const { return commit_; }

  void write(const nlohmann::json& rows, bool complete = true) const {
    if (path_.empty()) return;
    int gpus = 0;
    CUDA_CHECK(cudaGetDeviceCount(&gpus));
    nlohmann::ordered_json doc;
    doc["benchmark"] = benchmark_;
    doc["commit"] = commit_;
    doc["card"] = card_name();
    doc["card_detail"] = device_description();
    doc["gpus"] = gpus;
    doc["date"] = date_;
    doc["command"] = command_;
    doc["read_ceiling_tb_per_s"] = kReadCeilingTBs;
    doc["complete"] = complete;
    doc["meta"] = nlohmann::ordered_json::parse(meta_.is_null() ? "{}" : meta_.dump());
    doc["rows"] = nlohmann::ordered_json::parse(rows.dump());
    std::ofstream out(path_);
    out << doc.dump(2) << "\n";
    M3MSA_CHECK_ARG(out.good(), "--json: cannot write ", path_);
  }

 private:
  std::string benchmark_;
  std::string path_;
  std::string command_;
  std::string commit_;
  std::string date_;
  nlohmann::json meta_;
};

}  // namespace m3msa::bench
