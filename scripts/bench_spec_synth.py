#!/usr/bin/env python3
"""Benchmark: speculative decoding's speed-up against acceptance and clients, on a model large enough
to be memory-bound here (a timing model: a Llama-3.2-3B-shaped GGUF of random F16 weights, made once
into the cache; ``--dtype q4_0`` for a compute-bound one). Prints a table (or JSON).

Its text is noise, so the drafts are synthetic, as llama-server's ``--spec-synth-rates``: a run
without speculation gives every request's greedy answer, and the drafts of the runs with speculation
are that answer with each token replaced by a wrong one with probability 1 - acceptance (the cost rule
takes them as it would any draft, learning their acceptance). In-process engine, one after another in
one run: for each client count, the run without speculation, then one per acceptance rate; each row
checks that the answers are the same tokens.

  python scripts/bench_spec_synth.py [--quick] [--json] [--shape llama3-3b] [--clients 1,4,8]
                                     [--acceptance 0.5,0.8,0.95] [--tokens 48] [-t THREADS]
                                     [--dtype f16|q4_0] [--warmup 16]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import pyllama_kv as pk
from pyllama_kv import _paths
from pyllama_kv.config import default_threads
from pyllama_kv.engine import GREEDY, Engine, EngineConfig
from pyllama_kv.speculation.drafts import Draft
from pyllama_kv.tools.bench import machine
from pyllama_kv.tools.gguf import TIMING_DTYPES, make_timing_model


def timing_model(shape: str, layers: int | None, dtype: str) -> Path:
    name = f"{shape}{'' if layers is None else f'-{layers}l'}{'' if dtype == 'q4_0' else f'-{dtype}'}.gguf"
    path = _paths.cache_dir() / "timing" / name
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing the timing model {path}", file=sys.stderr)
        make_timing_model(path, shape, n_layer=layers, dtype=dtype)
    return path


def synthetic(engine: Engine, answers: list[list[int]], acceptance: float, seed: int) -> None:
    """Drafts from ``answers`` with each token wrong with probability 1 - ``acceptance``."""
    rng = random.Random(seed)

    def propose(tokens, state, k):
        n = len(tokens)
        for full in answers:
            if len(full) > n and full[:n] == list(tokens):
                d = list(full[n:n + k])
                return Draft([t if rng.random() < acceptance else (t + 1) % engine.n_vocab for t in d], "ngram", 16)
        return None
    engine.spec.propose = propose


def one_run(model, cfg: EngineConfig, prompts: list[list[int]], tokens: int, answers=None, acceptance=1.0,
            warmup: int = 0):
    """One engine: ``warmup`` tokens of every prompt first, not timed (a server's cost rule has measured
    its batch sizes long before; a fresh engine's first steps probe them), then the timed requests."""
    with Engine(model, cfg) as e:
        if answers is not None:
            synthetic(e, answers, acceptance, seed=len(prompts))
        if warmup:
            for h in [e.submit(p, GREEDY, max_tokens=warmup, keep=False) for p in prompts]:
                e.run_until_idle()
                h.result()
        steps0, drafted0, accepted0 = e.stats.steps, e.stats.spec.drafted, e.stats.spec.accepted
        hs = [e.submit(p, GREEDY, max_tokens=tokens, keep=False) for p in prompts]
        t0 = time.perf_counter()
        e.run_until_idle()
        wall = time.perf_counter() - t0
        done = [h.result()[0] for h in hs]
        st = e.stats.spec
        return {"wall_s": round(wall, 3), "tps": round(sum(len(c.tokens) for c in done) / wall, 3),
                "steps": e.stats.steps - steps0, "drafted": st.drafted - drafted0,
                "accepted": st.accepted - accepted0}, [c.context_tokens for c in done], [c.tokens for c in done]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-3b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers (a faster, smaller model)")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--acceptance", default="0.5,0.8,0.95")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=16,
                    help="tokens of every prompt generated first, not timed, on each engine (default 16; 0: cold)")
    ap.add_argument("--dtype", choices=TIMING_DTYPES, default="f16",
                    help="the weights' type (default f16: a decode here is memory-bound; q4_0: compute-bound)")
    ap.add_argument("--quick", action="store_true", help="a 2-layer model, 1 client, one rate (the suite's run)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("-t", "--threads", type=int, default=default_threads())
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.clients, args.acceptance, args.tokens = 2, "1", "0.8", 16
    model = pk.Model(timing_model(args.shape, args.layers, args.dtype))
    rows = []
    for c in (int(x) for x in args.clients.split(",")):
        prompts = [[(7 * i + j) % 1000 + 300 for j in range(24)] for i in range(c)]
        cfg = EngineConfig(n_ctx=256 * c, parallel=c, n_threads=args.threads, prefix_cache=0)
        base, contexts, want = one_run(model, cfg, prompts, args.tokens, warmup=args.warmup)
        rows.append({"clients": c, "acceptance": None, **base})
        print(f"  {c} client(s): no speculation {base['tps']} tok/s", file=sys.stderr)
        spec_cfg = EngineConfig(n_ctx=256 * c, parallel=c, n_threads=args.threads, prefix_cache=0, spec="ngram")
        for a in (float(x) for x in args.acceptance.split(",")):
            r, _, got = one_run(model, spec_cfg, prompts, args.tokens, contexts, a, warmup=args.warmup)
            r.update(clients=c, acceptance=a, speedup=round(r["tps"] / base["tps"], 3), same=got == want)
            rows.append(r)
            print(f"  {c} client(s), acceptance {a}: {r['tps']} tok/s, {r['speedup']}x", file=sys.stderr)
    model.close()
    out = {"benchmark": "spec_synth", "shape": args.shape, "dtype": args.dtype, "layers": args.layers,
           "threads": args.threads, "tokens": args.tokens, "warmup": args.warmup, "machine": machine(),
           "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{args.shape} timing model ({args.dtype}), {args.threads} threads, {args.tokens} tokens a request")
    for r in rows:
        what = "no speculation" if r["acceptance"] is None else f"acceptance {r['acceptance']}"
        tail = "" if r["acceptance"] is None else (f"  {r['speedup']}x, {r['accepted']}/{r['drafted']} kept, "
                                                   f"same answers: {r['same']}")
        print(f"  {r['clients']} client(s)  {what:<18}{r['tps']:>8} tok/s  {r['steps']:>4} steps{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
