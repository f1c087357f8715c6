"""The disk tier of the prefix cache (issue 24, section 4: ``cache_dir``): spans leaving host memory
are written to checked files, restored from them byte for byte instead of evaluated, a bad file is a
miss (counted, deleted, the sequence untouched), and the directory stays within its bound.
Also the API path (pk.PrefixCache, no engine) restoring from host memory and from disk."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import DEVICE_F32_ATOL, F32, cache_on_device, toks
from pyllama_kv.engine import EngineConfig
from pyllama_kv.prefixcache import spanfile
from pyllama_kv.prefixcache.cache import PrefixCache
from pyllama_kv.tools.gguf import make_tiny_model

#: what the tiers store, every evicted prefix paged out (the page-out rule: test_page_out_rule.py)
pytestmark = pytest.mark.usefixtures("every_page_out")

ATOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_model, pin_lib):
    with pk.Model(tiny_model, lib=pin_lib) as m:
        yield m


def new_ctx(model):
    return model.context(n_ctx=512, n_seq_max=4, **F32)


def fresh_logits(model, tokens):
    with model.context(n_ctx=512, n_seq_max=1, **F32) as c:
        return c.new_sequence().extend(tokens)


def files(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.endswith(spanfile.SUFFIX))


def page_to_disk(model, cache_dir, tokens) -> bytes:
    """Evaluate ``tokens`` in a context of its own and page them out to ``cache_dir`` (no host
    memory); returns the K/V bytes of their cells as evaluated."""
    return page_span_to_disk(model, cache_dir, tokens).data


def page_span_to_disk(model, cache_dir, tokens, writes: int = 1) -> pk.Span:
    """:func:`page_to_disk`, returning the Span of the cells as evaluated; ``writes``: the files
    the page-out should write (0: files hold it already)."""
    with new_ctx(model) as ctx:
        pc = pk.PrefixCache(ctx, max_sequences=1, cache_ram=0, cache_dir=cache_dir)
        s = pc.acquire(tokens)
        want = s.snapshot()
        pc.release(s)
        assert pc.evict() and len(pc) == 0
        st = pc.tier_stats()
        assert st["disk_writes"] == writes and st["host_bytes"] == 0 and st["disk_tokens"] >= len(tokens)
        return want


def test_a_span_comes_back_from_disk_byte_exact_in_a_new_context(model, tmp_path):
    a = toks(200, seed=1)
    want = page_to_disk(model, tmp_path, a)
    (f,) = files(tmp_path)
    assert f.name.split("-")[1:3] == ["0", "200"]
    with new_ctx(model) as ctx:   # another context (as after a restart): only the files are shared
        pc = pk.PrefixCache(ctx, max_sequences=2, cache_ram=0, cache_dir=tmp_path)
        prompt = a + toks(4, seed=2)
        s = pc.acquire(prompt)
        assert s.reused_tokens == 200 and pc.stats.restored_tokens == 200 and pc.stats.evaluated_tokens == 4
        assert s.snapshot(0, 200).data == want            # K/V of every layer, byte for byte
        np.testing.assert_allclose(s.logits(), fresh_logits(model, prompt), atol=ATOL)
        st = pc.tier_stats()
        assert st["disk_hits"] == 1 and st["disk_restored_tokens"] == 200 and st["disk_corrupt"] == 0
        # a prompt that goes on inside the span: the file is cut where the prompt leaves it
        t = pc.acquire(a[:120] + toks(3, seed=3))
        assert t.reused_tokens >= 120


def test_a_later_turn_writes_only_its_tail(model, tmp_path):
    a = toks(150, seed=4)
    page_to_disk(model, tmp_path, a)
    b = a + toks(40, seed=5)
    page_to_disk(model, tmp_path, b)   # the first file holds [0, 150): only [150, 190) is written
    assert sorted(tuple(int(x) for x in f.name.split("-")[1:3]) for f in files(tmp_path)) == [(0, 150), (150, 190)]
    with new_ctx(model) as ctx:
        pc = pk.PrefixCache(ctx, max_sequences=1, cache_ram=0, cache_dir=tmp_path)
        s = pc.acquire(b + [7])
        assert s.reused_tokens == 190 and pc.tier_stats()["disk_hits"] == 2
        np.testing.assert_allclose(s.logits(), fresh_logits(model, b + [7]), atol=ATOL)


def _flip(raw: bytes) -> bytes:
    return raw[:-1] + bytes([raw[-1] ^ 0x01])


def _version(raw: bytes) -> bytes:
    return raw[:8] + (spanfile.VERSION + 1).to_bytes(4, "little") + raw[12:]


def _v1(raw: bytes) -> bytes:
    """The same file as version 1 says it (whose body held only the tokens of [start, end))."""
    return raw[:8] + (1).to_bytes(4, "little") + raw[12:]


def _token(raw: bytes) -> bytes:
    """One token of the prefix changed (the name's and header's token hash then disagree with it)."""
    off = 16 + int.from_bytes(raw[12:16], "little") + 88
    return raw[:off] + bytes([raw[off] ^ 0x01]) + raw[off + 1:]


BAD = {"flipped byte": _flip, "truncated": lambda raw: raw[:-100], "garbage": lambda raw: os.urandom(len(raw)),
       "wrong version": _version, "version 1": _v1, "another token": _token, "empty": lambda raw: b"",
       "padded": lambda raw: raw + b"\0"}


@pytest.mark.parametrize("kind", [*BAD, "another model"])
def test_a_bad_file_is_a_miss_and_the_sequence_is_untouched(model, tmp_path, kind):
    a = toks(120, seed=6)
    page_to_disk(model, tmp_path, a)
    (f,) = files(tmp_path)
    if kind == "another model":
        # a file of another model, under this model's name (same tokens): its header says so
        other = make_tiny_model(tmp_path / "other.gguf", seed=9)
        other_dir = tmp_path / "other"
        with pk.Model(other) as m2:
            page_to_disk(m2, other_dir, a)
        (g,) = files(other_dir)
        assert g.name != f.name
        f.write_bytes(g.read_bytes())
    else:
        f.write_bytes(BAD[kind](f.read_bytes()))
    with new_ctx(model) as ctx:
        pc = pk.PrefixCache(ctx, max_sequences=1, cache_ram=0, cache_dir=tmp_path)
        # a sequence holding a prefix of the span: the miss leaves it as it was
        seq = ctx.new_sequence()
        seq.extend(a[:30])
        before = seq.snapshot().data
        assert pc.restore_into(seq, a + [5], 120) == 0
        assert seq.tokens == a[:30] and seq.snapshot().data == before
        st = pc.tier_stats()
        assert st["disk_corrupt"] == 1 and st["disk_hits"] == 0 and st["disk_misses"] == 1
        assert not f.exists(), "a refused file is deleted"
        # and the API path evaluates instead, correctly
        s = pc.acquire(a + [5])
        assert s.reused_tokens == 0
        np.testing.assert_allclose(s.logits(), fresh_logits(model, a + [5]),
                                   atol=DEVICE_F32_ATOL if cache_on_device(model) else ATOL)


def test_files_that_are_not_span_files_are_left_alone(model, tmp_path):
    a = toks(60, seed=7)
    page_to_disk(model, tmp_path, a)
    (f,) = files(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    os.mkfifo(tmp_path / f.name.replace("-0-60-", "-0-61-"))   # a FIFO under a span's name: never opened
    with new_ctx(model) as ctx:
        pc = pk.PrefixCache(ctx, max_sequences=1, cache_ram=0, cache_dir=tmp_path)
        s = pc.acquire(a + [9, 9])
        assert s.reused_tokens == 60
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_the_directory_stays_within_its_bound(model, tmp_path):
    with new_ctx(model) as ctx:
        pc = pk.PrefixCache(ctx, max_sequences=1, cache_ram=0, cache_dir=tmp_path, cache_dir_mib=1)
        for i in range(14):   # ~100 KB each: 1.4 MB through a 1 MiB directory
            pc.release(pc.acquire(toks(190, seed=100 + i)))
            pc.evict()
            assert sum(f.stat().st_size for f in files(tmp_path)) <= 1 << 20
        st = pc.tier_stats()
        assert st["disk_writes"] == 14 and st["disk_evicted_files"] > 0
        assert st["disk_bytes"] == sum(f.stat().st_size for f in files(tmp_path)) <= st["disk_budget_bytes"]
        # the most recent conversation is still there, the oldest is gone
        assert pc.acquire(toks(190, seed=113) + [3]).reused_tokens == 190
        assert pc.acquire(toks(190, seed=100) + [3]).reused_tokens == 0


def test_host_memory_spills_to_disk_and_both_restore_through_the_api(model, tmp_path):
    """pk.PrefixCache without the engine: an evicted prompt is restored from host memory; once host
    memory has let it go (a tiny budget), from disk."""
    with new_ctx(model) as ctx:
        pc = pk.PrefixCache(ctx, max_sequences=1, cache_ram=1, cache_dir=tmp_path)
        a = toks(200, seed=8)
        pc.release(pc.acquire(a))
        pc.evict()
        st = pc.tier_info   # live
        assert st.host_tokens == 200 and st.disk_files == 0
        s = pc.acquire(a + [4])
        assert s.reused_tokens == 200 and st.restored_tokens == 200 and st.disk_restored_tokens == 0
        np.testing.assert_allclose(s.logits(), fresh_logits(model, a + [4]), atol=ATOL)
        s.close()
        # enough other prompts to push a out of the 1 MiB of host memory (~100 KB each)
        for i in range(14):
            pc.release(pc.acquire(toks(200, seed=300 + i)))
            pc.evict()
        assert st.evicted_nodes > 0 and st.disk_writes > 0 and st.host_bytes <= 1 << 20
        assert pc.tier.matched(a) == 0   # not in host memory any more
        s = pc.acquire(a + [4])
        assert s.reused_tokens == 200 and st.disk_restored_tokens == 200
        np.testing.assert_allclose(s.logits(), fresh_logits(model, a + [4]), atol=ATOL)
        assert pc.tier.matched(a) == 200, "a span read from disk is kept in host memory again"


def test_the_engine_cache_takes_a_cache_dir(model, tmp_path):
    with new_ctx(model) as ctx:
        pc = PrefixCache(ctx, 2, 0, cache_dir=tmp_path / "new" / "dir")
        assert pc.tier_stats()["enabled"] and pc.tier_stats()["disk_budget_bytes"] == 1024 << 20
        assert (tmp_path / "new" / "dir").is_dir()
        (tmp_path / "file").write_text("x")
        with pytest.raises(pk.InvalidInputError, match="cache_dir"):
            pk.PrefixCache(ctx, cache_dir=tmp_path / "file")
        for bad in (dict(cache_ram=-1), dict(cache_ram=1.5), dict(cache_dir_mib=0), dict(cache_dir=3)):
            with pytest.raises(pk.InvalidInputError):
                pk.PrefixCache(ctx, **bad)


def test_the_cache_dir_flags_map_onto_the_engine_config(tmp_path):
    from pyllama_kv.cli import options
    from pyllama_kv.cli.common import CLIError

    p = argparse.ArgumentParser()
    options.add(p, "cache_dir", "cache_dir_mib")
    cfg = options.from_args(EngineConfig, p.parse_args([]))
    assert cfg.cache_dir is None and cfg.cache_dir_mib == 1024
    cfg = options.from_args(EngineConfig, p.parse_args(["--cache-dir", str(tmp_path), "--cache-dir-mib", "8"]))
    assert cfg.cache_dir == str(tmp_path) and cfg.cache_dir_mib == 8
    with pytest.raises(CLIError, match="--cache-dir-mib"):
        options.from_args(EngineConfig, p.parse_args(["--cache-dir-mib", "0"]))
    assert EngineConfig(cache_dir=tmp_path).cache_dir == str(tmp_path)


def test_the_engine_pages_out_to_disk_and_a_new_engine_restores_from_it(model, tmp_path):
    """EngineConfig.cache_dir reaches the engine's KV layer: a conversation evicted with no host
    memory goes to disk, and both this engine and a later one (as after a restart) restore it from
    there instead of evaluating it, answering as a fresh evaluation of the same tokens does (F32)."""
    from pyllama_kv.engine import GREEDY, Engine
    from test_engine import greedy_run

    def ask(eng, prompt):
        h = eng.submit(prompt, GREEDY, max_tokens=8)
        eng.run_until_idle()
        return h.result()[0].tokens, h.usage.prompt_tokens - h.usage.reused_tokens

    cfg = EngineConfig(n_ctx=512, parallel=1, prefix_cache=2, cache_ram=0, cache_dir=tmp_path, **F32)
    first = toks(120, seed=1)
    with Engine(model, cfg) as eng:
        answer, _ = ask(eng, first)
        assert answer == greedy_run(model, first, 8, n_ctx=512)
        for i in range(4):   # more than the cache holds: the first conversation is paged out to disk
            ask(eng, toks(150, seed=10 + i))
        assert eng.kv.tier_stats()["disk_writes"] >= 1 and files(tmp_path)
        second = first + answer + toks(10, seed=2)
        want = greedy_run(model, second, 8, n_ctx=512)   # the fresh evaluation
        got, evaluated = ask(eng, second)
        assert evaluated <= 12 and eng.kv.tier_stats()["disk_hits"] >= 1
        assert got == want, "restored from disk in the engine that wrote the files"
    with Engine(model, cfg) as eng:
        got, evaluated = ask(eng, second)
        st = eng.kv.tier_stats()
        assert evaluated <= 12 and st["disk_hits"] >= 1 and st["disk_restored_tokens"] >= 120
        assert got == want, "restored from disk in a new engine"


# -- any prefix of a stored span (issue 30, item 5) ------------------------------------------------


def other_token(t: int) -> int:
    """A token id of the tiny model's vocabulary other than ``t``."""
    return 3 + (t - 3 + 1) % 597


