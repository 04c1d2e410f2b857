// The DLPack exchange ABI (https://dmlc.github.io/dlpack/latest/c_api.html), written from the
// public specification: just the structs and codes the m3msa bindings consume. Both capsule
// flavours are understood: the legacy "dltensor" (DLManagedTensor, what __dlpack__() returns
// unless the caller asks for a version) and "dltensor_versioned" (DLManagedTensorVersioned, 1.x).
#pragma once

#include <cstdint>

namespace m3msa::python::dlpack {

// DLDeviceType (int32 in the ABI). Only the codes the bindings map are named.
enum DeviceType : int32_t {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,  // pinned host memory: readable by the CPU
  kDLCUDAManaged = 13,
};

// DLDataTypeCode (uint8 in the ABI).
enum TypeCode : uint8_t {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLBfloat = 4,
  kDLFloat8_e4m3fn = 10,  // DLPack >= 1.1: the OCP "fn" variant (bias 7, max 448, no inf)
};

struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};

struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;    // [ndim]
  int64_t* strides;  // [ndim] in elements; may be null: compact row-major
  uint64_t byte_offset;
};

// Legacy (pre-1.0) managed tensor: capsule name "dltensor", renamed "used_dltensor" once consumed.
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};

inline constexpr uint32_t kMajorVersion = 1;
inline constexpr uint64_t kFlagReadOnly = 1ull << 0;

// Versioned managed tensor: capsule name "dltensor_versioned", renamed "used_dltensor_versioned".
struct DLManagedTensorVersioned {
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
};

inline constexpr const char* kCapsuleName = "dltensor";
inline constexpr const char* kUsedCapsuleName = "used_dltensor";
inline constexpr const char* kVersionedCapsuleName = "dltensor_versioned";
inline constexpr const char* kUsedVersionedCapsuleName = "used_dltensor_versioned";

}  // namespace m3msa::python::dlpack
