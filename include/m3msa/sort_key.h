// The candidate sort key of docs/spec.md section 4, shared bit for bit by every backend.
//   bits 63..32  score image: ordered(S), 0xFFFFFFFF for a forced block, 0 for NaN
//   bits 31..24  generation tag (0 except on the wire of the context-parallel exchange)
//   bits 23..0   0xFFFFFF - block (equal scores prefer the lower block id)
// Bigger is better; 0 means "no candidate".
#pragma once

#include <cstdint>

#include "m3msa/dtype.h"

namespace m3msa {

inline constexpr uint64_t kNoCandidate = 0;
inline constexpr uint32_t kForcedImage = 0xFFFFFFFFu;
inline constexpr int64_t kMaxBlockId = 0xFFFFFE;  // 2^24 - 2
inline constexpr uint64_t kTagMask = 0xFF000000ull;

// Monotone map of an fp32 score onto uint32 (NaN -> 0, -0.0 -> +0.0).
M3MSA_HD uint32_t ordered_score(float score) {
  uint32_t u = float_bits(score);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0u;  // NaN ranks below every number
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? (u ^ 0xFFFFFFFFu) : (u | 0x80000000u);
}

M3MSA_HD uint64_t make_key(uint32_t image, uint32_t block) {
  return (static_cast<uint64_t>(image) << 32) | static_cast<uint64_t>(0xFFFFFFu - block);
}

M3MSA_HD uint64_t scored_key(float score, uint32_t block) {
  return make_key(ordered_score(score), block);
}

M3MSA_HD uint64_t forced_key(uint32_t block) {
  return make_key(kForcedImage, block);
}

// Block id of a non-empty key (tag bits ignored).
M3MSA_HD int32_t key_block(uint64_t key) {
  return static_cast<int32_t>(0xFFFFFFu - static_cast<uint32_t>(key & 0xFFFFFFull));
}

M3MSA_HD uint32_t key_tag(uint64_t key) {
  return static_cast<uint32_t>((key >> 24) & 0xFFu);
}

M3MSA_HD uint64_t with_tag(uint64_t key, uint32_t tag) {
  return (key & ~kTagMask) | (static_cast<uint64_t>(tag & 0xFFu) << 24);
}

// The wire tag of generation g: never 0, so a zeroed slot never looks like an arrival.
M3MSA_HD uint32_t generation_tag(uint32_t generation) {
  return generation % 255u + 1u;
}

// Whether block b of a row with nb visible blocks is forced (docs/spec.md section 4).
M3MSA_HD bool is_forced_block(int64_t block, int64_t nb, int init_blocks, int local_blocks) {
  return block < init_blocks || block >= nb - local_blocks;
}

}  // namespace m3msa