def test_a_prompt_sharing_only_a_prefix_of_a_disk_span_restores_that_prefix(model, tmp_path):
    """A file holds [0, 200); prompts that share only its first k tokens (the same document with
    another question) restore exactly those k from it, byte-exact, with the fresh logits (F32)."""
    a = toks(200, seed=11)
    span = page_span_to_disk(model, tmp_path, a)
    with new_ctx(model) as ctx:
        pc = pk.PrefixCache(ctx, max_sequences=1, cache_ram=0, cache_dir=tmp_path)
        st = pc.tier_info
        hits = restored = 0
        for k in (1, 57, 120, 199):
            prompt = a[:k] + [other_token(a[k])] + toks(5, seed=k)
            s = pc.acquire(prompt, remember=False)
            hits, restored = hits + 1, restored + k
            assert s.reused_tokens == k and pc.last_reused_tokens == k
            assert st.disk_hits == hits and st.disk_restored_tokens == restored and st.restored_tokens == restored
            assert st.evaluated_tokens == sum(len(a[:j]) + 6 for j in (1, 57, 120, 199) if j <= k) - restored
            assert s.snapshot(0, k).data == span.split(k)[0].data       # the cut is byte-exact
            np.testing.assert_allclose(s.logits(), fresh_logits(model, prompt), atol=ATOL)
            s.close()
        # a prompt that ends inside the span: all but its last token restored (one is evaluated)
        s = pc.acquire(a[:80], remember=False)
        assert s.reused_tokens == 79 and st.disk_hits == hits + 1
        np.testing.assert_allclose(s.logits(), fresh_logits(model, a[:80]), atol=ATOL)
        s.close()
        # a prompt that shares nothing: a miss
        misses = st.disk_misses
        s = pc.acquire([other_token(a[0])] + a[1:50], remember=False)
        assert s.reused_tokens == 0 and st.disk_misses == misses + 1 and st.disk_corrupt == 0
        s.close()
    assert len(files(tmp_path)) == 1, "nothing was refused or deleted"


