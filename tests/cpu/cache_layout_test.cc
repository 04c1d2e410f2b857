// Caches read in place through strides (docs/spec.md section 3): the layouts engines use
// (vLLM's [pages, 2, bs, kv_heads, hd], FlashInfer's [pages, kv_heads, bs, 2 * hd]) and sub-views
// give the packed layout's result bit for bit, since only the addressing changes; the views a
// backend cannot serve are refused by name.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "m3msa/case_io.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "m3msa/synthetic.h"
#include "m3msa/testing/layouts.h"

namespace m3msa {
namespace {

using testkit::copy_index_cache;
using testkit::kv_head_subview;
using testkit::relayout_kv_cache;

std::vector<uint8_t> bytes_of(const HostTensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return {p, p + t.nbytes()};
}

SyntheticCase layout_case(DType kv_dtype, DType index_dtype, uint64_t seed) {
  SyntheticSpec spec;
  spec.num_reqs = 3;
  spec.q_len = 2;
  spec.min_context = 300;
  spec.max_context = 2600;
  spec.kv_dtype = kv_dtype;
  spec.index_dtype = index_dtype;
  spec.k_scale = kv_dtype == DType::kFP8E4M3 ? 0.5f : 1.0f;
  spec.v_scale = kv_dtype == DType::kFP8E4M3 ? 0.25f : 1.0f;
  spec.seed = seed;
  return make_synthetic_case(spec);
}

HostTensor attend(const SyntheticCase& c, const KVCache& kv, const HostTensor& topk) {
  HostTensor out(DType::kBF16, {c.num_rows(), c.config.q_heads, c.config.head_dim});
  out.fill_bytes(0xA5);
  AttentionArgs a = c.attention_args(topk.view(), out.view());
  a.kv_cache = kv;
  cpu::sparse_attention(c.config, a, 2);
  return out;
}

HostTensor select(const SyntheticCase& c, const IndexCache& index) {
  HostTensor topk(DType::kI32, {c.num_rows(), c.config.index_heads, c.config.topk});
  topk.fill_bytes(0xA5);
  IndexerArgs a = c.indexer_args(topk.view());
  a.index_cache = index;
  cpu::select_topk(c.config, a, 2);
  return topk;
}

// A packed cache with twice the heads whose heads [kv_heads, 2 * kv_heads) hold `ours`.
HostTensor wide_copy(const HostTensor& ours) {
  const std::vector<int64_t>& s = ours.shape();
  HostTensor wide(ours.dtype(), {s[0], 2 * s[1], s[2], s[3], s[4]});
  wide.fill_bytes(0x3C);
  testkit::copy_kv_cache(KVCache(ours.view()), KVCache(kv_head_subview(wide, s[1], s[1])));
  return wide;
}

TEST(CacheLayout, AttentionOfEveryLayoutAndSubviewEqualsThePackedCacheBitForBit) {
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    SCOPED_TRACE(dtype_name(kv));
    SyntheticCase c = layout_case(kv, DType::kBF16, 7);
    const HostTensor topk = select(c, c.index_cache_view());
    const HostTensor want = attend(c, c.kv_cache_view(), topk);
    for (KVLayout layout : {KVLayout::kOurs, KVLayout::kVllm, KVLayout::kFlashInfer}) {
      SCOPED_TRACE(kv_layout_name(layout));
      const HostTensor cache = relayout_kv_cache(c.kv_cache, layout);
      const KVCache view = kv_cache_from_layout(cache.view(), layout, c.k_scale, c.v_scale);
      EXPECT_EQ(bytes_of(attend(c, view, topk)), bytes_of(want));
    }
    // A head shard of a wider packed cache, and K / V given as two views of it.
    const HostTensor wide = wide_copy(c.kv_cache);
    const KVCache sub(kv_head_subview(wide, c.config.kv_heads, c.config.kv_heads), c.k_scale,
                      c.v_scale);
    EXPECT_FALSE(sub.data.is_contiguous());
    EXPECT_EQ(bytes_of(attend(c, sub, topk)), bytes_of(want));
    const KVCache split = KVCache::split(sub.keys(), sub.values(), c.k_scale, c.v_scale);
    EXPECT_EQ(bytes_of(attend(c, split, topk)), bytes_of(want));
    // Dense causal attention reads the same views.
    HostTensor dense_want(DType::kBF16, {c.num_rows(), c.config.q_heads, c.config.head_dim});
    HostTensor dense_got(DType::kBF16, {c.num_rows(), c.config.q_heads, c.config.head_dim});
    AttentionArgs a = c.attention_args(TensorView{}, dense_want.view());
    cpu::dense_attention(c.config, a, 2);
    const HostTensor vllm = relayout_kv_cache(c.kv_cache, KVLayout::kVllm);
    a.kv_cache = kv_cache_from_layout(vllm.view(), KVLayout::kVllm, c.k_scale, c.v_scale);
    a.out = dense_got.view();
    cpu::dense_attention(c.config, a, 2);
    EXPECT_EQ(bytes_of(dense_got), bytes_of(dense_want));
  }
}

TEST(CacheLayout, SelectionFromAStridedIndexCacheEqualsTheContiguousOne) {
  for (DType index : {DType::kBF16, DType::kFP8E4M3}) {
    SCOPED_TRACE(dtype_name(index));
    SyntheticCase c = layout_case(DType::kBF16, index, 11);
    const HostTensor want = select(c, c.index_cache_view());
    const std::vector<int64_t>& s = c.index_cache.shape();
    // Pages padded by a token row, and tokens 2 rows apart: both read in place.
    for (const auto& [pad_tokens, token_mult] : {std::pair{1, 1}, {0, 2}, {3, 2}}) {
      HostTensor padded(index, {s[0], (s[1] + pad_tokens) * token_mult, s[2]});
      padded.fill_bytes(0x7F);
      TensorView view = padded.view();
      view.shape[1] = s[1];
      view.strides[1] = s[2] * token_mult;
      copy_index_cache(c.index_cache_view(), IndexCache{view});
      EXPECT_EQ(bytes_of(select(c, IndexCache{view})), bytes_of(want))
          << "pad " << pad_tokens << " token stride x" << token_mult;
    }
  }
}

TEST(CacheLayout, InsertsWriteThroughTheStridesOfEveryLayout) {
  for (DType kv : {DType::kBF16, DType::kFP8E4M3}) {
    SyntheticCase c = layout_case(kv, DType::kBF16, 3);
    const int hd = c.config.head_dim;
    std::vector<float> k(hd), v(hd);
    for (int d = 0; d < hd; ++d) {
      k[d] = 0.25f * d - 3.0f;
      v[d] = 2.0f - 0.125f * d;
    }
    std::vector<HostTensor> caches;
    std::vector<KVCache> views;
    for (KVLayout layout : {KVLayout::kOurs, KVLayout::kVllm, KVLayout::kFlashInfer}) {
      caches.push_back(relayout_kv_cache(c.kv_cache, layout));
      views.push_back(kv_cache_from_layout(caches.back().view(), layout, 0.5f, 4.0f));
    }
    for (KVCache& view : views) {
      for (const auto& [slot, head] :
           {std::pair{int64_t{3}, 1}, {int64_t{130}, 0}, {int64_t{300}, 3}}) {
        cpu::insert_kv(view, slot, head, k.data(), v.data(), hd);
      }
    }
    const std::vector<uint8_t> want = bytes_of(caches[0]);
    for (std::size_t i = 1; i < views.size(); ++i) {
      HostTensor back(kv, c.kv_cache.shape());
      testkit::copy_kv_cache(views[i], KVCache(back.view()));
      EXPECT_EQ(bytes_of(back), want) << kv_layout_name(static_cast<KVLayout>(i));
    }
  }
  // The index cache with padded pages.
  SyntheticCase c = layout_case(DType::kBF16, DType::kFP8E4M3, 5);
  const std::vector<int64_t>& s = c.index_cache.shape();
  HostTensor padded(DType::kFP8E4M3, {s[0], s[1] + 2, s[2]});
  padded.fill_bytes(0);
  TensorView view = padded.view();
  view.shape[1] = s[1];
  IndexCache strided{view};
  IndexCache packed = c.index_cache_view();
  copy_index_cache(packed, strided);
  std::vector<float> ik(static_cast<std::size_t>(s[2]));
  for (std::size_t d = 0; d < ik.size(); ++d) ik[d] = 0.5f * static_cast<float>(d) - 7.0f;
  for (int64_t slot : {int64_t{0}, int64_t{129}, s[0] * s[1] - 1}) {
    cpu::insert_index_k(packed, slot, ik.data(), static_cast<int>(s[2]));
    cpu::insert_index_k(strided, slot, ik.data(), static_cast<int>(s[2]));
  }
  HostTensor back(DType::kFP8E4M3, s);
  copy_index_cache(strided, IndexCache{back.view()});
  EXPECT_EQ(bytes_of(back), bytes_of(c.index_cache));
}

TEST(CacheLayout, ACaseNamesItsLayoutAndReplaysInPlace) {
  SyntheticCase c = layout_case(DType::kFP8E4M3, DType::kBF16, 13);
  const HostTensor topk = select(c, c.index_cache_view());
  const HostTensor want = attend(c, c.kv_cache_view(), topk);
  for (KVLayout layout : {KVLayout::kVllm, KVLayout::kFlashInfer}) {
    SyntheticCase relaid = c;
    relaid.kv_cache = relayout_kv_cache(c.kv_cache, layout);
    relaid.kv_layout = layout;
    const std::string dir = ::testing::TempDir() + "m3msa_layout_case_" + kv_layout_name(layout);
    save_case(dir, relaid);
    const LoadedCase loaded = load_case(dir);
    EXPECT_EQ(loaded.step.kv_layout, layout);
    EXPECT_EQ(loaded.step.kv_cache.shape(), relaid.kv_cache.shape());
    EXPECT_EQ(bytes_of(attend(loaded.step, loaded.step.kv_cache_view(), topk)), bytes_of(want));
  }
}

// Scales given as one-element f32 tensors (read when the operation runs) replace the floats.
TEST(CacheScales, ScaleTensorsReplaceTheFloatsInAttentionAndInserts) {
  SyntheticCase c = layout_case(DType::kFP8E4M3, DType::kBF16, 17);
  const HostTensor topk = select(c, c.index_cache_view());
  const HostTensor want = attend(c, c.kv_cache_view(), topk);  // 0.5 and 0.25
  HostTensor k_scale(DType::kF32, {1});
  HostTensor v_scale(DType::kF32, {1});
  k_scale.ptr<float>()[0] = c.k_scale;
  v_scale.ptr<float>()[0] = c.v_scale;
  KVCache kv(c.kv_cache.view(), 3.0f, 7.0f);  // the floats are overridden
  kv.k_scale_tensor = k_scale.view();
  kv.v_scale_tensor = v_scale.view();
  EXPECT_EQ(bytes_of(attend(c, kv, topk)), bytes_of(want));
  // A new value is read by the next call.
  k_scale.ptr<float>()[0] = 2.0f;
  v_scale.ptr<float>()[0] = 0.125f;
  EXPECT_EQ(bytes_of(attend(c, kv, topk)),
            bytes_of(attend(c, KVCache(c.kv_cache.view(), 2.0f, 0.125f), topk)));
  // The insert divides by the tensors' values.
  const int hd = c.config.head_dim;
  std::vector<float> k(hd, 1.5f), v(hd, -0.75f);
  HostTensor a(DType::kFP8E4M3, c.kv_cache.shape()), b(DType::kFP8E4M3, c.kv_cache.shape());
  a.fill_bytes(0);
  b.fill_bytes(0);
  KVCache by_tensor(a.view());
  by_tensor.k_scale_tensor = k_scale.view();
  by_tensor.v_scale_tensor = v_scale.view();
  KVCache by_float(b.view(), 2.0f, 0.125f);
  cpu::insert_kv(by_tensor, 5, 1, k.data(), v.data(), hd);
  cpu::insert_kv(by_float, 5, 1, k.data(), v.data(), hd);
  EXPECT_EQ(bytes_of(a), bytes_of(b));
  // Refused by name: another dtype, more than one element, another device.
  HostTensor wide(DType::kF32, {2});
  KVCache bad = kv;
  bad.k_scale_tensor = wide.view();
  EXPECT_THROW(validate_kv_cache(bad, c.config, "kv_cache"), Error);
  bad = kv;
  bad.v_scale_tensor.dtype = DType::kBF16;
  try {
    validate_kv_cache(bad, c.config, "kv_cache");
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("kv_cache.v_scale_tensor"), std::string::npos) << e.message();
  }
  bad = kv;
  bad.k_scale_tensor.device = Device::cuda(0);
  EXPECT_THROW(validate_kv_cache(bad, c.config, "kv_cache"), Error);
}

