"""The scheduler's view of one KV cache: a small interface, each method with its contract (in the
spirit of Ollama's ``kvcache.Cache``), and its implementation over a Context and a PrefixCache.

The scheduler only ever talks to this interface, so its tests can run against a fake as well as
the real context (tests/test_engine.py has one).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import numpy as np

from ..context import Context
from .tier import PagingPrefixCache, TierStats


class KVCache(Protocol):
    """What the scheduler needs of a KV cache. ``Seq`` handles are opaque and hashable."""

    @property
    def n_cells(self) -> int:
        """Cells in the cache."""

    @property
    def n_seq_ids(self) -> int:
        """Sequence ids for live sequences (idle cached prefixes excluded)."""

    def free_cells(self) -> int:
        """Cells no sequence holds now."""

    def free_ids(self) -> int:
        """Sequence ids that start() or fork() can take without evicting anything."""

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` an idle cached sequence holds (cells a start() would reuse)."""

    def start(self, tokens: Sequence[int]) -> tuple[Hashable, int]:
        """A new sequence for ``tokens``: a fork of the idle cached sequence with the longest common
        prefix (at most ``len(tokens) - 1`` of them, so at least one token is left to decode), or an
        empty sequence. Returns it and the number of tokens it already holds. Evicts other idle
        cached sequences when no id is free. LlamaError when no id can be had."""

    def fork(self, seq: Hashable) -> Hashable:
        """A new sequence sharing every cell of ``seq`` (no decode), with ``seq``'s logits."""

    def decode(self, batch: dict) -> dict:
        """Append ``{seq: tokens}`` in one continuous-batching step; ``{seq: logits}`` (float32,
        n_vocab) after each sequence's last token. Atomic: KVCacheFullError (no room, nothing
        changed) or another LlamaError."""

    def length(self, seq: Hashable) -> int:
        """Positions ``seq`` holds."""

    def shift(self, seq: Hashable, n_keep: int, n_discard: int) -> bool:
        """Context shift without a decode: drop positions [n_keep, n_keep + n_discard) of ``seq`` and
        move the later ones down by ``n_discard`` (a K-shift of their cells), so that ``seq`` holds
        0..n-1 again. False, with nothing changed, where that cannot be done in place: a cache that
        cannot K-shift, or a tail whose cells another sequence shares (the caller then truncates
        and re-evaluates)."""

    def truncate(self, seq: Hashable, n: int) -> None:
        """Keep the first ``n`` positions of ``seq`` and free the rest (cells shared with another
        sequence stay for it)."""

    def finish(self, seq: Hashable, keep: bool) -> None:
        """Done with ``seq``: kept as an idle cached sequence for later prefixes when ``keep`` (it may be
        evicted any time), else closed. Its id is free for start()/fork() either way."""

    def remember(self, seq: Hashable) -> None:
        """Keep a copy of ``seq``'s current tokens as an idle cached prefix, if an id is free for it;
        ``seq`` stays the caller's."""

    def evict(self, keep_for: Sequence[int] | None = None) -> bool:
        """Close the least recently used idle cached sequence (not the best match for ``keep_for``);
        False when there is none."""


class ContextKV:
    """:class:`KVCache` over a :class:`~pyllama_kv.context.Context`: ``parallel`` ids for live
    sequences, the rest of the context's ids for a :class:`~pyllama_kv.prefix.PrefixCache`."""

    def __init__(self, ctx: Context, parallel: int, prefix_cache: int, cache_ram: int = 0):
        self.ctx = ctx
        self.parallel = parallel
        # evicted idle prefixes are paged out to a host tier of ``cache_ram`` MiB (0: dropped)
        self.cache = PagingPrefixCache(ctx, prefix_cache, cache_ram)
        self._live = 0

    @property
    def n_cells(self) -> int:
        return self.ctx.n_ctx

    @property
    def n_seq_ids(self) -> int:
        return self.parallel

    def free_cells(self) -> int:
        return self.ctx.free_cells()

    def free_ids(self) -> int:
        return min(self.parallel - self._live, self.ctx.free_sequence_ids)

    def cached_prefix(self, tokens) -> int:
        return self.cache.longest(tokens)

    def start(self, tokens):
        seq, n = self.cache.fork_prefix(tokens)
        self._live += 1
        # a longer prefix paged out to host memory is restored (a memcpy), not evaluated; the cells
        # it takes were counted as prompt tokens to decode when the request was admitted
        n += self.cache.restore_into(seq, tokens, len(tokens) - 1)
        return seq, n

    def fork(self, seq):
        while True:
            try:
                child = seq.fork()
                break
            except Exception:
                if not self.cache.evict():
                    raise
        self._live += 1
        return child

    def decode(self, batch: dict) -> dict:
        return self.ctx.decode(batch)

    def length(self, seq) -> int:
        return len(seq)

    @property
    def can_shift(self) -> bool:
        """Whether this cache K-shifts at all: the library says so (llama_kv_self_can_shift: a RoPE
        model, and a cache type the device holding K can rotate), and it is the patched build (the
        vanilla one aborts on the K-shift of some cache types while saying it can: patches/0009)."""
        return bool(self.ctx.can_shift and self.ctx.patched)

    def shift(self, seq, n_keep: int, n_discard: int) -> bool:
        if not self.can_shift:
            return False
        ctx = self.ctx
        with ctx._critical():
            end = n_keep + n_discard
            if end < len(seq) and ctx._shared_in(seq.id, end, len(seq)):
                return False   # copy-on-write: the engine re-evaluates the tail into cells of its own
            seq.remove(n_keep, end)
        return True

    def truncate(self, seq, n: int) -> None:
        seq.truncate(n)

    def finish(self, seq, keep: bool) -> None:
        self._live -= 1
        if seq.closed:
            return
        if keep and len(seq) and self.cache.max_sequences > 0:
            self.cache.release(seq, keep=True)
        else:
            seq.close()

    def remember(self, seq) -> None:
        self.cache.remember(seq)

    def evict(self, keep_for=None) -> bool:
        return self.cache.evict(keep_for=keep_for)

    def tier_stats(self) -> dict:
        """The host tier's counters (pyllama_kv.engine.tier.TierStats, ``enabled``, ``off_reason``)."""
        return self.cache.tier_stats()

    @property
    def tier_info(self) -> TierStats:
        """The host tier's live counters (the engine's ``stats.prefix_tier``)."""
        return self.cache.tier_info

    def logits_of(self, seq) -> np.ndarray:
        return seq.logits()


class HoldingKV(ContextKV):
    """:class:`ContextKV` whose finished sequences keep their cells until :meth:`release`: for a
    caller that reads the cache (stats, a map) after its requests are done and before they free.
    When the engine needs room (it evicts), held sequences are finished first, oldest first."""

    def __init__(self, ctx: Context, parallel: int, prefix_cache: int):
        super().__init__(ctx, parallel, prefix_cache)
        self.held: list[tuple[Hashable, bool]] = []

    def finish(self, seq, keep: bool) -> None:
        self.held.append((seq, keep))

    def evict(self, keep_for=None) -> bool:
        # the engine needs cells or ids (a preempted continuation is "finished" too): what is held
        # goes first, or a preemption would free nothing and the engine would wait for ever
        if self.held:
            seq, keep = self.held.pop(0)
            super().finish(seq, keep)
            return True
        return super().evict(keep_for=keep_for)

    def release(self) -> None:
        """Finish what was held (as ContextKV.finish would have)."""
        held, self.held = self.held, []
        for seq, keep in held:
            super().finish(seq, keep)