def test_a_span_file_after_its_start_serves_a_prefix_of_its_own(model, tmp_path):
    """Files [0, 150) and [150, 190) (a later turn): a prompt that shares 170 tokens restores
    [0, 150) whole and [150, 170) cut from the second file, and goes on from there."""
    a = toks(150, seed=12)
    page_span_to_disk(model, tmp_path, a)
    b = a + toks(40, seed=13)
    span = page_span_to_disk(model, tmp_path, b)
    assert sorted(tuple(int(x) for x in f.name.split("-")[1:3]) for f in files(tmp_path)) == [(0, 150), (150, 190)]
    with new_ctx(model) as ctx:
        pc = pk.PrefixCache(ctx, max_sequences=1, cache_ram=0, cache_dir=tmp_path)
        prompt = b[:170] + [other_token(b[170])] + [5, 6]
        s = pc.acquire(prompt, remember=False)
        st = pc.tier_info
        assert s.reused_tokens == 170 and st.disk_hits == 2 and st.disk_restored_tokens == 170
        assert s.snapshot(0, 170).data == span.split(170)[0].data
        np.testing.assert_allclose(s.logits(), fresh_logits(model, prompt), atol=ATOL)
        # a sequence that holds [0, 160) already: the second file serves [160, 185) only
        seq = ctx.new_sequence()
        seq.extend(b[:160])
        assert pc.restore_into(seq, b, 185) == 25 and seq.tokens == b[:185]
        assert seq.snapshot(160, 185).data == span.split(160)[1].split(185)[0].data


