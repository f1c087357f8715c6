#!/usr/bin/env python3
"""Restoring a span vs evaluating its tokens again, per token, side by side in one run.

For each model: a sequence holds a prefix of ``--prefix`` tokens; its next ``--span`` tokens are
(a) evaluated (``extend``, in the context's batches) and (b) copied out with ``snapshot`` and put
back with ``restore`` (patch 0014's ``llama_state_seq_add_data``: a memcpy into free cells) after
truncating the sequence to its prefix. Medians of ``--repeat`` runs; the ratio is (a) / (b restore).

``--interleave N`` adds what a server's page-out meets: N sequences generate ``--span`` tokens
(at most 256) one step at a time, so each one's cells alternate with the others' (one cell range per
token); the snapshot of one of them, and its restore, per token; and the same snapshot with
patch 0019's gather off (``LLAMA_STATE_IO_GATHER=0``, alternating: on a device cache the cells are
then read in windows, patch 0016; on the CPU both read host memory in place). ``--flash-attn off,on`` runs each
setting (without flash attention the V cache is transposed: a V row per cell range to copy).

    .venv/bin/python scripts/bench_spans.py --json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import pyllama_kv as pk  # noqa: E402
from pyllama_kv.modelfile import catalogue  # noqa: E402


def round_trip(s, prefix: int) -> tuple[float, float, pk.Span]:
    """Snapshot ``s``'s positions from ``prefix`` on, truncate, restore: (snapshot s, restore s, the span)."""
    t = time.perf_counter()
    sp = s.snapshot(prefix)
    t_snap = time.perf_counter() - t
    s.truncate(prefix)
    t = time.perf_counter()
    s.restore(sp)
    return t_snap, time.perf_counter() - t, sp


def interleaved(model, prefix: int, span: int, n: int, repeat: int, threads: int | None, fa: bool) -> dict:
    """Snapshot and restore of a sequence whose ``span`` tokens were generated among ``n - 1`` others."""
    rng = np.random.default_rng(1)
    k = min(span, 256)
    toks = [int(t) for t in rng.integers(10, min(model.n_vocab, 30000), prefix + k)]
    snaps, restores, windows = [], [], []
    with model.context(n_ctx=prefix + n * k + k + 16, n_seq_max=n + 1, n_batch=512, n_threads=threads,
                       flash_attn=fa) as ctx:
        root = ctx.new_sequence()
        root.extend(toks[:prefix])
        seqs = [root.fork() for _ in range(n)]
        for i in range(k):
            ctx.decode({s: [toks[prefix + i]] for s in seqs})
        s = seqs[0]
        s.logits()
        graphs0 = gather_graphs(ctx)
        for _ in range(repeat):   # a snapshot only reads: the cells stay interleaved
            snaps.append(timed(lambda: s.snapshot(prefix)))
            if ctx.caps.stats:   # the same snapshot without patch 0019's gather, alternating (the mission pin's)
                with state_gather_off():
                    windows.append(timed(lambda: s.snapshot(prefix)))
        graphs = gather_graphs(ctx) - graphs0
        for _ in range(repeat):   # a restore fills free cells from a compact span, wherever it came from
            restores.append(round_trip(s, prefix)[1])
    med = statistics.median
    return {"interleaved_sequences": n, "interleaved_tokens": k,
            "interleaved_snapshot_ms_per_token": round(1e3 * med(snaps) / k, 4),
            "interleaved_snapshot_without_gather_ms_per_token": round(1e3 * med(windows) / k, 4) if windows else None,
            "interleaved_gather_graphs_per_snapshot": round(graphs / repeat, 1),
            "interleaved_restore_ms_per_token": round(1e3 * med(restores) / k, 4)}


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def gather_graphs(ctx) -> int:
    """Graphs patch 0019 computed to gather cells for state writes in ``ctx`` (0 where it is absent)."""
    return ctx._native.stats().get("n_state_gather_graphs", 0) if ctx.caps.stats else 0


@contextlib.contextmanager
def state_gather_off():
    """LLAMA_STATE_IO_GATHER=0 while inside: patch 0019 reads it at each state write."""
    old = os.environ.get("LLAMA_STATE_IO_GATHER")
    os.environ["LLAMA_STATE_IO_GATHER"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["LLAMA_STATE_IO_GATHER"]
        else:
            os.environ["LLAMA_STATE_IO_GATHER"] = old


def measure(name: str, prefix: int, span: int, repeat: int, threads: int | None, fa: bool = False,
            interleave: int = 0) -> dict:
    model = pk.Model(name if Path(name).is_file() else catalogue.resolve(name))
    rng = np.random.default_rng(0)
    toks = [int(t) for t in rng.integers(10, min(model.n_vocab, 30000), prefix + span)]
    evals, snaps, restores = [], [], []
    with model.context(n_ctx=prefix + span + 16, n_seq_max=2, n_batch=512, n_threads=threads,
                       flash_attn=fa) as ctx:
        s = ctx.new_sequence()
        s.extend(toks[:prefix])
        for _ in range(repeat):
            t = time.perf_counter()
            s.extend(toks[prefix:])
            s.logits()   # on a GPU, decode returns before the graph has run: wait for it
            evals.append(time.perf_counter() - t)
            t_snap, t_restore, sp = round_trip(s, prefix)
            snaps.append(t_snap)
            restores.append(t_restore)
            s.truncate(prefix)
        nbytes = sp.nbytes
    extra = interleaved(model, prefix, span, interleave, repeat, threads, fa) if interleave > 1 else {}
    model.close()
    med = statistics.median
    return {"model": name, "flash_attn": fa, "prefix": prefix, "span_tokens": span, "span_bytes": nbytes, **extra,
            "evaluate_ms_per_token": round(1e3 * med(evals) / span, 4),
            "snapshot_ms_per_token": round(1e3 * med(snaps) / span, 4),
            "restore_ms_per_token": round(1e3 * med(restores) / span, 4),
            "evaluate_over_restore": round(med(evals) / med(restores), 1),
            "evaluate_over_snapshot_plus_restore": round(med(evals) / (med(snaps) + med(restores)), 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m-instruct,gemma3-270m")
    p.add_argument("--prefix", type=int, default=256)
    p.add_argument("--span", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--flash-attn", default="off", help="off, on, or off,on (default off)")
    p.add_argument("--interleave", type=int, default=0, metavar="N",
                   help="also time a sequence generated among N (>1) sequences (default: not)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    fas = [{"off": False, "on": True}[v.strip()] for v in a.flash_attn.split(",")]
    rows = [measure(n, a.prefix, a.span, a.repeat, a.threads, fa, a.interleave)
            for n in a.models.split(",") for fa in fas]
    if a.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            fa = "on " if r["flash_attn"] else "off"
            print(f"{r['model']:<24} fa {fa} evaluate {r['evaluate_ms_per_token']:.3f} ms/token, restore "
                  f"{r['restore_ms_per_token']:.4f} ms/token ({r['evaluate_over_restore']}x), snapshot "
                  f"{r['snapshot_ms_per_token']:.4f} ms/token; {r['span_bytes'] / 2**20:.1f} MiB for "
                  f"{r['span_tokens']} tokens" + (
                      f"; interleaved among {r['interleaved_sequences']}: snapshot "
                      f"{r['interleaved_snapshot_ms_per_token']:.4f} ({r['interleaved_gather_graphs_per_snapshot']} "
                      f"gather graphs; without: {r['interleaved_snapshot_without_gather_ms_per_token']}), restore "
                      f"{r['interleaved_restore_ms_per_token']:.4f} ms/token" if "interleaved_sequences" in r else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
