"""The CUDA context-parallel indexer from Python (m3msa.CudaCpIndexer): every transport's
selection is bit-identical to select_topk on one GPU, also replayed from a CUDA graph; with two
GPUs, two processes (one rank each, NCCL bootstrap from the environment) agree with one GPU too.
Skips without torch or a GPU."""

import json
import os
import socket
import subprocess
import sys
import unittest

import m3msa
from cuda_common import CudaTestCase, GpuCase, gpu_config, requires_cuda, torch

HERE = os.path.dirname(os.path.abspath(__file__))

# Cases: (q_len, index dtype, spec). max_reqs / max_q_len / max_context below cover them all.
CASES = [
    (1, "bf16", dict(num_reqs=1, seq_lens=[1])),                       # fewer blocks than ranks
    (1, "fp8", dict(num_reqs=3, seq_lens=[100, 129, 257])),
    (4, "bf16", dict(num_reqs=6, min_context=4, max_context=30000, padding_reqs=2)),
    (2, "fp8", dict(num_reqs=8, min_context=1000, max_context=60000)),
]
LIMITS = dict(max_reqs=8, max_q_len=4, max_context=60000 + 128)


def case_for(cfg, q_len, index_dtype, spec, seed):
    """A decode case on torch's current device (no KV cache: the indexer does not read it)."""
    return GpuCase(cfg, kind="decode", q_len=q_len, index_dtype=index_dtype, seed=seed,
                   make_kv_cache=False, **spec)


@requires_cuda
class CudaCpTest(CudaTestCase):
    def check_transport(self, transport, world):
        cfg = gpu_config(index_heads=2, kv_heads=2)
        indexer = m3msa.CudaCpIndexer(cfg, transport=transport, world=world, **LIMITS)
        self.assertEqual((indexer.world_size, indexer.rank), (1, 0))
        self.assertEqual(indexer.merged_heads, [0, 1])
        for seed, (q_len, index_dtype, spec) in enumerate(CASES, 1):
            case = case_for(cfg, q_len, index_dtype, spec, seed)
            expected = m3msa.select_topk(cfg, case.index_q, case.index_cache, case.batch)
            for layer in range(2):  # both buffer parities
                got = indexer.select(case.index_q, case.index_cache, case.batch, layer=layer)
                indexer.check()
                self.assertTrue(torch.equal(got, expected),
                                f"{transport}: case {seed} layer {layer} differs from one GPU")
        if transport == "peer":  # calls made on the buffer set (the tag of the next call)
            self.assertEqual(indexer.generation(), 2 * len(CASES))
        indexer.close()
        with self.assertRaisesError("invalid_argument", "closed"):
            indexer.select(case.index_q, case.index_cache, case.batch)

    def test_peer_and_replicated_one_rank(self):
        for transport in ("peer", "replicated"):
            with self.subTest(transport=transport):
                self.check_transport(transport, "single")

    def test_nccl_transports_one_rank(self):
        for transport in ("nccl", "allreduce-max"):
            with self.subTest(transport=transport):
                self.check_transport(transport, "env")

    def test_graph_replay(self):
        cfg = gpu_config()
        indexer = m3msa.CudaCpIndexer(cfg, transport="peer", world="single", **LIMITS)
        static = case_for(cfg, 2, "bf16", dict(num_reqs=5, min_context=2, max_context=9000), 1)
        out = torch.empty(static.batch.num_rows, 2, cfg.topk, dtype=torch.int32, device="cuda")
        indexer.select(static.index_q, static.index_cache, static.batch, out)  # warm-up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            indexer.select(static.index_q, static.index_cache, static.batch, out)
        longest = static.batch.seq_lens.clone()
        gen = torch.Generator(device="cuda").manual_seed(5)
        for replay in range(4):
            # New metadata and values of the same host shapes: shorter contexts (the tables still
            # cover them), shuffled cache pages, fresh queries.
            lengths = (torch.rand(longest.shape, generator=gen, device="cuda") * longest).int()
            static.batch.seq_lens.copy_(torch.maximum(lengths, torch.full_like(lengths, 2)))
            pages = torch.randperm(static.index_cache.shape[0], generator=gen, device="cuda")
            static.index_cache.copy_(static.index_cache[pages])
            static.index_q.copy_(torch.randn(static.index_q.shape, generator=gen,
                                             device="cuda").bfloat16())
            out.fill_(-7)
            graph.replay()
            indexer.check()
            expected = m3msa.select_topk(cfg, static.index_q, static.index_cache, static.batch)
            self.assertTrue(torch.equal(out, expected), f"replay {replay}")

    def test_errors(self):
        cfg = gpu_config()
        with self.assertRaisesError("invalid_argument", "world"):
            m3msa.CudaCpIndexer(cfg, world="threads", **LIMITS)
        with self.assertRaisesError("invalid_argument", "transport"):
            m3msa.CudaCpIndexer(cfg, transport="carrier-pigeon", world="single", **LIMITS)
        indexer = m3msa.CudaCpIndexer(cfg, transport="peer", world="single", **LIMITS)
        case = case_for(cfg, 1, "bf16", dict(num_reqs=2, seq_lens=[300, 40]), 3)
        with self.assertRaisesError("invalid_argument", "index_cache", "cpu"):
            indexer.select(case.index_q, case.index_cache.cpu(), case.batch)
        big = case_for(cfg, 1, "bf16", dict(num_reqs=9, max_context=500), 4)
        with self.assertRaisesError("invalid_argument", "max_reqs"):
            indexer.select(big.index_q, big.index_cache, big.batch)


