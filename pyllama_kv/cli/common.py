"""What every command shares: the user-facing error, the phase that Ctrl-C reports, argument checks,
and opening a model."""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130       # 128 + SIGINT
EXIT_BROKEN_PIPE = 141       # 128 + SIGPIPE


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code EXIT_ERROR."""


# what the command is doing, for the line main() prints when Ctrl-C stops it there
_phase: str | None = None


def set_phase(what: str | None) -> None:
    global _phase
    _phase = what


def phase() -> str | None:
    return _phase


def setup_logging(debug: bool) -> None:
    if debug:
        import logging

        logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s", stream=sys.stderr)


def positive(name: str, v: int | None, minimum: int = 1) -> None:
    if v is not None and v < minimum:
        raise CLIError(f"{name} must be at least {minimum}, got {v}")


def resolve_model(spec: str):
    """A MODEL argument as a path: a catalogue name becomes its cached GGUF (pulled on first use)."""
    from ..catalogue import resolve

    return resolve(spec)


def open_model(path: str, lib: str | None, rpc: list[str] | None = None, validate: str | None = None):
    """The model at ``path`` on library ``lib``; with ``rpc`` (the --rpc endpoints), every layer runs
    on those rpc-server processes; ``validate`` is the --validate level (None: the default)."""
    from .. import Model
    from ..vetting import DEFAULT_VALIDATE

    return Model(path, lib=lib, rpc=rpc, validate=validate or DEFAULT_VALIDATE)


def check_ctx(model, n_ctx: int | None, flag: str = "--ctx") -> None:
    if n_ctx and n_ctx > model.n_ctx_train:
        raise CLIError(f"{flag} {n_ctx} is larger than the model supports (n_ctx_train {model.n_ctx_train})")


def check_output_file(out: str, what: str) -> Path:
    """``out`` as a file path to write, or CLIError: not a directory, and its directory must exist
    (nothing is created silently) and be writable."""
    path = Path(out)
    if not out:
        raise CLIError(f"an empty path: give the path of the file to write {what} to")
    if path.is_dir() or out.endswith(("/", os.sep)):
        raise CLIError(f"{out} is a directory: give the path of the file to write {what} to")
    parent = path.parent
    if not parent.exists():
        raise CLIError(f"cannot write {out}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise CLIError(f"cannot write {out}: {parent} is not a directory")
    try:  # really try (os.access says yes to root on a read-only file system)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise CLIError(f"cannot write {out}: {exc.strerror or exc}") from None
    return path
