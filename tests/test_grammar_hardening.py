"""Grammars as hostile input (issue 30, items 1-4): chains that crashed llguidance in the server's
process, grammars nothing can follow, endless grammars, and token ids of any size. Through the HTTP
server (one bounded subprocess for the module: if a grammar killed it, every later test would fail)
and at the library level (bounds, the worker's time limit and cancellation)."""
from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from pyllama_kv import _worker as _template_worker
from pyllama_kv.limits import GRAMMAR_MAX_DEPTH, GRAMMAR_MAX_RULES
from pyllama_kv.sampling import grammar_check as _grammar_check
from pyllama_kv.sampling.grammar import Grammar, GrammarError
from test_server import MODEL, ServerProc

#: what a client must never see: llguidance's error names, its parser state, its verbose markers
INTERNALS = ("NoExtensionBias", "LexerTooComplex", "non-verbose", "Too many items", "Earley", "lexer error",
             "parser error", "Traceback")


def lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: "x" r{i + 1}\n' for i in range(n)) + f'r{n}: "y"\n'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1}\n' for i in range(n)) + f'r{n} ::= "y"\n'


def defs_chain(n: int) -> dict:
    defs: dict = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string", "maxLength": 4}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def tool(params) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": params}}]


@pytest.fixture(scope="module")
def server(real_model, pin_lib):   # on each pin's library in turn
    with ServerProc(MODEL, "--lib", pin_lib, "--ctx", "1024", "--parallel", "2", "--max-tokens-cap", "64") as s:
        yield s


def post(server, body: dict, path: str = "/chat/completions", timeout: float = 60) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 8, **body}
    if "messages" not in body and path == "/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    return httpx.post(server.url + path, json=body, headers=server.headers(), timeout=timeout)


def refused(r: httpx.Response, field: str) -> str:
    """The 400's message, after checking it names ``field`` and carries none of llguidance's internals."""
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    msg = err["message"]
    assert field in msg and "\n" not in msg, msg
    assert not any(w in msg for w in INTERNALS), msg
    return msg


def alive(server) -> None:
    assert server.proc.poll() is None, server.log()
    assert httpx.get(server.root + "/health", timeout=10).status_code == 200
    r = post(server, {"max_tokens": 2})
    assert r.status_code == 200, r.text


# -- 1. chains past the old crash points -----------------------------------------------------------------


@pytest.mark.parametrize("n", [2_400, 3_000, 10_000])
def test_chained_grammars_are_400s_and_the_server_lives(server, n):
    msg = refused(post(server, {"grammar": lark_chain(n)}), "grammar")
    assert str(GRAMMAR_MAX_DEPTH) in msg or str(GRAMMAR_MAX_RULES) in msg
    refused(post(server, {"grammar": gbnf_chain(n)}), "grammar")
    refused(post(server, {"response_format": schema_format(defs_chain(n))}), "response_format.json_schema.schema")
    r = post(server, {"tools": tool({"type": "object", "properties": {"a": defs_chain(n)}}), "tool_choice": "required"})
    refused(r, "tools[0].function.parameters")
    alive(server)


def test_grammars_at_the_depth_bound_compile_and_run(server):
    """The bound is below the crash point: a chain just inside it compiles and generates (in the
    server's process too, after the worker's check), and the server lives."""
    n = GRAMMAR_MAX_DEPTH - 10
    for body in ({"grammar": lark_chain(n)}, {"grammar": gbnf_chain(n)},
                 {"response_format": schema_format(defs_chain(n - 10))}):
        r = post(server, {**body, "max_tokens": 4})
        assert r.status_code == 200, r.text
    alive(server)


# -- 3. grammars nothing can follow: 400s in one sentence, before any stream starts ------------------------


