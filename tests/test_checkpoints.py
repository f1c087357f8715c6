"""Checkpoints of a recurrent model's state (issue 32, item 4: exact prefix reuse for hybrid models).

A hybrid model (LFM2: short-convolution layers with recurrent state between attention layers) can
share the attention cells of any prefix, but its recurrent layers hold only the state after a
sequence's last token. ``seq.checkpoint()`` keeps that state (llama.cpp's partial sequence state),
``seq.fork(n, checkpoint=ck)`` forks the first n tokens of a longer sequence with it, and the prefix
cache and the engine keep checkpoints where prompts branch, so that a later prompt evaluates only
what no cached prefix holds. The oracle: F32 weights and cache, every continuation equal to a fresh
evaluation of the same tokens (up to float rounding, test_new_archs.TOL)."""
from __future__ import annotations

import numpy as np
import pytest
from test_new_archs import ARCHS, close, fresh

import pyllama_kv as pk
from conftest import F32, KVWrapper, toks
from pyllama_kv.core.checkpoint import Checkpoint
from pyllama_kv.engine import GREEDY, Engine, EngineConfig
from pyllama_kv.prefixcache.checkpoints import Checkpoints
from pyllama_kv.tools.gguf import make_tiny_model
from test_engine import greedy_run

SYSTEM = 120   # tokens of the shared "system prompt" in the engine tests


@pytest.fixture(scope="module")
def lfm2_path(models):
    return make_tiny_model(models / "ckpt-lfm2.gguf", seed=3, **ARCHS["lfm2"])


@pytest.fixture(scope="module")
def lfm2(lfm2_path, current_lib):
    with pk.Model(lfm2_path, lib=current_lib) as m:
        yield m


# -- the store (pure Python) -----------------------------------------------------------------------

def ck(tokens, size=10) -> Checkpoint:
    return Checkpoint.of(tokens, b"x" * size, model="m")


def test_the_store_finds_the_longest_checkpoint_of_a_prefix_within_the_limit():
    s = Checkpoints(max_bytes=1000)
    a = list(range(100))
    s.add(ck(a[:10]))
    s.add(ck(a[:40]))
    s.add(ck([7] * 30))          # 30 tokens that are not a prefix of a
    t = np.array(a + [5, 6], dtype=np.int32)
    assert s.best(t, 60).n == 40
    assert s.best(t, 39).n == 10          # no longer than the limit
    assert s.best(t, 9) is None
    assert s.best(np.array([1] * 50, dtype=np.int32), 50) is None
    assert a[:40] in s and a[:41] not in s


def test_the_store_keeps_its_bytes_least_recently_used_first_out():
    s = Checkpoints(max_bytes=25)
    s.add(ck([1], 10))
    s.add(ck([1, 2], 10))
    s.best(np.array([1, 9], dtype=np.int32), 5)    # [1] is used: [1, 2] is the oldest now
    s.add(ck([1, 2, 3], 10))
    assert len(s) == 2 and s.n_bytes == 20 and [1] in s and [1, 2] not in s
    s.add(ck([1, 2, 3], 12))                       # the same tokens: replaced, not added
    assert len(s) == 2 and s.n_bytes == 22
    s.add(ck([4], 30))                             # over the bytes alone: nothing of it stays
    assert len(s) == 0 and s.n_bytes == 0
    s.add(ck([5]))
    s.clear()
    assert len(s) == 0 and s.n_bytes == 0 and s.best(np.array([5], dtype=np.int32), 1) is None


# -- the core: checkpoint and fork ----------------------------------------------------------------

def test_a_fork_from_a_checkpoint_continues_as_a_fresh_evaluation(lfm2):
    a, b = toks(40, 1), toks(12, 2)
    with lfm2.context(n_ctx=512, n_seq_max=4, **F32) as c:
        s = c.new_sequence()
        s.extend(a[:20])
        ck20 = s.checkpoint()
        assert ck20.n == 20 and 0 < ck20.n_bytes < 100_000 and list(ck20.tokens) == a[:20]
        s.extend(a[20:])
        with pytest.raises(pk.InvalidInputError, match="recurrent layers"):
            s.fork(20)
        assert not c.can_fork(s, 20) and c.can_fork(s, 20, ck20)
        f = s.fork(20, checkpoint=ck20)
        assert f.tokens == a[:20]
        assert close(f.extend(b), fresh(lfm2, a[:20] + b))
        # the source keeps its own state, the cells they share included
        assert close(s.extend(b), fresh(lfm2, a + b))
        # a checkpoint at the whole length is the sequence's own state: accepted, not needed
        g = s.fork(len(s), checkpoint=s.checkpoint())
        assert close(g.extend([5]), fresh(lfm2, a + b + [5]))


