"""m3msa.torch: the torch.library ops against the m3msa operations on NumPy (the CPU reference)
bit for bit, every output option and cache layout, outputs written only where they belong, the
fake (meta) implementations, refusals by name; torch.compile(fullgraph=True) where torch >= 2.4;
on CUDA (skipped without a GPU) against the CPU, plan caching and CUDA graph capture. Skips
without torch."""

import unittest

import numpy as np

import m3msa
import oracle
from common import THREADS, TestCase, small_config
from cuda_common import CudaTestCase, GpuCase, gpu_config, requires_cuda

try:
    import torch
    import m3msa.torch as mtorch
except ImportError:
    torch = None

NO_TORCH = "torch is not installed"
POISON = 0x5A5A5A5A


def _torch_version():
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def compile_skip_reason():
    if torch is None:
        return NO_TORCH
    if _torch_version() < (2, 4):
        return f"torch.compile of custom ops needs torch >= 2.4, this is {torch.__version__}"
    return None


def t(value):
    """NumPy (bits tagged bf16 by m3msa.view) -> a CPU torch tensor."""
    if isinstance(value, m3msa.TypedView):
        assert value.dtype == "bf16", value.dtype
        return torch.from_numpy(np.ascontiguousarray(value.array).view(np.int16)).view(
            torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(value))


