// Bad input to the CPU reference: every case must be an Error(kInvalidArgument) whose message names
// the argument, thrown before any output is touched.
#include <gtest/gtest.h>

#include <climits>
#include <cstring>
#include <functional>
#include <string>

#include "m3msa/backend.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "reference_test_util.h"

namespace m3msa {
namespace {

using reftest::Case;
using reftest::CaseSpec;
using reftest::make_case;

void expect_invalid(const std::function<void()>& call, const std::string& name) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one naming '" << name << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos)
        << "message does not name '" << name << "': " << e.what();
  }
}

Case base_case() {
  CaseSpec spec;
  spec.q_len = 2;
  spec.seq_lens = {20, 9, 0};
  return make_case(spec);
}

struct Outs {
  HostTensor topk, out;
  explicit Outs(const Case& c)
      : topk(DType::kI32, {c.rows(), c.config.index_heads, c.config.topk}),
        out(DType::kBF16, {c.rows(), c.config.q_heads, c.config.head_dim}) {
    topk.fill_bytes(0x5A);
    out.fill_bytes(0x5A);
  }
};

void select(const Case& c, const IndexerArgs& args) {
  cpu::select_topk(c.config, args, 2);
}
void attend(const Case& c, const AttentionArgs& args) {
  cpu::sparse_attention(c.config, args, 2);
}

TEST(ReferenceValidation, IndexerTensorShapesDtypesStridesDevices) {
  Case c = base_case();
  Outs o(c);
  const int64_t rows = c.rows();
  const int H = c.config.index_heads, D = c.config.index_dim, k = c.config.topk;
  {
    IndexerArgs a = c.indexer(o.topk.view());
    a.index_q = TensorView::contiguous(c.index_q.data(), DType::kBF16, {rows, H, D / 2});
    expect_invalid([&] { select(c, a); }, "index_q");
  }
  {
    IndexerArgs a = c.indexer(o.topk.view());
    a.index_q.dtype = DType::kF32;
    expect_invalid([&] { select(c, a); }, "index_q");
  }
  {
    // An fp8 index_q is taken only beside an fp8 index cache (base_case's is bf16).
    ASSERT_EQ(c.index_cache.dtype(), DType::kBF16);
    HostTensor q8(DType::kFP8E4M3, {rows, H, D});
    IndexerArgs a = c.indexer(o.topk.view());
    a.index_q = q8.view();
    expect_invalid([&] { select(c, a); }, "index_q: an fp8_e4m3 index_q needs an fp8_e4m3");
  }
  {
    IndexerArgs a = c.indexer(o.topk.view());
    a.index_q.strides[1] = 1;  // heads interleaved: not row-major
    a.index_q.strides[2] = H;
    expect_invalid([&] { select(c, a); }, "index_q");
  }
  {
    IndexerArgs a = c.indexer(o.topk.view());
    a.index_q.device = Device::cuda(0);
    expect_invalid([&] { select(c, a); }, "index_q");
  }
  {
    IndexerArgs a = c.indexer(TensorView::contiguous(o.topk.data(), DType::kI32, {rows, H, k - 1}));
    expect_invalid([&] { select(c, a); }, "topk_idx");
    a.topk_idx = TensorView::contiguous(o.topk.data(), DType::kI64, {rows, H, k / 2});
    expect_invalid([&] { select(c, a); }, "topk_idx");
  }
  {
    IndexerArgs a = c.indexer(o.topk.view());
    a.index_cache.data.shape[1] = c.config.block_size * 2;
    expect_invalid([&] { select(c, a); }, "index_cache");
    a.index_cache.data = c.index_cache.view();
    a.index_cache.data.dtype = DType::kF32;
    expect_invalid([&] { select(c, a); }, "index_cache");
  }
  {
    IndexerArgs a = c.indexer(o.topk.view());
    a.batch.index_block_table = {};
    expect_invalid([&] { select(c, a); }, "batch.index_block_table");
  }
  {
    HostTensor scores(DType::kF32, {rows, H + 1, 5});
    expect_invalid([&] { cpu::score_blocks(c.config, c.indexer(), scores.view(), 1); }, "scores");
    HostTensor keys(DType::kI64, {rows, H, k});
    expect_invalid([&] { cpu::nominate(c.config, c.indexer(), 0, 1, keys.view(), 1); }, "keys");
    HostTensor good_keys(DType::kU64, {rows, H, k});
    expect_invalid([&] { cpu::nominate(c.config, c.indexer(), 2, 2, good_keys.view(), 1); },
                   "shard");
    expect_invalid([&] { cpu::nominate(c.config, c.indexer(), 0, 0, good_keys.view(), 1); },
                   "num_shards");
  }
  expect_invalid([&] { cpu::select_topk(c.config, c.indexer(o.topk.view()), -1); }, "threads");
  expect_invalid([&] { make_cpu_backend(-2); }, "threads");
  // Nothing above may have written the output.
  for (int64_t i = 0; i < o.topk.numel(); ++i) ASSERT_EQ(o.topk.ptr<uint32_t>()[i], 0x5A5A5A5Au);
}

