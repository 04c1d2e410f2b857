// The mixture of experts of M3 and the dense MLP (docs/spec.md section 8): argument structs,
// validation, the MXFP8 weight format and the CPU reference (the oracle of every other backend).
//
// Numerics (the contract the GPU path approximates):
//  - router: fp32 logits (k ascending), fp32 sigmoid, pick by s + bias (ties: lower expert id,
//    NaN keys last), weights routed_scaling * s_i / sum of the picked s in fp32;
//  - expert: g and u are fp32 sums rounded to bf16, the SwiGLU-OAI activation in fp32 rounded to
//    bf16, the down projection an fp32 sum (j ascending), never rounded before the TP reduce;
//  - one rank's partial sum_i w_i y_i + y_shared in fp32 (pick order, shared last).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "m3msa/config.h"
#include "m3msa/dtype.h"
#include "m3msa/tensor.h"

namespace m3msa {

// MXFP8: one e8m0 scale per this many consecutive elements along K.
inline constexpr int kMxfp8Block = 32;

// 2^(code - 127); code 255 is NaN (the OCP e8m0 format).
M3MSA_HD float e8m0_to_float(uint8_t code) {
  if (code == 0xFF) return bits_float(0x7FC00000u);
  // code 0 is 2^-127, an fp32 subnormal; every other code is a normal power of two.
  if (code == 0) return bits_float(0x00400000u);
  return bits_float(static_cast<uint32_t>(code) << 23);
}

// The router's pick order as one unsigned key, the largest picked first: larger keys first, NaN
// keys after every number, equal keys (-0 and +0 equal) by the lower expert id (0 <= id < 2^32 -
// 1). One max per candidate instead of the rule's branches (the GPU top-k's warp arg-max).
M3MSA_HD uint64_t moe_pick_order(float key, int id) {
  const uint32_t u = float_bits(key == 0.0f ? 0.0f : key);
  const uint32_t ord = key != key ? 0u : ((u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u));
  return (static_cast<uint64_t>(ord) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(id));
}

// The expert id a pick-order key was made for (moe_pick_order's low word, inverted).
M3MSA_HD int moe_pick_id(uint64_t order) {
  return static_cast<int>(0xFFFFFFFFu - static_cast<uint32_t>(order));
}

// The weights of one SwiGLU-OAI expert set: the routed experts (with a leading E axis) or one
// expert (the shared expert, the dense MLP: no E axis). I = the intermediate on this rank.
//   w13       [(E,) 2 I, hidden] bf16 | fp8_e4m3, rows [gate | up]
//   w13_scale [(E,) 2 I, hidden / 32] u8 e8m0, MXFP8 only
//   w2        [(E,) hidden, I] bf16 | fp8_e4m3
//   w2_scale  [(E,) hidden, I / 32] u8 e8m0, MXFP8 only
struct ExpertWeights {
  TensorView w13;
  TensorView w13_scale;
  TensorView w2;
  TensorView w2_scale;
  bool defined() const { return w13.defined() || w2.defined(); }
};

// The MoE of one sparse layer on one rank. rows = x.shape[0].
struct MoeArgs {
  TensorView x;              // [rows, hidden] bf16: the post-attention-norm output
  TensorView router_weight;  // [E, hidden] f32
  TensorView router_bias;    // [E] f32 e_score_correction_bias (not given: zeros)
  ExpertWeights experts;     // routed: [E, 2 I, hidden], [E, hidden, I] (+ scales)
  ExpertWeights shared;      // [2 S, hidden], [hidden, S]; required iff shared_intermediate > 0
  TensorView out;            // [rows, hidden] f32 out: this rank's partial (before the TP reduce)
  TensorView topk_ids;       // optional [rows, k] i32 out: the picked experts, pick order
  TensorView topk_weights;   // optional [rows, k] f32 out: their weights
};

// A dense SwiGLU-OAI MLP (the dense layers): the expert function with weight 1.
struct DenseMlpArgs {
  TensorView x;       // [rows, hidden] bf16
  ExpertWeights mlp;  // [2 D, hidden], [hidden, D] (+ scales); D = dense_intermediate / P
  TensorView out;     // [rows, hidden] f32 out: this rank's partial
  float activation_limit = 7.0f;
};

// Host-side validation (dtypes, shapes, contiguity, device when given): throws kInvalidArgument
// naming the tensor and the expected and found value.
void validate(const MoeConfig& config, const MoeArgs& args);
void validate(const DenseMlpArgs& args);
// One expert set's tensors: `experts` 0 for one expert (no E axis), else E; `intermediate` its I;
// `name` prefixes every message ("experts", "shared", ...). Device checked when `device` given.
void validate_expert_weights(const ExpertWeights& w, const char* name, int64_t experts,
                             int64_t intermediate, int64_t hidden, const Device* device = nullptr);

namespace cpu {

// The router alone: ids [rows, k] i32 and weights [rows, k] f32 (docs/spec.md section 8).
void moe_route(const MoeConfig& config, const TensorView& x, const TensorView& router_weight,
               const TensorView& router_bias, TensorView topk_ids, TensorView topk_weights,
               int threads = 0);
// Router + routed experts + shared expert: args.out = this rank's fp32 partial.
void moe(const MoeConfig& config, const MoeArgs& args, int threads = 0);
// The dense MLP: args.out = this rank's fp32 partial.
void dense_mlp(const DenseMlpArgs& args, int threads = 0);

// MXFP8 quantization of rows of K elements (K % 32 == 0): codes [rows, K] e4m3 and scales
// [rows, K / 32] e8m0; the scale of a group is floor(log2(amax)) - 8 (+127, clamped to [0, 254];
// amax 0 or not finite: see docs/spec.md section 8).
void quantize_mxfp8(const float* values, int64_t rows, int64_t k, uint8_t* codes, uint8_t* scales);
// The decoded value of element `i` of a row: code * 2^(scale - 127).
inline float mxfp8_value(const uint8_t* codes, const uint8_t* scales, int64_t i) {
  return fp8e4m3_to_float(codes[i]) * e8m0_to_float(scales[i / kMxfp8Block]);
}

}  // namespace cpu
}  // namespace m3msa
