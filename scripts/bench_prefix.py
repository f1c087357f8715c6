#!/usr/bin/env python3
"""Benchmark 4: prefix reuse. 8 requests share a 1,024-token prefix and differ in a 32-token tail.
Prints JSON.

Measured in one run, on the same context settings:
  full    each request evaluates its whole prompt in a fresh sequence;
  cache   pk.PrefixCache: the first request evaluates everything, the others fork the cached
          prefix and evaluate only their tail;
  ideal   the prefix evaluated once by hand, then each tail in a fork of it.
Reported: total and mean time to first token (the time until a request's next-token logits are
ready), tokens evaluated, and the ratios full/cache (the speed-up) and cache/ideal (the overhead of
the cache's bookkeeping over the hand-written ideal).

  python scripts/bench_prefix.py [--quick] [--json] [--prefix 1024] [--tail 32] [--requests 8]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import pyllama_kv as pk
from pyllama_kv.tools.bench import machine
from pyllama_kv.tools.gguf import make_tiny_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--tail", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3, help="repetitions; the best time of each method is kept")
    ap.add_argument("--quick", action="store_true", help="small sizes, for the test suite")
    ap.add_argument("--json", action="store_true", help="compact JSON")
    args = ap.parse_args(argv)
    P, T, R, layers, embd, repeat = args.prefix, args.tail, args.requests, args.layers, args.embd, args.repeat
    if args.quick:
        P, T, R, layers, embd, repeat = 128, 8, 4, 2, 64, 1
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 300, P).tolist()
    prompts = [prefix + rng.integers(3, 300, T).tolist() for _ in range(R)]
    n_ctx = ((P + R * T + P + T + 255) // 256) * 256
    kw = dict(n_ctx=n_ctx, n_seq_max=R + 4, n_batch=512, n_ubatch=512)
    out = {"benchmark": "prefix", "machine": machine(), "date": time.strftime("%Y-%m-%d"),
           "model": {"n_layer": layers, "n_embd": embd}, "prefix": P, "tail": T, "requests": R}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        mp = make_tiny_model(Path(tmp) / "m.gguf", n_layer=layers, n_embd=embd, n_head=8, n_head_kv=4, n_ff=2 * embd,
                             dtype="f16", n_ctx_train=max(4096, n_ctx))
        with pk.Model(mp) as m:
            ref_logits = {}

            def full(ctx):
                ttft = []
                for i, p in enumerate(prompts):
                    t = time.perf_counter()
                    s = ctx.new_sequence()
                    ref_logits[i] = s.extend(p)
                    ttft.append(time.perf_counter() - t)
                    s.close()
                return ttft, R * (P + T)

            def cache(ctx):
                pc = pk.PrefixCache(ctx, max_sequences=2)
                ttft, evaluated = [], 0
                for i, p in enumerate(prompts):
                    t = time.perf_counter()
                    s = pc.acquire(p)
                    lg = s.logits()
                    ttft.append(time.perf_counter() - t)
                    evaluated += len(p) - s.reused_tokens
                    assert np.abs(lg - ref_logits[i]).max() < 5e-2
                    pc.release(s, keep=False)
                pc.clear()
                return ttft, evaluated

            def ideal(ctx):
                ttft = []
                t = time.perf_counter()
                root = ctx.new_sequence()
                root.extend(prefix)
                t_prefix = time.perf_counter() - t
                for i, p in enumerate(prompts):
                    t = time.perf_counter()
                    s = root.fork()
                    s.extend(p[P:])
                    ttft.append(time.perf_counter() - t + (t_prefix if i == 0 else 0.0))
                    s.close()
                root.close()
                return ttft, P + R * T

            for name, fn in (("full", full), ("cache", cache), ("ideal", ideal)):
                best = None
                for _ in range(repeat):
                    with m.context(**kw) as ctx:
                        ttft, ev = fn(ctx)
                    if best is None or sum(ttft) < sum(best[0]):
                        best = (ttft, ev)
                ttft, ev = best
                results[name] = {"total_ms": round(sum(ttft) * 1000, 2), "mean_ttft_ms": round(np.mean(ttft) * 1000, 2),
                                 "first_ttft_ms": round(ttft[0] * 1000, 2),
                                 "later_mean_ttft_ms": round(float(np.mean(ttft[1:])) * 1000, 2) if R > 1 else None,
                                 "tokens_evaluated": ev}
                res = results[name]
                print(f"  {name:6} total {res['total_ms']:9.1f} ms, mean TTFT {res['mean_ttft_ms']:8.2f} ms, "
                      f"{ev} tokens evaluated", file=sys.stderr)
    out.update(results)
    out["speedup_full_over_cache"] = round(results["full"]["total_ms"] / results["cache"]["total_ms"], 2)
    out["overhead_cache_over_ideal"] = round(results["cache"]["total_ms"] / results["ideal"]["total_ms"], 3)
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
