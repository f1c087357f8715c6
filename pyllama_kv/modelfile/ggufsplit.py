"""Split GGUF models (llama.cpp's ``gguf-split``: ``NAME-00001-of-00003.gguf`` ...): merged into one
file, and (for tests and tools) split.

A model too big for one file on the Hugging Face hub comes in parts: the first holds the metadata and
some tensors, the others only tensors, each with ``split.no``, ``split.count`` and
``split.tensors.count``. The static validation and the vetting of :mod:`.validate` and :mod:`.vetting`
read one file through one open descriptor, so a split model is merged once, byte for byte what
``llama-gguf-split --merge`` writes (the first part's metadata, its ``split.count`` set to 0 and moved
last as ``gguf_set_val_u16`` moves it, so that the file is never taken for a part again; every tensor
in order, the data realigned), into a temporary file beside the target, renamed into place when
complete. The parts are read with the one GGUF reader (:mod:`.gguf`), and are checked to be the parts
of one model (their number, order and tensor count) first. :func:`split` writes parts as
``llama-gguf-split --split`` does (its ``split.*`` keys in its order), the tensors in ``n`` even runs.
``tests/test_model_sources.py`` checks both against the pinned ``llama-gguf-split`` when it is built.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path

from .. import _paths
from ..errors import GGUFFileError, ModelLoadError
from .filehash import file_sha256
from .gguf import _NUMPY, _SCALAR, ARRAY, BOOL, INT32, KV, STRING, UINT16, GGUFHeader, TensorInfo, read_gguf_header

#: a part's file name: the prefix, its number and the count (``-00001-of-00003.gguf``)
SPLIT_RE = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


class SplitError(ModelLoadError):
    """The parts of a split GGUF model are not a whole model (missing, out of order, or not GGUF)."""


def split_name(name: str) -> tuple[str, int, int] | None:
    """``(prefix, number, count)`` of a part's file name (number from 1), or None for a whole file."""
    m = SPLIT_RE.match(name)
    if not m or not 1 <= int(m["no"]) <= int(m["count"]):
        return None
    return m["prefix"], int(m["no"]), int(m["count"])


def part_name(prefix: str, no: int, count: int) -> str:
    return f"{prefix}-{no:05d}-of-{count:05d}.gguf"


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def _str(s: str | bytes) -> bytes:
    b = s if isinstance(s, bytes) else s.encode("utf-8", "surrogateescape")
    return struct.pack("<Q", len(b)) + b


def _kv_bytes(kv: KV) -> bytes:
    """One metadata entry as GGUF writes it: key, type, value."""
    out = [_str(kv.key), struct.pack("<I", kv.type)]
    if kv.type == STRING:
        out.append(_str(kv.value))
    elif kv.type == ARRAY:
        assert kv.elem_type is not None
        out.append(struct.pack("<IQ", kv.elem_type, len(kv.value)))
        if kv.elem_type == STRING:
            out.extend(_str(v) for v in kv.value)
        else:
            import numpy as np  # here: naming a model file (the CLI's start) loads no numpy

            out.append(np.asarray(kv.value, dtype=_NUMPY[kv.elem_type]).tobytes())
    else:
        out.append(struct.pack(_SCALAR[kv.type][0], int(kv.value) if kv.type == BOOL else kv.value))
    return b"".join(out)


def _tensor_bytes(t: TensorInfo, offset: int) -> bytes:
    return (_str(t.name) + struct.pack("<I", t.n_dims) + struct.pack(f"<{t.n_dims}Q", *t.ne[:t.n_dims])
            + struct.pack("<IQ", t.type, offset))


