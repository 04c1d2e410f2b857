// Seeded mixture-of-experts weights for tests and the demo (docs/spec.md section 8): the whole
// model's (TP = 1) router and experts, bf16-exact or MXFP8 (codes + scales kept, so a rank's slice
// binds the very bytes the master was quantized to), each rank's slice as LayerWeights binds it,
// and a double-precision composition of the MoE (the oracle's).
#pragma once

#include <cstdint>
#include <vector>

#include "m3msa/config.h"
#include "m3msa/runtime.h"
#include "m3msa/tensor.h"

namespace m3msa::testkit {

// One weight stack ([E,] rows, K): its values (exact in the storage format) and, for MXFP8, the
// e4m3 codes and the e8m0 scales per 32 elements along K.
struct MoeMatrix {
  bool fp8 = false;
  std::vector<int64_t> shape;
  std::vector<float> value;
  std::vector<uint8_t> codes, scales;
};

struct MasterMoe {
  std::vector<float> router;        // [E, hidden]
  std::vector<float> bias;          // [E]
  MoeMatrix w13, w2;                // [E, 2 I, hidden] rows [gate | up], [E, hidden, I]
  MoeMatrix shared_w13, shared_w2;  // [2 S, hidden], [hidden, S]; empty when S = 0
};

// Draws from SplitMix64(seed) only (other streams of a model stay as they were).
MasterMoe make_master_moe(const ModelConfig& m, uint64_t seed, bool fp8);

// Rank `rank` of `world`: its gate and up rows [rank I_r, (rank + 1) I_r) of every expert and its
// columns of w2 (MXFP8: the same codes and the scales of those groups; I_r % 32 == 0), the shared
// expert alike, the router whole. Tensors are appended to `storage` (keep it alive).
void bind_moe(const ModelConfig& m, const MasterMoe& moe, int rank, int world,
              std::vector<HostTensor>& storage, LayerWeights& layer);

// The MoE of one bf16 row x ([hidden]) in double: route by s + bias (ties: lower id), experts
// with g, u and the activation rounded to bf16 where docs/spec.md section 8 rounds, the sum in
// double. Returns the fp32 partial of the whole model (before the final bf16 rounding).
std::vector<double> moe_double(const ModelConfig& m, const MasterMoe& moe, const uint16_t* x);

// A dense layer's MLP (docs/spec.md section 8, "Dense MLP"): one expert of the whole width
// model.dense_intermediate D, bf16-exact or MXFP8. w13 [2 D, hidden] rows [gate | up], w2
// [hidden, D]. Draws from SplitMix64(seed) only.
struct MasterDenseMlp {
  MoeMatrix w13, w2;
};
MasterDenseMlp make_master_dense_mlp(const ModelConfig& m, uint64_t seed, bool fp8);

// Rank `rank` of `world`: its D / world gate and up rows and its columns of w2 (as bind_moe).
ExpertWeights bind_dense_mlp(const ModelConfig& m, const MasterDenseMlp& mlp, int rank, int world,
                             std::vector<HostTensor>& storage);

// The dense MLP of one bf16 row x in double, rounded where docs/spec.md section 8 rounds: the fp32
// output of the whole model before the final bf16 rounding.
std::vector<double> dense_mlp_double(const ModelConfig& m, const MasterDenseMlp& mlp,
                                     const uint16_t* x);

}  // namespace m3msa::testkit
