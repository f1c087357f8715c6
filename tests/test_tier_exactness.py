"""Exactness of the prefix cache's tiers, at the engine and over HTTP, on F32 weights and an F32 KV
cache: a conversation evicted from the KV cache and restored from the host tier (``cache_ram``), or
from the disk tier (``cache_dir``) by a new engine or server after a restart, answers with the
log-probabilities of a cache-free evaluation of the same tokens (each answer token's and those of
its top alternatives), not merely with the same greedy tokens.

The restored cells hold the evaluated bytes (test_spans, test_disk_tier), but they may sit elsewhere
in the cache and be read in another order, and the reference decodes the prompt in another batch
shape: F32 summation order only. Measured on the tiny model: at most ~1e-6 apart (log-probabilities
of order 1..10). TOL is a fixed bound with a wide margin; a wrong restore (a span on the wrong
positions, a stale or foreign span, a flipped value) moves them by far more (0.1 and up).

Each test proves that the tier served the prompt (the engine's tier counters, or the server's
cached_tokens where only a restore can have served them) before it compares.
"""
from __future__ import annotations

import math
from pathlib import Path

import httpx
import numpy as np
import pytest

import pyllama_kv as pk
from conftest import F32, toks
from pyllama_kv.engine import Engine, EngineConfig, SamplingParams

#: what the tiers store, every evicted prefix paged out (the page-out rule: test_page_out_rule.py)
pytestmark = pytest.mark.usefixtures("every_page_out")

TOL = 1e-4                # |log-probability - the cache-free one|, F32 (measured ~1e-6)
TOP = 5                   # alternatives compared per answer token
ANSWER = 8                # answer tokens per request
GREEDY_ALL = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model, pin_lib):
    with pk.Model(tiny_model, lib=pin_lib) as m:
        yield m


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    m = float(x.max())
    return x - (m + math.log(float(np.exp(x - m).sum())))


def cache_free_logprobs(model, prompt: list[int], answer: list[int]) -> list[np.ndarray]:
    """The log-probabilities before each answer token, from a context of their own that evaluates the
    prompt, then the answer one token at a time: no prefix cache, no tier."""
    out = []
    with model.context(n_ctx=512, n_seq_max=1, **F32) as c:
        s = c.new_sequence()
        logits = s.extend(prompt)
        for tok in answer:
            out.append(log_softmax(logits))
            logits = s.extend([tok])
    return out


def compare(refs: list[np.ndarray], answer: list[int], logprobs) -> float:
    """The largest difference between ``logprobs`` (the engine's: (token, logprob, alternatives) per
    answer token) and the cache-free ones; asserts the greedy choice and the top alternatives too."""
    assert logprobs is not None and len(logprobs) == len(answer) == len(refs)
    worst = 0.0
    for ref, tok, (t, lp, alts) in zip(refs, answer, logprobs):
        assert t == tok
        assert ref[tok] >= ref.max() - TOL, "greedy chose a token the cache-free evaluation does not"
        assert len(alts) == TOP
        kth = np.sort(ref)[-TOP]
        worst = max(worst, abs(lp - ref[tok]))
        for a, a_lp in alts:
            assert ref[a] >= kth - TOL, f"alternative {a} is not among the cache-free top {TOP}"
            worst = max(worst, abs(a_lp - ref[a]))
    return worst


def ask(eng: Engine, prompt: list[int], logprobs: int | None = None):
    h = eng.submit(prompt, GREEDY_ALL, max_tokens=ANSWER, logprobs=logprobs)
    eng.run_until_idle()
    (c,) = h.result()
    assert c.finish_reason == "length" and len(c.tokens) == ANSWER
    return c, h.usage


def evict_with_others(eng: Engine) -> None:
    """4 other conversations of 150 tokens: more than the 512 cells hold beside the first, and more
    idle prefixes than prefix_cache keeps, so the first is evicted (paged out to a tier)."""
    for i in range(4):
        ask(eng, toks(150, seed=10 + i))


FIRST = toks(120, seed=1)
NEW_MESSAGE = toks(10, seed=2)


def test_a_conversation_restored_from_the_host_tier_gives_the_cache_free_logprobs(model):
    cfg = EngineConfig(n_ctx=512, parallel=1, prefix_cache=2, cache_ram=16, **F32)
    with Engine(model, cfg) as eng:
        c1, _ = ask(eng, FIRST)
        evict_with_others(eng)
        second = FIRST + c1.tokens + NEW_MESSAGE
        before = dict(eng.kv.tier_stats())
        c2, usage = ask(eng, second, logprobs=TOP)
        st = eng.kv.tier_stats()
    # the tier served the conversation: restored (host memory), not evaluated
    assert st["restores"] > before["restores"]
    assert st["restored_tokens"] - before["restored_tokens"] >= len(FIRST)
    assert usage.reused_tokens >= len(FIRST) and usage.prompt_tokens - usage.reused_tokens <= len(NEW_MESSAGE) + 2
    worst = compare(cache_free_logprobs(model, second, c2.tokens), c2.tokens, c2.logprobs)
    print(f"max |logprob - reference| = {worst:.2e}")
    assert worst < TOL, worst


