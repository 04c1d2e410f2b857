"""CUDA graphs: select_topk + sparse_attention captured once with a CudaPlan by
torch.cuda.CUDAGraph, replayed with new inputs and metadata (same host shapes), equal the eager
calls bit for bit and the CPU reference under the usual rules. Skips without torch or a GPU."""

import types
import unittest

import numpy as np

import m3msa
import oracle
from common import THREADS
from cuda_common import CudaTestCase, gpu_config, requires_cuda, to_numpy_bits, torch

REQS, Q_LEN, WIDTH = 4, 2, 40  # requests, rows per request, table columns (up to 5120 tokens)
PAGES = REQS * WIDTH + 7


def random_step(gen, cfg, index_dtype):
    """A decode step with fresh values and metadata of fixed host shapes (one padding request)."""
    rows = REQS * Q_LEN
    seq_lens = torch.randint(Q_LEN, WIDTH * cfg.block_size + 1, (REQS,), generator=gen)
    seq_lens[int(torch.randint(0, REQS, (1,), generator=gen))] = 0
    table = torch.randperm(PAGES, generator=gen)[:REQS * WIDTH].view(REQS, WIDTH)

    def normal(*shape):
        return torch.randn(*shape, generator=gen)

    step = types.SimpleNamespace(
        seq_lens=seq_lens.int(), index_table=table.int(), kv_table=table.flip(0).int(),
        index_q=normal(rows, cfg.index_heads, cfg.index_dim).bfloat16(),
        q=normal(rows, cfg.q_heads, cfg.head_dim).bfloat16(),
        index_cache=normal(PAGES, cfg.block_size, cfg.index_dim).to(index_dtype),
        kv_cache=normal(PAGES, cfg.kv_heads, 2, cfg.block_size, cfg.head_dim).bfloat16())
    for name, value in vars(step).items():
        setattr(step, name, value.cuda())
    step.batch = m3msa.Batch.decode(step.seq_lens, step.index_table, step.kv_table, q_len=Q_LEN)
    return step


def copy_into(static, step):
    for name in ("seq_lens", "index_table", "kv_table", "index_q", "q", "index_cache",
                 "kv_cache"):
        getattr(static, name).copy_(getattr(step, name))


def host_case(cfg, step):
    """The step on the host, for the CPU reference."""
    def bits(tensor, dtype):
        return m3msa.view(to_numpy_bits(tensor), dtype)

    batch = m3msa.Batch.decode(step.seq_lens.cpu().numpy(), step.index_table.cpu().numpy(),
                               step.kv_table.cpu().numpy(), q_len=Q_LEN)
    index_dtype = "fp8" if step.index_cache.dtype == torch.float8_e4m3fn else "bf16"
    host = types.SimpleNamespace(cfg=cfg, batch=batch, rows=oracle.row_positions(batch),
                                 index_q=bits(step.index_q, "bf16"), q=bits(step.q, "bf16"),
                                 index_cache=bits(step.index_cache, index_dtype),
                                 kv_cache=bits(step.kv_cache, "bf16"))
    host.host = host  # the shape CudaTestCase.cpu_selection expects
    return host


