"""The whole-state store (``prefixcache/wholestates.py``): the host tier of a model whose memory holds
more than cells (LFM2's hybrid recurrent layers, Gemma 3's sliding window), which keeps evicted
sequences' whole states instead of spans. Its rules, each against a fresh evaluation (F32 weights and
cache: a continuation equals the same tokens evaluated alone, up to float rounding, test_new_archs.TOL):
a longer state replaces the shorter one it extends, the byte budget holds least recently used first
out, a prompt that leaves a kept state part-way does not get it, and a state loads onto a sequence that
holds a prefix of it (one whose cells another sequence shares too). Also a request cancelled
mid-generation on such a model: what comes after it, sharing its prefix, answers as a fresh
evaluation does."""
from __future__ import annotations

import numpy as np
import pytest
from test_new_archs import ARCHS, close, fresh

import pyllama_kv as pk
from conftest import F32, toks
from pyllama_kv.engine import GREEDY, Engine, EngineConfig
from pyllama_kv.prefixcache.tiers import TierStats
from pyllama_kv.prefixcache.wholestates import WholeStates
from pyllama_kv.tools.gguf import make_tiny_model


@pytest.fixture(scope="module", params=["lfm2", "gemma3"])
def model(request, models, current_lib):
    path = make_tiny_model(models / f"ws-{request.param}.gguf", seed=3, **ARCHS[request.param])
    with pk.Model(path, lib=current_lib) as m:
        yield m


def new_store(ctx, budget: int = 64 << 20) -> WholeStates:
    return WholeStates(ctx, budget, TierStats(enabled=True))


def evict(ctx, store: WholeStates, tokens) -> None:
    """What the prefix cache does with an evicted idle sequence of ``tokens``: its whole state is paged
    out to ``store``, then the sequence is closed."""
    s = ctx.new_sequence()
    s.extend(tokens)
    store.page_out(s)
    s.close()


def restored(ctx, store: WholeStates, prompt, held=()) -> tuple[int, pk.Sequence]:
    """A sequence holding ``held`` (a prefix of ``prompt``), restored from ``store`` as the prefix cache
    does (all of ``prompt`` but its last token at most): the tokens restored, and the sequence."""
    s = ctx.new_sequence()
    if held:
        s.extend(list(held))
    return store.restore_into(s, prompt, len(prompt) - 1), s


def test_a_longer_state_replaces_the_shorter_it_extends(model):
    a = toks(60, 1)
    with model.context(n_ctx=512, n_seq_max=4, **F32) as ctx:
        store = new_store(ctx)
        evict(ctx, store, a[:30])
        assert len(store) == 1 and store.stats.host_tokens == 30
        evict(ctx, store, a)                   # extends the kept 30: it takes their place
        assert len(store) == 1 and store.stats.host_tokens == 60 and store.stats.page_outs == 2
        assert store.nbytes == store.stats.host_bytes > 0
        nbytes = store.nbytes
        evict(ctx, store, a[:40])              # a kept state holds these 40 and more: nothing new
        assert len(store) == 1 and store.stats.page_outs == 2 and store.nbytes == nbytes
        # the 30 are gone: a prompt that extends them but leaves the 60 (and is longer) gets nothing
        other = a[:30] + toks(40, 2)
        assert store.matched(other, 0) == 0
        got, s = restored(ctx, store, other)
        assert got == 0 and len(s) == 0
        s.close()
        # a prompt that extends all 60 gets them, and goes on exactly as a fresh evaluation
        prompt = a + [7]
        assert store.matched(prompt, 0) == 60
        got, s = restored(ctx, store, prompt)
        assert got == 60 and list(s.tokens) == a and store.stats.restored_tokens == 60
        assert close(s.extend([7]), fresh(model, prompt))
        assert len(store) == 0 and store.nbytes == 0, "the state left the store: the sequence holds it now"


