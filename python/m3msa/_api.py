"""The operations. Every tensor is taken zero-copy (DLPack or the buffer protocol) and must be
contiguous, except the caches, which are read and written in place through their strides; outputs are written in place when given (out=...) and allocated like the inputs
otherwise (NumPy on the CPU, torch on the GPU). Every argument is validated before any work, and a
bad one raises m3msa.Error naming it.

Shapes use the per-rank SparseConfig: H = index_heads = kv_heads, D = index_dim, QH = q_heads,
HD = head_dim, k = topk, rows = batch.num_rows.

On CUDA tensors the work is ordered on the caller's stream: stream=None takes
torch.cuda.current_stream() of the tensors' device (when torch is imported; else the legacy default
stream), or pass stream= as a torch.cuda.Stream or an integer cudaStream_t handle (0: the legacy
default stream). Each producer is handed that stream through __dlpack__(stream=...), so its pending
writes are ordered before the call.

Two ways to run on the GPU:
  - unplanned (plan=None): one shared backend per GPU; every call first synchronizes the stream,
    copies the batch metadata to the host and checks its contents (table entries, lengths), and
    grows its workspaces when needed. Convenient and strict, for eager use; refused while the
    stream is being captured into a CUDA graph.
  - planned (plan=m3msa.CudaPlan(...)): the plan's own backend, sized up front for max_reqs /
    max_q_len / max_rows; a call allocates nothing, never synchronizes the host and can be captured
    by torch.cuda.graph (replays with new metadata of the same host shapes). Contents are not
    checked on the host (validate_contents=False), the kernels' device-side guards keep every read
    inside the tensors given (plan.device_status() reports them).
"""

import sys

import numpy as np

from . import _m3msa
from ._batch import Batch
from ._dtypes import TypedView, view
from ._errors import invalid

SparseConfig = _m3msa.SparseConfig
ModelConfig = _m3msa.ModelConfig

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def _unwrap(tensor):
    return tensor.array if isinstance(tensor, TypedView) else tensor


def _dlpack_device(tensor):
    """(DLPack device type, index) of a tensor; CPU for anything without __dlpack_device__."""
    tensor = _unwrap(tensor)
    probe = getattr(tensor, "__dlpack_device__", None)
    if probe is None:
        return _DL_CPU, 0
    device_type, index = probe()
    return int(device_type), int(index)


def _resolve_stream(tensor, stream):
    """The CUDA stream handle a call runs on, or None (legacy default stream / CPU)."""
    if stream is not None:
        return int(getattr(stream, "cuda_stream", stream))
    device_type, index = _dlpack_device(tensor)
    if device_type in (_DL_CUDA, _DL_CUDA_MANAGED):
        torch = sys.modules.get("torch")
        if torch is not None:
            return int(torch.cuda.current_stream(index).cuda_stream)
    return None


def _arg(tensor):
    """A tensor argument as the C++ side takes it. torch float8_e4m3fn tensors travel as their
    uint8 bits tagged 'fp8' (no copy), whatever the installed torch's DLPack export supports."""
    dtype = getattr(tensor, "dtype", None)
    if dtype is not None and type(tensor).__module__.split(".")[0] == "torch":
        torch = sys.modules["torch"]
        if dtype == getattr(torch, "float8_e4m3fn", None):
            return view(tensor.view(torch.uint8), "fp8")
    return tensor


_KV_LAYOUTS = ("ours", "vllm", "flashinfer")


def _kv_args(kv_cache, kv_layout):
    """(tensor, second tensor or None, layout) of a main cache given as one tensor in `kv_layout`
    or as a (k, v) pair of views [pages, kv_heads, block_size, HD] (any strides, HD contiguous)."""
    if kv_layout not in _KV_LAYOUTS:
        raise invalid(f"kv_layout: expected one of {', '.join(_KV_LAYOUTS)}, got {kv_layout!r}")
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2:
            raise invalid(f"kv_cache: a pair is (k, v), got {len(kv_cache)} tensors")
        if kv_layout != "ours":
            raise invalid(f"kv_layout: a (k, v) pair takes no layout, got {kv_layout!r}")
        return _arg(kv_cache[0]), _arg(kv_cache[1]), "ours"
    return _arg(kv_cache), None, kv_layout


