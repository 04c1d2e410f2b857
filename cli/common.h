// Small helpers shared by the m3msa subcommands.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <string>

#include "core/splitmix.h"
#include "m3msa/tensor.h"

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

// splitmix64: seedable, tiny, deterministic on every platform.
struct Rng : SplitMix64 {
  using SplitMix64::SplitMix64;
  float unit() { return unit_variance(); }
};

// A seed for stream `a`, `b` of `seed` (distinct streams never share a sequence).
uint64_t derive_seed(uint64_t seed, uint64_t a, uint64_t b = 0);

// Fills a bf16 tensor with unit-variance values times `scale`.
void fill_bf16(HostTensor& tensor, uint64_t seed, float scale = 1.0f);

// A deep copy (HostTensor copies share storage).
HostTensor clone(const HostTensor& tensor);

// Monotonic seconds since `start`.
inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

bool stderr_is_tty();

}  // namespace m3msa::cli
