// fuzz_npy: bytes -> a file -> the .npy reader (read_npy_header, read_npy, load_npy with and
// without an expected shape). Contract: accept or throw m3msa::Error naming the file; never
// crash, never UB, never allocate more than the file can fill. Half of the inputs get a valid
// preamble with a computed header length around fuzz-chosen header text, so the dict parser is
// reached; the other half are raw files. An accepted file must round-trip through write_npy.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "fuzz_common.h"
#include "m3msa/npy.h"

namespace m3msa::fuzz {
namespace {

// tmpfs when there is one: the reader is file-based and a disk makes the target I/O-bound.
const std::string& scratch_path(int which) {
  static const std::string dir = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  static const std::string paths[2] = {
      dir + "/m3msa_fuzz_npy_" + std::to_string(getpid()) + "_in.npy",
      dir + "/m3msa_fuzz_npy_" + std::to_string(getpid()) + "_out.npy"};
  return paths[which];
}

void write_file(const std::string& path, const std::string& bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  FUZZ_CHECK(f != nullptr, "cannot create %s", path.c_str());
  FUZZ_CHECK(std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size());
  std::fclose(f);
}

std::string framed(FuzzedDataProvider& in) {
  const int version = in.PickValueInArray<int>({1, 1, 2, 3});
  std::string header = in.ConsumeRandomLengthString(200);
  if (in.ConsumeBool()) {
    // A mostly well-formed dict with a fuzz-chosen descr and shape.
    header = "{'descr': '" + in.ConsumeRandomLengthString(4) +
             "', 'fortran_order': " + (in.ConsumeIntegralInRange<int>(0, 7) ? "False" : "True") +
             ", 'shape': (" + in.ConsumeRandomLengthString(24) + "), }";
  }
  std::string out = "\x93NUMPY";
  out += static_cast<char>(version);
  out += '\0';
  std::size_t len =
      header.size() +
      (in.ConsumeIntegralInRange<int>(0, 7) == 0 ? in.ConsumeIntegralInRange<int>(-3, 3) : 0);
  for (int i = 0; i < (version == 1 ? 2 : 4); ++i)
    out += static_cast<char>((len >> (8 * i)) & 0xFF);
  out += header;
  out += in.ConsumeRemainingBytesAsString();
  return out;
}

}  // namespace
}  // namespace m3msa::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace m3msa;
  using namespace m3msa::fuzz;
  if (size == 0) return 0;
  FuzzedDataProvider in(data + 1, size - 1);
  const std::string bytes =
      (data[0] & 1) ? framed(in) : std::string(reinterpret_cast<const char*>(data + 1), size - 1);
  const std::string& path = scratch_path(0);
  write_file(path, bytes);

  NpyHeader header;
  const bool header_ok = accepts([&] { header = read_npy_header(path); });
  NpyArray array;
  const bool array_ok = accepts([&] { array = read_npy(path); });
  FUZZ_CHECK(header_ok == array_ok, "read_npy_header and read_npy disagree");
  if (array_ok) {
    FUZZ_CHECK(array.descr == header.descr && array.shape == header.shape);
    FUZZ_CHECK(array.data.size() == static_cast<std::size_t>(array.numel()) * header.item_size());
    FUZZ_CHECK(header.data_offset + array.data.size() == bytes.size());
    // Round trip: what we read, written back and read again, is the same array.
    const std::string& out = scratch_path(1);
    write_npy(out, array.descr, array.shape, array.data.data(), array.data.size());
    const NpyArray again = read_npy(out);
    FUZZ_CHECK(again.descr == array.descr && again.shape == array.shape &&
               again.data == array.data);
  }
  for (DType dtype :
       {DType::kF32, DType::kBF16, DType::kFP8E4M3, DType::kI32, DType::kI64, DType::kU64}) {
    HostTensor tensor;
    if (accepts([&] { tensor = load_npy(path, dtype); })) {
      FUZZ_CHECK(array_ok && header.descr == npy_descr(dtype));
      FUZZ_CHECK(tensor.shape() == header.shape && tensor.nbytes() == array.data.size());
    }
    if (array_ok) {
      std::vector<int64_t> expected = header.shape;
      if (!expected.empty()) expected[0] = -1;
      accepts([&] { load_npy(path, dtype, expected); });
    }
  }
  return 0;
}
