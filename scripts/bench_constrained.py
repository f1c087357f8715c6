"""The cost of constrained decoding (pyllama_kv.sampling.grammar, llguidance); prints JSON.

* ``tokenizer``: seconds to build llguidance's tokenizer from the model's vocabulary (once per model),
  on SmolLM2's 49,152 tokens and Qwen2.5's 151,665 (a tiny random qwen2 carrying the real vocabulary).
* ``mask``: per-token time of the mask (llguidance's bitmask + its expansion to n_vocab) and of the
  whole masking step the engine does (a masked copy of the logits), walking a JSON document that
  matches a schema token by token.
* ``engine``: tokens/s of the engine at ``--parallel`` streams (8) on the catalogue model, every
  stream constrained by a JSON schema vs unconstrained, same prompts and lengths (``ignore_eos``),
  best of ``--repeat`` runs each, alternating; ``ratio`` = constrained / unconstrained (goal >= 0.9).
  The decode time is reported apart from the sampling time (mask, draw, text) per token, and
  ``ratio_same_decode`` is the ratio with both decodes at the faster one's time: on a shared machine
  the decodes' time swings by several times between runs, the sampling side is what a grammar adds.

    .venv/bin/python scripts/bench_constrained.py [--parallel 8] [--tokens 64] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from pyllama_kv import Model
from pyllama_kv.chat import templates as chat
from pyllama_kv.engine import Engine, EngineConfig, SamplingParams
from pyllama_kv.modelfile import catalogue
from pyllama_kv.sampling import grammar as constrain

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "items"], "properties": {
    "name": {"type": "string", "maxLength": 40},
    "items": {"type": "array", "minItems": 200, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "label", "score"], "properties": {
            "id": {"type": "integer", "minimum": 0}, "label": {"type": "string", "maxLength": 24},
            "score": {"type": "number", "minimum": 0, "maximum": 1}}}}}}
DOC = {"name": "benchmark", "items": [{"id": i, "label": f"item number {i}", "score": 0.5} for i in range(40)]}


def mask_cost(model) -> dict:
    t0 = time.perf_counter()
    constrain.tokenizer_for(model)
    build = time.perf_counter() - t0
    g = constrain.compile_grammar(model, constrain.Grammar.json_schema(SCHEMA))
    c = g.constraint()
    # the document as the grammar writes it (compact separators), minus its closing brackets
    text = json.dumps(DOC, separators=(", ", ": "))[:-2]
    toks = model.tokenize(text, add_bos=False)
    logits = np.random.default_rng(0).standard_normal(model.n_vocab).astype(np.float32)
    bitmask, masking = [], []
    for t in toks:
        a = time.perf_counter()
        c.allowed()
        b = time.perf_counter()
        masked = c.mask(logits)
        e = time.perf_counter()
        assert masked is not None and np.isfinite(masked[t]), "the document does not match the schema"
        bitmask.append(b - a)
        masking.append(e - b)
        assert c.accept(t)
    us = lambda xs: round(statistics.median(xs) * 1e6, 1)   # noqa: E731
    return {"n_vocab": model.n_vocab, "tokenizer_build_s": round(build, 3), "tokens": len(toks),
            "bitmask_us_median": us(bitmask), "mask_step_us_median": us(masking),
            "mask_step_us_p95": round(float(np.percentile(masking, 95)) * 1e6, 1)}


def engine_rate(model, parallel: int, n_tokens: int, threads: int | None, repeat: int) -> dict:
    prompts = [chat.tokenize_rendered(model, model.apply_chat_template(
        [{"role": "user", "content": f"Write inventory record number {i} as JSON."}])) for i in range(parallel)]
    grammar = constrain.compile_grammar(model, constrain.Grammar.json_schema(SCHEMA))
    cfg = EngineConfig(n_ctx=4096, parallel=parallel, prefix_cache=0, n_threads=threads)
    out: dict = {}
    with Engine(model, cfg) as eng:
        # the time in decode vs the time in sampling (mask, draw, detokenize): on a busy machine the
        # decodes' time swings by several times, the sampling side is what constraints add
        split = {"decode": 0.0, "sample": 0.0}
        decode, sample = eng.kv.decode, eng._sample

        def timed_decode(batch):
            t = time.perf_counter()
            try:
                return decode(batch)
            finally:
                split["decode"] += time.perf_counter() - t

        def timed_sample(cont):
            t = time.perf_counter()
            try:
                return sample(cont)
            finally:
                split["sample"] += time.perf_counter() - t

        eng.kv.decode = timed_decode          # type: ignore[method-assign]
        eng._sample = timed_sample            # type: ignore[method-assign]
        for _ in range(repeat):
            for label, g in (("unconstrained", None), ("constrained", grammar)):
                hs = [eng.submit(p, SamplingParams(temperature=0.8, seed=i, ignore_eos=True), max_tokens=n_tokens,
                                 grammar=g) for i, p in enumerate(prompts)]
                # the prompts first (same for both), then time the generation alone
                while any(s.prefilling for s in eng._continuations) or eng._waiting or eng._inbox:
                    eng.step()
                gen0 = eng.stats.generated_tokens
                split["decode"] = split["sample"] = 0.0
                t0 = time.perf_counter()
                eng.run_until_idle()
                dt = time.perf_counter() - t0
                n = eng.stats.generated_tokens - gen0
                reasons = sorted({h.result()[0].finish_reason or "" for h in hs})
                rate = n / dt
                best = out.get(label)
                if best is None or rate > best["tokens_per_s"]:
                    out[label] = {"tokens_per_s": round(rate, 1), "tokens": n, "seconds": round(dt, 2),
                                  "decode_s": round(split["decode"], 2),
                                  "sampling_ms_per_token": round(split["sample"] / n * 1e3, 3),
                                  "finish_reasons": reasons}
    out["ratio"] = round(out["constrained"]["tokens_per_s"] / out["unconstrained"]["tokens_per_s"], 3)
    # the same ratio with both runs' decodes at the faster one's time: what the constraint itself costs
    d = min(out["constrained"]["decode_s"], out["unconstrained"]["decode_s"])
    per = {k: d + out[k]["sampling_ms_per_token"] * out[k]["tokens"] / 1e3 for k in ("constrained", "unconstrained")}
    out["ratio_same_decode"] = round(per["unconstrained"] / per["constrained"], 3)
    out["parallel"] = parallel
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args(argv)
    result: dict = {"mask": {}}
    with Model(catalogue.model_path(catalogue.get(args.model))) as m:
        result["mask"]["49k"] = mask_cost(m)
        if not args.skip_engine:
            result["engine"] = engine_rate(m, args.parallel, args.tokens, args.threads, args.repeat)
    from pyllama_kv.tools.gguf import make_tiny_model

    with tempfile.TemporaryDirectory() as d:
        path = make_tiny_model(Path(d) / "qwen2.gguf", arch="qwen2", vocab="qwen")
        with Model(path) as q:
            result["mask"]["150k"] = mask_cost(q)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
