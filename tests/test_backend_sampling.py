"""The current pin's backend sampling (issue 49, item 2; docs/gpu.md): a sequence's sampler chain
run in the graph, its token read back instead of its logits. On the CPU backend too, so its
exactness is tested here: at the binding, in ``Context.decode(greedy=...)`` (both pins: the mission
pin's answer is numpy's argmax of the logits), and in the engine (``backend_sampling``), whose output
must not change. Tiny F32 model with an F32 cache: greedy in the graph is numpy's argmax of the same
logits."""
from __future__ import annotations

import numpy as np
import pytest
from test_pipeline import run
from test_speculation import same

import pyllama_kv as pk
from conftest import F32, toks
from pyllama_kv._native.sampler import NativeSampler
from pyllama_kv.engine import Engine, EngineConfig


@pytest.fixture(scope="module")
def model(tiny_model, current_lib):
    with pk.Model(tiny_model, lib=current_lib) as m:
        yield m


def test_the_caps_say_which_library_samples_in_the_graph(model, patched_lib, tiny_model):
    assert model.native_library.caps.backend_sampling is True
    with pk.Model(tiny_model, lib=patched_lib) as m:
        assert m.native_library.caps.backend_sampling is False


def test_a_greedy_chain_in_the_graph_picks_the_argmax_of_a_sequence_without_one(model):
    prompt = toks(12)
    with model.context(n_ctx=256, n_seq_max=2, **F32) as ctx:
        a = ctx.new_sequence()
        logits = a.extend(prompt)
        want = []
        for _ in range(16):
            t = int(np.argmax(logits))
            want.append(t)
            logits = a.extend([t])
        b = ctx.new_sequence()
        t = ctx.decode({b: prompt}, greedy=[b])[b]
        assert ctx._native.sampled_ids() == {b.id}   # (in the graph, not numpy's)
        got = [t]
        for _ in range(15):
            got.append(ctx.decode({b: [got[-1]]}, greedy=[b])[b])
        assert got == want
        # not greedy: the chain comes off and the next decode copies b's logits again (b and a hold
        # the same tokens)
        np.testing.assert_allclose(ctx.decode({b: [want[-1]]})[b], logits, rtol=0, atol=1e-4)
        assert ctx._native.sampled_ids() == frozenset()


def test_a_chain_goes_into_a_graph_once(model):
    """llama.cpp aborts the process when a chain is initialised for a graph twice (to any sequence):
    the binding refuses before the C call, and the chain stays the context's to free."""
    with model.context(n_ctx=256, n_seq_max=3, **F32) as ctx:
        nat = ctx._native
        chain = NativeSampler(model.native_library, model.n_vocab)
        chain.add_greedy()
        assert nat.set_sampler(0, chain)
        for sid in (0, 1):
            with pytest.raises(pk.InvalidInputError, match="once"):
                nat.set_sampler(sid, chain)
        chain.free()   # a no-op: attached, the context frees it
        assert chain.ptr is not None and nat.sampled_ids() == {0}
        a = ctx.new_sequence()
        assert a.id == 0
        logits = a.extend(toks(8))   # (not greedy: the chain comes off, the logits are real)
        assert nat.sampled_ids() == frozenset() and chain.ptr is None
        assert np.isfinite(logits).all() and logits.std() > 0


@pytest.fixture(params=["patched", "current"])
def any_pin_model(request, tiny_model, current_lib):
    # the mission pin's library asked only for its half: a device run of the current pin has none, and
    # its current half still runs
    lib = current_lib if request.param == "current" else request.getfixturevalue("patched_lib")
    with pk.Model(tiny_model, lib=lib) as m:
        yield m


def test_decode_greedy_gives_the_argmax_tokens_on_both_pins(any_pin_model):
    """``greedy`` sequences get their argmax token (ints; a list with ``outputs``), the others their
    logits, in one decode; a sequence keeps its kind or changes it between decodes freely."""
    m = any_pin_model
    with m.context(n_ctx=512, n_seq_max=4, **F32) as ctx:
        a, b, c = ctx.new_sequence(), ctx.new_sequence(), ctx.new_sequence()
        p = toks(20, seed=3)
        out = ctx.decode({a: p, b: p, c: p}, greedy=[b, c])
        assert type(out[b]) is int and out[b] == out[c] == int(np.argmax(out[a]))
        nxt = out[b]
        for i in range(12):
            greedy = [b] if i % 3 else [b, c]   # c changes kind every few steps
            out = ctx.decode({a: [nxt], b: [nxt], c: [nxt]}, greedy=greedy, copy=False)
            want = int(np.argmax(out[a]))
            got_c = out[c] if c in greedy else int(np.argmax(out[c]))
            assert out[b] == want == got_c
            nxt = want
        drafted = [nxt, 7, 8, 9]
        out = ctx.decode({a: drafted, b: drafted}, greedy=[b], outputs={a: 4, b: 4})
        assert out[b] == [int(np.argmax(r)) for r in out[a]]
        # b's logits were never read: asked for, they are evaluated again (and exact)
        np.testing.assert_allclose(b.logits(), a.logits(), rtol=0, atol=1e-4)


def test_decode_greedy_is_checked_before_anything_changes(any_pin_model):
    with any_pin_model.context(n_ctx=256, n_seq_max=3, **F32) as ctx:
        a, b = ctx.new_sequence(), ctx.new_sequence()
        a.extend(toks(5))
        for bad in ([b], 5, [object()]):
            with pytest.raises(pk.InvalidInputError, match="greedy"):
                ctx.decode({a: [3]}, greedy=bad)
        assert len(a) == 5 and len(b) == 0


