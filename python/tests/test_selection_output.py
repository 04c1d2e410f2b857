"""select_topk's output options: order="descending" | "ascending", major="token" | "head", and an
out= view into a buffer of larger capacity written in place through its strides. The selected set is
the default one; nothing outside the answers is written. CPU on NumPy; CUDA on torch (skipped
without torch or a GPU)."""

import unittest

import numpy as np

import m3msa
import oracle
from common import THREADS, TestCase, small_config
from cuda_common import GpuCase, gpu_config, requires_cuda, torch

SEQ_LENS = [150, 7, 0, 64, 65, 300]
POISON = 0x5A5A5A5A


def expected(default, order, major):
    want = np.array(default)
    if order == "ascending":
        for answer in want.reshape(-1, want.shape[-1]):
            valid = int((answer >= 0).sum())
            answer[:valid] = np.sort(answer[:valid])
    return want if major == "token" else want.transpose(1, 0, 2)


class SelectionOutputTest(TestCase):
    def test_orders_majors_and_a_larger_buffer(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(11), seq_lens=SEQ_LENS, q_len=2)
        default = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
        rows, heads, k = default.shape
        for order in ("descending", "ascending"):
            for major in ("token", "head"):
                shape = (rows + 3, heads, k + 2) if major == "token" else (heads, rows + 3, k + 2)
                buffer = np.full(shape, POISON, np.int32)
                view = buffer[:rows, :, :k] if major == "token" else buffer[:, :rows, :k]
                got = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, view,
                                        order=order, major=major, threads=THREADS)
                want = expected(default, order, major)
                np.testing.assert_array_equal(got, want, err_msg=f"{order} {major}")
                self.assertEqual(int((buffer == POISON).sum()), buffer.size - want.size)

    def test_unknown_options_are_refused(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(12), seq_lens=SEQ_LENS, q_len=1)
        with self.assertRaisesError("invalid_argument", "order"):
            m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, order="random")
        with self.assertRaises(m3msa.Error):
            m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, major="row")


@requires_cuda
class CudaSelectionOutputTest(TestCase):
    def test_orders_majors_and_a_larger_buffer_on_the_gpu(self):
        cfg = gpu_config()
        case = GpuCase(cfg, kind="decode", q_len=2, num_reqs=5, min_context=1,
                       max_context=30000, padding_reqs=1, seed=13)
        default = m3msa.select_topk(cfg, case.index_q, case.index_cache, case.batch)
        rows, heads, k = default.shape
        for order in ("descending", "ascending"):
            for major in ("token", "head"):
                shape = (rows + 3, heads, k + 2) if major == "token" else (heads, rows + 3, k + 2)
                buffer = torch.full(shape, POISON, dtype=torch.int32, device="cuda")
                view = buffer[:rows, :, :k] if major == "token" else buffer[:, :rows, :k]
                got = m3msa.select_topk(cfg, case.index_q, case.index_cache, case.batch, view,
                                        order=order, major=major)
                want = expected(default.cpu().numpy(), order, major)
                np.testing.assert_array_equal(got.cpu().numpy(), want, err_msg=f"{order} {major}")
                self.assertEqual(int((buffer == POISON).sum()), buffer.numel() - want.size)


if __name__ == "__main__":
    unittest.main()
