"""vLLM's MiniMax-M3 decode entry points, served by m3msa, and the vLLM plugin that swaps them in.

The two functions take exactly the arguments, layouts and return conventions of vLLM's
``minimax_m3_index_decode`` (vllm/models/minimax_m3/common/ops/index_topk.py) and
``minimax_m3_sparse_attn_decode`` (common/ops/sparse_attn.py); docs/vllm.md lists the commits
they follow, what is covered and what falls back. They run through the torch ops of m3msa.torch,
so they are capturable into CUDA graphs and opaque to torch.compile.

The plugin: ``pip install`` registers ``register`` under the ``vllm.general_plugins`` entry
point. With ``M3MSA_VLLM=1`` in the environment it replaces vLLM's two functions in their modules
(and in every already-imported module of vllm.models.minimax_m3 that imported them by name); a
call m3msa does not serve (a dtype, a layout or an sm_scale it does not take) goes to vLLM's own
function, decided once per kind of call and logged once.
"""

import logging
import math
import os
import sys
import threading

import torch

from . import torch as _ops  # registers torch.ops.m3msa.*
from ._errors import UnsupportedError, invalid, unsupported

__all__ = ["ENV_VAR", "minimax_m3_index_decode", "minimax_m3_sparse_attn_decode", "register",
           "install", "uninstall"]

ENV_VAR = "M3MSA_VLLM"

_log = logging.getLogger("m3msa.vllm")


def minimax_m3_index_decode(idx_q, index_kv_cache, block_table, seq_lens, max_seq_len, topk,
                            init_blocks, local_blocks, num_kv_heads, decode_query_len,
                            max_decode_query_len, out=None):
    """Index scores + exact top-k of decode rows (docs/spec.md section 4), vLLM's conventions.

    idx_q:          [total_q, num_kv_heads, D] bf16 (fp8 e4m3 beside an fp8 cache), rows
                    request-major: row r * decode_query_len + j is token j of request r
    index_kv_cache: [num_blocks, block_size, D] bf16 | fp8 e4m3
    block_table:    [num_reqs, max_blocks] int32; seq_lens: [num_reqs] int32, counting the
                    decode_query_len new tokens (0: a padding request, its rows all -1)
    max_seq_len:    unused (vLLM sizes a score buffer with it; m3msa needs none)
    out:            None, or int32 [num_kv_heads, >= total_q, topk] written in out[:, :total_q]
    Returns topk_idx int32 [num_kv_heads, total_q, topk]: the selected logical block ids of each
    (head, row), forced blocks first, then by descending score, -1 after the valid prefix.
    """
    del max_seq_len
    total_q, heads, _ = _ops._shape(idx_q, "idx_q", 3)
    if heads != num_kv_heads:
        raise invalid(f"idx_q: expected num_kv_heads = {num_kv_heads} index heads, got {heads}")
    if not 1 <= decode_query_len <= max_decode_query_len:
        raise invalid(f"decode_query_len: expected 1 <= decode_query_len <= "
                      f"max_decode_query_len ({max_decode_query_len}), got {decode_query_len}")
    reqs = int(seq_lens.shape[0])
    if total_q != reqs * decode_query_len:
        raise invalid(f"idx_q: expected num_reqs * decode_query_len = {reqs} * "
                      f"{decode_query_len} rows, got {total_q}")
    if out is None:
        result = torch.empty((heads, total_q, topk), dtype=torch.int32, device=idx_q.device)
    else:
        shape = tuple(out.shape)
        if (len(shape) != 3 or shape[0] != heads or shape[1] < total_q or shape[2] != topk or
                out.dtype != torch.int32):
            raise invalid(f"out: expected int32 [{heads}, >= {total_q}, {topk}], got "
                          f"{out.dtype} {list(shape)}")
        result = out[:, :total_q, :]
    torch.ops.m3msa.index_decode(idx_q, index_kv_cache, block_table, seq_lens,
                                 int(decode_query_len), int(topk), int(init_blocks),
                                 int(local_blocks), False, True, result)
    return result


