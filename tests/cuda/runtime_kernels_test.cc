// The runtime's CUDA kernels (src/cuda/gemm.h, norm.h) against double-precision and CPU
// references: exact where the maths is the same (the residual add, every fp8 code). Every test
// skips without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "runtime_gpu_fixture.h"

namespace m3msa {
namespace {

using namespace rtgpu;

// ---- Kernels ----

TEST(RuntimeKernels, SkinnyGemmMatchesDoubleReference) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  testkit::SplitMix64 rng(11);
  struct Case {
    int n, k;
  };
  for (const Case c : {Case{40, 64}, Case{1920, 512}, Case{136, 6144}, Case{24, 192}}) {
    for (int rows : {1, 3, 8, 9, 16}) {
      for (bool fp8 : {false, true}) {
        // bf16 / f32 out, then deep (bf16), then 8 warps over K (f32; its own reduction order)
        for (int variant = 0; variant < 4; ++variant) {
          const bool f32 = variant == 1 || variant == 3;
          const int deep = variant == 2 ? 1 : 0;
          std::vector<uint16_t> x(static_cast<std::size_t>(16) * c.k);
          for (auto& v : x) v = float_to_bf16(rng.signed_unit() * 2.0f);
          std::vector<uint8_t> w(static_cast<std::size_t>(c.n) * c.k * (fp8 ? 1 : 2));
          std::vector<double> wv(static_cast<std::size_t>(c.n) * c.k);
          for (std::size_t i = 0; i < wv.size(); ++i) {
            if (fp8) {
              w[i] = float_to_fp8e4m3(rng.signed_unit() * 300.0f);
              wv[i] = fp8e4m3_to_float(w[i]);
            } else {
              const uint16_t b = float_to_bf16(rng.signed_unit() * 0.1f);
              std::memcpy(&w[2 * i], &b, 2);
              wv[i] = bf16_to_float(b);
            }
          }
          std::vector<float> scale(static_cast<std::size_t>(c.n));
          for (auto& v : scale) v = 1e-3f * (1.5f + rng.signed_unit());
          DeviceTensor dx(DType::kBF16, {16, c.k}), dw(DType::kU8, {int64_t(w.size())});
          DeviceTensor ds(DType::kF32, {c.n}), dout(DType::kF32, {17, c.n});
          upload_into(dx.view(), x.data(), x.size() * 2);
          upload_into(dw.view(), w.data(), w.size());
          upload_into(ds.view(), scale.data(), scale.size() * 4);
          fill_device_bytes(dout.view(), 0x7F);  // poison (NaN as f32 / bf16 pairs)
          cuda::GemmSkinnyParams p;
          p.x = static_cast<const uint16_t*>(dx.data());
          p.x_stride = c.k;
          p.w = dw.data();
          p.scale = fp8 ? static_cast<const float*>(ds.data()) : nullptr;
          p.out = dout.data();
          p.out_stride = c.n;
          p.rows = rows;
          p.n = c.n;
          p.k = c.k;
          p.w_fp8 = fp8;
          p.out_f32 = f32;
          p.deep = deep;
          p.split_k8 = variant == 3;
          cuda::launch_gemm_skinny(p, nullptr);
          CUDA_CHECK(cudaDeviceSynchronize());
          const std::vector<uint8_t> raw = download<uint8_t>(dout.view());
          // Again with the other loops (deep, ring): the same bits (also: run to run determinism).
          const std::vector<uint8_t> raw2 = [&] {
            cuda::GemmSkinnyParams other = p;
            other.deep = 1 - p.deep;
            cuda::launch_gemm_skinny(other, nullptr);
            CUDA_CHECK(cudaDeviceSynchronize());
            return download<uint8_t>(dout.view());
          }();
          EXPECT_EQ(raw, raw2) << "deep = 0 and deep = 1 differ";
          // And through the ring loop (these grids are too small to take it by themselves).
          const std::vector<uint8_t> raw3 = [&] {
            cuda::GemmSkinnyParams other = p;
            other.deep = 0;
            other.force_ring = 1;
            cuda::launch_gemm_skinny(other, nullptr);
            CUDA_CHECK(cudaDeviceSynchronize());
            return download<uint8_t>(dout.view());
          }();
          EXPECT_EQ(raw, raw3) << "the ring and the group loops differ";
          int64_t bad = 0;
          std::string first;
          const std::size_t elem = f32 ? 4 : 2;
          for (int r = 0; r < 17; ++r) {
            for (int n = 0; n < c.n; ++n) {
              const uint8_t* at = raw.data() + (static_cast<std::size_t>(r) * c.n + n) * elem;
              if (r >= rows) {  // untouched: still poisoned
                bad += !std::all_of(at, at + elem, [](uint8_t b) { return b == 0x7F; });
                continue;
              }
              double ref = 0.0, mag = 0.0;
              for (int kk = 0; kk < c.k; ++kk) {
                const double t = bf16_to_float(x[static_cast<std::size_t>(r) * c.k + kk]) *
                                 wv[static_cast<std::size_t>(n) * c.k + kk];
                ref += t;
                mag += std::fabs(t);
              }
              const double sc = fp8 ? scale[static_cast<std::size_t>(n)] : 1.0;
              ref *= sc;
              mag *= sc;
              double got;
              if (f32) {
                float v;
                std::memcpy(&v, at, 4);
                got = v;
              } else {
                uint16_t v;
                std::memcpy(&v, at, 2);
                got = bf16_to_float(v);
              }
              // fp32 accumulation: ~1e-6 of the magnitude; bf16 output: half an ulp more.
              const double tol = 2e-6 * mag + (f32 ? 0.0 : std::fabs(ref) / 256.0) + 1e-30;
              if (!(std::fabs(got - ref) <= tol)) {
                if (bad++ == 0) {
                  first = "row " + std::to_string(r) + " col " + std::to_string(n) + ": got " +
                          std::to_string(got) + ", want " + std::to_string(ref);
                }
              }
            }
          }
          EXPECT_EQ(bad, 0) << "n " << c.n << " k " << c.k << " rows " << rows << " fp8 " << fp8
                            << " f32 " << f32 << " deep " << deep << " split_k8 " << (variant == 3)
                            << ": " << first;
        }
      }
    }
  }
}

// A skinny GEMM of contiguous x [*, k] and w [n, k] into f32 out [*, n], no scale; rows unset.
cuda::GemmSkinnyParams f32_gemm(const DeviceTensor& x, const DeviceTensor& w,
                                const DeviceTensor& out, int n, int k, bool fp8) {
  cuda::GemmSkinnyParams p;
  p.x = static_cast<const uint16_t*>(x.data());
  p.x_stride = k;
  p.w = w.data();
  p.out = out.data();
  p.out_stride = n;
  p.n = n;
  p.k = k;
  p.w_fp8 = fp8 ? 1 : 0;
  p.out_f32 = 1;
  return p;
}

// Every e4m3 code through the fp8 GEMM, exactly: column n holds code n % 256 at every k, row r of
// x is 1 at k = 5 r + 1 and 0 elsewhere, so out[r, n] must be the decoded code itself (f32 out, no
// scale). Covers +-0, the subnormals, the largest normals and the two NaN codes, which must make
// their whole column NaN; so must one NaN weight met only by zero activations (columns 256 ..
// 271: random codes, one NaN at a k no row selects, in the odd columns).
TEST(RuntimeKernels, SkinnyGemmDecodesEveryFp8CodeExactly) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  testkit::SplitMix64 rng(29);
  constexpr int kN = 272, kK = 128, kRows = 16, kHiddenNanK = 2;
  std::vector<uint16_t> x(static_cast<std::size_t>(kRows) * kK, float_to_bf16(0.0f));
  for (int r = 0; r < kRows; ++r)
    x[static_cast<std::size_t>(r) * kK + 5 * r + 1] = float_to_bf16(1.0f);
  std::vector<uint8_t> w(static_cast<std::size_t>(kN) * kK);
  for (int n = 0; n < kN; ++n) {
    for (int k = 0; k < kK; ++k) {
      uint8_t code = static_cast<uint8_t>(n % 256);
      if (n >= 256) {
        do {
          code = static_cast<uint8_t>(rng.next() & 0xFFu);
        } while ((code & 0x7Fu) == 0x7Fu);
        if (n % 2 == 1 && k == kHiddenNanK) code = 0xFF;
      }
      w[static_cast<std::size_t>(n) * kK + k] = code;
    }
  }
  DeviceTensor dx(DType::kBF16, {kRows, kK}), dw(DType::kU8, {int64_t(w.size())});
  DeviceTensor dout(DType::kF32, {kRows, kN});
  upload_into(dx.view(), x.data(), x.size() * 2);
  upload_into(dw.view(), w.data(), w.size());
  for (int variant = 0; variant < 6; ++variant) {
    const int loop = variant % 3;  // group, deep, ring (128-byte fp8 chunks: k = 128)
    const int rows = variant < 3 ? kRows : 8;
    fill_device_bytes(dout.view(), 0x5A);
    cuda::GemmSkinnyParams p = f32_gemm(dx, dw, dout, kN, kK, /*fp8=*/true);
    p.rows = rows;
    p.deep = loop == 1;
    p.force_ring = loop == 2;
    cuda::launch_gemm_skinny(p, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> out = download<float>(dout.view());
    int64_t bad = 0;
    std::string first;
    for (int r = 0; r < rows; ++r) {
      for (int n = 0; n < kN; ++n) {
        const int k = 5 * r + 1;
        const uint8_t code = w[static_cast<std::size_t>(n) * kK + k];
        const bool want_nan = (code & 0x7Fu) == 0x7Fu || (n >= 256 && n % 2 == 1);
        const float want = fp8e4m3_to_float(code);
        const float got = out[static_cast<std::size_t>(r) * kN + n];
        // == (not the bits): a -0 weight's products sum to +0 from the +0 accumulator.
        const bool ok = want_nan ? std::isnan(got) : got == want;
        if (!ok && bad++ == 0) {
          first = "row " + std::to_string(r) + " col " + std::to_string(n) + " code " +
                  std::to_string(code) + ": got " + std::to_string(got) + ", want " +
                  (want_nan ? std::string("NaN") : std::to_string(want));
        }
      }
    }
    EXPECT_EQ(bad, 0) << "loop " << loop << " (group, deep, ring), rows " << rows << ": " << first;
  }
}

// A row's output does not depend on how many rows its launch has: the loop may follow the row
// count (fp8 takes the ring from 2 rows, on grids of >= 4 CTAs per SM, as M3's q/k/v projection
// is), and every loop reduces a column in the same order. Rows 1, 2, 5 and 16 of the same inputs,
// bf16 and fp8 (128-byte chunks: k % 128 == 0; 64-byte: k = 192), bit for bit.
TEST(RuntimeKernels, SkinnyGemmRowResultIsIndependentOfTheBatch) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  testkit::SplitMix64 rng(31);
  constexpr int kN = 9856;  // 616 CTAs
  for (int k : {512, 192}) {
    for (bool fp8 : {false, true}) {
      std::vector<uint16_t> x(static_cast<std::size_t>(16) * k);
      for (auto& v : x) v = float_to_bf16(rng.signed_unit() * 2.0f);
      std::vector<uint8_t> w(static_cast<std::size_t>(kN) * k * (fp8 ? 1 : 2));
      for (std::size_t i = 0; i < w.size(); ++i) {
        w[i] = static_cast<uint8_t>(rng.next() & (fp8 ? 0x7Eu : 0x3Fu));  // no NaN, no huge bf16
      }
      DeviceTensor dx(DType::kBF16, {16, k}), dw(DType::kU8, {int64_t(w.size())});
      DeviceTensor dout(DType::kF32, {16, kN});
      upload_into(dx.view(), x.data(), x.size() * 2);
      upload_into(dw.view(), w.data(), w.size());
      cuda::GemmSkinnyParams p = f32_gemm(dx, dw, dout, kN, k, fp8);
      const auto run = [&](int rows) {
        fill_device_bytes(dout.view(), 0x7F);
        p.rows = rows;
        cuda::launch_gemm_skinny(p, nullptr);
        CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<float> out = download<float>(dout.view());
        out.resize(static_cast<std::size_t>(rows) * kN);
        return out;
      };
      const std::vector<float> all = run(16);
      for (int rows : {1, 2, 5}) {
        const std::vector<float> some = run(rows);
        const std::vector<float> head(all.begin(), all.begin() + static_cast<int64_t>(some.size()));
        EXPECT_EQ(0, std::memcmp(some.data(), head.data(), some.size() * sizeof(float)))
            << "k " << k << " fp8 " << fp8 << ": rows 0.." << rows - 1 << " of a " << rows
            << "-row launch differ from the same rows of a 16-row launch";
      }
    }
  }
}

