"""A sequence of a context's KV cache: a handle (its context and its id).

The context owns what a sequence holds: its tokens (the invariant: a sequence of length n holds
exactly positions 0..n-1 in the cache, position i holding ``tokens[i]``) and its next-token logits,
in one table keyed by sequence id (as Ollama's ``Causal`` owns its cells and llama.cpp's server slot
its ``cache_tokens``). Every method here forwards to the context's sequence channel (its public
``sequence_*`` methods), which checks the handle (closed, of another context), keeps the invariant,
and leaves everything untouched when it fails. How removal, shifting
and copy-on-write work is in :mod:`pyllama_kv.core.context`.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidInputError
from .state import SequenceState

if TYPE_CHECKING:
    from .checkpoint import Checkpoint
    from .span import Span

__all__ = ["Sequence", "SequenceState"]


class Sequence:
    """A sequence id in a :class:`~pyllama_kv.core.context.Context`. Made by ``ctx.new_sequence()`` or
    :meth:`fork`; use as a context manager or :meth:`close` it to free its id and cells."""

    def __init__(self, ctx, seq_id: int):
        self._ctx = ctx
        self.id = seq_id
        self.reused_tokens = 0  # set by PrefixCache.acquire: tokens served from cached cells

    @property
    def prefix_reused(self) -> int:
        """Deprecated alias of :attr:`reused_tokens` (the one name for prompt tokens served from cache)."""
        warnings.warn("Sequence.prefix_reused is deprecated: use Sequence.reused_tokens", DeprecationWarning,
                      stacklevel=2)
        return self.reused_tokens

    # -- state ----------------------------------------------------------------------------------

    @property
    def context(self):
        return self._ctx

    @property
    def tokens(self) -> list[int]:
        """The token ids the cache holds for this sequence; position i is index i (a copy)."""
        return list(self._ctx.sequence_tokens(self))

    def __len__(self) -> int:
        return len(self._ctx.sequence_tokens(self))

    @property
    def closed(self) -> bool:
        return self._ctx.sequence_closed(self)

    def __repr__(self) -> str:
        return f"<pyllama_kv.Sequence id={self.id} len={len(self)}{' closed' if self.closed else ''}>"

    def __enter__(self) -> Sequence:
        return self

    def __copy__(self):
        raise InvalidInputError("a Sequence cannot be copied (two objects would own one sequence id): "
                                "use seq.fork() for a prefix copy")

    def __deepcopy__(self, memo):
        self.__copy__()

    def __reduce_ex__(self, protocol):
        raise InvalidInputError("a Sequence cannot be pickled: use seq.export_state()")

    def __exit__(self, *exc) -> None:
        self.close()

    # -- decoding -------------------------------------------------------------------------------

    def extend(self, tokens) -> np.ndarray:
        """Decode ``tokens`` after the current ones; return the next-token logits (float32, n_vocab)."""
        return self._ctx.decode({self: tokens})[self]

    def logits(self, recompute: bool = False) -> np.ndarray:
        """Next-token logits for the current tokens.

        Returned from the last decode when still valid; otherwise (after remove, truncate, a shift, or
        with ``recompute=True``) the last token is evaluated again over the cached prefix, which is also
        a direct check of what the cache holds. That needs one cell: KVCacheFullError when the cache is
        full to the last cell and this sequence's last cell is shared with a fork.
        """
        return self._ctx.sequence_logits(self, recompute)

    # -- prefix copies --------------------------------------------------------------------------

    def fork(self, n: int | None = None, checkpoint: Checkpoint | None = None) -> Sequence:
        """A new sequence sharing this one's first ``n`` positions (default: all). No recompute:
        the cells are shared, not copied. LlamaError when no sequence id is free.

        A model with recurrent layers keeps their state after the last token only: a fork of fewer
        positions needs ``checkpoint``, a :meth:`checkpoint` of a sequence that held exactly those
        ``n`` tokens (InvalidInputError without one, or with one of other tokens)."""
        return self._ctx.sequence_fork(self, n, checkpoint)

    def checkpoint(self) -> Checkpoint:
        """The recurrent state of this sequence after its last token, in host memory: what a later
        :meth:`fork` at this length needs once the sequence has grown (see
        :mod:`pyllama_kv.core.checkpoint`). A model with recurrent layers and the current library."""
        return self._ctx.sequence_checkpoint(self)

    # -- removal and shifting -------------------------------------------------------------------

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions, drop the rest."""
        self._ctx.sequence_truncate(self, n)

    def remove(self, start: int, end: int, recompute: bool = False) -> None:
        """Drop positions [start, end) and shift the later ones down by ``end - start``.

        The shift is llama.cpp's K-shift (the cached keys are re-rotated, nothing is decoded), as in
        llama.cpp's context shift: the kept tokens keep the K/V they were computed with, so in a model
        of more than one layer the result approximates, by design, a fresh evaluation of the new token
        list. ``recompute=True`` re-evaluates the tail instead (exact, costs ``len - end`` tokens); so
        does a removal whose tail shares cells with a fork (copy-on-write), and every removal on a
        vanilla build or a model that cannot shift.
        """
        self._ctx.sequence_remove(self, start, end, recompute)

    def shift_out(self, n_keep: int, n_discard: int) -> None:
        """Context shift for generation loops: keep the first ``n_keep`` positions, drop the next
        ``n_discard``, shift the rest down. Refused (LlamaError) when the model cannot shift."""
        self._ctx.sequence_shift_out(self, n_keep, n_discard)

    # -- saving and restoring -------------------------------------------------------------------

    def export_state(self) -> SequenceState:
        """A copy of this sequence's cells (K/V data and positions) and tokens, to restore later into
        this context or another context of the same model and cache types with :meth:`Context.import_sequence`.

        Pending K-shifts are applied first (the state copies K as stored); cells shared with forks are
        copied like the others. LlamaError if the cache does not hold exactly positions 0..n-1 for it."""
        return self._ctx.sequence_export(self)

    def snapshot(self, start: int = 0, end: int | None = None) -> Span:
        """A :class:`~pyllama_kv.core.span.Span`: a compact host copy of this sequence's cells over
        positions [start, end) (default: to the end), its K/V rows of every layer and its tokens. The
        sequence is unchanged; the span refers to no cell (pending K-shifts are applied first)."""
        return self._ctx.sequence_snapshot(self, start, end)

    def restore(self, span: Span) -> None:
        """Add ``span``'s cells after this sequence's, which must be exactly positions
        [0, span.start) (they are kept as they are, shared with forks or not): a memcpy into free
        cells, no evaluation. Needs the patched library (LibraryError otherwise). Atomic: on
        KVCacheFullError (no contiguous room even after a defrag) or InvalidInputError (a span of
        another model, cache layout or position) the sequence is as it was."""
        self._ctx.sequence_restore(self, span)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Free this sequence's id and its cells (cells shared with forks stay for them)."""
        self._ctx.sequence_close(self)
