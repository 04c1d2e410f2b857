#include "common.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "m3msa/dtype.h"
#include "m3msa/error.h"
#include "m3msa/version.h"

namespace m3msa::cli {

const char* version_string() {
  return M3MSA_VERSION_STRING;
}

namespace {
std::string& command_line_storage() {
  static std::string line;
  return line;
}
}  // namespace

void set_command_line(int argc, char** argv) {
  std::string& line = command_line_storage();
  line = "m3msa";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool plain = !arg.empty() && arg.find_first_of(" \t\"'$`\\") == std::string::npos;
    line += " " + (plain ? arg : "'" + arg + "'");
  }
}

const std::string& command_line() {
  return command_line_storage();
}

std::string error_text(const std::exception& e) {
  const std::string text = e.what();
  const std::string prefix = "m3msa: ";
  return text.rfind(prefix, 0) == 0 ? text.substr(prefix.size()) : text;
}

HostTensor clone(const HostTensor& tensor) {
  if (tensor.empty() && tensor.shape().empty()) return {};
  HostTensor copy(tensor.dtype(), tensor.shape());
  if (tensor.nbytes()) std::memcpy(copy.data(), tensor.data(), tensor.nbytes());
  return copy;
}

bool stderr_is_tty() {
  return isatty(fileno(stderr)) != 0;
}

}  // namespace m3msa::cli
