"""A prompt-prefix cache over one context: many requests, shared prefixes evaluated once, and
prefixes evicted from the context paged out to host memory and disk (pyllama_kv.prefixcache.tiers)."""
from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..config import int_param
from ..core.checkpoint import Checkpoint
from ..core.context import Context
from ..core.sequence import Sequence
from ..errors import InvalidInputError, KVCacheFullError, LlamaError
from ..limits import CHECKPOINT_MIN_TOKENS
from .checkpoints import Checkpoints
from .events import Holding
from .eviction import IdlePrefixes
from .tiers import SpanTrie, Tiers, TierStats, can_restore, context_layout, shared_prefix
from .wholestates import WholeStates

__all__ = ["PrefixCache", "PrefixCacheStats", "TierStats", "shared_prefix"]

T = TypeVar("T")


@dataclass
class PrefixCacheStats:
    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0      # tokens served from cached cells (forked, not evaluated)
    restored_tokens: int = 0    # tokens restored from host memory or disk (not evaluated)
    evaluated_tokens: int = 0   # tokens decoded by acquire() (or left to the caller of fork_prefix)
    evictions: int = 0
    checkpoint_forks: int = 0   # forks that went back to a checkpoint (see PrefixCache.keeps_checkpoints)


class PrefixCache:
    """Serve prompts from cached sequences that share their prefix.

    ``acquire(tokens)`` returns a new sequence holding ``tokens``: it forks the cached sequence with
    the longest common prefix (sharing its cells, no recompute), restores what the tiers hold beyond
    it (a memcpy), and evaluates only the rest (always at least the last token, so the returned
    sequence has next-token logits). The prompt is remembered as an idle cached sequence for later
    requests. ``release(seq)`` hands a finished sequence back to be cached too (or closed).

    The idle cached sequences and the one eviction rule are :mod:`pyllama_kv.prefixcache.eviction`'s
    (:class:`~pyllama_kv.prefixcache.eviction.IdlePrefixes`, ``self.idle``; the engine's KV layer
    holds a PrefixCache and evicts through :meth:`evict`): the least recently used idle cached
    sequence goes, never the best match of the prompt being placed, when there are more than
    ``max_sequences`` of them, or when a sequence id or cells are needed; the best match is found in
    a token trie of the idle sequences. An evicted sequence is paged out first (patched library):
    its cells not already stored are copied to a token trie of spans in host memory of at most
    ``cache_ram`` MiB, a prefix shared by many sequences stored once; spans leaving host memory go
    to files in ``cache_dir`` (at most ``cache_dir_mib`` MiB) when one is given. See
    :mod:`pyllama_kv.prefixcache.tiers` and :mod:`pyllama_kv.prefixcache.spanfile`. ``cache_ram=0``
    without a ``cache_dir``: evicted sequences are dropped.

    A model with recurrent layers (a hybrid such as LFM2) keeps checkpoints of their state where
    prefixes branch (``self.checkpoints``, :mod:`~pyllama_kv.prefixcache.checkpoints`): a fork of a
    cached sequence's first n tokens takes its recurrent state from the checkpoint of those n tokens.
    A sliding-window model (Gemma 3) keeps its checkpoints as idle cached sequences of exactly those
    tokens (see :attr:`keeps_checkpoints`).

    Every acquired sequence has ``reused_tokens`` (the tokens it did not evaluate; the last acquire's
    are ``last_reused_tokens``); ``stats`` sums them up, ``tier_info``
    (:class:`~pyllama_kv.prefixcache.tiers.TierStats`) counts the tiers. Thread-safe through the context's lock.
    """

    def __init__(self, ctx, max_sequences: int | None = None, cache_ram: int = 256,
                 cache_dir: str | os.PathLike | None = None, cache_dir_mib: int = 1024):
        if not isinstance(ctx, Context):
            raise InvalidInputError(f"PrefixCache needs a pyllama_kv.Context, got {type(ctx).__name__}")
        ctx.check_open()
        if max_sequences is None:
            max_sequences = min(4, ctx.n_seq_max)
        if isinstance(max_sequences, bool) or not isinstance(max_sequences, int) \
                or not 0 <= max_sequences <= ctx.n_seq_max:
            raise InvalidInputError(f"max_sequences must be an integer in [0, n_seq_max={ctx.n_seq_max}]")
        cache_ram = int_param("cache_ram", cache_ram, 0)
        cache_dir_mib = int_param("cache_dir_mib", cache_dir_mib, 1)
        if cache_dir is not None and (not isinstance(cache_dir, (str, os.PathLike)) or not os.fspath(cache_dir)):
            raise InvalidInputError(f"cache_dir must be a directory path or None, got {cache_dir!r}")
        self.ctx = ctx
        self.max_sequences = max_sequences
        self.stats = PrefixCacheStats()
        self.last_reused_tokens = 0
        self.tier_info = TierStats()   # live: the engine's stats hold this object
        self.tiers: Tiers | None = None
        #: a model whose memory holds more than cells (recurrent layers, a sliding window): whole states
        #: of evicted sequences in host memory instead of spans (None: spans, or paging off)
        self.states: WholeStates | None = None
        if cache_ram == 0 and cache_dir is None:
            self.tier_info.off_reason = "cache_ram is 0 and there is no cache_dir"
        elif cache_ram > 0 and (ctx.model.recurrent or ctx.model.n_swa > 0) and ctx.caps.state_io:
            self.states = WholeStates(ctx, cache_ram << 20, self.tier_info)
        elif not can_restore(ctx):
            self.tier_info.off_reason = getattr(ctx, "no_restore_reason", "") or "the context cannot restore a span"
        else:
            self.tiers = Tiers(ctx, cache_ram << 20, self.tier_info, cache_dir, cache_dir_mib << 20)
        #: a recurrent model's state where its prefixes branch (None: a model without recurrent layers,
        #: or a library that cannot write that state back)
        self.checkpoints: Checkpoints | None = None
        if ctx.model.recurrent_checkpoints:
            self.checkpoints = Checkpoints()
        #: a sliding-window model's checkpoints: idle cached sequences by id (see keeps_checkpoints)
        self._window_checkpoints: dict[int, Sequence] | None = None
        if ctx.model.branch_checkpoints and not ctx.model.recurrent:
            self._window_checkpoints = {}
        #: the idle cached sequences and the one eviction rule (evicted ones paged out to the tiers)
        self.idle: IdlePrefixes[Sequence] = IdlePrefixes(self._page_out, self._absorbed)
        try:
            ly = context_layout(ctx)
            self._cell_bytes = ly.n_bytes(1) - ly.n_bytes(0)
        except LlamaError:
            self._cell_bytes = 0

    def __len__(self) -> int:
        return len(self.idle)

    @property
    def cached(self) -> list:
        """The idle cached sequences, least recently used first."""
        return list(self.idle)

    @property
    def keeps_checkpoints(self) -> bool:
        """Whether this cache keeps checkpoints where prefixes branch (:meth:`checkpoint`,
        :meth:`branch_point`). A recurrent model's are its recurrent state (:attr:`checkpoints`). A
        sliding-window model's are idle cached sequences of exactly the branch's tokens, kept when a
        longer one holds them too: a fork of a longer sequence's first n tokens needs the cells of the
        window before n, which that sequence no longer attends to, so the cache reuses them for other
        tokens when it finds them first (Context.can_fork), while the window of a sequence's own last
        tokens stays. False for other models: any prefix of a cached sequence forks."""
        return self.checkpoints is not None or self._window_checkpoints is not None

    def checkpoint_stats(self) -> dict | None:
        """The checkpoints kept now and the forks made from them; None when this cache keeps none
        (:attr:`keeps_checkpoints`). ``checkpoints``: how many; ``checkpoint_bytes``: the host memory of
        a recurrent model's (0 for a sliding-window model's: their cells are shared with the longer
        sequences); ``checkpoint_forks``: forks that went back to one (as ``stats``)."""
        if self.checkpoints is not None:
            n, nbytes = len(self.checkpoints), self.checkpoints.n_bytes
        elif self._window_checkpoints is not None:
            n, nbytes = sum(not s.closed for s in self._window_checkpoints.values()), 0
        else:
            return None
        return {"checkpoints": n, "checkpoint_bytes": nbytes, "checkpoint_forks": self.stats.checkpoint_forks}

    @property
    def tier(self) -> SpanTrie | None:
        """The host tier's trie of spans (None when paging is off)."""
        return None if self.tiers is None else self.tiers.trie

    def tier_stats(self) -> dict:
        """The tiers' counters (TierStats.as_dict(): ``enabled`` and, when off, ``off_reason``)."""
        return self.tier_info.as_dict()

    def holdings(self) -> dict[str, list[Holding]]:
        """What this cache holds, by medium (:mod:`~pyllama_kv.prefixcache.events`): ``"GPU"`` the
        idle cached sequences' cells, ``"CPU"`` the host tier's spans (or a hybrid model's whole
        states), ``"DISK"`` the span files of this model; each ``(tokens, start, end)``: positions
        [start, end) of ``tokens`` are there. Read between steps (under the context's lock)."""
        out: dict[str, list[Holding]] = {"GPU": [(s.tokens, 0, len(s)) for s in self.idle]}
        if self.tiers is not None:
            out["CPU"] = list(self.tiers.trie.holdings())
            if self.tiers.disk is not None:
                out["DISK"] = list(self.tiers.disk.holdings())
        elif self.states is not None:
            out["CPU"] = [(t, 0, len(t)) for t in self.states.token_runs()]
        return out

    def holdings_key(self) -> tuple:
        """A value that changes whenever :meth:`holdings` may have (cheap: the idle sequences and
        the tiers' counters), so that a reader skips the unchanged readings."""
        st = self.tier_info
        return (tuple((s.id, len(s)) for s in self.idle), st.host_bytes, st.host_nodes, st.host_tokens,
                st.paged_out_tokens, st.evicted_nodes, st.disk_files, st.disk_tokens, st.disk_writes,
                st.disk_evicted_files, st.disk_corrupt)

    # -- internals ------------------------------------------------------------------------------

    def _best(self, toks):
        """The idle cached sequence with the longest common prefix with ``toks``, and its length."""
        return self.idle.best(toks)

    def _source(self, toks) -> Sequence | None:
        """The idle cached sequence :meth:`fork_prefix` would fork for ``toks`` (None: none), which
        an eviction for that prompt keeps."""
        best, n = self._best(toks)
        return self._fork_point(best, min(n, toks.size - 1), toks)[0]

    def _fork_point(self, best, n: int, toks) -> tuple[Sequence | None, int, Checkpoint | None]:
        """What to fork for the first ``n`` of ``toks`` (``best`` shares them): ``(best, n, None)``
        when ``best.fork(n)`` can be made; else, for a model whose recurrent layers cannot go back to
        position n, ``(best, m, ck)`` with the longest checkpoint of a prefix of those n tokens; else
        the longest idle sequence that is all a prefix of them ``(s, len(s), None)`` (forked whole:
        a sliding-window model's checkpoint); else ``(best, 0, None)``: the prompt is evaluated
        afresh (see Context.can_fork)."""
        if best is None or n <= 0 or self.ctx.can_fork(best, n):
            return best, n, None
        if self.checkpoints is not None:
            ck = self.checkpoints.best(toks, n)
            if ck is not None and self.ctx.can_fork(best, ck.n, ck):
                return best, ck.n, ck
        whole = [s for s in self.idle.prefixes(toks[:n]) if len(s)]
        if whole:
            s = max(whole, key=len)
            return s, len(s), None
        return best, 0, None

    def _absorbed(self, seq) -> bool:
        """An idle cached sequence is closed because a longer one holds its tokens, unless this
        returns True: a sliding-window model's checkpoint stays; a recurrent model's state after
        them is kept as a checkpoint (the longer one holds only its own)."""
        if self._window_checkpoints is not None:
            return self._window_checkpoints.get(seq.id) is seq
        if self.checkpoints is not None:
            self.checkpoint(seq)
        return False

    def _resident_changed(self) -> None:
        st = self.tier_info
        st.resident_sequences = len(self.idle)
        st.resident_tokens = self.idle.n_tokens
        st.resident_bytes = st.resident_tokens * self._cell_bytes

    @property
    def paging(self) -> Tiers | WholeStates | None:
        """Where evicted prefixes go: ``tiers`` (spans) or ``states`` (whole states; at most one of the
        two is set); None: they are dropped."""
        return self.tiers if self.tiers is not None else self.states

    def _page_out(self, seq) -> None:
        paging = self.paging
        if paging is not None:
            paging.page_out(seq)

    def _evict(self, keep=None) -> bool:
        """Evict one idle cached sequence by the one rule (:meth:`IdlePrefixes.evict
        <pyllama_kv.prefixcache.eviction.IdlePrefixes.evict>`, never ``keep``), counted; False when
        there is none to evict."""
        if not self.idle.evict(keep):
            return False
        self.stats.evictions += 1
        self._resident_changed()
        return True

    def _with_room(self, op: Callable[[], T], keep, full: type[LlamaError] = KVCacheFullError) -> T:
        """``op()``, evicting (:meth:`_evict`, never ``keep``) and trying again while it raises ``full``."""
        while True:
            try:
                return op()
            except full:
                if not self._evict(keep):
                    raise

    def _remember(self, s) -> None:
        """Cache ``s`` (idle), closing cached sequences it makes redundant (prefixes of it: it holds
        their tokens, so nothing is lost; not a sliding-window model's checkpoints, so ``s`` itself is
        closed when one holds exactly its tokens), then evicting down to ``max_sequences``."""
        if self.max_sequences == 0:
            s.close()
            return
        same = self._exactly(s.tokens) if self._window_checkpoints is not None else None
        if same is not None and same is not s and self._is_window_checkpoint(same):
            s.close()
            self.idle.touch(same)
            return
        self.idle.add(s)
        self.stats.evictions += self.idle.trim(self.max_sequences)
        self._resident_changed()

    # -- API ------------------------------------------------------------------------------------

    def longest(self, tokens) -> int:
        """How many leading tokens of ``tokens`` an idle cached sequence already holds (0 where
        :meth:`fork_prefix` could not fork it: see Context.can_fork)."""
        with self.ctx.critical():
            toks = self.ctx.model.check_tokens(tokens)
            best, n = self._best(toks)
            # fork_prefix forks at most all but the last token: counted where that fork can be made
            m = min(n, toks.size - 1)
            if m <= 0:
                return n
            f = self._fork_point(best, m, toks)[1]
            return n if f == m else f

    def branch_point(self, tokens) -> int:
        """Where ``tokens`` leave the longest idle cached sequence they share a prefix with, inside
        it, when this cache keeps checkpoints (:attr:`keeps_checkpoints`) and none is there (a
        recurrent model: a fork can go only to an earlier point; a sliding-window model: no idle
        sequence of exactly those tokens); 0 otherwise. The engine keeps a checkpoint there while it
        evaluates the prompt, so that the next prompt sharing as much forks all of it."""
        if not self.keeps_checkpoints:
            return 0
        with self.ctx.critical():
            toks = self.ctx.model.check_tokens(tokens)
            best, n = self._best(toks)
            m = min(n, toks.size - 1)
            if best is None or m < CHECKPOINT_MIN_TOKENS:
                return 0
            if self._window_checkpoints is not None:
                return m if m < len(best) and not self._is_window_checkpoint(self._exactly(toks[:m])) else 0
            return m if self._fork_point(best, m, toks)[1] < m else 0

    def _exactly(self, toks) -> Sequence | None:
        """The idle cached sequence that holds exactly ``toks``, if any."""
        return next((s for s in self.idle.prefixes(toks) if len(s) == len(toks)), None)

    def _is_window_checkpoint(self, seq) -> bool:
        return seq is not None and self._window_checkpoints is not None and self._window_checkpoints.get(seq.id) is seq

    def checkpoint(self, seq) -> bool:
        """Keep a checkpoint after the tokens of ``seq`` (see :attr:`keeps_checkpoints`): a recurrent
        model's state (:mod:`~pyllama_kv.prefixcache.checkpoints`), or a sliding-window model's fork of
        ``seq`` as an idle cached sequence that no longer one absorbs (it counts against
        ``max_sequences`` and goes by the eviction rule like any other; it needs a free sequence id).
        Whether one was kept (False for other models, for an empty sequence, or when one of the same
        tokens is kept already)."""
        if not self.keeps_checkpoints:
            return False
        with self.ctx.critical():
            self.ctx.check_sequence(seq)
            if len(seq) == 0:
                return False
            if self._window_checkpoints is not None:
                return self._keep_window_checkpoint(seq)
            assert self.checkpoints is not None
            if seq.tokens in self.checkpoints:
                return False
            self.checkpoints.add(seq.checkpoint())
            return True

    def _keep_window_checkpoint(self, seq) -> bool:
        """A sliding-window model's checkpoint after the tokens of ``seq`` (see checkpoint): the idle
        sequence that holds exactly them becomes one, else a fork of ``seq`` is cached as one (the least
        recently used idle sequence evicted first when no sequence id is free)."""
        if self.max_sequences == 0 or len(seq) < CHECKPOINT_MIN_TOKENS:
            return False
        assert self._window_checkpoints is not None
        same = self._exactly(seq.tokens)
        if same is not None:
            if self._is_window_checkpoint(same):
                return False
            self._window_checkpoints[same.id] = same
            self.idle.touch(same)
            return True
        if not self.ctx.free_sequence_ids and not self._evict():
            return False
        kept = seq.fork()
        self._window_checkpoints[kept.id] = kept   # by id: at most one entry an id, a closed one's replaced
        self._remember(kept)
        return True

    def fork_prefix(self, tokens):
        """A new sequence holding the longest cached prefix of ``tokens`` (at most all but the last
        token), without evaluating or restoring anything: ``(seq, n)`` with ``n`` the tokens it
        holds (0: an empty sequence). Idle cached sequences other than the matching one are evicted
        when no sequence id is free; LlamaError when none can be had. The caller restores what it
        can (:meth:`restore_into`) and decodes the rest."""
        with self.ctx.critical():
            seq, n, _ = self._fork_prefix(self.ctx.model.check_tokens(tokens))
            return seq, n

    def _fork_prefix(self, toks) -> tuple[Sequence, int, Sequence | None]:
        """:meth:`fork_prefix` of checked ``toks``, and the idle sequence it forked (None: none), which
        the caller's evictions keep."""
        ctx = self.ctx
        if toks.size == 0:
            raise InvalidInputError("a prompt needs at least one token")
        best, n = self._best(toks)
        src, n, ck = self._fork_point(best, min(n, toks.size - 1), toks)
        if src is not None:
            self.idle.touch(src)
        seq = self._with_room(lambda: src.fork(n, ck) if (src is not None and n > 0) else ctx.new_sequence(),
                              src, full=LlamaError)
        n = len(seq)
        if ck is not None or (n and src is not best and self._is_window_checkpoint(src)):
            self.stats.checkpoint_forks += 1
        seq.reused_tokens = n
        st = self.stats
        st.requests += 1
        st.prompt_tokens += int(toks.size)
        st.reused_tokens += n
        st.evaluated_tokens += int(toks.size) - n
        self.tier_info.evaluated_tokens += int(toks.size) - n
        return seq, n, src

    def restore_into(self, seq, tokens, limit: int, make_room: Callable[[], bool] | None = None) -> int:
        """Restore the tiers' spans for ``tokens[len(seq):limit]`` onto ``seq`` (which holds a prefix
        of ``tokens``, e.g. from :meth:`fork_prefix`), host memory first, then disk; returns the
        tokens restored (0 when the tiers are off). Stops early, with ``seq`` valid, when the
        context has no room (``make_room()``, if given, is asked to free some first)."""
        paging = self.paging
        if paging is None:
            return 0
        with self.ctx.critical():
            self.ctx.check_sequence(seq)
            got = paging.restore_into(seq, tokens, limit, make_room)
            if got:
                seq.reused_tokens = len(seq)
                self.stats.restored_tokens += got
                self.stats.evaluated_tokens -= got
                self.tier_info.evaluated_tokens -= got
            return got

    def remember(self, seq) -> bool:
        """Keep a fork of ``seq`` (its current tokens) as an idle cached sequence, if a sequence id
        is free; the caller keeps ``seq``. Returns whether it was kept."""
        with self.ctx.critical():
            self.ctx.check_sequence(seq)
            if self.max_sequences == 0 or len(seq) == 0 or not self.ctx.free_sequence_ids:
                return False
            self._remember(seq.fork())
            return True

    def evict(self, keep_for=None) -> bool:
        """Evict the least recently used idle cached sequence (paged out, then closed; not the best
        match for the tokens ``keep_for``, if given); False when there is none."""
        with self.ctx.critical():
            keep = None
            if keep_for is not None and len(keep_for):
                keep = self._source(self.ctx.model.check_tokens(keep_for))
            return self._evict(keep)

    def page_out_idle(self, seq) -> bool:
        """Page idle cached ``seq`` out now (its cells copied to the host tier, then freed), whatever
        its rank; False, nothing done, when evicted prefixes would be dropped (no tier) or ``seq`` is
        not idle here."""
        with self.ctx.critical():
            if self.paging is None or seq not in self.idle:
                return False
            self.idle.evict_this(seq)
            self.stats.evictions += 1
            self._resident_changed()
            return True

    @property
    def last_reused(self) -> int:
        """Deprecated alias of :attr:`last_reused_tokens`."""
        warnings.warn("PrefixCache.last_reused is deprecated: use PrefixCache.last_reused_tokens",
                      DeprecationWarning, stacklevel=2)
        return self.last_reused_tokens

    def acquire(self, tokens, remember: bool = True):
        """A new sequence holding ``tokens`` (see the class docstring); the caller owns it."""
        ctx = self.ctx
        with ctx.critical():
            branch = self.branch_point(tokens)
            toks = ctx.model.check_tokens(tokens)
            seq, n, keep = self._fork_prefix(toks)
            try:
                n += self.restore_into(seq, toks, toks.size - 1, make_room=lambda: self._evict(keep))
                at = n
                if branch and at <= branch:   # a checkpoint where the prompt leaves the cached one, kept
                    head = toks[at:branch]
                    if head.size:
                        self._with_room(lambda: seq.extend(head), keep)
                    self.checkpoint(seq)
                    at = branch
                rest = toks[at:]
                self._with_room(lambda: seq.extend(rest), keep)
            except BaseException:
                seq.close()
                raise
            self.last_reused_tokens = n
            if remember and self.max_sequences > 0:
                try:
                    self._remember(seq.fork())
                except LlamaError:
                    pass  # no free id: the prompt simply is not cached
            return seq

    def release(self, seq: Sequence, keep: bool = True) -> None:
        """Give a finished sequence back: cached for later prefixes (``keep``) or closed."""
        with self.ctx.critical():
            self.ctx.check_sequence(seq)
            if seq in self.idle:
                raise InvalidInputError(f"sequence {seq.id} was already released to the prefix cache")
            if keep and len(seq) > 0:
                self._remember(seq)
            else:
                seq.close()

    def clear(self) -> None:
        """Close every idle cached sequence and drop the spans in host memory (files in
        ``cache_dir`` stay: they outlive the process by design)."""
        with self.ctx.critical():
            self.idle.clear()
            self._resident_changed()
            if self.checkpoints is not None:
                self.checkpoints.clear()
            if self._window_checkpoints is not None:
                self._window_checkpoints.clear()
            paging = self.paging
            if paging is not None:
                paging.clear()