def test_the_engine_s_output_is_the_same_with_backend_sampling(model):
    """Greedy, n=2, seeded, penalised, logprobs and stop-string requests in one engine (test_pipeline's
    load), with sampling in the graph off and on."""
    off, on = run(model, backend=False), run(model, backend=True)
    assert on.got == off.got and on.contexts == off.contexts
    assert off.in_graph == frozenset() and on.in_graph   # (the argmax requests' sequences had greedy chains)


def test_drafts_of_an_argmax_request_are_verified_from_the_graph_s_tokens(model):
    off = run(model, backend=False)
    on = run(model, spec="ngram", backend=True, oracle=off.contexts)
    # (the logprobs request's rows come from other batch shapes with drafts: within 1e-4)
    assert same(on.got, off.got) and on.in_graph
    st = on.engine.stats.spec
    assert st.accepted > 0 and st.drafted > st.accepted


def test_backend_sampling_on_needs_a_library_that_can(tiny_model, patched_lib, model):
    with pk.Model(tiny_model, lib=patched_lib) as m:
        with pytest.raises(pk.InvalidInputError, match="backend_sampling"):
            Engine(m, EngineConfig(n_ctx=256, parallel=2, backend_sampling=True))
        with Engine(m, EngineConfig(n_ctx=256, parallel=2, backend_sampling=None)) as e:   # auto: off here
            assert e._in_graph is False
    with Engine(model, EngineConfig(n_ctx=256, parallel=2, backend_sampling=None)) as e:   # CPU layers: off
        assert e._in_graph is False
    with pytest.raises(pk.InvalidInputError, match="backend_sampling"):
        EngineConfig(backend_sampling="yes")
    # the caller's own sampler draws every token: never in the graph
    with pytest.raises(pk.InvalidInputError, match="sampler_factory"):
        Engine(model, EngineConfig(n_ctx=256, parallel=2, backend_sampling=True),
               sampler_factory=lambda req, i: ((lambda logits: 6), None))


_RESERVE_CHILD = r"""
import resource, sys
import numpy as np
import pyllama_kv as pk

with pk.Model(sys.argv[1], lib=sys.argv[2]) as m:
    with m.context(n_ctx=1024, n_seq_max=4, n_batch=512, n_ubatch=512, type_k="f32", type_v="f32") as c:
        a, b = c.new_sequence(), c.new_sequence()
        c.decode({a: list(range(10, 18)), b: list(range(10, 18))})
        c.decode({a: [5], b: [5]})
        vm = [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmSize")][0] * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (60 << 20), resource.RLIM_INFINITY))
        c.decode({a: [6], b: [6]})   # a plain decode fits
        try:
            c.decode({a: [7], b: [7]}, greedy=[a])
            print("no error")
        except pk.DecodeError as e:
            print("DecodeError:", e)
        print("held", len(a), len(b))
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        logits = c.decode({a: [7], b: [7]})
        out = c.decode({a: [8], b: [8]}, greedy=[a])   # (a and b hold the same tokens)
        print("after", int(np.argmax(logits[a])) == int(np.argmax(logits[b])), out[a] == int(np.argmax(out[b])))
"""


def test_a_graph_reservation_that_cannot_allocate_fails_the_decode_only(real_model, current_lib):
    """A greedy chain makes the next decode reserve larger graphs (a padded copy of the logits). When
    that allocation fails, the decode fails (patches/current/0005: llama.cpp threw out of llama_decode,
    std::terminate), nothing changed, and the context decodes again once there is memory. In a
    subprocess: it limits its own address space just above what a plain decode needs."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _RESERVE_CHILD, str(real_model), current_lib],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "DecodeError: llama_decode failed with code -2" in r.stdout, r.stdout
    assert "held 10 10" in r.stdout and "after True True" in r.stdout, r.stdout


def test_greedy_from_the_logits_keeps_them_and_a_backend_that_chooses_none_falls_back(any_pin_model):
    """Where the logits were read (a library without sampling in the graph), the sequence keeps them;
    where the graph chose no token (a backend without its argmax: llama.cpp accepts the chain all the
    same), the decode fails with nothing changed and the context takes numpy's argmax from then on."""
    m = any_pin_model
    with m.context(n_ctx=256, n_seq_max=3, **F32) as ctx:
        a, b = ctx.new_sequence(), ctx.new_sequence()
        p = toks(9, seed=4)
        out = ctx.decode({a: p, b: p}, greedy=[a])
        if not m.native_library.caps.backend_sampling:
            assert out[a] == int(np.argmax(out[b]))
            assert ctx._table[a.id].logits is not None   # kept: logits() evaluates nothing again
            np.testing.assert_allclose(a.logits(), out[b], rtol=0, atol=1e-4)
            return
        nat = ctx._native
        real = nat.sampled_token
        nat.sampled_token = lambda i: -1
        with pytest.raises(pk.DecodeError, match="chose no token"):
            ctx.decode({a: [7], b: [7]}, greedy=[a])
        assert len(a) == len(b) == 9
        nat.sampled_token = real
        out = ctx.decode({a: [7], b: [7]}, greedy=[a])
        assert out[a] == int(np.argmax(out[b])) and nat.sampled_ids() == frozenset()
