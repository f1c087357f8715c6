"""The disk tier of the prefix cache (``cache_dir``): spans in files, one span per file, found again
by any prefix of their tokens that a prompt shares.

A span dropped from host memory (:mod:`pyllama_kv.prefixcache.tiers`) is written to ``cache_dir`` when one is
set. A file holds the K/V of positions ``[start, end)`` and the tokens of all positions ``[0, end)``
(its prefix's too), so it says on its own which prompts it continues. The directory keeps an index
in memory (:class:`TokenIndex`): a token trie of every file's tokens ``[0, end)``, built when the
directory is opened by reading only the files' headers and tokens (never their K/V), and brought up
to date when the directory changes (another process writes or deletes files there). A prompt that
neither the KV cache nor host memory can continue walks the index as the host tier's trie is
walked: a file whose tokens share ``k`` leading tokens with the prompt serves positions
``[pos, k)`` to a sequence holding ``[0, pos)`` (``start <= pos < k``), the file's span cut where
the prompt leaves it, so a prompt that shares only the first part of a stored conversation (the
same system prompt, another user) restores that part. Files are written once per prefix: the part
of a span that files already hold (touched instead) is not written again.

A file is untrusted input: every field is checked before its span is used (magic, version, length,
model fingerprint, positions, the token hash in its name and header against its tokens, the tokens
themselves against the prompt's, a SHA-256 of the body, and the K/V data parsed against the
context's layout). A file that fails any check is a miss: it is counted (``TierStats.disk_corrupt``),
deleted, and the sequence is left as it was; it is never a crash and never a wrong restore. Headers
are checked when the index reads them, the rest when a span is read. The directory holds at most
``max_bytes`` of span files: when it is opened and after each write, the least recently used (by
mtime; a hit touches its file) are deleted, whichever process wrote them. Writes are atomic (a
temporary file in the same directory, then a rename), so a reader never sees half a file under a
span's name; a crash can leave a temporary file, removed when it is an hour old. Files of other
models or cache layouts may share the directory (their names differ; they count toward the bound).
Writes and reads run on the caller's thread (the engine's, for the engine).

The format, version 2, little-endian::

    offset  size          field
    0       8             magic b"PKVSPAN\\0"
    8       4             u32 version (2)
    12      4             u32 F: length of the model fingerprint (1..256)
    16      F             the model fingerprint, ASCII (pyllama_kv.core.state.model_fingerprint)
    16+F    32            token hash: SHA-256 of b"pyllama-kv tokens v1\\0" + the int32 token ids
                          of positions [0, end)
    48+F    8, 8          u64 start, u64 end (start < end)
    64+F    8             u64 P: payload length
    72+F    32            SHA-256 of the body (tokens + payload)
    104+F   4*end         int32 token ids of positions [0, end) (the header: what the index reads)
    ...     P             payload: llama.cpp's one-sequence state of the span's cells [start, end) in
                          position order (the format in pyllama_kv.core.state), exactly what Span.data holds

The file's name is ``<key>-<start>-<end>-<token hash, hex>.kvspan``, ``key`` the first 16 hex
digits of a SHA-256 of the model fingerprint and the cache layout (types, row sizes, V layout).
Version 1 files (the tokens of ``[start, end)`` only) are refused as any other version is.
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
import struct
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..core import state as _state
from ..core.span import Span
from ..errors import InvalidInputError
from .trie import Node, TokenTrie

if TYPE_CHECKING:
    from .tiers import TierStats

MAGIC = b"PKVSPAN\0"
VERSION = 2
SUFFIX = ".kvspan"
_TOKENS_TAG = b"pyllama-kv tokens v1\0"
_KEY_TAG = b"pyllama-kv span key v1\0"
_HEAD = struct.Struct("<8sII")           # magic, version, fingerprint length
_MID = struct.Struct("<32sQQQ32s")       # token hash, start, end, payload length, body sha256
_MAX_FP = 256
_NAME = re.compile(r"^([0-9a-f]{16})-(\d{1,10})-(\d{1,10})-([0-9a-f]{64})" + re.escape(SUFFIX) + "$")
_TMP = re.compile(r"^\..*" + re.escape(SUFFIX) + r"\.tmp-\d+-[0-9a-f]+$")
_STALE_TMP_S = 3600
_RACY_NS = 1_000_000_000


def token_hash(tokens: Sequence[int] | np.ndarray) -> bytes:
    """The token hash (see the format) of ``tokens``."""
    return hashlib.sha256(_TOKENS_TAG + np.asarray(tokens, dtype="<i4").tobytes()).digest()


def layout_key(fingerprint: str, layout: _state.Layout) -> str:
    """The name prefix of the files of one model and cache layout."""
    return hashlib.sha256(_KEY_TAG + fingerprint.encode() + b"\0" + repr(layout).encode()).hexdigest()[:16]


def encode(span: Span, tokens: Sequence[int] | np.ndarray) -> tuple[bytes, bytes]:
    """The file bytes of ``span`` and its token hash; ``tokens``: the tokens of positions
    ``[0, span.end)``, its prefix's included (ending with the span's own)."""
    arr = np.asarray(tokens, dtype="<i4")
    if arr.size != span.end or not np.array_equal(arr[span.start:], np.asarray(span.tokens, dtype=np.int64)):
        raise InvalidInputError(f"encode needs the tokens of positions [0, {span.end}) ending with the span's")
    fp = span.model.encode("ascii")
    th = token_hash(arr)
    body = arr.tobytes() + span.data
    return b"".join((_HEAD.pack(MAGIC, VERSION, len(fp)), fp,
                     _MID.pack(th, span.start, span.end, len(span.data), hashlib.sha256(body).digest()),
                     body)), th


@dataclass(frozen=True)
class Header:
    """What a file's header says, checked (:func:`parse_header`)."""

    start: int
    end: int
    token_hash: bytes
    n_data: int
    body_sha: bytes
    body_offset: int      # where the tokens start (the body: tokens, then the payload)
    tokens: np.ndarray    # int32, positions [0, end)