def test_a_prefix_of_a_stored_span_is_not_written_again(model, tmp_path):
    """Store-once holds for prefixes of files: a prompt that files hold a prefix of writes only the
    part they lack, and one they hold whole writes nothing."""
    a = toks(200, seed=14)
    page_span_to_disk(model, tmp_path, a)
    page_span_to_disk(model, tmp_path, a[:120], writes=0)   # a prefix of the file: nothing written
    b = a[:120] + toks(30, seed=15)
    page_span_to_disk(model, tmp_path, b)   # only [120, 150) is written: the file holds [0, 120)
    assert sorted(tuple(int(x) for x in f.name.split("-")[1:3]) for f in files(tmp_path)) == [(0, 200), (120, 150)]
    with new_ctx(model) as ctx:
        pc = pk.PrefixCache(ctx, max_sequences=1, cache_ram=0, cache_dir=tmp_path)
        s = pc.acquire(b + [9], remember=False)
        assert s.reused_tokens == 150 and pc.tier_info.disk_hits == 2
        np.testing.assert_allclose(s.logits(), fresh_logits(model, b + [9]), atol=ATOL)


def test_the_token_index_finds_what_a_brute_force_finds():
    """spanfile.TokenIndex against every file compared with the prompt, through random adds and
    removes of files that share prefixes (a small vocabulary: many branch points)."""
    from pyllama_kv.core.span import shared_prefix
    from pyllama_kv.prefixcache.spanfile import TokenIndex, _File

    rng = np.random.default_rng(0)
    idx, held = TokenIndex(), {}
    pool = [rng.integers(0, 3, 40).astype(np.int32) for _ in range(6)]
    for step in range(600):
        if held and rng.random() < 0.35:
            name = sorted(held)[rng.integers(len(held))]
            idx.remove(name)
            del held[name]
        else:
            base = pool[rng.integers(len(pool))]
            end = int(rng.integers(1, 41))
            toks_ = base[:end].copy()
            if rng.random() < 0.3:
                toks_[rng.integers(end)] = rng.integers(0, 3)
            start = int(rng.integers(0, end))
            f = _File(f"f{step}", start, end, b"", int(rng.integers(1, 100)))
            idx.add(f, toks_)
            held[f.name] = (f, toks_)
        assert len(idx) == len(held)
        prompt = pool[rng.integers(len(pool))][:int(rng.integers(1, 41))].tolist()
        pos, limit = int(rng.integers(0, len(prompt))), int(rng.integers(1, len(prompt) + 1))
        want = max((min(shared_prefix(t, prompt), limit) for f, t in held.values()
                    if f.start <= pos < min(shared_prefix(t, prompt), limit)), default=0)
        got = idx.candidates(prompt, pos, limit)
        assert (got[0][0] if got else 0) == want
        for k, f in got:
            t = held[f.name][1]
            assert k == want and f.start <= pos and min(shared_prefix(t, prompt), limit) == k
    for name in list(held):
        idx.remove(name)
    assert not idx.root.children and idx.root.min_start > 1 << 40


