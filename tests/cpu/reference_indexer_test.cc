// CPU reference indexer: block scores and top-k selection against brute-force oracles, and every
// selection edge case of docs/spec.md section 6.
#include <gtest/gtest.h>

#include <cstring>

#include <cmath>
#include <set>
#include <vector>

#include "m3msa/backend.h"
#include "m3msa/cpu_reference.h"
#include "m3msa/error.h"
#include "m3msa/sort_key.h"
#include "reference_test_util.h"

namespace m3msa {
namespace {

using reftest::Case;
using reftest::CaseSpec;
using reftest::make_case;
using reftest::oracle_score;
using reftest::oracle_selection;

HostTensor run_select(const Case& c, int threads = 2) {
  HostTensor topk(DType::kI32, {c.rows(), c.config.index_heads, c.config.topk});
  topk.fill_bytes(0x5A);  // poison: every entry must be written
  cpu::select_topk(c.config, c.indexer(topk.view()), threads);
  return topk;
}

HostTensor run_scores(const Case& c, int64_t max_blocks, int threads = 2) {
  HostTensor scores(DType::kF32, {c.rows(), c.config.index_heads, max_blocks});
  scores.fill_bytes(0x5A);
  cpu::score_blocks(c.config, c.indexer(), scores.view(), threads);
  return scores;
}

HostTensor run_nominate(const Case& c, int shard, int shards, int threads = 2) {
  HostTensor keys(DType::kU64, {c.rows(), c.config.index_heads, c.config.topk});
  keys.fill_bytes(0x5A);
  cpu::nominate(c.config, c.indexer(), shard, shards, keys.view(), threads);
  return keys;
}

std::vector<int32_t> selection_of(const Case& c, const HostTensor& topk, int64_t row, int h) {
  const int k = c.config.topk;
  const int32_t* p = topk.ptr<int32_t>() + (row * c.config.index_heads + h) * k;
  return {p, p + k};
}

void expect_matches_oracle(const Case& c, const HostTensor& topk) {
  for (int64_t row = 0; row < c.rows(); ++row) {
    for (int h = 0; h < c.config.index_heads; ++h) {
      EXPECT_EQ(selection_of(c, topk, row, h), oracle_selection(c, row, h))
          << "row " << row << " (pos " << c.row_pos[row] << ") head " << h;
    }
  }
}

bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || a == b;
}

TEST(ReferenceIndexer, OneVisibleBlockSelectsOnlyBlockZero) {
  for (auto [init, local] : {std::pair{0, 1}, {0, 0}, {1, 0}, {1, 2}}) {
    CaseSpec spec;
    spec.config.init_blocks = init;
    spec.config.local_blocks = local;
    spec.seq_lens = {1, 5, 8};
    const Case c = make_case(spec);
    const HostTensor topk = run_select(c);
    for (int64_t row = 0; row < c.rows(); ++row) {
      for (int h = 0; h < c.config.index_heads; ++h) {
        EXPECT_EQ(selection_of(c, topk, row, h), (std::vector<int32_t>{0, -1, -1, -1}))
            << "init " << init << " local " << local << " row " << row;
      }
    }
  }
}

// The grid: forced-block settings x index dtype x query length, over lengths that hit nb = 1,
// nb < k, nb == k, nb == k + 1, nb >> k and padding.
TEST(ReferenceIndexer, ScoresAndSelectionMatchBruteForce) {
  for (auto [init, local] : {std::pair{0, 1}, {1, 2}, {0, 0}, {2, 0}}) {
    for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
      for (int q_len : {1, 4}) {
        CaseSpec spec;
        spec.config.init_blocks = init;
        spec.config.local_blocks = local;
        spec.index_dtype = dtype;
        spec.q_len = q_len;
        spec.seq_lens = {4, 9, 32, 33, 40, 100, 0};
        spec.seed =
            static_cast<uint64_t>(init * 100 + local * 10 + q_len) + (dtype == DType::kBF16);
        const Case c = make_case(spec);
        SCOPED_TRACE(testing::Message() << "init " << init << " local " << local << " dtype "
                                        << dtype_name(dtype) << " q_len " << q_len);
        const int64_t max_blocks = 14;
        const HostTensor scores = run_scores(c, max_blocks);
        for (int64_t row = 0; row < c.rows(); ++row) {
          for (int h = 0; h < c.config.index_heads; ++h) {
            for (int64_t b = 0; b < max_blocks; ++b) {
              const float got =
                  scores.ptr<float>()[(row * c.config.index_heads + h) * max_blocks + b];
              const float want = b < c.nb(row) ? oracle_score(c, row, h, b) : -INFINITY;
              ASSERT_TRUE(same_float(got, want)) << "row " << row << " head " << h << " block " << b
                                                 << ": " << got << " vs " << want;
            }
          }
        }
        expect_matches_oracle(c, run_select(c));
      }
    }
  }
}

