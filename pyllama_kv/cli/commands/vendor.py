"""`pyllama-kv vendor`: fetch a pinned llama.cpp into vendor/ (the mission pin into vendor/llama.cpp, the
current one into vendor/llama.cpp-current; of an installed package: into ~/.cache/pyllama-kv/src/)."""
from __future__ import annotations

from pathlib import Path

from ..common import CLIError
from ..render import log, print_json


def register(subparsers) -> None:
    s = subparsers.add_parser("vendor", description="Fetch a pinned llama.cpp source (a llama-cpp-python sdist "
                                                    "from PyPI, sha256-checked, cached in ~/.cache/pyllama-kv) into "
                                                    "vendor/ of the checkout (the mission pin into vendor/llama.cpp, "
                                                    "the current one into vendor/llama.cpp-current); for an "
                                                    "installed package, into ~/.cache/pyllama-kv/src/.")
    s.add_argument("--pin", choices=["mission", "current", "all"], default="mission",
                   help="which pin: mission (8733e0c, May 2025, our defrag series; the default), current (the "
                        "current llama.cpp, vendor/current.pin.json), or all (both)")
    s.add_argument("--source", metavar="PATH",
                   help="use an existing llama.cpp checkout or tarball at the pinned revision (one pin only)")
    s.add_argument("--force", action="store_true", help="replace the tree even if it already holds the pin")
    s.add_argument("--fingerprint", metavar="DIR",
                   help="print the fingerprint of an unpatched llama.cpp tree (for a new pin), over the paths "
                        "that --pin's pin file names")
    s.add_argument("--json", action="store_true", help="print the result as JSON (a list with --pin all)")


def run(args) -> int:
    from ...harness import vendor

    if args.fingerprint:
        if args.pin == "all":
            raise CLIError("--fingerprint compares with one pin: give --pin mission or --pin current")
        pin = vendor.Pin.load(name=args.pin)
        tree = Path(args.fingerprint)
        if not (tree / "include" / "llama.h").is_file():
            raise CLIError(f"{tree} is not a llama.cpp tree (no include/llama.h)")
        fp = vendor.fingerprint(tree, pin.fingerprint_paths)
        if args.json:
            print_json({"tree": str(tree), "pin": pin.name, "paths": list(pin.fingerprint_paths), "sha256": fp,
                        "matches_pin": fp == pin.fingerprint_sha256})
        else:
            print(fp)
        return 0
    names = vendor.pin_names(args.pin)
    if args.source and len(names) > 1:
        raise CLIError("--source is one tree of one revision: give --pin mission or --pin current")
    results = [vendor.vendor(source=Path(args.source) if args.source else None, force=args.force, log=log,
                             pin_name=name) for name in names]
    if args.json:
        rows = [{"pin": r.pin, "path": str(r.path), "revision": r.revision, "source": r.source,
                 "changed": r.changed, "files": r.files} for r in results]
        print_json(rows if args.pin == "all" else rows[0])
    return 0