TEST(ReferenceValidation, BatchLengthsAndTables) {
  {
    Case c = base_case();
    Outs o(c);
    c.seq_lens.ptr<int32_t>()[1] = -5;
    expect_invalid([&] { select(c, c.indexer(o.topk.view())); }, "batch.seq_lens");
    c.seq_lens.ptr<int32_t>()[1] = 1;  // live but shorter than q_len = 2
    expect_invalid([&] { select(c, c.indexer(o.topk.view())); }, "batch.seq_lens");
    c.seq_lens.ptr<int32_t>()[1] = INT32_MAX;  // block ids past kMaxBlockId
    expect_invalid([&] { select(c, c.indexer(o.topk.view())); }, "sequence length");
    c.seq_lens.ptr<int32_t>()[1] = 9;
    c.seq_lens.ptr<int32_t>()[0] = 40;  // needs 5 table columns, the table has 3
    expect_invalid([&] { select(c, c.indexer(o.topk.view())); }, "batch.index_block_table");
    for (int64_t i = 0; i < o.topk.numel(); ++i) ASSERT_EQ(o.topk.ptr<uint32_t>()[i], 0x5A5A5A5Au);
  }
  for (int32_t bad : {-1, 1000}) {
    Case c = base_case();
    Outs o(c);
    c.index_table.ptr<int32_t>()[1] = bad;  // request 0, block 1 (seq_len 20 sees 3 blocks)
    expect_invalid([&] { select(c, c.indexer(o.topk.view())); }, "batch.index_block_table");
    c.kv_table.ptr<int32_t>()[2] = bad;
    expect_invalid([&] { attend(c, c.attention(o.topk.view(), o.out.view())); },
                   "batch.kv_block_table");
  }
  for (int q_len : {0, 9, -1}) {
    Case c = base_case();
    Outs o(c);
    c.batch.q_len = q_len;
    expect_invalid([&] { select(c, c.indexer(o.topk.view())); }, "batch.q_len");
  }
  {
    Case c = base_case();
    Outs o(c);
    c.batch.num_reqs = 4;  // seq_lens has 3 entries
    expect_invalid([&] { select(c, c.indexer(o.topk.view())); }, "batch.seq_lens");
    c.batch.num_reqs = -1;
    expect_invalid([&] { select(c, c.indexer(o.topk.view())); }, "batch.num_reqs");
  }
}

