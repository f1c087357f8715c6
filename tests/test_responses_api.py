"""`POST /v1/responses` through the official openai client against `pyllama-kv serve` on the real
SmolLM2: text and message input, instructions, usage, the stream's events in the official order (and
the client's `responses.stream` helper), json_schema `text.format`, a function-tool round trip
(forced with tool_choice, answered with `function_call_output`, streamed too), `previous_response_id`
served from the prefix cache (`cached_tokens`), the store (GET, DELETE, `store: false`, and what it
dropped), a client that leaves mid-stream, and the 400s that name the field. Small models answer
poorly: the protocol is tested, and on the model's F32 copy (an F32 cache) that a greedy answer is the
greedy generation of the rendered conversation."""
from __future__ import annotations

import json
import re
import sys

import httpx
import jsonschema
import openai
import pytest

import pyllama_kv as pk
import test_server
from conftest import F32_SERVE, greedy_chat
from test_server import MODEL, ServerProc, _wait_for

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 20}}}
ESSAY = "Write a very long essay about the history of the bicycle, with many details."


@pytest.fixture(scope="module")
def server(real_model, pin_lib):   # on each pin's library in turn
    with ServerProc(MODEL, "--lib", pin_lib, "--ctx", "2048", "--parallel", "4", "--max-tokens-cap", "256",
                    "--max-body", "65536") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _post(server, body: dict, path: str = "/responses") -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers(), timeout=120)


def test_text_input_instructions_and_usage(client):
    r = client.responses.create(model=MODEL, input="Name a colour.", instructions="Answer in one word.",
                                max_output_tokens=24, temperature=0, metadata={"run": "1"})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete") and r.instructions == "Answer in one word."
    assert r.metadata == {"run": "1"} and r.store is True and r.temperature == 0
    (msg,) = r.output
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and msg.status == "incomplete"
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text" and r.output_text == msg.content[0].text
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 24 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.input_tokens_details.cached_tokens <= u.input_tokens and u.output_tokens_details.reasoning_tokens == 0
    # message items, with input_text parts and a developer message (the system's), and an earlier answer
    r = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
        {"role": "user", "content": "Name a fruit."}])
    assert r.output[0].type == "message" and r.usage.input_tokens > 20


def test_previous_response_id_costs_only_the_new_input(server, client):
    """A follow-up's prompt is the stored conversation and the new input: the prefix cache serves the
    conversation, the answer included (its tokens as generated), so only the new input is evaluated."""
    r1 = client.responses.create(model=MODEL, input="Tell me about the moon.", max_output_tokens=40, temperature=0)
    r2 = client.responses.create(model=MODEL, input="And the sun?", previous_response_id=r1.id,
                                 max_output_tokens=16, temperature=0)
    assert r2.previous_response_id == r1.id
    held = r1.usage.input_tokens + r1.usage.output_tokens - 1   # (the last answer token is never decoded)
    assert r2.usage.input_tokens > held
    assert r2.usage.input_tokens_details.cached_tokens >= held, (r1.usage, r2.usage)
    # the stored response, then forgotten
    got = httpx.get(f"{server.url}/responses/{r1.id}", headers=server.headers(), timeout=30)
    assert got.status_code == 200 and got.json()["id"] == r1.id and got.json()["output"][0]["type"] == "message"
    gone = httpx.delete(f"{server.url}/responses/{r1.id}", headers=server.headers(), timeout=30)
    assert gone.json() == {"id": r1.id, "object": "response.deleted", "deleted": True}
    assert httpx.get(f"{server.url}/responses/{r1.id}", headers=server.headers(), timeout=30).status_code == 404
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="More?", previous_response_id=r1.id, max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"
    # store: false keeps nothing
    r3 = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=4)
    assert r3.store is False
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="More?", previous_response_id=r3.id, max_output_tokens=4)


