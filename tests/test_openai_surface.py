"""The OpenAI surface agent frameworks need, through `pyllama-kv serve` and the official openai
client: structured output (response_format json_schema / json_object, the grammar extension),
logprobs (chat, completions, streamed), penalties and logit_bias, tool calls; the 400s that name
the field. One server (the real SmolLM2) for the module; every server is a bounded subprocess."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from test_server import MODEL, ServerProc

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population", "tags"],
          "properties": {"city": {"type": "string", "maxLength": 24},
                         "population": {"type": "integer", "minimum": 0, "maximum": 40000000},
                         "tags": {"type": "array", "items": {"enum": ["big", "small", "old", "new"]}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def server(real_model, pin_lib):   # on each pin's library in turn
    with ServerProc(MODEL, "--lib", pin_lib, "--ctx", "2048", "--parallel", "4", "--max-tokens-cap", "256") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# -- structured output ----------------------------------------------------------------------------


def test_response_format_json_schema_validates(client):
    r = client.chat.completions.create(
        model=MODEL, messages=_user("Describe a city as JSON."), n=3, temperature=1.0, seed=5, max_tokens=160,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_response_format_json_object_and_streaming(client):
    kw = dict(model=MODEL, messages=_user('Reply with a JSON object with one key "ok" set to true.'),
              temperature=0, max_tokens=200,
              response_format={"type": "json_object"})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop", whole
    assert isinstance(json.loads(whole.message.content), dict)
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **kw)
                   if ch.choices)
    assert text == whole.message.content


def test_grammar_extension(client):
    r = client.chat.completions.create(model=MODEL, messages=_user("Is water wet?"), max_tokens=8, temperature=1,
                                       extra_body={"grammar": 'root ::= "Yes." | "No."'})
    assert r.choices[0].message.content in ("Yes.", "No.") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=8,
                                  extra_body={"grammar": 'start: " " /[0-9]{2}/'})
    assert len(r.choices[0].text) == 3 and r.choices[0].text[1:].isdigit()


def test_bad_structured_output_requests_are_400s_naming_the_field(server):
    url, h = server.url + "/chat/completions", server.headers()
    good = {"model": MODEL, "messages": _user("hi"), "max_tokens": 2}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format.json_schema.schema", "strin"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"properties": {"a": {"$ref": "#/$defs/nope"}}}}}},
         "response_format.json_schema.schema", "nope"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
        ({"response_format": "json"}, "response_format", None),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", None),
        ({"grammar": "start: undefined_rule"}, "grammar", "undefined_rule"),
        ({"grammar": 7}, "grammar", None),
        ({"top_logprobs": 3}, "top_logprobs", None),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ]
    for extra, param, needle in cases:
        err = _error(httpx.post(url, json={**good, **extra}, headers=h, timeout=60))
        assert err["param"] == param, (extra, err)
        if needle:
            assert needle in err["message"], (extra, err)


# -- logprobs -------------------------------------------------------------------------------------


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=_user("Name a colour."), max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3)
    c = r.choices[0]
    content = c.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == c.message.content
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode("utf-8", "replace") == t.token
        assert len(t.top_logprobs) == 3
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert t.top_logprobs[0].token == t.token and abs(t.top_logprobs[0].logprob - t.logprob) < 1e-9  # greedy
    # streamed: an entry per token, chunk by chunk (the prompt now comes from the prefix cache, whose
    # quantized logits differ slightly from a fresh evaluation's: compare the stream with itself)
    streamed, text, usage = [], "", None
    for ch in client.chat.completions.create(model=MODEL, messages=_user("Name a colour."), max_tokens=6,
                                             temperature=0, logprobs=True, top_logprobs=2, stream=True,
                                             stream_options={"include_usage": True}):
        usage = ch.usage or usage
        if ch.choices and ch.choices[0].logprobs:
            streamed += ch.choices[0].logprobs.content
        if ch.choices:
            text += ch.choices[0].delta.content or ""
    assert usage is not None and len(streamed) == usage.completion_tokens
    assert "".join(t.token for t in streamed) == text
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token for t in streamed)
    # off by default
    r = client.chat.completions.create(model=MODEL, messages=_user("Hi"), max_tokens=2)
    assert r.choices[0].logprobs is None


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(x) and tok in top


# -- penalties and logit_bias -----------------------------------------------------------------------


def test_penalties_and_logit_bias_change_the_output(server, client, real_model):
    kw = dict(model=MODEL, prompt="one, two, one, two, one, two,", max_tokens=16, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    assert client.completions.create(frequency_penalty=2.0, presence_penalty=1.0, **kw).choices[0].text != plain
    assert client.completions.create(extra_body={"repeat_penalty": 1.5}, **kw).choices[0].text != plain
    import pyllama_kv as pk

    with pk.Model(real_model) as m:
        seven = m.tokenize(" seven", add_bos=False)
    assert len(seven) == 1
    biased = client.completions.create(logit_bias={str(seven[0]): 100}, **{**kw, "max_tokens": 3}).choices[0].text
    assert biased == " seven" * 3
    url, h = server.url + "/completions", server.headers()
    for extra, param in (({"frequency_penalty": 3}, "frequency_penalty"),
                         ({"presence_penalty": "x"}, "presence_penalty"), ({"repeat_penalty": 0}, "repeat_penalty"),
                         ({"logit_bias": {"a": 1}}, "logit_bias"),
                         ({"logit_bias": {"1": 500}}, "logit_bias"), ({"logit_bias": {"99999999": 1}}, "logit_bias"),
                         ({"logit_bias": [1]}, "logit_bias")):
        err = _error(httpx.post(url, json={"model": MODEL, "prompt": "x", "max_tokens": 1, **extra}, headers=h,
                                timeout=60))
        assert err["param"] == param, (extra, err)
