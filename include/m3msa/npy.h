// Reading and writing numpy .npy files (format versions 1.0 and 2.0; little-endian, C order).
//
// Element types: <f4, <u2, |u1 (also read as <u1), <i4, <i8, <u8. numpy has no bf16 or fp8 e4m3,
// so those tensors travel as their bit patterns: bf16 as <u2, fp8_e4m3 as |u1. The logical dtype
// is recorded next to the file (case.json, see docs/replay.md); save_npy / load_npy map DType to
// and from these descriptors.
//
// Every failure (bad magic, unsupported version, malformed header, fortran_order True, a
// big-endian or unknown descriptor, truncated or oversized data, a shape or dtype other than the
// expected one) throws m3msa::Error naming the file.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "m3msa/dtype.h"
#include "m3msa/tensor.h"

namespace m3msa {

// What the header of a .npy file says.
struct NpyHeader {
  std::string descr;           // normalized: "<f4", "<u2", "|u1", "<i4", "<i8" or "<u8"
  std::vector<int64_t> shape;  // () for a scalar
  int version_major = 1;
  std::size_t data_offset = 0;  // bytes before the data

  std::size_t item_size() const;
  int64_t numel() const;  // 1 for a scalar
};

// A whole file, untyped.
struct NpyArray {
  std::string descr;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;  // numel * item_size bytes, little-endian, C order

  int64_t numel() const;
};

// Parses and checks the header (including that the file holds exactly the data it announces).
NpyHeader read_npy_header(const std::string& path);
NpyArray read_npy(const std::string& path);
// descr must be one of the supported descriptors ("u1" and "<u1" are written as "|u1"); nbytes
// must equal numel(shape) * item size. Writes version 1.0, or 2.0 when the header needs it.
void write_npy(const std::string& path, const std::string& descr, const std::vector<int64_t>& shape,
               const void* data, std::size_t nbytes);

// The descriptor that stores `dtype`: f32 <f4, bf16 <u2, fp8_e4m3 |u1, u8 |u1, i32 <i4, i64 <i8,
// u64 <u8.
const char* npy_descr(DType dtype);

// A contiguous host tensor -> file (bf16 / fp8 as their bit patterns).
void save_npy(const std::string& path, const TensorView& tensor);
// File -> host tensor of `dtype`; the file's descriptor must be npy_descr(dtype). When
// `expected_shape` is given, the file's shape must match it (a negative extent matches any).
HostTensor load_npy(const std::string& path, DType dtype);
HostTensor load_npy(const std::string& path, DType dtype,
                    const std::vector<int64_t>& expected_shape);

}  // namespace m3msa
