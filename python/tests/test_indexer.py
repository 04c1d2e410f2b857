"""select_topk, score_blocks and nominate against the NumPy oracle of docs/spec.md section 4."""

import unittest

import numpy as np

import m3msa
import oracle
from common import THREADS, TestCase, small_config

# Decode rows cover: a padding request (0), a context inside one block, exact block boundaries
# (64 = 4 blocks, 65 = 5), fewer blocks than k, and contexts well past k blocks.
SEQ_LENS = [150, 7, 0, 64, 65, 300]


def oracle_case_from(case):
    """The oracle's view of an m3msa.synthetic_case (made by the C++ generator)."""
    c = oracle.Case()
    c.cfg = case.config
    c.batch = case.batch
    c.rows = oracle.row_positions(case.batch)
    c.index_table = np.asarray(case.batch.index_block_table)
    c.kv_table = np.asarray(case.batch.kv_block_table)
    c.index_cache, c.kv_cache, c.index_q, c.q = (case.index_cache, case.kv_cache, case.index_q,
                                                 case.q)
    c.k_scale, c.v_scale = case.k_scale, case.v_scale
    return c


class SelectTopkTest(TestCase):
    def check(self, cfg, c):
        got = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
        self.assertEqual(got.dtype, np.int32)
        self.assertEqual(got.shape, (c.batch.num_rows, cfg.index_heads, cfg.topk))
        self.assertSelectionEqual(got, oracle.select(c))
        return got

    def test_decode_random_values(self):
        cfg = small_config()
        for q_len in (1, 3):
            c = oracle.make_case(cfg, np.random.default_rng(q_len), seq_lens=SEQ_LENS,
                                 q_len=q_len)
            got = self.check(cfg, c)
            dead = [row for row, (_, pos) in enumerate(c.rows) if pos < 0]
            self.assertTrue(dead and (got[dead] == -1).all())

    def test_integer_values_tie_often(self):
        # Every score is exact and many are equal: the lower block id must win each tie.
        cfg = small_config()
        for dtype in ("bf16", "fp8"):
            c = oracle.make_case(cfg, np.random.default_rng(7), seq_lens=SEQ_LENS, q_len=2,
                                 index_dtype=dtype, integer=True)
            self.check(cfg, c)

    def test_fp8_index_cache(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(11), seq_lens=SEQ_LENS,
                             index_dtype="fp8")
        self.check(cfg, c)

    def test_fp8_index_q_beside_fp8_cache(self):
        # The oracle decodes the fp8 queries; the selection equals that of the bf16 queries that
        # hold the same values.
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(13), seq_lens=SEQ_LENS, q_len=2,
                             index_dtype="fp8")
        as_bf16 = c.index_q
        c.index_q = m3msa.as_fp8(oracle.decode(as_bf16) * np.float32(4.0))
        got = self.check(cfg, c)
        same = m3msa.select_topk(cfg, m3msa.as_bf16(oracle.decode(c.index_q)), c.index_cache,
                                 c.batch, threads=THREADS)
        np.testing.assert_array_equal(got, same)
        bf16_cache = oracle.make_case(cfg, np.random.default_rng(13), seq_lens=SEQ_LENS, q_len=2)
        with self.assertRaisesRegex(ValueError, "index_q: an fp8_e4m3 index_q needs"):
            m3msa.select_topk(cfg, c.index_q, bf16_cache.index_cache, bf16_cache.batch)

    def test_forced_leading_and_trailing_blocks(self):
        cfg = small_config(topk=5, init_blocks=1, local_blocks=2)
        c = oracle.make_case(cfg, np.random.default_rng(3), seq_lens=SEQ_LENS, q_len=2)
        self.check(cfg, c)

    def test_prefill(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(5), cu_seqlens=[0, 5, 5, 40],
                             context_lens=[0, 100, 30])
        self.check(cfg, c)

    def test_one_visible_block(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(1), seq_lens=[1, 16])
        got = self.check(cfg, c)
        self.assertTrue((got[:, :, 0] == 0).all() and (got[:, :, 1:] == -1).all())

    def test_threads_do_not_change_the_answer(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(9), seq_lens=SEQ_LENS, q_len=2)
        one = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=1)
        many = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=3)
        np.testing.assert_array_equal(one, many)

    def test_synthetic_case_from_the_cpp_generator(self):
        cfg = small_config()
        for kind, extra in (("decode", dict(q_len=2, seq_lens=[200, 33, 17, 90], padding_reqs=1)),
                            ("prefill", dict(chunk_lens=[3, 20], context_lens=[0, 70]))):
            case = m3msa.synthetic_case(cfg, kind=kind, num_reqs=4 if kind == "decode" else 2,
                                        index_dtype="fp8", seed=5, **extra)
            self.check(cfg, oracle_case_from(case))


class BuildingBlocksTest(TestCase):
    def test_score_blocks_are_the_oracle_scores(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(21), seq_lens=SEQ_LENS, q_len=2)
        got = m3msa.score_blocks(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
        self.assertEqual(got.dtype, np.float32)
        np.testing.assert_array_equal(got, oracle.scores(c))

    def test_nominate_one_shard_is_the_selection_as_keys(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(22), seq_lens=SEQ_LENS)
        got = m3msa.nominate(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
        self.assertEqual(got.dtype, np.uint64)
        np.testing.assert_array_equal(got, oracle.keys(c))

    def test_shards_merge_to_the_full_selection(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(23), seq_lens=SEQ_LENS)
        shards = [m3msa.nominate(cfg, c.index_q, c.index_cache, c.batch, shard, 3)
                  for shard in range(3)]
        merged = np.sort(np.concatenate(shards, axis=2), axis=2)[:, :, ::-1][:, :, :cfg.topk]
        np.testing.assert_array_equal(merged, oracle.keys(c))


if __name__ == "__main__":
    unittest.main()
