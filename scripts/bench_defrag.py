#!/usr/bin/env python3
"""Benchmark 2: the cost of one full defrag against the memory it moves, on each defrag path. Prints JSON.

For caches of 2k, 8k and 32k cells and a 32-layer model, with flash attention off and on, fragment the
cache with single-cell holes (every other cell freed: half free), then time one full defrag on each
path of the patched build, chosen with LLAMA_KV_DEFRAG_GRAPH (read at every defrag):

* ``gather``: the gather graphs (patch 0011; ``=1``): a constant number of nodes per layer;
* ``moves``: the per-move graphs (``=moves``): 6 nodes per layer and block move;
* ``host``: memcpy on the host cache (patch 0006; the default for a cache in host memory);
* ``vanilla``: the unpatched build, which stops after one graph's worth of moves and leaves holes.

Each row reports the moves, graphs and graph nodes from ``kv_stats()``, ms, GB/s and, measured in the
same run, the time of a contiguous numpy copy of the bytes the moved cells hold (K and V, all layers).
``ratios`` sets the paths side by side per cache size: gather/host, moves/host, host/copy, and the
nodes per graph against 8 per layer.

  python scripts/bench_defrag.py [--quick] [--json] [--cells 2048,8192,32768] [--layers 32]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import pyllama_kv as pk
from pyllama_kv.tools.bench import machine
from pyllama_kv.tools.gguf import make_tiny_model

TYPE_BYTES = {"f16": 2, "f32": 4}
PATHS = {"gather": "1", "moves": "moves", "host": None}  # path -> LLAMA_KV_DEFRAG_GRAPH


def numpy_copy_seconds(n_bytes: int, repeats: int = 3) -> float:
    src = np.ones(n_bytes, dtype=np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return best


def one(model: pk.Model, n_cells: int, type_kv: str, flash_attn: bool, n_threads: int | None,
        max_chunk: int = 1024) -> dict:
    # the worst-case reserve after a defrag must stay inside the cache on the vanilla build (patch 0003):
    # used cells end at n/2 after packing, so keep n_ubatch <= n/4
    n_ubatch = min(512, n_cells // 4)
    chunk = min(n_cells, max_chunk)
    with model.context(n_ctx=n_cells, n_seq_max=n_cells // chunk, n_batch=n_ubatch, n_ubatch=n_ubatch,
                       flash_attn=flash_attn, type_k=type_kv, type_v=type_kv, n_threads=n_threads) as ctx:
        # fill the cache: compute `chunk` cells once, then write copies of them (no compute)
        a = ctx.new_sequence()
        a.extend(np.random.default_rng(0).integers(3, 300, chunk).tolist())
        state = a.export_state()
        seqs = [a] + [ctx.import_sequence(state) for _ in range(n_cells // chunk - 1)]
        for s in seqs:  # single-cell holes: half the cache free
            for p in range(0, chunk, 2):
                ctx._L.llama_kv_self_seq_rm(ctx._ptr, s.id, p, p + 1)
        before = ctx.kv_stats()
        used_before = ctx.kv_cells() != -1
        t = time.perf_counter()
        ctx._L.llama_kv_self_defrag(ctx._ptr)
        ctx._L.llama_kv_self_update(ctx._ptr)
        secs = time.perf_counter() - t
        after = ctx.kv_stats()
        used_after = ctx.kv_cells() != -1
    t0, t1 = before.defrag_seconds, after.defrag_seconds
    n_embd_kv = model.n_embd // model.n_head * model.n_head_kv
    per_cell = model.n_layer * 2 * n_embd_kv * TYPE_BYTES[type_kv]
    moved = int((used_after & ~used_before).sum())  # cells that landed in a former hole
    n_bytes = moved * per_cell
    np_s = numpy_copy_seconds(n_bytes) if n_bytes else float("nan")
    return {
        "library": "patched" if model.library["has_stats"] else "vanilla",
        "n_cells": n_cells,
        "flash_attn": flash_attn,
        "used_cells": before.used_cells,
        "holes_before": before.holes,
        "holes_after": after.holes,
        "cells_moved": moved,
        "bytes_moved": n_bytes,
        "ms": round(secs * 1000, 3),
        "defrag_ms": None if t0 is None or t1 is None else round((t1 - t0) * 1000, 3),  # the library's own count
        "gb_per_s": round(n_bytes / secs / 1e9, 3),
        "moves": after.moves,
        "graphs": after.graphs,
        "nodes": after.nodes,
        "numpy_copy_ms": round(np_s * 1000, 3),
        "numpy_gb_per_s": round(n_bytes / np_s / 1e9, 3) if n_bytes else None,
        "ratio_to_numpy": round(secs / np_s, 2) if n_bytes else None,
    }


def run_path(mp: Path, lib: str | None, path: str | None, *args) -> dict:
    """One row: `path` (a key of PATHS) on the patched build (lib None: $PYLLAMA_KV_LIB, else the patched
    build), or the vanilla build (path None)."""
    old = os.environ.pop("LLAMA_KV_DEFRAG_GRAPH", None)
    try:
        value = PATHS[path] if path is not None else None
        if value is not None:
            os.environ["LLAMA_KV_DEFRAG_GRAPH"] = value
        with pk.Model(mp, lib=lib) as m:
            row = one(m, *args)
    finally:
        os.environ.pop("LLAMA_KV_DEFRAG_GRAPH", None)
        if old is not None:
            os.environ["LLAMA_KV_DEFRAG_GRAPH"] = old
    row["path"] = path or "vanilla"
    return row


def ratios(rows: list[dict], n_layer: int) -> dict:
    """The paths of one cache size and attention setting side by side."""
    by = {r["path"]: r for r in rows}
    g, mv, h = by["gather"], by["moves"], by["host"]

    def per_graph(r: dict) -> float | None:
        return round(r["nodes"] / r["graphs"], 1) if r["graphs"] else None

    return {
        "n_cells": g["n_cells"], "flash_attn": g["flash_attn"],
        "gather_ms": g["ms"], "moves_ms": mv["ms"], "host_ms": h["ms"], "copy_ms": h["numpy_copy_ms"],
        "gather_over_host": round(g["ms"] / h["ms"], 2),
        "moves_over_host": round(mv["ms"] / h["ms"], 2),
        "host_over_copy": h["ratio_to_numpy"],
        "gather_nodes_per_graph": per_graph(g), "moves_nodes_per_graph": per_graph(mv),
        "node_limit_per_graph": 8 * n_layer,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="2048,8192,32768", help="cache sizes (default 2048,8192,32768)")
    ap.add_argument("--layers", type=int, default=32, help="model layers (default 32)")
    ap.add_argument("--embd", type=int, default=256, help="model n_embd (default 256; KV heads are half the heads)")
    ap.add_argument("--type", default="f16", choices=sorted(TYPE_BYTES), help="KV cache type (default f16)")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: the context's)")
    ap.add_argument("--paths", default="gather,moves,host,vanilla",
                    help="defrag paths to time (default gather,moves,host,vanilla; vanilla needs its build)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for the test suite")
    ap.add_argument("--json", action="store_true", help="compact JSON")
    args = ap.parse_args(argv)
    cells = [int(x) for x in args.cells.split(",")]
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or any(p not in PATHS and p != "vanilla" for p in paths):
        ap.error(f"--paths takes a comma-separated list of {', '.join([*PATHS, 'vanilla'])}")
    layers, embd = args.layers, args.embd
    if args.quick:
        # small, but past vanilla's one graph of moves ((65536 - 2*64) / (6*64) = 170 moves at 64 layers;
        # 1024 cells need 256), so that vanilla visibly leaves holes, and the per-move path needs 2 graphs
        cells, layers, embd = [1024], 64, 64
        # one thread: vanilla's defrag graph has ~65k nodes, and on a loaded machine a barrier per node
        # between threads that cannot all run stretched it from 0.5 s to minutes
        args.threads = args.threads or 1
    out = {"benchmark": "defrag", "machine": machine(), "date": time.strftime("%Y-%m-%d"),
           "model": {"n_layer": layers, "n_embd": embd}, "type_kv": args.type, "rows": [], "ratios": []}
    with tempfile.TemporaryDirectory() as tmp:
        mp = make_tiny_model(Path(tmp) / "m.gguf", n_layer=layers, n_embd=embd, n_head=8, n_head_kv=4,
                             n_ff=2 * embd, n_ctx_train=max(cells), dtype="f16")
        for n in cells:
            for fa in (False, True):
                rows = []
                for lib, path in [(None, p) for p in PATHS if p in paths] + [("vanilla", None)] * ("vanilla" in paths):
                    row = run_path(mp, lib, path, n, args.type, fa, args.threads, 256 if args.quick else 1024)
                    rows.append(row)
                    print(f"  {row['path']:8} {n:6} cells fa={int(fa)}: {row['ms']:9.1f} ms, "
                          f"{row['gb_per_s']:.3f} GB/s (copy {row['numpy_copy_ms']} ms), graphs {row['graphs']}, "
                          f"nodes {row['nodes']}, holes left {row['holes_after']}", file=sys.stderr)
                out["rows"] += rows
                if all(p in paths for p in PATHS):
                    out["ratios"].append(ratios(rows, layers))
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
