#!/usr/bin/env python3
"""Benchmark: does one hostile request take the server from everyone else? Prints a table (or JSON).

One `pyllama-kv serve` on the real model (default: the catalogue's smollm2-135m-instruct), on
127.0.0.1 with a free port. First a quiet 8-token chat is timed (the median of a few). Then, one
hostile request at a time, the hostile request is sent from one thread and, once it is in flight, the
same 8-token chat from another; each row gives the chat's latency over the quiet one (the goal of issue
45: within 2x), what the server answered the hostile request and how long that took. The rows:

  tokenize-specials   /tokenize of 1 MiB repeating the spelling of a control token (<|im_end|>),
                      special parsing on: quadratic in llama.cpp before patch 0018 (88 s)
  tokenize-pieces     the same with with_pieces (per-token work, once done on the event loop)
  chat-specials       a chat whose message is 1 MiB of control-token spellings
  responses-items     a Responses request of 30,000 empty input items (40 s to refuse before)
  placeholders        a chat of 20,000 distinct strings sharing 8,000 private-use characters (the
                      template's placeholder scan, once (characters) x (strings) outside the sandbox)
  store-nested        32 Responses requests (store: true) whose reasoning.effort is a 1 MB nest of
                      empty lists (they cost ~42 MiB each once stored), the RSS after them

Each hostile request runs to its answer before the next; the quiet chat is measured again at the end.

  python scripts/bench_hostile.py [--quick] [--json] [--model NAME_OR_PATH] [--lib patched|current]
                                  [--only ROW,ROW]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chat_load import rss_mib  # noqa: E402
from bench_server import Server, free_port, pyllama_kv_cmd  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-instruct"
TIMEOUT = 600.0
CHAT = [{"role": "user", "content": "Name a colour."}]


def hostile_bodies(size: int, items: int, strings: int, pua: int) -> dict[str, tuple[str, object]]:
    """row -> (path, JSON body) of every hostile request but the store's (``size``: bytes of text)."""
    specials = "<|im_end|>" * (size // 10)
    marks = "".join(chr(0xF0000 + i) for i in range(pua))
    msgs = [{"role": "user", "content": f"{i} {marks if i == 0 else ''}"} for i in range(strings)]
    return {
        "tokenize-specials": ("/tokenize", {"content": specials, "parse_special": True}),
        "tokenize-pieces": ("/tokenize", {"content": specials, "parse_special": True, "with_pieces": True}),
        "chat-specials": ("/v1/chat/completions", {"model": "m", "max_tokens": 1,
                                                   "messages": [{"role": "user", "content": specials}]}),
        "responses-items": ("/v1/responses", {"model": "m", "max_output_tokens": 1, "input": [{}] * items}),
        "placeholders": ("/v1/chat/completions", {"model": "m", "max_tokens": 1, "messages": msgs}),
    }


def nested(depth: int, width: int) -> str:
    """The JSON text of ``width`` nests of ``depth`` empty lists (2 x depth x width bytes; too deep
    for Python's json to write)."""
    return "[" + ",".join(["[" * depth + "]" * depth] * width) + "]"


MODEL = {"id": "m"}   # the name the server answers to (its /v1/models), set once it is up


def chat_latency(client: httpx.Client, url: str) -> float:
    t0 = time.perf_counter()
    r = client.post(url + "/v1/chat/completions", json={"model": MODEL["id"], "messages": CHAT, "max_tokens": 8,
                                                        "temperature": 0}, timeout=TIMEOUT)
    r.raise_for_status()
    return time.perf_counter() - t0


def quiet(client: httpx.Client, url: str, n: int) -> float:
    chat_latency(client, url)   # warm
    return statistics.median(chat_latency(client, url) for _ in range(n))


def under(url: str, path: str, body, quiet_s: float) -> dict:
    """The 8-token chat's latency while ``body`` is in flight at ``path``, and the hostile answer."""
    if isinstance(body, dict) and "model" in body:
        body = {**body, "model": MODEL["id"]}
    data = json.dumps(body).encode()
    out: dict = {"body_bytes": len(data)}

    def send() -> None:
        t0 = time.perf_counter()
        try:
            r = httpx.post(url + path, content=data, headers={"Content-Type": "application/json"}, timeout=TIMEOUT)
            out["status"] = r.status_code
            out["answer"] = r.text[:120]
        except httpx.HTTPError as exc:
            out["status"] = f"error: {exc}"
        out["hostile_s"] = round(time.perf_counter() - t0, 3)

    t = threading.Thread(target=send)
    t.start()
    time.sleep(min(0.3, quiet_s))   # the hostile body is in and being worked on
    with httpx.Client() as c:
        lat = chat_latency(c, url)
    t.join()
    out["chat_s"] = round(lat, 3)
    out["chat_over_quiet"] = round(lat / quiet_s, 2)
    return out


def store_probe(url: str, pid: int, n: int, depth: int, width: int) -> dict:
    body = {"model": MODEL["id"], "max_output_tokens": 1, "store": True, "input": "hi", "reasoning": {"effort": 0}}
    data = json.dumps(body).replace('"effort": 0', '"effort": ' + nested(depth, width)).encode()
    before = rss_mib(pid, "VmRSS")
    codes: dict = {}
    with httpx.Client() as c:
        for _ in range(n):
            r = c.post(url + "/v1/responses", content=data, headers={"Content-Type": "application/json"},
                       timeout=TIMEOUT)
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
    return {"requests": n, "body_bytes": len(data), "statuses": codes, "rss_before_mib": before,
            "rss_after_mib": rss_mib(pid, "VmRSS")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--lib", default="patched")
    ap.add_argument("--quick", action="store_true", help="smaller bodies, fewer quiet runs (the suite's smoke run)")
    ap.add_argument("--only", help="comma-separated rows")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from pyllama_kv.modelfile import names

    model = names.resolve(args.model)
    size, items, strings, pua, runs = ((64 << 10, 3000, 2000, 800, 3) if args.quick else
                                       ((1 << 20) - 4096, 30_000, 20_000, 8_000, 5))
    rows = hostile_bodies(size, items, strings, pua)
    only = set(args.only.split(",")) if args.only else None
    port = free_port()
    cmd = [*pyllama_kv_cmd(), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--lib", args.lib,
           "--ctx", "2048", "--parallel", "4"]
    out: dict = {"model": Path(model).name, "lib": args.lib, "quick": args.quick, "rows": {}}
    with tempfile.TemporaryDirectory() as logs, Server("ours", cmd, port, Path(logs)) as srv, httpx.Client() as c:
        MODEL["id"] = srv.model_id()
        out["quiet_chat_s"] = q = round(quiet(c, srv.url, runs), 3)
        for name, (path, body) in rows.items():
            if only is None or name in only:
                out["rows"][name] = under(srv.url, path, body, q)
        if only is None or "store-nested" in only:
            assert srv.proc is not None
            out["rows"]["store-nested"] = store_probe(srv.url, srv.proc.pid, 4 if args.quick else 32,
                                                      1000, 60 if args.quick else 500)
        out["quiet_chat_after_s"] = round(quiet(c, srv.url, runs), 3)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"{out['model']} on {args.lib}: a quiet 8-token chat takes {out['quiet_chat_s']} s "
          f"({out['quiet_chat_after_s']} s after the probe)")
    print(f"{'row':<20}{'body':>10}{'answer':>8}{'hostile s':>11}{'chat s':>9}{'x quiet':>9}")
    for name, r in out["rows"].items():
        if name == "store-nested":
            print(f"{name:<20}{r['body_bytes']:>10}{str(r['statuses']):>8}   RSS {r['rss_before_mib']} -> "
                  f"{r['rss_after_mib']} MiB after {r['requests']} requests")
            continue
        print(f"{name:<20}{r['body_bytes']:>10}{str(r['status']):>8}{r['hostile_s']:>11}{r['chat_s']:>9}"
              f"{r['chat_over_quiet']:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
