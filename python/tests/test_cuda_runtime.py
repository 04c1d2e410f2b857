"""The runtime on the GPU from Python (the CUDA backend of runtime.h): forward_layer on
torch tensors equals the CPU runtime within a few bf16 ulps, and a torch.cuda.CUDAGraph of the
layers captured on the runtime's stream replays new steps bit-identically to eager calls. Skips
without torch or a GPU. A failure here is in the runtime's GPU path or in this binding."""

import unittest

import numpy as np

import m3msa
import oracle
from cuda_common import CudaTestCase, batch_to, requires_cuda, to_numpy_bits, to_torch, torch
from test_runtime import SPARSE_LAYERS, Model, decode_step

DIMS = dict(hidden=256, num_layers=3, first_sparse_layer=1, q_heads=8, kv_heads=2, head_dim=128,
            index_heads=2, index_dim=128, block_size=128, topk=4, rope_dim=64,
            rope_theta=10000.0)
PAGES = 48  # >= requests x blocks of the widest step (3 x 12)
STEPS = [([700, 129, 1500], 2), ([701, 130, 1501], 2), ([200, 900], 4)]


def config():
    return m3msa.RuntimeConfig(model=m3msa.ModelConfig(**DIMS), token_buckets=[1, 2, 4, 8, 16],
                               query_lens=[1, 2, 4], max_requests=4, max_context=4096, threads=8)


def on_gpu(layer):
    fields = {name: to_torch(getattr(layer, name)) for name in m3msa.LayerWeights.__slots__
              if name not in ("layer", "k_scale", "v_scale")}
    return m3msa.LayerWeights(layer.layer, k_scale=layer.k_scale, v_scale=layer.v_scale,
                              **fields)


@requires_cuda
class CudaRuntimeTest(CudaTestCase):
    def setUp(self):
        self.model = Model(np.random.default_rng(7), dims=DIMS, pages=PAGES)
        self.gpu_layers = [on_gpu(layer) for layer in self.model.layers]
        self.stream = torch.cuda.Stream()
        self.runtime = m3msa.Runtime(log=lambda line: None)
        self.assertEqual(self.runtime.prepare(self.gpu_layers, config(), stream=self.stream),
                         "active")

    def tearDown(self):
        self.runtime.close()

    def step(self, seed, seq_lens, q_len):
        rng = np.random.default_rng(100 + seed)
        batch, positions = decode_step(rng, seq_lens, q_len, block_size=128, pages=PAGES)
        hidden = m3msa.as_bf16(rng.standard_normal((batch.num_rows, DIMS["hidden"])))
        residual = m3msa.as_bf16(rng.standard_normal((batch.num_rows, DIMS["hidden"])) * 0.5)
        return batch, positions, hidden, residual

    def test_forward_layer_equals_the_cpu_runtime(self):
        cpu = m3msa.Runtime(log=lambda line: None)
        self.assertEqual(cpu.prepare(self.model.layers, config()), "active")
        for seed, (seq_lens, q_len) in enumerate(STEPS):
            batch, positions, hidden, residual = self.step(seed, seq_lens, q_len)
            gpu_hidden, gpu_residual = to_torch(hidden), to_torch(residual)
            self.assertTrue(cpu.begin_step(batch))
            with torch.cuda.stream(self.stream):
                self.assertTrue(self.runtime.begin_step(batch_to(batch)))
                for layer in SPARSE_LAYERS:
                    self.runtime.forward_layer(layer, gpu_hidden, gpu_residual,
                                               to_torch(positions))
            for layer in SPARSE_LAYERS:
                cpu.forward_layer(layer, hidden, residual, positions)
            self.stream.synchronize()
            for got, want, name in ((gpu_hidden, hidden, "hidden"),
                                    (gpu_residual, residual, "residual")):
                ok, message = oracle.bf16_close(oracle.bf16_decode(to_numpy_bits(got)),
                                                oracle.bf16_decode(want.array), ulps=4.0,
                                                floor=2.0 ** -6)
                self.assertTrue(ok, f"step {seed} {name}: {message}")
        cpu.close()

    def test_graph_of_the_layers_replays_new_steps(self):
        batch, positions, hidden, residual = self.step(0, *STEPS[0])
        static = [to_torch(hidden), to_torch(residual), to_torch(positions)]
        with torch.cuda.stream(self.stream):
            self.assertTrue(self.runtime.begin_step(batch_to(batch)))
            for layer in SPARSE_LAYERS:  # warm-up
                self.runtime.forward_layer(layer, *static)
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):
            for layer in SPARSE_LAYERS:
                self.runtime.forward_layer(layer, *static)
        for seed in (1, 2):
            seq_lens = [n + 7 * seed for n in STEPS[0][0]]
            batch, positions, hidden, residual = self.step(seed, seq_lens, STEPS[0][1])
            inputs = [to_torch(hidden), to_torch(residual), to_torch(positions)]
            with torch.cuda.stream(self.stream):
                self.assertTrue(self.runtime.begin_step(batch_to(batch)))
                for buffer, value in zip(static, inputs):
                    buffer.copy_(value)
                graph.replay()
                replayed = [static[0].clone(), static[1].clone()]
                for buffer, value in zip(static, inputs):  # the same step again, eagerly
                    buffer.copy_(value)
                for layer in SPARSE_LAYERS:
                    self.runtime.forward_layer(layer, *static)
            self.stream.synchronize()
            for got, want, name in ((replayed[0], static[0], "hidden"),
                                    (replayed[1], static[1], "residual")):
                self.assertTrue(torch.equal(got.view(torch.int16), want.view(torch.int16)),
                                f"step {seed}: replayed {name} differs from eager")


if __name__ == "__main__":
    unittest.main()
