"""A prompt-prefix cache over one context: many requests, shared prefixes evaluated once."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from .context import Context
from .errors import InvalidInputError, KVCacheFullError, LlamaError
from .sequence import Sequence


def shared_prefix(a, b) -> int:
    """How many leading tokens ``a`` and ``b`` (sequences of token ids) have in common."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:m], dtype=np.int64) != np.asarray(b[:m], dtype=np.int64))
    return int(diff[0]) if diff.size else m


@dataclass
class PrefixCacheStats:
    requests: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0      # tokens served from cached cells (forked, not evaluated)
    evaluated_tokens: int = 0   # tokens decoded by acquire()
    evictions: int = 0


class PrefixCache:
    """Serve prompts from cached sequences that share their prefix.

    ``acquire(tokens)`` returns a new sequence holding ``tokens``: it forks the cached sequence with
    the longest common prefix (sharing its cells, no recompute) and evaluates only the rest (always at
    least the last token, so the returned sequence has next-token logits). The prompt is remembered as
    an idle cached sequence for later requests. ``release(seq)`` hands a finished sequence back to
    be cached too (or closed). Idle cached sequences are evicted least-recently-used first, when there
    are more than ``max_sequences`` of them, or when a sequence id or cells are needed.

    Every acquired sequence has ``prefix_reused`` (the tokens it did not evaluate); ``stats`` sums
    them up. Thread-safe through the context's lock.
    """

    def __init__(self, ctx, max_sequences: int | None = None):
        if not isinstance(ctx, Context):
            raise InvalidInputError(f"PrefixCache needs a pyllama_kv.Context, got {type(ctx).__name__}")
        ctx._check_open()
        if max_sequences is None:
            max_sequences = min(4, ctx.n_seq_max)
        if isinstance(max_sequences, bool) or not isinstance(max_sequences, int) \
                or not 0 <= max_sequences <= ctx.n_seq_max:
            raise InvalidInputError(f"max_sequences must be an integer in [0, n_seq_max={ctx.n_seq_max}]")
        self.ctx = ctx
        self.max_sequences = max_sequences
        self._idle: OrderedDict[int, Sequence] = OrderedDict()  # seq id -> Sequence, LRU first
        self.stats = PrefixCacheStats()
        self.last_reused = 0

    def __len__(self) -> int:
        return len(self._idle)

    @property
    def cached(self) -> list:
        """The idle cached sequences, least recently used first."""
        return list(self._idle.values())

    # -- internals ------------------------------------------------------------------------------

    def _best(self, toks: np.ndarray):
        best, best_n = None, 0
        for s in self._idle.values():
            if min(len(s), toks.size) <= best_n:
                continue
            n = shared_prefix(s.tokens, toks)
            if n > best_n:
                best, best_n = s, n
        return best, best_n

    def _evict_one(self, keep=None) -> bool:
        for sid, s in self._idle.items():
            if s is keep:
                continue
            del self._idle[sid]
            s.close()
            self.stats.evictions += 1
            return True
        return False

    def _trim(self) -> None:
        while len(self._idle) > self.max_sequences and self._evict_one():
            pass

    def _remember(self, s) -> None:
        """Cache ``s`` (idle), dropping cached sequences it makes redundant (prefixes of it)."""
        if self.max_sequences == 0:
            s.close()
            return
        toks = s.tokens
        for sid, o in list(self._idle.items()):
            if len(o) > len(toks):
                continue
            ot = o.tokens
            if toks[:len(ot)] == ot:
                del self._idle[sid]
                o.close()
        self._idle[s.id] = s
        self._idle.move_to_end(s.id)
        self._trim()

    # -- API ------------------------------------------------------------------------------------

    def longest(self, tokens) -> int:
        """How many leading tokens of ``tokens`` an idle cached sequence already holds."""
        with self.ctx._critical():
            return self._best(self.ctx.model.check_tokens(tokens))[1]

    def fork_prefix(self, tokens):
        """A new sequence holding the longest cached prefix of ``tokens`` (at most all but the last
        token), without evaluating anything: ``(seq, n)`` with ``n`` the tokens it holds (0: an empty
        sequence). Idle cached sequences other than the matching one are evicted when no sequence
        id is free; LlamaError when none can be had. The caller decodes ``tokens[n:]``."""
        ctx = self.ctx
        with ctx._critical():
            toks = ctx.model.check_tokens(tokens)
            if toks.size == 0:
                raise InvalidInputError("a prompt needs at least one token")
            best, n = self._best(toks)
            n = min(n, toks.size - 1)
            if best is not None:
                self._idle.move_to_end(best.id)
            while True:
                try:
                    seq = best.fork(n) if (best is not None and n > 0) else ctx.new_sequence()
                    break
                except LlamaError:
                    if not self._evict_one(keep=best):
                        raise
            n = len(seq)
            seq.prefix_reused = n
            st = self.stats
            st.requests += 1
            st.prompt_tokens += int(toks.size)
            st.reused_tokens += n
            st.evaluated_tokens += int(toks.size) - n
            return seq, n

    def remember(self, seq) -> bool:
        """Keep a fork of ``seq`` (its current tokens) as an idle cached sequence, if a sequence id
        is free; the caller keeps ``seq``. Returns whether it was kept."""
        with self.ctx._critical():
            self.ctx._own(seq)
            if self.max_sequences == 0 or len(seq) == 0 or not self.ctx.free_sequence_ids:
                return False
            self._remember(seq.fork())
            return True

    def evict(self, keep_for=None) -> bool:
        """Close the least recently used idle cached sequence (not the best match for the tokens
        ``keep_for``, if given); False when there is none to close."""
        with self.ctx._critical():
            keep = None
            if keep_for is not None and len(keep_for):
                keep = self._best(self.ctx.model.check_tokens(keep_for))[0]
            return self._evict_one(keep=keep)

    def acquire(self, tokens, remember: bool = True):
        """A new sequence holding ``tokens`` (see the class docstring); the caller owns it."""
        ctx = self.ctx
        with ctx._critical():
            seq, n = self.fork_prefix(tokens)
            toks = ctx.model.check_tokens(tokens)
            keep = self._best(toks)[0]
            try:
                while True:
                    try:
                        seq.extend(toks[n:])
                        break
                    except KVCacheFullError:
                        if not self._evict_one(keep=keep):
                            raise
            except BaseException:
                seq.close()
                raise
            self.last_reused = n
            if remember and self.max_sequences > 0:
                try:
                    self._remember(seq.fork())
                except LlamaError:
                    pass  # no free id: the prompt simply is not cached
            return seq

    def release(self, seq: Sequence, keep: bool = True) -> None:
        """Give a finished sequence back: cached for later prefixes (``keep``) or closed."""
        with self.ctx._critical():
            self.ctx._own(seq)
            if self._idle.get(seq.id) is seq:
                raise InvalidInputError(f"sequence {seq.id} was already released to the prefix cache")
            if keep and len(seq) > 0:
                self._remember(seq)
            else:
                seq.close()

    def clear(self) -> None:
        """Close every idle cached sequence."""
        with self.ctx._critical():
            for s in list(self._idle.values()):
                s.close()
            self._idle.clear()
