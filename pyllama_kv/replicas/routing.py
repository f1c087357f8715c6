"""Routing by cache: which replica should serve a request, from what each replica says it holds.

A replica of ``pyllama-kv serve`` publishes its prefix cache's changes as KV events
(``--kv-events``, :mod:`pyllama_kv.prefixcache.events`: blocks of ``block_size`` tokens named by
chained hashes, per medium). :class:`CacheRouter` keeps one :class:`ReplicaView` per replica, built
from those events alone, and ranks the replicas for a request's tokens:

1. **The cache first.** The replica holding the longest run of the request's leading blocks (in any
   medium: the context's cells, host memory or disk; a restore is a copy, far cheaper than evaluating;
   of equal runs, the one holding more of it in its cells, then in host memory) comes first, so a
   conversation's next turn goes where its earlier turns are cached, and requests under one system
   prompt go where that prompt is.
2. **Unless its queue is long.** A replica whose load (requests waiting and running) exceeds the
   least loaded one's by more than ``max_imbalance`` is not chosen for its cache: a long queue costs
   more than evaluating a prefix again. Then the two least loaded of the rest compete (power of two
   choices, by load).
3. **New prefixes spread, and stay together.** A request whose first block no replica holds goes to
   the replica its first block hashes to among the least loaded (rendezvous hashing), so a burst of
   requests under a new system prompt lands on one replica (which evaluates the prompt once) while
   different new prompts spread over the replicas.

:meth:`CacheRouter.rank` returns every candidate, best first (the rest by load), so a caller that
finds the first full tries the next. Pure and thread-unsafe: one owner feeds it events and loads and
asks it (the Ray Serve request router, :mod:`pyllama_kv.replicas.ray_serve`, or any other front).
Fed by reports instead of events (:meth:`CacheRouter.replace`: every block a replica holds, as the
Ray Serve replicas report them), it also counts a request's blocks as held where it was just sent
(:meth:`CacheRouter.assume`), so that a burst of requests under a new prompt does not spread before
the first report shows it.
"""
from __future__ import annotations

import hashlib
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from ..prefixcache.events import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, block_hashes

__all__ = ["CacheRouter", "ReplicaView", "Route"]