// An fp8 index_q beside an fp8 cache scores its decoded values: the same scores and selection, bit
// for bit, as the bf16 index_q that holds exactly those values (every e4m3 value is a bf16 value),
// and both match the oracle.
TEST(ReferenceIndexer, Fp8IndexQScoresItsDecodedValues) {
  for (int q_len : {1, 3}) {
    CaseSpec spec;
    spec.index_dtype = DType::kFP8E4M3;
    spec.q_len = q_len;
    spec.seq_lens = {5, 40, 100, 0, 77};
    spec.seed = 41 + q_len;
    Case c = make_case(spec);
    const int H = c.config.index_heads;
    const int D = c.config.index_dim;
    HostTensor q8(DType::kFP8E4M3, {c.rows(), H, D});
    for (int64_t row = 0; row < c.rows(); ++row) {
      for (int h = 0; h < H; ++h) {
        for (int d = 0; d < D; ++d) {
          const uint8_t v = float_to_fp8e4m3(4.0f * c.index_q_at(row, h, d));
          q8.ptr<uint8_t>()[(row * H + h) * D + d] = v;
          c.set_index_q(row, h, d, fp8e4m3_to_float(v));  // exact in bf16
        }
      }
    }
    const int64_t max_blocks = 8;
    IndexerArgs a8 = c.indexer();
    a8.index_q = q8.view();
    HostTensor scores8(DType::kF32, {c.rows(), H, max_blocks});
    scores8.fill_bytes(0x5A);
    cpu::score_blocks(c.config, a8, scores8.view(), 2);
    const HostTensor scores16 = run_scores(c, max_blocks);
    ASSERT_EQ(std::memcmp(scores8.data(), scores16.data(), scores8.nbytes()), 0)
        << "q_len " << q_len;
    for (int64_t row = 0; row < c.rows(); ++row) {
      for (int h = 0; h < H; ++h) {
        for (int64_t b = 0; b < std::min<int64_t>(max_blocks, c.nb(row)); ++b) {
          ASSERT_TRUE(same_float(scores8.ptr<float>()[(row * H + h) * max_blocks + b],
                                 oracle_score(c, row, h, b)))
              << "row " << row << " head " << h << " block " << b;
        }
      }
    }
    HostTensor topk8(DType::kI32, {c.rows(), H, c.config.topk});
    topk8.fill_bytes(0x5A);
    a8.topk_idx = topk8.view();
    cpu::select_topk(c.config, a8, 2);
    const HostTensor topk16 = run_select(c);
    EXPECT_EQ(std::memcmp(topk8.data(), topk16.data(), topk8.nbytes()), 0) << "q_len " << q_len;
    expect_matches_oracle(c, topk8);
  }
}

TEST(ReferenceIndexer, M3SizedHeadsAndBlocks) {
  CaseSpec spec;
  spec.config = SparseConfig{};  // M3 defaults: 64/4 heads, 128 dims, 128-token blocks, top 16
  spec.seq_lens = {1, 129, 2048, 2049, 2100};
  spec.with_kv_cache = false;
  const Case c = make_case(spec);
  expect_matches_oracle(c, run_select(c));
}

