// The digest a rank stores next to its payload in a barrier-free exchange (the CP nominations,
// the peer all-reduce), so a peer that made another call is named instead of merged: FNV-1a over
// the 8 bytes of each value, in order.
#pragma once

#include <cstdint>
#include <initializer_list>

namespace m3msa {

inline uint32_t call_digest_of(std::initializer_list<int64_t> values) {
  uint32_t h = 2166136261u;
  for (int64_t v : values) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint32_t>((static_cast<uint64_t>(v) >> (8 * i)) & 0xFFu);
      h *= 16777619u;
    }
  }
  return h;
}

}  // namespace m3msa
