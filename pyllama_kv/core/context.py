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

The class is built in layers, one concern a module, each the next one's base (one object, so the
context stays the one writer): :mod:`.context_base` (lifecycle and lock, the table, raw cell
operations, the C calls that decode and maintain the cache), :mod:`.context_cells` (maintenance and
inspection), :mod:`.context_state` (states, spans and whole states, per capability) and this module
(construction, :meth:`Context.decode` and the sequence channel).

Pure pieces live beside these modules: :mod:`.batching` (how a decode is cut into llama_decode calls),
:mod:`.returncodes` (llama_decode's return code -> exception), :mod:`.kvstats` (KVStats and its
arithmetic), :mod:`.spanio` (state reads and span checks), :mod:`.critical` (the lock's state and the
critical section).

Tests and scripts that go behind the API's back use ``_ptr``, ``_L``, ``_seq_remove`` and
``_read_seq_state``.

All C calls go through ``self._native`` (:class:`pyllama_kv._native.kv.NativeContext`).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Callable

import numpy as np

from .._native import kv as _kv, omp as _omp
from ..config import ContextConfig, default_threads, int_param
from ..errors import InvalidInputError, KVCacheFullError, LibraryError, LlamaError
from ..limits import KV_CACHE_TYPES, QUANTIZED_KV_TYPES, kv_type_block
from . import state as _state
from .batching import fast_tokens as _fast_tokens
from .checkpoint import Checkpoint
from .context_base import _NO_TOKENS, _SeqEntry
from .context_state import ContextStates
from .cost import EvalCost
from .critical import LockState as _LockState
from .kvstats import KVStats
from .sequence import Sequence as _Sequence

if TYPE_CHECKING:
    from .batching import Plan as _Plan
    from .model import Model

__all__ = ["Context", "KVStats"]


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


def _check_weights(model: Model) -> None:
    """InvalidInputError unless ``model`` is open and has its weights (not ``vocab_only``)."""
    model.check_open()
    if model.vocab_only:
        raise InvalidInputError("this model was loaded with vocab_only=True (no weights): it tokenizes and "
                                "renders chats, it cannot make a context")


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


