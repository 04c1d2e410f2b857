#include "m3msa/npy.h"

#include <bit>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>

#include "m3msa/error.h"

static_assert(std::endian::native == std::endian::little,
              "npy I/O assumes a little-endian host (the data is copied as is)");

namespace m3msa {

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr std::size_t kMagicLen = 6;
constexpr std::size_t kMaxHeaderLen = 1 << 20;  // far above anything numpy writes

#define NPY_FAIL(path, ...) M3MSA_THROW(ErrorCode::kInvalidArgument, path, ": ", __VA_ARGS__)
#define NPY_CHECK(cond, path, ...) \
  do {                             \
    if (!(cond)) {                 \
      NPY_FAIL(path, __VA_ARGS__); \
    }                              \
  } while (0)

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

File open_file(const std::string& path, const char* mode) {
  File file(std::fopen(path.c_str(), mode));
  if (!file) {
    M3MSA_THROW(ErrorCode::kInvalidArgument, path, ": cannot open for ",
                mode[0] == 'r' ? "reading" : "writing", " (", std::strerror(errno), ")");
  }
  return file;
}

std::size_t file_size(std::FILE* file, const std::string& path) {
  NPY_CHECK(std::fseek(file, 0, SEEK_END) == 0, path, "cannot seek");
  const long size = std::ftell(file);
  NPY_CHECK(size >= 0, path, "cannot tell the file size");
  NPY_CHECK(std::fseek(file, 0, SEEK_SET) == 0, path, "cannot seek");
  return static_cast<std::size_t>(size);
}

// Normalizes a descriptor; empty when unsupported.
std::string normalize_descr(const std::string& descr) {
  if (descr == "<f4" || descr == "<u2" || descr == "<i4" || descr == "<i8" || descr == "<u8") {
    return descr;
  }
  if (descr == "|u1" || descr == "<u1" || descr == "u1" || descr == "=u1") return "|u1";
  return {};
}

std::size_t descr_item_size(const std::string& descr) {
  if (descr == "|u1") return 1;
  if (descr == "<u2") return 2;
  if (descr == "<f4" || descr == "<i4") return 4;
  return 8;  // <i8, <u8
}

int64_t checked_numel(const std::vector<int64_t>& shape, const std::string& path) {
  int64_t n = 1;
  for (int64_t extent : shape) {
    NPY_CHECK(extent >= 0, path, "negative extent ", extent, " in shape ", shape_string(shape));
    if (extent != 0 && n > std::numeric_limits<int64_t>::max() / extent) {
      NPY_FAIL(path, "shape ", shape_string(shape), " overflows");
    }
    n *= extent;
  }
  return n;
}

// A tiny parser for the Python dict literal of the header, e.g.
// {'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }
class HeaderParser {
 public:
  HeaderParser(const std::string& text, const std::string& path) : text_(text), path_(path) {}

  void parse(NpyHeader& header) {
    bool have_descr = false, have_order = false, have_shape = false;
    expect('{');
    skip_space();
    while (peek() != '}') {
      const std::string key = parse_string();
      expect(':');
      if (key == "descr") {
        const std::string descr = parse_string();
        NPY_CHECK(!descr.empty() && descr[0] != '>', path_, "big-endian data ('", descr,
                  "') is not supported");
        header.descr = normalize_descr(descr);
        NPY_CHECK(!header.descr.empty(), path_, "unsupported dtype '", descr,
                  "' (supported: <f4 <u2 u1 <i4 <i8 <u8)");
        have_descr = true;
      } else if (key == "fortran_order") {
        const std::string word = parse_word();
        NPY_CHECK(word == "True" || word == "False", path_,
                  "fortran_order must be True or False, got '", word, "'");
        NPY_CHECK(word == "False", path_,
                  "fortran_order True (column-major) is not supported: save a C-order array");
        have_order = true;
      } else if (key == "shape") {
        header.shape = parse_shape();
        have_shape = true;
      } else {
        NPY_FAIL(path_, "unexpected header key '", key, "'");
      }
      skip_space();
      if (peek() == ',') {
        ++pos_;
        skip_space();
      } else {
        NPY_CHECK(peek() == '}', path_, "malformed header: expected ',' or '}' at offset ", pos_,
                  " of '", text_, "'");
      }
    }
    ++pos_;
    for (; pos_ < text_.size(); ++pos_) {
      NPY_CHECK(std::isspace(static_cast<unsigned char>(text_[pos_])), path_,
                "malformed header: trailing characters after '}'");
    }
    NPY_CHECK(have_descr && have_order && have_shape, path_,
              "malformed header: it must have the keys descr, fortran_order and shape, got '",
              text_, "'");
  }