@requires_cuda
class CudaGraphTest(CudaTestCase):
    def capture(self, cfg, static, plan):
        rows = REQS * Q_LEN
        topk = torch.empty(rows, cfg.index_heads, cfg.topk, dtype=torch.int32, device="cuda")
        out = torch.empty(rows, cfg.q_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda")

        def body():
            m3msa.select_topk(cfg, static.index_q, static.index_cache, static.batch, topk,
                              plan=plan)
            m3msa.sparse_attention(cfg, static.q, static.kv_cache, static.batch, topk, out,
                                   plan=plan)

        body()  # warm-up, eager, with the plan
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        return graph, topk, out

    def test_replay_with_new_inputs_equals_eager(self):
        for index_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            with self.subTest(index_dtype=str(index_dtype)):
                self.check_replays(index_dtype)

    def check_replays(self, index_dtype):
        cfg = gpu_config()
        gen = torch.Generator().manual_seed(1)
        plan = m3msa.CudaPlan(cfg, max_reqs=REQS, max_q_len=Q_LEN)
        static = random_step(gen, cfg, index_dtype)
        graph, topk, out = self.capture(cfg, static, plan)
        for trial in range(4):
            step = random_step(gen, cfg, index_dtype)
            copy_into(static, step)
            topk.fill_(-7)
            out.fill_(float("nan"))
            graph.replay()
            eager_topk = m3msa.select_topk(cfg, step.index_q, step.index_cache, step.batch)
            eager_out = m3msa.sparse_attention(cfg, step.q, step.kv_cache, step.batch,
                                               eager_topk)
            torch.cuda.synchronize()
            self.assertTrue(torch.equal(topk, eager_topk), f"trial {trial}: selections differ")
            self.assertTrue(torch.equal(out.view(torch.int16), eager_out.view(torch.int16)),
                            f"trial {trial}: attention differs")
            if trial == 0:  # and the replay is right, not just repeatable
                host = host_case(cfg, step)
                cpu, scores = self.cpu_selection(host)
                self.assertSelectionNearTie(host, topk.cpu().numpy(), cpu, scores)
                expected = m3msa.sparse_attention(cfg, host.q, host.kv_cache, host.batch,
                                                  topk.cpu().numpy(), threads=THREADS)
                self.assertAttentionClose(to_numpy_bits(out), expected.array)
        self.assertEqual(plan.device_status(), 0)

    def test_device_scales_are_read_at_each_replay(self):
        # fp8 KV with k / v scales as device scalars: a captured graph sees each new value.
        cfg = gpu_config()
        gen = torch.Generator().manual_seed(5)
        plan = m3msa.CudaPlan(cfg, max_reqs=REQS, max_q_len=Q_LEN)
        step = random_step(gen, cfg, torch.bfloat16)
        kv_fp8 = step.kv_cache.float().to(torch.float8_e4m3fn)
        topk = m3msa.select_topk(cfg, step.index_q, step.index_cache, step.batch)
        k_scale = torch.full((1,), 0.5, dtype=torch.float32, device="cuda")
        v_scale = torch.full((1,), 0.25, dtype=torch.float32, device="cuda")
        out = torch.empty(REQS * Q_LEN, cfg.q_heads, cfg.head_dim, dtype=torch.bfloat16,
                          device="cuda")

        def body():
            m3msa.sparse_attention(cfg, step.q, kv_fp8, step.batch, topk, out, k_scale=k_scale,
                                   v_scale=v_scale, plan=plan)

        body()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        for k, v in ((0.5, 0.25), (2.0, 0.125), (0.0625, 3.0)):
            k_scale.fill_(k)
            v_scale.fill_(v)
            out.fill_(float("nan"))
            graph.replay()
            eager = m3msa.sparse_attention(cfg, step.q, kv_fp8, step.batch, topk, k_scale=k,
                                           v_scale=v)
            torch.cuda.synchronize()
            self.assertTrue(torch.equal(out.view(torch.int16), eager.view(torch.int16)),
                            f"k_scale {k} v_scale {v}")

    def test_unplanned_call_under_capture_is_refused(self):
        cfg = gpu_config()
        step = random_step(torch.Generator().manual_seed(2), cfg, torch.bfloat16)
        topk = m3msa.select_topk(cfg, step.index_q, step.index_cache, step.batch)  # eager: fine
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with self.assertRaises(m3msa.InvalidArgumentError) as raised:
            with torch.cuda.graph(graph):
                m3msa.select_topk(cfg, step.index_q, step.index_cache, step.batch, topk)
        self.assertIn("plan=m3msa.CudaPlan", raised.exception.message)
        # The stream is usable afterwards.
        again = m3msa.select_topk(cfg, step.index_q, step.index_cache, step.batch)
        self.assertTrue(torch.equal(again, topk))

    def test_calls_outside_the_plan_are_refused(self):
        cfg = gpu_config()
        step = random_step(torch.Generator().manual_seed(3), cfg, torch.bfloat16)
        small = m3msa.CudaPlan(cfg, max_reqs=REQS - 1, max_q_len=Q_LEN)
        with self.assertRaises(ValueError) as raised:
            m3msa.select_topk(cfg, step.index_q, step.index_cache, step.batch, plan=small)
        self.assertIn("max_reqs", str(raised.exception))
        short = m3msa.CudaPlan(cfg, max_reqs=REQS, max_q_len=1)
        with self.assertRaisesError("invalid_argument", "max_q_len"):
            m3msa.sparse_attention(cfg, step.q, step.kv_cache, step.batch, None, plan=short)
        other = m3msa.CudaPlan(gpu_config(topk=4), max_reqs=REQS, max_q_len=Q_LEN)
        with self.assertRaisesError("invalid_argument", "config differs"):
            m3msa.select_topk(cfg, step.index_q, step.index_cache, step.batch, plan=other)
        with self.assertRaisesError("invalid_argument", "plan", "dict"):
            m3msa.select_topk(cfg, step.index_q, step.index_cache, step.batch, plan={})


if __name__ == "__main__":
    unittest.main()
