"""CellShadow: which sequences hold which KV cells, for a library without a cell view.

The current llama.cpp has neither ``llama_kv_cache_view`` nor a used-cells counter. Its unified KV
cache gives one cell to each decoded token; ``seq_cp`` adds the destination to the source's cells
(shared, not copied); ``seq_rm`` drops a sequence from cells (a cell is free once no sequence holds
it); ``seq_add`` moves a cell's position for *every* sequence holding it (a position below 0 frees
the cell). :class:`~pyllama_kv._native.kv.CurrentContext` replays each of these calls here after
llama.cpp accepted it, so the count of used cells and which cells are shared are known as on the
mission pin. The physical cell order is not: the view lists the used cells first.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

_INF = 1 << 62


class CellShadow:
    """Per sequence ``{position: cell}``; per cell its position and its holders."""

    def __init__(self, n_cells: int, n_seq: int):
        self.n_cells = n_cells
        self.n_seq = n_seq
        self.seqs: dict[int, dict[int, int]] = {}
        self.holders: dict[int, set[int]] = {}
        self.pos: dict[int, int] = {}
        self._next = 0

    def used(self) -> int:
        return len(self.holders)

    def _drop(self, sid: int, c: int) -> None:
        h = self.holders[c]
        h.discard(sid)
        if not h:
            del self.holders[c], self.pos[c]

    def add(self, sids: Iterable[int], positions: Iterable[int]) -> None:
        """A decode placed one new cell for each (sequence, position)."""
        for s, p in zip(np.asarray(sids).tolist(), np.asarray(positions).tolist()):
            m = self.seqs.setdefault(s, {})
            old = m.get(p)
            if old is not None:
                self._drop(s, old)
            c = self._next
            self._next += 1
            m[p] = c
            self.holders[c] = {s}
            self.pos[c] = p

    def _range(self, sid: int, p0: int, p1: int) -> list[tuple[int, int]]:
        lo = 0 if p0 < 0 else p0
        hi = _INF if p1 < 0 else p1
        m = self.seqs.get(sid, {})
        return [(p, c) for p, c in m.items() if lo <= p < hi]

    def rm(self, sid: int, p0: int, p1: int) -> None:
        """seq_rm(sid, p0, p1) (sid < 0: every sequence)."""
        for s in (list(self.seqs) if sid < 0 else [sid]):
            m = self.seqs.get(s)
            if not m:
                continue
            for p, c in self._range(s, p0, p1):
                del m[p]
                self._drop(s, c)

    def cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """seq_cp(src, dst, p0, p1): dst also holds src's cells in the range."""
        if src == dst:
            return
        m = self.seqs.setdefault(dst, {})
        for p, c in self._range(src, p0, p1):
            old = m.get(p)
            if old is not None and old != c:
                self._drop(dst, old)
            m[p] = c
            self.holders[c].add(dst)

    def shift(self, sid: int, p0: int, p1: int, delta: int) -> None:
        """seq_add(sid, p0, p1, delta): the cells move for all their holders; below 0 they are freed."""
        if delta == 0:
            return
        moved = self._range(sid, p0, p1)
        for _p, c in moved:   # out of every holder's map first, so that moves cannot collide
            for h in self.holders[c]:
                if self.seqs[h].get(self.pos[c]) == c:
                    del self.seqs[h][self.pos[c]]
        for p, c in moved:
            q = p + delta
            if q < 0:
                del self.holders[c], self.pos[c]
                continue
            self.pos[c] = q
            for h in self.holders[c]:
                self.seqs[h][q] = c

    def clear(self) -> None:
        self.seqs.clear()
        self.holders.clear()
        self.pos.clear()

    def view(self) -> tuple[np.ndarray, np.ndarray]:
        """(pos (n,), seqs (n, n_seq)) as the mission view reads: -1 for a free cell, each used cell's
        holders (padded with -1); the used cells first, n = max(n_cells, used)."""
        n = max(self.n_cells, len(self.holders))
        pos = np.full(n, -1, dtype=np.int32)
        seqs = np.full((n, self.n_seq), -1, dtype=np.int32)
        for i, c in enumerate(sorted(self.holders, key=lambda c: (min(self.holders[c]), self.pos[c]))):
            pos[i] = self.pos[c]
            hs = sorted(self.holders[c])[:self.n_seq]
            seqs[i, :len(hs)] = hs
        return pos, seqs
