"""State and span I/O helpers for :class:`~pyllama_kv.core.context.Context`: reading a sequence's
state from llama.cpp whole, and the checks and copies around a snapshot or a restore. The context
calls them inside its critical section and does every write of cells and of its table itself."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from ..errors import InvalidInputError, KVCacheFullError, LlamaError
from . import state as _state
from .span import Span

if TYPE_CHECKING:
    from .._native.kv import NativeContext
    from .kvstats import KVStats

__all__ = ["check_restore", "make_span", "no_block", "read_seq_state", "read_span", "span_end"]


def read_seq_state(native: NativeContext, sid: int, copy: bool = True) -> bytes | memoryview:
    """llama.cpp's state of sequence ``sid`` (LlamaError when it cannot be read whole): bytes, or with
    ``copy=False`` a read-only view of the buffer llama.cpp wrote (one copy less, for a snapshot)."""
    data = native.state_seq_read(sid, copy)
    if data is None:
        raise LlamaError(f"llama.cpp could not write the state of sequence {sid} whole (or in a format the "
                         "binding reads)")
    return data


def span_end(start, end, n: int) -> int:
    """The checked end of a span over positions [start, end) of a sequence of ``n`` tokens (``end``
    None: to the end); InvalidInputError unless 0 <= start < end <= n."""
    end = n if end is None else end
    for name, v in (("start", start), ("end", end)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidInputError(f"{name} must be an int, got {type(v).__name__}")
    if not 0 <= start < end <= n:
        raise InvalidInputError(f"a span needs 0 <= start < end <= {n} (the sequence's length), got "
                                f"[{start}, {end})")
    return end


def make_span(data: bytes | memoryview, tokens: list[int], start: int, end: int, sid: int, n_ctx: int, model) -> Span:
    """The span of positions [start, end) of sequence ``sid``, whose state is ``data`` and whose
    tokens are ``tokens``: the cells' rows in position order, copied."""
    p, order = _state.position_order(data, len(tokens), sid, n_ctx)
    return Span(start, tuple(tokens[start:end]), _state.select(data, p, order[start:end]), p.layout,
                _state.model_fingerprint(model))


def read_span(native: NativeContext, sid: int, tokens: list[int], start: int, end: int, n_ctx: int,
              model) -> Span:
    """The span of positions [start, end) of sequence ``sid`` read by range (patch 0017; current/0003):
    llama.cpp writes just those cells; the span keeps that buffer (on the current pin, its translation to
    the mission format) when they are in position order (the usual case), else they are gathered once
    into position order. LlamaError when it cannot be read."""
    data = native.state_seq_range_read(sid, start, end)
    if data is None:
        raise LlamaError(f"llama.cpp could not write positions [{start}, {end}) of sequence {sid}")
    p, order = _state.position_order(data, end - start, sid, n_ctx, first=start)
    if not np.array_equal(order, np.arange(order.size)):
        data = _state.select(data, p, order)
    return Span(start, tuple(tokens[start:end]), data, p.layout, _state.model_fingerprint(model))


def check_restore(span, model, n_held: int, sid: int, n_ctx: int, layout: Callable[[], _state.Layout]) -> Span:
    """``span`` checked for a restore onto sequence ``sid`` of ``n_held`` tokens in a context of
    ``n_ctx`` cells whose state layout ``layout()`` reads: a Span of this model and layout whose
    data is whole and which starts where the sequence ends. InvalidInputError or KVCacheFullError."""
    if not isinstance(span, Span):
        raise InvalidInputError(f"restore needs a Span from Sequence.snapshot(), got {type(span).__name__}")
    if span.model != _state.model_fingerprint(model):
        raise InvalidInputError("the span comes from another model")
    if n_held != span.start:
        raise InvalidInputError(f"a span of positions [{span.start}, {span.end}) goes on a sequence of "
                                f"{span.start} tokens; sequence {sid} has {n_held}")
    if span.end > n_ctx:
        raise KVCacheFullError(f"the span ends at position {span.end}, past the context's {n_ctx} cells")
    if span.layout != layout():
        raise InvalidInputError("the span was copied from a context with other cache types or V layout "
                                "(flash attention)")
    try:
        span.parsed()   # the data is exactly len(tokens) cells of this layout, or InvalidInputError
    except InvalidInputError as exc:
        raise InvalidInputError(f"the span's data is not {len(span)} cells of this layout: {exc}") from None
    return span


def no_block(n_cells: int, st: KVStats) -> KVCacheFullError:
    """The error for ``n_cells`` cells that need one contiguous block the cache (``st``) lacks."""
    return KVCacheFullError(f"could not restore {n_cells} cells: they need one contiguous block, the "
                            f"largest free block is {st.largest_free_block} of {st.free_cells} free cells")
