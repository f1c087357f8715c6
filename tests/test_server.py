"""`pyllama-kv serve` on the real model, through the official openai client: chat and completions,
streaming and not, n=3, stop strings, seeds, usage; the errors (400, 401, 404, 413, 429); a client
that goes away mid-stream; 32 concurrent clients; vanilla vs patched under a fragmenting load;
SIGTERM. Every server is a subprocess on 127.0.0.1 (--port 0: the OS picks a free port, the startup
line says which), waited for with bounded loops and always stopped.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from conftest import ENTRY_POINT, ROOT, run_cli

KEY = "test-key"
MODEL = "smollm2-135m-instruct"
SYSTEM = "You are a terse assistant. Answer in one short sentence, without any preamble or pleasantries."
THREADS = "2"


def wait_healthy(root: str, proc: subprocess.Popen, timeout: float) -> bool:
    """Poll ``root``/health until it answers 200 (True), or the process ends or ``timeout`` seconds pass
    (False): a bounded wait for any server a test starts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(root + "/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            return False
        time.sleep(0.2)


class ServerProc:
    """`pyllama-kv serve MODEL ARGS --port 0` in a subprocess; its stderr is read by a thread (so the
    pipe never fills), the URL is taken from its startup line."""

    def __init__(self, model, *args: str, key: str | None = KEY, timeout: float = 120.0):
        cmd = [str(ENTRY_POINT)] if ENTRY_POINT.exists() else [sys.executable, "-m", "pyllama_kv.cli.main"]
        cmd += ["serve", str(model), "--port", "0", "-t", THREADS, *args] + (["--api-key", key] if key else [])
        env = dict(os.environ, GGML_NO_BACKTRACE="1")
        env.pop("PYLLAMA_KV_API_KEY", None)
        self.key = key
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=ROOT)
        self.lines: list[str] = []
        self._url = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self._url.wait(timeout):
            self.stop()
            raise AssertionError("the server printed no URL:\n" + self.log())
        if not wait_healthy(self.root, self.proc, timeout):
            self.stop()
            raise AssertionError("the server did not become healthy:\n" + self.log())

    def __enter__(self) -> ServerProc:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"(http://\S+)/v1", line)
            if m and not self._url.is_set():
                self.url = m.group(1) + "/v1"
                self._url.set()

    @property
    def root(self) -> str:
        return self.url[:-len("/v1")]

    def log(self) -> str:
        return "".join(self.lines)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=kw.pop("api_key", self.key or "none"), max_retries=0,
                             timeout=kw.pop("timeout", 120.0), **kw)

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def metrics(self) -> dict[str, float]:
        r = httpx.get(self.root + "/metrics", headers=self.headers(), timeout=10)
        assert r.status_code == 200, r.text
        out = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def idle_metrics(self, timeout: float = 60.0) -> dict[str, float]:
        """/metrics once nothing runs or waits (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["pyllama_kv_requests_running"] == 0 and m["pyllama_kv_requests_queued"] == 0:
                return m
            assert time.monotonic() < deadline, m
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(real_model, pin_lib):
    """The main server, on each pin's library in turn (issue 32: the server suite on both pins)."""
    with ServerProc(MODEL, "--lib", pin_lib, "--ctx", "2048", "--parallel", "8", "--max-tokens-cap", "256",
                    "--max-body", "65536") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def finished(metrics: dict, reason: str) -> float:
    return metrics[f'pyllama_kv_finished_total{{reason="{reason}"}}']


def chat(client, question: str, system: str | None = SYSTEM, **kw):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return client.chat.completions.create(model=MODEL, messages=msgs, **kw)


