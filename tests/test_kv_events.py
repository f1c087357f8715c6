"""KV events (issue 48, item 3): the prefix cache's contents as vLLM's block events, so that a router
of replicas knows what each one holds. The checks are a router's: a view built only from the events
(applied in order: no block stored before its parent, none removed that was not there) predicts, for
any prompt, the tokens the engine itself would reuse (its own ``kv.match``), after forks,
evictions, page-outs to host memory and disk, and restores; and the server's socket carries vLLM's
wire format (three frames, msgpack arrays tagged by event)."""
from __future__ import annotations

import json
import random
import threading
import time
import urllib.request

import pytest

import pyllama_kv as pk
from pyllama_kv.engine import GREEDY, Engine, EngineConfig
from pyllama_kv.engine.kvevents import KVEventSource
from pyllama_kv.errors import InvalidInputError
from pyllama_kv.prefixcache.events import MEDIA, AllBlocksCleared, BlockLedger, BlockRemoved, BlockStored, block_hashes

B = 4


class RouterView:
    """What a router knows of one replica: the blocks per medium, from the events alone."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {m: set() for m in MEDIA}
        self.cleared = 0

    def apply(self, events) -> None:
        for e in events:
            if isinstance(e, AllBlocksCleared):
                self.cleared += 1
                for s in self.held.values():
                    s.clear()
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.held[e.medium], "a block removed that was not announced"
                self.held[e.medium] -= set(e.block_hashes)
            else:
                assert isinstance(e, BlockStored) and e.block_size == B
                assert len(e.token_ids) == B * len(e.block_hashes)
                if e.medium == "GPU":   # the cache's own cells always hold a prefix from position 0
                    assert e.parent_block_hash is None or e.parent_block_hash in self.held["GPU"], \
                        "a block stored before its parent"
                assert not set(e.block_hashes) & self.held[e.medium], "a block stored twice"
                self.held[e.medium] |= set(e.block_hashes)

    def predict(self, tokens, media=MEDIA) -> int:
        """The tokens a request with ``tokens`` would find: its leading blocks held in ``media``."""
        held = set().union(*(self.held[m] for m in media))
        n = 0
        for h in block_hashes(tokens, B):
            if h not in held:
                break
            n += B
        return n


# ---------------------------------------------------------------------------------------------
# the ledger alone


def test_blocks_are_a_chain_of_hashes_and_the_events_say_what_changed():
    led = BlockLedger(B)
    a = list(range(10, 23))            # 13 tokens: 3 whole blocks
    ev = led.update({"GPU": [(a, 0, len(a))]})
    assert isinstance(ev[0], AllBlocksCleared)
    (st,) = ev[1:]
    assert st == BlockStored(block_hashes(a, B), None, a[:12], B, "GPU")
    assert block_hashes(a, B) == block_hashes(a[:12], B) and block_hashes(a[:8] + [0] * 4, B)[:2] == st.block_hashes[:2]
    assert block_hashes(a, B) != block_hashes([0] + a[1:], B)[:3]   # a block's hash names its whole prefix
    assert led.update({"GPU": [(a, 0, len(a))]}) == []          # nothing changed, nothing said
    b = a[:8] + [99] * 8               # branches after 2 blocks
    ev = led.update({"GPU": [(a, 0, 13), (b, 0, 16)], "CPU": [(b, 4, 16)]})
    hb = block_hashes(b, B)
    assert ev == [BlockStored(hb[2:], hb[1], [99] * 8, B, "GPU"),
                  BlockStored(hb[1:], hb[0], b[4:], B, "CPU")]   # from a span's start: its whole blocks
    ev = led.update({"CPU": [(b, 0, 6), (b, 6, 16)]})   # two spans straddle block 1: not announced
    assert ev[0].medium == "GPU" and isinstance(ev[0], BlockRemoved)
    assert ev[1:] == [BlockRemoved([hb[1]], "CPU"), BlockStored([hb[0]], None, b[:4], B, "CPU")]
    gone = ev[0].block_hashes
    assert set(gone) == set(block_hashes(a, B)) | set(hb[2:])
    depth = {h: i for i, h in enumerate(block_hashes(a, B))} | {h: i for i, h in enumerate(hb)}
    assert [depth[h] for h in gone] == sorted((depth[h] for h in gone), reverse=True)   # deepest first
    assert led.blocks("CPU") == {hb[0], hb[2], hb[3]}
    with pytest.raises(ValueError):
        BlockLedger(0)


# ---------------------------------------------------------------------------------------------
# an engine's events against what it reuses


def _prompts(rng: random.Random) -> list[list[int]]:
    systems = [[rng.randrange(3, 600) for _ in range(rng.randrange(20, 40))] for _ in range(3)]
    out = []
    for i in range(14):
        s = systems[i % 3]
        turn = [rng.randrange(3, 600) for _ in range(rng.randrange(3, 15))]
        out.append(s + turn)
        if i % 4 == 3:                 # a conversation's next turn: the last prompt continued
            out.append(out[-1] + [rng.randrange(3, 600) for _ in range(9)])
    return out


@pytest.mark.parametrize("tiers", ["device", "host+disk"])
def test_a_router_view_from_the_events_predicts_the_engines_reuse(tiny_model, every_page_out, tmp_path, tiers):
    """Prompts under three system prompts and conversations continued, two at a time, through a cache
    of 3 idle sequences (so evictions), with the host tier holding ~60 tokens' cells and spilling to a
    directory (so page-outs, spills and restores). After each round the view predicts, for every
    prompt so far and each of its prefixes: exactly the engine's resident match in whole blocks
    ("GPU"); at most its match across the tiers (never more than it holds) and, from the device
    and host tiers alone, no less than their whole blocks."""
    rng = random.Random(7)
    paging = {} if tiers == "device" else {"cache_ram": 1, "cache_dir": str(tmp_path), "cache_dir_mib": 1}
    cfg = EngineConfig(n_ctx=1024, parallel=2, prefix_cache=3, max_tokens=6, **paging)
    with pk.Model(tiny_model) as m, Engine(m, cfg) as eng:
        if tiers != "device":   # the tiny model's cells are small: host memory for ~60 tokens, so spans spill
            eng.kv.cache.tiers.trie.budget = 60 * eng.kv.cache._cell_bytes
        src, view = KVEventSource(eng, B), RouterView()
        view.apply(src.poll())
        assert view.cleared == 1
        seen: list[list[int]] = []
        prompts = _prompts(rng)
        for i in range(0, len(prompts), 2):
            for p in prompts[i:i + 2]:
                eng.submit(p, GREEDY, max_tokens=6)
                seen.append(p)
            while eng.has_work():
                eng.step()
                view.apply(src.poll())
            cache = eng.kv.cache
            # the view's device blocks are exactly the idle sequences' whole blocks
            assert view.held["GPU"] == {h for s in cache.idle for h in block_hashes(s.tokens, B)}
            for p in seen:
                for q in (p, p[:len(p) // 2], p + [5, 6, 7]):
                    resident = cache.longest(q)
                    assert view.predict(q, ["GPU"]) == resident // B * B, (len(q), resident)
                    assert view.predict(q) <= eng.kv.match(q)
        st = eng.stats.prefix_tier
        if tiers != "device":
            assert st.page_outs > 0 and st.restored_tokens > 0 and st.disk_writes > 0, st
            assert view.held["CPU"] and view.held["DISK"]
            assert any(view.predict(p) > view.predict(p, ["GPU"]) for p in seen)   # the tiers are seen


def test_a_cleared_cache_says_so_and_an_engine_without_one_says_nothing(tiny_model):
    with pk.Model(tiny_model) as m, Engine(m, EngineConfig(n_ctx=256, parallel=1, prefix_cache=2)) as eng:
        src, view = KVEventSource(eng, B), RouterView()
        eng.submit(list(range(3, 40)), GREEDY, max_tokens=3)
        eng.run_until_idle()
        view.apply(src.poll())
        assert view.held["GPU"] and src.poll() == []
        eng.kv.cache.clear()
        view.apply(src.poll())
        assert not any(view.held.values())


# ---------------------------------------------------------------------------------------------
# the server: vLLM's wire format over ZeroMQ, and the gauges routers read


def test_serve_publishes_vllm_kv_events_and_router_gauges(real_model):
    zmq = pytest.importorskip("zmq")
    msgpack = pytest.importorskip("msgpack")
    import uvicorn

    from pyllama_kv.server import ServerConfig, app as server_app

    with pytest.raises(InvalidInputError, match="ZeroMQ endpoint"):
        ServerConfig(kv_events="http://127.0.0.1:1")
    model = pk.Model(real_model)
    engine = Engine(model, EngineConfig(n_ctx=1024, parallel=2, prefix_cache=2, max_tokens=4, n_threads=1))
    server = server_app.Server(model, engine, ServerConfig(port=0, kv_events="tcp://127.0.0.1:*",
                                                           kv_events_block_size=B), ["m"])
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(server.kv_events.endpoint)
    sock = server_app.bind("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv = server_app._Uvicorn(uvicorn.Config(server.app, log_level="warning", lifespan="on"), server)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()

    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    try:
        for _ in range(6000):
            if uv.started:
                break
            time.sleep(0.01)
        assert uv.started
        prompt = model.tokenize("You are a careful assistant. Answer in one word. What colour is the sky?")
        view, seqs = RouterView(), []
        first = post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert first["choices"][0]["text"] is not None
        for _ in range(200):   # bounded: the events of the request arrive within 10 s
            if sub.poll(50):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv-events" and len(seq) == 8
                seqs.append(int.from_bytes(seq, "big"))
                ts, events = msgpack.unpackb(payload)
                assert isinstance(ts, float)
                decoded = []
                for e in events:
                    tag = e[0]
                    if tag == "BlockStored":
                        assert len(e) == 7 and e[5] is None   # lora_id
                        decoded.append(BlockStored(e[1], e[2], e[3], e[4], e[6]))
                    elif tag == "BlockRemoved":
                        decoded.append(BlockRemoved(e[1], e[2]))
                    else:
                        assert e == ["AllBlocksCleared"]
                        decoded.append(AllBlocksCleared())
                view.apply(decoded)
            elif view.predict(prompt):
                break
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))   # consecutive
        predicted = view.predict(prompt, ["GPU"])
        assert predicted == len(prompt) // B * B
        again = post("/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 4, "temperature": 0})
        assert predicted - 1 <= again["timings"]["cache_n"] <= len(prompt)
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                     "pyllama_kv_kv_usage"):
            assert f"\n{name} " in text, name
    finally:
        uv.should_exit = True
        thread.join(60)
        sock.close()
        sub.close()
        server.close()
        model.close()
