// m3msa info: version, build, backends, devices and the default configuration.
#include <fmt/format.h>

#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "backend_select.h"
#include "bench_registry.h"
#include "commands.h"
#include "common.h"
#include "m3msa/config.h"

#ifndef M3MSA_BUILD_INFO
#define M3MSA_BUILD_INFO "unknown"
#endif
#ifndef M3MSA_CUDA_ARCHITECTURES
#define M3MSA_CUDA_ARCHITECTURES ""
#endif

namespace m3msa::cli {

namespace {

int run_info(bool as_json) {
  const bool cuda_built = built_with_cuda();
  const int devices = cuda_device_count();
  std::string why_not_cuda;
  const bool cuda_usable = cuda_backend_usable(&why_not_cuda);
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const ModelConfig model;
  const SparseConfig sparse = model.sparse(1);
  std::vector<std::string> benches;
  for (const BenchEntry& e : registered_benches()) benches.push_back(e.name);

  if (as_json) {
    nlohmann::ordered_json j = {
        {"version", version_string()},
        {"build", M3MSA_BUILD_INFO},
        {"cuda_compiled", cuda_built},
        {"cuda_architectures", M3MSA_CUDA_ARCHITECTURES},
        {"cuda_devices", devices},
        {"backends",
         {{{"name", "cpu"}, {"available", true}, {"detail", fmt::format("{} threads", hw)}},
          {{"name", "cuda"},
           {"available", cuda_usable},
           {"detail", cuda_usable ? "" : why_not_cuda}}}},
        {"benchmarks", benches},
        {"default_config", sparse.to_string()},
        {"model",
         {{"hidden", model.hidden},
          {"layers", model.num_layers},
          {"first_sparse_layer", model.first_sparse_layer},
          {"sparse_layers", model.num_sparse_layers()}}},
    };
    std::printf("%s\n", j.dump(2).c_str());
    return kExitOk;
  }
  std::printf("m3msa %s\n", version_string());
  std::printf("build:    %s; CUDA %s\n", M3MSA_BUILD_INFO,
              cuda_built
                  ? fmt::format("compiled in (architectures {})", M3MSA_CUDA_ARCHITECTURES).c_str()
                  : "not compiled in (CPU only)");
  std::printf("backends:\n");
  std::printf("  cpu     available: the CPU reference, %u hardware threads\n", hw);
  std::printf("  cuda    %s\n",
              cuda_usable ? "available" : ("not available: " + why_not_cuda).c_str());
  std::printf("  auto    -> %s\n", cuda_usable ? "cuda" : "cpu");
  std::printf("devices:  %d CUDA device%s\n", devices, devices == 1 ? "" : "s");
  std::printf("bench:    %s\n", benches.empty()
                                    ? "none registered (needs the CUDA backend)"
                                    : fmt::format("{}", fmt::join(benches, ", ")).c_str());
  std::printf("default config (MiniMax-M3, one rank):\n  %s\n", sparse.to_string().c_str());
  std::printf("  model: hidden %d, %d layers (dense below layer %d, %d sparse)\n", model.hidden,
              model.num_layers, model.first_sparse_layer, model.num_sparse_layers());
  return kExitOk;
}

}  // namespace

Command add_info_command(CLI::App& parent) {
  auto as_json = std::make_shared<bool>(false);
  CLI::App* app = parent.add_subcommand(
      "info", "Show the version, the build, the backends and devices, and the default config");
  app->footer("Exit code 0.");
  app->add_flag("--json", *as_json, "print the same as JSON");
  return {app, [as_json]() { return run_info(*as_json); }};
}

}  // namespace m3msa::cli
