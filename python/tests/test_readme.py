"""The README's examples run as written (the torch one where torch and the CUDA backend exist)."""

import contextlib
import io
import os
import re
import unittest

import m3msa

README = os.environ.get("M3MSA_README",
                        os.path.join(os.path.dirname(__file__), os.pardir, "README.md"))


def example(name):
    text = open(README, encoding="utf-8").read()
    match = re.search(r"<!-- example: " + name + r"[^>]*-->\s*```python\n(.*?)```", text, re.S)
    if match is None:
        raise AssertionError(f"README has no '{name}' example")
    return match.group(1)


class ReadmeTest(unittest.TestCase):
    def test_numpy_example(self):
        code = example("numpy")
        self.assertLess(len(code.strip().splitlines()), 15)
        scope = {}
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, "README.md", "exec"), scope)
        idx = scope["idx"]
        self.assertEqual(idx.shape, (2, 4, 16))
        self.assertEqual(int(idx[0, 0, 0]), 3000 // 128)  # the own block is forced first
        self.assertEqual(sorted(idx[1, 0][idx[1, 0] >= 0].tolist()), list(range(700 // 128 + 1)))

    def test_torch_example(self):
        code = example("torch")
        self.assertLess(len(code.strip().splitlines()), 15)
        try:
            import torch
        except ImportError:
            self.skipTest("torch is not installed")
        if not (torch.cuda.is_available() and m3msa.info()["cuda_backend"]):
            self.skipTest("needs a GPU and the CUDA backend")
        exec(compile(code, "README.md", "exec"), {})


if __name__ == "__main__":
    unittest.main()
