"""The host tier of the engine's prefix cache (issue 24, first tier): idle prefixes evicted from the
KV cache are paged out as spans to a token trie in host memory, restored (a memcpy) instead of
evaluated when a prompt comes back, a shared prefix stored once, the bytes within ``cache_ram``."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import F32, toks
from pyllama_kv.engine import GREEDY, Engine, EngineConfig
from pyllama_kv.engine.tier import SpanTrie
from pyllama_kv.server.metrics import Snapshot, _EngineCollector


@pytest.fixture(scope="module")
def model(tiny_model):
    with pk.Model(tiny_model) as m:
        yield m


def ask(eng, prompt, max_tokens=12):
    h = eng.submit(prompt, GREEDY, max_tokens=max_tokens)
    eng.run_until_idle()
    out = h.result()[0].tokens
    return out, h.usage.prompt_tokens - h.usage.reused_tokens


def trie_bytes(trie: SpanTrie) -> int:
    total, stack = 0, list(trie.root.children.values())
    while stack:
        n = stack.pop()
        assert n.span is not None and n.span.start == n.start and n.span.tokens == n.tokens
        total += n.span.nbytes
        stack.extend(n.children.values())
    return total


def conversation_comes_back(model, cache_ram: int):
    """Turn 1 of conversation A, then enough other conversations to evict A from a small cache, then
    turn 2 of A: (turn 2's answer, prompt tokens evaluated for it, the engine)."""
    cfg = EngineConfig(n_ctx=512, parallel=1, prefix_cache=2, cache_ram=cache_ram, **F32)
    eng = Engine(model, cfg)
    first = toks(120, seed=1)
    answer, _ = ask(eng, first)
    for i in range(4):   # 4 x 150 tokens: more than the cache, and more idle prefixes than prefix_cache
        ask(eng, toks(150, seed=10 + i))
    second = first + answer + toks(10, seed=2)
    out, evaluated = ask(eng, second)
    return out, evaluated, eng


def test_an_evicted_conversation_is_restored_not_evaluated_and_answers_the_same(model):
    want, evaluated_off, eng_off = conversation_comes_back(model, cache_ram=0)
    got, evaluated_on, eng_on = conversation_comes_back(model, cache_ram=16)
    try:
        assert not eng_off.kv.tier_stats()["enabled"]
        st = eng_on.kv.tier_stats()
        assert st["enabled"] and st["restores"] >= 1 and st["restored_tokens"] >= 120
        assert evaluated_off >= 130, "without the tier the whole history is evaluated again"
        assert evaluated_on <= 12, "with it only the new message (and the last answer token) is"
        assert got == want
        # the engine's stats and /metrics say so
        assert eng_on.stats.as_dict()["prefix_tier"]["restored_tokens"] == st["restored_tokens"]
        server = SimpleNamespace(snapshot=Snapshot.take(eng_on))
        fams = {f.name: f.samples[0].value for f in _EngineCollector(server).collect() if f.samples}
        assert fams["pyllama_kv_prefix_restored_tokens"] == st["restored_tokens"]
        assert 0 < fams["pyllama_kv_prefix_host_bytes"] <= fams["pyllama_kv_prefix_host_budget_bytes"] == 16 << 20
    finally:
        eng_off.close()
        eng_on.close()


def test_a_shared_system_prompt_is_stored_once(model):
    system = toks(220, seed=3)
    cfg = EngineConfig(n_ctx=640, parallel=2, prefix_cache=2, cache_ram=64, **F32)
    with Engine(model, cfg) as eng:
        tails = []
        for i in range(16):
            user = toks(30, seed=100 + i)
            out, _ = ask(eng, system + user, max_tokens=6)
            tails.append(len(user) + len(out))
        while eng.kv.evict():   # page out what is still resident
            pass
        trie = eng.kv.cache.tier
        assert trie is not None
        st = eng.kv.tier_stats()
        assert st["page_outs"] >= 16
        # the system prompt's positions are held by one node chain: one child at the root, and no
        # node below it starts before position 220
        assert len(trie.root.children) == 1
        head = next(iter(trie.root.children.values()))
        assert head.end == 220 and len(head.children) == 16
        per_token = head.span.nbytes / len(head.span)
        # each conversation's tail once (less its last token or two: a sampled token is not decoded)
        assert 220 + sum(tails) - 32 <= st["host_tokens"] <= 220 + sum(tails)
        assert trie.nbytes == trie_bytes(trie) < per_token * (220 + sum(tails)) * 1.05
        assert trie.nbytes < per_token * 16 * 220, "16 copies of the system prompt would not fit in this"


def test_the_host_bytes_never_exceed_the_budget(model):
    cfg = EngineConfig(n_ctx=384, parallel=2, prefix_cache=2, cache_ram=1, **F32)
    rng = np.random.default_rng(7)
    systems = [toks(int(rng.integers(20, 120)), seed=200 + i) for i in range(3)]
    history = {c: list(systems[c % 3]) for c in range(24)}
    with Engine(model, cfg) as eng:
        trie = eng.kv.cache.tier
        assert trie is not None and trie.budget == 1 << 20
        for _ in range(60):
            c = int(rng.integers(0, 24))
            prompt = history[c] + toks(int(rng.integers(5, 60)), seed=int(rng.integers(1 << 30)))
            if len(prompt) > 300:
                prompt = list(systems[c % 3]) + prompt[-100:]
            h = eng.submit(prompt, GREEDY, max_tokens=int(rng.integers(1, 10)))
            while not h.done:
                eng.step()
                assert trie.nbytes <= trie.budget
                assert trie.nbytes == trie_bytes(trie)
            history[c] = prompt + h.result()[0].tokens
        st = eng.kv.tier_stats()
        assert st["evicted_nodes"] > 0, "the workload is meant to hit the budget"
        assert st["restores"] > 0
        assert st["host_bytes"] == trie.nbytes <= st["budget_bytes"]


def test_the_vanilla_library_drops_evicted_prefixes(tiny_model, vanilla_lib):
    with pk.Model(tiny_model, lib=vanilla_lib) as m:
        want, _, eng_ref = conversation_comes_back(m, cache_ram=0)
        got, evaluated, eng = conversation_comes_back(m, cache_ram=16)
        try:
            st = eng.kv.tier_stats()
            assert not st["enabled"] and "0014" in st["off_reason"] and st["page_outs"] == 0
            assert eng.stats.as_dict()["prefix_tier"]["off_reason"] == st["off_reason"]
            assert evaluated >= 130 and got == want
        finally:
            eng_ref.close()
            eng.close()


def test_the_cache_ram_flag_maps_onto_the_engine_config():
    import argparse

    from pyllama_kv.cli import options
    from pyllama_kv.cli.common import CLIError

    p = argparse.ArgumentParser()
    options.add(p, "cache_ram")
    assert options.from_args(EngineConfig, p.parse_args([])).cache_ram == EngineConfig().cache_ram == 256
    assert options.from_args(EngineConfig, p.parse_args(["--cache-ram", "0"])).cache_ram == 0
    with pytest.raises(CLIError, match="--cache-ram"):
        options.from_args(EngineConfig, p.parse_args(["--cache-ram", "-1"]))
