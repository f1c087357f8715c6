"""The API, engine, CLI and server on the current llama.cpp (the second pin, its own C API: issue 32
item 2). Tiny F32 models with an F32 cache, so that every oracle is exact up to float rounding:
logits compared with a fresh single-sequence evaluation on the same library.

Without build/current-cpu every test here fails, saying to run `make setup` (which builds it)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import F32, run_cli, run_py, toks
from pyllama_kv.engine import GREEDY, Engine, EngineConfig
from pyllama_kv.errors import InvalidInputError, LibraryError
from test_engine import greedy_run

TOL = 1e-4


@pytest.fixture(scope="module")
def current(current_lib) -> str:
    """build/current-cpu's library: `make setup` builds it, so without it every test here fails (and
    says to run `make setup`), as every other test that needs a build does (conftest._lib)."""
    return current_lib


@pytest.fixture(scope="module")
def model(tiny_model, current):
    with pk.Model(tiny_model, lib=current) as m:
        yield m


@pytest.fixture(scope="module")
def model1(one_layer_model, current):
    """1 layer: a K-shift is exactly a fresh evaluation (the oracle for removal by shifting)."""
    with pk.Model(one_layer_model, lib=current) as m:
        yield m


def fresh(model, tokens) -> np.ndarray:
    """The next-token logits of ``tokens`` evaluated alone, in a context of their own."""
    with model.context(n_ctx=512, n_seq_max=1, **F32) as c:
        return c.new_sequence().extend(tokens)


def test_the_current_library_is_detected_with_its_capabilities(model, current):
    lib = model.native_library
    assert lib.api == "current"
    caps = lib.caps
    assert not (caps.defrag or caps.stats or caps.cell_view)
    # states and spans through its series (patches/current/0001-0003), checkpoints through its own API
    assert caps.state_io and caps.span_restore and caps.span_range_read and caps.recurrent_checkpoints
    assert caps.partial_remove_may_fail and caps.flash_attn_auto and caps.scattered_cells
    info = pk.library_info(current)
    assert info["api"] == "current" and info["caps"]["cell_view"] is False
    # the mission libraries keep theirs
    assert pk.library_info("patched")["api"] == "mission" and pk.library_info("patched")["caps"]["defrag"]


def test_load_tokenize_decode(model):
    ids = model.tokenize("hello world")
    assert ids and all(0 <= t < model.n_vocab for t in ids)
    with model.context(n_ctx=256, n_seq_max=2, **F32) as ctx:
        s = ctx.new_sequence()
        logits = s.extend(toks(20))
        assert logits.shape == (model.n_vocab,) and np.isfinite(logits).all()
        assert ctx.kv_stats().used_cells == 20 and ctx.free_cells() == ctx.n_ctx - 20


def test_batched_decode_equals_single_sequences(model):
    prompts = [toks(17, 1), toks(9, 2), toks(31, 3)]
    with model.context(n_ctx=512, n_seq_max=4, **F32) as ctx:
        seqs = [ctx.new_sequence() for _ in prompts]
        out = ctx.decode(dict(zip(seqs, prompts)))
        for s, p in zip(seqs, prompts):
            assert np.abs(out[s] - fresh(model, p)).max() <= TOL
        nxt = ctx.decode({s: [5 + i] for i, s in enumerate(seqs)})
        for i, (s, p) in enumerate(zip(seqs, prompts)):
            assert np.abs(nxt[s] - fresh(model, p + [5 + i])).max() <= TOL


def test_a_fork_shares_cells_and_continues_exactly(model):
    prompt = toks(40, 4)
    with model.context(n_ctx=512, n_seq_max=4, **F32) as ctx:
        a = ctx.new_sequence()
        a.extend(prompt)
        used = ctx.kv_stats().used_cells
        b = a.fork()
        c = a.fork(25)
        assert ctx.kv_stats().used_cells == used, "a fork shares its parent's cells: nothing is recomputed"
        assert ctx.cell_holders().shape[1] == ctx.n_seq_max
        lb = b.extend([7, 8])
        lc = c.extend(toks(5, 9))
        assert np.abs(lb - fresh(model, prompt + [7, 8])).max() <= TOL
        assert np.abs(lc - fresh(model, prompt[:25] + toks(5, 9))).max() <= TOL
        assert ctx.kv_stats().used_cells == used + 2 + 5


@pytest.mark.parametrize("recompute", [False, True])
def test_remove_and_truncate_then_extend_equal_fresh(model1, recompute):
    model = model1
    t = toks(50, 5)
    with model.context(n_ctx=512, n_seq_max=3, **F32) as ctx:
        a = ctx.new_sequence()
        a.extend(t)
        b = a.fork(30)   # a shares [0, 30): removing inside it re-evaluates (copy-on-write)
        a.remove(10, 20, recompute=recompute)
        assert a.tokens == t[:10] + t[20:]
        assert np.abs(a.logits() - fresh(model, t[:10] + t[20:])).max() <= TOL
        assert np.abs(a.extend([11]) - fresh(model, t[:10] + t[20:] + [11])).max() <= TOL
        a.remove(35, 38, recompute=recompute)   # a private tail: K-shift where the library can
        want = t[:10] + t[20:] + [11]
        want = want[:35] + want[38:]
        assert np.abs(a.extend([12]) - fresh(model, want + [12])).max() <= TOL
        b.truncate(12)
        assert np.abs(b.extend(toks(4, 6)) - fresh(model, t[:12] + toks(4, 6))).max() <= TOL


def test_cell_counts_match_the_mission_library(tiny_model, model):
    """The current library has no cell view: the shadow's used cells and sharing are checked against
    the mission library's view after the same operations."""
    def run(m):
        with m.context(n_ctx=512, n_seq_max=4, **F32) as ctx:
            a = ctx.new_sequence()
            a.extend(toks(60, 7))
            b = a.fork(40)
            b.extend(toks(10, 8))
            a.remove(5, 15)
            b.truncate(30)
            c = b.fork()
            c.extend([3, 4, 5])
            rows = sorted(tuple(sorted(r[r >= 0])) for r in ctx.cell_holders() if (r >= 0).any())
            return ctx.kv_stats().used_cells, rows
    with pk.Model(tiny_model, lib="patched") as mission:
        assert run(model) == run(mission)