class Context(ContextStates):
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
        _check_weights(model)
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
        self.caps = lib.caps
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
        self._graph_argmax = True   # greedy tokens may be chosen in the graph (false once a backend chose none)
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

    def decode(self, batch: Mapping[_Sequence, Iterable[int]], *, copy: bool = True,
               outputs: Mapping[_Sequence, int] | None = None,
               greedy: Iterable[_Sequence] = (),
               between: Callable[[], None] | None = None) -> dict[_Sequence, np.ndarray | int | list[int]]:
        """Append tokens to several sequences at once: ``{seq: tokens}`` -> ``{seq: logits}``.

        One ``llama_decode`` call for the whole batch (more only when it holds more than ``n_batch``
        tokens). The logits are the next-token logits after each sequence's last new token, float32
        arrays of shape (n_vocab,). Atomic: on failure nothing changes (see the module docstring).

        ``outputs`` ``{seq: n}`` (1 <= n <= its new tokens; a sequence of ``batch``): that sequence gets
        the logits after each of its last ``n`` new tokens, an (n, n_vocab) array in position order
        (row i: the logits after new token ``len - n + i``), all from the one decode: what verifying a
        draft needs. Its stored next-token logits are the last row.

        ``copy=False`` (for a loop that samples every row at once, like the engine): the arrays are
        read-only views of llama.cpp's output buffer, valid only until the next call on this context
        that decodes; the sequences do not keep them (their ``logits()`` evaluates the last token
        again). This saves a copy of n_sequences x n_vocab floats per step (16 MiB for 32 sequences
        of a 128k vocabulary: a tenth of a GPU's step). The arrays of ``outputs`` are copies.

        ``greedy`` (sequences of ``batch``): their result is the argmax token itself, an int (with
        ``outputs``: a list of one per row), not logits. Where the library samples in the graph
        (``caps.backend_sampling``: the current pin) the argmax is taken there and only the token comes
        back, on a GPU no logits row at all; else it is numpy's argmax of the logits. In the graph a
        sequence id keeps its greedy chain until a decode of it is not greedy (each change costs a graph
        reservation: keep a sequence's kind for its life). A sequence whose token the graph chose stores
        no logits (its ``logits()`` evaluates its last token again); one whose logits were read keeps them.

        ``between()`` is called once, after the (last) ``llama_decode`` returned and before any output is
        read. On a GPU the graph is then still running (llama.cpp waits for the device when an output is
        read), so host work done there overlaps the device's (the engine's pipelined loop streams the
        last step's text there); on the CPU the decode has run already. It must not use the context
        (InvalidInputError, as from the abort callback); if it raises, the decode is undone and its
        exception raised.
        """
        with self.critical():
            self.check_open()
            wanted = self._outputs_of(outputs)   # the caller's code runs before _plan's checks
            picked = self._greedy_of(greedy, between)
            plan, entries = self._plan(batch)
            n_outs = self._outputs(wanted, entries, plan) if wanted else None
            argmax = self._greedy(picked, entries) if picked else None
            clock = self.eval_cost.clock
            t0 = clock()
            results = self._raw_decode(plan, copy, n_outs, argmax, between)
            self.eval_cost.observe(sum(len(p[1]) for p in plan), clock() - t0)
            return self._decoded(entries, plan, results, copy, argmax)

    @staticmethod
    def _decoded(entries: list[_SeqEntry], plan: _Plan, results: list, copy: bool,
                 argmax: list[bool] | None) -> dict[_Sequence, np.ndarray | int | list[int]]:
        """decode's table update (each entry's tokens and stored logits) and its result."""
        out: dict[_Sequence, np.ndarray | int | list[int]] = {}
        for i, (e, (_sid, new, _), logits) in enumerate(zip(entries, plan, results)):
            assert logits is not None   # every entry ends in the batch: it has an output
            e.tokens.extend(new)
            if not isinstance(logits, np.ndarray):   # greedy tokens the graph chose: no logits read
                e.logits = None
                out[e.seq] = logits
                continue
            last = logits if logits.ndim == 1 else logits[-1]
            e.logits = last if copy or logits.ndim == 2 else None
            if argmax is not None and argmax[i]:   # greedy, from the logits (a library without it)
                out[e.seq] = int(np.argmax(last)) if logits.ndim == 1 else [int(np.argmax(r)) for r in logits]
            else:
                out[e.seq] = logits
        return out

    @staticmethod
    def _greedy_of(greedy, between) -> list:
        """decode's ``greedy`` as a list, and ``between`` checked (before _plan's checks)."""
        try:
            picked = list(greedy)
        except TypeError:
            raise InvalidInputError("greedy must be an iterable of sequences of the batch") from None
        if between is not None and not callable(between):
            raise InvalidInputError("between must be a callable (or None)")
        return picked

    @staticmethod
    def _greedy(picked: list, entries: list[_SeqEntry]) -> list[bool]:
        """decode's ``greedy`` as a flag per plan entry (checked: sequences of the batch)."""
        index = {id(e.seq): i for i, e in enumerate(entries)}
        flags = [False] * len(entries)
        for seq in picked:
            i = index.get(id(seq))
            if i is None:
                raise InvalidInputError("greedy names a sequence that is not in the batch")
            flags[i] = True
        return flags

    @staticmethod
    def _outputs_of(outputs) -> list[tuple]:
        if outputs is None:
            return []
        if not isinstance(outputs, Mapping):
            raise InvalidInputError("outputs must be a mapping {sequence: n}")
        return list(outputs.items())

    def _outputs(self, wanted: list[tuple], entries: list[_SeqEntry], plan: _Plan) -> list[int]:
        """decode's ``outputs`` as a count per plan entry (checked: sequences of the batch, 1..their
        new tokens); InvalidInputError before anything changes."""
        index = {id(e.seq): i for i, e in enumerate(entries)}
        n_outs = [1] * len(entries)
        for seq, n in wanted:
            i = index.get(id(seq))
            if i is None:
                raise InvalidInputError("outputs names a sequence that is not in the batch")
            n_outs[i] = int_param("outputs", n, 1, len(plan[i][1]))
        return n_outs

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


def release_thread_pool() -> bool:
    """Before another thread takes over the decodes (``Engine.start``): free the calling thread's
    OpenMP workers, so that the thread that decodes has the only ones (two pools on 2 cores made every
    decode's barriers sleep: 23 against 18 ms a token; see :mod:`pyllama_kv._native.omp`). False when
    no OpenMP runtime is loaded."""
    return _omp.release_thread_pool()