TEST(ReferenceValidation, PrefillBatch) {
  CaseSpec spec;
  spec.kind = BatchKind::kPrefill;
  spec.context_lens = {5, 30};
  spec.chunk_lens = {6, 2};
  Case c = make_case(spec);
  Outs o(c);
  select(c, c.indexer(o.topk.view()));  // the unmodified case is valid
  c.context_lens.ptr<int32_t>()[1] = -3;
  expect_invalid([&] { select(c, c.indexer(o.topk.view())); }, "batch.context_lens");
  c.context_lens.ptr<int32_t>()[1] = INT32_MAX - 1;
  expect_invalid([&] { select(c, c.indexer(o.topk.view())); }, "sequence length");
  c.context_lens.ptr<int32_t>()[1] = 30;
  c.cu_seqlens_q.ptr<int32_t>()[1] = 9;  // 0, 9, 8: decreasing
  expect_invalid([&] { select(c, c.indexer(o.topk.view())); }, "batch.cu_seqlens_q");
  c.cu_seqlens_q.ptr<int32_t>()[1] = 6;
  // num_tokens one short of cu_seqlens_q[2]; every per-row tensor sized to match num_tokens so the
  // contents check is what fires.
  c.batch.num_tokens = 7;
  c.batch.slot_mapping = {};
  c.batch.index_slot_mapping = {};
  IndexerArgs a = c.indexer(
      TensorView::contiguous(o.topk.data(), DType::kI32, {7, c.config.index_heads, c.config.topk}));
  a.index_q = TensorView::contiguous(c.index_q.data(), DType::kBF16,
                                     {7, c.config.index_heads, c.config.index_dim});
  expect_invalid([&] { select(c, a); }, "num_tokens");
}

TEST(ReferenceValidation, Config) {
  Case c = base_case();
  Outs o(c);
  SparseConfig cfg = c.config;
  cfg.index_heads = 1;
  expect_invalid([&] { cpu::select_topk(cfg, c.indexer(o.topk.view()), 1); }, "config.index_heads");
  cfg = c.config;
  cfg.topk = 0;
  expect_invalid([&] { cpu::select_topk(cfg, c.indexer(o.topk.view()), 1); }, "config.topk");
  cfg = c.config;
  cfg.init_blocks = 3;
  cfg.local_blocks = 2;
  expect_invalid([&] { cpu::select_topk(cfg, c.indexer(o.topk.view()), 1); }, "config.init_blocks");
  cfg = c.config;
  cfg.q_heads = 3;
  expect_invalid([&] { cpu::sparse_attention(cfg, c.attention({}, o.out.view()), 1); },
                 "config.q_heads");
}

TEST(ReferenceValidation, AttentionArguments) {
  Case c = base_case();
  Outs o(c);
  select(c, c.indexer(o.topk.view()));
  const int64_t rows = c.rows();
  {
    AttentionArgs a = c.attention(o.topk.view(), o.out.view());
    a.q = TensorView::contiguous(c.q.data(), DType::kBF16, {rows, c.config.q_heads - 1, 16});
    expect_invalid([&] { attend(c, a); }, "q: expected shape");
  }
  {
    AttentionArgs a = c.attention(o.topk.view(), o.out.view());
    a.out.dtype = DType::kF32;
    expect_invalid([&] { attend(c, a); }, "out");
  }
  {
    AttentionArgs a = c.attention(o.topk.view(), o.out.view());
    a.kv_cache.v_scale = 0.0f;
    expect_invalid([&] { attend(c, a); }, "kv_cache");
  }
  {
    AttentionArgs a = c.attention(o.topk.view(), o.out.view());
    a.batch.kv_block_table = {};
    expect_invalid([&] { attend(c, a); }, "batch.kv_block_table");
  }
  // topk_idx contents: a block the row cannot see, a valid entry after -1, a repeated block.
  const int k = c.config.topk;
  auto with_entry = [&](int64_t index, int32_t value) {
    HostTensor t(DType::kI32, {rows, c.config.kv_heads, k});
    std::memcpy(t.data(), o.topk.data(), t.nbytes());
    t.ptr<int32_t>()[index] = value;
    return t;
  };
  HostTensor out(DType::kBF16, {rows, c.config.q_heads, c.config.head_dim});
  out.fill_bytes(0x5A);
  // Row 0 sits at position 18: 3 visible blocks, so its entries are 2, x, y, -1.
  for (auto [index, value] :
       {std::pair<int64_t, int32_t>{1, 3}, {1, -2}, {1, -1}, {3, 1}, {2, 2}}) {
    const HostTensor bad = with_entry(index, value);
    expect_invalid([&] { attend(c, c.attention(bad.view(), out.view())); }, "topk_idx");
  }
  // Dead rows (request 2) must hold -1 only.
  const HostTensor dead = with_entry(4 * c.config.kv_heads * k, 0);
  expect_invalid([&] { attend(c, c.attention(dead.view(), out.view())); }, "topk_idx");
  for (int64_t i = 0; i < out.numel(); ++i) ASSERT_EQ(out.ptr<uint16_t>()[i], 0x5A5A);
}

