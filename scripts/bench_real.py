#!/usr/bin/env python3
"""Benchmark on a real model: the generation engine against llama.cpp and llama-cpp-python.

On the real model (default: the catalogue's smollm2-135m-instruct, pulled on first use) and in one
run, generation tokens/s at 1, 4 and 8 parallel sequences for
  * engine: pyllama_kv's generation engine, one request with n=NPL continuations forked after a
    shared prompt, sampling (greedy by default) and streaming text;
  * batched-bench: llama.cpp's own `llama-batched-bench -pps` (shared prompt), from our patched build;
  * llama-cpp-python: its `Llama` on the same patched libllama (LLAMA_CPP_LIB_PATH), in a subprocess,
    generating the NPL sequences one after another (it cannot batch).
All three use the same library, prompt length, generated tokens per sequence (end-of-generation
ignored), threads and batch sizes. The columns are measured back to back for each parallel count,
and the whole round is repeated: the best of the repeats is kept for each.

It also measures chat time-to-first-token on the engine: a ~250-token system prompt and a question,
first cold, then other questions with the same system prompt, served from the prefix cache, against
the same questions with the prefix cache off (prefix_cache=0).

Targets: engine >= 0.95x batched-bench at every parallel count, >= 1.6x llama-cpp-python at 4.
Needs `pyllama-kv build --tools` and llama-cpp-python (make setup does both).

  python scripts/bench_real.py [--quick] [--json] [--model NAME_OR_PATH] [--npl 1,4,8] [-t THREADS]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_binding import batched_bench_path

import pyllama_kv as pk
from pyllama_kv.cli.render import table
from pyllama_kv.engine import Engine, EngineConfig, SamplingParams
from pyllama_kv.tools.bench import machine

DEFAULT_MODEL = "smollm2-135m-instruct"
TARGET_VS_CPP = 0.95    # engine / batched-bench, at every parallel count
TARGET_VS_LCP = 1.6     # engine / llama-cpp-python, at TARGET_LCP_NPL parallel sequences
TARGET_LCP_NPL = 4
NAMES = {"cpp": "batched-bench", "engine": "engine", "lcp": "llama-cpp-python"}

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
        "produce books quickly and cheaply. Within fifty years presses were working in more than two "
        "hundred cities across Europe, and the price of a book fell so far that ordinary merchants and "
        "students could own them. ")

SYSTEM = ("You are Quill, the support assistant of Northwind Books, an online bookshop that sells new and "
          "second-hand books, e-books and audiobooks. Answer customers politely and briefly, in plain "
          "language. Facts you may rely on: orders over 25 euros ship free "
          "within the European Union; other orders pay a flat 4 euros. Standard delivery takes three to "
          "five working days. Customers may return "
          "printed books within 30 days of delivery for a full refund if the book is unread and "
          "undamaged; e-books and audiobooks can be refunded within 14 days if they were not downloaded. "
          "Second-hand books are graded as fine, very good, good or fair, and the grade is shown on every "
          "listing. Gift cards never expire and can be used for any product. The loyalty programme gives "
          "one point per euro spent; 100 points are worth a 5 euro voucher. Customer service is open "
          "Monday to Friday from 9:00 to 18:00 central European time, by chat or at help@northwind.example. "
          "Never invent order numbers, prices or policies that are not listed here; if you do not know, "
          "say so and offer to connect the customer with a human colleague.")

QUESTIONS = ["How long does standard delivery take?", "Can I return an e-book I bought last week?",
             "What is a second-hand book graded 'good'?", "Do gift cards expire?",
             "When can I reach customer service?", "How many points do I need for a voucher?"]

# llama-cpp-python, in its own process (it loads its own copy of libllama): reads one job per line
# on stdin, generates the sequences one after another, answers one JSON line per job.
LCP_WORKER = r"""
import json, sys, time
import llama_cpp
cfg = json.loads(sys.argv[1])
llm = llama_cpp.Llama(model_path=cfg["model"], n_ctx=cfg["n_ctx"], n_batch=cfg["n_batch"], n_ubatch=cfg["n_ubatch"],
                      n_threads=cfg["threads"], n_threads_batch=cfg["threads"], seed=cfg["seed"], verbose=False)
