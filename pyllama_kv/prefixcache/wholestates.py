"""The host tier of a model whose memory holds more than cells: whole sequence states in host memory.

A model with recurrent layers (a hybrid such as LFM2) or a sliding-window cache (Gemma 3) has no
spans (:mod:`~pyllama_kv.prefixcache.tiers`): its state is not a run of cells that can be cut at any
position. So when :class:`~pyllama_kv.prefixcache.cache.PrefixCache` evicts an idle cached sequence of
such a model, it keeps the sequence's whole state instead (``Context.whole_state``: llama.cpp's own
bytes, its recurrent state and window included), and a prompt that extends all of a kept sequence's
tokens gets them back (``Context.sequence_load_whole``: written, not computed), the rest evaluated.
This is what a multi-turn chat needs: each turn extends the conversation the previous one left, and
under many conversations at once that conversation has been evicted from the KV cache in between.

Kept states are matched whole (a prompt that shares only part of one does not use it: neither kind of
memory can be cut back). One that another kept state extends is dropped (the longer holds its tokens,
and a prompt that extends the shorter one but not the longer gets it from the resident checkpoint
where prompts branch, or evaluates it). The bytes held never exceed ``budget`` (``cache_ram`` MiB):
least recently used first out; a state larger than the budget is not kept. Host memory only: these
bytes are never parsed, so they never go to disk, where they could come back changed.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from ..core.state import WholeState
from ..errors import KVCacheFullError, LlamaError
from ..limits import CHECKPOINT_MIN_TOKENS
from .tiers import TierStats

__all__ = ["WholeStates"]


class WholeStates:
    """Whole states of evicted sequences, least recently used first, at most ``budget`` bytes; its
    counters are the host tier's (:class:`~pyllama_kv.prefixcache.tiers.TierStats`). Not thread-safe
    on its own: the prefix cache calls it under the context's lock."""

    def __init__(self, ctx, budget: int, stats: TierStats):
        self.ctx = ctx
        self.budget = int(budget)
        self.stats = stats
        stats.enabled, stats.budget_bytes, stats.off_reason = True, self.budget, ""
        self._lru: OrderedDict[int, WholeState] = OrderedDict()   # by a serial number
        self._serial = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def token_runs(self) -> list:
        """The tokens of each kept state (what a restore can give back from position 0)."""
        return [s.tokens for s in self._lru.values()]

    def _sync(self) -> None:
        st = self.stats
        st.host_bytes, st.host_nodes = self.nbytes, len(self._lru)
        st.host_tokens = sum(len(s.tokens) for s in self._lru.values())

    def _drop(self, key: int) -> None:
        s = self._lru.pop(key, None)
        if s is not None:
            self.nbytes -= s.n_bytes

    def page_out(self, seq) -> None:
        """Keep the whole state of ``seq`` (being evicted) unless a kept one already extends it; drop
        the kept ones it extends; then the least recently used while over the budget."""
        n = len(seq)
        if n < CHECKPOINT_MIN_TOKENS:
            return
        toks = tuple(seq.tokens)
        for key, s in self._lru.items():
            if len(s.tokens) >= n and s.tokens[:n] == toks:
                self._lru.move_to_end(key)   # nothing new: a kept state holds these tokens and more
                return
        t0 = time.perf_counter()
        try:
            state = self.ctx.whole_state(seq)
        except LlamaError:
            return
        st = self.stats
        if state.n_bytes > self.budget:
            st.not_stored += 1
            return
        for key in [k for k, s in self._lru.items() if len(s.tokens) < n and toks[:len(s.tokens)] == s.tokens]:
            self._drop(key)   # this one extends it
        while self._lru and self.nbytes + state.n_bytes > self.budget:
            key = next(iter(self._lru))
            st.evicted_nodes += 1
            st.evicted_bytes += self._lru[key].n_bytes
            self._drop(key)
        self._serial += 1
        self._lru[self._serial] = state
        self.nbytes += state.n_bytes
        st.page_outs += 1
        st.paged_out_tokens += n
        st.paged_out_bytes += state.n_bytes
        st.page_out_seconds += time.perf_counter() - t0
        self._sync()

    def _best(self, tokens: Sequence[int], held: int, limit: int) -> tuple[int, WholeState] | None:
        """The longest kept state of more than ``held`` and at most ``limit`` tokens that ``tokens``
        start with."""
        best: tuple[int, WholeState] | None = None
        for key, s in self._lru.items():
            k = len(s.tokens)
            if held < k <= limit and (best is None or k > len(best[1].tokens)):
                if np.array_equal(np.asarray(tokens[:k]), s.tokens):
                    best = (key, s)
        return best

    def matched(self, tokens: Sequence[int], held: int) -> int:
        """How many of ``tokens`` a sequence holding ``held`` of them would hold after
        :meth:`restore_into` (all but the last token at most)."""
        b = self._best(tokens, held, len(tokens) - 1)
        return held if b is None else len(b[1].tokens)

    def restore_into(self, seq, tokens: Sequence[int], limit: int, make_room: Callable[[], bool] | None = None) -> int:
        """Make ``seq`` (holding a prefix of ``tokens``) hold the longest kept state of at most ``limit``
        of them; the tokens added (0: none kept, or no room even after ``make_room()`` freed what it
        could: ``seq`` unchanged). The state leaves the store: the sequence holds it now, and gives it
        back when it is evicted again."""
        held = len(seq)
        b = self._best(tokens, held, limit)
        if b is None:
            return 0
        key, state = b
        t0 = time.perf_counter()
        while True:
            try:
                self.ctx.sequence_load_whole(seq, state)
                break
            except KVCacheFullError:
                if make_room is None or not make_room():   # (an eviction may page out into this store)
                    return 0
        self._drop(key)
        got = len(state.tokens) - held
        st = self.stats
        st.restores += 1
        st.restored_tokens += got
        st.restore_seconds += time.perf_counter() - t0
        self._sync()
        return got

    def clear(self) -> None:
        self._lru.clear()
        self.nbytes = 0
        self._sync()