def test_an_engine_restores_the_system_prompt_of_a_paged_out_conversation(model, tmp_path):
    """An engine pages a conversation (a system prompt, a question, its answer) out to disk; a later
    engine on the same cache_dir gets another question under the same system prompt: the file
    serves the system prompt (and nothing more), counted as a disk hit and reused tokens, and the
    answer is what an engine without the cache gives (F32)."""
    from pyllama_kv.core.span import shared_prefix
    from pyllama_kv.engine import GREEDY, Engine

    def ask(eng, prompt):
        h = eng.submit(prompt, GREEDY, max_tokens=8)
        eng.run_until_idle()
        return h.result()[0].tokens, h.usage.reused_tokens

    system = toks(100, seed=21)
    first = system + toks(30, seed=22)
    cfg = EngineConfig(n_ctx=512, parallel=1, prefix_cache=2, cache_ram=0, cache_dir=tmp_path, **F32)
    with Engine(model, cfg) as eng:
        answer, _ = ask(eng, first)
        for i in range(4):   # more than the cache holds: the conversation is paged out to disk
            ask(eng, toks(150, seed=30 + i))
        assert eng.kv.tier_stats()["disk_writes"] >= 1
    second = system + toks(20, seed=23)
    n = shared_prefix(first + answer, second)
    assert 100 <= n < 110
    with Engine(model, EngineConfig(n_ctx=512, parallel=1, prefix_cache=2, cache_ram=0, **F32)) as eng:
        want, reused = ask(eng, second)
        assert reused == 0
    with Engine(model, cfg) as eng:
        assert eng.kv.match(second) == n, "the KV layer's match counts what the files hold (by the index)"
        got, reused = ask(eng, second)
        st = eng.kv.tier_stats()
        assert reused == n and st["disk_hits"] == 1 and st["disk_restored_tokens"] == n
        assert eng.stats.as_dict()["prefix_tier"]["disk_hits"] == 1 and eng.stats.reused_tokens == n
        assert got == want


