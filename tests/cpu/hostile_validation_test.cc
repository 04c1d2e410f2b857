// Hostile inputs to the host validators: each test pins one input the fuzzers (fuzz/) found or
// the reliability review (docs/reliability.md) listed, and the block-id limit of docs/spec.md
// section
// 4. Every case must end in an m3msa::Error whose message names the argument, never in a crash,
// UB (the sanitizer build runs these) or a silently accepted value.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "m3msa/batch.h"
#include "m3msa/config.h"
#include "m3msa/error.h"
#include "m3msa/ops.h"
#include "m3msa/sort_key.h"
#include "m3msa/tensor.h"

namespace m3msa {
namespace {

constexpr int kIntMax = std::numeric_limits<int>::max();
constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();

// Runs `f`, expects an invalid-argument error whose message contains `needle`.
template <typename F>
void expect_rejected(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "accepted; expected an error naming '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_NE(e.message().find(needle), std::string::npos)
        << "message does not name '" << needle << "': " << e.what();
  }
}

// ---- Configs ----

TEST(HostileConfig, ForcedBlockSumDoesNotOverflow) {
  SparseConfig c;
  c.init_blocks = kIntMax;  // init + local used to wrap to a negative int and pass
  c.local_blocks = 5;
  expect_rejected([&] { c.validate(); }, "config.init_blocks + config.local_blocks");
}

TEST(HostileConfig, NonFiniteRopeThetaAndEpsAreRejected) {
  for (double theta : {std::numeric_limits<double>::infinity(), std::nan(""), 0.0, -1.0}) {
    SparseConfig c;
    c.rope_theta = theta;
    expect_rejected([&] { c.validate(); }, "config.rope_theta");
  }
  for (float eps : {std::numeric_limits<float>::infinity(), std::nanf(""), 0.0f}) {
    SparseConfig c;
    c.rms_eps = eps;
    expect_rejected([&] { c.validate(); }, "config.rms_eps");
  }
}

TEST(HostileConfig, ModelSplitsValidateOrNameTheField) {
  ModelConfig m;
  EXPECT_NO_THROW(m.validate());
  expect_rejected([&] { m.sparse(0); }, "tp_size");
  expect_rejected([&] { m.sparse(3); }, "tp_size");
  for (int tp : {1, 2, 4, 8, 16, 32, 64}) EXPECT_NO_THROW(m.sparse(tp).validate()) << tp;
  m.first_sparse_layer = m.num_layers;
  expect_rejected([&] { m.validate(); }, "model.first_sparse_layer");
}

// Found by fuzz_config (fuzz/corpus/fuzz_config/regression-zero-kv-heads-model): a model with
// 0 KV and index heads passed validate(), since sparse(1) maps 0 KV heads to 1 per rank; its CP
// view (every index head on the rank) then had 0 index heads.
TEST(HostileConfig, ModelWithoutKvHeadsIsRejected) {
  ModelConfig m;
  m.kv_heads = m.index_heads = 0;
  expect_rejected([&] { m.validate(); }, "model.kv_heads");
  m = ModelConfig{};
  m.q_heads = 0;
  expect_rejected([&] { m.validate(); }, "model.q_heads");
  // Every valid model's CP view validates, with all its index heads.
  for (int tp : {1, 2, 4, 8}) {
    const SparseConfig cp = ModelConfig{}.sparse(tp, true);
    EXPECT_NO_THROW(cp.validate()) << tp;
    EXPECT_EQ(cp.index_heads, ModelConfig{}.index_heads) << tp;
  }
}

// ---- Tensor views ----

TEST(HostileTensor, RankOutsideTheViewIsRejectedBeforeAnyIndexing) {
  int32_t storage[4] = {};
  for (int ndim : {-1, 7, 100, std::numeric_limits<int>::min()}) {
    TensorView v = TensorView::contiguous(storage, DType::kI32, {4});
    v.ndim = ndim;  // used to read shape[] past its 6 entries while building the message
    expect_rejected([&] { check_tensor(v, "arg", DType::kI32, {4}); }, "arg");
    EXPECT_FALSE(describe(v).empty());
  }
}

TEST(HostileTensor, NegativeExtentsAreRejectedEvenWhereAnyExtentIsExpected) {
  int32_t storage[4] = {};
  TensorView v = TensorView::contiguous(storage, DType::kI32, {2, 2});
  v.shape[1] = -3;
  expect_rejected([&] { check_tensor(v, "table", DType::kI32, {2, -1}); }, "table");
}

TEST(HostileTensor, SizesThatOverflowInt64AreRejected) {
  int32_t storage[4] = {};
  TensorView v = TensorView::contiguous(storage, DType::kI32, {1, 1, 1});
  v.shape = {int64_t{1} << 40, int64_t{1} << 40, 1};
  expect_rejected([&] { check_tensor(v, "big", DType::kI32, {-1, -1, -1}); }, "big");
  // A zero extent first does not make the strides of the others safe to multiply.
  v.shape = {0, int64_t{1} << 62, int64_t{1} << 62};
  expect_rejected([&] { check_tensor(v, "big", DType::kI32, {-1, -1, -1}); }, "big");
  // Elements fit, bytes do not.
  v.shape = {int64_t{1} << 30, int64_t{1} << 30, 2};
  expect_rejected([&] { check_tensor(v, "big", DType::kI32, {-1, -1, -1}); }, "big");

  expect_rejected(
      [&] {
        TensorView::contiguous(nullptr, DType::kF32, {int64_t{1} << 40, int64_t{1} << 40});
      },
      "int64");
  expect_rejected([&] { HostTensor(DType::kF32, {int64_t{1} << 40, int64_t{1} << 40}); }, "int64");
  expect_rejected([&] { HostTensor(DType::kF32, {kI64Max / 2}); }, "int64");
}

TEST(HostileTensor, UnknownDtypeIsAnError) {
  int32_t storage[4] = {};
  TensorView v = TensorView::contiguous(storage, DType::kI32, {4});
  v.dtype = static_cast<DType>(99);
  expect_rejected([&] { check_tensor(v, "x", {DType::kBF16, DType::kFP8E4M3}, {4}); }, "x");
  expect_rejected([&] { HostTensor(static_cast<DType>(-1), {4}); }, "dtype");
}

// ---- Batches ----

SparseConfig tiny_config(int block_size = 4) {
  SparseConfig c;
  c.q_heads = 1;
  c.kv_heads = 1;
  c.index_heads = 1;
  c.head_dim = 8;
  c.index_dim = 8;
  c.rope_dim = 8;
  c.block_size = block_size;
  c.topk = 2;
  return c;
}

struct PrefillBatch {
  HostTensor cu{DType::kI32, {3}}, context{DType::kI32, {2}}, table{DType::kI32, {2, 4}};
  BatchMeta batch;
  PrefillBatch(std::vector<int32_t> cu_values, std::vector<int32_t> context_values) {
    for (int i = 0; i < 3; ++i) cu.ptr<int32_t>()[i] = cu_values[i];
    for (int i = 0; i < 2; ++i) context.ptr<int32_t>()[i] = context_values[i];
    for (int i = 0; i < 8; ++i) table.ptr<int32_t>()[i] = 0;
    batch.kind = BatchKind::kPrefill;
    batch.num_reqs = 2;
    batch.num_tokens = cu_values[2];
    batch.cu_seqlens_q = cu.view();
    batch.context_lens = context.view();
    batch.index_block_table = table.view();
  }
};

TEST(HostileBatch, CuSeqlensDifferencesDoNotOverflow) {
  // cu = [INT_MIN, INT_MAX, INT_MAX]: non-decreasing, but INT_MAX - INT_MIN wraps in 32 bits.
  PrefillBatch p({std::numeric_limits<int32_t>::min(), kIntMax, kIntMax}, {0, 0});
  expect_rejected([&] { validate_batch_contents(p.batch, tiny_config(), 1, 1); },
                  "batch.cu_seqlens_q[0]");
}

TEST(HostileBatch, ZeroBlockSizeAndNegativePageCountsAreErrors) {
  PrefillBatch p({0, 1, 2}, {0, 0});
  expect_rejected([&] { validate_batch_contents(p.batch, tiny_config(0), 1, 1); },
                  "config.block_size");
  expect_rejected([&] { validate_batch_contents(p.batch, tiny_config(), -1, 1); }, "index_pages");
  expect_rejected([&] { validate_batch_contents(p.batch, tiny_config(), 1, -5); }, "kv_pages");
}

TEST(HostileBatch, SlotBoundDoesNotOverflowForHugePageCounts) {
  PrefillBatch p({0, 1, 2}, {0, 0});
  HostTensor slots(DType::kI64, {2});
  p.batch.slot_mapping = slots.view();
  // pages * block_size is past int64 here; it used to wrap negative and reject every slot (UB).
  slots.ptr<int64_t>()[0] = kI64Max;
  slots.ptr<int64_t>()[1] = 0;
  EXPECT_NO_THROW(validate_batch_contents(p.batch, tiny_config(4), 1, kI64Max / 2));
  // An ordinary cache: the bound is exact, negative slots are padding.
  slots.ptr<int64_t>()[0] = 3 * 4;
  expect_rejected([&] { validate_batch_contents(p.batch, tiny_config(4), 1, 3); },
                  "batch.slot_mapping[0]");
  slots.ptr<int64_t>()[0] = 3 * 4 - 1;
  slots.ptr<int64_t>()[1] = -7;
  EXPECT_NO_THROW(validate_batch_contents(p.batch, tiny_config(4), 1, 3));
}

// ---- The block-id limit (docs/spec.md section 4): ids up to 2^24 - 2, so a request may hold
// 2^24 - 1 blocks. Validation only: nothing is scored at this size. ----

struct LimitCase {
  HostTensor seq_lens{DType::kI32, {1}};
  HostTensor table;  // [1, 2^24 - 1], every entry page 0 (aliasing is allowed)
  BatchMeta batch;
  explicit LimitCase(int64_t seq_len) : table(DType::kI32, {1, kMaxBlockId + 1}) {
    table.fill_bytes(0);
    seq_lens.ptr<int32_t>()[0] = static_cast<int32_t>(seq_len);
    batch.kind = BatchKind::kDecode;
    batch.num_reqs = 1;
    batch.q_len = 1;
    batch.seq_lens = seq_lens.view();
    batch.index_block_table = table.view();
    batch.kv_block_table = table.view();
  }
};

TEST(HostileBatch, BlockIdLimitAcceptedAndOneMoreBlockRejected) {
  for (int block_size : {128, 1}) {
    SCOPED_TRACE(block_size);
    const SparseConfig config = tiny_config(block_size);
    const int64_t limit = (kMaxBlockId + 1) * block_size;  // (2^24 - 1) blocks
    ASSERT_LE(limit + 1, std::numeric_limits<int32_t>::max());
    {
      LimitCase ok(limit);
      EXPECT_NO_THROW(validate_batch_contents(ok.batch, config, 1, 1));
      const std::vector<RowPosition> rows = row_positions(ok.batch);
      ASSERT_EQ(rows.size(), 1u);
      EXPECT_EQ(visible_blocks(rows[0].pos, block_size) - 1, kMaxBlockId);
    }
    // One token more opens block 2^24 - 1: past the cap, whatever the table holds.
    LimitCase over(limit + 1);
    expect_rejected([&] { validate_batch_contents(over.batch, config, 1, 1); },
                    "batch.seq_lens[0]");
  }
}

TEST(HostileBatch, PrefillBlockIdLimitNamesContextLens) {
  const SparseConfig config = tiny_config(128);
  const int32_t limit = static_cast<int32_t>((kMaxBlockId + 1) * 128);
  HostTensor table(DType::kI32, {1, kMaxBlockId + 1});
  table.fill_bytes(0);
  for (int32_t context : {limit - 1, limit}) {
    HostTensor cu(DType::kI32, {2}), ctx(DType::kI32, {1});
    cu.ptr<int32_t>()[0] = 0;
    cu.ptr<int32_t>()[1] = 1;
    ctx.ptr<int32_t>()[0] = context;
    BatchMeta b;
    b.kind = BatchKind::kPrefill;
    b.num_reqs = 1;
    b.num_tokens = 1;
    b.cu_seqlens_q = cu.view();
    b.context_lens = ctx.view();
    b.index_block_table = table.view();
    if (context == limit - 1) {
      EXPECT_NO_THROW(validate_batch_contents(b, config, 1, 1));
    } else {
      expect_rejected([&] { validate_batch_contents(b, config, 1, 1); }, "batch.context_lens[0]");
    }
  }
}

TEST(HostileBatch, WhyTheCapIsTwoToTheTwentyFourMinusTwo) {
  // Block 2^24 - 1 would put 0 in the low 24 bits: with a NaN score (image 0) its key would be
  // kNoCandidate, i.e. the block would vanish. The cap keeps every real candidate non-zero.
  EXPECT_EQ(make_key(0u, 0xFFFFFFu), kNoCandidate);
  EXPECT_NE(scored_key(std::nanf(""), static_cast<uint32_t>(kMaxBlockId)), kNoCandidate);
}

// ---- Cache scales ----

TEST(HostileCache, NonFiniteScalesAreRejected) {
  const SparseConfig c = tiny_config();
  HostTensor data(DType::kFP8E4M3, {1, 1, 2, c.block_size, c.head_dim});
  for (float bad : {std::numeric_limits<float>::infinity(), std::nanf(""), 0.0f, -1.0f}) {
    KVCache cache{data.view(), bad, 1.0f};
    expect_rejected([&] { validate_kv_cache(cache, c, "kv_cache"); }, "kv_cache");
    cache = KVCache{data.view(), 1.0f, bad};
    expect_rejected([&] { validate_kv_cache(cache, c, "kv_cache"); }, "kv_cache");
  }
}

// Regression (fuzz_config): huge head counts and dims used to pass validate() and overflow int64 in
// qkv_width(); they are now rejected naming the field, and the largest accepted values are safe.
TEST(HostileConfig, HugeHeadCountsAndDimsAreRejectedNamingTheField) {
  const auto expect_rejected = [](SparseConfig config, const std::string& field) {
    try {
      config.validate();
      ADD_FAILURE() << field << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  SparseConfig config;
  config.q_heads = 1 << 30;
  expect_rejected(config, "config.q_heads");
  config = SparseConfig{};
  config.head_dim = 1 << 30;
  expect_rejected(config, "config.head_dim");
  config = SparseConfig{};
  config.index_dim = 1 << 30;
  expect_rejected(config, "config.index_dim");
  config = SparseConfig{};
  config.block_size = 1 << 30;
  expect_rejected(config, "config.block_size");
  config = SparseConfig{};
  config.q_heads = config.kv_heads = config.index_heads = 1 << 16;
  config.head_dim = config.index_dim = 1 << 16;
  EXPECT_NO_THROW(config.validate());
  EXPECT_GT(config.qkv_width(), 0);
}

}  // namespace
}  // namespace m3msa
