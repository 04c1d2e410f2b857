#include "interop.h"

#include <limits>
#include <string>

#include "dlpack.h"
#include "m3msa/error.h"

namespace m3msa::python {

namespace {

std::string type_name(py::handle object) {
  return Py_TYPE(object.ptr())->tp_name;
}

std::string element_type_name(const dlpack::DLDataType& type) {
  std::string base;
  switch (type.code) {
    case dlpack::kDLInt: base = "int"; break;
    case dlpack::kDLUInt: base = "uint"; break;
    case dlpack::kDLFloat: base = "float"; break;
    case dlpack::kDLBfloat: base = "bfloat"; break;
    case dlpack::kDLFloat8_e4m3fn: return "float8_e4m3fn";
    case 5: base = "complex"; break;
    case 6: return "bool";
    default: return "DLPack type code " + std::to_string(type.code);
  }
  std::string name = base + std::to_string(type.bits);
  if (type.lanes != 1) name += "x" + std::to_string(type.lanes);
  return name;
}

std::optional<DType> native_dtype(const dlpack::DLDataType& type) {
  if (type.lanes != 1) return std::nullopt;
  if (type.code == dlpack::kDLFloat && type.bits == 32) return DType::kF32;
  if (type.code == dlpack::kDLBfloat && type.bits == 16) return DType::kBF16;
  if (type.code == dlpack::kDLFloat8_e4m3fn && type.bits == 8) return DType::kFP8E4M3;
  if (type.code == dlpack::kDLInt && type.bits == 32) return DType::kI32;
  if (type.code == dlpack::kDLInt && type.bits == 64) return DType::kI64;
  if (type.code == dlpack::kDLUInt && type.bits == 64) return DType::kU64;
  if (type.code == dlpack::kDLUInt && type.bits == 8) return DType::kU8;
  return std::nullopt;
}

// The m3msa dtype of an element type, honouring a dtype declared through m3msa.view(): a declared
// dtype accepts its own element type or raw integers of its width (its bits stored as integers).
DType map_dtype(const dlpack::DLDataType& type, std::optional<DType> declared, const char* name) {
  const std::optional<DType> native = native_dtype(type);
  const bool integer = type.code == dlpack::kDLInt || type.code == dlpack::kDLUInt;
  if (declared) {
    const bool raw_bits = integer && type.lanes == 1 && type.bits == dtype_size(*declared) * 8;
    M3MSA_CHECK_ARG(native == declared || raw_bits, name, ": m3msa.view(..., '",
                    dtype_name(*declared), "') needs ", dtype_size(*declared) * 8,
                    "-bit integer or ", dtype_name(*declared), " elements, got ",
                    element_type_name(type));
    return *declared;
  }
  if (native) return *native;
  std::string hint;
  if (integer && type.bits == 16) {
    hint = " (a bfloat16 tensor stored as 16-bit integers: pass m3msa.view(array, 'bf16'))";
  } else if (integer && type.bits == 8) {
    hint = " (an fp8 e4m3 tensor stored as 8-bit integers: pass m3msa.view(array, 'fp8'))";
  } else if (type.code == dlpack::kDLFloat && type.bits != 32) {
    hint = " (convert it: float32 and bfloat16 are the floating types m3msa reads)";
  }
  M3MSA_THROW(ErrorCode::kInvalidArgument, name, ": element type ", element_type_name(type),
              " has no m3msa dtype (f32, bf16, fp8_e4m3, i32, i64, u64, u8)", hint);
}

Device map_device(const dlpack::DLDevice& device, const char* name) {
  switch (device.device_type) {
    case dlpack::kDLCPU:
    case dlpack::kDLCUDAHost: return Device::cpu();
    case dlpack::kDLCUDA:
    case dlpack::kDLCUDAManaged: return Device::cuda(device.device_id);
    default: break;
  }
  M3MSA_THROW(ErrorCode::kUnsupported, name, ": tensors on DLPack device type ", device.device_type,
              " are not supported (CPU and CUDA memory are)");
}

TensorView view_of(const dlpack::DLTensor& tensor, const char* name,
                   std::optional<DType> declared) {
  M3MSA_CHECK_ARG(tensor.ndim >= 0 && tensor.ndim <= kMaxDims, name, ": ", tensor.ndim,
                  " dimensions, at most ", kMaxDims, " supported");
  TensorView view;
  view.dtype = map_dtype(tensor.dtype, declared, name);
  view.device = map_device(tensor.device, name);
  view.ndim = tensor.ndim;
  view.data =
      tensor.data == nullptr ? nullptr : static_cast<char*>(tensor.data) + tensor.byte_offset;
  int64_t compact = 1;
  for (int d = tensor.ndim - 1; d >= 0; --d) {
    view.shape[d] = tensor.shape[d];
    view.strides[d] = tensor.strides != nullptr ? tensor.strides[d] : compact;
    compact *= tensor.shape[d];
  }
  return view;
}

// Buffer-protocol format character -> the equivalent DLPack element type.
dlpack::DLDataType buffer_element_type(const std::string& format, py::ssize_t itemsize,
                                       const char* name) {
  std::string code = format;
  if (!code.empty() && (code[0] == '@' || code[0] == '=' || code[0] == '<')) code.erase(0, 1);
  M3MSA_CHECK_ARG(code.size() == 1, name, ": unsupported buffer element format '", format, "'");
  dlpack::DLDataType type{0, static_cast<uint8_t>(itemsize * 8), 1};
  switch (code[0]) {
    case 'e':
    case 'f':
    case 'd': type.code = dlpack::kDLFloat; break;
    case 'b':
    case 'h':
    case 'i':
    case 'l':
    case 'q': type.code = dlpack::kDLInt; break;
    case 'B':
    case 'H':
    case 'I':
    case 'L':
    case 'Q': type.code = dlpack::kDLUInt; break;
    case '?': type.code = 6; break;
    default:
      M3MSA_THROW(ErrorCode::kInvalidArgument, name, ": unsupported buffer element format '",
                  format, "'");
  }
  return type;
}

// Asks a DLPack producer for a capsule. For CUDA memory the producer is told the consumer's
// stream, so it orders its pending work before ours (a no-op when the streams are the same,
// which keeps the call capturable in a CUDA graph).
py::object export_dlpack(py::handle object, std::optional<uintptr_t> cuda_stream) {
  if (cuda_stream && py::hasattr(object, "__dlpack_device__")) {
    const py::tuple device = object.attr("__dlpack_device__")();
    const int type = device[0].cast<int>();
    if (type == dlpack::kDLCUDA || type == dlpack::kDLCUDAManaged) {
      // DLPack stream numbering: 1 is the legacy default stream; 0 is ambiguous and not allowed.
      const uintptr_t stream = *cuda_stream == 0 ? 1 : *cuda_stream;
      return object.attr("__dlpack__")(py::arg("stream") = stream);
    }
  }
  return object.attr("__dlpack__")();
}

}  // namespace

struct ImportScope::Imported {
  dlpack::DLManagedTensor* legacy = nullptr;
  dlpack::DLManagedTensorVersioned* versioned = nullptr;
  std::unique_ptr<py::buffer_info> buffer;