 private:
  char peek() {
    NPY_CHECK(pos_ < text_.size(), path_, "malformed header: it ends early: '", text_, "'");
    return text_[pos_];
  }
  void skip_space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  void expect(char c) {
    skip_space();
    NPY_CHECK(peek() == c, path_, "malformed header: expected '", c, "' at offset ", pos_, " of '",
              text_, "'");
    ++pos_;
  }
  std::string parse_string() {
    skip_space();
    const char quote = peek();
    NPY_CHECK(quote == '\'' || quote == '"', path_,
              "malformed header: expected a string at offset ", pos_, " of '", text_, "'");
    const std::size_t end = text_.find(quote, pos_ + 1);
    NPY_CHECK(end != std::string::npos, path_, "malformed header: unterminated string");
    std::string out = text_.substr(pos_ + 1, end - pos_ - 1);
    pos_ = end + 1;
    return out;
  }
  std::string parse_word() {
    skip_space();
    const std::size_t start = pos_;
    while (pos_ < text_.size() && std::isalpha(static_cast<unsigned char>(text_[pos_]))) ++pos_;
    return text_.substr(start, pos_ - start);
  }
  std::vector<int64_t> parse_shape() {
    expect('(');
    std::vector<int64_t> shape;
    skip_space();
    while (peek() != ')') {
      NPY_CHECK(std::isdigit(static_cast<unsigned char>(peek())), path_,
                "malformed shape: expected a non-negative integer at offset ", pos_, " of '", text_,
                "'");
      int64_t value = 0;
      while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
        NPY_CHECK(value <= (std::numeric_limits<int64_t>::max() - 9) / 10, path_,
                  "malformed shape: extent too large");
        value = value * 10 + (text_[pos_++] - '0');
      }
      // Python 2 long suffix, still accepted by numpy.
      if (pos_ < text_.size() && text_[pos_] == 'L') ++pos_;
      shape.push_back(value);
      skip_space();
      if (peek() == ',') {
        ++pos_;
        skip_space();
      } else {
        NPY_CHECK(peek() == ')', path_, "malformed shape: expected ',' or ')' at offset ", pos_,
                  " of '", text_, "'");
      }
    }
    ++pos_;
    NPY_CHECK(shape.size() <= 32, path_, "shape has ", shape.size(), " dimensions");
    return shape;
  }

  const std::string& text_;
  const std::string& path_;
  std::size_t pos_ = 0;
};

