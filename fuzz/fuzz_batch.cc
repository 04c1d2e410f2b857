// fuzz_batch: bytes -> a decode or prefill BatchMeta over small host tensors with hostile
// lengths (seq_lens, cu_seqlens_q, context_lens), block tables, slot mappings, page counts and
// configs -> validate_batch_contents. Contract: accept or throw m3msa::Error, never crash or UB.
// When a batch is accepted, row_positions must succeed and every live row must be safe to serve:
// its visible blocks exist in both tables and map to real pages, its block ids are within the
// sort-key cap, and every slot is inside its cache.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "fuzz_common.h"
#include "m3msa/batch.h"
#include "m3msa/sort_key.h"

namespace m3msa::fuzz {
namespace {

constexpr int64_t kMaxElements = 4096;  // per tensor: the harness never allocates more

struct Storage {
  std::vector<std::vector<uint8_t>> buffers;
  void* allocate(int64_t bytes) {
    buffers.emplace_back(static_cast<std::size_t>(bytes) + 1);  // +1: never a null data()
    return buffers.back().data();
  }
};

// An i32 length-like value: small and plausible mostly, an edge value sometimes.
int32_t hostile_length(FuzzedDataProvider& in, int32_t plausible_max) {
  return in.ConsumeIntegralInRange<int>(0, 5) == 0
             ? hostile_int(in, plausible_max)
             : in.ConsumeIntegralInRange<int32_t>(0, plausible_max);
}

// A tensor of `dtype` and `shape` filled by `value(i)`, or (sometimes) a broken variant of it:
// not given, another dtype, another rank, or other extents. Never allocates more than
// kMaxElements elements; when the natural shape is bigger, the view gets a small wrong shape.
template <typename T, typename Fill>
TensorView make_tensor(FuzzedDataProvider& in, Storage& storage, DType dtype,
                       std::vector<int64_t> shape, Fill value) {
  switch (in.ConsumeIntegralInRange<int>(0, 15)) {
    case 0: return {};  // not given
    case 1: dtype = in.ConsumeBool() ? DType::kI64 : DType::kI32; break;
    case 2: shape.push_back(in.ConsumeIntegralInRange<int64_t>(0, 3)); break;
    case 3:
      for (int64_t& extent : shape) extent = in.ConsumeIntegralInRange<int64_t>(0, 9);
      break;
    default: break;
  }
  int64_t numel = 1;
  for (int64_t& extent : shape) {
    if (extent < 0 || extent > kMaxElements) extent = in.ConsumeIntegralInRange<int64_t>(0, 9);
    numel *= extent;
    if (numel > kMaxElements) {
      extent = 1;
      numel = 1;
    }
  }
  const std::size_t item = dtype_size(dtype);
  void* data = storage.allocate(numel * static_cast<int64_t>(item));
  for (int64_t i = 0; i < numel; ++i) {
    const T v = value(i);
    if (item == 4) {
      static_cast<int32_t*>(data)[i] = static_cast<int32_t>(v);
    } else {
      static_cast<int64_t*>(data)[i] = static_cast<int64_t>(v);
    }
  }
  return TensorView::contiguous(data, dtype, shape);
}

SparseConfig make_config(FuzzedDataProvider& in) {
  SparseConfig c;
  c.q_heads = 2;
  c.kv_heads = 1;
  c.index_heads = 1;
  c.head_dim = 8;
  c.index_dim = 8;
  c.rope_dim = 8;
  c.topk = in.ConsumeIntegralInRange<int>(1, 8);
  c.local_blocks = in.ConsumeIntegralInRange<int>(0, 1);
  c.block_size = in.ConsumeIntegralInRange<int>(0, 7) == 0
                     ? hostile_int(in, 300)
                     : in.PickValueInArray<int>({1, 2, 3, 4, 8, 16, 128});
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) c.topk = hostile_int(in);
  return c;
}

void check_accepted(const BatchMeta& b, const SparseConfig& config, int64_t index_pages,
                    int64_t kv_pages) {
  const int64_t num_rows = b.num_rows();
  if (num_rows > kMaxElements * 64) return;  // legitimately large: not worth the memory here
  std::vector<RowPosition> rows;
  FUZZ_CHECK(accepts([&] { rows = row_positions(b); }),
             "row_positions rejected a batch validate_batch_contents accepted");
  FUZZ_CHECK(static_cast<int64_t>(rows.size()) == num_rows);
  const int64_t bs = config.block_size;
  for (int64_t i = 0; i < num_rows; ++i) {
    const RowPosition& row = rows[static_cast<std::size_t>(i)];
    FUZZ_CHECK(row.req >= 0 && row.req < b.num_reqs, "row %lld req %d", (long long)i, row.req);
    if (b.kind == BatchKind::kDecode) {
      const int32_t seq = b.seq_lens.ptr<int32_t>()[row.req];
      FUZZ_CHECK(row.req == i / b.q_len);
      FUZZ_CHECK(row.pos == (seq == 0 ? -1 : int64_t{seq} - b.q_len + i % b.q_len));
    } else {
      const int32_t* cu = b.cu_seqlens_q.ptr<int32_t>();
      FUZZ_CHECK(cu[row.req] <= i && i < cu[row.req + 1]);
      FUZZ_CHECK(row.pos == int64_t{b.context_lens.ptr<int32_t>()[row.req]} + (i - cu[row.req]));
    }
    if (row.pos < 0) {
      FUZZ_CHECK(row.pos == -1 && b.kind == BatchKind::kDecode, "dead row with pos %lld",
                 (long long)row.pos);
      continue;
    }
    const int64_t nb = visible_blocks(row.pos, config.block_size);
    FUZZ_CHECK(nb - 1 <= kMaxBlockId, "row %lld sees block %lld", (long long)i,
               (long long)(nb - 1));
    for (const auto& [table, pages] :
         {std::pair{b.index_block_table, index_pages}, {b.kv_block_table, kv_pages}}) {
      if (!table.defined()) continue;
      FUZZ_CHECK(nb <= table.shape[1]);
      const int32_t* entries = table.ptr<int32_t>() + int64_t{row.req} * table.shape[1];
      for (int64_t blk = 0; blk < nb; ++blk) {
        FUZZ_CHECK(entries[blk] >= 0 && entries[blk] < pages, "table entry %d, pages %lld",
                   entries[blk], (long long)pages);
      }
    }
  }
  for (const auto& [slots, pages] :
       {std::pair{b.slot_mapping, kv_pages}, {b.index_slot_mapping, index_pages}}) {
    if (!slots.defined()) continue;
    for (int64_t i = 0; i < slots.shape[0]; ++i) {
      const int64_t slot = slots.ptr<int64_t>()[i];
      FUZZ_CHECK(slot < 0 || static_cast<__int128>(slot) < static_cast<__int128>(pages) * bs,
                 "slot %lld with %lld pages", (long long)slot, (long long)pages);
    }
  }
}

}  // namespace
}  // namespace m3msa::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace m3msa;
  using namespace m3msa::fuzz;
  FuzzedDataProvider in(data, size);
  Storage storage;
  const SparseConfig config = make_config(in);
  const int bs = config.block_size > 0 ? config.block_size : 1;
  const int64_t index_pages = in.ConsumeIntegralInRange<int>(0, 7) == 0
                                  ? hostile_i64(in)
                                  : in.ConsumeIntegralInRange(0, 16);
  const int64_t kv_pages = in.ConsumeIntegralInRange<int>(0, 7) == 0
                               ? hostile_i64(in)
                               : in.ConsumeIntegralInRange(0, 16);

  BatchMeta b;
  const int kind = in.ConsumeIntegralInRange<int>(0, 20);
  b.kind = kind == 0 ? static_cast<BatchKind>(hostile_int(in)) : static_cast<BatchKind>(kind & 1);
  b.num_reqs =
      in.ConsumeIntegralInRange<int>(0, 9) == 0 ? hostile_int(in) : in.ConsumeIntegralInRange(0, 5);
  b.q_len =
      in.ConsumeIntegralInRange<int>(0, 9) == 0 ? hostile_int(in) : in.ConsumeIntegralInRange(1, 4);
  const int64_t reqs = b.num_reqs;
  const int32_t max_len =
      static_cast<int32_t>(std::min<int64_t>(int64_t{bs} * (in.ConsumeBool() ? 3 : 12), 1 << 30));

  if (b.kind == BatchKind::kPrefill) {
    // Mostly a well-formed prefix sum starting at 0, so the content checks are reached.
    std::vector<int32_t> cu(
        static_cast<std::size_t>(std::max<int64_t>(0, std::min<int64_t>(reqs, 64)) + 1));
    for (std::size_t i = 1; i < cu.size(); ++i) {
      cu[i] = static_cast<int32_t>(cu[i - 1] + in.ConsumeIntegralInRange<int32_t>(
                                                   0, std::min(2 * int64_t{bs}, int64_t{1} << 24)));
    }
    b.cu_seqlens_q = make_tensor<int64_t>(in, storage, DType::kI32, {reqs + 1}, [&](int64_t i) {
      return static_cast<std::size_t>(i) < cu.size() && in.ConsumeIntegralInRange<int>(0, 15) != 0
                 ? int64_t{cu[static_cast<std::size_t>(i)]}
                 : int64_t{hostile_int(in, 64)};
    });
    b.context_lens = make_tensor<int64_t>(in, storage, DType::kI32, {reqs},
                                          [&](int64_t) { return hostile_length(in, max_len); });
    b.num_tokens = in.ConsumeIntegralInRange<int>(0, 7) == 0 ? hostile_i64(in) : cu.back();
  } else {
    b.seq_lens = make_tensor<int64_t>(in, storage, DType::kI32, {reqs}, [&](int64_t) {
      return in.ConsumeIntegralInRange<int>(0, 5) == 0 ? 0 : hostile_length(in, max_len);
    });
  }
  const int64_t rows = b.num_rows();
  const int64_t columns = in.ConsumeIntegralInRange<int64_t>(0, 14);
  auto table_entry = [&](int64_t pages) {
    return [&in, pages](int64_t) -> int64_t {
      if (in.ConsumeIntegralInRange<int>(0, 15) == 0) return hostile_int(in);
      return pages > 0
                 ? in.ConsumeIntegralInRange<int64_t>(0, std::min<int64_t>(pages, 1 << 20) - 1)
                 : 0;
    };
  };
  b.index_block_table =
      make_tensor<int64_t>(in, storage, DType::kI32, {reqs, columns}, table_entry(index_pages));
  b.kv_block_table =
      make_tensor<int64_t>(in, storage, DType::kI32, {reqs, columns}, table_entry(kv_pages));
  auto slot = [&](int64_t pages) {
    return [&in, pages, bs](int64_t) -> int64_t {
      if (in.ConsumeIntegralInRange<int>(0, 15) == 0) return hostile_i64(in);
      const int64_t span = pages > 0 && pages < (int64_t{1} << 30) ? pages * bs : 1;
      return in.ConsumeIntegralInRange<int64_t>(-1, span - 1);
    };
  };
  b.slot_mapping = make_tensor<int64_t>(in, storage, DType::kI64, {rows}, slot(kv_pages));
  b.index_slot_mapping = make_tensor<int64_t>(in, storage, DType::kI64, {rows}, slot(index_pages));

  if (accepts([&] { validate_batch_contents(b, config, index_pages, kv_pages); })) {
    check_accepted(b, config, index_pages, kv_pages);
  }
  // The shape-only validator on a hostile device must keep the same contract.
  Device device;
  device.type = static_cast<DeviceType>(in.ConsumeIntegralInRange<int>(0, 2));
  device.index = in.ConsumeIntegralInRange<int>(-1, 2);
  accepts([&] { validate_batch_shapes(b, device); });
  return 0;
}
