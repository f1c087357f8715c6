"""The patched llama.cpp tree that a package build compiles (``pip install``, ``python -m build``).

Of the mission pin by default; of the current llama.cpp with ``--pin current`` (CMake:
``-DPYLLAMA_KV_PIN=current``): the same steps on ``vendor/llama.cpp-current`` and
``patches/current/`` (a series that may be empty), and the build info says ``"variant": "current"``.

The top-level ``CMakeLists.txt`` runs this at configure time, in the build's own (isolated) Python:
the harness needs nothing but the standard library, git (for ``git apply``) and, only when no
source is at hand, pip to fetch the pinned archive.

Where the source comes from, in order:

1. the tree in ``vendor/llama.cpp`` beside the pin, **if our whole series is applied to it**: an
   sdist made by ``make sdist`` carries that tree, and a checkout after ``make setup`` has it;
2. otherwise the pinned archive, from the cache (``~/.cache/pyllama-kv/downloads``) or downloaded
   there with pip, sha256-checked, unpacked into the build directory and patched there: the same
   steps as ``pyllama-kv vendor`` and ``pyllama-kv patch``. A pristine or partly patched tree in
   ``vendor/`` is never modified by a package build.

Either way the build never compiles an unpatched tree: the series is proven applied
(``patch.state``) and ``include/llama.h`` must declare our stats function.

    python -m pyllama_kv.harness.source --work DIR --info FILE [--pin mission|current]
                                        [--backend cpu|cuda|metal] [--rpc]

prints the tree's path as its last line and writes FILE, the build info that the package carries
beside the library (``pyllama_kv/lib/build-info.json``, read by ``library_info()``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .. import _paths
from ..errors import HarnessError
from ..modelfile.download import Log
from . import patch as _patch, vendor as _vendor

STATS_SYMBOL = "llama_kv_self_stats"  # declared in include/llama.h by patches/0004-kv-stats-api.patch


def _log(msg: str) -> None:
    print(f"pyllama-kv: {msg}", file=sys.stderr, flush=True)


def _is_patched(tree: Path, patches: list[_patch.Patch]) -> bool:
    if not (tree / "include" / "llama.h").is_file():
        return False
    try:
        return _patch.state(tree, patches).complete
    except _patch.PatchError:
        return False


def patched_tree(work: Path, log: Log = _log, pin_name: str = _paths.DEFAULT_PIN) -> tuple[Path, str]:
    """A llama.cpp tree of the pinned revision with the whole series applied; and where it came from."""
    pin = _vendor.Pin.load(name=pin_name)
    mission = pin_name == _paths.DEFAULT_PIN
    patches = _patch.series(_paths.patches_dir(pin=pin_name))
    if not patches and mission:
        raise HarnessError(f"no patches found in {_paths.patches_dir()}: the package would be unpatched")
    vendored = _paths.vendor_dir(pin=pin_name)
    marker = _vendor.read_marker(vendored) or {}
    if marker.get("revision") == pin.revision and _is_patched(vendored, patches):
        tree, origin = vendored, f"{vendored} (patched tree, {marker.get('source')})"
    else:
        if vendored.exists():
            log(f"{vendored} is not the pinned tree with all {len(patches)} patches applied: not using it")
        tree = Path(work) / vendored.name
        if not (_vendor.read_marker(tree) or {}).get("revision") == pin.revision:
            _vendor.unpack_pinned(pin, tree, log)
        applied = _patch.apply(tree, patches)
        if applied:
            log(f"applied {len(applied)} patch(es) in {tree}")
        origin = f"{pin.package}=={pin.version} sdist (sha256 {pin.sha256[:12]}...), patched at build time"
    if not _is_patched(tree, patches):
        raise HarnessError(f"{tree} does not hold the whole patch series: refusing to build it")
    if mission and STATS_SYMBOL not in (tree / "include" / "llama.h").read_text(errors="replace"):
        raise HarnessError(f"{tree}/include/llama.h does not declare {STATS_SYMBOL}: not our patched tree")
    return tree, origin


def build_info(origin: str, backend: str, rpc: bool, pin_name: str = _paths.DEFAULT_PIN) -> dict:
    """What the package carries beside its library: the same keys as a build manifest."""
    pin = _vendor.Pin.load(name=pin_name)
    return {
        "variant": "patched" if pin_name == _paths.DEFAULT_PIN else pin_name,
        "pin": pin_name,
        "revision": pin.revision,
        "pin_source": _vendor.pinned_source(pin),
        "backend": backend,
        "rpc": rpc,
        "patches": [{"name": p.name, "sha256": p.sha256} for p in _patch.series(_paths.patches_dir(pin=pin_name))],
        "source": origin,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pyllama_kv.harness.source", description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="a directory of the build to unpack into if needed")
    ap.add_argument("--info", type=Path, required=True, help="where to write build-info.json")
    ap.add_argument("--pin", default=_paths.DEFAULT_PIN, choices=tuple(_paths.PINS))
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda", "metal"))
    ap.add_argument("--rpc", action="store_true")
    args = ap.parse_args(argv)
    try:
        tree, origin = patched_tree(args.work, pin_name=args.pin)
        args.info.parent.mkdir(parents=True, exist_ok=True)
        args.info.write_text(json.dumps(build_info(origin, args.backend, args.rpc, args.pin), indent=2) + "\n")
    except HarnessError as exc:
        _log(f"error: {exc}")
        return 1
    _log(f"building llama.cpp from {origin}")
    print(tree)
    return 0


if __name__ == "__main__":
    sys.exit(main())
