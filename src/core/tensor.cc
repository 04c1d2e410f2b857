#include "m3msa/tensor.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>

#include "m3msa/error.h"

namespace m3msa {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kFP8E4M3: return 1;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
    case DType::kU64: return 8;
    case DType::kU8: return 1;
  }
  M3MSA_THROW(ErrorCode::kInvalidArgument, "dtype: unknown value ", static_cast<int>(dtype));
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kFP8E4M3: return "fp8_e4m3";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
    case DType::kU64: return "u64";
    case DType::kU8: return "u8";
  }
  return "unknown";
}

DType parse_dtype(const std::string& text, const char* what) {
  if (text == "f32" || text == "float32") return DType::kF32;
  if (text == "bf16" || text == "bfloat16") return DType::kBF16;
  if (text == "fp8" || text == "fp8_e4m3" || text == "float8_e4m3fn") return DType::kFP8E4M3;
  if (text == "i32" || text == "int32") return DType::kI32;
  if (text == "i64" || text == "int64") return DType::kI64;
  if (text == "u64" || text == "uint64") return DType::kU64;
  if (text == "u8" || text == "uint8") return DType::kU8;
  M3MSA_THROW(ErrorCode::kInvalidArgument, what, ": unknown dtype '", text,
              "' (expected f32, bf16, fp8, i32, i64, u64 or u8)");
}

std::string device_name(Device device) {
  return device.type == DeviceType::kCPU ? std::string("cpu")
                                         : "cuda:" + std::to_string(device.index);
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  Device device) {
  return contiguous(data, dtype, std::vector<int64_t>(shape), device);
}

TensorView TensorView::contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                                  Device device) {
  M3MSA_CHECK_ARG(shape.size() <= static_cast<std::size_t>(kMaxDims), "tensor: ", shape.size(),
                  " dimensions, at most ", kMaxDims, " supported");
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.ndim = static_cast<int>(shape.size());
  view.device = device;
  int64_t stride = 1;
  for (int d = view.ndim - 1; d >= 0; --d) {
    M3MSA_CHECK_ARG(shape[d] >= 0, "tensor: negative extent ", shape[d], " in dimension ", d);
    view.shape[d] = shape[d];
    view.strides[d] = stride;
    // Strides of a hostile shape must not wrap: a product past int64 is an error.
    M3MSA_CHECK_ARG(shape[d] == 0 || stride <= std::numeric_limits<int64_t>::max() / shape[d],
                    "tensor: shape ", shape_string(shape), " has more elements than int64 holds");
    stride *= shape[d];
  }
  return view;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return ndim == 0 ? 0 : n;
}

bool TensorView::is_contiguous() const {
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

std::string describe(const TensorView& view) {
  // Used in error messages about views that failed validation: never read past shape[kMaxDims].
  if (view.ndim < 0 || view.ndim > kMaxDims) {
    return std::string(dtype_name(view.dtype)) + "[<" + std::to_string(view.ndim) +
           " dimensions>] " + device_name(view.device);
  }
  return std::string(dtype_name(view.dtype)) + shape_string(view.sizes()) + " " +
         device_name(view.device);
}

namespace {
std::string expected_shape_string(std::initializer_list<int64_t> shape) {
  std::ostringstream out;
  out << '[';
  int i = 0;
  for (int64_t extent : shape) {
    out << (i++ ? ", " : "");
    if (extent < 0) {
      out << '*';
    } else {
      out << extent;
    }
  }
  out << ']';
  return out.str();
}

// Product of the non-zero extents, or -1 when it does not fit in int64. Bounding it bounds every
// suffix product too, so is_contiguous() and numel() cannot overflow on an accepted view.
int64_t checked_extent_product(const int64_t* shape, int ndim) {
  int64_t product = 1;
  for (int d = 0; d < ndim; ++d) {
    if (shape[d] == 0) continue;
    if (product > std::numeric_limits<int64_t>::max() / shape[d]) return -1;
    product *= shape[d];
  }
  return product;
}

void check_shape(const TensorView& view, const char* name,
                 std::initializer_list<int64_t> expected_shape) {
  // Rank, extents and size first: everything after (and every message) indexes shape[].
  M3MSA_CHECK_ARG(view.ndim >= 0 && view.ndim <= kMaxDims, name, ": ", view.ndim,
                  " dimensions is outside [0, ", kMaxDims, "] (expected shape ",
                  expected_shape_string(expected_shape), ")");
  check_extents(view, name);
  M3MSA_CHECK_ARG(view.data != nullptr || view.numel() == 0, name, ": null data pointer for ",
                  describe(view));
  bool shape_ok = view.ndim == static_cast<int>(expected_shape.size());
  if (shape_ok) {
    int d = 0;
    for (int64_t extent : expected_shape) {
      if (extent >= 0 && view.shape[d] != extent) shape_ok = false;
      ++d;
    }
  }
  M3MSA_CHECK_ARG(shape_ok, name, ": expected shape ", expected_shape_string(expected_shape),
                  ", got ", shape_string(view.sizes()));
}

std::string strides_string(const TensorView& view) {
  return shape_string({view.strides.begin(), view.strides.begin() + view.ndim});
}

void check_shape_and_layout(const TensorView& view, const char* name,
                            std::initializer_list<int64_t> expected_shape) {
  check_shape(view, name, expected_shape);
  M3MSA_CHECK_ARG(view.is_contiguous(), name,
                  ": expected a contiguous row-major tensor, got strides ", strides_string(view),
                  " for shape ", shape_string(view.sizes()));
}

void check_dtype(const TensorView& view, const char* name, std::initializer_list<DType> dtypes) {
  bool ok = false;
  std::string allowed;
  for (DType dtype : dtypes) {
    ok = ok || view.dtype == dtype;
    allowed += (allowed.empty() ? "" : " or ") + std::string(dtype_name(dtype));
  }
  M3MSA_CHECK_ARG(ok, name, ": expected dtype ", allowed, ", got ", dtype_name(view.dtype));
}
}  // namespace

void check_extents(const TensorView& view, const char* name) {
  M3MSA_CHECK_ARG(view.ndim >= 0 && view.ndim <= kMaxDims, name, ": ", view.ndim,
                  " dimensions is outside [0, ", kMaxDims, "]");
  for (int d = 0; d < view.ndim; ++d) {
    M3MSA_CHECK_ARG(view.shape[d] >= 0, name, ": negative extent ", view.shape[d], " in dimension ",
                    d, " of ", describe(view));
  }
  const int64_t product = checked_extent_product(view.shape.data(), view.ndim);
  M3MSA_CHECK_ARG(product >= 0 && static_cast<uint64_t>(product) <=
                                      static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) /
                                          dtype_size(view.dtype),
                  name, ": ", describe(view), " has more bytes than int64 holds");
}

