"""The GGUF reader of the runtime: a GGUF file's header, metadata and tensor table, read as the pinned
llama.cpp's ``gguf_init_from_file`` reads them, with its checks plus those it would crash on (never
the tensor data).

One reader for everything that looks into a GGUF file: :class:`~pyllama_kv.core.model.Model` (through the
static validation of :mod:`pyllama_kv.modelfile.validate`, which gets the header from here), the model
fingerprint of :mod:`pyllama_kv.core.state`, the chat template lookup of :mod:`pyllama_kv.chat.templates`, and the
tools (``pyllama-kv inspect``). It is strict and fast: a tiny model takes ~1 ms, a 49k-token BPE
vocabulary with its merges ~0.1 s (gguf's GGUFReader took 6 s).

:func:`read_gguf_header` raises :class:`~pyllama_kv.errors.GGUFFileError` (a LlamaError) for a file
that is not GGUF, is truncated or corrupt, or has values of types that cannot be read; OSError when
the file cannot be read at all.
"""
from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import GGUFFileError

__all__ = ["GGML_TYPES", "GGUFFileError", "GGUFHeader", "GGUF_TYPE_NAMES", "KV", "TensorInfo", "ggml_type_name",
           "read_gguf_header"]

INT64_MAX = 2**63 - 1
GGML_MAX_NAME = 64         # ggml.h: names are shorter
GGML_MAX_DIMS = 4
GGUF_DEFAULT_ALIGNMENT = 32

# GGUF value types (ggml/include/gguf.h)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
GGUF_TYPE_NAMES = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32", "BOOL", "STRING",
                   "ARRAY", "UINT64", "INT64", "FLOAT64")
_SCALAR = {UINT8: ("<B", 1), INT8: ("<b", 1), UINT16: ("<H", 2), INT16: ("<h", 2), UINT32: ("<I", 4),
           INT32: ("<i", 4), FLOAT32: ("<f", 4), BOOL: ("<b", 1), UINT64: ("<Q", 8), INT64: ("<q", 8),
           FLOAT64: ("<d", 8)}
_NUMPY = {UINT8: "<u1", INT8: "<i1", UINT16: "<u2", INT16: "<i2", UINT32: "<u4", INT32: "<i4",
          FLOAT32: "<f4", BOOL: "<i1", UINT64: "<u8", INT64: "<i8", FLOAT64: "<f8"}
_INTEGER_TYPES = frozenset((UINT8, INT8, UINT16, INT16, UINT32, INT32, UINT64, INT64))

# the ggml types of the pinned ggml (ggml.c type_traits): id -> (name, block size, bytes per block);
# the removed ids (4, 5, 31-33, 36-38) have block size 0 there and are refused by gguf_init_from_file
GGML_TYPES = {
    0: ("f32", 1, 4), 1: ("f16", 1, 2), 2: ("q4_0", 32, 18), 3: ("q4_1", 32, 20), 6: ("q5_0", 32, 22),
    7: ("q5_1", 32, 24), 8: ("q8_0", 32, 34), 9: ("q8_1", 32, 40), 10: ("q2_K", 256, 84),
    11: ("q3_K", 256, 110), 12: ("q4_K", 256, 144), 13: ("q5_K", 256, 176), 14: ("q6_K", 256, 210),
    15: ("q8_K", 256, 292), 16: ("iq2_xxs", 256, 66), 17: ("iq2_xs", 256, 74), 18: ("iq3_xxs", 256, 98),
    19: ("iq1_s", 256, 50), 20: ("iq4_nl", 32, 18), 21: ("iq3_s", 256, 110), 22: ("iq2_s", 256, 82),
    23: ("iq4_xs", 256, 136), 24: ("i8", 1, 1), 25: ("i16", 1, 2), 26: ("i32", 1, 4), 27: ("i64", 1, 8),
    28: ("f64", 1, 8), 29: ("iq1_m", 256, 56), 30: ("bf16", 1, 2), 34: ("tq1_0", 256, 54),
    35: ("tq2_0", 256, 66),
}
GGML_TYPE_F32 = 0


