"""A seeded, server-like workload over one context (`pyllama-kv stress`, the demo, the benchmarks).

Requests arrive with prompts of random length (some sharing a system-prompt prefix, served by
forking a sequence that holds it), generate a random number of tokens, and leave, so the cache
fragments. Every step is one continuous-batching decode: the prompts of the requests admitted this
step and one token for each request that is generating.

The request stream is drawn from the seed alone, so the patched and the vanilla library see the same
requests. What differs is what the library manages to place:

* a **slot failure** is a decode the library refused (KVCacheFullError) although the free cells were
  enough for the batch: the fragmentation failure our patches fix. The new requests of that batch
  fail; the generating ones are retried alone (and one by one if needed);
* when the cells really are not there, the oldest request is preempted (closed) and counted.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from .errors import KVCacheFullError


@dataclass
class StressConfig:
    n_seqs: int = 8              # requests served at once
    n_ctx: int = 2048            # KV cache cells
    steps: int = 300             # decode steps (server iterations)
    seed: int = 0
    n_batch: int = 512
    n_ubatch: int = 512
    prompt_min: int = 16
    prompt_max: int = 384
    gen_min: int = 8
    gen_max: int = 128
    n_prefixes: int = 2          # shared system prompts
    prefix_min: int = 32
    prefix_max: int = 128
    share_prob: float = 0.5      # fraction of requests that start with a shared prefix
    arrival_rate: float = 0.6    # mean new requests per step
    sequential: bool = False     # serve the requests one after another (no fragmentation)
    record_map: bool = False     # keep the cache occupancy of every step (for --map)
    n_threads: int | None = None


@dataclass
class Request:
    rid: int
    arrival: int
    prefix: int | None
    suffix: list[int]
    gen_len: int
    seq: object = None
    generated: int = 0
    next_token: int = 0


@dataclass
class StressResult:
    config: dict
    library: dict
    steps: int = 0
    decode_calls: int = 0
    prompt_tokens: int = 0
    gen_tokens: int = 0
    reused_tokens: int = 0
    seconds: float = 0.0
    requests: dict = field(default_factory=dict)
    slot_failures: int = 0
    failed_requests: int = 0
    preempted: int = 0
    kv: dict = field(default_factory=dict)
    peak_fragmentation: float = 0.0
    mean_fragmentation: float = 0.0
    free_at_failures: float | None = None  # mean share of the cache that was free when a slot failure hit
    interrupted: bool = False

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.gen_tokens

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tokens"] = self.tokens
        d["tokens_per_s"] = round(self.tokens / self.seconds, 1) if self.seconds > 0 else None
        return d


def make_requests(cfg: StressConfig, n_vocab: int, n: int) -> tuple[list[list[int]], list[Request]]:
    """The shared prefixes and ``n`` requests, from the seed alone."""
    rng = np.random.default_rng(cfg.seed)
    lo, hi = 3, max(4, n_vocab)
    prefixes = [rng.integers(lo, hi, int(rng.integers(cfg.prefix_min, cfg.prefix_max + 1))).tolist()
                for _ in range(cfg.n_prefixes)]
    reqs = []
    t = 0.0
    for rid in range(n):
        t += rng.exponential(1.0 / max(cfg.arrival_rate, 1e-6))
        shared = cfg.n_prefixes > 0 and rng.random() < cfg.share_prob
        prefix = int(rng.integers(0, cfg.n_prefixes)) if shared else None
        plen = int(rng.integers(cfg.prompt_min, cfg.prompt_max + 1))
        if prefix is not None:
            plen = max(1, plen - len(prefixes[prefix]))
        suffix = rng.integers(lo, hi, plen).tolist()
        reqs.append(Request(rid, int(t), prefix, suffix, int(rng.integers(cfg.gen_min, cfg.gen_max + 1))))
    return prefixes, reqs


def run_stress(model, cfg: StressConfig, progress: Callable[[int, int, StressResult], None] | None = None,
               should_stop: Callable[[], bool] | None = None) -> tuple[StressResult, np.ndarray | None]:
    """Run the workload on ``model`` (its library decides patched or vanilla); return the result and,
    with ``cfg.record_map``, the occupancy map (steps x cells, int16: -1 free, -2 shared, else a
    sequence id)."""
    n_seq_max = (1 if cfg.sequential else cfg.n_seqs) + cfg.n_prefixes
    ctx = model.context(n_ctx=cfg.n_ctx, n_seq_max=n_seq_max, n_batch=cfg.n_batch, n_ubatch=cfg.n_ubatch,
                        n_threads=cfg.n_threads)
    res = StressResult(config=asdict(cfg), library={k: model.library.get(k) for k in ("variant", "path", "backend")})
    prefixes, reqs = make_requests(cfg, model.n_vocab, n=cfg.steps * 4 + 16)
    queue = deque(reqs)
    holders: dict[int, object] = {}
    active: list[Request] = []
    frags = []
    fail_free: list[float] = []
    maps = [] if cfg.record_map else None
    arrived = started = completed = 0
    limit = 1 if cfg.sequential else cfg.n_seqs
    t0 = time.perf_counter()

    def decode(batch):
        res.decode_calls += 1
        return ctx.decode(batch)

    def close(r):
        if r.seq is not None and not r.seq.closed:
            r.seq.close()
        if r in active:
            active.remove(r)

    try:
        for step in range(cfg.steps):
            if should_stop is not None and should_stop():
                res.interrupted = True
                break
            # admit arrivals (FIFO, up to the concurrency limit)
            new: list[Request] = []
            while queue and len(active) + len(new) < limit and (cfg.sequential or queue[0].arrival <= step):
                r = queue.popleft()
                arrived += 1
                new.append(r)
            batch = {}
            for r in new:
                if r.prefix is not None:
                    h = holders.get(r.prefix)
                    if h is None:
                        h = ctx.new_sequence()
                        try:
                            decode({h: prefixes[r.prefix]})
                            res.prompt_tokens += len(prefixes[r.prefix])
                            holders[r.prefix] = h
                        except KVCacheFullError:
                            h.close()
                            h = None
                    if h is not None:
                        r.seq = h.fork()
                        res.reused_tokens += len(h)
                    else:
                        r.seq = ctx.new_sequence()
                        r.suffix = prefixes[r.prefix] + r.suffix
                else:
                    r.seq = ctx.new_sequence()
                batch[r.seq] = r.suffix
            for r in active:
                batch[r.seq] = [r.next_token]
            by_seq = {r.seq: r for r in new + active}
            out = {}
            while batch:
                try:
                    out = decode(batch)
                    break
                except KVCacheFullError:
                    needed = sum(len(t) for t in batch.values())
                    free_now = ctx._free_cells()
                    if needed <= free_now:
                        # refused although the cells are free: fragmentation
                        res.slot_failures += 1
                        fail_free.append(free_now / ctx.n_ctx)
                        failed_new = [by_seq[s] for s in batch if by_seq[s] in new]
                        if failed_new:
                            for r in failed_new:
                                res.failed_requests += 1
                                batch.pop(r.seq)
                                new.remove(r)
                                close(r)
                            continue
                        # generation tokens only: one sequence at a time
                        out = {}
                        for s in list(batch):
                            try:
                                out.update(decode({s: batch[s]}))
                            except KVCacheFullError:
                                res.slot_failures += 1
                                res.failed_requests += 1
                                close(by_seq[s])
                        break
                    # really full: preempt the oldest request
                    victim = active[0] if active else (new[0] if new else None)
                    if victim is None:
                        break
                    batch.pop(victim.seq, None)
                    if victim in new:
                        new.remove(victim)
                    close(victim)
                    res.preempted += 1
            for r in new:
                if r.seq in out:
                    res.prompt_tokens += len(batch[r.seq])
                    active.append(r)
                    started += 1
            for r in list(active):
                if r.seq not in out:
                    continue
                if r not in new:
                    res.gen_tokens += 1
                    r.generated += 1
                r.next_token = int(np.argmax(out[r.seq]))
                if r.generated >= r.gen_len:
                    completed += 1
                    close(r)
            st = ctx.kv_stats()
            frags.append(st.fragmentation)
            if maps is not None:
                maps.append(ctx.kv_cells().astype(np.int16))
            res.steps = step + 1
            if progress is not None:
                res.seconds = time.perf_counter() - t0
                progress(step + 1, cfg.steps, res)
    except KeyboardInterrupt:
        res.interrupted = True
    finally:
        res.seconds = time.perf_counter() - t0
        st = ctx.kv_stats()
        res.kv = {k: v for k, v in st.as_dict().items()
                  if k in ("defrags", "moves", "cells_moved", "graphs", "slot_retries", "slot_failures", "defrag_seconds")}
        if st.defrag_seconds is not None and res.seconds > 0:
            res.kv["defrag_share"] = round(st.defrag_seconds / res.seconds, 4)
        res.requests = {"arrived": arrived, "started": started, "completed": completed,
                        "failed": res.failed_requests, "preempted": res.preempted, "active_at_end": len(active)}
        res.peak_fragmentation = round(max(frags), 4) if frags else 0.0
        res.mean_fragmentation = round(float(np.mean(frags)), 4) if frags else 0.0
        res.free_at_failures = round(float(np.mean(fail_free)), 4) if fail_free else None
        ctx.close()
    occupancy = np.stack(maps) if maps else None
    return res, occupancy


def draw_map(occupancy: np.ndarray, path, title: str = "") -> None:
    """Draw the occupancy map (steps x cells) as a PNG: a colour per sequence, shared cells dark
    grey, free cells white. Needs matplotlib (``pip install pyllama-kv[map]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError as exc:
        raise ImportError("--map needs matplotlib: pip install 'pyllama-kv[map]' (or pip install matplotlib)") from exc
    occ = np.asarray(occupancy)
    n_ids = int(occ.max()) + 1 if occ.size and occ.max() >= 0 else 1
    base = plt.get_cmap("tab20").colors
    colors = [(1.0, 1.0, 1.0), (0.25, 0.25, 0.25)] + [base[i % len(base)] for i in range(n_ids)]
    img = occ.astype(np.int32) + 2  # -2 shared -> 0 ... ; remap: free first
    img = np.where(occ == -1, 0, np.where(occ == -2, 1, occ.astype(np.int32) + 2))
    steps, cells = occ.shape
    fig_w = min(16.0, max(6.0, cells / 160))
    fig_h = min(10.0, max(3.0, steps / 40))
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=100)
    ax.imshow(img, aspect="auto", interpolation="nearest", cmap=ListedColormap(colors), vmin=0, vmax=len(colors) - 1)
    ax.set_xlabel("KV cache cell")
    ax.set_ylabel("step")
    ax.set_title(title or "KV cache occupancy (white: free, grey: shared by a fork)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
