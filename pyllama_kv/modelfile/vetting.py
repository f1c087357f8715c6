"""Vetting: a GGUF model of any architecture is run in a child process before this process loads it.

A GGUF file is untrusted input, and the pinned llama.cpp (8733e0c) asserts on much of what a file
says. For dense ``llama`` models, :mod:`pyllama_kv.modelfile.validate` knows every key and tensor the
loader and graph read and refuses a lying file statically. The other ~80 architectures the pinned
llama.cpp implements have their own keys, tensors and graphs; writing a static validator for each
would be a second llama.cpp. So for them, after the generic structural checks (header, key types,
tensor table, offsets and sizes inside the file, tensor types ggml knows, the vocabulary), a child
process does what this process is about to do, stage by stage:

====================  ==============================================================================
stage                 what the child does (the same library, ``n_gpu_layers`` and ``use_mmap``)
====================  ==============================================================================
load                  ``llama_model_load_from_file``
context               a context of :data:`VET_CTX` cells and 2 sequences (f16 cache, one thread)
tokenize              tokenize and detokenize a short text (the vocabulary at work)
decode batch          one ``llama_decode`` of a multi-token batch
decode token          one more single token
fork                  a prefix copy of the sequence, and one token decoded for both sequences at once
k-shift               drop tokens in the middle and K-shift the tail (where the cache can shift; a
                      cache that cannot is recorded, not an error)
defrag                a full defragmentation of the cache
state                 a sequence's state exported and imported into a new sequence (round trip;
                      where the library has sequence states: not on the current llama.cpp)
====================  ==============================================================================

A signal or abort in the child (SIGABRT from GGML_ASSERT, SIGSEGV, SIGFPE, ...) becomes a
:class:`~pyllama_kv.errors.ModelLoadError` naming the file, the stage and the signal, and this
process never hands the file to llama.cpp. A child that runs past :data:`VET_TIMEOUT` seconds is
killed and refused the same way.

**One file, one identity.** The caller opens the file once; the static checks, the hash, the
vetting child and this process's own load all read that open file (the child inherits the
descriptor and loads ``/proc/self/fd/N``), so a file swapped in at the path after the hash is never
what gets loaded. (A process that can write into the model file itself can change it under any
reader, mmap'ed weights included: that is outside what a loader can guard.)

The verdict is cached under ``<cache>/vetted/``, keyed by the file's sha256 (computed once and
remembered by :mod:`pyllama_kv.modelfile.filehash` under its inode, size, mtime and ctime), the library's
(a rebuilt library vets again), the options that change what runs (``n_gpu_layers``, ``use_mmap``)
and :data:`VET_VERSION` (a changed vetting procedure vets again). A later load of the same bytes costs
a ``stat`` and one small JSON read. Only deterministic verdicts are cached: a pass, a crash signal
(SIGABRT, SIGSEGV, SIGFPE, SIGBUS, SIGILL) and llama.cpp's own refusal to load; a child killed from
outside (SIGKILL, say, by the OOM killer), a timeout or a failure of the child's Python is not, and
the next load vets again.

What vetting does *not* prove: that another context shape (a much larger ``n_ctx``, a quantized
cache, flash attention, more sequences or threads, a batch large enough to move work to a GPU) or a
prompt the child did not try runs without abort. It catches the file-level lies (a missing tensor, a
wrong shape, a bad hyperparameter) that abort at load, at graph build or at the first decodes,
which is where a lying file strikes.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import _paths
from ..errors import InvalidInputError, ModelLoadError
from . import filehash as _filehash

#: the levels of ``Model(..., validate=...)`` and ``--validate``; True means "full", False "off"
VALIDATE_LEVELS = ("full", "static", "off")
VALIDATE_HELP = {
    "full": "refuse files that would crash llama.cpp: dense llama models are checked statically "
            "(every key, tensor and vocabulary field the loader asserts on), every other architecture "
            "gets the generic checks and then a vetting run in a child process (load, decode, fork, "
            "K-shift, defrag, state round trip; the verdict is cached by the file's sha256)",
    "static": "the static checks only (for a llama model, the same guarantee as full; for another "
              "architecture only the header, tensor table and vocabulary: a lying file can still abort)",
    "off": "no checks: llama.cpp reads the file as it is (a bad file can abort the process)",
}
DEFAULT_VALIDATE = "full"

#: seconds a vetting child may take (loading a large model from a cold disk is the slow part)
VET_TIMEOUT = 600.0
#: cells of the vetting child's context (at most the model's n_ctx_train)
VET_CTX = 128
#: the vetting procedure's version: part of the verdict cache key, raised when the child changes
VET_VERSION = 2
#: the signals a file can cause (llama.cpp's asserts and bad memory accesses): such a verdict is cached
_FILE_SIGNALS = frozenset((signal.SIGABRT, signal.SIGSEGV, signal.SIGFPE, signal.SIGBUS, signal.SIGILL))
#: the text the vetting child tokenizes
_VET_TEXT = "Vetting run: the quick brown fox jumps over the lazy dog. 12345 ++ <|x|> \u00e9\u4e2d\U0001f600"

STAGES = ("load", "context", "tokenize", "decode batch", "decode token", "fork", "k-shift", "defrag",
          "state")


def validate_level(value) -> str:
    """``value`` (True, False, "full", "static" or "off") as one of :data:`VALIDATE_LEVELS`."""
    if value is True:
        return "full"
    if value is False:
        return "off"
    if isinstance(value, str) and value in VALIDATE_LEVELS:
        return value
    raise InvalidInputError(f"validate must be one of {', '.join(map(repr, VALIDATE_LEVELS))} (or True/False), "
                            f"got {value!r}")


@dataclass(frozen=True)
class Verdict:
    """What a vetting run found: ``ok``, the ``stage`` that failed and why (``error``), whether the
    cache could K-shift, the seconds the run took, and whether this verdict came from the cache."""

    ok: bool
    error: str | None = None
    stage: str | None = None
    can_shift: bool | None = None
    seconds: float = 0.0
    cached: bool = False
    #: whether the same file would give the same verdict again (what is cached)
    deterministic: bool = True


def _vet_dir() -> Path:
    return _paths.cache_dir() / "vetted"


def _verdict_path(file_sha: str, lib_sha: str, n_gpu_layers: int, use_mmap: bool) -> Path:
    return _vet_dir() / f"v{VET_VERSION}-{file_sha[:32]}-{lib_sha[:16]}-ngl{n_gpu_layers}-mmap{int(use_mmap)}.json"


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def cached_verdict(path: str | os.PathLike, lib_path: str | os.PathLike, n_gpu_layers: int = 0,
                   use_mmap: bool = True) -> Verdict | None:
    """The cached verdict for this file on this library, or None (never vetted, the file changed
    since it was hashed, or it was never hashed: this reads no file, only the caches)."""
    file_sha, lib_sha = _filehash.cached_sha256(path), _filehash.cached_sha256(lib_path)
    if file_sha is None or lib_sha is None:
        return None
    return _read_verdict(_verdict_path(file_sha, lib_sha, n_gpu_layers, use_mmap))


def _read_verdict(vp: Path) -> Verdict | None:
    """The verdict stored at ``vp`` (None: none, or not readable as one)."""
    try:
        return Verdict(**{**json.loads(vp.read_text()), "cached": True})
    except (OSError, ValueError, TypeError):
        return None


def _store(vp: Path, verdict: Verdict) -> None:
    # a read-only cache: vet again next time
    _filehash.save_json(vp, {k: v for k, v in asdict(verdict).items() if k not in ("cached", "deterministic")})


def fd_path(fd: int) -> str:
    """A path that opens the file open as ``fd`` in this process (and in a child it is passed to)."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


