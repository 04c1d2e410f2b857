"""The CUDA backend through torch tensors: select_topk, sparse / dense attention and preprocess
equal the CPU reference of the same build (selections under the near-tie rule, attention within
the bf16 tolerance of the C++ GPU tests, preprocessing bit-exact up to one code on <= 1e-4 of the
elements), on torch's current stream, unplanned and planned. Skips without torch or a GPU."""

import unittest

import numpy as np

import m3msa
import oracle
from common import THREADS
from cuda_common import (CudaTestCase, GpuCase, batch_to, gpu_config, requires_cuda, to_numpy_bits,
                         to_torch, torch)

# Decode cases: (q_len, index dtype, kv dtype, seq_lens or None, extra spec).
DECODE = [
    (1, "bf16", "bf16", [1, 128, 129, 1000, 0, 20000], {}),  # one token, block edges, padding
    (4, "fp8", "fp8", None, dict(num_reqs=6, min_context=4, max_context=9000, padding_reqs=1)),
    (2, "bf16", "fp8", None, dict(num_reqs=5, min_context=1024, max_context=24000)),
]


def decode_case(cfg, q_len, index_dtype, kv_dtype, seq_lens, extra, seed):
    spec = dict(kind="decode", q_len=q_len, index_dtype=index_dtype, kv_dtype=kv_dtype, seed=seed)
    if kv_dtype == "fp8":
        spec.update(k_scale=0.5, v_scale=2.0)
    if seq_lens is not None:
        spec.update(num_reqs=len(seq_lens), seq_lens=seq_lens)
    spec.update(extra)
    return GpuCase(cfg, **spec)


