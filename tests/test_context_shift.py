"""Context shift and prompt truncation in the engine (what Ollama's runner does when a sequence is
full): a small context generates far past its size, positions stay 0..n-1, the logits after a shift
are those of a fresh evaluation of the kept tokens (both the K-shift and the re-evaluation path),
forks stay independent, long prompts are truncated or refused, and the options reach the engine
from the server's request fields and from `chat`."""
from __future__ import annotations

import json

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import F32, KVWrapper, run_cli, toks
from pyllama_kv.config import EngineConfig, SamplingParams
from pyllama_kv.engine import Engine, HoldingKV
from pyllama_kv.engine.admission import truncate_prompt

GREEDY_ALL = SamplingParams(temperature=0.0, ignore_eos=True)
# logits of the 1-layer f32 model after a K-shift vs a fresh evaluation: RoPE of an already rotated
# key differs from RoPE at the new position by float rounding only (measured ~1e-6 of logits ~1)
TOL_KSHIFT = 1e-4
# the re-evaluation path decodes the same tokens at the same positions over the same prefix: f32
# matmuls give the same logits whatever the batch shape, so only summation-order noise remains
TOL_REEVAL = 1e-5
# the same on the tiny gemma3 (6 layers, 5 with an 8-token sliding window; F32 weights and cache):
# measured max |logits - fresh| = 3.8e-6 over logits up to ~60 (relative ~6e-8). A fixed bound with
# a 25x margin, not scaled by a measured noise level (its K-shift is off by ~0.14: an approximation,
# as on any model of more than one layer, so this bound tells the two paths apart)
TOL_REEVAL_SWA = 1e-4


class Recorder(KVWrapper):
    """Wraps a ContextKV: after every decode, each sequence's token list and next-token logits."""

    def __init__(self, kv):
        super().__init__(kv)
        self.records: list[tuple[int, list[int], np.ndarray]] = []
        self.shifted: set[int] = set()          # sequence ids shifted since their last decode
        self.batches: list[int] = []

    def shift(self, seq, n_keep, n_discard):
        self.shifted.add(seq.id)
        return self.kv.shift(seq, n_keep, n_discard)

    def truncate(self, seq, n):
        self.shifted.add(seq.id)
        self.kv.truncate(seq, n)

    def decode(self, batch):
        self.batches.append(sum(len(t) for t in batch.values()))
        out = self.kv.decode(batch)
        for seq, logits in out.items():
            if seq.id in self.shifted:
                self.records.append((seq.id, seq.tokens, logits.copy()))
                self.shifted.discard(seq.id)
        return out


def check_positions(ctx, conts) -> None:
    """Every live sequence holds exactly positions 0..n-1, and its tokens are the continuation's first n."""
    pos, seqs = ctx.kv_view()
    for s in conts:
        mine = (seqs == s.seq.id).any(axis=1)
        assert sorted(pos[mine].tolist()) == list(range(len(s.seq))), f"sequence {s.seq.id}"
        assert s.seq.tokens == s.tokens[:len(s.seq)]


def fresh_logits(model, tokens: list[int]) -> np.ndarray:
    with model.context(n_ctx=256, n_seq_max=1, **F32) as c:
        return c.new_sequence().extend(tokens)


def run_checked(eng: Engine, handle) -> None:
    while not handle.done:
        eng.step()
        assert all(len(s.seq) < eng.n_ctx for s in eng._continuations)
        check_positions(eng.kv.ctx, eng._continuations)


# -- the real model: a 64-cell context generates 500 tokens --------------------------------------------


