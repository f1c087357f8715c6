"""The prefix cache's one eviction rule and its token trie (prefixcache/eviction.py, prefixcache/trie.py,
issue 31): the trie finds what the linear scan it replaced found, the rule evicts what the rule before
it evicted, and the API's PrefixCache and the engine's KV layer evict through the same object."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import toks
from pyllama_kv.core.span import shared_prefix
from pyllama_kv.engine import GREEDY, Engine, EngineConfig, kv as engine_kv
from pyllama_kv.prefixcache.cache import PrefixCache
from pyllama_kv.prefixcache.eviction import IdlePrefixes
from pyllama_kv.prefixcache.trie import NO_RANK, TokenTrie


class FakeSeq:
    def __init__(self, sid: int, tokens: list[int], world: World):
        self.id, self.tokens, self.world = sid, list(tokens), world

    def __len__(self) -> int:
        return len(self.tokens)

    def close(self) -> None:
        self.world.close(self)


class World:
    """Sequence ids as a context hands them out (the least free one; a closed sequence's id is taken
    again), and what was closed and paged out, in order."""

    def __init__(self, n_ids: int):
        self.free = list(range(n_ids))
        self.closed: list[int] = []
        self.paged: list[int] = []

    def new(self, tokens) -> FakeSeq:
        self.free.sort()
        return FakeSeq(self.free.pop(0), tokens, self)

    def close(self, s: FakeSeq) -> None:
        self.closed.append(s.id)
        self.free.append(s.id)


class LinearIdle:
    """The rule and the match as PrefixCache wrote them before the trie: an OrderedDict scanned
    front to back (least recently used first), the first strictly longer match kept."""

    def __init__(self, world: World):
        self.idle: OrderedDict[int, FakeSeq] = OrderedDict()
        self.world = world

    def best(self, t):
        best, best_n = None, 0
        for s in self.idle.values():
            if min(len(s), len(t)) <= best_n:
                continue
            n = shared_prefix(s.tokens, t)
            if n > best_n:
                best, best_n = s, n
        return best, best_n

    def touch(self, s):
        self.idle.move_to_end(s.id)

    def evict(self, keep=None) -> bool:
        victim = next((s for s in self.idle.values() if s is not keep), None)
        if victim is None:
            return False
        self.world.paged.append(victim.id)
        del self.idle[victim.id]
        victim.close()
        return True

    def add(self, s):
        for sid, o in list(self.idle.items()):
            if len(o) <= len(s) and s.tokens[:len(o)] == o.tokens:
                del self.idle[sid]
                o.close()
        self.idle[s.id] = s

    def trim(self, max_sequences: int) -> int:
        n = 0
        while len(self.idle) > max_sequences and self.evict():
            n += 1
        return n


def random_prompt(rng, pool) -> list[int]:
    base = pool[rng.integers(len(pool))]
    t = base[:int(rng.integers(1, len(base) + 1))].copy()
    if rng.random() < 0.3:
        t[rng.integers(len(t))] = rng.integers(0, 3)
    if rng.random() < 0.2:
        t = np.concatenate((t, rng.integers(0, 3, int(rng.integers(1, 5)))))
    return t.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_the_trie_matches_and_evicts_as_the_linear_scan_did(seed):
    """Random workloads (a 3-token vocabulary: many shared prefixes and ties) through IdlePrefixes
    and the linear scan it replaced: the same best match (the same sequence, the least recently used
    of equals), the same sequences closed and paged out, in the same order."""
    rng = np.random.default_rng(seed)
    pool = [rng.integers(0, 3, 30).astype(np.int32) for _ in range(5)]
    max_sequences = int(rng.integers(1, 12))
    old_w, new_w = World(64), World(64)
    old = LinearIdle(old_w)
    new: IdlePrefixes[FakeSeq] = IdlePrefixes(lambda s: new_w.paged.append(s.id))
    for step in range(800):
        p = random_prompt(rng, pool)
        ob, on = old.best(p)
        nb, nn = new.best(np.asarray(p, np.int32))
        assert nn == on and (nb is None) == (ob is None) and (nb is None or nb.id == ob.id), step
        r = rng.random()
        if r < 0.55:      # a prompt forks its best match, then is cached (PrefixCache.acquire)
            if ob is not None:
                old.touch(ob)
                new.touch(nb)
            if len(old.idle) < 60:
                old.add(old_w.new(p))
                new.add(new_w.new(p))
            assert old.trim(max_sequences) == new.trim(max_sequences)
        elif r < 0.85:    # room is made for the prompt, its best match kept
            assert old.evict(ob) == new.evict(nb)
        elif r < 0.97:    # room is made with nothing kept
            assert old.evict() == new.evict()
        else:
            for s in list(old.idle.values()):
                s.close()
            old.idle.clear()
            new.clear()
        assert [s.id for s in new] == list(old.idle), step
        assert new.n_tokens == sum(len(s) for s in old.idle.values())
        assert sorted(new_w.closed) == sorted(old_w.closed) and new_w.paged == old_w.paged, step
    new.clear()
    assert len(new) == 0 and not new._trie.root.children and new._trie.root.least == NO_RANK


def test_token_trie_longest_and_prefixes():
    trie: TokenTrie[str, tuple[str, int]] = TokenTrie(rank=lambda v: v[1])
    trie.insert("a", ("a", 5), [1, 2, 3, 4])
    trie.insert("b", ("b", 2), [1, 2, 3, 9])
    trie.insert("c", ("c", 7), [1, 2])
    assert trie.longest([1, 2, 3, 4, 5]) == (("a", 5), 4)
    assert trie.longest([1, 2, 3]) == (("b", 2), 3)     # a and b share 3: the least rank
    assert trie.longest([1, 2]) == (("b", 2), 2)
    assert trie.longest([7]) == (None, 0) and trie.longest([]) == (None, 0)
    assert sorted(v[0] for v in trie.prefixes([1, 2, 3, 4, 8])) == ["a", "c"]
    trie.remove("b")
    assert trie.longest([1, 2, 3]) == (("a", 5), 3)
    assert len(trie) == 2 and "b" not in trie


def test_the_trie_matches_200_idle_sequences_without_comparing_each(monkeypatch):
    """200 idle sequences under 20 system prompts: the trie walks the prompt once, comparing a few
    nodes' tokens, where the scan compared the prompt with all 200 (issue 31: a resident match was a
    linear scan). Counted, not timed: the token comparisons each match makes."""
    from pyllama_kv.prefixcache import trie as trie_mod

    rng = np.random.default_rng(0)
    systems = [rng.integers(3, 600, 40).tolist() for _ in range(20)]
    w_old, w_new = World(256), World(256)
    old, new = LinearIdle(w_old), IdlePrefixes[FakeSeq]()
    for i in range(200):
        p = systems[i % 20] + rng.integers(3, 600, 14).tolist()
        old.add(w_old.new(p))
        new.add(w_new.new(p))
    qs = [systems[i] + rng.integers(3, 600, 12).tolist() for i in range(20)]
    arrs = [np.asarray(q, np.int32) for q in qs]
    compared = []
    real = trie_mod.shared_prefix
    monkeypatch.setattr(trie_mod, "shared_prefix", lambda a, b: compared.append(1) or real(a, b))
    for q, a in zip(qs, arrs):
        compared.clear()
        assert old.best(q)[1] == new.best(a)[1] == 40
        assert len(compared) <= 4, len(compared)   # the scan: 200 comparisons for every prompt


# -- one rule for the API and the engine -----------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model):
    with pk.Model(tiny_model) as m:
        yield m


def test_the_engine_and_the_api_evict_through_the_same_rule(model, monkeypatch):
    """pk.PrefixCache and the engine's KV layer hold the same PrefixCache class, whose idle
    sequences are an IdlePrefixes, and every eviction of either (the engine's reserve/make_room/fork
    included) is IdlePrefixes.evict; the engine keeps no copy of the rule or of the match."""
    calls: list[IdlePrefixes] = []
    evict = IdlePrefixes.evict

    def spy(self, keep=None):
        calls.append(self)
        return evict(self, keep)

    monkeypatch.setattr(IdlePrefixes, "evict", spy)
    # (no host tier: with one, each idle prefix is paged out before the next prompt's decode, by age, and
    # nothing is left for the rule to evict)
    eng = Engine(model, EngineConfig(n_ctx=256, parallel=1, prefix_cache=2, cache_ram=0))
    assert type(eng.kv.cache) is pk.PrefixCache is PrefixCache
    assert isinstance(eng.kv.cache.idle, IdlePrefixes)
    for kv_cls in (engine_kv.ContextKV, engine_kv.HoldingKV, engine_kv.PrefixPolicy):
        assert not {"_best", "_evict"} & set(vars(kv_cls)), kv_cls
    for i in range(4):   # 4 x 100 tokens in 256 cells and 2 idle slots: evictions
        h = eng.submit(toks(100, seed=i), GREEDY, max_tokens=4)
        eng.run_until_idle()
        h.result()
    engine_evictions = [c for c in calls if c is eng.kv.cache.idle]
    assert engine_evictions and eng.kv.cache.stats.evictions > 0
    with pk.Context(model, n_ctx=256, n_seq_max=3) as ctx:
        pc = pk.PrefixCache(ctx, max_sequences=2, cache_ram=0)
        assert type(pc) is type(eng.kv.cache) and type(pc.idle) is type(eng.kv.cache.idle)
        calls.clear()
        for i in range(4):
            pc.acquire(toks(100, seed=10 + i)).close()
        assert calls and all(c is pc.idle for c in calls) and pc.stats.evictions > 0
