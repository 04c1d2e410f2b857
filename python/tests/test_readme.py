"""The README's examples run as written (the torch one where torch and the CUDA backend exist)."""

import contextlib
import io
import os
import re
import unittest

import numpy as np

import m3msa
from cuda_common import REQUIRED, CudaTestCase, skip_reason

README = os.environ.get("M3MSA_README",
                        os.path.join(os.path.dirname(__file__), os.pardir, "README.md"))


def example(name):
    text = open(README, encoding="utf-8").read()
    match = re.search(r"<!-- example: " + name + r"[^>]*-->\s*```python\n(.*?)```", text, re.S)
    if match is None:
        raise AssertionError(f"README has no '{name}' example")
    return match.group(1)


class ReadmeTest(CudaTestCase):  # a TestCase with the GPU comparisons
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
        self.assertLessEqual(len(code.strip().splitlines()), 15)
        reason = skip_reason()
        if reason is not None:
            if REQUIRED:
                self.fail(f"M3MSA_REQUIRE_CUDA=1 but {reason}")
            self.skipTest(reason)
        import torch
        scope = {}
        exec(compile(code, "README.md", "exec"), scope)
        torch.cuda.synchronize()
        cfg, idx, out = scope["cfg"], scope["idx"], scope["out"]
        self.assertEqual((idx.dtype, tuple(idx.shape), idx.device.type),
                         (torch.int32, (2, 4, 16), "cuda"))
        self.assertEqual((out.dtype, tuple(out.shape)), (torch.bfloat16, (2, 64, 128)))
        # The replay wrote what the CPU reference computes from the same tensors.
        def bits(name):
            tensor = scope[name].cpu()
            return m3msa.view(tensor.view(torch.int16).numpy().view(np.uint16), "bf16")

        table = scope["table"].cpu().numpy()
        batch = m3msa.Batch.decode([3000, 700], table, table)
        host_idx = m3msa.select_topk(cfg, bits("index_q"), bits("index_cache"), batch)
        scores = m3msa.score_blocks(cfg, bits("index_q"), bits("index_cache"), batch)
        case = type("Case", (), dict(cfg=cfg, rows=[(0, 2999), (1, 699)]))
        self.assertSelectionNearTie(case, idx.cpu().numpy(), host_idx, scores)
        expected = m3msa.sparse_attention(cfg, bits("q"), bits("kv_cache"), batch,
                                          idx.cpu().numpy())
        self.assertAttentionClose(out.cpu().view(torch.int16).numpy().view(np.uint16),
                                   expected.array)


if __name__ == "__main__":
    unittest.main()