@pytest.mark.parametrize("lib", ["patched", "vanilla"])
def test_64_cells_generate_500_tokens(real_model, lib, vanilla_lib):
    with pk.Model(real_model, lib=lib) as m:
        prompt = m.tokenize("Once upon a time, in a city by the sea,")
        cfg = EngineConfig(n_ctx=64, parallel=1, prefix_cache=1, n_threads=2)
        with Engine(m, cfg) as eng:
            kshift = eng.kv.can_shift
            assert kshift == (lib == "patched"), "the patched build K-shifts this f16 cache; vanilla re-evaluates"
            h = eng.submit(prompt, GREEDY_ALL, max_tokens=500)
            run_checked(eng, h)
            (c,) = h.result()
            st = eng.stats
        assert c.finish_reason == "length" and len(c.tokens) == 500
        u = h.usage
        assert u.completion_tokens == 500 and u.context_shifts == st.context_shifts >= 500 // 64
        assert u.dropped_tokens == st.dropped_tokens
        # the sequence at the end: the kept start, then the newest tokens; nothing else
        assert len(c.context_tokens) == len(prompt) + 500 - u.dropped_tokens <= 64
        assert c.context_tokens[:4] == prompt[:4] and c.context_tokens[-20:] == c.tokens[-20:]
        if kshift:
            assert st.shifts_reevaluated == 0 and st.reevaluated_tokens == 0
        else:
            assert st.shifts_reevaluated == st.context_shifts and st.reevaluated_tokens > 0
            assert st.slot_failures == 0 and st.finished["cache_full"] == 0
        # off: the old behaviour, the answer ends with the context
        with Engine(m, cfg) as eng:
            h = eng.submit(prompt, GREEDY_ALL, max_tokens=500, context_shift=False)
            eng.run_until_idle()
            (c,) = h.result()
        assert c.finish_reason == "length" and len(prompt) + len(c.tokens) == 64


# -- exactness: the logits after a shift are a fresh evaluation of the kept tokens ---------------------


def _shift_run(model, n: int = 1, params=GREEDY_ALL, force_reeval: bool = False, max_tokens: int = 150,
               prompt_len: int = 10):
    cfg = EngineConfig(n_ctx=64, parallel=max(n, 1), prefix_cache=1, **F32)
    with Engine(model, cfg) as eng:
        rec = Recorder(eng.kv)
        if force_reeval:
            rec.kv.shift = lambda *a: False    # as a cache that cannot K-shift says
        eng.kv = rec
        h = eng.submit(toks(prompt_len, 7), params, max_tokens=max_tokens, n=n, n_keep=5)
        while not h.done:
            eng.step()
            check_positions(rec.kv.ctx, eng._continuations)
        return h, eng.stats, rec


def _max_err(model, rec: Recorder) -> float:
    assert rec.records, "no decode after a shift was recorded"
    return max(float(np.abs(lg - fresh_logits(model, tk)).max()) for _, tk, lg in rec.records)


def test_k_shift_logits_equal_a_fresh_evaluation(one_layer_model):
    """One layer: a token's K/V depend only on the token and its position, so a K-shift is exactly
    a fresh evaluation (up to rounding). (With more layers it is an approximation by design.)"""
    with pk.Model(one_layer_model) as m:
        h, st, rec = _shift_run(m)
        assert st.context_shifts >= 3 and st.shifts_reevaluated == 0
        assert h.result()[0].finish_reason == "length" and len(h.result()[0].tokens) == 150
        assert _max_err(m, rec) < TOL_KSHIFT


@pytest.mark.parametrize("how", ["forced", "vanilla"])
def test_reevaluation_logits_equal_a_fresh_evaluation(tiny_model, vanilla_lib, how):
    """Two layers: the re-evaluation path (a cache that cannot shift; the vanilla build) is exact."""
    with pk.Model(tiny_model, lib="vanilla" if how == "vanilla" else "patched") as m:
        h, st, rec = _shift_run(m, force_reeval=how == "forced")
        assert st.context_shifts >= 3 and st.shifts_reevaluated == st.context_shifts
        assert h.result()[0].finish_reason == "length" and len(h.result()[0].tokens) == 150
        assert _max_err(m, rec) < TOL_REEVAL


@pytest.fixture(scope="module")
def gemma3_model(models):
    """The tiny gemma3 of test_architectures (the same bytes: its vetting verdict is shared). Fewer
    layers do not do: with no full-attention layer llama.cpp crashes (vetting refuses such a file)."""
    from pyllama_kv.tools.gguf import make_tiny_model

    return make_tiny_model(models / "gemma3-swa.gguf", arch="gemma3", n_layer=6, sliding_window=8)


