"""The strongest peer, built apart: the *current* llama.cpp's ``llama-server`` (``pyllama-kv build --peer``).

Serving and caching claims are measured against the newest llama.cpp the package index carries, not
only the one at our pin. That is our second pin, ``current`` (``vendor/current.pin.json``: the newest
llama-cpp-python sdist with its sha256 and a fingerprint of the tree; one pin file for both uses). The
peer is built from the same unpacked tree, ``vendor/llama.cpp-current`` (``pyllama-kv vendor --pin
current``, run here when it is missing: fetched with pip, hash-checked, cached in
``~/.cache/pyllama-kv/downloads``), but never patched: while the tree holds none of the current pin's
series (``patches/current/``) it is used as it is; once it holds some, a copy with the series reversed
in ``~/.cache/pyllama-kv/peer/<revision>/src`` is. Only ``llama-server`` and ``llama-batched-bench``
(the C++ side of ``scripts/bench_binding.py --lib current``, a few seconds more) are built, in
``~/.cache/pyllama-kv/peer/<revision>/build``, statically linked (``BUILD_SHARED_LIBS=OFF``: it never
loads our libllama), CPU only, no OpenSSL, with ggml's default CPU flags (as our builds). Its flags are
those it was measured with (a change would rebuild every peer build made so far: 18 minutes);
``build.PIN_FLAGS["current"]`` turns off the app binary and the web UI download as well.

The result is recorded in ``~/.cache/pyllama-kv/peer/<revision>/manifest.json`` (pin, sha256, flags,
binary paths) and reused while the pin and flags are the same and both binaries are there, so a second
``make`` or benchmark run builds nothing (a peer built before ``llama-batched-bench`` was a target
builds just that, in the same build directory). Benchmarks find them with :func:`find_peer_server`
and :func:`find_peer_batched_bench`. The runtime never imports this.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from .. import _paths
from ..errors import HarnessError
from ..modelfile.download import Log, stderr_log as _stderr
from . import patch as _patch, vendor as _vendor
from .build import _run_logged

PIN = "current"

TARGET = "llama-server"
BATCHED_BENCH = "llama-batched-bench"   # bench_binding.py's C++ reference on the current pin
TARGETS = (TARGET, BATCHED_BENCH)
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
]


class PeerError(HarnessError):
    """The peer's source could not be had or built; the message says why."""


def peer_pin_path(root: Path | None = None) -> Path:
    """The current pin's file (the peer has no pin of its own)."""
    root = root or _paths.checkout_root()
    if root is None:
        raise PeerError("the peer build is a benchmark tool of a checkout: run it from a clone of pyllama_kv")
    return _paths.pin_path(root, PIN)


def peer_dir(pin: _vendor.Pin) -> Path:
    return _paths.cache_dir() / "peer" / pin.revision


def _manifest_path(pin: _vendor.Pin) -> Path:
    return peer_dir(pin) / "manifest.json"


def read_manifest(root: Path | None = None) -> dict | None:
    """The peer build's manifest, if it is built for the current pin and flags and its binaries exist."""
    try:
        pin = _vendor.Pin.load(peer_pin_path(root), name=PIN)
        m = json.loads(_manifest_path(pin).read_text())
    except (OSError, ValueError, HarnessError):
        return None
    ok = (m.get("sha256") == pin.sha256 and m.get("cmake_flags") == CMAKE_FLAGS
          and Path(m.get("server", "")).is_file() and Path(m.get("batched_bench", "")).is_file())
    return m if ok else None


def find_peer_server(root: Path | None = None) -> Path | None:
    """The current llama-server's path, or None when ``pyllama-kv build --peer`` has not built it."""
    m = read_manifest(root)
    return Path(m["server"]) if m else None


def find_peer_batched_bench(root: Path | None = None) -> Path | None:
    """The current llama-batched-bench's path, or None when ``pyllama-kv build --peer`` has not built it."""
    m = read_manifest(root)
    return Path(m["batched_bench"]) if m else None