def test_metrics_show_the_disk_counters_after_a_disk_hit(tiny_model, model, tmp_path):
    """Through the HTTP server: a completion whose prompt shares the first 90 tokens of a span file
    restores them (cached_tokens), and /metrics says so in pyllama_kv_prefix_disk_*."""
    import httpx

    a = toks(160, seed=41)
    page_to_disk(model, tmp_path, a)
    size = files(tmp_path)[0].stat().st_size
    from test_server import ServerProc

    server = ServerProc(tiny_model, "--type-k", "f32", "--type-v", "f32", "--ctx", "512", "--cache-ram", "0",
                        "--cache-dir", str(tmp_path), "--cache-dir-mib", "8", key=None)
    try:
        m = server.metrics()
        assert m["pyllama_kv_prefix_disk_files"] == 1 and m["pyllama_kv_prefix_disk_bytes"] == size
        assert m["pyllama_kv_prefix_disk_tokens"] == 160 and m["pyllama_kv_prefix_disk_budget_bytes"] == 8 << 20
        assert m["pyllama_kv_prefix_disk_hits_total"] == 0
        prompt = a[:90] + [other_token(a[90])] + toks(4, seed=42)
        r = httpx.post(server.root + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                                              "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == 95 and usage["prompt_tokens_details"]["cached_tokens"] == 90
        m = server.metrics()
        assert m["pyllama_kv_prefix_disk_hits_total"] == 1
        assert m["pyllama_kv_prefix_disk_restored_tokens_total"] == 90
        assert m["pyllama_kv_prefix_restored_tokens_total"] == 90
        assert m["pyllama_kv_prefix_disk_misses_total"] == 0 and m["pyllama_kv_prefix_disk_corrupt_total"] == 0
        for name in ("writes", "written_bytes", "write_errors", "evictions", "not_stored"):
            assert f"pyllama_kv_prefix_disk_{name}_total" in m
    finally:
        server.stop()


def test_chat_stats_show_the_tiers(real_model, tmp_path):
    """`pyllama-kv chat --json`'s /stats has the tiers' counters, the disk's included."""
    import json

    from conftest import run_cli

    r = run_cli(["chat", str(real_model), "--json", "-n", "4", "--temp", "0", "--cache-dir", str(tmp_path / "d"),
                 "--cache-dir-mib", "3"], input="Hi\n/stats\n")
    assert r.returncode == 0, r.stderr
    stats = [json.loads(ln) for ln in r.stdout.splitlines()][-1]["stats"]["prefix_tier"]
    assert stats["enabled"] and stats["disk_budget_bytes"] == 3 << 20
    for key in ("disk_writes", "disk_hits", "disk_misses", "disk_corrupt", "disk_evicted_files", "disk_bytes",
                "disk_files", "restored_tokens"):
        assert key in stats


# -- processes killed, and processes that share a directory ----------------------------------------

_CHILD = r"""
import json, os, signal, sys
import numpy as np
import pyllama_kv as pk
from pyllama_kv.prefixcache import spanfile


model_path, cache_dir, convs_path, kill_at, rounds, mib = sys.argv[1:7]
kill_at, rounds, mib = int(kill_at), int(rounds), int(mib)
convs = json.load(open(convs_path))
writes = 0
_open = open


class Torn:
    # a span file whose write stops half-way: the process is killed there (SIGKILL: nothing runs after)
    def __init__(self, f):
        self.f = f

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, b):
        self.f.write(b[:len(b) // 2])
        self.f.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def killing_open(path, mode="r", *args, **kw):
    global writes
    f = _open(path, mode, *args, **kw)
    if "x" in mode:
        writes += 1
        if writes == kill_at:
            return Torn(f)
    return f


spanfile.open = killing_open
results = []
# one thread: two of these run at once, and two threads each on two cores spin at ggml's barriers
with pk.Model(model_path) as m, m.context(n_ctx=512, n_seq_max=4, type_k="f32", type_v="f32", n_threads=1) as ctx:
    pc = pk.PrefixCache(ctx, max_sequences=1, cache_ram=0, cache_dir=cache_dir, cache_dir_mib=mib)
    for r in range(rounds):
        for i, conv in enumerate(convs):
            prompt = conv + [7]
            s = pc.acquire(prompt)   # restored from files (ours or the other process's) as far as they go
            n, ok = s.reused_tokens, True
            if n:
                with m.context(n_ctx=512, n_seq_max=1, type_k="f32", type_v="f32", n_threads=1) as c:
                    ok = bool(np.allclose(s.logits(), c.new_sequence().extend(prompt), atol=1e-4))
            s.close()
            pc.evict()   # the prompt is paged out: the files get what they lack of it
            results.append([i, n, ok])
            print("step", r, i, flush=True)
    print(json.dumps({"results": results, "stats": pc.tier_stats()}), flush=True)
"""


def _child(model_path, cache_dir, convs, tmp_path, kill_at=0, rounds=1, mib=1024, tag="c"):
    import json
    import subprocess
    import sys

    from conftest import ROOT

    convs_path = tmp_path / f"convs-{tag}.json"
    convs_path.write_text(json.dumps(convs))
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(model_path), str(cache_dir), str(convs_path),
                             str(kill_at), str(rounds), str(mib)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=dict(os.environ, GGML_NO_BACKTRACE="1"))


