"""Build libllama from a vendored tree with CMake (`pyllama-kv build`), and report builds.

Three variants over two pins (``VARIANT_PIN``):

* ``patched`` (default): the mission pin's ``vendor/llama.cpp`` with our series applied (applied here
  if needed);
* ``vanilla``: a copy of that tree with the series reversed, in ``build/src-vanilla/``, for
  side-by-side comparisons;
* ``current`` (``--pin current``): the current llama.cpp's ``vendor/llama.cpp-current`` with its own
  series (``patches/current/``, possibly empty) applied. Its CMake options differ from the mission
  pin's (``cmake_flags(pin=...)``): no curl option any more, no OpenSSL, no unified app binary, no web
  UI download; its RPC server is ``ggml-rpc-server``.

``--rpc`` turns on ggml's RPC backend (``-DGGML_RPC=ON``: layers offloaded to ``rpc-server``
processes on other machines, ``pk.Model(path, rpc=[...])``) and builds ``rpc-server`` itself; the
manifest says ``"rpc": true``. A later build that does not say ``--rpc`` or ``--no-rpc`` keeps what
the existing build has, and switching it is a reconfigure in place, not a rebuild.

Each build lives in ``build/<variant>-<backend>/`` with ``manifest.json`` (pin, revision, patch names
and sha256, backend, CMake flags, time, library path) and ``build.log``. A build whose manifest does not
match what would be built now (a patch changed, other flags) is stale and is rebuilt.

``find_builds()`` only reads manifests: the Python API uses it to locate a library without running
anything.
"""
from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .. import _paths
from .._native.locate import (  # noqa: F401  (find_builds, lib_name: re-exported)
    find_builds,
    lib_name,
    manifest_pin,
    read_manifest,
    registry_dir,
)
from ..errors import BuildError, HarnessError  # noqa: F401  (BuildError: re-exported)
from ..modelfile.download import Log, stderr_log as _stderr
from . import patch as _patch, vendor as _vendor

VARIANTS = ("patched", "vanilla", "current")
# the pin each variant is built from (_paths.PINS)
VARIANT_PIN = {"patched": "mission", "vanilla": "mission", "current": "current"}
BACKENDS = ("cpu", "cuda", "metal")
# llama.cpp's own programs that `build --tools` adds, for the benchmarks: llama-batched-bench
# (scripts/bench_binding.py) and llama-server (scripts/bench_server.py; plain HTTP, no curl, no SSL)
TOOLS = ("llama-batched-bench", "llama-server", "llama-gguf-split")
# ggml's RPC server (tools/rpc at the pin), built with the RPC backend (--rpc); the current pin names
# its target ggml-rpc-server
RPC_SERVER = "rpc-server"
RPC_SERVERS = {"mission": RPC_SERVER, "current": "ggml-rpc-server"}


def variant_pin(variant: str) -> str:
    """The pin a variant is built from: "mission" (patched, vanilla) or "current"."""
    try:
        return VARIANT_PIN[variant]
    except KeyError:
        raise BuildError(f"unknown variant {variant!r}: choose one of {', '.join(VARIANTS)}") from None


def default_backend() -> str:
    return "metal" if platform.system() == "Darwin" else "cpu"


def build_dir(variant: str, backend: str, root: Path | None = None) -> Path:
    return _paths.build_root(root) / f"{variant}-{backend}"


# ---------------------------------------------------------------------------------------------
# CMake flags per backend


def _find_cuda(fetch_cublas: bool = False, log: Log = _stderr) -> dict:
    """nvcc and cuBLAS, or a toolkit overlay with cuBLAS from PyPI (see pyllama_kv.harness.cuda)."""
    from . import cuda

    return cuda.find_toolkit(fetch=fetch_cublas, log=log)


# the options of the llama.cpp CMake project per pin; tools are configured always and built only on
# request (--tools), so that asking for them adds a target instead of changing the configuration of an
# existing build
PIN_FLAGS = {
    "mission": [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_COMMON=ON",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",
    ],
    # the current llama.cpp: LLAMA_CURL is gone (deprecated, ignored); common's HTTP client would look for
    # OpenSSL (LLAMA_OPENSSL); a standalone build adds the unified `llama` app (LLAMA_BUILD_APP); and
    # llama-server's web UI would be downloaded from a Hugging Face bucket at build time
    # (LLAMA_USE_PREBUILT_UI): all off. GGML_NATIVE stays at its default (on), as for the mission pin.
    "current": [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        "-DLLAMA_BUILD_COMMON=ON",
        "-DLLAMA_BUILD_TOOLS=ON",
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
    ],
}


