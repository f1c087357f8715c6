"""Constrained decoding (pyllama_kv.sampling.grammar, llguidance) in the engine: a held set of JSON schemas
validates 100% on the real model (forks included), a grammar survives preemption, a grammar that
never completes ends by length, uncompilable schemas are errors naming the problem, and logprobs
are the log-softmax of the logits the engine sampled from."""
from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

import pyllama_kv as pk
from pyllama_kv.chat import templates as chat
from pyllama_kv.engine import GREEDY, Engine, EngineConfig, SamplingParams
from pyllama_kv.sampling import grammar as constrain
from pyllama_kv.sampling.grammar import Grammar, GrammarError
from test_engine import FakeKV

# the held set: nested objects, arrays, enums, required fields, string formats, numbers with bounds
SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["user"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["name", "address"], "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                        "properties": {"city": {"type": "string", "maxLength": 24},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}},
    "array": {"type": "object", "additionalProperties": False, "required": ["tags"], "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 4}}},
    "enum": {"type": "object", "additionalProperties": False, "required": ["colour", "size"], "properties": {
        "colour": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]},
        "note": {"type": "string", "maxLength": 16}}},
    "formats": {"type": "object", "additionalProperties": False, "required": ["date", "email", "id"], "properties": {
        "date": {"type": "string", "format": "date"}, "email": {"type": "string", "format": "email", "maxLength": 32},
        "id": {"type": "string", "format": "uuid"}}},
    "bounds": {"type": "object", "additionalProperties": False, "required": ["age", "count", "score"], "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "count": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5}}},
}


