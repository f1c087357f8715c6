"""`pyllama-kv`: the command line.

Every subcommand has --help; data-producing ones have --json. Errors are one line on stderr and a
non-zero exit code (no traceback unless --debug).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_ERROR = 1
EXIT_USAGE = 2


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code EXIT_ERROR."""


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


# ---------------------------------------------------------------------------------------------
# harness commands


def cmd_vendor(args) -> int:
    from . import vendor

    res = vendor.vendor(source=Path(args.source) if args.source else None, force=args.force, log=_log)
    if args.json:
        _print_json({"path": str(res.path), "revision": res.revision, "source": res.source,
                     "changed": res.changed, "files": res.files})
    return 0


def cmd_patch(args) -> int:
    from . import _paths, patch

    tree = Path(args.tree) if args.tree else _paths.vendor_dir()
    if args.status:
        st = patch.state(tree)
        rows = [{"name": p.name, "subject": p.subject(), "applied": a} for p, a in zip(st.patches, st.applied)]
        if args.json:
            _print_json({"tree": str(tree), "patches": rows, "conflict": st.conflict})
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
            _print_json({"tree": str(tree), "applied": [p.name for p in st.patches[:st.n_applied]], "would_apply": todo})
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
        _print_json({"tree": str(tree), verb: names})
    elif names:
        for n in names:
            _log(f"{verb} {n}")
    else:
        _log(f"nothing to do: the series is {'not applied' if args.reverse else 'already applied'} in {tree}")
    return 0


def cmd_build(args) -> int:
    from . import build

    m = build.build(
        variant="vanilla" if args.vanilla else "patched",
        backend=args.backend,
        tools=args.tools,
        cuda_arch=args.cuda_arch,
        jobs=args.jobs,
        force=args.force,
        extra_cmake=args.cmake_arg,
        log=_log,
    )
    if args.json:
        _print_json(m)
    else:
        print(m["lib"])
    return 0


def cmd_status(args) -> int:
    from . import build

    st = build.status()
    if args.json:
        _print_json(st)
        return 0
    v = st["vendor"]
    print(f"llama.cpp revision  {st['revision']}  ({st['pin']['source']}, cached: {'yes' if st['pin']['cached'] else 'no'})")
    print(f"vendor tree         {v['path']}: {v['state']}")
    for p in st["patches"]:
        print(f"  {'[x]' if p['applied'] else '[ ]'} {p['name']}")
    if not st["builds"]:
        print("builds              none (run `pyllama-kv build`)")
    for b in st["builds"]:
        print(f"build {b['variant']}-{b['backend']:<6} {b['lib']}" + (f"  (stale: {b['stale']})" if b["stale"] else ""))
    return 0


# ---------------------------------------------------------------------------------------------
# parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pyllama-kv",
        description="Run GGUF models with many sequences at once over a patched llama.cpp KV cache.",
        epilog="Run `pyllama-kv COMMAND --help` for each command's options.",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks and llama.cpp's log")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    s = sub.add_parser("vendor", help="fetch the pinned llama.cpp into vendor/llama.cpp (cached download)",
                       description="Fetch the pinned llama.cpp source (the llama-cpp-python sdist from PyPI, "
                                   "sha256-checked, cached in ~/.cache/pyllama-kv) into vendor/llama.cpp.")
    s.add_argument("--source", metavar="PATH", help="use an existing llama.cpp checkout or tarball at the pinned revision")
    s.add_argument("--force", action="store_true", help="replace vendor/llama.cpp even if it already holds the pin")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_vendor)

    s = sub.add_parser("patch", help="apply our KV-cache patch series to vendor/llama.cpp",
                       description="Apply patches/*.patch in order (idempotent). A patch that does not apply "
                                   "fails with its name and hunk, and the tree is left unchanged.")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="only check that the rest of the series would apply")
    g.add_argument("--status", action="store_true", help="list which patches are applied")
    g.add_argument("--reverse", action="store_true", help="reverse the applied patches")
    s.add_argument("--tree", metavar="DIR", help="llama.cpp tree to work on (default: vendor/llama.cpp)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_patch)

    s = sub.add_parser("build", help="build libllama (patched by default, or --vanilla)",
                       description="Build libllama with CMake into build/<variant>-<backend>/ (reused when up to date).")
    s.add_argument("--vanilla", action="store_true", help="build the same revision without our patches")
    s.add_argument("--backend", choices=["cpu", "cuda", "metal"], default=None,
                   help="compute backend (default: metal on macOS, cpu elsewhere)")
    s.add_argument("--cuda-arch", metavar="ARCHS", help="CMAKE_CUDA_ARCHITECTURES for --backend cuda (default: native)")
    s.add_argument("--tools", action="store_true", help="also build llama.cpp's llama-batched-bench (for benchmarks)")
    s.add_argument("-j", "--jobs", type=int, help="parallel compile jobs (default: all cores)")
    s.add_argument("--force", action="store_true", help="rebuild even if up to date")
    s.add_argument("--cmake-arg", action="append", metavar="-DX=Y", help="extra CMake argument (repeatable)")
    s.add_argument("--json", action="store_true", help="print the build manifest as JSON")
    s.set_defaults(func=cmd_build)

    s = sub.add_parser("status", help="pinned revision, vendor tree, patches and builds",
                       description="Show the pinned revision, the vendor tree's state, which patches are "
                                   "applied, and each build with its library path.")
    s.add_argument("--json", action="store_true", help="print as JSON")
    s.set_defaults(func=cmd_status)

    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    from .build import BuildError
    from .patch import PatchError
    from .vendor import VendorError

    known = (CLIError, VendorError, PatchError, BuildError)
    try:
        from . import errors as _errors  # the API's exceptions, when the API is importable
        known = known + (_errors.LlamaError,)
    except ImportError:  # pragma: no cover
        pass
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        _log("interrupted")
        return 130
    except known as exc:
        if args.debug:
            raise
        msg = str(exc).strip()
        first, _, rest = msg.partition("\n")
        _log(f"pyllama-kv {args.command}: error: {first}")
        if rest and isinstance(exc, (PatchError, BuildError)):
            _log(rest)
        return EXIT_ERROR
    except (OSError, ValueError) as exc:
        if args.debug:
            raise
        _log(f"pyllama-kv {args.command}: error: {exc}")
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
