#!/usr/bin/env python3
"""Benchmark 1: the Python binding against llama.cpp's own C++ llama-batched-bench. Prints JSON.

Both run in this one invocation, on the same model (a random 8-layer, n_embd 512 llama written with
the gguf package, so decoding dominates), the same patched library build, context, batch sizes and
threads: prompt 128 and generation 128 tokens for 1, 2, 4, 8 parallel sequences. The Python side
uses ``ctx.decode`` exactly as batched-bench uses llama_decode: one batch with every sequence's
prompt, then one batch per generation step with one token per sequence. Reported per row: prompt
and generation tokens/s of both, the ratio python/C++ (1.0 = as fast), and the share of the Python
generation loop spent outside llama_decode (the binding's own cost, measured within one run).

``--lib`` picks the library of each column, a comma-separated list, all measured in the same run,
interleaved row by row on the same model, context, batch sizes and threads:
  * ``patched`` (default): our pin's patched build against that build's llama-batched-bench;
  * ``current``: ours on the current llama.cpp (``build/current-*``) against the current llama.cpp's
    own llama-batched-bench (the peer build, ``pyllama-kv build --peer``, built here when missing),
    run with ``-kvu`` (one unified cache, as our contexts on the current pin are) and ``-fa on|off``
    explicitly (its default, auto, could differ from ours).
Each row says its ``lib``; with both, ``current_vs_patched`` gives the current pin's tokens/s over the
mission pin's for each program and parallel count.

Needs `pyllama-kv build --tools` (make setup does it).

  python scripts/bench_binding.py [--quick] [--json] [--npl 1,2,4,8] [--pp 128] [--tg 128]
                                  [--lib patched,current] [--model NAME_OR_GGUF]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyllama_kv as pk
from pyllama_kv.harness import build as _build
from pyllama_kv.harness.peer import build_peer, find_peer_batched_bench
from pyllama_kv.modelfile import catalogue
from pyllama_kv.tools.bench import machine
from pyllama_kv.tools.gguf import make_tiny_model

LIBS = ("patched", "current")
CPP_TRIES = 5   # runs of llama-batched-bench for one row set (see run_cpp)


def batched_bench_path() -> Path:
    for b in _build.find_builds():
        if b.get("variant") == "patched" and "llama-batched-bench" in b.get("tools", []):
            p = Path(b["bin_dir"]) / "llama-batched-bench"
            if p.is_file():
                return p
    raise SystemExit("llama-batched-bench is not built: run `pyllama-kv build --tools` (make setup does it)")


def current_batched_bench_path() -> Path:
    """The current llama.cpp's llama-batched-bench (the peer build), built first when missing."""
    exe = find_peer_batched_bench()
    if exe is None:
        print("current: the peer build is missing; building it (`pyllama-kv build --peer`) ...", file=sys.stderr)
        exe = Path(build_peer(log=lambda m: print(m, file=sys.stderr))["batched_bench"])
    return exe


def run_cpp(exe: Path, model: Path, n_ctx: int, n_batch: int, n_ubatch: int, pp: int, tg: int, npl: list[int],
            threads: int, ngl: int = 0, flash_attn: bool = False, current: bool = False) -> dict[int, dict]:
    """llama-batched-bench's rows by parallel count. ``current``: the current pin's binary, whose -fa
    takes a value (default auto) and whose cache is one per sequence unless -kvu (ours is unified).

    The current pin's logger is a leaked singleton whose worker thread is not flushed at exit
    (llama.cpp issue 22142): a result line logged just before the program ends is often lost (exit 0,
    nothing printed; most runs on a busy machine). So that binary gets one more parallel count, 1,
    after those asked for: while it runs, the thread writes the rows that count (the extra row, the
    last, is ignored), and a run whose rows are still missing is made again (CPP_TRIES)."""
    fa = (["-fa", "on" if flash_attn else "off", "-kvu"] if current else ["-fa"] if flash_attn else [])
    runs = [*npl, 1] if current else npl
    cmd = [str(exe), "-m", str(model), "-c", str(n_ctx), "-b", str(n_batch), "-ub", str(n_ubatch),
           "-npp", str(pp), "-ntg", str(tg), "-npl", ",".join(map(str, runs)), "-t", str(threads), "-tb", str(threads),
           "--output-format", "jsonl", "-ngl", str(999 if ngl < 0 else ngl), *fa]
    env = dict(os.environ, LLAMA_ARG_THREADS=str(threads))
    wanted = {pl for pl in npl if pl * (pp + tg) <= n_ctx}
    for _ in range(CPP_TRIES):
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise SystemExit(f"llama-batched-bench failed ({r.returncode}):\n{r.stderr[-2000:]}")
        rows = {}
        for line in (r.stdout + "\n" + r.stderr).splitlines():
            line = line.strip()
            if line.startswith("{") and '"speed_pp"' in line:
                d = json.loads(line)
                rows.setdefault(d["pl"], d)   # the first: a trailing extra count of 1 comes last
        if wanted <= rows.keys():
            return {pl: rows[pl] for pl in npl if pl in rows}
        print(f"  llama-batched-bench ({exe}) exited 0 without printing rows {sorted(wanted - rows.keys())}: "
              "its log was lost at exit; running it again", file=sys.stderr)
    raise SystemExit(f"llama-batched-bench printed no rows for {sorted(wanted)} in {CPP_TRIES} runs")