TEST(ReferenceIndexer, AllBlocksWhenNbAtMostK) {
  CaseSpec spec;
  spec.seq_lens = {30, 32};  // nb = 4 = k
  const Case c = make_case(spec);
  const HostTensor topk = run_select(c);
  for (int64_t row = 0; row < c.rows(); ++row) {
    for (int h = 0; h < c.config.index_heads; ++h) {
      const std::vector<int32_t> got = selection_of(c, topk, row, h);
      EXPECT_EQ(got[0], 3) << "the own (forced) block comes first";
      EXPECT_EQ(std::set<int32_t>(got.begin(), got.end()), (std::set<int32_t>{0, 1, 2, 3}));
    }
  }
}

TEST(ReferenceIndexer, NbIsKPlusOneDropsTheLowestScore) {
  CaseSpec spec;
  spec.seq_lens = {40, 33};  // nb = 5 = k + 1
  const Case c = make_case(spec);
  const HostTensor topk = run_select(c);
  const HostTensor scores = run_scores(c, 5);
  for (int64_t row = 0; row < c.rows(); ++row) {
    for (int h = 0; h < c.config.index_heads; ++h) {
      const float* s = scores.ptr<float>() + (row * c.config.index_heads + h) * 5;
      int worst = 0;
      for (int b = 1; b < 4; ++b) {
        if (s[b] <= s[worst]) worst = b;  // ties drop the higher id
      }
      const std::vector<int32_t> got = selection_of(c, topk, row, h);
      std::set<int32_t> expected{0, 1, 2, 3, 4};
      expected.erase(worst);
      EXPECT_EQ(std::set<int32_t>(got.begin(), got.end()), expected) << "row " << row;
    }
  }
}

// Positions after pos in the own page (the rest of this step's tokens and stale garbage) must not
// reach a score, a selection or the softmax.
TEST(ReferenceIndexer, OwnBlockTailIsNeverRead) {
  for (int q_len : {1, 4}) {
    CaseSpec spec;
    spec.config.local_blocks = 0;  // the own block competes on its score
    spec.q_len = q_len;
    spec.seq_lens = {21, 60};
    Case c = make_case(spec);
    const HostTensor scores_before = run_scores(c, 8);
    const HostTensor topk_before = run_select(c);
    HostTensor out_before(DType::kBF16, {c.rows(), c.config.q_heads, c.config.head_dim});
    cpu::sparse_attention(c.config, c.attention(topk_before.view(), out_before.view()), 2);

    const int bs = c.config.block_size;
    // Index keys aligned with head 0 of `row`: a dot product far above any random one.
    auto poison_tail = [&](int req, int64_t from, int64_t row) {
      const int64_t end = (from / bs + 1) * bs;
      for (int64_t p = from; p < end; ++p) {
        for (int d = 0; d < c.config.index_dim; ++d) {
          c.set_index_k(req, p, d, c.index_q_at(row, 0, d) > 0 ? 200.0f : -200.0f);
        }
        for (int kvh = 0; kvh < c.config.kv_heads; ++kvh) {
          for (int d = 0; d < c.config.head_dim; ++d) {
            c.set_kv_raw(req, kvh, 0, p, d, 300.0f);
            c.set_kv_raw(req, kvh, 1, p, d, -300.0f);
          }
        }
      }
    };
    const int64_t last_row = q_len - 1;  // the last row of request 0, at position 20
    poison_tail(0, 21, last_row);
    poison_tail(1, 60, 2 * q_len - 1);
    EXPECT_EQ(reftest::bytes_of(run_scores(c, 8)), reftest::bytes_of(scores_before));
    const HostTensor topk_after = run_select(c);
    EXPECT_EQ(reftest::bytes_of(topk_after), reftest::bytes_of(topk_before));
    HostTensor out_after(DType::kBF16, {c.rows(), c.config.q_heads, c.config.head_dim});
    cpu::sparse_attention(c.config, c.attention(topk_after.view(), out_after.view()), 2);
    EXPECT_EQ(reftest::bytes_of(out_after), reftest::bytes_of(out_before));

    // The same poison one token earlier is visible to the last row and must change its score,
    // so the comparison above could have failed.
    poison_tail(0, 20, last_row);
    const HostTensor scores_visible = run_scores(c, 8);
    EXPECT_NE(scores_visible.ptr<float>()[last_row * c.config.index_heads * 8 + 2],
              scores_before.ptr<float>()[last_row * c.config.index_heads * 8 + 2]);
  }
}

