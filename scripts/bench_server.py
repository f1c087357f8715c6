#!/usr/bin/env python3
"""Benchmark: `pyllama-kv serve` against llama.cpp's own llama-server, under the same chat load. Prints JSON.

In one run and one after another, on the real model (default: the catalogue's smollm2-135m-instruct),
the same seeded load goes to
  * patched:      `pyllama-kv serve MODEL --lib patched` (our patch series: one shared cache, prefix reuse);
  * vanilla:      `pyllama-kv serve MODEL --lib vanilla` (the same server on the unpatched library);
  * llama-server: llama.cpp's own server from our patched build, `-np C -cb`, same threads and batch;
  * ours-current: `pyllama-kv serve MODEL --lib current` (ours on the current llama.cpp and its series);
  * current:      the current llama-server (`pyllama-kv build --peer`, built when missing), `-np C -kvu`
                  (one unified cache of all the cells, as ours), the same threads, batch and flash attention.
The default `--only` is the first three.
Each server is a subprocess on 127.0.0.1 with a free port, waited for through /health and stopped after.

Context: both get the same total KV cells N. llama-server splits them into C fixed slots of N/C cells
each; `pyllama-kv serve` shares all N among the requests it runs.

The load: C concurrent clients send R chat requests (OpenAI API, streaming, temperature 0, max_tokens
M). Every request has one of two seeded system prompts of ~250 tokens (readable English made from a
word list) and a question of its own. Reported per server: completion tokens/s (all completion tokens
over the wall time of the load), time to first token and request latency (p50, p95), errors, and the
prompt tokens evaluated versus reused (from usage.prompt_tokens_details.cached_tokens, or llama-server's
per-request timings.prompt_n, with its /metrics counters beside). Then the ratios patched/llama-server.
Targets: >= 2x llama-server's completion tokens/s, a lower p95 latency, 0 errors on patched.

Needs `pyllama-kv build --tools` (llama-server) and both builds (make setup does it).

  python scripts/bench_server.py [--quick] [--json] [--clients C] [--requests R] [--max-tokens M]
                                 [--model NAME_OR_PATH] [--only patched,vanilla,llama-server]
                                 [--ctx N] [-t THREADS] [--system-tokens T] [--seed S]
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

import pyllama_kv as pk
from pyllama_kv.config import default_threads
from pyllama_kv.harness import build as _build
from pyllama_kv.harness.peer import build_peer, find_peer_server
from pyllama_kv.modelfile import catalogue
from pyllama_kv.tools.bench import fan_out, machine

DEFAULT_MODEL = "smollm2-135m-instruct"
SERVERS = ("patched", "vanilla", "llama-server", "ours-current", "current")
TARGET_TPS = 2.0          # patched / llama-server completion tokens/s
START_TIMEOUT = 120.0     # seconds a server may take to answer /health
REQUEST_TIMEOUT = 300.0   # seconds one request may take

# the word list the system prompts are made of: sentences of a made-up town's guide
PLACES = ["harbour", "market", "library", "bakery", "station", "museum", "garden", "bridge", "school", "theatre",
          "mill", "chapel", "square", "orchard", "workshop", "lighthouse", "ferry", "tower", "inn", "river"]
PEOPLE = ["the baker", "the old captain", "the librarian", "a young carpenter", "the mayor", "two fishermen",
          "the gardener", "a travelling painter", "the station master", "the schoolteacher", "the miller's daughter"]
VERBS = ["opens", "repairs", "visits", "paints", "cleans", "guards", "decorates", "measures", "describes", "closes"]
TIMES = ["every morning", "on Sundays", "after the spring rains", "before the first frost", "at dusk",
         "in late summer", "twice a week", "during the harvest fair", "when the tide is low", "each winter"]
DETAILS = ["with great care", "while humming an old song", "for the children of the town", "without asking for pay",
           "as the tradition demands", "using tools from the workshop", "with help from the neighbours"]
REASONS = ["because the visitors expect it", "since the roof leaked last year", "so that nobody gets lost",
           "because the council asked for it", "to keep the old customs alive", "since the weather turned"]


def system_prompt(model: pk.Model, seed: int, tokens: int) -> str:
    """Seeded English sentences about a made-up town, just past ``tokens`` tokens long."""
    rng = random.Random(seed)
    town = rng.choice(["Eldermoor", "Westhaven", "Brightwater", "Oakridge", "Stonebury"])
    text = f"You are the guide of {town}, a small town by the sea. Answer briefly, using these notes. "
    while len(model.tokenize(text, add_bos=False)) < tokens:
        text += (f"{rng.choice(PEOPLE).capitalize()} {rng.choice(VERBS)} the {rng.choice(PLACES)} "
                 f"{rng.choice(TIMES)} {rng.choice(DETAILS)}, {rng.choice(REASONS)}. ")
    return text.strip()


def question(i: int, rng: random.Random) -> str:
    return (f"Visitor {i + 1} asks: what happens at the {rng.choice(PLACES)} {rng.choice(TIMES)}, "
            f"and who takes care of the {rng.choice(PLACES)}?")


def percentile(xs: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of xs, by linear interpolation; None when empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server_path() -> Path:
    for b in _build.find_builds():
        if b.get("variant") == "patched" and "llama-server" in b.get("tools", []):
            p = Path(b["bin_dir"]) / "llama-server"
            if p.is_file():
                return p
    raise SystemExit("llama-server is not built: run `pyllama-kv build --tools` (make setup does it)")


def pyllama_kv_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "pyllama-kv"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "pyllama_kv.cli"]


def server_cmd(name: str, model: Path, port: int, n_ctx: int, clients: int, threads: int, n_batch: int,
               ngl: int = 0, libs: dict | None = None, flash_attn: bool = False) -> list[str]:
    """The command of server ``name``; ``ngl``: layers on the GPU (-1: all) for every server;
    ``libs``: a path for "patched", "vanilla", "llama-server", "ours-current" (a library) or "current" (a
    llama-server) instead of the build's;
    ``flash_attn``: the same setting for every server."""
    libs = libs or {}
    if name == "current":   # the current llama-server (build --peer): one unified cache, -fa takes a value
        exe = libs.get("current") or find_peer_server()
        assert exe is not None
        return [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", str(n_ctx),
                "-np", str(clients), "-kvu", "-t", str(threads), "-tb", str(threads), "-b", str(n_batch),
                "-ub", str(n_batch), "-ngl", str(999 if ngl < 0 else ngl), "--metrics", "--no-webui",
                "-fa", "on" if flash_attn else "off"]
    lib = libs.get(name) or name
    if name == "ours-current":
        lib = libs.get(name) or "current"   # pyllama-kv serve on the current library
    if name == "llama-server":
        return [libs.get(name) or str(llama_server_path()), "-m", str(model), "--host", "127.0.0.1",
                "--port", str(port),
                "-c", str(n_ctx), "-np", str(clients), "-cb", "-t", str(threads), "-tb", str(threads),
                "-b", str(n_batch), "-ub", str(n_batch), "-ngl", str(999 if ngl < 0 else ngl), "--metrics",
                "--no-webui", *(["-fa"] if flash_attn else [])]
    return [*pyllama_kv_cmd(), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--ctx", str(n_ctx),
            "--parallel", str(clients), "--threads", str(threads), "--batch", str(n_batch), "-ngl", str(ngl),
            "--lib", lib, "--flash-attn", "on" if flash_attn else "off"]


class Server:
    """One server subprocess on 127.0.0.1, its output in a log file; ready once /health answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, log_dir: Path):
        self.name, self.cmd, self.url = name, cmd, f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def __enter__(self) -> Server:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before it was ready:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.__exit__()
        raise RuntimeError(f"{self.name} did not answer /health within {START_TIMEOUT:.0f} s:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def model_id(self) -> str:
        """The model name the server answers to (the first of /v1/models)."""
        try:
            return str(httpx.get(self.url + "/v1/models", timeout=10.0).json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise RuntimeError(f"{self.name}: GET /v1/models gave no model: {exc}") from None

    def metrics(self) -> dict[str, float]:
        """The Prometheus counters and gauges of /metrics (name{labels} -> value); {} when there are none."""
        try:
            r = httpx.get(self.url + "/metrics", timeout=10.0)
            if r.status_code != 200:
                return {}
            out = {}
            for fam in text_string_to_metric_families(r.text):
                for s in fam.samples:
                    labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                    out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
            return out
        except (httpx.HTTPError, ValueError):
            return {}


def one_request(client: httpx.Client, url: str, model_name: str, messages: list[dict], max_tokens: int) -> dict:
    """One streaming chat request: timings, usage and text, or the error."""
    body = {"model": model_name, "messages": messages, "temperature": 0, "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    res: dict = {"ttft": None, "latency": None, "completion_tokens": None, "prompt_tokens": None,
                 "cached_tokens": None, "prompt_n": None, "chunks": 0, "text": "", "error": None}
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT) as r:
            if r.status_code != 200:
                res["error"] = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}"
                return res
            done = False
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res["error"] = f"error in stream: {json.dumps(chunk['error'])[:200]}"
                    return res
                for ch in chunk.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        if res["ttft"] is None:
                            res["ttft"] = time.perf_counter() - t0
                        res["text"] += piece
                        res["chunks"] += 1
                usage = chunk.get("usage")
                if usage:
                    res["completion_tokens"] = usage.get("completion_tokens")
                    res["prompt_tokens"] = usage.get("prompt_tokens")
                    res["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                timings = chunk.get("timings")   # llama-server's extension: prompt_n = prompt tokens evaluated
                if timings and "prompt_n" in timings:
                    res["prompt_n"] = timings["prompt_n"]
            if not done:
                res["error"] = "the stream ended without data: [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"[:200]
    res["latency"] = time.perf_counter() - t0
    if res["ttft"] is None and res["error"] is None:
        res["ttft"] = res["latency"]   # an empty answer: the first (and last) event is the end
    return res


def run_load(url: str, model_name: str, requests: list[list[dict]], clients: int, max_tokens: int,
             label: str) -> tuple[list[dict], float]:
    """``clients`` threads take the requests in order; returns the results (in request order) and wall time."""
    def progress(done: int) -> None:
        if done % max(1, len(requests) // 4) == 0 or done == len(requests):
            print(f"  [{label}] {done}/{len(requests)} requests done", file=sys.stderr)

    results, wall = fan_out(len(requests), clients,
                            lambda client, i: one_request(client, url, model_name, requests[i], max_tokens),
                            httpx.Client, progress)
    return [r for r in results if r is not None], wall


def prompt_reused(ok: list[dict]) -> tuple[int | None, str | None]:
    """Prompt tokens the server served from its cache over the successful requests ``ok``, and where
    that was read: our usage.prompt_tokens_details.cached_tokens, or llama-server's timings.prompt_n
    (tokens evaluated); (None, None) when neither is there for every request."""
    if ok and all(r["cached_tokens"] is not None for r in ok):
        return sum(r["cached_tokens"] for r in ok), "usage.prompt_tokens_details.cached_tokens"
    if ok and all(r["prompt_n"] is not None for r in ok):
        return sum(r["prompt_tokens"] or 0 for r in ok) - sum(r["prompt_n"] for r in ok), "timings.prompt_n"
    return None, None


def summarize(name: str, results: list[dict], wall: float, before: dict, after: dict) -> dict:
    ok = [r for r in results if r["error"] is None]
    completion = sum((r["completion_tokens"] if r["completion_tokens"] is not None else r["chunks"]) for r in ok)
    prompt = sum(r["prompt_tokens"] or 0 for r in ok)

    def p(xs: list[float], q: float) -> float | None:
        v = percentile(xs, q)
        return None if v is None else round(v, 3)

    reused, source = prompt_reused(ok)
    delta = {k: round(after[k] - before.get(k, 0.0), 3) for k in sorted(after)
             if any(w in k for w in ("prompt_tokens", "tokens_predicted", "slot_failures", "slot_retries", "defrag",
                                     "prefix_page", "prefix_restore", "seconds", "decode_calls"))
             and not k.endswith("_created")}
    return {
        "server": name, "requests": len(results), "errors": len(results) - len(ok),
        "error_samples": sorted({r["error"] for r in results if r["error"]})[:3],
        "wall_s": round(wall, 3), "completion_tokens": completion,
        "completion_tps": round(completion / wall, 2) if wall > 0 else None,
        "ttft_p50_s": p([r["ttft"] for r in ok], 0.5), "ttft_p95_s": p([r["ttft"] for r in ok], 0.95),
        "latency_p50_s": p([r["latency"] for r in ok], 0.5), "latency_p95_s": p([r["latency"] for r in ok], 0.95),
        "prompt_tokens": prompt,
        "prompt_evaluated": None if reused is None else prompt - reused, "prompt_reused": reused,
        "prompt_source": source,
        "metrics_delta": delta,   # the server's own counters over the load (/metrics), where it has them
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"catalogue name or GGUF path (default {DEFAULT_MODEL})")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients C, and llama-server's slots (default 8)")
    ap.add_argument("--requests", type=int, default=32, help="chat requests in the load (default 32)")
    ap.add_argument("--max-tokens", type=int, default=48, help="max_tokens of each request (default 48)")
    ap.add_argument("--system-tokens", type=int, default=250, help="length of each system prompt (default 250)")
    ap.add_argument("--ctx", type=int, default=None,
                    help="total KV cells of each server (default: 512 per client)")
    ap.add_argument("-t", "--threads", type=int, default=default_threads(), help="CPU threads of each server")
    ap.add_argument("--only", default=",".join(SERVERS[:3]),
                    help=f"servers to run, of {','.join(SERVERS)} (default {','.join(SERVERS[:3])})")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the prompts and questions (default 1234)")
    ap.add_argument("--quick", action="store_true", help="a small load (fewer, shorter requests), for the test suite")
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=None,
                    help="layers on the GPU for every server (default: pk.Model's: all on a GPU library, else 0)")
    ap.add_argument("--patched-lib", default=None, metavar="PATH",
                    help="the libllama of `patched` (default: the build's)")
    ap.add_argument("--llama-server", default=None, metavar="PATH",
                    help="the llama-server (default: the patched build's)")
    ap.add_argument("--current-lib", default=None, metavar="PATH",
                    help="the libllama of `ours-current` (default: the current pin's build)")
    ap.add_argument("--current-server", default=None, metavar="PATH",
                    help="the llama-server of `current` (default: the peer build's)")
    ap.add_argument("--flash-attn", default="auto", choices=("on", "off", "auto"),
                    help="flash attention for every server (default auto: on where the model's layers are on a GPU)")
    ap.add_argument("--serve-args", default="", metavar="FLAGS",
                    help="more flags for our servers (patched, vanilla, ours-current), e.g. "
                         "\"--backend-sampling on --pipeline on\"")
    ap.add_argument("--json", action="store_true", help="compact JSON")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if not only or any(s not in SERVERS for s in only):
        ap.error(f"--only takes a comma-separated list of {', '.join(SERVERS)}")
    clients, n_req, max_tokens, sys_tokens = args.clients, args.requests, args.max_tokens, args.system_tokens
    if args.quick:
        clients, n_req, max_tokens, sys_tokens = 4, 8, 8, 64
    if clients < 1 or n_req < 1 or max_tokens < 1 or sys_tokens < 1:
        ap.error("--clients, --requests, --max-tokens and --system-tokens must be >= 1")
    n_ctx = args.ctx or clients * (256 if args.quick else 512)
    n_batch = 512

    model_path = catalogue.resolve(args.model)
    libs = {"patched": args.patched_lib, "llama-server": args.llama_server, "ours-current": args.current_lib,
            "current": args.current_server}
    if "current" in only and not args.current_server and find_peer_server() is None:
        print("current: building the peer llama-server (`pyllama-kv build --peer`) ...", file=sys.stderr)
        build_peer(log=lambda m: print(m, file=sys.stderr))
    mission = any(s in only for s in ("patched", "vanilla", "llama-server"))
    with pk.Model(model_path, args.n_gpu_layers, lib=args.patched_lib if mission else args.current_lib) as model:
        ngl = model.n_gpu_layers
        fa = model.on_gpu if args.flash_attn == "auto" else args.flash_attn == "on"
        systems = [system_prompt(model, args.seed + k, sys_tokens) for k in (0, 1)]
        system_lens = [len(model.tokenize(s, add_bos=False)) for s in systems]
    rng = random.Random(args.seed)
    requests = [[{"role": "system", "content": systems[i % 2]}, {"role": "user", "content": question(i, rng)}]
                for i in range(n_req)]
    out: dict = {
        "benchmark": "server", "machine": machine(), "date": time.strftime("%Y-%m-%d"),
        "model": str(model_path),
        "settings": {"clients": clients, "requests": n_req, "max_tokens": max_tokens, "temperature": 0,
                     "stream": True, "system_prompts": 2, "system_prompt_tokens": system_lens,
                     "n_ctx_total": n_ctx, "llama_server_ctx_per_slot": n_ctx // clients, "threads": args.threads,
                     "n_batch": n_batch, "seed": args.seed, "servers": only, "n_gpu_layers": ngl, "flash_attn": fa,
                     "note": (f"every server gets {n_ctx} KV cells in all: llama-server -c {n_ctx} -np {clients} "
                              f"splits them into {clients} slots of {n_ctx // clients}; pyllama-kv serve shares "
                              "them among all requests")},
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in only:
            port = free_port()
            cmd = server_cmd(name, model_path, port, n_ctx, clients, args.threads, n_batch, ngl, libs, fa)
            if name in ("patched", "vanilla", "ours-current"):   # our servers' extra flags
                cmd += shlex.split(args.serve_args)
            print(f"{name}: starting {' '.join(cmd)}", file=sys.stderr)
            t0 = time.perf_counter()
            srv = Server(name, cmd, port, Path(tmp))
            try:
                with srv:
                    print(f"{name}: ready in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
                    model_id = srv.model_id()
                    # one tiny request first, so that no server's first-request setup counts in the load
                    with httpx.Client() as c:
                        one_request(c, srv.url, model_id, [{"role": "user", "content": "Hello"}], 1)
                    before = srv.metrics()
                    results, wall = run_load(srv.url, model_id, requests, clients, max_tokens, name)
                    row = summarize(name, results, wall, before, srv.metrics())
            except RuntimeError as exc:
                print(f"{name}: {exc}", file=sys.stderr)
                row = {"server": name, "requests": n_req, "errors": n_req, "error_samples": [str(exc)[:500]],
                       "started": False}
            out["rows"].append(row)
            if row.get("completion_tps") is not None:
                print(f"{name}: {row['completion_tps']:.1f} completion tok/s, TTFT p50/p95 {row['ttft_p50_s']}/"
                      f"{row['ttft_p95_s']} s, latency p50/p95 {row['latency_p50_s']}/{row['latency_p95_s']} s, "
                      f"{row['errors']} errors, prompt tokens evaluated {row['prompt_evaluated']} / reused "
                      f"{row['prompt_reused']}", file=sys.stderr)
                secs = {k.removeprefix("pyllama_kv_").removesuffix("_total"): v
                        for k, v in (row.get("metrics_delta") or {}).items()
                        if k.endswith("seconds_total")}   # counters: a gauge's delta says nothing
                if secs:
                    print(f"{name}: where the time went (s): {secs}", file=sys.stderr)
            else:
                print(f"{name}: {row['errors']} errors: {row['error_samples'][:1]}", file=sys.stderr)
    by = {r["server"]: r for r in out["rows"]}
    ratios = {}
    for name, ref_name in (("patched", "llama-server"), ("vanilla", "llama-server"), ("ours-current", "current"),
                           ("patched", "current")):
        r, ref = by.get(name), by.get(ref_name)
        if not (r and ref and r.get("completion_tps") and ref.get("completion_tps")):
            continue
        ratios[f"{name}/{ref_name}"] = {
            "completion_tps": round(r["completion_tps"] / ref["completion_tps"], 3),
            "latency_p95": round(r["latency_p95_s"] / ref["latency_p95_s"], 3),
            "ttft_p95": round(r["ttft_p95_s"] / ref["ttft_p95_s"], 3),
        }
    out["ratios"] = ratios
    pr = ratios.get("patched/llama-server")
    out["targets"] = {
        f"patched_tps_at_least_{TARGET_TPS:g}x": None if pr is None else pr["completion_tps"] >= TARGET_TPS,
        "patched_lower_p95": None if pr is None else pr["latency_p95"] < 1.0,
        "patched_no_errors": by["patched"]["errors"] == 0 if "patched" in by else None,
    }
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
