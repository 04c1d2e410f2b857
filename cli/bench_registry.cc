#include "bench_registry.h"

#include <map>

#include "m3msa/error.h"

namespace m3msa::cli {

namespace {
// A function-local static: registrars in other translation units may run before this file's
// globals are initialized.
std::map<std::string, BenchEntry>& registry() {
  static std::map<std::string, BenchEntry> entries;
  return entries;
}
}  // namespace

void register_bench(const std::string& name, const std::string& description, BenchHandler handler) {
  M3MSA_CHECK_ARG(!name.empty() && name.find(' ') == std::string::npos,
                  "register_bench: the name must be one non-empty word, got '", name, "'");
  M3MSA_CHECK_ARG(handler != nullptr, "register_bench(", name, "): null handler");
  M3MSA_CHECK_ARG(registry().count(name) == 0, "register_bench: '", name, "' is registered twice");
  registry()[name] = BenchEntry{name, description, std::move(handler)};
}

std::vector<BenchEntry> registered_benches() {
  std::vector<BenchEntry> out;
  for (const auto& [name, entry] : registry()) out.push_back(entry);
  return out;
}

}  // namespace m3msa::cli
