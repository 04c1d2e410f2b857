// Selection output options (ops.h SelectionOptions): descending key or ascending block id,
// token-major [rows, H, k] or head-major [H, rows, k], written into a caller's buffer of larger
// capacity. The selected set never changes; entries outside the answers are never written.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "m3msa/synthetic.h"

namespace m3msa {
namespace {

constexpr int32_t kPoison = 0x5A5A5A5A;

SyntheticCase selection_case(BatchKind kind, uint64_t seed) {
  SyntheticSpec spec;
  spec.kind = kind;
  spec.num_reqs = 4;
  spec.q_len = 2;
  spec.padding_reqs = kind == BatchKind::kDecode ? 1 : 0;
  spec.min_context = 1;
  spec.max_context = 5000;
  spec.make_kv_cache = false;
  spec.seed = seed;
  return make_synthetic_case(spec);
}

// The answer of (row, head) in `buffer` as `options` place it, with the view's strides.
std::vector<int32_t> answer(const TensorView& view, const SelectionOptions& options, int64_t row,
                            int head, int k) {
  const bool head_major = options.major == SelectionMajor::kHeadMajor;
  const int32_t* at = view.ptr<const int32_t>() + row * view.strides[head_major ? 1 : 0] +
                      head * view.strides[head_major ? 0 : 1];
  return {at, at + k};
}

TEST(SelectionOutput, EveryOrderAndMajorIntoALargerBufferHoldsTheSameSelection) {
  for (BatchKind kind : {BatchKind::kDecode, BatchKind::kPrefill}) {
    SyntheticCase c = selection_case(kind, kind == BatchKind::kDecode ? 3 : 4);
    const SparseConfig& cfg = c.config;
    const int64_t rows = c.num_rows();
    const int H = cfg.index_heads;
    const int k = cfg.topk;
    HostTensor want(DType::kI32, {rows, H, k});
    cpu::select_topk(cfg, c.indexer_args(want.view()), 2);
    for (SelectionOrder order : {SelectionOrder::kDescendingKey, SelectionOrder::kAscendingBlock}) {
      for (SelectionMajor major : {SelectionMajor::kTokenMajor, SelectionMajor::kHeadMajor}) {
        const SelectionOptions options{order, major};
        SCOPED_TRACE(std::string(selection_order_name(order)) + " " + selection_major_name(major));
        // Capacity: 3 more rows and 5 more entries per answer than needed.
        const bool head_major = major == SelectionMajor::kHeadMajor;
        const int64_t cap_rows = rows + 3;
        const int64_t cap_k = k + 5;
        HostTensor buffer(DType::kI32, head_major ? std::vector<int64_t>{H, cap_rows, cap_k}
                                                  : std::vector<int64_t>{cap_rows, H, cap_k});
        std::fill(buffer.ptr<int32_t>(), buffer.ptr<int32_t>() + buffer.numel(), kPoison);
        TensorView view = buffer.view();
        view.shape[head_major ? 1 : 0] = rows;
        view.shape[2] = k;
        IndexerArgs a = c.indexer_args(view);
        a.selection = options;
        cpu::select_topk(cfg, a, 2);
        int64_t written = 0;
        for (int64_t row = 0; row < rows; ++row) {
          for (int h = 0; h < H; ++h) {
            std::vector<int32_t> expect(want.ptr<int32_t>() + (row * H + h) * k,
                                        want.ptr<int32_t>() + (row * H + h + 1) * k);
            if (order == SelectionOrder::kAscendingBlock) {
              std::sort(expect.begin(), std::find(expect.begin(), expect.end(), -1));
            }
            EXPECT_EQ(answer(view, options, row, h, k), expect) << "row " << row << " head " << h;
            written += k;
          }
        }
        const int64_t untouched =
            std::count(buffer.ptr<int32_t>(), buffer.ptr<int32_t>() + buffer.numel(), kPoison);
        EXPECT_EQ(untouched, buffer.numel() - written) << "entries outside the answers written";
      }
    }
  }
}

TEST(SelectionOutput, OverlappingAnswersAndUnknownNamesAreRefused) {
  SyntheticCase c = selection_case(BatchKind::kDecode, 5);
  const SparseConfig& cfg = c.config;
  const int64_t rows = c.num_rows();
  HostTensor buffer(DType::kI32, {rows, cfg.index_heads, cfg.topk});
  TensorView view = buffer.view();
  view.strides[1] = cfg.topk - 1;  // answers of one row overlap
  IndexerArgs a = c.indexer_args(view);
  try {
    cpu::select_topk(cfg, a, 1);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("topk_idx"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("overlap"), std::string::npos) << e.message();
  }
  // Head-major needs [H, rows, k].
  a = c.indexer_args(buffer.view());
  a.selection.major = SelectionMajor::kHeadMajor;
  if (rows != cfg.index_heads) {
    EXPECT_THROW(cpu::select_topk(cfg, a, 1), Error);
  }
  EXPECT_THROW(parse_selection_order("random", "order"), Error);
  EXPECT_THROW(parse_selection_major("row", "major"), Error);
  EXPECT_EQ(parse_selection_order("ascending", "order"), SelectionOrder::kAscendingBlock);
  EXPECT_EQ(parse_selection_major("head", "major"), SelectionMajor::kHeadMajor);
}

}  // namespace
}  // namespace m3msa
