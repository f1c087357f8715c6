#!/usr/bin/env python3
"""Benchmark: another client's latency while hostile grammars flood `pyllama-kv serve`. Prints JSON.

Issue 30 measured, before grammars were bounded and compiled in worker processes: 45 concurrent 24 KB
GBNF grammars made another client's 2-token completion take 32.9 s (0.05 s normally) and /health 6.9 s;
a 3,000-rule chain killed the server. Here, in one run against one server on the real model
(default: the catalogue's smollm2-135m-instruct):

  * quiet: a probe client sends 2-token completions and GET /health one after another, alone;
  * flood: the same probe while F clients send grammars at once, each different (no cache hit):
    24 KB GBNF grammars of 480 chained rules (the costliest that pass the bounds: each a ~0.3 s
    pure-Python conversion, in a worker) and 10,000-rule chains (Lark, GBNF, JSON schema $defs, in
    response_format and in a tool's parameters: refused by the bounds).

Printed: the probe's completion and /health latency (p50, p95, max) quiet and during the flood, their
ratios flood/quiet, the flood's answers by status, and whether the server still answers at the end.
The flood's requests carry max_tokens 2.

  python scripts/bench_grammar_flood.py [--quick] [--json] [--flood F] [--model NAME_OR_PATH] [-t THREADS]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import Server, free_port, percentile, pyllama_kv_cmd  # noqa: E402

from pyllama_kv.config import default_threads  # noqa: E402
from pyllama_kv.modelfile import catalogue  # noqa: E402
from pyllama_kv.tools.bench import machine  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-instruct"


def gbnf_chain(n: int, tag: int) -> str:
    return "root ::= r0\n" + "".join(f'r{i} ::= "x{tag}" r{i + 1}\n' for i in range(n)) + f'r{n} ::= "y"\n'


def flood_bodies(n: int, model: str) -> list[dict]:
    """``n`` hostile requests: mostly 24 KB grammars within the bounds, a fifth 10,000-rule chains."""
    out = []
    for i in range(n):
        kind = i % 5
        base = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": f"hi {i}"}]}
        if kind < 4 - (i % 2):
            out.append({**base, "grammar": gbnf_chain(480, i)})
        elif i % 3 == 0:
            out.append({**base, "grammar": "start: r0\n" + "".join(f'r{j}: "x" r{j + 1}\n' for j in range(10_000))
                        + 'r10000: "y"\n'})
        else:
            defs: dict = {f"d{j}": {"$ref": f"#/$defs/d{j + 1}"} for j in range(10_000)}
            defs["d10000"] = {"type": "string"}
            schema = {"$defs": defs, "$ref": "#/$defs/d0"}
            if i % 2:
                out.append({**base, "response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": schema}}})
            else:
                out.append({**base, "tool_choice": "required", "tools": [{"type": "function", "function": {
                    "name": "f", "parameters": {"type": "object", "properties": {"a": schema}}}}]})
    return out


def probe(url: str, model: str, stop: threading.Event, max_probes: int) -> dict:
    """2-token completions and /health, alternately, until ``stop`` (or ``max_probes`` of each)."""
    done, health, errors = [], [], 0
    with httpx.Client(timeout=120) as c:
        while not stop.is_set() and len(done) < max_probes:
            t = time.perf_counter()
            try:
                r = c.post(url + "/v1/completions", json={"model": model, "prompt": "The sky is", "max_tokens": 2,
                                                         "temperature": 0})
                errors += r.status_code != 200
            except httpx.HTTPError:
                errors += 1
            done.append(time.perf_counter() - t)
            t = time.perf_counter()
            try:
                errors += c.get(url + "/health").status_code != 200
            except httpx.HTTPError:
                errors += 1
            health.append(time.perf_counter() - t)
    stats = {}
    for name, xs in (("completion", done), ("health", health)):
        stats[name] = {"n": len(xs), "p50_s": percentile(xs, 0.5), "p95_s": percentile(xs, 0.95),
                       "max_s": max(xs) if xs else None}
    stats["errors"] = errors
    return stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small flood (the suite runs this)")
    ap.add_argument("--json", action="store_true", help="JSON only")
    ap.add_argument("--flood", type=int, default=None, help="hostile requests at once (default 45; quick 10)")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("-t", "--threads", type=int, default=default_threads())
    a = ap.parse_args(argv)
    flood = a.flood or (10 if a.quick else 45)
    model = catalogue.resolve(a.model)
    port = free_port()
    cmd = [*pyllama_kv_cmd(), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--ctx", "1024",
           "--parallel", "4", "--threads", str(a.threads), "--max-tokens-cap", "16"]
    out: dict = {"benchmark": "grammar-flood", "machine": machine(), "date": time.strftime("%Y-%m-%d"),
                 "model": str(model), "flood": flood}
    with tempfile.TemporaryDirectory() as logs, Server("ours", cmd, port, Path(logs)) as srv:
        name = srv.model_id()
        stop = threading.Event()
        out["quiet"] = probe(srv.url, name, stop, 10 if a.quick else 30)
        bodies = flood_bodies(flood, name)
        statuses: dict[str, int] = {}
        lock = threading.Lock()

        def send(body: dict) -> None:
            try:
                r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
                key = str(r.status_code)
            except httpx.HTTPError as e:
                key = type(e).__name__
            with lock:
                statuses[key] = statuses.get(key, 0) + 1

        t0 = time.perf_counter()
        with ThreadPoolExecutor(flood + 1) as ex:
            probing = ex.submit(probe, srv.url, name, stop, 10_000)
            list(ex.map(send, bodies))
            stop.set()
            out["flood_run"] = probing.result()
        out["flood_seconds"] = time.perf_counter() - t0
        out["flood_answers"] = statuses
        try:
            out["alive_after"] = httpx.get(srv.url + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            out["alive_after"] = False
        out["server_exited"] = srv.proc is not None and srv.proc.poll() is not None
    q, f = out["quiet"], out["flood_run"]
    out["ratios"] = {f"{k}_{s}": (f[k][s] / q[k][s]) if q[k][s] and f[k][s] is not None else None
                     for k in ("completion", "health") for s in ("p50_s", "p95_s")}
    print(json.dumps(out, indent=None if a.json else 2))
    if not a.json:
        print(f"another client's completion p95: {q['completion']['p95_s']:.3f} s quiet, "
              f"{f['completion']['p95_s']:.3f} s during the flood; /health p95 {q['health']['p95_s']:.3f} -> "
              f"{f['health']['p95_s']:.3f} s; flood answers {statuses}; alive after: {out['alive_after']}",
              file=sys.stderr)
    return 0 if out["alive_after"] and not f["errors"] and not q["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
