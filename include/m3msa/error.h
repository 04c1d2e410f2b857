// One error type for the whole library. Every failure carries a code, a message that names the
// argument and the offending value, the throw site (file:line) and, in multi-rank code, the rank.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace m3msa {

enum class ErrorCode {
  kInvalidArgument,  // the caller passed something the contract forbids
  kUnsupported,      // valid in general, not implemented by this backend / configuration
  kTimeout,          // a bounded wait expired (a peer rank never arrived)
  kInternal,         // a bug or a failed CUDA / NCCL call
};

const char* error_code_name(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message, const char* file = nullptr, int line = 0,
        int rank = -1);

  ErrorCode code() const noexcept { return code_; }
  // The message without the "[code] file:line" decoration.
  const std::string& message() const noexcept { return message_; }
  int rank() const noexcept { return rank_; }
  // A copy of this error attributed to `rank` (multi-rank code rethrows with this).
  Error with_rank(int rank) const;

 private:
  ErrorCode code_;
  std::string message_;
  std::string file_;
  int line_;
  int rank_;
};

namespace detail {
// Builds a message from any streamable pieces: M3MSA_CHECK_ARG(x > 0, "k must be > 0, got ", x).
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

}  // namespace m3msa

#define M3MSA_THROW(code, ...) \
  throw ::m3msa::Error((code), ::m3msa::detail::concat(__VA_ARGS__), __FILE__, __LINE__)

#define M3MSA_CHECK(cond, code, ...)    \
  do {                                  \
    if (!(cond)) {                      \
      M3MSA_THROW((code), __VA_ARGS__); \
    }                                   \
  } while (0)

#define M3MSA_CHECK_ARG(cond, ...) \
  M3MSA_CHECK(cond, ::m3msa::ErrorCode::kInvalidArgument, __VA_ARGS__)
#define M3MSA_CHECK_SUPPORTED(cond, ...) \
  M3MSA_CHECK(cond, ::m3msa::ErrorCode::kUnsupported, __VA_ARGS__)
#define M3MSA_CHECK_INTERNAL(cond, ...)                                                  \
  M3MSA_CHECK(cond, ::m3msa::ErrorCode::kInternal, "internal check failed: " #cond ": ", \
              __VA_ARGS__)