def test_reevaluation_on_a_sliding_window_model_equals_a_fresh_evaluation(gemma3_model):
    """Sliding-window layers (8 tokens, shorter than what a shift keeps): after each shift of a
    64-cell context the logits are a fresh evaluation's of the kept tokens, under a fixed bound."""
    from pyllama_kv.tools.gguf_inspect import inspect_gguf

    assert inspect_gguf(gemma3_model)["sliding_window"] == 8
    with pk.Model(gemma3_model) as m:
        h, st, rec = _shift_run(m, force_reeval=True)
        assert st.context_shifts >= 3 and st.shifts_reevaluated == st.context_shifts
        assert h.result()[0].finish_reason == "length" and len(h.result()[0].tokens) == 150
        assert len(rec.records) == st.context_shifts
        assert _max_err(m, rec) < TOL_REEVAL_SWA


def test_forks_after_a_shift_stay_independent(one_layer_model):
    """A 63-token prompt in 64 cells, n=3: the three continuations fork it and shift at once, while
    they (and the cached prompt) share all its cells. Each first shift drops [5, 34) and its kept
    tail is shared, so it is cut and re-evaluated into cells of its own (copy-on-write: a K-shift
    would move the siblings' cells too); later shifts K-shift a private tail. Each continuation's
    logits stay those of its own tokens, and its cells hold 0..n-1."""
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11, ignore_eos=True)
    with pk.Model(one_layer_model) as m:
        h, st, rec = _shift_run(m, n=3, params=params, max_tokens=100, prompt_len=63)
        res = h.result()
        assert [c.finish_reason for c in res] == ["length"] * 3 and all(len(c.tokens) == 100 for c in res)
        assert len({tuple(c.tokens) for c in res}) == 3, "the continuations should differ (seeds)"
        assert h.usage.context_shifts == st.context_shifts >= 9 and len(rec.records) >= 9
        assert 3 <= st.shifts_reevaluated < st.context_shifts, "both paths should have run"
        assert _max_err(m, rec) < TOL_KSHIFT
        for c in res:
            assert c.context_tokens[:5] == toks(63, 7)[:5] and c.context_tokens[-10:] == c.tokens[-10:]


# -- truncation -------------------------------------------------------------------------------------


def test_truncate_prompt_cuts_after_n_keep_at_a_turn_boundary():
    t = list(range(100))
    out, b, dropped = truncate_prompt(t, 60, 4, [])
    assert out == t[:4] + t[44:] and dropped == 40 and len(out) == 60
    # turns start at 10, 30, 50, 80: dropping 40 after 4 reaches 44, so the cut moves to 50
    out, b, dropped = truncate_prompt(t, 60, 4, [10, 30, 50, 80])
    assert out == t[:4] + t[50:] and dropped == 46 and b == [4, 34]
    # the last turn alone is too long: it is split (nothing else fits)
    out, b, dropped = truncate_prompt(t, 10, 4, [10, 30, 50, 80])
    assert out == t[:4] + t[94:] and b == []
    assert truncate_prompt(t, 100, 4, [3])[2] == 0


def test_long_prompt_truncated_or_refused(tiny_model):
    with pk.Model(tiny_model) as m:
        cfg = EngineConfig(n_ctx=128, parallel=1, prefix_cache=0, **F32)
        prompt = toks(300, 5)
        with Engine(m, cfg) as eng:
            with pytest.raises(pk.InvalidInputError, match=r"300 tokens; the context holds 128.*truncate=True"):
                eng.submit(prompt, GREEDY_ALL, max_tokens=16)
            turns = [100, 200, 250]
            h = eng.submit(prompt, GREEDY_ALL, max_tokens=16, truncate=True, n_keep=8, boundaries=turns)
            eng.run_until_idle()
            (c,) = h.result()
        assert c.finish_reason == "length" and len(c.tokens) == 16
        # room for the answer: min(max_tokens, half of what is not kept) = 16, so 188 tokens go after
        # the first 8: up to 196, and on to the next turn start, 200 (turn 250 stays whole)
        assert h.usage.prompt_tokens == 8 + 100 and h.usage.truncated_tokens == 192
        assert c.context_tokens == prompt[:8] + prompt[200:] + c.tokens and c.boundaries == [8, 58]
        assert eng.stats.truncated_prompts == 1 and eng.stats.context_shifts == 0
        # the answer is the one a prompt of the kept tokens gets
        with Engine(m, cfg) as eng:
            h2 = eng.submit(prompt[:8] + prompt[200:], GREEDY_ALL, max_tokens=16)
            eng.run_until_idle()
        assert h2.result()[0].tokens == c.tokens
        # the config's default
        with Engine(m, EngineConfig(n_ctx=128, parallel=1, prefix_cache=0, truncate=True, **F32)) as eng:
            h = eng.submit(prompt, GREEDY_ALL, max_tokens=200)
            eng.run_until_idle()
        assert h.usage.truncated_tokens > 0 and h.result()[0].finish_reason == "length"
        assert len(h.result()[0].tokens) == 200 and h.usage.context_shifts > 0
        with pytest.raises(pk.InvalidInputError):
            EngineConfig(n_keep=-2)
        with pytest.raises(pk.InvalidInputError):
            EngineConfig(context_shift="yes")  # type: ignore[arg-type]


