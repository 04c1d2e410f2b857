// The mixture of experts' bytes a decode step reads: the floors of `bench moe` and `bench layer`,
// and the rank shapes both accept.
#pragma once

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <string_view>

#include "flags.h"
#include "m3msa/config.h"
#include "m3msa/moe.h"

namespace m3msa::bench {

// One SwiGLU expert's (or the dense MLP's) w13 [2 I, H] + w2 [H, I]: bf16, or MXFP8 codes plus
// one e8m0 scale byte per 32 elements.
inline int64_t expert_bytes(int64_t hidden, int64_t inter, bool fp8) {
  const int64_t elems = 3 * hidden * inter;
  return fp8 ? elems + elems / kMxfp8Block : 2 * elems;
}

// The expected number of distinct experts `tokens` uniformly routed rows pick:
// E (1 - (1 - k / E)^tokens).
inline double expected_distinct_experts(const MoeConfig& c, int tokens) {
  const double e = c.num_experts;
  return e * (1.0 - std::pow(1.0 - c.experts_per_token / e, tokens));
}

// A TP size P (a --tp or --rank-of value) whose FFN shards M3 has: P divides the expert and the
// dense MLP intermediates into whole MXFP8 blocks; a usage error naming `flag` otherwise.
inline void require_ffn_split(std::string_view flag, int P) {
  const ModelConfig m;
  require_flag(m.moe_intermediate % P == 0 && m.dense_intermediate % P == 0 &&
                   (m.moe_intermediate / P) % kMxfp8Block == 0 &&
                   (m.dense_intermediate / P) % kMxfp8Block == 0,
               flag,
               fmt::format("{} must divide the expert intermediate {} and the dense MLP {} into "
                           "multiples of {} (e.g. 1, 2, 4, 8)",
                           P, m.moe_intermediate, m.dense_intermediate, kMxfp8Block));
}

}  // namespace m3msa::bench