def minimax_m3_sparse_attn_decode(q, kv_cache, topk_idx, block_table, seq_lens, num_kv_heads,
                                  sm_scale, output, decode_query_len):
    """Block-sparse GQA attention of decode rows over their selected blocks (docs/spec.md
    section 5), vLLM's conventions; writes output, returns None.

    q:        [total_q, num_heads, head_dim] bf16
    kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim] bf16 | fp8 e4m3 (K = [:, 0],
              V = [:, 1]; fp8 values are used as stored, with no scale, as vLLM's kernel does)
    topk_idx: [num_kv_heads, total_q, topk] int32 from minimax_m3_index_decode (any view of a
              larger buffer)
    sm_scale: must be 1 / sqrt(head_dim), the scale of M3's attention (m3msa.UnsupportedError
              otherwise)
    output:   [total_q, num_heads, head_dim] bf16
    """
    total_q, _, head_dim = _ops._shape(q, "q", 3)
    _ops._shape(kv_cache, "kv_cache", 5)
    if int(kv_cache.shape[3]) != num_kv_heads:
        raise invalid(f"kv_cache: expected num_kv_heads = {num_kv_heads} in axis 3 of "
                      f"[num_blocks, 2, block_size, num_kv_heads, head_dim], got "
                      f"{list(kv_cache.shape)}")
    reqs = int(seq_lens.shape[0])
    if decode_query_len < 1 or total_q != reqs * decode_query_len:
        raise invalid(f"q: expected num_reqs * decode_query_len = {reqs} * {decode_query_len} "
                      f"rows, got {total_q}")
    want = 1.0 / math.sqrt(head_dim)
    if not math.isclose(float(sm_scale), want, rel_tol=1e-6):
        raise unsupported(f"sm_scale: m3msa attends with 1 / sqrt(head_dim) = {want!r}, "
                          f"got {sm_scale!r}")
    shape = tuple(topk_idx.shape)
    if len(shape) != 3 or shape[0] != num_kv_heads or shape[1] != total_q:
        raise invalid(f"topk_idx: expected [{num_kv_heads}, {total_q}, topk], got {list(shape)}")
    if tuple(output.shape) != tuple(q.shape) or output.dtype != torch.bfloat16:
        raise invalid(f"output: expected bfloat16 {list(q.shape)} (that of q), got "
                      f"{output.dtype} {list(output.shape)}")
    torch.ops.m3msa.sparse_attn_decode(q, kv_cache, "vllm", topk_idx.permute(1, 0, 2),
                                       block_table, seq_lens, int(decode_query_len), 1.0, 1.0,
                                       output)


# ---- The plugin ----

# vLLM's modules and the functions m3msa replaces in them.
_TARGETS = {
    "vllm.models.minimax_m3.common.ops.index_topk": ("minimax_m3_index_decode",
                                                     minimax_m3_index_decode),
    "vllm.models.minimax_m3.common.ops.sparse_attn": ("minimax_m3_sparse_attn_decode",
                                                      minimax_m3_sparse_attn_decode),
}
_CONSUMERS = "vllm.models.minimax_m3"

_installed = {}  # module name -> (function name, vLLM's original, our wrapper)
_lock = threading.Lock()


def _call_kind(args, kwargs):
    """What decides whether m3msa serves a call: the devices and dtypes of its tensors and its
    non-integer scalars (an sm_scale), never the per-step sizes."""
    kind = []
    for value in list(args) + [kwargs[k] for k in sorted(kwargs)]:
        if isinstance(value, torch.Tensor):
            kind.append((value.device.type, str(value.dtype), value.dim()))
        elif isinstance(value, float):
            kind.append(value)
    return tuple(kind)


def _swapped(name, ours, original):
    served = {}

    def call(*args, **kwargs):
        kind = _call_kind(args, kwargs)
        if served.get(kind, True):
            try:
                return ours(*args, **kwargs)
            except UnsupportedError as error:
                served[kind] = False
                _log.warning("m3msa does not serve this %s call (%s); vLLM's own kernel runs "
                             "it and every call like it", name, error)
        return original(*args, **kwargs)

    call.__name__ = name
    call.__qualname__ = name
    call.__doc__ = ours.__doc__
    call.m3msa_original = original
    return call


def install():
    """Replaces vLLM's functions with m3msa's (idempotent). Returns the names replaced."""
    import importlib

    replaced = []
    with _lock:
        for module_name, (name, ours) in _TARGETS.items():
            if module_name in _installed:
                continue
            module = importlib.import_module(module_name)
            original = getattr(module, name)
            wrapper = _swapped(name, ours, original)
            setattr(module, name, wrapper)
            _installed[module_name] = (name, original, wrapper)
            _rebind(original, wrapper)
            replaced.append(f"{module_name}.{name}")
    return replaced


def uninstall():
    """Puts vLLM's functions back."""
    import importlib

    with _lock:
        for module_name, (name, original, wrapper) in list(_installed.items()):
            setattr(importlib.import_module(module_name), name, original)
            _rebind(wrapper, original)
            del _installed[module_name]


def _rebind(old, new):
    """Modules that imported `old` by name before the swap get `new`."""
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == _CONSUMERS or
                                  module_name.startswith(_CONSUMERS + ".")):
            continue
        for attribute, value in list(vars(module).items()):
            if value is old:
                setattr(module, attribute, new)


def register():
    """The vllm.general_plugins entry point: installs when M3MSA_VLLM is 1 / true / yes / on."""
    if os.environ.get(ENV_VAR, "").strip().lower() not in ("1", "true", "yes", "on"):
        return
    replaced = install()
    if replaced:
        _log.info("m3msa serves %s", ", ".join(replaced))
