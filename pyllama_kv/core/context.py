"""A llama.cpp context: one KV cache shared by up to ``n_seq_max`` sequences.

Contract (what every method guarantees):

* **Validation first.** Token ids, sequence membership, positions and sizes are checked in Python
  before any C call; bad input raises :class:`~pyllama_kv.errors.InvalidInputError` and changes
  nothing.
* **Atomic decode.** If :meth:`Context.decode` fails (cache full even after defrag, abort callback,
  compute error), every sequence involved is exactly as before the call: its token list and its
  cells (partial positions are removed).
* **Thread safety.** One re-entrant lock per context serialises every call on the context and its
  sequences, so a context may be shared between threads. Calls on different contexts run in
  parallel.
* **Vanilla builds.** The API runs on the unpatched library too (for comparisons): stats counters
  are ``None``, ``remove`` re-evaluates instead of K-shifting, and ``defrag`` refuses when the
  vanilla library would abort the process (see patches/0003).

Ownership. The context is the only writer of what its sequences hold: a table keyed by sequence id
(``_table``, one :class:`_SeqEntry` per open sequence) has each sequence's handle, its tokens (the
invariant: a sequence of length n holds exactly positions 0..n-1, position i holding ``tokens[i]``)
and the next-token logits of its last decode (None once its tokens changed otherwise: recomputed on
demand). A :class:`~pyllama_kv.core.sequence.Sequence` is a handle (context, id): its methods call the
context's, which check it, change cells and table together, and keep the invariant. A handle is
closed when the table no longer holds it under its id (Sequence.close), or when the context is closed
(the table then keeps the tokens each sequence held, for reading).

Removal shifts with llama.cpp's K-shift when the removed range's tail is private. Cells shared after
a fork are never changed for the other holder: llama.cpp shifts the position of a shared cell for
*every* sequence in it, so when a removal would shift shared cells, the sequence drops its claim on
the tail and re-evaluates it into cells of its own (copy-on-write; the sibling pays nothing).

Package interface. sequence.py, prefix.py, sampling.py and engine/ use a context only through its
public methods and these single-underscore ones (not public API, but the documented way in; nothing
else in the package reads a Context's attributes):

* public: ``critical()`` (``with ctx.critical():`` the lock, Ctrl-C held back, re-entry from a
  callback refused: several calls as one step), ``check_open()``, ``check_sequence(seq)``
  (InvalidInputError for a closed context / a sequence not open in it), ``shared_in(sid, lo, hi)``;
* ``_own(seq)``: the sequence's entry (``.tokens``, ``.logits``: read, never written), for sampling.
* ``_tokens_of(seq)``, ``_is_closed(seq)``: what a handle holds (its live token list: read, never
  written) and whether it is closed; no lock taken.
* ``_next_logits(seq, recompute, copy)``, ``_fork``, ``_truncate``, ``_remove``, ``_shift_out``,
  ``_export``, ``_close_sequence``: the operations behind Sequence's methods (and Sampler.sample).
* ``shared_in(seq_id, lo, hi)``: whether another sequence shares a cell of ``seq_id`` in [lo, hi).

Tests and scripts that go behind the API's back use ``_ptr``, ``_L``, ``_seq_remove`` and
``_read_seq_state``.

All C calls go through ``self._native`` (:class:`pyllama_kv._native.kv.NativeContext`).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .._native import kv as _kv
from ..config import ContextConfig, default_threads, int_param
from ..errors import DecodeError, InvalidInputError, KVCacheFullError, LibraryError, LlamaError
from ..limits import KV_CACHE_TYPES, kv_type_block
from . import _signals, state as _state
from .sequence import Sequence as _Sequence
from .state import SequenceState as _SequenceState

if TYPE_CHECKING:
    from .model import Model
    from .span import Span as _Span


@dataclass(frozen=True)
class KVStats:
    """A snapshot of the KV cache. Counters are cumulative over the context's life and are None on a
    vanilla build (which lacks ``llama_kv_self_stats``)."""

    n_cells: int
    used_cells: int
    free_cells: int
    holes: int                 # free runs with a used cell after them (gaps a batch cannot span)
    largest_free_block: int    # the biggest batch that fits without a defrag
    fragmentation: float       # 1 - largest_free_block / free_cells (0: all free cells contiguous)
    defrags: int | None = None
    moves: int | None = None
    cells_moved: int | None = None
    graphs: int | None = None
    nodes: int | None = None           # graph nodes computed for defrags (0 on the host memcpy path)
    slot_retries: int | None = None
    slot_failures: int | None = None
    defrag_seconds: float | None = None   # time spent in defrags (patched build)

    def as_dict(self) -> dict:
        return asdict(self)


def _fast_tokens(toks, n_vocab: int) -> list | None:
    """``toks`` itself when it is a list of in-range Python ints (the common case, checked without
    numpy); None when the general check must decide."""
    if type(toks) is not list or not toks:
        return None
    for t in toks:
        if type(t) is not int:
            return None
    if min(toks) < 0 or max(toks) >= n_vocab:
        return None
    return toks


# decodes of at least this many tokens poll for Ctrl-C from the abort callback (a prompt chunk);
# smaller ones (generation steps) are short enough to finish before the interrupt is delivered
_POLL_TOKENS = 32


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
_CC = ContextConfig   # the defaults of Context's arguments are ContextConfig's


def _is_model(obj) -> bool:
    """Whether ``obj`` is a pyllama_kv.Model, by the package interface model.py declares for contexts
    (this module does not import model.py, which imports it for Model.context)."""
    return isinstance(obj, _kv.CResource) and isinstance(getattr(obj, "_lib", None), _kv.Library) \
        and hasattr(obj, "_contexts")


class _Critical:
    """The context's lock, with Ctrl-C held back and re-entrant calls from a callback refused."""

    __slots__ = ("ctx", "sig")

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.sig: _signals.defer_sigint | None = None

    def __enter__(self) -> None:
        ctx = self.ctx
        ctx._lock.acquire()
        if ctx._busy:
            ctx._lock.release()
            raise InvalidInputError(
                "the context is inside llama_decode: it cannot be used from its own abort callback "
                "(or log handler) on the decoding thread")
        ctx._depth += 1
        if ctx._depth > 1:   # nested on this thread: the outer section holds Ctrl-C back already
            self.sig = None
            return
        self.sig = _signals.defer_sigint()
        self.sig.__enter__()

    def __exit__(self, *exc) -> None:
        try:
            self.ctx._depth -= 1
            self.ctx._lock.release()
        finally:
            if self.sig is not None:
                self.sig.__exit__(*exc)   # delivers a held-back Ctrl-C, now that the state is whole


