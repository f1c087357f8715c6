"""Sequence states: llama.cpp's byte format parsed and checked in Python, model fingerprints, digests.

``llama_state_seq_set_data`` trusts its input: a cell count of 0 reads before the cell array
(segfault in ``state_read_meta``), a huge count is allocated before anything is checked, and
positions are written into the cache as given (a negative one makes a used cell look free; gaps,
duplicates or positions past the context break the sequence invariant silently). So
:meth:`Context.import_sequence <pyllama_kv.core.context.Context.import_sequence>` calls C only with data
that :func:`parse` has read completely and :func:`check_import` has matched against the importing
context, its model and the state's tokens.

This module makes no C call and holds no context: the context reads and writes llama.cpp's bytes and
owns the sequence's tokens; the functions here check, reorder and digest them.

The format, as llama.cpp 8733e0c writes it for one sequence (``llama_state_seq_get_data`` ->
``llama_context::state_seq_write_data`` -> ``llama_kv_cache_unified::state_write(io, seq_id)``),
native byte order, no padding::

    u32 cell_count
    cell_count x { i32 pos; u32 n_seq_id }               state_write_meta; n_seq_id is 0 for one sequence
    u32 v_trans; u32 n_layer                             state_write_data
    n_layer x { i32 k_type; u64 k_row_size; cell_count * k_row_size bytes }
    v_trans == 0: n_layer x { i32 v_type; u64 v_row_size; cell_count * v_row_size bytes }
    v_trans == 1: n_layer x { i32 v_type; u32 v_elem_size; u32 n_embd_v_gqa;
                              n_embd_v_gqa rows of cell_count * v_elem_size bytes }

The cells are in cache order; :func:`export_state` reorders them by position, so a valid state
holds positions 0..n-1 in that order and ``state_read_meta`` puts them into n contiguous cells.
"""
from __future__ import annotations

import hashlib
import mmap
import struct
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..errors import GGUFFileError, InvalidInputError, KVCacheFullError, LlamaError
from ..limits import INT32_MAX, INT32_MIN, KV_CACHE_TYPES
from ..modelfile.gguf import ggml_type_name

_DIGEST_TAG = b"pyllama-kv sequence state v1\0"


def _tname(t: int) -> str:
    return ggml_type_name(t) if t in KV_CACHE_TYPES.values() else f"ggml type {t}"


