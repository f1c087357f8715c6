"""Helpers shared by the benchmark scripts in ``scripts/``: the machine a result was measured on, and
a load of requests taken in order by a number of clients."""
from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["fan_out", "machine"]

T = TypeVar("T")


def machine() -> dict:
    """CPU model, core count, platform and Python version, for the ``machine`` field of a result."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}



def fan_out(n: int, clients: int, work: Callable[[Any, int], T], session: Callable[[], AbstractContextManager],
            on_done: Callable[[int], None] | None = None) -> tuple[list[T | None], float]:
    """``clients`` threads, each with its own ``session()`` (an HTTP client), take items ``0..n-1`` in
    order and call ``work(session, i)``; returns the results in item order and the wall time.
    ``on_done(k)`` is called after each item with how many are done."""
    results: list[T | None] = [None] * n
    lock = threading.Lock()
    nxt, done = [0], [0]

    def worker() -> None:
        with session() as s:
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= n:
                    return
                results[i] = work(s, i)
                with lock:
                    done[0] += 1
                    k = done[0]
                if on_done is not None:
                    on_done(k)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - t0
