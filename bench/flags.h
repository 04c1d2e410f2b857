// The flag convention of every `m3msa bench NAME` (README: exit 2 for bad flags or values, the
// message naming the flag): parse with parse_flags, check every value (comma lists included)
// right after parsing with the helpers below, which throw cli::UsageError ("FLAG: what", exit 2
// through cli/main.cc), and only then look for a device (require_device), so a refused command
// line says why on any machine and never after minutes of measuring.
#pragma once

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include "commands.h"  // cli/: UsageError
#include "common.h"    // cli/: the exit codes
#include "m3msa/backend.h"
#include "m3msa/dtype.h"
#include "m3msa/error.h"

namespace m3msa::bench {

// Parses the command line into `app`. An exit code where the handler must stop (CLI11 printed
// why): 0 after --help, kExitUsage after any parse error (an unknown flag, a value that is not of
// the flag's type, ...); nullopt to go on. Use: if (auto code = parse_flags(...)) return *code;
inline std::optional<int> parse_flags(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? cli::kExitOk : cli::kExitUsage;
  }
  return std::nullopt;
}

// Refuses a flag's value unless `ok`: a usage error "FLAG: WHAT".
inline void require_flag(bool ok, std::string_view flag, std::string_view what) {
  if (!ok) throw cli::UsageError(fmt::format("{}: {}", flag, what));
}

namespace detail {

// ">= 1" or "in 1..16" (no upper bound written where there is none).
template <typename Int>
std::string range_text(Int lo, Int hi) {
  return hi == std::numeric_limits<Int>::max() ? fmt::format(">= {}", lo)
                                               : fmt::format("in {}..{}", lo, hi);
}

inline std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace detail

// A scalar flag in [lo, hi]: "--reps: must be >= 1, got 0".
template <typename Int>
void require_range(std::string_view flag, Int value, std::type_identity_t<Int> lo,
                   std::type_identity_t<Int> hi = std::numeric_limits<Int>::max()) {
  require_flag(value >= lo && value <= hi, flag,
               fmt::format("must be {}, got {}", detail::range_text(lo, hi), value));
}

// Runs `check` (a library parse or check of a flag's value: parse_dtype, ModelConfig::sparse,
// AttentionTuning::parse, ...) and returns what it returns; the m3msa::Error it throws becomes a
// usage error naming the flag.
template <typename Check>
auto with_flag(std::string_view flag, Check&& check) -> decltype(check()) {
  try {
    return check();
  } catch (const Error& e) {
    const std::string& message = e.message();
    // A parser given the flag as its `what` (parse_kv_layout) names it already.
    if (message.rfind(std::string(flag) + ":", 0) == 0) throw cli::UsageError(message);
    throw cli::UsageError(fmt::format("{}: {}", flag, message));
  }
}

// The items of a flag's list ("a,b,c" -> {"a", "b", "c"}, spaces around an item dropped); refuses
// an empty list and an empty item.
inline std::vector<std::string> list_items(std::string_view flag, std::string_view text,
                                           char separator = ',') {
  require_flag(!text.empty(), flag, "needs at least one value");
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at <= text.size()) {
    std::size_t end = text.find(separator, at);
    if (end == std::string_view::npos) end = text.size();
    std::string_view item = text.substr(at, end - at);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    require_flag(!item.empty(), flag, fmt::format("empty item in '{}'", text));
    out.emplace_back(item);
    at = end + 1;
  }
  return out;
}

// "1,4,16" -> {1, 4, 16}: every item a whole integer in [lo, hi], or a usage error naming the
// flag and the item.
template <typename Int = int>
std::vector<Int> int_list(std::string_view flag, std::string_view text,
                          std::type_identity_t<Int> lo,
                          std::type_identity_t<Int> hi = std::numeric_limits<Int>::max()) {
  static_assert(std::is_integral_v<Int>);
  std::vector<Int> out;
  for (const std::string& item : list_items(flag, text)) {
    Int value{};
    const char* end = item.data() + item.size();
    const auto [stop, error] = std::from_chars(item.data(), end, value);
    require_flag(error != std::errc::invalid_argument && stop == end, flag,
                 fmt::format("'{}' is not an integer", item));
    require_flag(error == std::errc{} && value >= lo && value <= hi, flag,
                 fmt::format("must be {}, got {}", detail::range_text(lo, hi), item));
    out.push_back(value);
  }
  return out;
}

