"""`pyllama-kv stress`: the seeded server-like workload (tools/workload.run_stress, on the engine)."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import options
from ..common import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    MODEL_HELP,
    CLIError,
    add_deprecated_flag,
    add_lib_flag,
    check_ctx,
    check_output_file,
    lib_label,
    open_model,
    positive,
    set_phase,
    setup_logging,
)
from ..render import Progress, log, print_json, stress_table


def _default(name: str):
    from ...tools.workload import StressConfig

    return options.field_default(StressConfig, name)


def register(subparsers) -> None:
    s = subparsers.add_parser("stress", description="Requests arrive with prompts of random length (some sharing a "
                                                    "prefix, served by fork), generate a random number of tokens and "
                                                    "leave, so the cache fragments. Reports decode calls, tokens/s, "
                                                    "slot failures (batches refused although enough cells were "
                                                    "free), defrags, moves, graphs, retries and peak fragmentation.")
    s.add_argument("model", help=MODEL_HELP)
    add_lib_flag(s)
    s.add_argument("--parallel", type=int, default=_default("parallel"),
                   help="requests served at once (default %(default)s)")
    add_deprecated_flag(s, "--seqs", "--parallel", "parallel", type=int)
    options.add(s, "n_ctx", defaults={"n_ctx": _default("n_ctx")})
    s.add_argument("--steps", type=int, default=_default("steps"), help="decode steps (default %(default)s)")
    s.add_argument("--seed", type=int, default=_default("seed"), help="workload seed (default %(default)s)")
    s.add_argument("--sequential", action="store_true",
                   help="serve the same requests one after another (no fragmentation)")
    s.add_argument("--map", metavar="FILE.png", help="draw the cache occupancy over time into this image (needs "
                                                     "matplotlib; .png is added to a name without a suffix; "
                                                     "checked before the workload runs)")
    options.add(s, "n_threads", "rpc", "validate", "trust_unverified")
    s.add_argument("--json", action="store_true", help="print the result as JSON")


def stress_config(parallel: int, n_ctx: int, steps: int, seed: int, sequential: bool = False,
                  n_threads: int | None = None):
    """The workload's StressConfig, from flag values (checked, with the flags' names)."""
    from ...tools.workload import StressConfig

    positive("--parallel", parallel)
    positive("--ctx", n_ctx)
    positive("--steps", steps)
    positive("-t", n_threads)
    return StressConfig(parallel=parallel, n_ctx=n_ctx, steps=steps, seed=seed, sequential=sequential,
                        n_threads=n_threads)


def run_workload(model_path: str, lib: str | None, cfg, label: str, progress: bool,
                 rpc: list[str] | None = None, validate: str | None = None) -> tuple[dict, Any]:
    """Run the workload once on a model opened with ``lib``; return the result (as a dict) and the
    occupancy map (when cfg.record_map). Ctrl-C stops the workload with what ran (``interrupted``)."""
    from ...tools.workload import run_stress

    set_phase(f"loading the model ({label})")
    model = open_model(model_path, lib, rpc, validate)
    try:
        check_ctx(model, cfg.n_ctx)
        set_phase(f"starting the workload ({label})")  # run_stress itself stops cleanly on Ctrl-C
        res, occ = run_stress(model, cfg, progress=Progress(label, progress))
    finally:
        model.close()
    return res.as_dict(), occ


def check_map_path(out: str) -> Path:
    """The file ``--map`` will write, checked before the workload runs: matplotlib is there, the
    format is one it writes (no suffix: .png is added, as matplotlib would), and the file can be
    written. CLIError otherwise."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise CLIError("--map needs matplotlib: pip install 'pyllama-kv[map]' (or pip install matplotlib)") from None
    path = Path(out)
    if out and not out.endswith(("/", os.sep)) and not path.is_dir() and not path.suffix:
        path = path.with_name(path.name + ".png")
    formats = Figure().canvas.get_supported_filetypes()
    if path.suffix and path.suffix[1:].lower() not in formats:
        raise CLIError(f"--map {out}: matplotlib cannot write {path.suffix} files; use .png "
                       f"(or one of {', '.join('.' + f for f in sorted(formats))})")
    return check_output_file(str(path) if path != Path(out) else out, "the map")


def run(args) -> int:
    from ...tools.workload import draw_map

    setup_logging(args.debug)
    cfg = stress_config(args.parallel, args.n_ctx, args.steps, args.seed, args.sequential, args.n_threads)
    map_path = check_map_path(args.map) if args.map is not None else None  # before the workload, not after
    cfg = replace(cfg, record_map=map_path is not None)
    label = lib_label(args.lib)   # None: $PYLLAMA_KV_LIB, else patched, as pk.Model picks it
    d, occ = run_workload(options.model_path(args.model, args.trust_unverified), args.lib, cfg, label,
                          progress=not args.json, rpc=args.rpc, validate=args.validate)
    rc = EXIT_INTERRUPTED if d.get("interrupted") else 0
    if not args.json:  # the results first: a failure to draw the map must not lose them
        print(stress_table([(label, d)]), flush=True)
    map_error = None
    if map_path is not None:
        set_phase("drawing the map")
        try:
            if occ is None:
                raise CLIError("no step ran, so there is no map to draw")
            written = draw_map(occ, map_path, title=f"KV cache occupancy, {label} ({d['steps']} steps, "
                                                    f"seed {cfg.seed}); white: free, dark grey: shared prefix")
            d["map"] = str(written)
        except KeyboardInterrupt:
            map_error, rc = "interrupted while drawing the map", EXIT_INTERRUPTED
        except Exception as exc:
            if args.debug:
                raise
            map_error, rc = f"could not write the map {map_path}: {' '.join(str(exc).split())}", EXIT_ERROR
        if map_error:
            d["map_error"] = map_error
    if args.json:
        print_json(d)
    elif "map" in d:
        print(f"map: {d['map']}")
    if map_error:
        log(f"pyllama-kv stress: error: {map_error}")
    return rc
