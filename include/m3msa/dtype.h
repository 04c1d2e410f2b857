// Element types and the exact scalar conversions every backend shares (host and device).
// bf16: round to nearest even, NaN kept quiet. fp8 e4m3 (OCP "fn": bias 7, max 448, no inf):
// round to nearest even with saturation to +-448; NaN stays NaN (docs/spec.md section 3).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__CUDACC__)
#define M3MSA_HD __host__ __device__ __forceinline__
#else
#define M3MSA_HD inline
#endif

namespace m3msa {

enum class DType : int { kF32 = 0, kBF16, kFP8E4M3, kI32, kI64, kU64, kU8 };

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
// Parses "f32", "bf16", "fp8" / "fp8_e4m3", "i32", "i64", "u64", "u8"; throws naming `what`.
DType parse_dtype(const std::string& text, const char* what);

M3MSA_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

M3MSA_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

M3MSA_HD float bf16_to_float(uint16_t b) {
  return bits_float(static_cast<uint32_t>(b) << 16);
}

M3MSA_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

M3MSA_HD float round_to_bf16(float f) {
  return bf16_to_float(float_to_bf16(f));
}

M3MSA_HD float fp8e4m3_to_float(uint8_t v) {
  const uint32_t sign = (v & 0x80u) ? 0x80000000u : 0u;
  const uint32_t exponent = (v >> 3) & 0xFu;
  const uint32_t mantissa = v & 0x7u;
  if (exponent == 0xFu && mantissa == 0x7u) return bits_float(sign | 0x7FC00000u);  // NaN
  if (exponent == 0) {
    // Subnormal: mantissa * 2^-9, exact in fp32.
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 512.0f);
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

M3MSA_HD uint8_t float_to_fp8e4m3(float f) {
  const uint32_t u = float_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t magnitude_bits = u & 0x7FFFFFFFu;
  if (magnitude_bits > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7Fu);  // NaN
  const float magnitude = bits_float(magnitude_bits);
  if (magnitude >= 448.0f) return static_cast<uint8_t>(sign | 0x7Eu);  // saturate (inf too)
  if (magnitude < 0.015625f) {
    // Subnormal range (below 2^-6): round magnitude / 2^-9 to nearest even; 8 becomes 2^-6.
    const float scaled = magnitude * 512.0f;
    uint32_t q = static_cast<uint32_t>(scaled);
    const float remainder = scaled - static_cast<float>(q);
    if (remainder > 0.5f || (remainder == 0.5f && (q & 1u))) ++q;
    return static_cast<uint8_t>(sign | q);  // q == 8 encodes exponent 1, mantissa 0
  }
  int32_t exponent = static_cast<int32_t>(magnitude_bits >> 23) - 127;
  const uint32_t mantissa = magnitude_bits & 0x7FFFFFu;
  uint32_t rounded = (mantissa + 0x7FFFFu + ((mantissa >> 20) & 1u)) >> 20;
  if (rounded == 8u) {
    rounded = 0;
    ++exponent;
  }
  const int32_t biased = exponent + 7;
  if (biased > 15 || (biased == 15 && rounded == 7u)) return static_cast<uint8_t>(sign | 0x7Eu);
  return static_cast<uint8_t>(sign | (static_cast<uint32_t>(biased) << 3) | rounded);
}

}  // namespace m3msa
