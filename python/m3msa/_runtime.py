"""The fused decode runtime (include/m3msa/runtime.h, docs/runtime.md) from Python: the
lifecycle calls of one rank, over a Communicator. A thin layer: semantics, shapes and errors are
the C++ runtime's. Every call releases the GIL, so one Python thread per rank can drive a
ThreadGroup (ranks as threads); ranks as processes use Communicator.nccl_from_env()."""

import json

from . import _m3msa
from ._api import _DL_CUDA, _DL_CUDA_MANAGED, _arg, _dlpack_device, _resolve_stream
from ._errors import invalid

RuntimeConfig = _m3msa.RuntimeConfig
ThreadGroup = _m3msa.ThreadGroup


class Communicator:
    """One rank's handle on a communicator: Communicator.single() (TP = 1),
    Communicator.nccl_from_env(timeout_ms) (one rank per process: RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, LOCAL_RANK; collective), or ThreadGroup(P, timeout_ms).communicator(rank)."""

    single = staticmethod(_m3msa.Communicator.single)

    @staticmethod
    def nccl_from_env(timeout_ms=30_000):
        return _m3msa.Communicator.nccl_from_env(int(timeout_ms))


class LayerWeights:
    """One layer's tensors for this rank, bound without copies (runtime.h LayerWeights; shapes
    with sc = config.model.sparse(P), W = sc.qkv_width):

        qkv_proj [W, hidden] bf16 | fp8 (+ qkv_proj_scale [W] f32), q_norm / k_norm [head_dim],
        index_q_norm / index_k_norm [index_dim], input_norm / post_attention_norm [hidden] (bf16),
        o_proj [hidden, QH * head_dim] (+ o_proj_scale [hidden] f32), kv_cache (+ k_scale,
        v_scale), index_cache, optional mlp_gate_up [2 I, hidden] and mlp_down [hidden, I].

    Optional mixture of experts (docs/spec.md section 8; exclusive with the MLP), I_r =
    moe_intermediate / P, S_r = shared_experts * I_r: router_weight [E, hidden] f32, router_bias
    [E] f32, experts_w13 [E, 2 I_r, hidden] and experts_w2 [E, hidden, I_r], shared_w13
    [2 S_r, hidden] and shared_w2 [hidden, S_r], bf16 or fp8 e4m3 (MXFP8) with uint8 e8m0
    *_scale tensors, one per 32 elements along the last axis.

    A dense layer (layer < first_sparse_layer; the dense layers are bound all or none) has no
    index part (index_q_norm, index_k_norm and index_cache stay None), qkv_proj rows [q | k | v]
    only, and its dense MLP instead of an FFN above, D_r = dense_intermediate / P: dense_w13
    [2 D_r, hidden] and dense_w2 [hidden, D_r], bf16 or fp8 e4m3 (MXFP8) with dense_w13_scale /
    dense_w2_scale.

    The runtime reads them (and writes the caches) for as long as it is bound: keep them alive
    and in place until detach() or close()."""

    __slots__ = ("layer", "qkv_proj", "qkv_proj_scale", "q_norm", "k_norm", "index_q_norm",
                 "index_k_norm", "input_norm", "post_attention_norm", "o_proj", "o_proj_scale",
                 "kv_cache", "k_scale", "v_scale", "index_cache", "mlp_gate_up", "mlp_down",
                 "router_weight", "router_bias", "experts_w13", "experts_w13_scale", "experts_w2",
                 "experts_w2_scale", "shared_w13", "shared_w13_scale", "shared_w2",
                 "shared_w2_scale", "dense_w13", "dense_w13_scale", "dense_w2", "dense_w2_scale")

    def __init__(self, layer, *, qkv_proj, q_norm, k_norm, input_norm, post_attention_norm,
                 o_proj, kv_cache, index_q_norm=None, index_k_norm=None, index_cache=None,
                 qkv_proj_scale=None, o_proj_scale=None, k_scale=1.0, v_scale=1.0,
                 mlp_gate_up=None, mlp_down=None, router_weight=None, router_bias=None,
                 experts_w13=None, experts_w13_scale=None, experts_w2=None,
                 experts_w2_scale=None, shared_w13=None, shared_w13_scale=None, shared_w2=None,
                 shared_w2_scale=None, dense_w13=None, dense_w13_scale=None, dense_w2=None,
                 dense_w2_scale=None):
        self.layer = int(layer)
        self.qkv_proj, self.qkv_proj_scale = _arg(qkv_proj), qkv_proj_scale
        self.q_norm, self.k_norm = q_norm, k_norm
        self.index_q_norm, self.index_k_norm = index_q_norm, index_k_norm
        self.input_norm, self.post_attention_norm = input_norm, post_attention_norm
        self.o_proj, self.o_proj_scale = _arg(o_proj), o_proj_scale
        self.kv_cache, self.k_scale, self.v_scale = _arg(kv_cache), float(k_scale), float(v_scale)
        self.index_cache = _arg(index_cache)
        self.mlp_gate_up, self.mlp_down = mlp_gate_up, mlp_down
        self.router_weight, self.router_bias = router_weight, router_bias
        self.experts_w13, self.experts_w13_scale = _arg(experts_w13), experts_w13_scale
        self.experts_w2, self.experts_w2_scale = _arg(experts_w2), experts_w2_scale
        self.shared_w13, self.shared_w13_scale = _arg(shared_w13), shared_w13_scale
        self.shared_w2, self.shared_w2_scale = _arg(shared_w2), shared_w2_scale
        self.dense_w13, self.dense_w13_scale = _arg(dense_w13), dense_w13_scale
        self.dense_w2, self.dense_w2_scale = _arg(dense_w2), dense_w2_scale


