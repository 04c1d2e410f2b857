// Selection output options on the CUDA indexer (every kernel: split, span, unfused, prefill):
// descending or ascending, token- or head-major, into a buffer of larger capacity. Each answer is
// the default answer of the same kernel (itself checked against the CPU reference elsewhere) in
// the order asked for; nothing outside the answers is written.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "indexer_test_util.h"
#include "m3msa/cuda_backend.h"

namespace m3msa {
namespace {

constexpr int32_t kPoison = 0x5A5A5A5A;

HostTensor run(const SyntheticCase& c, const DeviceCase& d, IndexerVariant variant,
               const SelectionOptions& options, const std::vector<int64_t>& buffer_shape,
               TensorView* host_view) {
  DeviceTensor buffer(DType::kI32, buffer_shape);
  fill_device_bytes(buffer.view(), 0x5A);
  const bool head_major = options.major == SelectionMajor::kHeadMajor;
  TensorView view = buffer.view();
  view.shape[head_major ? 1 : 0] = c.num_rows();
  view.shape[2] = c.config.topk;
  idxtest::GpuIndexer gpu(c.config, idxtest::limits_for(c));
  IndexerArgs a = d.indexer_args(view);
  a.selection = options;
  gpu.launch(c.config, a, variant);
  gpu.sync();
  EXPECT_EQ(gpu.status(), 0u);
  HostTensor out;
  copy_to_host(buffer.view(), out);
  *host_view = view;
  host_view->data = out.data();
  host_view->device = Device::cpu();
  return out;
}

TEST(CudaSelectionOutput, EveryOrderAndMajorHoldsTheDefaultAnswer) {
  M3MSA_INDEXER_REQUIRE_GPU();
  struct Case {
    SyntheticSpec spec;
    std::vector<IndexerVariant> variants;
  };
  std::vector<Case> cases;
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    cases.push_back({idxtest::decode_spec(6, 2, 1, 70000, dtype, 1, 91),
                     {IndexerVariant::kFused, IndexerVariant::kSpan, IndexerVariant::kUnfused,
                      IndexerVariant::kLastCtaMerge, IndexerVariant::kSplitMerge}});
  }
  SyntheticSpec prefill;
  prefill.kind = BatchKind::kPrefill;
  prefill.num_reqs = 3;
  prefill.max_context = 20000;
  prefill.make_kv_cache = false;
  prefill.seed = 92;
  cases.push_back({prefill, {IndexerVariant::kFused}});
  for (const Case& entry : cases) {
    SyntheticCase c = make_synthetic_case(entry.spec);
    DeviceCase d = upload(c);
    const int64_t rows = c.num_rows();
    const int H = c.config.index_heads;
    const int k = c.config.topk;
    for (IndexerVariant variant : entry.variants) {
      TensorView want_view;
      const HostTensor want = run(c, d, variant, SelectionOptions{}, {rows, H, k}, &want_view);
      for (SelectionOrder order :
           {SelectionOrder::kDescendingKey, SelectionOrder::kAscendingBlock}) {
        for (SelectionMajor major : {SelectionMajor::kTokenMajor, SelectionMajor::kHeadMajor}) {
          const SelectionOptions options{order, major};
          SCOPED_TRACE(std::string(selection_order_name(order)) + " " +
                       selection_major_name(major) + " variant " +
                       std::to_string(static_cast<int>(variant)));
          const bool head_major = major == SelectionMajor::kHeadMajor;
          const std::vector<int64_t> shape = head_major ? std::vector<int64_t>{H, rows + 2, k + 3}
                                                        : std::vector<int64_t>{rows + 2, H, k + 3};
          TensorView view;
          const HostTensor got = run(c, d, variant, options, shape, &view);
          int64_t written = 0;
          for (int64_t row = 0; row < rows; ++row) {
            for (int h = 0; h < H; ++h) {
              const int32_t* w = want.ptr<int32_t>() + (row * H + h) * k;
              std::vector<int32_t> expect(w, w + k);
              if (order == SelectionOrder::kAscendingBlock) {
                std::sort(expect.begin(), std::find(expect.begin(), expect.end(), -1));
              }
              const int32_t* at = view.ptr<const int32_t>() +
                                  row * view.strides[head_major ? 1 : 0] +
                                  h * view.strides[head_major ? 0 : 1];
              EXPECT_EQ(std::vector<int32_t>(at, at + k), expect) << "row " << row << " head " << h;
              written += k;
            }
          }
          EXPECT_EQ(std::count(got.ptr<int32_t>(), got.ptr<int32_t>() + got.numel(), kPoison),
                    got.numel() - written);
        }
      }
    }
  }
}

}  // namespace
}  // namespace m3msa
