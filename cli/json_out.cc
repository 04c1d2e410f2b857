#include "json_out.h"

#include <fstream>

#include "m3msa/error.h"

namespace m3msa::cli {

nlohmann::ordered_json check_json(const CheckResult& result) {
  return nlohmann::ordered_json{{"name", result.name},
                                {"passed", result.passed()},
                                {"checked", result.checked},
                                {"failed", result.failed},
                                {"detail", result.detail}};
}

void write_json_file(const std::string& path, const nlohmann::ordered_json& document) {
  std::ofstream file(path);
  file << document.dump(2) << "\n";
  M3MSA_CHECK_ARG(file.good(), "--json: cannot write ", path);
}

}  // namespace m3msa::cli
