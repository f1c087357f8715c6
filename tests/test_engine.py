"""The generation engine: batching, forks, streaming text, stop strings, cancellation, admission,
prefix eviction, threads. Scheduler-level cases also run against a fake KV cache (the engine only
talks to the KVCache interface)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import F32, KVWrapper, toks
from pyllama_kv.engine import GREEDY, Engine, EngineConfig, SamplingParams, TextStream
from pyllama_kv.errors import KVCacheFullError, QueueFullError


@pytest.fixture(scope="module")
def model(tiny_model, pin_lib):
    with pk.Model(tiny_model, lib=pin_lib) as m:
        yield m


def greedy_run(model, prompt, n, n_ctx=1024):
    with model.context(n_ctx=n_ctx, n_seq_max=1, **F32) as c:
        s = c.new_sequence()
        logits = s.extend(prompt)
        out = []
        for _ in range(n):
            t = int(np.argmax(logits))
            out.append(t)
            logits = s.extend([t])
        return out


class Spy(KVWrapper):
    """Wraps a KVCache and records every decode batch as {seq: n_tokens}."""

    def __init__(self, kv):
        super().__init__(kv)
        self.batches: list[dict] = []

    def decode(self, batch):
        self.batches.append({s: len(t) for s, t in batch.items()})
        return self.kv.decode(batch)


# -- the text stream ------------------------------------------------------------------------------


def test_text_stream_never_splits_a_character():
    data = "héllo ☃ 𝄞 end".encode()
    ts = TextStream()
    pieces = [data[i:i + 1] for i in range(len(data))]
    out = []
    for p in pieces:
        text, stop = ts.feed(p)
        assert not stop
        text.encode("utf-8")          # a lone surrogate or a split char would not be whole text
        out.append(text)
    out.append(ts.flush())
    assert "".join(out) == data.decode()
    assert all("\ufffd" not in t for t in out)


@pytest.mark.parametrize("cuts", [[1, 2, 3], [4], [2, 5], [7]])
def test_text_stream_stop_string_split_across_pieces(cuts):
    text = "Hello ### world"
    data = text.encode()
    bounds = [0, *cuts, len(data)]
    ts = TextStream(stop=["###", "never"])
    emitted = ""
    stopped = False
    for a, b in zip(bounds, bounds[1:]):
        t, stopped = ts.feed(data[a:b])
        emitted += t
        assert "#" not in emitted
        if stopped:
            break
    assert stopped and emitted == "Hello "


def test_text_stream_holds_back_only_possible_stop_prefixes():
    ts = TextStream(stop=["</s>"])
    assert ts.feed(b"a <")[0] == "a "
    assert ts.feed(b"b")[0] == "<b"
    assert ts.feed(b"</")[0] == ""
    assert ts.flush() == "</"


# -- the engine on the real context -------------------------------------------------------------


def test_prompt_chunks_and_generation_share_a_decode(model):
    cfg = EngineConfig(n_ctx=1024, parallel=2, prefix_cache=0, n_batch=32, n_ubatch=32, **F32)
    with Engine(model, cfg) as eng:
        eng.kv = spy = Spy(eng.kv)
        a = eng.submit(toks(8), GREEDY, max_tokens=40)
        for _ in range(3):
            eng.step()
        b = eng.submit(toks(200, 1), GREEDY, max_tokens=4)
        eng.run_until_idle()
        assert a.result()[0].finish_reason == "length" and b.result()[0].finish_reason == "length"
    seq_a = next(iter(spy.batches[0]))
    mixed = [bt for bt in spy.batches if len(bt) == 2]
    assert mixed, "the long prompt was never decoded beside the running request"
    for bt in mixed:
        assert bt[seq_a] == 1 and sum(bt.values()) <= 32
    # the 200-token prompt went in by chunks of at most 31 tokens, each beside a token of a
    assert len(mixed) >= 200 // 31
    assert all(seq_a in bt for bt in spy.batches[:3 + len(mixed)])


def test_n_greedy_forks_equal_single_runs(model):
    prompt = toks(12, 2)
    want = greedy_run(model, prompt, 16)
    cfg = EngineConfig(n_ctx=512, parallel=4, prefix_cache=1, **F32)
    with Engine(model, cfg) as eng:
        h = eng.submit(prompt, GREEDY, max_tokens=16, n=4)
        eng.run_until_idle()
        res = h.result()
        assert [c.tokens for c in res] == [want] * 4
        assert h.usage.completion_tokens == 64 and h.usage.prompt_tokens == 12
        assert eng.stats.evaluated_tokens == 12, "the prompt is evaluated once for the 4 continuations"


def test_stop_string_across_tokens_in_the_engine(model):
    prompt = toks(10, 3)
    cfg = EngineConfig(n_ctx=512, parallel=2, prefix_cache=0, **F32)
    with Engine(model, cfg) as eng:
        full = eng.submit(prompt, GREEDY, max_tokens=24)
        eng.run_until_idle()
        c = full.result()[0]
        pieces = [model.token_to_piece(t) for t in c.tokens]
        stop = before = None
        for k in range(1, len(pieces) - 1):   # a stop string made of the end of one token and the start of the next
            cand = pieces[k][-2:] + pieces[k + 1][:1]
            if len(pieces[k]) < 2 or not pieces[k + 1] or not cand.isascii() or not cand.strip():
                continue
            head = (b"".join(pieces[:k]) + pieces[k][:-2]).decode("utf-8", "replace")
            if cand.decode() not in head:
                stop, before = cand.decode(), head
                break
        assert stop is not None, pieces
        h = eng.submit(prompt, GREEDY, max_tokens=24, stop=[stop])
        eng.run_until_idle()
        r = h.result()[0]
        assert r.finish_reason == "stop" and r.text == before


def test_streamed_text_equals_the_detokenized_tokens(model):
    cfg = EngineConfig(n_ctx=512, parallel=2, prefix_cache=0, **F32)
    with Engine(model, cfg) as eng:
        h = eng.submit(toks(6, 4), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7),
                       max_tokens=48)
        eng.run_until_idle()
        events = list(h)
        text = "".join(e.text for e in events)
        tokens = [t for e in events for t in e.tokens]
        assert events[-1].finish_reason in ("length", "eos")
        assert text == b"".join(model.token_to_piece(t) for t in tokens).decode("utf-8", "replace")


def test_cancel_frees_cells_within_one_step(model):
    cfg = EngineConfig(n_ctx=512, parallel=2, prefix_cache=0, **F32)
    with Engine(model, cfg) as eng:
        h = eng.submit(toks(30, 5), GREEDY, max_tokens=200)
        for _ in range(3):
            eng.step()
        assert eng.kv.free_cells() < 512
        h.cancel()
        eng.step()
        assert eng.kv.free_cells() == 512
        assert h.done and h.result()[0].finish_reason == "cancelled"


def test_admission_waits_instead_of_preempting(model):
    # 4 requests of 100 prompt + 60 output tokens; the cache holds 2 of them with their reserves of 64
    # (3 on the current pin, which pads 384 cells to 512)
    cfg = EngineConfig(n_ctx=384, parallel=4, prefix_cache=0, output_reserve=64, **F32)
    with Engine(model, cfg) as eng:
        hs = [eng.submit(toks(100, 10 + i), GREEDY, max_tokens=60) for i in range(4)]
        eng.step()
        fit = eng.n_ctx // 164
        assert fit < 4 and eng.running == fit and eng.waiting == 4 - fit
        eng.run_until_idle()
        assert [h.result()[0].finish_reason for h in hs] == ["length"] * 4
        assert eng.stats.preempted == 0 and eng.stats.finished["cache_full"] == 0


def test_cached_prefixes_are_evicted_before_a_request_waits(model):
    cfg = EngineConfig(n_ctx=256, parallel=2, prefix_cache=4, output_reserve=16, **F32)
    with Engine(model, cfg) as eng:
        for i in range(4):     # four finished conversations kept as idle cached sequences
            eng.submit(toks(40, 20 + i), GREEDY, max_tokens=8)
            eng.run_until_idle()
        assert len(eng.kv.cache) >= 3 and eng.kv.free_cells() < 120
        h = eng.submit(toks(150, 30), GREEDY, max_tokens=8)
        eng.step()
        assert eng.running == 1, "the idle prefixes should have been evicted to admit it"
        eng.run_until_idle()
        assert h.result()[0].finish_reason == "length"
        assert eng.kv.cache.stats.evictions >= 2


def test_prefix_reuse_across_requests(model):
    system = toks(64, 40)
    cfg = EngineConfig(n_ctx=1024, parallel=2, prefix_cache=2, **F32)
    with Engine(model, cfg) as eng:
        a = eng.submit(system + toks(5, 41), GREEDY, max_tokens=4)
        eng.run_until_idle()
        b = eng.submit(system + toks(5, 42), GREEDY, max_tokens=4)
        eng.run_until_idle()
        assert a.usage.reused_tokens == 0 and b.usage.reused_tokens >= 64
        assert b.result()[0].tokens == greedy_run(model, system + toks(5, 42), 4)


def test_queue_bound_and_bad_requests(model):
    cfg = EngineConfig(n_ctx=256, parallel=1, prefix_cache=0, max_queue=2)
    with Engine(model, cfg) as eng:
        eng.submit([5, 6], GREEDY, max_tokens=2)
        eng.submit([5, 6], GREEDY, max_tokens=2)
        with pytest.raises(QueueFullError):
            eng.submit([5, 6], GREEDY, max_tokens=2)
        for bad in (dict(prompt=[]), dict(prompt=[10**9]), dict(prompt=list(range(3, 300))),
                    dict(prompt=[5], max_tokens=0), dict(prompt=[5], n=2), dict(prompt=[5], stop=[1])):
            with pytest.raises(pk.InvalidInputError):
                eng.submit(**{"params": GREEDY, **bad})
        eng.run_until_idle()
        assert eng.stats.finished["length"] == 2


def test_submit_and_cancel_from_8_threads(model):
    cfg = EngineConfig(n_ctx=1024, parallel=4, prefix_cache=2, max_queue=200)
    eng = Engine(model, cfg)
    eng.start()
    handles = []
    lock = threading.Lock()

    def client(i):
        rng = np.random.default_rng(i)
        for k in range(6):
            h = eng.submit(rng.integers(3, 600, int(rng.integers(4, 40))).tolist(), GREEDY,
                           max_tokens=int(rng.integers(2, 20)), n=int(rng.integers(1, 3)))
            with lock:
                handles.append(h)
            if k % 3 == 1:
                time.sleep(0.001 * int(rng.integers(0, 5)))
                h.cancel()

    ts = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    try:
        for h in handles:
            assert h.wait(120), f"request {h.id} never finished"
        assert len(handles) == 48
        for h in handles:
            reasons = {c.finish_reason for c in h.result()}
            assert reasons <= {"length", "eos", "cancelled"}, reasons
        assert sum(eng.stats.finished.values()) == sum(h.n for h in handles)
        deadline = time.monotonic() + 30
        while eng.has_work() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.running == 0 and eng.waiting == 0
    finally:
        eng.close()


# -- the scheduler against a fake cache ---------------------------------------------------------


class FakeKV:
    """Cells are counted per sequence (no sharing); the logits pick ``script[len(tokens)]``."""

    def __init__(self, n_cells, parallel, n_vocab, script):
        self.n_cells, self.parallel, self.n_vocab, self.script = n_cells, parallel, n_vocab, script
        self.seqs: dict[int, list[int]] = {}
        self.ids = iter(range(10**6))

    def free_cells(self):
        return self.n_cells - sum(len(t) for t in self.seqs.values())

    def free_ids(self):
        return self.parallel - len(self.seqs)

    context = None

    def match(self, tokens):
        return 0

    def reserve(self, tokens, n_cells, n_ids):
        return self.free_ids() >= n_ids and len(tokens) + n_cells <= self.free_cells()

    def make_room(self, n_cells):
        return self.free_cells() >= n_cells

    def start(self, tokens):
        sid = next(self.ids)
        self.seqs[sid] = []
        return sid, 0

    def fork(self, seq):
        sid = next(self.ids)
        self.seqs[sid] = list(self.seqs[seq])
        return sid

    def decode(self, batch):
        if sum(len(t) for t in batch.values()) > self.free_cells():
            raise KVCacheFullError("full")
        out = {}
        for s, t in batch.items():
            self.seqs[s].extend(t)
            logits = np.zeros(self.n_vocab, np.float32)
            logits[self.script[min(len(self.seqs[s]), len(self.script) - 1)]] = 1.0
            out[s] = logits
        return out

    def shift(self, seq, n_keep, n_discard):
        del self.seqs[seq][n_keep:n_keep + n_discard]
        return True

    def truncate(self, seq, n):
        del self.seqs[seq][n:]

    def finish(self, seq, keep):
        del self.seqs[seq]

    def remember(self, seq):
        pass

    def checkpoints_at(self, tokens, boundaries, held):
        return []

    def checkpoint(self, seq):
        pass

    def page_out_idle(self, decoded, upcoming=0):
        return 0

    def kv_stats(self):
        return {}


class FakeModel:
    n_vocab = 8
    PIECES = {1: b"h", 2: "é".encode()[:1], 3: "é".encode()[1:], 4: "☃".encode()[:2],
              5: "☃".encode()[2:], 6: b"!", 7: b""}

    def check_tokens(self, t):
        return np.asarray(list(t), dtype=np.int32)

    def token_to_piece(self, t):
        return self.PIECES.get(t, b"?")

    def is_eog(self, t):
        return t == 7


def test_utf8_deltas_from_split_pieces_with_a_fake_cache():
    script = [0, 0, 1, 2, 3, 4, 5, 6, 7]   # after the 2-token prompt: h, é (2 pieces), ☃ (2), !, eos
    kv = FakeKV(64, 2, 8, script)
    eng = Engine(FakeModel(), EngineConfig(n_ctx=64, parallel=2, prefix_cache=0), kv=kv)
    h = eng.submit([1, 1], GREEDY, max_tokens=20)
    eng.run_until_idle()
    deltas = [e.text for e in h if e.text]
    assert "".join(deltas) == "hé☃!"
    assert deltas == ["h", "é", "☃", "!"]
    assert h.result()[0].finish_reason == "eos" and kv.seqs == {}


def test_preemption_is_the_last_resort_with_a_fake_cache():
    script = [1] * 200
    kv = FakeKV(60, 2, 8, script)
    # reserves of 8 let both in; they grow to 25 each: the cache (60) fills, one is preempted and
    # resumed later from its tokens so far
    eng = Engine(FakeModel(), EngineConfig(n_ctx=60, parallel=2, prefix_cache=0, output_reserve=8), kv=kv)
    a = eng.submit([1] * 10, GREEDY, max_tokens=25)
    b = eng.submit([1] * 10, GREEDY, max_tokens=25)
    eng.run_until_idle(max_steps=500)
    assert eng.stats.preempted >= 1
    for h in (a, b):
        c = h.result()[0]
        assert c.finish_reason == "length" and len(c.tokens) == 25
    assert kv.seqs == {}


def test_stress_on_a_small_cache_completes_instead_of_thrashing(tiny_model, vanilla_lib):
    """The seeded workload on 1024 cells: before the engine, 174 preemptions and 6 completions in 300
    steps; now most admitted requests complete, preemption is rare, and only vanilla fails slots."""
    from pyllama_kv.tools.workload import StressConfig, run_stress

    cfg = StressConfig(n_ctx=1024, parallel=8, steps=200, n_threads=1)
    with pk.Model(tiny_model) as m:
        res, _ = run_stress(m, cfg)
    rq = res.requests
    assert res.slot_failures == 0 and rq["failed"] == 0
    assert rq["completed"] >= 0.6 * rq["started"] and rq["completed"] >= 8, rq
    assert res.preempted <= max(2, rq["started"] // 10), rq
    with pk.Model(tiny_model, lib="vanilla") as m:
        van, _ = run_stress(m, cfg)
    assert van.slot_failures > 0 and van.requests["failed"] > 0


def test_between_steps_runs_on_the_loop_thread_or_inline():
    kv = FakeKV(64, 2, 8, [1] * 100)
    eng = Engine(FakeModel(), EngineConfig(n_ctx=64, parallel=2, prefix_cache=0), kv=kv)
    me = threading.current_thread()
    # no loop thread: now, on the calling thread
    assert eng.between_steps(lambda e: threading.current_thread()).result(0) is me
    eng.start()
    try:
        h = eng.submit([1, 1], GREEDY, max_tokens=30)
        seen = []
        for _ in range(20):   # each answer is taken between two steps: never beside a decode
            seen.append(eng.between_steps(lambda e: (threading.current_thread(), e.stats.steps)).result(10))
        assert all(t is not me and t.name == "pyllama-kv-engine" for t, _ in seen) and h.wait(10)
        assert [s for _, s in seen] == sorted(s for _, s in seen)
        boom = eng.between_steps(lambda e: 1 // 0)
        with pytest.raises(ZeroDivisionError):
            boom.result(10)
        assert eng.alive, "an asker's error does not stop the engine"
    finally:
        eng.close()
    assert eng.between_steps(lambda e: 7).result(0) == 7


def test_sampling_beyond_greedy_needs_a_context_or_a_sampler_factory():
    kv = FakeKV(64, 2, 8, [1] * 10)
    eng = Engine(FakeModel(), EngineConfig(n_ctx=64, parallel=2, prefix_cache=0), kv=kv)
    assert eng.context is None
    with pytest.raises(pk.InvalidInputError, match="sampler_factory"):
        eng.submit([1, 1], SamplingParams(temperature=0.8), max_tokens=2)
    eng = Engine(FakeModel(), EngineConfig(n_ctx=64, parallel=2, prefix_cache=0), kv=kv,
                 sampler_factory=lambda req, i: ((lambda logits: 6), None))
    h = eng.submit([1, 1], SamplingParams(temperature=0.8), max_tokens=2)
    eng.run_until_idle(max_steps=10)
    assert h.result()[0].tokens == [6, 6]