@dataclass(frozen=True)
class SequenceState:
    """The saved cells and tokens of a sequence (see Sequence.export_state), for Context.import_sequence.

    ``data`` is llama.cpp's state of the sequence (its byte layout: this module's docstring), its cells in
    position order. ``model`` is the fingerprint of the model that made it (pyllama_kv.core.state.model_fingerprint:
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


@dataclass(frozen=True, eq=False)
class WholeState:
    """A sequence's whole state as the library wrote it (with a recurrent model's state and a
    sliding-window cache's cells, which :class:`SequenceState` cannot hold), for the prefix cache of this
    process: never parsed, so :meth:`Context.sequence_load_whole
    <pyllama_kv.core.context.Context.sequence_load_whole>` takes only one that its own context made."""

    tokens: tuple
    data: bytes = field(repr=False)
    owner: object = field(repr=False, default=None)

    @property
    def n_bytes(self) -> int:
        return len(self.data)


# -- the format ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerLayout:
    """One layer's K and V headers. ``v_row`` is the bytes per cell of V in both layouts;
    ``v_elem`` and ``n_embd_v`` are set only for a transposed V (else 0)."""

    k_type: int
    k_row: int
    v_type: int
    v_row: int
    v_elem: int = 0
    n_embd_v: int = 0


@dataclass(frozen=True)
class Layout:
    """What a state's K/V headers must say for one context: V transposed or not, and per layer the
    types and row sizes (llama.cpp's ``n_embd_k_gqa`` / ``n_embd_v_gqa`` times the type's size)."""

    v_trans: bool
    layers: tuple

    def n_bytes(self, cell_count: int) -> int:
        """The exact length of a state of ``cell_count`` cells in this layout."""
        n = 4 + 8 * cell_count + 8
        for ly in self.layers:
            n += 12 + cell_count * ly.k_row
            n += 12 + cell_count * ly.v_row  # both V headers are 12 bytes
        return n


@dataclass(frozen=True)
class ParsedState:
    cell_count: int
    pos: np.ndarray  # int32, per cell in data order
    layout: Layout
    meta_off: int  # offset of the cell array
    k_off: tuple  # per layer: offset of its K rows
    v_off: tuple  # per layer: offset of its V data


class _Reader:
    def __init__(self, data: bytes | memoryview):
        self.data = data
        self.off = 0

    def need(self, n: int, what: str) -> int:
        left = len(self.data) - self.off
        if n > left:
            raise InvalidInputError(f"the state data ends inside {what}: {n} more bytes needed at byte "
                                    f"{self.off}, {left} left (truncated or tampered)")
        off = self.off
        self.off += n
        return off

    def scalar(self, fmt: str, what: str) -> int:
        off = self.need(struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.data, off)[0]


# long: one reader that follows the bytes in the order llama.cpp writes them (state_write_data: cells,
# V layout, K per layer, V per layer), each field checked where it is read
def parse(data: bytes | memoryview, max_cells: int, expect: Layout | None = None) -> ParsedState:
    """Read a sequence state completely, bounds-checking every field before it is used.

    ``max_cells`` bounds the cell count before anything is sized by it. With ``expect`` (the
    importing context's layout) every header must equal it, checked as soon as it is read.
    InvalidInputError names the first problem: truncation, trailing bytes, a count over the bound,
    a cell holding sequence ids, or a header that differs from ``expect``.
    """
    r = _Reader(data)
    cell_count = r.scalar("=I", "the cell count")
    if cell_count > max_cells:
        raise InvalidInputError(f"the state holds {cell_count} cells, more than the {max_cells} the context has")
    meta_off = r.need(8 * cell_count, f"the positions of its {cell_count} cells")
    cells = np.frombuffer(data, dtype=np.int32, count=2 * cell_count, offset=meta_off).reshape(cell_count, 2)
    if cell_count and cells[:, 1].any():
        i = int(np.flatnonzero(cells[:, 1])[0])
        raise InvalidInputError(f"cell {i} of the state lists {int(cells[i, 1]) & 0xFFFFFFFF} sequence ids "
                                "(a one-sequence state lists none)")
    v_trans = r.scalar("=I", "the V layout flag")
    if v_trans not in (0, 1):
        raise InvalidInputError(f"the state's V layout flag is {v_trans}, not 0 or 1")
    if expect is not None and bool(v_trans) != expect.v_trans:
        raise InvalidInputError(f"the state's V cache is {'' if v_trans else 'not '}transposed, this context's is "
                                f"{'' if expect.v_trans else 'not '}(flash attention differs)")
    n_layer = r.scalar("=I", "the layer count")
    if expect is not None and n_layer != len(expect.layers):
        raise InvalidInputError(f"the state has {n_layer} layers, this context's model has {len(expect.layers)}")

    def check(il: int, what: str, got: int, want: int | None, name=str) -> None:
        if expect is not None and got != want:
            raise InvalidInputError(f"layer {il}: the state's {what} is {name(got)}, this context's is {name(want)}")

    k_types, k_rows, k_off = [], [], []
    for il in range(n_layer):
        e = expect.layers[il] if expect is not None else None
        t = r.scalar("=i", f"the K type of layer {il}")
        check(il, "K type", t, e and e.k_type, _tname)
        row = r.scalar("=Q", f"the K row size of layer {il}")
        check(il, "K row size", row, e and e.k_row)
        k_off.append(r.need(cell_count * row, f"the K rows of layer {il}"))
        k_types.append(t)
        k_rows.append(row)
    layers, v_off = [], []
    for il in range(n_layer):
        e = expect.layers[il] if expect is not None else None
        t = r.scalar("=i", f"the V type of layer {il}")
        check(il, "V type", t, e and e.v_type, _tname)
        if v_trans:
            el = r.scalar("=I", f"the V element size of layer {il}")
            check(il, "V element size", el, e and e.v_elem)
            n_embd_v = r.scalar("=I", f"the V width of layer {il}")
            check(il, "V width (n_embd_v_gqa)", n_embd_v, e and e.n_embd_v)
            row = el * n_embd_v
            ly = LayerLayout(k_types[il], k_rows[il], t, row, el, n_embd_v)
        else:
            row = r.scalar("=Q", f"the V row size of layer {il}")
            check(il, "V row size", row, e and e.v_row)
            ly = LayerLayout(k_types[il], k_rows[il], t, row)
        v_off.append(r.need(cell_count * row, f"the V data of layer {il}"))
        layers.append(ly)
    if r.off != len(data):
        raise InvalidInputError(f"the state data has {len(data) - r.off} bytes after its end (at byte {r.off})")
    return ParsedState(cell_count, cells[:, 0].copy(), Layout(bool(v_trans), tuple(layers)), meta_off,
                       tuple(k_off), tuple(v_off))


def _gather(data, p: ParsedState, order: np.ndarray) -> np.ndarray:
    """``data`` (bytes-like) with its cells (positions, K rows, V rows or transposed-V columns) replaced by
    its cells ``order``, in that order, written once into one new array (the cell count field is left
    as it was). Consecutive cells are sliced, not gathered."""
    c = p.cell_count
    buf = np.frombuffer(data, dtype=np.uint8)
    idx = np.asarray(order, dtype=np.intp)
    n = int(idx.size)
    sel: slice | np.ndarray = idx
    if n and idx[0] >= 0 and np.array_equal(idx, np.arange(idx[0], idx[0] + n)):
        # consecutive cells (a span of a sequence whose cells are in position order, the common case)
        sel = slice(int(idx[0]), int(idx[0]) + n)
    per_cell = 8 + sum(ly.k_row + ly.v_row for ly in p.layout.layers)
    out = np.empty(buf.size - (c - n) * per_cell, dtype=np.uint8)
    w = cur = 0

    def raw(end: int) -> None:   # the header bytes from cur to end, as they are
        nonlocal w, cur
        k = end - cur
        out[w:w + k] = buf[cur:end]
        w, cur = w + k, end

    def cells(off: int, shape: tuple, axis: int) -> None:   # the cells of the block at off, of shape
        nonlocal w, cur
        raw(off)
        src = buf[off:off + int(np.prod(shape))].reshape(shape)
        dshape = shape[:axis] + (n,) + shape[axis + 1:]
        k = int(np.prod(dshape))
        dst = out[w:w + k].reshape(dshape)
        if isinstance(sel, slice):
            dst[...] = src[(slice(None),) * axis + (sel,)]
        else:   # mode="clip": no buffering of the output (the indices are valid)
            np.take(src, sel, axis=axis, out=dst, mode="clip")
        w, cur = w + k, off + src.size

    cells(p.meta_off, (c, 8), 0)
    for il, ly in enumerate(p.layout.layers):
        cells(p.k_off[il], (c, ly.k_row), 0)
    for il, ly in enumerate(p.layout.layers):
        if p.layout.v_trans:
            cells(p.v_off[il], (ly.n_embd_v, c, ly.v_elem), 1)
        else:
            cells(p.v_off[il], (c, ly.v_row), 0)
    raw(buf.size)
    assert w == out.size
    return out


def reorder(data: bytes, p: ParsedState, order: np.ndarray) -> bytes:
    """``data`` with its cells (positions, K rows, V rows or transposed-V columns) permuted by ``order``."""
    return _gather(data, p, order).tobytes()


# -- a context's layout ------------------------------------------------------------------------


def select(data, p: ParsedState, idx: np.ndarray) -> memoryview:
    """``data`` (bytes-like) reduced to its cells ``idx``, in that order (positions, K rows, V rows or
    transposed-V columns), with the cell count to match: a compact copy of just those cells, as a
    read-only view of one new numpy buffer (no further copy into a bytes object)."""
    out = _gather(data, p, idx)
    out[:4] = np.frombuffer(struct.pack("=I", int(np.asarray(idx).size)), dtype=np.uint8)
    out.flags.writeable = False
    return out.data


def concat(a: bytes | memoryview, pa: ParsedState, b: bytes | memoryview, pb: ParsedState) -> bytes:
    """The state holding the cells of ``a`` then those of ``b`` (the same layout, checked by the caller)."""
    ca, cb = pa.cell_count, pb.cell_count
    A, B = np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)
    out = [struct.pack("=I", ca + cb), a[pa.meta_off:pa.meta_off + 8 * ca], b[pb.meta_off:pb.meta_off + 8 * cb]]
    cur = pa.meta_off + 8 * ca
    for il, ly in enumerate(pa.layout.layers):
        off, boff = pa.k_off[il], pb.k_off[il]
        out += [a[cur:off], a[off:off + ca * ly.k_row], b[boff:boff + cb * ly.k_row]]
        cur = off + ca * ly.k_row
    for il, ly in enumerate(pa.layout.layers):
        off, boff = pa.v_off[il], pb.v_off[il]
        if pa.layout.v_trans:   # V is stored [n_embd_v][cell]: the cells of b go after a's in each row
            va = A[off:off + ca * ly.v_row].reshape(ly.n_embd_v, ca, ly.v_elem)
            vb = B[boff:boff + cb * ly.v_row].reshape(ly.n_embd_v, cb, ly.v_elem)
            parts: list[bytes | memoryview] = [np.concatenate([va, vb], axis=1).tobytes()]
        else:
            parts = [a[off:off + ca * ly.v_row], b[boff:boff + cb * ly.v_row]]
        out += [a[cur:off], *parts]
        cur = off + ca * ly.v_row
    out.append(a[cur:])
    return b"".join(out)


def empty_state(layout: Layout) -> bytes:
    """The state of a sequence holding no cells in ``layout``: the cell count 0 and the layer headers
    (what the mission pin writes for an empty sequence; the current API writes only the count)."""
    out = [struct.pack("=III", 0, int(layout.v_trans), len(layout.layers))]
    out += [struct.pack("=iQ", ly.k_type, ly.k_row) for ly in layout.layers]
    for ly in layout.layers:
        out.append(struct.pack("=iII", ly.v_type, ly.v_elem, ly.n_embd_v) if layout.v_trans
                   else struct.pack("=iQ", ly.v_type, ly.v_row))
    return b"".join(out)


def context_layout(empty_state: bytes, type_k: str, type_v: str) -> Layout:
    """The layout of a context's states, from llama.cpp's state of one of its sequences that holds no
    cells (exactly the headers: V layout, n_layer, per layer K/V type and row size) and its cache types."""
    try:
        p = parse(empty_state, max_cells=0)
    except InvalidInputError as exc:
        raise LlamaError(f"llama.cpp's empty sequence state is not in the expected format: {exc}") from None
    ly = p.layout
    want_k, want_v = KV_CACHE_TYPES[type_k], KV_CACHE_TYPES[type_v]
    if any(x.k_type != want_k or x.v_type != want_v for x in ly.layers):
        raise LlamaError("llama.cpp's state headers disagree with the context's cache types")
    return ly


# -- model fingerprint --------------------------------------------------------------------------

_SAMPLE = 1024  # bytes hashed at the start, middle and end of each tensor's data
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_fp_lock = threading.Lock()


def _gguf_layout(path, header=None) -> tuple[int, list[int]]:
    """(data offset, sorted tensor data offsets) of a GGUF file, from ``header`` (the file's, already
    read) or read by the one GGUF reader (pyllama_kv.modelfile.gguf); GGUFFileError when it is not a GGUF
    that reader accepts."""
    if header is None:
        from ..modelfile.gguf import read_gguf_header

        header = read_gguf_header(path)
    data_off = header.data_offset
    return data_off, sorted(data_off + t.offset for t in header.tensors if data_off + t.offset <= header.file_size)


def _compute_fingerprint(path, header=None) -> str:
    h = hashlib.sha256(b"pyllama-kv model fingerprint v1\0")
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        h.update(struct.pack("<Q", size))
        if size == 0:
            return "sha256:" + h.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            try:
                data_off, starts = _gguf_layout(path, header)
            except (GGUFFileError, OSError):
                # not a GGUF the reader accepts: the first 16 MiB and 256 spread samples
                data_off, starts = min(size, 16 << 20), [size * i // 256 for i in range(256)]
            h.update(mm[:data_off])  # header, metadata, tensor table
            ends = starts[1:] + [size]
            for a, b in zip(starts, ends):  # a tensor's data (and its alignment padding)
                for s in sorted({a, max(a, (a + b) // 2 - _SAMPLE // 2), max(a, b - _SAMPLE)}):
                    h.update(mm[s:min(b, s + _SAMPLE)])
    return "sha256:" + h.hexdigest()


def model_fingerprint(model, path=None, header=None) -> str:
    """A fingerprint of ``model``'s GGUF file, computed once per Model and cached: SHA-256 of its
    size, header, metadata and tensor table, and of 1 KiB at the start, middle and end of each
    tensor's data. Two models of the same shape with different weights differ; the whole file is
    not read (a few KiB per tensor). ``path``: where to read the file the first time (the open file
    the model was loaded from), else ``model.path``; ``header``: that file's GGUF header if it was
    read already (validation reads it), so that it is not parsed twice."""
    with _fp_lock:
        fp = _fingerprints.get(model)
    if fp is None:
        try:
            fp = _compute_fingerprint(model.path if path is None else path, header)
        except OSError as exc:
            raise LlamaError(f"cannot fingerprint the model file {model.path}: {exc}") from None
        with _fp_lock:
            fp = _fingerprints.setdefault(model, fp)
    return fp


def state_digest(tokens, data: bytes, model: str) -> str:
    """SHA-256 over the fingerprint, the tokens (int32) and the data: what export records and
    import checks, so that a state changed after export (a flipped byte, other tokens) is refused."""
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < INT32_MIN or arr.max() > INT32_MAX):
        return ""  # cannot be a valid state's tokens
    h = hashlib.sha256(_DIGEST_TAG)
    mb = model.encode("utf-8", "surrogatepass")
    h.update(struct.pack("<Q", len(mb)) + mb)
    h.update(struct.pack("<Q", arr.size) + arr.astype("<i4").tobytes())
    h.update(data)
    return h.hexdigest()


# -- export and import --------------------------------------------------------------------------


def position_order(data: bytes | memoryview, n_tokens: int, seq_id: int,
                   max_cells: int, first: int = 0) -> tuple[ParsedState, np.ndarray]:
    """llama.cpp's state ``data`` of sequence ``seq_id`` parsed, and the order that puts its cells in
    position order. LlamaError when the cells do not hold exactly positions first..first+n_tokens-1."""
    try:
        p = parse(data, max_cells=max_cells)
    except InvalidInputError as exc:
        raise LlamaError(f"llama.cpp's state of sequence {seq_id} is not in the expected format: {exc}") from None
    order = np.argsort(p.pos, kind="stable")
    if p.cell_count != n_tokens or not np.array_equal(p.pos[order], np.arange(first, first + n_tokens)):
        raise LlamaError(f"sequence {seq_id} has {n_tokens} tokens but its cells hold positions "
                         f"{sorted(p.pos.tolist())[:12]}{'...' if p.cell_count > 12 else ''}")
    return p, order


def export_state(data: bytes, tokens: list[int], seq_id: int, max_cells: int, model) -> SequenceState:
    """The SequenceState of a sequence holding ``tokens``, from llama.cpp's state ``data`` of it (read
    with no K-shift pending): its cells put in position order, the fingerprint of ``model`` and the
    digest. LlamaError when the cells do not hold exactly positions 0..len(tokens)-1."""
    p, order = position_order(data, len(tokens), seq_id, max_cells)
    if not np.array_equal(order, np.arange(p.cell_count)):
        data = reorder(data, p, order)
    fp = model_fingerprint(model)
    return SequenceState(tokens=tokens, data=data, model=fp, digest=state_digest(tokens, data, fp))


def check_import(state: SequenceState, model, n_ctx: int,
                 layout: Callable[[], Layout]) -> tuple[np.ndarray, bytes, ParsedState]:
    """Everything about ``state`` that import needs, checked before C sees it: the state's model
    fingerprint and digest (against ``model``), its tokens, and its data parsed against the importing
    context's ``layout()`` (called only once the cheap checks passed). InvalidInputError for a changed,
    foreign or malformed state; KVCacheFullError when it holds more cells than ``n_ctx``."""
    if not isinstance(state, SequenceState):
        raise InvalidInputError("import_sequence needs a SequenceState from Sequence.export_state()")
    fp = model_fingerprint(model)
    if not isinstance(state.model, str) or state.model != fp:
        raise InvalidInputError(f"the state is from another model (fingerprint {str(state.model)[:23]!r}, this "
                                f"context's model has {fp[:23]!r})")
    data = state.data
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidInputError(f"SequenceState.data must be bytes, got {type(data).__name__}")
    if type(data) is not bytes:
        data = bytes(data)  # an immutable copy: nothing can change it between the checks and C
    toks = model.check_tokens(state.tokens)
    if not isinstance(state.digest, str) or state.digest != state_digest(toks, data, fp):
        raise InvalidInputError("the state's digest does not match its tokens and data: it was changed after export")
    if len(data) < 4:
        raise InvalidInputError(f"the state data is {len(data)} bytes, too short for its header")
    (cell_count,) = struct.unpack_from("=I", data, 0)
    if cell_count != toks.size:
        raise InvalidInputError(f"the state data holds {cell_count} cells but has {toks.size} tokens")
    if cell_count > n_ctx:
        raise KVCacheFullError(f"the state holds {cell_count} cells, more than n_ctx={n_ctx}")
    p = parse(data, max_cells=n_ctx, expect=layout())
    if not np.array_equal(p.pos, np.arange(cell_count, dtype=np.int32)):
        bad = int(np.flatnonzero(p.pos != np.arange(cell_count))[0])
        raise InvalidInputError(f"cell {bad} of the state holds position {int(p.pos[bad])}, not {bad}: "
                                "a state holds positions 0..n-1 in order")
    return toks, data, p

