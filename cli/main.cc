// m3msa: the command-line tool (demo, info, replay, bench, launch, soak). The subcommands and the
// parse step live in args.cc (fuzzed by fuzz/fuzz_cli_args.cc); main() prints and runs.
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>

#include "args.h"
#include "commands.h"
#include "common.h"
#include "m3msa/error.h"

int main(int argc, char** argv) {
  using namespace m3msa::cli;
  set_command_line(argc, argv);
  CommandLine line;
  ParsedCommandLine parsed;
  try {
    parsed = parse_command_line(line, argc, argv);
  } catch (const CommandLineError& e) {
    std::fprintf(stderr, "%s: error: %s\n%s\n", e.where().c_str(), e.message().c_str(),
                 e.hint().c_str());
    return kExitUsage;
  }
  if (parsed.print) return parsed.print(std::cout, std::cerr);

  const std::string& where = parsed.where;
  try {
    return parsed.command->run();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "%s: error: %s\n", where.c_str(), e.what());
    return kExitUsage;
  } catch (const m3msa::Error& e) {
    std::fprintf(stderr, "%s: error: %s\n", where.c_str(), error_text(e).c_str());
    return kExitError;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: %s\n", where.c_str(), e.what());
    return kExitError;
  }
}