def test_a_wrong_checkpoint_is_refused_with_nothing_changed(lfm2, lfm2_path, current_lib):
    a = toks(30, 3)
    with lfm2.context(n_ctx=512, n_seq_max=4, **F32) as c:
        s = c.new_sequence()
        s.extend(a[:10])
        ck10 = s.checkpoint()
        s.extend(a[10:])
        free = c.free_sequence_ids
        with pytest.raises(pk.InvalidInputError, match="not the first 12"):
            s.fork(12, checkpoint=ck10)
        other = c.new_sequence()
        other.extend(toks(10, 4))
        with pytest.raises(pk.InvalidInputError, match="not the first 10"):
            s.fork(10, checkpoint=other.checkpoint())
        with pytest.raises(pk.InvalidInputError, match="Checkpoint"):
            s.fork(10, checkpoint=b"state")
        # a model with other weights (the same shapes): refused
        other_path = make_tiny_model(lfm2_path.with_name("ckpt-lfm2-other.gguf"), seed=4, **ARCHS["lfm2"])
        with pk.Model(other_path, lib=current_lib) as m2, m2.context(n_ctx=256, n_seq_max=1, **F32) as c2:
            s2 = c2.new_sequence()
            s2.extend(a[:10])
            with pytest.raises(pk.InvalidInputError, match="another model"):
                s.fork(10, checkpoint=s2.checkpoint())
        # the same file loaded again is the same model (its fingerprint): its checkpoint serves
        with pk.Model(lfm2_path, lib=current_lib) as m3, m3.context(n_ctx=256, n_seq_max=1, **F32) as c3:
            s3 = c3.new_sequence()
            s3.extend(a[:10])
            f = s.fork(10, checkpoint=s3.checkpoint())
            assert close(f.extend([7]), fresh(lfm2, a[:10] + [7]))
            f.close()
        with pytest.raises(pk.InvalidInputError, match="empty"):
            c.new_sequence().checkpoint()
        assert c.free_sequence_ids == free - 2 and s.tokens == a
        assert close(s.extend([9]), fresh(lfm2, a + [9]))


def test_checkpoints_need_recurrent_layers_and_the_current_library(models, tiny_model, current_lib):
    p = make_tiny_model(models / "ckpt-smollm3.gguf", seed=3, **ARCHS["smollm3"])
    with pk.Model(p, lib=current_lib) as m, m.context(n_ctx=256, n_seq_max=1, **F32) as c:
        s = c.new_sequence()
        s.extend(toks(5))
        with pytest.raises(pk.InvalidInputError, match="no recurrent layers"):
            s.checkpoint()
    with pk.Model(tiny_model) as m, m.context(n_ctx=256, n_seq_max=1) as c:
        assert not m.native_library.caps.recurrent_checkpoints
        s = c.new_sequence()
        s.extend(toks(5))
        with pytest.raises(pk.LibraryError, match="PARTIAL_ONLY"):
            s.checkpoint()


# -- the prefix cache and the engine ----------------------------------------------------------------

def test_the_prefix_cache_forks_a_shared_prefix_from_the_checkpoint_it_kept(lfm2):
    """acquire() of a prompt that leaves a cached one keeps a checkpoint there: the next prompt
    sharing that much forks it; a prompt whose answer was cached after it leaves its checkpoint too."""
    sys_, q = toks(60, 5), [toks(10, 10 + i) for i in range(4)]
    with lfm2.context(n_ctx=1024, n_seq_max=8, **F32) as c:
        cache = pk.PrefixCache(c, max_sequences=4)
        s1 = cache.acquire(sys_ + q[0])
        assert cache.last_reused_tokens == 0
        s2 = cache.acquire(sys_ + q[1])            # the branch: evaluated, its checkpoint kept
        assert cache.last_reused_tokens == 0 and len(cache.checkpoints) == 1
        s3 = cache.acquire(sys_ + q[2])
        assert cache.last_reused_tokens == 60 and cache.stats.checkpoint_forks == 1
        assert close(s3.extend([7]), fresh(lfm2, sys_ + q[2] + [7]))
        # the cached prompt sys+q[0] is absorbed by its longer continuation: its checkpoint stays
        s1.extend([3, 4, 5])
        cache.release(s1)
        s4 = cache.acquire(sys_ + q[0] + [3, 4, 5, 9])   # extends the whole cached one: no checkpoint needed
        assert cache.last_reused_tokens == 73
        assert close(s4.extend([1]), fresh(lfm2, sys_ + q[0] + [3, 4, 5, 9, 1]))
        s5 = cache.acquire(sys_ + q[0] + [3, 8])         # leaves it after 71: forks 70 from the checkpoint
        assert cache.last_reused_tokens == 70 and close(s5.extend([2]), fresh(lfm2, sys_ + q[0] + [3, 8, 2]))
        for s in (s2, s3, s4, s5):
            s.close()


