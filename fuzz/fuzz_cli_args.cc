// fuzz_cli_args: bytes -> an argument vector (the input split at NUL bytes, as argv strings
// cannot hold one) -> the m3msa command line's parse step (cli/args.h): every subcommand's flags,
// values and validators, the subcommand dispatch, help and version. Nothing is run.
//
// Contract (args.h): the parse returns a subcommand to run or help / version text, or throws
// CommandLineError, an m3msa::Error with code kInvalidArgument whose message names what is wrong
// (a flag, a positional argument, a subcommand, or the argument it did not expect). Never a
// crash, UB, a hang or another exception (an uncaught one aborts: libFuzzer records it).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "args.h"
#include "fuzz_common.h"

namespace m3msa::fuzz {
namespace {

constexpr std::size_t kMaxArgs = 48;

// Every name an error may use to point at the culprit: flags with their dashes, positional
// names, subcommand names.
std::vector<std::string> known_names(const cli::CommandLine& line) {
  std::vector<std::string> names;
  auto add_app = [&names](const CLI::App& app) {
    for (const CLI::Option* opt : app.get_options()) {
      for (const std::string& l : opt->get_lnames()) names.push_back("--" + l);
      for (const std::string& s : opt->get_snames()) names.push_back("-" + s);
      if (!opt->get_name(true, false).empty()) names.push_back(opt->get_name(true, false));
    }
  };
  add_app(*line.app);
  for (const cli::Command& c : line.commands) {
    names.push_back(c.app->get_name());
    add_app(*c.app);
  }
  return names;
}

bool contains(const std::string& text, const std::string& part) {
  return !part.empty() && text.find(part) != std::string::npos;
}

// `name` occurs in `text` as a word of its own ("command" is not named by "subcommand").
bool names_as_word(const std::string& text, const std::string& name) {
  auto word_char = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == '-';
  };
  for (std::size_t at = text.find(name); at != std::string::npos; at = text.find(name, at + 1)) {
    const bool starts = at == 0 || !word_char(text[at - 1]) || name[0] == '-';
    const std::size_t end = at + name.size();
    const bool ends = end == text.size() || !word_char(text[end]);
    if (starts && ends) return true;
  }
  return false;
}

// The message names a flag / argument / subcommand, or repeats an argument of the input (CLI11
// repeats what it could not convert; args.cc quotes what was not expected). An unquoted single
// character is too common to count as naming anything.
bool names_culprit(const std::string& message, const cli::CommandLine& line,
                   const std::vector<std::string>& args) {
  for (const std::string& name : known_names(line)) {
    if (name.size() >= 2 && names_as_word(message, name)) return true;
  }
  for (std::size_t i = 1; i < args.size(); ++i) {
    if (args[i].size() >= 2 && contains(message, args[i])) return true;
    if (contains(message, "'" + args[i] + "'")) return true;  // quoted, even when short or empty
  }
  return false;
}

}  // namespace
}  // namespace m3msa::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace m3msa;
  std::vector<std::string> args = {"m3msa"};
  if (size > 0) {
    std::string current;
    for (size_t i = 0; i < size; ++i) {
      if (data[i] == 0) {
        args.push_back(current);
        current.clear();
      } else {
        current.push_back(static_cast<char>(data[i]));
      }
    }
    args.push_back(current);
  }
  if (args.size() > fuzz::kMaxArgs) args.resize(fuzz::kMaxArgs);
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  argv.push_back(nullptr);
  const int argc = static_cast<int>(args.size());

  cli::CommandLine line;
  try {
    const cli::ParsedCommandLine parsed = cli::parse_command_line(line, argc, argv.data());
    if (parsed.print) {
      std::ostringstream out, err;
      const int code = parsed.print(out, err);
      FUZZ_CHECK(code == 0, "help / version exit code %d", code);
      FUZZ_CHECK(!out.str().empty(), "help / version printed nothing");
    } else {
      FUZZ_CHECK(parsed.command != nullptr && parsed.command->app != nullptr);
      FUZZ_CHECK(parsed.command->app->parsed());
      FUZZ_CHECK(parsed.where == "m3msa " + parsed.command->app->get_name(), "where '%s'",
                 parsed.where.c_str());
      FUZZ_CHECK(static_cast<bool>(parsed.command->run));
      // Exactly one subcommand was selected.
      const auto selected = std::count_if(line.commands.begin(), line.commands.end(),
                                          [](const cli::Command& c) { return c.app->parsed(); });
      FUZZ_CHECK(selected == 1, "%d subcommands selected", static_cast<int>(selected));
      // Every accepted floating-point value is finite (a NaN passes CLI11's Range check).
      for (const CLI::Option* opt : parsed.command->app->get_options()) {
        if (opt->count() == 0 || opt->get_type_name().rfind("FLOAT", 0) != 0) continue;
        double value = 0;
        FUZZ_CHECK(CLI::detail::lexical_cast(opt->results().back(), value) && std::isfinite(value),
                   "%s accepted '%s'", opt->get_name().c_str(), opt->results().back().c_str());
      }
    }
  } catch (const cli::CommandLineError& e) {
    FUZZ_CHECK(e.code() == ErrorCode::kInvalidArgument, "code %s", error_code_name(e.code()));
    FUZZ_CHECK(!e.message().empty(), "an error without a message");
    FUZZ_CHECK(e.where().rfind("m3msa", 0) == 0, "where '%s'", e.where().c_str());
    FUZZ_CHECK(!e.hint().empty());
    FUZZ_CHECK(fuzz::names_culprit(e.message(), line, args),
               "the message names no flag, argument or subcommand: '%s'", e.message().c_str());
  }
  return 0;
}
