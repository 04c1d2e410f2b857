"""Per-step batch metadata (docs/spec.md section 3): the Python side of m3msa::BatchMeta."""

import numpy as np

from ._errors import invalid


def _as_array(value, dtype, name):
    """Python lists become NumPy arrays of the required dtype; arrays pass through untouched."""
    if value is None or not isinstance(value, (list, tuple)):
        return value
    try:
        return np.asarray(value, dtype=dtype)
    except (TypeError, ValueError) as error:
        raise invalid(f"{name}: cannot make an {np.dtype(dtype)} array of it: {error}") from None


def _length(array, name):
    shape = getattr(array, "shape", None)
    if shape is None or len(shape) != 1:
        raise invalid(f"{name}: expected a 1-d array, got {type(array).__name__}"
                      + ("" if shape is None else f" of shape {tuple(shape)}"))
    return int(shape[0])


class Batch:
    """The rows of one step and where they sit. Holds the caller's arrays (NumPy arrays, torch
    tensors, ...) without copying; they are read at each call. Build one with Batch.decode() or
    Batch.prefill().

    Fields (None = not given):
        kind: 'decode' or 'prefill'
        num_reqs, q_len (decode rows per request), num_tokens (prefill rows)
        seq_lens            [num_reqs] int32, decode: counts the q_len new tokens; 0 = padding
        cu_seqlens_q        [num_reqs + 1] int32, prefill: row offsets of each request
        context_lens        [num_reqs] int32, prefill: tokens cached before this chunk
        index_block_table   [num_reqs, max_blocks] int32 -> index-K cache page
        kv_block_table      [num_reqs, max_blocks] int32 -> main KV cache page
        slot_mapping        [rows] int64, main KV cache slot (page * block_size + offset), <0 skip
        index_slot_mapping  [rows] int64, index-K cache slot, <0 skip
    """

    __slots__ = ("kind", "num_reqs", "q_len", "num_tokens", "seq_lens", "cu_seqlens_q",
                 "context_lens", "index_block_table", "kv_block_table", "slot_mapping",
                 "index_slot_mapping")

    def __init__(self, kind, num_reqs, *, q_len=1, num_tokens=0, seq_lens=None,
                 cu_seqlens_q=None, context_lens=None, index_block_table=None,
                 kv_block_table=None, slot_mapping=None, index_slot_mapping=None):
        if kind not in ("decode", "prefill"):
            raise invalid(f"batch.kind must be 'decode' or 'prefill', got {kind!r}")
        self.kind = kind
        self.num_reqs = int(num_reqs)
        self.q_len = int(q_len)
        self.num_tokens = int(num_tokens)
        self.seq_lens = _as_array(seq_lens, np.int32, "batch.seq_lens")
        self.cu_seqlens_q = _as_array(cu_seqlens_q, np.int32, "batch.cu_seqlens_q")
        self.context_lens = _as_array(context_lens, np.int32, "batch.context_lens")
        self.index_block_table = _as_array(index_block_table, np.int32, "batch.index_block_table")
        self.kv_block_table = _as_array(kv_block_table, np.int32, "batch.kv_block_table")
        self.slot_mapping = _as_array(slot_mapping, np.int64, "batch.slot_mapping")
        self.index_slot_mapping = _as_array(index_slot_mapping, np.int64,
                                            "batch.index_slot_mapping")

    @classmethod
    def decode(cls, seq_lens, index_block_table=None, kv_block_table=None, *, q_len=1,
               slot_mapping=None, index_slot_mapping=None):
        """num_reqs requests of q_len rows each (1 + speculative tokens); row = req * q_len + j
        sits at position seq_lens[req] - q_len + j."""
        seq_lens = _as_array(seq_lens, np.int32, "batch.seq_lens")
        return cls("decode", _length(seq_lens, "batch.seq_lens"), q_len=q_len,
                   seq_lens=seq_lens, index_block_table=index_block_table,
                   kv_block_table=kv_block_table, slot_mapping=slot_mapping,
                   index_slot_mapping=index_slot_mapping)

    @classmethod
    def prefill(cls, cu_seqlens_q, context_lens, index_block_table=None, kv_block_table=None, *,
                num_tokens=None, slot_mapping=None, index_slot_mapping=None):
        """Variable-length chunks: row i of request r sits at context_lens[r] + i. num_tokens
        defaults to cu_seqlens_q[-1], which reads the array (a device sync for a GPU tensor:
        pass num_tokens explicitly there, and always under CUDA graph capture)."""
        cu_seqlens_q = _as_array(cu_seqlens_q, np.int32, "batch.cu_seqlens_q")
        context_lens = _as_array(context_lens, np.int32, "batch.context_lens")
        if num_tokens is None:
            if _length(cu_seqlens_q, "batch.cu_seqlens_q") == 0:
                raise invalid("batch.cu_seqlens_q: expected num_reqs + 1 entries, got 0")
            num_tokens = int(cu_seqlens_q[-1])
        return cls("prefill", _length(context_lens, "batch.context_lens"), num_tokens=num_tokens,
                   cu_seqlens_q=cu_seqlens_q, context_lens=context_lens,
                   index_block_table=index_block_table, kv_block_table=kv_block_table,
                   slot_mapping=slot_mapping, index_slot_mapping=index_slot_mapping)

    @property
    def num_rows(self):
        return self.num_reqs * self.q_len if self.kind == "decode" else self.num_tokens

    def __repr__(self):
        fields = [f"num_reqs={self.num_reqs}"]
        fields.append(f"q_len={self.q_len}" if self.kind == "decode"
                      else f"num_tokens={self.num_tokens}")
        for name in self.__slots__[4:]:
            value = getattr(self, name)
            if value is not None:
                fields.append(f"{name}={type(value).__name__}{tuple(getattr(value, 'shape', ()))}")
        return f"Batch.{self.kind}({', '.join(fields)})"
