"""The context-parallel indexer: the CPU model of its exchange (include/m3msa/cp_model.h,
docs/context_parallel.md; P ranks as threads of this process) and one rank of the CUDA one (cp_cuda.h), both
bit-identical to select_topk."""

import sys

from . import _m3msa
from ._api import _arg, _check_batch, _check_config, _empty, _resolve_stream
from ._errors import unsupported

_MICROSECONDS_DEFAULT = 500_000  # cp.h kDefaultCpSpinBudget


def _require_cp():
    if not _m3msa.has_cp:
        raise unsupported("the CP CPU selector is not in this build (src/cp was not built)")


class CpSelector:
    """P ranks of the CP indexer over one world; every call runs all ranks (one thread each) and
    assembles the full selection.

    config: the one-GPU SparseConfig (all H index heads), world_size: P, max_rows: the most rows a
    call may pass; spin_budget_us bounds every wait (expiry raises m3msa.Error with code
    'timeout'); threads: CPU threads each rank scores with.
    """

    def __init__(self, config, world_size, max_rows, *, spin_budget_us=_MICROSECONDS_DEFAULT,
                 threads=1):
        _require_cp()
        _check_config(config)
        self.config = config
        self._group = _m3msa.CpuCpGroup(config, world_size, max_rows, spin_budget_us, threads)

    @property
    def world_size(self):
        return self._group.world_size

    def merged_heads(self, rank):
        """The global index heads rank `rank` merges, ascending."""
        return self._group.merged_heads(rank)

    def generation(self, rank=0):
        """Calls made so far on the rank's buffer set."""
        return self._group.generation(rank)

    def __call__(self, index_q, index_cache, batch, out=None, *, layer=0):
        """select_topk() through the CP exchange: out [rows, H, k] int32. Returns out."""
        _check_batch(batch)
        if out is None:
            out = _empty(index_q, (batch.num_rows, self.config.index_heads, self.config.topk),
                         "i32", "out")
        self._group.select_all(layer, index_q, index_cache, batch, out)
        return out


def cp_merged_heads(world_size, index_heads, rank):
    _require_cp()
    return _m3msa.cp_merged_heads(world_size, index_heads, rank)


def cp_consumers(world_size, index_heads, head):
    _require_cp()
    return _m3msa.cp_consumers(world_size, index_heads, head)


class CudaCpIndexer:
    """One rank of the context-parallel indexer on the GPU (include/m3msa/cp_cuda.h,
    docs/context_parallel.md): this rank scores every index head over its round-robin shard of the blocks, the ranks exchange
    their nominations and this rank merges the exact top-k of the heads it attends
    (merged_heads), bit-identical to select_topk on one GPU.

    world: 'env' - one rank per process (the engine's layout): RANK, WORLD_SIZE, MASTER_ADDR,
           MASTER_PORT and LOCAL_RANK from the environment bootstrap an NCCL communicator (every
           rank constructs together: construction is collective); 'single' - one rank, this
           process only (world size 1).
    transport: 'peer', 'nccl', 'replicated' or 'allreduce-max' (cp_cuda.h).
    max_reqs, max_q_len, max_context: the largest decode batch (sizes every buffer up front).
    device: this rank's GPU (None: LOCAL_RANK % visible devices for 'env', 0 for 'single').
    spin_budget_us bounds every device-side wait; timeout_ms every host-side one. An expired wait
    raises m3msa.TimeoutError naming the rank that never delivered (from check()).

    select() allocates nothing and never synchronizes the host: it can be captured into a CUDA
    graph. Every rank must make the same calls with the same shapes in the same order.
    """

    def __init__(self, config, *, max_reqs, max_q_len=1, max_context, transport="peer",
                 world="env", device=None, spin_budget_us=_MICROSECONDS_DEFAULT,
                 timeout_ms=30_000):
        _check_config(config)
        self.config = config
        self._rank = _m3msa.CudaCpRank(config, world, -1 if device is None else int(device),
                                       int(max_reqs), int(max_q_len), int(max_context),
                                       transport, int(spin_budget_us), int(timeout_ms))

    rank = property(lambda self: self._rank.rank)
    world_size = property(lambda self: self._rank.world_size)
    device = property(lambda self: self._rank.device)
    merged_heads = property(lambda self: list(self._rank.merged_heads))

    def select(self, index_q, index_cache, batch, out=None, *, layer=0, stream=None):
        """One decode indexer call: index_q [rows, H, D] bf16 and the full index cache on this
        rank's GPU; out [rows, len(merged_heads), k] int32, the selections of merged_heads.
        Returns out."""
        _check_batch(batch)
        if out is None:
            out = _empty(index_q, (batch.num_rows, len(self.merged_heads), self.config.topk),
                         "i32", "out")
        self._rank.select(int(layer), _arg(index_q), _arg(index_cache), batch, out,
                          _resolve_stream(index_q, stream))
        return out

    __call__ = select

    def check(self, *, stream=None):
        """Synchronizes the stream and raises m3msa.TimeoutError if a wait of an earlier call
        expired (the rank is then out of lockstep: build a new group)."""
        if stream is None and "torch" in sys.modules:
            stream = sys.modules["torch"].cuda.current_stream(self.device)
        self._rank.check(None if stream is None else int(getattr(stream, "cuda_stream", stream)))

    def close(self):
        """Releases this rank's buffers and communicator now (collective when the ranks are
        processes: every rank closes); later calls raise. Garbage collection does the same."""
        self._rank.close()

    def generation(self):
        """Calls made so far on this rank's buffer set (synchronizes the device)."""
        return int(self._rank.generation())
