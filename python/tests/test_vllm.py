"""m3msa.vllm: vLLM's two MiniMax-M3 decode entry points fed tensors built the way vLLM builds
them (request-major rows, one block table for both caches, the index cache [blocks, 128-token
block, D], the main cache [blocks, 2, block, KVH, HD], a head-major selection buffer of larger
capacity, padding requests of length 0), against the CPU reference and against an oracle of
vLLM's own rules (forced init blocks, then local blocks, then descending score; -1 padding);
the plugin's swap, fallback and undo on a stand-in vllm package; the entry point in
pyproject.toml; on a GPU the same calls eager, replayed from a CUDA graph with new inputs, and
under torch.compile(fullgraph=True). Skips without torch (the GPU class without a GPU)."""

import functools
import importlib
import math
import os
import sys
import tempfile
import textwrap
import types
import unittest
from unittest import mock

import numpy as np

import m3msa
import oracle
from common import THREADS, TestCase, small_config
from cuda_common import CudaTestCase, gpu_config, requires_cuda

try:
    import torch
    import m3msa.vllm as mvllm
    from test_torch_ops import (POISON, bits, compile_skip_reason, kv_in_layout,
                                shared_table_case, t)
except ImportError:
    torch = None

NO_TORCH = "torch is not installed"
SEQ_LENS = [150, 7, 0, 64, 65, 300, 16]
# The GPU class: up to 15 blocks of 128 tokens against a top-8, and a padding request.
CUDA_SEQ_LENS = [1900, 7, 0, 1000, 1290]


def vllm_rule_selection(c, topk, init_blocks, local_blocks):
    """[H, rows, topk] by vLLM's documented rule: a block's score is the max over its visible
    tokens of idx_q . index_k; init blocks score 1e30, local blocks (the last local_blocks) 1e29;
    NaN counts as -1e30; the topk highest, descending; -1 after min(topk, visible blocks)."""
    block_scores = oracle.scores(c)
    rows = len(c.rows)
    heads = c.cfg.index_heads
    out = np.full((heads, rows, topk), -1, np.int32)
    for row, (_, pos) in enumerate(c.rows):
        if pos < 0:
            continue
        nb = pos // c.cfg.block_size + 1
        for h in range(heads):
            s = np.nan_to_num(block_scores[row, h, :nb].astype(np.float64), nan=-1e30)
            s[:min(init_blocks, nb)] = 1e30
            s[max(0, nb - local_blocks):] = 1e29
            order = sorted(range(nb), key=lambda b: (-s[b], b))[:topk]
            out[h, row, :len(order)] = order
    return out


