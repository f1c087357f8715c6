"""The OpenMP runtime our CPU builds of ggml use (libgomp on Linux, libomp elsewhere).

libgomp keeps a pool of worker threads for every thread that ran a parallel region, and counts them
all; when they outnumber the CPUs it stops spinning at a barrier after 100 turns and sleeps on a
futex instead. A context used first on one thread (a model loaded and a context made on the main
thread) and then decoding on another (the engine's loop thread) leaves two pools on a 2-core machine:
every barrier of every decode then sleeps and wakes (~150 context switches a decode), and a token of
SmolLM2 took 23 ms instead of 18. :func:`release_thread_pool` frees the calling thread's pool
(``omp_pause_resource_all(omp_pause_soft)``, OpenMP 5.0), so that the thread that decodes is the only
one with workers.
"""
from __future__ import annotations

import ctypes
import os

__all__ = ["release_thread_pool"]

#: the OpenMP runtimes a ggml build may have loaded, by platform
_RUNTIMES = ("libgomp.so.1", "libomp.so", "libomp.so.5", "libomp.dylib", "libiomp5.so")
_OMP_PAUSE_SOFT = 1


def release_thread_pool() -> bool:
    """Free the OpenMP worker threads of the calling thread's pool (they are made again if it runs a
    parallel region later). False when no OpenMP runtime is loaded in this process, or it cannot."""
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LOCAL", 0)
    for name in _RUNTIMES:
        try:
            rt = ctypes.CDLL(name, mode=mode)   # only one already loaded (RTLD_NOLOAD): never loads it
        except OSError:
            continue
        fn = getattr(rt, "omp_pause_resource_all", None)
        if fn is None:
            return False
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn(_OMP_PAUSE_SOFT) == 0
    return False
