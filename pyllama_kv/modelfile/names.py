"""A MODEL argument as a GGUF file: the one resolver behind every command and ``pk.Model(...)``.

In order: an existing file (the parts of a split model, ``NAME-00001-of-0000N.gguf``, merged once
into one file: :func:`.ggufsplit.merged`); a catalogue name (:mod:`.catalogue`); ``ollama:NAME`` and
``lmstudio:PATH`` (:mod:`.local`: read in place); a Hugging Face name (:mod:`.hub`: ``hf:`` and the
rules of :func:`.hub.parse`); anything else is a path, as given (loading says "no such file").

A path that exists must be a regular file (``os.stat``, links followed): a loop of links, a directory,
a FIFO (whose open would block for ever), a device or a socket is one ModelLoadError here, before any
command or ``pk.Model`` opens it.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from ..errors import ModelLoadError
from . import catalogue, hub, local
from .download import Log, stderr_log
from .ggufsplit import merged, part_name, split_name

__all__ = ["resolve"]


def _split_parts(p: Path) -> list[Path] | None:
    """The parts of the split model whose part ``p`` is, when every one is beside it."""
    s = split_name(p.name)
    if s is None or s[2] == 1:
        return None
    parts = [p.with_name(part_name(s[0], i, s[2])) for i in range(1, s[2] + 1)]
    return parts if all(q.is_file() for q in parts) else None


def _existing(p: Path) -> os.stat_result | None:
    """``os.stat(p)``, or None when nothing is there (then ``p`` may be a name). ModelLoadError for a
    path that is there but cannot be followed or read (a loop of links, a permission)."""
    try:
        return os.stat(p)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise ModelLoadError(f"{p}: cannot be read: {exc.strerror or exc}") from None
    except ValueError:
        raise ModelLoadError("the model path contains a NUL byte") from None


def resolve(spec: str | os.PathLike, log: Log = stderr_log, *, trust_unverified: bool = False) -> Path:
    """``spec`` (a MODEL argument) as the path of one GGUF file, a regular file when it exists (see
    the module docstring). Raises a ModelLoadError subclass (one line) for a name that cannot be
    found, fetched or verified. ``trust_unverified``: a Hugging Face file the hub cannot vouch for
    is loaded (:func:`.hub.verify`), not refused."""
    p = Path(spec)
    st = _existing(p)
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise ModelLoadError(f"{p} is {local.file_kind(st.st_mode)}, not a GGUF file")
        parts = _split_parts(p)
        return merged(parts, log) if parts else p
    s = os.fspath(spec)
    if not isinstance(s, str):
        return p
    if s in catalogue.entries():
        return catalogue.resolve(s, log=log)
    if s.startswith("ollama:"):
        return local.resolve_ollama(s[len("ollama:"):])
    if s.startswith("lmstudio:"):
        return merged(local.resolve_lmstudio(s[len("lmstudio:"):]), log)
    name = hub.parse(s[len("hf:"):], explicit=True) if s.startswith("hf:") else hub.parse(s)
    if name is not None:
        try:
            return hub.fetch(name, log, trust_unverified=trust_unverified)
        except hub.HubError as exc:   # it may have been meant as a path
            raise hub.HubError(str(exc) if s.startswith("hf:") else f"{s}: no such file; as a Hugging Face name: "
                               f"{exc}") from None
    if s.startswith("hf:"):
        raise hub.HubError(f"{s!r} is not a Hugging Face model name (hf:OWNER/REPO[@REVISION][:QUANT] or "
                           "hf:OWNER/REPO[@REVISION]/FILE.gguf)")
    if catalogue.looks_like_path(s):
        return p
    raise catalogue.CatalogueError(
        f"{s}: no such file, and not a model name in the catalogue (known: {', '.join(catalogue.names()) or 'none'}), "
        "nor OWNER/REPO[:QUANT] on Hugging Face, ollama:NAME or lmstudio:PATH (`pyllama-kv models --local`)")
