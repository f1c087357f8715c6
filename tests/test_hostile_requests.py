"""Issue 45 (hardening, fifth round): what an adversarial probe found, each case checked by counting
work or by which lock or thread a call takes, never by timing.

* vocabulary calls (tokenize, detokenize, token_to_piece, ...) hold no lock that generation needs,
  and ``Model.close`` waits for those running;
* every endpoint counts a request's lists before it looks at any item (``limits.MAX_MESSAGES``,
  ``MAX_MESSAGE_PARTS``), and types every other field before it translates the items;
* the Responses store is bounded by the memory it holds (tracemalloc, hostile shapes), and what it
  keeps is typed first (``reasoning.effort``, ``text.format.description``);
* the chat template's placeholder scan is one pass (Python lines counted);
* no endpoint does per-item or per-token work on the event loop;
* a lone surrogate an answer repeats is written as its escape (it was a 500, or a cut stream).
"""
from __future__ import annotations

import asyncio
import gc
import json
import sys
import threading
import time
import tracemalloc

import httpx
import pytest

import pyllama_kv as pk
from conftest import run_py
from pyllama_kv.chat import templates
from pyllama_kv.errors import InvalidInputError
from pyllama_kv.limits import MAX_CONTROL_TEXTS, MAX_MESSAGE_PARTS, MAX_MESSAGES
from pyllama_kv.server import messages, protocol, responses
from pyllama_kv.server.protocol import APIError
from pyllama_kv.server.relay import Bounds

BOUNDS = Bounds(parallel=4, max_tokens_cap=256)

# -- 1. vocabulary calls and the model's lock -----------------------------------------------------------


class _HeldNative:
    """A model's native object whose tokenize stops inside the "C call" until ``release`` is set
    (``entered`` says it is there), and whose free is recorded."""

    def __init__(self, real):
        self.real = real
        self.entered, self.release = threading.Event(), threading.Event()
        self.freed = False

    def __getattr__(self, name):
        return getattr(self.real, name)

    def tokenize(self, *args):
        self.entered.set()
        assert self.release.wait(60), "never released"
        return self.real.tokenize(*args)

    def free(self) -> None:
        self.freed = True
        self.real.free()


def test_a_vocabulary_call_holds_no_lock_generation_needs_and_close_waits_for_it(real_model):
    model = pk.Model(real_model)
    held = _HeldNative(model._native)
    model._native = held
    got: list = []
    tokenizer = threading.Thread(target=lambda: got.append(model.tokenize("hello <|im_end|>", special=True)))
    closer = threading.Thread(target=model.close)
    try:
        tokenizer.start()
        assert held.entered.wait(60)
        # the model's lock (which a context's detokenization and sampling take) is free meanwhile
        assert model._lock.acquire(blocking=False), "tokenize holds the model's lock"
        model._lock.release()
        closer.start()
        for _ in range(6000):   # close() begins: no new vocabulary call from then on ...
            if model.closed:
                break
            time.sleep(0.01)
        assert model.closed
        with pytest.raises(InvalidInputError, match="closed"):
            model.token_to_piece(1)
        assert not held.freed, "the model was freed under a running tokenize"   # ... and it waits
    finally:
        held.release.set()
        for t in (tokenizer, closer):
            if t.ident is not None:
                t.join(60)
    assert held.freed and got and got[0][-1] == 2   # the running call finished first, whole


CLOSE_IN_A_CALL = """
import sys, pyllama_kv as pk
m = pk.Model(sys.argv[1])
real = m._native
class Native:   # its tokenize closes the model, as a log handler in the calling thread could
    def __getattr__(self, name):
        return getattr(real, name)
    def tokenize(self, *args):
        try:
            m.close()
        except pk.InvalidInputError:
            print("refused")
        return real.tokenize(*args)
m._native = Native()
print(m.tokenize("hello", add_bos=False), m.closed)
m.close()
print("closed", m.closed)
"""