ORDER_TEXT = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
ORDER_END = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_stream_events_in_the_official_order(client):
    events = list(client.responses.create(model=MODEL, input="Name three animals.", max_output_tokens=24,
                                          temperature=0, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ORDER_TEXT and types[-4:-1] == ORDER_END, types
    assert types[-1] in ("response.completed", "response.incomplete")
    assert set(types[4:-4]) == {"response.output_text.delta"} and len(types) > 8
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[-4].text == deltas == final.output_text and final.id == events[0].response.id
    assert events[0].response.status == "in_progress" and final.usage.output_tokens <= 24
    assert events[-2].item.status == final.output[0].status == ("incomplete" if final.status == "incomplete"
                                                                else "completed")


def test_json_schema_text_format_streamed_with_the_helper(client):
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    with client.responses.stream(model=MODEL, input="Name a city as JSON.", text=fmt, max_output_tokens=64,
                                 temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()   # (needs response.completed: the grammar completes)
    assert final.status == "completed" and "".join(deltas) == final.output_text
    jsonschema.validate(json.loads(final.output_text), CITY)
    assert final.text.format.type == "json_schema"
    r = client.responses.create(model=MODEL, input="Describe a city as JSON.", text={"format": {"type": "json_object"}},
                                max_output_tokens=64, temperature=0)
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def test_function_tool_round_trip(client):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    r = client.responses.create(model=MODEL, input=[question], tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temp_c": 22})}
    # the whole history sent back (the call item as the client got it) ...
    r2 = client.responses.create(model=MODEL, input=[question, call.model_dump(exclude_none=True), result],
                                 tools=[WEATHER], tool_choice="none", max_output_tokens=32, temperature=0)
    assert r2.output[0].type == "message" and r2.output_text
    # ... or only the result, after the stored call
    r3 = client.responses.create(model=MODEL, input=[result], previous_response_id=r.id, tools=[WEATHER],
                                 tool_choice="none", max_output_tokens=32, temperature=0)
    assert r3.output[0].type == "message" and r3.usage.input_tokens == r2.usage.input_tokens
    assert r3.usage.input_tokens_details.cached_tokens > 0


def test_function_call_streamed(client):
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER], temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 parallel_tool_calls=False) as stream:
        types, args = [], ""
        for e in stream:
            types.append(e.type)
            if e.type == "response.function_call_arguments.delta":
                args += e.delta
        final = stream.get_final_response()
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"], types
    (call,) = final.output
    assert call.type == "function_call" and call.arguments == args and json.loads(args)["city"]


BAD = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools[0].parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{no"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"input": None}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#"}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt_cache_key": "k"}, "prompt_cache_key"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"stream_options": {"include_usage": True}}, "stream_options.include_usage"),
    ({"metadata": {"k": 1}}, "metadata.k"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"input": "word " * 3000}, "input"),
]


@pytest.mark.parametrize("patch,param", BAD, ids=[p for _, p in BAD])
def test_bad_requests_name_the_field(server, patch, param):
    r = _post(server, {"model": MODEL, "input": "hi", "max_output_tokens": 2, **patch})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["message"].startswith(param.split("[")[0].split(".")[0]) or err["code"] == "context_length_exceeded", err


def test_still_serving_after_bad_requests_and_counted(server, client):
    assert _post(server, {"model": MODEL, "input": "hi", "tools": [{"type": "file_search"}]}).status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-5", input="hi")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="hi", reasoning={"effort": "high", "summary": "detailed"})
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, reasoning={"effort": "low"},
                                user="u1", include=[], background=False, truncation="auto")
    assert r.output and r.reasoning.effort == "low" and r.truncation == "auto"
    m = server.metrics()
    assert m['pyllama_kv_http_requests_total{endpoint="/v1/responses",status="200"}'] >= 1
    assert m['pyllama_kv_http_requests_total{endpoint="/v1/responses",status="400"}'] >= 2
    assert m['pyllama_kv_http_requests_total{endpoint="/v1/responses",status="404"}'] >= 1
    assert m["pyllama_kv_internal_errors_total"] == 0
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").responses.create(model=MODEL, input="hi")


def test_a_client_that_leaves_mid_stream_cancels_its_request(server, client):
    key = 'pyllama_kv_client_disconnects_total{stage="generating"}'
    base = server.idle_metrics()
    stream = client.responses.create(model=MODEL, input=ESSAY, max_output_tokens=256, temperature=0.7, stream=True)
    for i, _ in enumerate(stream):
        if i >= 6:
            break
    stream.close()
    _wait_for(lambda: server.metrics()[key] >= base[key] + 1)
    after = server.idle_metrics()
    assert after["pyllama_kv_kv_request_cells"] == 0 and after["pyllama_kv_internal_errors_total"] == 0
    cancelled = 'pyllama_kv_finished_total{reason="cancelled"}'
    assert after[cancelled] >= base[cancelled] + 1