class Evaluated(KVWrapper):
    def __init__(self, kv):
        super().__init__(kv)
        self.checkpoints: list[int] = []

    def checkpoint(self, seq):
        self.checkpoints.append(len(seq))
        self.kv.checkpoint(seq)


def _conversation(eng, model, prompt, bounds, n_ctx: int = 1024) -> int:
    """One request through ``eng`` (6 greedy tokens, the turn ``bounds``), run to its end: its answer
    is the greedy continuation of a fresh evaluation; returns the prompt tokens it reused."""
    h = eng.submit(prompt, GREEDY, max_tokens=6, boundaries=bounds)
    eng.run_until_idle()
    assert list(h.result()[0].tokens) == greedy_run(model, prompt, len(h.result()[0].tokens), n_ctx=n_ctx)
    return h.usage.reused_tokens


def test_the_engine_serves_a_shared_system_prompt_from_its_checkpoint(lfm2):
    """Conversations under one system prompt on the hybrid model: with the turn boundary given, the
    first keeps a checkpoint at the end of the system prompt and every later one forks all of it;
    without, the second keeps one where it leaves the first (the trie's branch) and the third
    forks it. Every answer is the greedy continuation of a fresh evaluation."""
    system = toks(SYSTEM, 20)
    cfg = EngineConfig(n_ctx=2048, parallel=2, prefix_cache=4, **F32)
    for bounds in ([SYSTEM], None):
        with Engine(lfm2, cfg) as eng:
            eng.kv = rec = Evaluated(eng.kv)
            reused = []
            for i in range(3):
                reused.append(_conversation(eng, lfm2, system + toks(15, 30 + i), bounds))
            if bounds:
                assert reused == [0, SYSTEM, SYSTEM] and rec.checkpoints[0] == SYSTEM
            else:
                assert reused == [0, 0, SYSTEM] and rec.checkpoints[0] == SYSTEM
            kv = eng.kv.kv_stats()   # what /metrics reports of them
            assert kv["checkpoints"] >= 1 and kv["checkpoint_bytes"] > 0 and kv["checkpoint_forks"] >= 1
            tier = eng.kv.tier_stats()   # no spans for a recurrent state: the host tier keeps whole states
            assert tier["enabled"] and not tier["off_reason"], tier


