// The NaN rule of docs/spec.md section 4 on the CPU reference and on the CPU model of the
// context-parallel exchange (P = 2 and 4, which must select exactly what one rank selects):
// a block with a NaN dot product among its visible tokens scores NaN and ranks below every number
// but above "no candidate"; a NaN after a row's position changes nothing; dead rows are all -1.
#include <gtest/gtest.h>

#include "m3msa/cp_model.h"
#include "m3msa/cpu_reference.h"
#include "nan_score_case.h"

namespace m3msa {
namespace {

using nantest::check_masked_nan;
using nantest::check_visible_nan;

HostTensor reference_select(const SyntheticCase& c) {
  HostTensor topk(DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk});
  topk.fill_bytes(0x5A);  // poison: every entry must be written
  cpu::select_topk(c.config, c.indexer_args(topk.view()), 2);
  return topk;
}

nantest::SelectFn cp_select(int world_size) {
  return [world_size](const SyntheticCase& c) {
    CpConfig cp;
    cp.world_size = world_size;
    cp.max_rows = static_cast<int>(c.num_rows());
    CpuCpGroup group(c.config, cp);
    HostTensor topk(DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk});
    topk.fill_bytes(0x5A);
    cp_select_all(group, 0, c.indexer_args(topk.view()));
    return topk;
  };
}

TEST(NanScore, ReferenceRanksANanBlockBelowEveryNumber) {
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    for (int local_blocks : {0, 1}) {
      for (BatchKind kind : {BatchKind::kDecode, BatchKind::kPrefill}) {
        check_visible_nan(reference_select, dtype, local_blocks, kind);
      }
    }
  }
}

TEST(NanScore, ReferenceIgnoresANanAfterThePosition) {
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    for (int local_blocks : {0, 1}) {
      for (BatchKind kind : {BatchKind::kDecode, BatchKind::kPrefill}) {
        check_masked_nan(reference_select, dtype, local_blocks, kind);
      }
    }
  }
}

// An fp8 index_q beside the fp8 cache follows the same rule.
TEST(NanScore, ReferenceWithAnFp8QueryFollowsTheRule) {
  for (int local_blocks : {0, 1}) {
    for (BatchKind kind : {BatchKind::kDecode, BatchKind::kPrefill}) {
      check_visible_nan(reference_select, DType::kFP8E4M3, local_blocks, kind, DType::kFP8E4M3);
      check_masked_nan(reference_select, DType::kFP8E4M3, local_blocks, kind, DType::kFP8E4M3);
    }
  }
}

// The scores of a shard are those of one rank, so the NaN block is ranked the same on every
// shard and in the merge.
TEST(NanScore, CpModelSelectsWhatOneRankSelects) {
  for (int world_size : {2, 4}) {
    SCOPED_TRACE(testing::Message() << "P = " << world_size);
    for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
      for (int local_blocks : {0, 1}) {
        check_visible_nan(cp_select(world_size), dtype, local_blocks, BatchKind::kDecode);
        check_masked_nan(cp_select(world_size), dtype, local_blocks, BatchKind::kDecode);
      }
    }
  }
}

}  // namespace
}  // namespace m3msa
