// The configuration structs (include/m3msa/config.h) for Python from one table of fields each:
// the read-write attributes, a keyword-only constructor that takes every field (defaults: the
// struct's own), repr and ==, so no field can be missing from one of them.
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "m3msa/config.h"

namespace m3msa::python {

namespace py = pybind11;

template <typename C>
struct ConfigField {
  const char* name;
  std::variant<int C::*, float C::*, double C::*> member;
};

template <typename C>
using ConfigFields = std::vector<ConfigField<C>>;

inline ConfigFields<SparseConfig> sparse_config_fields() {
  using S = SparseConfig;
  return {{"q_heads", &S::q_heads},
          {"kv_heads", &S::kv_heads},
          {"head_dim", &S::head_dim},
          {"index_heads", &S::index_heads},
          {"index_dim", &S::index_dim},
          {"block_size", &S::block_size},
          {"topk", &S::topk},
          {"init_blocks", &S::init_blocks},
          {"local_blocks", &S::local_blocks},
          {"rope_dim", &S::rope_dim},
          {"rope_theta", &S::rope_theta},
          {"rms_eps", &S::rms_eps}};
}

// A base struct's fields as fields of a derived struct (ModelConfig of SparseConfig's).
template <typename Derived, typename Base>
ConfigFields<Derived> widen_fields(const ConfigFields<Base>& fields) {
  ConfigFields<Derived> out;
  for (const ConfigField<Base>& f : fields) {
    std::visit([&](auto member) { out.push_back({f.name, member}); }, f.member);
  }
  return out;
}

template <typename C>
std::string config_repr(const char* type_name, const C& c, const ConfigFields<C>& fields) {
  std::ostringstream out;
  out << type_name << "(";
  for (std::size_t i = 0; i < fields.size(); ++i) {
    out << (i ? ", " : "") << fields[i].name << "=";
    std::visit([&](auto member) { out << c.*member; }, fields[i].member);
  }
  out << ")";
  return out.str();
}

// Binds `own` as attributes (a derived class inherits its base's) and, over `all`, the keyword
// constructor (an unknown keyword or a value of the wrong type is a TypeError naming it), repr,
// == and copy.
template <typename C, typename... Options>
void bind_config_fields(py::class_<C, Options...>& cls, const char* type_name,
                        const ConfigFields<C>& own, const ConfigFields<C>& all) {
  for (const ConfigField<C>& f : own) {
    std::visit([&](auto member) { cls.def_readwrite(f.name, member); }, f.member);
  }
  const std::string name(type_name);
  const C defaults;
  std::string doc = name + "(*";
  for (const ConfigField<C>& f : all) {
    std::ostringstream value;
    std::visit([&](auto member) { value << defaults.*member; }, f.member);
    doc += std::string(", ") + f.name + "=" + value.str();
  }
  doc += ")";
  cls.def(
         py::init([all, name](const py::kwargs& kwargs) {
           C c;
           for (const auto& [key, value] : kwargs) {
             const std::string field = py::cast<std::string>(key);
             auto it = std::find_if(all.begin(), all.end(),
                                    [&](const ConfigField<C>& f) { return field == f.name; });
             if (it == all.end()) {
               throw py::type_error(name + "() got an unexpected keyword argument '" + field + "'");
             }
             std::visit(
                 [&](auto member) {
                   using T = std::remove_reference_t<decltype(c.*member)>;
                   if (py::isinstance<py::bool_>(value) ||
                       (std::is_integral_v<T> && !py::isinstance<py::int_>(value))) {
                     throw py::type_error(name + "." + field + ": expected " +
                                          (std::is_integral_v<T> ? "an int" : "a number") +
                                          ", got " + std::string(py::str(value.get_type())));
                   }
                   c.*member = value.template cast<T>();
                 },
                 it->member);
           }
           return c;
         }),
         doc.c_str())
      .def("__repr__", [all, name](const C& c) { return config_repr(name.c_str(), c, all); })
      .def("__eq__",
           [all](const C& a, const C& b) {
             for (const ConfigField<C>& f : all) {
               const bool equal =
                   std::visit([&](auto member) { return a.*member == b.*member; }, f.member);
               if (!equal) return false;
             }
             return true;
           })
      .def("__copy__", [](const C& c) { return c; })
      .def("__deepcopy__", [](const C& c, py::handle) { return c; });
}

}  // namespace m3msa::python