def test_the_readme_example_runs(server, tmp_path):
    """README's Responses example, against this server (its URL and key)."""
    from conftest import ROOT, run_py

    readme = (ROOT / "README.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "client.responses" in b]
    script = tmp_path / "responses_example.py"
    script.write_text(code.replace("http://127.0.0.1:8080", server.root).replace('"unused"', repr(server.key)))
    r = run_py([str(script)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) > 0   # cached_tokens


# -- answers against a fresh evaluation, and the store's bound (a server on the F32 copy) ----------------

#: the responses the exactness server stores (its ResponseStore's max_items, set by the wrapper below)
STORED = 2

#: `pyllama-kv serve` with a store of STORED responses (the bound is limits.RESPONSES_STORED, 1,024:
#: too many to fill in a test); the rest is the console script's main
SERVE_WITH_A_SMALL_STORE = f"""#!{sys.executable}
import functools, sys
from pyllama_kv.server import responses
responses.ResponseStore = functools.partial(responses.ResponseStore, max_items={STORED})
from pyllama_kv.cli import main
sys.exit(main())
"""


@pytest.fixture(scope="module")
def f32_model(real_f32_model, pin_lib):
    with pk.Model(real_f32_model, lib=pin_lib) as m:
        yield m


@pytest.fixture(scope="module")
def exact(real_f32_model, pin_lib, tmp_path_factory):
    """`serve` on the real model's F32 copy with an F32 cache (a greedy answer is then the greedy
    generation of a fresh evaluation, whatever the batch shapes) and a store of STORED responses."""
    script = tmp_path_factory.mktemp("serve") / "pyllama-kv"
    script.write_text(SERVE_WITH_A_SMALL_STORE)
    script.chmod(0o755)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_server, "ENTRY_POINT", script)
        s = ServerProc(real_f32_model, "--lib", pin_lib, "--ctx", "1024", "--parallel", "1", *F32_SERVE)
    with s:
        yield s


def test_a_greedy_answer_is_the_greedy_generation_of_the_rendered_conversation(exact, f32_model):
    """temperature 0: the answer's text and token counts are those of a greedy generation of the
    conversation as the chat template renders it (instructions as a system message before the input,
    input_text parts as their text, an earlier answer as an assistant message), evaluated alone."""
    prompt, want = greedy_chat(f32_model, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is the capital of France?"}], 16)
    r = exact.client().responses.create(model=real_name(exact), max_output_tokens=16, temperature=0,
                                        instructions="Be brief.", input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
        {"role": "assistant",
         "content": [{"type": "output_text", "text": "Hello! How can I help?", "annotations": []}]},
        {"role": "user", "content": "What is the capital of France?"}])
    assert r.usage.input_tokens == len(prompt), (r.usage, len(prompt))
    assert r.output_text == f32_model.detokenize(want), (r.output_text, f32_model.detokenize(want))
    assert r.status == ("incomplete" if len(want) == 16 else "completed")
    assert r.usage.output_tokens in (len(want), len(want) + 1)   # (with the end-of-generation token or not)


def test_previous_response_id_after_the_store_dropped_it(exact):
    """The store keeps the STORED most recently used responses: a follow-up of one it dropped is the
    documented 400 naming previous_response_id (code previous_response_not_found), GET says 404, and
    the responses it kept still serve follow-ups."""
    c, name = exact.client(), real_name(exact)
    first, second = (c.responses.create(model=name, input=f"Say {w}.", max_output_tokens=2, temperature=0).id
                     for w in ("one", "two"))
    got = httpx.get(f"{exact.url}/responses/{first}", headers=exact.headers(), timeout=30)
    assert got.status_code == 200   # a use: the first is the most recently used now
    third = c.responses.create(model=name, input="Say three.", max_output_tokens=2, temperature=0).id
    with pytest.raises(openai.BadRequestError) as e:   # the least recently used went for it
        c.responses.create(model=name, input="More?", previous_response_id=second, max_output_tokens=2)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == "previous_response_id", err
    assert err["code"] == "previous_response_not_found" and second in err["message"], err
    assert httpx.get(f"{exact.url}/responses/{second}", headers=exact.headers(), timeout=30).status_code == 404
    for kept in (first, third):
        r = c.responses.create(model=name, input="More?", previous_response_id=kept, max_output_tokens=2,
                               temperature=0, store=False)
        assert r.previous_response_id == kept and r.output


def real_name(server) -> str:
    """The id the server lists for its model (a file's stem)."""
    return server.client().models.list().data[0].id
