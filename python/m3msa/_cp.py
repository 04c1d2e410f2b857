"""The CPU model of the context-parallel indexer exchange (include/m3msa/cp.h, docs/cp.md): P
ranks as threads of this process, bit-identical to select_topk."""

from . import _m3msa
from ._api import _check_batch, _check_config, _empty
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
