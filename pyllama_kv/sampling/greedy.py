"""Greedy draws: :func:`argmax` for one row of logits, :func:`argmaxes` for a step's rows at once.

A greedy step of many sequences over a large vocabulary is a scan of every logit (32 sequences of a
128k vocabulary: 16 MiB, ~1.5 ms on one core), while a GPU computes that step in ~13 ms. numpy
releases the GIL inside ``argmax``, so :func:`argmaxes` splits the rows across a few threads
(measured on the H200 machine in docs/gpu.md). Below :data:`PARALLEL_MIN_FLOATS` the hand-off costs
more than it saves, and the rows are scanned on the calling thread."""
from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: the logits a step must hold before its rows are split across threads (8 rows of a 128k vocabulary)
PARALLEL_MIN_FLOATS = 1 << 20
#: the most threads a step's rows are split across (the scan is bound by memory, not by cores)
MAX_THREADS = 8

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def argmax(logits: np.ndarray) -> int:
    """The most likely token of one row (the engine's greedy sampler; ties go to the lowest id)."""
    return int(np.argmax(logits))


def _scan(rows: Sequence[np.ndarray]) -> list[int]:
    return [int(np.argmax(r)) for r in rows]


def _threads() -> int:
    return max(1, min(MAX_THREADS, (os.cpu_count() or 1)))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_threads() - 1, thread_name_prefix="pyllama-kv-argmax")
        return _pool


def argmaxes(rows: Sequence[np.ndarray]) -> list[int]:
    """``[argmax(r) for r in rows]``, the same tokens, with the rows split across up to
    :data:`MAX_THREADS` threads (the caller's among them) when they hold at least
    :data:`PARALLEL_MIN_FLOATS` logits and the machine has more than one core."""
    n = len(rows)
    k = min(_threads(), n)
    if k < 2 or sum(r.size for r in rows) < PARALLEL_MIN_FLOATS:
        return _scan(rows)
    parts = [rows[i * n // k:(i + 1) * n // k] for i in range(k)]
    pool = _executor()
    futures = [pool.submit(_scan, p) for p in parts[1:]]
    out = _scan(parts[0])
    for f in futures:
        out += f.result()
    return out
