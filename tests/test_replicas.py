"""`serve --replicas` on Ray Serve (issue 48): two engine replicas of the real model behind one
ingress on a local Ray (127.0.0.1, a free port, shut down at the end of the module).

* routing follows the cache: every later turn of a conversation goes to the replica that served
  its first turn and reuses the conversation so far there;
* a replica killed (SIGKILL) mid-load: each of its in-flight requests ends with a clear retryable
  error (a stream's ``error`` event, or a 503 with Retry-After), never a hang; the other replica
  keeps serving; Ray starts a new replica within 60 s, which takes new prefixes;
* the replicas share a disk tier (``cache_dir``): a conversation paged out to it is every replica's,
  and goes on where its blocks are nearer (cells, then host memory);
* the HTTP surface is the server's: errors, the API key, streaming, /v1/models;
* the CLI: `serve --replicas` refuses what it does not take, in one line.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT

ray = pytest.importorskip("ray", reason="the replicas extra (ray[serve]) is installed by `make setup`")
from ray import serve  # noqa: E402

from pyllama_kv.replicas.ray_serve import APP_NAME, REPLICA_HEADER, ReplicaSpec, application  # noqa: E402

httpx = pytest.importorskip("httpx")

SYSTEMS = [f"You are assistant number {i}. " + ("Answer briefly, kindly and in plain words. " * 6) +
           f"Your favourite colour is {c}." for i, c in enumerate(["red", "green", "blue", "amber"])]
BOUND = 120.0   # seconds any one wait in this module may take


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_pair() -> int:
    """A port P with P + 1 free too (the two replicas' KV-event endpoints)."""
    import socket

    for _ in range(50):
        p = _free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two free ports in a row")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, real_model):
    """A local Ray with Serve's proxy on 127.0.0.1 and the application: 2 replicas of the real model,
    a shared disk tier, routed by cache (reports every 0.25 s)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    port, events = _free_port(), _free_pair()
    ray.init(num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cache_dir = tmp_path_factory.mktemp("spans")
        spec = ReplicaSpec(model=str(real_model), names=("smol",),
                           engine={"n_ctx": 2048, "parallel": 4, "n_threads": 1, "prefix_cache": 2,
                                   "cache_dir": str(cache_dir)},
                           server={"api_key": "k", "kv_events": f"tcp://127.0.0.1:{events}"})
        serve.run(application(spec, replicas=2, stats_period=0.25), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}", cache_dir, events
    finally:
        serve.shutdown()
        ray.shutdown()


def _chat(client, url, messages, max_tokens=8, **kw):
    return client.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer k"},
                       json={"model": "smol", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw})


def _replicas() -> dict[str, int]:
    """The live engine replicas: Ray Serve's replica id -> the pid of its process."""
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if "EngineReplica" in a["name"]:
            try:
                h = ray.get_actor(a["name"], namespace=a["namespace"])
                out[a["name"].rsplit("#", 1)[-1]] = ray.get(h.__ray_call__.remote(lambda self: os.getpid()), timeout=10)
            except Exception:   # noqa: BLE001 - a dead one, or one not up yet
                continue
    return out


def test_turns_follow_their_cache(cluster):
    url = cluster[0]
    convs = [[{"role": "system", "content": s}] for s in SYSTEMS for _ in range(2)]
    served: list[list[str]] = [[] for _ in convs]
    held = [0] * len(convs)   # tokens of each conversation so far (its last prompt and answer)
    with httpx.Client(timeout=BOUND) as c:
        for turn in range(3):
            for i, msgs in enumerate(convs):
                msgs.append({"role": "user", "content": f"Question {turn} of conversation {i}: name a fruit."})
                r = _chat(c, url, msgs)
                assert r.status_code == 200, r.text
                served[i].append(r.headers[REPLICA_HEADER])
                body = r.json()
                usage = body["usage"]
                if turn:   # the conversation so far is cached where its earlier turns were
                    assert usage["prompt_tokens_details"]["cached_tokens"] >= held[i] - 1, (i, turn, usage)
                held[i] = usage["prompt_tokens"] + usage["completion_tokens"]
                msgs.append(body["choices"][0]["message"])
    for i, reps in enumerate(served):
        assert len(set(reps)) == 1, (i, reps)   # every turn on one replica


def test_http_surface_is_the_servers(cluster):
    url = cluster[0]
    with httpx.Client(timeout=BOUND) as c:
        assert c.get(f"{url}/v1/models").status_code == 401   # the API key, checked by the replica
        r = c.get(f"{url}/v1/models", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "smol"
        r = c.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer k"}, content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = c.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer k"},
                   content=b"x" * ((1 << 20) + 1))
        assert r.status_code == 413, r.text   # refused at the ingress, before any replica
        with c.stream("POST", f"{url}/v1/chat/completions", headers={"Authorization": "Bearer k"},
                      json={"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                            "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            text = r.read().decode()
        assert text.rstrip().endswith("data: [DONE]"), text
        # a stored Responses conversation is continued, read and deleted on the replica that stored it
        auth = {"Authorization": "Bearer k"}
        r = c.post(f"{url}/v1/responses", headers=auth, json={"model": "smol", "input": "Name a planet.",
                                                              "max_output_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        rid, home = r.json()["id"], r.headers[REPLICA_HEADER]
        for k in range(4):
            r = c.post(f"{url}/v1/responses", headers=auth, json={"model": "smol", "input": f"And {k}?",
                                                                  "previous_response_id": rid,
                                                                  "max_output_tokens": 4, "temperature": 0})
            assert r.status_code == 200 and r.headers[REPLICA_HEADER] == home, r.text
            assert r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
            rid = r.json()["id"]
        r = c.get(f"{url}/v1/responses/{rid}", headers=auth)
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == home
        assert c.delete(f"{url}/v1/responses/{rid}", headers=auth).status_code == 200
        assert c.get(f"{url}/v1/responses/{rid}", headers=auth).status_code == 404


def test_each_replica_publishes_its_kv_events(cluster, real_model):
    """`--kv-events tcp://HOST:PORT` with replicas: replica r publishes on PORT + r; the prompt of a
    request appears, as BlockStored blocks with the chained hashes, on the endpoint of a replica."""
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    import pyllama_kv as pk
    from pyllama_kv.prefixcache.events import BlockStored, block_hashes, from_wire
    from pyllama_kv.replicas.keys import RouteKeys

    url, events = cluster[0], cluster[2]
    subs = []
    for p in (events, events + 1):
        s = zmq.Context.instance().socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{p}")
        subs.append(s)
    vocab = pk.Model(real_model, vocab_only=True)
    try:
        keys = RouteKeys(vocab)
        stored: set[int] = set()
        with httpx.Client(timeout=BOUND) as c:
            for k in range(5):   # bounded; a SUB socket misses what was sent before it joined
                msgs = [{"role": "system", "content": f"Events check {k}. " + SYSTEMS[1]},
                        {"role": "user", "content": "Say yes."}]
                assert _chat(c, url, msgs, max_tokens=2).status_code == 200
                want = block_hashes(keys.tokens("/v1/chat/completions",
                                                json_body({"model": "smol", "messages": msgs})), 16)
                for _ in range(100):
                    for s in subs:
                        while s.poll(0):
                            _, _, payload = s.recv_multipart()
                            for e in from_wire(msgpack.unpackb(payload)[1]):
                                if isinstance(e, BlockStored):
                                    stored.update(e.block_hashes)
                    if want[:4] and set(want[:4]) <= stored:
                        return
                    time.sleep(0.05)
        pytest.fail("no replica announced the blocks of a prompt it served")
    finally:
        for s in subs:
            s.close()
        vocab.close()


def json_body(obj) -> bytes:
    import json

    return json.dumps(obj).encode()


def _stream_one(url: str, i: int, out: dict, started: threading.Event, counter: list) -> None:
    body = {"model": "smol", "stream": True, "max_tokens": 400, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEMS[i % len(SYSTEMS)]},
                         {"role": "user", "content": f"Count from 1 to 500, request {i}."}]}
    try:
        with httpx.Client(timeout=BOUND) as c, c.stream("POST", f"{url}/v1/chat/completions", json=body,
                                                        headers={"Authorization": "Bearer k"}) as r:
            out["status"], out["replica"] = r.status_code, r.headers.get(REPLICA_HEADER)
            text = ""
            for chunk in r.iter_text():
                if not out.get("first"):
                    out["first"] = True
                    counter.append(i)
                    if len(counter) == 4:
                        started.set()
                text += chunk
            out["text"] = text
    except Exception as exc:   # noqa: BLE001 - recorded: the test says what went wrong
        out["exc"] = repr(exc)


def test_replica_killed_midload(cluster):
    url = cluster[0]
    before = _replicas()
    assert len(before) == 2, before
    outs: list[dict] = [{} for _ in range(4)]
    started, counter = threading.Event(), []
    threads = [threading.Thread(target=_stream_one, args=(url, i, outs[i], started, counter), daemon=True)
               for i in range(4)]
    for t in threads:
        t.start()
    assert started.wait(BOUND), outs
    victim = outs[0]["replica"]
    os.kill(before[victim], signal.SIGKILL)
    for t in threads:
        t.join(BOUND)
        assert not t.is_alive(), "a request hung after its replica was killed"
    for o in outs:   # every request: a whole answer, or the retryable error event
        assert "exc" not in o and o["status"] == 200, o
        if o["replica"] == victim:
            assert '"code": "replica_failed"' in o["text"] and "event: error" in o["text"], o["text"][-300:]
        else:
            assert o["text"].rstrip().endswith("data: [DONE]"), o["text"][-300:]
    with httpx.Client(timeout=BOUND) as c:   # the other replica serves meanwhile, and Ray brings one back
        deadline = time.monotonic() + 60
        while True:
            r = _chat(c, url, [{"role": "user", "content": "hello"}])
            assert r.status_code in (200, 503), r.text
            after = _replicas()
            if r.status_code == 200 and len(after) == 2 and victim not in after:
                break
            assert time.monotonic() < deadline, f"no second replica within 60 s: {after}"
            time.sleep(0.5)
        if r.status_code == 503:
            assert r.headers.get("retry-after")
    new = (set(after) - set(before)).pop()
    with httpx.Client(timeout=BOUND) as c:   # the new replica answers (the router sends it new prefixes)
        for k in range(12):
            r = _chat(c, url, [{"role": "system", "content": f"New prompt {k}. " * 20},
                               {"role": "user", "content": "hi"}], max_tokens=2)
            assert r.status_code == 200, r.text
            if r.headers[REPLICA_HEADER] == new:
                break
        else:
            pytest.fail("the restarted replica got none of 12 new prefixes")


def test_cli_refuses_what_replicas_do_not_take(tiny_model):
    cmd = [sys.executable, "-m", "pyllama_kv.cli", "serve", str(tiny_model), "--replicas", "2"]
    for extra, says in ((["--draft-model", str(tiny_model)], "--draft-model"), (["--router", "nope"], "--router"),
                        (["--replicas", "-1"], "replicas")):
        p = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=BOUND, cwd=ROOT)
        assert p.returncode == 2, (extra, p.stderr)
        assert says in p.stderr.strip().splitlines()[-1], p.stderr   # one line says what is wrong


def test_route_keys_are_the_prompt_tokens_a_replica_evaluates(real_model):
    """The ingress tokenizes on the vocabulary alone (Model(vocab_only=True)) what a replica would
    evaluate: the chat rendered with the model's template, Messages' system prompt included."""
    import json

    import pyllama_kv as pk
    from pyllama_kv.chat.templates import apply_chat_template, tokenize_rendered
    from pyllama_kv.replicas.keys import RouteKeys

    full, vocab = pk.Model(real_model), pk.Model(real_model, vocab_only=True)
    try:
        with pytest.raises(pk.InvalidInputError, match="vocab_only"):
            pk.Context(vocab)
        keys = RouteKeys(vocab)
        msgs = [{"role": "system", "content": SYSTEMS[0]}, {"role": "user", "content": "Name a fruit."},
                {"role": "assistant", "content": "A pear."}, {"role": "user", "content": "Another?"}]
        want = tokenize_rendered(full, apply_chat_template(full, msgs, True), True)
        got = keys.tokens("/v1/chat/completions", json.dumps({"model": "m", "messages": msgs}).encode())
        assert got == want and vocab.tokenize("x y") == full.tokenize("x y")
        anthropic = {"model": "m", "max_tokens": 8, "system": SYSTEMS[0], "messages": msgs[1:]}
        assert keys.tokens("/v1/messages", json.dumps(anthropic).encode()) == want
        assert keys.tokens("/v1/completions", b'{"model": "m", "prompt": "Once upon"}') == \
            full.tokenize("Once upon", add_bos=True, special=True)
        for path, body in (("/v1/chat/completions", b"{bad"), ("/v1/models", b""), ("/v1/chat/completions", b"[]"),
                           ("/v1/responses", b'{"model": "m", "input": "hi", "previous_response_id": "resp_1"}')):
            assert keys.tokens(path, body) is None, path   # routed by load; the replica answers it
    finally:
        vocab.close()
        full.close()
