#!/usr/bin/env python3
"""Benchmark: two replicas on Ray Serve, routed by cache against round-robin and Ray's power of two
choices, and one server with the same total slots, cells and threads. Prints a table (or JSON).

One after another in one run, each a subprocess on 127.0.0.1 with a free port (the same model,
default: the catalogue's smollm2-135m-instruct; greedy, non-streaming chat requests):
  * replicas-prefix:  `pyllama-kv serve --replicas 2 --router prefix`  (each replica: P slots, T threads,
                      N cells)
  * replicas-rr:      the same with `--router round-robin`
  * replicas-pow2:    the same with `--router pow2` (Ray's default)
  * one-server:       `pyllama-kv serve` with 2P slots, 2T threads and 2N cells
The load: S system prompts, C conversations (conversation i under system prompt i mod S) of K turns
each; every client takes the next conversation and sends its turns in order (each turn carries the
conversation so far). Reported per setup: the prompt tokens served from a cache
(usage.prompt_tokens_details.cached_tokens) of all prompt tokens, completion tokens/s over the wall
time, p95 latency of the first turns and of the later turns, errors. On this 2-core machine the two
replicas share the cores one server has; the routers' difference is in the cached tokens.

  python scripts/bench_replicas.py [--quick] [--json] [--model NAME_OR_PATH] [--clients 4]
                                   [--prefix-cache 4] [--cache-ram 256] [--ctx 4096] [--only replicas-prefix,...]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import Server, free_port, percentile, pyllama_kv_cmd  # noqa: E402

from pyllama_kv.tools.bench import fan_out, machine  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-instruct"
SETUPS = ("replicas-prefix", "replicas-rr", "replicas-pow2", "one-server")
ROUTER = {"replicas-prefix": "prefix", "replicas-rr": "round-robin", "replicas-pow2": "pow2"}
TOPICS = ["gardening", "astronomy", "cooking", "sailing", "chess", "bicycles", "tea", "birds", "trains", "pottery"]


def conversations(n_sys: int, n_conv: int, turns: int, seed: int) -> tuple[list[str], list[list[str]]]:
    """The system prompts (each ~150 tokens) and each conversation's user messages."""
    rng = random.Random(seed)
    systems = []
    for i in range(n_sys):
        topic = TOPICS[i % len(TOPICS)]
        rules = " ".join(f"Rule {k}: when asked about {rng.choice(TOPICS)}, relate it to {topic} in one line."
                         for k in range(8))
        systems.append(f"You are assistant {i}, an expert on {topic}. Answer in one short sentence. {rules}")
    users = [[f"Conversation {c}, question {t}: tell me one thing about {rng.choice(TOPICS)}." for t in range(turns)]
             for c in range(n_conv)]
    return systems, users


def server_cmd(setup: str, model: str, port: int, args) -> list[str]:
    common = [*pyllama_kv_cmd(), "serve", model, "--port", str(port), "--max-tokens", "4096"]
    if setup == "one-server":
        return [*common, "--parallel", str(2 * args.slots), "--threads", str(2 * args.threads),
                "--ctx", str(2 * args.ctx), "--prefix-cache", str(2 * args.prefix_cache),
                "--cache-ram", str(2 * args.cache_ram)]
    return [*common, "--replicas", "2", "--router", ROUTER[setup], "--parallel", str(args.slots),
            "--threads", str(args.threads), "--ctx", str(args.ctx), "--prefix-cache", str(args.prefix_cache),
            "--cache-ram", str(args.cache_ram), "--replica-cpus", "1"]