def _check_restores(model, cache_dir, convs, why: str = "") -> list[int]:
    """A new PrefixCache on ``cache_dir`` asks for every conversation: each is a miss or an exact
    restore (the fresh logits, F32), and no file under a span's name is refused. The restored counts.
    ``why`` goes into the failures' messages (what led here: a seed)."""
    got = []
    with new_ctx(model) as ctx:
        pc = pk.PrefixCache(ctx, max_sequences=1, cache_ram=0, cache_dir=cache_dir)
        for conv in convs:
            prompt = conv + [7]
            s = pc.acquire(prompt, remember=False)
            if s.reused_tokens:
                np.testing.assert_allclose(s.logits(), fresh_logits(model, prompt), atol=ATOL,
                                           err_msg=f"{s.reused_tokens} tokens restored; {why}")
            got.append(s.reused_tokens)
            s.close()
        assert pc.tier_info.disk_corrupt == 0, f"a torn or foreign file under a span's name; {why}"
    return got


SYSTEM_N = 100
#: when the kill from outside comes (steps and a pause drawn from it); $PYLLAMA_KV_KILL_SEED overrides it
KILL_SEED = 4545


def _convs(n: int, seed: int, tail: int = 40) -> list[list[int]]:
    system = toks(SYSTEM_N, seed=51)
    return [system + toks(tail + 10 * i, seed=seed + i) for i in range(n)]


