"""A file's content hash, computed once: the one identity that verdicts about a file are keyed by.

Hashing a GGUF of hundreds of MiB costs about a second per GiB here, so the sha256 of a file is
remembered in ``<cache>/hashes.json`` under its *quick key* — the resolved path, device, inode, size,
mtime and ctime (ns). A file whose quick key changed (rewritten, touched, replaced, truncated,
renamed, chmod-ed) is hashed again; one whose key is unchanged is trusted to be the same bytes. The
ctime is what makes this stronger than the usual trade of ``make`` and rsync: an edit that restores
size and mtime by hand (``touch -d``, ``os.utime``) on the same inode still moves the ctime, which
no call can set back; only writing the disk under the file system (or setting the clock back) is
not seen. The catalogue (is a cached model the pinned bytes?) and model vetting (was this file
vetted before?) both use it.

The index is a small JSON file rewritten atomically; a corrupt or unreadable index is treated as
empty (everything is hashed again), never as an error. Entries for files that no longer exist are
dropped when the index is written.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

from .. import _paths

_lock = threading.Lock()
#: entries kept in the index at most (the oldest go first)
MAX_ENTRIES = 512


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of ``path``'s bytes, read in 1 MiB chunks (no cache)."""
    with open(path, "rb") as f:
        return sha256_fd(f.fileno())


def sha256_fd(fd: int) -> str:
    """The sha256 of the bytes of the open file ``fd`` (read with pread from offset 0: the
    descriptor's own offset is left alone)."""
    h = hashlib.sha256()
    off = 0
    while True:
        chunk = os.pread(fd, 1 << 20, off)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)
        off += len(chunk)


def quick_key(path: str | os.PathLike, fd: int | None = None) -> str:
    """Resolved path, device, inode, size, mtime and ctime: what says "the same file, unchanged"
    without reading it (OSError if it cannot be stat'ed). With ``fd`` (``path`` opened), the
    identity is the open file's (fstat), whatever ``path`` names now."""
    p = Path(path).resolve()
    st = os.fstat(fd) if fd is not None else p.stat()
    return f"{p}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def _index_path() -> Path:
    return _paths.cache_dir() / "hashes.json"


def _load() -> dict[str, str]:
    try:
        data = json.loads(_index_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str) and len(v) == 64}


def _key_path(key: str) -> str:
    """The path of a quick key (a path may itself hold '|': the five fields after it cannot)."""
    return key.rsplit("|", 5)[0]


def save_json(path: Path, obj) -> bool:
    """Write ``obj`` as JSON to the cache file ``path`` atomically (a temporary file beside it, renamed
    into place). Best effort: False when the cache is read-only or full, and no temporary file is
    left behind; a reader then finds the old file or none, never a torn one."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
        return True
    except OSError:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        return False


def _store(index: dict[str, str]) -> None:
    index = {k: v for k, v in index.items() if os.path.exists(_key_path(k))}
    if len(index) > MAX_ENTRIES:
        index = dict(list(index.items())[-MAX_ENTRIES:])
    save_json(_index_path(), index)   # a read-only or full cache: hash again next time


def cached_sha256(path: str | os.PathLike) -> str | None:
    """The remembered sha256 of ``path`` if its quick key is unchanged since it was hashed, else None."""
    try:
        key = quick_key(path)
    except OSError:
        return None
    with _lock:
        return _load().get(key)


def file_sha256(path: str | os.PathLike, fd: int | None = None) -> str:
    """The sha256 of ``path``: remembered if the file is unchanged (quick key), else computed and
    remembered. With ``fd`` (``path`` opened), of the open file's bytes, read through ``fd``: what
    the caller then hands on by that descriptor is what was hashed, even if ``path`` was replaced
    meanwhile. OSError if the file cannot be read."""
    key = quick_key(path, fd)
    with _lock:
        got = _load().get(key)
    if got is not None:
        return got
    digest = sha256_fd(fd) if fd is not None else sha256_file(path)
    if quick_key(path, fd) != key:   # changed while it was read: do not remember a torn hash
        return digest
    with _lock:
        index = _load()
        index.pop(key, None)
        index[key] = digest
        _store(index)
    return digest


def remember(path: str | os.PathLike, digest: str) -> None:
    """Record that ``path``, as it is now, has the sha256 ``digest`` — for a file whose bytes were
    hashed while it was written (a verified download renamed into place), so that its first use
    need not read it again. Nothing is recorded if it cannot be stat'ed."""
    try:
        key = quick_key(path)
    except OSError:
        return
    with _lock:
        index = _load()
        index.pop(key, None)
        index[key] = digest
        _store(index)


def forget(path: str | os.PathLike) -> None:
    """Drop what is remembered of ``path`` (whatever its quick key)."""
    p = str(Path(path).resolve())
    with _lock:
        index = _load()
        kept = {k: v for k, v in index.items() if _key_path(k) != p}
        if len(kept) != len(index):
            _store(kept)
