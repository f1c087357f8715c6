"""A draft model: a second, smaller model whose greedy continuation is the draft (issue 47, item 2).

It has its own context on the same library, with one sequence per target continuation that mirrors it:
before drafting, a mirror is cut back to what it shares with the continuation's tokens (a fork, a
removal, an accepted or rejected draft, a context shift: whatever happened on the target side) and the
rest is evaluated, all mirrors in one batched decode; then ``k`` greedy steps draft for every mirror at
once. A mirror of a continuation that finished is closed (:meth:`DraftModel.forget`).

The draft model must share the target's vocabulary (the same size and the same text for every token,
checked once at start: :func:`check_vocab`), since the target verifies the draft's token ids.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from ..errors import InvalidInputError, KVCacheFullError
from .drafts import Draft

__all__ = ["DraftModel", "check_vocab"]


def check_vocab(target, draft) -> None:
    """InvalidInputError unless ``draft`` has ``target``'s vocabulary: its size, and the bytes of every
    token (special tokens included)."""
    if draft.n_vocab != target.n_vocab:
        raise InvalidInputError(f"the draft model's vocabulary has {draft.n_vocab} tokens, the model's "
                                f"{target.n_vocab}: a draft model must share the model's vocabulary (the same "
                                "tokenizer)")
    for t in range(target.n_vocab):
        if draft.token_to_piece(t, special=True) != target.token_to_piece(t, special=True):
            raise InvalidInputError(f"the draft model's token {t} is {draft.token_to_piece(t, special=True)!r}, the "
                                    f"model's {target.token_to_piece(t, special=True)!r}: a draft model must share the "
                                    "model's vocabulary (the same tokenizer)")


class DraftModel:
    """Greedy drafts of ``model`` (see the module docstring) in a context of ``n_ctx`` cells with
    ``parallel`` mirror sequences."""

    def __init__(self, model, parallel: int, n_ctx: int, n_threads: int | None = None, **cache):
        self.model = model
        self.ctx = model.context(n_ctx=n_ctx, n_seq_max=parallel, n_threads=n_threads, **cache)
        self._mirrors: dict[Hashable, Any] = {}   # key -> its mirror Sequence

    def close(self) -> None:
        self.ctx.close()

    def forget(self, key: Hashable) -> None:
        """The continuation ``key`` is done: its mirror goes."""
        seq = self._mirrors.pop(key, None)
        if seq is not None:
            seq.close()

    def _mirror(self, key: Hashable, tokens: Sequence[int]):
        """``key``'s mirror, cut back to what it shares with ``tokens``; (mirror, the tokens it lacks)."""
        seq = self._mirrors.get(key)
        if seq is None:
            if not self.ctx.free_sequence_ids:
                return None, []
            seq = self._mirrors[key] = self.ctx.new_sequence()
        held = seq.tokens
        n = 0
        limit = min(len(held), len(tokens) - 1)   # the last token is decoded with the draft's first step
        while n < limit and held[n] == tokens[n]:
            n += 1
        if n < len(held):
            seq.truncate(n)
        return seq, list(tokens[n:])

    def propose(self, wanted: Sequence[tuple[Hashable, Sequence[int], int]]) -> dict[Hashable, Draft]:
        """Drafts for ``wanted`` [(key, the continuation's tokens, the most draft tokens)]: catch every
        mirror up, then draft greedily for all at once. A mirror that does not fit is dropped (its
        continuation gets no draft this step)."""
        todo = {}
        for key, tokens, k in wanted:
            if k > 0 and len(tokens) + k < self.ctx.n_ctx:
                seq, missing = self._mirror(key, tokens)
                if seq is not None and missing:
                    todo[key] = (seq, missing, k)
        if not todo:
            return {}
        try:
            out = self.ctx.decode({seq: missing for seq, missing, _k in todo.values()}, copy=False)
        except KVCacheFullError:
            for key in todo:
                self.forget(key)
            return {}
        drafts = {key: [int(np.argmax(out[seq]))] for key, (seq, _m, _k) in todo.items()}
        for step in range(1, max(k for _s, _m, k in todo.values())):
            batch = {todo[key][0]: [d[-1]] for key, d in drafts.items() if todo[key][2] > step}
            if not batch:
                break
            try:
                out = self.ctx.decode(batch, copy=False)
            except KVCacheFullError:
                break
            for key, d in drafts.items():
                seq = todo[key][0]
                if seq in out:
                    d.append(int(np.argmax(out[seq])))
        return {key: Draft(d, "draft", 0) for key, d in drafts.items()}
