"""The current pin's backend sampling at the binding (issue 49, item 2; docs/gpu.md): a sequence's
sampler chain run in the graph, its token read back instead of its logits. On the CPU backend too,
so its exactness is tested here; the engine does not use it yet. Tiny F32 model with an F32 cache:
greedy in the graph is numpy's argmax of the same logits."""
from __future__ import annotations

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import F32, toks
from pyllama_kv._native.sampler import NativeSampler


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
        chain = NativeSampler(model.native_library, model.n_vocab)
        chain.add_greedy()
        nat = ctx._native
        b = ctx.new_sequence()
        assert nat.set_sampler(b.id, chain)
        got = []
        b.extend(prompt)
        for _ in range(16):
            t = nat.sampled_token(-1)
            got.append(t)
            b.extend([t])
        assert got == want
        # removed: the next decode copies b's logits again (b and a hold the same tokens)
        assert nat.set_sampler(b.id, None)
        x = int(np.argmax(logits))
        np.testing.assert_allclose(b.extend([x]), a.extend([x]), rtol=0, atol=1e-4)
