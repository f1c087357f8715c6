"""The prefix cache's checkpoints of a recurrent model's state, where its prefixes branch.

A model with recurrent layers (a hybrid such as LFM2) can share the attention cells of any prefix of
a cached sequence, but its recurrent layers hold only the state after the sequence's last token
(:mod:`pyllama_kv.core.checkpoint`). Without more, a prompt that shares a cached sequence's first n
tokens but not all of them evaluates everything again: what llama-server answers with periodic
context checkpoints and a re-evaluation from the last one before the point where prompts diverge.

:class:`Checkpoints` keeps the state *exactly* at the positions that matter, so that a prompt
evaluates only what no cached prefix holds. The prefix cache and the engine put one there:

* a cached sequence that another one makes redundant (a prefix of it: its cells are shared by the
  longer one, its recurrent state would be lost) leaves its checkpoint behind: the end of a prompt
  whose answer was cached after it, the end of each turn;
* the engine cuts a prompt's evaluation at the caller's turn boundaries (the server's: the end of the
  system prompt) and where the prompt leaves the longest cached prefix (a branch of the trie), and
  keeps a checkpoint at each.

A fork of the first n tokens of a cached sequence then takes its attention cells from that sequence
and its recurrent state from the checkpoint of the same n tokens (``seq.fork(n, checkpoint=ck)``).
At most :data:`~pyllama_kv.limits.CHECKPOINT_BYTES` together, least recently used first out. Not
thread-safe on its own: the prefix cache calls it under the context's lock.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..core.checkpoint import Checkpoint
from ..limits import CHECKPOINT_BYTES

__all__ = ["Checkpoints"]


def _key(tokens: np.ndarray) -> tuple[int, int]:
    return int(tokens.size), hash(tokens.tobytes())


class Checkpoints:
    """Checkpoints keyed by the tokens they follow, least recently used first, at most ``max_bytes``."""

    def __init__(self, max_bytes: int = CHECKPOINT_BYTES):
        self.max_bytes = max_bytes
        self._lru: OrderedDict[tuple[int, int], Checkpoint] = OrderedDict()
        self._lengths: dict[int, int] = {}   # n -> how many checkpoints follow n tokens
        self.n_bytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, tokens) -> bool:
        return self._get(np.asarray(tokens, dtype=np.int32)) is not None

    def _get(self, toks: np.ndarray) -> Checkpoint | None:
        ck = self._lru.get(_key(toks))
        return ck if ck is not None and np.array_equal(ck.tokens, toks) else None

    def add(self, ck: Checkpoint) -> None:
        """Keep ``ck`` as the most recently used (replacing one of the same tokens), then drop the
        least recently used while over the bytes (``ck`` too, when it alone is over them)."""
        key = _key(ck.tokens)
        old = self._lru.pop(key, None)
        if old is not None:
            self._drop(key, old)
        self._lru[key] = ck
        self._lengths[ck.n] = self._lengths.get(ck.n, 0) + 1
        self.n_bytes += ck.n_bytes
        while self.n_bytes > self.max_bytes and self._lru:
            k, o = self._lru.popitem(last=False)
            self._drop(k, o)

    def _drop(self, key: tuple[int, int], ck: Checkpoint) -> None:
        self.n_bytes -= ck.n_bytes
        left = self._lengths[ck.n] - 1
        if left:
            self._lengths[ck.n] = left
        else:
            del self._lengths[ck.n]

    def best(self, tokens: np.ndarray, limit: int) -> Checkpoint | None:
        """The checkpoint of the longest prefix of ``tokens`` no longer than ``limit`` tokens (0 < n),
        marked used; None when there is none."""
        for n in sorted((n for n in self._lengths if 0 < n <= limit), reverse=True):
            ck = self._get(tokens[:n])
            if ck is not None:
                self._lru.move_to_end(_key(ck.tokens))
                return ck
        return None

    def clear(self) -> None:
        self._lru.clear()
        self._lengths.clear()
        self.n_bytes = 0