def test_a_conversation_restored_from_disk_by_a_new_engine_gives_the_cache_free_logprobs(model, tmp_path):
    cfg = EngineConfig(n_ctx=512, parallel=1, prefix_cache=2, cache_ram=0, cache_dir=tmp_path, **F32)
    with Engine(model, cfg) as eng:
        c1, _ = ask(eng, FIRST)
        evict_with_others(eng)
        assert eng.kv.tier_stats()["disk_writes"] >= 1
    second = FIRST + c1.tokens + NEW_MESSAGE
    with Engine(model, cfg) as eng:        # as after a restart: nothing but the files
        c2, usage = ask(eng, second, logprobs=TOP)
        st = eng.kv.tier_stats()
    assert st["disk_hits"] >= 1 and st["disk_restored_tokens"] >= len(FIRST)
    assert usage.reused_tokens >= len(FIRST) and usage.prompt_tokens - usage.reused_tokens <= len(NEW_MESSAGE) + 2
    worst = compare(cache_free_logprobs(model, second, c2.tokens), c2.tokens, c2.logprobs)
    print(f"max |logprob - reference| = {worst:.2e}")
    assert worst < TOL, worst


# -- over HTTP: /v1/completions with logprobs, a restored prompt against the first (cache-free) answer --

SERVER_ARGS = ("--ctx", "512", "--parallel", "1", "--prefix-cache", "2", "--max-tokens-cap", "16",
               "--type-k", "f32", "--type-v", "f32")


def complete(s, prompt: list[int]) -> dict:
    body = {"model": "tiny.gguf", "prompt": prompt, "max_tokens": ANSWER, "temperature": 0, "logprobs": TOP}
    r = httpx.post(s.url + "/completions", json=body, headers=s.headers(), timeout=120)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["choices"][0]["finish_reason"] == "length" and d["usage"]["completion_tokens"] == ANSWER, d
    return d


def cached(d: dict) -> int:
    return (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def compare_http(want: dict, got: dict) -> float:
    """The largest difference between two answers' log-probabilities (the answer token's and the
    top alternatives'); asserts the same text, the same tokens and the same alternatives."""
    a, b = want["choices"][0], got["choices"][0]
    assert a["text"] == b["text"]
    la, lb = a["logprobs"], b["logprobs"]
    assert la["tokens"] == lb["tokens"] and len(la["token_logprobs"]) == ANSWER
    worst = max(abs(x - y) for x, y in zip(la["token_logprobs"], lb["token_logprobs"]))
    for ta, tb in zip(la["top_logprobs"], lb["top_logprobs"]):
        assert ta.keys() == tb.keys()
        worst = max(worst, *(abs(ta[k] - tb[k]) for k in ta))
    return worst


def test_over_http_a_prompt_restored_from_host_memory_answers_as_evaluated(tiny_model):
    """The first request on a new server is evaluated (no cache yet): the reference. Four others evict
    it from the KV cache to host memory; asked again, it is restored and answers the same."""
    from test_server import ServerProc

    prompt = toks(120, seed=3)
    s = ServerProc(tiny_model, *SERVER_ARGS, "--cache-ram", "16")
    try:
        want = complete(s, prompt)
        assert cached(want) == 0
        for i in range(4):
            complete(s, toks(150, seed=20 + i))
        restored0 = s.metrics()["pyllama_kv_prefix_restored_tokens_total"]
        got = complete(s, prompt)
        m = s.metrics()
    finally:
        assert s.stop() == 0, s.log()[-2000:]
    assert cached(got) >= len(prompt) - 1
    assert m["pyllama_kv_prefix_restored_tokens_total"] - restored0 >= len(prompt) - 1
    worst = compare_http(want, got)
    print(f"max |logprob - reference| = {worst:.2e}")
    assert worst < TOL, worst


def test_over_http_a_prompt_restored_from_disk_after_a_restart_answers_as_evaluated(tiny_model, tmp_path: Path):
    """A server evaluates the prompt (the reference), pages it out to --cache-dir and stops; a new
    server on the same directory serves it from the file (cached tokens on a server that has
    evaluated nothing else can only come from there) and answers the same."""
    from test_server import ServerProc

    prompt = toks(120, seed=4)
    args = (*SERVER_ARGS, "--cache-ram", "0", "--cache-dir", str(tmp_path))
    s = ServerProc(tiny_model, *args)
    try:
        want = complete(s, prompt)
        assert cached(want) == 0
        for i in range(4):
            complete(s, toks(150, seed=30 + i))
    finally:
        assert s.stop() == 0, s.log()[-2000:]
    assert any(tmp_path.iterdir()), "nothing was paged out to the directory"
    s = ServerProc(tiny_model, *args)
    try:
        got = complete(s, prompt)
    finally:
        assert s.stop() == 0, s.log()[-2000:]
    assert cached(got) >= len(prompt) - 1
    worst = compare_http(want, got)
    print(f"max |logprob - reference| = {worst:.2e}")
    assert worst < TOL, worst