def _scale(value, name):
    """A k / v scale as the C++ side takes it: a number, or a one-element float32 tensor read
    when the operation runs (a captured CUDA graph sees each replay's value)."""
    if isinstance(value, (int, float, np.floating, np.integer)):
        return float(value)
    if hasattr(value, "__dlpack__") or hasattr(value, "__array_interface__"):
        return _arg(value)
    raise invalid(f"{name}: expected a number or a one-element float32 tensor, got "
                  f"{type(value).__name__}")


def _native_plan(plan):
    if plan is None:
        return None
    if not isinstance(plan, CudaPlan):
        raise invalid(f"plan: expected an m3msa.CudaPlan or None, got {type(plan).__name__}")
    return plan._native


def _device_index(device):
    """A CUDA device index from None (torch's current device, else 0), an int, 'cuda:N' or a
    torch.device."""
    if device is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            return int(torch.cuda.current_device())
        return 0
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if kind != "cuda" or (index and not index.isdigit()):
            raise invalid(f"device: expected 'cuda' or 'cuda:N', got {device!r}")
        return int(index) if index else _device_index(None)
    if getattr(device, "type", "cuda") != "cuda":
        raise invalid(f"device: expected a CUDA device, got {device}")
    index = getattr(device, "index", device)
    return _device_index(None) if index is None else int(index)


class CudaPlan:
    """A CUDA backend of its own, planned for every batch within the limits: calls given
    plan=this allocate nothing, never synchronize the host and can be captured into a CUDA graph
    (torch.cuda.graph), then replayed with new metadata.

    config:     the SparseConfig every call must pass (a call with another raises)
    max_reqs:   requests per call (padding requests included)
    max_q_len:  decode rows per request (1..8)
    max_rows:   rows per call (prefill tokens); 0 = max_reqs * max_q_len
    max_context: tokens per request; only the unfused indexer baseline needs it (0 = not planned)
    device:     CUDA device index, 'cuda:N' or torch.device (None: torch's current device)
    validate_contents: also check the batch contents on the host (synchronizes: not capturable;
                for debugging)

    A call outside the limits raises InvalidArgumentError instead of growing the workspaces. Keep
    the plan alive as long as any CUDA graph captured with it: the graph reads its workspaces.
    """

    def __init__(self, config, *, max_reqs, max_q_len=1, max_rows=0, max_context=0, device=None,
                 validate_contents=False):
        _check_config(config)
        self._native = _m3msa.CudaPlan(config, int(max_reqs), int(max_q_len), int(max_rows),
                                       int(max_context), _device_index(device),
                                       bool(validate_contents))

    config = property(lambda self: self._native.config)
    max_reqs = property(lambda self: self._native.max_reqs)
    max_q_len = property(lambda self: self._native.max_q_len)
    max_rows = property(lambda self: self._native.max_rows)
    max_context = property(lambda self: self._native.max_context)
    device = property(lambda self: self._native.device)
    validate_contents = property(lambda self: self._native.validate_contents)

    def device_status(self, clear=True, *, stream=None):
        """The indexer's sticky device-side guard bits since the last clear (0: none fired; 1: a
        table entry outside the cache, 2: a sequence longer than its table row, 4: too many
        prefill row groups). Synchronizes the stream: call it outside graph capture."""
        if stream is not None:
            stream = int(getattr(stream, "cuda_stream", stream))
        elif "torch" in sys.modules:
            stream = int(sys.modules["torch"].cuda.current_stream(self.device).cuda_stream)
        return int(self._native.device_status(bool(clear), stream))

    def __repr__(self):
        return (f"m3msa.CudaPlan(device={self.device}, max_reqs={self.max_reqs}, "
                f"max_q_len={self.max_q_len}, max_rows={self.max_rows}, "
                f"validate_contents={self.validate_contents})")


_NUMPY_DTYPES = {"i32": np.int32, "f32": np.float32, "bf16": np.uint16, "u64": np.uint64}


