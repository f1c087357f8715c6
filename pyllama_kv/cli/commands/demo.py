"""`pyllama-kv demo`: the main job on the built-in tiny model: the stress workload on the vanilla and
the patched build side by side, then one `run` of 4 continuations. It calls the workload and the
run logic directly (stress.run_workload, run.generate)."""
from __future__ import annotations

from .. import options
from ..common import EXIT_INTERRUPTED, phase, setup_logging
from ..render import log, print_json, stress_table

PROMPT = b"The KV cache of the model"


def register(subparsers) -> None:
    s = subparsers.add_parser("demo", description="Make the tiny model in ~/.cache/pyllama-kv/models, run `stress` "
                                                  "on the vanilla and the patched build side by side, print the "
                                                  "comparison, then a short `run --parallel 4`.")
    s.add_argument("--seed", type=int, default=0, help="workload and sampling seed (default %(default)s)")
    s.add_argument("--quick", action="store_true", help="a shorter workload")
    options.add(s, "n_threads")
    s.add_argument("--json", action="store_true", help="print the stress results as JSON")


def run(args) -> int:
    from ... import _paths
    from ...config import SamplingParams
    from ...tools.gguf import make_tiny_model
    from ...tools.workload import StressConfig
    from .run import RunSpec, generate
    from .stress import run_workload, stress_config

    setup_logging(args.debug)
    mpath = _paths.cache_dir() / "models" / "tiny-demo-2l-64.gguf"
    if not mpath.is_file():
        log(f"making the built-in tiny model at {mpath} ...")
        make_tiny_model(mpath, n_layer=2, n_embd=64, seed=0)
    defaults = {name: options.field_default(StressConfig, name) for name in ("n_seqs", "n_ctx", "steps")}
    steps = 120 if args.quick else defaults["steps"]
    print(f"pyllama-kv demo: a server-like workload ({defaults['n_seqs']} requests at once, {defaults['n_ctx']} KV "
          f"cells, {steps} steps, seed {args.seed}) on the vanilla and the patched llama.cpp\n")
    results: list[tuple[str, dict]] = []
    for lib in ("vanilla", "patched"):
        cfg = stress_config(defaults["n_seqs"], defaults["n_ctx"], steps, args.seed, n_threads=args.n_threads)
        try:
            d, _ = run_workload(str(mpath), lib, cfg, lib, progress=not args.json)
        except KeyboardInterrupt:
            if not results or args.json:
                raise  # main() says what was interrupted
            print()
            print(stress_table(results))
            log(f"pyllama-kv demo: interrupted while {phase()}")
            return EXIT_INTERRUPTED
        results.append((lib, d))
        if d.get("interrupted"):  # Ctrl-C: show what ran, and stop there
            break
    if args.json:
        print_json({"model": str(mpath), "stress": dict(results)})
        return EXIT_INTERRUPTED if results[-1][1].get("interrupted") else 0
    print()
    print(stress_table(results))
    if results[-1][1].get("interrupted"):
        log(f"pyllama-kv demo: interrupted during the {results[-1][0]} workload")
        return EXIT_INTERRUPTED
    van, pat = results[0][1], results[1][1]
    print()
    if van["slot_failures"]:
        print(f"vanilla: {van['slot_failures']} batches refused (\"failed to find KV cache slot\") with on average "
              f"{van['free_at_failures']:.0%} of the cache free; {van['failed_requests']} requests failed.")
    print(f"patched: {pat['slot_failures']} refused; {pat['kv'].get('slot_retries')} slot searches recovered by a "
          f"full defrag ({pat['kv'].get('moves')} block moves, {pat['kv'].get('defrag_share', 0):.1%} of the run); "
          f"{pat['tokens']} tokens processed vs {van['tokens']}.")
    print("\nNow 4 continuations of one prompt: evaluated once, forked 3 times, decoded together:\n", flush=True)
    params = SamplingParams(seed=args.seed if args.seed >= 0 else None)
    return generate(RunSpec(model=str(mpath), prompt=PROMPT, params=params, n_predict=24, parallel=4,
                            n_threads=args.n_threads))

