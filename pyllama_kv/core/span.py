"""Spans: a compact host copy of one sequence's cells over positions [start, end).

A :class:`Span` owns the K and V rows of every layer for its cells (read-only bytes, or a read-only
memoryview of the buffer llama.cpp wrote them into, in llama.cpp's one-sequence state format, cells in
position order), its tokens, and the identity of the model and cache layout they belong to. It never
refers to the context it came from: a span outlives the cells it copied, and restoring it is a memcpy
into free cells (llama.cpp's ``llama_state_seq_add_data``, patch 0014), not an evaluation. This is the
unit a prefix cache larger than the KV cache pages out to host memory and back in (Ollama's MLX runner
calls it a snapshot).

* ``seq.snapshot(start, end)`` (:meth:`pyllama_kv.Sequence.snapshot`) copies a span out; the
  sequence is unchanged.
* ``seq.restore(span)`` adds the span's cells to a sequence that holds exactly positions
  ``[0, span.start)`` (its parent prefix, possibly shared with forks, is kept as it is); the
  sequence then holds ``[0, span.end)``. It needs the patched library.
* :meth:`Span.split` and :meth:`Span.merge` cut a span in two at a position and join two adjacent
  spans, without touching a context.

Restored cells hold the exact bytes that were copied out: a restored sequence's state is byte for
byte the original's (tested on an F32 model in tests/test_spans.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidInputError
from . import state as _state


def shared_prefix(a, b) -> int:
    """How many leading tokens ``a`` and ``b`` (sequences or arrays of token ids) have in common."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:m], dtype=np.int64) != np.asarray(b[:m], dtype=np.int64))
    return int(diff[0]) if diff.size else m


@dataclass(frozen=True, eq=False)
class Span:
    """The cells of one sequence over positions ``[start, start + len(tokens))``: see the module
    docstring. ``data`` is a one-sequence state of exactly these cells in position order; ``layout``
    the cache layout it was read with; ``model`` the model's fingerprint."""

    start: int
    tokens: tuple[int, ...]
    data: bytes | memoryview   # read-only: bytes, or a view of the numpy buffer it was gathered into
    layout: _state.Layout
    model: str

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V data this span holds (what it costs in host memory, besides its tokens)."""
        return len(self.data)

    def __repr__(self) -> str:
        return f"<pyllama_kv.Span [{self.start}, {self.end}) {self.nbytes} bytes>"

    def parsed(self) -> _state.ParsedState:
        return _state.parse(self.data, len(self.tokens), self.layout)

    def split(self, at: int) -> tuple[Span, Span]:
        """The spans ``[start, at)`` and ``[at, end)`` (``start < at < end``)."""
        if isinstance(at, bool) or not isinstance(at, int) or not self.start < at < self.end:
            raise InvalidInputError(f"split needs a position strictly inside [{self.start}, {self.end}), got {at!r}")
        p = self.parsed()
        k = at - self.start
        head = _state.select(self.data, p, np.arange(k))
        tail = _state.select(self.data, p, np.arange(k, len(self.tokens)))
        return (Span(self.start, self.tokens[:k], head, self.layout, self.model),
                Span(at, self.tokens[k:], tail, self.layout, self.model))

    def merge(self, other: Span) -> Span:
        """This span followed by ``other``, which must start where this one ends (same model and layout)."""
        if not isinstance(other, Span):
            raise InvalidInputError(f"merge needs a Span, got {type(other).__name__}")
        if other.start != self.end:
            raise InvalidInputError(f"spans [{self.start}, {self.end}) and [{other.start}, {other.end}) are not "
                                    "adjacent")
        if other.model != self.model or other.layout != self.layout:
            raise InvalidInputError("spans of another model or cache layout cannot be merged")
        data = _state.concat(self.data, self.parsed(), other.data, other.parsed())
        return Span(self.start, self.tokens + other.tokens, data, self.layout, self.model)