def bits(tensor):
    """A torch tensor as NumPy (bf16 -> uint16 bits)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def shared_table_case(cfg, seed, **spec):
    """An oracle case whose main KV cache is paged by the index table (one block table for both
    caches, as engines keep it)."""
    c = oracle.make_case(cfg, np.random.default_rng(seed), **spec)
    kv = np.full_like(c.kv_cache.array, oracle.NAN_BITS["bf16"])  # NaN where no context lives
    for req, n in enumerate(c.lengths):
        for b in range(-(-n // cfg.block_size)):
            kv[c.index_table[req, b]] = c.kv_cache.array[c.kv_table[req, b]]
    c.kv_cache = m3msa.view(kv, "bf16")
    c.kv_table = c.index_table
    c.batch.kv_block_table = c.index_table
    return c


def kv_in_layout(kv_ours, layout):
    """Our [pages, KVH, 2, bs, HD] cache as a torch tensor in `layout`."""
    kv = t(kv_ours)
    if layout == "ours":
        return kv
    if layout == "vllm":
        return kv.permute(0, 2, 3, 1, 4).contiguous()
    return torch.cat([kv[:, :, 0], kv[:, :, 1]], dim=-1).contiguous()  # flashinfer


SEQ_LENS = [150, 7, 0, 64, 65, 300]


@unittest.skipIf(torch is None, NO_TORCH)
class TorchOpsTest(TestCase):
    def test_ops_are_registered_with_mutating_schemas(self):
        for name in ("index_decode", "index_prefill", "sparse_attn_decode",
                     "sparse_attn_prefill"):
            schema = str(getattr(torch.ops.m3msa, name).default._schema)
            self.assertIn("Tensor(a!) out", schema, name)
            self.assertTrue(schema.endswith("-> ()"), schema)

    def test_index_decode_every_option_matches_the_reference(self):
        cfg = small_config()
        for q_len in (1, 3):
            c = oracle.make_case(cfg, np.random.default_rng(3 + q_len), seq_lens=SEQ_LENS,
                                 q_len=q_len)
            want = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
            np.testing.assert_array_equal(want, oracle.select(c))
            rows, heads, k = want.shape
            for ascending in (False, True):
                for head_major in (False, True):
                    shape = (heads, rows + 4, k + 1) if head_major else (rows + 4, heads, k + 1)
                    buffer = torch.full(shape, POISON, dtype=torch.int32)
                    out = buffer[:, :rows, :k] if head_major else buffer[:rows, :, :k]
                    torch.ops.m3msa.index_decode(
                        t(c.index_q), t(c.index_cache), t(c.index_table), t(c.batch.seq_lens),
                        q_len, k,
                        cfg.init_blocks, cfg.local_blocks, ascending, head_major, out)
                    expect = np.array(want)
                    if ascending:
                        for answer in expect.reshape(-1, k):
                            valid = int((answer >= 0).sum())
                            answer[:valid] = np.sort(answer[:valid])
                    if head_major:
                        expect = expect.transpose(1, 0, 2)
                    label = f"q_len {q_len} ascending {ascending} head_major {head_major}"
                    np.testing.assert_array_equal(out.numpy(), expect, err_msg=label)
                    self.assertEqual(int((buffer == POISON).sum()), buffer.numel() - out.numel(),
                                     label)

    def test_index_prefill_matches_the_reference(self):
        cfg = small_config()
        c = oracle.make_case(cfg, np.random.default_rng(8), cu_seqlens=[0, 5, 5, 40],
                             context_lens=[30, 3, 100])
        want = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
        out = torch.full(want.shape, POISON, dtype=torch.int32)
        torch.ops.m3msa.index_prefill(t(c.index_q), t(c.index_cache), t(c.index_table),
                                      t(c.batch.cu_seqlens_q), t(c.batch.context_lens),
                                      cfg.topk, cfg.init_blocks, cfg.local_blocks, False, False,
                                      out)
        np.testing.assert_array_equal(out.numpy(), want)

    def test_attention_every_layout_and_a_head_major_selection(self):
        cfg = small_config()
        for q_len in (1, 2):
            c = shared_table_case(cfg, 20 + q_len, seq_lens=SEQ_LENS, q_len=q_len)
            topk = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
            want = m3msa.sparse_attention(cfg, c.q, c.kv_cache, c.batch, topk, threads=THREADS)
            self.assertBf16Close(m3msa.to_float32(want), oracle.attention(c, topk))
            dense = m3msa.dense_attention(cfg, c.q, c.kv_cache, c.batch, threads=THREADS)
            rows = topk.shape[0]
            # The selection kept head-major in a buffer of larger capacity, passed permuted.
            buffer = torch.full((cfg.kv_heads, rows + 3, cfg.topk), -1, dtype=torch.int32)
            buffer[:, :rows] = t(topk).permute(1, 0, 2)
            selection = buffer[:, :rows].permute(1, 0, 2)
            for layout in mtorch.KV_LAYOUTS:
                for chosen, expect in ((selection, want), (None, dense)):
                    out = torch.full(tuple(c.q.array.shape), float("nan"), dtype=torch.bfloat16)
                    torch.ops.m3msa.sparse_attn_decode(
                        t(c.q), kv_in_layout(c.kv_cache, layout), layout, chosen,
                        t(c.index_table), t(c.batch.seq_lens), q_len, 1.0, 1.0, out)
                    np.testing.assert_array_equal(
                        bits(out), np.asarray(expect.array),
                        err_msg=f"q_len {q_len} {layout} {'dense' if chosen is None else ''}")

    def test_attention_prefill_matches_the_reference(self):
        cfg = small_config()
        c = shared_table_case(cfg, 31, cu_seqlens=[0, 4, 20], context_lens=[60, 0])
        topk = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
        want = m3msa.sparse_attention(cfg, c.q, c.kv_cache, c.batch, topk, threads=THREADS)
        out = torch.empty(tuple(c.q.array.shape), dtype=torch.bfloat16)
        torch.ops.m3msa.sparse_attn_prefill(t(c.q), t(c.kv_cache), "ours", t(topk),
                                            t(c.index_table), t(c.batch.cu_seqlens_q),
                                            t(c.batch.context_lens), 1.0, 1.0, out)
        np.testing.assert_array_equal(bits(out), np.asarray(want.array))

    def test_refusals_name_the_argument(self):
        cfg = small_config()
        c = shared_table_case(cfg, 40, seq_lens=[20, 33])
        args = (t(c.q), kv_in_layout(c.kv_cache, "vllm"))
        out = torch.empty(tuple(c.q.array.shape), dtype=torch.bfloat16)
        rest = (None, t(c.index_table), t(c.batch.seq_lens), 1, 1.0, 1.0, out)
        with self.assertRaisesError("invalid_argument", "kv_layout"):
            torch.ops.m3msa.sparse_attn_decode(*args, "paged", *rest)
        with self.assertRaisesError("invalid_argument", "kv_cache (ours)"):
            torch.ops.m3msa.sparse_attn_decode(*args, "ours", *rest)  # a vllm cache as ours
        topk = torch.full((2, cfg.index_heads, cfg.topk), -1, dtype=torch.int32)
        with self.assertRaisesError("invalid_argument", "index_cache"):
            torch.ops.m3msa.index_decode(t(c.index_q), t(c.index_table), t(c.index_table),
                                         t(c.batch.seq_lens), 1, cfg.topk, 0, 1, False, False,
                                         topk)
        with self.assertRaisesError("invalid_argument", "batch.index_block_table"):
            torch.ops.m3msa.index_decode(t(c.index_q), t(c.index_cache), t(c.index_table),
                                         torch.tensor([20, 999], dtype=torch.int32), 1,
                                         cfg.topk, 0, 1, False, False, topk)

    def test_fake_implementations_check_shapes_and_run_nothing(self):
        meta = dict(device="meta")
        q = torch.empty((6, 4, 16), dtype=torch.bfloat16, **meta)
        kv = torch.empty((9, 2, 16, 2, 16), dtype=torch.bfloat16, **meta)
        table = torch.empty((3, 4), dtype=torch.int32, **meta)
        seq = torch.empty((3,), dtype=torch.int32, **meta)
        out = torch.empty((6, 4, 16), dtype=torch.bfloat16, **meta)
        topk = torch.empty((6, 2, 4), dtype=torch.int32, **meta)
        torch.ops.m3msa.sparse_attn_decode(q, kv, "vllm", topk, table, seq, 2, 1.0, 1.0, out)
        with self.assertRaisesError("invalid_argument", "out"):
            torch.ops.m3msa.sparse_attn_decode(q, kv, "vllm", topk, table, seq, 2, 1.0, 1.0,
                                               out[:5])
        index_q = torch.empty((6, 2, 16), dtype=torch.bfloat16, **meta)
        cache = torch.empty((9, 16, 16), dtype=torch.bfloat16, **meta)
        selection = torch.empty((2, 6, 4), dtype=torch.int32, **meta)
        torch.ops.m3msa.index_decode(index_q, cache, table, seq, 2, 4, 0, 1, False, True,
                                     selection)
        with self.assertRaisesError("invalid_argument", "out"):
            torch.ops.m3msa.index_decode(index_q, cache, table, seq, 2, 4, 0, 1, False, False,
                                         selection)

    @unittest.skipIf(compile_skip_reason(), compile_skip_reason())
    def test_compiles_with_fullgraph(self):
        cfg = small_config()
        c = shared_table_case(cfg, 50, seq_lens=SEQ_LENS, q_len=1)
        want_topk = m3msa.select_topk(cfg, c.index_q, c.index_cache, c.batch, threads=THREADS)
        want = m3msa.sparse_attention(cfg, c.q, c.kv_cache, c.batch, want_topk, threads=THREADS)

        def step(index_q, index_cache, q, kv, table, seq_lens):
            topk = torch.empty((index_q.shape[0], cfg.index_heads, cfg.topk), dtype=torch.int32)
            torch.ops.m3msa.index_decode(index_q, index_cache, table, seq_lens, 1, cfg.topk,
                                         cfg.init_blocks, cfg.local_blocks, False, False, topk)
            out = torch.empty_like(q)
            torch.ops.m3msa.sparse_attn_decode(q, kv, "ours", topk, table, seq_lens, 1, 1.0,
                                               1.0, out)
            return topk, out

        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        topk, out = compiled(t(c.index_q), t(c.index_cache), t(c.q), t(c.kv_cache),
                             t(c.index_table), t(c.batch.seq_lens))
        np.testing.assert_array_equal(topk.numpy(), want_topk)
        np.testing.assert_array_equal(bits(out), np.asarray(want.array))


@requires_cuda
class CudaTorchOpsTest(CudaTestCase):
    def test_decode_ops_match_the_cpu_and_replay_in_a_graph(self):
        cfg = gpu_config()
        case = GpuCase(cfg, num_reqs=6, q_len=1, max_context=3000, seed=7)
        h = case.host
        want = m3msa.select_topk(cfg, h.index_q, h.index_cache, h.batch, threads=THREADS)
        table = case.batch.index_block_table
        seq_lens = case.batch.seq_lens
        rows = h.batch.num_rows
        buffer = torch.full((cfg.index_heads, rows + 2, cfg.topk), POISON, dtype=torch.int32,
                            device="cuda")
        topk = buffer[:, :rows]
        out = torch.empty_like(case.q)

        def step():
            torch.ops.m3msa.index_decode(case.index_q, case.index_cache, table, seq_lens, 1,
                                         cfg.topk, cfg.init_blocks, cfg.local_blocks, False,
                                         True, topk)
            torch.ops.m3msa.sparse_attn_decode(case.q, case.kv_cache, "ours",
                                               topk.permute(1, 0, 2), case.batch.kv_block_table,
                                               seq_lens, 1, case.k_scale, case.v_scale, out)

        step()  # eager: creates the plan
        torch.cuda.synchronize()
        eager_topk, eager_out = topk.clone(), out.clone()
        self.assertTrue((buffer[:, rows:] == POISON).all().item())
        gpu = eager_topk.permute(1, 0, 2).cpu().numpy()
        scores = m3msa.score_blocks(cfg, h.index_q, h.index_cache, h.batch, threads=THREADS)
        self.assertSelectionNearTie(case, gpu, want, scores)
        self.assertTrue(len(mtorch.plans()) >= 1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        topk.fill_(-7)
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(topk, eager_topk))
        self.assertTrue(torch.equal(out, eager_out))

    def test_a_capture_without_a_plan_is_refused_by_name(self):
        cfg = gpu_config(topk=4)
        case = GpuCase(cfg, num_reqs=200, q_len=1, max_context=600, seed=9)
        mtorch.clear_plans()
        out = torch.empty((case.host.batch.num_rows, cfg.index_heads, cfg.topk),
                          dtype=torch.int32, device="cuda")
        graph = torch.cuda.CUDAGraph()
        with self.assertRaisesError("invalid_argument", "outside the capture"):
            with torch.cuda.graph(graph):
                torch.ops.m3msa.index_decode(case.index_q, case.index_cache,
                                             case.batch.index_block_table, case.batch.seq_lens,
                                             1, cfg.topk, cfg.init_blocks, cfg.local_blocks,
                                             False, False, out)


if __name__ == "__main__":
    unittest.main()