def run_conversation(client: httpx.Client, url: str, model: str, system: str, users: list[str],
                     max_tokens: int) -> list[dict]:
    msgs = [{"role": "system", "content": system}]
    out = []
    for turn, text in enumerate(users):
        msgs.append({"role": "user", "content": text})
        t0 = time.perf_counter()
        try:
            r = client.post(f"{url}/v1/chat/completions", json={"model": model, "messages": msgs, "temperature": 0,
                                                                 "max_tokens": max_tokens})
            ok = r.status_code == 200
            body = r.json() if ok else {}
        except (httpx.HTTPError, ValueError):
            ok, body = False, {}
        dt = time.perf_counter() - t0
        if not ok:
            out.append({"turn": turn, "ok": False, "latency": dt})
            break
        u = body["usage"]
        out.append({"turn": turn, "ok": True, "latency": dt, "prompt": u["prompt_tokens"],
                    "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                    "completion": u["completion_tokens"]})
        msgs.append(body["choices"][0]["message"])
    return out


def run_setup(setup: str, model: str, args, systems, users, log_dir: Path) -> dict:
    port = free_port()
    env_note = os.environ.get("RAY_ADDRESS")
    if env_note and setup != "one-server":
        print(f"  (RAY_ADDRESS={env_note}: the replicas join that cluster)", file=sys.stderr)
    with Server(setup, server_cmd(setup, model, port, args), port, log_dir) as srv:
        mid = srv.model_id()
        n = len(users)
        convs, wall = fan_out(n, args.clients, lambda c, i: run_conversation(
            c, srv.url, mid, systems[i % len(systems)], users[i], args.max_tokens),
            lambda: httpx.Client(timeout=600.0))
    turns = [t for conv in convs for t in (conv or [])]
    ok = [t for t in turns if t["ok"]]
    first = [t["latency"] for t in ok if t["turn"] == 0]
    later = [t["latency"] for t in ok if t["turn"] > 0]
    return {"setup": setup, "requests": len(turns), "errors": len(turns) - len(ok) + (n * args.turns - len(turns)),
            "prompt_tokens": sum(t["prompt"] for t in ok), "cached_tokens": sum(t["cached"] for t in ok),
            "completion_tokens": sum(t["completion"] for t in ok), "wall_s": wall,
            "tok_s": sum(t["completion"] for t in ok) / wall if wall else 0.0,
            "p95_first_s": percentile(first, 0.95) if first else None,
            "p95_later_s": percentile(later, 0.95) if later else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--systems", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--slots", type=int, default=2, help="slots per replica (one server: twice)")
    ap.add_argument("--threads", type=int, default=1, help="threads per replica (one server: twice)")
    ap.add_argument("--ctx", type=int, default=4096, help="cells per replica (one server: twice)")
    ap.add_argument("--prefix-cache", type=int, default=4, help="cached prefixes per replica (one server: twice)")
    ap.add_argument("--cache-ram", type=int, default=256, help="MiB of host tier per replica (one server: twice; "
                    "0: an evicted prefix is dropped, so what each replica can keep is bounded by its cells)")
    ap.add_argument("--only", default=",".join(SETUPS))
    ap.add_argument("--quick", action="store_true", help="4 system prompts, 8 conversations of 2 turns")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.systems, args.conversations, args.turns = 4, 8, 2
    from pyllama_kv.modelfile import names

    model = str(names.resolve(args.model))
    setups = [s for s in args.only.split(",") if s]
    bad = [s for s in setups if s not in SETUPS]
    if bad:
        ap.error(f"--only: unknown setup(s) {', '.join(bad)} (choose from {', '.join(SETUPS)})")
    systems, users = conversations(args.systems, args.conversations, args.turns, args.seed)
    rows = []
    with tempfile.TemporaryDirectory() as logs:
        for s in setups:
            print(f"{s}: {args.conversations} conversations x {args.turns} turns, {args.clients} clients ...",
                  file=sys.stderr, flush=True)
            rows.append(run_setup(s, model, args, systems, users, Path(logs)))
    out = {"benchmark": "replicas", "model": Path(model).name, "machine": machine(), "clients": args.clients,
           "prefix_cache": args.prefix_cache, "cache_ram": args.cache_ram, "ctx": args.ctx, "systems": args.systems,
           "conversations": args.conversations, "turns": args.turns, "rows": rows}
    by = {r["setup"]: r for r in rows}
    if "replicas-prefix" in by and "replicas-rr" in by and by["replicas-rr"]["cached_tokens"]:
        out["prefix_vs_rr_cached"] = by["replicas-prefix"]["cached_tokens"] / by["replicas-rr"]["cached_tokens"]
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['model']}, {args.clients} clients, {args.systems} system prompts, {args.conversations} "
          f"conversations x {args.turns} turns; per replica: {args.ctx} cells, {args.prefix_cache} cached prefixes, "
          f"{args.cache_ram} MiB host tier; {out['machine'].get('cpu')}, {out['machine'].get('cores')} cores")
    print(f"{'setup':<17}{'cached/prompt tokens':>22}{'tok/s':>8}{'p95 first':>11}{'p95 later':>11}{'errors':>8}")
    for r in rows:
        share = f"{r['cached_tokens']}/{r['prompt_tokens']}"
        f95 = f"{r['p95_first_s']:.2f}s" if r["p95_first_s"] is not None else "-"
        l95 = f"{r['p95_later_s']:.2f}s" if r["p95_later_s"] is not None else "-"
        print(f"{r['setup']:<17}{share:>22}{r['tok_s']:>8.1f}{f95:>11}{l95:>11}{r['errors']:>8}")
    if "prefix_vs_rr_cached" in out:
        print(f"cached prompt tokens, prefix / round-robin: {out['prefix_vs_rr_cached']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
