"""The engine's KV layer: the one owner of the KV policy (as vLLM v1's KV cache manager is).

The scheduler decides *who* runs; this layer decides *what the cache keeps*. The scheduler asks it
for a prefix match (:meth:`KVCache.match`) and for room (:meth:`KVCache.reserve` at admission,
:meth:`KVCache.make_room` when a decode found none), and preempts a continuation when told there is
no room. It never evicts anything itself and never reaches the context behind the cache.

**The eviction rule is the prefix cache's** (:mod:`pyllama_kv.prefixcache.eviction`, written once
for the API's :class:`~pyllama_kv.prefixcache.cache.PrefixCache` and this layer alike): room is made
by evicting *idle cached prefixes* (prompts and finished conversations kept for reuse; never a
sequence a request holds), least recently used first, never the best match of the prompt being
placed. An evicted prefix is paged out to the host tier when the KV has one (its cells are copied to
host memory, and a later prompt restores them instead of evaluating them again), and dropped
otherwise.

**What the engine adds** (:class:`PrefixPolicy`, around that rule): reservations (reserve() evicts
until the prompt's cells and the cells promised to running requests fit, make_room() until a decode
fits) and the hold-back at admission: the idle prefix that is the best match for the prompt being
placed goes last, and only when no live sequence could free cells later (nothing else would make
room). :class:`HoldingKV` finishes the sequences it holds back before anything idle is evicted.

:class:`ContextKV` implements the interface over a :class:`~pyllama_kv.core.context.Context` and a
:class:`~pyllama_kv.prefixcache.cache.PrefixCache` it holds (composition: it evicts through
``PrefixCache.evict``); tests/test_kv_policy.py drives the same policy and the scheduler over a fake
in pure Python, without a model.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

import numpy as np

from ..core.context import Context
from ..limits import (
    CHECKPOINT_INTERVAL,
    CHECKPOINT_MIN_TOKENS,
    CHECKPOINT_PERIODIC,
    IDLE_PAGE_OUT_MIN,
    IDLE_PAGE_OUT_TOKENS,
)
from ..prefixcache.cache import PrefixCache
from ..prefixcache.tiers import TierStats


class KVCache(Protocol):
    """What the scheduler needs of a KV cache. ``Seq`` handles are opaque and hashable."""

    @property
    def n_cells(self) -> int:
        """Cells in the cache."""

    @property
    def parallel(self) -> int:
        """Sequence ids for live sequences (idle cached prefixes excluded): EngineConfig.parallel."""

    @property
    def context(self) -> Context | None:
        """The context this cache is (for llama.cpp's samplers, which need one), or None (a fake)."""

    def free_cells(self) -> int:
        """Cells no sequence holds now."""

    def free_ids(self) -> int:
        """Sequence ids that start() or fork() can take without evicting anything."""

    def match(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the cache can give a start() without evaluating them: held by an
        idle cached prefix (shared cells) or paged out to the host or disk tier (restored by a copy; the
        disk's by its index of files, unread)."""

    def reserve(self, tokens: Sequence[int], n_cells: int, n_ids: int) -> bool:
        """Make room for a start(``tokens``) (the tokens beyond the idle prefix it would share), plus
        ``n_cells`` more cells, plus ``n_ids`` free sequence ids, evicting idle cached prefixes by
        the module's rule; True when that room is there now, False when it cannot be had without a
        live sequence ending (what could be evicted has been). Nothing is promised past this call:
        the caller counts what it has promised to running requests into ``n_cells``."""

    def make_room(self, n_cells: int) -> bool:
        """A decode of ``n_cells`` tokens found no room: evict idle cached prefixes by the module's
        rule (no match is kept) until ``n_cells`` cells are free. True when they are (decode again),
        False when they are not and nothing is left to evict (the caller preempts)."""

    def start(self, tokens: Sequence[int]) -> tuple[Hashable, int]:
        """A new live sequence for ``tokens``: a fork of the idle cached sequence with the longest common
        prefix (at most ``len(tokens) - 1`` of them, so at least one token is left to decode), extended
        by what the host and disk tiers hold beyond it (restored, not evaluated), or an empty sequence.
        Returns it and the number of tokens it already holds. Call after reserve() said yes;
        LlamaError when no id can be had."""

    def fork(self, seq: Hashable) -> Hashable:
        """A new live sequence sharing every cell of ``seq`` (no decode), with ``seq``'s logits. Its id
        was counted in reserve()'s ``n_ids``; an idle prefix remembered since may hold it, and is then
        evicted. LlamaError when no id can be had."""

    def decode(self, batch: dict, outputs: dict | None = None, greedy: Sequence[Hashable] = (),
               between: Callable[[], None] | None = None) -> dict:
        """Append ``{seq: tokens}`` in one continuous-batching step; ``{seq: logits}`` (float32,
        n_vocab) after each sequence's last token, read-only and valid only until the next decode
        (sample them first); for a sequence of ``outputs`` ``{seq: n}``, an (n, n_vocab) array: the
        logits after each of its last n tokens (a draft's verification). For a sequence of ``greedy``
        the argmax token instead (an int; with ``outputs``, a list): chosen in the graph where the
        library can (Context.decode). ``between`` is called once the decode is under way, before its
        outputs are read (Context.decode: the engine's pipelined loop); it touches no sequence. Atomic:
        KVCacheFullError (no room, nothing changed) or another LlamaError."""

    def shift(self, seq: Hashable, n_keep: int, n_discard: int) -> bool:
        """Context shift without a decode: drop positions [n_keep, n_keep + n_discard) of ``seq`` and
        move the later ones down by ``n_discard`` (a K-shift of their cells), so that ``seq`` holds
        0..n-1 again. False, with nothing changed, where that cannot be done in place: a cache that
        cannot K-shift, a tail whose cells another sequence shares, or a sliding-window cache that no
        longer holds the window of position ``n_keep`` (the caller then truncates and re-evaluates)."""

    def truncate(self, seq: Hashable, n: int) -> None:
        """Keep the first ``n`` positions of ``seq`` and free the rest (cells shared with another
        sequence stay for it). InvalidInputError, nothing changed, where its memory cannot go back to
        ``n`` (Context.can_fork: recurrent layers, a sliding-window cache that reused older cells); 0
        always works."""

    def finish(self, seq: Hashable, keep: bool) -> None:
        """Done with live ``seq``: kept as an idle cached prefix for later prompts when ``keep`` (it may
        be evicted any time), else closed. Its id is free for start()/fork() either way."""

    def remember(self, seq: Hashable) -> None:
        """Keep a copy of live ``seq``'s current tokens as an idle cached prefix, if an id is free for
        it; ``seq`` stays the caller's."""

    def checkpoints_at(self, tokens: Sequence[int], boundaries: Sequence[int], held: int) -> list[int]:
        """Where a start()ed sequence for ``tokens`` holding ``held`` of them should keep a checkpoint
        of its state while the rest is evaluated (a model with recurrent layers or a sliding-window
        cache: the caller's turn ``boundaries`` and where ``tokens`` leave the longest cached
        prefix; PrefixCache.keeps_checkpoints), ascending, in [held, len(tokens)) (``held`` itself: the
        sequence holds the point's tokens already, as a fork that ends where the prompt branches);
        [] for a cache that keeps none."""

    def checkpoint(self, seq: Hashable) -> None:
        """Keep a checkpoint of live ``seq``'s state after its current tokens (see checkpoints_at)."""

    def page_out_idle(self, decoded: int, upcoming: int = 0) -> int:
        """Called before every decode with ``decoded``, the tokens the engine has decoded so far, and
        ``upcoming``, those of the decode about to run: page out the idle cached prefixes that will
        have gone unused while ``limits.IDLE_PAGE_OUT_TOKENS`` tokens were decoded by the end of it and
        whose cells running sequences do not share (see limits), so that the decode neither attends
        over their cells nor places its new tokens above them (looked at once every
        IDLE_PAGE_OUT_TOKENS // 2 tokens or more); how many went. 0 where evicted prefixes would be
        dropped (no host tier)."""

    def kv_stats(self) -> dict:
        """The cache's cells for metrics (``KVStats.as_dict()``, plus ``cached_cells``: held by idle
        cached prefixes, and ``request_cells``: held by live sequences alone; where the prefix cache
        keeps checkpoints, PrefixCache.checkpoint_stats() too); {} when there are none to report.
        Call between steps (Engine.between_steps), never beside a decode."""


class PrefixPolicy(ABC):
    """The engine's reservations and hold-back at admission (see the module docstring), written once
    over primitives a cache provides: :meth:`_evict_idle` is the prefix cache's one eviction rule
    (:meth:`pyllama_kv.prefixcache.eviction.IdlePrefixes.evict`, for ContextKV), and the
    :class:`KVCache` methods reserve() and make_room() (and fork()'s need for an id) evict only
    through it."""

    @abstractmethod
    def free_cells(self) -> int: ...

    @abstractmethod
    def free_ids(self) -> int: ...

    @abstractmethod
    def _resident_match(self, tokens: Sequence[int]) -> int:
        """Leading ``tokens`` held by an idle cached prefix (cells a start() shares)."""

    @abstractmethod
    def _evict_idle(self, keep_for: Sequence[int] | None) -> bool:
        """Evict one idle cached prefix by the one rule (:mod:`pyllama_kv.prefixcache.eviction`): the
        least recently used, not the best match for ``keep_for``, paged out to the host tier when it
        can hold it, else dropped. False when there is none."""

    @property
    @abstractmethod
    def n_live(self) -> int:
        """Live sequences (started or forked, not finished)."""

    def reserve(self, tokens: Sequence[int], n_cells: int, n_ids: int) -> bool:
        """See :meth:`KVCache.reserve`."""
        n = len(tokens)
        while True:
            shared = min(self._resident_match(tokens), n - 1) if n else 0
            if self.free_ids() >= n_ids and n - shared + n_cells <= self.free_cells():
                return True
            if self._evict_idle(tokens):
                continue
            # the best match goes too, but only when nothing is live: a prompt that shares a short
            # prefix with a long idle sequence in a small cache (a truncated conversation) would
            # otherwise wait for ever; while something runs, its end makes room instead
            if self.n_live == 0 and self._evict_idle(None):
                continue
            return False

    def make_room(self, n_cells: int) -> bool:
        """See :meth:`KVCache.make_room`."""
        while self.free_cells() < n_cells:
            if not self._evict_idle(None):
                return False
        return True

    def page_out_idle(self, decoded: int, upcoming: int = 0) -> int:
        """See :meth:`KVCache.page_out_idle` (a cache without a host tier: nothing)."""
        return 0


class ContextKV(PrefixPolicy):
    """:class:`KVCache` over a :class:`~pyllama_kv.core.context.Context`: ``parallel`` ids for live
    sequences, the rest of the context's ids for ``cache``, the
    :class:`~pyllama_kv.prefixcache.cache.PrefixCache` of idle prefixes (the same class as the API's,
    with ``max_sequences=prefix_cache``), paged out to a host tier of ``cache_ram`` MiB (0: evicted
    prefixes are dropped) and, with ``cache_dir``, to files there (at most ``cache_dir_mib`` MiB)."""

    def __init__(self, ctx: Context, parallel: int, prefix_cache: int, cache_ram: int = 0,
                 cache_dir: str | None = None, cache_dir_mib: int = 1024):
        self.ctx = ctx
        self.parallel = parallel
        self.cache = PrefixCache(ctx, max_sequences=prefix_cache, cache_ram=cache_ram, cache_dir=cache_dir,
                                 cache_dir_mib=cache_dir_mib)
        self._live = 0
        #: idle prefix id -> (its last use, the engine's decoded tokens from which its idle age counts):
        #: page_out_idle's ages; and the decoded tokens at its last page-out look (at most one every
        #: IDLE_PAGE_OUT_TOKENS // 2 tokens)
        self._idle_seen: dict[int, tuple[int | None, int]] = {}
        self._idle_checked = 0

    @property
    def n_cells(self) -> int:
        return self.ctx.n_ctx

    @property
    def context(self) -> Context:
        return self.ctx

    @property
    def n_live(self) -> int:
        return self._live

    def free_cells(self) -> int:
        return self.ctx.free_cells()

    def free_ids(self) -> int:
        return min(self.parallel - self._live, self.ctx.free_sequence_ids)

    def _resident_match(self, tokens) -> int:
        held = self.cache.longest(tokens)
        states = self.cache.states
        if states is not None and states.matched(tokens, held) > held:
            return 0   # a kept whole state goes into new cells: none of them shared
        return held

    def _evict_idle(self, keep_for) -> bool:
        return self.cache.evict(keep_for=keep_for)

    def match(self, tokens) -> int:
        held = self.cache.longest(tokens)
        paging = self.cache.paging
        return paging.matched(tokens, held) if paging is not None else held

    def start(self, tokens):
        seq, n = self.cache.fork_prefix(tokens)
        self._live += 1
        # a longer prefix paged out to host memory or disk is restored (a memcpy), not evaluated;
        # reserve() counted the cells it takes among the prompt's
        n += self.cache.restore_into(seq, tokens, len(tokens) - 1)
        return seq, n

    def fork(self, seq):
        while self.ctx.free_sequence_ids == 0 and self._evict_idle(None):
            pass
        child = seq.fork()
        self._live += 1
        return child

    def decode(self, batch: dict, outputs: dict | None = None, greedy: Sequence[Hashable] = (),
               between: Callable[[], None] | None = None) -> dict:
        # views of llama.cpp's output rows: the engine samples every row before its next decode
        return self.ctx.decode(batch, copy=False, outputs=outputs, greedy=greedy,   # type: ignore[arg-type]
                               between=between)

    @property
    def can_shift(self) -> bool:
        """Whether this cache K-shifts at all: the library says so (can_shift: a RoPE model whose
        K-shift continues exactly, and a cache type the device holding K can rotate), and its
        ``caps.kv_shift`` trusts that (the vanilla build aborts on the K-shift of some cache types
        while saying it can: patches/0009)."""
        return bool(self.ctx.can_shift and self.ctx.caps.kv_shift)

    def shift(self, seq, n_keep: int, n_discard: int) -> bool:
        if not self.can_shift:
            return False
        ctx = self.ctx
        with ctx.critical():
            end = n_keep + n_discard
            if end < len(seq) and ctx.shared_in(seq.id, end, len(seq)):
                return False   # copy-on-write: the engine re-evaluates the tail into cells of its own
            if not ctx.can_fork(seq, n_keep):
                return False   # a sliding-window cache no longer holds the window of position n_keep
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

    def checkpoints_at(self, tokens, boundaries, held: int) -> list[int]:
        if not self.cache.keeps_checkpoints:
            return []
        points = set(boundaries) | {self.cache.branch_point(tokens)}
        if self.cache.checkpoints is not None:   # a recurrent model: periodic ones too (see periodic_points)
            points |= set(periodic_points(held, len(tokens)))
        return sorted(p for p in points if CHECKPOINT_MIN_TOKENS <= p and held <= p < len(tokens))

    def checkpoint(self, seq) -> None:
        self.cache.checkpoint(seq)

    def page_out_idle(self, decoded: int, upcoming: int = 0) -> int:
        cache = self.cache
        if cache.paging is None:
            return 0
        end = decoded + upcoming   # the decoded tokens once this decode ran
        seen, self._idle_seen = self._idle_seen, {}
        for s in cache.idle:
            used = cache.idle.last_used(s)
            # not idle at the last look, or used since (forked for this decode, say: the cells the fork
            # shares stay with it): its age counts from now
            prev = seen.get(s.id)
            self._idle_seen[s.id] = prev if prev is not None and prev[0] == used else (used, decoded)
        if not self._idle_seen or end - self._idle_checked < IDLE_PAGE_OUT_TOKENS // 2:   # (not every token)
            return 0
        self._idle_checked = decoded   # (drafts in ``upcoming`` that are refused never count as decoded)
        live = None
        n = 0
        for s in list(cache.idle):
            if end - self._idle_seen[s.id][1] < IDLE_PAGE_OUT_TOKENS:
                continue
            # it goes when at least IDLE_PAGE_OUT_MIN of its tokens are its own: no running sequence shares
            # its first `keep` tokens (the cells they share stay). Looked at every step while it stays, so
            # one comparison of `keep` tokens per running sequence, stopping at the first that shares them
            keep = len(s.tokens) - IDLE_PAGE_OUT_MIN + 1
            if keep <= 0:
                continue
            if live is None:   # the running sequences' tokens
                live = [np.asarray(q.tokens, dtype=np.int32) for q in self.ctx.sequences if q not in cache.idle]
            head = np.asarray(s.tokens[:keep], dtype=np.int32)
            if any(q.size >= keep and np.array_equal(q[:keep], head) for q in live):
                continue
            if cache.page_out_idle(s):
                self._idle_seen.pop(s.id, None)
                n += 1
        return n

    def evict(self, keep_for=None) -> bool:
        """Evict one idle cached prefix by the module's rule (for tests and tools: the engine asks
        reserve() and make_room()); False when there is none."""
        return self._evict_idle(keep_for)

    def kv_stats(self) -> dict:
        ctx = self.ctx
        kv = ctx.kv_stats().as_dict()
        # which used cells the idle cached prefixes hold, and which only requests hold
        cached = [q.id for q in self.cache.cached]
        seqs = ctx.cell_holders()
        by_cache = np.isin(seqs, cached).any(axis=1)
        kv["cached_cells"] = int(by_cache.sum())
        kv["request_cells"] = int(((seqs >= 0).any(axis=1) & ~by_cache).sum())
        kv.update(self.cache.checkpoint_stats() or {})   # a model whose prefix cache keeps checkpoints
        return kv

    def holdings(self) -> tuple[tuple, Callable[[], dict]]:
        """The prefix cache's change key and a reader of its holdings, by medium
        (PrefixCache.holdings_key / holdings: for KV events). Call between steps."""
        return self.cache.holdings_key(), self.cache.holdings

    def tier_stats(self) -> dict:
        """The tiers' counters, host and disk (pyllama_kv.prefixcache.tiers.TierStats, ``enabled``,
        ``off_reason``)."""
        return self.cache.tier_stats()

    @property
    def tier_info(self) -> TierStats:
        """The tiers' live counters, host and disk (the engine's ``stats.prefix_tier``)."""
        return self.cache.tier_info


def periodic_points(held: int, n: int) -> list[int]:
    """Where a recurrent model's long prompt keeps checkpoints besides the exact ones (its turns, where
    it leaves the cache): every CHECKPOINT_INTERVAL tokens of the part it evaluates, the last
    CHECKPOINT_PERIODIC of them. A later prompt that branches inside this one, where no exact
    checkpoint is (a raw completion: no turns known), then forks from the last one before its branch
    instead of evaluating everything (llama-server keeps such checkpoints too); the cache's byte bound
    (CHECKPOINT_BYTES) bounds them all."""
    first = (held // CHECKPOINT_INTERVAL + 1) * CHECKPOINT_INTERVAL
    return list(range(first, n, CHECKPOINT_INTERVAL))[-CHECKPOINT_PERIODIC:]


def context_kv(ctx: Context, config, hold: bool = False) -> ContextKV:
    """The engine's KV layer over ``ctx`` as an :class:`~pyllama_kv.config.EngineConfig` says
    (parallel, prefix_cache and the tiers: cache_ram, cache_dir, cache_dir_mib); a :class:`HoldingKV`
    with ``hold``."""
    cls = HoldingKV if hold else ContextKV
    return cls(ctx, config.parallel, config.prefix_cache, cache_ram=config.cache_ram, cache_dir=config.cache_dir,
               cache_dir_mib=config.cache_dir_mib)


class HoldingKV(ContextKV):
    """:class:`ContextKV` whose finished sequences keep their cells until :meth:`release`: for a
    caller that reads the cache (stats, a map) after its requests are done and before they free.
    When room is needed, held sequences are finished first, oldest first (they count as live until
    then)."""

    def __init__(self, ctx: Context, parallel: int, prefix_cache: int, **tiers):
        super().__init__(ctx, parallel, prefix_cache, **tiers)
        self.held: list[tuple[Hashable, bool]] = []

    def finish(self, seq, keep: bool) -> None:
        self.held.append((seq, keep))

    def _evict_idle(self, keep_for) -> bool:
        # what is held goes first (a preempted continuation is "finished" too), or a preemption
        # would free nothing and the engine would wait for ever
        if self.held:
            seq, keep = self.held.pop(0)
            super().finish(seq, keep)
            return True
        return super()._evict_idle(keep_for)

    def release(self) -> None:
        """Finish what was held (as ContextKV.finish would have)."""
        held, self.held = self.held, []
        for seq, keep in held:
            super().finish(seq, keep)