def header_size(raw: bytes) -> int | None:
    """How many leading bytes of a file :func:`parse_header` needs, from its first bytes (at least
    ``_HEAD.size + _MAX_FP + _MID.size`` of them, or the whole file); None when they cannot say
    (then parse_header names the problem)."""
    if len(raw) < _HEAD.size:
        return None
    _, _, n_fp = _HEAD.unpack_from(raw, 0)
    if not 0 < n_fp <= _MAX_FP or len(raw) < _HEAD.size + n_fp + _MID.size:
        return None
    _, _, e, _, _ = _MID.unpack_from(raw, _HEAD.size + n_fp)
    return _HEAD.size + n_fp + _MID.size + 4 * e


def parse_header(raw: bytes, *, fingerprint: str, start: int, end: int, token_hash_: bytes,
                 file_size: int) -> Header:
    """The header at the start of ``raw`` (a file of ``file_size`` bytes: all of it, or at least
    :func:`header_size` bytes), checked against what its name says (positions ``[start, end)``, the
    token hash) and this model: magic, version, fingerprint, the file's size, and the token hash
    against the tokens. InvalidInputError names the first field that disagrees."""
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
    if th != token_hash_:
        raise InvalidInputError("the header's token hash differs from the name's")
    if file_size != off + 4 * end + n_data:
        raise InvalidInputError(f"{file_size} bytes, the header says {off + 4 * end + n_data} (truncated or padded)")
    if len(raw) < off + 4 * end:
        raise InvalidInputError("truncated: the tokens are missing")
    toks = np.frombuffer(raw, dtype="<i4", count=end, offset=off)
    if hashlib.sha256(_TOKENS_TAG + raw[off:off + 4 * end]).digest() != th:
        raise InvalidInputError("the tokens differ from the token hash (corrupt)")
    return Header(s, e, th, n_data, body_sha, off, toks.astype(np.int32))


