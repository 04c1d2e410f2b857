// m3msa: the command-line tool (demo, info, replay, bench).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "commands.h"
#include "common.h"
#include "m3msa/error.h"

int main(int argc, char** argv) {
  using namespace m3msa::cli;
  CLI::App app{
      "m3msa: MiniMax-M3 sparse attention (MSA) decode. The lightning indexer's block scoring, "
      "exact "
      "top-k block selection and block-sparse GQA attention, on the CPU reference (and CUDA when "
      "built with it).",
      "m3msa"};
  app.option_defaults()->always_capture_default();
  app.set_version_flag("--version", std::string("m3msa ") + version_string());
  app.require_subcommand(1);
  app.footer(
      "Run `m3msa SUBCOMMAND --help` for the flags of a subcommand.\n"
      "Exit codes: 0 ok, 1 a correctness check failed, 2 bad flags or values, 3 an error from "
      "the library (the message names the argument).\n"
      "Environment: none is read.");

  set_command_line(argc, argv);
  std::vector<Command> commands;
  commands.push_back(add_demo_command(app));
  commands.push_back(add_info_command(app));
  commands.push_back(add_replay_command(app));
  commands.push_back(add_bench_command(app));
  commands.push_back(add_launch_command(app));

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string where = "m3msa";
    bool any_parsed = false;
    for (const Command& c : commands) {
      if (c.app->parsed()) {
        where += " " + c.app->get_name();
        any_parsed = true;
      }
    }
    if (!any_parsed && argc > 1 && argv[1][0] != '-') {
      std::fprintf(stderr,
                   "m3msa: error: unknown subcommand '%s' (expected demo, info, replay or "
                   "bench)\nRun `m3msa --help` for the subcommands.\n",
                   argv[1]);
      return kExitUsage;
    }
    std::fprintf(stderr, "%s: error: %s\nRun `%s --help` for the flags and their defaults.\n",
                 where.c_str(), e.what(), where.c_str());
    return kExitUsage;
  }

  for (const Command& c : commands) {
    if (!c.app->parsed()) continue;
    const std::string where = "m3msa " + c.app->get_name();
    try {
      return c.run();
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
  std::fprintf(stderr, "m3msa: error: no subcommand (run `m3msa --help`)\n");
  return kExitUsage;
}
