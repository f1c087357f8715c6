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
* **Capabilities, not pins.** What the loaded library can do is its ``caps``
  (:class:`pyllama_kv._native.ffi.Caps`); this module asks them and never the pin's name. On a
  library without a capability an operation that needs it raises :class:`LibraryError` naming both
  (state export/import, snapshot/restore, the cell view), or takes the documented graceful path:
  stats counters are None, ``defrag`` is a no-op where batches go into non-contiguous cells (the
  largest free block is then all free cells), a removal re-evaluates instead of K-shifting. A
  partial removal the library refuses (recurrent or sliding-window memory: ``seq_rm`` false) raises
  InvalidInputError with the sequence unchanged.
* **Memory that cannot go back.** A fork, truncation, removal or re-evaluation that keeps the first
  n positions of a sequence (0 < n < its length) needs the memory's state at n: recurrent layers
  (a recurrent or hybrid model) hold only the state after the last token, and a sliding-window cache
  of the current llama.cpp reuses the cells of positions that fell out of the window. Where the state
  at n is gone, the call raises InvalidInputError before anything changes (never a continuation from
  the wrong state). Such a model's context cannot K-shift either (``can_shift`` False), nor can one
  with layers without RoPE that llama.cpp rotates all the same (``Model.k_shift_exact``).

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

