"""preprocess against the NumPy oracle (docs/spec.md section 2): head norms, partial NeoX RoPE and
the cache inserts, written in place into the caller's caches (which also proves the inputs are
not copies)."""

import unittest

import numpy as np

import m3msa
import oracle
from common import THREADS, TestCase, small_config

POISON = {"bf16": 0x1234, "fp8": 0x21}


def setup(cfg, rng, kv_dtype="bf16"):
    """A decode batch with a padding request, its slots, and poisoned caches."""
    c = oracle.make_case(cfg, rng, seq_lens=[40, 0, 17], q_len=2)
    bs = cfg.block_size
    rows = c.batch.num_rows
    positions = np.array([pos for _, pos in c.rows], np.int64)
    slots, index_slots = np.full(rows, -1, np.int64), np.full(rows, -1, np.int64)
    for row, (req, pos) in enumerate(c.rows):
        if pos >= 0:
            slots[row] = c.kv_table[req, pos // bs] * bs + pos % bs
            index_slots[row] = c.index_table[req, pos // bs] * bs + pos % bs
    c.batch.slot_mapping, c.batch.index_slot_mapping = slots, index_slots
    c.positions = positions
    kv_shape = np.asarray(c.kv_cache.array).shape
    kv_bits = np.uint16 if kv_dtype == "bf16" else np.uint8
    c.kv_cache = m3msa.view(np.full(kv_shape, POISON[kv_dtype], kv_bits), kv_dtype)
    c.index_cache = m3msa.view(np.full(np.asarray(c.index_cache.array).shape, POISON["bf16"],
                                       np.uint16), "bf16")
    c.qkv = m3msa.as_bf16(rng.standard_normal((rows, cfg.qkv_width)))
    c.weights = [m3msa.as_bf16(rng.standard_normal(n) * 0.2)
                 for n in (cfg.head_dim, cfg.head_dim, cfg.index_dim, cfg.index_dim)]
    return c


class PreprocessTest(TestCase):
    def assertWithin(self, got, expected, tolerance, what):
        error = np.abs(np.asarray(got, np.float64) - expected)
        bad = ~(error <= tolerance)
        if bad.any():
            worst = np.unravel_index(np.argmax(np.where(bad, error - tolerance, -np.inf)),
                                     error.shape)
            self.fail(f"{what}: {int(bad.sum())} elements off; worst at {worst}: got "
                      f"{np.asarray(got)[worst]}, expected {expected[worst]}")

    def run_preprocess(self, cfg, c, k_scale=1.0, v_scale=1.0):
        q_out, index_q_out = m3msa.preprocess(
            cfg, c.qkv, *c.weights, c.positions, c.batch, c.kv_cache, c.index_cache,
            k_scale=k_scale, v_scale=v_scale, threads=THREADS)
        expected, tolerance = oracle.preprocess(cfg, c.qkv.array, [w.array for w in c.weights],
                                                c.positions)
        return q_out, index_q_out, expected, tolerance

    def test_outputs_and_bf16_cache_inserts(self):
        cfg = small_config()
        c = setup(cfg, np.random.default_rng(1))
        q_out, index_q_out, expected, tolerance = self.run_preprocess(cfg, c)
        live = [row for row, (_, pos) in enumerate(c.rows) if pos >= 0]
        half_ulp = lambda ref: 2.0 ** -8 * np.abs(ref) + 1e-6  # final rounding to bf16
        for name, got in (("q", q_out), ("index_q", index_q_out)):
            ref = expected[name][live]
            self.assertWithin(m3msa.to_float32(got)[live], ref,
                              tolerance[name][live] + half_ulp(ref), name)

        bs = cfg.block_size
        kv = oracle.bf16_decode(c.kv_cache.array)
        index = oracle.bf16_decode(c.index_cache.array)
        kv_written = np.zeros(kv.shape[:1] + kv.shape[3:4], bool)  # [pages, block_size]
        index_written = np.zeros(index.shape[:2], bool)
        for row in live:
            page, offset = divmod(int(c.batch.slot_mapping[row]), bs)
            kv_written[page, offset] = True
            ref = expected["k"][row]
            self.assertWithin(kv[page, :, 0, offset], ref, tolerance["k"][row] + half_ulp(ref),
                              f"k of row {row}")
            np.testing.assert_array_equal(kv[page, :, 1, offset], expected["v"][row])
            page, offset = divmod(int(c.batch.index_slot_mapping[row]), bs)
            index_written[page, offset] = True
            ref = expected["index_k"][row]
            self.assertWithin(index[page, offset], ref,
                              tolerance["index_k"][row] + half_ulp(ref), f"index_k of row {row}")
        # Nothing else was touched (padding rows and every other slot keep the poison).
        kv_bits = np.moveaxis(np.asarray(c.kv_cache.array), 3, 1)  # [pages, bs, heads, 2, HD]
        self.assertTrue((kv_bits[~kv_written] == POISON["bf16"]).all())
        self.assertTrue((np.asarray(c.index_cache.array)[~index_written] == POISON["bf16"]).all())

    def test_fp8_kv_cache_with_scales(self):
        cfg = small_config()
        c = setup(cfg, np.random.default_rng(2), kv_dtype="fp8")
        k_scale, v_scale = 0.5, 0.25
        _, _, expected, tolerance = self.run_preprocess(cfg, c, k_scale, v_scale)
        bs = cfg.block_size
        kv = oracle.fp8_decode(c.kv_cache.array).astype(np.float64)
        fp8_half_ulp = lambda ref, scale: 2.0 ** -4 * np.abs(ref) + 2.0 ** -10 * scale
        for row, (_, pos) in enumerate(c.rows):
            if pos < 0:
                continue
            page, offset = divmod(int(c.batch.slot_mapping[row]), bs)
            ref_k, ref_v = expected["k"][row], expected["v"][row]
            self.assertWithin(kv[page, :, 0, offset] * k_scale, ref_k,
                              tolerance["k"][row] + 2.0 ** -8 * np.abs(ref_k)
                              + fp8_half_ulp(ref_k, k_scale), f"k of row {row}")
            self.assertWithin(kv[page, :, 1, offset] * v_scale, ref_v,
                              fp8_half_ulp(ref_v, v_scale), f"v of row {row}")

    def test_given_outputs_are_written_in_place(self):
        cfg = small_config()
        c = setup(cfg, np.random.default_rng(3))
        rows = c.batch.num_rows
        q_out = np.zeros((rows, cfg.q_heads, cfg.head_dim), np.uint16)  # bits, tagged for us
        index_q_out = m3msa.view(np.zeros((rows, cfg.index_heads, cfg.index_dim), np.uint16),
                                 "bf16")
        got_q, got_index_q = m3msa.preprocess(cfg, c.qkv, *c.weights, c.positions, c.batch,
                                              c.kv_cache, c.index_cache, q_out, index_q_out)
        self.assertIs(got_q, q_out)
        self.assertIs(got_index_q, index_q_out)
        self.assertTrue(q_out.any() and index_q_out.array.any())


if __name__ == "__main__":
    unittest.main()
