// The seam between `m3msa bench` and the benchmark code: a benchmark registers a handler under a
// name, and `m3msa bench NAME [ARGS...]` calls it with the remaining arguments, so bench/ code
// plugs in without editing main.cc.
//
// To add one (e.g. from bench/attention_bench.cc), compile the file into the m3msa_cli target
// (`target_sources(m3msa_cli PRIVATE ...)`: an object file of the executable itself, so its static
// initializer always runs) and register at namespace scope:
//
//   #include "bench_registry.h"   // cli/ is on the include path of m3msa_cli
//   namespace {
//   int run_attention_bench(int argc, char** argv) {  // argv[0] is "m3msa bench attention"
//     CLI::App app{"sparse attention benchmark"};       // parse argv however you like
//     ...
//     return 0;                                         // the process exit code
//   }
//   const m3msa::cli::BenchRegistrar kRegistrar("attention", "sparse attention kernels",
//                                               run_attention_bench);
//   }  // namespace
//
// Without any registered benchmark (a build without CUDA), `m3msa bench` says that it is not
// built and exits non-zero.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace m3msa::cli {

// argv[0] is "m3msa bench NAME"; the rest are the arguments after NAME. Returns the exit code.
using BenchHandler = std::function<int(int argc, char** argv)>;

struct BenchEntry {
  std::string name;
  std::string description;
  BenchHandler handler;
};

// Throws m3msa::Error(kInvalidArgument) on an empty or duplicate name.
void register_bench(const std::string& name, const std::string& description, BenchHandler handler);
// Sorted by name.
std::vector<BenchEntry> registered_benches();

struct BenchRegistrar {
  BenchRegistrar(const std::string& name, const std::string& description, BenchHandler handler) {
    register_bench(name, description, std::move(handler));
  }
};

}  // namespace m3msa::cli
