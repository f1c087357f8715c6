#!/usr/bin/env python3
"""The prefix cache's host tier (``EngineConfig.cache_ram``) off vs on, side by side in one run, on
a multi-conversation chat load whose working set is several times the KV cache.

``--conversations`` conversations share one system prompt (~``--system`` tokens); each starts with
its own document (~``--doc`` tokens) and has ``--turns`` turns, served round-robin: turn t of every
conversation is submitted at once (the engine runs ``--parallel`` of them at a time), so each
conversation comes back after all the others. A turn's prompt is the conversation so far (its
previous prompt, the answer, a new user message of ~``--msg`` tokens), in the model's chat markup,
built from tokens so that a history is an exact prefix of the next prompt. Greedy answers of
``--answer`` tokens.

Reported per mode: prompt tokens submitted and evaluated, tokens restored from host memory, TTFT
p50/p95 (engine level: submit to first token) over all turns and over the later turns, wall time,
the tier's peak host bytes; and how many answers the two modes agree on (greedy: they should).

    .venv/bin/python scripts/bench_prefix_tier.py
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import pyllama_kv as pk  # noqa: E402
from pyllama_kv.engine import GREEDY, Engine, EngineConfig  # noqa: E402
from pyllama_kv.modelfile import catalogue  # noqa: E402

WORDS = ("river stone market window garden letter engine morning silver harbor lantern meadow bridge "
         "candle forest violin paper thunder orchard compass ladder island mirror velvet").split()


def text(rng: np.random.Generator, n_words: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n_words))


def markup(model, role: str, content: str) -> list[int]:
    return model.tokenize(f"<|im_start|>{role}\n{content}<|im_end|>\n", add_bos=False, special=True)


def run(model, args, cache_ram: int) -> dict:
    rng = np.random.default_rng(0)
    system = markup(model, "system", "You are a helpful assistant. " + text(rng, args.system))
    convs = [system + markup(model, "user", "Read this document. " + text(rng, args.doc)) for _ in
             range(args.conversations)]
    gen_prompt = model.tokenize("<|im_start|>assistant\n", add_bos=False, special=True)
    cfg = EngineConfig(n_ctx=args.ctx, parallel=args.parallel, prefix_cache=args.prefix_cache, n_batch=512,
                       n_threads=args.threads, cache_ram=cache_ram, max_tokens=args.answer)
    ttft: list[list[float]] = []
    answers: list[list[int]] = []
    peak = 0
    t0 = time.perf_counter()
    with Engine(model, cfg) as eng:
        for turn in range(args.turns):
            handles = []
            for c in range(len(convs)):
                if turn:
                    convs[c] = convs[c] + markup(model, "user", text(rng, args.msg))
                prompt = convs[c] + gen_prompt
                handles.append(eng.submit(prompt, GREEDY, max_tokens=args.answer))
                convs[c] = prompt
            while any(not h.done for h in handles):
                eng.step()
                tier = eng.kv.cache.tier
                if tier is not None:
                    peak = max(peak, tier.nbytes)
            row = []
            for c, h in enumerate(handles):
                out = h.result()[0].tokens
                answers.append(out)
                convs[c] = convs[c] + out + model.tokenize("<|im_end|>\n", add_bos=False, special=True)
                row.append(h.ttft or 0.0)
            ttft.append(row)
        st = eng.stats.as_dict()
        tier_st = eng.kv.tier_stats()
    wall = time.perf_counter() - t0
    flat = np.array([t for row in ttft for t in row])
    later = np.array([t for row in ttft[1:] for t in row])
    return {
        "cache_ram_mib": cache_ram,
        "prompt_tokens": st["prompt_tokens"],
        "evaluated_tokens": st["evaluated_tokens"],
        "reused_tokens_resident": st["reused_tokens"] - tier_st["restored_tokens"],
        "restored_tokens": tier_st["restored_tokens"],
        "restores": tier_st["restores"],
        "generated_tokens": st["generated_tokens"],
        "ttft_p50_s": round(float(np.percentile(flat, 50)), 3),
        "ttft_p95_s": round(float(np.percentile(flat, 95)), 3),
        "later_turns_ttft_p50_s": round(float(np.percentile(later, 50)), 3) if later.size else None,
        "later_turns_ttft_p95_s": round(float(np.percentile(later, 95)), 3) if later.size else None,
        "wall_s": round(wall, 2),
        "host_bytes_peak": peak,
        "host_bytes_end": tier_st["host_bytes"],
        "paged_out_tokens": tier_st["paged_out_tokens"],
        "host_evicted_bytes": tier_st["evicted_bytes"],
        "preempted": st["preempted"],
        "_answers": answers,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--prefix-cache", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=200, help="words of the shared system prompt")
    ap.add_argument("--doc", type=int, default=60, help="words of each conversation's document")
    ap.add_argument("--msg", type=int, default=15, help="words of each later user message")
    ap.add_argument("--answer", type=int, default=24, help="tokens per answer")
    ap.add_argument("--cache-ram", type=int, default=256, help="MiB for the 'on' run")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    with pk.Model(catalogue.resolve(args.model)) as model:
        off = run(model, args, 0)
        on = run(model, args, args.cache_ram)
    same = sum(a == b for a, b in zip(off.pop("_answers"), on.pop("_answers")))
    working_set = off["prompt_tokens"] // args.turns
    out = {"model": args.model, "n_ctx": args.ctx, "parallel": args.parallel, "threads": args.threads,
           "conversations": args.conversations, "turns": args.turns,
           "mean_prompt_tokens_per_turn_round": working_set, "working_set_vs_cache": round(working_set / args.ctx, 1),
           "off": off, "on": on, "answers_equal": f"{same}/{args.conversations * args.turns}",
           "evaluated_ratio_off_on": round(off["evaluated_tokens"] / max(1, on["evaluated_tokens"]), 2),
           "later_ttft_p95_ratio_off_on": round(off["later_turns_ttft_p95_s"] / max(1e-9, on["later_turns_ttft_p95_s"]),
                                                2) if args.turns > 1 else None}
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