@pytest.mark.parametrize("kill_at", [1, 4, "outside"])
def test_a_process_killed_while_writing_leaves_only_misses_or_exact_restores(tiny_model, model, tmp_path, kill_at):
    """A process paging conversations out is SIGKILLed: half-way through writing its first or fourth
    span file, or from outside at some moment of a loop that writes, reads and evaluates (when: a
    seeded random, $PYLLAMA_KV_KILL_SEED or KILL_SEED, named in every failure's message). A new cache
    on the directory gets, for every conversation, a miss or an exact restore; no torn file."""
    import signal
    import time

    convs = _convs(6, seed=60)
    cache_dir = tmp_path / "cache"
    why = f"killed at {kill_at}"
    if kill_at == "outside":
        seed = int(os.environ.get("PYLLAMA_KV_KILL_SEED", KILL_SEED))
        rng = np.random.default_rng(seed)
        steps, pause = 3 + int(rng.integers(0, 12)), float(rng.random()) * 0.02   # 3..14 steps in, then 0..20 ms
        why = f"killed from outside after {steps} steps and {pause * 1000:.1f} ms (PYLLAMA_KV_KILL_SEED={seed})"
        p = _child(tiny_model, cache_dir, convs, tmp_path, rounds=1000)
        try:
            assert p.stdout is not None
            for _ in range(steps):
                assert p.stdout.readline().startswith("step"), (why, p.stderr.read() if p.stderr else "")
            time.sleep(pause)
            p.send_signal(signal.SIGKILL)
        finally:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=60)
    else:
        p = _child(tiny_model, cache_dir, convs, tmp_path, kill_at=kill_at)
        _, err = p.communicate(timeout=300)
        assert p.returncode == -signal.SIGKILL, err
        # it died half-way through a write: its temporary file is there, under no span's name
        assert [f for f in os.listdir(cache_dir) if ".tmp-" in f], os.listdir(cache_dir)
        assert len(files(cache_dir)) == kill_at - 1
    got = _check_restores(model, cache_dir, convs, why)
    for conv, n in zip(convs, got):
        assert n in (0, SYSTEM_N, len(conv)), (got, why)
    if kill_at == 4:   # three files were written whole: three conversations come back, the rest share the system prompt
        assert got == [len(c) for c in convs[:3]] + [SYSTEM_N] * 3
    if kill_at == 1:
        assert got == [0] * 6


def test_two_processes_on_one_directory_only_miss_or_restore_exactly_within_the_bound(tiny_model, model, tmp_path):
    """Two processes page out and restore conversations in one 1 MiB directory at the same time (a
    system prompt shared by all, some conversations shared by both): every restore either makes is
    exact (F32 logits equal a fresh evaluation), no file is refused, and the directory ends within
    its bound, which both enforced (each deletes the least recently used files, the other's too)."""
    import json

    shared = _convs(3, seed=70, tail=120)
    a = shared + _convs(8, seed=80, tail=140)
    b = _convs(8, seed=90, tail=140) + shared[::-1]
    cache_dir = tmp_path / "cache"
    procs = [_child(tiny_model, cache_dir, c, tmp_path, rounds=2, mib=1, tag=t) for c, t in ((a, "a"), (b, "b"))]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        outs.append(json.loads(out.splitlines()[-1]))
    total = sum(f.stat().st_size for f in files(cache_dir))
    assert 0 < total <= 1 << 20
    restored = 0
    for o in outs:
        st = o["stats"]
        assert st["disk_corrupt"] == 0 and st["disk_write_errors"] == 0
        assert all(ok for _, _, ok in o["results"]), o["results"]
        restored += sum(n for _, n, _ in o["results"])
    assert restored > 0
    assert sum(o["stats"]["disk_evicted_files"] for o in outs) > 0, "the bound was never reached"
    _check_restores(model, cache_dir, a + b)


def test_two_contexts_on_one_directory_share_files_and_hold_the_bound(model, tmp_path):
    """Two caches on two contexts take turns on one 1 MiB directory: each restores what the other
    wrote (exactly), and after every step the directory is within its bound, which both enforce."""
    convs = _convs(12, seed=110, tail=130)
    reused = []
    with new_ctx(model) as c1, new_ctx(model) as c2:
        pcs = [pk.PrefixCache(c, max_sequences=1, cache_ram=0, cache_dir=tmp_path, cache_dir_mib=1) for c in (c1, c2)]
        for i, conv in enumerate(convs + convs[::-1]):
            pc = pcs[i % 2]
            prompt = conv + [7]
            s = pc.acquire(prompt)
            if s.reused_tokens:
                np.testing.assert_allclose(s.logits(), fresh_logits(model, prompt), atol=ATOL)
            reused.append(s.reused_tokens)
            s.close()
            pc.evict()
            assert sum(f.stat().st_size for f in files(tmp_path)) <= 1 << 20
        st = [pc.tier_info for pc in pcs]
        assert all(x.disk_corrupt == 0 and x.disk_write_errors == 0 for x in st)
        assert sum(x.disk_evicted_files for x in st) > 0, "the bound was never reached"
        assert all(x.disk_bytes <= 1 << 20 for x in st)
    # the second cache's first prompt: the system prompt from the first's file; the last conversation
    # (the second cache's) comes back whole to the first cache, right after it
    assert reused[0] == 0 and reused[1] == SYSTEM_N
    assert reused[12] == len(convs[11])
    assert all(n >= SYSTEM_N for n in reused[1:]), reused