def build_peer(jobs: int | None = None, force: bool = False, root: Path | None = None, log: Log = _stderr) -> dict:
    """Fetch, verify, unpack and build the peer's llama-server and llama-batched-bench (reused when up to
    date); its manifest."""
    pin = _vendor.Pin.load(peer_pin_path(root), name=PIN)
    if not force:
        m = read_manifest(root)
        if m is not None:
            log(f"peer llama-server and llama-batched-bench ({pin.package}=={pin.version}, "
                f"llama.cpp {pin.revision}): up to date")
            return m
    if not shutil.which("cmake"):
        raise PeerError("cmake was not found on PATH: install CMake 3.14 or newer (e.g. `pip install cmake`)")
    base = peer_dir(pin)
    src, bdir = _pristine_tree(pin, root, log), base / "build"
    if _configured_from(bdir) not in (None, src.resolve()):
        shutil.rmtree(bdir)  # configured from another tree (the cache's own copy before the pins were one)
    t0 = time.monotonic()
    base.mkdir(parents=True, exist_ok=True)
    log_path = base / "build.log"
    jobs = jobs or os.cpu_count() or 2
    log(f"building the peer's {' and '.join(TARGETS)} (llama.cpp {pin.revision}, {pin.package}=={pin.version}) "
        f"with {jobs} job(s); log: {log_path}")
    with open(log_path, "w") as lf:
        for cmd, progress in ((["cmake", "-S", str(src), "-B", str(bdir), *CMAKE_FLAGS], False),
                              (["cmake", "--build", str(bdir), "--config", "Release", "-j", str(jobs),
                                "--target", *TARGETS], True)):
            # build's runner: the log file, and progress for the long part (about 18 minutes on 2 cores)
            rc = _run_logged(cmd, lf, "peer", log, progress=progress)
            if rc != 0:
                tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
                raise PeerError(f"the peer build failed (exit {rc}); last lines of {log_path}:\n{tail}")
    server, batched = bdir / "bin" / TARGET, bdir / "bin" / BATCHED_BENCH
    for exe in (server, batched):
        if not exe.is_file():
            raise PeerError(f"the peer build finished but {exe} is missing")
    manifest = {
        "project": "llama.cpp", "pin": PIN, "revision": pin.revision, "source_dir": str(src.resolve()),
        "package": pin.package, "version": pin.version,
        "sha256": pin.sha256, "fingerprint": pin.fingerprint_sha256, "cmake_flags": CMAKE_FLAGS,
        "server": str(server.resolve()), "batched_bench": str(batched.resolve()),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.monotonic() - t0, 1), "log": str(log_path),
    }
    _manifest_path(pin).write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"peer llama-server and llama-batched-bench built in {manifest['build_seconds']}s: {server}, {batched}")
    return manifest


def _pristine_tree(pin: _vendor.Pin, root: Path | None, log: Log) -> Path:
    """The current pin's tree without any of its series: ``vendor/llama.cpp-current`` itself (vendored
    first if missing), or a copy with the series reversed when the tree holds some of it."""
    root = root or _paths.checkout_root()
    vdir = _paths.vendor_dir(root, PIN)
    if (_vendor.read_marker(vdir) or {}).get("revision") != pin.revision:
        _vendor.vendor(root=root, log=log, pin_name=PIN)
    series = _patch.series(_paths.patches_dir(root, PIN))
    st = _patch.state(vdir, series)
    if st.conflict is None and st.n_applied == 0:
        return vdir
    copy = peer_dir(pin) / "src"
    if copy.exists():
        shutil.rmtree(copy)
    log(f"{vdir} holds patches of the current pin: building the peer from an unpatched copy in {copy}")
    # the top level's models (vocabulary files) and docs are not needed; src/models and tools/mtmd/models
    # are source code: only the top level's are left out
    top = vdir.resolve()
    shutil.copytree(vdir, copy, symlinks=True,
                    ignore=lambda d, names: [n for n in names if Path(d).resolve() == top and n in _NOT_COPIED])
    _patch.reverse(copy, series)
    return copy


#: what the peer's unpatched copy of the tree leaves out, at its top level only
_NOT_COPIED = ("models", "docs", ".git")


def _configured_from(bdir: Path) -> Path | None:
    """The source directory a CMake build directory was configured from (None: not configured)."""
    try:
        text = (bdir / "CMakeCache.txt").read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("CMAKE_HOME_DIRECTORY:INTERNAL="):
            return Path(line.split("=", 1)[1]).resolve()
    return None