class ReplicaView:
    """What one replica holds: from its KV events (applied in the order they were sent) or from its
    latest report of every block it holds (:meth:`replace`); and the blocks the router sent it lately
    (:meth:`assume`: their prompts are being evaluated there, and its next reports may not show them
    yet), which count as held until two later reports."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {m: set() for m in MEDIA}
        self.events = 0
        self.reports = 0
        self.assumed: dict[int, int] = {}   # block hash -> the report count when it was assumed

    def apply(self, events: Iterable) -> None:
        for e in events:
            self.events += 1
            if isinstance(e, AllBlocksCleared):
                for s in self.held.values():
                    s.clear()
            elif isinstance(e, BlockRemoved):
                self.held.setdefault(e.medium, set()).difference_update(e.block_hashes)
            elif isinstance(e, BlockStored):
                self.held.setdefault(e.medium, set()).update(e.block_hashes)

    def clear(self) -> None:
        """Forget everything (the replica restarted, or its events were lost)."""
        for s in self.held.values():
            s.clear()
        self.assumed.clear()

    def replace(self, held: dict[str, Iterable[int]]) -> None:
        """The replica's report of every block it holds now, by medium (what it does not list, it
        does not hold); assumed blocks older than the report before this one are dropped."""
        self.held = {m: set(held.get(m, ())) for m in set(MEDIA) | set(held)}
        self.reports += 1
        self.assumed = {h: n for h, n in self.assumed.items() if n >= self.reports - 1}

    def assume(self, hashes: Iterable[int]) -> None:
        """Blocks a request just sent here will hold (see the class docstring)."""
        for h in hashes:
            self.assumed[h] = self.reports

    def matched(self, hashes: Sequence[int], media: Sequence[str] | None = None) -> int:
        """How many of ``hashes`` (a request's leading blocks, in order) this replica holds in a row
        from the first, in any medium (or in ``media`` alone; assumed blocks count as the device's)."""
        held, assumed = self.held, self.assumed
        sets = [held[m] for m in (held if media is None else media) if m in held]
        n = 0
        for h in hashes:
            if h not in assumed and not any(h in s for s in sets):
                break
            n += 1
        return n


@dataclass
class Route:
    """A ranking: ``order`` best first, ``matched_blocks`` of the first, and why it is first
    (``"cache"``, ``"load"``: the cache's replica was too busy, ``"new"``: no replica held the first
    block)."""

    order: list[Hashable]
    matched_blocks: int = 0
    reason: str = "new"
    matches: dict[Hashable, int] = field(default_factory=dict)


def _rendezvous(key: int, replica: Hashable) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}:{replica!r}".encode(), digest_size=8).digest(), "big")


class CacheRouter:
    """Ranks replicas for a request by their cached blocks and their loads (see the module docstring)."""

    def __init__(self, block_size: int = 16, max_imbalance: int = 4):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not isinstance(max_imbalance, int) or max_imbalance < 0:
            raise ValueError(f"max_imbalance must be a non-negative integer, got {max_imbalance!r}")
        self.block_size = block_size
        self.max_imbalance = max_imbalance
        self.views: dict[Hashable, ReplicaView] = {}
        self.loads: dict[Hashable, int] = {}

    def view(self, replica: Hashable) -> ReplicaView:
        v = self.views.get(replica)
        if v is None:
            v = self.views[replica] = ReplicaView()
        return v

    def apply(self, replica: Hashable, events: Iterable) -> None:
        """``replica``'s KV events, in the order it sent them."""
        self.view(replica).apply(events)

    def replace(self, replica: Hashable, held: dict[str, Iterable[int]]) -> None:
        """``replica``'s report of every block it holds, by medium (:meth:`ReplicaView.replace`)."""
        self.view(replica).replace(held)

    def assume(self, replica: Hashable, tokens: Sequence[int]) -> None:
        """A request for ``tokens`` was sent to ``replica``: its blocks count as held there until its
        reports catch up (:meth:`ReplicaView.assume`)."""
        self.view(replica).assume(block_hashes(tokens, self.block_size))

    def forget(self, replica: Hashable) -> None:
        """``replica`` is gone (or restarted: its cache is empty until its events say otherwise)."""
        self.views.pop(replica, None)
        self.loads.pop(replica, None)

    def set_load(self, replica: Hashable, load: int) -> None:
        """Requests waiting and running on ``replica`` now."""
        self.loads[replica] = max(0, int(load))

    def rank(self, tokens: Sequence[int], candidates: Sequence[Hashable]) -> Route:
        """Every candidate, best first, for a request whose prompt is ``tokens``."""
        cands = list(dict.fromkeys(candidates))
        if not cands:
            return Route([])
        load = {r: self.loads.get(r, 0) for r in cands}
        hashes = block_hashes(tokens, self.block_size)
        matches = {r: self.view(r).matched(hashes) for r in cands}
        # of equal matches, the one holding more of it nearer: its cells, then host memory (a shared
        # disk tier's blocks are every replica's; restoring from it costs more than a fork)
        near = {r: (self.view(r).matched(hashes, ("GPU",)), self.view(r).matched(hashes, ("GPU", "CPU")))
                for r in cands if matches[r]}
        least = min(load.values())
        by_load = sorted(cands, key=lambda r: (load[r], -matches[r], repr(r)))
        fit = [r for r in cands if load[r] - least <= self.max_imbalance]
        best = max(fit, key=lambda r: (matches[r], near.get(r, (0, 0)), -load[r], repr(r)))
        if matches[best] > 0:
            reason = "cache" if max(matches.values()) == matches[best] else "load"
            first = best
        elif max(matches.values()) > 0:   # the replicas holding it are all too busy
            first, reason = self._two_choices(hashes, fit, load), "load"
        else:
            first, reason = self._new(hashes, fit, load), "new"
        order = [first] + [r for r in by_load if r != first]
        return Route(order, matches[first], reason, matches)

    def _new(self, hashes: Sequence[int], fit: list, load: dict) -> Hashable:
        """A prefix no replica holds: among the least loaded, the one its first block hashes to."""
        if not hashes:
            return min(fit, key=lambda r: (load[r], repr(r)))
        least = min(load[r] for r in fit)
        pool = [r for r in fit if load[r] == least]
        return max(pool, key=lambda r: _rendezvous(hashes[0], r))

    @staticmethod
    def _two_choices(hashes: Sequence[int], fit: list, load: dict) -> Hashable:
        """Power of two choices: of two replicas picked by the request's first block, the less loaded."""
        key = hashes[0] if hashes else 0
        two = sorted(fit, key=lambda r: _rendezvous(key, r))[-2:]
        return min(two, key=lambda r: (load[r], repr(r)))
