"""The first part of :class:`~pyllama_kv.core.context.Context`: its lifecycle and lock, the table of
what each sequence holds, the raw cell operations and the C calls that decode and maintain the cache.

A Context is one class built in layers, one concern a module, each the next one's base:
``ContextBase`` (here) <- :class:`~.context_cells.ContextCells` (maintenance and inspection) <-
:class:`~.context_state.ContextStates` (states, spans and whole states: what a library's capabilities
allow) <- :class:`~.context.Context` (construction, :meth:`decode` and the sequence channel). They are
one object: the context stays the one writer of cells and of the table, and its contract is
:mod:`pyllama_kv.core.context`'s docstring. Only ``Context`` is made; the layers are not used alone.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable

import numpy as np

from .._native import kv as _kv
from ..errors import DecodeError, InvalidInputError, LibraryError, LlamaError
from . import _signals, state as _state
from .batching import POLL_TOKENS as _POLL_TOKENS, chunk_plan as _chunk_plan, fill_batch as _fill_batch
from .checkpoint import Checkpoint
from .cost import EvalCost
from .critical import Critical as _Critical, LockState as _LockState
from .kvstats import KVStats, kv_stats as _kv_stats
from .returncodes import decode_error as _decode_error
from .sequence import Sequence as _Sequence

if TYPE_CHECKING:
    from .batching import Plan as _Plan
    from .model import Model

class _SeqEntry:
    """One row of a context's sequence table: the handle given out for the id, the tokens its cells
    hold (position i: ``tokens[i]``), and the next-token logits of its last decode (None: to recompute)."""

    __slots__ = ("seq", "id", "tokens", "logits")

    def __init__(self, seq: _Sequence):
        self.seq = seq
        self.id: int = seq.id
        self.tokens: list[int] = []
        self.logits: np.ndarray | None = None


_NO_TOKENS: tuple = ()

# what each capability a method may need is, for the LibraryError of a library without it
_CAP_TEXT = {
    "state_io": "sequence states in the byte format pyllama_kv validates (llama_state_seq_* of the mission pin; "
                "of the current one with patches/current/0002)",
    "span_restore": "llama_state_seq_add_data (restoring a span onto a sequence that keeps its prefix: patch 0014; "
                    "patches/current/0001 on the current pin)",
    "cell_view": "a per-cell view of the KV cache in cache order (llama_kv_cache_view)",
    "recurrent_checkpoints": "a sequence's recurrent state read and written alone (llama_state_seq_*_ext with "
                             "LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: the current pin)",
}


class ContextBase(_kv.CResource):
    """Lifecycle, lock, table, raw cell operations and C calls of a :class:`~.context.Context`
    (whose ``__init__`` sets every attribute declared here)."""

    caps: _kv.Caps
    model: Model
    _libobj: _kv.Library
    n_threads: int
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    _spare_id: int
    _guard: _LockState
    _no_abort: bool
    _abort_exc: BaseException | None
    _abort_fn: Callable[[], bool] | None
    _abort_installed: bool
    _shift_pending: bool
    _layout: _state.Layout | None
    _whole_owner: object
    type_k: str
    type_v: str
    can_shift: bool
    patched: bool
    _batch: _kv.NativeBatch
    _free_ids: list[int]
    _table: dict[int, _SeqEntry]
    eval_cost: EvalCost

    # -- lifecycle ------------------------------------------------------------------------------

    _native: _kv.NativeContext | None = None   # None until made and once closed

    def _adopt(self, native: _kv.NativeContext) -> None:
        """Called by Model.open_native_context with the new native context, under the model's lock."""
        self._native = native

    @property
    def closed(self) -> bool:
        return self._native is None

    # raw C access for tests and scripts that go behind the API's back (not used by the package)
    @property
    def _ptr(self):
        """The raw ``llama_context *`` (None once closed)."""
        n = self._native
        return None if n is None else n.ptr

    @property
    def _L(self):
        """The cffi library the context's C calls go through (a benchmark may replace it)."""
        assert self._native is not None
        return self._native.L

    @_L.setter
    def _L(self, lib) -> None:
        assert self._native is not None
        self._native.L = lib

    def close(self) -> None:
        """Free the context and its KV cache; its sequences become closed. Refused (InvalidInputError)
        from the context's own abort callback, while its decode runs."""
        if getattr(self, "_native", None) is None:
            return
        with self.critical():
            native = self._native
            if native is None:
                return
            if self._guard.depth > 1:
                # a log handler or callback running inside another call of this context: freeing it
                # here would pull the context out from under that call
                raise InvalidInputError("the context cannot be closed from inside one of its own calls "
                                        "(a callback or log handler)")
            # every handle is closed now (see sequence_closed); the table stays, so that a sequence closed
            # with its context still tells the tokens it held (one closed by Sequence.close holds none)
            for e in self._table.values():
                e.logits = None
            self._native = None
            native.free()
            self.model.forget_context(self)

    def critical(self) -> _Critical:
        """``with ctx.critical():`` the lock, Ctrl-C held back, no re-entry from a callback."""
        return _Critical(self._guard)

    def __repr__(self) -> str:
        if self.closed:
            return "<pyllama_kv.Context closed>"
        return (f"<pyllama_kv.Context n_ctx={self.n_ctx} sequences={len(self._table)}/{self.n_seq_max} "
                f"{self._libobj.info.get('variant') or self.caps.api}>")

    def check_open(self) -> None:
        """InvalidInputError when the context is closed."""
        if self._native is None:
            raise InvalidInputError("the context is closed")

    def check_sequence(self, seq) -> None:
        """InvalidInputError unless ``seq`` is a sequence open in this context."""
        self._own(seq)

    @property
    def lock(self) -> threading.RLock:
        """The context's lock; hold it to make several calls one atomic step."""
        return self._guard.lock

    # -- sequences ------------------------------------------------------------------------------

    def new_sequence(self):
        """A new, empty sequence with a free id. LlamaError when all n_seq_max ids are in use."""
        with self.critical():
            self.check_open()
            if not self._free_ids:
                raise LlamaError(
                    f"all {self.n_seq_max} sequences are in use: close one first (n_seq_max={self.n_seq_max})")
            sid = self._free_ids.pop(0)
            self._seq_remove(sid, -1, -1)  # defensive: the id starts empty
            s = _Sequence(self, sid)
            self._table[sid] = _SeqEntry(s)
            return s

    @property
    def sequences(self) -> list:
        """The open sequences, by id."""
        with self._guard.lock:
            if self._native is None:
                return []
            return [self._table[k].seq for k in sorted(self._table)]

    @property
    def free_sequence_ids(self) -> int:
        with self._guard.lock:
            return len(self._free_ids)

    def _own(self, seq) -> _SeqEntry:
        """The table entry of ``seq``; InvalidInputError when it is not a sequence open in this context."""
        if type(seq) is _Sequence and self._native is not None:
            e = self._table.get(seq.id)
            if e is not None and e.seq is seq:
                return e
        if not isinstance(seq, _Sequence):
            raise InvalidInputError(f"expected a Sequence, got {type(seq).__name__}")
        if seq.context is not self:
            raise InvalidInputError("the sequence belongs to another context")
        raise InvalidInputError(f"sequence {seq.id} is closed")

    def _entry(self, seq) -> _SeqEntry:
        """The entry of ``seq`` for an operation on it: the context open, ``seq`` open in it."""
        self.check_open()
        return self._own(seq)

    def _release(self, sid: int) -> None:
        """Free sequence id ``sid`` and its cells; its handle is closed."""
        self._seq_remove(sid, -1, -1)
        del self._table[sid]
        self._free_ids.append(sid)
        self._free_ids.sort()

    def _free_cells(self) -> int:
        """Cells no sequence holds (cheap: no view is read)."""
        assert self._native is not None
        return self.n_ctx - self._native.used_cells()

    def free_cells(self) -> int:
        """Cells no sequence holds now (cheap: llama.cpp's counter, no view is read)."""
        with self.critical():
            self.check_open()
            return self._free_cells()

    # -- raw cell operations (the caller holds critical and validated) ------------------------

    def _seq_remove(self, sid: int, p0: int, p1: int) -> None:
        """Drop the cells of ``sid`` with position in [p0, p1) (-1: open end); no shift. A range the
        library's memory refuses (recurrent or sliding-window: llama.cpp's seq_rm says false and
        changes nothing) is InvalidInputError, raised before any table change."""
        assert self._native is not None
        if not self._native.seq_rm(sid, p0, p1):
            raise InvalidInputError(
                f"llama.cpp cannot remove positions [{p0}, {'end' if p1 < 0 else p1}) of sequence {sid}: this "
                "model's memory (recurrent or sliding-window) keeps no per-position state to cut; nothing was "
                "changed (re-create the sequence from its tokens instead)")

    def _check_cut(self, e: _SeqEntry, n: int, what: str, checkpoint: Checkpoint | None = None) -> None:
        """InvalidInputError, raised before anything changes, when sequence ``e`` cannot continue
        from its first ``n`` positions (0 < n < its length: a fork, truncation, removal or
        re-evaluation that keeps them): recurrent layers hold the state after its last token only
        (unless ``checkpoint``, already checked by :meth:`_check_checkpoint`, holds the state at
        ``n``), and a sliding-window cache that reused the cells of positions outside the window of
        its last token (llama_memory_seq_pos_min rose) no longer holds the positions the token at
        ``n`` attends to, [n - n_swa + 1, n)."""
        if n <= 0 or n >= len(e.tokens):
            return
        if self.model.recurrent and checkpoint is None:
            raise InvalidInputError(f"{what} needs the state of sequence {e.id} at position {n}, which this "
                                    "model's recurrent layers no longer hold (only the state after its last "
                                    "token); nothing was changed")
        w = self.model.n_swa
        if w > 0:
            assert self._native is not None
            lo = self._native.seq_pos_min(e.id)
            if lo > max(0, n - w + 1):
                raise InvalidInputError(
                    f"{what} needs positions [{max(0, n - w + 1)}, {n}) of sequence {e.id} (the {w}-token sliding "
                    f"window of position {n}), but its sliding-window cache holds them only from position {lo} "
                    "on (the cells of older positions were reused); nothing was changed")

    def _seq_copy(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Let ``dst`` also hold ``src``'s cells with position in [p0, p1) (-1: open end)."""
        assert self._native is not None
        self._native.seq_cp(src, dst, p0, p1)

    def _seq_shift(self, sid: int, p0: int, p1: int, delta: int) -> None:
        """Shift positions [p0, p1) of ``sid`` by ``delta`` (a K-shift, applied before the next
        decode or view read)."""
        assert self._native is not None
        self._native.seq_add(sid, p0, p1, delta)
        self._shift_pending = True

    @contextlib.contextmanager
    def _uninterruptible(self) -> Iterator[None]:
        """``with ctx._uninterruptible():`` decodes inside ignore the abort callback and Ctrl-C."""
        prev = self._no_abort
        self._no_abort = True
        try:
            yield
        finally:
            self._no_abort = prev

    def _need(self, cap: str, what: str) -> None:
        """LibraryError naming ``what`` and the capability ``cap`` when the library lacks it."""
        if not getattr(self.caps, cap):
            raise LibraryError(f"{what} needs {_CAP_TEXT[cap]}, which the {self.caps.api} llama.cpp library "
                               f"({self._libobj.path}) does not have yet")

    # -- the C calls that decode and maintain the cache -------------------------------------------

    def _on_abort_poll(self, _data) -> bool:
        """Polled by ggml between graph nodes (with the GIL): True aborts the decode. An exception
        from the user's callback aborts it too, and is raised (as the cause) after the rollback."""
        try:
            if self._no_abort:
                return False
            if _signals.interrupt_pending():
                return True
            fn = self._abort_fn
            return bool(fn()) if fn is not None else False
        except BaseException as exc:   # never into C; KeyboardInterrupt included
            self._abort_exc = exc
            return True

    def _set_abort(self, on: bool) -> None:
        if on != self._abort_installed:
            assert self._native is not None
            self._native.enable_abort(on)
            self._abort_installed = on

    def _c_decode(self, batch, n_tokens: int) -> int:
        """One llama_decode with the abort callback installed when it has something to poll."""
        self._set_abort(self._abort_fn is not None or n_tokens >= _POLL_TOKENS)
        self._abort_exc = None
        native = self._native
        assert native is not None
        guard = self._guard
        guard.busy = True
        try:
            return native.decode(batch, n_tokens)
        finally:
            guard.busy = False

    def _c_update(self) -> None:
        """llama_kv_self_update: apply pending K-shifts and a scheduled defrag, to completion. The
        abort callback is not obeyed here: maintenance either completes or, interrupted, would
        leave cells and K/V disagreeing (llama.cpp drops an aborted shift's deltas)."""
        assert self._native is not None
        prev = self._no_abort
        self._guard.busy = True
        self._no_abort = True
        try:
            self._native.update()
            self._shift_pending = False
        finally:
            self._guard.busy = False
            self._no_abort = prev

    def _apply_shifts(self) -> None:
        """Apply a pending K-shift now, so that cell positions read from the view are exact and a
        following decode cannot abort the shift half-way."""
        if self._shift_pending:
            self._c_update()

    def _raw_decode(self, plan: _Plan, copy: bool = True, n_outs: list[int] | None = None,
                    greedy: list[bool] | None = None, between: Callable[[], None] | None = None) -> list:
        """Decode ``plan`` = [(seq_id, tokens, first_pos)] (validated) in as few llama_decode calls as
        n_batch allows, with one output (the last token) per entry, or the last ``n_outs[e]`` of entry
        ``e`` (validated: 1..its tokens), whose result is then an (n, n_vocab) array in position order.
        On failure every entry's new positions are removed and the mapped exception is raised.
        ``copy=False``: the one-row results of the last llama_decode are read-only views of llama.cpp's
        output buffer (see :meth:`decode`). ``greedy[e]``: entry ``e``'s result is its argmax token
        instead (an int; a list of them with ``n_outs``) where the graph chose it
        (:meth:`_sample_in_graph`), else its logits as usual. ``between()`` runs after the last
        llama_decode returned and before an output is read, the context refusing every call meanwhile
        (as from its abort callback); what it raises is raised after the rollback."""
        native = self._native
        assert native is not None
        b = self._batch
        rows_of: list[list] = [[] for _ in plan]
        n_vocab = self.model.n_vocab
        chunks = _chunk_plan(plan, b.cap)
        self._apply_shifts()
        in_graph = self._sample_in_graph(plan, greedy)
        try:
            for k, chunk in enumerate(chunks):
                n, outs = _fill_batch(b, plan, chunk, n_outs)
                rc = self._c_decode(b, n)
                if rc != 0:
                    raise self._decode_error(rc)
                if between is not None and k == len(chunks) - 1:
                    self._guard.busy = True   # (on a GPU the graph is still running: only the host works)
                    try:
                        between()
                    finally:
                        self._guard.busy = False
                raw = outs if in_graph is None else [o for o in outs if not in_graph[o[0]]]
                if in_graph is not None and len(raw) < len(outs):
                    for e, bidx in outs:
                        if in_graph[e]:
                            rows_of[e].append(self._sampled_token(bidx))
                if raw:
                    # one copy for all rows of this call (a view for the last call's, when asked);
                    # each output gets a row of it (llama.cpp keeps a row for every output when one of
                    # a micro-batch's outputs has no sampler in the graph)
                    view = not copy and k == len(chunks) - 1
                    rows = native.logits_view(len(outs), n_vocab) if view else native.logits(len(outs), n_vocab)
                    for i, (e, _bidx) in enumerate(outs):
                        if in_graph is None or not in_graph[e]:
                            rows_of[e].append(rows[i])
        except BaseException:
            # llama_decode restored its own partial cells; remove what earlier chunks added
            for sid, _toks, pos0 in plan:
                native.seq_rm(sid, pos0, -1)
            raise
        out: list = []
        for e, r in enumerate(rows_of):
            many = n_outs is not None and n_outs[e] > 1
            if in_graph is not None and in_graph[e]:
                out.append(r if many else r[0])
            else:
                out.append((r[0] if len(r) == 1 and not many else np.stack(r)) if r else None)
        return out

    def _sample_in_graph(self, plan: _Plan, greedy: list[bool] | None) -> list[bool] | None:
        """Which entries of ``plan`` get their greedy token from the graph (None: none): a greedy chain
        is attached to the sequence ids of the ``greedy`` entries and removed from the others' (they
        need their logits), each id keeping its chain until a decode wants otherwise, since every change
        costs a graph reservation. Only where the library samples in the graph (``caps.backend_sampling``)."""
        if not self.caps.backend_sampling:
            return None
        native = self._native
        assert native is not None
        has = native.sampled_ids()
        if not self._graph_argmax:   # this backend chose no token once: its chains come off, numpy decides
            for sid in has:
                native.set_sampler(sid, None)
            return None
        if not has and not greedy:
            return None
        n_vocab = self.model.n_vocab
        res = []
        for e, (sid, _t, _p) in enumerate(plan):
            want = greedy is not None and greedy[e]
            on = sid in has
            if want != on:
                on = native.attach_greedy(sid, n_vocab) if want else not native.set_sampler(sid, None)
            res.append(want and on)
        return res if any(res) else None

    def _sampled_token(self, bidx: int) -> int:
        """The token the graph chose for batch row ``bidx`` (DecodeError where it chose none: a backend
        whose argmax the chain could not take, which llama.cpp accepts all the same)."""
        assert self._native is not None
        tok = self._native.sampled_token(bidx)
        if not 0 <= tok < self.model.n_vocab:
            self._graph_argmax = False   # (later decodes take numpy's argmax)
            raise DecodeError(f"the greedy sampler in the graph chose no token (got {tok}): this backend cannot "
                              "sample in the graph, so this context no longer tries; nothing was changed")
        return tok

    def _decode_error(self, rc: int) -> BaseException:
        """The exception for llama_decode's return code ``rc`` (see :mod:`.returncodes`)."""
        exc, self._abort_exc = self._abort_exc, None
        return _decode_error(rc, self._libobj.last_error(), stats=self.kv_stats, patched=self.caps.slot_retry,
                             abort_exc=exc)

    def _read_view(self) -> tuple[np.ndarray, np.ndarray]:
        assert self._native is not None
        return self._native.view()

    def kv_stats(self) -> KVStats:
        """Cells, holes, the largest free block, and (patched build) the defrag/retry counters."""
        with self.critical():
            self.check_open()
            _, seqs = self._read_view()
            counters = None
            if self.caps.stats:
                assert self._native is not None
                counters = self._native.stats()
        return _kv_stats(seqs, counters)