def test_batch_stays_within_a_small_context(tiny_model):
    with pk.Model(tiny_model) as m:
        cfg = EngineConfig(n_ctx=64, parallel=2, prefix_cache=0, **F32)   # n_batch 512 by default
        assert cfg.context().n_batch == 64
        with Engine(m, cfg) as eng:
            rec = eng.kv = Recorder(eng.kv)
            hs = [eng.submit(toks(40, 9), GREEDY_ALL, max_tokens=100, truncate=True),
                  eng.submit(toks(90, 8), GREEDY_ALL, max_tokens=100, truncate=True)]
            eng.run_until_idle()
        assert eng.n_batch == 64 and max(rec.batches) <= 64
        assert all(h.result()[0].finish_reason == "length" for h in hs)


# -- the options from the server's request and from chat ----------------------------------------------


def test_server_extension_fields_round_trip():
    from pyllama_kv.server import protocol

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    req = protocol.parse(body, "chat", parallel=2, max_tokens_cap=64)
    assert req.engine_options() == {}
    req = protocol.parse({**body, "context_shift": False, "n_keep": -1, "truncate": True}, "chat", parallel=2,
                         max_tokens_cap=64)
    assert req.engine_options() == {"context_shift": False, "n_keep": -1, "truncate": True}
    req = protocol.parse({"model": "m", "prompt": "x", "n_keep": 16}, "completion", parallel=2, max_tokens_cap=64)
    assert req.engine_options() == {"n_keep": 16}
    for bad in ({"context_shift": "no"}, {"truncate": 1}, {"n_keep": -2}, {"n_keep": 1.5}):
        with pytest.raises(protocol.APIError) as e:
            protocol.parse({**body, **bad}, "chat", parallel=2, max_tokens_cap=64)
        assert e.value.status == 400 and e.value.param == next(iter(bad))


def test_engine_takes_the_request_options(tiny_model):
    """What the server hands to Engine.submit (``**req.engine_options()``) does what it says."""
    from pyllama_kv.server import protocol

    body = {"model": "m", "prompt": toks(100, 3), "max_tokens": 60}
    with pk.Model(tiny_model) as m, Engine(m, EngineConfig(n_ctx=64, parallel=1, prefix_cache=0, **F32)) as eng:
        outs = {}
        for name, extra in (("default", {}), ("no shift", {"context_shift": False}),
                            ("truncate", {"truncate": True, "n_keep": 2})):
            req = protocol.parse({**body, **extra}, "completion", parallel=1, max_tokens_cap=64)
            if name == "default":
                with pytest.raises(pk.InvalidInputError, match="truncate"):
                    eng.submit(req.prompt, GREEDY_ALL, max_tokens=60, **req.engine_options())
                continue
            h = eng.submit(req.prompt[:40] if name == "no shift" else req.prompt, GREEDY_ALL, max_tokens=60,
                           **req.engine_options())
            eng.run_until_idle()
            outs[name] = (h.result()[0], h.usage)
    c, u = outs["no shift"]
    assert c.finish_reason == "length" and len(c.tokens) == 64 - 40 and u.context_shifts == 0
    c, u = outs["truncate"]
    assert len(c.tokens) == 60 and u.truncated_tokens > 0 and c.context_tokens[:2] == body["prompt"][:2]


SIMPLE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}<assistant>{% endif %}")


def _chat(model, lines, *extra):
    r = run_cli(["chat", str(model), "--json", *extra], input="".join(f"{ln}\n" for ln in lines), timeout=180)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return [json.loads(ln) for ln in r.stdout.splitlines()]


