"""`pyllama-kv demo`: the main job (`make demo`).

On the catalogue's real model (pulled on first use): the seeded server-like workload on the vanilla
and the patched build side by side (first what a user cares about: requests completed and failed,
completed requests and generated tokens per second; then the detail: tokens/s and the KV counters),
then 4 chat answers to one question (the prompt evaluated once, forked 3 times, the answers decoded
together), then the KV stats. ``--tiny`` runs the same on the built-in random-weight tiny model
(offline), ending with a `run --parallel 4` of raw continuations.
"""
from __future__ import annotations

import sys
import textwrap

from ...limits import DEFAULT_N_CTX
from .. import options
from ..common import EXIT_INTERRUPTED, open_model, phase, set_phase, setup_logging
from ..render import log, print_json, stress_table, table

DEFAULT_MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France, and what is it famous for?"
N_ANSWERS = 4
ANSWER_TOKENS = 96
TINY_PROMPT = b"The KV cache of the model"
WORKLOAD_PARALLEL = 8    # requests served at once by the workload
STEPS, QUICK_STEPS, TINY_QUICK_STEPS = 300, 100, 120   # the workload's decode steps (--steps overrides)


def register(subparsers) -> None:
    s = subparsers.add_parser(
        "demo",
        description="The main job. On the real model (default: the catalogue's smollm2-135m-instruct, pulled into "
                    "~/.cache/pyllama-kv on first use): run the seeded server-like workload on the vanilla and the "
                    "patched build side by side and compare them, then ask one chat question 4 times at once (the "
                    "prompt evaluated once and forked, the answers decoded together), then print the KV stats. "
                    "About a minute on 2 cores (--quick: a shorter workload).")
    s.add_argument("--model", default=DEFAULT_MODEL, metavar="MODEL",
                   help="GGUF file or catalogue name (default %(default)s)")
    s.add_argument("--tiny", action="store_true",
                   help="use the built-in random-weight tiny model instead (offline; its text is not readable)")
    s.add_argument("--seed", type=int, default=0, help="workload and sampling seed (default %(default)s)")
    s.add_argument("--quick", action="store_true", help="a shorter workload")
    s.add_argument("--steps", type=int, metavar="N",
                   help=f"the workload's decode steps (default {STEPS}; --quick: {QUICK_STEPS}, "
                        f"{TINY_QUICK_STEPS} with --tiny)")
    options.add(s, "n_threads")
    s.add_argument("--json", action="store_true", help="print every result as one JSON object")


def _workload(model_path: str, steps: int, n_ctx: int, args) -> tuple[list[tuple[str, dict]], bool]:
    """The stress workload on vanilla then patched; (results, interrupted)."""
    from .stress import run_workload, stress_config

    results: list[tuple[str, dict]] = []
    for lib in ("vanilla", "patched"):
        cfg = stress_config(WORKLOAD_PARALLEL, n_ctx, steps, args.seed, n_threads=args.n_threads)
        try:
            d, _ = run_workload(model_path, lib, cfg, lib, progress=not args.json)
        except KeyboardInterrupt:
            if not results or args.json:
                raise  # main() says what was interrupted
            return results, True
        results.append((lib, d))
        if d.get("interrupted"):  # Ctrl-C: show what ran, and stop there
            return results, True
    return results, False


def _steps(args, default: int, quick: int) -> int:
    return args.steps if args.steps is not None else quick if args.quick else default


def _rate(n: float, seconds: float, digits: int) -> float | None:
    return round(n / seconds, digits) if seconds > 0 else None


def summary(d: dict) -> dict:
    """What a user of the server cares about, from one workload result (StressResult.as_dict()): requests
    completed and failed, and work done per second (completed requests, generated tokens). tokens/s, the
    evaluated prompt tokens plus the generated ones, is detail: a build that reuses more cached prefixes
    evaluates fewer tokens for the same work."""
    req, secs = d["requests"], d["seconds"]
    return {
        "requests_arrived": req.get("arrived"),
        "requests_completed": req["completed"],
        "requests_failed": d["failed_requests"],
        "completed_per_s": _rate(req["completed"], secs, 3),
        "gen_tokens_per_s": _rate(d["gen_tokens"], secs, 1),
        "seconds": round(secs, 2),
        "tokens_per_s": d["tokens_per_s"],
        "reused_tokens": d["reused_tokens"],
    }


def _ratio(p, v) -> str:
    return f"{p / v:.2f}x" if p is not None and v else ""


