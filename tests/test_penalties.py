"""frequency/presence/repeat penalties and logit_bias: the engine's output is exactly what
llama.cpp's sampler chain (logit bias -> penalties -> greedy), driven directly over a context,
gives; and they change the output."""
from __future__ import annotations

import numpy as np
import pytest

import pyllama_kv as pk
from pyllama_kv._native import sampler as _sampler
from pyllama_kv.config import SamplingParams
from pyllama_kv.engine import GREEDY, Engine, EngineConfig
from pyllama_kv.errors import InvalidInputError

PROMPT = "List the numbers: one, two, one, two, one, two,"


@pytest.fixture(scope="module")
def model(real_model):
    with pk.Model(real_model) as m:
        yield m


def _engine_tokens(model, params: SamplingParams, n: int) -> list[int]:
    with Engine(model, EngineConfig(n_ctx=256, parallel=1, prefix_cache=0, n_threads=2)) as eng:
        h = eng.submit(model.tokenize(PROMPT), params, max_tokens=n)
        eng.run_until_idle()
    return h.result()[0].tokens


def _chain_tokens(model, n: int, bias: dict, last_n: int, repeat: float, freq: float, present: float) -> list[int]:
    """The chain built with the llama_sampler_* calls directly, over a context's own logits."""
    native = _sampler.NativeSampler(model._lib, model.n_vocab)
    if bias:
        native.add_logit_bias(bias)
    native.add_penalties(last_n, repeat, freq, present)
    native.add_greedy()
    out: list[int] = []
    try:
        with model.context(n_ctx=256, n_seq_max=1, n_threads=2) as ctx:
            seq = ctx.new_sequence()
            logits = seq.extend(model.tokenize(PROMPT))
            while len(out) < n:
                tok = native.apply(np.asarray(logits, np.float32), 0)
                native.accept(tok)
                if model.is_eog(tok):
                    break
                out.append(tok)
                logits = seq.extend([tok])
    finally:
        native.free()
    return out


def test_penalties_match_the_sampler_chain_and_change_the_output(model):
    n = 24
    plain = _engine_tokens(model, GREEDY, n)
    p = SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5, repeat_penalty=1.3)
    pen = _engine_tokens(model, p, n)
    assert pen != plain   # the penalties are applied
    assert pen == _chain_tokens(model, n, {}, n, 1.3, 1.5, 0.5)
    # penalty_last_n bounds the window the chain looks back over
    p2 = SamplingParams(temperature=0.0, frequency_penalty=2.0, penalty_last_n=2)
    assert _engine_tokens(model, p2, n) == _chain_tokens(model, n, {}, 2, 1.0, 2.0, 0.0)


def test_logit_bias_matches_the_sampler_chain(model):
    n = 8
    plain = _engine_tokens(model, GREEDY, n)
    banned = plain[0]
    forced = model.tokenize(" seven", add_bos=False)[0]
    p = SamplingParams(temperature=0.0, logit_bias={banned: -100.0, forced: 7.5})
    got = _engine_tokens(model, p, n)
    assert banned not in got and got != plain
    assert got == _chain_tokens(model, n, {banned: -100.0, forced: 7.5}, n, 1.0, 0.0, 0.0)
    # +100 makes a token certain
    assert _engine_tokens(model, SamplingParams(temperature=0.0, logit_bias={forced: 100.0}), 4) == [forced] * 4


def test_sampled_penalties_are_seeded_and_valid(model):
    p = SamplingParams(temperature=0.8, seed=3, frequency_penalty=1.0, logit_bias=((5, -100.0),))
    a = _engine_tokens(model, p, 16)
    assert a == _engine_tokens(model, p, 16) and 5 not in a


def test_bad_values_are_refused(model):
    for kw in ({"frequency_penalty": 2.5}, {"presence_penalty": -3}, {"repeat_penalty": 0},
               {"logit_bias": {1: 101}}, {"logit_bias": [(1,)]}, {"penalty_last_n": -2}):
        with pytest.raises(InvalidInputError):
            SamplingParams(**kw)
    with Engine(model, EngineConfig(n_ctx=128, parallel=1, n_threads=2)) as eng, \
            pytest.raises(InvalidInputError, match="logit_bias"):
        eng.submit([1, 2], SamplingParams(logit_bias={model.n_vocab: 1.0}))