def _validate(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


@pytest.fixture(scope="module")
def model(real_model):
    with pk.Model(real_model) as m:
        yield m


@pytest.fixture(scope="module")
def engine(model):
    with Engine(model, EngineConfig(n_ctx=2048, parallel=4, n_threads=2)) as eng:
        yield eng


def _prompt(model, text: str) -> list[int]:
    return chat.tokenize_rendered(model, model.apply_chat_template([{"role": "user", "content": text}]))


def test_every_schema_of_the_held_set_validates(model, engine):
    """5 schemas x 3 forks at temperature 1: every completion parses and validates (formats too)."""
    handles = {}
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        p = _prompt(model, f"Give me an example of {name} data as JSON.")
        handles[name] = engine.submit(p, SamplingParams(temperature=1.0, seed=100 + i), max_tokens=200, n=3,
                                      grammar=Grammar.json_schema(schema))
    engine.run_until_idle()
    for name, h in handles.items():
        comps = h.result()
        texts = [c.text for c in comps]
        for c in comps:
            assert c.finish_reason in ("stop", "eos"), (name, c.finish_reason, c.text)
            _validate(c.text, SCHEMAS[name])
        assert len(set(texts)) > 1, (name, texts)   # each fork drew (and matched) its own tokens


def test_json_object_and_unconstrained_differ(model, engine):
    p = _prompt(model, "Say hello.")
    free = engine.submit(p, GREEDY, max_tokens=24)
    obj = engine.submit(p, GREEDY, max_tokens=120, grammar=Grammar.json_object())
    engine.run_until_idle()
    assert not free.result()[0].text.lstrip().startswith("{")
    c = obj.result()[0]
    assert c.finish_reason in ("stop", "eos") and isinstance(json.loads(c.text), dict)


def test_gbnf_lark_and_regex(model, engine):
    p = _prompt(model, "Is the sky blue? Answer yes or no.")
    hs = [engine.submit(p, SamplingParams(temperature=1.0, seed=s), max_tokens=40, grammar=g)
          for s, g in enumerate([Grammar.gbnf('root ::= "maybe" | "perhaps"'),
                                 Grammar.lark('start: "A" /[0-9]{3}/ "Z"'),
                                 Grammar.regex(r"x[a-c]{2,4}y")])]
    engine.run_until_idle()
    texts = [h.result()[0].text for h in hs]
    assert texts[0] in ("maybe", "perhaps")


    assert re.fullmatch(r"A[0-9]{3}Z", texts[1]) and re.fullmatch(r"x[a-c]{2,4}y", texts[2]), texts
    assert all(h.result()[0].finish_reason == "stop" for h in hs)


def test_a_grammar_that_never_completes_ends_by_length(model, engine):
    h = engine.submit(_prompt(model, "Count."), SamplingParams(temperature=1.0, seed=3), max_tokens=12,
                      grammar=Grammar.lark('start: item+ "END_NEVER_COMES" item\nitem: /[a-z]+ /'),
                      stop=["END"])
    engine.run_until_idle()
    c = h.result()[0]
    # the grammar cannot end before its literal; a stop string inside it or max_tokens ends it
    assert c.finish_reason in ("length", "stop") and len(c.tokens) <= 12
    h = engine.submit(_prompt(model, "Count."), SamplingParams(temperature=1.0, seed=3), max_tokens=12,
                      grammar=Grammar.regex("(ab)+c(ab)+c(ab)+c(ab)+c(ab)+c(ab)+c(ab)+c"))
    engine.run_until_idle()
    c = h.result()[0]
    assert c.finish_reason == "length" and len(c.tokens) == 12


@pytest.mark.parametrize("schema,needle", [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
    ({"type": "strin"}, "strin"),
])
def test_a_schema_that_cannot_compile_is_an_error_naming_it(model, engine, schema, needle):
    with pytest.raises(GrammarError, match=needle):
        engine.submit(_prompt(model, "x"), GREEDY, grammar=Grammar.json_schema(schema))
    with pytest.raises(GrammarError, match="foo"):
        constrain.compile_grammar(model, Grammar.lark("start: foo"))


def test_tokenizer_is_built_once_per_model(model):
    a = constrain.tokenizer_for(model)
    assert constrain.tokenizer_for(model) is a and a.vocab_size == model.n_vocab
    info = constrain.vocab_info(model)
    assert info.eos_ids[0] == model.eos and all(model.is_eog(t) for t in info.eos_ids)
    assert info.tokens[model.eos].startswith(b"\xff<")   # special tokens are marked for llguidance


# -- a fake vocabulary: preemption, forks ------------------------------------------------------------


class FakeModel:
    n_vocab = 8
    PIECES = [b"a", b"b", b"c", b"d", b"e", b"f", b"g", b""]

    def check_tokens(self, t):
        return np.asarray(list(t), dtype=np.int32)

    def token_to_piece(self, t):
        return self.PIECES[t]

    def is_eog(self, t):
        return t == 7


def _fake_grammar(grammar: Grammar) -> constrain.CompiledGrammar:
    info = constrain.VocabInfo(tokens=[*FakeModel.PIECES[:7], b"\xff<eos>"], eos_ids=[7], special_ids=[7], bos=None)
    tok = constrain.build_tokenizer(info, lambda text: [b"abcdefg".index(c) for c in text if c in b"abcdefg"])
    return constrain.CompiledGrammar(grammar, tok, FakeModel.n_vocab)


def test_the_grammar_state_survives_preemption():
    """The cache always prefers "b"; the grammar forces "abab...". Two requests outgrow a cache of
    60 cells, one is preempted and resumed: its matcher is rebuilt from its tokens and the text is
    still exactly what the grammar allows."""
    g = _fake_grammar(Grammar.regex("(ab){12}"))
    kv = FakeKV(60, 2, 8, [1] * 200)
    eng = Engine(FakeModel(), EngineConfig(n_ctx=60, parallel=2, prefix_cache=0, output_reserve=8), kv=kv)
    hs = [eng.submit([1] * 10, GREEDY, max_tokens=30, grammar=g) for _ in range(2)]
    eng.run_until_idle(max_steps=500)
    assert eng.stats.preempted >= 1
    for h in hs:
        c = h.result()[0]
        assert c.text == "ab" * 12 and c.finish_reason == "stop"
    assert kv.seqs == {}


def test_forks_each_own_their_matcher():
    """n=3 with a seeded sampler over the fake vocabulary: each fork follows its own path through
    (a|b|c)(d|e)... and all end where the grammar completes."""
    g = _fake_grammar(Grammar.regex("[abc][de][fg][abc][de]"))
    kv = FakeKV(200, 4, 8, [7] * 200)   # the cache wants to end at once; the grammar does not let it

    def sampler(req, i):
        rng = np.random.default_rng(i)

        def draw(logits):
            ok = np.flatnonzero(np.isfinite(logits))
            return int(rng.choice(ok))
        return draw, None

    eng = Engine(FakeModel(), EngineConfig(n_ctx=200, parallel=4, prefix_cache=0), kv=kv, sampler_factory=sampler)
    h = eng.submit([1, 2], GREEDY, max_tokens=20, n=3, grammar=g)
    eng.run_until_idle(max_steps=100)


    texts = [c.text for c in h.result()]
    assert all(re.fullmatch("[abc][de][fg][abc][de]", t) for t in texts), texts
    assert len(set(texts)) > 1, texts


# -- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_the_log_softmax_of_the_engines_logits(model):
    seen: list[np.ndarray] = []

    def sampler(req, i):
        from pyllama_kv.sampling.sampler import Sampler

        smp = Sampler(eng.kv.ctx, temp=0.9, seed=7 + i)

        def draw(logits):
            seen.append(np.array(logits, dtype=np.float64))
            return smp.sample_logits(logits)
        return draw, smp.close

    with Engine(model, EngineConfig(n_ctx=512, parallel=2, n_threads=2), sampler_factory=sampler) as eng:
        h = eng.submit(_prompt(model, "Name three fruits."), SamplingParams(temperature=0.9), max_tokens=12,
                       logprobs=5)
        eng.run_until_idle()
    c = h.result()[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.tokens) == 12
    for (tok, lp, top), logits, t in zip(c.logprobs, seen, c.tokens):
        direct = logits - (logits.max() + np.log(np.exp(logits - logits.max()).sum()))
        assert tok == t and abs(lp - direct[tok]) < 1e-4
        order = np.argsort(-direct)[:5]
        assert [a for a, _ in top] == order.tolist()
        assert np.allclose([b for _, b in top], direct[order], atol=1e-4)


def test_logprobs_match_a_fresh_evaluation(model):
    """Greedy answer with logprobs, then the same tokens through a context directly: each reported
    logprob is the log-softmax of that context's logits (the raw distribution)."""
    with Engine(model, EngineConfig(n_ctx=512, parallel=1, prefix_cache=0, n_threads=2)) as eng:
        p = _prompt(model, "What is 2+2?")
        h = eng.submit(p, GREEDY, max_tokens=8, logprobs=2)
        eng.run_until_idle()
    c = h.result()[0]
    with model.context(n_ctx=512, n_seq_max=1, n_threads=2) as ctx:
        seq = ctx.new_sequence()
        logits = seq.extend(p)
        for tok, lp, top in c.logprobs:
            x = np.asarray(logits, np.float64)
            direct = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
            assert abs(lp - direct[tok]) < 1e-3 and top[0][0] == tok   # greedy: the top one
            logits = seq.extend([tok])


def test_masked_draws_are_those_of_the_chain_over_every_candidate(model):
    """NativeSampler.apply leaves -inf (masked) candidates out (argpartition over tens of thousands of
    tied -inf is ten times slower): the seeded draws equal the chain's over all n_vocab candidates."""
    from pyllama_kv._native import sampler as native_sampler

    def chain(top_k):
        s = native_sampler.NativeSampler(model._lib, model.n_vocab)
        if top_k:
            s.add_top_k(top_k)
        s.add_top_p(0.9, 1)
        s.add_temp(0.9)
        s.add_dist(11)
        return s

    def apply_all(s, logits):   # every candidate, -inf included, as llama.cpp gets them
        c = s._cand_np
        c["id"], c["logit"], c["p"] = s._ids, logits, 0.0
        a = s._arr
        a.data, a.size, a.selected, a.sorted = s._cand, model.n_vocab, -1, False
        s.L.llama_sampler_apply(s.ptr, a)
        return int(a.data[a.selected].id)

    rng = np.random.default_rng(2)
    for top_k in (0, 3, 40, 5000):
        fast, full = chain(top_k), chain(top_k)
        try:
            for _ in range(60):
                logits = (rng.standard_normal(model.n_vocab) * 3).astype(np.float32)
                logits[rng.random(model.n_vocab) < 0.999] = -np.inf
                got, want = fast.apply(logits, top_k), apply_all(full, logits)
                assert got == want and np.isfinite(logits[got])
                fast.accept(got)
                full.accept(want)
        finally:
            fast.free()
            full.free()


def test_run_json_schema_and_grammar_files(real_model, tmp_path):
    from conftest import run_cli

    schema = {"type": "object", "additionalProperties": False, "required": ["answer"],
              "properties": {"answer": {"enum": ["yes", "no"]}}}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    r = run_cli(["run", "smollm2-135m-instruct", "--chat", "-p", "Is the sky blue?", "--json-schema",
                 str(tmp_path / "s.json"), "-n", "40", "-t", "2", "--parallel", "2", "--json"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    texts = [o["text"] for o in out["outputs"]]
    assert len(texts) == 2 and all(json.loads(t)["answer"] in ("yes", "no") for t in texts), out["outputs"]
    (tmp_path / "g.gbnf").write_text('root ::= "A" [0-9] [0-9]\n')
    r = run_cli(["run", "smollm2-135m-instruct", "-p", "Code:", "--grammar", str(tmp_path / "g.gbnf"), "-n", "10",
                 "-t", "2", "--json"])
    assert r.returncode == 0, r.stderr
    assert re.fullmatch("A[0-9]{2}", json.loads(r.stdout)["outputs"][0]["text"]), r.stdout
    (tmp_path / "bad.json").write_text('{"type": "strin"}')
    r = run_cli(["run", "smollm2-135m-instruct", "-p", "x", "--json-schema", str(tmp_path / "bad.json")])
    assert r.returncode != 0 and "strin" in r.stderr
