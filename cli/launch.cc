// m3msa launch -n N -- CMD [ARGS...]: starts N copies of CMD, one per rank, with the environment
// of the NCCL bootstrap (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; NCCL_NVLS_ENABLE=0
// unless already set), waits for all of them and exits with the first non-zero status. When one
// rank fails, the others get `--grace` seconds to notice (their bounded waits report the missing
// rank), then SIGTERM, so a dead rank never leaves the launch hanging.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "commands.h"
#include "common.h"

namespace m3msa::cli {

namespace {

struct LaunchOptions {
  int ranks = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29511;
  double grace_s = 10.0;
  std::vector<std::string> command;
};

int run_launch(const LaunchOptions& opt) {
  if (opt.command.empty()) throw UsageError("launch: a command after -- is required");
  if (opt.ranks < 1) throw UsageError("launch: -n must be >= 1");
  std::vector<pid_t> pids;
  for (int r = 0; r < opt.ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("m3msa launch: fork");
      return kExitError;
    }
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(opt.ranks).c_str(), 1);
      ::setenv("MASTER_ADDR", opt.master_addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(opt.master_port).c_str(), 1);
      ::setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast stays off on shared hosts
      std::vector<char*> argv;
      std::vector<std::string> args = opt.command;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execvp(argv[0], argv.data());
      std::perror("m3msa launch: exec");
      std::_Exit(127);
    }
    pids.push_back(pid);
  }
  int first_failure = 0;
  int alive = opt.ranks;
  auto deadline = std::chrono::steady_clock::time_point::max();
  while (alive > 0) {
    int status = 0;
    const pid_t done = ::waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      --alive;
      int rank = 0;
      for (int r = 0; r < opt.ranks; ++r) {
        if (pids[static_cast<size_t>(r)] == done) rank = r;
      }
      pids[static_cast<size_t>(rank)] = -1;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0) {
        std::fprintf(stderr, "m3msa launch: rank %d exited with status %d\n", rank, code);
        if (first_failure == 0) {
          first_failure = code;
          deadline = std::chrono::steady_clock::now() +
                     std::chrono::milliseconds(static_cast<int64_t>(opt.grace_s * 1000));
        }
      }
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      for (pid_t pid : pids) {
        if (pid > 0) ::kill(pid, SIGTERM);
      }
      deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return first_failure;
}

}  // namespace

Command add_launch_command(CLI::App& parent) {
  auto opt = std::make_shared<LaunchOptions>();
  CLI::App* app = parent.add_subcommand(
      "launch", "Start N ranks of a command with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set");
  app->add_option("-n,--ranks", opt->ranks, "number of ranks (processes)")->required();
  app->add_option("--master-addr", opt->master_addr, "MASTER_ADDR given to every rank");
  app->add_option("--master-port", opt->master_port, "MASTER_PORT given to every rank");
  app->add_option("--grace", opt->grace_s,
                  "seconds the other ranks get after one fails before SIGTERM");
  app->add_option("command", opt->command, "the command and its arguments (after --)")->required();
  app->footer("Exit code: the first non-zero status of a rank, else 0.");
  return {app, [opt]() { return run_launch(*opt); }};
}

}  // namespace m3msa::cli
