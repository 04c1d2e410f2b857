// Oracles of the demo model (demo_model.h): one runtime layer replayed from a given input, so a
// system's layer outputs and selections can be checked layer by layer (teacher forcing).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "m3msa/comm.h"
#include "m3msa/runtime.h"
#include "m3msa/tensor.h"
#include "m3msa/testing/demo_model.h"

namespace m3msa::testkit::demo {

class Oracle {
 public:
  virtual ~Oracle() = default;
  virtual std::string name() const = 0;
  virtual void begin_step(const Step& step) = 0;
  // Layer `li` of the run (spec.first_layer() + li), in place: the layer's outputs; topk
  // [rows, H, k]; scores [rows, H, max_blocks] of the oracle's index_q over its own caches (the
  // near-tie rule's reference). A dense layer selects nothing: topk comes back empty.
  virtual void layer(int li, const Step& step, std::vector<uint16_t>& hidden,
                     std::vector<uint16_t>& residual, std::vector<int32_t>& topk,
                     HostTensor& scores) = 0;
};

// The CPU runtime at TP = 1 on the same weights and caches (the oracle of the CUDA path).
std::unique_ptr<Oracle> make_cpu_runtime_oracle(const Spec& spec, int threads);

// The composed double-precision reference (oracle.h) on the master weights (the oracle of the
// CPU path): independent numerics, so wiring errors of the runtime cannot cancel.
std::unique_ptr<Oracle> make_composed_oracle(const Spec& spec, int threads);

}  // namespace m3msa::testkit::demo