  Imported() = default;
  Imported(const Imported&) = delete;
  Imported& operator=(const Imported&) = delete;
  ~Imported() {
    if (legacy != nullptr && legacy->deleter != nullptr) legacy->deleter(legacy);
    if (versioned != nullptr && versioned->deleter != nullptr) versioned->deleter(versioned);
  }
};

ImportScope::ImportScope(std::optional<uintptr_t> cuda_stream) : cuda_stream_(cuda_stream) {}

ImportScope::~ImportScope() {
  // Hand the tensors back in reverse order of import.
  while (!imported_.empty()) imported_.pop_back();
}

TensorView ImportScope::from_dlpack_capsule(py::handle capsule, const char* name, bool writable,
                                            std::optional<DType> declared) {
  PyObject* raw = capsule.ptr();
  if (PyCapsule_IsValid(raw, dlpack::kCapsuleName)) {
    auto* managed =
        static_cast<dlpack::DLManagedTensor*>(PyCapsule_GetPointer(raw, dlpack::kCapsuleName));
    if (managed == nullptr || PyCapsule_SetName(raw, dlpack::kUsedCapsuleName) != 0) {
      throw py::error_already_set();
    }
    imported_.push_back(std::make_unique<Imported>());
    imported_.back()->legacy = managed;
    return view_of(managed->dl_tensor, name, declared);
  }
  if (PyCapsule_IsValid(raw, dlpack::kVersionedCapsuleName)) {
    auto* managed = static_cast<dlpack::DLManagedTensorVersioned*>(
        PyCapsule_GetPointer(raw, dlpack::kVersionedCapsuleName));
    if (managed == nullptr || PyCapsule_SetName(raw, dlpack::kUsedVersionedCapsuleName) != 0) {
      throw py::error_already_set();
    }
    imported_.push_back(std::make_unique<Imported>());
    imported_.back()->versioned = managed;
    M3MSA_CHECK_SUPPORTED(managed->version.major == dlpack::kMajorVersion, name,
                          ": DLPack major version ", managed->version.major, " is not supported (",
                          dlpack::kMajorVersion, " is)");
    M3MSA_CHECK_ARG(!writable || (managed->flags & dlpack::kFlagReadOnly) == 0, name,
                    ": the tensor is read-only but this call writes it");
    return view_of(managed->dl_tensor, name, declared);
  }
  M3MSA_THROW(ErrorCode::kInvalidArgument, name,
              ": the capsule is not an unconsumed DLPack tensor (a DLPack capsule can be "
              "imported once)");
}

TensorView ImportScope::from_buffer(py::handle object, const char* name, bool writable,
                                    std::optional<DType> declared) {
  std::unique_ptr<py::buffer_info> info;
  try {
    info = std::make_unique<py::buffer_info>(
        py::reinterpret_borrow<py::buffer>(object).request(writable));
  } catch (py::error_already_set& error) {
    M3MSA_THROW(ErrorCode::kInvalidArgument, name,
                writable ? ": not a writable array (this call writes it): " : ": ", error.what());
  }
  imported_.push_back(std::make_unique<Imported>());
  imported_.back()->buffer = std::move(info);
  const py::buffer_info& buffer = *imported_.back()->buffer;
  M3MSA_CHECK_ARG(buffer.ndim <= kMaxDims, name, ": ", buffer.ndim, " dimensions, at most ",
                  kMaxDims, " supported");
  TensorView view;
  view.dtype = map_dtype(buffer_element_type(buffer.format, buffer.itemsize, name), declared, name);
  view.device = Device::cpu();
  view.ndim = static_cast<int>(buffer.ndim);
  view.data = buffer.ptr;
  for (int d = 0; d < view.ndim; ++d) {
    const auto index = static_cast<std::size_t>(d);
    M3MSA_CHECK_ARG(buffer.strides[index] % buffer.itemsize == 0, name, ": stride ",
                    buffer.strides[index], " bytes of dimension ", d,
                    " is not a multiple of the element size ", buffer.itemsize);
    view.shape[d] = buffer.shape[index];
    view.strides[d] = buffer.strides[index] / buffer.itemsize;
  }
  return view;
}

TensorView ImportScope::tensor(py::handle object, const char* name, bool writable) {
  std::optional<DType> declared;
  py::handle target = object;
  if (py::isinstance<TypedView>(object)) {
    const TypedView& typed = object.cast<const TypedView&>();
    target = typed.array;
    declared = typed.dtype;
  }
  M3MSA_CHECK_ARG(!target.is_none(), name, " is required, got None");
  if (PyCapsule_CheckExact(target.ptr())) {
    return from_dlpack_capsule(target, name, writable, declared);
  }
  const bool has_buffer = PyObject_CheckBuffer(target.ptr()) != 0;
  if (py::hasattr(target, "__dlpack__")) {
    py::object capsule;
    try {
      capsule = export_dlpack(target, cuda_stream_);
    } catch (py::error_already_set& error) {
      // NumPy < 2 refuses to export read-only arrays through DLPack; the buffer protocol can.
      if (!has_buffer) {
        // Name where the tensor lives: the usual cause is a tensor on another GPU than the
        // call's stream (torch refuses to export it for that stream).
        std::string where;
        if (py::hasattr(target, "__dlpack_device__")) {
          try {
            const py::tuple device = target.attr("__dlpack_device__")();
            const int type = device[0].cast<int>();
            where = (type == dlpack::kDLCUDA || type == dlpack::kDLCUDAManaged)
                        ? " on cuda:" + std::to_string(device[1].cast<int>())
                        : "";
          } catch (py::error_already_set&) {
          }
        }
        M3MSA_THROW(ErrorCode::kInvalidArgument, name, ": __dlpack__() of a ", type_name(target),
                    where, " failed: ", error.what());
      }
    }
    if (capsule) return from_dlpack_capsule(capsule, name, writable, declared);
  }
  if (has_buffer) return from_buffer(target, name, writable, declared);
  M3MSA_THROW(ErrorCode::kInvalidArgument, name,
              ": expected an array (a NumPy array, a torch tensor or any object with __dlpack__ "
              "or the buffer protocol), got ",
              type_name(target));
}

TensorView ImportScope::optional_tensor(py::handle object, const char* name, bool writable) {
  if (object.is_none()) return {};
  return tensor(object, name, writable);
}

namespace {

py::object batch_field(py::handle batch, const char* field) {
  M3MSA_CHECK_ARG(py::hasattr(batch, field), "batch: expected an m3msa.Batch, got a ",
                  type_name(batch), " without the attribute '", field, "'");
  return batch.attr(field);
}

int64_t batch_integer(py::handle batch, const char* field, int64_t lo, int64_t hi) {
  const py::object value = batch_field(batch, field);
  int64_t result = 0;
  try {
    result = value.cast<int64_t>();
  } catch (const py::cast_error&) {
    M3MSA_THROW(ErrorCode::kInvalidArgument, "batch.", field, ": expected an int, got a ",
                type_name(value));
  }
  M3MSA_CHECK_ARG(result >= lo && result <= hi, "batch.", field, " must be in [", lo, ", ", hi,
                  "], got ", result);
  return result;
}

}  // namespace

BatchMeta ImportScope::batch(py::handle object) {
  M3MSA_CHECK_ARG(!object.is_none(), "batch is required, got None");
  BatchMeta meta;
  const std::string kind = py::str(batch_field(object, "kind"));
  if (kind == "decode") {
    meta.kind = BatchKind::kDecode;
  } else if (kind == "prefill") {
    meta.kind = BatchKind::kPrefill;
  } else {
    M3MSA_THROW(ErrorCode::kInvalidArgument, "batch.kind must be 'decode' or 'prefill', got '",
                kind, "'");
  }
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  meta.num_reqs = static_cast<int>(batch_integer(object, "num_reqs", 0, kIntMax));
  meta.q_len = static_cast<int>(batch_integer(object, "q_len", 0, kIntMax));
  meta.num_tokens = batch_integer(object, "num_tokens", 0, std::numeric_limits<int64_t>::max());
  meta.seq_lens = optional_tensor(batch_field(object, "seq_lens"), "batch.seq_lens");
  meta.cu_seqlens_q = optional_tensor(batch_field(object, "cu_seqlens_q"), "batch.cu_seqlens_q");
  meta.context_lens = optional_tensor(batch_field(object, "context_lens"), "batch.context_lens");
  meta.index_block_table =
      optional_tensor(batch_field(object, "index_block_table"), "batch.index_block_table");
  meta.kv_block_table =
      optional_tensor(batch_field(object, "kv_block_table"), "batch.kv_block_table");
  meta.slot_mapping = optional_tensor(batch_field(object, "slot_mapping"), "batch.slot_mapping");
  meta.index_slot_mapping =
      optional_tensor(batch_field(object, "index_slot_mapping"), "batch.index_slot_mapping");
  return meta;
}

}  // namespace m3msa::python