def _empty(like, shape, dtype, name):
    """A new output of `shape` and m3msa `dtype` where `like` lives. On NumPy a bf16 output is
    uint16 bits tagged m3msa.view(..., 'bf16'), ready to feed the next call (to_float32()
    decodes it)."""
    tensor = _unwrap(like)
    if type(tensor).__module__.split(".")[0] == "torch":
        import torch
        torch_dtypes = {"i32": torch.int32, "f32": torch.float32, "bf16": torch.bfloat16,
                        "u64": getattr(torch, "uint64", torch.int64)}
        return torch.empty(shape, dtype=torch_dtypes[dtype], device=tensor.device)
    if _dlpack_device(tensor)[0] in (_DL_CPU, _DL_CUDA_HOST):
        array = np.empty(shape, dtype=_NUMPY_DTYPES[dtype])
        return view(array, dtype) if dtype == "bf16" else array
    raise invalid(f"{name}: cannot allocate an output next to a {type(tensor).__name__} on a "
                  f"device; pass {name}=")


def _typed(out, dtype):
    """What the C++ side is handed for an output. An output's dtype is fixed by the operation, so
    untagged bits arrays are accepted there: NumPy uint16 for bf16, torch int64 for uint64."""
    if dtype == "bf16" and isinstance(out, np.ndarray) and out.dtype == np.uint16:
        return view(out, dtype)
    if dtype == "u64" and type(out).__module__.split(".")[0] == "torch":
        return view(out, "u64")  # torch without uint64 hands back int64 storage
    return out


def _check_config(config):
    if not isinstance(config, SparseConfig):
        raise invalid(f"config: expected an m3msa.SparseConfig, got {type(config).__name__}")


def _check_batch(batch):
    if not isinstance(batch, Batch):
        raise invalid(f"batch: expected an m3msa.Batch, got {type(batch).__name__}")


def select_topk(config, index_q, index_cache, batch, out=None, *, order="descending",
                major="token", threads=0, stream=None, plan=None):
    """Index scoring + exact top-k block selection (docs/spec.md section 4).

    index_q:      [rows, H, D] bf16, or fp8 e4m3 beside an fp8 index_cache (a NumPy uint8
                  array as m3msa.view(a, 'fp8'))
    index_cache:  [pages, block_size, D] bf16 | fp8 e4m3, read through batch.index_block_table;
                  any page and token strides, D contiguous (CUDA: tokens contiguous within a
                  page, page stride a multiple of 16 bytes)
    out:          int32 (the topk_idx): per (row, head) the selected logical block ids, then -1;
                  dead rows all -1. [rows, H, k] (major="token") or [H, rows, k] (major="head");
                  a strided view into a buffer of larger capacity (say buf[:rows, :, :k] or
                  buf[:, :rows, :k]) is written in place through its strides (CUDA: token-major,
                  contiguous).
    order:        "descending" (sort key, forced blocks first) or "ascending" (block id; CPU)
    plan:         an m3msa.CudaPlan for allocation-free, sync-free, capturable GPU calls
    Returns out.
    """
    _check_config(config)
    _check_batch(batch)
    native = _native_plan(plan)
    if major not in ("token", "head"):
        raise invalid(f"major: expected 'token' or 'head', got {major!r}")
    rows, heads, k = batch.num_rows, config.index_heads, config.topk
    shape = (rows, heads, k) if major == "token" else (heads, rows, k)
    if out is None:
        out = _empty(index_q, shape, "i32", "out")
    _m3msa.select_topk(config, _arg(index_q), _arg(index_cache), batch, out, order, major,
                       threads, _resolve_stream(index_q, stream), native)
    return out


