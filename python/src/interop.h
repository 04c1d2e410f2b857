// Zero-copy import of Python arrays into TensorView: DLPack producers (NumPy >= 1.22, PyTorch,
// CuPy, JAX...), bare DLPack capsules, and anything with the buffer protocol (NumPy arrays that
// DLPack refuses, such as read-only ones). Nothing is ever copied: a view points at the caller's
// memory, which must stay alive and unmoved for the call (the ImportScope guarantees that for the
// objects it imported).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "m3msa/batch.h"
#include "m3msa/dtype.h"
#include "m3msa/tensor.h"

namespace m3msa::python {

namespace py = pybind11;

// An array paired with the m3msa dtype its bits hold: NumPy has no bfloat16 or float8, so a bf16
// tensor travels as uint16 (or int16) and an fp8 e4m3 tensor as uint8 (or int8) plus this tag.
// Python: m3msa.view(array, "bf16").
struct TypedView {
  py::object array;
  DType dtype;
};

// One call's imports. Keeps every imported DLPack tensor and buffer alive until destruction,
// which hands them back to their producers: destroy it with the GIL held (the normal case: it
// lives on the binding's stack outside any gil_scoped_release block).
class ImportScope {
 public:
  // cuda_stream: the stream the call's work will be ordered on, as an integer handle (0 is the
  // legacy default stream), or nullopt when the caller gave none. It is what a CUDA producer's
  // __dlpack__(stream=...) is told, so the producer can order its pending writes before ours.
  explicit ImportScope(std::optional<uintptr_t> cuda_stream = std::nullopt);
  ~ImportScope();
  ImportScope(const ImportScope&) = delete;
  ImportScope& operator=(const ImportScope&) = delete;

  // A tensor argument; `name` is the argument's name in every error. writable: the call writes
  // through the view (an output or a cache), so read-only memory is refused.
  TensorView tensor(py::handle object, const char* name, bool writable = false);
  // Same, but None gives the "not given" view.
  TensorView optional_tensor(py::handle object, const char* name, bool writable = false);
  // The batch metadata of an m3msa.Batch (duck-typed: the attributes of BatchMeta).
  BatchMeta batch(py::handle object);

 private:
  struct Imported;
  TensorView from_dlpack_capsule(py::handle capsule, const char* name, bool writable,
                                 std::optional<DType> declared);
  TensorView from_buffer(py::handle object, const char* name, bool writable,
                         std::optional<DType> declared);

  std::optional<uintptr_t> cuda_stream_;
  std::vector<std::unique_ptr<Imported>> imported_;
};

}  // namespace m3msa::python
