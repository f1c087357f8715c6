"""Where things live: the project checkout, the download cache, vendor and build dirs.

Pure path logic shared by the harness (vendor/patch/build) and the API. Nothing here runs a
program or touches the network.

Environment overrides:
  PYLLAMA_KV_ROOT   the project checkout (holds vendor/, patches/, build/); default: the parent of
                    this package when it holds patches/ (an editable install or a source tree)
  PYLLAMA_KV_CACHE  the download cache; default ~/.cache/pyllama-kv (or $XDG_CACHE_HOME/pyllama-kv)
"""
from __future__ import annotations

import os
from pathlib import Path


def project_root() -> Path:
    env = os.environ.get("PYLLAMA_KV_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parent.parent
    if (here / "patches").is_dir():
        return here
    # an installed package outside a checkout: use the current directory if it looks like one
    cwd = Path.cwd()
    if (cwd / "patches").is_dir() and (cwd / "vendor").is_dir():
        return cwd
    return here


def cache_dir() -> Path:
    env = os.environ.get("PYLLAMA_KV_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "pyllama-kv"


def pin_path(root: Path | None = None) -> Path:
    return (root or project_root()) / "vendor" / "llama.cpp.pin.json"


def vendor_dir(root: Path | None = None) -> Path:
    return (root or project_root()) / "vendor" / "llama.cpp"


def patches_dir(root: Path | None = None) -> Path:
    return (root or project_root()) / "patches"


def build_root(root: Path | None = None) -> Path:
    return (root or project_root()) / "build"
