"""Shared set-up of the Python suites: the small configuration and a few assertions."""

import os
import unittest

import numpy as np

import m3msa
import oracle

# Small enough for a brute-force oracle, big enough for every rule to matter: 2 KV heads of 2
# query heads, 16-token blocks, top-4 (so contexts past 64 tokens are really sparse).
SMALL = dict(q_heads=4, kv_heads=2, head_dim=16, index_heads=2, index_dim=16, block_size=16,
             topk=4, rope_dim=8)

# CPU threads the suites use (CI machines are shared; results never depend on it).
THREADS = int(os.environ.get("M3MSA_TEST_THREADS", "2"))


def small_config(**overrides):
    return m3msa.SparseConfig(**{**SMALL, **overrides})


class TestCase(unittest.TestCase):
    def assertSelectionEqual(self, actual, expected):
        actual = np.asarray(actual)
        if not np.array_equal(actual, expected):
            where = tuple(int(i) for i in np.argwhere(actual != expected)[0][:2])
            self.fail(f"selection differs at (row, head) {where}: got {actual[where]}, "
                      f"expected {expected[where]}")

    def assertBf16Close(self, actual, expected, ulps=1.0):
        ok, message = oracle.bf16_close(actual, expected, ulps)
        if not ok:
            self.fail(message)

    def assertRaisesError(self, code, *fragments):
        """Context manager: an m3msa.Error with `code` whose message holds every fragment."""
        test = self

        class Check:
            def __enter__(self):
                return self

            def __exit__(self, kind, error, traceback):
                if kind is None:
                    test.fail(f"no m3msa.Error raised (expected {code})")
                if not issubclass(kind, m3msa.Error):
                    return False
                test.assertEqual(error.code, code, str(error))
                for fragment in fragments:
                    test.assertIn(fragment, error.message)
                self.error = error
                return True

        return Check()
