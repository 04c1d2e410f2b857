// m3msa bench NAME [ARGS...]: the benchmarks registered through bench_registry.h. A build
// without the CUDA backend has none and says so.
#include <fmt/format.h>

#include <cstdio>
#include <string>
#include <vector>

#include "bench_registry.h"
#include "commands.h"
#include "common.h"
#include "m3msa/backend.h"

namespace m3msa::cli {

namespace {

std::string bench_list() {
  std::string out;
  for (const BenchEntry& e : registered_benches()) {
    out += fmt::format("  {:<12} {}\n", e.name, e.description);
  }
  return out;
}

std::string not_built_message() {
  return built_with_cuda()
             ? "m3msa bench: no benchmarks are registered in this build"
             : "m3msa bench: not built: needs the CUDA backend (this build has no CUDA; "
               "configure on a machine with nvcc, M3MSA_ENABLE_CUDA=ON)";
}

int run_bench(const std::string& name, std::vector<std::string> args) {
  const std::vector<BenchEntry> benches = registered_benches();
  const bool help_flag = name.empty() && !args.empty() && (args[0] == "-h" || args[0] == "--help");
  if (name == "help" || help_flag) {
    std::printf("Usage: m3msa bench NAME [ARGS...]   (m3msa bench NAME --help for its flags)\n");
    if (benches.empty()) {
      std::printf("%s\n", not_built_message().c_str());
    } else {
      std::printf("Benchmarks:\n%s", bench_list().c_str());
    }
    return kExitOk;
  }
  if (name.empty()) {
    if (benches.empty()) {
      std::fprintf(stderr, "%s\n", not_built_message().c_str());
      return kExitError;
    }
    std::fprintf(stderr, "m3msa bench: a benchmark name is required%s; registered:\n%s",
                 args.empty() ? "" : fmt::format(" (got {})", args[0]).c_str(),
                 bench_list().c_str());
    return kExitUsage;
  }
  if (benches.empty()) {
    std::fprintf(stderr, "%s\n", not_built_message().c_str());
    return kExitError;
  }
  for (const BenchEntry& e : benches) {
    if (e.name != name) continue;
    std::vector<std::string> storage;
    storage.push_back("m3msa bench " + name);
    for (std::string& a : args) storage.push_back(std::move(a));
    std::vector<char*> argv;
    for (std::string& s : storage) argv.push_back(s.data());
    argv.push_back(nullptr);
    return e.handler(static_cast<int>(storage.size()), argv.data());
  }
  std::fprintf(stderr, "m3msa bench: unknown benchmark '%s'; registered:\n%s", name.c_str(),
               bench_list().c_str());
  return kExitUsage;
}

}  // namespace

Command add_bench_command(CLI::App& parent) {
  auto name = std::make_shared<std::string>();
  CLI::App* app = parent.add_subcommand(
      "bench",
      "Benchmarks (need the CUDA backend): m3msa bench NAME [ARGS...]; `bench help` lists");
  // Every argument after NAME belongs to the benchmark, --help included.
  app->set_help_flag();
  app->prefix_command();
  app->add_option("name", *name, "benchmark to run");
  return {app, [name, app]() {
            std::vector<std::string> rest = app->remaining();
            return run_bench(*name, rest);
          }};
}

}  // namespace m3msa::cli
