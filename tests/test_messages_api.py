"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) through the official
anthropic client against `pyllama-kv serve` on the real SmolLM2: system prompts, stop_reason and
stop_sequence, usage (input + cache reads = the prompt), the stream's events and the client's
`messages.stream` helper, a tool_use / tool_result round trip (forced with tool_choice), count_tokens
(equal to what a request is charged), `x-api-key` and Bearer auth, and errors in Anthropic's shape
naming the field. Small models answer poorly: the protocol is tested, and on the model's F32 copy (an
F32 cache) that a greedy answer is the greedy generation of the rendered conversation."""
from __future__ import annotations

import json
import re

import anthropic
import httpx
import pytest

import pyllama_kv as pk
from conftest import F32_SERVE, greedy_chat
from test_server import KEY, MODEL, ServerProc, _wait_for

WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}
GREEDY = {"temperature": 0, "top_k": 20, "top_p": 0.9}
ESSAY = "Write a very long essay about the history of the bicycle, with many details."


@pytest.fixture(scope="module")
def server(real_model, pin_lib):   # on each pin's library in turn
    with ServerProc(MODEL, "--lib", pin_lib, "--ctx", "2048", "--parallel", "4", "--max-tokens-cap", "256",
                    "--max-body", "65536") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.root, api_key=KEY, max_retries=0, timeout=120.0)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_create_usage_and_stop_reasons(client):
    # (the client has no temperature, top_p, top_k any more: the API still takes them)
    m = client.messages.create(model=MODEL, max_tokens=24, messages=_user("Name a colour."), extra_body=GREEDY,
                               system="Answer in one word.", metadata={"user_id": "u1"},
                               cache_control={"type": "ephemeral"})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert m.content[0].type == "text" and m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    u = m.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 24 and u.cache_creation_input_tokens == 0
    # the same system prompt, as text blocks with cache_control: the cache serves the prompt's start
    again = client.messages.create(model=MODEL, max_tokens=4, messages=_user("Name a fruit."), extra_body=GREEDY,
                                   system=[{"type": "text", "text": "Answer in one word.",
                                            "cache_control": {"type": "ephemeral"}}])
    assert again.usage.cache_read_input_tokens > 0
    assert again.stop_reason == "max_tokens" or again.usage.output_tokens < 4
    # a stop sequence: the answer ends before it, and the response says which one matched
    stops = [" ", ".", ",", "\n"]
    s = client.messages.create(model=MODEL, max_tokens=64, messages=_user("Tell me a story about a cat."),
                               extra_body=GREEDY, stop_sequences=stops)
    if s.stop_reason == "stop_sequence":
        assert s.stop_sequence in stops and not any(x in s.content[0].text for x in stops)
    else:
        assert s.stop_reason == "end_turn" and s.stop_sequence is None


def test_structured_output_with_output_config_format(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    m = client.messages.create(model=MODEL, max_tokens=64, messages=_user("Name a city as JSON."), extra_body=GREEDY,
                               output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}})
    assert m.stop_reason == "end_turn" and isinstance(json.loads(m.content[0].text)["city"], str)


def test_count_tokens_is_what_a_request_is_charged(client):
    kw = {"model": MODEL, "messages": _user("What is the weather in Paris?"), "system": "Be brief.",
          "tools": [WEATHER], "tool_choice": {"type": "any"}}
    n = client.messages.count_tokens(**kw).input_tokens
    m = client.messages.create(max_tokens=2, extra_body=GREEDY, **kw)
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens > 0
    # with tool_choice none the tools are not rendered: fewer tokens
    assert client.messages.count_tokens(**{**kw, "tool_choice": {"type": "none"}}).input_tokens < n


def test_stream_events_and_the_helper(client):
    with client.messages.stream(model=MODEL, max_tokens=24, messages=_user("Name three animals."),
                                extra_body=GREEDY) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_message()
    raw = [t for t in types if t not in ("text", "input_json")]   # (the helper adds text events, skips pings)
    assert raw[:3] == ["message_start", "content_block_start", "content_block_delta"], raw
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"], raw
    assert final.content[0].type == "text" and final.content[0].text and final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens > 0 and final.usage.input_tokens + final.usage.cache_read_input_tokens > 10
    with client.messages.stream(model=MODEL, max_tokens=16, messages=_user("Say hello.")) as stream:
        text = "".join(stream.text_stream)
    assert text == stream.get_final_message().content[0].text


def test_the_wire_events_in_order(server):
    body = {"model": MODEL, "max_tokens": 16, "messages": _user("Say hello."), "stream": True}
    with httpx.stream("POST", server.root + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names   # each event named, as its data's type
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"], names
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"], names
    start, delta = data[0]["message"], data[-2]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens") and delta["usage"]["output_tokens"] > 0


def test_tool_use_round_trip(client):
    messages = _user("What is the weather in Paris?")
    m = client.messages.create(model=MODEL, max_tokens=100, messages=messages, tools=[WEATHER], extra_body=GREEDY,
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use"
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    assert isinstance(use.input["city"], str)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": [{"type": "text", "text": '{"temp_c": 22}'}]}]}]
    answer = client.messages.create(model=MODEL, max_tokens=40, messages=messages, tools=[WEATHER], extra_body=GREEDY,
                                    tool_choice={"type": "none"})
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.usage.cache_read_input_tokens > 0


def test_tool_use_streamed(client):
    with client.messages.stream(model=MODEL, max_tokens=100, messages=_user("Weather in Rome?"), tools=[WEATHER],
                                extra_body=GREEDY, tool_choice={"type": "tool", "name": "get_weather",
                                                            "disable_parallel_tool_use": True}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert deltas and all(e.delta.type == "input_json_delta" for e in deltas)
    (use,) = final.content
    assert final.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    assert isinstance(use.input["city"], str)


def test_api_key_as_x_api_key_or_bearer(server):
    bearer = anthropic.Anthropic(base_url=server.root, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=_user("Hi")).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.root, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=_user("Hi"))
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.get(server.url + "/models", headers={"x-api-key": KEY}, timeout=10)   # any endpoint takes it
    assert r.status_code == 200


BAD = [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "x"}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]},
     "messages[0].content[0].id"),
    ({"system": [{"type": "image"}]}, "system[0]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"stop_sequences": "x"}, "stop_sequences"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"metadata": {"user_id": 3}}, "metadata.user_id"),
    ({"mcp_servers": [{}]}, "mcp_servers"),
    ({"frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize("patch,field", BAD, ids=[f for _, f in BAD])
def test_errors_in_anthropics_shape_name_the_field(server, patch, field):
    body = {"model": MODEL, "max_tokens": 2, "messages": _user("hi"), **patch}
    r = httpx.post(server.root + "/v1/messages", json={k: v for k, v in body.items() if v is not None},
                   headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["message"].startswith(field) or f"{field} " in err["error"]["message"], err


def test_still_serving_after_errors_and_counted(server, client):
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=2, messages=_user("word " * 3000))
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus-4", max_tokens=2, messages=_user("hi"))
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=MODEL, messages=_user("hi"), extra_body={"max_tokens": 3})
    assert client.messages.create(model=MODEL, max_tokens=2, messages=_user("hi")).content
    m = server.metrics()
    assert m['pyllama_kv_http_requests_total{endpoint="/v1/messages",status="200"}'] >= 1
    assert m['pyllama_kv_http_requests_total{endpoint="/v1/messages",status="400"}'] >= 1
    assert m['pyllama_kv_http_requests_total{endpoint="/v1/messages/count_tokens",status="400"}'] >= 1
    assert m["pyllama_kv_internal_errors_total"] == 0


def test_a_client_that_leaves_mid_stream_cancels_its_request(server, client):
    key = 'pyllama_kv_client_disconnects_total{stage="generating"}'
    base = server.idle_metrics()
    with client.messages.stream(model=MODEL, max_tokens=256, messages=_user(ESSAY),
                                extra_body={"temperature": 0.7}) as stream:
        for i, _ in enumerate(stream.text_stream):
            if i >= 5:
                break
    _wait_for(lambda: server.metrics()[key] >= base[key] + 1)
    after = server.idle_metrics()
    assert after["pyllama_kv_kv_request_cells"] == 0 and after["pyllama_kv_internal_errors_total"] == 0


def test_the_readme_example_runs(server, tmp_path):
    """README's Messages example, against this server (its URL and key)."""
    from conftest import ROOT, run_py

    readme = (ROOT / "README.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "messages.create" in b]
    script = tmp_path / "messages_example.py"
    script.write_text(code.replace("http://127.0.0.1:8080", server.root).replace('"unused"', repr(KEY)))
    r = run_py([str(script)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "end_turn" in r.stdout or "max_tokens" in r.stdout


# -- answers against a fresh evaluation (a server on the F32 copy) -------------------------------------


@pytest.fixture(scope="module")
def f32_model(real_f32_model, pin_lib):
    with pk.Model(real_f32_model, lib=pin_lib) as m:
        yield m


@pytest.fixture(scope="module")
def exact(real_f32_model, pin_lib):
    """`serve` on the real model's F32 copy with an F32 cache: a greedy answer is then the greedy
    generation of a fresh evaluation, whatever the batch shapes."""
    with ServerProc(real_f32_model, "--lib", pin_lib, "--ctx", "1024", "--parallel", "1", *F32_SERVE) as s:
        yield s


def test_a_greedy_answer_is_the_greedy_generation_of_the_rendered_conversation(exact, f32_model):
    """temperature 0: the answer's text and its input tokens are those of a greedy generation of the
    conversation as the chat template renders it (``system`` as a system message first, text blocks
    as their text, an earlier answer as an assistant message), evaluated alone."""
    client = anthropic.Anthropic(base_url=exact.root, api_key=KEY, max_retries=0, timeout=120.0)
    prompt, want = greedy_chat(f32_model, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is the capital of France?"}], 16)
    m = client.messages.create(model=client.models.list().data[0].id, max_tokens=16, extra_body=GREEDY,
                               system=[{"type": "text", "text": "Be brief."}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi!"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello! How can I help?"}]},
        {"role": "user", "content": "What is the capital of France?"}])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(prompt), (m.usage, len(prompt))
    text = f32_model.detokenize(want)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text, (m.content, text)
    assert m.stop_reason == ("max_tokens" if len(want) == 16 else "end_turn")