print(json.dumps({"lib": str(llama_cpp.llama_cpp._base_path),
                  "has_stats": hasattr(llama_cpp.llama_cpp._lib, "llama_kv_self_stats")}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    t_tg, outs = 0.0, []
    for _ in range(job["npl"]):
        llm.reset()                 # a new request: the whole prompt is evaluated, as for the engine
        gen = llm.generate(job["prompt"], **job["sampling"])
        toks = [next(gen)]          # the prompt is in and the first token drawn: generation starts
        t = time.perf_counter()
        for tok in gen:             # each further token is one decode and one draw
            toks.append(int(tok))
            if len(toks) == job["tg"] + 1:
                break
        t_tg += time.perf_counter() - t
        gen.close()
        outs.append([int(x) for x in toks])
    print(json.dumps({"t_tg": t_tg, "tokens": outs}), flush=True)
"""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class LlamaCppPython:
    """The llama-cpp-python worker process, kept for the whole run (one model load)."""

    def __init__(self, model: Path, lib_dir: Path, n_ctx: int, n_batch: int, n_ubatch: int, threads: int,
                 seed: int):
        cfg = {"model": str(model), "n_ctx": n_ctx, "n_batch": n_batch, "n_ubatch": n_ubatch, "threads": threads,
               "seed": seed}
        env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(lib_dir))
        self.proc = subprocess.Popen([sys.executable, "-c", LCP_WORKER, json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.info = self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise SystemExit(f"llama-cpp-python failed (is it installed? `make setup` does it):\n{err[-2000:]}")
        return json.loads(line)

    def run(self, prompt: list[int], tg: int, npl: int, sampling: dict) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "tg": tg, "npl": npl, "sampling": sampling}) + "\n")
        self.proc.stdin.flush()
        d = self._read()
        d["speed_tg"] = npl * tg / d["t_tg"]
        return d

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_cpp(exe: Path, model: Path, n_ctx: int, n_batch: int, n_ubatch: int, pp: int, tg: int, npl: int,
            threads: int) -> dict:
    """llama-batched-bench with a shared prompt (-pps: decoded once, copied to the other sequences)."""
    cmd = [str(exe), "-m", str(model), "-c", str(n_ctx), "-b", str(n_batch), "-ub", str(n_ubatch), "-npp", str(pp),
           "-ntg", str(tg), "-npl", str(npl), "-pps", "-t", str(threads), "-tb", str(threads),
           "--output-format", "jsonl", "-ngl", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, LLAMA_ARG_THREADS=str(threads)))
    if r.returncode != 0:
        raise SystemExit(f"llama-batched-bench failed ({r.returncode}):\n{r.stderr[-2000:]}")
    for line in (r.stdout + "\n" + r.stderr).splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            return json.loads(line)
    raise SystemExit(f"no result from llama-batched-bench:\n{r.stdout[-2000:]}")


def engine_config(n_ctx: int, parallel: int, prefix_cache: int, s: dict) -> EngineConfig:
    return EngineConfig(n_ctx=n_ctx, parallel=parallel, prefix_cache=prefix_cache, n_batch=s["n_batch"],
                        n_ubatch=s["n_ubatch"], n_threads=s["threads"], output_reserve=s["tg"] + 1,
                        max_tokens=max(s["tg"] + 1, 64))


def run_engine(model: pk.Model, prompt: list[int], npl: int, params: SamplingParams, s: dict) -> dict:
    """One request, n=npl continuations forked after the prompt, tg+1 tokens each: the first is drawn
    from the prompt's logits, the other tg each need a decode (as batched-bench's tg steps)."""
    tg = s["tg"]
    with Engine(model, engine_config(s["n_ctx"], npl, 0, s)) as eng:
        eng.submit(prompt[:16], params, max_tokens=1)     # warm-up, as batched-bench does
        eng.run_until_idle()
        g = eng.stats.generated_tokens
        h = eng.submit(prompt, params, max_tokens=tg + 1, n=npl)
        while eng.stats.generated_tokens < g + npl:          # the prompt is in, first tokens drawn
            eng.step()
        t = time.perf_counter()
        eng.run_until_idle()
        t_tg = time.perf_counter() - t
        comps = h.result()
    counts = sorted({len(c.tokens) - 1 for c in comps})
    return {"speed_tg": npl * tg / t_tg, "t_tg": t_tg, "generated": counts, "tokens": [c.tokens for c in comps],
            "finish": sorted({str(c.finish_reason) for c in comps})}


def run_chat(model: pk.Model, s: dict, repeat: int, n_questions: int) -> dict:
    """Time to first token of chat prompts (system prompt + question), on an engine with a prefix cache
    (the first question cold, the others reusing the system prompt's cells) and on one without."""
    def prompt(q: str) -> list[int]:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        return model.tokenize(model.apply_chat_template(msgs), special=True)

    prompts = [prompt(q) for q in QUESTIONS[:n_questions]]
    system_tokens = len(model.tokenize(model.apply_chat_template([{"role": "system", "content": SYSTEM}],
                                                                 add_generation_prompt=False), special=True))
    warm = model.tokenize(" warm up", add_bos=False)
    params = SamplingParams(temperature=0.0)
    n_ctx = 2048
    cold: list[float] = []
    reuse: list[float] = []
    no_reuse: list[float] = []
    reused: list[int] = []
    cold_reused: list[int] = []
    off_reused: list[int] = []

    def ttft(eng: Engine, toks: list[int]) -> tuple[float, int]:
        h = eng.submit(toks, params, max_tokens=4)
        eng.run_until_idle()
        h.result()
        assert h.ttft is not None
        return h.ttft * 1000, h.usage.reused_tokens

    for r in range(repeat):
        log(f"[{r + 1}/{repeat}] chat time to first token ({len(prompts)} questions, with and without prefix reuse)")
        with Engine(model, engine_config(n_ctx, 1, 4, s)) as on, Engine(model, engine_config(n_ctx, 1, 0, s)) as off:
            for eng in (on, off):
                eng.submit(warm, params, max_tokens=1, keep=False)
                eng.run_until_idle()
            for i, toks in enumerate(prompts):
                ms, n = ttft(on, toks)
                (cold if i == 0 else reuse).append(ms)
                (cold_reused if i == 0 else reused).append(n)
                ms, n = ttft(off, toks)
                no_reuse.append(ms)
                off_reused.append(n)
    return {"system_tokens": system_tokens, "prompt_tokens": [len(p) for p in prompts], "questions": n_questions,
            "cold_ms": round(min(cold), 1), "reuse_ms": round(min(reuse), 1), "no_reuse_ms": round(min(no_reuse), 1),
            "speedup": round(min(no_reuse) / min(reuse), 2),
            "reused_tokens": min(reused), "cold_reused_tokens": max(cold_reused),
            "no_reuse_reused_tokens": max(off_reused)}


def make_prompt(model: pk.Model, pp: int) -> list[int]:
    toks = model.tokenize(TEXT * (pp // 40 + 2))
    return toks[:pp]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"a GGUF path or a catalogue name (default {DEFAULT_MODEL})")
    ap.add_argument("--npl", default="1,4,8", help="parallel sequences (default 1,4,8)")
    ap.add_argument("--pp", type=int, default=128, help="prompt tokens (default 128)")
    ap.add_argument("--tg", type=int, default=128, help="generated tokens per sequence (default 128)")
    ap.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for every column (default: the cores this process may use; "
                         "on a busy machine 1 gives steadier figures)")
    ap.add_argument("--temp", type=float, default=0.0,
                    help="sampling temperature for every column (default 0: greedy); >0 samples with a fixed seed")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of every measurement; the best is kept (default 3)")
    ap.add_argument("--quick", action="store_true", help="short prompts and generations, one round (under a minute)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    try:
        npl = sorted({int(x) for x in args.npl.split(",")})
    except ValueError:
        ap.error(f"--npl needs comma-separated integers, got {args.npl!r}")
    pp, tg, repeat, n_questions = args.pp, args.tg, args.repeat, len(QUESTIONS)
    if args.quick:
        pp, tg, repeat, n_questions = 32, 16, 1, 2   # a cold question and one served from the prefix cache
    if min(npl) < 1 or pp < 16 or tg < 1 or repeat < 1 or args.threads < 1:
        ap.error("--npl values, --tg, --repeat and --threads must be positive, --pp at least 16")
    n_batch = n_ubatch = 512
    n_ctx = (pp + max(npl) * (tg + 1) + 255) // 256 * 256
    seed = 1
    exe = batched_bench_path()
    s = {"n_ctx": n_ctx, "n_batch": n_batch, "n_ubatch": n_ubatch, "pp": pp, "tg": tg, "npl": npl,
         "threads": args.threads, "repeat": repeat, "flash_attn": False, "shared_prompt": True,
         "sampling": "greedy" if args.temp == 0 else f"temp {args.temp}, top-k 40, top-p 0.95, min-p 0.05, seed {seed}"}
    try:
        params = SamplingParams(temperature=args.temp, seed=seed, ignore_eos=True)
    except pk.InvalidInputError as exc:
        ap.error(f"--temp: {exc}")
    lcp_sampling = {"temp": args.temp, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}
    if args.temp == 0:
        lcp_sampling.update(top_k=1, top_p=1.0, min_p=0.0)

    try:
        model = pk.Model(args.model)
    except pk.LlamaError as exc:
        raise SystemExit(f"bench_real.py: {exc}") from None
    with model:
        path = model.path
        prompt = make_prompt(model, pp)
        if len(prompt) < pp:
            ap.error(f"--pp {pp} is longer than the benchmark's prompt text ({len(prompt)} tokens)")
        log(f"model {path.name} ({model.size / 2**20:.1f} MiB), {args.threads} threads, prompt {pp}, generate {tg}, "
            f"npl {','.join(map(str, npl))}, {repeat} round(s)")
        lcp = LlamaCppPython(path, exe.parent, n_ctx, n_batch, n_ubatch, args.threads, seed)
        best: dict[str, dict[int, dict]] = {c: {} for c in NAMES}

        def measure(col: str, pl: int) -> dict:
            if col == "cpp":
                return run_cpp(exe, path, n_ctx, n_batch, n_ubatch, pp, tg, pl, args.threads)
            if col == "engine":
                return run_engine(model, prompt, pl, params, s)
            return lcp.run(prompt, tg, pl, lcp_sampling)

        try:
            for r in range(repeat):
                for pl in npl:
                    order = list(NAMES) if r % 2 == 0 else list(NAMES)[::-1]   # no column always first
                    log(f"[{r + 1}/{repeat}] npl {pl}: " + ", ".join(NAMES[c] for c in order))
                    runs = {c: measure(c, pl) for c in order}
                    for col, d in runs.items():
                        if pl not in best[col] or d["speed_tg"] > best[col][pl]["speed_tg"]:
                            best[col][pl] = d
                    log("    tokens/s  " + "  ".join(f"{NAMES[c]} {d['speed_tg']:.1f}" for c, d in runs.items()))
        finally:
            lcp.close()
        chat = run_chat(model, s, repeat, n_questions)
        size = model.size

    rows = []
    for pl in npl:
        e, c, p = best["engine"][pl], best["cpp"][pl], best["lcp"][pl]
        rows.append({"parallel": pl, "engine_tps": round(e["speed_tg"], 1),
                     "batched_bench_tps": round(c["speed_tg"], 1), "llama_cpp_python_tps": round(p["speed_tg"], 1),
                     "engine_vs_batched_bench": round(e["speed_tg"] / c["speed_tg"], 3),
                     "engine_vs_llama_cpp_python": round(e["speed_tg"] / p["speed_tg"], 3),
                     "engine_generated": e["generated"], "engine_finish": e["finish"]})
    vs_lcp = next((r["engine_vs_llama_cpp_python"] for r in rows if r["parallel"] == TARGET_LCP_NPL), None)
    cpp_met = all(r["engine_vs_batched_bench"] >= TARGET_VS_CPP for r in rows)
    lcp_met = None if vs_lcp is None else vs_lcp >= TARGET_VS_LCP
    checks = {"llama_cpp_python_lib": lcp.info["lib"],
              "llama_cpp_python_on_ours": Path(lcp.info["lib"]) == exe.parent and bool(lcp.info["has_stats"])}
    if args.temp == 0 and 1 in npl:
        # one sequence, the same prompt batch and one token per decode: the same greedy tokens
        checks["greedy_npl1_equal"] = best["engine"][1]["tokens"][0] == best["lcp"][1]["tokens"][0]
    m = machine()
    out = {"benchmark": "real", "machine": m, "date": time.strftime("%Y-%m-%d"),
           "model": {"name": args.model, "file": path.name, "size_mib": round(size / 2**20, 1)},
           "library": str(exe.parent / "libllama.so"), "settings": s, "rows": rows, "chat": chat, "checks": checks,
           "targets": {"engine_vs_batched_bench": TARGET_VS_CPP, "engine_vs_batched_bench_met": cpp_met,
                       "engine_vs_llama_cpp_python_at": TARGET_LCP_NPL, "engine_vs_llama_cpp_python": TARGET_VS_LCP,
                       "engine_vs_llama_cpp_python_met": lcp_met, "met": cpp_met and lcp_met is not False}}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{path.name} ({size / 2**20:.1f} MiB); {m['cpu']}, {m['cores']} cores, "
          f"{args.threads} threads; prompt {pp}, generate {tg} per sequence, {s['sampling']}; best of {repeat}\n")
    print(table(["engine t/s", "batched-bench t/s", "llama-cpp-python t/s", "engine/bb", "engine/lcp"],
                [(f"npl {r['parallel']}", (r["engine_tps"], r["batched_bench_tps"], r["llama_cpp_python_tps"],
                                           f"{r['engine_vs_batched_bench']:.2f}x",
                                           f"{r['engine_vs_llama_cpp_python']:.2f}x")) for r in rows]))
    print(f"\nchat time to first token ({chat['system_tokens']}-token system prompt + a question, "
          f"{chat['prompt_tokens'][0]} tokens): cold {chat['cold_ms']} ms, with prefix reuse {chat['reuse_ms']} ms "
          f"({chat['reused_tokens']} tokens reused), without {chat['no_reuse_ms']} ms: {chat['speedup']}x")
    print(f"targets: engine >= {TARGET_VS_CPP}x batched-bench at every npl: {'met' if cpp_met else 'NOT met'}; "
          f">= {TARGET_VS_LCP}x llama-cpp-python at npl {TARGET_LCP_NPL}: "
          f"{'n/a' if lcp_met is None else 'met' if lcp_met else 'NOT met'}")
    if not checks["llama_cpp_python_on_ours"] or not checks.get("greedy_npl1_equal", True):
        print(f"checks: {checks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
