"""The runtime from Python (CPU backend): the lifecycle and its refusals, forward_layer against the
documented numerics composed from the tested ops (preprocess, select_topk, sparse_attention) and
NumPy matmuls / norms, and two ranks as Python threads over a ThreadGroup."""

import threading
import unittest

import numpy as np

import m3msa
import oracle
from common import THREADS, TestCase

MODEL = dict(hidden=64, num_layers=3, first_sparse_layer=1, q_heads=4, kv_heads=2, head_dim=16,
             index_heads=2, index_dim=16, block_size=16, topk=4, rope_dim=8, rope_theta=10000.0)
SPARSE_LAYERS = (1, 2)
PAGES = 40


def runtime_config(intermediate=0, **overrides):
    model = m3msa.ModelConfig(**MODEL, intermediate=intermediate)
    options = dict(model=model, token_buckets=[1, 2, 4, 8], query_lens=[1, 2, 4], max_requests=4,
                   max_context=512, threads=THREADS)
    options.update(overrides)
    return m3msa.RuntimeConfig(**options)


def bf16(values):
    """float -> bf16 values (float32), round to nearest even."""
    return oracle.bf16_round(values).astype(np.float32)


class Model:
    """Seeded weights and caches of the sparse layers (TP = 1), as m3msa.LayerWeights."""

    def __init__(self, rng, intermediate=0, dims=None, pages=PAGES):
        dims = MODEL if dims is None else dims
        self.model = m3msa.ModelConfig(**dims, intermediate=intermediate)
        sc = self.sc = self.model.sparse(1)
        hidden = dims["hidden"]

        def weight(*shape, scale=1.0):
            return m3msa.as_bf16(rng.standard_normal(shape) * scale)

        self.layers = []
        for layer in SPARSE_LAYERS:
            mlp = {}
            if intermediate:
                mlp = dict(mlp_gate_up=weight(2 * intermediate, hidden, scale=hidden ** -0.5),
                           mlp_down=weight(hidden, intermediate, scale=intermediate ** -0.5))
            self.layers.append(m3msa.LayerWeights(
                layer, qkv_proj=weight(sc.qkv_width, hidden, scale=hidden ** -0.5),
                q_norm=weight(sc.head_dim, scale=0.2), k_norm=weight(sc.head_dim, scale=0.2),
                index_q_norm=weight(sc.index_dim, scale=0.2),
                index_k_norm=weight(sc.index_dim, scale=0.2),
                input_norm=weight(hidden, scale=0.2), post_attention_norm=weight(hidden, scale=0.2),
                o_proj=weight(hidden, sc.q_heads * sc.head_dim, scale=0.1),
                kv_cache=weight(pages, sc.kv_heads, 2, sc.block_size, sc.head_dim),
                index_cache=weight(pages, sc.block_size, sc.index_dim), **mlp))