class _TimedLib:
    """Delegates to the cffi library, timing llama.cpp's compute: llama_decode, and the wait for the
    device before outputs are read (on a GPU llama_decode returns before the graph has run; the
    first read of logits synchronizes). The rest of a Python step is the binding's own cost."""

    # the calls that read a decode's outputs, and where their context argument is
    _READS = {"llama_get_logits": 0, "llama_get_logits_ith": 0, "llama_get_embeddings_ith": 0,
              "llama_get_embeddings_seq": 0, "llama_sampler_sample": 1, "llama_get_sampled_token_ith": 0}

    def __init__(self, lib):
        self._lib = lib
        self.in_decode = 0.0

    def llama_decode(self, ctx, batch):
        t = time.perf_counter()
        try:
            return self._lib.llama_decode(ctx, batch)
        finally:
            self.in_decode += time.perf_counter() - t

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if name not in self._READS:
            return fn
        where = self._READS[name]

        def read(*args):
            t = time.perf_counter()
            self._lib.llama_synchronize(args[where])
            self.in_decode += time.perf_counter() - t
            return fn(*args)
        return read


def run_py(model: pk.Model, n_ctx: int, n_batch: int, n_ubatch: int, pp: int, tg: int, npl: list[int],
           threads: int, flash_attn: bool = False) -> dict[int, dict]:
    rows = {}
    with model.context(n_ctx=n_ctx, n_seq_max=max(npl), n_batch=n_batch, n_ubatch=n_ubatch, n_threads=threads,
                       flash_attn=flash_attn) as ctx:
        timed = _TimedLib(ctx._L)
        ctx._L = timed
        warm = ctx.new_sequence()
        warm.extend(list(range(16)))  # the same warm-up as batched-bench
        warm.close()
        for pl in npl:
            if pl * (pp + tg) > n_ctx:
                continue
            ctx.clear()
            for s in ctx.sequences:
                s.close()
            seqs = [ctx.new_sequence() for _ in range(pl)]
            t0 = time.perf_counter()
            ctx.decode({s: [0] * pp for s in seqs})
            t1 = time.perf_counter()
            step = [0]
            timed.in_decode = 0.0
            for _ in range(tg):
                ctx.decode({s: step for s in seqs})
            t2 = time.perf_counter()
            rows[pl] = {"pl": pl, "t_pp": t1 - t0, "speed_pp": pl * pp / (t1 - t0),
                        "t_tg": t2 - t1, "speed_tg": pl * tg / (t2 - t1),
                        "tg_outside_decode": (t2 - t1 - timed.in_decode) / (t2 - t1)}
            for s in seqs:
                s.close()
    return rows


