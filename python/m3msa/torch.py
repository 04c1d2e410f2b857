"""The m3msa operations as torch.library custom ops (namespace ``m3msa``), for torch.compile and
CUDA graphs.

    import m3msa.torch  # registers torch.ops.m3msa.*
    torch.ops.m3msa.index_decode(index_q, index_cache, block_table, seq_lens, q_len, topk,
                                 init_blocks, local_blocks, False, False, out)

Every op writes a caller's preallocated output in place (its schema marks it ``Tensor(a!)``) and
returns nothing; each has a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` traces
through it without running it. The sizes of the operation come from the tensors' shapes (heads,
dimensions, block size, top-k width), the rules of the selection from the integer arguments.

  index_decode(index_q [rows, H, D], index_cache [pages, block_size, D], block_table [reqs, nb],
               seq_lens [reqs] int32, q_len, topk, init_blocks, local_blocks, ascending,
               head_major, out)
      out: int32 [rows, H, topk], or [H, rows, topk] when head_major; any outer strides (a view
      into a buffer of larger capacity is written in place).
  index_prefill(index_q, index_cache, block_table, cu_seqlens_q [reqs + 1], context_lens [reqs],
               topk, init_blocks, local_blocks, ascending, head_major, out)
  sparse_attn_decode(q [rows, QH, HD], kv_cache, kv_layout, topk_idx [rows, KVH, k] or None,
                     block_table, seq_lens, q_len, k_scale, v_scale, out [rows, QH, HD] bf16)
      kv_cache in kv_layout "ours" [pages, KVH, 2, block_size, HD], "vllm"
      [pages, 2, block_size, KVH, HD] or "flashinfer" [pages, KVH, block_size, 2 * HD];
      topk_idx with any outer strides (a head-major selection passes as .permute(1, 0, 2));
      None attends densely (causal).
  sparse_attn_prefill(q, kv_cache, kv_layout, topk_idx, block_table, cu_seqlens_q, context_lens,
                      k_scale, v_scale, out)

On CUDA tensors an op runs on torch's current stream through an m3msa.CudaPlan cached per device,
sizes and bound (requests, rows per request, rows), so it allocates nothing of its own beyond
what torch's allocator hands it, never synchronizes the host and can be captured by
torch.cuda.graph. A plan is created on the first call that no cached plan covers; that call must
not be inside a graph capture (run the largest shape once eagerly first, as engines do in their
warm-up): inside a capture it raises m3msa.InvalidArgumentError saying so. Where the CUDA kernels
do not write or read a layout in place (a head-major or ascending selection, a strided topk_idx),
the op goes through a scratch tensor and one copy on the same stream. Metadata contents are not
checked on the host on CUDA (the kernels' device-side guards keep every read in bounds); on the
CPU every call is fully validated.

Requires torch >= 1.13; torch.compile needs torch >= 2.4.
"""

import threading

import torch

from . import _api
from ._batch import Batch
from ._errors import UnsupportedError, invalid

__all__ = ["KV_LAYOUTS", "clear_plans", "plans"]

KV_LAYOUTS = ("ours", "vllm", "flashinfer")

_SCHEMAS = {
    "index_decode": "index_decode(Tensor index_q, Tensor index_cache, Tensor block_table, "
                    "Tensor seq_lens, int q_len, int topk, int init_blocks, int local_blocks, "
                    "bool ascending, bool head_major, Tensor(a!) out) -> ()",
    "index_prefill": "index_prefill(Tensor index_q, Tensor index_cache, Tensor block_table, "
                     "Tensor cu_seqlens_q, Tensor context_lens, int topk, int init_blocks, "
                     "int local_blocks, bool ascending, bool head_major, Tensor(a!) out) -> ()",
    "sparse_attn_decode": "sparse_attn_decode(Tensor q, Tensor kv_cache, str kv_layout, "
                          "Tensor? topk_idx, Tensor block_table, Tensor seq_lens, int q_len, "
                          "float k_scale, float v_scale, Tensor(a!) out) -> ()",
    "sparse_attn_prefill": "sparse_attn_prefill(Tensor q, Tensor kv_cache, str kv_layout, "
                           "Tensor? topk_idx, Tensor block_table, Tensor cu_seqlens_q, "
                           "Tensor context_lens, float k_scale, float v_scale, "
                           "Tensor(a!) out) -> ()",
}


