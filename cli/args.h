// The m3msa command line as functions: one CLI::App with every subcommand registered, and a
// parse step that runs nothing. main() uses both; fuzz/fuzz_cli_args.cc feeds them arbitrary
// argument vectors, so everything a user can type is checked here before any work starts.
//
// Contract of parse_command_line: it returns (a subcommand to run, or help / version text to
// print) or throws CommandLineError, an m3msa::Error with code kInvalidArgument whose message
// names the flag, argument or subcommand that is wrong. It never runs a subcommand, never reads
// or writes a file and never throws anything else.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "m3msa/error.h"

namespace m3msa::cli {

// The top-level app with every subcommand (demo, info, replay, bench, launch, soak). Build a
// fresh one per parse: CLI::App keeps the state of the last parse.
struct CommandLine {
  CommandLine();
  CommandLine(const CommandLine&) = delete;
  CommandLine& operator=(const CommandLine&) = delete;

  std::unique_ptr<CLI::App> app;
  std::vector<Command> commands;  // in registration order
};

// A bad command line: m3msa::Error(kInvalidArgument) with where the error was found ("m3msa" or
// "m3msa demo") and what the user can do next. message() is CLI11's text (it names the flag),
// or for an unknown subcommand, names it.
class CommandLineError : public Error {
 public:
  CommandLineError(std::string where, const std::string& message, std::string hint);
  const std::string& where() const { return where_; }
  const std::string& hint() const { return hint_; }  // "Run `m3msa demo --help` for ..."

 private:
  std::string where_;
  std::string hint_;
};

struct ParsedCommandLine {
  // The subcommand to run (null when help or the version was asked for).
  const Command* command = nullptr;
  std::string where;  // "m3msa demo"
  // Help / version: prints the text to `out` (errors to `err`) and returns the exit code.
  std::function<int(std::ostream& out, std::ostream& err)> print;
};

// Parses argv[1..argc) into `line` (argv[0] is ignored). See the header comment.
ParsedCommandLine parse_command_line(CommandLine& line, int argc, const char* const* argv);

}  // namespace m3msa::cli
