#include "m3msa/error.h"

namespace m3msa {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kUnsupported: return "unsupported";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kInternal: return "internal";
  }
  return "unknown";
}

namespace {
std::string decorate(ErrorCode code, const std::string& message, const char* file, int line,
                     int rank) {
  std::string out = "m3msa: ";
  if (rank >= 0) out += "rank " + std::to_string(rank) + ": ";
  out += error_code_name(code);
  out += ": ";
  out += message;
  if (file != nullptr) {
    std::string path(file);
    auto slash = path.find_last_of('/');
    out += " (" + (slash == std::string::npos ? path : path.substr(slash + 1)) + ":" +
           std::to_string(line) + ")";
  }
  return out;
}
}  // namespace

Error::Error(ErrorCode code, const std::string& message, const char* file, int line, int rank)
    : std::runtime_error(decorate(code, message, file, line, rank)),
      code_(code),
      message_(message),
      file_(file ? file : ""),
      line_(line),
      rank_(rank) {}

Error Error::with_rank(int rank) const {
  return Error(code_, message_, file_.empty() ? nullptr : file_.c_str(), line_, rank);
}

}  // namespace m3msa