def write_gguf(target: Path, kvs: list[KV], tensors: list[tuple[TensorInfo, Path, int]], alignment: int,
               version: int = 3) -> Path:
    """Write a GGUF file at ``target`` (a temporary file beside it, renamed into place; nothing is left
    on error): metadata ``kvs``, then each tensor of ``tensors`` — ``(info, the file holding its data,
    the offset of that data there)`` — its data copied from there and realigned to ``alignment``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)))
            for kv in kvs:
                out.write(_kv_bytes(kv))
            offset = 0
            for t, _, _ in tensors:
                out.write(_tensor_bytes(t, offset))
                offset = _pad(offset + t.nbytes, alignment)
            out.write(b"\0" * (_pad(out.tell(), alignment) - out.tell()))
            _copy_data(out, tensors, alignment)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _copy_data(out, tensors: list[tuple[TensorInfo, Path, int]], alignment: int) -> None:
    files: dict[Path, object] = {}
    try:
        for t, src, at in tensors:
            f = files.get(src) or files.setdefault(src, open(src, "rb"))  # closed below
            f.seek(at)  # type: ignore[attr-defined]
            left = t.nbytes
            while left:
                chunk = f.read(min(left, 1 << 20))  # type: ignore[attr-defined]
                if not chunk:
                    raise SplitError(f"{src} is truncated: tensor {t.name} ends past the end of the file")
                out.write(chunk)
                left -= len(chunk)
            out.write(b"\0" * (_pad(t.nbytes, alignment) - t.nbytes))
    finally:
        for f in files.values():
            f.close()  # type: ignore[attr-defined]


def _int(h: GGUFHeader, key: str) -> int | None:
    kv = h.kv.get(key)
    return int(kv.value) if kv is not None and kv.type != STRING and kv.type != ARRAY else None


def read_parts(parts: list[Path]) -> list[GGUFHeader]:
    """The headers of ``parts``, checked to be the parts of one model in order (SplitError otherwise)."""
    headers = []
    for i, p in enumerate(parts):
        try:
            h = read_gguf_header(p)
        except (GGUFFileError, OSError) as exc:
            raise SplitError(f"part {i + 1} of {len(parts)}: {exc}") from None
        if _int(h, "split.count") != len(parts) or _int(h, "split.no") != i:
            raise SplitError(f"{p.name} says it is part {_int(h, 'split.no')} (from 0) of {_int(h, 'split.count')}, "
                             f"expected part {i} of {len(parts)}")
        headers.append(h)
    want = _int(headers[0], "split.tensors.count")
    got = sum(len(h.tensors) for h in headers)
    if want is not None and want != got:
        raise SplitError(f"the {len(parts)} parts of {parts[0].name} hold {got} tensors, the first says {want}")
    return headers


def merge(parts: list[Path], target: Path) -> Path:
    """Merge the parts of a split model (in order) into the one GGUF file ``target``, atomically: what
    ``llama-gguf-split --merge`` writes (``split.count`` 0, last)."""
    headers = read_parts(parts)
    kvs = [kv for k, kv in headers[0].kv.items() if k != "split.count"] + [KV("split.count", UINT16, None, 0)]
    tensors = [(t, p, h.data_offset + t.offset) for p, h in zip(parts, headers) for t in h.tensors]
    free = shutil.disk_usage(target.parent).free
    need = sum(p.stat().st_size for p in parts)
    if need > free:
        raise SplitError(f"merging {parts[0].name} needs {need} bytes in {target.parent}, {free} are free")
    return write_gguf(target, kvs, tensors, headers[0].alignment, headers[0].version)


def split(path: Path, n: int, out_dir: Path, prefix: str | None = None) -> list[Path]:
    """Split the GGUF file ``path`` into ``n`` parts in ``out_dir`` as ``gguf-split`` does (the
    metadata in the first, the tensors in ``n`` runs): their paths, in order."""
    h = read_gguf_header(path)
    if not 1 <= n <= len(h.tensors):
        raise SplitError(f"cannot split {len(h.tensors)} tensors into {n} parts")
    prefix = prefix or path.name[:-len(".gguf")]
    import numpy as np

    runs = [list(r) for r in np.array_split(np.arange(len(h.tensors)), n)]
    out = []
    for i, run in enumerate(runs):
        meta = [KV("split.no", UINT16, None, i), KV("split.tensors.count", INT32, None, len(h.tensors)),
                KV("split.count", UINT16, None, n)]   # (gguf-split's order: it sets split.count last)
        kvs = (list(h.kv.values()) + meta) if i == 0 else meta
        tensors = [(h.tensors[j], path, h.data_offset + h.tensors[j].offset) for j in run]
        out.append(write_gguf(out_dir / part_name(prefix, i + 1, n), kvs, tensors, h.alignment, h.version))
    return out


def merged_dir() -> Path:
    return _paths.cache_dir() / "merged"


def merged(parts: list[Path], log=None) -> Path:
    """The one-file copy of the split model ``parts`` (in order), made once in ``<cache>/merged/``
    (named by the parts' sha256, so other bytes are another file) and reused after."""
    if len(parts) == 1:
        return parts[0]
    key = hashlib.sha256("|".join(file_sha256(p) for p in parts).encode()).hexdigest()[:16]
    prefix = (split_name(parts[0].name) or (parts[0].name[:-len(".gguf")],))[0]
    target = merged_dir() / f"{key}-{prefix}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if log:
        log(f"merging the {len(parts)} parts of {prefix} into {target} ...")
    merge(parts, target)
    file_sha256(target)   # hashed once, remembered: its first load costs a stat
    return target
