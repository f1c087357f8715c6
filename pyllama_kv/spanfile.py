"""The disk tier of the prefix cache (``cache_dir``): spans in files, one span per file, found again
by the tokens they continue.

A span dropped from host memory (:mod:`pyllama_kv.tier`) is written to ``cache_dir`` when one is
set. A later prompt whose prefix neither the KV cache nor host memory holds asks the directory for
a file that continues it: the file's name says which model and cache layout, which positions
``[start, end)``, and a hash of the tokens of positions ``[0, end)``, so a lookup hashes the
prompt's own prefixes at the ends the directory offers and reads only a file whose hash matches.

A file is untrusted input: every field is checked before its span is used (magic, version, length,
model fingerprint, positions, token hash, the tokens themselves against the prompt, a SHA-256 of the
body, and the K/V data parsed against the context's layout). A file that fails any check is a miss:
it is counted (``TierStats.disk_corrupt``), deleted, and the sequence is left as it was; it is never
a crash and never a wrong restore. The directory holds at most ``max_bytes`` of span files: after
each write the least recently used (by mtime; a hit touches its file) are deleted. Writes are
atomic (a temporary file in the same directory, then a rename), so a reader never sees half a file
under a span's name; a crash can leave a temporary file, removed when it is an hour old. Files of
other models or cache layouts may share the directory (their names differ; they count toward the
bound). Writes and reads run on the caller's thread (the engine's, for the engine).

The format, version 1, little-endian::

    offset  size          field
    0       8             magic b"PKVSPAN\\0"
    8       4             u32 version (1)
    12      4             u32 F: length of the model fingerprint (1..256)
    16      F             the model fingerprint, ASCII (pyllama_kv.state.model_fingerprint)
    16+F    32            token hash: SHA-256 of b"pyllama-kv tokens v1\\0" + the int32 token ids
                          of positions [0, end)
    48+F    8, 8          u64 start, u64 end (start < end)
    64+F    8             u64 P: payload length
    72+F    32            SHA-256 of the body (tokens + payload)
    104+F   4*(end-start) int32 token ids of positions [start, end)
    ...     P             payload: llama.cpp's one-sequence state of the span's cells in position
                          order (the format in pyllama_kv.state), exactly what Span.data holds

The file's name is ``<key>-<start>-<end>-<token hash, hex>.kvspan``, ``key`` the first 16 hex
digits of a SHA-256 of the model fingerprint and the cache layout (types, row sizes, V layout).
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
import struct
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import state as _state
from .errors import InvalidInputError
from .span import Span

if TYPE_CHECKING:
    from .tier import TierStats

MAGIC = b"PKVSPAN\0"
VERSION = 1
SUFFIX = ".kvspan"
_TOKENS_TAG = b"pyllama-kv tokens v1\0"
_KEY_TAG = b"pyllama-kv span key v1\0"
_HEAD = struct.Struct("<8sII")           # magic, version, fingerprint length
_MID = struct.Struct("<32sQQQ32s")       # token hash, start, end, payload length, body sha256
_MAX_FP = 256
_NAME = re.compile(r"^([0-9a-f]{16})-(\d{1,10})-(\d{1,10})-([0-9a-f]{64})" + re.escape(SUFFIX) + "$")
_TMP = re.compile(r"^\..*" + re.escape(SUFFIX) + r"\.tmp-\d+-[0-9a-f]+$")
_STALE_TMP_S = 3600


def prefix_hashes(tokens: Sequence[int] | np.ndarray, ends: Iterable[int]) -> dict[int, bytes]:
    """The token hash (see the format) of ``tokens[:e]`` for every ``e`` in ``ends`` (each
    ``<= len(tokens)``), in one pass over the tokens."""
    arr = np.asarray(tokens, dtype="<i4")
    h = hashlib.sha256(_TOKENS_TAG)
    out: dict[int, bytes] = {}
    prev = 0
    for e in sorted(set(ends)):
        h.update(arr[prev:e].tobytes())
        prev = e
        out[e] = h.copy().digest()
    return out


def layout_key(fingerprint: str, layout: _state.Layout) -> str:
    """The name prefix of the files of one model and cache layout."""
    return hashlib.sha256(_KEY_TAG + fingerprint.encode() + b"\0" + repr(layout).encode()).hexdigest()[:16]


def encode(span: Span, token_hash: bytes) -> bytes:
    """The file bytes of ``span`` (``token_hash``: of the tokens of positions [0, span.end))."""
    fp = span.model.encode("ascii")
    body = np.asarray(span.tokens, dtype="<i4").tobytes() + span.data
    return b"".join((_HEAD.pack(MAGIC, VERSION, len(fp)), fp,
                     _MID.pack(token_hash, span.start, span.end, len(span.data), hashlib.sha256(body).digest()),
                     body))


def decode(raw: bytes, *, fingerprint: str, layout: _state.Layout, start: int, end: int, token_hash: bytes,
           tokens: Sequence[int]) -> Span:
    """The span in ``raw`` (a file's bytes), checked against what the caller expects: this model and
    cache layout, positions ``[start, end)``, the prompt's token hash and its ``tokens`` of those
    positions. InvalidInputError names the first field that disagrees."""
    if len(raw) < _HEAD.size:
        raise InvalidInputError("truncated: shorter than the header")
    magic, version, n_fp = _HEAD.unpack_from(raw, 0)
    if magic != MAGIC:
        raise InvalidInputError("not a span file (bad magic)")
    if version != VERSION:
        raise InvalidInputError(f"span file version {version}, this reader knows {VERSION}")
    if not 0 < n_fp <= _MAX_FP or len(raw) < _HEAD.size + n_fp + _MID.size:
        raise InvalidInputError("truncated or bad header (fingerprint length)")
    fp = raw[_HEAD.size:_HEAD.size + n_fp]
    if fp != fingerprint.encode("ascii"):
        raise InvalidInputError("the span file comes from another model")
    off = _HEAD.size + n_fp
    th, s, e, n_data, body_sha = _MID.unpack_from(raw, off)
    off += _MID.size
    if (s, e) != (start, end):
        raise InvalidInputError(f"the header says positions [{s}, {e}), the name [{start}, {end})")
    if th != token_hash:
        raise InvalidInputError("the token hash differs from the prompt's")
    n = end - start
    if len(raw) != off + 4 * n + n_data:
        raise InvalidInputError(f"{len(raw)} bytes, the header says {off + 4 * n + n_data} (truncated or padded)")
    body = raw[off:]
    if hashlib.sha256(body).digest() != body_sha:
        raise InvalidInputError("the body's SHA-256 differs from the header's (corrupt)")
    toks = np.frombuffer(body, dtype="<i4", count=n)
    if not np.array_equal(toks, np.asarray(tokens, dtype=np.int64)):
        raise InvalidInputError("the span's tokens differ from the prompt's")
    data = bytes(body[4 * n:])
    _state.parse(data, n, layout)   # exactly n cells of this layout, or InvalidInputError
    return Span(start, tuple(int(t) for t in toks), data, layout, fingerprint)


@dataclass(frozen=True)
class _Entry:
    name: str
    key: str
    start: int
    end: int
    token_hash: bytes
    size: int
    mtime_ns: int


class SpanDir:
    """The span files of one model and cache layout in ``path`` (see the module docstring), the
    directory within ``max_bytes``."""

    def __init__(self, path: str | os.PathLike, max_bytes: int, fingerprint: str, layout: _state.Layout,
                 stats: TierStats):
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidInputError(f"cache_dir {str(path)!r} cannot be created: {exc}") from None
        if not self.path.is_dir():
            raise InvalidInputError(f"cache_dir {str(path)!r} is not a directory")
        self.max_bytes = int(max_bytes)
        self.fingerprint = fingerprint
        self.layout = layout
        self.key = layout_key(fingerprint, layout)
        self.stats = stats
        stats.disk_budget_bytes = self.max_bytes
        self._listing: tuple[int, list[_Entry]] | None = None   # (directory mtime, our entries)
        self._remove_stale_tmp()
        self._scan()

    # -- the directory ------------------------------------------------------------------------------

    def _scan(self) -> list[_Entry]:
        """Every span file in the directory (any key); updates the disk stats."""
        out: list[_Entry] = []
        try:
            with os.scandir(self.path) as it:
                for de in it:
                    m = _NAME.match(de.name)
                    if m is None or not de.is_file(follow_symlinks=False):
                        continue
                    try:
                        st = de.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    s, e = int(m.group(2)), int(m.group(3))
                    if s < e:
                        out.append(_Entry(de.name, m.group(1), s, e, bytes.fromhex(m.group(4)), st.st_size,
                                          st.st_mtime_ns))
        except OSError:
            return []
        ours = [x for x in out if x.key == self.key]
        self.stats.disk_files = len(out)
        self.stats.disk_bytes = sum(x.size for x in out)
        self.stats.disk_tokens = sum(x.end - x.start for x in ours)
        try:
            self._listing = (os.stat(self.path).st_mtime_ns, ours)
        except OSError:
            self._listing = None
        return out

    def _ours(self) -> list[_Entry]:
        """This model's entries, rescanned when the directory changed."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return []
        if self._listing is None or self._listing[0] != mtime:
            self._scan()
        return self._listing[1] if self._listing is not None else []

    def _remove_stale_tmp(self) -> None:
        now = time.time()
        try:
            with os.scandir(self.path) as it:
                for de in it:
                    if _TMP.match(de.name):
                        try:
                            if now - de.stat(follow_symlinks=False).st_mtime > _STALE_TMP_S:
                                os.unlink(de.path)
                        except OSError:
                            pass
        except OSError:
            pass

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(self.path / name)
        except OSError:
            pass

    def _bound(self, newest: str) -> None:
        """Delete the least recently used span files until the directory is within ``max_bytes``."""
        entries = self._scan()
        total = sum(x.size for x in entries)
        if total <= self.max_bytes:
            return
        for x in sorted(entries, key=lambda x: (x.name == newest, x.mtime_ns)):
            if total <= self.max_bytes:
                break
            self._unlink(x.name)
            total -= x.size
            self.stats.disk_evicted_files += 1
        self._scan()

    # -- writing ------------------------------------------------------------------------------------

    def _matching(self, tokens: Sequence[int], pos: int) -> list[_Entry]:
        """This model's files that hold ``tokens[:end]`` (by name) from a ``start <= pos`` to an
        ``end > pos``, longest first."""
        cands = [x for x in self._ours() if x.start <= pos < x.end <= len(tokens)]
        if not cands:
            return []
        hashes = prefix_hashes(tokens, [x.end for x in cands])
        return sorted((x for x in cands if hashes[x.end] == x.token_hash), key=lambda x: -x.end)

    def covered(self, tokens: Sequence[int], pos: int) -> int:
        """How far files (by their names, unread) continue ``tokens`` from ``pos``, one after another;
        those files are touched (recently used)."""
        while True:
            best = self._matching(tokens, pos)
            if not best:
                return pos
            try:
                os.utime(self.path / best[0].name)
            except OSError:
                pass
            pos = best[0].end

    def put(self, tokens: Sequence[int], span: Span) -> bool:
        """Write ``span`` (``tokens``: the tokens of positions [0, span.end), its prefix included),
        less what files hold already (stored once: the files that hold a part are touched instead).
        False when nothing was written (all there already, larger than the bound, another model or
        layout, or an OS error, counted in ``disk_write_errors``)."""
        if span.model != self.fingerprint or span.layout != self.layout or len(tokens) < span.end:
            return False
        tokens = tokens[:span.end]
        have = self.covered(tokens, span.start)
        if have >= span.end:
            return False
        if have > span.start:
            span = span.split(have)[1]
        th = prefix_hashes(tokens, [span.end])[span.end]
        name = f"{self.key}-{span.start}-{span.end}-{th.hex()}{SUFFIX}"
        raw = encode(span, th)
        if len(raw) > self.max_bytes:
            self.stats.disk_not_stored += 1
            return False
        dest = self.path / name
        tmp = self.path / f".{name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
        try:
            with open(tmp, "xb") as f:
                f.write(raw)
            os.replace(tmp, dest)
        except OSError:
            self.stats.disk_write_errors += 1
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        self.stats.disk_writes += 1
        self.stats.disk_written_bytes += len(raw)
        self._bound(newest=name)
        return True

    # -- reading ------------------------------------------------------------------------------------

    def _read(self, name: str) -> bytes | None:
        """The bytes of a regular file of at most ``max_bytes`` (None: gone, or not such a file)."""
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(self.path / name, flags)
        except OSError:
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > self.max_bytes:
                return None
            chunks, left = [], st.st_size
            while left > 0:
                b = os.read(fd, min(left, 1 << 24))
                if not b:
                    break
                chunks.append(b)
                left -= len(b)
            return b"".join(chunks)
        except OSError:
            return None
        finally:
            os.close(fd)

    def find(self, tokens: Sequence[int], pos: int, limit: int) -> tuple[Span, str] | None:
        """The longest stored span that goes on a sequence holding ``tokens[:pos]``: positions
        ``[pos, e)``, ``pos < e <= limit``, cut from a file whose tokens are ``tokens[:end]``
        (``start <= pos``), with the file's name. Rejected files are counted, deleted and skipped.
        None: a miss."""
        if pos < limit:
            for x in self._matching(tokens, pos):
                raw = self._read(x.name)
                if raw is None:
                    if (self.path / x.name).exists():
                        self.stats.disk_corrupt += 1   # not a regular file, or larger than the bound
                        self._unlink(x.name)
                    continue
                try:
                    span = decode(raw, fingerprint=self.fingerprint, layout=self.layout, start=x.start,
                                  end=x.end, token_hash=x.token_hash, tokens=tokens[x.start:x.end])
                except InvalidInputError:
                    self.stats.disk_corrupt += 1
                    self._unlink(x.name)
                    continue
                try:
                    os.utime(self.path / x.name)   # recently used: the bound deletes it last
                except OSError:
                    pass
                if span.start < pos:
                    span = span.split(pos)[1]
                if span.end > limit:
                    span = span.split(limit)[0]
                return span, x.name
        return None

    def reject(self, name: str) -> None:
        """The file of a span that the context refused after all (counted, deleted)."""
        self.stats.disk_corrupt += 1
        self._unlink(name)
