"""The pipelined loop (issue 49, item 1; engine/stream.py): a step's tokens are streamed while the
next step's graph runs, from ``Context.decode``'s ``between`` hook, which runs after ``llama_decode``
returned and before an output is read. On the CPU the decode has run by then, so only the order of
the work changes; what is tested here is that nothing else does: the same tokens, texts, finish
reasons and per-continuation event order as the serial loop, on both pins (F32), with sampling in
the graph, drafts, stop strings, n=2 and cancellation."""
from __future__ import annotations

from typing import NamedTuple

import pytest

import pyllama_kv as pk
from conftest import F32, toks
from pyllama_kv.engine import GREEDY, Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model, pin_lib):
    with pk.Model(tiny_model, lib=pin_lib) as m:
        yield m


class _Order:
    """Wraps a context's cffi library, recording llama_decode and the first output read after it."""

    def __init__(self, lib, log):
        self._lib, self._log = lib, log

    def __getattr__(self, name):
        fn = getattr(self._lib, name)
        if name in ("llama_decode", "llama_get_logits", "llama_get_sampled_token_ith"):
            def call(*a):
                self._log.append(name)
                return fn(*a)
            return call
        return fn


def test_between_runs_after_the_decode_and_before_any_output_is_read(model):
    with model.context(n_ctx=256, n_seq_max=2, **F32) as ctx:
        a = ctx.new_sequence()
        log: list = []
        ctx._L = _Order(ctx._L, log)
        out = ctx.decode({a: toks(6)}, between=lambda: log.append("between"))
        assert log[:3] == ["llama_decode", "between", "llama_get_logits"] and out[a].shape == (model.n_vocab,)


def test_between_cannot_use_the_context_and_its_error_undoes_the_decode(model):
    with model.context(n_ctx=256, n_seq_max=2, **F32) as ctx:
        a = ctx.new_sequence()
        a.extend(toks(4))
        seen = []

        def nosy():
            try:
                ctx.kv_stats()
            except pk.InvalidInputError as e:
                seen.append(str(e))
            raise RuntimeError("consumer bug")

        with pytest.raises(RuntimeError, match="consumer bug"):
            ctx.decode({a: [5, 6]}, between=nosy)
        assert "between" in seen[0] and len(a) == 4
        assert ctx.free_cells() == ctx.n_ctx - 4
        with pytest.raises(pk.InvalidInputError, match="between"):
            ctx.decode({a: [5]}, between=3)
        a.extend([5, 6])   # (the context works on)


class Run(NamedTuple):
    got: list          # per request, per continuation: (tokens, text, finish reason, logprobs)
    events: list       # per continuation, sorted: its events' (tokens, text, finish reason)
    inside: int        # token events delivered from inside a decode (the pipelined stream)
    engine: Engine
    contexts: list     # each continuation's context tokens
    in_graph: frozenset   # the sequence ids with a greedy chain in the graph at the end


def run(model, pipeline: bool | None = False, spec: str = "none", backend: bool = False, oracle=None) -> Run:
    """Greedy, greedy n=2, seeded, stop-string, logprobs and penalised requests in one engine (their
    rows share batches; also tests/test_backend_sampling.py's load). ``oracle``: the contexts of a run
    without drafts, drafted from with wrong tokens put in (test_speculation's oracle)."""
    from test_speculation import oracle_drafts

    cfg = EngineConfig(n_ctx=1024, parallel=8, spec=spec, pipeline=pipeline, backend_sampling=backend, **F32)
    cases = [(GREEDY, 1, {}), (GREEDY, 2, {}), (SamplingParams(temperature=0.9, top_k=20, seed=5), 1, {}),
             (GREEDY, 1, {"stop": ["e", "a"]}), (GREEDY, 1, {"logprobs": 2}),
             (SamplingParams(temperature=0.0, repeat_penalty=1.3), 1, {})]
    inside = [0]
    with Engine(model, cfg) as e:
        events: dict = {}
        if oracle is not None:
            oracle_drafts(e, oracle, wrong=0.1)

        def on_event(ev, e=e):
            events.setdefault((ev.request_id, ev.index), []).append((ev.tokens, ev.text, ev.finish_reason))
            if e.context._guard.busy:
                inside[0] += 1

        hs = [e.submit(toks(20 + 5 * i, seed=i), p, max_tokens=30 + 3 * i, n=n, on_event=on_event, **kw)
              for i, (p, n, kw) in enumerate(cases)]
        e.run_until_idle()
        done = [h.result() for h in hs]
        assert not e._unsent and not e.has_work()
        in_graph = e.context._native.sampled_ids()
    got = [[(c.tokens, c.text, c.finish_reason, c.logprobs) for c in r] for r in done]
    contexts = [c.context_tokens for r in done for c in r]
    return Run(got, sorted(events.values()), inside[0], e, contexts, in_graph)


@pytest.mark.parametrize("spec,backend", [("none", False), ("none", True), ("ngram", False)])
def test_the_pipelined_loop_gives_the_serial_loop_s_output(model, spec, backend):
    if backend and not model.native_library.caps.backend_sampling:
        pytest.skip("sampling in the graph: the current pin")
    oracle = run(model, False).contexts if spec != "none" else None
    want, want_events, none_inside, _, _, _ = run(model, False, spec, backend, oracle)
    got, got_events, inside, e, _, _ = run(model, True, spec, backend, oracle)
    assert got == want and got_events == want_events
    assert none_inside == 0 and inside > 0   # streamed from inside the next decode, pipelined only
    assert e.stats.generated_tokens == sum(len(c[0]) for r in got for c in r)
    if oracle is not None:   # several tokens of one continuation streamed at once, in order
        assert e.stats.spec.accepted > 0


def test_a_cancelled_or_stopped_engine_sends_what_waits(model):
    cfg = EngineConfig(n_ctx=512, parallel=2, pipeline=True, **F32)
    with Engine(model, cfg) as e:
        h = e.submit(toks(10), GREEDY, max_tokens=100)
        for _ in range(4):
            e.step()
        assert e._unsent   # the last step's token waits for the next decode
        n_before = len(h.completions[0].tokens)
        h.cancel()
        e.step()
        c = h.result(timeout=0)[0]
        assert c.finish_reason == "cancelled" and len(c.tokens) == n_before + 1 == 4
        h2 = e.submit(toks(10, seed=2), GREEDY, max_tokens=100)
        for _ in range(3):
            e.step()
    c2 = h2.result(timeout=0)[0]   # closed: cancelled, after the tokens it had drawn
    assert c2.finish_reason == "cancelled" and len(c2.tokens) == 3


def test_auto_is_off_on_the_cpu(model):
    with Engine(model, EngineConfig(n_ctx=256, parallel=2)) as e:
        assert e._pipelined is False
    with pytest.raises(pk.InvalidInputError, match="pipeline"):
        EngineConfig(pipeline="sometimes")
