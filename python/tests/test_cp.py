"""The CP CPU selector (include/m3msa/cp.h) is bit-identical to select_topk."""

import unittest

import numpy as np

import m3msa
import oracle
from common import TestCase, small_config


@unittest.skipUnless(m3msa.info()["cp_cpu_selector"], "the CP CPU selector is not in this build")
class CpSelectorTest(TestCase):
    def test_equals_select_topk_for_every_world_size(self):
        cfg = small_config()  # 2 index heads: P = 1, 2 (one merger per head) and 4 (two each)
        c = oracle.make_case(cfg, np.random.default_rng(3), seq_lens=[300, 0, 17, 64, 129],
                             q_len=2)
        expected = oracle.select(c)
        for world_size in (1, 2, 4):
            selector = m3msa.CpSelector(cfg, world_size, max_rows=c.batch.num_rows)
            self.assertEqual(selector.world_size, world_size)
            for layer in range(2):  # consecutive calls use alternating buffer parities
                got = selector(c.index_q, c.index_cache, c.batch, layer=layer)
                self.assertSelectionEqual(got, expected)
            self.assertEqual(selector.generation(0), 2)

    def test_head_placement(self):
        self.assertEqual(m3msa.cp_merged_heads(2, 4, 1), [2, 3])
        self.assertEqual(m3msa.cp_consumers(8, 4, 1), [2, 3])

    def test_too_many_rows(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(4), seq_lens=[40, 17])
        selector = m3msa.CpSelector(cfg, 2, max_rows=1)
        with self.assertRaisesError("invalid_argument"):
            selector(c.index_q, c.index_cache, c.batch)


if __name__ == "__main__":
    unittest.main()