def run_engine(model: pk.Model, n_ctx: int, n_batch: int, n_ubatch: int, pp: int, tg: int, npl: list[int],
               threads: int, flash_attn: bool = False, backend_sampling: bool = False,
               pipeline: bool | None = None) -> dict[int, dict]:
    """The same work through the generation engine: pl requests of a pp-token prompt, tg greedy tokens
    each (EOS ignored). Generation tokens/s is timed from the step after the last prompt went in.
    ``backend_sampling``: the tokens are chosen in the graph (EngineConfig.backend_sampling)."""
    from pyllama_kv.engine import Engine, EngineConfig, SamplingParams

    rows = {}
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    for pl in npl:
        if pl * (pp + tg) > n_ctx:
            continue
        cfg = EngineConfig(n_ctx=n_ctx, parallel=pl, prefix_cache=0, n_batch=n_batch, n_ubatch=n_ubatch,
                           n_threads=threads, output_reserve=tg, max_tokens=max(tg, 1),
                           flash_attn=flash_attn, backend_sampling=backend_sampling, pipeline=pipeline)
        with Engine(model, cfg) as eng:
            ctx = eng.context
            assert ctx is not None
            timed = _TimedLib(ctx._L)
            ctx._L = timed
            warm = eng.submit(list(range(16)), greedy, max_tokens=1)
            eng.run_until_idle()
            warm.result()
            hs = [eng.submit([0] * pp, greedy, max_tokens=tg) for _ in range(pl)]
            t0 = time.perf_counter()
            while eng.stats.generated_tokens < pl:      # prompts in, first tokens sampled
                eng.step()
            t1 = time.perf_counter()
            g0 = eng.stats.generated_tokens
            timed.in_decode = 0.0
            eng.run_until_idle()
            t2 = time.perf_counter()
            n = eng.stats.generated_tokens - g0
            assert all(len(h.result()[0].tokens) == tg for h in hs)
        rows[pl] = {"pl": pl, "t_pp": t1 - t0, "speed_tg": n / (t2 - t1), "t_tg": t2 - t1,
                    "tg_outside_decode": (t2 - t1 - timed.in_decode) / (t2 - t1)}
    return rows


def summary(rows: list[dict]) -> dict:
    """The worst of the rows: the lowest python/C++ ratio, the largest binding overhead, the lowest
    engine/ctx.decode ratios (None where there are no rows)."""
    return {
        "min_ratio": min((min(r["pp_ratio"], r["tg_ratio"]) for r in rows), default=None),
        "max_py_tg_overhead": max((r["py_tg_overhead"] for r in rows), default=None),
        "min_engine_vs_decode": min((r["engine_vs_decode"] for r in rows), default=None),
        "min_engine_vs_decode_in_run": min((r["engine_vs_decode_in_run"] for r in rows), default=None),
    }


CROSS = ("cpp_pp_tps", "py_pp_tps", "cpp_tg_tps", "py_tg_tps", "engine_tg_tps")


