// Invariants of kernel building blocks that the end-to-end tests would only show as speed or as
// rare bits: the attention's warp merge reads and writes shared memory without bank conflicts
// (a host model of the 16-byte accesses, both accumulator layouts), the balanced attention plan's
// shares cover every unit once and its parts meet in distinct slots, and the streamed MXFP8 tile's
// block scale folded into the e4m3 widening gives the bits of the widening then the scale multiply
// for every byte and every code it takes (on the device).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "cuda/attention_kernel.cuh"
#include "cuda/common.cuh"
#include "cuda/gemm_kernel.cuh"

namespace m3msa {
namespace {

namespace attn = cuda::attention;

// Shared-memory wavefronts of one warp's 16-byte accesses (unit = 16-byte index): the warp is
// served a quarter (8 lanes, 128 bytes) at a time; distinct units of a quarter in the same bank
// group (unit % 8) each take a wavefront.
int wavefronts(const std::vector<int>& units) {
  int total = 0;
  for (int quarter = 0; quarter < 4; ++quarter) {
    std::map<int, std::set<int>> by_group;
    for (int lane = 8 * quarter; lane < 8 * quarter + 8; ++lane) {
      by_group[units[lane] % 8].insert(units[lane]);
    }
    std::size_t worst = 0;
    for (const auto& [group, distinct] : by_group) worst = std::max(worst, distinct.size());
    total += static_cast<int>(worst);
  }
  return total;
}

// The stores of the warp merge as attention_sparse_kernel issues them: lane (g, c) stores, for
// accumulator column e and tiles t0 .. t0 + 3, 4 consecutive dims of head g + 8 (e >> 1).
template <bool kFp8>
void expect_conflict_free_merge() {
  for (int t0 = 0; t0 < 16; t0 += 4) {
    for (int e = 0; e < 4; ++e) {
      std::vector<int> units(32);
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2;
        const int c = lane & 3;
        const int head = g + 8 * (e >> 1);
        const int n = 2 * c + (e & 1);
        const int dim = attn::out_dim<kFp8>(t0, n);
        // The 4 tiles of the store are 4 consecutive dims.
        for (int i = 1; i < 4; ++i) ASSERT_EQ(attn::out_dim<kFp8>(t0 + i, n), dim + i);
        ASSERT_EQ(dim % 4, 0);
        units[lane] = head * attn::kMergeUnits + attn::merge_unit(dim / 4);
      }
      EXPECT_EQ(wavefronts(units), 4) << "fp8 " << kFp8 << " store t0 " << t0 << " column " << e;
    }
  }
  // The loads: thread t of the CTA reads head t / 8, unit (t % 8) + 8 j of one warp's partial.
  for (int warp = 0; warp < attn::kWarps; ++warp) {
    for (int j = 0; j < 4; ++j) {
      std::vector<int> units(32);
      for (int lane = 0; lane < 32; ++lane) {
        const int tid = 32 * warp + lane;
        units[lane] = (tid >> 3) * attn::kMergeUnits + attn::merge_unit((tid & 7) + 8 * j);
      }
      EXPECT_EQ(wavefronts(units), 4) << "fp8 " << kFp8 << " load warp " << warp << " j " << j;
    }
  }
  // merge_unit permutes a head's 32 units (no two dims share a slot).
  std::set<int> slots;
  for (int u = 0; u < attn::kHeadDim / 4; ++u) slots.insert(attn::merge_unit(u));
  EXPECT_EQ(slots.size(), static_cast<std::size_t>(attn::kHeadDim / 4));
  EXPECT_LT(*slots.rbegin(), attn::kMergeUnits);
}

TEST(AttentionWarpMerge, SharedMemoryAccessesAreConflictFree) {
  expect_conflict_free_merge<false>();
  expect_conflict_free_merge<true>();
}

// The balanced attention plan's shares, walked as the kernel walks them (each CTA's segments from
// its share's first entry on): every unit's entries covered once, in order, by consecutive CTAs;
// the parts of a cut unit agree on their count, first slot and counter, part i sits in the slot
// the merging CTA reads for it, no two parts share a slot (< 2 per CTA) or two cut units a
// counter; beyond one wave of units (the plan's only use) a unit has at most two parts.
TEST(AttentionBalancedPlan, SharesCoverEveryUnitOnce) {
  struct Part {
    int64_t cta;
    attn::UnitWork w;
  };
  uint64_t state = 12345;
  auto next = [&](int64_t n) {  // uniform in [0, n)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<int64_t>((state >> 33) % static_cast<uint64_t>(n));
  };
  for (int trial = 0; trial < 3000; ++trial) {
    const int64_t ctas = 1 + next(400);
    const int topk = 1 + static_cast<int>(next(40));
    const int64_t units = trial % 2 == 0 ? ctas + 1 + next(2 * ctas + 5) : 1 + next(3 * ctas + 5);
    const int64_t items = units * topk;
    if (items < ctas) continue;  // the launcher never plans an empty share
    const std::string what = std::to_string(units) + " units x " + std::to_string(topk) + " on " +
                             std::to_string(ctas) + " CTAs";
    std::vector<std::vector<Part>> parts(static_cast<size_t>(units));
    for (int64_t cta = 0; cta < ctas; ++cta) {
      const int64_t hi = (cta + 1) * items / ctas;
      for (int64_t at = cta * items / ctas; at < hi;) {
        const attn::UnitWork w = attn::balanced_segment(at, items, topk, cta, ctas);
        ASSERT_LT(w.first, w.last) << what;
        ASSERT_EQ(at, w.unit * topk + w.first) << what;
        parts[static_cast<size_t>(w.unit)].push_back(Part{cta, w});
        at = w.unit * topk + w.last;
      }
    }
    std::set<int64_t> slots;
    std::set<int64_t> counters;
    for (int64_t u = 0; u < units; ++u) {
      const std::vector<Part>& ps = parts[static_cast<size_t>(u)];
      ASSERT_FALSE(ps.empty()) << what << ": unit " << u;
      EXPECT_EQ(ps.front().w.first, 0) << what;
      EXPECT_EQ(ps.back().w.last, topk) << what;
      for (size_t i = 0; i < ps.size(); ++i) {
        const attn::UnitWork& w = ps[i].w;
        EXPECT_EQ(w.parts, static_cast<int>(ps.size())) << what << ": unit " << u;
        if (i > 0) {
          EXPECT_EQ(w.first, ps[i - 1].w.last) << what;
          EXPECT_EQ(ps[i].cta, ps[i - 1].cta + 1) << what;
        }
        if (ps.size() == 1) continue;
        EXPECT_EQ(w.slot0, ps[0].w.slot0) << what;
        EXPECT_EQ(w.counter, ps[0].cta) << what;
        const int64_t read_at = i == 0 ? w.slot0 : 2 * w.counter + 2 * static_cast<int64_t>(i);
        EXPECT_EQ(w.slot, read_at) << what << ": unit " << u << " part " << i;
        EXPECT_TRUE(slots.insert(w.slot).second) << what << ": slot " << w.slot;
        EXPECT_LT(w.slot, 2 * ctas) << what;
      }
      if (ps.size() > 1) EXPECT_TRUE(counters.insert(ps[0].w.counter).second) << what;
      if (units > ctas) EXPECT_LE(ps.size(), 2u) << what;
    }
  }
}

// out[code][byte] = {folded lo, folded hi, two-step lo, two-step hi, folded nan bits, two-step
// nan bits} for the 4 bytes byte, byte ^ 0x80, byte + 1, byte ^ 0x01 widened at once.
__global__ void fold_kernel(uint32_t* out) {
  const uint32_t code = blockIdx.x;
  const uint32_t b = threadIdx.x;
  const uint32_t four = b | ((b ^ 0x80u) << 8) | (((b + 1u) & 0xFFu) << 16) | ((b ^ 0x01u) << 24);
  uint32_t lo_f, hi_f, nan_f = 0;
  cuda::gemm::fp8x4_to_bf16x4(four, lo_f, hi_f, nan_f, cuda::gemm::mx_fold_multiplier(code));
  uint32_t lo, hi, nan = 0;
  cuda::gemm::fp8x4_to_bf16x4(four, lo, hi, nan);
  const uint32_t scale = cuda::gemm::e8m0_to_bf16x2(code);
  lo = cuda::gemm::scale_bf16x2(lo, scale);
  hi = cuda::gemm::scale_bf16x2(hi, scale);
  uint32_t* o = out + (static_cast<int64_t>(code) * 256 + b) * 6;
  o[0] = lo_f;
  o[1] = hi_f;
  o[2] = lo;
  o[3] = hi;
  o[4] = nan_f & 0x80808080u;
  o[5] = nan & 0x80808080u;
}

TEST(Mxfp8FoldedScale, EveryByteAndCodeGivesTheTwoStepBits) {
  M3MSA_REQUIRE_GPU();
  constexpr int kCodes = static_cast<int>(cuda::gemm::kMxFoldMaxCode) + 1;
  const std::size_t n = static_cast<std::size_t>(kCodes) * 256 * 6;
  cuda::DeviceBuffer dev(n * sizeof(uint32_t));
  fold_kernel<<<kCodes, 256>>>(static_cast<uint32_t*>(dev.data()));
  CUDA_CHECK_LAUNCH();
  std::vector<uint32_t> host(n);
  CUDA_CHECK(cudaMemcpy(host.data(), dev.data(), n * sizeof(uint32_t), cudaMemcpyDeviceToHost));
  int bad = 0;
  std::string first;
  for (int code = 0; code < kCodes; ++code) {
    for (int b = 0; b < 256; ++b) {
      const uint32_t* o = host.data() + (static_cast<std::size_t>(code) * 256 + b) * 6;
      // NaN bytes carry a placeholder the tile replaces by NaN: compare their flags, not values.
      const uint32_t nan = o[5];
      const uint32_t lo_mask =
          ((nan & 0x80u) ? 0u : 0xFFFFu) | ((nan & 0x8000u) ? 0u : 0xFFFF0000u);
      const uint32_t hi_mask =
          ((nan & 0x800000u) ? 0u : 0xFFFFu) | ((nan & 0x80000000u) ? 0u : 0xFFFF0000u);
      const bool same = o[4] == o[5] && (o[0] & lo_mask) == (o[2] & lo_mask) &&
                        (o[1] & hi_mask) == (o[3] & hi_mask);
      if (!same && bad++ == 0) {
        first = "code " + std::to_string(code) + " byte " + std::to_string(b);
      }
    }
  }
  EXPECT_EQ(bad, 0) << "first: " << first;
}

}  // namespace
}  // namespace m3msa
