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
from conftest import F32, toks
from pyllama_kv import spanfile
from pyllama_kv.engine import EngineConfig
from pyllama_kv.engine.tier import PagingPrefixCache
from pyllama_kv.tools.gguf import make_tiny_model

ATOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_model):
    with pk.Model(tiny_model) as m:
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
    with new_ctx(model) as ctx:
        pc = pk.PrefixCache(ctx, max_sequences=1, cache_ram=0, cache_dir=cache_dir)
        s = pc.acquire(tokens)
        want = s.snapshot().data
        pc.release(s)
        assert pc.evict() and len(pc) == 0
        st = pc.tier_stats()
        assert st["disk_writes"] == 1 and st["host_bytes"] == 0 and st["disk_tokens"] >= len(tokens)
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


BAD = {"flipped byte": _flip, "truncated": lambda raw: raw[:-100], "garbage": lambda raw: os.urandom(len(raw)),
       "wrong version": _version, "empty": lambda raw: b"", "padded": lambda raw: raw + b"\0"}


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
        np.testing.assert_allclose(s.logits(), fresh_logits(model, a + [5]), atol=ATOL)


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
        pc = PagingPrefixCache(ctx, 2, 0, cache_dir=tmp_path / "new" / "dir")
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
    memory goes to disk, and a later engine (as after a restart) restores it from there instead of
    evaluating it, answering exactly as the first did (F32)."""
    from pyllama_kv.engine import GREEDY, Engine

    def ask(eng, prompt):
        h = eng.submit(prompt, GREEDY, max_tokens=8)
        eng.run_until_idle()
        return h.result()[0].tokens, h.usage.prompt_tokens - h.usage.reused_tokens

    cfg = EngineConfig(n_ctx=512, parallel=1, prefix_cache=2, cache_ram=0, cache_dir=tmp_path, **F32)
    first = toks(120, seed=1)
    with Engine(model, cfg) as eng:
        answer, _ = ask(eng, first)
        for i in range(4):   # more than the cache holds: the first conversation is paged out to disk
            ask(eng, toks(150, seed=10 + i))
        assert eng.kv.tier_stats()["disk_writes"] >= 1 and files(tmp_path)
        second = first + answer + toks(10, seed=2)
        want, evaluated = ask(eng, second)
        assert evaluated <= 12 and eng.kv.tier_stats()["disk_hits"] >= 1
    with Engine(model, cfg) as eng:
        got, evaluated = ask(eng, second)
        st = eng.kv.tier_stats()
        assert evaluated <= 12 and st["disk_hits"] >= 1 and st["disk_restored_tokens"] >= 120
        assert got == want
