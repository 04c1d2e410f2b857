// The composed double-precision oracle of one runtime layer (TP = 1): the CPU reference ops
// (cpu::preprocess, select_topk, sparse_attention) for the attention core, with the projections,
// norms, residual adds and the SwiGLU-OAI MLP written out in double precision and rounded to bf16
// where the runtime rounds. Its numerics are independent of the runtime's, so wiring errors (a
// wrong slice, a wrong norm, a wrong order of adds) cannot cancel.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "m3msa/batch.h"
#include "m3msa/cache.h"
#include "m3msa/config.h"
#include "m3msa/tensor.h"
#include "m3msa/testing/moe_model.h"

namespace m3msa::testkit {

// One layer's TP = 1 weights as floats (row-major [out, in]) and its caches (updated in place).
struct ReferenceLayer {
  std::span<const float> qkv;             // [W, hidden] fused rows [q | k | v | index_q | index_k]
  std::span<const float> o_proj;          // [hidden, QH*HD]
  std::span<const float> gate, up, down;  // [I, hidden] x2, [hidden, I]; empty: no MLP
  const MasterMoe* moe = nullptr;         // the mixture of experts (instead of an MLP)
  // A dense layer's MLP: the layer is dense (qkv rows [q | k | v], no index part, no selection,
  // dense causal attention), and this is its FFN.
  const MasterDenseMlp* dense_mlp = nullptr;
  std::span<const float> input_norm, post_norm;           // [hidden] (Gemma-style: x * (1 + w))
  TensorView q_norm, k_norm, index_q_norm, index_k_norm;  // bf16
  KVCache kv_cache;
  IndexCache index_cache;
};

struct ReferenceOptions {
  double swiglu_limit = 7.0;
  int threads = 1;
  // The layer shares this selection ([rows, index_heads, k] i32; docs/spec.md section 7: no
  // index_q, no index_k insert, no indexer); otherwise it selects.
  const HostTensor* shared_topk = nullptr;
  HostTensor* select_out = nullptr;  // the layer's own selection, when it selects
  TensorView scores_out;  // [rows, index_heads, >= max blocks] f32: block scores of its index_q
};

// hidden, residual ([rows, hidden] bf16): the layer's inputs, replaced by its outputs.
void reference_layer(const ModelConfig& model, const ReferenceLayer& w, const BatchMeta& batch,
                     const TensorView& positions, std::vector<uint16_t>& hidden,
                     std::vector<uint16_t>& residual, const ReferenceOptions& options = {});

}  // namespace m3msa::testkit
