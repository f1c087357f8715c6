"""The prefix cache's one eviction rule, and the idle cached sequences it chooses from.

An *idle cached sequence* is one that no caller holds: a prompt or a finished conversation kept in
the context so that a later prompt sharing its prefix forks it (shares its cells) instead of
evaluating those tokens again. :class:`IdlePrefixes` keeps them, least recently used first, and in a
token trie (:class:`~pyllama_kv.prefixcache.trie.TokenTrie`), so :meth:`IdlePrefixes.best` finds the
longest match by walking the prompt's tokens once instead of comparing it with every sequence.

**The rule** (:meth:`IdlePrefixes.evict`; the only code that evicts an idle cached sequence, used by
the API's :class:`~pyllama_kv.prefixcache.cache.PrefixCache` and by the engine's KV layer,
:class:`~pyllama_kv.engine.kv.ContextKV`, which holds a PrefixCache):

1. Only idle cached sequences are evicted, never a sequence a caller holds.
2. The least recently used goes first. A sequence is used when it is cached (:meth:`IdlePrefixes.add`)
   and when a prompt forks it (:meth:`IdlePrefixes.touch`).
3. ``keep`` is never evicted: the best match of the prompt being placed, whose cells that prompt
   will share (the caller finds it with :meth:`IdlePrefixes.best`).
4. An evicted sequence is paged out first (``page_out``: to the host tier, whose spans leave for the
   disk tier when one is set, :mod:`pyllama_kv.prefixcache.tiers`) when the tiers are on, then closed:
   its id and the cells no other sequence shares are free.
5. Caching a sequence closes the idle ones that are a prefix of it (it holds their tokens, so
   nothing is lost; these are not evictions; a sliding-window model's checkpoints stay), and
   :meth:`IdlePrefixes.trim` evicts down to a bound (``PrefixCache.max_sequences``).

What the callers add, by composition, never by a second copy of the rule:

* ``PrefixCache.acquire``/``fork_prefix`` evict while the context has no room or no free id,
  keeping the prompt's best match.
* the engine (``engine/kv.py``, ``PrefixPolicy``): ``reserve`` evicts at admission until the
  prompt's cells and the running requests' promised cells fit, keeping the prompt's best match,
  and lets that match go too only when no request is live (else a running one ending makes room);
  ``make_room`` and ``fork`` keep nothing; ``HoldingKV`` finishes the sequences it holds back
  before anything idle is evicted.

Not thread-safe on its own: PrefixCache calls it under the context's lock.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, Protocol, TypeVar

import numpy as np

from .trie import TokenTrie

__all__ = ["IdlePrefixes"]


class _Seq(Protocol):
    @property
    def id(self) -> int: ...

    @property
    def tokens(self) -> Sequence[int]: ...

    def close(self) -> None: ...


S = TypeVar("S", bound=_Seq)


class IdlePrefixes(Generic[S]):
    """The idle cached sequences (see the module docstring), and the one eviction rule over them.
    A sequence is anything with ``id``, ``tokens`` and ``close()`` (a
    :class:`~pyllama_kv.core.sequence.Sequence`); its tokens are read once, when it is added (an
    idle sequence does not change). ``page_out(seq)`` is called on a sequence before it is evicted
    (None: evicted sequences are dropped), ``absorbed(seq)`` on one before it is closed because a
    longer one holds its tokens (rule 5: the prefix cache keeps a recurrent model's state there);
    when it returns True the sequence stays (a sliding-window model's checkpoint: the longer one
    holds the window before its end only until the cache reuses those cells)."""

    def __init__(self, page_out: Callable[[S], object] | None = None,
                 absorbed: Callable[[S], bool] | None = None):
        self.page_out = page_out
        self.absorbed = absorbed
        self._lru: OrderedDict[int, S] = OrderedDict()   # seq id -> sequence, least recently used first
        self._used: dict[int, int] = {}                  # seq id -> when it was last used (the trie's rank)
        self._len: dict[int, int] = {}
        self._clock = itertools.count()
        self._trie: TokenTrie[int, S] = TokenTrie(rank=lambda s: self._used[s.id])
        self.n_tokens = 0    # tokens the idle sequences hold together

    def __len__(self) -> int:
        return len(self._lru)

    def __iter__(self) -> Iterator[S]:
        """The idle sequences, least recently used first."""
        return iter(list(self._lru.values()))

    def __contains__(self, seq: object) -> bool:
        sid = getattr(seq, "id", None)
        return isinstance(sid, int) and self._lru.get(sid) is seq

    def best(self, tokens: Sequence[int] | np.ndarray) -> tuple[S | None, int]:
        """The idle sequence sharing the most leading tokens with ``tokens``, and how many; of those
        that share as many, the least recently used. ``(None, 0)`` when none shares a token."""
        return self._trie.longest(tokens)

    def prefixes(self, tokens: Sequence[int] | np.ndarray) -> list[S]:
        """The idle sequences whose tokens are all a prefix of ``tokens`` (``tokens`` itself included)."""
        return self._trie.prefixes(tokens)

    def touch(self, seq: S) -> None:
        """``seq`` was used (a prompt forks it): it is the most recently used now."""
        self._used[seq.id] = next(self._clock)
        self._lru.move_to_end(seq.id)
        self._trie.rerank(seq.id)

    def add(self, seq: S) -> None:
        """Cache ``seq`` as the most recently used idle sequence, closing the idle sequences that
        are a prefix of it (rule 5)."""
        toks = np.asarray(seq.tokens, dtype=np.int32)
        for o in self._trie.prefixes(toks):
            if self.absorbed is not None and self.absorbed(o):
                continue   # kept: the caller says the longer one does not hold it for good
            self._forget(o)
            o.close()
        sid = seq.id
        self._lru[sid] = seq
        self._used[sid] = next(self._clock)
        self._len[sid] = len(toks)
        self.n_tokens += len(toks)
        self._trie.insert(sid, seq, toks)

    def _forget(self, seq: S) -> None:
        sid = seq.id
        del self._lru[sid], self._used[sid]
        self.n_tokens -= self._len.pop(sid)
        self._trie.remove(sid)

    def evict(self, keep: S | None = None) -> bool:
        """**The eviction rule**: the least recently used idle sequence other than ``keep`` is paged
        out (``page_out``, when set) and closed. False when there is none to evict."""
        victim = next((s for s in self._lru.values() if s is not keep), None)
        if victim is None:
            return False
        self.evict_this(victim)
        return True

    def evict_this(self, seq: S) -> None:
        """Evict idle ``seq`` now, whatever its rank: paged out (``page_out``, when set) and closed
        (the engine's rule for prefixes idle too long: ContextKV.page_out_idle)."""
        if self.page_out is not None:
            self.page_out(seq)
        self._forget(seq)
        seq.close()

    def last_used(self, seq: S) -> int:
        """When ``seq`` was last added or used (a count that grows with every use of any idle sequence)."""
        return self._used[seq.id]

    def trim(self, max_sequences: int) -> int:
        """Evict (:meth:`evict`) down to ``max_sequences`` idle sequences; how many went."""
        n = 0
        while len(self._lru) > max_sequences and self.evict():
            n += 1
        return n

    def clear(self) -> None:
        """Close every idle sequence (none is paged out)."""
        for s in list(self._lru.values()):
            self._forget(s)
            s.close()