def ggml_type_name(t: int) -> str:
    return GGML_TYPES[t][0] if t in GGML_TYPES else f"type {t}"


class KV(NamedTuple):
    """One metadata entry. ``value``: an int, float or bool; a str (decoded from UTF-8, undecodable
    bytes kept as surrogates); for an array, a numpy array, or a list of bytes for strings."""
    key: str
    type: int
    elem_type: int | None
    value: Any

    def describe(self) -> str:
        """The GGUF type and the value, for messages."""
        if self.type == ARRAY:
            et = GGUF_TYPE_NAMES[self.elem_type] if self.elem_type is not None else "?"
            vals = list(self.value[:6])
            shown = ", ".join(repr(v) if isinstance(v, bytes) else str(v) for v in vals)
            more = ", ..." if len(self.value) > 6 else ""
            return f"an array of {len(self.value)} {et} [{shown}{more}]"
        return f"{GGUF_TYPE_NAMES[self.type]} {self.value!r}"


class TensorInfo(NamedTuple):
    name: str
    n_dims: int
    ne: tuple          # 4 ints, ggml order (ne[0] is the row length), padded with 1
    type: int          # ggml type id
    offset: int        # from the start of the data section
    nbytes: int

    @property
    def shape(self) -> tuple:
        return tuple(self.ne[:self.n_dims])


class GGUFHeader(NamedTuple):
    path: Path
    version: int
    kv: dict            # key -> KV, in file order
    tensors: list       # TensorInfo, in file order
    alignment: int
    data_offset: int
    file_size: int

    def string(self, key: str) -> str | None:
        """The string value of ``key`` (None: absent or not a string)."""
        kv = self.kv.get(key)
        return kv.value if kv is not None and kv.type == STRING else None

    def loader_needs(self) -> tuple[str | None, str | None]:
        """(architecture, pre-tokenizer) that the loading llama.cpp must know: the pre-tokenizer of a
        BPE vocabulary only (None for another vocabulary, or an empty one, which llama.cpp takes as its
        default); what :func:`pyllama_kv._native.archs.loads_with` takes."""
        pre = self.string("tokenizer.ggml.pre") if self.string("tokenizer.ggml.model") == "gpt2" else None
        return self.string("general.architecture"), pre or None


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def read_gguf_header(path: str | os.PathLike, fd: int | None = None) -> GGUFHeader:
    """Read a GGUF file's metadata and tensor table (never the tensor data) as llama.cpp's
    gguf_init_from_file does, with its checks plus those it would crash on. GGUFFileError if the
    file is not one llama.cpp can parse (or it shrank while being read); OSError if it cannot be
    read. With ``fd``, the open file is read (``path`` only names it in messages)."""
    path = Path(path)
    with (os.fdopen(os.dup(fd), "rb") if fd is not None else open(path, "rb")) as f:
        size = os.fstat(f.fileno()).st_size
        magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFFileError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as exc:   # mmap of a file that shrank to nothing under us
            raise GGUFFileError(f"{path}: cannot read: {exc}") from None
    try:
        return _parse(path, mm, size)
    finally:
        mm.close()


