// Shared pieces of the libFuzzer targets: hostile value pickers on top of FuzzedDataProvider, the
// "accept or throw m3msa::Error" contract every validator must keep, and an invariant check that
// aborts (libFuzzer then records a crash with the input that broke it).
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "m3msa/dtype.h"
#include "m3msa/error.h"

// An invariant of an accepted input does not hold: report it and abort (a libFuzzer crash).
#define FUZZ_CHECK(cond, ...)                                                           \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, "" __VA_ARGS__);                                             \
      std::fprintf(stderr, "\n");                                                       \
      std::abort();                                                                     \
    }                                                                                   \
  } while (0)

namespace m3msa::fuzz {

// Runs a validator. Returns true when it accepts, false when it throws m3msa::Error with a
// caller-facing code and a message; anything else (another exception type, an internal error, an
// empty message) is a bug and aborts. Crashes and UB inside are caught by ASan / UBSan.
template <typename F>
bool accepts(F&& validator) {
  try {
    validator();
    return true;
  } catch (const Error& error) {
    FUZZ_CHECK(
        error.code() == ErrorCode::kInvalidArgument || error.code() == ErrorCode::kUnsupported,
        "unexpected error code %s: %s", error_code_name(error.code()), error.what());
    FUZZ_CHECK(!error.message().empty(), "an error without a message");
    return false;
  }
}

// An int that is small most of the time and an edge value some of the time.
inline int hostile_int(FuzzedDataProvider& in, int small_max = 64) {
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: return in.ConsumeIntegral<int>();
    case 1:
      return in.PickValueInArray<int>(
          {0, -1, 1, std::numeric_limits<int>::max(), std::numeric_limits<int>::min(),
           std::numeric_limits<int>::max() - 1, 1 << 24, (1 << 24) - 1, 1 << 30, -(1 << 30)});
    default: return in.ConsumeIntegralInRange<int>(-2, small_max);
  }
}

inline int64_t hostile_i64(FuzzedDataProvider& in, int64_t small_max = 64) {
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0: return in.ConsumeIntegral<int64_t>();
    case 1:
      return in.PickValueInArray<int64_t>(
          {0, -1, 1, std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min(),
           int64_t{1} << 31, (int64_t{1} << 31) - 1, int64_t{1} << 32, int64_t{1} << 40,
           int64_t{1} << 62, -(int64_t{1} << 62)});
    default: return in.ConsumeIntegralInRange<int64_t>(-2, small_max);
  }
}

// Any bit pattern: NaNs (quiet and signalling), infinities, subnormals, -0.0 and ordinary values.
inline float hostile_float(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: return bits_float(in.ConsumeIntegral<uint32_t>());
    case 1:
      return in.PickValueInArray<float>(
          {0.0f, -0.0f, 1.0f, -1.0f, 1e-6f, 448.0f, 1e30f, std::numeric_limits<float>::infinity(),
           -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
           std::numeric_limits<float>::denorm_min()});
    default: return static_cast<float>(in.ConsumeIntegralInRange<int>(-8, 8)) * 0.25f;
  }
}

inline double hostile_double(FuzzedDataProvider& in) {
  if (in.ConsumeBool()) {
    const uint64_t bits = in.ConsumeIntegral<uint64_t>();
    double value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }
  return in.PickValueInArray<double>({5e6, 1e4, 1.0, 0.0, -1.0,
                                      std::numeric_limits<double>::infinity(),
                                      std::numeric_limits<double>::quiet_NaN(), 1e-300});
}

}  // namespace m3msa::fuzz