# ---- Sizes from shapes ----

def _shape(tensor, name, ndim):
    shape = tuple(tensor.shape)
    if len(shape) != ndim:
        raise invalid(f"{name}: expected {ndim} dimensions, got shape {list(shape)}")
    return shape


def _kv_geometry(kv_cache, kv_layout):
    """(kv_heads, block_size, head_dim) of a main cache in kv_layout."""
    if kv_layout not in KV_LAYOUTS:
        raise invalid(f"kv_layout: expected one of {', '.join(KV_LAYOUTS)}, got {kv_layout!r}")
    if kv_layout == "ours":
        _, heads, two, block, dim = _shape(kv_cache, "kv_cache (ours)", 5)
    elif kv_layout == "vllm":
        _, two, block, heads, dim = _shape(kv_cache, "kv_cache (vllm)", 5)
    else:
        _, heads, block, width = _shape(kv_cache, "kv_cache (flashinfer)", 4)
        two, dim = 2, width // 2
        if width % 2:
            raise invalid(f"kv_cache (flashinfer): the last axis holds K then V, so its size "
                          f"must be even, got {width}")
    if two != 2:
        raise invalid(f"kv_cache ({kv_layout}): the K/V axis must have size 2, got {two}")
    return heads, block, dim


def _index_config(index_q, index_cache, topk, init_blocks, local_blocks):
    _, heads, dim = _shape(index_q, "index_q", 3)
    _, block, cache_dim = _shape(index_cache, "index_cache", 3)
    if cache_dim != dim:
        raise invalid(f"index_cache: expected index_dim {dim} (from index_q) in its last axis, "
                      f"got shape {list(index_cache.shape)}")
    # Only the index fields matter to the indexer; the others are set to valid values.
    return _api.SparseConfig(q_heads=heads, kv_heads=heads, head_dim=dim, index_heads=heads,
                             index_dim=dim, block_size=block, topk=int(topk),
                             init_blocks=int(init_blocks), local_blocks=int(local_blocks),
                             rope_dim=0)


def _attention_config(q, kv_cache, kv_layout, topk_idx):
    _, q_heads, dim = _shape(q, "q", 3)
    kv_heads, block, cache_dim = _kv_geometry(kv_cache, kv_layout)
    if cache_dim != dim:
        raise invalid(f"kv_cache ({kv_layout}): expected head_dim {dim} (from q), got shape "
                      f"{list(kv_cache.shape)}")
    if kv_heads <= 0 or q_heads % kv_heads:
        raise invalid(f"q: {q_heads} query heads are not a multiple of the cache's {kv_heads} "
                      f"KV heads")
    topk = 1 if topk_idx is None else int(_shape(topk_idx, "topk_idx", 3)[2])
    return _api.SparseConfig(q_heads=q_heads, kv_heads=kv_heads, head_dim=dim,
                             index_heads=kv_heads, index_dim=dim, block_size=block, topk=topk,
                             init_blocks=0, local_blocks=0, rope_dim=0)


def _config_key(config):
    return (config.q_heads, config.kv_heads, config.head_dim, config.index_heads,
            config.index_dim, config.block_size, config.topk, config.init_blocks,
            config.local_blocks)


# ---- Plans (CUDA) ----

_plans = {}
_plans_lock = threading.Lock()


def _bound(value, floor):
    """The smallest power of two >= max(value, floor): plans are shared by nearby shapes."""
    value = max(int(value), floor)
    return 1 << (value - 1).bit_length()


def _plan(config, tensor, num_reqs, q_len, rows):
    """A cached CudaPlan of tensor's device covering the call, created when none does."""
    device = tensor.device.index if tensor.device.index is not None else \
        torch.cuda.current_device()
    key = (device, _config_key(config))
    with _plans_lock:
        for plan in _plans.get(key, ()):
            if plan.max_reqs >= num_reqs and plan.max_q_len >= q_len and plan.max_rows >= rows:
                return plan
        if torch.cuda.is_current_stream_capturing():
            raise invalid(
                f"no m3msa plan on cuda:{device} covers num_reqs={num_reqs}, q_len={q_len}, "
                f"rows={rows} for {config}, and a plan cannot be created during CUDA graph "
                f"capture: run these shapes (or larger) once outside the capture first")
        max_reqs = _bound(num_reqs, 8)
        plan = _api.CudaPlan(config, max_reqs=max_reqs, max_q_len=max(1, q_len),
                             max_rows=max(_bound(rows, 8), max_reqs * max(1, q_len)),
                             device=device)
        _plans.setdefault(key, []).append(plan)
        return plan


