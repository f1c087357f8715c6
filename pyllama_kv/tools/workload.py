"""A seeded, server-like workload over one context (`pyllama-kv stress`, the demo, the benchmarks).

Requests arrive with prompts of random length (some starting with one of a few shared system
prompts), generate a random number of tokens, and leave, so the cache fragments. They are served
by the generation engine (pyllama_kv.engine) in step mode: every step is one continuous-batching
decode of one token per generating request plus prompt chunks, with prefix reuse, admission
control and preemption as the engine does them.

The request stream is drawn from the seed alone, so the patched and the vanilla library see the same
requests at the same steps. What differs is what the library manages to place:

* a **slot failure** is a decode the library refused (KVCacheFullError) although the free cells were
  enough for the batch: the fragmentation failure our patches fix. The engine fails the requests
  whose prompts were in that batch (finish reason "cache_full");
* when the cells really are not there, the engine preempts a request and resumes it later; that is
  counted too, and should be rare: admission keeps an output reserve for each running request.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import CacheConfig, SamplingParams
from ..errors import LibraryError

_GREEDY_FULL_LENGTH = SamplingParams(temperature=0.0, ignore_eos=True)


@dataclass(frozen=True)
class StressConfig(CacheConfig):
    """The workload: its KV cache (CacheConfig's fields: n_ctx, batch sizes, cache types, threads) and
    the request stream drawn from ``seed``."""

    parallel: int = 8            # requests served at once (EngineConfig.parallel)
    steps: int = 300             # decode steps (server iterations)
    seed: int = 0
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
    # cells the engine reserves per running request at admission: on purpose fewer than EngineConfig's
    # 64, so that more requests are admitted at once and the cache fills and fragments (what is measured)
    output_reserve: int = 32


@dataclass
class WorkItem:
    """One request of the drawn stream (what Engine.submit will get at step ``arrival``)."""

    rid: int
    arrival: int
    prefix: int | None
    suffix: list[int]
    gen_len: int


@dataclass
class StressResult:
    config: dict
    library: dict
    steps: int = 0
    decode_calls: int = 0
    evaluated_tokens: int = 0    # prompt tokens evaluated (EngineStats.evaluated_tokens; not the admitted
                                 # prompts' length, which EngineStats.prompt_tokens and Usage count)
    gen_tokens: int = 0
    reused_tokens: int = 0       # prompt tokens served from cached cells (shared system prompts)
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
        return self.evaluated_tokens + self.gen_tokens

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tokens"] = self.tokens
        d["tokens_per_s"] = round(self.tokens / self.seconds, 1) if self.seconds > 0 else None
        return d


def make_requests(cfg: StressConfig, n_vocab: int, n: int) -> tuple[list[list[int]], list[WorkItem]]:
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
        reqs.append(WorkItem(rid, int(t), prefix, suffix, int(rng.integers(cfg.gen_min, cfg.gen_max + 1))))
    return prefixes, reqs


def run_stress(model, cfg: StressConfig, progress: Callable[[int, int, StressResult], None] | None = None,
               should_stop: Callable[[], bool] | None = None) -> tuple[StressResult, np.ndarray | None]:
    """Run the workload on ``model`` (its library decides patched or vanilla); return the result and,
    with ``cfg.record_map``, the occupancy map (steps x cells, int16: -1 free, -2 shared, else a
    sequence id)."""
    from ..config import EngineConfig
    from ..engine import Engine

    parallel = 1 if cfg.sequential else cfg.parallel
    ecfg = EngineConfig(**cfg.cache_kwargs(), parallel=parallel, prefix_cache=max(cfg.n_prefixes, 1),
                        max_queue=100_000, output_reserve=cfg.output_reserve, max_tokens=max(cfg.gen_max, 1),
                        keep_finished=False)
    res = StressResult(config=asdict(cfg), library={k: model.library.get(k) for k in ("variant", "path", "backend")})
    prefixes, reqs = make_requests(cfg, model.n_vocab, n=cfg.steps * 4 + 16)
    frags: list[float] = []
    fail_free: list[float] = []
    maps: list[np.ndarray] | None = [] if cfg.record_map else None
    handles: list = []
    nxt = 0
    if cfg.record_map and not model.native_library.caps.cell_view:
        raise LibraryError(f"the occupancy map (--map) needs a per-cell view of the KV cache in cache order, which "
                           f"the {model.native_library.caps.api} llama.cpp library does not have: run without --map")
    eng = Engine(model, ecfg)
    ctx = eng.context
    assert ctx is not None   # (an engine over its own context)
    t0 = time.perf_counter()
    try:
        for step in range(cfg.steps):
            if should_stop is not None and should_stop():
                res.interrupted = True
                break
            nxt = _submit_arrivals(eng, cfg, prefixes, reqs, nxt, step, handles)
            failures = eng.stats.slot_failures
            free_before = ctx.free_cells()
            eng.step()
            if eng.stats.slot_failures > failures:
                fail_free.append(free_before / ctx.n_ctx)
            st = ctx.kv_stats()
            frags.append(st.fragmentation)
            if maps is not None:
                maps.append(ctx.kv_cells().astype(np.int16))
            res.steps = step + 1
            if progress is not None:
                _fill(res, eng, handles, t0)
                progress(step + 1, cfg.steps, res)
    except KeyboardInterrupt:
        res.interrupted = True
    finally:
        _finish(res, eng, ctx, handles, t0, frags, fail_free)
    occupancy = np.stack(maps) if maps else None
    return res, occupancy


def _submit_arrivals(eng, cfg: StressConfig, prefixes: list[list[int]], reqs: list[WorkItem], nxt: int, step: int,
                     handles: list) -> int:
    """Submit the requests from ``reqs[nxt]`` that arrive by ``step`` (all of them at once in
    sequential mode, where one is served at a time, up to 3 waiting); return the next one's index."""
    while nxt < len(reqs) and (cfg.sequential or reqs[nxt].arrival <= step):
        r = reqs[nxt]
        nxt += 1
        prompt = (prefixes[r.prefix] if r.prefix is not None else []) + r.suffix
        prompt = prompt[:cfg.n_ctx - 2]
        handles.append(eng.submit(prompt, _GREEDY_FULL_LENGTH, max_tokens=r.gen_len))
        if cfg.sequential and eng.waiting > 2:
            break
    return nxt


def _finish(res: StressResult, eng, ctx, handles: list, t0: float, frags: list[float], fail_free: list[float]) -> None:
    """The result's final counts, cache statistics and fragmentation; then the engine is closed."""
    _fill(res, eng, handles, t0)
    st = ctx.kv_stats()
    keep = ("defrags", "moves", "cells_moved", "graphs", "slot_retries", "slot_failures", "defrag_seconds")
    res.kv = {k: v for k, v in st.as_dict().items() if k in keep}
    if st.defrag_seconds is not None and res.seconds > 0:
        res.kv["defrag_share"] = round(st.defrag_seconds / res.seconds, 4)
    res.peak_fragmentation = round(max(frags), 4) if frags else 0.0
    res.mean_fragmentation = round(float(np.mean(frags)), 4) if frags else 0.0
    res.free_at_failures = round(float(np.mean(fail_free)), 4) if fail_free else None
    eng.close()


def _fill(res: StressResult, eng, handles: list, t0: float) -> None:
    st = eng.stats
    res.seconds = time.perf_counter() - t0
    res.decode_calls = st.decode_calls
    res.evaluated_tokens = st.evaluated_tokens
    res.gen_tokens = st.generated_tokens
    res.reused_tokens = st.reused_tokens
    res.slot_failures = st.slot_failures
    res.failed_requests = st.finished["cache_full"]
    res.preempted = st.preempted
    res.requests = {"arrived": len(handles), "started": st.admitted, "completed": st.finished["length"],
                    "failed": st.finished["cache_full"], "preempted": st.preempted, "active_at_end": eng.running,
                    "waiting_at_end": eng.waiting}


def draw_map(occupancy: np.ndarray, path, title: str = "") -> Path:
    """Draw the occupancy map (steps x cells) as an image: a colour per sequence, shared cells dark
    grey, free cells white; return the path written. The format is the suffix's (a path without one
    gets ``.png``). The file is written whole or not at all (a temporary file renamed over it).
    Needs matplotlib (``pip install pyllama-kv[map]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError as exc:
        raise ImportError("--map needs matplotlib: pip install 'pyllama-kv[map]' (or pip install matplotlib)") from exc
    occ = np.asarray(occupancy)
    n_ids = int(occ.max()) + 1 if occ.size and occ.max() >= 0 else 1
    base = plt.get_cmap("tab20").colors  # type: ignore[attr-defined]
    colors = [(1.0, 1.0, 1.0), (0.25, 0.25, 0.25)] + [base[i % len(base)] for i in range(n_ids)]
    # colour indices: free 0, shared 1, sequence i: i + 2
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
    path = Path(path)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                fig.savefig(f, format=path.suffix[1:].lower())
            umask = os.umask(0o022)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would stick to the result
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    finally:
        plt.close(fig)
    return path
