"""sparse_attention and dense_attention against a float64 NumPy oracle (docs/spec.md section 5)."""

import unittest

import numpy as np

import m3msa
import oracle
from common import THREADS, TestCase, small_config

SEQ_LENS = [150, 7, 0, 64, 65, 300]


class AttentionTest(TestCase):
    def run_case(self, cfg, c):
        topk_idx = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
        out = m3msa.sparse_attention(cfg, c.q, c.kv_cache, c.batch, topk_idx, k_scale=c.k_scale,
                                     v_scale=c.v_scale, threads=THREADS)
        self.assertIsInstance(out, m3msa.TypedView)
        self.assertEqual(out.dtype, "bf16")
        self.assertEqual(out.shape, (c.batch.num_rows, cfg.q_heads, cfg.head_dim))
        return topk_idx, m3msa.to_float32(out)

    def test_sparse_matches_oracle(self):
        cfg = small_config()
        for q_len in (1, 3):
            c = oracle.make_case(cfg, np.random.default_rng(q_len), seq_lens=SEQ_LENS,
                                 q_len=q_len)
            topk_idx, got = self.run_case(cfg, c)
            self.assertBf16Close(got, oracle.attention(c, topk_idx))
            dead = [row for row, (_, pos) in enumerate(c.rows) if pos < 0]
            self.assertTrue((got[dead] == 0).all(), "dead rows must be zeros")

    def test_fp8_cache_with_scales(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(4), seq_lens=SEQ_LENS, q_len=2,
                             kv_dtype="fp8", k_scale=0.5, v_scale=2.0)
        topk_idx, got = self.run_case(cfg, c)
        self.assertBf16Close(got, oracle.attention(c, topk_idx))

    def test_prefill(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(6), cu_seqlens=[0, 5, 5, 40],
                             context_lens=[0, 100, 30])
        topk_idx, got = self.run_case(cfg, c)
        self.assertBf16Close(got, oracle.attention(c, topk_idx))

    def test_dense_matches_oracle(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(8), seq_lens=SEQ_LENS, q_len=2)
        got = m3msa.dense_attention(cfg, c.q, c.kv_cache, c.batch, threads=THREADS)
        self.assertBf16Close(m3msa.to_float32(got), oracle.attention(c))

    def test_sparse_equals_dense_when_every_block_fits(self):
        # nb <= k for every row: the selection covers the context, so the answers are equal.
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(10), seq_lens=[64, 1, 40, 0, 17],
                             q_len=1)
        topk_idx, sparse = self.run_case(cfg, c)
        dense = m3msa.to_float32(m3msa.dense_attention(cfg, c.q, c.kv_cache, c.batch))
        np.testing.assert_array_equal(sparse, dense)


if __name__ == "__main__":
    unittest.main()