// Reads and checks the header; leaves the file positioned at the data.
NpyHeader parse_header(std::FILE* file, const std::string& path, std::size_t size) {
  unsigned char prefix[12];
  NPY_CHECK(size >= 10 && std::fread(prefix, 1, 10, file) == 10, path,
            "not a .npy file (shorter than the 10-byte preamble)");
  NPY_CHECK(std::memcmp(prefix, kMagic, kMagicLen) == 0, path,
            "not a .npy file (bad magic; expected \\x93NUMPY)");
  NpyHeader header;
  header.version_major = prefix[6];
  std::size_t header_len = 0;
  std::size_t preamble = 10;
  if (prefix[6] == 1) {
    header_len = prefix[8] | (static_cast<std::size_t>(prefix[9]) << 8);
  } else if (prefix[6] == 2) {
    NPY_CHECK(size >= 12 && std::fread(prefix + 10, 1, 2, file) == 2, path,
              "truncated .npy preamble");
    header_len = prefix[8] | (static_cast<std::size_t>(prefix[9]) << 8) |
                 (static_cast<std::size_t>(prefix[10]) << 16) |
                 (static_cast<std::size_t>(prefix[11]) << 24);
    preamble = 12;
  } else {
    NPY_FAIL(path, "unsupported .npy format version ", int{prefix[6]}, ".", int{prefix[7]},
             " (supported: 1.0 and 2.0)");
  }
  NPY_CHECK(header_len <= kMaxHeaderLen, path, "header length ", header_len, " is implausible");
  NPY_CHECK(preamble + header_len <= size, path, "truncated header: it announces ", header_len,
            " bytes, the file has ", size - preamble, " after the preamble");
  std::string text(header_len, '\0');
  NPY_CHECK(std::fread(text.data(), 1, header_len, file) == header_len, path,
            "cannot read the header");
  HeaderParser(text, path).parse(header);
  header.data_offset = preamble + header_len;

  const int64_t numel = checked_numel(header.shape, path);
  const std::size_t item = descr_item_size(header.descr);
  NPY_CHECK(static_cast<uint64_t>(numel) <= std::numeric_limits<std::size_t>::max() / item, path,
            "shape ", shape_string(header.shape), " is too large");
  const std::size_t expected = static_cast<std::size_t>(numel) * item;
  const std::size_t found = size - header.data_offset;
  NPY_CHECK(found >= expected, path, "truncated data: shape ", shape_string(header.shape), " of ",
            header.descr, " needs ", expected, " bytes, the file has ", found);
  NPY_CHECK(found == expected, path, found - expected, " bytes of trailing data after the ",
            expected, " bytes that shape ", shape_string(header.shape), " of ", header.descr,
            " needs");
  return header;
}

void read_data(std::FILE* file, const std::string& path, void* dst, std::size_t nbytes) {
  if (nbytes == 0) return;
  NPY_CHECK(std::fread(dst, 1, nbytes, file) == nbytes, path, "cannot read ", nbytes,
            " bytes of data");
}

}  // namespace

std::size_t NpyHeader::item_size() const {
  return descr_item_size(descr);
}

int64_t NpyHeader::numel() const {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

int64_t NpyArray::numel() const {
  int64_t n = 1;
  for (int64_t extent : shape) n *= extent;
  return n;
}

NpyHeader read_npy_header(const std::string& path) {
  File file = open_file(path, "rb");
  return parse_header(file.get(), path, file_size(file.get(), path));
}

NpyArray read_npy(const std::string& path) {
  File file = open_file(path, "rb");
  const NpyHeader header = parse_header(file.get(), path, file_size(file.get(), path));
  NpyArray array;
  array.descr = header.descr;
  array.shape = header.shape;
  array.data.resize(static_cast<std::size_t>(header.numel()) * header.item_size());
  read_data(file.get(), path, array.data.data(), array.data.size());
  return array;
}

void write_npy(const std::string& path, const std::string& descr, const std::vector<int64_t>& shape,
               const void* data, std::size_t nbytes) {
  const std::string normalized = normalize_descr(descr);
  M3MSA_CHECK_ARG(!normalized.empty(), path, ": write_npy: unsupported dtype '", descr,
                  "' (supported: <f4 <u2 u1 <i4 <i8 <u8)");
  const int64_t numel = checked_numel(shape, path);
  M3MSA_CHECK_ARG(static_cast<std::size_t>(numel) * descr_item_size(normalized) == nbytes, path,
                  ": write_npy: shape ", shape_string(shape), " of ", normalized, " needs ",
                  static_cast<std::size_t>(numel) * descr_item_size(normalized), " bytes, got ",
                  nbytes);
  M3MSA_CHECK_ARG(data != nullptr || nbytes == 0, path, ": write_npy: null data");

  std::string dict = "{'descr': '" + normalized + "', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    dict += std::to_string(shape[i]);
    if (i + 1 < shape.size() || shape.size() == 1) dict += ",";
    if (i + 1 < shape.size()) dict += " ";
  }
  dict += "), }";
  // Pad with spaces and a final newline so the data starts on a 64-byte boundary (as numpy does).
  auto padded_total = [&](std::size_t preamble_len) {
    return (preamble_len + dict.size() + 1 + 63) / 64 * 64;
  };
  int version = 1;
  std::size_t preamble = 10;
  if (padded_total(10) - 10 > 65535) {
    version = 2;
    preamble = 12;
  }
  const std::size_t total = padded_total(preamble);
  dict.append(total - preamble - dict.size() - 1, ' ');
  dict += '\n';
  const std::size_t header_len = dict.size();

  std::string out(kMagic, kMagicLen);
  out += static_cast<char>(version);
  out += '\0';
  out += static_cast<char>(header_len & 0xFF);
  out += static_cast<char>((header_len >> 8) & 0xFF);
  if (version == 2) {
    out += static_cast<char>((header_len >> 16) & 0xFF);
    out += static_cast<char>((header_len >> 24) & 0xFF);
  }
  out += dict;

  File file = open_file(path, "wb");
  bool ok = std::fwrite(out.data(), 1, out.size(), file.get()) == out.size();
  if (ok && nbytes > 0) ok = std::fwrite(data, 1, nbytes, file.get()) == nbytes;
  ok = (std::fflush(file.get()) == 0) && ok;
  M3MSA_CHECK(ok, ErrorCode::kInternal, path, ": write failed (", std::strerror(errno), ")");
}

