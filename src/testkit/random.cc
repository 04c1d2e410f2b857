#include "m3msa/testing/random.h"

#include <numeric>
#include <utility>

#include "m3msa/dtype.h"
#include "m3msa/error.h"

namespace m3msa::testkit {

uint64_t derive_seed(uint64_t seed, uint64_t a, uint64_t b) {
  SplitMix64 rng(seed ^ (a * 0xD1B54A32D192ED03ull) ^ (b * 0x8CB92BA72F3D8DD7ull));
  rng.next();
  return rng.next();
}

void fill_bf16(HostTensor& tensor, uint64_t seed, float scale) {
  M3MSA_CHECK_INTERNAL(tensor.dtype() == DType::kBF16, "fill_bf16 on ", dtype_name(tensor.dtype()));
  SplitMix64 rng(seed);
  uint16_t* data = tensor.ptr<uint16_t>();
  for (int64_t i = 0; i < tensor.numel(); ++i) {
    data[i] = float_to_bf16(rng.unit_variance() * scale);
  }
}

std::vector<float> random_values(SplitMix64& rng, std::size_t n, float scale) {
  std::vector<float> v(n);
  for (float& x : v) x = round_to_bf16(rng.signed_unit() * scale);
  return v;
}

HostTensor bf16_tensor(const std::vector<float>& values, std::vector<int64_t> shape) {
  HostTensor t(DType::kBF16, std::move(shape));
  for (std::size_t i = 0; i < values.size(); ++i) t.ptr<uint16_t>()[i] = float_to_bf16(values[i]);
  return t;
}

std::vector<float> to_floats(const HostTensor& tensor) {
  std::vector<float> out(static_cast<std::size_t>(tensor.numel()));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_float(tensor.ptr<uint16_t>()[i]);
  return out;
}

std::vector<int32_t> page_permutation(int64_t pages, uint64_t seed) {
  std::vector<int32_t> perm(static_cast<std::size_t>(pages));
  std::iota(perm.begin(), perm.end(), 0);
  SplitMix64 rng(seed);
  for (std::size_t i = perm.size(); i > 1; --i) {
    std::swap(perm[i - 1], perm[static_cast<std::size_t>(rng.next() % i)]);
  }
  return perm;
}

}  // namespace m3msa::testkit