TEST(ReferenceValidation, PreprocessArguments) {
  Case c = base_case();
  const SparseConfig& cfg = c.config;
  const int64_t rows = c.rows();
  HostTensor qkv(DType::kBF16, {rows, cfg.qkv_width()});
  qkv.fill_bytes(0);
  HostTensor norm(DType::kBF16, {cfg.head_dim});
  norm.fill_bytes(0);
  HostTensor q_out(DType::kBF16, {rows, cfg.q_heads, cfg.head_dim});
  HostTensor index_q_out(DType::kBF16, {rows, cfg.index_heads, cfg.index_dim});
  auto args = [&] {
    PreprocessArgs a;
    a.qkv = qkv.view();
    a.q_norm = a.k_norm = a.index_q_norm = a.index_k_norm = norm.view();
    a.positions = c.positions.view();
    a.batch = c.batch;
    a.kv_cache = c.kv_cache_view();
    a.index_cache = c.index_cache_view();
    a.q_out = q_out.view();
    a.index_q_out = index_q_out.view();
    return a;
  };
  cpu::preprocess(cfg, args(), 1);  // valid as built
  {
    PreprocessArgs a = args();
    a.qkv = TensorView::contiguous(qkv.data(), DType::kBF16, {rows, cfg.qkv_width() - 16});
    expect_invalid([&] { cpu::preprocess(cfg, a, 1); }, "qkv");
  }
  {
    PreprocessArgs a = args();
    a.q_norm = TensorView::contiguous(norm.data(), DType::kBF16, {cfg.head_dim / 2});
    expect_invalid([&] { cpu::preprocess(cfg, a, 1); }, "q_norm");
  }
  {
    PreprocessArgs a = args();
    a.positions.dtype = DType::kI32;
    expect_invalid([&] { cpu::preprocess(cfg, a, 1); }, "positions");
  }
  {
    PreprocessArgs a = args();
    a.batch.slot_mapping = {};
    expect_invalid([&] { cpu::preprocess(cfg, a, 1); }, "batch.slot_mapping");
  }
  {
    HostTensor slots(DType::kI64, {rows});
    std::memcpy(slots.data(), c.slot_mapping.data(), slots.nbytes());
    slots.ptr<int64_t>()[1] = slots.ptr<int64_t>()[0];  // two live tokens, one slot
    PreprocessArgs a = args();
    a.batch.slot_mapping = slots.view();
    expect_invalid([&] { cpu::preprocess(cfg, a, 1); }, "batch.slot_mapping");
  }
  {
    HostTensor slots(DType::kI64, {rows});
    std::memcpy(slots.data(), c.index_slot_mapping.data(), slots.nbytes());
    slots.ptr<int64_t>()[2] = c.index_cache.shape()[0] * cfg.block_size;  // one past the cache
    PreprocessArgs a = args();
    a.batch.index_slot_mapping = slots.view();
    expect_invalid([&] { cpu::preprocess(cfg, a, 1); }, "batch.index_slot_mapping");
  }
}

}  // namespace
}  // namespace m3msa
