#include "m3msa/batch.h"

#include <algorithm>
#include <utility>

#include "m3msa/error.h"
#include "m3msa/sort_key.h"

namespace m3msa {

void validate_batch_shapes(const BatchMeta& batch, Device device) {
  M3MSA_CHECK_ARG(batch.num_reqs >= 0, "batch.num_reqs must be >= 0, got ", batch.num_reqs);
  const int64_t reqs = batch.num_reqs;
  if (batch.kind == BatchKind::kDecode) {
    M3MSA_CHECK_ARG(batch.q_len >= 1 && batch.q_len <= kMaxQueryLen, "batch.q_len must be in [1, ",
                    kMaxQueryLen, "], got ", batch.q_len);
    check_tensor(batch.seq_lens, "batch.seq_lens", DType::kI32, {reqs});
    check_device(batch.seq_lens, "batch.seq_lens", device);
  } else if (batch.kind == BatchKind::kPrefill) {
    M3MSA_CHECK_ARG(batch.num_tokens >= 0, "batch.num_tokens must be >= 0, got ", batch.num_tokens);
    check_tensor(batch.cu_seqlens_q, "batch.cu_seqlens_q", DType::kI32, {reqs + 1});
    check_tensor(batch.context_lens, "batch.context_lens", DType::kI32, {reqs});
    check_device(batch.cu_seqlens_q, "batch.cu_seqlens_q", device);
    check_device(batch.context_lens, "batch.context_lens", device);
  } else {
    M3MSA_THROW(ErrorCode::kInvalidArgument, "batch.kind: unknown value ",
                static_cast<int>(batch.kind));
  }
  const int64_t rows = batch.num_rows();
  if (batch.index_block_table.defined()) {
    check_tensor(batch.index_block_table, "batch.index_block_table", DType::kI32, {reqs, -1});
    check_device(batch.index_block_table, "batch.index_block_table", device);
  }
  if (batch.kv_block_table.defined()) {
    check_tensor(batch.kv_block_table, "batch.kv_block_table", DType::kI32, {reqs, -1});
    check_device(batch.kv_block_table, "batch.kv_block_table", device);
  }
  if (batch.slot_mapping.defined()) {
    check_tensor(batch.slot_mapping, "batch.slot_mapping", DType::kI64, {rows});
    check_device(batch.slot_mapping, "batch.slot_mapping", device);
  }
  if (batch.index_slot_mapping.defined()) {
    check_tensor(batch.index_slot_mapping, "batch.index_slot_mapping", DType::kI64, {rows});
    check_device(batch.index_slot_mapping, "batch.index_slot_mapping", device);
  }
}

namespace {
void check_table_row(const TensorView& table, const char* name, int req, int64_t blocks,
                     int64_t pages) {
  if (!table.defined()) return;
  M3MSA_CHECK_ARG(blocks <= table.shape[1], name, ": request ", req, " needs ", blocks,
                  " blocks but the table has ", table.shape[1], " columns");
  const int32_t* row = table.ptr<int32_t>() + req * table.shape[1];
  for (int64_t b = 0; b < blocks; ++b) {
    M3MSA_CHECK_ARG(row[b] >= 0 && row[b] < pages, name, "[", req, "][", b, "] = ", row[b],
                    " is not a page in [0, ", pages, ")");
  }
}

void check_slots(const TensorView& slots, const char* name, int64_t pages, int block_size) {
  if (!slots.defined()) return;
  const int64_t* data = slots.ptr<int64_t>();
  for (int64_t i = 0; i < slots.shape[0]; ++i) {
    // slot < pages * block_size, without the product (pages can be any int64).
    M3MSA_CHECK_ARG(data[i] < 0 || data[i] / block_size < pages, name, "[", i, "] = ", data[i],
                    " is past the cache (", pages, " pages of ", block_size, " tokens)");
  }
}
}  // namespace

void validate_batch_contents(const BatchMeta& batch, const SparseConfig& config,
                             int64_t index_pages, int64_t kv_pages) {
  validate_batch_shapes(batch, Device::cpu());
  M3MSA_CHECK_ARG(config.block_size > 0, "config.block_size must be > 0, got ", config.block_size);
  M3MSA_CHECK_ARG(index_pages >= 0, "index_pages must be >= 0, got ", index_pages);
  M3MSA_CHECK_ARG(kv_pages >= 0, "kv_pages must be >= 0, got ", kv_pages);
  if (batch.kind == BatchKind::kPrefill) {
    // Checked before the loop: with cu[0] == 0 and every step non-decreasing, all offsets are
    // in [0, INT32_MAX], so the differences below cannot overflow.
    const int32_t* cu = batch.cu_seqlens_q.ptr<int32_t>();
    M3MSA_CHECK_ARG(cu[0] == 0, "batch.cu_seqlens_q[0] must be 0, got ", cu[0]);
  }
  const int64_t max_tokens = (kMaxBlockId + 1) * int64_t{config.block_size};
  for (int req = 0; req < batch.num_reqs; ++req) {
    int64_t end = 0;  // one past the last position of the request
    if (batch.kind == BatchKind::kDecode) {
      const int32_t seq_len = batch.seq_lens.ptr<int32_t>()[req];
      M3MSA_CHECK_ARG(seq_len == 0 || seq_len >= batch.q_len, "batch.seq_lens[", req,
                      "] = ", seq_len, " must be 0 (padding) or >= q_len (", batch.q_len, ")");
      end = seq_len;
    } else {
      const int32_t* cu = batch.cu_seqlens_q.ptr<int32_t>();
      const int32_t context = batch.context_lens.ptr<int32_t>()[req];
      M3MSA_CHECK_ARG(cu[req + 1] >= cu[req], "batch.cu_seqlens_q must be non-decreasing, got ",
                      cu[req], " then ", cu[req + 1], " at request ", req);
      M3MSA_CHECK_ARG(context >= 0, "batch.context_lens[", req, "] must be >= 0, got ", context);
      end = int64_t{context} + (int64_t{cu[req + 1]} - cu[req]);
    }
    // Name the argument that carries the length: seq_lens for decode, context_lens (plus the
    // request's new tokens) for prefill.
    M3MSA_CHECK_ARG(end >= 0 && end <= max_tokens,
                    batch.kind == BatchKind::kDecode ? "batch.seq_lens[" : "batch.context_lens[",
                    req, "]", batch.kind == BatchKind::kDecode ? "" : " + new tokens",
                    ": sequence length ", end, " is out of range [0, ", max_tokens, "] (",
                    kMaxBlockId + 1, " blocks of ", config.block_size,
                    " tokens: block ids are capped at ", kMaxBlockId, ")");
    const int64_t blocks = (end + config.block_size - 1) / config.block_size;
    check_table_row(batch.index_block_table, "batch.index_block_table", req, blocks, index_pages);
    check_table_row(batch.kv_block_table, "batch.kv_block_table", req, blocks, kv_pages);
  }
  if (batch.kind == BatchKind::kPrefill) {
    const int32_t* cu = batch.cu_seqlens_q.ptr<int32_t>();
    M3MSA_CHECK_ARG(cu[batch.num_reqs] == batch.num_tokens, "batch.cu_seqlens_q[", batch.num_reqs,
                    "] = ", cu[batch.num_reqs], " must equal batch.num_tokens (", batch.num_tokens,
                    ")");
  }
  check_slots(batch.slot_mapping, "batch.slot_mapping", kv_pages, config.block_size);
  check_slots(batch.index_slot_mapping, "batch.index_slot_mapping", index_pages, config.block_size);
}

void check_unique_slots(const TensorView& slots, const TensorView& positions, const char* name) {
  const int64_t* slot = slots.ptr<const int64_t>();
  const int64_t* pos = positions.ptr<const int64_t>();
  std::vector<std::pair<int64_t, int64_t>> used;  // (slot, row)
  for (int64_t row = 0; row < slots.shape[0]; ++row) {
    if (pos[row] >= 0 && slot[row] >= 0) used.emplace_back(slot[row], row);
  }
  std::sort(used.begin(), used.end());
  for (std::size_t i = 1; i < used.size(); ++i) {
    M3MSA_CHECK_ARG(used[i].first != used[i - 1].first, name, "[", used[i].second,
                    "] = ", used[i].first, " repeats ", name, "[", used[i - 1].second,
                    "]: two tokens cannot share a cache slot");
  }
}

std::vector<RowPosition> row_positions(const BatchMeta& batch) {
  validate_batch_shapes(batch, Device::cpu());
  std::vector<RowPosition> rows(static_cast<std::size_t>(batch.num_rows()));
  if (batch.kind == BatchKind::kDecode) {
    const int32_t* seq_lens = batch.seq_lens.ptr<int32_t>();
    for (int req = 0; req < batch.num_reqs; ++req) {
      for (int j = 0; j < batch.q_len; ++j) {
        RowPosition& row = rows[static_cast<std::size_t>(req) * batch.q_len + j];
        row.req = req;
        row.pos = seq_lens[req] == 0 ? -1 : int64_t{seq_lens[req]} - batch.q_len + j;
      }
    }
  } else {
    const int32_t* cu = batch.cu_seqlens_q.ptr<int32_t>();
    const int32_t* context = batch.context_lens.ptr<int32_t>();
    for (int req = 0; req < batch.num_reqs; ++req) {
      for (int32_t i = cu[req]; i < cu[req + 1]; ++i) {
        M3MSA_CHECK_ARG(i >= 0 && i < batch.num_tokens, "batch.cu_seqlens_q: row ", i,
                        " is outside [0, num_tokens = ", batch.num_tokens, ")");
        rows[static_cast<std::size_t>(i)] = {req, int64_t{context[req]} + (i - cu[req])};
      }
    }
  }
  return rows;
}

}  // namespace m3msa