def plans():
    """The cached CUDA plans: [(device, config fields, max_reqs, max_q_len, max_rows)]."""
    with _plans_lock:
        return [(device, fields, p.max_reqs, p.max_q_len, p.max_rows)
                for (device, fields), cached in _plans.items() for p in cached]


def clear_plans():
    """Drops the cached plans (graphs captured with them must not be replayed afterwards)."""
    with _plans_lock:
        _plans.clear()


# ---- Implementations ----

# Whether the CUDA kernels take a layout in place, learned once per layout: the first call that
# the library refuses as unsupported switches that layout to the scratch-and-copy route.
_cuda_in_place = {}


def _on_cuda(tensor):
    return tensor.device.type == "cuda"


def _decode_batch(seq_lens, q_len, block_table):
    return Batch("decode", int(seq_lens.shape[0]), q_len=int(q_len), seq_lens=seq_lens,
                 index_block_table=block_table, kv_block_table=block_table)


def _prefill_batch(cu_seqlens_q, context_lens, rows, block_table):
    return Batch("prefill", int(context_lens.shape[0]), num_tokens=int(rows),
                 cu_seqlens_q=cu_seqlens_q, context_lens=context_lens,
                 index_block_table=block_table, kv_block_table=block_table)


def _select(index_q, index_cache, batch, q_len, topk, init_blocks, local_blocks, ascending,
            head_major, out):
    config = _index_config(index_q, index_cache, topk, init_blocks, local_blocks)
    order = "ascending" if ascending else "descending"
    major = "head" if head_major else "token"
    if not _on_cuda(index_q):
        _api.select_topk(config, index_q, index_cache, batch, out, order=order, major=major)
        return
    plan = _plan(config, index_q, batch.num_reqs, q_len, batch.num_rows)
    direct = (order, major, out.is_contiguous())
    if direct == ("descending", "token", True) or _cuda_in_place.get(("select",) + direct, True):
        try:
            _api.select_topk(config, index_q, index_cache, batch, out, order=order, major=major,
                             plan=plan)
            return
        except UnsupportedError:
            if direct == ("descending", "token", True):
                raise
            _cuda_in_place[("select",) + direct] = False
    scratch = torch.empty((batch.num_rows, config.index_heads, config.topk), dtype=torch.int32,
                          device=index_q.device)
    _api.select_topk(config, index_q, index_cache, batch, scratch, plan=plan)
    if ascending:  # the valid prefix by block id, then the -1 padding
        last = torch.iinfo(torch.int32).max
        scratch = scratch.masked_fill(scratch < 0, last).sort(dim=-1).values
        scratch = scratch.masked_fill(scratch == last, -1)
    out.copy_(scratch.permute(1, 0, 2) if head_major else scratch)


def _attend(q, kv_cache, kv_layout, topk_idx, batch, q_len, k_scale, v_scale, out):
    config = _attention_config(q, kv_cache, kv_layout, topk_idx)
    if not _on_cuda(q):
        _api.sparse_attention(config, q, kv_cache, batch, topk_idx, out, k_scale=k_scale,
                              v_scale=v_scale, kv_layout=kv_layout)
        return
    plan = _plan(config, q, batch.num_reqs, q_len, batch.num_rows)
    if topk_idx is not None and not topk_idx.is_contiguous() and \
            not _cuda_in_place.get(("attend", "strided_topk"), True):
        topk_idx = topk_idx.contiguous()
    try:
        _api.sparse_attention(config, q, kv_cache, batch, topk_idx, out, k_scale=k_scale,
                              v_scale=v_scale, kv_layout=kv_layout, plan=plan)
    except UnsupportedError as error:
        if topk_idx is None or topk_idx.is_contiguous() or "topk_idx" not in str(error):
            raise
        _cuda_in_place[("attend", "strided_topk")] = False
        _api.sparse_attention(config, q, kv_cache, batch, topk_idx.contiguous(), out,
                              k_scale=k_scale, v_scale=v_scale, kv_layout=kv_layout, plan=plan)