@requires_cuda
class CudaVllmEntryPointsTest(CudaTestCase):
    """Both entry points on the GPU, fed the way vLLM feeds them (one table for both caches, the
    main cache in vLLM's layout, a head-major selection buffer of larger capacity): eager against
    the CPU reference, one step replayed from a CUDA graph on new inputs against the same step
    eager, and the step under torch.compile(fullgraph=True) against eager."""

    def make(self, seed, q_len):
        cfg = gpu_config()
        c = shared_table_case(cfg, seed, seq_lens=CUDA_SEQ_LENS, q_len=q_len)
        dev = types.SimpleNamespace(
            idx_q=t(c.index_q).cuda(), index_cache=t(c.index_cache).cuda(),
            table=t(c.index_table).cuda(), seq_lens=t(c.batch.seq_lens).cuda(),
            q=t(c.q).cuda(), kv=kv_in_layout(c.kv_cache, "vllm").cuda())
        rows = len(c.rows)
        dev.buffer = torch.full((cfg.index_heads, rows + 3, cfg.topk), POISON, dtype=torch.int32,
                                device="cuda")
        dev.out = torch.full((rows, cfg.q_heads, cfg.head_dim), float("nan"),
                             dtype=torch.bfloat16, device="cuda")
        return cfg, c, dev

    @staticmethod
    def step(cfg, q_len, idx_q, index_cache, table, seq_lens, q, kv, buffer, out):
        topk = mvllm.minimax_m3_index_decode(idx_q, index_cache, table, seq_lens,
                                             max(CUDA_SEQ_LENS), cfg.topk, cfg.init_blocks,
                                             cfg.local_blocks, cfg.index_heads, q_len, q_len,
                                             out=buffer)
        mvllm.minimax_m3_sparse_attn_decode(q, kv, topk, table, seq_lens, cfg.kv_heads,
                                            1.0 / math.sqrt(cfg.head_dim), out, q_len)
        return topk

    def run_step(self, cfg, q_len, dev):
        return self.step(cfg, q_len, dev.idx_q, dev.index_cache, dev.table, dev.seq_lens, dev.q,
                         dev.kv, dev.buffer, dev.out)

    def test_eager_matches_the_cpu_reference(self):
        for q_len in (1, 2, 4):
            cfg, c, dev = self.make(90 + q_len, q_len)
            rows = len(c.rows)
            topk = self.run_step(cfg, q_len, dev)
            torch.cuda.synchronize()
            self.assertTrue(bool((dev.buffer[:, rows:] == POISON).all()), f"q_len {q_len}")
            gpu = topk.permute(1, 0, 2).cpu().numpy()
            want = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
            scores = m3msa.score_blocks(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
            case = types.SimpleNamespace(cfg=cfg, rows=c.rows)
            self.assertSelectionNearTie(case, gpu, want, scores)
            # Attention over the GPU's own selection, against the CPU reference of the same.
            ref = m3msa.sparse_attention(cfg, c.q, c.kv_cache, c.batch, gpu, threads=THREADS)
            self.assertAttentionClose(bits(dev.out), np.asarray(ref.array))

    def test_graph_replay_with_new_inputs_equals_eager(self):
        q_len = 2
        cfg, _, dev = self.make(97, q_len)
        self.run_step(cfg, q_len, dev)  # eager first: the plan is made outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.run_step(cfg, q_len, dev)
        gen = torch.Generator(device="cuda").manual_seed(5)
        for round_ in range(2):
            dev.idx_q.copy_(torch.randn(dev.idx_q.shape, generator=gen, device="cuda"))
            dev.q.copy_(torch.randn(dev.q.shape, generator=gen, device="cuda"))
            dev.buffer.fill_(-7)
            dev.out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            replayed_topk, replayed_out = dev.buffer.clone(), dev.out.clone()
            self.run_step(cfg, q_len, dev)
            torch.cuda.synchronize()
            self.assertTrue(torch.equal(replayed_topk, dev.buffer), f"round {round_}")
            self.assertTrue(torch.equal(replayed_out, dev.out), f"round {round_}")

    def test_compiles_with_fullgraph(self):
        reason = compile_skip_reason()
        if reason:
            self.skipTest(reason)
        q_len = 1
        cfg, c, dev = self.make(98, q_len)
        rows = len(c.rows)
        self.run_step(cfg, q_len, dev)
        torch.cuda.synchronize()
        eager_topk, eager_out = dev.buffer[:, :rows].clone(), dev.out.clone()
        dev.buffer.fill_(-7)
        dev.out.zero_()
        compiled = torch.compile(functools.partial(self.step, cfg, q_len), fullgraph=True,
                                 backend="aot_eager")
        compiled(dev.idx_q, dev.index_cache, dev.table, dev.seq_lens, dev.q, dev.kv, dev.buffer,
                 dev.out)
        torch.cuda.synchronize()
        # The compiled step writes the rows of this step into the caller's buffer, as eager does,
        # and leaves the buffer's spare rows as they were.
        self.assertTrue(torch.equal(eager_topk, dev.buffer[:, :rows]))
        self.assertTrue(bool((dev.buffer[:, rows:] == -7).all()))
        self.assertTrue(torch.equal(eager_out, dev.out))


@unittest.skipIf(torch is None, NO_TORCH)
class VllmEntryPointsTest(TestCase):
    def test_index_decode_matches_the_reference_and_vllms_rule(self):
        for init_blocks, local_blocks in ((0, 1), (1, 2)):
            cfg = small_config(init_blocks=init_blocks, local_blocks=local_blocks)
            for q_len in (1, 2, 4):
                c = shared_table_case(cfg, 60 + q_len, seq_lens=SEQ_LENS, q_len=q_len)
                rows = len(c.rows)
                label = f"init {init_blocks} local {local_blocks} q_len {q_len}"
                want = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch,
                                         threads=THREADS).transpose(1, 0, 2)
                np.testing.assert_array_equal(
                    want, vllm_rule_selection(c, cfg.topk, init_blocks, local_blocks), label)
                buffer = torch.full((cfg.index_heads, rows + 5, cfg.topk), POISON,
                                    dtype=torch.int32)
                got = mvllm.minimax_m3_index_decode(
                    t(c.index_q), t(c.index_cache), t(c.index_table), t(c.batch.seq_lens),
                    max(SEQ_LENS), cfg.topk, init_blocks, local_blocks, cfg.index_heads, q_len,
                    4, out=buffer)
                self.assertEqual(got.data_ptr(), buffer.data_ptr(), label)
                self.assertEqual(tuple(got.shape), (cfg.index_heads, rows, cfg.topk), label)
                np.testing.assert_array_equal(got.numpy(), want, label)
                self.assertTrue(bool((buffer[:, rows:] == POISON).all()), label)
                fresh = mvllm.minimax_m3_index_decode(
                    t(c.index_q), t(c.index_cache), t(c.index_table), t(c.batch.seq_lens),
                    max(SEQ_LENS), cfg.topk, init_blocks, local_blocks, cfg.index_heads, q_len,
                    q_len)
                np.testing.assert_array_equal(fresh.numpy(), want, label)

    def test_sparse_attn_decode_matches_the_reference(self):
        cfg = small_config()
        for q_len in (1, 3):
            c = shared_table_case(cfg, 70 + q_len, seq_lens=SEQ_LENS, q_len=q_len)
            rows = len(c.rows)
            buffer = torch.full((cfg.index_heads, rows + 2, cfg.topk), POISON, dtype=torch.int32)
            topk = mvllm.minimax_m3_index_decode(
                t(c.index_q), t(c.index_cache), t(c.index_table), t(c.batch.seq_lens),
                max(SEQ_LENS), cfg.topk, cfg.init_blocks, cfg.local_blocks, cfg.kv_heads, q_len,
                q_len, out=buffer)
            selection = topk.permute(1, 0, 2).contiguous().numpy()
            want = m3msa.sparse_attention(cfg, c.q, c.kv_cache, c.batch, selection,
                                          threads=THREADS)
            self.assertBf16Close(m3msa.to_float32(want), oracle.attention(c, selection))
            output = torch.full(tuple(c.q.array.shape), float("nan"), dtype=torch.bfloat16)
            result = mvllm.minimax_m3_sparse_attn_decode(
                t(c.q), kv_in_layout(c.kv_cache, "vllm"), topk, t(c.index_table),
                t(c.batch.seq_lens), cfg.kv_heads, 1.0 / math.sqrt(cfg.head_dim), output, q_len)
            self.assertIsNone(result)
            np.testing.assert_array_equal(bits(output), np.asarray(want.array), f"q_len {q_len}")

    def test_refusals_name_the_argument(self):
        cfg = small_config()
        c = shared_table_case(cfg, 80, seq_lens=[20, 33])
        args = (t(c.index_q), t(c.index_cache), t(c.index_table), t(c.batch.seq_lens), 64,
                cfg.topk, 0, 1)
        with self.assertRaisesError("invalid_argument", "idx_q", "num_kv_heads"):
            mvllm.minimax_m3_index_decode(*args, cfg.index_heads + 1, 1, 1)
        with self.assertRaisesError("invalid_argument", "decode_query_len"):
            mvllm.minimax_m3_index_decode(*args, cfg.index_heads, 2, 1)
        with self.assertRaisesError("invalid_argument", "idx_q", "decode_query_len"):
            mvllm.minimax_m3_index_decode(*args, cfg.index_heads, 2, 2)
        small = torch.empty((cfg.index_heads, 1, cfg.topk), dtype=torch.int32)
        with self.assertRaisesError("invalid_argument", "out"):
            mvllm.minimax_m3_index_decode(*args, cfg.index_heads, 1, 1, out=small)
        wide = torch.empty((cfg.index_heads, 8, cfg.topk), dtype=torch.int64)
        with self.assertRaisesError("invalid_argument", "out", "int32"):
            mvllm.minimax_m3_index_decode(*args, cfg.index_heads, 1, 1, out=wide)
        topk = mvllm.minimax_m3_index_decode(*args, cfg.index_heads, 1, 1)
        output = torch.empty(tuple(c.q.array.shape), dtype=torch.bfloat16)
        attn = (t(c.q), kv_in_layout(c.kv_cache, "vllm"), topk, t(c.index_table),
                t(c.batch.seq_lens), cfg.kv_heads)
        with self.assertRaisesError("unsupported", "sm_scale"):
            mvllm.minimax_m3_sparse_attn_decode(*attn, 0.5, output, 1)
        with self.assertRaisesError("invalid_argument", "kv_cache", "num_kv_heads"):
            mvllm.minimax_m3_sparse_attn_decode(*attn[:5], cfg.kv_heads * 2, 0.25, output, 1)
        with self.assertRaisesError("invalid_argument", "output", "bfloat16"):
            mvllm.minimax_m3_sparse_attn_decode(*attn, 1.0 / math.sqrt(cfg.head_dim),
                                                output.float(), 1)


