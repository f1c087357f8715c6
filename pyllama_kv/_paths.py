"""Where things live: the project checkout, the package's own data, the download cache, vendor and
build dirs.

Pure path logic shared by the harness (vendor/patch/build) and the API. Nothing here runs a
program or touches the network.

Two ways to run:

* from a **checkout** (the package sits beside ``patches/`` and ``vendor/``, an editable install,
  or ``$PYLLAMA_KV_ROOT``): the pin, the patches, the vendored tree and the builds are the
  checkout's (``vendor/``, ``patches/``, ``build/``);
* from an **installed package** (``pip install``): the pin file and the patch series ship inside the
  package (``pyllama_kv/_data/``), and the source tree and the builds made by ``pyllama-kv vendor``
  and ``pyllama-kv build`` go to the cache (``<cache>/src/llama.cpp``, ``<cache>/builds/``).

Two pins (``PINS``): ``mission`` (the default: ``vendor/llama.cpp.pin.json``, ``vendor/llama.cpp``,
``patches/0*.patch``) and ``current`` (the current llama.cpp: ``vendor/current.pin.json``,
``vendor/llama.cpp-current``, ``patches/current/``); ``pin_path``, ``vendor_dir`` and ``patches_dir``
take the pin's name.

Environment overrides:
  PYLLAMA_KV_ROOT   the project checkout (holds vendor/, patches/, build/)
  PYLLAMA_KV_CACHE  the download cache; default ~/.cache/pyllama-kv (or $XDG_CACHE_HOME/pyllama-kv)
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def _package_lib() -> Path:
    """The package's lib/. A plain ``pip install -e .`` (scikit-build-core's default editable mode,
    "redirect") leaves the code in the checkout and puts what CMake installed, lib/ included, in
    site-packages/pyllama_kv/: the package's ``__path__`` lists both, so look in each."""
    for d in getattr(sys.modules.get(__package__ or ""), "__path__", None) or [PACKAGE_DIR]:
        if (Path(d) / "lib").is_dir():
            return Path(d).resolve() / "lib"
    return PACKAGE_DIR / "lib"


# what a package build installs inside the package (CMakeLists.txt): the pin file and the patch
# series (_data/), and the patched library with its build-info.json (lib/)
PACKAGE_DATA = PACKAGE_DIR / "_data"
PACKAGE_LIB = _package_lib()


def _is_checkout(d: Path) -> bool:
    """A pyllama_kv checkout: its package, its pin and its patch series (not any folder that happens to
    hold a patches/ and a vendor/)."""
    return ((d / "patches").is_dir() and (d / "vendor" / "llama.cpp.pin.json").is_file()
            and (d / "pyllama_kv" / "__init__.py").is_file())


def checkout_root() -> Path | None:
    """The project checkout this package runs from, or None for an installed package."""
    env = os.environ.get("PYLLAMA_KV_ROOT")
    if env:
        return Path(env).resolve()
    if _is_checkout(PACKAGE_DIR.parent):
        return PACKAGE_DIR.parent
    # an installed package run from inside a checkout: use that checkout
    try:
        cwd = Path.cwd()
    except OSError:  # the current directory was removed
        return None
    return cwd if _is_checkout(cwd) else None


def cache_dir() -> Path:
    env = os.environ.get("PYLLAMA_KV_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "pyllama-kv"


# the pins: the mission pin (May 2025, our defrag series: the default) and the current llama.cpp.
# name -> (pin file in vendor/, the tree's directory name in vendor/, its patch series under patches/)
PINS: dict[str, tuple[str, str, str]] = {
    "mission": ("llama.cpp.pin.json", "llama.cpp", ""),
    "current": ("current.pin.json", "llama.cpp-current", "current"),
}
DEFAULT_PIN = "mission"


def _pin_entry(pin: str) -> tuple[str, str, str]:
    try:
        return PINS[pin]
    except KeyError:
        raise ValueError(f"unknown pin {pin!r}: choose one of {', '.join(PINS)}") from None


def pin_path(root: Path | None = None, pin: str = DEFAULT_PIN) -> Path:
    name = _pin_entry(pin)[0]
    root = root or checkout_root()
    return root / "vendor" / name if root else PACKAGE_DATA / name


def patches_dir(root: Path | None = None, pin: str = DEFAULT_PIN) -> Path:
    """The pin's series: ``patches/`` (mission: ``patches/0*.patch``), ``patches/current/`` (current)."""
    sub = _pin_entry(pin)[2]
    root = root or checkout_root()
    base = root / "patches" if root else PACKAGE_DATA / "patches"
    return base / sub if sub else base


def vendor_dir(root: Path | None = None, pin: str = DEFAULT_PIN) -> Path:
    name = _pin_entry(pin)[1]
    root = root or checkout_root()
    return root / "vendor" / name if root else cache_dir() / "src" / name


def build_root(root: Path | None = None) -> Path:
    root = root or checkout_root()
    return root / "build" if root else cache_dir() / "builds"