def cmake_flags(backend: str, tools: bool = False, cuda_arch: str | None = None,
                extra: list[str] | None = None, rpc: bool | None = None, cuda_info: dict | None = None,
                pin: str = "mission") -> list[str]:
    """The CMake flags of a build of ``pin``. ``rpc``: -DGGML_RPC=ON (True), =OFF (False), or not given
    (None: CMake's default, off), so that builds made before the option existed stay up to date.
    ``cuda_arch``: default ``cuda.default_arch()``; ``cuda_info``: ``_find_cuda()``'s toolkit."""
    if pin not in PIN_FLAGS:
        raise BuildError(f"unknown pin {pin!r}: choose one of {', '.join(PIN_FLAGS)}")
    flags = list(PIN_FLAGS[pin])
    if backend == "cpu":
        flags += ["-DGGML_CUDA=OFF", "-DGGML_METAL=OFF"]
    elif backend == "cuda":
        from .cuda import default_arch

        # no VMM: libggml-cuda does not link the driver's libcuda.so, which a machine without a GPU lacks
        # --exclude-libs: a host compiler that links part of its newer libstdc++ statically (a
        # devtoolset-style GCC as CUDAHOSTCXX) put those std:: symbols into libggml-cuda.so's exports,
        # where they interposed on libstdc++'s own in a Python process: llama_model_load_from_file
        # crashed in print_info on an H200 (llama.cpp's own tools ran). Keep them local to the library.
        flags += ["-DGGML_CUDA=ON", "-DGGML_METAL=OFF", "-DGGML_CUDA_NO_VMM=ON",
                  f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch or default_arch()}",
                  "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL"]
        if cuda_info and cuda_info.get("root"):  # a toolkit overlay with cuBLAS from PyPI
            flags += [f"-DCUDAToolkit_ROOT={cuda_info['root']}", f"-DCMAKE_CUDA_COMPILER={cuda_info['nvcc']}"]
    elif backend == "metal":
        flags += ["-DGGML_METAL=ON", "-DGGML_CUDA=OFF", "-DGGML_METAL_EMBED_LIBRARY=ON"]
    else:
        raise BuildError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if rpc is not None:
        flags.append(f"-DGGML_RPC={'ON' if rpc else 'OFF'}")
    return flags + list(extra or [])


def _rpc_in(flags: list[str]) -> bool | None:
    """The GGML_RPC value that ``flags`` give (None: not given)."""
    given = [f.split("=", 1)[1].upper() for f in flags if f.startswith("-DGGML_RPC=")]
    return None if not given else given[-1] in ("ON", "1", "TRUE", "YES")


# ---------------------------------------------------------------------------------------------
# manifests


def register(manifest: dict) -> None:
    """Record a build in the registry (~/.cache/pyllama-kv/builds/), where the runtime finds it from
    any directory (pyllama_kv._native.locate). Best effort: an unwritable cache only loses that."""
    reg = registry_dir()
    try:
        reg.mkdir(parents=True, exist_ok=True)
        f = reg / f"{manifest['variant']}-{manifest['backend']}.json"
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        os.replace(tmp, f)
    except (OSError, KeyError):
        pass


def _patch_records(variant: str, patches: list) -> list[dict]:
    """The patches a build of ``variant`` is made with, as its manifest records them."""
    return [] if variant == "vanilla" else [{"name": p.name, "sha256": p.sha256} for p in patches]


def _wanted(variant: str, backend: str, flags: list[str], tools: bool, root: Path | None) -> dict:
    pin_name = variant_pin(variant)
    pin = _vendor.Pin.load(name=pin_name, root=root)
    patches = _patch_records(variant, _patch.series(_paths.patches_dir(root, pin_name)))
    rpc = bool(_rpc_in(flags))
    return {
        "pin": pin_name,
        "revision": pin.revision,
        "pin_source": _vendor.pinned_source(pin),
        "variant": variant,
        "backend": backend,
        "patches": patches,
        "cmake_flags": flags,
        "rpc": rpc,
        "tools": (list(TOOLS) if tools else []) + ([RPC_SERVERS[pin_name]] if rpc else []),
    }