def headline(van: dict, pat: dict) -> str:
    """The first screen: requests completed and failed, and work per second, vanilla beside patched."""
    sv, sp = summary(van), summary(pat)

    def fmt(v, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    rows = [
        ("requests completed", [sv["requests_completed"], sp["requests_completed"],
                                _ratio(sp["requests_completed"], sv["requests_completed"])]),
        ("requests failed", [sv["requests_failed"], sp["requests_failed"], ""]),
        ("completed requests/s", [fmt(sv["completed_per_s"], ".2f"), fmt(sp["completed_per_s"], ".2f"),
                                  _ratio(sp["completed_per_s"], sv["completed_per_s"])]),
        ("generated tokens/s", [fmt(sv["gen_tokens_per_s"], ".1f"), fmt(sp["gen_tokens_per_s"], ".1f"),
                                _ratio(sp["gen_tokens_per_s"], sv["gen_tokens_per_s"])]),
        ("wall time", [f"{sv['seconds']:.1f} s", f"{sp['seconds']:.1f} s", ""]),
    ]
    return "\n".join(ln.rstrip() for ln in table(["vanilla", "patched", "patched/vanilla"], rows).splitlines())


def _details_note(van: dict, pat: dict) -> str:
    note = ("The same requests arrive at the same steps on both builds. In detail (tokens/s counts the prompt tokens "
            f"evaluated and the tokens generated, not the prompt tokens served from cached prefixes: "
            f"{pat['reused_tokens']:,} patched, {van['reused_tokens']:,} vanilla; so it is not the work done):")
    return textwrap.fill(note, width=104)


def _compare(van: dict, pat: dict) -> str:
    lines = []
    if van["slot_failures"]:
        lines.append(f"vanilla: {van['slot_failures']} batches refused (\"failed to find KV cache slot\") with on "
                     f"average {van['free_at_failures']:.0%} of the cache free; {van['failed_requests']} requests "
                     f"failed, {van['requests']['completed']} completed.")
    else:
        lines.append(f"vanilla: no batch refused this time; {van['requests']['completed']} requests completed.")
    kv = pat["kv"]
    lines.append(f"patched: {pat['slot_failures']} refused, {pat['failed_requests']} failed, "
                 f"{pat['requests']['completed']} completed; {kv.get('slot_retries')} slot searches recovered by a "
                 f"full defrag ({kv.get('moves')} block moves, {kv.get('defrag_share', 0):.1%} of the run).")
    return "\n".join(lines)


def _print_workload(van: dict, pat: dict, results: list[tuple[str, dict]]) -> None:
    print(headline(van, pat))   # after the header line and its blank line
    print()
    print(_details_note(van, pat))
    print()
    print(stress_table(results))
    print()
    print(_compare(van, pat), flush=True)


def _chat_answers(model_path: str, args) -> dict:
    """One chat question, N_ANSWERS sampled answers: a request with n=4 on the engine (the prompt is
    evaluated once and forked; the answers decode together)."""
    import time

    from ...chat.templates import tokenize_rendered
    from ...config import EngineConfig, SamplingParams
    from ...engine.oneshot import EngineSession

    set_phase("loading the model (chat)")
    model = open_model(model_path, "patched")
    try:
        prompt = model.apply_chat_template([{"role": "user", "content": QUESTION}])
        toks = tokenize_rendered(model, prompt)
        cfg = options.build(EngineConfig, n_ctx=1024, parallel=N_ANSWERS, prefix_cache=0, n_threads=args.n_threads,
                            max_queue=1, max_tokens=ANSWER_TOKENS)
        with EngineSession(model, cfg, hold=True) as session:   # the answers keep their cells for the stats
            params = SamplingParams(temperature=0.6, top_p=0.95, seed=args.seed)
            set_phase("answering")
            tty = sys.stderr.isatty() and not args.json
            t0 = time.perf_counter()
            h = session.submit(toks, params, max_tokens=ANSWER_TOKENS, n=N_ANSWERS, keep=False)

            def progress(_events: list) -> None:
                if tty:
                    sys.stderr.write(f"\r  answering: {sum(len(c.tokens) for c in h.completions)} tokens ")
                    sys.stderr.flush()

            session.run(h, progress)
            seconds = time.perf_counter() - t0
            if tty:
                sys.stderr.write("\n")
            st = session.ctx.kv_stats()
        comps = h.completions
        return {
            "question": QUESTION,
            "prompt": prompt,
            "answers": [{"text": c.text.strip(), "tokens": len(c.tokens), "finish_reason": c.finish_reason}
                        for c in comps],
            "prompt_tokens": h.usage.prompt_tokens,
            "prompt_evaluated": h.usage.prompt_tokens,
            "prompt_reused": h.usage.prompt_tokens * (N_ANSWERS - 1),
            "generated_tokens": h.usage.completion_tokens,
            "seconds": round(seconds, 3),
            "ttft_s": round(h.ttft, 3) if h.ttft is not None else None,
            "kv": st.as_dict(),
            "kv_cells": {"used": st.used_cells, "total": st.n_cells, "largest_free_block": st.largest_free_block},
        }
    finally:
        model.close()


def _print_answers(c: dict) -> None:
    print(f"\nOne chat question, {N_ANSWERS} answers: the prompt ({c['prompt_tokens']} tokens) is evaluated once, "
          f"forked {N_ANSWERS - 1} times ({c['prompt_reused']} tokens reused, not recomputed), and the answers "
          "decode together, one batch per step.\n")
    print(f"Q: {c['question']}\n")
    for i, a in enumerate(c["answers"]):
        body = textwrap.fill(" ".join(a["text"].split()) or "(empty)", width=92, initial_indent=f"[{i}] ",
                             subsequent_indent="    ")
        print(body + ("" if a["finish_reason"] in ("stop", "eos") else f" [{a['finish_reason']}]"))
    gen = c["generated_tokens"]
    print(f"\n{gen} tokens in {c['seconds']:.2f} s ({gen / c['seconds']:.0f} tok/s, {N_ANSWERS} sequences per "
          f"decode); first token after {c['ttft_s']:.2f} s")
    kv, cells = c["kv"], c["kv_cells"]
    print(f"KV cache: {cells['used']}/{cells['total']} cells used (the {c['prompt_tokens']}-token prompt once, "
          f"shared by {N_ANSWERS} sequences, plus their answers); largest free block {cells['largest_free_block']}; "
          f"defrags {kv.get('defrags')}, slot retries {kv.get('slot_retries')}, "
          f"slot failures {kv.get('slot_failures')}")


def run(args) -> int:
    setup_logging(args.debug)
    if args.tiny:
        return _tiny(args)
    from ...modelfile.catalogue import resolve

    set_phase("finding the model")
    model_path = str(resolve(args.model))
    steps, n_ctx = _steps(args, STEPS, QUICK_STEPS), 1024   # about a minute in all on 2 cores
    if not args.json:
        print(f"pyllama-kv demo on {args.model}: a server-like workload ({WORKLOAD_PARALLEL} requests at once, {n_ctx} "
              f"KV cells, {steps} steps, seed {args.seed}) on the vanilla and the patched llama.cpp\n", flush=True)
    results, interrupted = _workload(model_path, steps, n_ctx, args)
    if interrupted:
        return _interrupted(results, args)
    van, pat = results[0][1], results[1][1]
    if not args.json:
        _print_workload(van, pat, results)
    chat = _chat_answers(model_path, args)
    if args.json:
        print_json({"model": model_path, "summary": {lib: summary(d) for lib, d in results}, "stress": dict(results),
                    "chat": chat})
    else:
        _print_answers(chat)
    return 0


def _interrupted(results: list[tuple[str, dict]], args) -> int:
    if args.json:
        print_json({"stress": dict(results), "interrupted": True})
        return EXIT_INTERRUPTED
    print()
    print(stress_table(results))
    where = f"running the {results[-1][0]} workload" if results[-1][1].get("interrupted") else phase()
    log(f"pyllama-kv demo: interrupted while {where}")
    return EXIT_INTERRUPTED


def _tiny(args) -> int:
    """The offline demo: the workload on the built-in tiny model, then `run --parallel 4`."""
    from ... import _paths
    from ...config import SamplingParams
    from ...tools.gguf import make_tiny_model
    from .run import RunSpec, generate

    mpath = _paths.cache_dir() / "models" / "tiny-demo-2l-64.gguf"
    if not mpath.is_file():
        log(f"making the built-in tiny model at {mpath} ...")
        make_tiny_model(mpath, n_layer=2, n_embd=64, seed=0)
    steps, n_ctx = _steps(args, STEPS, TINY_QUICK_STEPS), DEFAULT_N_CTX
    if not args.json:
        print(f"pyllama-kv demo --tiny: a server-like workload ({WORKLOAD_PARALLEL} requests at once, "
              f"{n_ctx} KV cells, {steps} steps, seed {args.seed}) on the vanilla and the patched llama.cpp\n")
    results, interrupted = _workload(str(mpath), steps, n_ctx, args)
    if interrupted:
        return _interrupted(results, args)
    if args.json:
        print_json({"model": str(mpath), "summary": {lib: summary(d) for lib, d in results}, "stress": dict(results)})
        return 0
    _print_workload(results[0][1], results[1][1], results)
    print("\nNow 4 continuations of one prompt: evaluated once, forked 3 times, decoded together:\n", flush=True)
    params = SamplingParams(seed=args.seed if args.seed >= 0 else None)
    return generate(RunSpec(model=str(mpath), prompt=TINY_PROMPT, params=params, n_predict=24, parallel=4,
                            n_threads=args.n_threads))