def decode(raw: bytes, *, fingerprint: str, layout: _state.Layout, start: int, end: int, token_hash: bytes,
           tokens: Sequence[int] | np.ndarray) -> Span:
    """The span in ``raw`` (a file's bytes), checked against what the caller expects: this model and
    cache layout, positions ``[start, end)``, the name's token hash, and ``tokens``: the prompt's
    tokens that the file's must begin with (``start < len(tokens) <= end``: the span is then cut
    there by the caller). InvalidInputError names the first field that disagrees."""
    h = parse_header(raw, fingerprint=fingerprint, start=start, end=end, token_hash_=token_hash, file_size=len(raw))
    body = memoryview(raw)[h.body_offset:]
    if hashlib.sha256(body).digest() != h.body_sha:
        raise InvalidInputError("the body's SHA-256 differs from the header's (corrupt)")
    k = len(tokens)
    if not start < k <= end or not np.array_equal(h.tokens[:k], np.asarray(tokens, dtype=np.int64)):
        raise InvalidInputError("the span's tokens differ from the prompt's")
    data = bytes(body[4 * end:])
    _state.parse(data, end - start, layout)   # exactly end - start cells of this layout, or InvalidInputError
    return Span(start, tuple(int(t) for t in h.tokens[start:end]), data, layout, fingerprint)


@dataclass(frozen=True)
class _Entry:
    """A span file in the directory, by its name (any model)."""

    name: str
    key: str
    start: int
    end: int
    token_hash: bytes
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class _File:
    """A file of this model in the index (its header checked)."""

    name: str
    start: int
    end: int
    token_hash: bytes
    size: int


class _INode(Node):
    """A node of the :class:`TokenIndex`: its items are files by name, ranked by their start."""

    __slots__ = ()

    @property
    def files(self) -> dict[str, _File]:
        return self.items

    @property
    def min_start(self) -> int:
        """The least start of the files in this subtree (``NO_RANK`` when none)."""
        return self.least