void check_tensor(const TensorView& view, const char* name, DType dtype,
                  std::initializer_list<int64_t> expected_shape) {
  M3MSA_CHECK_ARG(view.dtype == dtype, name, ": expected dtype ", dtype_name(dtype), ", got ",
                  dtype_name(view.dtype));
  check_shape_and_layout(view, name, expected_shape);
}

void check_tensor(const TensorView& view, const char* name, std::initializer_list<DType> dtypes,
                  std::initializer_list<int64_t> expected_shape) {
  check_dtype(view, name, dtypes);
  check_shape_and_layout(view, name, expected_shape);
}

void check_strided_tensor(const TensorView& view, const char* name,
                          std::initializer_list<DType> dtypes,
                          std::initializer_list<int64_t> expected_shape) {
  check_dtype(view, name, dtypes);
  check_shape(view, name, expected_shape);
  if (view.numel() == 0) return;
  M3MSA_CHECK_ARG(
      view.ndim == 0 || view.shape[view.ndim - 1] == 1 || view.strides[view.ndim - 1] == 1, name,
      ": expected stride 1 in the last dimension, got strides ", strides_string(view),
      " for shape ", shape_string(view.sizes()));
  // The farthest element must be addressable in int64 bytes, so offsets computed anywhere (host
  // or device) cannot wrap.
  const int64_t limit =
      std::numeric_limits<int64_t>::max() / static_cast<int64_t>(dtype_size(view.dtype));
  int64_t last = 0;
  for (int d = 0; d < view.ndim; ++d) {
    M3MSA_CHECK_ARG(view.strides[d] >= 0, name, ": negative stride ", view.strides[d],
                    " in dimension ", d, " (strides ", strides_string(view), ")");
    const int64_t extent = view.shape[d] - 1;
    M3MSA_CHECK_ARG(extent == 0 || view.strides[d] <= (limit - last) / extent, name, ": strides ",
                    strides_string(view), " for shape ", shape_string(view.sizes()),
                    " address more bytes than int64 holds");
    last += extent * view.strides[d];
  }
}

void check_device(const TensorView& view, const char* name, Device device) {
  M3MSA_CHECK_ARG(view.device == device, name, ": expected a tensor on ", device_name(device),
                  ", got one on ", device_name(view.device));
}

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)) {
  for (int64_t extent : shape_) {
    M3MSA_CHECK_ARG(extent >= 0, "HostTensor: negative extent in shape ", shape_string(shape_));
  }
  // A size that wraps would allocate a small buffer for a huge view.
  const int64_t product = checked_extent_product(shape_.data(), static_cast<int>(shape_.size()));
  M3MSA_CHECK_ARG(product >= 0 && static_cast<uint64_t>(product) <=
                                      static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) /
                                          dtype_size(dtype_),
                  "HostTensor: ", dtype_name(dtype_), shape_string(shape_),
                  " has more bytes than int64 holds");
  const std::size_t bytes = (nbytes() + 63) / 64 * 64;
  void* raw = bytes ? std::aligned_alloc(64, bytes) : nullptr;
  M3MSA_CHECK(bytes == 0 || raw != nullptr, ErrorCode::kInternal, "HostTensor: out of memory for ",
              bytes, " bytes");
  storage_ = std::shared_ptr<uint8_t>(static_cast<uint8_t*>(raw), [](uint8_t* p) { std::free(p); });
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t extent : shape_) n *= extent;
  return n;
}

TensorView HostTensor::view() const {
  return TensorView::contiguous(const_cast<void*>(data()), dtype_, shape_, Device::cpu());
}

void HostTensor::fill_bytes(uint8_t byte) {
  if (nbytes()) std::memset(data(), byte, nbytes());
}

}  // namespace m3msa