@requires_cuda
class CudaOpsTest(CudaTestCase):
    def check_select(self, case, **kwargs):
        got = m3msa.select_topk(case.cfg, case.index_q, case.index_cache, case.batch, **kwargs)
        self.assertIsInstance(got, torch.Tensor)
        self.assertEqual((got.dtype, got.device), (torch.int32, case.index_q.device))
        cpu, scores = self.cpu_selection(case)
        self.assertSelectionNearTie(case, got.cpu().numpy(), cpu, scores)
        return got

    def check_attention(self, case, topk, **kwargs):
        got = m3msa.sparse_attention(case.cfg, case.q, case.kv_cache, case.batch, topk,
                                     k_scale=case.k_scale, v_scale=case.v_scale, **kwargs)
        self.assertIsInstance(got, torch.Tensor)
        self.assertEqual((got.dtype, tuple(got.shape)),
                         (torch.bfloat16, (case.batch.num_rows, case.cfg.q_heads, 128)))
        h = case.host
        # The CPU attends over the GPU's own selection: the attention is compared, not the indexer.
        host_topk = None if topk is None else topk.cpu().numpy()
        expected = m3msa.sparse_attention(case.cfg, h.q, h.kv_cache, h.batch, host_topk,
                                          k_scale=h.k_scale, v_scale=h.v_scale, threads=THREADS)
        self.assertAttentionClose(to_numpy_bits(got), expected.array)
        dead = [row for row, (_, pos) in enumerate(case.rows) if pos < 0]
        if dead:
            self.assertFalse(got[dead].float().abs().sum().item(), "dead rows must be zeros")
        return got

    def test_decode_selection_and_attention_match_the_cpu(self):
        for seed, (q_len, index_dtype, kv_dtype, seq_lens, extra) in enumerate(DECODE, 1):
            for cfg in (gpu_config(), m3msa.SparseConfig()):  # small, and M3's 64 / 4 / 4 / 16
                with self.subTest(q_len=q_len, index=index_dtype, kv=kv_dtype, cfg=cfg):
                    case = decode_case(cfg, q_len, index_dtype, kv_dtype, seq_lens, extra, seed)
                    topk = self.check_select(case)
                    self.check_attention(case, topk)

    def test_prefill_selection_and_attention_match_the_cpu(self):
        cfg = gpu_config()
        case = GpuCase(cfg, kind="prefill", num_reqs=3, chunk_lens=[5, 130, 40],
                       context_lens=[0, 3000, 127], index_dtype="fp8", seed=7)
        topk = self.check_select(case)
        self.check_attention(case, topk)

    def test_dense_attention_matches_the_cpu(self):
        cfg = gpu_config()
        case = decode_case(cfg, 2, "bf16", "bf16", [300, 0, 2000], {}, 11)
        got = m3msa.dense_attention(cfg, case.q, case.kv_cache, case.batch)
        h = case.host
        expected = m3msa.dense_attention(cfg, h.q, h.kv_cache, h.batch, threads=THREADS)
        self.assertAttentionClose(to_numpy_bits(got), expected.array)

    def test_outputs_in_place_and_two_runs_bit_identical(self):
        cfg = gpu_config()
        case = decode_case(cfg, 1, "bf16", "bf16", None, dict(num_reqs=8, max_context=30000), 3)
        topk = torch.full((case.batch.num_rows, cfg.index_heads, cfg.topk), 12345,
                          dtype=torch.int32, device="cuda")  # poisoned
        out = torch.full((case.batch.num_rows, cfg.q_heads, 128), float("nan"),
                         dtype=torch.bfloat16, device="cuda")
        self.assertIs(m3msa.select_topk(cfg, case.index_q, case.index_cache, case.batch, topk),
                      topk)
        self.assertIs(m3msa.sparse_attention(cfg, case.q, case.kv_cache, case.batch, topk, out),
                      out)
        again_topk = m3msa.select_topk(cfg, case.index_q, case.index_cache, case.batch)
        again_out = m3msa.sparse_attention(cfg, case.q, case.kv_cache, case.batch, again_topk)
        self.assertTrue(torch.equal(topk, again_topk))
        self.assertTrue(torch.equal(out.view(torch.int16), again_out.view(torch.int16)))
        self.assertFalse(out.isnan().any().item(), "every output element must be written")

    def test_runs_on_the_current_torch_stream(self):
        cfg = gpu_config()
        case = decode_case(cfg, 1, "fp8", "bf16", None, dict(num_reqs=4, max_context=20000), 5)
        expected = m3msa.select_topk(cfg, case.index_q, case.index_cache, case.batch)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # Written on the side stream just before the call: ordered only if the call runs there.
            index_q = case.index_q.clone()
            out = torch.full_like(expected, -7)
            m3msa.select_topk(cfg, index_q, case.index_cache, case.batch, out)
            planned = m3msa.CudaPlan(cfg, max_reqs=4)
            out_planned = torch.full_like(expected, -7)
            m3msa.select_topk(cfg, index_q, case.index_cache, case.batch, out_planned,
                              plan=planned)
        side.synchronize()
        self.assertTrue(torch.equal(out, expected))
        self.assertTrue(torch.equal(out_planned, expected))
        # An explicit stream= (a torch.cuda.Stream or its integer handle) wins over the current.
        out_explicit = torch.zeros_like(expected)
        m3msa.select_topk(cfg, case.index_q, case.index_cache, case.batch, out_explicit,
                          stream=side.cuda_stream)
        side.synchronize()
        self.assertTrue(torch.equal(out_explicit, expected))

    def test_planned_calls_equal_unplanned(self):
        cfg = gpu_config()
        plan = m3msa.CudaPlan(cfg, max_reqs=8, max_q_len=4, max_rows=200)
        self.assertEqual((plan.max_reqs, plan.max_q_len, plan.max_rows, plan.device),
                         (8, 4, 200, torch.cuda.current_device()))
        for seed, (q_len, index_dtype, kv_dtype, seq_lens, extra) in enumerate(DECODE, 1):
            case = decode_case(cfg, q_len, index_dtype, kv_dtype, seq_lens, extra, seed)
            eager = m3msa.select_topk(cfg, case.index_q, case.index_cache, case.batch)
            planned = m3msa.select_topk(cfg, case.index_q, case.index_cache, case.batch, plan=plan)
            self.assertTrue(torch.equal(eager, planned))
            out = m3msa.sparse_attention(cfg, case.q, case.kv_cache, case.batch, planned,
                                         k_scale=case.k_scale, v_scale=case.v_scale, plan=plan)
            ref = m3msa.sparse_attention(cfg, case.q, case.kv_cache, case.batch, eager,
                                         k_scale=case.k_scale, v_scale=case.v_scale)
            self.assertTrue(torch.equal(out.view(torch.int16), ref.view(torch.int16)))
        prefill = GpuCase(cfg, kind="prefill", num_reqs=2, chunk_lens=[70, 9],
                          context_lens=[500, 0], seed=9)
        eager = m3msa.select_topk(cfg, prefill.index_q, prefill.index_cache, prefill.batch)
        planned = m3msa.select_topk(cfg, prefill.index_q, prefill.index_cache, prefill.batch,
                                    plan=plan)
        self.assertTrue(torch.equal(eager, planned))
        self.assertEqual(plan.device_status(), 0)

    def test_preprocess_matches_the_cpu(self):
        for kv_dtype in ("bf16", "fp8"):
            with self.subTest(kv=kv_dtype):
                self.check_preprocess(kv_dtype)

    def check_preprocess(self, kv_dtype):
        cfg = gpu_config()
        rng = np.random.default_rng(4)
        k_scale, v_scale = (0.5, 0.25) if kv_dtype == "fp8" else (1.0, 1.0)
        case = m3msa.synthetic_case(cfg, num_reqs=4, q_len=2, seq_lens=[300, 0, 129, 5000],
                                    kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale, seed=4)
        rows = case.num_rows
        qkv = m3msa.as_bf16(rng.standard_normal((rows, cfg.qkv_width)))
        weights = [m3msa.as_bf16(rng.standard_normal(n) * 0.2)
                   for n in (cfg.head_dim, cfg.head_dim, cfg.index_dim, cfg.index_dim)]
        kv_host = m3msa.view(np.asarray(case.kv_cache.array).copy(), kv_dtype)
        index_host = m3msa.view(np.asarray(case.index_cache.array).copy(), "bf16")
        kv_gpu, index_gpu = to_torch(kv_host), to_torch(index_host)
        q_cpu, iq_cpu = m3msa.preprocess(cfg, qkv, *weights, case.positions, case.batch, kv_host,
                                         index_host, k_scale=k_scale, v_scale=v_scale,
                                         threads=THREADS)
        q_gpu, iq_gpu = m3msa.preprocess(cfg, to_torch(qkv), *[to_torch(w) for w in weights],
                                         to_torch(case.positions), batch_to(case.batch), kv_gpu,
                                         index_gpu, k_scale=k_scale, v_scale=v_scale)
        self.assertEqual(q_gpu.dtype, torch.bfloat16)
        live = [row for row, (_, pos) in enumerate(oracle.row_positions(case.batch)) if pos >= 0]
        self.assertBitsNear(to_numpy_bits(q_gpu)[live], q_cpu.array[live], "q_out")
        self.assertBitsNear(to_numpy_bits(iq_gpu)[live], iq_cpu.array[live], "index_q_out")
        self.assertBitsNear(to_numpy_bits(kv_gpu), kv_host.array, "kv_cache")
        self.assertBitsNear(to_numpy_bits(index_gpu), index_host.array, "index_cache")

    def test_torch_fp8_and_bits_views_are_the_same(self):
        cfg = gpu_config()
        case = decode_case(cfg, 1, "fp8", "fp8", [700, 4000], {}, 13)
        as_fp8 = m3msa.select_topk(cfg, case.index_q, case.index_cache, case.batch)
        bits = m3msa.view(case.index_cache.view(torch.uint8), "fp8")
        as_bits = m3msa.select_topk(cfg, case.index_q, bits, case.batch)
        self.assertTrue(torch.equal(as_fp8, as_bits))


if __name__ == "__main__":
    unittest.main()