class Runtime:
    """One rank's runtime. Lifecycle (every rank calls the same functions in the same order):
    prepare() -> 'skipped' | 'not_ready' | 'active' | 'fallback'; per step begin_step(batch)
    (False: a counted refusal, run the step natively) then forward_layer() per sparse layer;
    detach(replacement) or close() at the end. Errors raise the m3msa exception of their code,
    with every rank's message where ranks disagree.

    log: a callable taking one line (fallback decisions, readiness retries); None: stderr.
    """

    def __init__(self, log=None):
        self._native = _m3msa.Runtime(log)

    def prepare(self, layers, config, comm=None, *, capturing=False, has_metadata=True,
                stream=None):
        """Binds `layers` (LayerWeights of every sparse layer) for `config` over `comm`
        (default: Communicator.single()). On the GPU the kernels are queued on `stream` (default:
        torch's current stream of the weights' device): the stream an engine captures on.
        capturing: the engine is capturing a graph now (prepare is then an error)."""
        if not isinstance(config, RuntimeConfig):
            raise invalid(f"config: expected an m3msa.RuntimeConfig, got {type(config).__name__}")
        layers = list(layers)
        if not all(isinstance(layer, LayerWeights) for layer in layers):
            raise invalid("layers: expected m3msa.LayerWeights")
        if comm is None:
            comm = Communicator.single()
        first = layers[0].qkv_proj if layers else None
        cuda = first is not None and _is_cuda(first)
        return self._native.prepare(layers, config, comm, bool(capturing), bool(has_metadata),
                                    _resolve_stream(first, stream) if cuda else None, cuda)

    def begin_step(self, batch, *, pad_to_reqs=None, stream=None):
        """Stages the decode metadata of one step (host or device tensors); False = refused
        (counted in stats()). pad_to_reqs: pad to that many requests (padding rows: position -1)
        so a captured graph of that shape replays the step."""
        pad = -1 if pad_to_reqs is None else int(pad_to_reqs)
        return bool(self._native.begin_step(batch, pad, _resolve_stream(batch.seq_lens, stream)))

    def forward_layer(self, layer, hidden, residual, positions, *, stream=None):
        """Sparse layer `layer` of the accepted step, in place: hidden [rows, hidden] bf16 (in:
        the layer input; out: post-attention-normed hidden, or the MLP output), residual
        [rows, hidden] bf16 (in: the residual; out: the new residual), positions [rows] int64."""
        self._native.forward_layer(int(layer), hidden, residual, positions,
                                   _resolve_stream(hidden, stream))

    def detach(self, replacement=()):
        """Every rank, after the engine destroyed its graphs: (layer, kv_cache, index_cache)
        entries whose storage must be empty (None or zero elements); then close()."""
        self._native.detach([tuple(entry) for entry in replacement])

    def close(self):
        """Agreed across ranks; idempotent."""
        self._native.close()

    def stats(self):
        """RuntimeStats as a dict (state, fallback reasons, refusals, steps, buckets, ...)."""
        return json.loads(self._native.stats_json())

    @property
    def state(self):
        """'idle', 'active', 'fallback' or 'closed'."""
        return self._native.state


def _is_cuda(tensor):
    return _dlpack_device(tensor)[0] in (_DL_CUDA, _DL_CUDA_MANAGED)
