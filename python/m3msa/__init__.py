"""m3msa: MiniMax-M3 sparse attention (MSA) decode from Python.

    import m3msa
    cfg = m3msa.SparseConfig()                       # MiniMax-M3 defaults
    idx = m3msa.select_topk(cfg, index_q, index_cache, batch)
    out = m3msa.sparse_attention(cfg, q, kv_cache, batch, idx)

Tensors are taken zero-copy through DLPack (torch tensors, NumPy arrays, ...) or the buffer
protocol. NumPy has no bfloat16 / float8: pass their bits as uint16 / uint8 arrays tagged with
m3msa.view(array, 'bf16' | 'fp8') (as_bf16() / as_fp8() convert floats, to_float32() decodes).
Every failure raises m3msa.Error with .code 'invalid_argument', 'unsupported', 'timeout' or
'internal' and a message naming the argument; the instance is InvalidArgumentError (a ValueError),
UnsupportedError (a NotImplementedError), TimeoutError (a builtins.TimeoutError) or InternalError.

On torch CUDA tensors the calls run on the CUDA backend, on torch's current stream; pass
plan=m3msa.CudaPlan(...) for calls that allocate nothing and never synchronize the host, which
torch.cuda.graph can capture.

Submodules (they import torch): m3msa.torch registers the operations as torch.library ops
(torch.ops.m3msa.*, for torch.compile and CUDA graphs); m3msa.vllm serves vLLM's MiniMax-M3 decode
entry points and holds the vLLM plugin (docs/vllm.md).
"""

from . import _m3msa

__version__ = _m3msa.__version__  # the CMake project version, compiled into the module
from ._errors import (Error, InternalError, InvalidArgumentError, TimeoutError, UnsupportedError,
                      make_error)

_m3msa._set_error_type(make_error)

from ._api import (CudaPlan, ModelConfig, SparseConfig, SyntheticCase, dense_attention, info,
                   nominate, preprocess, score_blocks, select_topk, sparse_attention,
                   synthetic_case)
from ._batch import Batch
from ._cp import CpSelector, CudaCpIndexer, cp_consumers, cp_merged_heads
from ._runtime import Communicator, LayerWeights, Runtime, RuntimeConfig, ThreadGroup
from ._dtypes import (TypedView, as_bf16, as_fp8, bf16_bits_to_float32, float32_to_bf16_bits,
                      float32_to_fp8_bits, fp8_bits_to_float32, to_float32, view)

__all__ = [
    "Batch", "Communicator", "CpSelector", "CudaCpIndexer", "CudaPlan", "Error", "InternalError",
    "InvalidArgumentError", "LayerWeights", "ModelConfig", "Runtime", "RuntimeConfig",
    "SparseConfig", "SyntheticCase", "ThreadGroup", "TimeoutError", "TypedView",
    "UnsupportedError",
    "as_bf16", "as_fp8", "bf16_bits_to_float32", "cp_consumers", "cp_merged_heads",
    "dense_attention", "float32_to_bf16_bits", "float32_to_fp8_bits", "fp8_bits_to_float32",
    "info", "nominate", "preprocess", "score_blocks", "select_topk", "sparse_attention",
    "synthetic_case", "to_float32", "view",
]