def open_model_file(path: Path) -> int:
    """``path`` opened for reading: the one open file that validation, vetting and llama.cpp's load
    all read (through :func:`fd_path`), so that a file swapped in at the path
    meanwhile is never what gets loaded. ModelLoadError naming the path. (Standard library only: the
    CLI calls it before it imports the model's modules, so that a missing file is reported fast.)"""
    try:
        # O_NONBLOCK: a FIFO put at the path after it was checked never blocks the open
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: no such file") from None
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot open: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ModelLoadError(f"{path}: not a file")
    return fd


def vet(path: str | os.PathLike, lib_path: str | os.PathLike, n_gpu_layers: int = 0, use_mmap: bool = True,
        timeout: float | None = None, fd: int | None = None) -> Verdict:
    """Vet ``path`` on the library at ``lib_path`` (see the module docstring): the cached verdict if
    there is one, else a vetting run in a child process, cached when deterministic. With ``fd`` (the
    file opened by the caller, which then loads it through :func:`fd_path`), the open file is hashed
    and vetted, whatever ``path`` names by then. Returns the verdict; raises ModelLoadError (one line,
    naming the stage, and the signal if one killed the child) when it is a refusal."""
    path = Path(path)
    timeout = VET_TIMEOUT if timeout is None else timeout
    try:
        file_sha = _filehash.file_sha256(path, fd)
        lib_sha = _filehash.file_sha256(lib_path)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc.strerror or exc}") from None
    vp = _verdict_path(file_sha, lib_sha, n_gpu_layers, use_mmap)
    verdict = _read_verdict(vp)
    if verdict is None:
        verdict = _run_child(path, lib_path, n_gpu_layers, use_mmap, timeout, fd)
        if verdict.deterministic:
            _store(vp, verdict)
    if not verdict.ok:
        why = " ".join(f"refused by vetting at stage '{verdict.stage}': {verdict.error}".split())
        raise ModelLoadError(f"{path}: {why}")
    return verdict


