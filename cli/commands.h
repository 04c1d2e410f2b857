// The subcommands of m3msa. Each adds itself to the top-level app and returns the function that
// runs it once the command line has been parsed.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <stdexcept>
#include <string>

namespace m3msa::cli {

struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;  // returns the exit code (common.h)
};

Command add_demo_command(CLI::App& parent);
Command add_info_command(CLI::App& parent);
Command add_replay_command(CLI::App& parent);
Command add_bench_command(CLI::App& parent);
Command add_launch_command(CLI::App& parent);
Command add_soak_command(CLI::App& parent);

// A bad flag value found after parsing (a combination CLI11 cannot see): exit code kExitUsage.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace m3msa::cli
