"""`pyllama-kv patch`: apply (check, list, reverse) our KV-cache patch series."""
from __future__ import annotations

from pathlib import Path

from ..render import log, print_json


def register(subparsers) -> None:
    s = subparsers.add_parser("patch", description="Apply patches/*.patch in order (idempotent). A patch that does "
                                                   "not apply fails with its name and hunk, and the tree is left "
                                                   "unchanged.")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="only check that the rest of the series would apply")
    g.add_argument("--status", action="store_true", help="list which patches are applied")
    g.add_argument("--reverse", action="store_true", help="reverse the applied patches")
    s.add_argument("--tree", metavar="DIR",
                   help="llama.cpp tree to work on (default: vendor/llama.cpp of the checkout; for an installed "
                        "package, the tree `pyllama-kv vendor` puts in ~/.cache/pyllama-kv/src)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> int:
    from ... import _paths
    from ...harness import patch

    tree = Path(args.tree) if args.tree else _paths.vendor_dir()
    if args.status:
        st = patch.state(tree)
        rows = [{"name": p.name, "subject": p.subject(), "applied": a} for p, a in zip(st.patches, st.applied)]
        if args.json:
            print_json({"tree": str(tree), "patches": rows, "conflict": st.conflict})
        else:
            for r in rows:
                print(f"{'applied ' if r['applied'] else 'pending '} {r['name']}  {r['subject']}")
            if st.conflict:
                print(f"conflict at {st.conflict}:\n{st.detail}")
        return 1 if st.conflict else 0
    if args.check:
        st = patch.check(tree)
        todo = [p.name for p in st.patches[st.n_applied:]]
        if args.json:
            print_json({"tree": str(tree), "applied": [p.name for p in st.patches[:st.n_applied]],
                        "would_apply": todo})
        else:
            print(f"{st.n_applied} applied; {len(todo)} would apply cleanly" + (f": {', '.join(todo)}" if todo else ""))
        return 0
    if args.reverse:
        names = patch.reverse(tree)
        verb = "reversed"
    else:
        names = patch.apply(tree)
        verb = "applied"
    if args.json:
        print_json({"tree": str(tree), verb: names})
    elif names:
        for n in names:
            log(f"{verb} {n}")
    else:
        log(f"nothing to do: the series is {'not applied' if args.reverse else 'already applied'} in {tree}")
    return 0