TEST(ReferenceIndexer, SpeculativeRowsSelectPerRow) {
  CaseSpec spec;
  spec.q_len = 4;
  spec.seq_lens = {100, 77};
  spec.seed = 7;
  const Case c = make_case(spec);
  const HostTensor topk = run_select(c);
  expect_matches_oracle(c, topk);
  int differing = 0;
  for (int req = 0; req < 2; ++req) {
    for (int j = 1; j < 4; ++j) {
      for (int h = 0; h < c.config.index_heads; ++h) {
        std::vector<int32_t> a = selection_of(c, topk, req * 4, h);
        std::vector<int32_t> b = selection_of(c, topk, req * 4 + j, h);
        differing +=
            (std::set<int32_t>(a.begin(), a.end()) != std::set<int32_t>(b.begin(), b.end()));
      }
    }
  }
  EXPECT_GT(differing, 0) << "random queries of one request should not all select alike";
}

TEST(ReferenceIndexer, DeadRowsGiveMinusOneAndNoCandidates) {
  CaseSpec spec;
  spec.q_len = 2;
  spec.seq_lens = {0, 50, 0};
  const Case c = make_case(spec);
  const HostTensor topk = run_select(c);
  const HostTensor keys = run_nominate(c, 0, 1);
  const HostTensor scores = run_scores(c, 7);
  const int per_row = c.config.index_heads * c.config.topk;
  for (int64_t row : {0, 1, 4, 5}) {
    for (int i = 0; i < per_row; ++i) {
      EXPECT_EQ(topk.ptr<int32_t>()[row * per_row + i], -1) << row;
      EXPECT_EQ(keys.ptr<uint64_t>()[row * per_row + i], kNoCandidate) << row;
    }
    for (int i = 0; i < c.config.index_heads * 7; ++i) {
      EXPECT_EQ(scores.ptr<float>()[row * c.config.index_heads * 7 + i], -INFINITY) << row;
    }
  }
  expect_matches_oracle(c, topk);
}

TEST(ReferenceIndexer, NanScoresRankLastAndNeverOpenTheValidPrefix) {
  for (DType dtype : {DType::kBF16, DType::kFP8E4M3}) {
    CaseSpec spec;
    spec.index_dtype = dtype;
    spec.seq_lens = {100, 30, 30};  // nb 13, 4 and 4
    Case c = make_case(spec);
    // One NaN token inside otherwise finite blocks: the whole block scores NaN.
    c.set_index_k(0, 8 * 1 + 3, 5, NAN);
    c.set_index_k(0, 8 * 3 + 7, 0, NAN);
    c.set_index_k(1, 8 * 0 + 2, 1, NAN);
    c.set_index_k(1, 8 * 1 + 6, 9, NAN);
    for (int64_t p = 0; p < 30; ++p) c.set_index_k(2, p, 0, NAN);  // every block of request 2
    const HostTensor scores = run_scores(c, 13);
    const HostTensor topk = run_select(c);
    expect_matches_oracle(c, topk);
    for (int h = 0; h < c.config.index_heads; ++h) {
      const float* s0 = scores.ptr<float>() + (0 * c.config.index_heads + h) * 13;
      EXPECT_TRUE(std::isnan(s0[1]) && std::isnan(s0[3]));
      EXPECT_FALSE(std::isnan(s0[2]));
      const std::vector<int32_t> r0 = selection_of(c, topk, 0, h);
      EXPECT_EQ(std::count(r0.begin(), r0.end(), 1) + std::count(r0.begin(), r0.end(), 3), 0)
          << "12 finite candidates remain, NaN blocks must lose";
      const std::vector<int32_t> r1 = selection_of(c, topk, 1, h);
      EXPECT_EQ(r1[0], 3);
      EXPECT_EQ(std::vector<int32_t>(r1.begin() + 2, r1.end()), (std::vector<int32_t>{0, 1}))
          << "NaN blocks fill the tail of the prefix, lower id first";
      EXPECT_EQ(selection_of(c, topk, 2, h), (std::vector<int32_t>{3, 0, 1, 2}));
    }
  }
}

