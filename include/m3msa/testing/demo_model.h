// The demo's synthetic model: M3's attention dimensions (or any ModelConfig) with a dense
// SwiGLU-OAI MLP, every weight and cache element drawn by a counter-based hash of (seed, layer,
// tensor, index) (hashed_unit), so any rank's slice is generated directly and TP = P slices
// assemble exactly into TP = 1; the master (TP = 1) weights as floats for oracles; and the
// decode steps of a run.
#pragma once

#include <cstdint>
#include <vector>

#include "m3msa/batch.h"
#include "m3msa/config.h"
#include "m3msa/runtime.h"
#include "m3msa/tensor.h"
#include "m3msa/testing/moe_model.h"
#include "m3msa/testing/runtime_model.h"

namespace m3msa::testkit::demo {

// Everything that defines one demo run: the model, the weights' dtype, the steps.
struct Spec {
  ModelConfig model;  // sparse layers [first_sparse_layer, num_layers), dense ones below
  bool fp8 = false;   // qkv_proj and o_proj as fp8 e4m3 with per-output-channel scales
  bool context_parallel = false;  // CP indexer (every rank's qkv_proj has every index_q head)
  // The mixture of experts on every sparse layer instead of the dense MLP (model.num_experts,
  // experts_per_token, moe_intermediate, shared_experts), seeded per layer (make_master_moe).
  bool moe = false;
  bool moe_fp8 = true;  // MXFP8 experts (else bf16)
  // The dense layers [0, first_sparse_layer) bound and run too: dense attention and the dense MLP
  // of model.dense_intermediate (MXFP8 when moe_fp8, else bf16), seeded per layer
  // (make_master_dense_mlp).
  bool dense_layers = false;
  uint64_t seed = 1;
  int batch = 1;
  int q_len = 1;
  int steps = 1;
  std::vector<int64_t> contexts;  // per request: tokens cached before the first step
  int64_t max_blocks = 0;         // block-table width (covers the last step)
  int64_t pages = 0;              // pages per cache

  RuntimeConfig runtime_config(int threads) const;
  int64_t rows() const { return int64_t{batch} * q_len; }
  // The layers a run binds and runs: [first_layer(), model.num_layers).
  int first_layer() const { return dense_layers ? 0 : model.first_sparse_layer; }
  int run_layers() const { return model.num_layers - first_layer(); }
  bool is_dense(int layer_index) const {
    return first_layer() + layer_index < model.first_sparse_layer;
  }
  // Bytes of one rank's weights / caches (all layers).
  double weight_bytes(int tp) const;
  double cache_bytes(int tp) const;
};

Spec make_spec(const ModelConfig& model, bool fp8, uint64_t seed, int batch, int64_t context,
               int q_len, int steps);

// The whole model's experts of sparse layer `layer` (spec.moe).
MasterMoe make_layer_moe(const Spec& spec, int layer);
// The whole model's MLP of dense layer `layer` (spec.dense_layers).
MasterDenseMlp make_layer_dense_mlp(const Spec& spec, int layer);

// A rank's model as host tensors (its slices of the master TP = 1 tensors, which are defined
// element by element by a counter-based hash of (seed, tensor, index): any slice is generated
// directly, and TP = P slices assemble exactly into TP = 1). Generation uses `threads` threads.
struct HostModel {
  std::vector<HostTensor> storage;
  ModelWeights weights;  // views into storage
};
HostModel make_host_model(const Spec& spec, int rank, int world, int threads);

// The master (TP = 1) values of the projection weights as floats (dequantized for fp8), for the
// independent reference: [W, hidden] qkv rows, [hidden, QH*HD] o_proj, MLP [I, H] x2, [H, I].
// A dense layer: qkv rows [q | k | v], no index norms, its dense MLP.
struct MasterLayer {
  int layer = -1;
  std::vector<float> qkv, o_proj, gate, up, down;
  bool has_moe = false;
  MasterMoe moe;
  bool dense = false;
  MasterDenseMlp dense_mlp;
  std::vector<float> q_norm, k_norm, iq_norm, ik_norm, input_norm, post_norm;
};
// layer_index counts the run's layers (spec.first_layer() + layer_index is the layer id).
MasterLayer make_master_layer(const Spec& spec, int layer_index, int threads);

// One decode step's host metadata (`batch` views the tensors) and its input embeddings.
struct Step : StepMeta {
  std::vector<uint16_t> hidden_in;  // [rows, hidden] bf16
};
Step make_step(const Spec& spec, int step);
std::vector<Step> make_steps(const Spec& spec);

}  // namespace m3msa::testkit::demo
