"""The second part of :class:`~pyllama_kv.core.context.Context` (see :mod:`.context_base`): cache
maintenance (defrag, clear) and inspection (the cell view, occupancy, stats, who holds which cells)."""
from __future__ import annotations

import numpy as np

from ..errors import LlamaError
from .context_base import ContextBase
from .kvstats import KVStats


class ContextCells(ContextBase):
    """Maintenance and inspection of a :class:`~.context.Context`'s cells."""

    # -- cache maintenance ----------------------------------------------------------------------

    def defrag(self) -> KVStats:
        """Pack all used cells to the front of the cache now; return the stats after it.

        On a vanilla build this refuses (LlamaError) when the library would abort the process
        (cells in use past n_ctx - n_ubatch and holes to fill: see patches/0003). A library without
        defrag (``caps.defrag`` False: it writes batches into non-contiguous cells, so a batch fits
        whenever enough cells are free) does nothing here.
        """
        with self.critical():
            self.check_open()
            if not self.caps.defrag:
                return self.kv_stats()
            if not self.caps.safe_defrag:
                pos, seqs = self._read_view()
                used = seqs[:, 0] >= 0
                n_used = int(used.sum())
                holes = n_used and not used[:n_used].all()
                if holes and n_used + min(self.n_ctx, self.n_ubatch) > self.n_ctx:
                    raise LlamaError(
                        "the vanilla build would abort the process on this defrag (its worst-case graph runs past the "
                        f"end of the cache: {n_used} used cells + n_ubatch {self.n_ubatch} > n_ctx {self.n_ctx}); "
                        "use the patched build"
                    )
            assert self._native is not None
            self._native.defrag()
            self._c_update()
            return self.kv_stats()

    def clear(self) -> None:
        """Empty the cache; every open sequence becomes empty (its id stays reserved)."""
        with self.critical():
            self.check_open()
            assert self._native is not None
            self._native.clear()
            for e in self._table.values():
                e.tokens.clear()
                e.logits = None

    # -- inspection -----------------------------------------------------------------------------
    def kv_view(self) -> tuple[np.ndarray, np.ndarray]:
        """(pos, seqs): per cell its position (-1 when free) and the ids of the sequences holding it,
        shape (n_cells, n_seq_max), padded with -1. A pending K-shift is applied first, so positions
        are exact."""
        with self.critical():
            self.check_open()
            self._need("cell_view", "the cell view")
            self._apply_shifts()
            pos, seqs = self._read_view()
        # the view has a column more, for the spare id, which holds no cell between calls
        return pos, np.ascontiguousarray(seqs[:, :self.n_seq_max])

    def kv_cells(self) -> np.ndarray:
        """Per-cell occupancy, int32 (n_cells,): -1 free, -2 shared by several sequences, else the id
        of the one sequence holding the cell."""
        with self.critical():
            self.check_open()
            self._need("cell_view", "the cell view")
            _, seqs = self._read_view()
        occ = seqs[:, 0].copy()
        shared = (seqs >= 0).sum(axis=1) > 1
        occ[shared] = -2
        return occ

    def cell_holders(self) -> np.ndarray:
        """The ids of the sequences holding each cell, int32 (n_cells, n_seq_max), padded with -1 (a free
        cell: all -1). Which cells are shared and how many each sequence holds, on every library; the
        rows are in cache order only where ``caps.cell_view`` (see :meth:`kv_view`)."""
        with self.critical():
            self.check_open()
            _, seqs = self._read_view()
        return np.ascontiguousarray(seqs[:, :self.n_seq_max])

    def shared_in(self, sid: int, lo: int, hi: int) -> bool:
        """Whether any cell of sequence ``sid`` with position in [lo, hi) is held by another sequence too
        (a tail that cannot be K-shifted in place). Call it inside ``critical()``."""
        self._apply_shifts()
        pos, seqs = self._read_view()
        mine = (seqs == sid).any(axis=1) & (pos >= lo) & (pos < hi)
        if not mine.any():
            return False
        return bool(((seqs[mine] >= 0).sum(axis=1) > 1).any())

    def _exclusive_cells(self, sid: int, lo: int) -> int:
        self._apply_shifts()
        pos, seqs = self._read_view()
        mine = (seqs == sid).any(axis=1) & (pos >= lo)
        return int((mine & ((seqs >= 0).sum(axis=1) == 1)).sum())