// A flag's value, one of `allowed`.
inline void require_choice(std::string_view flag, const std::string& value,
                           const std::vector<std::string>& allowed) {
  require_flag(std::find(allowed.begin(), allowed.end(), value) != allowed.end(), flag,
               fmt::format("got '{}', expected one of {}", value, detail::joined(allowed)));
}

// A list whose every item is one of `allowed` (in the order given).
inline std::vector<std::string> choice_list(std::string_view flag, std::string_view text,
                                            const std::vector<std::string>& allowed) {
  std::vector<std::string> out = list_items(flag, text);
  for (const std::string& item : out) require_choice(flag, item, allowed);
  return out;
}

// An integer list whose every item is one of `allowed` (e.g. the TP sizes a shape splits into).
template <typename Int = int>
std::vector<Int> int_choice_list(std::string_view flag, std::string_view text,
                                 const std::vector<Int>& allowed) {
  std::vector<Int> out = int_list<Int>(flag, text, std::numeric_limits<Int>::min());
  std::vector<std::string> names;
  for (Int a : allowed) names.push_back(fmt::format("{}", a));
  for (Int v : out) {
    require_flag(std::find(allowed.begin(), allowed.end(), v) != allowed.end(), flag,
                 fmt::format("got {}, expected one of {}", v, detail::joined(names)));
  }
  return out;
}

// Every item of a list through a library parser (parse_kv_layout, parse_cp_transport,
// AttentionTuning::parse, ...), its errors naming the flag (with_flag).
template <typename Parse>
auto parsed_list(std::string_view flag, std::string_view text, Parse&& parse,
                 char separator = ',') {
  using Value = std::decay_t<decltype(parse(std::string()))>;
  std::vector<Value> out;
  for (const std::string& item : list_items(flag, text, separator)) {
    out.push_back(with_flag(flag, [&] { return parse(item); }));
  }
  return out;
}

// A dtype as the benchmarks' tables and flags write it ("fp8", not dtype_name's "fp8_e4m3").
inline std::string dtype_label(DType dtype) {
  return dtype == DType::kFP8E4M3 ? "fp8" : dtype_name(dtype);
}

// A dtype flag's value: parse_dtype's names ("bf16", "fp8", "bfloat16", ...), restricted to the
// dtypes the benchmark runs.
inline DType dtype_flag(std::string_view flag, const std::string& value,
                        const std::vector<DType>& allowed) {
  std::vector<std::string> names;
  for (DType d : allowed) names.push_back(dtype_label(d));
  DType dtype{};
  bool known = true;
  try {
    dtype = parse_dtype(value, "");
  } catch (const Error&) {
    known = false;
  }
  require_flag(known && std::find(allowed.begin(), allowed.end(), dtype) != allowed.end(), flag,
               fmt::format("got '{}', expected one of {}", value, detail::joined(names)));
  return dtype;
}

inline std::vector<DType> dtype_list(std::string_view flag, std::string_view text,
                                     const std::vector<DType>& allowed) {
  std::vector<DType> out;
  for (const std::string& item : list_items(flag, text)) {
    out.push_back(dtype_flag(flag, item, allowed));
  }
  return out;
}

// An output file's path whose folder exists: the file is written only after measuring.
inline void require_output_path(std::string_view flag, const std::string& path) {
  if (path.empty()) return;
  const std::filesystem::path folder = std::filesystem::path(path).parent_path();
  std::error_code error;
  require_flag(folder.empty() || std::filesystem::is_directory(folder, error), flag,
               fmt::format("the folder of '{}' does not exist", path));
}

// After every flag is checked: a benchmark needs a CUDA device ("bench NAME: no CUDA device
// visible", a library error: exit 3).
inline void require_device(std::string_view who) {
  M3MSA_CHECK_SUPPORTED(cuda_device_count() > 0, who, ": no CUDA device visible");
}

}  // namespace m3msa::bench
