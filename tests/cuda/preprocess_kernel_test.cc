// The CUDA preprocessing kernel against cpu::preprocess (docs/spec.md section 2): q_out,
// index_q_out and both caches compared element by element (cache bytes everywhere, so a stray write
// shows), for bf16 and fp8 caches with scales != 1, positions up to ~2M (large RoPE angles), dead
// rows (whose slots point at real pages: nothing may be written there), negative slots, and a small
// non-M3 configuration. The kernel is meant to be bit-exact; a difference of one bf16 ulp (one fp8
// code) is tolerated on at most 1e-4 of the elements, because cos/sin of the double angle come
// from CUDA's libm on one side and the host's on the other. Skips without a GPU.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "attention_test_util.h"
#include "cuda/common.cuh"
#include "cuda/preprocess.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/dtype.h"
#include "m3msa/testing/layouts.h"

namespace m3msa {
namespace {

using attntest::DevTensor;
using attntest::Rng;
using attntest::to_dev;
using attntest::to_host;

struct PrepShape {
  SparseConfig config;
  int reqs;
  int q_len;
  int padding;      // trailing requests with seq_len 0
  int64_t max_len;  // seq_len drawn in [q_len, max_len]
  DType kv;
  DType index;
  float k_scale;
  float v_scale;
  uint64_t seed;
};

struct HostPrep {
  HostTensor qkv, q_norm, k_norm, iq_norm, ik_norm, positions, seq_lens, slots, index_slots,
      kv_cache, index_cache, q_out, index_q_out;
  BatchMeta batch;
};

HostTensor random_bf16(std::vector<int64_t> shape, Rng& rng, double scale) {
  HostTensor t(DType::kBF16, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) {
    t.ptr<uint16_t>()[i] = float_to_bf16(static_cast<float>(rng.uniform(-scale, scale)));
  }
  return t;
}

HostTensor random_cache(DType dtype, std::vector<int64_t> shape, Rng& rng) {
  HostTensor t(dtype, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float v = static_cast<float>(rng.uniform(-2.0, 2.0));
    if (dtype == DType::kBF16) {
      t.ptr<uint16_t>()[i] = float_to_bf16(v);
    } else {
      t.ptr<uint8_t>()[i] = float_to_fp8e4m3(v);
    }
  }
  return t;
}

HostPrep make_prep(const PrepShape& s) {
  const SparseConfig& cfg = s.config;
  Rng rng(s.seed);
  HostPrep h;
  const int64_t rows = int64_t{s.reqs} * s.q_len;
  h.qkv = random_bf16({rows, cfg.qkv_width()}, rng, 3.0);
  h.q_norm = random_bf16({cfg.head_dim}, rng, 0.5);
  h.k_norm = random_bf16({cfg.head_dim}, rng, 0.5);
  h.iq_norm = random_bf16({cfg.index_dim}, rng, 0.5);
  h.ik_norm = random_bf16({cfg.index_dim}, rng, 0.5);
  h.seq_lens = HostTensor(DType::kI32, {s.reqs});
  h.positions = HostTensor(DType::kI64, {rows});
  h.slots = HostTensor(DType::kI64, {rows});
  h.index_slots = HostTensor(DType::kI64, {rows});
  // Caches of a few pages; distinct random slots for live rows, some negative.
  const int64_t pages = (rows + cfg.block_size - 1) / cfg.block_size + 2;
  std::vector<int64_t> free_slots(static_cast<size_t>(pages * cfg.block_size));
  std::iota(free_slots.begin(), free_slots.end(), 0);
  for (size_t i = free_slots.size() - 1; i > 0; --i) {
    std::swap(free_slots[i],
              free_slots[static_cast<size_t>(rng.range(0, static_cast<int64_t>(i)))]);
  }
  std::vector<int64_t> free_index = free_slots;
  for (size_t i = free_index.size() - 1; i > 0; --i) {
    std::swap(free_index[i],
              free_index[static_cast<size_t>(rng.range(0, static_cast<int64_t>(i)))]);
  }
  for (int r = 0; r < s.reqs; ++r) {
    const bool live = r < s.reqs - s.padding;
    const int64_t len = live ? rng.range(s.q_len, s.max_len) : 0;
    h.seq_lens.ptr<int32_t>()[r] = static_cast<int32_t>(len);
    for (int j = 0; j < s.q_len; ++j) {
      const int64_t row = int64_t{r} * s.q_len + j;
      h.positions.ptr<int64_t>()[row] = live ? len - s.q_len + j : -1;
      // Dead rows still carry real slots: the kernel must not write them.
      h.slots.ptr<int64_t>()[row] =
          rng.range(0, 9) == 0 ? -1 : free_slots[static_cast<size_t>(row)];
      h.index_slots.ptr<int64_t>()[row] =
          rng.range(0, 9) == 0 ? -1 : free_index[static_cast<size_t>(row)];
    }
  }
  h.kv_cache = random_cache(s.kv, {pages, cfg.kv_heads, 2, cfg.block_size, cfg.head_dim}, rng);
  h.index_cache = random_cache(s.index, {pages, cfg.block_size, cfg.index_dim}, rng);
  h.q_out = HostTensor(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
  h.index_q_out = HostTensor(DType::kBF16, {rows, cfg.index_heads, cfg.index_dim});
  h.q_out.fill_bytes(0xFF);
  h.index_q_out.fill_bytes(0xFF);
  h.batch.kind = BatchKind::kDecode;
  h.batch.num_reqs = s.reqs;
  h.batch.q_len = s.q_len;
  return h;
}

PreprocessArgs args_of(const SparseConfig& cfg, const TensorView& qkv, const TensorView& qn,
                       const TensorView& kn, const TensorView& iqn, const TensorView& ikn,
                       const TensorView& pos, const BatchMeta& batch, const TensorView& kv,
                       const TensorView& ic, const TensorView& q_out, const TensorView& iq_out,
                       float k_scale, float v_scale) {
  (void)cfg;
  PreprocessArgs a;
  a.qkv = qkv;
  a.q_norm = qn;
  a.k_norm = kn;
  a.index_q_norm = iqn;
  a.index_k_norm = ikn;
  a.positions = pos;
  a.batch = batch;
  a.kv_cache = {kv, k_scale, v_scale};
  a.index_cache = {ic};
  a.q_out = q_out;
  a.index_q_out = iq_out;
  return a;
}

// Element-wise comparison of bf16 or fp8 buffers: counts exact mismatches and fails on any
// difference beyond one ulp / one code, or on more than 1e-4 of the elements differing.
void expect_matches(const HostTensor& gpu, const HostTensor& ref, const std::string& what) {
  ASSERT_EQ(gpu.nbytes(), ref.nbytes()) << what;
  const int64_t n = ref.numel();
  int64_t differ = 0;
  int64_t worst_at = -1;
  double worst = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    double steps;
    if (ref.dtype() == DType::kBF16) {
      const uint16_t a = gpu.ptr<uint16_t>()[i];
      const uint16_t b = ref.ptr<uint16_t>()[i];
      if (a == b) continue;
      const float fa = bf16_to_float(a);
      const float fb = bf16_to_float(b);
      steps = (std::isnan(fa) || std::isnan(fb))
                  ? 1e9
                  : std::fabs(fa - fb) / attntest::bf16_ulp(std::max(std::fabs(fa), std::fabs(fb)));
    } else {
      const uint8_t a = gpu.ptr<uint8_t>()[i];
      const uint8_t b = ref.ptr<uint8_t>()[i];
      if (a == b) continue;
      // Same sign: adjacent codes differ by one; otherwise only +-0 are neighbours.
      steps = ((a ^ b) & 0x80) ? ((a & 0x7F) == 0 && (b & 0x7F) == 0 ? 0 : 1e9)
                               : std::abs(static_cast<int>(a & 0x7F) - static_cast<int>(b & 0x7F));
    }
    ++differ;
    if (steps > worst) {
      worst = steps;
      worst_at = i;
    }
  }
  std::printf("[ info ] %s: %lld of %lld elements differ, worst %.3g ulp at %lld\n", what.c_str(),
              static_cast<long long>(differ), static_cast<long long>(n), worst,
              static_cast<long long>(worst_at));
  EXPECT_LE(worst, 1.0) << what << ": element " << worst_at << " differs by " << worst
                        << " ulp (bf16) / codes (fp8)";
  EXPECT_LE(static_cast<double>(differ), 1e-4 * static_cast<double>(n) + 0.5)
      << what << ": " << differ << " elements differ (one-ulp slips allowed on 1e-4 of them)";
}

void run_shape(const PrepShape& s, const std::string& name) {
  const SparseConfig& cfg = s.config;
  HostPrep h = make_prep(s);

  // Device copies (taken before the CPU run rewrites the host caches).
  DevTensor qkv = to_dev(h.qkv), qn = to_dev(h.q_norm), kn = to_dev(h.k_norm),
            iqn = to_dev(h.iq_norm), ikn = to_dev(h.ik_norm), pos = to_dev(h.positions),
            seq = to_dev(h.seq_lens), slots = to_dev(h.slots), islots = to_dev(h.index_slots),
            kv = to_dev(h.kv_cache), ic = to_dev(h.index_cache), q_out = to_dev(h.q_out),
            iq_out = to_dev(h.index_q_out);
  BatchMeta dev_batch = h.batch;
  dev_batch.seq_lens = seq.view;
  dev_batch.slot_mapping = slots.view;
  dev_batch.index_slot_mapping = islots.view;
  cuda::launch_preprocess(
      cfg,
      args_of(cfg, qkv.view, qn.view, kn.view, iqn.view, ikn.view, pos.view, dev_batch, kv.view,
              ic.view, q_out.view, iq_out.view, s.k_scale, s.v_scale),
      nullptr);
  CUDA_CHECK(cudaDeviceSynchronize());
  // The attention part then the index part (the runtime's overlap) write the same bytes.
  DevTensor kv2 = to_dev(h.kv_cache), ic2 = to_dev(h.index_cache), q_out2 = to_dev(h.q_out),
            iq_out2 = to_dev(h.index_q_out);
  const PreprocessArgs split_args =
      args_of(cfg, qkv.view, qn.view, kn.view, iqn.view, ikn.view, pos.view, dev_batch, kv2.view,
              ic2.view, q_out2.view, iq_out2.view, s.k_scale, s.v_scale);
  cuda::launch_preprocess(cfg, split_args, nullptr, cuda::PreprocessPart::kAttention);
  cuda::launch_preprocess(cfg, split_args, nullptr, cuda::PreprocessPart::kIndex);
  CUDA_CHECK(cudaDeviceSynchronize());
  auto same_bytes = [](const TensorView& a, const TensorView& b) {
    const HostTensor ha = to_host(a), hb = to_host(b);
    return ha.nbytes() == hb.nbytes() && std::memcmp(ha.data(), hb.data(), ha.nbytes()) == 0;
  };
  EXPECT_TRUE(same_bytes(kv2.view, kv.view)) << name << ": kv_cache";
  EXPECT_TRUE(same_bytes(ic2.view, ic.view)) << name << ": index_cache";
  EXPECT_TRUE(same_bytes(q_out2.view, q_out.view)) << name << ": q_out";
  EXPECT_TRUE(same_bytes(iq_out2.view, iq_out.view)) << name << ": index_q_out";

  BatchMeta host_batch = h.batch;
  host_batch.seq_lens = h.seq_lens.view();
  host_batch.slot_mapping = h.slots.view();
  host_batch.index_slot_mapping = h.index_slots.view();
  cpu::preprocess(cfg, args_of(cfg, h.qkv.view(), h.q_norm.view(), h.k_norm.view(),
                               h.iq_norm.view(), h.ik_norm.view(), h.positions.view(), host_batch,
                               h.kv_cache.view(), h.index_cache.view(), h.q_out.view(),
                               h.index_q_out.view(), s.k_scale, s.v_scale));

  expect_matches(to_host(q_out.view), h.q_out, name + " q_out");
  expect_matches(to_host(iq_out.view), h.index_q_out, name + " index_q_out");
  expect_matches(to_host(kv.view), h.kv_cache, name + " kv_cache bytes");
  expect_matches(to_host(ic.view), h.index_cache, name + " index_cache bytes");
}

TEST(CudaPreprocess, MatchesCpuReference) {
  M3MSA_REQUIRE_GPU();
  const DType bf16 = DType::kBF16;
  const DType fp8 = DType::kFP8E4M3;
  SparseConfig m3;
  run_shape({m3, 1, 1, 0, 1, bf16, bf16, 1.0f, 1.0f, 1}, "M3 one token at pos 0");
  run_shape({m3, 16, 4, 3, 2000000, bf16, fp8, 1.0f, 1.0f, 2}, "M3 bf16 KV / fp8 index");
  run_shape({m3, 33, 1, 4, 300000, fp8, bf16, 0.5f, 3.0f, 3}, "M3 fp8 KV scales");
  run_shape({m3, 7, 8, 1, 5000, fp8, fp8, 2.0f, 0.125f, 4}, "M3 fp8 both, q_len 8");
  SparseConfig small;
  small.q_heads = 6;
  small.kv_heads = 2;
  small.index_heads = 2;
  small.head_dim = 48;
  small.index_dim = 40;
  small.block_size = 16;
  small.topk = 4;
  small.rope_dim = 24;
  run_shape({small, 9, 2, 2, 3000, fp8, bf16, 1.5f, 0.5f, 5}, "small config");
  SparseConfig no_rope = small;
  no_rope.rope_dim = 0;
  run_shape({no_rope, 4, 1, 1, 100, bf16, bf16, 1.0f, 1.0f, 6}, "rope_dim 0");
}

// The insert writes through the strides of every layout (cache.h KVLayout) and of an index cache
// with padded pages: the same bytes as the packed caches.
TEST(CudaPreprocess, InsertsIntoEveryCacheLayoutInPlace) {
  M3MSA_REQUIRE_GPU();
  for (DType kv_dtype : {DType::kBF16, DType::kFP8E4M3}) {
    SparseConfig m3;
    const PrepShape s{m3, 5, 2, 1, 9000, kv_dtype, DType::kBF16, 0.5f, 2.0f, 21};
    const SparseConfig& cfg = s.config;
    HostPrep h = make_prep(s);
    DevTensor qkv = to_dev(h.qkv), qn = to_dev(h.q_norm), kn = to_dev(h.k_norm),
              iqn = to_dev(h.iq_norm), ikn = to_dev(h.ik_norm), pos = to_dev(h.positions),
              seq = to_dev(h.seq_lens), slots = to_dev(h.slots), islots = to_dev(h.index_slots);
    BatchMeta dev_batch = h.batch;
    dev_batch.seq_lens = seq.view;
    dev_batch.slot_mapping = slots.view;
    dev_batch.index_slot_mapping = islots.view;
    // The scales as device scalars too (read when the kernel runs): the same bytes.
    const float scale_values[2] = {s.k_scale, s.v_scale};
    cuda::DeviceBuffer scale_buffer(sizeof(scale_values));
    CUDA_CHECK(cudaMemcpy(scale_buffer.data(), scale_values, sizeof(scale_values),
                          cudaMemcpyHostToDevice));
    auto run = [&](const HostTensor& kv_host, KVLayout layout, const TensorView& index_view,
                   bool device_scales = false) {
      DevTensor kv = to_dev(kv_host), q_out = to_dev(h.q_out), iq_out = to_dev(h.index_q_out);
      PreprocessArgs a =
          args_of(cfg, qkv.view, qn.view, kn.view, iqn.view, ikn.view, pos.view, dev_batch, kv.view,
                  index_view, q_out.view, iq_out.view, s.k_scale, s.v_scale);
      a.kv_cache = kv_cache_from_layout(kv.view, layout, s.k_scale, s.v_scale);
      if (device_scales) {
        auto* base = static_cast<float*>(scale_buffer.data());
        a.kv_cache.k_scale = a.kv_cache.v_scale = 9.0f;  // overridden by the tensors
        a.kv_cache.k_scale_tensor = TensorView::contiguous(base, DType::kF32, {1}, Device::cuda(0));
        a.kv_cache.v_scale_tensor =
            TensorView::contiguous(base + 1, DType::kF32, {1}, Device::cuda(0));
      }
      cuda::launch_preprocess(cfg, a, nullptr);
      CUDA_CHECK(cudaDeviceSynchronize());
      const HostTensor got = to_host(kv.view);
      HostTensor ours(kv_host.dtype(), h.kv_cache.shape());
      testkit::copy_kv_cache(kv_cache_from_layout(got.view(), layout), KVCache(ours.view()));
      return ours;
    };
    DevTensor ic = to_dev(h.index_cache);
    const HostTensor want = run(h.kv_cache, KVLayout::kOurs, ic.view);
    const HostTensor want_index = to_host(ic.view);
    DevTensor ic_scaled = to_dev(h.index_cache);
    const HostTensor scaled = run(h.kv_cache, KVLayout::kOurs, ic_scaled.view, true);
    EXPECT_EQ(std::memcmp(scaled.data(), want.data(), want.nbytes()), 0) << "device scales";
    for (KVLayout layout : {KVLayout::kVllm, KVLayout::kFlashInfer}) {
      // The index cache with one padding token row per page.
      const std::vector<int64_t>& is = h.index_cache.shape();
      HostTensor padded(h.index_cache.dtype(), {is[0], is[1] + 1, is[2]});
      padded.fill_bytes(0);
      TensorView pv = padded.view();
      pv.shape[1] = is[1];
      testkit::copy_index_cache(IndexCache{h.index_cache.view()}, IndexCache{pv});
      DevTensor pic = to_dev(padded);
      TensorView dv = pv;
      dv.data = pic.view.data;
      dv.device = pic.view.device;
      const HostTensor got = run(testkit::relayout_kv_cache(h.kv_cache, layout), layout, dv);
      EXPECT_EQ(std::memcmp(got.data(), want.data(), want.nbytes()), 0) << kv_layout_name(layout);
      const HostTensor got_padded = to_host(pic.view);
      HostTensor got_index(h.index_cache.dtype(), is);
      TensorView gv = pv;
      gv.data = const_cast<void*>(got_padded.data());
      testkit::copy_index_cache(IndexCache{gv}, IndexCache{got_index.view()});
      EXPECT_EQ(std::memcmp(got_index.data(), want_index.data(), want_index.nbytes()), 0)
          << kv_layout_name(layout) << " index cache";
    }
  }
}

}  // namespace
}  // namespace m3msa