const char* npy_descr(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "<f4";
    case DType::kBF16: return "<u2";
    case DType::kFP8E4M3: return "|u1";
    case DType::kU8: return "|u1";
    case DType::kI32: return "<i4";
    case DType::kI64: return "<i8";
    case DType::kU64: return "<u8";
  }
  M3MSA_THROW(ErrorCode::kInvalidArgument, "npy_descr: unknown dtype ", static_cast<int>(dtype));
}

void save_npy(const std::string& path, const TensorView& tensor) {
  M3MSA_CHECK_ARG(tensor.device.type == DeviceType::kCPU, path, ": save_npy needs a host tensor, ",
                  "got ", describe(tensor));
  M3MSA_CHECK_ARG(tensor.is_contiguous(), path, ": save_npy needs a contiguous tensor, got ",
                  describe(tensor));
  M3MSA_CHECK_ARG(tensor.ndim > 0, path, ": save_npy: the tensor is not given (0 dimensions)");
  write_npy(path, npy_descr(tensor.dtype), tensor.sizes(), tensor.data, tensor.nbytes());
}

HostTensor load_npy(const std::string& path, DType dtype) {
  File file = open_file(path, "rb");
  const NpyHeader header = parse_header(file.get(), path, file_size(file.get(), path));
  NPY_CHECK(header.descr == npy_descr(dtype), path, "expected dtype ", npy_descr(dtype),
            " (storing ", dtype_name(dtype), "), got ", header.descr);
  NPY_CHECK(header.shape.size() <= static_cast<std::size_t>(kMaxDims), path, "shape ",
            shape_string(header.shape), " has more than ", kMaxDims, " dimensions");
  HostTensor tensor(dtype, header.shape);
  read_data(file.get(), path, tensor.data(), tensor.nbytes());
  return tensor;
}

HostTensor load_npy(const std::string& path, DType dtype,
                    const std::vector<int64_t>& expected_shape) {
  const NpyHeader header = read_npy_header(path);
  bool match = header.shape.size() == expected_shape.size();
  for (std::size_t d = 0; match && d < expected_shape.size(); ++d) {
    match = expected_shape[d] < 0 || expected_shape[d] == header.shape[d];
  }
  if (!match) {
    std::string want = "[";
    for (std::size_t d = 0; d < expected_shape.size(); ++d) {
      if (d) want += ", ";
      want += expected_shape[d] < 0 ? std::string("*") : std::to_string(expected_shape[d]);
    }
    want += "]";
    NPY_FAIL(path, "shape mismatch: expected ", want, ", got ", shape_string(header.shape));
  }
  return load_npy(path, dtype);
}

}  // namespace m3msa