UNFOLLOWABLE = [
    ("response_format", {"$ref": "#"}),
    ("response_format", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    ("response_format", {"type": "string", "pattern": "^(x{1000}){1000}$"}),
    ("grammar", "root ::= root"),
    ("grammar", 'start: %json {"$ref": "#"}'),
    ("response_format", {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}),
    ("tools", {"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}),
]


@pytest.mark.parametrize("where,what", UNFOLLOWABLE, ids=[f"{w}-{i}" for i, (w, _) in enumerate(UNFOLLOWABLE)])
@pytest.mark.parametrize("stream", [False, True])
def test_grammars_nothing_can_follow_are_400s_naming_the_field(server, where, what, stream):
    if where == "response_format":
        body, field = {"response_format": schema_format(what)}, "response_format.json_schema.schema"
    elif where == "grammar":
        body, field = {"grammar": what}, "grammar"
    else:
        body, field = {"tools": tool(what), "tool_choice": "required"}, "tools[0].function.parameters"
    msg = refused(post(server, {**body, "stream": stream}), field)
    if where == "response_format" and "pattern" in json.dumps(what):
        assert "too complex" in msg
    assert json.dumps(what)[:20] not in msg   # the grammar text is not echoed back
    before = server.metrics().get("pyllama_kv_internal_errors_total", 0)
    assert post(server, {**body, "stream": stream}).status_code == 400   # cached refusal: the same answer
    assert server.metrics().get("pyllama_kv_internal_errors_total", 0) == before


def test_an_endless_grammar_stops_with_length(server):
    """``root ::= "a" root`` can never end: the answer is cut with ``length`` (README's promise), not
    a 500 — at max_tokens, or where llguidance's parser limit stops an endless forced run."""
    for stream in (False, True):
        r = post(server, {"grammar": 'root ::= "a" root', "max_tokens": 6, "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: {")]
            assert not any("error" in e for e in events), events
            finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
            text = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
        else:
            choice = r.json()["choices"][0]
            finish, text = [choice["finish_reason"]], choice["message"]["content"]
        assert finish == ["length"], r.text
        assert text and set(text) == {"a"}, text
    r = post(server, {"grammar": 'root ::= "a" root | "a"', "max_tokens": 6})   # one that can end: fine
    assert r.status_code == 200 and set(r.json()["choices"][0]["message"]["content"]) == {"a"}


def test_a_grammar_that_breaks_while_generating_is_a_400_or_an_error_event(server):
    """Past a free first choice, a pattern too complex for llguidance's lexer: not a 200 cut with
    ``length`` (that is only for an endless forced run) but a 400 naming the field, or, once
    streaming, an SSE error event naming it."""
    schema = {"type": "string", "pattern": "^(a|b|c|d|e|f|g|h)(x{1000}){1000}$"}
    field = "response_format.json_schema.schema"
    msg = refused(post(server, {"response_format": schema_format(schema), "max_tokens": 16}), field)
    assert "too complex" in msg
    r = post(server, {"response_format": schema_format(schema), "max_tokens": 16, "stream": True})
    assert r.status_code == 200
    errors = [json.loads(line[6:])["error"] for line in r.text.splitlines()
              if line.startswith("data: {") and '"error"' in line]
    assert len(errors) == 1 and errors[0]["param"] == field, r.text
    assert not any(w in errors[0]["message"] for w in INTERNALS), errors
    alive(server)


LEAKY = [  # (body, field, what the answer must not carry)
    ({"grammar": "start: < [99999999] >"}, "grammar", "lexer error"),
    ({"grammar": "root ::= <[99999999]>"}, "grammar", "root ::="),
    ({"grammar": "start: <|endoftext|> <|nonexistent|>"}, "grammar", "<|endoftext|>"),
    ({"grammar": "start: /(?<=a)b/"}, "grammar", "(?<=a)b"),
    ({"response_format": schema_format({"type": "string", "pattern": "(("})}, "response_format.json_schema.schema",
     "(("),
]


@pytest.mark.parametrize("body,field,secret", LEAKY, ids=[str(i) for i in range(len(LEAKY))])
def test_refusals_carry_no_internals_and_no_grammar_text(server, body, field, secret):
    msg = refused(post(server, body), field)
    assert secret not in msg and "\u27e6" not in msg and "\u27e6" not in msg, msg
    assert len(msg) < 300


@pytest.mark.parametrize("style", ["percent", "absolute-id", "relative-id"])
def test_ref_chains_the_bounds_used_to_miss_are_refused_by_them(server, style):
    """``$ref`` forms llguidance follows: a percent-encoded pointer, absolute and relative ``$id``s.
    A 3,000-link chain of each crashed llguidance (in a worker): the bounds see it now."""
    n = 3_000
    if style == "percent":
        defs: dict = {f"d{i}": {"$ref": f"#/%24defs/d{i + 1}"} for i in range(n)}
        root = "#/%24defs/d0"
    else:
        name = (lambda i: f"http://x/d{i}") if style == "absolute-id" else (lambda i: f"d{i}")
        defs = {f"d{i}": {"$id": name(i), "$ref": name(i + 1)} for i in range(n)}
        root = name(0)
    defs[f"d{n}"] = {"type": "string", **({"$id": f"http://x/d{n}" if style == "absolute-id" else f"d{n}"}
                                             if style != "percent" else {})}
    msg = refused(post(server, {"response_format": schema_format({"$defs": defs, "$ref": root})}),
                  "response_format.json_schema.schema")
    assert "levels deep" in msg and "crashed" not in msg, msg
    msg = refused(post(server, {"response_format": schema_format({"$ref": "#/nowhere"})}),
                  "response_format.json_schema.schema")
    assert "names no schema" in msg


def test_tool_parameters_with_local_refs_keep_their_meaning(server):
    """Pydantic writes ``$defs`` and ``#/$defs/...`` refs: embedded in the call's schema, they still
    resolve against the tool's own parameters."""
    params = {"type": "object", "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                "required": ["x"], "additionalProperties": False}},
              "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"], "additionalProperties": False}
    r = post(server, {"tools": tool(params), "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 64})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls", r.text
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert isinstance(json.loads(call["arguments"])["p"]["x"], int), call


def test_schema_true_is_a_schema(server):
    r = post(server, {"response_format": schema_format(True), "max_tokens": 6})
    assert r.status_code == 200, r.text


# -- 4. token ids of any size ------------------------------------------------------------------------------


@pytest.mark.parametrize("tid", [49152, 2**31 - 1, 2**31, 2**63, 2**64, 10**30])
def test_token_ids_of_any_size_are_400s(server, tid):
    msg = refused(post(server, {"logit_bias": {str(tid): 5}}), "logit_bias")
    assert "out of range" in msg
    r = post(server, {"prompt": [1, tid]}, path="/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    refused(post(server, {"grammar": f"start: <[{tid}]>"}), "grammar")
    refused(post(server, {"grammar": f"start: <[^{tid}]>"}), "grammar")
    alive(server)


def test_token_references_are_read_as_the_grammar_reads_them(server):
    """``<[n]>`` inside a string or a comment is text, not a token reference."""
    r = post(server, {"grammar": 'start: "<[99999]>" // <[99999]>\n', "max_tokens": 12})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "<[99999]>", r.text


# -- the library: bounds, the worker's limits ----------------------------------------------------------


def test_bounds_refuse_before_llguidance():
    with pytest.raises(GrammarError, match="levels deep"):
        Grammar.lark(lark_chain(GRAMMAR_MAX_DEPTH + 5))
    with pytest.raises(GrammarError, match="rules"):
        Grammar.gbnf(gbnf_chain(GRAMMAR_MAX_RULES + 5))
    with pytest.raises(GrammarError, match="levels deep"):
        Grammar.json_schema(defs_chain(GRAMMAR_MAX_DEPTH + 5))
    with pytest.raises(GrammarError, match="nests too deeply"):
        Grammar.json_schema("[" * 100_000 + "]" * 100_000)
    with pytest.raises(GrammarError, match="characters"):
        Grammar.regex("x" * (1 << 20))
    # rules referred to from many places are not a chain; a cycle is counted once
    Grammar.lark("start: a b a b\n" + "".join(f'{c}: "{c}" | start\n' for c in "ab"))
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}
    Grammar.json_schema({"$defs": {"t": tree}, "$ref": "#/$defs/t"})
    assert _grammar_check.token_references("lark", "start: <[12]> <[5-9,100]>") == [12, 5, 9, 100]


def stalled_worker(pool, memory_limit: int):
    """A worker of ``pool`` that never answers (stopped with SIGSTOP), put back as the pool's next idle
    one: whatever a job costs, it runs past any time limit (no grammar has to be slower than a bound)."""
    w = pool.acquire(memory_limit, 2)
    os.kill(w.proc.pid, signal.SIGSTOP)
    pool.release(w, reuse=True)
    return w


def bounded(fn, *args, **kw):
    """``fn(*args, **kw)`` in a thread, bounded at 60 s: a call that would wait forever fails the test."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kw)
        except BaseException as e:   # (re-raised below, in the test's thread)
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the call waited on a worker that will never answer"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_worker_past_its_time_limit_is_killed_and_a_cancelled_one_too():
    """A worker that does not answer within the job's time limit is killed and the job refused; a job
    whose client left (cancel set) is cancelled and its worker killed; a new worker then does the job.
    The late workers are stopped ones (SIGSTOP), so that no grammar has to outlast a clock."""
    slow = {"kind": "gbnf", "source": gbnf_chain(GRAMMAR_MAX_DEPTH - 20)}
    pool = _template_worker.GRAMMAR_POOL
    killed = pool.killed
    late = [stalled_worker(pool, 2 << 30)]
    try:
        got = bounded(_template_worker.grammar_job, slow, time_limit=0.05, memory_limit=2 << 30)
        assert "takes more than 0.05 s" in got["error"]
        assert pool.killed == killed + 1 and late[0].proc.poll() == -signal.SIGKILL
        cancel = threading.Event()
        cancel.set()
        late.append(stalled_worker(pool, 2 << 30))
        with pytest.raises(_template_worker.Cancelled):
            bounded(_template_worker.grammar_job, slow, time_limit=30, memory_limit=2 << 30, cancel=cancel)
        assert pool.killed == killed + 2 and late[1].proc.poll() == -signal.SIGKILL
    finally:
        for w in late:   # (a failed test leaves no stopped worker to the tests after it)
            if w.proc.poll() is None:
                w.proc.kill()
    got = bounded(_template_worker.grammar_job, slow, time_limit=60, memory_limit=2 << 30)   # a new worker does it
    assert isinstance(got.get("text"), str), got
    assert pool.killed == killed + 2


def test_the_grammar_cache_keeps_verdicts_and_compiles_a_grammar_once(real_model, monkeypatch):
    """Verdicts of many tools' parameters are kept (70 schemas: a second pass costs no worker), and
    threads asking for one grammar at once compile it once."""
    import pyllama_kv as pk
    from pyllama_kv.sampling import grammar as constrain

    calls = []
    real_check, real_compile = constrain.check_in_worker, constrain.compile_grammar
    monkeypatch.setattr(constrain, "check_in_worker", lambda *a, **k: calls.append("check") or real_check(*a, **k))
    monkeypatch.setattr(constrain, "compile_grammar", lambda *a, **k: calls.append("compile") or real_compile(*a, **k))
    with pk.Model(real_model) as model:
        cache = constrain.GrammarCache(model)
        schemas = [Grammar.json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"}}})
                   for i in range(70)]
        for g in schemas * 2:
            cache.check(g)
        assert calls.count("check") == 70
        bad = Grammar.json_schema({"$ref": "#"})
        for _ in range(2):
            with pytest.raises(GrammarError, match="nothing can follow"):
                cache.compile(bad)
        assert calls.count("compile") == 1
        one = Grammar.gbnf(gbnf_chain(300))
        out: list = []
        threads = [threading.Thread(target=lambda: out.append(cache.compile(one))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(out) == 4 and all(o is out[0] for o in out)
        assert calls.count("compile") == 2


def test_llguidance_errors_in_one_sentence():
    assert "nothing can follow" in _grammar_check.plain("NoExtensionBias <non-verbose/>")
    assert "too complex" in _grammar_check.plain("parser error: Too many items (limit 50000; ff_tokens)")
    msg = _grammar_check.plain("at 1(8): Token range end too large: 300\n   1 | start: <[300]>\n      ^")
    assert msg == "at line 1, column 8: Token range end too large: 300"
    gbnf = "Failed to convert the grammar from GBNF to Lark: Expected name at line 1, 'root ::= ' ^ '<[9]>'"
    assert _grammar_check.plain(gbnf, "gbnf") == "not valid GBNF: Expected name at line 1"
    assert _grammar_check.plain("2(4): Expected value (at \":\" (':'))\n   2 | x: : y", "gbnf") == "Expected value"