# One rank of the two-process test: argv = [tests dir, transport]; prints one JSON line.
CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import m3msa, torch
from cuda_common import GpuCase, gpu_config
from test_cuda_cp import CASES, LIMITS, case_for
cfg = gpu_config()
indexer = m3msa.CudaCpIndexer(cfg, transport=sys.argv[2], world="env", **LIMITS)
torch.cuda.set_device(indexer.device)
bad = []
for seed, (q_len, dtype, spec) in enumerate(CASES, 1):
    case = case_for(cfg, q_len, dtype, spec, seed)
    full = m3msa.select_topk(cfg, case.index_q, case.index_cache, case.batch)
    for layer in range(2):
        got = indexer.select(case.index_q, case.index_cache, case.batch, layer=layer)
        indexer.check()
        if not torch.equal(got, full[:, indexer.merged_heads]):
            bad.append([seed, layer])
result = dict(rank=indexer.rank, device=indexer.device, heads=indexer.merged_heads, bad=bad)
indexer.close()  # collective across the processes: both ranks get here
print(json.dumps(result))
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@requires_cuda
class CudaCpTwoProcessTest(CudaTestCase):
    def setUp(self):
        if torch.cuda.device_count() < 2:
            self.skipTest("needs two GPUs")

    def test_two_processes_equal_one_gpu(self):
        # The peer transport across processes (CUDA IPC) is left out: it is known to stall;
        # nccl and replicated cover the process-per-rank bootstrap from Python.
        for transport in ("nccl", "replicated"):
            with self.subTest(transport=transport):
                port = str(free_port())
                procs = []
                for rank in range(2):
                    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                    procs.append(subprocess.Popen(
                        [sys.executable, "-c", CHILD, HERE, transport], env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
                results = []
                for proc in procs:
                    try:
                        out, err = proc.communicate(timeout=240)
                    except subprocess.TimeoutExpired:
                        for p in procs:
                            p.kill()
                        self.fail(f"{transport}: a rank did not finish in 240 s")
                    self.assertEqual(proc.returncode, 0, f"{transport}: {err[-2000:]}")
                    results.append(json.loads(out.strip().splitlines()[-1]))
                self.assertEqual(sorted(r["rank"] for r in results), [0, 1])
                self.assertEqual(sorted(h for r in results for h in r["heads"]), [0, 1])
                for r in results:
                    self.assertEqual(r["bad"], [], f"{transport} rank {r['rank']}")


if __name__ == "__main__":
    unittest.main()
