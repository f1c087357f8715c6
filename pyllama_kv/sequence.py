"""One sequence in a context's KV cache: its tokens, prefix copies, removal and shifting.

The invariant: a sequence of length n holds exactly positions 0..n-1 in the cache, position i
holding ``tokens[i]``. Every method keeps it, and every failing method leaves it untouched.

Cells shared after :meth:`Sequence.fork` are never changed for the other holder: llama.cpp shifts
the position of a shared cell for *every* sequence in it, so when a removal would shift shared
cells, this sequence drops its claim on the tail and re-evaluates it into cells of its own
(copy-on-write). Cost: the tokens after the removed range are decoded again; the sibling pays
nothing. Removals whose tail is private use llama.cpp's K-shift (no decode at all).

A sequence reaches its context only through the context's package interface (see the docstring of
pyllama_kv.context); it makes no C call itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import state as _state
from .config import int_param
from .errors import InvalidInputError, KVCacheFullError, LlamaError


@dataclass(frozen=True)
class SequenceState:
    """The saved cells and tokens of a sequence (see Sequence.export_state), for Context.import_sequence.

    ``data`` is llama.cpp's state of the sequence (the byte layout is in pyllama_kv.state), its cells in
    position order. ``model`` is the fingerprint of the model that made it (pyllama_kv.state.model_fingerprint:
    a hash of the GGUF header, metadata, tensor table and a sample of each tensor's data). ``digest`` is a
    SHA-256 of the fingerprint, the tokens and the data. Import checks all of them and the structure of
    ``data`` against the importing context, and refuses (InvalidInputError) a state that was changed after
    export, comes from another model, or was made with other cache types or flash-attention setting.
    A digest is no signature: K/V values edited with the digest recomputed cannot be told from real ones;
    they are trusted (they change outputs, they cannot crash the process or break the cache).
    """

    tokens: list
    data: bytes = field(repr=False)
    model: str = ""
    digest: str = ""


class Sequence:
    """A sequence id in a :class:`~pyllama_kv.context.Context`. Made by ``ctx.new_sequence()`` or
    :meth:`fork`; use as a context manager or :meth:`close` it to free its id and cells."""

    def __init__(self, ctx, seq_id: int):
        self._ctx = ctx
        self.id = seq_id
        self._tokens: list[int] = []
        self._logits: np.ndarray | None = None
        self._closed = False
        self.prefix_reused = 0  # set by PrefixCache.acquire: tokens served from cached cells

    # -- state ----------------------------------------------------------------------------------

    @property
    def context(self):
        return self._ctx

    @property
    def tokens(self) -> list[int]:
        """The token ids the cache holds for this sequence; position i is index i (a copy)."""
        return list(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<pyllama_kv.Sequence id={self.id} len={len(self._tokens)}{' closed' if self._closed else ''}>"

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

    def _check(self) -> None:
        self._ctx._check_open()
        if self._closed:
            raise InvalidInputError(f"sequence {self.id} is closed")

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
        with self._ctx._critical():
            self._check()
            if not self._tokens:
                raise InvalidInputError(f"sequence {self.id} is empty: it has no next-token logits")
            if self._logits is None or recompute:
                self._rebuild_tail(len(self._tokens) - 1, np.asarray(self._tokens[-1:], dtype=np.int32))
            assert self._logits is not None
            return self._logits.copy()

    # -- prefix copies --------------------------------------------------------------------------

    def fork(self, n: int | None = None) -> Sequence:
        """A new sequence sharing this one's first ``n`` positions (default: all). No recompute:
        the cells are shared, not copied. LlamaError when no sequence id is free."""
        ctx = self._ctx
        with ctx._critical():
            self._check()
            n = len(self._tokens) if n is None else int_param("n", n, 0, len(self._tokens))
            child = ctx.new_sequence()
            if n > 0:
                ctx._seq_copy(self.id, child.id, 0, n)
            child._tokens = self._tokens[:n]
            if n == len(self._tokens) and self._logits is not None:
                child._logits = self._logits.copy()
            return child

    # -- removal and shifting -------------------------------------------------------------------

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions, drop the rest."""
        ctx = self._ctx
        with ctx._critical():
            self._check()
            n = int_param("n", n, 0, len(self._tokens))
            if n == len(self._tokens):
                return
            ctx._seq_remove(self.id, n, -1)
            del self._tokens[n:]
            self._logits = None
            ctx._forget_logits(self.id)   # a sampler must not use the logits of the longer sequence

    def remove(self, start: int, end: int, recompute: bool = False) -> None:
        """Drop positions [start, end) and shift the later ones down by ``end - start``.

        The shift is llama.cpp's K-shift (the cached keys are re-rotated, nothing is decoded), as in
        llama.cpp's context shift: the kept tokens keep the K/V they were computed with, so in a model
        of more than one layer the result approximates, by design, a fresh evaluation of the new token
        list. ``recompute=True`` re-evaluates the tail instead (exact, costs ``len - end`` tokens); so
        does a removal whose tail shares cells with a fork (copy-on-write), and every removal on a
        vanilla build or a model that cannot shift.
        """
        ctx = self._ctx
        with ctx._critical():
            self._check()
            n = len(self._tokens)
            start = int_param("start", start, 0, n)
            end = int_param("end", end, start, n)
            if start == end:
                return
            if end == n:
                self.truncate(start)
                return
            tail = np.asarray(self._tokens[end:], dtype=np.int32)
            shift_ok = (not recompute and ctx.can_shift and ctx.patched
                        and not ctx._shared_in(self.id, end, n))
            if not shift_ok:
                self._rebuild_tail(start, tail)
                return
            ctx._seq_remove(self.id, start, end)
            ctx._seq_shift(self.id, end, -1, -(end - start))
            del self._tokens[start:end]
            self._logits = None
            ctx._forget_logits(self.id)

    def shift_out(self, n_keep: int, n_discard: int) -> None:
        """Context shift for generation loops: keep the first ``n_keep`` positions, drop the next
        ``n_discard``, shift the rest down. Refused (LlamaError) when the model cannot shift."""
        ctx = self._ctx
        with ctx._critical():
            self._check()
            if not ctx.can_shift:
                raise LlamaError(
                    "this model/context cannot shift its KV cache (no RoPE, or a cache type without K-shift)")
            n = len(self._tokens)
            n_keep = int_param("n_keep", n_keep, 0, n)
            n_discard = int_param("n_discard", n_discard, 0, n - n_keep)
            self.remove(n_keep, n_keep + n_discard)

    def _rebuild_tail(self, start: int, tail: np.ndarray) -> None:
        """Make positions [start:] hold ``tail``, evaluated afresh into cells of this sequence only.

        Atomic. When ``tail.size`` cells are free, the tail is built under the context's spare
        sequence id (which shares our prefix) and swapped in only when the decode succeeded.
        Otherwise (patched build only) it is rebuilt in place, in the cells our old tail frees:
        that decode cannot be aborted (the abort callback and Ctrl-C wait for it), and the patched
        library's defrag-and-retry guarantees it a slot, since the cells were counted first. The
        vanilla build, which may fail to place a batch in scattered cells, refuses instead
        (KVCacheFullError, nothing changed).
        """
        ctx = self._ctx
        sid = self.id
        if tail.size == 0:
            self.truncate(start)
            return
        free = ctx._free_cells()
        if free >= tail.size:
            tmp = ctx._spare_id
            ctx._seq_remove(tmp, -1, -1)
            try:
                if start > 0:
                    ctx._seq_copy(sid, tmp, 0, start)
                (logits,) = ctx._raw_decode([(tmp, tail, start)])
            except BaseException:
                ctx._seq_remove(tmp, -1, -1)
                ctx._forget_logits(tmp)
                raise
            # swap: our cells become the spare sequence's
            ctx._seq_remove(sid, -1, -1)
            ctx._seq_copy(tmp, sid, -1, -1)
            ctx._seq_remove(tmp, -1, -1)
            ctx._move_logits(tmp, sid)
        else:
            exclusive = ctx._exclusive_cells(sid, start)
            if not ctx.patched or free + exclusive < tail.size:
                why = ("" if ctx.patched else
                       "; the vanilla build cannot re-evaluate in place without risking the sequence")
                raise KVCacheFullError(
                    f"re-evaluating {tail.size} tokens of sequence {sid} needs {tail.size} free cells; {free} are "
                    f"free{why}")
            old = np.asarray(self._tokens[start:], dtype=np.int32)
            ctx._seq_remove(sid, start, -1)
            with ctx._uninterruptible():
                try:
                    (logits,) = ctx._raw_decode([(sid, tail, start)])
                except LlamaError:
                    self._restore_tail(start, old)
                    raise
        del self._tokens[start:]
        self._tokens.extend(int(t) for t in tail)
        self._logits = logits

    def _restore_tail(self, start: int, old: np.ndarray) -> None:
        """Best effort after an in-place re-evaluation failed for a reason no check foresees (a
        compute error): decode the old tail again, else truncate and say so."""
        ctx = self._ctx
        with ctx._uninterruptible():
            try:
                if old.size:
                    ctx._raw_decode([(self.id, old, start)])
            except LlamaError as exc:
                del self._tokens[start:]
                self._logits = None
                ctx._forget_logits(self.id)
                raise LlamaError(f"sequence {self.id} could not be restored after a failed re-evaluation and was "
                                 f"truncated to {start} tokens: {exc}") from exc

    # -- saving and restoring -------------------------------------------------------------------

    def export_state(self) -> SequenceState:
        """A copy of this sequence's cells (K/V data and positions) and tokens, to restore later into
        this context or another context of the same model and cache types with :meth:`Context.import_sequence`.

        Pending K-shifts are applied first (the state copies K as stored); cells shared with forks are
        copied like the others. LlamaError if the cache does not hold exactly positions 0..n-1 for it."""
        ctx = self._ctx
        with ctx._critical():
            self._check()
            return _state.export_sequence(self)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Free this sequence's id and its cells (cells shared with forks stay for them)."""
        ctx = self._ctx
        if self._closed:
            return
        with ctx._critical():
            if self._closed or ctx.closed:
                self._closed = True
                return
            ctx._release(self.id)
            self._closed = True
            self._tokens = []
            self._logits = None