def test_the_byte_budget_holds_least_recently_used_first_out(model):
    a, b, c = (toks(40, 10 + i) for i in range(3))
    with model.context(n_ctx=512, n_seq_max=4, **F32) as ctx:
        s = ctx.new_sequence()
        s.extend(a)
        size = ctx.whole_state(s).n_bytes   # every 40-token state is this large
        s.close()
        store = new_store(ctx, budget=2 * size + size // 2)   # room for two
        evict(ctx, store, a)
        evict(ctx, store, b)
        assert len(store) == 2 and store.nbytes == 2 * size
        evict(ctx, store, a[:30])   # a prefix of a: nothing new, but a was used: b is the oldest now
        evict(ctx, store, c)        # over the budget: b goes
        st = store.stats
        assert len(store) == 2 and store.nbytes == 2 * size <= store.budget
        assert st.evicted_nodes == 1 and st.evicted_bytes == size and st.host_bytes == store.nbytes
        assert store.matched(b + [5], 0) == 0
        assert store.matched(a + [5], 0) == 40 and store.matched(c + [5], 0) == 40
        for t in (a, c):   # what stayed comes back exact
            got, s = restored(ctx, store, t + [5])
            assert got == 40 and close(s.extend([5]), fresh(model, t + [5]))
            s.close()
        # a state larger than the whole budget is not kept (and nothing else goes for it)
        small = new_store(ctx, budget=size - 1)
        evict(ctx, small, a)
        assert len(small) == 0 and small.nbytes == 0 and small.stats.not_stored == 1
        assert small.stats.evicted_nodes == 0


def test_a_prompt_that_branches_inside_a_kept_state_is_evaluated(model):
    """Through the prefix cache (one idle sequence at most): a conversation evicted into the store, then
    a longer prompt that shares only its first 40 tokens: neither memory can be cut back, so nothing is
    restored and the prompt is evaluated, exactly; a prompt that extends the whole conversation gets
    the rest of it back from the store, exactly."""
    a, b = toks(60, 20), toks(60, 21)
    with model.context(n_ctx=1024, n_seq_max=6, **F32) as ctx:
        cache = pk.PrefixCache(ctx, max_sequences=1, cache_ram=16)
        assert cache.states is not None and cache.tiers is None
        cache.release(cache.acquire(a))
        cache.release(cache.acquire(b))   # a is evicted: its whole state goes to the store
        st = cache.tier_info
        assert st.page_outs == 1 and st.host_tokens == 60
        branch = a[:40] + toks(30, 22)   # longer than a, which it leaves after 40
        s = cache.acquire(branch)
        assert st.restored_tokens == 0 and cache.last_reused_tokens == 0
        assert close(s.extend([7]), fresh(model, branch + [7]))
        s.close()
        whole = a + toks(5, 23)
        s = cache.acquire(whole)
        # all 60 reused; a[40:] only the store holds (a[:40] may come from the cached branch: a
        # sliding-window model forks it, and the state loads onto the fork)
        assert cache.last_reused_tokens == 60 and st.restores == 1 and 20 <= st.restored_tokens <= 60
        assert close(s.extend([7]), fresh(model, whole + [7]))
        s.close()


def test_a_state_loads_onto_a_sequence_that_holds_a_prefix_of_it(model):
    """A sequence holding the first 25 tokens of a kept 60-token state, its cells shared with another
    sequence (a fork): the state adds the other 35, the sequence goes on exactly, and the sequence it
    shared its cells with is untouched."""
    a = toks(60, 30)
    with model.context(n_ctx=512, n_seq_max=6, **F32) as ctx:
        store = new_store(ctx)
        evict(ctx, store, a)
        base = ctx.new_sequence()
        base.extend(a[:25])
        seq = base.fork()
        prompt = a + [9]
        assert store.matched(prompt, len(seq)) == 60
        assert store.restore_into(seq, prompt, len(prompt) - 1) == 35
        assert list(seq.tokens) == a and store.stats.restored_tokens == 35
        assert close(seq.extend([9]), fresh(model, prompt))
        tail = toks(6, 31)
        assert list(base.tokens) == a[:25] and close(base.extend(tail), fresh(model, a[:25] + tail))
        # a sequence that holds all of it (or more) has nothing to gain
        assert store.matched(a + [9, 9], 60) == 60
        s = ctx.new_sequence()
        s.extend(a)
        assert store.restore_into(s, a + [9, 9], 61) == 0


# -- cancellation on these models -------------------------------------------------------------------

SYSTEM = 40


def fresh_greedy(model, prompt, n: int) -> list[tuple[int, float]]:
    """The greedy continuation of ``prompt`` evaluated alone (F32), with each token's log-probability."""
    out = []
    with model.context(n_ctx=512, n_seq_max=1, **F32) as c:
        s = c.new_sequence()
        logits = s.extend(prompt)
        for _ in range(n):
            t = int(np.argmax(logits))
            top = float(logits.max())
            out.append((t, float(logits[t]) - top - float(np.log(np.exp(logits - top).sum()))))
            logits = s.extend([t])
    return out


def answers_as_fresh(model, completion, prompt) -> None:
    """``completion`` (asked with logprobs=1) is the greedy continuation of a fresh evaluation of
    ``prompt``: the same tokens, each with its log-probability (a state a cell off moves these, where the
    greedy tokens alone may not move)."""
    got = [(t, lp) for t, lp, _ in completion.logprobs or ()]
    want = fresh_greedy(model, prompt, len(got))
    assert [t for t, _ in got] == [t for t, _ in want] and len(got) == len(completion.tokens) > 0, (got, want)
    assert np.allclose([lp for _, lp in got], [lp for _, lp in want], atol=1e-3), (got, want)


def test_a_cancelled_request_leaves_what_shares_its_prefix_exact(model):
    """Two conversations under one system prompt run together (the second shares the first's cells or
    checkpoint); the first is cancelled mid-generation. The second, and later requests that share the
    cancelled one's prompt, part or all of what it had generated, or the system prompt, answer as a
    fresh evaluation does (tokens and log-probabilities); no sequence outlives them but the cache's
    idle ones."""
    system = toks(SYSTEM, 40)
    p1, p2 = system + toks(12, 41), system + toks(12, 42)
    cfg = EngineConfig(n_ctx=1024, parallel=2, prefix_cache=4, **F32)
    with Engine(model, cfg) as eng:
        h1 = eng.submit(p1, GREEDY, max_tokens=48, boundaries=[SYSTEM], logprobs=1)
        h2 = eng.submit(p2, GREEDY, max_tokens=10, boundaries=[SYSTEM], logprobs=1)
        for _ in range(4):
            eng.step()
        partial = list(h1.completions[0].tokens)   # what it has generated so far
        assert not h1.done and len(partial) >= 2, partial
        h1.cancel()
        eng.run_until_idle()
        (c1,), (c2,) = h1.result(), h2.result()
        assert c1.finish_reason == "cancelled" and list(c1.tokens)[:len(partial)] == partial
        answers_as_fresh(model, c1, p1)
        answers_as_fresh(model, c2, p2)
        assert len(c2.tokens) == 10
        for prompt in (p1 + list(c1.tokens) + toks(3, 44), p1 + partial[:2], p1, system + toks(12, 43)):
            h = eng.submit(prompt, GREEDY, max_tokens=8, logprobs=1)
            eng.run_until_idle()
            answers_as_fresh(model, h.result()[0], prompt)
        cached = {s.id for s in eng.kv.cache.cached}
        assert {s.id for s in eng.context.sequences} <= cached, "a sequence of a finished request outlived it"