def _wait_for(predicate, timeout: float = 30.0) -> None:
    """Until ``predicate()`` (bounded)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# the API


def test_models_health_and_startup_line(server, client, request):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    r = httpx.get(server.root + "/health", timeout=10)   # no key needed
    assert r.status_code == 200 and r.json()["status"] == "ok"
    line = server.lines[0]
    assert server.url.startswith("http://127.0.0.1:")
    pin = request.node.callspec.params["pin_lib"]   # the startup line names the pin's library
    assert MODEL in line and f"library {pin}" in line and "ctx 2048" in line and "parallel 8" in line


def test_chat_and_usage(client):
    r = chat(client, "What is the capital of France?", max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and c.message.content.strip()
    assert c.finish_reason in ("stop", "length")
    u = r.usage
    assert 20 < u.prompt_tokens < 100 and 0 < u.completion_tokens <= 24
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # the same conversation again: its prompt is forked from the cache, all but the last token
    r2 = chat(client, "What is the capital of France?", max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens == u.prompt_tokens
    assert r2.usage.prompt_tokens_details.cached_tokens == u.prompt_tokens - 1


def test_the_next_turn_of_a_chat_reuses_every_cached_token(client):
    """A chat sent back whole with its answer (as every OpenAI client does) starts with the tokens the
    cache holds for the previous turn (the server's Transcripts), streamed or not, so only the new
    message is evaluated: every token of the previous prompt and answer but the undecoded last one."""
    for stream in (False, True):
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Tell me a story about a {'red' if stream else 'blue'} fox."}]
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0)
        assert r.choices[0].finish_reason == "length"   # 20 tokens of a story: the cells are kept
        u = r.usage
        msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
        kw = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, **kw)
        u2 = list(r2)[-1].usage if stream else r2.usage
        assert u2.prompt_tokens_details.cached_tokens == u.prompt_tokens + u.completion_tokens - 1


def test_chat_streaming(client):
    stream = chat(client, "Name three colours.", max_tokens=16, temperature=0, stream=True,
                  stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text.strip() and finishes in (["stop"], ["length"])
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and 0 < usage.completion_tokens <= 16


def test_sse_wire_format_ends_with_done(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url + "/completions", json=body, headers=server.headers(), timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "length"


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    parts = list(client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0,
                                           stream=True))
    assert "".join(p.choices[0].text for p in parts).strip()
    assert parts[-1].choices[0].finish_reason == "length"


def test_n3_forked_continuations(client):
    r = chat(client, "Write a word.", max_tokens=8, temperature=1.0, seed=7, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens >= 3
    chunks = list(chat(client, "Write a word.", max_tokens=8, temperature=1.0, seed=7, n=3, stream=True))
    ends = {ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason}
    assert ends == {0, 1, 2}


def test_stop_strings(client):
    for stop in (",", [",", "\n"]):
        r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=24, temperature=0, stop=stop)
        c = r.choices[0]
        assert c.finish_reason == "stop" and "," not in c.text, c
    r = chat(client, "Count from 1 to 10, separated by commas.", max_tokens=40, temperature=0, stop=["5"])
    assert "5" not in r.choices[0].message.content and r.choices[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def small(real_model, pin_lib):
    """One request at a time, one waiting, no prefix cache: every request starts from an empty cache."""
    with ServerProc(MODEL, "--lib", pin_lib, "--ctx", "512", "--parallel", "1", "--max-queue", "1",
                    "--prefix-cache", "0", "--shutdown-grace", "30") as s:
        yield s


def test_seed_reproducibility(small):
    """Same seed and temperature, same text. With quantized weights, where a request's cells lie in
    the cache changes its logits (by up to ~0.5 here: the activations are quantized too), so the
    runs are compared on a server without a prefix cache, where each starts from an empty cache."""
    c = small.client()

    def text(seed: int) -> str:
        return chat(c, "Tell me a story.", max_tokens=24, temperature=0.9, seed=seed).choices[0].message.content

    a, b = text(1234), text(1234)
    assert a == b and a.strip()
    assert len({a, text(1), text(2)}) > 1   # the seed matters


# ---------------------------------------------------------------------------------------------
# errors


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    return err


def test_bad_requests_get_400(server, client):
    url, h = server.url + "/chat/completions", server.headers()
    _error(httpx.post(url, content=b"{not json", headers={**h, "content-type": "application/json"}, timeout=30), 400)
    _error(httpx.post(url, json=[1, 2], headers=h, timeout=30), 400)
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for field, value in (("temperature", 5), ("temperature", "hot"), ("top_p", 0), ("n", 0), ("n", 9),
                         ("max_tokens", 0), ("max_tokens", 100000), ("stop", 3), ("seed", 2**64), ("stream", "yes"),
                         ("messages", "hi"), ("messages", [{"content": "no role"}]), ("top_k", -1), ("min_p", 2)):
        err = _error(httpx.post(url, json={**good, field: value}, headers=h, timeout=30), 400)
        assert err["param"] and err["param"].split("[")[0] == field, (field, err)
    del good["model"]
    assert _error(httpx.post(url, json=good, headers=h, timeout=30), 400)["param"] == "model"
    # unknown fields are refused, naming the field (nothing is silently ignored); user is accepted
    r = httpx.post(url, json={**good, "model": MODEL, "frobnicate": 1, "user": "x"}, headers=h, timeout=60)
    assert _error(r, 400)["param"] == "frobnicate"
    r = httpx.post(url, json={**good, "model": MODEL, "user": "x"}, headers=h, timeout=60)
    assert r.status_code == 200, r.text
    # a prompt longer than the context
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="word " * 3000, max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    # through the client too
    with pytest.raises(openai.BadRequestError):
        chat(client, "hi", temperature=3.0)


def test_body_size_cap(server):
    r = httpx.post(server.url + "/completions", json={"model": MODEL, "prompt": "x" * 70000},
                   headers=server.headers(), timeout=30)
    _error(r, 413)


def test_api_key_required(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
              {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"}):
        r = httpx.post(server.url + "/chat/completions", json={"model": MODEL, "messages": []}, headers=h, timeout=30)
        assert _error(r, 401)["code"] == "invalid_api_key"
    for h in (f"bearer {KEY}", f"BEARER  {KEY}"):   # the scheme is case-insensitive
        assert httpx.get(server.url + "/models", headers={"Authorization": h}, timeout=10).status_code == 200
    assert httpx.get(server.root + "/metrics", timeout=10).status_code == 401


def test_unknown_model_or_path_get_404(server, client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    _error(httpx.get(server.url + "/nothing-here", headers=server.headers(), timeout=10), 404)
    _error(httpx.get(server.url + "/models/gpt-4", headers=server.headers(), timeout=10), 404)


# ---------------------------------------------------------------------------------------------
# nothing lost, nothing leaked


def test_disconnect_mid_stream_frees_cells(server, client):
    prompt = "Write a very long essay about the history of the bicycle, with many details."

    def stream_and_leave(n_chunks: int) -> None:
        stream = chat(client, prompt, max_tokens=256, temperature=0.7, seed=1, stream=True)
        for i, _ in enumerate(stream):
            if i >= n_chunks:
                break
        stream.close()   # the client goes away

    stream_and_leave(3)   # its prompt is now a cached prefix: the baseline holds it
    base = server.idle_metrics()
    stream_and_leave(20)
    after = server.idle_metrics()
    assert after["pyllama_kv_kv_used_cells"] == base["pyllama_kv_kv_used_cells"], (base, after)
    assert after["pyllama_kv_kv_request_cells"] == 0
    assert finished(after, "cancelled") >= finished(base, "cancelled") + 1
    assert after["pyllama_kv_completion_tokens_total"] - base["pyllama_kv_completion_tokens_total"] < 256


def test_clients_that_leave_are_counted_not_logged(server, client):
    """A client that leaves a stream, or stops waiting for a non-streaming answer: each is one
    counted client disconnect (stage "generating"), no internal error, nothing in the log."""
    key = 'pyllama_kv_client_disconnects_total{stage="generating"}'
    prompt = "Write a very long essay about the history of the bicycle, with many details."
    base = server.idle_metrics()
    n_lines = len(server.lines)
    stream = chat(client, prompt, max_tokens=256, temperature=0.7, seed=2, stream=True)
    for i, _ in enumerate(stream):
        if i >= 3:
            break
    stream.close()
    _wait_for(lambda: server.metrics()[key] >= base[key] + 1)
    body = {"model": MODEL, "max_tokens": 256, "temperature": 0.7, "seed": 3,
            "messages": [{"role": "user", "content": prompt}]}
    with pytest.raises(httpx.ReadTimeout):   # it stops waiting: httpx closes the connection
        httpx.post(server.url + "/chat/completions", json=body, headers=server.headers(), timeout=0.5)
    _wait_for(lambda: server.metrics()[key] >= base[key] + 2)
    after = server.idle_metrics()
    assert after[key] == base[key] + 2 and after["pyllama_kv_kv_request_cells"] == 0
    assert after["pyllama_kv_internal_errors_total"] == 0
    log = "".join(server.lines[n_lines:])
    assert "Traceback" not in log and "ERROR" not in log, log


def test_concurrent_requests_share_a_new_system_prompt(client):
    """Requests that arrive together with one long system prompt: it is evaluated once (the others
    wait for it and fork it), not once per request."""
    system = "You answer questions about the planets of the solar system, briefly and accurately. " * 12

    def one(i: int):
        return chat(client, f"Tell me about planet number {i}.", system=system, max_tokens=4, temperature=0).usage

    with ThreadPoolExecutor(6) as pool:
        usages = list(pool.map(one, range(6)))
    evaluated = sum(u.prompt_tokens - u.prompt_tokens_details.cached_tokens for u in usages)
    assert usages[0].prompt_tokens > 200
    assert evaluated < 2 * usages[0].prompt_tokens, [(u.prompt_tokens, u.prompt_tokens_details.cached_tokens)
                                                     for u in usages]


def test_32_concurrent_clients(server, client):
    def one(i: int) -> str:
        system = SYSTEM if i % 2 == 0 else None
        question = f"Give me one fact about the number {i}."
        if i % 3 == 0:
            text = ""
            for ch in chat(client, question, system=system, max_tokens=12, temperature=0.5, seed=i, stream=True):
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    assert ch.choices[0].finish_reason in (None, "stop", "length")
            return text
        if i % 3 == 1:
            r = client.completions.create(model=MODEL, prompt=f"Fact {i}:", max_tokens=12, temperature=0)
            assert r.choices[0].finish_reason in ("stop", "length")
            return r.choices[0].text
        r = chat(client, question, system=system, max_tokens=12, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
        return r.choices[0].message.content

    before = server.idle_metrics()
    with ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(one, range(32)))
    assert len(texts) == 32 and sum(bool(t.strip()) for t in texts) >= 28
    after = server.idle_metrics()
    assert httpx.get(server.root + "/health", timeout=10).status_code == 200
    assert after["pyllama_kv_kv_request_cells"] == 0
    assert after["pyllama_kv_kv_used_cells"] == after["pyllama_kv_kv_cached_cells"]
    assert sum(finished(after, r) - finished(before, r) for r in ("stop", "eos", "length")) == 32
    assert finished(after, "error") == finished(after, "cache_full") == 0
    # the shared system prompt was evaluated once and forked
    assert after["pyllama_kv_prompt_tokens_reused_total"] - before["pyllama_kv_prompt_tokens_reused_total"] > 200
    ttft = "pyllama_kv_time_to_first_token_seconds_count"
    assert after[ttft] >= before[ttft] + 32


# ---------------------------------------------------------------------------------------------
# the queue, shutdown


def test_full_queue_gets_429_and_sigterm_exits_0(small):
    """Last on the small server: it ends with SIGTERM. One request runs (a count the model goes on with
    to max_tokens), one waits (the queue holds one), so a third is refused: each state is seen in
    /metrics before the next request is sent, so the order does not depend on timing."""
    s = small
    c = s.client()
    count = dict(model=MODEL, prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", max_tokens=200, temperature=0)

    def until(what, pred) -> None:
        deadline = time.monotonic() + 60   # bounds the loop only
        while not pred(s.metrics()):
            assert time.monotonic() < deadline, what
            time.sleep(0.02)

    base = s.metrics()["pyllama_kv_requests_submitted_total"]
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(c.completions.create, **count)
        until("the first request admitted", lambda m: m["pyllama_kv_requests_submitted_total"] >= base + 1)
        waiting = pool.submit(c.completions.create, **{**count, "max_tokens": 8})   # (queued: its length is not needed)
        until("the second request queued or admitted",
              lambda m: m["pyllama_kv_requests_submitted_total"] >= base + 2)
        until("the second request queued", lambda m: m["pyllama_kv_requests_queued"] == 1)
        assert s.metrics()["pyllama_kv_requests_running"] == 1   # the first has ~200 tokens to go
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=MODEL, prompt="Refused:", max_tokens=4, temperature=0)
        assert e.value.response.headers.get("retry-after") and e.value.code == "queue_full"
        assert s.metrics()["pyllama_kv_requests_rejected_total"] >= 1
        done = [running.result(timeout=120), waiting.result(timeout=120)]
    assert all(o.choices[0].finish_reason in ("stop", "length") for o in done)
    # SIGTERM while a request runs: it still finishes (within the grace time), then exit 0
    with ThreadPoolExecutor(1) as pool:
        base = s.metrics()["pyllama_kv_requests_submitted_total"]
        fut = pool.submit(c.completions.create, **{**count, "max_tokens": 48})   # well within the grace
        until("the last request admitted", lambda m: m["pyllama_kv_requests_submitted_total"] >= base + 1)
        s.proc.send_signal(signal.SIGTERM)
        r = fut.result(timeout=120)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
    assert s.stop() == 0, s.log()
    assert "Traceback" not in s.log()


def test_sigterm_repeated_during_the_shutdown_still_exits_0(tiny_model):
    """A supervisor that repeats SIGTERM until the process is gone: exit code 0 whenever the repeats
    arrive (the default handler was put back before the engine closed, and a repeat then ended the
    process by the signal: -15, seen once in the suite)."""
    s = ServerProc(tiny_model, "--ctx", "256", "--parallel", "1", key=None)
    try:
        sent, deadline = 0, time.monotonic() + 60   # bounds the loop only
        while s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
            sent += 1
            assert time.monotonic() < deadline, "the server did not stop"
            time.sleep(0.002)
        assert s.proc.returncode == 0 and sent > 1, (sent, s.log())
        log = s.log()
        assert "Traceback" not in log, log[-4000:]   # (whole: the diff pytest shows cuts the frames)
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------------
# a careless or hostile client, on a tiny model (a server that starts in seconds)

ECHO_TEMPLATE = ("{%- for m in messages %}{%- if m['role'] not in ['system', 'user', 'assistant'] %}"
                 "{{ raise_exception('Unknown role: ' + m['role']) }}{%- endif %}"
                 "<|{{ m['role'] }}|>{{ m['content'] }}{%- endfor %}{%- if add_generation_prompt %}<|assistant|>"
                 "{%- endif %}")


@pytest.fixture(scope="module")
def tiny(models):
    """A tiny model whose template raises on unknown roles, quoting the role; 1 s to send a body."""
    from pyllama_kv.tools.gguf import make_tiny_model

    path = make_tiny_model(models / "echo-role.gguf", kv_overrides={"tokenizer.chat_template": ECHO_TEMPLATE})
    with ServerProc(path, "--ctx", "256", "--body-timeout", "1", key=None) as s:
        yield s


def test_template_errors_and_odd_values(tiny):
    url = tiny.url + "/chat/completions"

    def post(body: bytes) -> httpx.Response:
        return httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)

    msg = '{"model": "echo-role", "max_tokens": 2, "messages": [{"role": "%s", "content": "hi"}]%s}'
    err = _error(post((msg % ("robot", "")).encode()), 400)   # the template's own message
    assert "Unknown role: robot" in err["message"] and err["param"] == "messages"
    # a lone surrogate (valid JSON) quoted back in an error message: still a 400, not a 500
    err = _error(post((msg % ("x\\ud800", "")).encode()), 400)
    assert "Unknown role: x" in err["message"]
    for seed in (-3, 2**40, 2**64 - 1):   # OpenAI's seeds are 64-bit
        assert post((msg % ("user", f', "seed": {seed}, "temperature": 1')).encode()).status_code == 200
    for extra in (', "n": 0', ', "stop": [1]', ', "seed": 18446744073709551616', ', "temperature": NaN'):
        _error(post((msg % ("user", extra)).encode()), 400)
    # text content parts (what OpenAI clients send today), but no images
    r = tiny.client().chat.completions.create(model="echo-role", max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]}])
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client().chat.completions.create(model="echo-role", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}])
    assert e.value.param == "messages[0].content[0]"
    assert httpx.head(url, timeout=10).status_code == 405
    _error(httpx.get(url, timeout=10), 405)
    assert httpx.get(tiny.root + "/health", timeout=10).status_code == 200


def test_half_sent_body_gets_408(tiny):
    """A client that stops sending its body (slowloris) gets 408 after --body-timeout, and the
    connection is closed; the server keeps serving."""
    host, port = tiny.root[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=15) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\":")
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            part = s.recv(4096)   # bounded by the socket's timeout
            if not part:
                break
            data += part
    assert data.startswith(b"HTTP/1.1 408 "), data
    assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "timeout"
    assert httpx.get(tiny.root + "/health", timeout=10).status_code == 200


def test_half_a_body_then_gone_is_a_quiet_disconnect(tiny):
    """A client that sends half of its Content-Length and closes: a counted client disconnect, with
    no traceback in the log and no internal error; the server keeps serving."""
    host, port = tiny.root[len("http://"):].rsplit(":", 1)
    key = 'pyllama_kv_client_disconnects_total{stage="body"}'
    before = tiny.metrics()
    n_lines = len(tiny.lines)
    for path in (b"/v1/chat/completions", b"/v1/completions"):
        with socket.create_connection((host, int(port)), timeout=15) as s:
            s.sendall(b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 500\r\n\r\n{\"model\": \"echo-role\", \"messages\": [")
        # closed: the server is reading the other 460 bytes
    _wait_for(lambda: tiny.metrics().get(key, 0) >= before.get(key, 0) + 2 or "Traceback" in tiny.log(), 30)
    time.sleep(0.5)   # anything it would log about it is logged by now
    log = "".join(tiny.lines[n_lines:])
    assert "Traceback" not in log and "ClientDisconnect" not in log and "ERROR" not in log, log
    after = tiny.metrics()
    assert after[key] == before[key] + 2
    assert after["pyllama_kv_internal_errors_total"] == before["pyllama_kv_internal_errors_total"] == 0
    assert httpx.get(tiny.root + "/health", timeout=10).status_code == 200


def test_api_key_must_fit_in_a_header():
    from pyllama_kv.errors import InvalidInputError
    from pyllama_kv.server import ServerConfig

    for key in ("clé", "two words", "tab\t", ""):
        with pytest.raises(InvalidInputError):
            ServerConfig(api_key=key)
    assert ServerConfig(api_key="sk-abc_123.~").api_key == "sk-abc_123.~"


# ---------------------------------------------------------------------------------------------
# vanilla vs patched under the same fragmenting load


N_FRAGMENTING = 32   # requests of the fragmenting load, 24 at a time


def _fragmenting_load(s: ServerProc) -> tuple[int, list]:
    """Many concurrent completions of varied prompt and answer lengths in a small cache: (ok, errors)."""
    c = s.client()
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()

    def one(i: int):
        prompt = " ".join(words[(i * 7 + k) % len(words)] for k in range(8 + (i * 37) % 90))
        try:
            r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=4 + (i * 13) % 40, temperature=0)
            return r.choices[0].finish_reason
        except openai.APIStatusError as e:
            return e

    with ThreadPoolExecutor(24) as pool:
        out = list(pool.map(one, range(N_FRAGMENTING)))
    errors = [o for o in out if isinstance(o, Exception)]
    return len(out) - len(errors), errors


@pytest.mark.parametrize("lib", ["vanilla", "patched"])
def test_fragmenting_load_vanilla_vs_patched(real_model, lib):
    s = ServerProc(MODEL, "--lib", lib, "--ctx", "640", "--parallel", "8", "--batch", "256", "--prefix-cache", "0",
                   key=None)
    try:
        ok, errors = _fragmenting_load(s)
        m = s.idle_metrics()
        assert s.proc.poll() is None and httpx.get(s.root + "/health", timeout=10).status_code == 200
        assert m["pyllama_kv_kv_used_cells"] == 0
        if lib == "patched":
            assert not errors and m["pyllama_kv_slot_failures_total"] == 0, errors
            assert m["pyllama_kv_kv_library_slot_failures_total"] == 0
        else:   # each failure is a clear error of its own request; the rest completed
            assert m["pyllama_kv_slot_failures_total"] > 0 and errors, m
            for e in errors:
                assert e.status_code == 503 and e.code == "kv_cache_full" and "fragmented" in e.message, e
            assert ok + len(errors) == N_FRAGMENTING
        assert s.stop() == 0
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------------
# --template: a chat template for a model without one (or instead of its own)

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_a_template_file_serves_chats_for_a_model_without_one(tiny_model, tmp_path):
    """The tiny model has no chat template: chats get a 400 saying so; with --template FILE the server
    renders every chat (and /apply-template) with it: the prompt is that rendering's tokens. A template
    that fails or is refused stops the start with one line naming the file."""
    import pyllama_kv as pk

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cache"}]
    body = {"model": "tiny", "messages": msgs, "max_tokens": 4, "temperature": 0}
    with ServerProc(tiny_model, "--ctx", "256", "--parallel", "1", key=None) as s:
        r = httpx.post(s.url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "has no chat template" in r.json()["error"]["message"], r.text
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    with ServerProc(tiny_model, "--ctx", "256", "--parallel", "1", "--template", str(tmp_path / "t.jinja"),
                    key=None) as s:
        text = httpx.post(s.root + "/apply-template", json={"messages": msgs}, timeout=60).json()["prompt"]
        assert text == "<system>be brief\n<user>the cache\n<assistant>"
        r = httpx.post(s.url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        with pk.Model(tiny_model) as m:
            assert r.json()["usage"]["prompt_tokens"] == len(m.tokenize(text, special=True))
        log = s.log()
        assert "Traceback" not in log, log[-4000:]   # (whole: the diff pytest shows cuts the frames)
    for bad, why in (("{{ raise_exception('no') }}", "no"), ("{{ cycler.__init__.__globals__ }}", "refused")):
        (tmp_path / "bad.jinja").write_text(bad)
        r = run_cli(["serve", str(tiny_model), "--port", "0", "--template", str(tmp_path / "bad.jinja")], timeout=120)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and len(lines) == 1 and "bad.jinja" in lines[0] and why in lines[0], r.stderr
