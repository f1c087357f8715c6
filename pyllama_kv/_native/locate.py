"""Where the libllama to load is: read-only, no harness import, nothing run.

In order: the ``lib`` argument (a path, ``"patched"``, ``"vanilla"`` or ``"current"``), else
``$PYLLAMA_KV_LIB`` (an explicit choice, as llama-cpp-python's ``LLAMA_CPP_LIB_PATH``), else the
library inside the package, else the patched build:

1. the one **inside the package** (``pyllama_kv/lib/``, compiled by ``pip install``; its
   ``build-info.json`` says what it is), then
2. the builds made by ``pyllama-kv build``, found through their ``manifest.json``: under ``build/``
   of the checkout this package lives in (``$PYLLAMA_KV_ROOT`` overrides it; ``<cache>/builds/`` for
   an installed package), and in the registry of builds, ``~/.cache/pyllama-kv/builds/*.json``
   (``$PYLLAMA_KV_CACHE`` moves it), so a program started from any directory finds a library built
   earlier.

``"vanilla"`` is never bundled: it is always a build (``pyllama-kv build --vanilla``). ``"current"``
is the current llama.cpp (the second pin, ``pyllama-kv build --pin current``, or a package compiled
with ``-DPYLLAMA_KV_PIN=current``). ``library_info()["origin"]`` says which of these was loaded, and
``["pin"]`` which pin (``"mission"`` or ``"current"``; None for a library we know nothing about).
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

from .. import _paths
from ..errors import LibraryError


def _one_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def read_manifest(path: Path) -> dict | None:
    """A build manifest (a directory holding manifest.json, or the JSON file itself), or None."""
    f = path / "manifest.json" if path.is_dir() else path
    try:
        m = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) else None


# the library names `resolve` knows, and the pin each is built from
VARIANT_PIN = {"patched": "mission", "vanilla": "mission", "current": "current"}
# how to make each when it is missing
_BUILD_CMD = {"patched": "pyllama-kv build", "vanilla": "pyllama-kv build --vanilla",
              "current": "pyllama-kv vendor --pin current && pyllama-kv build --pin current"}


def manifest_pin(m: dict) -> str | None:
    """The pin a build manifest (or a package's build info) was made from; manifests written before
    the second pin existed do not say it, and were all made from the mission pin."""
    pin = m.get("pin")
    if isinstance(pin, str):
        return pin
    return VARIANT_PIN.get(str(m.get("variant")))


def lib_name() -> str:
    """The file name of libllama on this system."""
    return {"Darwin": "libllama.dylib", "Windows": "llama.dll"}.get(platform.system(), "libllama.so")


def bundled() -> dict | None:
    """The build info of the library a package build put inside the package, or None. Its
    ``variant`` is "patched" (the mission pin, the default) or "current" (-DPYLLAMA_KV_PIN=current)."""
    lib = _paths.PACKAGE_LIB / lib_name()
    if not lib.is_file():
        return None
    m = read_manifest(_paths.PACKAGE_LIB / "build-info.json") or {}
    return dict(m, lib=str(lib), origin="package", variant=m.get("variant") or "patched")


def registry_dir() -> Path:
    """Where ``pyllama-kv build`` records the builds it made (one JSON manifest each)."""
    return _paths.cache_dir() / "builds"


def find_builds(root: Path | None = None, registry: bool = True) -> list[dict]:
    """Every build with a manifest and an existing library: the checkout's first, then the
    registry's (each library once)."""
    out: list[dict] = []
    seen: set[str] = set()
    dirs: list[Path] = []
    broot = _paths.build_root(root)
    if broot.is_dir():
        dirs += [d for d in sorted(broot.iterdir()) if d.is_dir()]
    if registry and registry_dir().is_dir():
        dirs += sorted(registry_dir().glob("*.json"))
    for d in dirs:
        m = read_manifest(d)
        try:
            lib = Path(m["lib"]) if m else None
            if lib is None or not lib.is_file():
                continue
            key = str(lib.resolve())
        except (OSError, ValueError, TypeError, KeyError, RuntimeError):
            continue
        if m is not None and key not in seen:
            seen.add(key)
            out.append(m)
    return out


def _manifest_builds() -> list[dict]:
    # reading manifests only (no subprocess): the API never runs anything
    try:
        return find_builds(_paths.checkout_root())
    except (OSError, ValueError, TypeError):  # an unreadable build dir or a damaged manifest
        return []


def resolve(lib: str | os.PathLike | None = None) -> tuple[Path, dict]:
    """Path and build info of the library to load.

    ``lib`` may be a path, ``"patched"`` (the library inside the package if it is the patched one,
    else the CPU build, else any backend), ``"vanilla"`` (a build), ``"current"`` (the library inside
    the package if it was compiled from the current pin, else a build, CPU first), or None:
    ``$PYLLAMA_KV_LIB``, else the library inside the package, else ``"patched"``.
    """
    origin = "argument"
    if lib is None:
        env = os.environ.get("PYLLAMA_KV_LIB")
        lib, origin = (env, "PYLLAMA_KV_LIB") if env else ("", "")
        if not env:
            b = bundled()
            if b is not None:
                return Path(b["lib"]).resolve(), _info_from_manifest(b, "package")
            lib = "patched"
    name = _lib_name_arg(lib)
    if name in VARIANT_PIN:
        return _resolve_variant(name)
    try:
        path = Path(name).expanduser()
    except RuntimeError:  # "~user" of an unknown user
        path = Path(name)
    try:
        if path.is_dir():
            raise LibraryError(f"library {path} is a directory, not a libllama file")
        if not path.is_file():
            raise LibraryError(f"library {path} does not exist" if not path.exists() else
                               f"library {path} is not a regular file")
        path = path.resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # a NUL byte, a symlink loop, a name too long
        raise LibraryError(f"library {name!r}: {_one_line(exc)}") from None
    pkg = bundled()
    for b in ([pkg] if pkg else []) + _manifest_builds():
        try:
            if Path(b["lib"]).resolve() == path:
                return path, _info_from_manifest(b, origin)
        except (OSError, ValueError, RuntimeError, TypeError, KeyError):
            continue
    return path, {"path": str(path), "variant": "unknown", "pin": None, "revision": None, "patches": [],
                  "backend": None, "origin": origin}


_CHOICES = "a path to a libllama, 'patched', 'vanilla' or 'current'"


def _lib_name_arg(lib: object) -> str:
    """``lib`` as a string (a name or a path); LibraryError for what cannot be one."""
    if isinstance(lib, (bytes, os.PathLike)):
        try:
            lib = os.fsdecode(lib)
        except (TypeError, ValueError) as exc:
            raise LibraryError(f"lib must be {_CHOICES}: {_one_line(exc)}") from None
    if not isinstance(lib, str):
        raise LibraryError(f"lib must be {_CHOICES} or None, not {type(lib).__name__}")
    if not lib.strip():
        raise LibraryError(f"lib is an empty string: give {_CHOICES}")
    if "\0" in lib:
        raise LibraryError(f"library path {lib!r} contains a NUL byte")
    return lib


def _resolve_variant(name: str) -> tuple[Path, dict]:
    """The library called ``name`` ("patched", "vanilla", "current"): the package's own if it is that
    one, else a build of that variant, the CPU build first."""
    b = bundled()
    if b is not None and b.get("variant") == name:
        return Path(b["lib"]).resolve(), _info_from_manifest(b, "package")
    cands = [b for b in _manifest_builds() if b.get("variant") == name]
    cands.sort(key=lambda b: (b.get("backend") != "cpu", b.get("backend", "")))
    if not cands:
        raise LibraryError(
            f"no {name} build of libllama found under {_paths.build_root()} or in {registry_dir()}"
            + ("" if name == "vanilla" else " (and none inside the package)")
            + f": run `make setup` in a checkout, or `{_BUILD_CMD[name]}`, or set PYLLAMA_KV_LIB"
        )
    return Path(cands[0]["lib"]).resolve(), _info_from_manifest(cands[0], "build")


def _info_from_manifest(b: dict, origin: str) -> dict:
    """``origin``: where the library was found: "package" (inside the installed package), "build" (a
    `pyllama-kv build`), "PYLLAMA_KV_LIB" or "argument" (a path given)."""
    return {
        "origin": origin,
        "path": str(Path(b["lib"]).resolve()),
        "variant": b.get("variant"),
        "pin": manifest_pin(b),
        "revision": b.get("revision"),
        "patches": [p.get("name") for p in (b.get("patches") or []) if isinstance(p, dict)],
        "backend": b.get("backend"),
        "built_at": b.get("built_at"),
    }