class Context(_kv.CResource):
    """A context over a :class:`~pyllama_kv.core.model.Model` with a KV cache of ``n_ctx`` cells.

    >>> with model.context(n_ctx=2048, n_seq_max=8) as ctx:
    ...     a = ctx.new_sequence()
    ...     logits = a.extend(model.tokenize("The cache"))
    ...     b = a.fork()                                  # shares a's cells, no recompute
    ...     out = ctx.decode({a: [5], b: [7]})            # one llama_decode for both
    ...     ctx.kv_stats()

    ``n_threads`` defaults to the cores this process may use (llama.cpp's own default is 4);
    ``defrag_thold`` (llama.cpp's automatic defrag threshold, off by default) may be set.
    ``flash_attn`` is needed for a quantized V cache.
    """

    def __init__(self, model: Model, n_ctx: int = _CC.n_ctx, n_seq_max: int = _CC.n_seq_max,
                 n_batch: int = _CC.n_batch, n_ubatch: int = _CC.n_ubatch, flash_attn: bool = _CC.flash_attn,
                 type_k: str = _CC.type_k, type_v: str = _CC.type_v, n_threads: int | None = _CC.n_threads,
                 defrag_thold: float | None = _CC.defrag_thold):
        if not _is_model(model):
            raise InvalidInputError("model must be a pyllama_kv.Model")
        model.check_open()
        # what needs no model is ContextConfig's to check (the batch within the context included)
        cfg = ContextConfig(n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_batch, n_ubatch=n_ubatch,
                            flash_attn=flash_attn, type_k=type_k, type_v=type_v, n_threads=n_threads,
                            defrag_thold=defrag_thold)
        n_ctx, n_seq_max, n_batch, n_ubatch = cfg.n_ctx, cfg.n_seq_max, cfg.n_batch, cfg.n_ubatch
        flash_attn, type_k, type_v, defrag_thold = cfg.flash_attn, cfg.type_k, cfg.type_v, cfg.defrag_thold
        if n_ctx > model.n_ctx_train:
            raise InvalidInputError(
                f"n_ctx={n_ctx} is larger than the model supports (n_ctx_train={model.n_ctx_train})")
        if n_seq_max > n_ctx:
            raise InvalidInputError(f"n_seq_max={n_seq_max} is larger than n_ctx={n_ctx}")
        for name, t, hd in (("type_k", type_k, model.head_dim_k), ("type_v", type_v, model.head_dim_v)):
            block = kv_type_block(t)
            if hd % block:
                raise InvalidInputError(f"{name}={t!r} needs a head size that is a multiple of its block size "
                                        f"{block}; this model's is {hd}")

        lib = model._lib
        if defrag_thold is not None and defrag_thold > 0 and not lib.patched:
            raise InvalidInputError("defrag_thold (automatic defrag) on the vanilla build can abort the process "
                                    "inside llama_decode (see patches/0003): use the patched build")
        self.model = model
        self._libobj = lib
        # llama.cpp's default is a fixed 4 threads; more threads than cores makes ggml's spinning
        # barriers crawl (a defrag graph of many small copies ran ~30x slower on 2 cores)
        n_threads = cfg.n_threads or default_threads()
        self.n_threads = n_threads
        self._lock = threading.RLock()
        self._busy = False        # inside a C call that may call back into Python (decode, update)
        self._depth = 0           # nesting of critical sections on the thread holding the lock
        self._no_abort = False    # a maintenance decode that must complete (abort callback ignored)
        self._abort_exc: BaseException | None = None
        self._shift_pending = False   # a K-shift (seq_add) not yet applied by an update
        with model._lock:   # the model cannot be closed while a context of it is being made
            model.check_open()
            native_model = model._native
            assert native_model is not None
            # one id more than asked for: a spare sequence under which a tail is re-evaluated and
            # swapped in only on success (copy-on-write and exact removal stay atomic)
            native, err = _kv.NativeContext.create(
                lib, native_model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch,
                n_seq_max=n_seq_max + 1, flash_attn=flash_attn, type_k=KV_CACHE_TYPES[type_k],
                type_v=KV_CACHE_TYPES[type_v], n_threads=n_threads, defrag_thold=defrag_thold)
            if native is None:
                raise LlamaError("llama.cpp could not create the context" + (f": {err}" if err else ""))
            self._native = native
            model._contexts.add(self)
        # n_ctx may be padded up (256 with flash attention)
        self.n_ctx, self.n_batch, self.n_ubatch = native.sizes()
        self.n_seq_max: int = n_seq_max
        self._spare_id: int = n_seq_max
        self.flash_attn = flash_attn
        self.type_k, self.type_v = type_k, type_v
        self.can_shift: bool = native.can_shift() and model.rope_type != -1
        self.patched: bool = self._libobj.patched
        self._batch = _kv.NativeBatch(self.n_batch)
        self._free_ids = list(range(self.n_seq_max))
        self._table: dict[int, _SeqEntry] = {}   # the open sequences by id: the one record of what they hold
        self._abort_fn: Callable[[], bool] | None = None
        native.set_abort_poll(self._on_abort_poll)
        self._abort_installed = False

    # -- lifecycle ------------------------------------------------------------------------------

    _native: _kv.NativeContext | None = None   # None until made and once closed

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
            if self._depth > 1:
                # a log handler or callback running inside another call of this context: freeing it
                # here would pull the context out from under that call
                raise InvalidInputError("the context cannot be closed from inside one of its own calls "
                                        "(a callback or log handler)")
            # every handle is closed now (see _is_closed); the table stays, so that a sequence closed
            # with its context still tells the tokens it held (one closed by Sequence.close holds none)
            for e in self._table.values():
                e.logits = None
            self._native = None
            native.free()
            self.model._contexts.discard(self)

    def critical(self) -> _Critical:
        """``with ctx.critical():`` the lock, Ctrl-C held back, no re-entry from a callback."""
        return _Critical(self)

    def __repr__(self) -> str:
        if self.closed:
            return "<pyllama_kv.Context closed>"
        return (f"<pyllama_kv.Context n_ctx={self.n_ctx} sequences={len(self._table)}/{self.n_seq_max} "
                f"{'patched' if self.patched else 'vanilla'}>")

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
        return self._lock

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
        with self._lock:
            if self._native is None:
                return []
            return [self._table[k].seq for k in sorted(self._table)]

    @property
    def free_sequence_ids(self) -> int:
        with self._lock:
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

    def _tokens_of(self, seq) -> list[int] | tuple:
        """The live token list of ``seq``: read it, never change it. Empty once ``seq`` is closed,
        except when its context closed: the tokens it held then."""
        e = self._table.get(seq.id)
        return e.tokens if e is not None and e.seq is seq else _NO_TOKENS

    def _is_closed(self, seq) -> bool:
        e = self._table.get(seq.id)
        return e is None or e.seq is not seq or self._native is None

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
        """Drop the cells of ``sid`` with position in [p0, p1) (-1: open end); no shift."""
        assert self._native is not None
        self._native.seq_rm(sid, p0, p1)

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

    def _read_seq_state(self, sid: int) -> bytes:
        """llama.cpp's state of sequence ``sid`` (LlamaError when it cannot be read whole)."""
        assert self._native is not None
        n = self._native.state_seq_size(sid)
        if n == 0:
            raise LlamaError(f"llama.cpp could not size the state of sequence {sid}")
        got, data = self._native.state_seq_get(sid, n)
        if got != n:
            raise LlamaError(f"llama.cpp wrote {got} bytes of the state of sequence {sid}, expected {n}")
        return data

    def _write_seq_state(self, data: bytes, sid: int) -> int:
        """Write a checked state into the empty sequence ``sid``: the bytes llama.cpp read (0: no slot)."""
        assert self._native is not None
        return self._native.state_seq_set(data, sid)


    def import_sequence(self, state):
        """A new sequence holding the cells and tokens of ``state`` (from Sequence.export_state).

        The cells are written, not computed. Before C sees it, the state is checked whole (see
        pyllama_kv.core.state): its model fingerprint and digest, its tokens, and its data, parsed to the
        last byte against this context (layers, K/V types and row sizes, V layout, positions 0..n-1 in
        order, one per token). InvalidInputError for a state changed after export, from another model
        or made with other cache settings; KVCacheFullError when its cells do not fit in one
        contiguous run of free cells (llama.cpp's restore has no defrag retry). All or nothing: on any
        error no sequence id is taken and no cell is changed. An empty state gives an empty sequence.
        """
        with self.critical():
            self.check_open()
            if not isinstance(state, _SequenceState):
                raise InvalidInputError("import_sequence needs a SequenceState from Sequence.export_state()")
            s = self.new_sequence()  # LlamaError when no id is free; given back on any failure below
            try:
                self._import_into(self._table[s.id], state)
            except BaseException:
                self._release(s.id)
                raise
            return s

    def _import_into(self, e: _SeqEntry, state: _SequenceState) -> None:
        """Fill the new, empty sequence of ``e`` from ``state``; on any error it holds no cells."""
        sid = e.id
        toks, data, p = _state.check_import(
            state, self.model, self.n_ctx,
            lambda: _state.context_layout(self._read_seq_state(sid), self.type_k, self.type_v))
        if p.cell_count == 0:
            return
        # free cells may still carry the pending delta of a removed cell: the next update would
        # rotate the imported K by it
        self._c_update()
        st = self.kv_stats()
        if st.largest_free_block < p.cell_count:
            raise KVCacheFullError(f"could not restore {p.cell_count} cells: they need one contiguous block, the "
                                   f"largest free block is {st.largest_free_block} of {st.free_cells} free cells")
        got = self._write_seq_state(data, sid)
        if got != len(data):
            self._seq_remove(sid, -1, -1)
            if got == 0:
                raise KVCacheFullError(f"llama.cpp found no slot for {p.cell_count} cells")
            raise LlamaError(f"llama.cpp read {got} of the {len(data)} bytes of a checked state")
        e.tokens = toks.tolist()

    # -- sequences: the operations behind Sequence's methods (the context writes every entry) ----

    def _next_logits(self, seq, recompute: bool = False, copy: bool = True) -> np.ndarray:
        """Sequence.logits (``copy=False``: the stored array itself, for a sampler that only reads it)."""
        with self.critical():
            e = self._entry(seq)
            if not e.tokens:
                raise InvalidInputError(f"sequence {e.id} is empty: it has no next-token logits")
            if e.logits is None or recompute:
                self._rebuild_tail(e, len(e.tokens) - 1, np.asarray(e.tokens[-1:], dtype=np.int32))
            assert e.logits is not None
            return e.logits.copy() if copy else e.logits

    def _fork(self, seq, n: int | None) -> _Sequence:
        """Sequence.fork: a new sequence sharing the first ``n`` cells of ``seq``."""
        with self.critical():
            e = self._entry(seq)
            n = len(e.tokens) if n is None else int_param("n", n, 0, len(e.tokens))
            child = self.new_sequence()
            if n > 0:
                self._seq_copy(e.id, child.id, 0, n)
            c = self._table[child.id]
            c.tokens = e.tokens[:n]
            if n == len(e.tokens) and e.logits is not None:
                c.logits = e.logits.copy()
            return child

    def _truncate(self, seq, n: int) -> None:
        """Sequence.truncate."""
        with self.critical():
            e = self._entry(seq)
            self._cut(e, int_param("n", n, 0, len(e.tokens)))

    def _cut(self, e: _SeqEntry, n: int) -> None:
        """Keep the first ``n`` (validated) positions of ``e``."""
        if n == len(e.tokens):
            return
        self._seq_remove(e.id, n, -1)
        del e.tokens[n:]
        e.logits = None

    def _remove(self, seq, start: int, end: int, recompute: bool = False) -> None:
        """Sequence.remove: a K-shift when the tail is private and the build and model can shift,
        else the tail re-evaluated (copy-on-write when it is shared)."""
        with self.critical():
            e = self._entry(seq)
            n = len(e.tokens)
            start = int_param("start", start, 0, n)
            end = int_param("end", end, start, n)
            self._remove_range(e, start, end, recompute)

    def _remove_range(self, e: _SeqEntry, start: int, end: int, recompute: bool) -> None:
        n = len(e.tokens)
        if start == end:
            return
        if end == n:
            self._cut(e, start)
            return
        tail = np.asarray(e.tokens[end:], dtype=np.int32)
        shift_ok = not recompute and self.can_shift and self.patched and not self.shared_in(e.id, end, n)
        if not shift_ok:
            self._rebuild_tail(e, start, tail)
            return
        self._seq_remove(e.id, start, end)
        self._seq_shift(e.id, end, -1, -(end - start))
        del e.tokens[start:end]
        e.logits = None

    def _shift_out(self, seq, n_keep: int, n_discard: int) -> None:
        """Sequence.shift_out."""
        with self.critical():
            e = self._entry(seq)
            if not self.can_shift:
                raise LlamaError(
                    "this model/context cannot shift its KV cache (no RoPE, or a cache type without K-shift)")
            n = len(e.tokens)
            n_keep = int_param("n_keep", n_keep, 0, n)
            n_discard = int_param("n_discard", n_discard, 0, n - n_keep)
            self._remove_range(e, n_keep, n_keep + n_discard, False)

    def _rebuild_tail(self, e: _SeqEntry, start: int, tail: np.ndarray) -> None:
        """Make positions [start:] of ``e`` hold ``tail``, evaluated afresh into cells of its own.

        Atomic. When ``tail.size`` cells are free, the tail is built under the spare sequence id
        (which shares our prefix) and swapped in only when the decode succeeded. Otherwise (patched
        build only) it is rebuilt in place, in the cells our old tail frees: that decode cannot be
        aborted (the abort callback and Ctrl-C wait for it), and the patched library's
        defrag-and-retry guarantees it a slot, since the cells were counted first. The vanilla
        build, which may fail to place a batch in scattered cells, refuses instead
        (KVCacheFullError, nothing changed).
        """
        sid = e.id
        if tail.size == 0:
            self._cut(e, start)
            return
        free = self._free_cells()
        if free >= tail.size:
            tmp = self._spare_id
            self._seq_remove(tmp, -1, -1)
            try:
                if start > 0:
                    self._seq_copy(sid, tmp, 0, start)
                (logits,) = self._raw_decode([(tmp, tail, start)])
            except BaseException:
                self._seq_remove(tmp, -1, -1)
                raise
            # swap: our cells become the spare sequence's
            self._seq_remove(sid, -1, -1)
            self._seq_copy(tmp, sid, -1, -1)
            self._seq_remove(tmp, -1, -1)
        else:
            exclusive = self._exclusive_cells(sid, start)
            if not self.patched or free + exclusive < tail.size:
                why = ("" if self.patched else
                       "; the vanilla build cannot re-evaluate in place without risking the sequence")
                raise KVCacheFullError(
                    f"re-evaluating {tail.size} tokens of sequence {sid} needs {tail.size} free cells; {free} are "
                    f"free{why}")
            old = np.asarray(e.tokens[start:], dtype=np.int32)
            self._seq_remove(sid, start, -1)
            with self._uninterruptible():
                try:
                    (logits,) = self._raw_decode([(sid, tail, start)])
                except LlamaError:
                    self._restore_tail(e, start, old)
                    raise
        del e.tokens[start:]
        e.tokens.extend(tail.tolist())
        e.logits = logits

    def _restore_tail(self, e: _SeqEntry, start: int, old: np.ndarray) -> None:
        """Best effort after an in-place re-evaluation failed for a reason no check foresees (a
        compute error): decode the old tail again, else truncate and say so."""
        with self._uninterruptible():
            try:
                if old.size:
                    self._raw_decode([(e.id, old, start)])
            except LlamaError as exc:
                del e.tokens[start:]
                e.logits = None
                raise LlamaError(f"sequence {e.id} could not be restored after a failed re-evaluation and was "
                                 f"truncated to {start} tokens: {exc}") from exc

    def _export(self, seq) -> _SequenceState:
        """Sequence.export_state."""
        with self.critical():
            e = self._entry(seq)
            # a state copies K as stored: a K-shift still pending would be lost
            self._c_update()
            return _state.export_state(self._read_seq_state(e.id), list(e.tokens), e.id, self.n_ctx, self.model)

    def _snapshot(self, seq, start: int, end: int | None) -> _Span:
        """Sequence.snapshot: a compact copy of the cells of ``seq`` over positions [start, end)."""
        from .span import Span

        with self.critical():
            e = self._entry(seq)
            n = len(e.tokens)
            end = n if end is None else end
            for name, v in (("start", start), ("end", end)):
                if isinstance(v, bool) or not isinstance(v, int):
                    raise InvalidInputError(f"{name} must be an int, got {type(v).__name__}")
            if not 0 <= start < end <= n:
                raise InvalidInputError(f"a span needs 0 <= start < end <= {n} (the sequence's length), got "
                                        f"[{start}, {end})")
            self._c_update()   # a state copies K as stored: a K-shift still pending would be lost
            data = self._read_seq_state(e.id)
            p, order = _state.position_order(data, n, e.id, self.n_ctx)
            return Span(start, tuple(e.tokens[start:end]), _state.select(data, p, order[start:end]), p.layout,
                        _state.model_fingerprint(self.model))

    def _restore(self, seq, span: _Span) -> None:
        """Sequence.restore: add the cells of ``span`` to ``seq``, which holds exactly [0, span.start)."""
        from .span import Span

        with self.critical():
            e = self._entry(seq)
            if not isinstance(span, Span):
                raise InvalidInputError(f"restore needs a Span from Sequence.snapshot(), got {type(span).__name__}")
            if span.model != _state.model_fingerprint(self.model):
                raise InvalidInputError("the span comes from another model")
            if len(e.tokens) != span.start:
                raise InvalidInputError(f"a span of positions [{span.start}, {span.end}) goes on a sequence of "
                                        f"{span.start} tokens; sequence {e.id} has {len(e.tokens)}")
            if span.end > self.n_ctx:
                raise KVCacheFullError(f"the span ends at position {span.end}, past the context's {self.n_ctx} cells")
            layout = _state.context_layout(self._read_seq_state(self._spare_id), self.type_k, self.type_v)
            if span.layout != layout:
                raise InvalidInputError("the span was copied from a context with other cache types or V layout "
                                        "(flash attention)")
            try:
                span.parsed()   # the data is exactly len(tokens) cells of this layout, or InvalidInputError
            except InvalidInputError as exc:
                raise InvalidInputError(f"the span's data is not {len(span)} cells of this layout: {exc}") from None
            self._c_update()   # free cells may still carry the pending delta of a removed cell
            st = self.kv_stats()
            if st.largest_free_block < len(span) <= st.free_cells:
                self.defrag()
                st = self.kv_stats()
            if st.largest_free_block < len(span):
                raise KVCacheFullError(f"could not restore {len(span)} cells: they need one contiguous block, the "
                                       f"largest free block is {st.largest_free_block} of {st.free_cells} free cells")
            assert self._native is not None
            got = self._native.state_seq_add(span.data, e.id)
            if got is None:
                raise LibraryError(f"{self.model._lib.path} cannot restore a span (llama_state_seq_add_data is "
                                   "patch 0014 of pyllama_kv's series): use the patched library")
            if got != len(span.data):   # llama.cpp removed the cells it placed: the sequence is as it was
                raise KVCacheFullError(f"llama.cpp could not add the span's {len(span)} cells")
            e.tokens.extend(span.tokens)
            e.logits = None   # computed from the restored cells at the next logits() or decode

    def _close_sequence(self, seq) -> None:
        """Sequence.close: free the id and cells of ``seq`` (nothing when it is closed already)."""
        if self._is_closed(seq):
            return
        with self.critical():
            if self._native is not None and not self._is_closed(seq):
                self._release(seq.id)

    # -- decoding -------------------------------------------------------------------------------

    @property
    def abort_callback(self) -> Callable[[], bool] | None:
        """A function polled during decode; returning True aborts it (DecodeError, nothing changed)."""
        return self._abort_fn

    @abort_callback.setter
    def abort_callback(self, fn: Callable[[], bool] | None) -> None:
        if fn is not None and not callable(fn):
            raise InvalidInputError(f"abort_callback must be a callable or None, got {type(fn).__name__}")
        with self.critical():
            self.check_open()
            self._abort_fn = fn

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
        self._busy = True
        try:
            return native.decode(batch, n_tokens)
        finally:
            self._busy = False

    def _c_update(self) -> None:
        """llama_kv_self_update: apply pending K-shifts and a scheduled defrag, to completion. The
        abort callback is not obeyed here: maintenance either completes or, interrupted, would
        leave cells and K/V disagreeing (llama.cpp drops an aborted shift's deltas)."""
        assert self._native is not None
        prev = self._no_abort
        self._busy = True
        self._no_abort = True
        try:
            self._native.update()
            self._shift_pending = False
        finally:
            self._busy = False
            self._no_abort = prev

    def _apply_shifts(self) -> None:
        """Apply a pending K-shift now, so that cell positions read from the view are exact and a
        following decode cannot abort the shift half-way."""
        if self._shift_pending:
            self._c_update()

    def _raw_decode(self, plan: list[tuple[int, list[int] | np.ndarray, int]]) -> list[np.ndarray | None]:
        """Decode ``plan`` = [(seq_id, tokens, first_pos)] (validated) in as few llama_decode calls as
        n_batch allows, with one output (the last token) per entry. On failure every entry's new
        positions are removed and the mapped exception is raised."""
        native = self._native
        assert native is not None
        b = self._batch
        cap = b.cap
        results: list[np.ndarray | None] = [None] * len(plan)
        n_vocab = self.model.n_vocab
        # flatten into chunks of at most n_batch tokens
        chunks: list[list[tuple[int, int, int, int]]] = []  # (entry, lo, hi, pos0) per piece
        cur: list[tuple[int, int, int, int]] = []
        room = cap
        for e, (_sid, toks, pos0) in enumerate(plan):
            lo = 0
            while lo < len(toks):
                take = min(room, len(toks) - lo)
                cur.append((e, lo, lo + take, pos0))
                lo += take
                room -= take
                if room == 0:
                    chunks.append(cur)
                    cur, room = [], cap
        if cur:
            chunks.append(cur)
        self._apply_shifts()
        try:
            for chunk in chunks:
                # fill the batch with one numpy assignment per array (lists built in Python are
                # cheaper than a numpy call per sequence for the many small pieces of a generation step)
                tok: list[int] = []
                pos: list[int] = []
                sid_l: list[int] = []
                outs = []
                for e, lo, hi, pos0 in chunk:
                    sid, toks, _ = plan[e]
                    k = hi - lo
                    tok.extend(toks[lo:hi] if (lo or hi != len(toks)) else toks)
                    pos.extend(range(pos0 + lo, pos0 + hi))
                    sid_l.extend([sid] * k)
                    if hi == len(toks):
                        outs.append((e, len(tok) - 1))
                n = len(tok)
                b.np_token[:n] = tok
                b.np_pos[:n] = pos
                b.np_sid[:n] = sid_l
                b.np_out[:n] = 0
                if outs:
                    b.np_out[[bidx for _, bidx in outs]] = 1
                else:  # a chunk that ends no entry: llama.cpp still wants one output
                    b.np_out[n - 1] = 1
                rc = self._c_decode(b, n)
                if rc != 0:
                    raise self._decode_error(rc)
                if outs:
                    # one copy for all rows of this call; each sequence gets a row of it
                    rows = native.logits(len(outs), n_vocab)
                    for i, (e, _bidx) in enumerate(outs):
                        results[e] = rows[i]
        except BaseException:
            # llama_decode restored its own partial cells; remove what earlier chunks added
            for sid, _toks, pos0 in plan:
                native.seq_rm(sid, pos0, -1)
            raise
        return results

    def _decode_error(self, rc: int) -> BaseException:
        err = self._libobj.last_error()
        if rc == 1:
            st = self.kv_stats()
            return KVCacheFullError(
                f"no room in the KV cache for the batch ({st.free_cells} of {st.n_cells} cells free, largest free "
                f"block {st.largest_free_block}{'' if self.patched else '; the vanilla build does not defragment'})"
            )
        if rc == 2:
            exc = self._abort_exc
            self._abort_exc = None
            if exc is not None:
                if not isinstance(exc, Exception):   # KeyboardInterrupt, SystemExit: re-raised as is
                    return exc
                err_ = DecodeError(f"decode aborted: the abort callback raised {type(exc).__name__}: {exc}; "
                                   "nothing was changed")
                err_.__cause__ = exc
                return err_
            if _signals.interrupt_pending():
                return DecodeError("decode interrupted (Ctrl-C); nothing was changed")
            return DecodeError("decode aborted by the abort callback; nothing was changed")
        if rc == -1:
            return InvalidInputError(f"llama_decode rejected the batch: {err or 'invalid input'}")
        return DecodeError(f"llama_decode failed with code {rc}" + (f": {err}" if err else ""))

    def decode(self, batch: Mapping[_Sequence, Iterable[int]]) -> dict[_Sequence, np.ndarray]:
        """Append tokens to several sequences at once: ``{seq: tokens}`` -> ``{seq: logits}``.

        One ``llama_decode`` call for the whole batch (more only when it holds more than ``n_batch``
        tokens). The logits are the next-token logits after each sequence's last new token, float32
        arrays of shape (n_vocab,). Atomic: on failure nothing changes (see the module docstring).
        """
        with self.critical():
            self.check_open()
            if not isinstance(batch, Mapping):
                raise InvalidInputError("decode needs a non-empty mapping {sequence: tokens}")
            # first run every piece of caller code (the mapping's iteration, token iterables), then
            # check the state they may have changed: nothing the checks saw can change after them
            items: list[tuple[_Sequence, list[int]]] = []
            n_vocab = self.model.n_vocab
            table = self._table
            for seq, toks in list(batch.items()):
                e = table.get(seq.id) if type(seq) is _Sequence else None
                if e is None or e.seq is not seq:
                    e = self._own(seq)  # raises the precise error
                arr = _fast_tokens(toks, n_vocab)
                if arr is None:  # not a plain list of ints: the general (numpy) check
                    arr = self.model.check_tokens(toks).tolist()
                items.append((seq, arr))
            if not items:
                raise InvalidInputError("decode needs a non-empty mapping {sequence: tokens}")
            self.check_open()
            plan: list[tuple[int, list[int] | np.ndarray, int]] = []
            entries = []
            seen: set[int] = set()
            total = 0
            for seq, arr in items:
                sid = seq.id
                e = table.get(sid)
                if e is None or e.seq is not seq:   # closed by the caller's code above
                    e = self._own(seq)
                if sid in seen:
                    raise InvalidInputError(f"sequence {sid} appears twice in the batch")
                seen.add(sid)
                if not arr:
                    raise InvalidInputError(f"empty token list for sequence {sid}")
                n_new = len(arr)
                n_old = len(e.tokens)
                if n_old + n_new > self.n_ctx:
                    raise KVCacheFullError(
                        f"sequence {sid} would hold {n_old + n_new} positions, more than n_ctx={self.n_ctx}")
                plan.append((sid, arr, n_old))
                entries.append(e)
                total += n_new
            free = self._free_cells()
            if total > free:
                raise KVCacheFullError(f"the batch needs {total} cells but only {free} of {self.n_ctx} are free")
            results = self._raw_decode(plan)
            out: dict[_Sequence, np.ndarray] = {}
            for e, (_sid, new, _), logits in zip(entries, plan, results):
                assert logits is not None   # every entry ends in the batch: it has an output
                e.tokens.extend(new)
                e.logits = logits
                out[e.seq] = logits
            return out

    # -- cache maintenance ----------------------------------------------------------------------

    def defrag(self) -> KVStats:
        """Pack all used cells to the front of the cache now; return the stats after it.

        On a vanilla build this refuses (LlamaError) when the library would abort the process
        (cells in use past n_ctx - n_ubatch and holes to fill: see patches/0003).
        """
        with self.critical():
            self.check_open()
            if not self.patched:
                pos, seqs = self._read_view()
                used = seqs[:, 0] >= 0
                n_used = int(used.sum())
                holes = n_used and not used[:n_used].all()
                if holes and n_used + min(self.n_ctx, self.n_ubatch) > self.n_ctx:
                    raise LlamaError(
                        "the vanilla build would abort the process on this defrag (its worst-case graph runs past the "
                        f"end of the cache: {n_used} used cells + n_ubatch {self.n_ubatch} > n_ctx {self.n_ctx}); "
                        "use the patched build"
                    )
            assert self._native is not None
            self._native.defrag()
            self._c_update()
            return self.kv_stats()

    def clear(self) -> None:
        """Empty the cache; every open sequence becomes empty (its id stays reserved)."""
        with self.critical():
            self.check_open()
            assert self._native is not None
            self._native.clear()
            for e in self._table.values():
                e.tokens.clear()
                e.logits = None

    # -- inspection -----------------------------------------------------------------------------

    def _read_view(self) -> tuple[np.ndarray, np.ndarray]:
        assert self._native is not None
        return self._native.view()

    def kv_view(self) -> tuple[np.ndarray, np.ndarray]:
        """(pos, seqs): per cell its position (-1 when free) and the ids of the sequences holding it,
        shape (n_cells, n_seq_max), padded with -1. A pending K-shift is applied first, so positions
        are exact."""
        with self.critical():
            self.check_open()
            self._apply_shifts()
            pos, seqs = self._read_view()
        # the view has a column more, for the spare id, which holds no cell between calls
        return pos, np.ascontiguousarray(seqs[:, :self.n_seq_max])

    def kv_cells(self) -> np.ndarray:
        """Per-cell occupancy, int32 (n_cells,): -1 free, -2 shared by several sequences, else the id
        of the one sequence holding the cell."""
        with self.critical():
            self.check_open()
            _, seqs = self._read_view()
        occ = seqs[:, 0].copy()
        shared = (seqs >= 0).sum(axis=1) > 1
        occ[shared] = -2
        return occ

    def kv_stats(self) -> KVStats:
        """Cells, holes, the largest free block, and (patched build) the defrag/retry counters."""
        with self.critical():
            self.check_open()
            _, seqs = self._read_view()
            counters = None
            if self.patched:
                assert self._native is not None
                counters = self._native.stats()
        free = seqs[:, 0] < 0
        n = int(free.size)
        n_free = int(free.sum())
        largest = 0
        holes = 0
        if n_free:
            # runs of free cells
            d = np.diff(np.concatenate(([0], free.astype(np.int8), [0])))
            starts = np.flatnonzero(d == 1)
            ends = np.flatnonzero(d == -1)
            largest = int((ends - starts).max())
            holes = int((ends < n).sum())  # runs followed by a used cell
        extra: dict[str, Any] = {}
        if counters is not None:
            extra = dict(defrags=counters["n_defrags"], moves=counters["n_defrag_moves"],
                         cells_moved=counters["n_defrag_cells"], graphs=counters["n_defrag_graphs"],
                         nodes=counters["n_defrag_nodes"],
                         slot_retries=counters["n_slot_retries"], slot_failures=counters["n_slot_failures"],
                         defrag_seconds=counters["t_defrag_us"] / 1e6)
        frag = 0.0 if n_free == 0 else 1.0 - largest / n_free
        return KVStats(n_cells=n, used_cells=n - n_free, free_cells=n_free, holes=holes,
                       largest_free_block=largest, fragmentation=round(frag, 6), **extra)

    def shared_in(self, sid: int, lo: int, hi: int) -> bool:
        """Whether any cell of sequence ``sid`` with position in [lo, hi) is held by another sequence too
        (a tail that cannot be K-shifted in place). Call it inside ``critical()``."""
        self._apply_shifts()
        pos, seqs = self._read_view()
        mine = (seqs == sid).any(axis=1) & (pos >= lo) & (pos < hi)
        if not mine.any():
            return False
        return bool(((seqs[mine] >= 0).sum(axis=1) > 1).any())

    def _exclusive_cells(self, sid: int, lo: int) -> int:
        self._apply_shifts()
        pos, seqs = self._read_view()
        mine = (seqs == sid).any(axis=1) & (pos >= lo)
        return int((mine & ((seqs >= 0).sum(axis=1) == 1)).sum())

