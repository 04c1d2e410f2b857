// The CUDA kernels read caches in place through strides (docs/spec.md section 3): attention over
// vLLM's and FlashInfer's layouts and over a head shard of a wider cache, and the indexer over an
// index cache with padded pages, give the packed layout's result bit for bit (only the addressing
// changes); views the kernels cannot serve are refused by name before any launch.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "cuda/attention.h"
#include "indexer_test_util.h"
#include "m3msa/cuda_backend.h"
#include "m3msa/testing/layouts.h"

namespace m3msa {
namespace {

using attntest::DevTensor;
using attntest::to_dev;
using attntest::to_host;

SyntheticCase attention_case(DType kv, int q_len, uint64_t seed) {
  SyntheticSpec spec;
  spec.num_reqs = 6;
  spec.q_len = q_len;
  spec.padding_reqs = 1;
  spec.min_context = 100;
  spec.max_context = 40000;
  spec.kv_dtype = kv;
  spec.k_scale = kv == DType::kFP8E4M3 ? 0.5f : 1.0f;
  spec.v_scale = kv == DType::kFP8E4M3 ? 0.25f : 1.0f;
  spec.seed = seed;
  return make_synthetic_case(spec);
}

// Runs the CUDA attention with `kv` (a device KVCache) on the device copy of the rest of `c`.
HostTensor attend(const SyntheticCase& c, const attntest::DevAttention& dev, const KVCache& kv,
                  const DevTensor& topk) {
  const SparseConfig& cfg = c.config;
  cuda::DeviceBuffer ws = attntest::attention_workspace(cfg);
  DevTensor out = attntest::poisoned(DType::kBF16, {c.num_rows(), cfg.q_heads, cfg.head_dim});
  AttentionArgs a = dev.args(topk.view, out.view);
  a.kv_cache = kv;
  cuda::launch_attention(cfg, a, ws.data(), ws.bytes(), nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  return to_host(out.view);
}

TensorView on_device(TensorView host_shaped, const DevTensor& dev) {
  host_shaped.data = dev.view.data;
  host_shaped.device = dev.view.device;
  return host_shaped;
}

TEST(CudaCacheLayout, AttentionOverEveryLayoutAndSubviewEqualsThePackedCache) {
  M3MSA_REQUIRE_GPU();
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    for (int q_len : {1, 4}) {
      SCOPED_TRACE(std::string(dtype_name(kv)) + " q_len " + std::to_string(q_len));
      SyntheticCase c = attention_case(kv, q_len, 40 + q_len);
      const HostTensor topk_host = attntest::random_selection(c, 9);
      attntest::DevAttention dev(c);
      DevTensor topk = to_dev(topk_host);
      const HostTensor want = attend(c, dev, dev.kv, topk);
      for (KVLayout layout : {KVLayout::kVllm, KVLayout::kFlashInfer}) {
        const HostTensor cache = testkit::relayout_kv_cache(c.kv_cache, layout);
        DevTensor d = to_dev(cache);
        const KVCache view = kv_cache_from_layout(d.view, layout, c.k_scale, c.v_scale);
        EXPECT_TRUE(attntest::bitwise_equal(attend(c, dev, view, topk), want))
            << kv_layout_name(layout);
      }
      // Heads [kv_heads, 2 kv_heads) of a packed cache with twice the heads, as the packed form
      // and as K and V views.
      const std::vector<int64_t>& s = c.kv_cache.shape();
      HostTensor wide(kv, {s[0], 2 * s[1], s[2], s[3], s[4]});
      wide.fill_bytes(0x3C);
      const TensorView sub_host = testkit::kv_head_subview(wide, s[1], s[1]);
      testkit::copy_kv_cache(KVCache(c.kv_cache.view()), KVCache(sub_host));
      DevTensor wide_dev = to_dev(wide);
      TensorView sub = testkit::kv_head_subview(wide, s[1], s[1]);
      sub.data = static_cast<uint8_t*>(wide_dev.view.data) +
                 (static_cast<uint8_t*>(sub_host.data) - static_cast<uint8_t*>(wide.data()));
      sub.device = wide_dev.view.device;
      const KVCache packed_sub(sub, c.k_scale, c.v_scale);
      EXPECT_TRUE(attntest::bitwise_equal(attend(c, dev, packed_sub, topk), want)) << "head shard";
      const KVCache split =
          KVCache::split(packed_sub.keys(), packed_sub.values(), c.k_scale, c.v_scale);
      EXPECT_TRUE(attntest::bitwise_equal(attend(c, dev, split, topk), want))
          << "head shard as k, v";
      // Dense causal attention reads the same way.
      DevTensor none;
      const HostTensor dense_want = attend(c, dev, dev.kv, none);
      EXPECT_TRUE(attntest::bitwise_equal(attend(c, dev, split, none), dense_want)) << "dense";
    }
  }
}

TEST(CudaCacheLayout, AttentionRefusesStridesTheKernelCannotServe) {
  M3MSA_REQUIRE_GPU();
  SyntheticCase c = attention_case(DType::kBF16, 1, 3);
  attntest::DevAttention dev(c);
  DevTensor topk = to_dev(attntest::random_selection(c, 1));
  KVCache odd = KVCache::split(dev.kv.keys(), dev.kv.values());
  odd.k.strides[2] = c.config.head_dim + 4;  // rows 8 bytes off the 16-byte grid
  odd.k.shape[0] = 1;                        // stays inside the buffer
  odd.v.shape[0] = 1;
  try {
    attend(c, dev, odd, topk);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("kv_cache.k: token stride"), std::string::npos) << e.message();
  }
}

TEST(CudaCacheLayout, IndexerOverPaddedPagesEqualsTheContiguousCache) {
  M3MSA_INDEXER_REQUIRE_GPU();
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    for (int q_len : {1, 2}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " q_len " + std::to_string(q_len));
      SyntheticCase c =
          make_synthetic_case(idxtest::decode_spec(5, q_len, 200, 60000, dtype, 1, 70 + q_len));
      const std::vector<int64_t>& s = c.index_cache.shape();
      // Two padding token rows per page (a page stride of 130 rows, still 16-byte aligned).
      HostTensor padded(dtype, {s[0], s[1] + 2, s[2]});
      padded.fill_bytes(0x7F);
      TensorView pv = padded.view();
      pv.shape[1] = s[1];
      testkit::copy_index_cache(c.index_cache_view(), IndexCache{pv});
      DeviceCase d = upload(c);
      DevTensor pd = to_dev(padded);
      for (IndexerVariant variant :
           {IndexerVariant::kFused, IndexerVariant::kSpan, IndexerVariant::kUnfused}) {
        SCOPED_TRACE(static_cast<int>(variant));
        auto run = [&](const IndexCache& cache) {
          DeviceTensor topk(DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk});
          fill_device_bytes(topk.view(), idxtest::kPoisonByte);
          idxtest::GpuIndexer gpu(c.config, idxtest::limits_for(c));
          IndexerArgs a = d.indexer_args(topk.view());
          a.index_cache = cache;
          gpu.launch(c.config, a, variant);
          gpu.sync();
          EXPECT_EQ(gpu.status(), 0u);
          HostTensor out;
          copy_to_host(topk.view(), out);
          return out;
        };
        const HostTensor want = run(d.index_cache_view());
        EXPECT_TRUE(attntest::bitwise_equal(run(IndexCache{on_device(pv, pd)}), want));
      }
      // Tokens not contiguous within a page: the kernels stage whole pages, so refused by name.
      TensorView gapped = on_device(pv, pd);
      gapped.shape[0] = s[0] / 2;
      gapped.strides[1] = 2 * s[2];
      DeviceTensor topk(DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk});
      idxtest::GpuIndexer gpu(c.config, idxtest::limits_for(c));
      IndexerArgs a = d.indexer_args(topk.view());
      a.index_cache = IndexCache{gapped};
      try {
        gpu.launch(c.config, a);
        ADD_FAILURE() << "accepted";
      } catch (const Error& e) {
        EXPECT_NE(e.message().find("index_cache: token stride"), std::string::npos) << e.message();
      }
    }
  }
}

}  // namespace
}  // namespace m3msa
