// Small runtime models for tests: seeded master (TP = 1) weights and caches, each rank's slice of
// them as the runtime binds it, the head placement under TP, and decode-step metadata.
#pragma once

#include <cstdint>
#include <vector>

#include "m3msa/batch.h"
#include "m3msa/config.h"
#include "m3msa/runtime.h"
#include "m3msa/tensor.h"
#include "m3msa/testing/moe_model.h"
#include "m3msa/testing/random.h"

namespace m3msa::testkit {

// hidden 256, 4 q heads / 2 KV heads of 32, blocks of 16 tokens, top-4: contexts of a few
// hundred tokens already need a real selection. Layer 0 is dense, layers 1 and 2 are sparse.
ModelConfig small_model(int intermediate = 128);
RuntimeConfig small_config(int intermediate = 128);

// One layer's TP = 1 parameters (bf16-exact floats, row-major [out, in]) and the initial contents
// of its caches. A dense layer (dense = true) has no index part (wiq, wik, the index norms and the
// index cache are empty) and the dense MLP as its FFN.
struct MasterLayer {
  int layer = -1;
  bool dense = false;
  MasterDenseMlp dense_mlp;                 // dense layers only
  std::vector<float> wq, wk, wv, wiq, wik;  // [QH*HD | KVH*HD | KVH*HD | IH*ID | ID, hidden]
  std::vector<float> q_norm, k_norm, iq_norm, ik_norm, input_norm, post_norm;
  std::vector<float> wo;  // [hidden, QH*HD]
  bool mlp = false;
  std::vector<float> gate, up, down;  // [I, hidden], [I, hidden], [hidden, I]
  bool has_moe = false;               // the layer's FFN is the mixture of experts below
  MasterMoe moe;
  HostTensor kv_cache;     // [pages, KVH, 2, bs, HD] bf16
  HostTensor index_cache;  // [pages, bs, ID] bf16
};

struct MasterModel {
  ModelConfig config;
  int64_t pages = 0;
  std::vector<MasterLayer> layers;  // one per sparse layer (and dense layer, if added), ascending
};

// Every value drawn in order from SplitMix64(seed) (random_values); caches are random
// everywhere (so a read past a context is visible).
MasterModel make_master(const ModelConfig& m, int64_t pages, uint64_t seed, bool mlp_on_last_layer);

// Puts the dense layers [0, first_sparse_layer) in front of model.layers, drawn from
// SplitMix64(seed) (the sparse layers' values stay as they were), with bf16-exact or MXFP8 MLPs.
void add_dense_layers(MasterModel& model, uint64_t seed, bool fp8_mlp);

// Appends rows [first, first + count) of a row-major [rows, cols] matrix.
void append_rows(std::vector<float>& out, const std::vector<float>& w, int64_t cols, int64_t first,
                 int64_t count);

// Columns [first, first + count) of a row-major [rows, cols] matrix.
std::vector<float> columns(const std::vector<float>& w, int64_t rows, int64_t cols, int64_t first,
                           int64_t count);

// The fused projection of rank r as float rows [q | k | v | index_q | index_k]; with context
// parallelism every rank carries every index_q head.
std::vector<float> rank_qkv_rows(const ModelConfig& m, const MasterLayer& w, int rank, int world,
                                 bool context_parallel = false);

// What one rank binds: owning storage plus the LayerWeights views into it. The caches are fresh
// copies of the master caches (this rank's KV heads), so every run starts from the same state.
struct RankModel {
  std::vector<HostTensor> storage;
  std::vector<HostTensor> kv_caches;     // per layer of the master
  std::vector<HostTensor> index_caches;  // per layer of the master (empty for a dense layer)
  ModelWeights weights;

  TensorView keep(HostTensor t) {
    storage.push_back(std::move(t));
    return storage.back().view();
  }
};

// fp8_qkv: the fused projection as fp8 e4m3 with per-output-channel scales (max |w| / 448).
// context_parallel: the projection as the CP runtime binds it (every index_q head).
RankModel make_rank_model(const MasterModel& master, int rank, int world, bool fp8_qkv = false,
                          bool context_parallel = false);

// Pages x KV heads of rank `rank` of `world` whose K / V tile differs from the TP = 1 cache's
// tile of the same global head ([pages, KVH, 2, bs, HD] bf16 both): 0 when the rank wrote
// exactly what TP = 1 wrote.
int64_t kv_tiles_differing(const ModelConfig& m, int rank, int world, const HostTensor& rank_kv,
                           const HostTensor& one_kv);

// One decode step's metadata. Request r owns pages perm[r * max_blocks + b] for logical block b
// (a different shuffle per cache, so mixing the tables up shows). A request of seq_len 0 is
// padding (dead rows: position and slots -1).
struct StepMeta {
  HostTensor seq_lens, index_table, kv_table, slots, index_slots, positions;
  BatchMeta batch;
};

StepMeta make_step(const std::vector<int32_t>& seq_lens, int q_len, int block_size,
                   int64_t max_blocks, const std::vector<int32_t>& index_perm,
                   const std::vector<int32_t>& kv_perm);

}  // namespace m3msa::testkit
