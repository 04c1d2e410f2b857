"""Caches read in place through their strides (docs/spec.md section 3): the main cache as ours,
vLLM's and FlashInfer's layouts, as a (k, v) pair of views and as sub-views; the index cache with
padded pages. Every form gives the packed layout's bits. The CPU part runs on NumPy; the CUDA part
on torch tensors (skipped without torch or a GPU)."""

import unittest

import numpy as np

import m3msa
import oracle
from common import THREADS, TestCase, small_config
from cuda_common import GpuCase, gpu_config, requires_cuda, to_numpy_bits, torch

SEQ_LENS = [150, 7, 0, 64, 65, 300]


def relayout(kv, layout):
    """A packed cache [pages, kv_heads, 2, bs, hd] (array) in `layout`, contiguous."""
    if layout == "ours":
        return kv
    if layout == "vllm":  # [pages, 2, bs, kv_heads, hd]
        return np.ascontiguousarray(kv.transpose(0, 2, 3, 1, 4))
    pages, heads, _, bs, hd = kv.shape  # flashinfer: [pages, kv_heads, bs, 2 * hd]
    return np.ascontiguousarray(kv.transpose(0, 1, 3, 2, 4)).reshape(pages, heads, bs, 2 * hd)


def head_shard(kv):
    """A vLLM cache with twice the heads (garbage in the first half) and the view of the second."""
    pages, two, bs, heads, hd = kv.shape
    wide = np.full((pages, two, bs, 2 * heads, hd), 0x7F, kv.dtype)
    wide[:, :, :, heads:] = kv
    return wide[:, :, :, heads:]


class LayoutTest(TestCase):
    def attend(self, cfg, c, topk, kv_cache, **kwargs):
        out = m3msa.sparse_attention(cfg, c.q, kv_cache, c.batch, topk, k_scale=c.k_scale,
                                     v_scale=c.v_scale, threads=THREADS, **kwargs)
        return np.asarray(out.array)

    def test_every_layout_equals_the_packed_cache(self):
        cfg = small_config()
        for kv_dtype in ("bf16", "fp8"):
            c = oracle.make_case(cfg, np.random.default_rng(3), seq_lens=SEQ_LENS, q_len=2,
                                 kv_dtype=kv_dtype, k_scale=0.5, v_scale=2.0)
            topk = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
            want = self.attend(cfg, c, topk, c.kv_cache)
            kv, dtype = c.kv_cache.array, c.kv_cache.dtype
            for layout in ("vllm", "flashinfer"):
                got = self.attend(cfg, c, topk, m3msa.view(relayout(kv, layout), dtype),
                                  kv_layout=layout)
                np.testing.assert_array_equal(got, want, err_msg=layout)
            shard = m3msa.view(head_shard(relayout(kv, "vllm")), dtype)
            np.testing.assert_array_equal(
                self.attend(cfg, c, topk, shard, kv_layout="vllm"), want, err_msg="shard")
            pair = (m3msa.view(kv[:, :, 0], dtype), m3msa.view(kv[:, :, 1], dtype))
            np.testing.assert_array_equal(self.attend(cfg, c, topk, pair), want, err_msg="pair")

    def test_padded_index_pages(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(5), seq_lens=SEQ_LENS, q_len=1)
        want = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
        pages, bs, d = c.index_cache.array.shape
        padded = np.zeros((pages, bs + 3, d), c.index_cache.array.dtype)
        padded[:, :bs] = c.index_cache.array
        view = m3msa.view(padded[:, :bs], c.index_cache.dtype)
        got = m3msa.select_topk(cfg, c.index_q, view, c.batch, threads=THREADS)
        self.assertSelectionEqual(got, want)

    def test_scale_arrays_are_read_like_numbers(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(9), seq_lens=SEQ_LENS, q_len=2,
                             kv_dtype="fp8", k_scale=0.5, v_scale=2.0)
        topk = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
        want = self.attend(cfg, c, topk, c.kv_cache)
        out = m3msa.sparse_attention(cfg, c.q, c.kv_cache, c.batch, topk,
                                     k_scale=np.array([0.5], np.float32),
                                     v_scale=np.array([2.0], np.float32), threads=THREADS)
        np.testing.assert_array_equal(np.asarray(out.array), want)
        with self.assertRaisesError("invalid_argument", "kv_cache.v_scale_tensor", "one element"):
            m3msa.sparse_attention(cfg, c.q, c.kv_cache, c.batch, topk,
                                   v_scale=np.array([0.5, 1.0], np.float32), threads=THREADS)
        with self.assertRaisesError("invalid_argument", "k_scale", "float64"):
            m3msa.sparse_attention(cfg, c.q, c.kv_cache, c.batch, topk,
                                   k_scale=np.array([0.5], np.float64), threads=THREADS)

    def test_refusals_name_the_argument(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(7), seq_lens=SEQ_LENS, q_len=1)
        topk = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
        with self.assertRaisesError("invalid_argument", "kv_layout", "nhd"):
            self.attend(cfg, c, topk, c.kv_cache, kv_layout="nhd")
        kv = c.kv_cache.array
        pair = (m3msa.view(kv[:, :, 0], "bf16"), m3msa.view(kv[:, :, 1], "bf16"))
        with self.assertRaisesError("invalid_argument", "kv_layout", "pair"):
            self.attend(cfg, c, topk, pair, kv_layout="vllm")
        # head_dim not contiguous
        bad = (m3msa.view(kv[:, :, 0, :, ::2], "bf16"), m3msa.view(kv[:, :, 1, :, ::2], "bf16"))
        with self.assertRaisesError("invalid_argument", "kv_cache.k"):
            self.attend(cfg, c, topk, bad)
        with self.assertRaisesError("invalid_argument", "kv_cache", "flashinfer"):
            self.attend(cfg, c, topk, c.kv_cache, kv_layout="flashinfer")


