"""engine/admission.py as a function: submit's checks and normalisation without a model or a loop."""
from __future__ import annotations

import pytest

from pyllama_kv.config import GREEDY, EngineConfig, SamplingParams
from pyllama_kv.engine.admission import Limits, admit, drop_range
from pyllama_kv.engine.request import RequestHandle
from pyllama_kv.errors import InvalidInputError
from pyllama_kv.sampling.grammar import Grammar, GrammarError

LIMITS = Limits(config=EngineConfig(n_ctx=64, parallel=2, max_tokens=100), n_ctx=64, parallel=2, n_vocab=50)


def test_defaults_come_from_the_config():
    cfg = LIMITS.config
    sub = admit(LIMITS, [1, 2, 3], max_tokens=10, stop=["", "x"])
    assert sub.prompt == [1, 2, 3] and sub.params == SamplingParams() and sub.max_tokens == 10
    assert sub.stop == ("x",) and sub.n == 1 and sub.truncated == 0
    assert (sub.keep, sub.context_shift) == (cfg.keep_finished, cfg.context_shift)
    req = sub.request(RequestHandle(7, 1, 3, None))
    assert req.prompt == [1, 2, 3] and req.handle.id == 7 and req.stop == ("x",)


@pytest.mark.parametrize("kwargs, words", [
    ({"prompt": []}, "the prompt is empty"),
    ({"params": "greedy"}, "params must be a SamplingParams"),
    ({"max_tokens": 0}, "max_tokens must be an integer in [1, 100]"),
    ({"max_tokens": True}, "max_tokens must be an integer"),
    ({"context_shift": 1}, "context_shift must be a bool or None"),
    ({"truncate": "yes"}, "truncate must be a bool or None"),
    ({"n": 3}, "n must be an integer in [1, 2] (the engine's parallel)"),
    ({"stop": [1]}, "stop must be a string or a list of at most"),
    ({"boundaries": [1.5]}, "boundaries must be token indices"),
    ({"logprobs": 21}, "logprobs=21 is out of range"),
    ({"prompt": list(range(64))}, "truncate=True"),
])
def test_refusals_name_the_argument(kwargs, words):
    args = {"prompt": [1, 2, 3], "max_tokens": 10, **kwargs}
    with pytest.raises(InvalidInputError) as e:
        admit(LIMITS, args.pop("prompt"), **args)
    assert words in str(e.value)


def test_sampling_needs_llama_samplers_and_bias_in_the_vocabulary():
    no_ctx = Limits(config=LIMITS.config, n_ctx=64, parallel=2, n_vocab=50, can_sample=False)
    assert admit(no_ctx, [1], GREEDY, max_tokens=10).params is GREEDY
    with pytest.raises(InvalidInputError, match="sampling other than greedy"):
        admit(no_ctx, [1], SamplingParams(temperature=0.7), max_tokens=10)
    with pytest.raises(InvalidInputError, match="logit_bias token 50 is out of range"):
        admit(LIMITS, [1], SamplingParams(logit_bias={50: 1.0}), max_tokens=10)


def test_a_long_prompt_is_cut_at_a_turn_when_allowed():
    toks = list(range(100))
    sub = admit(LIMITS, toks, max_tokens=8, truncate=True, n_keep=4, boundaries=[10, 50, 60, 200])
    assert sub.truncated == len(toks) - len(sub.prompt) > 0
    assert sub.prompt[:4] == [0, 1, 2, 3] and sub.prompt[4] == 50   # the first turn start in reach
    assert len(sub.prompt) <= 64 - 8 and sub.boundaries == [4, 14]


def test_grammars_are_checked_against_the_model_and_vocabulary():
    with pytest.raises(GrammarError, match="needs the engine's model"):
        admit(LIMITS, [1], max_tokens=10, grammar=Grammar.regex("a+"))
    with pytest.raises(GrammarError, match="must be a Grammar or a CompiledGrammar"):
        admit(LIMITS, [1], max_tokens=10, grammar="a+")


def test_drop_range():
    assert drop_range([2, 5, 9, 12], 4, 9) == [2, 4, 7]