def test_chat_goes_on_past_the_context_and_stats_count_the_dropped_tokens(tiny_model, tmp_path):
    (tmp_path / "t.jinja").write_text(SIMPLE)
    long = "the cache " * 40
    lines = ["hi", "again", long, "/stats", "one more", "/stats"]
    out = _chat(tiny_model, lines, "--template", str(tmp_path / "t.jinja"), "--system", "be brief",
                "--ctx", "128", "-n", "110", "--temp", "0")
    t1, t2, t3, s1, t4, s2 = out
    for t in (t1, t2, t3, t4):
        assert t["finish_reason"] == "length" and "error" not in t, t
        assert t["usage"]["completion_tokens"] == 110 and t["usage"]["prompt_tokens"] < 128
    # the first answer outgrows the context: it shifts and goes on
    assert t1["usage"]["context_shifts"] >= 1 and t1["usage"]["dropped_tokens"] > 0
    # the next turn starts from what the engine kept: the cached cells are reused
    assert t2["usage"]["reused_tokens"] > 0
    assert t2["usage"]["evaluated_tokens"] < t2["usage"]["prompt_tokens"] // 2
    # the long message does not fit beside the conversation: older turns are dropped
    assert t3["usage"]["truncated_tokens"] > 0
    assert t1["usage"]["truncated_tokens"] == t2["usage"]["truncated_tokens"] == 0
    dropped = sum(t["usage"]["dropped_tokens"] for t in (t1, t2, t3))
    assert s1["stats"]["total"]["dropped_tokens"] == dropped
    assert s1["stats"]["total"]["context_shifts"] == sum(t["usage"]["context_shifts"] for t in (t1, t2, t3))
    assert s2["stats"]["total"]["dropped_tokens"] == dropped + t4["usage"]["dropped_tokens"]
    assert s2["stats"]["last_turn"]["dropped_tokens"] == t4["usage"]["dropped_tokens"]
    # off: the old refusal
    out = _chat(tiny_model, ["hi", long], "--template", str(tmp_path / "t.jinja"), "--ctx", "64", "-n", "4",
                "--temp", "0", "--context-shift", "off")
    assert out[1]["finish_reason"] == "context_full" and "/reset" in out[1]["error"]


def test_holding_kv_keeps_shifted_sequences_whole(tiny_model):
    """`run` reads the cache after the request through HoldingKV: a shifted sequence is still
    0..n-1 there, and its cells are freed on release. Two continuations outgrow 64 cells together:
    one is preempted, and the cells HoldingKV holds for it are given back (they used to be held, and
    the engine waited for ever)."""
    with pk.Model(tiny_model) as m:
        cfg = EngineConfig(n_ctx=64, parallel=2, prefix_cache=0, keep_finished=False, **F32)
        ctx = m.context(**cfg.context().context_kwargs())
        try:
            kv = HoldingKV(ctx, cfg.parallel, cfg.prefix_cache)
            with Engine(m, cfg, kv=kv) as eng:
                h = eng.submit(toks(20, 4), GREEDY_ALL, max_tokens=200, n=2)
                assert eng.run_until_idle(max_steps=5000) < 5000
                eng.run_until_idle()
                assert [c.finish_reason for c in h.result()] == ["length", "length"]
                assert h.usage.context_shifts >= 2 and eng.stats.preempted >= 1
                pos, seqs = ctx.kv_view()
                for seq, _ in kv.held:
                    mine = (seqs == seq.id).any(axis=1)
                    assert sorted(pos[mine].tolist()) == list(range(len(seq)))
                kv.release()
            assert ctx.free_cells() == 64
        finally:
            ctx.close()


def test_server_truncates_a_long_prompt_only_when_asked(tiny_model):
    """Over HTTP: a prompt longer than the context is a 400 naming the field, and with the extension
    field "truncate": true it is cut and answered (the server's own length check defers to it)."""
    import httpx

    from test_server import ServerProc

    s = ServerProc(str(tiny_model), "--ctx", "128", "--parallel", "1", "--max-tokens-cap", "8")
    try:
        prompt = " ".join(["the cache model token"] * 60)           # well over 128 tokens
        body = {"model": tiny_model.name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        r = httpx.post(s.url + "/completions", json=body, headers=s.headers(), timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        r = httpx.post(s.url + "/completions", json={**body, "truncate": True}, headers=s.headers(), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        assert s.stop() == 0, s.log()[-2000:]