def _index_decode(index_q, index_cache, block_table, seq_lens, q_len, topk, init_blocks,
                  local_blocks, ascending, head_major, out):
    _select(index_q, index_cache, _decode_batch(seq_lens, q_len, block_table), q_len, topk,
            init_blocks, local_blocks, ascending, head_major, out)


def _index_prefill(index_q, index_cache, block_table, cu_seqlens_q, context_lens, topk,
                   init_blocks, local_blocks, ascending, head_major, out):
    batch = _prefill_batch(cu_seqlens_q, context_lens, index_q.shape[0], block_table)
    _select(index_q, index_cache, batch, 1, topk, init_blocks, local_blocks, ascending,
            head_major, out)


def _sparse_attn_decode(q, kv_cache, kv_layout, topk_idx, block_table, seq_lens, q_len,
                        k_scale, v_scale, out):
    _attend(q, kv_cache, kv_layout, topk_idx, _decode_batch(seq_lens, q_len, block_table), q_len,
            k_scale, v_scale, out)


def _sparse_attn_prefill(q, kv_cache, kv_layout, topk_idx, block_table, cu_seqlens_q,
                         context_lens, k_scale, v_scale, out):
    batch = _prefill_batch(cu_seqlens_q, context_lens, q.shape[0], block_table)
    _attend(q, kv_cache, kv_layout, topk_idx, batch, 1, k_scale, v_scale, out)


# ---- Fake (meta) implementations: shapes only, nothing runs ----

def _fake_select(index_q, head_major, out, topk):
    rows, heads, _ = _shape(index_q, "index_q", 3)
    want = (heads, rows, topk) if head_major else (rows, heads, topk)
    if tuple(out.shape) != want:
        raise invalid(f"out: expected shape {list(want)}, got {list(out.shape)}")


def _fake_index_decode(index_q, index_cache, block_table, seq_lens, q_len, topk, init_blocks,
                       local_blocks, ascending, head_major, out):
    _fake_select(index_q, head_major, out, topk)


def _fake_index_prefill(index_q, index_cache, block_table, cu_seqlens_q, context_lens, topk,
                        init_blocks, local_blocks, ascending, head_major, out):
    _fake_select(index_q, head_major, out, topk)


def _fake_attend(q, kv_cache, kv_layout, out):
    _kv_geometry(kv_cache, kv_layout)
    if tuple(out.shape) != tuple(q.shape):
        raise invalid(f"out: expected shape {list(q.shape)} (that of q), got {list(out.shape)}")


def _fake_sparse_attn_decode(q, kv_cache, kv_layout, topk_idx, block_table, seq_lens, q_len,
                             k_scale, v_scale, out):
    _fake_attend(q, kv_cache, kv_layout, out)


def _fake_sparse_attn_prefill(q, kv_cache, kv_layout, topk_idx, block_table, cu_seqlens_q,
                              context_lens, k_scale, v_scale, out):
    _fake_attend(q, kv_cache, kv_layout, out)


_IMPLS = {
    "index_decode": (_index_decode, _fake_index_decode),
    "index_prefill": (_index_prefill, _fake_index_prefill),
    "sparse_attn_decode": (_sparse_attn_decode, _fake_sparse_attn_decode),
    "sparse_attn_prefill": (_sparse_attn_prefill, _fake_sparse_attn_prefill),
}

_OLD_TORCH = int(torch.__version__.split(".")[0]) < 2
_library = torch.library.Library("m3msa", "DEF")
for _name, _schema in _SCHEMAS.items():
    _run, _fake = _IMPLS[_name]
    _library.define(_schema)
    _library.impl(_name, _run, "CPU")
    _library.impl(_name, _run, "CUDA")
    _library.impl(_name, _fake, "Meta")
    if _OLD_TORCH:  # torch 1.x has no autograd fallthrough for meta tensors
        _library.impl(_name, _fake, "AutogradMeta")
