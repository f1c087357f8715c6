#!/usr/bin/env python3
"""Benchmark: embeddings throughput (texts/s) of `pyllama-kv serve` against llama.cpp's own
`llama-server --embeddings` at the pin, side by side in one run, on the same model, threads and batch.
Prints JSON.

Load: N texts of ~T tokens each (256 of ~100 by default), sent as /v1/embeddings requests of `--per-request`
texts by `--clients` concurrent clients; the clock runs from the first request to the last answer, after
one warm-up request per server. Both servers pool the same way (`--pooling`, mean by default) and get the
same batch (`-b = -ub = --batch`: one decode is one graph, as a mean-pooled or non-causal batch needs);
llama-server packs one sequence per slot into a batch, so it gets enough slots (`-np`) to fill its batch
with these texts, and the cells for them. Both vectors of the first text are compared (max abs diff).
Goal (issue 33): ours >= llama-server.

  python scripts/bench_embeddings.py [--model NAME_OR_PATH] [--texts 256] [--tokens 100] [--quick] [--json]

``--quick`` (the test suite): a tiny generated BERT, 32 texts of ~20 tokens.
Needs `pyllama-kv build --tools` (llama-server).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

import pyllama_kv as pk
from pyllama_kv.config import default_threads
from pyllama_kv.modelfile import catalogue
from pyllama_kv.tools.bench import machine
from pyllama_kv.tools.gguf import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import Server, free_port, llama_server_path, pyllama_kv_cmd  # noqa: E402

WORDS = ("the cache model sequence token batch prefix fork people work time world state year day life "
         "house water river city school music letter number question answer system memory").split()


def make_texts(model: pk.Model, n: int, tokens: int, seed: int = 0) -> list[str]:
    """``n`` distinct texts of about ``tokens`` tokens each (random words, cut by the model's tokenizer)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [f"item{i}"] + [rng.choice(WORDS) for _ in range(tokens * 2)]
        text = " ".join(words)
        toks = model.tokenize(text, add_bos=False, special=False)[:tokens - 2]
        out.append(model.detokenize(toks))
    return out


def commands(model: Path, port: int, name: str, a, n_slots: int) -> list[str]:
    if name == "llama-server":
        return [str(llama_server_path()), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                "--embeddings", "--pooling", a.pooling, "-c", str(n_slots * a.slot_cells), "-np", str(n_slots),
                "-t", str(a.threads), "-tb", str(a.threads), "-b", str(a.batch), "-ub", str(a.batch), "-ngl", "0",
                "--no-webui"]
    return [*pyllama_kv_cmd(), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--pooling",
            a.pooling, "--threads", str(a.threads), "--batch", str(a.batch), "--ctx", str(a.batch), "--parallel", "1"]


def run_load(url: str, texts: list[str], per_request: int, clients: int) -> tuple[float, list, int]:
    """(seconds, the first text's vector, errors) of embedding ``texts`` in requests of ``per_request``."""
    chunks = [texts[i:i + per_request] for i in range(0, len(texts), per_request)]
    first: list = []
    errors = 0

    def post(chunk: list[str]) -> list | None:
        r = httpx.post(url + "/v1/embeddings", json={"input": chunk, "encoding_format": "float"}, timeout=600)
        if r.status_code != 200:
            return None
        return r.json()["data"]

    post(texts[:2])   # warm-up (and the embeddings context of ours)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(post, chunks))
    dt = time.perf_counter() - t0
    for i, res in enumerate(results):
        if res is None or len(res) != len(chunks[i]):
            errors += 1
        elif i == 0:
            first = res[0]["embedding"]
    return dt, first, errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="catalogue name or GGUF path")
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=100, help="tokens per text (about)")
    ap.add_argument("--pooling", default="mean", choices=("mean", "cls", "last"))
    ap.add_argument("--batch", type=int, default=2048, help="tokens per decode, both servers (-b = -ub)")
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--per-request", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="a tiny generated BERT, 32 texts of ~20 tokens")
    ap.add_argument("--json", action="store_true", help="compact JSON")
    a = ap.parse_args()
    tmp = tempfile.TemporaryDirectory(prefix="bench-emb-")
    if a.quick:
        model_path = make_tiny_model(Path(tmp.name) / "bert.gguf", arch="bert", n_ctx_train=512)
        a.texts, a.tokens, a.batch = 32, 20, 512
    else:
        p = Path(a.model)
        model_path = p if p.is_file() else catalogue.model_path(catalogue.get(a.model))
    with pk.Model(model_path) as m:
        texts = make_texts(m, a.texts, a.tokens)
        n_tokens = sum(len(m.tokenize(t, add_bos=True, special=True)) for t in texts)
    a.slot_cells = a.tokens + 16
    n_slots = max(1, min(64, a.batch // a.tokens))   # enough to fill a batch with these texts
    rows, vecs = [], {}
    for name in ("pyllama-kv", "llama-server"):
        port = free_port()
        with Server(name, commands(model_path, port, name, a, n_slots), port, Path(tmp.name)) as srv:
            dt, first, errors = run_load(srv.url, texts, a.per_request, a.clients)
        vecs[name] = np.asarray(first, dtype=np.float32)
        rows.append({"server": name, "seconds": round(dt, 3), "texts_per_s": round(a.texts / dt, 2),
                     "tokens_per_s": round(n_tokens / dt, 1), "errors": errors})
    ratio = rows[1]["seconds"] / rows[0]["seconds"]   # texts/s ours over theirs (same texts), unrounded
    diff = float(np.abs(vecs["pyllama-kv"] - vecs["llama-server"]).max()) \
        if vecs["pyllama-kv"].size and vecs["pyllama-kv"].shape == vecs["llama-server"].shape else None
    out = {"benchmark": "embeddings", "date": time.strftime("%Y-%m-%d"), "machine": machine(),
           "model": model_path.name,
           "settings": {"texts": a.texts, "tokens_per_text": a.tokens, "prompt_tokens": n_tokens, "pooling": a.pooling,
                        "batch": a.batch, "threads": a.threads, "clients": a.clients, "per_request": a.per_request,
                        "llama_server_slots": n_slots, "quick": a.quick},
           "rows": rows, "ratio_ours_over_llama_server": round(ratio, 3), "first_vector_max_abs_diff": diff,
           "target_met": ratio >= 1.0}
    print(json.dumps(out, separators=(",", ":")) if a.json else json.dumps(out, indent=2))
    print(f"pyllama-kv / llama-server texts/s: {ratio:.2f}x", file=sys.stderr)
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
