// JSON output shared by the subcommands that take --json (demo, replay).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "checks.h"

namespace m3msa::cli {

// {"name", "passed", "checked", "failed", "detail"} of one check.
nlohmann::ordered_json check_json(const CheckResult& result);

// Writes `document` (indented) to `path`; throws naming --json when the file cannot be written.
void write_json_file(const std::string& path, const nlohmann::ordered_json& document);

}  // namespace m3msa::cli