class _Reader:
    """The read offset into a mapped GGUF file and its checked reads: every value is read where
    gguf_init_from_file reads it, and a read past the end is a GGUFFileError naming what was read."""

    def __init__(self, path: Path, mm, size: int):
        self.path, self.mm, self.size = path, mm, size
        self.off = 4   # past the magic

    def trunc(self, what: str, at: int, need: int) -> GGUFFileError:
        return GGUFFileError(f"{self.path}: truncated or corrupt GGUF: {what} at byte {at} needs {need} bytes, "
                             f"the file has {max(0, self.size - at)} left")

    def bad(self, msg: str) -> GGUFFileError:
        return GGUFFileError(f"{self.path}: {msg}")

    def read(self, fmt: str, n: int, what: str):
        if self.off + n > self.size:
            raise self.trunc(what, self.off, n)
        v = struct.unpack_from(fmt, self.mm, self.off)[0]
        self.off += n
        return v

    def read_str(self, what: str) -> bytes:
        n = self.read("<Q", 8, what)
        if n > self.size - self.off:
            raise self.trunc(what, self.off, n)
        s = self.mm[self.off:self.off + n]
        self.off += n
        return s

    def strings(self, key: str, n: int) -> list[bytes]:
        """An array of ``n`` strings (the loop inlined: Qwen's 151k-token vocabulary and its merges)."""
        mm, size, off = self.mm, self.size, self.off
        if n * 8 > size - off:
            raise self.trunc(f"the {n} strings of {key}", off, n * 8)
        unpack_from = struct.unpack_from
        items: list[bytes] = []
        append = items.append
        for j in range(n):
            if off + 8 > size:
                raise self.trunc(f"{key}[{j}]", off, 8)
            ln = unpack_from("<Q", mm, off)[0]
            off += 8
            end = off + ln
            if end > size:
                raise self.trunc(f"{key}[{j}]", off, ln)
            append(mm[off:end])
            off = end
        self.off = off
        return items

    def value(self, key: str) -> KV:
        """The typed value of metadata entry ``key`` (its type next in the file)."""
        t = self.read("<i", 4, f"the type of {key}")
        if t == ARRAY:
            et = self.read("<i", 4, f"the element type of {key}")
            n = self.read("<Q", 8, f"the length of {key}")
            if et == STRING:
                return KV(key, ARRAY, STRING, self.strings(key, n))
            if et in _SCALAR:
                nb = n * _SCALAR[et][1]
                if nb > self.size - self.off:
                    raise self.trunc(f"the {n} values of {key}", self.off, nb)
                import numpy as np  # here: naming a model file (the CLI's start) loads no numpy

                arr = np.frombuffer(self.mm, dtype=_NUMPY[et], count=n, offset=self.off).copy()
                self.off += nb
                return KV(key, ARRAY, et, arr)
            raise self.bad(f"{key} is an array of invalid GGUF type {et} (llama.cpp refuses nested arrays)")
        if t == STRING:
            return KV(key, STRING, None, self.read_str(key).decode("utf-8", "surrogateescape"))
        if t in _SCALAR:
            fmt, n = _SCALAR[t]
            v = self.read(fmt, n, key)
            return KV(key, t, None, v != 0 if t == BOOL else v)
        raise self.bad(f"{key} has invalid GGUF type {t}")

    def metadata(self, n_kv: int) -> dict[str, KV]:
        kv: dict[str, KV] = {}
        for i in range(n_kv):
            kb = self.read_str(f"the key of metadata entry {i}")
            if not kb:
                raise self.bad(f"metadata entry {i} has an empty key (llama.cpp aborts on it)")
            key = kb.decode("utf-8", "surrogateescape")
            if key in kv:
                raise self.bad(f"duplicate metadata key {key!r}")
            kv[key] = self.value(key)
        return kv

    def alignment(self, kv: dict[str, KV]) -> int:
        a = kv.get("general.alignment")
        if a is None:
            return GGUF_DEFAULT_ALIGNMENT
        if a.type != UINT32:
            raise self.bad(f"general.alignment is {a.describe()}: expected a UINT32 (llama.cpp aborts on it)")
        if a.value == 0 or a.value & (a.value - 1):
            raise self.bad(f"general.alignment = {a.value}: expected a power of 2")
        return a.value

    def tensor(self, i: int, names: set) -> TensorInfo:
        """Entry ``i`` of the tensor table (``names``: the names read so far, no duplicate allowed)."""
        nb = self.read_str(f"the name of tensor {i}")
        name = nb.decode("utf-8", "surrogateescape")
        if len(nb) >= GGML_MAX_NAME or b"\0" in nb:
            raise self.bad(f"tensor name {name!r} is invalid: names are 1 to {GGML_MAX_NAME - 1} bytes, no NUL")
        if name in names:
            raise self.bad(f"duplicate tensor name {name!r}")
        names.add(name)
        n_dims = self.read("<I", 4, f"the dimension count of tensor {name}")
        if n_dims > GGML_MAX_DIMS:
            raise self.bad(f"tensor {name} has {n_dims} dimensions: at most {GGML_MAX_DIMS}")
        ne = [1, 1, 1, 1]
        for j in range(n_dims):
            ne[j] = self.read("<q", 8, f"dimension {j} of tensor {name}")
            if ne[j] < 1:
                raise self.bad(f"tensor {name} has shape {ne[:n_dims]}: dimension {j} is {ne[j]}, expected >= 1"
                               + (" (llama.cpp divides by it)" if ne[j] == 0 else ""))
        # gguf_init_from_file's overflow test
        if (INT64_MAX // ne[1] <= ne[0] or INT64_MAX // ne[2] <= ne[0] * ne[1]
                or INT64_MAX // ne[3] <= ne[0] * ne[1] * ne[2]):
            raise self.bad(f"tensor {name} has shape {ne[:n_dims]}: 2^63 elements or more")
        t = self.read("<i", 4, f"the type of tensor {name}")
        if t not in GGML_TYPES:
            raise self.bad(f"tensor {name} has invalid ggml type {t}")
        _tn, blck, tsize = GGML_TYPES[t]
        if ne[0] % blck:
            raise self.bad(f"tensor {name} of type {_tn} has rows of {ne[0]} elements, not a multiple of its "
                           f"block size {blck}")
        offset = self.read("<Q", 8, f"the data offset of tensor {name}")
        nbytes = ne[0] // blck * tsize * ne[1] * ne[2] * ne[3]
        return TensorInfo(name, n_dims, tuple(ne), t, offset, nbytes)

    def check_data(self, tensors: list[TensorInfo], data_offset: int, alignment: int) -> None:
        """Each tensor's data follows the table in order, padded, and inside the file."""
        expected = 0
        for ti in tensors:
            if ti.offset != expected:
                raise self.bad(f"tensor {ti.name} has data offset {ti.offset}, expected {expected} (tensor data must "
                               f"follow the table in order, each padded to {alignment} bytes)")
            expected += _pad(ti.nbytes, alignment)
            end = data_offset + ti.offset + ti.nbytes
            if end > self.size:
                raise self.bad(f"truncated or corrupt GGUF: the data of tensor {ti.name} ends at byte {end}, "
                               f"past the end of the file ({self.size} bytes)")


def _parse(path: Path, mm, size: int) -> GGUFHeader:
    """The file field by field in gguf_init_from_file's order: header, metadata, tensor table, data
    offsets, each value checked where it is read (:class:`_Reader`)."""
    r = _Reader(path, mm, size)
    version = r.read("<I", 4, "the version")
    if version not in (2, 3):
        raise r.bad(f"GGUF version {version} is not supported (llama.cpp reads versions 2 and 3)")
    n_tensors = r.read("<q", 8, "the tensor count")
    n_kv = r.read("<q", 8, "the metadata count")
    if n_tensors < 0 or n_kv < 0:
        raise r.bad(f"truncated or corrupt GGUF: {n_tensors} tensors and {n_kv} metadata entries")
    kv = r.metadata(n_kv)
    alignment = r.alignment(kv)
    names: set = set()
    tensors = [r.tensor(i, names) for i in range(n_tensors)]
    data_offset = _pad(r.off, alignment)
    r.check_data(tensors, data_offset, alignment)
    return GGUFHeader(path, version, kv, tensors, alignment, data_offset, size)