# ---- The plugin, on a stand-in vllm package (vLLM itself is not needed to check the swap) ----

STAND_IN = {
    "vllm/__init__.py": "",
    "vllm/models/__init__.py": "",
    "vllm/models/minimax_m3/__init__.py": "",
    "vllm/models/minimax_m3/common/__init__.py": "",
    "vllm/models/minimax_m3/common/ops/__init__.py": "",
    "vllm/models/minimax_m3/common/ops/index_topk.py": """
        calls = []
        def minimax_m3_index_decode(*args, **kwargs):
            calls.append(args)
            return "vllm index"
    """,
    "vllm/models/minimax_m3/common/ops/sparse_attn.py": """
        calls = []
        def minimax_m3_sparse_attn_decode(*args, **kwargs):
            calls.append(args)
            return "vllm attention"
    """,
    # A consumer that imported the functions by name before the plugin ran.
    "vllm/models/minimax_m3/common/sparse_attention.py": """
        from .ops.index_topk import minimax_m3_index_decode
        from .ops.sparse_attn import minimax_m3_sparse_attn_decode as attend
    """,
}


@unittest.skipIf(torch is None, NO_TORCH)
class VllmPluginTest(TestCase):
    def setUp(self):
        self.root = tempfile.TemporaryDirectory()
        for path, text in STAND_IN.items():
            full = os.path.join(self.root.name, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w") as f:
                f.write(textwrap.dedent(text))
        self.saved = {name: module for name, module in sys.modules.items()
                      if name == "vllm" or name.startswith("vllm.")}
        for name in self.saved:
            del sys.modules[name]
        sys.path.insert(0, self.root.name)
        self.consumer = importlib.import_module("vllm.models.minimax_m3.common.sparse_attention")
        self.index_topk = importlib.import_module("vllm.models.minimax_m3.common.ops.index_topk")
        self.sparse_attn = importlib.import_module(
            "vllm.models.minimax_m3.common.ops.sparse_attn")

    def tearDown(self):
        mvllm.uninstall()
        sys.path.remove(self.root.name)
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
        sys.modules.update(self.saved)
        self.root.cleanup()

    def test_register_does_nothing_unless_enabled(self):
        originals = (self.index_topk.minimax_m3_index_decode,
                     self.sparse_attn.minimax_m3_sparse_attn_decode)
        for value in (None, "0", "no"):
            env = {k: v for k, v in os.environ.items() if k != mvllm.ENV_VAR}
            if value is not None:
                env[mvllm.ENV_VAR] = value
            with mock.patch.dict(os.environ, env, clear=True):
                mvllm.register()
            self.assertEqual((self.index_topk.minimax_m3_index_decode,
                              self.sparse_attn.minimax_m3_sparse_attn_decode), originals, value)

    def test_swap_serves_calls_falls_back_and_undoes(self):
        original_index = self.index_topk.minimax_m3_index_decode
        original_attend = self.sparse_attn.minimax_m3_sparse_attn_decode
        with mock.patch.dict(os.environ, {mvllm.ENV_VAR: "1"}):
            mvllm.register()
        swapped = self.index_topk.minimax_m3_index_decode
        self.assertIsNot(swapped, original_index)
        self.assertIs(swapped.m3msa_original, original_index)
        self.assertIs(self.consumer.minimax_m3_index_decode, swapped)
        self.assertIs(self.consumer.attend, self.sparse_attn.minimax_m3_sparse_attn_decode)
        self.assertEqual(mvllm.install(), [])  # idempotent

        cfg = small_config()
        c = shared_table_case(cfg, 90, seq_lens=SEQ_LENS, q_len=1)
        topk = self.consumer.minimax_m3_index_decode(
            t(c.index_q), t(c.index_cache), t(c.index_table), t(c.batch.seq_lens), 512,
            cfg.topk, cfg.init_blocks, cfg.local_blocks, cfg.kv_heads, 1, 1)
        want = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
        np.testing.assert_array_equal(topk.numpy(), want.transpose(1, 0, 2))
        self.assertEqual(self.index_topk.calls, [])

        output = torch.empty(tuple(c.q.array.shape), dtype=torch.bfloat16)
        attn = (t(c.q), kv_in_layout(c.kv_cache, "vllm"), topk, t(c.index_table),
                t(c.batch.seq_lens), cfg.kv_heads)
        self.assertIsNone(self.consumer.attend(*attn, 1.0 / math.sqrt(cfg.head_dim), output, 1))
        self.assertEqual(self.sparse_attn.calls, [])
        # An sm_scale m3msa does not take: vLLM's kernel runs it, and every call of that kind.
        with self.assertLogs("m3msa.vllm", "WARNING") as logs:
            self.assertEqual(self.consumer.attend(*attn, 0.5, output, 1), "vllm attention")
        self.assertIn("sm_scale", logs.output[0])
        self.assertEqual(self.consumer.attend(*attn, 0.5, output, 1), "vllm attention")
        self.assertEqual(len(self.sparse_attn.calls), 2)
        # A bad argument is not a fallback: the error reaches the caller.
        with self.assertRaisesError("invalid_argument", "idx_q"):
            self.consumer.minimax_m3_index_decode(
                t(c.index_q), t(c.index_cache), t(c.index_table), t(c.batch.seq_lens), 512,
                cfg.topk, 0, 1, cfg.kv_heads + 1, 1, 1)

        mvllm.uninstall()
        self.assertIs(self.index_topk.minimax_m3_index_decode, original_index)
        self.assertIs(self.consumer.minimax_m3_index_decode, original_index)
        self.assertIs(self.consumer.attend, original_attend)


class EntryPointTest(unittest.TestCase):
    def test_pyproject_declares_the_vllm_plugin(self):
        try:
            import tomllib
        except ImportError:
            self.skipTest("tomllib needs Python >= 3.11")
        path = os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")
        with open(path, "rb") as f:
            project = tomllib.load(f)["project"]
        self.assertEqual(project["entry-points"]["vllm.general_plugins"]["m3msa"],
                         "m3msa.vllm:register")


if __name__ == "__main__":
    unittest.main()
