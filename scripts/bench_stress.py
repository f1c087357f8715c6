#!/usr/bin/env python3
"""Benchmark 3: the server-like workload (`pyllama-kv stress`) at 4, 8 and 16 sequences. Prints JSON.

For each concurrency, with the same seeds, in one run: the patched build, the vanilla build, and
the patched build serving the same requests one after another (--sequential: no fragmentation).
Reported: tokens/s, slot failures, slot retries and defrags (patched), the time spent in defrag as a
share of the run, and the ratios patched/vanilla and patched/sequential tokens/s.

  python scripts/bench_stress.py [--quick] [--json] [--parallel 4,8,16] [--seeds 0,1] [--steps 300]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import pyllama_kv as pk
from pyllama_kv.tools.bench import machine
from pyllama_kv.tools.gguf import make_tiny_model
from pyllama_kv.tools.workload import StressConfig, run_stress


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parallel", default="4,8,16", help="requests served at once, comma-separated")
    ap.add_argument("--seqs", dest="parallel", help=argparse.SUPPRESS)   # the old name of --parallel
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="one small configuration, for the test suite")
    ap.add_argument("--json", action="store_true", help="compact JSON")
    args = ap.parse_args(argv)
    parallels = [int(x) for x in args.parallel.split(",")]
    seeds = [int(x) for x in args.seeds.split(",")]
    steps, n_ctx = args.steps, args.ctx
    if args.quick:  # one thread: ggml's barriers crawl when the suite's other work takes the cores
        parallels, seeds, steps = [8], [0], 120
    out = {"benchmark": "stress", "machine": machine(), "date": time.strftime("%Y-%m-%d"),
           "model": {"n_layer": args.layers, "n_embd": args.embd}, "n_ctx": n_ctx, "steps": steps, "seeds": seeds,
           "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        mp = make_tiny_model(Path(tmp) / "m.gguf", n_layer=args.layers, n_embd=args.embd)
        models = {lib: pk.Model(mp, lib=lib) for lib in ("patched", "vanilla")}
        try:
            for n in parallels:
                agg = {}
                for mode, lib, sequential in (("patched", "patched", False), ("vanilla", "vanilla", False),
                                              ("sequential", "patched", True)):
                    tot = {"tokens": 0, "seconds": 0.0, "slot_failures": 0, "failed_requests": 0, "preempted": 0,
                           "defrags": 0, "slot_retries": 0, "defrag_seconds": 0.0, "completed": 0,
                           "peak_fragmentation": 0.0}
                    for seed in seeds:
                        cfg = StressConfig(parallel=n, n_ctx=n_ctx, steps=steps, seed=seed, sequential=sequential,
                                           n_threads=1 if args.quick else None)
                        r, _ = run_stress(models[lib], cfg)
                        d = r.as_dict()
                        tot["tokens"] += d["tokens"]
                        tot["seconds"] += d["seconds"]
                        tot["slot_failures"] += d["slot_failures"]
                        tot["failed_requests"] += d["failed_requests"]
                        tot["preempted"] += d["preempted"]
                        tot["completed"] += d["requests"]["completed"]
                        tot["defrags"] += d["kv"].get("defrags") or 0
                        tot["slot_retries"] += d["kv"].get("slot_retries") or 0  # 0 on vanilla (no counter)
                        tot["defrag_seconds"] += d["kv"].get("defrag_seconds") or 0.0
                        tot["peak_fragmentation"] = max(tot["peak_fragmentation"], d["peak_fragmentation"])
                    tot["tokens_per_s"] = round(tot["tokens"] / tot["seconds"], 1)
                    tot["defrag_share"] = round(tot["defrag_seconds"] / tot["seconds"], 4) if lib == "patched" else None
                    tot["seconds"] = round(tot["seconds"], 3)
                    tot["defrag_seconds"] = round(tot["defrag_seconds"], 4)
                    agg[mode] = tot
                pat, van, seq = agg["patched"], agg["vanilla"], agg["sequential"]
                row = {"parallel": n, **agg,
                       "patched_vs_vanilla_tps": round(pat["tokens_per_s"] / van["tokens_per_s"], 3),
                       "patched_vs_sequential_tps": round(pat["tokens_per_s"] / seq["tokens_per_s"], 3)}
                out["rows"].append(row)
                print(f"  parallel {n:2}: patched {pat['tokens_per_s']:8.1f} tok/s ({pat['slot_failures']} "
                      f"failures, defrag {pat['defrag_share']:.1%}), vanilla {van['tokens_per_s']:8.1f} "
                      f"({van['slot_failures']} failures), sequential {seq['tokens_per_s']:8.1f}",
                      file=sys.stderr)
        finally:
            for m in models.values():
                m.close()
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
