#include "progress.h"

#include <cstdio>

#include "common.h"

namespace m3msa::cli {

using Clock = std::chrono::steady_clock;

Progress::Progress(bool enabled, std::chrono::milliseconds delay,
                   std::chrono::milliseconds line_interval)
    : enabled_(enabled),
      tty_(stderr_is_tty()),
      delay_(delay),
      line_interval_(line_interval),
      start_(Clock::now()),
      last_(Clock::time_point::min()) {}

Progress::~Progress() {
  finish();
}

void Progress::update(const std::string& text) {
  if (!enabled_) return;
  const auto now = Clock::now();
  if (now - start_ < delay_) return;
  const auto interval = tty_ ? std::chrono::milliseconds(100) : line_interval_;
  if (last_ != Clock::time_point::min() && now - last_ < interval) return;
  last_ = now;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  if (tty_) {
    std::fprintf(stderr, "\r\033[K%s (%.0f s)", text.c_str(), elapsed);
    line_shown_ = true;
  } else {
    std::fprintf(stderr, "%s (%.0f s)\n", text.c_str(), elapsed);
  }
  std::fflush(stderr);
}

void Progress::finish() {
  if (line_shown_) {
    std::fprintf(stderr, "\r\033[K");
    std::fflush(stderr);
    line_shown_ = false;
  }
}

}  // namespace m3msa::cli