def test_a_long_raw_prompt_keeps_periodic_checkpoints_for_its_first_branch(lfm2):
    """A raw prompt (no turns known) of 1,170 tokens on the hybrid model keeps a checkpoint every
    CHECKPOINT_INTERVAL tokens: the first prompt that branches from it at 1,100 forks the last one
    before (1,024 tokens reused, not 0), keeps an exact one where it branches, and the next prompt
    branching there forks all 1,100. Every answer is the greedy continuation of a fresh evaluation."""
    from pyllama_kv.limits import CHECKPOINT_INTERVAL

    long = toks(1150, 50)
    with Engine(lfm2, EngineConfig(n_ctx=4096, parallel=2, prefix_cache=4, **F32)) as eng:
        reused = [_conversation(eng, lfm2, long + toks(20, 60), None, n_ctx=2048)]
        for seed in (70, 80):
            reused.append(_conversation(eng, lfm2, long[:1100] + toks(31, seed), None, n_ctx=2048))
    assert reused == [0, 1100 // CHECKPOINT_INTERVAL * CHECKPOINT_INTERVAL, 1100], reused


# -- a sliding-window model: its checkpoints are idle sequences of exactly the branch's tokens -----------

@pytest.fixture(scope="module")
def gemma3(models, current_lib):
    with pk.Model(make_tiny_model(models / "ckpt-gemma3.gguf", seed=3, **ARCHS["gemma3"]), lib=current_lib) as m:
        yield m


def _reuse_old_windows(spacer, ctx) -> None:
    """The spacer (the cache's first cells, before the first conversation's) goes, and a new sequence
    of 145 tokens comes: llama.cpp's search starts at the freed cells and goes on through the first
    conversation's, taking those of positions outside every window of the one sequence holding them
    (how a server's cache loses them as requests come and go); then it goes too."""
    spacer.close()
    s = ctx.new_sequence()
    s.extend(toks(145, 900))
    s.close()


def test_a_sliding_window_models_checkpoint_keeps_a_shared_system_prompt_forkable(gemma3):
    """Gemma 3's SWA layers attend to the last 8 positions: a fork of a longer cached sequence's first
    n tokens needs the cells of the window before n, which that sequence no longer attends to, so the
    cache reuses them when other sequences come and go (and llama.cpp then drops every earlier
    position of that sequence), and the fork is refused (the prompt is then evaluated again). Without
    the turn boundary the first conversation alone holds the system prompt: after that, the second
    evaluates everything and keeps a checkpoint where it leaves the first, which the third forks (or
    the second itself, where its cells still hold the window before the branch: the idle page-out
    moves the first out before the second is placed, so they may).
    With the boundary the first keeps a checkpoint at the end of the system prompt (an idle sequence
    of exactly it, whose window is its own last tokens): every later conversation forks all of it.
    Every answer is the greedy continuation of a fresh evaluation."""
    system = toks(SYSTEM, 20)
    cfg = EngineConfig(n_ctx=512, parallel=2, prefix_cache=4, **F32)
    for bounds in ([SYSTEM], None):
        with Engine(gemma3, cfg) as eng:
            cache = eng.kv.cache
            assert cache.keeps_checkpoints and cache.checkpoints is None
            spacer = eng.context.new_sequence()
            spacer.extend(toks(20, 800))
            reused = []
            for i in range(3):
                reused.append(_conversation(eng, gemma3, system + toks(15, 30 + i), bounds))
                if i == 0:
                    first = max(cache.cached, key=len)
                    assert len(first) > SYSTEM + 15
                    _reuse_old_windows(spacer, eng.context)
                    # the first conversation no longer serves the system prompt: llama.cpp purged its
                    # positions up to the reused cells (a sequence's positions stay contiguous)
                    assert not eng.context.can_fork(first, SYSTEM)
            if bounds:   # the checkpoint kept its cells: it serves every later conversation
                assert reused == [0, SYSTEM, SYSTEM]
                assert [list(s.tokens) for s in cache.cached if len(s) == SYSTEM] == [system]
            else:        # the second evaluates everything, and keeps a checkpoint where it left the first
                assert reused == [0, 0, SYSTEM]
            kv = eng.kv.kv_stats()   # the checkpoints share their cells: no bytes of their own
            assert kv["checkpoints"] >= 1 and kv["checkpoint_bytes"] == 0
            if bounds:   # (without, the third may fork the second itself while it holds the window)
                assert cache.stats.checkpoint_forks >= 1 and kv["checkpoint_forks"] >= 1
            tier = eng.kv.tier_stats()
            assert tier["enabled"] and not tier["off_reason"], tier


def test_the_prefix_cache_keeps_a_window_checkpoint_where_a_prompt_branches(gemma3):
    """acquire() on the sliding-window model: a prompt that leaves a cached one inside it keeps an idle
    sequence of exactly the shared tokens (a checkpoint), which a longer sequence cached after it does
    not absorb (rule 5 keeps it), and a sequence of the same tokens does not duplicate; while the
    longer one still holds the window, a prompt forks that one. clear() drops them."""
    sys_, q = toks(60, 5), [toks(10, 10 + i) for i in range(3)]
    with gemma3.context(n_ctx=512, n_seq_max=8, **F32) as c:
        cache = pk.PrefixCache(c, max_sequences=4)
        a = cache.acquire(sys_ + q[0])
        a.extend(toks(30, 50))
        cache.release(a)                           # absorbs the cached prompt sys+q[0]
        b = cache.acquire(sys_ + q[1])             # leaves a after 60 tokens: forks them, keeps a checkpoint
        assert cache.last_reused_tokens == 60
        kept = [s for s in cache.cached if len(s) == 60]
        assert len(kept) == 1 and list(kept[0].tokens) == sys_
        b.extend([4, 5])
        cache.release(b)                           # b's prompt and answer: the checkpoint is not absorbed
        assert kept[0] in cache.cached
        d = c.new_sequence()
        d.extend(sys_)
        cache.release(d)                           # exactly the checkpoint's tokens: not kept twice
        assert d.closed and [s for s in cache.cached if len(s) == 60] == kept
        longest = max(cache.cached, key=len)
        s = cache.acquire(sys_ + q[2])
        assert cache.last_reused_tokens == 60 and close(s.extend([7]), fresh(gemma3, sys_ + q[2] + [7]))
        assert cache.stats.checkpoint_forks == 0   # the longest still held the window: forked from it
        s.close()
        assert c.can_fork(longest, 60)
        cache.clear()
        assert not cache.cached


# -- the host tier of such models: whole states of evicted sequences --------------------------------

@pytest.mark.parametrize("arch", ["lfm2", "gemma3"])
def test_an_evicted_conversation_comes_back_from_its_whole_state(arch, lfm2, gemma3, tmp_path):
    """One idle sequence at most (prefix_cache=1): a second conversation evicts the first, whose whole
    state (recurrent state or window included) goes to host memory; the first's next turn gets all of
    it back from there, written, not evaluated, and its answer is the greedy continuation of a fresh
    evaluation. Without cache_ram the next turn evaluates everything again (a cache_dir does not hold
    such states: its tier says why it is off)."""
    model = lfm2 if arch == "lfm2" else gemma3
    first, other = toks(60, 40), toks(60, 41)
    for ram in (16, 0):
        cfg = EngineConfig(n_ctx=512, parallel=1, prefix_cache=1, cache_ram=ram,
                           cache_dir=None if ram else str(tmp_path), **F32)
        with Engine(model, cfg) as eng:
            h = eng.submit(first, GREEDY, max_tokens=6)
            eng.run_until_idle()
            held = first + list(h.result()[0].tokens)[:-1]   # what the cache keeps (the last token is not decoded)
            _conversation(eng, model, other, None)          # evicts the first conversation
            tier = eng.kv.tier_stats()
            second = held + toks(10, 42)
            reused = _conversation(eng, model, second, None)
            if ram:
                assert tier["enabled"] and tier["page_outs"] >= 1 and tier["host_bytes"] > 0, tier
                assert reused == len(held) and eng.kv.tier_stats()["restored_tokens"] == len(held)
            else:
                kind = "recurrent layers" if arch == "lfm2" else "sliding-window cache"
                assert not tier["enabled"] and kind in tier["off_reason"] and reused == 0, tier


def test_a_whole_state_goes_only_into_its_own_context_and_onto_its_prefix(lfm2):
    """sequence_load_whole refuses a state of another context and a sequence it does not extend, and
    changes nothing then; a state that does not fit leaves the sequence as it was."""
    with lfm2.context(n_ctx=256, n_seq_max=4, **F32) as c, lfm2.context(n_ctx=256, n_seq_max=4, **F32) as d:
        a = c.new_sequence()
        a.extend(toks(40, 50))
        state = c.whole_state(a)
        b = c.new_sequence()
        b.extend(toks(5, 51))   # not a prefix of the state's tokens
        with pytest.raises(pk.InvalidInputError):
            c.sequence_load_whole(b, state)
        assert len(b) == 5
        with pytest.raises(pk.InvalidInputError):
            d.sequence_load_whole(d.new_sequence(), state)
        e = c.new_sequence()
        filler = c.new_sequence()
        filler.extend(toks(200, 52))   # 11 cells free: the state's 40 do not fit
        with pytest.raises(pk.KVCacheFullError):
            c.sequence_load_whole(e, state)
        assert len(e) == 0 and len(b) == 5 and c.kv_stats().used_cells == 245
        assert c._native.seq_pos_min(c._spare_id) == c._native.seq_pos_min(e.id) == -1   # llama.cpp's own word
        filler.close()
        c.sequence_load_whole(e, state)
        assert list(e.tokens) == list(a.tokens)
        assert close(e.extend([7]), fresh(lfm2, list(a.tokens) + [7]))
