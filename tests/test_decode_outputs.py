"""Context.decode(outputs={seq: n}): the logits after each of a sequence's last n new tokens, from one
decode (what verifying a draft needs), on both pins, against fresh evaluations on F32 weights and cache."""
from __future__ import annotations

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import F32, toks

F32_ATOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_model, pin_lib):
    with pk.Model(tiny_model, lib=pin_lib) as m:
        yield m


def fresh(model, tokens: list[int]) -> np.ndarray:
    with model.context(n_ctx=256, n_seq_max=1, n_batch=64, n_ubatch=64, **F32) as c:
        return c.new_sequence().extend(tokens)


@pytest.mark.parametrize("n_batch", [64, 4])   # 4: the outputs of one sequence span llama_decode calls
def test_every_asked_position_has_the_logits_of_a_fresh_evaluation(model, n_batch):
    prompt, new, other = toks(9), toks(7, seed=1), toks(5, seed=2)
    with model.context(n_ctx=256, n_seq_max=3, n_batch=n_batch, n_ubatch=n_batch, **F32) as c:
        a, b = c.new_sequence(), c.new_sequence()
        a.extend(prompt)
        out = c.decode({a: new, b: other}, outputs={a: 5})
        assert out[a].shape == (5, model.n_vocab) and out[b].shape == (model.n_vocab,)
        for i in range(5):   # row i: after new token 2 + i
            np.testing.assert_allclose(out[a][i], fresh(model, prompt + new[:3 + i]), atol=F32_ATOL)
        np.testing.assert_allclose(out[b], fresh(model, other), atol=F32_ATOL)
        # the sequence's next-token logits are the last row, and it holds every new token
        np.testing.assert_allclose(a.logits(), out[a][-1], atol=0)
        assert a.tokens == prompt + new and b.tokens == other
        # a rejected tail is one truncation; what is left continues as a fresh evaluation
        a.truncate(len(prompt) + 3)
        np.testing.assert_allclose(a.extend([17]), fresh(model, prompt + new[:3] + [17]), atol=F32_ATOL)


def test_all_new_tokens_and_copy_false(model):
    with model.context(n_ctx=256, n_seq_max=2, n_batch=64, n_ubatch=64, **F32) as c:
        a = c.new_sequence()
        t = toks(6, seed=3)
        out = c.decode({a: t}, outputs={a: 6}, copy=False)
        for i in range(6):
            np.testing.assert_allclose(out[a][i], fresh(model, t[:i + 1]), atol=F32_ATOL)
        out[a][0, 0] += 1.0   # a copy of its own, not llama.cpp's buffer
        np.testing.assert_allclose(a.logits(), fresh(model, t), atol=F32_ATOL)


def test_bad_outputs_change_nothing(model):
    with model.context(n_ctx=256, n_seq_max=3, n_batch=64, n_ubatch=64, **F32) as c:
        a, b, other = c.new_sequence(), c.new_sequence(), c.new_sequence()
        a.extend(toks(4))
        before = c.free_cells()
        for outputs, match in (({a: 0}, "outputs"), ({a: 4}, "outputs"), ({other: 1}, "not in the batch"),
                               ([(a, 1)], "mapping"), ({a: "2"}, "outputs")):
            with pytest.raises(pk.InvalidInputError, match=match):
                c.decode({a: toks(3, seed=5), b: toks(2, seed=6)}, outputs=outputs)
            assert a.tokens == toks(4) and b.tokens == [] and c.free_cells() == before
