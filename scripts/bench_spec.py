#!/usr/bin/env python3
"""Benchmark: speculative decoding, ours against the current llama-server's, on loads where the answer
repeats the prompt and on one where it does not. Prints a table (or JSON).

One after another in one run, on the same model (default: the catalogue's smollm2-135m-instruct), the
same KV cells, slots and threads, each server a subprocess on 127.0.0.1 with a free port:
  * ours-off:     `pyllama-kv serve --spec none`
  * ours-ngram:   `pyllama-kv serve --spec ngram` (each answer's own prompt and output)
  * ours-cache:   `pyllama-kv serve --spec ngram,cache` (and every conversation the server finished)
  * peer-off:     the current llama-server (`pyllama-kv build --peer`), no speculation
  * peer-simple:  the same with `--spec-type ngram-simple`
  * peer-mod:     the same with `--spec-type ngram-mod`
The loads (seeded, greedy, non-streaming chat requests; C clients take them in order):
  * code:   a ~45-line Python file, returned with one rename (the answer repeats the prompt);
  * agents: a JSON record given in the prompt written back with one field changed (the arguments of a
            tool call that echo a record);
  * chat:   short open questions about a made-up town (nothing to repeat: speculation must not lose).
Each load sends max(2, C) requests at C clients (`--requests N`: N). Reported per server, load and client count:
completion tokens/s (all completion tokens over the wall
time), p95 latency, errors, the drafted and accepted tokens (timings.draft_n / draft_n_accepted, as
llama-server names them); then ours-best / ours-off and ours-best / peer-best per load and clients, and
how many of our answers with speculation equal ours without (greedy: the same on F32 weights; on a
quantized model a different batch shape may flip a near-tie).

  python scripts/bench_spec.py [--quick] [--json] [--model NAME_OR_PATH] [--clients 1,4,8]
                               [--only ours-off,ours-ngram,...] [--loads code,agents,chat] [-t THREADS]
                               [--kv-type f16|f32] [--requests N]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import Server, free_port, percentile, pyllama_kv_cmd  # noqa: E402

from pyllama_kv.config import default_threads  # noqa: E402
from pyllama_kv.harness.peer import build_peer, find_peer_server  # noqa: E402
from pyllama_kv.tools.bench import fan_out, machine  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-instruct"
SERVERS = ("ours-off", "ours-ngram", "ours-cache", "peer-off", "peer-simple", "peer-mod")
REQUEST_TIMEOUT = 600.0

NAMES = ["total", "count", "items", "cache", "price", "weight", "label", "owner", "status", "value", "index", "limit"]


def code_file(rng: random.Random, lines: int) -> tuple[str, str, str]:
    """A Python file of about ``lines`` lines, and a name in it with its replacement."""
    fn = rng.choice(["compute_totals", "load_records", "merge_items", "update_cache"])
    out = [f"def {fn}(records, limit=10):", '    """Sum what the records hold, at most limit of them."""',
           "    result = {}"]
    while len(out) < lines - 2:
        a, b = rng.sample(NAMES, 2)
        out += [f"    for {a} in records[:limit]:", f"        {b} = {a}.get('{b}', 0)",
                f"        result['{a}'] = result.get('{a}', 0) + {b}"]
    out += ["    return result", ""]
    old = rng.choice([n for n in NAMES if f"for {n} in" in "\n".join(out)])
    return "\n".join(out), old, old + "_value"


def loads(n_requests: int, seed: int, code_lines: int) -> dict[str, list[list[dict]]]:
    rng = random.Random(seed)
    out: dict[str, list[list[dict]]] = {"code": [], "agents": [], "chat": []}
    for _ in range(n_requests):
        src, old, new = code_file(rng, code_lines)
        out["code"].append([{"role": "system", "content": "You edit code. Answer with the whole file, changed as "
                                                          "asked, and nothing else."},
                            {"role": "user", "content": f"Rename `{old}` to `{new}` in this file:\n```python\n{src}"
                                                        "```"}])
        rec = {"id": rng.randrange(10_000), "owner": rng.choice(["ana", "bo", "chen", "dara"]),
               "items": [rng.choice(NAMES) for _ in range(12)], "status": "open",
               "notes": " ".join(rng.choice(NAMES) for _ in range(10))}
        # the arguments of a tool call that echo a record (SmolLM2 writes it back, changed as asked)
        out["agents"].append([{"role": "user", "content": "Here is a JSON record:\n" + json.dumps(rec)
                               + "\nWrite the same JSON record again, with the status changed to closed."}])
        town = rng.choice(["Eldermoor", "Westhaven", "Brightwater"])
        q = rng.choice(["What would you visit first in {t}?", "Describe a morning at the harbour of {t}.",
                        "Invent a festival for {t}.", "Write a short note to a friend about {t}."])
        out["chat"].append([{"role": "user", "content": q.format(t=town)}])
    return out


def server_cmd(name: str, model: Path, port: int, args) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port)]
    if name.startswith("peer"):
        exe = find_peer_server()
        assert exe is not None
        spec = {"peer-off": [], "peer-simple": ["--spec-type", "ngram-simple"],
                "peer-mod": ["--spec-type", "ngram-mod"]}[name]
        return [str(exe), "-m", str(model), *common, "-c", str(args.ctx), "-np", str(args.slots), "-kvu",
                "-t", str(args.threads), "-tb", str(args.threads), "-b", "512", "-ub", "512", "--metrics",
                "--no-webui", "-fa", "off", "-ctk", args.kv_type, "-ctv", args.kv_type, *spec]
    spec = {"ours-off": "none", "ours-ngram": "ngram", "ours-cache": "ngram,cache"}[name]
    return [*pyllama_kv_cmd(), "serve", str(model), *common, "--ctx", str(args.ctx), "--parallel", str(args.slots),
            "--threads", str(args.threads), "--batch", "512", "--flash-attn", "off", "--lib", "current",
            "--spec", spec, "--type-k", args.kv_type, "--type-v", args.kv_type]


def one_request(client: httpx.Client, url: str, model: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    t0 = time.perf_counter()
    res: dict = {"latency": None, "completion_tokens": 0, "draft_n": 0, "draft_n_accepted": 0, "text": None,
                 "error": None}
    try:
        r = client.post(url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)
        if r.status_code != 200:
            res["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
        else:
            d = r.json()
            res["text"] = d["choices"][0]["message"]["content"]
            res["completion_tokens"] = d["usage"]["completion_tokens"]
            t = d.get("timings") or {}
            res["draft_n"], res["draft_n_accepted"] = t.get("draft_n", 0), t.get("draft_n_accepted", 0)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:200]
    res["latency"] = time.perf_counter() - t0
    return res


def run_load(url: str, model: str, requests: list[list[dict]], clients: int, max_tokens: int) -> dict:
    results, wall = fan_out(len(requests), clients,
                            lambda c, i: one_request(c, url, model, requests[i], max_tokens), httpx.Client)
    ok = [r for r in results if r is not None and r["error"] is None]
    toks = sum(r["completion_tokens"] for r in ok)
    p95 = percentile([r["latency"] for r in ok], 0.95)
    return {"clients": clients, "requests": len(requests), "errors": len(requests) - len(ok),
            "completion_tokens": toks, "wall_s": round(wall, 3), "tps": round(toks / wall, 2) if wall else None,
            "latency_p95_s": None if p95 is None else round(p95, 3),
            "draft_n": sum(r["draft_n"] or 0 for r in ok),
            "draft_n_accepted": sum(r["draft_n_accepted"] or 0 for r in ok),
            "texts": [r["text"] for r in results if r is not None]}


def ratios(rows: list[dict]) -> list[dict]:
    """Per load and clients: ours' best over ours-off, and over the peer's best."""
    out = []
    keys = sorted({(r["load"], r["clients"]) for r in rows})
    for load, c in keys:
        by = {r["server"]: r for r in rows if (r["load"], r["clients"]) == (load, c) and r["tps"] and not r["errors"]}
        ours = [by[s] for s in ("ours-ngram", "ours-cache") if s in by]
        peers = [by[s] for s in ("peer-off", "peer-simple", "peer-mod") if s in by]
        best = max(ours, key=lambda r: r["tps"], default=None)
        row = {"load": load, "clients": c, "ours_best": best and best["server"]}
        if "ours-off" in by and "peer-off" in by:   # the engines alone, neither speculating
            row["off_over_peer_off"] = round(by["ours-off"]["tps"] / by["peer-off"]["tps"], 3)
        if best and "ours-off" in by:
            row["ours_best_over_off"] = round(best["tps"] / by["ours-off"]["tps"], 3)
            # every speculating server's answers against speculation off (F32: all the same)
            off = by["ours-off"]["texts"]
            row["same_answers_by_server"] = {r["server"]: sum(a == b for a, b in zip(r["texts"], off)) for r in ours}
            row["same_answers"] = row["same_answers_by_server"][best["server"]]
            row["answers"] = len(best["texts"])
        if best and peers:
            pb = max(peers, key=lambda r: r["tps"])
            row["peer_best"] = pb["server"]
            row["ours_best_over_peer_best"] = round(best["tps"] / pb["tps"], 3)
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--quick", action="store_true", help="1 client, 2 requests a load, 3 servers (the suite's run)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--only", help="comma-separated servers (default: all six; --quick: ours-off,ours-ngram,peer-off)")
    ap.add_argument("--loads", default="code,agents,chat")
    ap.add_argument("-t", "--threads", type=int, default=default_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-type", default="f16", choices=("f16", "f32"),
                    help="the KV cache's type on every server (default f16; f32 with F32 weights: greedy answers "
                         "with and without speculation must then be the same)")
    ap.add_argument("--requests", type=int, default=0,
                    help="requests a load sends at each client count (default max(2, clients): a cell of 2 requests "
                         "swings by ~15%% here)")
    args = ap.parse_args(argv)
    if args.requests < 0:
        ap.error("--requests must be positive")
    from pyllama_kv.modelfile import names

    model = names.resolve(args.model)
    clients = [1] if args.quick else [int(c) for c in args.clients.split(",")]
    only = (args.only.split(",") if args.only else
            ["ours-off", "ours-ngram", "peer-off"] if args.quick else list(SERVERS))
    bad = [s for s in only if s not in SERVERS]
    if bad:
        ap.error(f"--only: unknown servers {bad}; choose from {', '.join(SERVERS)}")
    args.slots = max(clients)
    args.ctx = 1024 * args.slots
    per = 2 if args.quick else args.requests or None
    max_tokens = ({"code": 96, "agents": 64, "chat": 32} if args.quick else
                  {"code": 300, "agents": 128, "chat": 96})
    wanted = args.loads.split(",")
    if any(s.startswith("peer") for s in only) and find_peer_server() is None:
        build_peer()
    rows = []
    for name in only:
        port = free_port()
        with tempfile.TemporaryDirectory() as logs, Server(name, server_cmd(name, model, port, args), port,
                                                          Path(logs)) as srv:
            mid = srv.model_id()
            for c in clients:
                work = loads(per or max(2, c), args.seed + c, 20 if args.quick else 45)
                for load in wanted:
                    r = run_load(srv.url, mid, work[load], c, max_tokens[load])
                    rows.append({"server": name, "load": load, **r})
                    print(f"  [{name}] {load}, {c} client(s): {r['tps']} tok/s, p95 {r['latency_p95_s']} s, drafts "
                          f"{r['draft_n_accepted']}/{r['draft_n']}, errors {r['errors']}", file=sys.stderr)
    out = {"benchmark": "spec", "model": Path(model).name, "kv_type": args.kv_type, "threads": args.threads,
           "machine": machine(), "date": time.strftime("%Y-%m-%d"),
           "rows": [{k: v for k, v in r.items() if k != "texts"} for r in rows],
           "ratios": ratios(rows)}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{out['model']}, {args.threads} threads, greedy; tokens/s (drafted/accepted)")
    for r in out["rows"]:
        acc = f"{r['draft_n_accepted']}/{r['draft_n']}" if r["draft_n"] else "-"
        print(f"  {r['load']:<7}{r['clients']:>3}  {r['server']:<12}{r['tps']!s:>9} tok/s  p95 "
              f"{r['latency_p95_s']!s:>7} s  drafts {acc:<12} errors {r['errors']}")
    for q in out["ratios"]:
        said = []
        if q.get("ours_best"):
            said.append(f"best ours {q['ours_best']}: {q.get('ours_best_over_off')}x ours-off, "
                        f"{q.get('ours_best_over_peer_best')}x {q.get('peer_best')}; "
                        f"same answers as off: {q.get('same_answers')}/{q.get('answers')}")
        if q.get("off_over_peer_off") is not None:
            said.append(f"ours-off {q['off_over_peer_off']}x peer-off")
        if said:
            print(f"  {q['load']:<7}{q['clients']:>3}  " + "; ".join(said))
    return 0


if __name__ == "__main__":
    sys.exit(main())
