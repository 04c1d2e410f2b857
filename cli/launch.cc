// m3msa launch -n N -- CMD [ARGS...]: starts N copies of CMD, one per rank, with the environment
// of the NCCL bootstrap (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; NCCL_NVLS_ENABLE=0
// unless already set), waits for all of them and exits with the first non-zero status. When one
// rank fails, the others get `--grace` seconds to notice (their bounded waits report the missing
// rank), then SIGTERM, then (5 s later) SIGKILL, so a dead rank never leaves the launch hanging.
// `--timeout S` bounds the whole launch the same way (exit status 124 when it fired first), and
// `--log-dir DIR` sends each rank's stdout and stderr to DIR/rank<r>.log instead of the terminal.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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
  double timeout_s = 0.0;  // 0: none
  std::string log_dir;
  std::vector<std::string> command;
};

constexpr int kExitTimedOut = 124;  // as timeout(1)

int run_launch(const LaunchOptions& opt) {
  if (opt.command.empty()) throw UsageError("launch: a command after -- is required");
  if (opt.ranks < 1) throw UsageError("launch: -n must be >= 1");
  // Bounded so the conversion to clock ticks cannot overflow (a week is far beyond any run).
  constexpr double kMaxSeconds = 7.0 * 24 * 3600;
  if (!(opt.grace_s >= 0 && opt.grace_s <= kMaxSeconds)) {
    throw UsageError("launch: --grace must be in [0, 604800] seconds, got " +
                     std::to_string(opt.grace_s));
  }
  if (!(opt.timeout_s >= 0 && opt.timeout_s <= kMaxSeconds)) {
    throw UsageError("launch: --timeout must be in [0, 604800] seconds, got " +
                     std::to_string(opt.timeout_s));
  }
  if (!opt.log_dir.empty()) ::mkdir(opt.log_dir.c_str(), 0755);  // may exist already
  using Clock = std::chrono::steady_clock;
  const Clock::time_point start = Clock::now();
  std::vector<pid_t> pids;
  for (int r = 0; r < opt.ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("m3msa launch: fork");
      for (pid_t p : pids) ::kill(p, SIGKILL);
      return kExitError;
    }
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(opt.ranks).c_str(), 1);
      ::setenv("MASTER_ADDR", opt.master_addr.c_str(), 1);
      ::setenv("MASTER_PORT", std::to_string(opt.master_port).c_str(), 1);
      ::setenv("NCCL_NVLS_ENABLE", "0", 0);  // NVLink multicast stays off on shared hosts
      if (!opt.log_dir.empty()) {
        const std::string path = opt.log_dir + "/rank" + std::to_string(r) + ".log";
        const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0) {
          std::perror(("m3msa launch: " + path).c_str());
          std::_Exit(127);
        }
        ::dup2(fd, STDOUT_FILENO);
        ::dup2(fd, STDERR_FILENO);
        ::close(fd);
      }
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
  auto seconds = [](double s) { return std::chrono::milliseconds(static_cast<int64_t>(s * 1000)); };
  int first_failure = 0;
  int alive = opt.ranks;
  // Stop sequence: at `stop_at` SIGTERM to every live rank, 5 s later SIGKILL.
  Clock::time_point stop_at =
      opt.timeout_s > 0 ? start + seconds(opt.timeout_s) : Clock::time_point::max();
  Clock::time_point kill_at = Clock::time_point::max();
  bool timed_out = false;
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
      const double at = std::chrono::duration<double>(Clock::now() - start).count();
      if (code != 0) {
        std::fprintf(stderr, "m3msa launch: rank %d exited with status %d after %.1f s\n", rank,
                     code, at);
        if (first_failure == 0) {
          first_failure = code;
          stop_at = std::min(stop_at, Clock::now() + seconds(opt.grace_s));
        }
      } else if (first_failure != 0) {
        std::fprintf(stderr, "m3msa launch: rank %d exited cleanly after %.1f s\n", rank, at);
      }
      continue;
    }
    const Clock::time_point now = Clock::now();
    if (now > stop_at) {
      if (first_failure == 0) timed_out = true;
      for (int r = 0; r < opt.ranks; ++r) {
        const pid_t pid = pids[static_cast<size_t>(r)];
        if (pid <= 0) continue;
        std::fprintf(stderr, "m3msa launch: rank %d still running: SIGTERM\n", r);
        ::kill(pid, SIGTERM);
      }
      stop_at = Clock::time_point::max();
      kill_at = now + std::chrono::seconds(5);
    }
    if (now > kill_at) {
      for (int r = 0; r < opt.ranks; ++r) {
        const pid_t pid = pids[static_cast<size_t>(r)];
        if (pid <= 0) continue;
        std::fprintf(stderr, "m3msa launch: rank %d ignored SIGTERM: SIGKILL\n", r);
        ::kill(pid, SIGKILL);
      }
      kill_at = Clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (timed_out) {
    std::fprintf(stderr, "m3msa launch: --timeout %.1f s expired\n", opt.timeout_s);
    return kExitTimedOut;
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
  app->add_option("--timeout", opt->timeout_s,
                  "seconds after which every rank still running gets SIGTERM (0: none); exit 124");
  app->add_option("--log-dir", opt->log_dir,
                  "write each rank's stdout and stderr to DIR/rank<r>.log");
  app->add_option("command", opt->command, "the command and its arguments (after --)")->required();
  app->footer(
      "Exit code: the first non-zero status of a rank (128 + signal for a rank killed by one), "
      "124 when --timeout expired first, else 0.");
  return {app, [opt]() { return run_launch(*opt); }};
}

}  // namespace m3msa::cli