def test_a_refused_partial_removal_leaves_the_sequence_unchanged(model):
    """Recurrent or sliding-window memory answers seq_rm with false for a partial range: the call
    raises and the sequence holds exactly what it held (the oracle: its continuation)."""
    class Refusing:
        def __init__(self, L):
            self.L = L

        def __getattr__(self, name):
            return getattr(self.L, name)

        def llama_memory_seq_rm(self, mem, sid, p0, p1):
            if p0 > 0:
                return False
            return self.L.llama_memory_seq_rm(mem, sid, p0, p1)

    t = toks(30, 10)
    with model.context(n_ctx=256, n_seq_max=2, **F32) as ctx:
        a = ctx.new_sequence()
        a.extend(t)
        used = ctx.kv_stats().used_cells
        ctx._L = Refusing(ctx._L)
        for op in (lambda: a.truncate(20), lambda: a.remove(25, 30), lambda: a.remove(5, 10)):
            with pytest.raises(InvalidInputError, match="cannot remove positions"):
                op()
            assert a.tokens == t and ctx.kv_stats().used_cells == used
        assert np.abs(a.extend([9]) - fresh(model, t + [9])).max() <= TOL


def test_what_the_current_library_lacks_is_a_clear_error(model):
    with model.context(n_ctx=256, n_seq_max=2, **F32) as ctx:
        a = ctx.new_sequence()
        a.extend(toks(10))
        for op, what in ((ctx.kv_cells, "the cell view"), (ctx.kv_view, "the cell view")):
            with pytest.raises(LibraryError, match=f"{what}.*which the current llama.cpp library"):
                op()
        assert ctx.can_restore and ctx.can_save_state   # patches/current/0001, 0002
        st = ctx.defrag()   # nothing to do: batches go into non-contiguous cells
        assert st.defrags is None and st.holes == 0 and st.largest_free_block == st.free_cells
        assert a.tokens == toks(10)
    with pytest.raises(InvalidInputError, match="defrag_thold needs automatic defrag"):
        model.context(n_ctx=256, defrag_thold=0.1)
    with pytest.raises(InvalidInputError, match="llama_max_parallel_sequences"):
        model.context(n_ctx=2048, n_seq_max=256)   # one id more is the spare: 257 > 256