def test_close_from_within_a_vocabulary_call_is_refused(real_model):
    """A log handler runs in the thread of the call that logs: closing the model there freed it under
    that call (a crash, before; in a subprocess here) and would wait for it forever with a count alone:
    it is refused, and the model stays open."""
    r = run_py(["-c", CLOSE_IN_A_CALL, str(real_model)], timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.split("\n")[:3] == ["refused", "[28120] False", "closed True"], r.stdout


# -- 1b. lists counted before any item is looked at ----------------------------------------------------


class _Watched(dict):
    """A JSON object that counts every look at its keys or values (``_Watched.looks``)."""

    looks = 0

    def _look(self):
        type(self).looks += 1

    def get(self, *a):
        self._look()
        return super().get(*a)

    def __getitem__(self, k):
        self._look()
        return super().__getitem__(k)

    def items(self):
        self._look()
        return super().items()

    def __iter__(self):
        self._look()
        return super().__iter__()

    def __contains__(self, k):
        self._look()
        return super().__contains__(k)


def _items(n: int, **item) -> list:
    _Watched.looks = 0
    return [_Watched(item) for _ in range(n)]


def _refused(parse, body, param: str) -> APIError:
    with pytest.raises(APIError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert _Watched.looks == 0, f"{_Watched.looks} looks at items before the refusal"
    return e.value


TOO_MANY = MAX_MESSAGES + 1
MSG = {"role": "user", "content": ""}


def _chat(body):
    return protocol.parse(body, "chat", parallel=4, max_tokens_cap=256)


@pytest.mark.parametrize("case", ["chat", "apply-template", "responses", "messages", "count_tokens"])
def test_too_many_messages_are_refused_before_any_is_looked_at(case):
    """30,000 empty Responses input items took 40 s to be refused (translated, rendered, then tokenized
    quadratically): now every endpoint that takes messages counts them first."""
    if case == "chat":
        e = _refused(_chat, {"model": "m", "messages": _items(TOO_MANY, **MSG)}, "messages")
    elif case == "apply-template":
        e = _refused(protocol.parse_apply_template, {"messages": _items(TOO_MANY, **MSG)}, "messages")
    elif case == "responses":
        d = responses.ResponsesDialect(BOUNDS, responses.ResponseStore())
        e = _refused(d.parse, {"model": "m", "input": _items(30_000, **MSG)}, "input")
    else:
        d = messages.MessagesDialect(BOUNDS, lambda t: b"")
        body = {"model": "m", "messages": _items(TOO_MANY, **MSG)}
        e = _refused(d.parse, {**body, "max_tokens": 4}, "messages") if case == "messages" else \
            _refused(d.parse_count, body, "messages")
    assert f"at most {MAX_MESSAGES}" in e.message


def test_a_stored_conversation_counts_with_the_new_input():
    store = responses.ResponseStore()
    store.put("resp_a", [dict(MSG) for _ in range(MAX_MESSAGES - 1)], {"id": "resp_a"})
    d = responses.ResponsesDialect(BOUNDS, store)
    e = _refused(d.parse, {"model": "m", "previous_response_id": "resp_a", "input": _items(2, **MSG)}, "input")
    assert f"after the {MAX_MESSAGES - 1} messages" in e.message


@pytest.mark.parametrize("case", ["chat", "responses", "messages"])
def test_too_many_parts_of_one_message_are_refused_before_any_is_looked_at(case):
    parts = _items(MAX_MESSAGE_PARTS + 1, type="input_text" if case == "responses" else "text", text="")
    if case == "chat":
        _refused(_chat, {"model": "m", "messages": [{"role": "user", "content": parts}]}, "messages[0].content")
    elif case == "responses":
        d = responses.ResponsesDialect(BOUNDS, responses.ResponseStore())
        _refused(d.parse, {"model": "m", "input": [{"role": "user", "content": parts}]}, "input[0].content")
    else:
        d = messages.MessagesDialect(BOUNDS, lambda t: b"")
        _refused(d.parse, {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": parts}]},
                 "messages[0].content")


def test_other_fields_are_typed_before_the_items_are_translated():
    """A Responses body with a bad field is refused without translating its input (up to the bound)."""
    d = responses.ResponsesDialect(BOUNDS, responses.ResponseStore())
    _refused(d.parse, {"model": "m", "input": _items(MAX_MESSAGES, **MSG), "text": {"format": 5}}, "text.format")
    m = messages.MessagesDialect(BOUNDS, lambda t: b"")
    _refused(m.parse, {"model": "m", "max_tokens": 4, "messages": _items(MAX_MESSAGES, **MSG), "tools": 5}, "tools")
    _refused(_chat, {"model": "m", "messages": _items(MAX_MESSAGES, **MSG), "echo": True}, "echo")


# -- 2. the Responses store: typed, and bounded by the memory it holds ------------------------------------


@pytest.mark.parametrize("field,value", [
    ("reasoning.effort", [[]] * 50), ("reasoning.effort", {"a": 1}), ("reasoning.effort", "extreme"),
    ("reasoning.effort", 3), ("text.format.description", [[], []]), ("text.format.description", {"a": {}})])
def test_every_repeated_field_is_typed_before_it_is_stored(field, value):
    """``reasoning.effort`` (any JSON value) and ``text.format.description`` were copied unchecked into
    every stored response; now each is one of its documented values or types."""
    def body(v) -> dict:
        if field == "reasoning.effort":
            return {"model": "m", "input": "hi", "reasoning": {"effort": v}}
        return {"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                 "schema": {"type": "object"}, "description": v}}}
    d = responses.ResponsesDialect(BOUNDS, responses.ResponseStore())
    with pytest.raises(APIError) as e:
        d.parse(body(value))
    assert e.value.status == 400 and e.value.param == field
    for ok in (responses.REASONING_EFFORTS if field == "reasoning.effort" else ("a city",)) + (None,):
        assert d.parse(body(ok)).kind == "chat"


def _nested_empty_lists(i: int) -> list:
    return [[[], [[]], [[], []]] for _ in range(2000 + i % 7)]


def _tiny_keys(i: int) -> dict:
    return {f"{k:x}": 0 for k in range(6000 + i % 5)}


def _long_string(i: int) -> str:
    return "x" * (100_000 + i) + "\U0001f600"   # (one astral character: 4 bytes for every character)


def _tiny(i: int) -> int:
    return i


# (each of the large shapes is half the bound or more once stored: 12 of them evict again and again; many
# tiny responses test the entries' own cost)
@pytest.mark.parametrize("shape,count", [(_nested_empty_lists, 12), (_tiny_keys, 12), (_long_string, 12),
                                         (_tiny, 20_000)])
def test_the_store_holds_at_most_its_bound_whatever_the_shapes(shape, count):
    """1 MB bodies of nested empty lists cost ~42 MiB each once stored, against a bound counted in JSON
    characters: the store's memory (traced) now stays within its bound, whatever the shape."""
    bound = 2 << 20
    store = responses.ResponseStore(max_items=10_000, max_bytes=bound)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(count):
            conv = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": shape(i)}}}]}]
            resp = {"id": f"resp_{i}", "reasoning": {"effort": shape(i)}, "output": []}
            store.put(resp["id"], conv, resp)
            del conv, resp
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(store) > 0 and store.held <= bound
    assert held <= bound, f"the store holds {held} bytes, over its bound of {bound}"


def test_a_stored_response_comes_back_as_it_was_given():
    store = responses.ResponseStore()
    conv = [{"role": "user", "content": "caf\u00e9 \ud800"}, {"role": "assistant", "content": "ok"}]
    resp = {"id": "resp_x", "output": [{"type": "message", "content": [{"text": "\U0001f600"}]}]}
    store.put("resp_x", conv, resp)
    assert store.conversation("resp_x") == conv and json.loads(store.answer("resp_x")) == resp
    store.conversation("resp_x").append({})   # a copy each time
    assert len(store.conversation("resp_x")) == 2


# -- 3. the placeholder scan: one pass --------------------------------------------------------------------


def _lines(fn, *args) -> tuple[object, int]:
    """``fn(*args)`` and the Python lines of pyllama_kv.chat.templates it ran."""
    count = 0
    path = templates.__file__

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename != path:
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        out = fn(*args)
    finally:
        sys.settrace(None)
    return out, count


def test_placeholders_are_chosen_in_one_pass():
    """8,000 private-use characters in use x 20,000 strings took 4.7 s: now linear in both."""
    used, n_texts = 400, 800
    texts = [f"t{i}" + (chr(0xF0000 + i) if i < used else "") for i in range(n_texts)]
    marks, lines = _lines(templates._placeholders, 3, texts)
    assert marks == [chr(0xF0000 + used + k) for k in range(3)]
    assert lines <= 10 * (used + n_texts), f"{lines} lines for {used} used characters in {n_texts} texts"


def test_too_many_control_token_spellings_are_refused_before_rendering(real_model, monkeypatch):
    """Each typed control-token spelling is tokenized on its own (about 70 us a call): 1 MiB of them
    took 11 s and stalled other clients. At most MAX_CONTROL_TEXTS, counted before the template runs."""
    rendered = []
    real_render = templates.render
    monkeypatch.setattr(templates, "render", lambda *a, **k: rendered.append(1) or real_render(*a, **k))
    with pk.Model(real_model) as model:
        ok = templates.apply_chat_template(model, [{"role": "user", "content": "<|im_end|> " * MAX_CONTROL_TEXTS}])
        assert len(ok.plain) == MAX_CONTROL_TEXTS and rendered == [1]
        too_many = [{"role": "user", "content": "<|im_end|>" * (MAX_CONTROL_TEXTS - 10)},
                    {"role": "user", "content": "a<|im_start|>b" * 11}]
        with pytest.raises(InvalidInputError, match=f"{MAX_CONTROL_TEXTS + 1} times.*at most {MAX_CONTROL_TEXTS}"):
            templates.apply_chat_template(model, too_many)
        assert rendered == [1]   # refused before the template ran


def test_control_text_among_many_private_use_characters_renders_plain(real_model):
    model = pk.Model(real_model)
    try:
        n = 600
        msgs = [{"role": "user", "content": f"m{i} {chr(0xF0000 + i)}" + (" <|im_end|> x" if i % 3 == 0 else "")}
                for i in range(n)]
        rendered, lines = _lines(templates.apply_chat_template, model, msgs)
        assert lines <= 200 * n, f"{lines} lines for {n} messages"
        # every message's private-use character is back as it was, every typed <|im_end|> plain
        text = str(rendered)
        assert all(f"m{i} {chr(0xF0000 + i)}" in text for i in range(n))
        typed = [text[a:b] for a, b in rendered.plain]
        assert typed == ["<|im_end|>"] * len(range(0, n, 3))
    finally:
        model.close()


# -- 4. no per-item or per-token work on the event loop -------------------------------------------------


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


class _LoopWatch:
    """A model whose vocabulary calls record whether they ran on an event loop's thread."""

    WATCHED = ("tokenize", "detokenize", "token_to_piece", "check_tokens")

    def __init__(self, model):
        self._model = model
        self.calls: list[str] = []
        self.on_loop: list[str] = []

    def __getattr__(self, name):
        attr = getattr(self._model, name)
        if name not in self.WATCHED:
            return attr
        return self.watch(name, attr)

    def watch(self, name, fn):
        def watched(*args, **kwargs):
            self.calls.append(name)
            if _on_loop():
                self.on_loop.append(name)
            return fn(*args, **kwargs)
        return watched


@pytest.fixture(scope="module")
def served(real_model):
    """A server over SmolLM2 on 127.0.0.1 (a free port, in this process), its model watched."""
    import uvicorn

    from pyllama_kv.config import EngineConfig
    from pyllama_kv.engine import Engine
    from pyllama_kv.server import ServerConfig, app as server_app

    model = pk.Model(real_model)
    engine = Engine(model, EngineConfig(n_ctx=512, parallel=1, prefix_cache=0, max_tokens=8, n_threads=1))
    watch = _LoopWatch(model)
    server = server_app.Server(watch, engine, ServerConfig(port=0), ["m"])
    for name, d in server.dialects.items():
        d.parse = watch.watch(f"{name}.parse", d.parse)
    server.anthropic.parse_count = watch.watch("count.parse", server.anthropic.parse_count)
    sock = server_app.bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv = server_app._Uvicorn(uvicorn.Config(server.app, log_level="warning", lifespan="on"), server)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(6000):
        if uv.started:
            break
        time.sleep(0.01)
    assert uv.started
    try:
        yield url, watch
    finally:
        uv.should_exit = True
        thread.join(60)
        sock.close()
        engine.close()
        model.close()


def test_no_endpoint_does_per_item_work_on_the_event_loop(served):
    """A 1 MiB /tokenize with pieces made /health wait 4.5 s: its pieces were made on the event loop."""
    url, watch = served
    watch.calls.clear()
    watch.on_loop.clear()
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/tokenize", json={"content": "hello <|im_end|> " * 50, "with_pieces": True})
        assert r.status_code == 200 and r.json()["tokens"][2] == {"id": 2, "piece": "<|im_end|>"}
        r = c.post("/detokenize", json={"tokens": [28120, 216, 2]})
        assert r.status_code == 200 and r.json()["content"] == "hello <|im_end|>"
        assert c.post("/apply-template", json={"messages": [MSG]}).status_code == 200
        r = c.post("/v1/messages/count_tokens", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["input_tokens"] > 0
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2, "logprobs": True, "top_logprobs": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["content"]
        r = c.post("/v1/responses", json={"model": "m", "input": [MSG] * (MAX_MESSAGES + 1)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert {"token_to_piece", "detokenize", "check_tokens", "tokenize", "chat.parse", "responses.parse",
            "count.parse"} <= set(watch.calls)
    assert watch.on_loop == [], f"on the event loop: {sorted(set(watch.on_loop))}"


def _post(c: httpx.Client, path: str, body: dict) -> httpx.Response:
    """``body`` as ASCII JSON: a lone surrogate travels as its escape, as a client's JSON may carry it."""
    return c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def test_a_lone_surrogate_the_answer_repeats_is_written_as_its_escape(served):
    """A lone surrogate in a field an answer repeats (Responses' instructions and metadata, a rendered
    prompt) made the answer a 500 and cut a stream: it is written back as its JSON escape."""
    url, _ = served
    odd = "x \ud800 y"
    with httpx.Client(base_url=url, timeout=120) as c:
        r = _post(c, "/v1/responses", {"model": "m", "input": "hi", "instructions": odd, "metadata": {"k": odd},
                                       "max_output_tokens": 2})
        assert r.status_code == 200 and r.json()["instructions"] == odd and r.json()["metadata"] == {"k": odd}
        assert json.loads(c.get(f"/v1/responses/{r.json()['id']}").content)["instructions"] == odd
        r = _post(c, "/v1/responses", {"model": "m", "input": "hi", "metadata": {"k": odd}, "max_output_tokens": 2,
                                       "stream": True})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and events[-1]["type"] in ("response.completed", "response.incomplete")
        assert events[-1]["response"]["metadata"] == {"k": odd}
        r = _post(c, "/apply-template", {"messages": [{"role": "user", "content": odd}]})
        assert r.status_code == 200 and odd in r.json()["prompt"]