def sparse_attention(config, q, kv_cache, batch, topk_idx, out=None, *, k_scale=1.0, v_scale=1.0,
                     kv_layout="ours", threads=0, stream=None, plan=None):
    """Block-sparse GQA attention over the selected blocks (docs/spec.md section 5).

    q:         [rows, QH, HD] bf16
    kv_cache:  bf16 | fp8 e4m3 (read = stored * k/v_scale), read in place through
               batch.kv_block_table: one tensor laid out as kv_layout says, or a (k, v) pair of
               views [pages, kv_heads, block_size, HD] with any strides (HD contiguous)
    kv_layout: "ours" [pages, kv_heads, 2, block_size, HD]; "vllm" [pages, 2, block_size,
               kv_heads, HD]; "flashinfer" [pages, kv_heads, block_size, 2 * HD] (K then V);
               strided sub-views of each are read in place (CUDA: strides in whole 16 bytes)
    k_scale, v_scale: numbers, or one-element float32 tensors read when the operation runs (CPU;
               CUDA takes numbers); fp8 caches only
    topk_idx:  [rows, kv_heads, k] int32 from select_topk, any outer strides (a head-major
               selection as .transpose(1, 0, 2)); None attends densely (causal)
    out:       [rows, QH, HD] bf16 (on NumPy: m3msa.view of uint16 bits, or a uint16 array).
    plan:      an m3msa.CudaPlan for allocation-free, sync-free, capturable GPU calls
    Returns out.
    """
    _check_config(config)
    _check_batch(batch)
    native = _native_plan(plan)
    if out is None:
        out = _empty(q, (batch.num_rows, config.q_heads, config.head_dim), "bf16", "out")
    kv, kv_v, layout = _kv_args(kv_cache, kv_layout)
    _m3msa.sparse_attention(config, _arg(q), kv, kv_v, layout, _scale(k_scale, "k_scale"),
                            _scale(v_scale, "v_scale"), batch, topk_idx, _typed(out, "bf16"),
                            threads, _resolve_stream(q, stream), native)
    return out


def dense_attention(config, q, kv_cache, batch, out=None, *, k_scale=1.0, v_scale=1.0,
                    kv_layout="ours", threads=0, stream=None, plan=None):
    """Dense causal attention over every visible key: sparse_attention without a selection (the
    oracle the sparse path equals when every row sees <= topk blocks)."""
    return sparse_attention(config, q, kv_cache, batch, None, out, k_scale=k_scale,
                            v_scale=v_scale, kv_layout=kv_layout, threads=threads, stream=stream,
                            plan=plan)


def preprocess(config, qkv, q_norm, k_norm, index_q_norm, index_k_norm, positions, batch,
               kv_cache, index_cache, q_out=None, index_q_out=None, *, k_scale=1.0, v_scale=1.0,
               kv_layout="ours", threads=0, stream=None, plan=None):
    """Per-token preprocessing (docs/spec.md section 2): Gemma RMSNorm of every head of q, k,
    index_q and index_k, partial NeoX RoPE at `positions`, and the cache inserts.

    qkv:           [rows, qkv_width] bf16, [q | k | v | index_q | index_k]
    q_norm, k_norm: [HD] bf16; index_q_norm, index_k_norm: [D] bf16
    positions:     [rows] int64 (< 0: padding, nothing written)
    kv_cache:      written in place at batch.slot_mapping (k and v); one tensor in kv_layout or
                   a (k, v) pair of views, as for sparse_attention
    index_cache:   written in place at batch.index_slot_mapping (index_k); [pages, block_size, D]
                   with any page and token strides (D contiguous)
    q_out:         [rows, QH, HD] bf16; index_q_out: [rows, H, D] bf16
    Returns (q_out, index_q_out).
    """
    _check_config(config)
    _check_batch(batch)
    native = _native_plan(plan)
    rows = batch.num_rows
    if q_out is None:
        q_out = _empty(qkv, (rows, config.q_heads, config.head_dim), "bf16", "q_out")
    if index_q_out is None:
        index_q_out = _empty(qkv, (rows, config.index_heads, config.index_dim), "bf16",
                             "index_q_out")
    kv, kv_v, layout = _kv_args(kv_cache, kv_layout)
    _m3msa.preprocess(config, qkv, q_norm, k_norm, index_q_norm, index_k_norm, positions, batch,
                      kv, kv_v, layout, _scale(k_scale, "k_scale"), _scale(v_scale, "v_scale"),
                      _arg(index_cache), _typed(q_out, "bf16"), _typed(index_q_out, "bf16"), threads,
                      _resolve_stream(qkv, stream), native)
    return q_out, index_q_out


