"""`pyllama-kv status`: each pin (mission and current) with its revision, vendor tree and patches, the
library inside the package (a pip install) and the builds with their pin."""
from __future__ import annotations

from ..render import print_json


def register(subparsers) -> None:
    s = subparsers.add_parser("status", description="Show each pin's revision (mission and current), its vendor "
                                                    "tree's state, which patches are applied, the library inside the "
                                                    "package (pip install) and each build with its library path and "
                                                    "pin.")
    s.add_argument("--json", action="store_true", help="print as JSON")


def run(args) -> int:
    from ..._native import locate
    from ...harness import build

    st = build.status()
    pkg = locate.bundled()
    st["package_library"] = None if pkg is None else {
        "lib": pkg["lib"], "variant": pkg.get("variant"), "pin": locate.manifest_pin(pkg),
        "revision": pkg.get("revision"),
        "backend": pkg.get("backend"), "rpc": bool(pkg.get("rpc")), "built_at": pkg.get("built_at"),
        "patches": [p.get("name") for p in pkg.get("patches") or [] if isinstance(p, dict)],
    }
    if args.json:
        print_json(st)
        return 0
    for name, pin in st["pins"].items():
        v = pin["vendor"]
        if pin.get("error"):
            print(f"llama.cpp {name:<9} unknown: {pin['error']}")
            continue
        print(f"llama.cpp {name:<9} {pin['revision']}  ({pin['source']}, cached: {'yes' if pin['cached'] else 'no'})")
        print(f"  vendor tree       {v['path']}: {v['state']}")
        if not pin["patches"]:
            print(f"  patches           none ({pin['patches_dir']})")
        for p in pin["patches"]:
            print(f"  {'[x]' if p['applied'] else '[ ]'} {p['name']}")
    if pkg is not None:
        lib = st["package_library"]
        print(f"package library     {lib['lib']}  ({lib['variant']}, {lib['backend']}, {len(lib['patches'])} patches"
              + (", RPC" if lib["rpc"] else "") + ")")
    if not st["builds"]:
        print("builds              none" + ("" if pkg else " (run `pyllama-kv build`)"))
    for b in st["builds"]:
        print(f"build {b['variant'] + '-' + b['backend']:<13} {b['lib']}  ({b['pin']} pin, {str(b['revision'])[:12]})"
              + ("  (RPC)" if b.get("rpc") else "") + (f"  (stale: {b['stale']})" if b["stale"] else ""))
    return 0
