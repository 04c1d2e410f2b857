// A progress indicator on stderr for runs longer than a few seconds. Nothing is shown before
// `delay` has passed, so short runs stay quiet. On a terminal one line is rewritten in place;
// otherwise (a log file, a pipe) plain lines are written, at most one per `line_interval`.
#pragma once

#include <chrono>
#include <string>

namespace m3msa::cli {

class Progress {
 public:
  explicit Progress(bool enabled, std::chrono::milliseconds delay = std::chrono::seconds(2),
                    std::chrono::milliseconds line_interval = std::chrono::seconds(5));
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // "step 3/8 layer 2/4": shown if the run is old enough (and rate-limited).
  void update(const std::string& text);
  // Clears the in-place line (call before printing results to the terminal).
  void finish();

 private:
  bool enabled_;
  bool tty_;
  bool line_shown_ = false;
  std::chrono::milliseconds delay_;
  std::chrono::milliseconds line_interval_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace m3msa::cli
