#!/usr/bin/env python3
"""A hybrid model's prefix reuse: `pyllama-kv serve --lib current` against the current llama-server
(``pyllama-kv build --peer``), one after another in one run, on a tiny LFM2 (short-convolution layers
with recurrent state between attention layers; random F32 weights, written by the project's
generator), or with ``--arch gemma3`` on a tiny Gemma 3 whose sliding-window layers attend to the last
``--window`` tokens only (the same load: what a sliding-window cache lets a server reuse). Prints JSON.

A recurrent layer's state cannot be rolled back, so a prompt that shares only a part of a cached
sequence cannot simply fork it. The current llama-server keeps periodic context checkpoints and
re-evaluates from the last one before the point where prompts diverge; we keep checkpoints exactly
where prompts branch (pyllama_kv.prefixcache.checkpoints: the end of the system prompt, each prompt
whose answer was cached after it, where a prompt leaves the longest cached one).

The load, sent one request at a time (temperature 0, ``--max-tokens`` per answer): conversation A for
``--turns`` turns under a system prompt of ~``--system-words`` words, then conversations B and C of
one turn each under the same system prompt, then A's next turn again. Reported per request and server:
prompt tokens, tokens served from the cache (ours: usage.prompt_tokens_details.cached_tokens;
llama-server: prompt tokens minus timings.prompt_n) and tokens evaluated; and the *new* tokens of
each request, the floor no cache can go below: for a later turn, what its prompt adds to the
previous prompt and answer of its conversation; for B and C, what follows the system prompt. Both
servers get the same cells, slots and threads.

    .venv/bin/python scripts/bench_hybrid_reuse.py [--system-words 300] [--turns 4] [--arch lfm2|gemma3]
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
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_chat_load import document, follow_up  # noqa: E402
from bench_server import Server, free_port, one_request, pyllama_kv_cmd  # noqa: E402

from pyllama_kv.config import default_threads  # noqa: E402
from pyllama_kv.harness.peer import build_peer, find_peer_server  # noqa: E402
from pyllama_kv.tools.bench import machine  # noqa: E402
from pyllama_kv.tools.gguf import make_tiny_model  # noqa: E402

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SERVERS = ("ours-current", "current")
ARCHS = {"lfm2": "tiny lfm2 (6 layers: conv/attention, F32)",
         "gemma3": "tiny gemma3 (6 layers: 5 with a sliding window, 1 global; F32)"}


def tiny_model(tmp: Path, args) -> Path:
    extra = {"sliding_window": args.window} if args.arch == "gemma3" else {}
    return make_tiny_model(tmp / f"tiny-{args.arch}.gguf", seed=3, arch=args.arch, n_layer=6, n_ctx_train=16384,
                           kv_overrides={"tokenizer.chat_template": CHATML}, **extra)


def server_cmd(name: str, model: Path, port: int, args) -> list[str]:
    if name == "current":
        exe = find_peer_server()
        assert exe is not None
        return [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", str(args.ctx),
                "-np", str(args.clients), "-t", str(args.threads), "-tb", str(args.threads), "-ngl", "0", "-kvu",
                "--no-webui"]
    return [*pyllama_kv_cmd(), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--ctx", str(args.ctx), "--parallel", str(args.clients), "--threads", str(args.threads),
            "--lib", "current", "--cache-ram", "0"]


def run_server(name: str, model: Path, args, log_dir: Path) -> list[dict]:
    port = free_port()
    srv = Server(name, server_cmd(name, model, port, args), port, log_dir)
    rng = random.Random(args.seed + 1)
    system = {"role": "system", "content": "You answer from these notes. " + document(rng, args.system_words)}
    order = ["A"] * args.turns + ["B", "C", "A"]
    convs: dict[str, list[dict]] = {}
    rows = []
    with srv, httpx.Client() as c:
        model_id = httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for i, label in enumerate(order):
            msgs = convs.setdefault(label, [system])
            turn = sum(1 for m in msgs if m["role"] == "user")
            msgs.append({"role": "user", "content": follow_up(rng, turn + ord(label))})
            r = one_request(c, srv.url, model_id, msgs, args.max_tokens)
            if r["error"]:
                raise RuntimeError(f"{name}: request {i} failed: {r['error']}\n{srv.log_tail()}")
            msgs.append({"role": "assistant", "content": r["text"]})
            cached = r["cached_tokens"] if r["cached_tokens"] is not None else (
                r["prompt_tokens"] - r["prompt_n"] if r["prompt_n"] is not None else None)
            rows.append({"request": i + 1, "conversation": label, "turn": turn + 1,
                         "prompt_tokens": r["prompt_tokens"], "cached": cached,
                         "evaluated": None if cached is None else r["prompt_tokens"] - cached,
                         "completion_tokens": r["completion_tokens"]})
    return rows


def new_tokens(rows: list[dict], system_tokens: int) -> None:
    """Each row's new tokens (see the module docstring), from the prompts' sizes."""
    last: dict[str, dict] = {}
    for r in rows:
        prev = last.get(r["conversation"])
        r["new"] = (r["prompt_tokens"] - system_tokens if prev is None
                    else r["prompt_tokens"] - prev["prompt_tokens"] - (prev["completion_tokens"] or 0))
        last[r["conversation"]] = r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system-words", type=int, default=300,
                    help="the system prompt's words (default 300: ~1,000 tokens of the tiny byte vocabulary)")
    ap.add_argument("--turns", type=int, default=4, help="turns of conversation A before B and C (default 4)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--clients", type=int, default=4, help="slots (llama-server -np) and our --parallel")
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=",".join(SERVERS))
    ap.add_argument("--arch", choices=sorted(ARCHS), default="lfm2",
                    help="the tiny model: lfm2 (hybrid: recurrent state) or gemma3 (a sliding-window cache of "
                         "--window tokens in 5 of 6 layers)")
    ap.add_argument("--window", type=int, default=128, help="gemma3's sliding window (default 128)")
    args = ap.parse_args(argv)
    only = [s for s in args.only.split(",") if s]
    if "current" in only and find_peer_server() is None:
        print("current: building the peer llama-server (`pyllama-kv build --peer`) ...", file=sys.stderr)
        build_peer(log=lambda m: print(m, file=sys.stderr))
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp), args)
        out: dict = {"benchmark": "hybrid-reuse", "machine": machine(), "date": time.strftime("%Y-%m-%d"),
                     "model": ARCHS[args.arch], "servers": {}}
        for name in only:
            print(f"{name} ...", file=sys.stderr)
            out["servers"][name] = run_server(name, model, args, Path(tmp))
        import pyllama_kv as pk
        with pk.Model(model, lib="current") as m:
            rng = random.Random(args.seed + 1)
            system = {"role": "system", "content": "You answer from these notes. " + document(rng, args.system_words)}
            sys_toks = len(m.tokenize(m.apply_chat_template([system], add_generation_prompt=False), special=True))
        out["system_prompt_tokens"] = sys_toks
        for rows in out["servers"].values():
            new_tokens(rows, sys_toks)
        out["evaluated_total"] = {k: sum(r["evaluated"] or 0 for r in v) for k, v in out["servers"].items()}
        out["new_total"] = {k: sum(r["new"] for r in v) for k, v in out["servers"].items()}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