// Runs `fn`, expecting an Error of `code` (default: invalid argument) whose message holds every
// one of `words`.
template <typename Fn>
void expect_refused(Fn fn, std::initializer_list<const char*> words,
                    ErrorCode code = ErrorCode::kInvalidArgument) {
  try {
    fn();
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const char* w : words) EXPECT_NE(e.message().find(w), std::string::npos) << e.message();
  }
}

TEST(CacheLayout, ViewsNoBackendCanServeAreRefusedByName) {
  SyntheticCase c = layout_case(DType::kBF16, DType::kBF16, 2);
  const SparseConfig& cfg = c.config;
  const KVCache packed = c.kv_cache_view();
  validate_kv_cache(packed, cfg, "kv_cache");
  // Both forms, or half of the split form.
  KVCache both = packed;
  both.k = packed.keys();
  expect_refused([&] { validate_kv_cache(both, cfg, "kv_cache"); }, {"kv_cache", "not both"});
  KVCache half = KVCache::split(packed.keys(), TensorView{});
  expect_refused([&] { validate_kv_cache(half, cfg, "kv_cache"); }, {"kv_cache", "both k and v"});
  // head_dim not contiguous, a negative stride, V of another dtype.
  KVCache bad = KVCache::split(packed.keys(), packed.values());
  bad.k.strides[3] = 2;
  expect_refused([&] { validate_kv_cache(bad, cfg, "kv_cache"); }, {"kv_cache.k", "stride 1"});
  bad = KVCache::split(packed.keys(), packed.values());
  bad.v.strides[1] = -bad.v.strides[1];
  expect_refused([&] { validate_kv_cache(bad, cfg, "kv_cache"); }, {"kv_cache.v", "negative"});
  bad = KVCache::split(packed.keys(), packed.values());
  bad.v.dtype = DType::kFP8E4M3;
  expect_refused([&] { validate_kv_cache(bad, cfg, "kv_cache"); }, {"kv_cache.v", "dtype"});
  // Layout shapes.
  expect_refused([&] { kv_cache_from_layout(c.kv_cache.view(), KVLayout::kFlashInfer); },
                 {"kv_cache", "flashinfer"});
  expect_refused([&] { parse_kv_layout("nhd", "layout"); }, {"layout", "nhd"});
  EXPECT_EQ(parse_kv_layout("vllm", "layout"), KVLayout::kVllm);

  // What the CUDA kernels take on top: strides they can address (whole 16 bytes, an index
  // cache's tokens contiguous within a page); the split form, other layouts and run-time scales
  // are served.
  const ErrorCode unsupported = ErrorCode::kUnsupported;
  check_kv_cache_cuda(packed, "kv_cache");
  check_kv_cache_cuda(KVCache::split(packed.keys(), packed.values()), "kv_cache");
  KVCache scaled = packed;
  scaled.k_scale_tensor = c.kv_cache.view();
  check_kv_cache_cuda(scaled, "kv_cache");
  KVCache odd = KVCache::split(packed.keys(), packed.values());
  odd.k.strides[2] = cfg.head_dim + 4;  // 8 bytes past a 16-byte row
  validate_kv_cache(odd, cfg, "kv_cache");
  expect_refused([&] { check_kv_cache_cuda(odd, "kv_cache"); }, {"kv_cache.k", "token stride"},
                 unsupported);
  odd = KVCache::split(packed.keys(), packed.values());
  odd.v.data = static_cast<uint8_t*>(odd.v.data) + 2;
  expect_refused([&] { check_kv_cache_cuda(odd, "kv_cache"); }, {"kv_cache.v", "aligned"},
                 unsupported);
  IndexCache index = c.index_cache_view();
  check_index_cache_cuda(index, "index_cache");
  index.data.strides[1] = 2 * cfg.index_dim;
  validate_index_cache(index, cfg, "index_cache");
  expect_refused([&] { check_index_cache_cuda(index, "index_cache"); },
                 {"index_cache", "token stride"}, unsupported);
  index = c.index_cache_view();
  index.data.strides[0] += 4;
  expect_refused([&] { check_index_cache_cuda(index, "index_cache"); },
                 {"index_cache", "page stride"}, unsupported);
}

}  // namespace
}  // namespace m3msa
