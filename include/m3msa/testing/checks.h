// The comparison rules of the test kit: the checks the demo, replay and soak run (results that say
// what was checked, how many items, how many failed, and the worst or first failing element with
// its coordinates), the near-tie rule for selections of another backend, and value comparisons
// in ulps or within an absolute + relative tolerance. Used by the tests and the CLI alike.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "m3msa/ops.h"

namespace m3msa::testkit {

// Tolerances, in units of the output dtype.
// CPU reference vs itself in another summation order (sparse vs dense attention): fp32 sums in a
// different order flip at most the last bf16 bit, rarely two.
inline constexpr double kSameBackendUlps = 2.0;
// Another backend vs the CPU reference (different accumulation hardware and order).
inline constexpr double kCrossBackendUlps = 4.0;
// Errors are measured in ulps at max(|reference|, RMS of the reference tensor, kUlpFloor): an
// output near zero comes from cancellation of terms of the tensor's typical size, and its error
// scales with those terms, not with the result (a relative measure there would mean nothing).
inline constexpr float kUlpFloor = 1.0f / 1024.0f;
// Near-tie rule for selections of another backend (docs/spec.md section 4): a block may be swapped
// with another only when both reference scores are within this (relative to max(1, |S_k|)) of
// the k-th selected score.
inline constexpr double kSelectionTieTolerance = 1e-3;

// The near-tie rule: `score` may stand in for the k-th selected score `kth` when it is within
// tolerance * max(1, |kth|) of it. NaN on either side is never a tie.
inline bool near_tie(double score, double kth, double tolerance = kSelectionTieTolerance) {
  return std::fabs(score - kth) <= tolerance * std::max(1.0, std::fabs(kth));
}

struct CheckResult {
  std::string name;     // what was checked (one line)
  int64_t checked = 0;  // items checked
  int64_t failed = 0;   // items that failed
  std::string detail;   // the worst / first failure, or the worst error when all passed
  double worst = 0.0;   // worst error seen (ulps for value comparisons)

  bool passed() const { return failed == 0; }
  // Accumulates another result of the same check (keeps the first failure's detail).
  void merge(const CheckResult& other);
};

// Every (row, head) list of topk_idx ([rows, H, k] i32, host) is well formed: live rows hold
// min(k, nb) distinct visible block ids, the forced blocks first (ascending), then -1; dead rows
// hold only -1.
CheckResult check_selections_wellformed(const SparseConfig& config, const BatchMeta& batch,
                                        const TensorView& topk_idx);

// Recomputes the block scores (cpu::score_blocks) and checks every list of args.topk_idx against
// the top-k of the sort keys of docs/spec.md section 4, or against `want` ([rows, H, k] i32) when
// given. tie_tolerance 0: the exact list; > 0: the same set up to swaps of blocks whose reference
// scores are within the tolerance of the k-th score (kSelectionTieTolerance).
CheckResult check_selections_vs_scores(const SparseConfig& config, const IndexerArgs& args,
                                       double tie_tolerance, int threads,
                                       const TensorView& want = TensorView{});

// Element-wise comparison of two host tensors of one shape and dtype (bf16, fp8_e4m3 or f32), the
// error in ulps of the dtype (see kUlpFloor); NaN and inf must sit at the same positions. Elements
// above max_ulps fail. `include` (optional) picks the flat indices to compare.
CheckResult compare_values(const std::string& name, const TensorView& got, const TensorView& want,
                           double max_ulps, const std::function<bool(int64_t)>& include = nullptr);

// Bit-exact comparison (any dtype); reports the first mismatch with its coordinates.
CheckResult compare_exact(const std::string& name, const TensorView& got, const TensorView& want);

// "[2, 17, 5]" for flat index i of a tensor of `view`'s shape.
std::string coordinates(const TensorView& view, int64_t index);

// One system's selections ([rows, H, k] i32, `got`) against an oracle's (`want`) under the
// near-tie rule, with `scores` ([rows, H, max_blocks] f32) the oracle's block scores. A (row,
// head) list fails when it is malformed (an entry outside [0, nb), a repeat, not -1 past min(k,
// nb)) or when its set differs from the oracle's by a block that is not a near tie of the
// oracle's lowest non-forced selected score. Rows whose lists differ by near ties only are marked
// in `swapped` (sized rows). Returns the failing lists; `first` describes the first.
int64_t compare_selection_near_tie(const SparseConfig& sc, const std::vector<int32_t>& got,
                                   const std::vector<int32_t>& want, const HostTensor& scores,
                                   const BatchMeta& batch, std::vector<bool>& swapped,
                                   std::string& first);

// Values compared within |got - want| <= abs_tol + rel_tol |want| (bf16 [rows, cols]); any
// non-finite value fails. Accumulates over calls.
struct ValueCheck {
  int64_t checked = 0;
  int64_t differ = 0;  // not bit-identical (within the tolerance or not)
  int64_t bad = 0;
  double worst = 0.0;  // largest |got - want| / (abs_tol + rel_tol |want|) of finite pairs
  std::string first;   // the first failure
};
// Rows marked in `skip` (empty: none) are left out; `what` names the tensor in `first`.
void compare_close(ValueCheck& check, const std::vector<uint16_t>& got,
                   const std::vector<uint16_t>& want, int64_t rows, int64_t cols, double abs_tol,
                   double rel_tol, const std::vector<bool>& skip, const std::string& what);

// Per row (bf16 [rows, cols]): relative L2 error <= l2_tol and every element within abs_cap and
// finite where the other is; for outputs that amplify bf16 rounding flips (an MLP, the MoE).
// A failing row counts once in `bad`; `worst` is the worst L2 ratio / l2_tol.
void compare_rows_l2(ValueCheck& check, const std::vector<uint16_t>& got,
                     const std::vector<uint16_t>& want, int64_t rows, int64_t cols, double l2_tol,
                     double abs_cap, const std::vector<bool>& skip, const std::string& what);

}  // namespace m3msa::testkit
