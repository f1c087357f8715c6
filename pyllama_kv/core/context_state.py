"""The third part of :class:`~pyllama_kv.core.context.Context` (see :mod:`.context_base`): sequence
states, spans and whole states, each as far as the library's capabilities allow (``caps.state_io``,
``span_restore``, ``span_range_read``) and the model's memory (a plain KV cache, or any memory for a
whole state). Byte formats are :mod:`.state`'s and :mod:`.spanio`'s; this part moves the bytes in and
out of llama.cpp and keeps the table true."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidInputError, KVCacheFullError, LibraryError, LlamaError
from . import spanio as _spanio, state as _state
from .context_base import _CAP_TEXT, _SeqEntry
from .context_cells import ContextCells
from .state import SequenceState as _SequenceState

if TYPE_CHECKING:
    from .span import Span as _Span


class ContextStates(ContextCells):
    """States, spans and whole states of a :class:`~.context.Context`'s sequences."""

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
