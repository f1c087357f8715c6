"""The host tier of the engine's prefix cache (issue 24, first tier): idle prefixes evicted from the
KV cache are paged out as spans to a token trie in host memory, restored (a memcpy) instead of
evaluated when a prompt comes back, a shared prefix stored once, the bytes within ``cache_ram``."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import F32, toks
from pyllama_kv.engine import GREEDY, Engine, EngineConfig
from pyllama_kv.prefixcache.tiers import SpanTrie
from pyllama_kv.server.metrics import Snapshot, _EngineCollector

#: what the tiers store, every evicted prefix paged out (the page-out rule: test_page_out_rule.py)
pytestmark = pytest.mark.usefixtures("every_page_out")


@pytest.fixture(scope="module")
def model(tiny_model, pin_lib):
    with pk.Model(tiny_model, lib=pin_lib) as m:
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


def stored_below(trie: SpanTrie, n: int) -> int:
    """How many positions ``< n`` the trie's spans hold, all nodes together (a prefix stored once
    under every conversation that continues it: exactly its length)."""
    total, stack = 0, list(trie.root.children.values())
    while stack:
        node = stack.pop()
        total += max(0, min(node.end, n) - node.start)
        stack.extend(node.children.values())
    return total


SYSTEM = 1000


def test_a_shared_system_prompt_is_stored_once(model):
    """Issue 24: 16 conversations under one 1,000-token system prompt hold its K/V once in host
    memory, checked after every request (while the prompt is also resident, forked by the
    conversations in the context) and after everything is paged out."""
    system = toks(SYSTEM, seed=3)
    cfg = EngineConfig(n_ctx=1280, parallel=2, prefix_cache=2, cache_ram=64, **F32)
    with Engine(model, cfg) as eng:
        trie = eng.kv.cache.tier
        assert trie is not None
        tails = []
        for i in range(16):
            user = toks(30, seed=100 + i)
            out, evaluated = ask(eng, system + user, max_tokens=6)
            tails.append(len(user) + len(out))
            if i:
                assert evaluated <= 31, "the system prompt is served from the cache, not evaluated"
            assert stored_below(trie, SYSTEM) in (0, SYSTEM)
            assert trie.nbytes == trie_bytes(trie) <= trie.budget
        while eng.kv.evict():   # page out what is still resident
            pass
        st = eng.kv.tier_stats()
        assert st["page_outs"] >= 16
        assert stored_below(trie, SYSTEM) == SYSTEM
        # the system prompt's positions are held by one node chain: one child at the root, and no
        # node below it starts before position SYSTEM (a user message may start with the same token
        # as another, so the branch point may be a token or two later)
        assert len(trie.root.children) == 1
        head = next(iter(trie.root.children.values()))
        assert SYSTEM <= head.end <= SYSTEM + 2 and len(head.children) >= 14
        per_token = head.span.nbytes / len(head.span)
        # each conversation's tail once (less its last token or two: a sampled token is not decoded)
        assert SYSTEM + sum(tails) - 32 <= st["host_tokens"] <= SYSTEM + sum(tails)
        assert trie.nbytes == trie_bytes(trie) < per_token * (SYSTEM + sum(tails)) * 1.05
        assert trie.nbytes < per_token * SYSTEM * 2, "16 copies of the system prompt would take 16x"
        assert st["resident_sequences"] == 0 and st["host_bytes"] == trie.nbytes


def test_the_api_prefix_cache_stores_a_shared_prompt_once(model):
    """The same through pk.PrefixCache without the engine: two idle sequences at most, so most
    conversations are paged out; each comes back restored, its answer as evaluated."""
    system = toks(SYSTEM, seed=4)
    with model.context(n_ctx=2048, n_seq_max=4, **F32) as ctx:
        pc = pk.PrefixCache(ctx, max_sequences=2, cache_ram=64)
        trie = pc.tier
        assert trie is not None
        convs = [system + toks(30, seed=200 + i) for i in range(16)]
        for c in convs:
            pc.release(pc.acquire(c))
            assert stored_below(trie, SYSTEM) in (0, SYSTEM)
        assert pc.stats.evaluated_tokens <= SYSTEM + 16 * 30 + 1
        assert stored_below(trie, SYSTEM) == SYSTEM and len(trie.root.children) == 1
        for c in convs[:4]:   # they come back: restored from host memory, not evaluated
            before = pc.stats.evaluated_tokens
            s = pc.acquire(c + [5])
            assert pc.stats.evaluated_tokens - before == 1
            with model.context(n_ctx=2048, n_seq_max=1, **F32) as ref:
                np.testing.assert_allclose(s.logits(), ref.new_sequence().extend(c + [5]), atol=1e-4)
            pc.release(s)
        assert stored_below(trie, SYSTEM) == SYSTEM
        st = pc.tier_stats()
        assert st["restored_tokens"] > 0 and st["host_bytes"] == trie.nbytes <= st["budget_bytes"]


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


def test_a_long_random_workload_keeps_both_bounds_and_restores_exactly(model, tmp_path):
    """pk.PrefixCache with host memory and a directory, both small, under a random mix of new
    conversations, returning ones, releases and evictions: after every operation the host bytes and
    the directory are within their bounds, the trie's accounting is exact, and every acquired
    sequence holds what a fresh evaluation computes."""
    rng = np.random.default_rng(11)
    systems = [toks(int(rng.integers(40, 160)), seed=400 + i) for i in range(3)]
    history = {c: list(systems[c % 3]) for c in range(20)}
    with model.context(n_ctx=768, n_seq_max=4, **F32) as ctx, \
            model.context(n_ctx=512, n_seq_max=1, **F32) as ref:
        pc = pk.PrefixCache(ctx, max_sequences=2, cache_ram=1, cache_dir=tmp_path, cache_dir_mib=1)
        trie, live = pc.tier, []
        assert trie is not None and pc.tiers is not None and pc.tiers.disk is not None
        # bounds below the options' 1 MiB unit, so that a short load hits both
        host_bound, disk_bound = 200 << 10, 400 << 10
        trie.budget = pc.tier_info.budget_bytes = host_bound
        pc.tiers.disk.max_bytes = pc.tier_info.disk_budget_bytes = disk_bound

        def check():
            assert trie.nbytes == trie_bytes(trie) <= trie.budget == host_bound
            on_disk = sum(f.stat().st_size for f in tmp_path.iterdir() if f.name.endswith(".kvspan"))
            assert on_disk == pc.tier_info.disk_bytes <= disk_bound

        for step in range(100):
            op = rng.random()
            if op < 0.6 or not live:
                c = int(rng.integers(0, 20))
                prompt = history[c] + toks(int(rng.integers(5, 60)), seed=int(rng.integers(1 << 30)))
                if len(prompt) > 400:
                    prompt = list(systems[c % 3]) + prompt[-150:]
                s = pc.acquire(prompt)
                history[c] = prompt
                if step % 8 == 0:
                    r = ref.new_sequence()
                    np.testing.assert_allclose(s.logits(), r.extend(prompt), atol=1e-4)
                    r.close()
                live.append(s)
                if len(live) > 2:
                    live.pop(0).close()
            elif op < 0.85:
                pc.release(live.pop(int(rng.integers(0, len(live)))))
            else:
                pc.evict()
            check()
        st = pc.tier_stats()
        assert st["evicted_nodes"] > 0 and st["disk_evicted_files"] > 0, "the load is meant to hit both bounds"
        assert st["restored_tokens"] > 0 and st["disk_hits"] > 0
        assert st["disk_corrupt"] == 0


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


def test_an_idle_prefix_is_paged_out_while_others_decode_and_restored_when_it_comes_back(model):
    """llama.cpp attends over every cell up to the highest in use, so an idle conversation left in the
    cells slows every decode of the others: after limits.IDLE_PAGE_OUT_TOKENS tokens decoded without it, it is
    paged out to the host tier (its cells freed), and restored, not evaluated, when it comes back.
    The same answers as an engine without the host tier (which keeps it resident)."""
    from pyllama_kv.limits import IDLE_PAGE_OUT_MIN, IDLE_PAGE_OUT_TOKENS

    def run(cache_ram: int):
        eng = Engine(model, EngineConfig(n_ctx=1024, parallel=2, prefix_cache=4, cache_ram=cache_ram, **F32))
        first = toks(200, seed=3)
        answer, _ = ask(eng, first, max_tokens=8)
        free_before = eng.kv.free_cells()
        other, _ = ask(eng, toks(20, seed=4), max_tokens=3 * IDLE_PAGE_OUT_TOKENS)   # decodes without it
        freed = eng.kv.free_cells() - free_before
        back, evaluated = ask(eng, first + answer + toks(6, seed=5), max_tokens=8)
        return eng, freed, (answer, other, back), evaluated

    eng_on, freed_on, got, evaluated_on = run(16)
    eng_off, freed_off, want, evaluated_off = run(0)
    try:
        assert eng_on.stats.idle_page_outs >= 1 and eng_off.stats.idle_page_outs == 0
        assert freed_off < 0, "without a tier it stays in the cells (the other conversation took more)"
        assert freed_on - freed_off >= 200 - IDLE_PAGE_OUT_MIN, "with one, the idle conversation's cells were freed"
        st = eng_on.kv.tier_stats()
        assert st["restored_tokens"] >= 200 and evaluated_on <= 8 and evaluated_off <= 8
        assert got == want
    finally:
        eng_on.close()
        eng_off.close()


@contextlib.contextmanager
def an_idle_conversation(model):
    """An engine with a host tier after a 200-token conversation finished: (the engine, the
    conversation's prompt, its answer), the conversation idle and not paged out yet."""
    eng = Engine(model, EngineConfig(n_ctx=1024, parallel=2, prefix_cache=4, cache_ram=16, **F32))
    try:
        first = toks(200, seed=3)
        answer, _ = ask(eng, first, max_tokens=4)
        yield eng, first, answer
    finally:
        eng.close()


def comes_back(eng, first, answer) -> tuple[int, int]:
    """The conversation's next turn: (prompt tokens it evaluated, the tier's restored tokens so far)."""
    _, evaluated = ask(eng, first + answer + toks(6, seed=5), max_tokens=4)
    return evaluated, eng.kv.tier_stats()["restored_tokens"]


def test_an_idle_prefix_goes_before_a_prompt_step_that_would_attend_over_it(model):
    """The idle page-out runs before the decode that makes a prefix's idle time reach the bound: a
    prompt of 100 tokens right after a 200-token conversation finished is evaluated with that
    conversation already paged out, so its cells sit where the conversation's were (from cell 0: the
    decode neither attends over the idle cells nor places the prompt above them), and the same answer
    comes back to the conversation restored."""
    from pyllama_kv.limits import IDLE_PAGE_OUT_TOKENS

    with an_idle_conversation(model) as (eng, first, answer):
        assert eng.stats.idle_page_outs == 0
        prompt = toks(100, seed=4)
        assert len(prompt) >= IDLE_PAGE_OUT_TOKENS
        h = eng.submit(prompt, GREEDY, max_tokens=2)
        eng.step()   # the prompt's evaluation: the idle conversation went before it
        assert eng.stats.idle_page_outs == 1
        ctx = eng.context
        if ctx.caps.cell_view:   # the mission pin's cells in cache order: the prompt took the freed low ones
            used = np.flatnonzero(ctx.kv_cells() != -1)   # (-2: shared with the cache's copy of the prompt)
            assert used.size == len(prompt) and used.max() < len(prompt), used
        eng.run_until_idle()
        h.result()
        evaluated, restored = comes_back(eng, first, answer)
        assert evaluated <= 8 and restored >= 200


def test_a_prefix_forked_for_a_few_tokens_still_goes_before_the_decode(model):
    """A cached conversation that a new prompt forks at admission for a few of its tokens still goes
    before the decode when the rest of it has been idle long enough: the fork keeps the cells it shares,
    the conversation's other 150 cells are paged out (left resident they would cost this decode's
    attention, and the new prompt's cells would go above them; the agents load after the code load ran
    39 tok/s with such prefixes kept for another 32 tokens, 48.5 without), and it comes back restored."""
    with an_idle_conversation(model) as (eng, first, answer):
        ask(eng, toks(10, seed=6), max_tokens=2)   # a look that sees the conversation idle
        assert eng.stats.idle_page_outs == 0
        h = eng.submit(first[:50] + toks(60, seed=7), GREEDY, max_tokens=2)
        eng.step()   # admission forks the conversation's first 50 tokens; the chunk is decoded
        assert h.usage.reused_tokens == 50 and eng.stats.idle_page_outs == 1
        eng.run_until_idle()
        h.result()
        evaluated, restored = comes_back(eng, first, answer)
        assert evaluated <= 8 and restored >= 150