def decode_step(rng, seq_lens, q_len, block_size=16, pages=PAGES):
    """A decode batch over random page tables, with the slots of its new tokens."""
    reqs = len(seq_lens)
    width = max(1, max(-(-n // block_size) for n in seq_lens))
    index_table = rng.permutation(pages)[:reqs * width].reshape(reqs, width).astype(np.int32)
    kv_table = rng.permutation(pages)[:reqs * width].reshape(reqs, width).astype(np.int32)
    positions, slots, index_slots = [], [], []
    for req, n in enumerate(seq_lens):
        for j in range(q_len):
            pos = n - q_len + j if n > 0 else -1
            positions.append(pos)
            slots.append(kv_table[req, pos // block_size] * block_size + pos % block_size
                         if pos >= 0 else -1)
            index_slots.append(index_table[req, pos // block_size] * block_size
                               + pos % block_size if pos >= 0 else -1)
    batch = m3msa.Batch.decode(np.array(seq_lens, np.int32), index_table, kv_table, q_len=q_len,
                               slot_mapping=np.array(slots, np.int64),
                               index_slot_mapping=np.array(index_slots, np.int64))
    return batch, np.array(positions, np.int64)


def gemma_rms_norm(x, weight, eps):
    x = np.asarray(x, np.float32)
    rms = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True, dtype=np.float32) + np.float32(eps))
    return x * rms * (np.float32(1.0) + weight)


def oracle_layer(model, w, kv_cache, index_cache, batch, positions, hidden, residual,
                 swiglu_limit=7.0):
    """runtime.h's numerics from the ops: returns (hidden, residual) as float32 bf16 values and
    writes the caches (copies) like the layer does."""
    sc = model.sparse(1)
    rows = hidden.shape[0]
    f = lambda t: oracle.bf16_decode(t.array).astype(np.float64)  # noqa: E731
    x = bf16(hidden.astype(np.float32) + residual.astype(np.float32))
    h = bf16(gemma_rms_norm(x, oracle.bf16_decode(w.input_norm.array), sc.rms_eps))
    qkv = bf16(h.astype(np.float64) @ f(w.qkv_proj).T)
    q, index_q = m3msa.preprocess(sc, m3msa.as_bf16(qkv), w.q_norm, w.k_norm, w.index_q_norm,
                                  w.index_k_norm, positions, batch, kv_cache, index_cache,
                                  threads=THREADS)
    topk = m3msa.select_topk(sc, index_q, index_cache, batch, threads=THREADS)
    a = m3msa.sparse_attention(sc, q, kv_cache, batch, topk, threads=THREADS)
    o = bf16(f(a).reshape(rows, -1) @ f(w.o_proj).T)
    x2 = bf16(x + o)
    h2 = bf16(gemma_rms_norm(x2, oracle.bf16_decode(w.post_attention_norm.array), sc.rms_eps))
    if w.mlp_gate_up is None:
        return h2, x2
    gate_up = bf16(h2.astype(np.float64) @ f(w.mlp_gate_up).T)
    gate, up = np.split(gate_up, 2, axis=1)
    gate = np.minimum(gate, swiglu_limit)
    up = np.clip(up, -swiglu_limit, swiglu_limit)
    act = bf16(gate / (1.0 + np.exp(-1.702 * gate)) * (up + 1.0))
    return bf16(act.astype(np.float64) @ f(w.mlp_down).T), x2


def copy_caches(layer):
    return (m3msa.view(np.asarray(layer.kv_cache.array).copy(), "bf16"),
            m3msa.view(np.asarray(layer.index_cache.array).copy(), "bf16"))


class RuntimeTest(TestCase):
    def test_lifecycle_and_refusals(self):
        rng = np.random.default_rng(1)
        model = Model(rng)
        lines = []
        runtime = m3msa.Runtime(log=lines.append)
        self.assertEqual(runtime.state, "idle")
        config = runtime_config()
        self.assertEqual(runtime.prepare(model.layers, config, has_metadata=False), "skipped")
        with self.assertRaisesError("invalid_argument", "capturing"):
            runtime.prepare(model.layers, config, capturing=True)
        self.assertEqual(runtime.prepare(model.layers, config), "active")
        self.assertEqual(runtime.state, "active")
        batch, _ = decode_step(rng, [40, 17], 2)
        prefill = m3msa.Batch.prefill([0, 3], [5], batch.index_block_table[:1],
                                      batch.kv_block_table[:1])
        self.assertFalse(runtime.begin_step(prefill))
        self.assertFalse(runtime.begin_step(decode_step(rng, [40, 17], 3)[0]))  # q_len 3
        self.assertFalse(runtime.begin_step(decode_step(rng, [40] * 5, 1)[0]))  # 5 requests
        self.assertTrue(runtime.begin_step(batch))
        stats = runtime.stats()
        self.assertEqual(stats["state"], "active")
        self.assertEqual(stats["steps_accepted"], 1)
        self.assertEqual(stats["refusals"]["prefill or mixed batch"], 1)
        self.assertEqual(sum(stats["refusals"].values()), 3)
        hidden = np.zeros((4, 64), np.uint16)
        with self.assertRaisesError("invalid_argument", "hidden"):
            runtime.forward_layer(1, m3msa.view(np.zeros((3, 64), np.uint16), "bf16"),
                                  m3msa.view(hidden.copy(), "bf16"), np.zeros(4, np.int64))
        runtime.close()
        self.assertEqual(runtime.state, "closed")
        runtime.close()  # idempotent
        self.assertFalse(runtime.begin_step(batch))

    def test_forward_layer_matches_the_composed_ops(self):
        for intermediate in (0, 32):
            with self.subTest(mlp=bool(intermediate)):
                self.check_forward(intermediate)

    def check_forward(self, intermediate):
        rng = np.random.default_rng(2 + intermediate)
        model = Model(rng, intermediate)
        runtime = m3msa.Runtime()
        self.assertEqual(runtime.prepare(model.layers, runtime_config(intermediate)), "active")
        for step, (seq_lens, q_len) in enumerate((([40, 17, 100], 2), ([41, 18, 101], 1))):
            batch, positions = decode_step(np.random.default_rng(step), seq_lens, q_len)
            rows = batch.num_rows
            hidden = m3msa.as_bf16(rng.standard_normal((rows, 64)))
            residual = m3msa.as_bf16(rng.standard_normal((rows, 64)) * 0.5)
            self.assertTrue(runtime.begin_step(batch))
            for layer in model.layers:
                # The oracle starts from exactly what the runtime is handed: inputs and caches.
                inputs = (oracle.bf16_decode(hidden.array), oracle.bf16_decode(residual.array))
                kv, index = copy_caches(layer)
                runtime.forward_layer(layer.layer, hidden, residual, positions)
                want_h, want_r = oracle_layer(model.model, layer, kv, index, batch, positions,
                                              *inputs)
                where = f"step {step} layer {layer.layer}"
                for got, want, name in ((residual, want_r, "residual"), (hidden, want_h, "hidden"),
                                        (layer.kv_cache, kv, "kv cache"),
                                        (layer.index_cache, index, "index cache")):
                    want = want if isinstance(want, np.ndarray) else oracle.bf16_decode(want.array)
                    ok, message = oracle.bf16_close(oracle.bf16_decode(got.array), want, ulps=2.0,
                                                    floor=2.0 ** -8)
                    self.assertTrue(ok, f"{where} {name}: {message}")
        self.assertEqual(runtime.stats()["layers_run"], 4)
        runtime.close()

    def test_mixture_of_experts(self):
        # bf16 experts (E 4, top-2, width 32, one shared) on both sparse layers: forward_layer
        # against the MoE of docs/spec.md section 8 composed in NumPy (g, u and the activation
        # rounded to bf16 where the spec rounds); a wrong expert shape is refused by name.
        rng = np.random.default_rng(7)
        moe = dict(num_experts=4, experts_per_token=2, moe_intermediate=32, shared_experts=1)
        model = Model(rng)
        for key, value in moe.items():
            setattr(model.model, key, value)
        hidden_size, inter = 64, 32
        for layer in model.layers:
            layer.router_weight = (rng.standard_normal((4, hidden_size)) * 0.3).astype(np.float32)
            layer.router_bias = (rng.standard_normal(4) * 0.05).astype(np.float32)
            layer.experts_w13 = m3msa.as_bf16(rng.standard_normal((4, 2 * inter, hidden_size))
                                              * hidden_size ** -0.5)
            layer.experts_w2 = m3msa.as_bf16(rng.standard_normal((4, hidden_size, inter))
                                             * inter ** -0.5)
            layer.shared_w13 = m3msa.as_bf16(rng.standard_normal((2 * inter, hidden_size))
                                             * hidden_size ** -0.5)
            layer.shared_w2 = m3msa.as_bf16(rng.standard_normal((hidden_size, inter))
                                            * inter ** -0.5)
        config = runtime_config(model=model.model)
        runtime = m3msa.Runtime()
        self.assertEqual(runtime.prepare(model.layers, config), "active")
        batch, positions = decode_step(np.random.default_rng(8), [40, 17], 2)
        rows = batch.num_rows
        hidden = m3msa.as_bf16(rng.standard_normal((rows, 64)))
        residual = m3msa.as_bf16(rng.standard_normal((rows, 64)) * 0.5)
        self.assertTrue(runtime.begin_step(batch))
        f = lambda t: oracle.bf16_decode(t.array).astype(np.float64)  # noqa: E731
        for layer in model.layers:
            inputs = (oracle.bf16_decode(hidden.array), oracle.bf16_decode(residual.array))
            kv, index = copy_caches(layer)
            runtime.forward_layer(layer.layer, hidden, residual, positions)
            h2, _ = oracle_layer(model.model, layer, kv, index, batch, positions, *inputs)
            x = h2.astype(np.float64)
            s = 1.0 / (1.0 + np.exp(-(x @ layer.router_weight.astype(np.float64).T)))
            keys = s + layer.router_bias
            want = np.zeros_like(x)
            for r in range(rows):
                picked = np.argsort(-keys[r], kind="stable")[:2]
                weights = 2.0 * s[r, picked] / s[r, picked].sum()
                sets = [(f(layer.experts_w13)[e], f(layer.experts_w2)[e], w)
                        for e, w in zip(picked, weights)]
                sets.append((f(layer.shared_w13), f(layer.shared_w2), 1.0))
                for w13, w2, weight in sets:
                    g = np.minimum(bf16(w13[:inter] @ x[r]), 7.0)
                    u = np.clip(bf16(w13[inter:] @ x[r]), -7.0, 7.0)
                    act = bf16(g / (1.0 + np.exp(-1.702 * g)) * (u + 1.0)).astype(np.float64)
                    want[r] += weight * (w2 @ act)
            ok, message = oracle.bf16_close(oracle.bf16_decode(hidden.array), bf16(want),
                                            ulps=4.0, floor=2.0 ** -6)
            self.assertTrue(ok, f"layer {layer.layer} MoE output: {message}")
        runtime.close()
        bad = Model(np.random.default_rng(9)).layers
        for layer, good in zip(bad, model.layers):
            for name in ("router_weight", "router_bias", "experts_w13", "experts_w2",
                         "shared_w13", "shared_w2"):
                setattr(layer, name, getattr(good, name))
        bad[0].experts_w13 = m3msa.as_bf16(np.zeros((4, 2 * inter - 1, hidden_size)))
        with self.assertRaisesError("invalid_argument", "experts.w13"):
            m3msa.Runtime().prepare(bad, config)

    def test_dense_layer(self):
        # Layer 0 bound as a dense layer (qkv_proj [q | k | v], no index part, a bf16 dense MLP of
        # width 32) before the sparse layers: forward_layer(0) against dense attention and the
        # MLP composed from the ops and NumPy; a dense layer with an index cache is refused by name.
        rng = np.random.default_rng(10)
        model = Model(rng)
        model.model.dense_intermediate = 32
        sc, hidden_size, inter = model.sc, 64, 32
        width = (sc.q_heads + 2 * sc.kv_heads) * sc.head_dim

        def weight(*shape, scale=1.0):
            return m3msa.as_bf16(rng.standard_normal(shape) * scale)

        dense = m3msa.LayerWeights(
            0, qkv_proj=weight(width, hidden_size, scale=hidden_size ** -0.5),
            q_norm=weight(sc.head_dim, scale=0.2), k_norm=weight(sc.head_dim, scale=0.2),
            input_norm=weight(hidden_size, scale=0.2),
            post_attention_norm=weight(hidden_size, scale=0.2),
            o_proj=weight(hidden_size, sc.q_heads * sc.head_dim, scale=0.1),
            kv_cache=weight(PAGES, sc.kv_heads, 2, sc.block_size, sc.head_dim),
            dense_w13=weight(2 * inter, hidden_size, scale=hidden_size ** -0.5),
            dense_w2=weight(hidden_size, inter, scale=inter ** -0.5))
        config = runtime_config(model=model.model)
        runtime = m3msa.Runtime()
        self.assertEqual(runtime.prepare([dense] + model.layers, config), "active")
        self.assertEqual(runtime.stats()["bound_layers"], [0, 1, 2])
        batch, positions = decode_step(np.random.default_rng(11), [40, 17], 2)
        rows = batch.num_rows
        hidden = m3msa.as_bf16(rng.standard_normal((rows, 64)))
        residual = m3msa.as_bf16(rng.standard_normal((rows, 64)) * 0.5)
        self.assertTrue(runtime.begin_step(batch))
        inputs = (oracle.bf16_decode(hidden.array), oracle.bf16_decode(residual.array))
        kv = m3msa.view(np.asarray(dense.kv_cache.array).copy(), "bf16")
        runtime.forward_layer(0, hidden, residual, positions)
        f = lambda t: oracle.bf16_decode(t.array).astype(np.float64)  # noqa: E731
        x = bf16(inputs[0].astype(np.float32) + inputs[1].astype(np.float32))
        h = bf16(gemma_rms_norm(x, oracle.bf16_decode(dense.input_norm.array), sc.rms_eps))
        # The ops take the sparse layout: zero index columns, index results thrown away.
        qkv = np.zeros((rows, sc.qkv_width), np.float32)
        qkv[:, :width] = bf16(h.astype(np.float64) @ f(dense.qkv_proj).T)
        scratch = m3msa.as_bf16(np.zeros((PAGES, sc.block_size, sc.index_dim)))
        norm = m3msa.as_bf16(np.zeros(sc.index_dim))
        q, _ = m3msa.preprocess(sc, m3msa.as_bf16(qkv), dense.q_norm, dense.k_norm, norm, norm,
                                positions, batch, kv, scratch, threads=THREADS)
        a = m3msa.dense_attention(sc, q, kv, batch, threads=THREADS)
        x2 = bf16(x + bf16(f(a).reshape(rows, -1) @ f(dense.o_proj).T))
        h2 = bf16(gemma_rms_norm(x2, oracle.bf16_decode(dense.post_attention_norm.array),
                                 sc.rms_eps)).astype(np.float64)
        w13 = f(dense.dense_w13)
        g = np.minimum(bf16(h2 @ w13[:inter].T), 7.0)
        u = np.clip(bf16(h2 @ w13[inter:].T), -7.0, 7.0)
        act = bf16(g / (1.0 + np.exp(-1.702 * g)) * (u + 1.0)).astype(np.float64)
        for got, want, name in ((residual, x2, "residual"),
                                (hidden, bf16(act @ f(dense.dense_w2).T), "dense MLP output"),
                                (dense.kv_cache, oracle.bf16_decode(kv.array), "kv cache")):
            ok, message = oracle.bf16_close(oracle.bf16_decode(got.array), want, ulps=4.0,
                                            floor=2.0 ** -6)
            self.assertTrue(ok, f"layer 0 {name}: {message}")
        for layer in model.layers:
            runtime.forward_layer(layer.layer, hidden, residual, positions)
        self.assertEqual(runtime.stats()["layers_run"], 3)
        runtime.close()
        dense.index_cache = model.layers[0].index_cache
        with self.assertRaisesError("invalid_argument", "layer 0 index_cache"):
            m3msa.Runtime().prepare([dense] + model.layers, config)

    def test_two_ranks_as_threads(self):
        # pipeline_parallel_size 2 is unsupported on every rank: both fall back together (the
        # outcome is agreed through the group), each Python thread driving one rank.
        group = m3msa.ThreadGroup(2, timeout_ms=20_000)
        rng = np.random.default_rng(3)
        results, errors = [None, None], [None, None]
        models = [Model(rng), Model(rng)]

        def rank(r):
            try:
                runtime = m3msa.Runtime(log=lambda line: None)
                config = runtime_config(pipeline_parallel_size=2)
                results[r] = (runtime.prepare(models[r].layers, config, group.communicator(r)),
                              runtime.stats())
                runtime.close()
            except Exception as error:  # noqa: BLE001 (reported below)
                errors[r] = error

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        self.assertEqual(errors, [None, None])
        for outcome, stats in results:
            self.assertEqual(outcome, "fallback")
            self.assertTrue(any("pipeline" in reason for reason in stats["fallback_reasons"]))
        self.assertFalse(group.broken)

    def test_bad_arguments(self):
        runtime = m3msa.Runtime()
        with self.assertRaisesError("invalid_argument", "config"):
            runtime.prepare([], {"max_requests": 4})
        with self.assertRaisesError("invalid_argument", "layers"):
            runtime.prepare([{"layer": 1}], runtime_config())
        layer = Model(np.random.default_rng(4)).layers[0]
        layer.q_norm = m3msa.as_bf16(np.zeros(15))
        with self.assertRaisesError("invalid_argument", "q_norm"):
            runtime.prepare([layer, Model(np.random.default_rng(5)).layers[1]], runtime_config())
        with self.assertRaisesError("invalid_argument", "tp_allreduce"):
            runtime_config(tp_allreduce="ring")
        with self.assertRaisesError("invalid_argument", "transport"):
            runtime_config(cp_transport="smoke-signals")

    def test_context_parallel_and_sharing_options(self):
        config = runtime_config(context_parallel=True, cp_transport="nccl",
                                selection_share_period=2, tp_allreduce="peer")
        self.assertTrue(config.context_parallel)
        self.assertEqual(config.cp_transport, "nccl")
        self.assertEqual(config.selection_share_period, 2)
        self.assertEqual(config.tp_allreduce, "peer")
        self.assertEqual(runtime_config().tp_allreduce, "auto")
        self.assertEqual(runtime_config().indexer_overlap, "auto")
        self.assertEqual(runtime_config(indexer_overlap="on").indexer_overlap, "on")
        with self.assertRaisesError("invalid_argument", "indexer_overlap"):
            runtime_config(indexer_overlap="sometimes")
        # The CP view of a rank keeps every index head.
        model = m3msa.ModelConfig(**MODEL)
        self.assertEqual(model.sparse(2, context_parallel=True).index_heads, MODEL["index_heads"])
        self.assertEqual(model.sparse(2).index_heads, MODEL["index_heads"] // 2)


if __name__ == "__main__":
    unittest.main()