class TokenIndex(TokenTrie[str, _File]):
    """A token trie (:class:`~pyllama_kv.prefixcache.trie.TokenTrie`) of the tokens ``[0, end)`` of
    files: a file hangs at the node where its tokens end. A file shares with a prompt the tokens down
    to the deepest node on the prompt's path that is its ancestor (or down to where the prompt leaves
    the trie, for a file below that point); each node knows the least ``start`` of the files below
    it, so a lookup visits only subtrees with a file that can continue the sequence."""

    node_class = _INode

    def __init__(self) -> None:
        super().__init__(rank=lambda f: f.start)

    def files(self) -> Iterator[_File]:
        return self.values()

    def add(self, f: _File, tokens: np.ndarray) -> None:
        """Index ``f``, whose tokens of positions ``[0, f.end)`` are ``tokens``."""
        assert len(tokens) == f.end
        self.insert(f.name, f, tokens)

    def candidates(self, tokens: Sequence[int] | np.ndarray, pos: int, limit: int) -> list[tuple[int, _File]]:
        """The best files to continue a sequence holding ``tokens[:pos]``: ``(k, file)`` with
        ``file.start <= pos < k``, ``k`` = min(the tokens the file shares with ``tokens``,
        ``limit``): it serves positions ``[pos, k)``. Only the files of the longest ``k``, the
        smallest first (the least to read)."""
        out: list[tuple[int, _File]] = []
        done: Node | None = None   # the subtree already visited (files that share more)
        for m, shared in reversed(self.path(tokens)):
            k = min(shared, limit)
            if k <= pos or (out and k < out[0][0]):
                break
            if m.least <= pos:
                stack = [m]
                while stack:
                    x = stack.pop()
                    out.extend((k, f) for f in x.items.values() if f.start <= pos)
                    stack.extend(c for c in x.children.values() if c is not done and c.least <= pos)
            done = m
        out.sort(key=lambda x: (-x[0], x[1].end - x[1].start, x[1].name))
        return out


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
        self.index = TokenIndex()
        self._seen: int | None = None   # the directory's mtime when it was last read
        self._racy = True
        self._remove_stale_tmp()
        self._bound(newest=None)        # reads the directory (and the index) first

    # -- the directory ------------------------------------------------------------------------------

    def _list(self) -> list[_Entry]:
        """Every span file in the directory (any key), by name; [] when it cannot be read."""
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
        return out

    def _scan(self) -> list[_Entry]:
        """Read the directory: every span file in it (any key), the index brought up to date with
        this model's files (new ones' headers read and checked: a bad one is counted and deleted),
        the disk stats updated."""
        try:
            self._seen = os.stat(self.path).st_mtime_ns
            # a change in the same tick of the file system's clock would not change the mtime: a
            # listing read soon after the last change is read again next time (as git's racy index)
            self._racy = time.time_ns() - self._seen < _RACY_NS
        except OSError:
            self._seen = None
        entries = self._list()
        ours = {x.name: x for x in entries if x.key == self.key}
        for f in list(self.index.files()):
            if f.name not in ours:
                self.index.remove(f.name)
        bad = set()
        for name, x in ours.items():
            if name not in self.index and not self._index(x):
                bad.add(name)
        if bad:
            entries = [x for x in entries if x.name not in bad]
        self.stats.disk_files = len(entries)
        self.stats.disk_bytes = sum(x.size for x in entries)
        self._count_tokens()
        return entries

    def _count_tokens(self) -> None:
        self.stats.disk_tokens = sum(f.end - f.start for f in self.index.files())

    def _sync(self) -> None:
        """Read the directory again when it changed since it was last read (another process, or ours),
        or when it had changed less than a second before it was read."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return
        if mtime != self._seen or self._racy:
            self._scan()

    def _open(self, name: str) -> tuple[int, int] | None | bool:
        """``(fd, size)`` of a regular file of at most ``max_bytes`` under ``name``; None: gone (or
        unreadable); False: there, but not such a file."""
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(self.path / name, flags)
        except FileNotFoundError:
            return None
        except OSError:
            return False if (self.path / name).is_symlink() else None
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size > self.max_bytes:
            os.close(fd)
            return False
        return fd, st.st_size

    @staticmethod
    def _read_fd(fd: int, n: int) -> bytes:
        chunks, left = [], n
        while left > 0:
            b = os.read(fd, min(left, 1 << 24))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        return b"".join(chunks)

    def _index(self, x: _Entry) -> bool:
        """Read the header of our file ``x`` and index it; False when it was refused (counted,
        deleted) or is gone."""
        opened = self._open(x.name)
        if not isinstance(opened, tuple):
            if opened is False:
                self._refuse(x.name)
            return False
        fd, size = opened
        try:
            raw = self._read_fd(fd, min(size, _HEAD.size + _MAX_FP + _MID.size))
            need = header_size(raw)
            if need is not None and len(raw) < need <= size:
                raw += self._read_fd(fd, need - len(raw))
        except OSError:
            return False
        finally:
            os.close(fd)
        try:
            h = parse_header(raw, fingerprint=self.fingerprint, start=x.start, end=x.end, token_hash_=x.token_hash,
                             file_size=size)
        except InvalidInputError:
            self._refuse(x.name)
            return False
        self.index.add(_File(x.name, x.start, x.end, x.token_hash, size), h.tokens)
        return True

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
        self.index.remove(name)
        try:
            os.unlink(self.path / name)
        except OSError:
            pass

    def _refuse(self, name: str) -> None:
        """A file that failed a check: counted (a miss), deleted."""
        self.stats.disk_corrupt += 1
        self._unlink(name)

    def _touch(self, name: str) -> None:
        try:
            os.utime(self.path / name)   # recently used: the bound deletes it last
        except OSError:
            pass

    def _bound(self, newest: str | None) -> None:
        """Delete the least recently used span files (any process's, ``newest`` last) until the
        directory is within ``max_bytes``."""
        for _ in range(3):   # again if other processes wrote meanwhile
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

    def holdings(self):
        """``(tokens, start, end)`` for every file of this model in the index (as last read)."""
        for node, f in self.index.nodes_and_values():
            yield self.index.path_tokens(node), f.start, f.end

    # -- looking up ---------------------------------------------------------------------------------

    def covered(self, tokens: Sequence[int] | np.ndarray, pos: int, touch: bool = True, sync: bool = True) -> int:
        """How far files (by the index: unread) continue ``tokens`` from ``pos``, one after another;
        with ``touch``, those files are touched (recently used)."""
        if sync:
            self._sync()
        while pos < len(tokens):
            cands = self.index.candidates(tokens, pos, len(tokens))
            if not cands:
                break
            k, f = cands[0]
            if touch:
                self._touch(f.name)
            pos = k
        return pos

    # -- writing ------------------------------------------------------------------------------------

    def put(self, tokens: Sequence[int], span: Span) -> bool:
        """Write ``span`` (``tokens``: the tokens of positions [0, span.end), its prefix included),
        less what files hold already (stored once: the files that hold a part, whole or as a prefix
        of theirs, are touched instead). False when nothing was written (all there already, larger
        than the bound, another model or layout, or an OS error, counted in ``disk_write_errors``)."""
        if span.model != self.fingerprint or span.layout != self.layout or len(tokens) < span.end:
            return False
        arr = np.asarray(tokens[:span.end], dtype=np.int32)
        if not np.array_equal(arr[span.start:], np.asarray(span.tokens, dtype=np.int64)):
            return False
        have = self.covered(arr, span.start)
        if have >= span.end:
            return False
        if have > span.start:
            span = span.split(have)[1]
        raw, th = encode(span, arr)
        name = f"{self.key}-{span.start}-{span.end}-{th.hex()}{SUFFIX}"
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
        self.index.add(_File(name, span.start, span.end, th, len(raw)), arr)
        self.stats.disk_writes += 1
        self.stats.disk_written_bytes += len(raw)
        self._bound(newest=name)
        return True

    # -- reading ------------------------------------------------------------------------------------

    def _read(self, name: str) -> bytes | None | bool:
        """The bytes of a regular file of at most ``max_bytes``; None: gone; False: not such a file."""
        opened = self._open(name)
        if not isinstance(opened, tuple):
            return opened
        fd, size = opened
        try:
            return self._read_fd(fd, size)
        except OSError:
            return None
        finally:
            os.close(fd)

    def find(self, tokens: Sequence[int], pos: int, limit: int) -> tuple[Span, str] | None:
        """The longest stored span that goes on a sequence holding ``tokens[:pos]``: positions
        ``[pos, k)``, ``pos < k <= limit``, cut from a file that holds ``[start, end)``
        (``start <= pos``) and whose tokens begin with ``tokens[:k]``, with the file's name.
        Rejected files are counted, deleted and skipped; files gone meanwhile (another process)
        are skipped. None: a miss."""
        if pos >= limit:
            return None
        self._sync()
        while True:
            cands = self.index.candidates(tokens, pos, limit)
            if not cands:
                return None
            k, x = cands[0]
            raw = self._read(x.name)
            if raw is None:
                self.index.remove(x.name)
                self._count_tokens()
                continue
            if raw is False:
                self._refuse(x.name)
                self._scan()
                continue
            assert isinstance(raw, bytes)
            try:
                span = decode(raw, fingerprint=self.fingerprint, layout=self.layout, start=x.start, end=x.end,
                              token_hash=x.token_hash, tokens=tokens[:k])
            except InvalidInputError:
                self._refuse(x.name)
                self._scan()
                continue
            self._touch(x.name)
            if span.start < pos:
                span = span.split(pos)[1]
            if span.end > k:
                span = span.split(k)[0]
            return span, x.name

    def reject(self, name: str) -> None:
        """The file of a span that the context refused after all (counted, deleted)."""
        self._refuse(name)
        self._scan()
