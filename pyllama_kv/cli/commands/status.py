"""`pyllama-kv status`: the pinned revision, the vendor tree, the patches, the library inside the
package (a pip install) and the builds."""
from __future__ import annotations

from ..render import print_json


def register(subparsers) -> None:
    s = subparsers.add_parser("status", description="Show the pinned revision, the vendor tree's state, which "
                                                    "patches are applied, the library inside the package (pip install) "
                                                    "and each build with its library path.")
    s.add_argument("--json", action="store_true", help="print as JSON")


def run(args) -> int:
    from ..._native import locate
    from ...harness import build

    st = build.status()
    pkg = locate.bundled()
    st["package_library"] = None if pkg is None else {
        "lib": pkg["lib"], "backend": pkg.get("backend"), "rpc": bool(pkg.get("rpc")), "built_at": pkg.get("built_at"),
        "patches": [p.get("name") for p in pkg.get("patches") or [] if isinstance(p, dict)],
    }
    if args.json:
        print_json(st)
        return 0
    v = st["vendor"]
    print(f"llama.cpp revision  {st['revision']}  ({st['pin']['source']}, "
          f"cached: {'yes' if st['pin']['cached'] else 'no'})")
    print(f"vendor tree         {v['path']}: {v['state']}")
    for p in st["patches"]:
        print(f"  {'[x]' if p['applied'] else '[ ]'} {p['name']}")
    if pkg is not None:
        lib = st["package_library"]
        print(f"package library     {lib['lib']}  ({lib['backend']}, {len(lib['patches'])} patches"
              + (", RPC" if lib["rpc"] else "") + ")")
    if not st["builds"]:
        print("builds              none" + ("" if pkg else " (run `pyllama-kv build`)"))
    for b in st["builds"]:
        print(f"build {b['variant']}-{b['backend']:<6} {b['lib']}" + ("  (RPC)" if b.get("rpc") else "")
              + (f"  (stale: {b['stale']})" if b["stale"] else ""))
    return 0