TEST(RuntimeKernels, SkinnyGemmRefusesUnsupportedShapes) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  DeviceTensor buf(DType::kU8, {1 << 20});
  cuda::GemmSkinnyParams p;
  p.x = static_cast<const uint16_t*>(buf.data());
  p.w = buf.data();
  p.out = buf.data();
  p.n = 16;
  p.k = 96;  // not a multiple of 64
  p.x_stride = 96;
  p.out_stride = 16;
  p.rows = 1;
  EXPECT_THROW(cuda::launch_gemm_skinny(p, nullptr), Error);
  p.k = 64;
  p.x_stride = 64;
  p.rows = 17;
  EXPECT_THROW(cuda::launch_gemm_skinny(p, nullptr), Error);
}

TEST(RuntimeKernels, AddRmsNormMatchesCpu) {
  M3MSA_RUNTIME_REQUIRE_GPUS(1);
  testkit::SplitMix64 rng(5);
  // One pass with 1, 2 and 4 chunks per thread (6144, 8200, 24576), the loop beyond (40000).
  for (int n : {512, 6144, 8200, 24576, 40000}) {
    for (int rows : {1, 7, 16}) {
      for (bool f32 : {false, true}) {
        const std::size_t count = static_cast<std::size_t>(rows) * n;
        std::vector<uint16_t> res(count), w(static_cast<std::size_t>(n));
        std::vector<float> delta(count);
        std::vector<uint16_t> delta16(count);
        for (std::size_t i = 0; i < count; ++i) {
          res[i] = float_to_bf16(rng.signed_unit() * 3.0f);
          delta[i] = rng.signed_unit() * 2.0f;
          delta16[i] = float_to_bf16(delta[i]);
        }
        for (auto& v : w) v = float_to_bf16(rng.signed_unit() * 0.3f);
        DeviceTensor dres(DType::kBF16, {rows, n}), dw(DType::kBF16, {n}),
            dd(f32 ? DType::kF32 : DType::kBF16, {rows, n}), dout(DType::kBF16, {rows, n});
        upload_into(dres.view(), res.data(), count * 2);
        upload_into(dw.view(), w.data(), w.size() * 2);
        if (f32) {
          upload_into(dd.view(), delta.data(), count * 4);
        } else {
          upload_into(dd.view(), delta16.data(), count * 2);
        }
        cuda::NormResidualParams p;
        p.delta = dd.data();
        p.residual = static_cast<uint16_t*>(dres.data());
        p.weight = static_cast<const uint16_t*>(dw.data());
        p.out = static_cast<uint16_t*>(dout.data());
        p.rows = rows;
        p.n = n;
        p.delta_f32 = f32;
        p.eps = 1e-6f;
        cuda::launch_norm_residual(p, nullptr);
        CUDA_CHECK(cudaDeviceSynchronize());
        const std::vector<uint16_t> got_res = download<uint16_t>(dres.view());
        const std::vector<uint16_t> got_out = download<uint16_t>(dout.view());
        std::vector<uint16_t> want_res(count), want_out(count);
        for (std::size_t i = 0; i < count; ++i) {
          const float d = f32 ? round_to_bf16(delta[i]) : bf16_to_float(delta16[i]);
          want_res[i] = float_to_bf16(bf16_to_float(res[i]) + d);
        }
        for (int r = 0; r < rows; ++r) {
          runtime_detail::gemma_rmsnorm_row(&want_res[static_cast<std::size_t>(r) * n], w.data(), n,
                                            1e-6f, &want_out[static_cast<std::size_t>(r) * n]);
        }
        EXPECT_EQ(got_res, want_res) << "the residual add is exact maths";
        Check c;
        // Only the sum-of-squares order differs: one bf16 rounding of the output can flip.
        compare_bf16(c, got_out.data(), want_out.data(), rows, n, 1e-6, 1.0 / 128, {}, "normed");
        EXPECT_EQ(c.bad, 0) << c.first;
      }
    }
  }
}

}  // namespace
}  // namespace m3msa