Package interface. Other modules use a context only through its public methods (nothing else in
the package reads a Context's private attributes):

* ``critical()`` (``with ctx.critical():`` the lock, Ctrl-C held back, re-entry from a callback
  refused: several calls as one step), ``check_open()``, ``check_sequence(seq)`` (InvalidInputError
  for a closed context / a sequence not open in it), ``shared_in(sid, lo, hi)``, ``cache_layout()``
  and ``can_restore`` (for the prefix cache's tiers), ``can_fork(seq, n)`` (for its prefix matches);
* **the sequence channel**: ``sequence_tokens``, ``sequence_closed``, ``sequence_logits`` (and
  ``sequence_logits_lent``), ``sequence_fork``, ``sequence_truncate``, ``sequence_remove``,
  ``sequence_shift_out``, ``sequence_export``, ``sequence_snapshot``, ``sequence_restore`` and
  ``sequence_close``: the
  operations behind :class:`~pyllama_kv.core.sequence.Sequence`'s methods, each taking the handle
  first. A Sequence forwards to them; the context checks the handle and writes cells and table. Users
  call the Sequence's methods (``sequence_logits_lent(seq)`` lends a sampler the stored array).

Pure pieces live beside this module: :mod:`.batching` (how a decode is cut into llama_decode calls),
:mod:`.returncodes` (llama_decode's return code -> exception), :mod:`.kvstats` (KVStats and its
arithmetic), :mod:`.spanio` (state reads and span checks), :mod:`.critical` (the lock's state and the
critical section).

Tests and scripts that go behind the API's back use ``_ptr``, ``_L``, ``_seq_remove`` and
``_read_seq_state``.

All C calls go through ``self._native`` (:class:`pyllama_kv._native.kv.NativeContext`).
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Callable

import numpy as np

from .._native import kv as _kv
from ..config import ContextConfig, default_threads, int_param
from ..errors import InvalidInputError, KVCacheFullError, LibraryError, LlamaError
from ..limits import KV_CACHE_TYPES, QUANTIZED_KV_TYPES, kv_type_block
from . import _signals, spanio as _spanio, state as _state
from .batching import (
    POLL_TOKENS as _POLL_TOKENS,
    chunk_plan as _chunk_plan,
    fast_tokens as _fast_tokens,
    fill_batch as _fill_batch,
)
from .checkpoint import Checkpoint
from .cost import EvalCost
from .critical import Critical as _Critical, LockState as _LockState
from .kvstats import KVStats, kv_stats as _kv_stats
from .returncodes import decode_error as _decode_error
from .sequence import Sequence as _Sequence
from .state import SequenceState as _SequenceState

if TYPE_CHECKING:
    from .batching import Plan as _Plan
    from .model import Model
    from .span import Span as _Span

__all__ = ["Context", "KVStats"]


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


def _check_cache_types(model: Model, type_k: str, type_v: str) -> None:
    """A quantized cache type needs head sizes that are a multiple of its block size."""
    for name, t, hd in (("type_k", type_k, model.head_dim_k), ("type_v", type_v, model.head_dim_v)):
        block = kv_type_block(t)
        if hd % block:
            raise InvalidInputError(f"{name}={t!r} needs a head size that is a multiple of its block size "
                                    f"{block}; this model's is {hd}")


def _check_library_params(lib: _kv.Library, defrag_thold: float | None, n_seq_max: int) -> None:
    """InvalidInputError for context parameters the library cannot honour (checked before C)."""
    caps = lib.caps
    if defrag_thold is not None and defrag_thold > 0:
        if not caps.defrag:
            raise InvalidInputError(f"defrag_thold needs automatic defrag, which the {caps.api} llama.cpp library "
                                    "does not have (it writes batches into non-contiguous cells, so none is "
                                    "needed): leave defrag_thold unset")
        if not caps.safe_defrag:
            raise InvalidInputError("defrag_thold (automatic defrag) on the vanilla build can abort the process "
                                    "inside llama_decode (see patches/0003): use the patched build")
    top = lib.max_parallel_sequences()
    if top is not None and n_seq_max + 1 > top:   # one spare id (see Context.__init__)
        raise InvalidInputError(f"n_seq_max={n_seq_max} is more than this library allows ({top - 1}: "
                                f"llama_max_parallel_sequences() is {top}, one id is the context's spare)")
_CC = ContextConfig   # the defaults of Context's arguments are ContextConfig's


def _is_model(obj) -> bool:
    """Whether ``obj`` is a pyllama_kv.Model, by the package interface model.py declares for contexts
    (this module does not import model.py, which imports it for Model.context)."""
    return isinstance(obj, _kv.CResource) and isinstance(getattr(obj, "native_library", None), _kv.Library) \
        and callable(getattr(obj, "open_native_context", None))


def _auto_flash_attn(model: Model, type_v: str) -> bool | None:
    """Flash attention's "auto" for ``model``: on for a quantized V cache (it needs it); the library's
    own auto (None) where it has one (the current pin: on where the backend has a kernel, the CPU's
    included; ``serve`` ran a many-chats load faster with it on there, docs/benchmarks.md);
    else off on the CPU and, on a GPU, on where the backend has a kernel for the model's head size
    (the mission pin's CUDA set, patch 0015)."""
    if type_v in QUANTIZED_KV_TYPES:
        return True
    caps = model.native_library.caps
    if caps.flash_attn_auto:
        return None
    if not model.on_gpu:
        return False
    return model.head_dim_k == model.head_dim_v and model.head_dim_k in caps.gpu_flash_attn_head_sizes


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
                 n_batch: int = _CC.n_batch, n_ubatch: int = _CC.n_ubatch, flash_attn: bool | None = _CC.flash_attn,
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
        if flash_attn is None:   # auto (see CacheConfig)
            flash_attn = _auto_flash_attn(model, type_v)
        if n_ctx > model.n_ctx_train:
            raise InvalidInputError(
                f"n_ctx={n_ctx} is larger than the model supports (n_ctx_train={model.n_ctx_train})")
        if n_seq_max > n_ctx:
            raise InvalidInputError(f"n_seq_max={n_seq_max} is larger than n_ctx={n_ctx}")
        _check_cache_types(model, type_k, type_v)

        lib = model.native_library
        self.caps: _kv.Caps = lib.caps
        _check_library_params(lib, defrag_thold, n_seq_max)
        self.model = model
        self._libobj = lib
        # llama.cpp's default is a fixed 4 threads; more threads than cores makes ggml's spinning
        # barriers crawl (a defrag graph of many small copies ran ~30x slower on 2 cores)
        n_threads = cfg.n_threads or default_threads()
        self.n_threads = n_threads
        self._guard = _LockState()   # the lock, busy (inside a C call that may call back) and depth
        self._no_abort = False    # a maintenance decode that must complete (abort callback ignored)
        self._abort_exc: BaseException | None = None
        self._shift_pending = False   # a K-shift (seq_add) not yet applied by an update
        # made under the model's lock (the model cannot be closed meanwhile), ours before the model
        # registers us. One id more than asked for: a spare sequence under which a tail is
        # re-evaluated and swapped in only on success (copy-on-write and exact removal stay atomic)
        native = model.open_native_context(
            self, self._adopt, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max + 1,
            flash_attn=flash_attn, type_k=KV_CACHE_TYPES[type_k], type_v=KV_CACHE_TYPES[type_v],
            n_threads=n_threads, defrag_thold=defrag_thold)
        self.n_ctx, self.n_batch, self.n_ubatch = native.sizes()   # n_ctx may be padded up (to 256)
        self.n_seq_max: int = n_seq_max
        self._spare_id: int = n_seq_max
        self._layout: _state.Layout | None = None   # the layout of its states (_layout_of), read once
        self._whole_owner = object()   # marks the WholeStates this context made (whole_state)
        self.flash_attn = flash_attn
        self.type_k, self.type_v = type_k, type_v
        # llama.cpp's word, unless a K-shift of this model would continue wrongly (Model.k_shift_exact)
        self.can_shift: bool = native.can_shift() and model.k_shift_exact
        self.patched: bool = self._libobj.patched
        self._batch = _kv.NativeBatch(self.n_batch, lib)
        self._free_ids = list(range(self.n_seq_max))
        self._table: dict[int, _SeqEntry] = {}   # the open sequences by id: the one record of what they hold
        self._abort_fn: Callable[[], bool] | None = None
        native.set_abort_poll(self._on_abort_poll)
        self._abort_installed = False
        self.eval_cost = EvalCost()   # what a token costs to evaluate, from the decodes (decode alone writes it)

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

    def _read_seq_state(self, sid: int) -> bytes:
        """llama.cpp's state of sequence ``sid`` (LlamaError when it cannot be read whole)."""
        data = self._read_seq_view(sid, copy=True)
        assert isinstance(data, bytes)
        return data

    def _read_seq_view(self, sid: int, copy: bool = False) -> bytes | memoryview:
        """The same, by default as a view of llama.cpp's buffer: one copy less (see spanio.read_seq_state)."""
        assert self._native is not None
        self._need("state_io", "reading a sequence's state")
        return _spanio.read_seq_state(self._native, sid, copy)

    def _write_seq_state(self, data: bytes, sid: int) -> int:
        """Write a checked state into the empty sequence ``sid``: the bytes llama.cpp read (0: no slot)."""
        assert self._native is not None
        return self._native.state_seq_set(data, sid)

    def cache_layout(self) -> _state.Layout:
        """The layout of this context's sequence states (cache types, row sizes, V layout), read once
        from its spare sequence, which holds no cells between calls."""
        with self.critical():
            self.check_open()
            return self._layout_of()

    def _layout_of(self) -> _state.Layout:
        if self._layout is None:
            self._need_states("reading a sequence's state")
            data = self._read_seq_state(self._spare_id)
            if len(data) == 4:   # an API that writes no layer headers for an empty sequence
                data = self._probe_state()
            self._layout = _state.context_layout(data, self.type_k, self.type_v)
        return self._layout

    def _probe_state(self) -> bytes:
        """An empty state with its layer headers, from the state of one token decoded into the spare
        sequence (which holds no cells again after), its cell cut out. Between decodes only: it
        overwrites llama.cpp's output rows."""
        assert self._native is not None
        self._raw_decode([(self._spare_id, [0], 0)])
        try:
            one = self._read_seq_state(self._spare_id)
        finally:
            self._native.seq_rm(self._spare_id, -1, -1)
        try:
            p = _state.parse(one, max_cells=1)
        except InvalidInputError as exc:
            raise LlamaError(f"llama.cpp's state of one cell is not in the expected format: {exc}") from None
        return bytes(_state.select(one, p, np.zeros(0, dtype=np.intp)))

    def _need_states(self, what: str) -> None:
        """``_need("state_io")``, and a memory whose states the binding reads: a plain KV cache, not
        recurrent layers or a sliding-window cache (their states hold more than cells)."""
        self._need("state_io", what)
        if not self._plain_memory:
            raise LibraryError(f"{what} needs a plain KV cache; this model's memory has {self._memory_kind}, whose "
                               "states the binding does not read (a recurrent state alone: Sequence.checkpoint())")

    @property
    def _memory_kind(self) -> str:
        return "recurrent layers" if self.model.recurrent else "a sliding-window cache"

    @property
    def _plain_memory(self) -> bool:
        """A plain KV cache: no recurrent layers and no sliding-window cache (their states hold more
        than cells, in formats the binding does not read)."""
        return not (self.model.recurrent or self.model.n_swa > 0)

    @property
    def can_save_state(self) -> bool:
        """Whether sequences can be exported and snapshotted here: a library whose states the binding
        reads (``caps.state_io``) and a plain KV cache (not recurrent layers or a sliding-window
        cache); False once closed."""
        return self._native is not None and self.caps.state_io and self._plain_memory

    @property
    def can_restore(self) -> bool:
        """Whether a span can be restored here (:attr:`can_save_state`, and the library has
        llama_state_seq_add_data: patch 0014, patches/current/0001); False once closed."""
        return self.can_save_state and self.caps.span_restore

    @property
    def no_restore_reason(self) -> str:
        """Why :attr:`can_restore` is False, in words ("" when it is True): what the prefix cache's
        tiers report as their ``off_reason``."""
        if self.can_restore:
            return ""
        if self._native is None:
            return "the context is closed"
        if not self._plain_memory:
            return (f"this model's memory has {self._memory_kind}, whose states the binding does not read: "
                    "evicted prefixes are dropped, not paged out")
        if not self.caps.state_io:
            return f"the library lacks {_CAP_TEXT['state_io']}: evicted prefixes are dropped, not paged out"
        return f"the library lacks {_CAP_TEXT['span_restore']}: evicted prefixes are dropped, not paged out"

    @property
    def cache_on_device(self) -> bool:
        """Whether some of the KV cache is in a device's memory (:attr:`Model.on_device
        <pyllama_kv.Model.on_device>`): a snapshot of it is a transfer, not a memcpy of host memory."""
        return self.model.on_device

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
            self._need_states("importing a sequence's state")
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
        toks, data, p = _state.check_import(state, self.model, self.n_ctx, self._layout_of)
        if p.cell_count == 0:
            return
        # free cells may still carry the pending delta of a removed cell: the next update would
        # rotate the imported K by it
        self._c_update()
        st = self.kv_stats()
        if st.largest_free_block < p.cell_count:
            raise _spanio.no_block(p.cell_count, st)
        got = self._write_seq_state(data, sid)
        if got != len(data):
            self._seq_remove(sid, -1, -1)
            if got == 0:
                raise KVCacheFullError(f"llama.cpp found no slot for {p.cell_count} cells")
            raise LlamaError(f"llama.cpp read {got} of the {len(data)} bytes of a checked state")
        e.tokens = toks.tolist()

    # -- the sequence channel: the operations behind Sequence's methods -------------------------
    # A Sequence is a handle that forwards here; each method checks the handle (InvalidInputError for
    # one closed or of another context) and the context writes cells and table together.

    def sequence_tokens(self, seq) -> list[int] | tuple:
        """Sequence.tokens and len(): the live token list of ``seq`` (read it, never change it; no
        lock taken). Empty once ``seq`` is closed, except when its context closed: the tokens it held
        then."""
        e = self._table.get(seq.id)
        return e.tokens if e is not None and e.seq is seq else _NO_TOKENS

    def sequence_closed(self, seq) -> bool:
        """Sequence.closed: whether the table no longer holds ``seq`` or the context is closed (no lock)."""
        e = self._table.get(seq.id)
        return e is None or e.seq is not seq or self._native is None

    def sequence_logits(self, seq, recompute: bool = False, copy: bool = True) -> np.ndarray:
        """Sequence.logits (``copy=False``: the stored array itself, for a sampler that only reads it)."""
        with self.critical():
            e = self._entry(seq)
            if not e.tokens:
                raise InvalidInputError(f"sequence {e.id} is empty: it has no next-token logits")
            if e.logits is None or recompute:
                self._rebuild_tail(e, len(e.tokens) - 1, np.asarray(e.tokens[-1:], dtype=np.int32))
            assert e.logits is not None
            return e.logits.copy() if copy else e.logits

    def sequence_logits_lent(self, seq) -> np.ndarray:
        """For a sampler inside ``critical()``: the stored next-token logits of ``seq``, lent (read
        them, never write them; the context is their only writer), recomputed first when stale."""
        logits = self._own(seq).logits
        return logits if logits is not None else self.sequence_logits(seq, copy=False)

    def sequence_fork(self, seq, n: int | None, checkpoint: Checkpoint | None = None) -> _Sequence:
        """Sequence.fork: a new sequence sharing the first ``n`` cells of ``seq`` (and, for a
        recurrent model cut at ``n``, its recurrent state taken from ``checkpoint``)."""
        with self.critical():
            e = self._entry(seq)
            n = len(e.tokens) if n is None else int_param("n", n, 0, len(e.tokens))
            if checkpoint is not None:
                self._check_checkpoint(e, n, checkpoint)
                if n == len(e.tokens):
                    checkpoint = None   # the sequence's own state is the one at n
            self._check_cut(e, n, f"a fork of the first {n} of {len(e.tokens)} tokens", checkpoint)
            child = self.new_sequence()
            if n > 0:
                self._seq_copy(e.id, child.id, 0, n)
            if checkpoint is not None:
                assert self._native is not None
                if not self._native.recurrent_state_set(checkpoint.data, child.id):
                    child.close()
                    raise LlamaError(f"llama.cpp refused the checkpoint of {checkpoint.n} tokens for a fork of "
                                     f"sequence {e.id} (its log says why); nothing was changed")
            c = self._table[child.id]
            c.tokens = e.tokens[:n]
            if n == len(e.tokens) and e.logits is not None:
                c.logits = e.logits.copy()
            return child

    def _check_checkpoint(self, e: _SeqEntry, n: int, ck: Checkpoint) -> None:
        """InvalidInputError unless ``ck`` is a checkpoint of this model after exactly the first ``n``
        tokens of ``e`` (LibraryError where the library cannot write one back)."""
        if not isinstance(ck, Checkpoint):
            raise InvalidInputError(f"checkpoint must be a pyllama_kv Checkpoint, got {type(ck).__name__}")
        self._need("recurrent_checkpoints", "a fork from a checkpoint")
        if ck.model != _state.model_fingerprint(self.model):
            raise InvalidInputError("the checkpoint belongs to another model")
        if ck.n != n or not np.array_equal(ck.tokens, np.asarray(e.tokens[:n], dtype=np.int32)):
            raise InvalidInputError(f"the checkpoint follows {ck.n} tokens that are not the first {n} of sequence "
                                    f"{e.id}; nothing was changed")

    def sequence_checkpoint(self, seq) -> Checkpoint:
        """Sequence.checkpoint: the recurrent state of ``seq`` after its last token (see
        :mod:`pyllama_kv.core.checkpoint`). InvalidInputError for an empty sequence or a model
        without recurrent layers (its cells can be forked at any position without one)."""
        with self.critical():
            e = self._entry(seq)
            self._need("recurrent_checkpoints", "a checkpoint of a sequence's recurrent state")
            if not self.model.recurrent:
                raise InvalidInputError("this model has no recurrent layers: a fork at any position needs no "
                                        "checkpoint")
            if not e.tokens:
                raise InvalidInputError(f"sequence {e.id} is empty: there is no state to keep")
            assert self._native is not None
            data = self._native.recurrent_state_get(e.id)
            if not data:
                raise LlamaError(f"llama.cpp could not write the recurrent state of sequence {e.id} (its log says why)")
            return Checkpoint.of(e.tokens, data, _state.model_fingerprint(self.model))

    def can_fork(self, seq, n: int, checkpoint: Checkpoint | None = None) -> bool:
        """Whether ``seq.fork(n, checkpoint)`` (or, without a checkpoint, a truncation to ``n``) can be
        made: False where the memory no longer holds the state at position ``n`` (recurrent layers
        without a checkpoint of those n tokens; a sliding-window cache that reused the cells of older
        positions: see the module docstring). Always True for none or all of it."""
        with self.critical():
            e = self._entry(seq)
            try:
                n = int_param("n", n, 0, len(e.tokens))
                if checkpoint is not None and n < len(e.tokens):
                    self._check_checkpoint(e, n, checkpoint)
                self._check_cut(e, n, "", checkpoint)
            except (InvalidInputError, LibraryError):
                return False
            return True

    def sequence_truncate(self, seq, n: int) -> None:
        """Sequence.truncate."""
        with self.critical():
            e = self._entry(seq)
            self._cut(e, int_param("n", n, 0, len(e.tokens)))

    def _cut(self, e: _SeqEntry, n: int) -> None:
        """Keep the first ``n`` (validated) positions of ``e``."""
        if n == len(e.tokens):
            return
        self._check_cut(e, n, f"truncating to {n} tokens")
        self._seq_remove(e.id, n, -1)
        del e.tokens[n:]
        e.logits = None

    def sequence_remove(self, seq, start: int, end: int, recompute: bool = False) -> None:
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
        shift_ok = not recompute and self.can_shift and self.caps.kv_shift and not self.shared_in(e.id, end, n)
        if not shift_ok:
            self._rebuild_tail(e, start, tail)
            return
        self._check_cut(e, start, f"removing positions [{start}, {end})")
        self._seq_remove(e.id, start, end)
        self._seq_shift(e.id, end, -1, -(end - start))
        del e.tokens[start:end]
        e.logits = None

    def sequence_shift_out(self, seq, n_keep: int, n_discard: int) -> None:
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
        self._check_cut(e, start, f"re-evaluating sequence {sid} from position {start}")
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
            if not self.caps.slot_retry or free + exclusive < tail.size:
                why = ("" if self.caps.slot_retry else
                       "; this library cannot re-evaluate in place without risking the sequence")
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

    def sequence_export(self, seq) -> _SequenceState:
        """Sequence.export_state."""
        with self.critical():
            e = self._entry(seq)
            self._need_states("exporting a sequence's state")
            # a state copies K as stored: a K-shift still pending would be lost
            self._c_update()
            data = _state.empty_state(self._layout_of()) if not e.tokens else self._read_seq_state(e.id)
            return _state.export_state(data, list(e.tokens), e.id, self.n_ctx, self.model)

    def whole_state(self, seq) -> _state.WholeState:
        """The whole state of ``seq`` as the library writes it, any memory (a recurrent model's state and
        a sliding-window cache included), for :meth:`sequence_load_whole` in this context. LlamaError
        when llama.cpp cannot write it."""
        with self.critical():
            e = self._entry(seq)
            # a state copies K as stored: a K-shift still pending would be lost, so the library must be
            # able to apply it now (caps.state_io: the current pin's patches/current/0002)
            self._need("state_io", "reading a sequence's whole state")
            self._c_update()
            assert self._native is not None
            data = self._native.state_seq_whole_read(e.id) if e.tokens else None
            if data is None:
                raise LlamaError(f"llama.cpp could not write the state of sequence {e.id}")
            return _state.WholeState(tuple(e.tokens), data, self._whole_owner)

    def sequence_load_whole(self, seq, state: _state.WholeState) -> None:
        """Make ``seq``, which holds a proper prefix of ``state``'s tokens, hold all of them from
        ``state`` (made by :meth:`whole_state` of this context): its cells are written, not computed.
        All or nothing: the state goes into the spare sequence first, and only then takes the place
        of ``seq``'s cells. InvalidInputError for a state of another context or that ``seq`` does not
        start; KVCacheFullError when its cells do not fit."""
        with self.critical():
            e = self._entry(seq)
            if not isinstance(state, _state.WholeState) or state.owner is not self._whole_owner:
                raise InvalidInputError("sequence_load_whole takes a WholeState that this context's whole_state made")
            n = len(e.tokens)
            if len(state.tokens) <= n or tuple(e.tokens) != state.tokens[:n]:
                raise InvalidInputError(f"the state's {len(state.tokens)} tokens do not extend the {n} of sequence "
                                        f"{e.id}")
            assert self._native is not None
            self._c_update()   # free cells may still carry the pending delta of a removed cell
            tmp = self._spare_id
            got = self._native.state_seq_whole_write(state.data, tmp, len(state.tokens))
            if got != len(state.data):
                self._seq_remove(tmp, -1, -1)
                raise KVCacheFullError(f"llama.cpp could not place the {len(state.tokens)} cells of the state")
            emptied = False
            try:   # whole sequences: any memory takes these
                self._seq_remove(e.id, -1, -1)
                emptied = True
                self._seq_copy(tmp, e.id, -1, -1)
                self._seq_remove(tmp, -1, -1)
            except BaseException:   # not expected: the spare is left empty, and seq says what it holds
                self._native.seq_rm(tmp, -1, -1)
                if emptied:
                    self._native.seq_rm(e.id, -1, -1)
                    e.tokens, e.logits = [], None
                raise
            e.tokens = list(state.tokens)
            e.logits = None   # computed at the next decode

    def sequence_snapshot(self, seq, start: int, end: int | None) -> _Span:
        """Sequence.snapshot: a compact copy of the cells of ``seq`` over positions [start, end)."""
        with self.critical():
            e = self._entry(seq)
            self._need_states("a snapshot of a sequence's cells")
            end = _spanio.span_end(start, end, len(e.tokens))
            self._c_update()   # a state copies K as stored: a K-shift still pending would be lost
            if self.caps.span_range_read:   # just the span's cells (patch 0017)
                assert self._native is not None
                return _spanio.read_span(self._native, e.id, list(e.tokens), start, end, self.n_ctx, self.model)
            return _spanio.make_span(self._read_seq_view(e.id), e.tokens, start, end, e.id, self.n_ctx,
                                     self.model)

    def sequence_restore(self, seq, span: _Span) -> None:
        """Sequence.restore: add the cells of ``span`` to ``seq``, which holds exactly [0, span.start)."""
        with self.critical():
            e = self._entry(seq)
            self._need("span_restore", "restoring a span")
            span = _spanio.check_restore(span, self.model, len(e.tokens), e.id, self.n_ctx,
                                         self._layout_of)
            self._c_update()   # free cells may still carry the pending delta of a removed cell
            st = self.kv_stats()
            if st.largest_free_block < len(span) <= st.free_cells:
                self.defrag()
                st = self.kv_stats()
            if st.largest_free_block < len(span):
                raise _spanio.no_block(len(span), st)
            assert self._native is not None
            got = self._native.state_seq_add(span.data, e.id)
            if got is None:
                raise LibraryError(f"{self._libobj.path} cannot restore a span (llama_state_seq_add_data is "
                                   "patch 0014 of pyllama_kv's series): use the patched library")
            if got != len(span.data):   # llama.cpp removed the cells it placed: the sequence is as it was
                raise KVCacheFullError(f"llama.cpp could not add the span's {len(span)} cells")
            e.tokens.extend(span.tokens)
            e.logits = None   # computed from the restored cells at the next logits() or decode

    def sequence_close(self, seq) -> None:
        """Sequence.close: free the id and cells of ``seq`` (nothing when it is closed already)."""
        if self.sequence_closed(seq):
            return
        with self.critical():
            if self._native is not None and not self.sequence_closed(seq):
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

    def _raw_decode(self, plan: _Plan, copy: bool = True) -> list[np.ndarray | None]:
        """Decode ``plan`` = [(seq_id, tokens, first_pos)] (validated) in as few llama_decode calls as
        n_batch allows, with one output (the last token) per entry. On failure every entry's new
        positions are removed and the mapped exception is raised. ``copy=False``: the rows of the last
        llama_decode are read-only views of llama.cpp's output buffer (see :meth:`decode`)."""
        native = self._native
        assert native is not None
        b = self._batch
        results: list[np.ndarray | None] = [None] * len(plan)
        n_vocab = self.model.n_vocab
        chunks = _chunk_plan(plan, b.cap)
        self._apply_shifts()
        try:
            for k, chunk in enumerate(chunks):
                n, outs = _fill_batch(b, plan, chunk)
                rc = self._c_decode(b, n)
                if rc != 0:
                    raise self._decode_error(rc)
                if outs:
                    # one copy for all rows of this call (a view for the last call's, when asked);
                    # each sequence gets a row of it
                    view = not copy and k == len(chunks) - 1
                    rows = native.logits_view(len(outs), n_vocab) if view else native.logits(len(outs), n_vocab)
                    for i, (e, _bidx) in enumerate(outs):
                        results[e] = rows[i]
        except BaseException:
            # llama_decode restored its own partial cells; remove what earlier chunks added
            for sid, _toks, pos0 in plan:
                native.seq_rm(sid, pos0, -1)
            raise
        return results

    def _decode_error(self, rc: int) -> BaseException:
        """The exception for llama_decode's return code ``rc`` (see :mod:`.returncodes`)."""
        exc, self._abort_exc = self._abort_exc, None
        return _decode_error(rc, self._libobj.last_error(), stats=self.kv_stats, patched=self.caps.slot_retry,
                             abort_exc=exc)

    def decode(self, batch: Mapping[_Sequence, Iterable[int]], *, copy: bool = True) -> dict[_Sequence, np.ndarray]:
        """Append tokens to several sequences at once: ``{seq: tokens}`` -> ``{seq: logits}``.

        One ``llama_decode`` call for the whole batch (more only when it holds more than ``n_batch``
        tokens). The logits are the next-token logits after each sequence's last new token, float32
        arrays of shape (n_vocab,). Atomic: on failure nothing changes (see the module docstring).

        ``copy=False`` (for a loop that samples every row at once, like the engine): the arrays are
        read-only views of llama.cpp's output buffer, valid only until the next call on this context
        that decodes; the sequences do not keep them (their ``logits()`` evaluates the last token
        again). This saves a copy of n_sequences x n_vocab floats per step (16 MiB for 32 sequences
        of a 128k vocabulary: a tenth of a GPU's step).
        """
        with self.critical():
            self.check_open()
            plan, entries = self._plan(batch)
            t0 = time.perf_counter()
            results = self._raw_decode(plan, copy)
            self.eval_cost.observe(sum(len(p[1]) for p in plan), time.perf_counter() - t0)
            out: dict[_Sequence, np.ndarray] = {}
            for e, (_sid, new, _), logits in zip(entries, plan, results):
                assert logits is not None   # every entry ends in the batch: it has an output
                e.tokens.extend(new)
                e.logits = logits if copy else None
                out[e.seq] = logits
            return out

    def _plan(self, batch) -> tuple[_Plan, list[_SeqEntry]]:
        """decode's plan [(seq_id, tokens, first_pos)] for ``batch`` and the entries it extends. First
        every piece of caller code runs (the mapping's iteration, token iterables), then the state they
        may have changed is checked: nothing the checks saw can change after them."""
        if not isinstance(batch, Mapping):
            raise InvalidInputError("decode needs a non-empty mapping {sequence: tokens}")
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
        plan: _Plan = []
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
        return plan, entries

    # -- cache maintenance ----------------------------------------------------------------------

    def defrag(self) -> KVStats:
        """Pack all used cells to the front of the cache now; return the stats after it.

        On a vanilla build this refuses (LlamaError) when the library would abort the process
        (cells in use past n_ctx - n_ubatch and holes to fill: see patches/0003). A library without
        defrag (``caps.defrag`` False: it writes batches into non-contiguous cells, so a batch fits
        whenever enough cells are free) does nothing here.
        """
        with self.critical():
            self.check_open()
            if not self.caps.defrag:
                return self.kv_stats()
            if not self.caps.safe_defrag:
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
            self._need("cell_view", "the cell view")
            self._apply_shifts()
            pos, seqs = self._read_view()
        # the view has a column more, for the spare id, which holds no cell between calls
        return pos, np.ascontiguousarray(seqs[:, :self.n_seq_max])

    def kv_cells(self) -> np.ndarray:
        """Per-cell occupancy, int32 (n_cells,): -1 free, -2 shared by several sequences, else the id
        of the one sequence holding the cell."""
        with self.critical():
            self.check_open()
            self._need("cell_view", "the cell view")
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
            if self.caps.stats:
                assert self._native is not None
                counters = self._native.stats()
        return _kv_stats(seqs, counters)

    def cell_holders(self) -> np.ndarray:
        """The ids of the sequences holding each cell, int32 (n_cells, n_seq_max), padded with -1 (a free
        cell: all -1). Which cells are shared and how many each sequence holds, on every library; the
        rows are in cache order only where ``caps.cell_view`` (see :meth:`kv_view`)."""
        with self.critical():
            self.check_open()
            _, seqs = self._read_view()
        return np.ascontiguousarray(seqs[:, :self.n_seq_max])

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

