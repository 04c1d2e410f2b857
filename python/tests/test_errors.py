"""Every bad argument raises m3msa.Error with the right code and a message naming it."""

import unittest

import numpy as np

import m3msa
import oracle
from common import TestCase, small_config


class ErrorTest(TestCase):
    def setUp(self):
        self.cfg = small_config()
        self.c = oracle.make_case(self.cfg, np.random.default_rng(0), seq_lens=[40, 0, 17])

    def select(self, **overrides):
        args = dict(index_q=self.c.index_q, index_cache=self.c.index_cache, batch=self.c.batch)
        args.update(overrides)
        return m3msa.select_topk(self.cfg, **args)

    def test_error_carries_code_message_and_rank(self):
        with self.assertRaisesError("invalid_argument", "index_q: expected dtype bf16, got f32") \
                as check:
            self.select(index_q=np.zeros((3, 2, 16), np.float32))
        error = check.error
        self.assertIsInstance(error, RuntimeError)
        self.assertIsNone(error.rank)
        self.assertIn(error.message, str(error))
        self.assertIn("invalid argument", str(error))

    def test_wrong_shape_names_the_output(self):
        with self.assertRaisesError("invalid_argument", "topk_idx", "expected shape"):
            self.select(out=np.zeros((3, 2, 5), np.int32))

    def test_wrong_shape_names_the_input(self):
        with self.assertRaisesError("invalid_argument", "index_q", "expected shape"):
            self.select(index_q=m3msa.as_bf16(np.zeros((3, 2, 8))))

    def test_bad_table_entry_names_the_table(self):
        table = self.c.index_table.copy()
        table[0, 1] = 10_000
        batch = m3msa.Batch.decode(self.c.batch.seq_lens, table, self.c.kv_table)
        with self.assertRaisesError("invalid_argument", "batch.index_block_table[0][1] = 10000"):
            self.select(batch=batch)

    def test_bad_config_field(self):
        with self.assertRaisesError("invalid_argument", "config.topk"):
            m3msa.select_topk(small_config(topk=0), self.c.index_q, self.c.index_cache,
                              self.c.batch)
        with self.assertRaisesError("invalid_argument", "config.index_heads"):
            small_config(index_heads=3).validate()

    def test_config_constructors_take_every_field_by_name(self):
        model = m3msa.ModelConfig(hidden=512, num_experts=8, experts_per_token=2,
                                  moe_intermediate=256, dense_intermediate=1024, topk=8,
                                  routed_scaling=1.5)
        self.assertEqual((model.hidden, model.num_experts, model.experts_per_token,
                          model.moe_intermediate, model.dense_intermediate, model.topk,
                          model.routed_scaling), (512, 8, 2, 256, 1024, 8, 1.5))
        self.assertEqual(model.q_heads, m3msa.ModelConfig().q_heads)  # the others: defaults
        self.assertIn("num_experts=8", repr(model))
        self.assertEqual(model, m3msa.ModelConfig(num_experts=8, hidden=512, experts_per_token=2,
                                                  moe_intermediate=256, dense_intermediate=1024,
                                                  topk=8, routed_scaling=1.5))
        self.assertNotEqual(model, m3msa.ModelConfig())
        self.assertEqual(small_config(), small_config())
        with self.assertRaisesRegex(TypeError, "unexpected keyword argument 'topc'"):
            m3msa.SparseConfig(topc=3)
        with self.assertRaisesRegex(TypeError, "ModelConfig.num_experts: expected an int"):
            m3msa.ModelConfig(num_experts=8.0)
        with self.assertRaisesRegex(TypeError, "SparseConfig.rms_eps: expected a number"):
            m3msa.SparseConfig(rms_eps=True)

    def test_wrong_python_types(self):
        with self.assertRaisesError("invalid_argument", "config"):
            m3msa.select_topk({"topk": 4}, self.c.index_q, self.c.index_cache, self.c.batch)
        with self.assertRaisesError("invalid_argument", "batch"):
            self.select(batch={"seq_lens": [1]})
        with self.assertRaisesError("invalid_argument", "index_cache", "expected an array",
                                    "str"):
            self.select(index_cache="not an array")
        with self.assertRaisesError("invalid_argument", "index_q is required"):
            self.select(index_q=None)

    def test_bits_arrays_need_a_dtype(self):
        with self.assertRaisesError("invalid_argument", "index_q", "uint16", "m3msa.view"):
            self.select(index_q=self.c.index_q.array)
        with self.assertRaisesError("invalid_argument", "index_cache", "fp8"):
            self.select(index_cache=np.zeros((4, 16, 16), np.uint8))
        with self.assertRaisesError("invalid_argument", "index_q", "view", "float32"):
            self.select(index_q=m3msa.view(np.zeros((3, 2, 16), np.float32), "bf16"))
        with self.assertRaisesError("invalid_argument", "dtype", "'float16'"):
            m3msa.view(np.zeros(3, np.float16), "float16")

    def test_non_contiguous_input(self):
        wide = np.zeros((3, 2, 32), np.uint16)
        with self.assertRaisesError("invalid_argument", "index_q", "contiguous"):
            self.select(index_q=m3msa.view(wide[:, :, ::2], "bf16"))

    def test_read_only_output(self):
        out = np.zeros((3, 2, 4), np.int32)
        out.flags.writeable = False
        with self.assertRaisesError("invalid_argument", "topk_idx", "writ"):
            self.select(out=out)

    def test_bad_batch_fields(self):
        with self.assertRaisesError("invalid_argument", "batch.q_len"):
            self.select(batch=m3msa.Batch.decode(self.c.batch.seq_lens, self.c.index_table,
                                                 q_len=9))
        with self.assertRaisesError("invalid_argument", "batch.seq_lens", "i32"):
            self.select(batch=m3msa.Batch.decode(np.array([40, 0, 17], np.int64),
                                                 self.c.index_table))
        with self.assertRaisesError("invalid_argument", "batch.seq_lens[1] = 1"):
            self.select(batch=m3msa.Batch.decode([40, 1, 17], self.c.index_table, q_len=2),
                        index_q=m3msa.as_bf16(np.zeros((6, 2, 16))))
        with self.assertRaisesError("invalid_argument", "batch.kind"):
            m3msa.Batch("verify", 1)

    def test_attention_errors_name_their_arguments(self):
        cfg, c = self.cfg, self.c
        with self.assertRaisesError("invalid_argument", "kv_cache", "k_scale"):
            m3msa.sparse_attention(cfg, c.q, c.kv_cache, c.batch, None, k_scale=0.0)
        with self.assertRaisesError("invalid_argument", "topk_idx", "expected shape"):
            m3msa.sparse_attention(cfg, c.q, c.kv_cache, c.batch, np.zeros((3, 2, 3), np.int32))
        with self.assertRaisesError("invalid_argument", "out", "expected shape"):
            m3msa.sparse_attention(cfg, c.q, c.kv_cache, c.batch, None,
                                   out=np.zeros((3, 4, 8), np.uint16))

    def test_output_dtypes(self):
        with self.assertRaisesError("invalid_argument", "scores", "float64"):
            m3msa.score_blocks(self.cfg, self.c.index_q, self.c.index_cache, self.c.batch,
                               out=np.zeros((3, 2, 4), np.float64))
        with self.assertRaisesError("invalid_argument", "scores", "expected dtype f32, got i32"):
            m3msa.score_blocks(self.cfg, self.c.index_q, self.c.index_cache, self.c.batch,
                               out=np.zeros((3, 2, 4), np.int32))
        with self.assertRaisesError("invalid_argument", "topk_idx", "expected dtype i32, got i64"):
            self.select(out=np.zeros((3, 2, 4), np.int64))

    def test_cp_placement(self):
        if not m3msa.info()["cp_cpu_selector"]:
            self.skipTest("CP CPU selector not built")
        with self.assertRaisesError("invalid_argument", "3"):
            m3msa.CpSelector(self.cfg, 3, 8)


if __name__ == "__main__":
    unittest.main()
