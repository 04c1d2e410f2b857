// Python bindings of the runtime (include/m3msa/runtime.h) and its communicators.
#pragma once

#include <pybind11/pybind11.h>

namespace m3msa::python {

void bind_runtime(pybind11::module_& m);

}  // namespace m3msa::python