def cross(rows: list[dict]) -> list[dict]:
    """For each parallel count measured on both pins: the current pin's tokens/s over the mission
    pin's, for each program (C++ batched-bench, the binding's ctx.decode, the engine)."""
    by = {(r["lib"], r["parallel"]): r for r in rows}
    out = []
    for pl in sorted({r["parallel"] for r in rows}):
        a, b = by.get(("current", pl)), by.get(("patched", pl))
        if a and b:
            out.append({"parallel": pl, **{k.removesuffix("_tps"): round(a[k] / b[k], 3) for k in CROSS}})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--npl", default="1,4,8", help="parallel sequences (default 1,4,8)")
    ap.add_argument("--pp", type=int, default=128, help="prompt tokens per sequence (default 128)")
    ap.add_argument("--tg", type=int, default=128, help="generated tokens per sequence (default 128)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=512)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeat", type=int, default=5, help="alternate C++ and Python runs this many times; best of each")
    ap.add_argument("--model", default=None, metavar="GGUF",
                    help="time this model (a catalogue name, or a file e.g. from scripts/make_timing_model.py) "
                         "instead of a random --layers x --embd f16 llama")
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=None,
                    help="layers on the GPU, for both programs (default: pk.Model's: all on a GPU library)")
    ap.add_argument("--flash-attn", choices=("on", "off"), default="off", help="flash attention, both programs")
    ap.add_argument("--batched-bench", default=None, metavar="PATH",
                    help="the llama-batched-bench to compare with (default: the patched build's); ours then "
                         "runs on the libllama.so beside it")
    ap.add_argument("--lib", default="patched",
                    help=f"libraries, comma-separated, of {','.join(LIBS)}, measured in the same run (default "
                         "patched; current: ours on the current llama.cpp against its own llama-batched-bench)")
    ap.add_argument("--current-batched-bench", default=None, metavar="PATH",
                    help="the current llama.cpp's llama-batched-bench (default: the peer build's)")
    ap.add_argument("--backend-sampling", action="store_true",
                    help="on a library that can (current), also the engine with its greedy tokens chosen in the "
                         "graph, in the same run (engine_bs_* in each row)")
    ap.add_argument("--pipeline", choices=("on", "off", "auto"), default="auto",
                    help="the engine's pipelined loop (EngineConfig.pipeline; auto: on where the layers are on a GPU)")
    ap.add_argument("--quick", action="store_true", help="a small model and sizes, for the test suite")
    ap.add_argument("--json", action="store_true", help="compact JSON")
    args = ap.parse_args(argv)
    npl = [int(x) for x in args.npl.split(",")]
    libs = list(dict.fromkeys(x.strip() for x in args.lib.split(",") if x.strip()))
    if not libs or any(x not in LIBS for x in libs):
        ap.error(f"--lib takes a comma-separated list of {', '.join(LIBS)}")
    pp, tg, layers, embd, repeat = args.pp, args.tg, args.layers, args.embd, args.repeat
    if args.quick:
        npl, pp, tg, layers, embd, repeat = [1, 2], 16, 8, 2, 64, 1
    n_ctx = max(npl) * (pp + tg)
    n_ctx = (n_ctx + 255) // 256 * 256
    n_batch, n_ubatch = 2048, 512
    given = {"patched": args.batched_bench, "current": args.current_batched_bench}
    exes = {lib: Path(given[lib]) if given[lib] else batched_bench_path() if lib == "patched"
            else current_batched_bench_path() for lib in libs}
    fa = args.flash_attn == "on"
    out: dict = {
        "benchmark": "binding", "machine": machine(), "date": time.strftime("%Y-%m-%d"),
        "model": {"n_layer": layers, "n_embd": embd, "dtype": "f16"},
        "settings": {"n_ctx": n_ctx, "n_batch": n_batch, "n_ubatch": n_ubatch, "pp": pp, "tg": tg, "npl": npl,
                     "threads": args.threads, "flash_attn": fa, "repeat": repeat, "libs": libs},
        # the first library's, as before --lib; every library's under "libraries"
        "library": str(exes[libs[0]].parent / "libllama.so"), "libraries": {}, "rows": []}
    best: dict[tuple[str, str], dict[int, dict]] = {(lib, k): {} for lib in libs for k in ("cpp", "py", "eng", "bs")}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if args.model:
            mp = Path(catalogue.resolve(args.model))
        else:
            mp = make_tiny_model(Path(tmp) / "bench.gguf", n_layer=layers, n_embd=embd, n_head=8, n_head_kv=8,
                                 n_ff=4 * embd, dtype="f16", n_ctx_train=max(4096, n_ctx))
        # a llama-batched-bench given by path: ours runs on the libllama beside it (the same build)
        lib_of = dict(zip(libs, libs))
        for lib in (lib for lib in libs if given[lib]):
            beside = exes[lib].parent / "libllama.so"
            if beside.exists():
                lib_of[lib] = str(beside)
            else:
                print(f"{lib}: no libllama.so beside {exes[lib]}; ours runs on the {lib} build pyllama-kv finds",
                      file=sys.stderr)
        models = {lib: stack.enter_context(pk.Model(mp, args.n_gpu_layers, lib=lib_of[lib])) for lib in libs}
        model = models[libs[0]]
        ngl = model.n_gpu_layers
        out["model"] = {"file": mp.name, "desc": model.desc, "n_layer": model.n_layer, "n_embd": model.n_embd,
                        "n_gpu_layers": ngl, "gpus": model._lib.gpu_devices()}
        for lib, m in models.items():
            out["libraries"][lib] = {"libllama": m.library.get("path"), "revision": m.library.get("revision"),
                                     "batched_bench": str(exes[lib])}
        # interleaved row by row (for each parallel count and library: C++, then Python, then the
        # engine; repeated), so that all see the same machine state; the best of the repeats is kept
        for _ in range(repeat):
            for one in npl:
                for lib, m in models.items():
                    cpp = run_cpp(exes[lib], mp, n_ctx, n_batch, n_ubatch, pp, tg, [one], args.threads, ngl, fa,
                                  current=lib == "current")
                    for pl, d in cpp.items():
                        b = best[lib, "cpp"].setdefault(pl, d)
                        b["speed_pp"] = max(b["speed_pp"], d["speed_pp"])
                        b["speed_tg"] = max(b["speed_tg"], d["speed_tg"])
                    for pl, d in run_py(m, n_ctx, n_batch, n_ubatch, pp, tg, [one], args.threads, fa).items():
                        b = best[lib, "py"].setdefault(pl, d)
                        b["speed_pp"] = max(b["speed_pp"], d["speed_pp"])
                        b["speed_tg"] = max(b["speed_tg"], d["speed_tg"])
                        b["tg_outside_decode"] = min(b["tg_outside_decode"], d["tg_outside_decode"])
                    bs_too = args.backend_sampling and m.native_library.caps.backend_sampling
                    kinds = ("eng", "bs") if bs_too else ("eng",)
                    for kind in kinds:
                        for pl, d in run_engine(m, n_ctx, n_batch, n_ubatch, pp, tg, [one], args.threads, fa,
                                                backend_sampling=kind == "bs",
                                                pipeline={"on": True, "off": False}.get(args.pipeline)).items():
                            b = best[lib, kind].setdefault(pl, d)
                            b["speed_tg"] = max(b["speed_tg"], d["speed_tg"])
                            b["tg_outside_decode"] = min(b["tg_outside_decode"], d["tg_outside_decode"])
    for lib, pl in ((lib, pl) for lib in libs for pl in npl):
        c, p, e = best[lib, "cpp"].get(pl), best[lib, "py"].get(pl), best[lib, "eng"].get(pl)
        if not c or not p or not e:
            continue
        row = {"lib": lib, "parallel": pl, "cpp_pp_tps": round(c["speed_pp"], 1), "py_pp_tps": round(p["speed_pp"], 1),
               "pp_ratio": round(p["speed_pp"] / c["speed_pp"], 3),
               "cpp_tg_tps": round(c["speed_tg"], 1), "py_tg_tps": round(p["speed_tg"], 1),
               "tg_ratio": round(p["speed_tg"] / c["speed_tg"], 3),
               # share of the Python generation loop spent outside llama_decode: the binding's own cost,
               # measured inside one run (immune to the machine's drift between the two programs)
               "py_tg_overhead": round(p["tg_outside_decode"], 4),
               # the engine (sampling, streaming text, scheduling) against raw ctx.decode, same run
               "engine_tg_tps": round(e["speed_tg"], 1), "engine_vs_decode": round(e["speed_tg"] / p["speed_tg"], 3),
               # the same comparison from shares measured inside each run (immune to drift between
               # runs): the engine's loop outside llama_decode against the raw ctx.decode loop's
               "engine_tg_overhead": round(e["tg_outside_decode"], 4),
               "engine_vs_decode_in_run": round((1 - e["tg_outside_decode"]) / (1 - p["tg_outside_decode"]), 3)}
        bs = best[lib, "bs"].get(pl)
        if bs:   # the engine with backend sampling, beside the engine without
            row.update(engine_bs_tg_tps=round(bs["speed_tg"], 1),
                       engine_bs_vs_engine=round(bs["speed_tg"] / e["speed_tg"], 3),
                       engine_bs_tg_overhead=round(bs["tg_outside_decode"], 4))
            print(f"  {lib} npl {pl}: engine with backend sampling tg {row['engine_bs_tg_tps']:8.1f} "
                  f"({row['engine_bs_vs_engine']:.3f} of the engine; overhead {row['engine_bs_tg_overhead']:.2%})",
                  file=sys.stderr)
        out["rows"].append(row)
        print(f"  {lib} npl {pl}: pp C++ {row['cpp_pp_tps']:8.1f} py {row['py_pp_tps']:8.1f} ({row['pp_ratio']:.3f})   "
              f"tg C++ {row['cpp_tg_tps']:8.1f} py {row['py_tg_tps']:8.1f} ({row['tg_ratio']:.3f}), "
              f"binding overhead {row['py_tg_overhead']:.2%}, engine tg {row['engine_tg_tps']:8.1f} "
              f"({row['engine_vs_decode']:.3f} of ctx.decode; in-run {row['engine_vs_decode_in_run']:.3f}, "
              f"engine overhead {row['engine_tg_overhead']:.2%})", file=sys.stderr)
    out.update(summary(out["rows"]))   # over every library's rows; each library's under by_lib
    out["by_lib"] = {lib: summary([r for r in out["rows"] if r["lib"] == lib]) for lib in libs}
    if set(LIBS) <= set(libs):
        out["current_vs_patched"] = cross(out["rows"])
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
