// fuzz_tensor: tensor views with hostile ndim, extents, strides, dtypes, devices and null data
// -> check_tensor / check_device / describe; hostile shapes -> TensorView::contiguous and
// HostTensor; the argument structs of preprocess / indexer / attention -> validate(config, args,
// device). Contract: accept or throw m3msa::Error, never crash or UB. A view that
// check_tensor accepts is one every backend may index without further checks: the right rank
// and dtype, non-negative extents equal to the expected ones, contiguous strides, and a byte
// size that fits in int64.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <vector>

#include "fuzz_common.h"
#include "m3msa/ops.h"
#include "m3msa/tensor.h"

namespace m3msa::fuzz {
namespace {

constexpr int kMaxExpected = 6;

DType hostile_dtype(FuzzedDataProvider& in) {
  return in.ConsumeIntegralInRange<int>(0, 9) == 0
             ? static_cast<DType>(in.ConsumeIntegral<int>())
             : static_cast<DType>(in.ConsumeIntegralInRange(0, 6));
}

Device hostile_device(FuzzedDataProvider& in) {
  Device device;
  device.type = in.ConsumeIntegralInRange<int>(0, 9) == 0
                    ? static_cast<DeviceType>(in.ConsumeIntegral<int>())
                    : static_cast<DeviceType>(in.ConsumeIntegralInRange(0, 1));
  device.index = in.ConsumeBool() ? 0 : hostile_int(in, 8);
  return device;
}

// Product of the extents with overflow detection (nullopt-like: returns false on overflow).
bool checked_bytes(const std::vector<int64_t>& shape, std::size_t item, __int128& bytes) {
  bytes = static_cast<__int128>(item);
  for (int64_t extent : shape) {
    if (extent < 0) return false;
    bytes *= extent;
    if (bytes > std::numeric_limits<int64_t>::max()) return false;
  }
  return true;
}

// check_tensor takes the expected shape as an initializer_list: dispatch on its length.
void call_check(const TensorView& view, bool one_dtype, DType dtype, DType other, int n,
                const int64_t* e) {
  auto run = [&](std::initializer_list<int64_t> shape) {
    if (one_dtype) {
      check_tensor(view, "fuzz", dtype, shape);
    } else {
      check_tensor(view, "fuzz", {dtype, other}, shape);
    }
  };
  switch (n) {
    case 0: run({}); break;
    case 1: run({e[0]}); break;
    case 2: run({e[0], e[1]}); break;
    case 3: run({e[0], e[1], e[2]}); break;
    case 4: run({e[0], e[1], e[2], e[3]}); break;
    case 5: run({e[0], e[1], e[2], e[3], e[4]}); break;
    default: run({e[0], e[1], e[2], e[3], e[4], e[5]}); break;
  }
}

// Any view: rank, extents, strides, dtype, device and data pointer all fuzz-chosen.
TensorView hostile_view(FuzzedDataProvider& in) {
  static std::array<uint8_t, 256> buffer{};
  TensorView view;
  const int mode = in.ConsumeIntegralInRange<int>(0, 3);
  view.ndim = mode == 0 ? hostile_int(in, 16) : in.ConsumeIntegralInRange<int>(0, kMaxDims);
  for (int d = 0; d < kMaxDims; ++d) {
    view.shape[d] = in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, 8) : hostile_i64(in);
  }
  // Mostly the contiguous strides of the shape (so the later checks are reached), sometimes not.
  int64_t stride = 1;
  for (int d = kMaxDims - 1; d >= 0; --d) {
    const bool contiguous = d < view.ndim && in.ConsumeIntegralInRange<int>(0, 7) != 0;
    view.strides[d] = contiguous ? stride : hostile_i64(in);
    if (contiguous && d < view.ndim) {
      __int128 next = static_cast<__int128>(stride) * view.shape[d];
      stride =
          next > std::numeric_limits<int64_t>::max() || next < 0 ? 1 : static_cast<int64_t>(next);
    }
  }
  view.dtype = hostile_dtype(in);
  view.device = hostile_device(in);
  view.data = in.ConsumeBool() ? buffer.data() : nullptr;
  return view;
}

void fuzz_check_tensor(FuzzedDataProvider& in) {
  const TensorView view = hostile_view(in);
  const bool one_dtype = in.ConsumeBool();
  const DType dtype = hostile_dtype(in);
  const DType other = hostile_dtype(in);
  const int n = in.ConsumeIntegralInRange<int>(0, kMaxExpected);
  int64_t expected[kMaxExpected];
  for (int d = 0; d < kMaxExpected; ++d) {
    expected[d] = in.ConsumeBool() ? view.shape[d] : (in.ConsumeBool() ? -1 : hostile_i64(in, 8));
  }

  if (accepts([&] { call_check(view, one_dtype, dtype, other, n, expected); })) {
    FUZZ_CHECK(view.ndim == n);
    FUZZ_CHECK(view.dtype == dtype || (!one_dtype && view.dtype == other));
    std::vector<int64_t> shape(view.shape.begin(), view.shape.begin() + view.ndim);
    __int128 bytes = 0;
    FUZZ_CHECK(checked_bytes(shape, dtype_size(view.dtype), bytes),
               "accepted a view whose extents are negative or whose size overflows int64");
    for (int d = 0; d < n; ++d) FUZZ_CHECK(expected[d] < 0 || view.shape[d] == expected[d]);
    FUZZ_CHECK(view.is_contiguous());
    FUZZ_CHECK(view.data != nullptr || view.numel() == 0);
    FUZZ_CHECK(!describe(view).empty());
  }
  const Device device = hostile_device(in);
  if (accepts([&] { check_device(view, "fuzz", device); })) FUZZ_CHECK(view.device == device);
}

void fuzz_constructors(FuzzedDataProvider& in) {
  const int n = in.ConsumeIntegralInRange<int>(0, kMaxDims + 2);
  std::vector<int64_t> shape(static_cast<std::size_t>(n));
  for (int64_t& extent : shape) {
    extent = in.ConsumeBool() ? in.ConsumeIntegralInRange<int64_t>(0, 6) : hostile_i64(in);
  }
  const DType dtype = hostile_dtype(in);
  TensorView view;
  if (accepts([&] { view = TensorView::contiguous(nullptr, dtype, shape); })) {
    FUZZ_CHECK(view.ndim == n && n <= kMaxDims);
    for (int d = 0; d < n; ++d) FUZZ_CHECK(view.shape[d] == shape[static_cast<std::size_t>(d)]);
    FUZZ_CHECK(view.is_contiguous());
  }
  // Only allocate what is small; a size that overflows must be an error, not a wrapped malloc.
  __int128 bytes = 0;
  std::size_t item = 0;
  const bool known_dtype = accepts([&] { item = dtype_size(dtype); });
  if (!known_dtype) {
    FUZZ_CHECK(!accepts([&] { HostTensor t(dtype, shape); }));
    return;
  }
  const bool fits = checked_bytes(shape, item, bytes);
  if (!fits || bytes <= 4096) {
    HostTensor tensor;
    if (accepts([&] { tensor = HostTensor(dtype, shape); })) {
      FUZZ_CHECK(fits, "HostTensor accepted a shape whose size overflows");
      FUZZ_CHECK(tensor.nbytes() == static_cast<std::size_t>(bytes));
      tensor.fill_bytes(0xA5);
    }
  }
}

// The argument structs of the three operations (ops.h), each view either the one the config
// asks for (over a real buffer) or a hostile one, validated for the host or a device: the shared
// validate() must keep the same contract as check_tensor.
void fuzz_op_args(FuzzedDataProvider& in) {
  SparseConfig c;
  c.kv_heads = c.index_heads = in.ConsumeIntegralInRange<int>(1, 2);
  c.q_heads = c.kv_heads * in.ConsumeIntegralInRange<int>(1, 2);
  c.head_dim = c.index_dim = c.rope_dim = 8;
  c.block_size = in.ConsumeIntegralInRange<int>(1, 4);
  c.topk = in.ConsumeIntegralInRange<int>(1, 4);
  if (in.ConsumeIntegralInRange<int>(0, 7) == 0) c.topk = hostile_int(in);
  const int reqs = in.ConsumeIntegralInRange<int>(0, 3);
  const int q_len = in.ConsumeIntegralInRange<int>(1, 2);
  const int64_t rows = int64_t{reqs} * q_len;
  const Device device = in.ConsumeBool() ? Device::cpu() : hostile_device(in);
  std::vector<std::vector<uint8_t>> storage;
  // The right view for (dtype, shape) on `device` most of the time, a hostile one otherwise.
  auto view = [&](DType dtype, std::vector<int64_t> shape) -> TensorView {
    if (in.ConsumeIntegralInRange<int>(0, 15) == 0) return hostile_view(in);
    int64_t numel = 1;
    for (int64_t extent : shape) numel *= extent;
    if (numel > 4096) return hostile_view(in);
    storage.emplace_back(static_cast<std::size_t>(numel) * dtype_size(dtype) + 1);
    TensorView v = TensorView::contiguous(storage.back().data(), dtype, shape);
    v.device = device;
    return v;
  };
  const int64_t pages = in.ConsumeIntegralInRange<int64_t>(0, 4);
  BatchMeta batch;
  batch.num_reqs = reqs;
  batch.q_len = q_len;
  batch.seq_lens = view(DType::kI32, {reqs});
  batch.index_block_table = view(DType::kI32, {reqs, 2});
  batch.kv_block_table = view(DType::kI32, {reqs, 2});
  batch.slot_mapping = view(DType::kI64, {rows});
  batch.index_slot_mapping = view(DType::kI64, {rows});
  const DType cache_dtype = in.ConsumeBool() ? DType::kBF16 : DType::kFP8E4M3;
  IndexCache index_cache{view(cache_dtype, {pages, c.block_size, c.index_dim})};
  KVCache kv_cache{view(cache_dtype, {pages, c.kv_heads, 2, c.block_size, c.head_dim}),
                   in.ConsumeBool() ? 1.0f : hostile_float(in),
                   in.ConsumeBool() ? 1.0f : hostile_float(in)};
  const int64_t topk = std::max(1, std::min(c.topk, 8));
  switch (in.ConsumeIntegralInRange<int>(0, 2)) {
    case 0: {
      PreprocessArgs a;
      a.qkv = view(DType::kBF16, {rows, c.qkv_width()});
      a.q_norm = view(DType::kBF16, {c.head_dim});
      a.k_norm = view(DType::kBF16, {c.head_dim});
      a.index_q_norm = view(DType::kBF16, {c.index_dim});
      a.index_k_norm = view(DType::kBF16, {c.index_dim});
      a.positions = view(DType::kI64, {rows});
      a.batch = batch;
      a.kv_cache = kv_cache;
      a.index_cache = index_cache;
      a.q_out = view(DType::kBF16, {rows, c.q_heads, c.head_dim});
      a.index_q_out = view(DType::kBF16, {rows, c.index_heads, c.index_dim});
      if (accepts([&] { validate(c, a, device); })) {
        FUZZ_CHECK(a.qkv.device == device && a.kv_cache.data.device == device);
        FUZZ_CHECK(std::isfinite(a.kv_cache.k_scale) && a.kv_cache.k_scale > 0);
      }
      break;
    }
    case 1: {
      IndexerArgs a;
      a.index_q = view(DType::kBF16, {rows, c.index_heads, c.index_dim});
      a.index_cache = index_cache;
      a.batch = batch;
      a.topk_idx = view(DType::kI32, {rows, c.index_heads, topk});
      if (accepts([&] { validate(c, a, device); })) {
        FUZZ_CHECK(a.topk_idx.ndim == 3 && a.topk_idx.shape[2] == c.topk);
      }
      break;
    }
    default: {
      AttentionArgs a;
      a.q = view(DType::kBF16, {rows, c.q_heads, c.head_dim});
      a.kv_cache = kv_cache;
      a.batch = batch;
      if (in.ConsumeBool()) a.topk_idx = view(DType::kI32, {rows, c.kv_heads, topk});
      a.out = view(DType::kBF16, {rows, c.q_heads, c.head_dim});
      if (accepts([&] { validate(c, a, device); })) {
        FUZZ_CHECK(a.out.ndim == 3 && a.out.device == device);
        FUZZ_CHECK(std::isfinite(a.kv_cache.v_scale) && a.kv_cache.v_scale > 0);
      }
      break;
    }
  }
}

}  // namespace
}  // namespace m3msa::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: m3msa::fuzz::fuzz_constructors(in); break;
    case 1: m3msa::fuzz::fuzz_op_args(in); break;
    default: m3msa::fuzz::fuzz_check_tensor(in); break;
  }
  return 0;
}