MANY_SEQUENCES = """
import sys
import pyllama_kv as pk
with pk.Model(sys.argv[1], lib=sys.argv[2]) as m, m.context(n_ctx=256, n_seq_max=80, n_batch=64, n_ubatch=8) as c:
    seqs = [c.new_sequence() for _ in range(64)]
    out = c.decode({s: [3 + i, 5] for i, s in enumerate(seqs)})
    print(len(out), c.kv_stats().used_cells)
"""


def test_more_sequences_than_n_batch_decode(tiny_model, current):
    """The current llama.cpp sizes its output buffer for n_seq_max rows and asserts that they fit in
    n_outputs_max, which defaults to n_batch: a context of 81 sequence ids and n_batch 64 aborted the
    process at its first decode. The binding sets n_outputs_max (a subprocess: a regression kills it)."""
    r = run_py(["-c", MANY_SEQUENCES, str(tiny_model), current])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["64", "128"]


def test_the_engine_generates_as_a_plain_decode_loop(model):
    prompt = toks(12, 2)
    want = greedy_run(model, prompt, 16, n_ctx=512)
    cfg = EngineConfig(n_ctx=512, parallel=4, prefix_cache=2, cache_ram=8, **F32)
    with Engine(model, cfg) as eng:
        assert eng.stats.prefix_tier.enabled   # the host tier, through patches/current/0001
        h = eng.submit(prompt, GREEDY, max_tokens=16, n=4)
        eng.run_until_idle()
        assert [c.tokens for c in h.result()] == [want] * 4
        assert eng.stats.evaluated_tokens == 12, "the prompt is evaluated once for the 4 continuations"
        again = eng.submit(prompt + want[:3], GREEDY, max_tokens=8)
        eng.run_until_idle()
        assert again.result()[0].tokens == want[3:11]


def test_cli_run_on_the_current_library(tiny_model, current):
    r = run_cli(["run", str(tiny_model), "-p", "hello", "-n", "6", "--temp", "0", "--json", "--lib", "current",
                 "-t", "2"])
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out, out


def test_server_smoke_on_the_current_library(tiny_model, current):
    from test_server import ServerProc

    s = ServerProc(tiny_model, "--lib", "current", "--ctx", "512", "--parallel", "2", "--max-tokens-cap", "16")
    try:
        import httpx

        body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0}
        r = httpx.post(s.url + "/completions", json=body, headers=s.headers(), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        m = s.idle_metrics()
        assert m["pyllama_kv_kv_cells"] >= 512
    finally:
        assert s.stop() == 0, s.log()[-3000:]


def test_penalties_and_logit_bias_sample_on_the_current_library(model):
    """llama_sampler_init_penalties takes n_vocab first on the current llama.h: a penalised, biased,
    seeded request generates, and a bias of +100 on one token makes it the greedy answer."""
    from pyllama_kv.engine import SamplingParams

    prompt = toks(8, 11)
    cfg = EngineConfig(n_ctx=256, parallel=2, prefix_cache=0, **F32)
    p = SamplingParams(temperature=0.7, seed=3, frequency_penalty=0.5, presence_penalty=0.3, repeat_penalty=1.1,
                       logit_bias=((42, 2.0),))
    forced = SamplingParams(temperature=0.0, logit_bias=((42, 100.0),), frequency_penalty=0.1)
    with Engine(model, cfg) as eng:
        a = eng.submit(prompt, p, max_tokens=12)
        b = eng.submit(prompt, p, max_tokens=12)
        f = eng.submit(prompt, forced, max_tokens=1)
        eng.run_until_idle()
        assert len(a.result()[0].tokens) == 12 and a.result()[0].tokens == b.result()[0].tokens
        assert f.result()[0].tokens == [42]
