"""`pyllama-kv vendor`: fetch the pinned llama.cpp into vendor/llama.cpp (of an installed package:
into ~/.cache/pyllama-kv/src/llama.cpp)."""
from __future__ import annotations

from pathlib import Path

from ..common import CLIError
from ..render import log, print_json


def register(subparsers) -> None:
    s = subparsers.add_parser("vendor", description="Fetch the pinned llama.cpp source (the llama-cpp-python sdist "
                                                    "from PyPI, sha256-checked, cached in ~/.cache/pyllama-kv) into "
                                                    "vendor/llama.cpp of the checkout; for an installed "
                                                    "package, into ~/.cache/pyllama-kv/src/llama.cpp.")
    s.add_argument("--source", metavar="PATH",
                   help="use an existing llama.cpp checkout or tarball at the pinned revision")
    s.add_argument("--force", action="store_true", help="replace the tree even if it already holds the pin")
    s.add_argument("--fingerprint", metavar="DIR",
                   help="print the fingerprint of an unpatched llama.cpp tree (for a new pin)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> int:
    from ...harness import vendor

    if args.fingerprint:
        pin = vendor.Pin.load()
        tree = Path(args.fingerprint)
        if not (tree / "include" / "llama.h").is_file():
            raise CLIError(f"{tree} is not a llama.cpp tree (no include/llama.h)")
        fp = vendor.fingerprint(tree, pin.fingerprint_paths)
        if args.json:
            print_json({"tree": str(tree), "paths": list(pin.fingerprint_paths), "sha256": fp,
                        "matches_pin": fp == pin.fingerprint_sha256})
        else:
            print(fp)
        return 0
    res = vendor.vendor(source=Path(args.source) if args.source else None, force=args.force, log=log)
    if args.json:
        print_json({"path": str(res.path), "revision": res.revision, "source": res.source,
                    "changed": res.changed, "files": res.files})
    return 0
