"""`pyllama-kv build`: build libllama: patched or vanilla (the mission pin), or current (the current llama.cpp)."""
from __future__ import annotations

import shlex
import sys

from ...harness.cuda import DEFAULT_ARCHS, FETCH_FLAG, fetch_command
from ..common import CLIError
from ..render import log, print_json


def register(subparsers) -> None:
    s = subparsers.add_parser("build", description="Build libllama with CMake into build/<variant>-<backend>/ "
                                                   "(reused when up to date).")
    s.add_argument("--pin", choices=["mission", "current"], default="mission",
                   help="which llama.cpp: mission (8733e0c with our series: build/patched-<backend>, the default) or "
                        "current (the current llama.cpp with patches/current/: build/current-<backend>; run "
                        "`pyllama-kv vendor --pin current` first)")
    s.add_argument("--vanilla", action="store_true", help="build the mission pin's revision without our patches")
    s.add_argument("--backend", choices=["cpu", "cuda", "metal"], default=None,
                   help="compute backend (default: metal on macOS, cpu elsewhere)")
    s.add_argument("--cuda-arch", metavar="ARCHS",
                   help="CMAKE_CUDA_ARCHITECTURES for --backend cuda, e.g. 90 or '80;90' (default: the GPUs that "
                        f"nvidia-smi lists, else {DEFAULT_ARCHS}; each architecture adds to the compile time)")
    s.add_argument("--fetch-cublas", action="store_true",
                   help="for --backend cuda when the toolkit lacks cuBLAS: download NVIDIA's nvidia-cublas wheel for "
                        "nvcc's CUDA version (about 400 MB) into ~/.cache/pyllama-kv with pip and build with it")
    s.add_argument("--peer", action="store_true",
                   help="build only the current llama.cpp's llama-server and llama-batched-bench, unpatched and "
                        "statically linked, apart from our builds (from vendor/llama.cpp-current, the current "
                        "pin's tree, vendored if missing; built in ~/.cache/pyllama-kv/peer), for the benchmarks "
                        "that compare with the strongest peer")
    s.add_argument("--tools", action="store_true",
                   help="also build llama.cpp's llama-batched-bench and llama-server of that pin (for the benchmarks)")
    rpc = s.add_mutually_exclusive_group()
    rpc.add_argument("--rpc", action="store_true", default=None,
                     help="with ggml's RPC backend, and build rpc-server (ggml-rpc-server on the current pin): "
                          "offload layers to other machines "
                          "(pk.Model(..., rpc=[...]), --rpc HOST:PORT on the commands that load a model); "
                          "kept by later builds")
    rpc.add_argument("--no-rpc", dest="rpc", action="store_false", help="without the RPC backend")
    s.add_argument("-j", "--jobs", type=int, help="parallel compile jobs (default: all cores)")
    s.add_argument("--force", action="store_true", help="rebuild even if up to date")
    s.add_argument("--cmake-arg", action="append", metavar="-DX=Y", help="extra CMake argument (repeatable)")
    s.add_argument("--json", action="store_true", help="print the build manifest as JSON")


def _with_fetch(args, exc) -> bool:
    """cuBLAS is missing: the error names the command to run again; on a terminal, offer to run it."""
    again = shlex.join(["pyllama-kv", *sys.argv[1:], FETCH_FLAG])
    exc.args = (str(exc).replace(f"`{fetch_command()}`", f"`{again}`"),)
    if not (sys.stdin.isatty() and sys.stderr.isatty()):
        return False
    log(str(exc))
    try:
        answer = input("Download cuBLAS now and build? [y/N] ")
    except EOFError:
        answer = ""
    return answer.strip().lower() in ("y", "yes")


def run(args) -> int:
    from ...harness import build
    from ...harness.cuda import CublasMissing

    if args.peer:
        from ...harness.peer import build_peer

        m = build_peer(jobs=args.jobs, force=args.force, log=log)
        print_json(m) if args.json else print(m["server"])
        return 0

    if args.vanilla and args.pin != "mission":
        raise CLIError("--vanilla is the mission pin without our series; the current pin has no vanilla build yet "
                       "(its series, patches/current/, is applied to build/current-<backend>)")
    variant = "current" if args.pin == "current" else "vanilla" if args.vanilla else "patched"

    def go(fetch: bool) -> dict:
        return build.build(variant=variant, backend=args.backend, tools=args.tools,
                           cuda_arch=args.cuda_arch, jobs=args.jobs, force=args.force, extra_cmake=args.cmake_arg,
                           log=log, rpc=args.rpc, fetch_cublas=fetch)

    try:
        m = go(args.fetch_cublas)
    except CublasMissing as exc:
        if args.fetch_cublas or not _with_fetch(args, exc):
            raise
        m = go(True)
    if args.json:
        print_json(m)
    else:
        print(m["lib"])
    return 0
