"""`pyllama-kv patch`: apply (check, list, reverse) a pin's patch series: the mission pin's KV-cache series
(patches/0*.patch on vendor/llama.cpp) or the current pin's (patches/current/ on vendor/llama.cpp-current)."""
from __future__ import annotations

from pathlib import Path

from ..common import CLIError
from ..render import log, print_json


def register(subparsers) -> None:
    s = subparsers.add_parser("patch", description="Apply a pin's series in order (idempotent): patches/*.patch to "
                                                   "vendor/llama.cpp, or with --pin current patches/current/*.patch to "
                                                   "vendor/llama.cpp-current (that series may be empty). A patch that "
                                                   "does not apply fails with its name and hunk, and the tree is left "
                                                   "unchanged.")
    s.add_argument("--pin", choices=["mission", "current"], default="mission",
                   help="whose series on whose tree: mission (the default) or current")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="only check that the rest of the series would apply")
    g.add_argument("--status", action="store_true", help="list which patches are applied")
    g.add_argument("--reverse", action="store_true", help="reverse the applied patches")
    s.add_argument("--tree", metavar="DIR",
                   help="llama.cpp tree to work on (default: the pin's tree, vendor/llama.cpp or "
                        "vendor/llama.cpp-current of the checkout; for an installed package, the tree `pyllama-kv "
                        "vendor` puts in ~/.cache/pyllama-kv/src)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> int:
    from ... import _paths
    from ...harness import patch

    tree = Path(args.tree) if args.tree else _paths.vendor_dir(pin=args.pin)
    series = patch.series(_paths.patches_dir(pin=args.pin))
    if not tree.is_dir():
        flag = "" if args.pin == "mission" else f" --pin {args.pin}"
        raise CLIError(f"{tree} does not exist: run `pyllama-kv vendor{flag}` first")
    if args.status:
        st = patch.state(tree, series)
        rows = [{"name": p.name, "subject": p.subject(), "applied": a} for p, a in zip(st.patches, st.applied)]
        if args.json:
            print_json({"pin": args.pin, "tree": str(tree), "patches": rows, "conflict": st.conflict})
        else:
            if not rows:
                print(f"no patches in {_paths.patches_dir(pin=args.pin)}: the {args.pin} pin is built as released")
            for r in rows:
                print(f"{'applied ' if r['applied'] else 'pending '} {r['name']}  {r['subject']}")
            if st.conflict:
                print(f"conflict at {st.conflict}:\n{st.detail}")
        return 1 if st.conflict else 0
    if args.check:
        st = patch.check(tree, series)
        todo = [p.name for p in st.patches[st.n_applied:]]
        if args.json:
            print_json({"pin": args.pin, "tree": str(tree), "applied": [p.name for p in st.patches[:st.n_applied]],
                        "would_apply": todo})
        else:
            print(f"{st.n_applied} applied; {len(todo)} would apply cleanly" + (f": {', '.join(todo)}" if todo else ""))
        return 0
    if args.reverse:
        names = patch.reverse(tree, series)
        verb = "reversed"
    else:
        names = patch.apply(tree, series)
        verb = "applied"
    if args.json:
        print_json({"pin": args.pin, "tree": str(tree), verb: names})
    elif names:
        for n in names:
            log(f"{verb} {n}")
    elif not series:
        log(f"nothing to do: the {args.pin} pin's series ({_paths.patches_dir(pin=args.pin)}) is empty")
    else:
        log(f"nothing to do: the series is {'not applied' if args.reverse else 'already applied'} in {tree}")
    return 0