def stale_reason(manifest: dict | None, wanted: dict) -> str | None:
    """Why an existing build does not match what would be built now (None: it matches)."""
    if manifest is None:
        return "not built"
    if not Path(manifest.get("lib", "")).is_file():
        return "library missing"
    for key in ("revision", "variant", "backend", "patches", "cmake_flags"):
        if manifest.get(key) != wanted.get(key):
            return f"{key} changed"
    if not set(wanted.get("tools", [])) <= set(manifest.get("tools", [])):
        return "tools not built"
    return None


# ---------------------------------------------------------------------------------------------
# build


def _prepare_source(variant: str, root: Path | None, log: Log) -> Path:
    pin = variant_pin(variant)
    vdir = _paths.vendor_dir(root, pin)
    if not (vdir / "include" / "llama.h").is_file():
        if root is not None or _paths.checkout_root() is not None:
            flag = "" if pin == _paths.DEFAULT_PIN else f" --pin {pin}"
            raise BuildError(f"{vdir} holds no llama.cpp tree: run `pyllama-kv vendor{flag}` first")
        # an installed package: the pinned tree goes into the cache (from the cached archive if any)
        _vendor.vendor(log=log, pin_name=pin)
    if variant in ("patched", "current"):
        applied = _patch.apply(vdir, _patch.series(_paths.patches_dir(root, pin)))
        if applied:
            log(f"applied {len(applied)} patch(es): {', '.join(applied)}")
        return vdir
    # vanilla: a fresh copy of the tree with the series reversed
    src = _paths.build_root(root) / "src-vanilla" / "llama.cpp"
    if src.exists():
        shutil.rmtree(src)
    src.parent.mkdir(parents=True, exist_ok=True)
    log(f"copying the tree to {src} (without our patches) ...")
    shutil.copytree(vdir, src, symlinks=True, ignore=shutil.ignore_patterns("models", "docs", ".git"))
    reversed_ = _patch.reverse(src)
    if reversed_:
        log(f"reversed {len(reversed_)} patch(es) in the copy")
    return src


def _run_logged(cmd: list[str], log_file, label: str, log: Log, progress: bool) -> int:
    log_file.write(f"$ {' '.join(cmd)}\n")
    log_file.flush()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert proc.stdout is not None
    last = -10
    tty = sys.stderr.isatty()
    for line in proc.stdout:
        log_file.write(line)
        m = re.match(r"^\[\s*(\d+)%\]", line)
        if progress and m:
            pct = int(m.group(1))
            if tty:
                sys.stderr.write(f"\r  [{label}] {pct:3d}% {line[m.end():].strip()[:70]:<70}")
                sys.stderr.flush()
            elif pct >= last + 10 or (pct == 100 and last != 100):
                log(f"  [{label}] {pct:3d}%")
                last = pct
    rc = proc.wait()
    if progress and tty:
        sys.stderr.write("\n")
    return rc


def _needs_fresh_dir(reason: str, old_flags: list[str], flags: list[str]) -> bool:
    """Whether the CMake directory must be configured afresh rather than in place. In place is safe
    when every variable the old build set is set again (a new value overrides CMake's cache); a
    variable no longer given would keep its old cached value."""
    if reason in ("forced", "backend changed"):
        return True
    names = [{f.split("=", 1)[0] for f in fl} for fl in (old_flags, flags)]
    return reason == "cmake_flags changed" and not names[0] <= names[1]