def score_blocks(config, index_q, index_cache, batch, out=None, *, max_blocks=None, threads=0):
    """Block scores S(t, h, b) (docs/spec.md section 4), CPU reference only: [rows, H, max_blocks]
    float32; blocks a row cannot see and dead rows hold -inf. max_blocks defaults to the index
    table's width. Returns out."""
    _check_config(config)
    _check_batch(batch)
    if out is None:
        if max_blocks is None:
            table = batch.index_block_table
            if table is None:
                raise invalid("batch.index_block_table is required")
            shape = tuple(getattr(_unwrap(table), "shape", ()))
            max_blocks = int(shape[1]) if len(shape) == 2 else 0
        out = _empty(index_q, (batch.num_rows, config.index_heads, max_blocks), "f32", "out")
    _m3msa.score_blocks(config, _arg(index_q), _arg(index_cache), batch, out, threads)
    return out


def nominate(config, index_q, index_cache, batch, shard=0, num_shards=1, out=None, *, threads=0):
    """The top-k sort keys (docs/spec.md section 4) of one round-robin shard of the blocks, CPU
    reference only: [rows, H, k] uint64, descending, 0-padded. Returns out."""
    _check_config(config)
    _check_batch(batch)
    if out is None:
        out = _empty(index_q, (batch.num_rows, config.index_heads, config.topk), "u64", "out")
    _m3msa.nominate(config, _arg(index_q), _arg(index_cache), batch, shard, num_shards,
                    _typed(out, "u64"), threads)
    return out


class SyntheticCase:
    """A seeded random case from the C++ generator (synthetic.h), as zero-copy NumPy arrays:
    bf16 / fp8 tensors come as m3msa.view()s. Fields: config, batch, positions, index_q, q,
    index_cache, kv_cache, k_scale, v_scale."""

    def __init__(self, config, fields):
        self.config = config
        self.batch = Batch(fields["kind"], fields["num_reqs"], q_len=fields["q_len"],
                           num_tokens=fields["num_tokens"], seq_lens=fields["seq_lens"],
                           cu_seqlens_q=fields["cu_seqlens_q"],
                           context_lens=fields["context_lens"],
                           index_block_table=fields["index_block_table"],
                           kv_block_table=fields["kv_block_table"],
                           slot_mapping=fields["slot_mapping"],
                           index_slot_mapping=fields["index_slot_mapping"])
        for name in ("positions", "index_q", "q", "index_cache", "kv_cache", "k_scale",
                     "v_scale"):
            setattr(self, name, fields[name])

    @property
    def num_rows(self):
        return self.batch.num_rows


def synthetic_case(config, *, kind="decode", num_reqs=4, q_len=1, seq_lens=(), min_context=1,
                   max_context=4096, chunk_lens=(), context_lens=(), padding_reqs=0,
                   index_dtype="bf16", kv_dtype="bf16", k_scale=1.0, v_scale=1.0, extra_pages=3,
                   query_scale=1.0, make_index_cache=True, make_kv_cache=True, seed=1):
    """make_synthetic_case() of the C++ library: caches with random contexts (and garbage after
    each one), shuffled page tables, random queries; deterministic for a given seed."""
    _check_config(config)
    fields = _m3msa.synthetic_case(config, kind, num_reqs, q_len, list(seq_lens), min_context,
                                   max_context, list(chunk_lens), list(context_lens),
                                   padding_reqs, index_dtype, kv_dtype, float(k_scale),
                                   float(v_scale), extra_pages, float(query_scale),
                                   make_index_cache, make_kv_cache, seed)
    return SyntheticCase(config, fields)


def info():
    """What this build can do."""
    from . import __version__
    return {
        "version": __version__,
        "built_with_cuda": bool(_m3msa.built_with_cuda()),
        "cuda_device_count": int(_m3msa.cuda_device_count()),
        "cuda_backend": bool(_m3msa.cuda_backend_available()),
        "cp_cpu_selector": bool(_m3msa.has_cp),
        "module": _m3msa.__file__,
    }