#: the module a vetting run starts in its child process (by name: the child loads a Model, which the
#: model-file layer does not import)
CHILD = "pyllama_kv.core.vetting_child"


def _run_child(path: Path, lib_path: str | os.PathLike, n_gpu_layers: int, use_mmap: bool,
               timeout: float, fd: int | None = None) -> Verdict:
    cmd = [sys.executable, "-m", CHILD, "--lib", os.fspath(lib_path), "--n-gpu-layers",
           str(n_gpu_layers), "--mmap", str(int(use_mmap)), fd_path(fd) if fd is not None else os.fspath(path)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL, timeout=timeout,
                              start_new_session=True, pass_fds=(fd,) if fd is not None else ())
    except subprocess.TimeoutExpired as exc:
        stage, _ = _read_child(exc.stdout)
        return Verdict(False, f"the vetting run took longer than {timeout:g}s (at stage '{stage}')", "timeout",
                       seconds=time.perf_counter() - t0, deterministic=False)
    seconds = time.perf_counter() - t0
    stage, result = _read_child(proc.stdout)
    if proc.returncode < 0:
        crash = -proc.returncode in {int(s) for s in _FILE_SIGNALS} and stage != "start"
        who = "llama.cpp was" if crash else "the vetting child was"
        return Verdict(False, f"{who} killed by {_signal_name(proc.returncode)} ({_last_error_line(proc.stderr)})",
                       stage, seconds=seconds, deterministic=crash)
    if result.get("ok"):
        return Verdict(True, None, None, bool(result.get("can_shift")), seconds)
    error = result.get("error") or f"the vetting run exited with status {proc.returncode} " \
                                   f"({_last_error_line(proc.stderr)})"
    # llama.cpp's own refusal to load is the file's; any other failure (memory, the child's Python)
    # may not come back: vet again next time
    return Verdict(False, str(error), stage, seconds=seconds,
                   deterministic=stage == "load" and str(error).startswith("ModelLoadError"))


def _read_child(stdout: bytes | None) -> tuple[str, dict]:
    """The last stage the child started ("start" before the first) and its result line ({} if none)."""
    stage, result = "start", {}
    for line in (stdout or b"").decode("utf-8", "replace").splitlines():
        if line.startswith("stage "):
            stage = line[6:]
        elif line.startswith("{"):
            with contextlib.suppress(ValueError):
                result = json.loads(line)
    return stage, result


def _last_error_line(stderr: bytes) -> str:
    """The most telling line of llama.cpp's stderr: the last GGML_ASSERT/abort/error line, else the last."""
    lines = [ln.strip() for ln in stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if any(w in ln for w in ("GGML_ASSERT", "error", "Error", "abort", "exception")):
            return ln[-300:]
    return lines[-1][-300:] if lines else "nothing on stderr"
