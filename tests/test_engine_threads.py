"""The engine's loop thread decodes without its barriers sleeping (counted in context switches, not
time). libgomp keeps a pool of workers for each thread that ran a parallel region and, when they
outnumber the CPUs, stops spinning at barriers: a model and context set up (and decoded) on the main
thread and then decoding on the engine's thread left two pools, and every decode slept and woke at
its barriers (~150 context switches a decode; SmolLM2's token 23 ms instead of 18). Engine.start
frees the starting thread's pool first. Each case runs in a fresh process (a fresh OpenMP runtime)."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import run_py

SCRIPT = r'''
import json, os, sys
import pyllama_kv as pk
import pyllama_kv.engine.scheduler as sched
from pyllama_kv.engine import Engine, EngineConfig, SamplingParams

if sys.argv[2] == "no-release":
    sched.release_thread_pool = lambda: False
threads = len(os.sched_getaffinity(0))        # a pool per thread outnumbers the CPUs whatever their count
m = pk.Model(sys.argv[1], lib=sys.argv[3])
with m.context(n_ctx=256, n_threads=threads) as ctx:   # the main thread decodes first: its pool exists
    s = ctx.new_sequence()
    ctx.decode({s: list(range(10, 50))})

def switches():
    total = 0
    for t in os.listdir(f"/proc/{os.getpid()}/task"):
        for line in open(f"/proc/{os.getpid()}/task/{t}/status"):
            if line.startswith("voluntary_ctxt_switches"):
                total += int(line.split()[1])
    return total

greedy = SamplingParams(temperature=0.0, ignore_eos=True)
with Engine(m, EngineConfig(n_ctx=1024, parallel=1, n_threads=threads, flash_attn=False)) as e:
    e.start()
    e.submit(list(range(100, 140)), greedy, max_tokens=4).result(120)   # the prompt, and a few tokens
    calls, before = e.stats.decode_calls, switches()
    e.submit(list(range(100, 140)) + [7], greedy, max_tokens=48).result(300)
    n = e.stats.decode_calls - calls
    print(json.dumps({"decodes": n, "switches": switches() - before, "released": sys.argv[2]}))
'''


def _run(real_model, mode: str, lib: str) -> dict:
    r = run_py(["-c", SCRIPT, str(real_model), mode, lib], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts context switches in /proc")
def test_the_loop_thread_decodes_without_sleeping_at_barriers(real_model, pin_lib):
    fixed = _run(real_model, "release", pin_lib)
    broken = _run(real_model, "no-release", pin_lib)
    print(fixed, broken)
    assert fixed["decodes"] >= 40 and broken["decodes"] >= 40
    # fixed: the workers spin (a few switches for the loop's own waits); broken: every barrier sleeps
    assert fixed["switches"] <= 2 * fixed["decodes"], fixed
    assert broken["switches"] >= 20 * broken["decodes"], broken
