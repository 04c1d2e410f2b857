// Non-owning tensor views (what every public entry takes) and a small owning host tensor (what
// the CLI, the tests and the CPU backend allocate). Strides are in elements.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "m3msa/dtype.h"

namespace m3msa {

enum class DeviceType : int { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  static Device cpu() { return {DeviceType::kCPU, 0}; }
  static Device cuda(int index = 0) { return {DeviceType::kCUDA, index}; }
  bool operator==(const Device& other) const = default;
};

std::string device_name(Device device);

inline constexpr int kMaxDims = 6;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kF32;
  int ndim = 0;  // 0 with data == nullptr means "not given"
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};
  Device device{};

  // A contiguous row-major view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               Device device = Device::cpu());
  static TensorView contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                               Device device = Device::cpu());

  bool defined() const { return data != nullptr || ndim > 0; }
  int64_t numel() const;
  int64_t size(int dim) const { return shape[dim]; }
  bool is_contiguous() const;
  std::vector<int64_t> sizes() const { return {shape.begin(), shape.begin() + ndim}; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }

  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
};

// "[4, 128]"
std::string shape_string(const std::vector<int64_t>& shape);
// "bf16[4, 128] cpu"
std::string describe(const TensorView& view);

// Validation used by every public entry: the error names `name`, the expected and the found value.
// A negative expected extent means "any"; `device` is checked when given.
void check_tensor(const TensorView& view, const char* name, DType dtype,
                  std::initializer_list<int64_t> expected_shape);
void check_tensor(const TensorView& view, const char* name, std::initializer_list<DType> dtypes,
                  std::initializer_list<int64_t> expected_shape);
// The same for a strided view: any non-negative strides with stride 1 in the last dimension, the
// farthest element addressable in int64 bytes.
void check_strided_tensor(const TensorView& view, const char* name,
                          std::initializer_list<DType> dtypes,
                          std::initializer_list<int64_t> expected_shape);
void check_device(const TensorView& view, const char* name, Device device);
// The rank is in [0, kMaxDims], every extent >= 0 and the byte size fits int64 (so numel() and
// nbytes() are exact): kInvalidArgument naming `name` otherwise.
void check_extents(const TensorView& view, const char* name);

// An owning, contiguous host tensor (64-byte aligned).
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }
  void* data() { return storage_.get(); }
  const void* data() const { return storage_.get(); }
  template <typename T>
  T* ptr() {
    return static_cast<T*>(data());
  }
  template <typename T>
  const T* ptr() const {
    return static_cast<const T*>(data());
  }
  TensorView view() const;
  bool empty() const { return shape_.empty(); }  // default-constructed (a [0] tensor is not empty)
  // Fill every byte with `byte` (poisoning outputs in tests).
  void fill_bytes(uint8_t byte);

 private:
  DType dtype_ = DType::kF32;
  std::vector<int64_t> shape_;
  std::shared_ptr<uint8_t> storage_;
};

}  // namespace m3msa
