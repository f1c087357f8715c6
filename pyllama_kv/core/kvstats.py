"""KVStats: a snapshot of a context's KV cache, and the arithmetic that makes one from a cell view
and llama.cpp's counters (pure: :meth:`pyllama_kv.core.context.Context.kv_stats` reads the view)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["KVStats", "kv_stats"]


@dataclass(frozen=True)
class KVStats:
    """A snapshot of the KV cache. Counters are cumulative over the context's life and are None on a
    vanilla build (which lacks ``llama_kv_self_stats``)."""

    n_cells: int
    used_cells: int
    free_cells: int
    holes: int                 # free runs with a used cell after them (gaps a batch cannot span)
    largest_free_block: int    # the biggest batch that fits without a defrag
    fragmentation: float       # 1 - largest_free_block / free_cells (0: all free cells contiguous)
    defrags: int | None = None
    moves: int | None = None
    cells_moved: int | None = None
    graphs: int | None = None
    nodes: int | None = None           # graph nodes computed for defrags (0 on the host memcpy path)
    slot_retries: int | None = None
    slot_failures: int | None = None
    defrag_seconds: float | None = None   # time spent in defrags (patched build)

    def as_dict(self) -> dict:
        return asdict(self)


def kv_stats(seqs: np.ndarray, counters: dict | None) -> KVStats:
    """The stats of a cache whose cell view is ``seqs`` (n_cells rows, the first column -1 for a free
    cell) and whose patched-build counters are ``counters`` (None: a vanilla build)."""
    free = seqs[:, 0] < 0
    n = int(free.size)
    n_free = int(free.sum())
    largest = 0
    holes = 0
    if n_free:
        # runs of free cells
        d = np.diff(np.concatenate(([0], free.astype(np.int8), [0])))
        starts = np.flatnonzero(d == 1)
        ends = np.flatnonzero(d == -1)
        largest = int((ends - starts).max())
        holes = int((ends < n).sum())  # runs followed by a used cell
    extra: dict[str, Any] = {}
    if counters is not None:
        extra = dict(defrags=counters["n_defrags"], moves=counters["n_defrag_moves"],
                     cells_moved=counters["n_defrag_cells"], graphs=counters["n_defrag_graphs"],
                     nodes=counters["n_defrag_nodes"],
                     slot_retries=counters["n_slot_retries"], slot_failures=counters["n_slot_failures"],
                     defrag_seconds=counters["t_defrag_us"] / 1e6)
    frag = 0.0 if n_free == 0 else 1.0 - largest / n_free
    return KVStats(n_cells=n, used_cells=n - n_free, free_cells=n_free, holes=holes,
                   largest_free_block=largest, fragmentation=round(frag, 6), **extra)