TEST(ReferenceIndexer, OtherForcedSettingsInitOneLocalTwo) {
  CaseSpec spec;
  spec.config.init_blocks = 1;
  spec.config.local_blocks = 2;
  spec.seq_lens = {100, 16, 9};  // nb 13, 2, 2
  const Case c = make_case(spec);
  const HostTensor topk = run_select(c);
  expect_matches_oracle(c, topk);
  for (int h = 0; h < c.config.index_heads; ++h) {
    const std::vector<int32_t> r0 = selection_of(c, topk, 0, h);
    EXPECT_EQ(std::vector<int32_t>(r0.begin(), r0.begin() + 3), (std::vector<int32_t>{0, 11, 12}));
    EXPECT_EQ(selection_of(c, topk, 1, h), (std::vector<int32_t>{0, 1, -1, -1}));
  }
}

TEST(ReferenceIndexer, AllEqualScoresPreferLowerBlocksAfterForced) {
  for (auto [init, local] : {std::pair{0, 1}, {1, 2}}) {
    CaseSpec spec;
    spec.config.init_blocks = init;
    spec.config.local_blocks = local;
    spec.seq_lens = {100};
    Case c = make_case(spec);
    for (int h = 0; h < c.config.index_heads; ++h) {
      for (int d = 0; d < c.config.index_dim; ++d) c.set_index_q(0, h, d, 0.0f);
    }
    const HostTensor topk = run_select(c);
    const std::vector<int32_t> expected =
        init == 0 ? std::vector<int32_t>{12, 0, 1, 2} : std::vector<int32_t>{0, 11, 12, 1};
    for (int h = 0; h < c.config.index_heads; ++h) EXPECT_EQ(selection_of(c, topk, 0, h), expected);
  }
}

TEST(ReferenceIndexer, KeysAreDescendingAndMatchTheSelection) {
  CaseSpec spec;
  spec.config.init_blocks = 1;
  spec.config.local_blocks = 1;
  spec.q_len = 2;
  spec.seq_lens = {100, 17, 3, 0};
  const Case c = make_case(spec);
  const HostTensor keys = run_nominate(c, 0, 1);
  const HostTensor topk = run_select(c);
  const HostTensor scores = run_scores(c, 13);
  const int k = c.config.topk;
  for (int64_t row = 0; row < c.rows(); ++row) {
    for (int h = 0; h < c.config.index_heads; ++h) {
      const uint64_t* key = keys.ptr<uint64_t>() + (row * c.config.index_heads + h) * k;
      const std::vector<int32_t> sel = selection_of(c, topk, row, h);
      for (int i = 0; i < k; ++i) {
        if (sel[i] < 0) {
          EXPECT_EQ(key[i], kNoCandidate);
          continue;
        }
        if (i > 0) {
          EXPECT_GT(key[i - 1], key[i]) << "row " << row << " head " << h;
        }
        EXPECT_EQ(key_block(key[i]), sel[i]);
        EXPECT_EQ(key_tag(key[i]), 0u);
        const int64_t nb = c.nb(row);
        const float s = scores.ptr<float>()[(row * c.config.index_heads + h) * 13 + sel[i]];
        EXPECT_EQ(key[i],
                  is_forced_block(sel[i], nb, 1, 1) ? forced_key(sel[i]) : scored_key(s, sel[i]));
      }
    }
  }
}

