// Small helpers shared by the m3msa subcommands.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>

#include "m3msa/tensor.h"
#include "m3msa/testing/random.h"

namespace m3msa::cli {

// Exit codes of every subcommand (documented in `m3msa --help`).
inline constexpr int kExitOk = 0;
inline constexpr int kExitCheckFailed = 1;  // a correctness check failed
inline constexpr int kExitUsage = 2;        // bad flags or values
inline constexpr int kExitError = 3;        // the library reported an error (m3msa::Error)

const char* version_string();  // M3MSA_VERSION_STRING of m3msa/version.h

// The command line as typed (main() records it; saved cases and JSON reports carry it).
void set_command_line(int argc, char** argv);
const std::string& command_line();

// An m3msa::Error's text without the leading "m3msa: " (the CLI prefixes its own).
std::string error_text(const std::exception& e);

// Seeds and fills: the test kit's (m3msa/testing/random.h), so the CLI draws the same streams.
using testkit::derive_seed;
using testkit::fill_bf16;

// A deep copy (HostTensor copies share storage).
HostTensor clone(const HostTensor& tensor);

// Monotonic seconds since `start`.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

bool stderr_is_tty();

}  // namespace m3msa::cli