def build(
    variant: str = "patched",
    backend: str | None = None,
    tools: bool = False,
    cuda_arch: str | None = None,
    jobs: int | None = None,
    force: bool = False,
    extra_cmake: list[str] | None = None,
    root: Path | None = None,
    log: Log = _stderr,
    progress: bool = True,
    rpc: bool | None = None,
    fetch_cublas: bool = False,
) -> dict:
    """Build (or reuse) one variant for one backend; return its manifest. ``rpc``: with ggml's RPC
    backend and rpc-server (True), without (False), or as the existing build has it (None).
    ``fetch_cublas``: for --backend cuda without cuBLAS, download it from PyPI (harness.cuda)."""
    backend = _check_request(variant, backend)
    cuda_info = _find_cuda(fetch_cublas, log) if backend == "cuda" else None
    bdir = build_dir(variant, backend, root)
    if rpc is None:  # as the existing build has it
        rpc = _rpc_in((read_manifest(bdir) or {}).get("cmake_flags") or [])
    flags = cmake_flags(backend, tools=tools, cuda_arch=cuda_arch, extra=extra_cmake, rpc=rpc, cuda_info=cuda_info,
                        pin=variant_pin(variant))
    wanted = _wanted(variant, backend, flags, tools, root)
    reason = "forced" if force else stale_reason(read_manifest(bdir), wanted)
    if reason is None:
        m = read_manifest(bdir)
        assert m is not None
        log(f"{variant}-{backend}: up to date ({m['lib']})")
        register(m)
        return m

    t0 = time.monotonic()
    log(f"{variant}-{backend}: building ({reason})")
    src = _prepare_source(variant, root, log)
    cmake_dir = bdir / "cmake"
    previous = _open_build_dir(bdir, cmake_dir, reason, flags)
    log_path = bdir / "build.log"
    label = f"{variant}-{backend}"
    _compile(src, cmake_dir, flags, ["llama", *wanted["tools"]], jobs or os.cpu_count() or 2, log_path, label, log,
             progress)
    lib = _built_library(cmake_dir, wanted["tools"], label)
    manifest = dict(wanted)
    if reason == "tools not built":  # same sources and flags: earlier tools are still current
        manifest["tools"] = sorted(set(previous.get("tools", [])) | set(manifest["tools"]))
    manifest.update({
        "lib": str(lib.parent.resolve() / lib.name),
        "bin_dir": str((cmake_dir / "bin").resolve()),
        "source_dir": str(src.resolve()),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.monotonic() - t0, 1),
        "log": str(log_path.resolve()),
        "platform": f"{platform.system()} {platform.machine()}",
    })
    if cuda_info:
        manifest["cuda"] = cuda_info
    (bdir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    register(manifest)
    log(f"{variant}-{backend}: built {lib} in {manifest['build_seconds']}s")
    return manifest


def _open_build_dir(bdir: Path, cmake_dir: Path, reason: str, flags: list[str]) -> dict:
    """Make ``bdir`` ready for a build: its manifest removed (returned, {} if none) until the build
    succeeds, the CMake directory removed when it must be configured afresh."""
    bdir.mkdir(parents=True, exist_ok=True)
    previous = read_manifest(bdir) or {}
    (bdir / "manifest.json").unlink(missing_ok=True)
    if cmake_dir.exists() and _needs_fresh_dir(reason, previous.get("cmake_flags", []), flags):
        shutil.rmtree(cmake_dir)
    return previous


def _check_request(variant: str, backend: str | None) -> str:
    """The backend to build for (this machine's default when None), once the variant, the backend
    and cmake are known to be usable here."""
    variant_pin(variant)  # BuildError for an unknown variant
    backend = backend or default_backend()
    if backend == "metal" and platform.system() != "Darwin":
        raise BuildError("--backend metal needs macOS (Apple's Metal framework); use --backend cpu or cuda here")
    if not shutil.which("cmake"):
        raise BuildError("cmake was not found on PATH: install CMake 3.14 or newer (e.g. `pip install cmake`)")
    return backend


def _compile(src: Path, cmake_dir: Path, flags: list[str], targets: list[str], jobs: int, log_path: Path,
             label: str, log: Log, progress: bool) -> None:
    """Configure ``cmake_dir`` from ``src`` and build ``targets``, the output in ``log_path``;
    BuildError with the log's last lines if either step fails."""
    with open(log_path, "w") as lf:
        cfg = ["cmake", "-S", str(src), "-B", str(cmake_dir), *flags]
        log(f"  configure: {' '.join(flags)}")
        rc = _run_logged(cfg, lf, label, log, progress=False)
        if rc == 0:
            bld = ["cmake", "--build", str(cmake_dir), "--config", "Release", "-j", str(jobs), "--target", *targets]
            rc = _run_logged(bld, lf, label, log, progress=progress)
    if rc != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise BuildError(f"{label}: the build failed (exit {rc}); last lines of {log_path}:\n{tail}")


def _built_library(cmake_dir: Path, tools: list[str], label: str) -> Path:
    """The libllama the build wrote; BuildError if it or one of ``tools`` is missing. On the current
    pin it is a link (libllama.so -> libllama.so.0 -> libllama.so.0.5.0): the manifest keeps its name."""
    lib = next((p for p in (cmake_dir / "bin" / lib_name(), cmake_dir / "src" / lib_name()) if p.is_file()), None)
    for t in tools:
        if not (cmake_dir / "bin" / t).is_file():
            raise BuildError(f"{label}: the build finished but {t} is not in {cmake_dir}/bin")
    if lib is None:
        raise BuildError(f"{label}: the build finished but {lib_name()} is not in {cmake_dir}/bin")
    return lib


# ---------------------------------------------------------------------------------------------
# status


def _vendor_status(vdir: Path, patches: list) -> tuple[dict, list[bool]]:
    """A vendor tree's state (missing, pristine, patched, partly patched, conflict) and which of
    ``patches`` it holds."""
    out: dict = {"path": str(vdir), "present": (vdir / "include" / "llama.h").is_file()}
    marker = _vendor.read_marker(vdir)
    out["source"] = marker.get("source") if marker else None
    out["revision"] = marker.get("revision") if marker else None
    applied = [False] * len(patches)
    if not out["present"]:
        out["state"] = "missing"
        return out, applied
    try:
        st = _patch.state(vdir, patches)
    except _patch.PatchError as exc:
        out["state"] = f"error: {exc}"
        return out, applied
    out["state"] = ("conflict" if st.conflict else
                    "patched" if st.complete and patches else
                    "pristine" if st.n_applied == 0 else  # (with an empty series: nothing to apply)
                    f"partly patched ({st.n_applied}/{len(patches)})")
    if st.conflict:
        out["conflict"] = {"patch": st.conflict, "detail": st.detail}
    return out, st.applied


def pin_status(pin_name: str, root: Path | None = None) -> dict:
    """One pin: its revision and archive, its vendor tree's state and its patch series."""
    pin = _vendor.Pin.load(name=pin_name, root=root)
    patches = _patch.series(_paths.patches_dir(root, pin_name))
    vendor, applied = _vendor_status(_paths.vendor_dir(root, pin_name), patches)
    return {
        "name": pin_name,
        "revision": pin.revision,
        "source": f"{pin.package}=={pin.version}", "filename": pin.filename, "sha256": pin.sha256,
        "cached": _vendor.cached_archive(pin).is_file(),
        "vendor": vendor,
        "patches_dir": str(_paths.patches_dir(root, pin_name)),
        "patches": [{"name": p.name, "subject": p.subject(), "sha256": p.sha256, "applied": a}
                    for p, a in zip(patches, applied)],
    }


def _pin_status_or_none(pin_name: str, root: Path | None) -> dict:
    """``pin_status``; for a second pin whose file is missing (a package installed before it existed),
    what can be said without it."""
    try:
        return pin_status(pin_name, root)
    except _vendor.VendorError as exc:
        if pin_name == _paths.DEFAULT_PIN:
            raise
        return {"name": pin_name, "revision": None, "error": str(exc), "source": None, "filename": None,
                "sha256": None, "cached": False, "patches": [], "patches_dir": None,
                "vendor": {"path": str(_paths.vendor_dir(root, pin_name)), "present": False, "state": "no pin file"}}


def status(root: Path | None = None) -> dict:
    """Both pins (revision, vendor tree state, patches applied) and the builds (for `pyllama-kv status`).
    The top-level ``revision``, ``pin``, ``vendor`` and ``patches`` are the mission pin's; ``pins`` has
    both."""
    pins = {name: _pin_status_or_none(name, root) for name in _paths.PINS}
    mission = pins[_paths.DEFAULT_PIN]
    out: dict = {
        "revision": mission["revision"],
        "pin": {k: mission[k] for k in ("name", "source", "filename", "sha256", "cached")},
        "vendor": mission["vendor"],
        "patches": mission["patches"],
        "pins": pins,
        "builds": [],
    }
    broot = _paths.build_root(root)
    for variant in VARIANTS:
        pin_name = variant_pin(variant)
        records = [{"name": p["name"], "sha256": p["sha256"]} for p in pins[pin_name]["patches"]]
        for backend in BACKENDS:
            d = broot / f"{variant}-{backend}"
            m = read_manifest(d)
            if m is None:
                continue
            # the sources decide staleness here (the flags a build was asked for are its own business)
            stale = stale_reason(m, dict(m, revision=pins[pin_name]["revision"],
                                         patches=[] if variant == "vanilla" else records))
            out["builds"].append({
                "variant": variant, "backend": backend, "pin": manifest_pin(m), "revision": m.get("revision"),
                "lib": m.get("lib"), "dir": str(d),
                "built_at": m.get("built_at"), "tools": m.get("tools", []), "bin_dir": m.get("bin_dir"),
                "rpc": bool(m.get("rpc")),
                "stale": stale, "patches": [p["name"] for p in m.get("patches", [])],
            })
    return out