// A quick check of the context-parallel identity: every shard nominates its own top k, and the
// top k of the union is the single-shard selection. (The full CP model is tested elsewhere.)
TEST(ReferenceIndexer, ShardNominationsMergeToTheSelection) {
  CaseSpec spec;
  spec.config.init_blocks = 1;
  spec.config.local_blocks = 1;
  spec.q_len = 2;
  spec.seq_lens = {100, 40, 9, 2, 0};
  const Case c = make_case(spec);
  const HostTensor topk = run_select(c);
  const int k = c.config.topk;
  const int heads = c.config.index_heads;
  for (int shards : {1, 2, 3, 5, 16}) {
    std::vector<HostTensor> nominations;
    for (int s = 0; s < shards; ++s) nominations.push_back(run_nominate(c, s, shards));
    for (int64_t row = 0; row < c.rows(); ++row) {
      for (int h = 0; h < heads; ++h) {
        std::vector<uint64_t> candidates;
        for (int s = 0; s < shards; ++s) {
          const uint64_t* key = nominations[s].ptr<uint64_t>() + (row * heads + h) * k;
          for (int i = 0; i < k; ++i) {
            if (key[i] != kNoCandidate) {
              EXPECT_EQ(key_block(key[i]) % shards, s) << "shard nominated a foreign block";
            }
            candidates.push_back(with_tag(key[i], generation_tag(static_cast<uint32_t>(s))));
          }
        }
        const std::vector<uint64_t> merged = cpu::top_keys(candidates, k);
        std::vector<int32_t> got(static_cast<std::size_t>(k));
        cpu::keys_to_indices(merged.data(), static_cast<int>(merged.size()), got.data(), k);
        EXPECT_EQ(got, selection_of(c, topk, row, h)) << shards << " shards, row " << row;
      }
    }
  }
}

TEST(ReferenceIndexer, DeterministicForAnyThreadCount) {
  CaseSpec spec;
  spec.q_len = 2;
  spec.config.init_blocks = 1;
  reftest::Rng rng(99);
  for (int r = 0; r < 9; ++r) spec.seq_lens.push_back(r == 4 ? 0 : rng.range(2, 400));
  const Case c = make_case(spec);
  const auto topk1 = reftest::bytes_of(run_select(c, 1));
  const auto scores1 = reftest::bytes_of(run_scores(c, 51, 1));
  const auto keys1 = reftest::bytes_of(run_nominate(c, 1, 3, 1));
  for (int threads : {2, 3, 7, 0}) {
    EXPECT_EQ(reftest::bytes_of(run_select(c, threads)), topk1) << threads;
    EXPECT_EQ(reftest::bytes_of(run_scores(c, 51, threads)), scores1) << threads;
    EXPECT_EQ(reftest::bytes_of(run_nominate(c, 1, 3, threads)), keys1) << threads;
  }
}

TEST(ReferenceIndexer, TopKeysStripsTagsDropsEmptiesAndDuplicates) {
  const uint64_t a = scored_key(3.0f, 7), b = scored_key(1.0f, 2), f = forced_key(9);
  const uint64_t n = scored_key(NAN, 4);
  const std::vector<uint64_t> in = {
      kNoCandidate, with_tag(b, 5), n, with_tag(a, 200), a, with_tag(kNoCandidate, 3), f};
  EXPECT_EQ(cpu::top_keys(in, 10), (std::vector<uint64_t>{f, a, b, n}));
  EXPECT_EQ(cpu::top_keys(in, 2), (std::vector<uint64_t>{f, a}));
  EXPECT_TRUE(cpu::top_keys(in, 0).empty());

  std::vector<int32_t> out(4, 123);
  const std::vector<uint64_t> keys = {f, kNoCandidate, a};
  cpu::keys_to_indices(keys.data(), 3, out.data(), 4);
  EXPECT_EQ(out, (std::vector<int32_t>{9, 7, -1, -1}));
  const std::vector<uint64_t> too_many = {f, a, b, n, scored_key(0.0f, 1)};
  EXPECT_THROW(cpu::keys_to_indices(too_many.data(), 5, out.data(), 4), Error);
}

TEST(ReferenceIndexer, BackendRunsTheReference) {
  std::unique_ptr<Backend> backend = make_cpu_backend(3);
  EXPECT_EQ(backend->device(), Device::cpu());
  EXPECT_FALSE(backend->name().empty());
  CaseSpec spec;
  spec.seq_lens = {100, 0, 7};
  const Case c = make_case(spec);
  HostTensor topk(DType::kI32, {c.rows(), c.config.index_heads, c.config.topk});
  backend->select_topk(c.config, c.indexer(topk.view()));
  backend->synchronize();
  EXPECT_EQ(reftest::bytes_of(topk), reftest::bytes_of(run_select(c)));
}

}  // namespace
}  // namespace m3msa