@requires_cuda
class CudaLayoutTest(TestCase):
    def test_every_layout_equals_the_packed_cache_on_the_gpu(self):
        cfg = gpu_config()
        for kv_dtype in ("bf16", "fp8"):
            case = GpuCase(cfg, kind="decode", q_len=2, num_reqs=5, min_context=100,
                           max_context=20000, kv_dtype=kv_dtype, seed=17,
                           **(dict(k_scale=0.5, v_scale=2.0) if kv_dtype == "fp8" else {}))
            topk = m3msa.select_topk(cfg, case.index_q, case.index_cache, case.batch)

            def attend(kv_cache, **kwargs):
                out = m3msa.sparse_attention(cfg, case.q, kv_cache, case.batch, topk,
                                             k_scale=case.k_scale, v_scale=case.v_scale,
                                             **kwargs)
                return to_numpy_bits(out)

            kv = case.kv_cache  # [pages, kv_heads, 2, bs, hd] torch
            want = attend(kv)
            vllm = kv.permute(0, 2, 3, 1, 4).contiguous()
            np.testing.assert_array_equal(attend(vllm, kv_layout="vllm"), want)
            pages, heads, _, bs, hd = kv.shape
            fi = kv.permute(0, 1, 3, 2, 4).contiguous().reshape(pages, heads, bs, 2 * hd)
            np.testing.assert_array_equal(attend(fi, kv_layout="flashinfer"), want)
            # vLLM's K and V as torch views of the cache (K = cache[:, 0], tokens then heads).
            pair = (vllm[:, 0].permute(0, 2, 1, 3), vllm[:, 1].permute(0, 2, 1, 3))
            np.testing.assert_array_equal(attend(pair), want)
            bits = torch.int16 if kv.dtype == torch.bfloat16 else torch.uint8
            wide = torch.zeros((pages, 2, bs, 2 * heads, hd), dtype=bits, device=kv.device)
            wide[:, :, :, heads:] = vllm.view(bits)
            shard = wide.view(kv.dtype)[:, :, :, heads:]
            np.testing.assert_array_equal(attend(shard, kv_layout="vllm"), want)


if __name__ == "__main__":
    unittest.main()
