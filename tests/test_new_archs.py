"""Architectures only the current llama.cpp can run, on tiny random models (issue 32, item 4):
``smollm3`` (dense; no RoPE in every 4th layer), ``gemma3`` with its sliding-window (SWA) cache, and
``lfm2`` (hybrid: short-convolution layers with recurrent state between attention layers).

F32 weights and an F32 cache, so that every oracle is exact up to float rounding: logits compared
with a fresh single-sequence evaluation on the same library. A cut the model's memory cannot make
(recurrent state, a window the SWA cache no longer holds) must raise InvalidInputError with nothing
changed; whatever succeeds must continue exactly as a fresh evaluation."""
from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest

import pyllama_kv as pk
from conftest import F32, run_cli, toks
from pyllama_kv.engine import GREEDY, Engine, EngineConfig
from pyllama_kv.tools.gguf import make_tiny_model
from pyllama_kv.tools.gguf_inspect import inspect_gguf
from test_engine import greedy_run

# 1e-4 per 10 of the logits' magnitude: F32 rounding moves logits with the batch shape by ~2e-6 of
# their size (measured: gemma3's reach ~64, its embeddings scaled by sqrt(n_embd), and moved by 1.1e-4
# between one batch and one token at a time; lfm2's and smollm3's ~35, by <3e-5). A continuation from
# the wrong state is off by whole units (2 to 12 here).
TOL = 1e-4

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

ARCHS = {
    "smollm3": dict(arch="smollm3", n_layer=4),   # layer 3 without RoPE
    # layers 0 and 1 with an 8-token window, layer 2 global (the current pin reads the pattern)
    "gemma3": dict(arch="gemma3", n_layer=3, sliding_window=8,
                   kv_overrides={"gemma3.attention.sliding_window_pattern": (3, gguf.GGUFValueType.UINT32)}),
    # conv, attention, conv, attention; a chat template for serve
    "lfm2": dict(arch="lfm2", n_layer=4, kv_overrides={"tokenizer.chat_template": CHATML}),
}


@pytest.fixture(scope="module")
def paths(models) -> dict:
    return {name: make_tiny_model(models / f"new-{name}.gguf", seed=3, **kw) for name, kw in ARCHS.items()}


@pytest.fixture(scope="module", params=list(ARCHS))
def model(request, paths, current_lib):
    with pk.Model(paths[request.param], lib=current_lib) as m:
        yield m


def arch(model) -> str:
    return model.meta("general.architecture")


def fresh(model, tokens) -> np.ndarray:
    """The next-token logits of ``tokens`` evaluated alone, in a context of their own."""
    with model.context(n_ctx=512, n_seq_max=1, **F32) as c:
        return c.new_sequence().extend(tokens)


def close(a, b) -> bool:
    return float(np.abs(a - b).max()) <= TOL * max(1.0, float(np.abs(b).max()) / 10)


# -- the files -------------------------------------------------------------------------------------

def test_the_generator_writes_what_llama_cpp_reads(paths):
    """The metadata and tensors llama.cpp-current's loaders ask for (src/models/{smollm3,lfm2}.cpp)."""
    r = gguf.GGUFReader(paths["lfm2"])
    kv = r.get_field("lfm2.attention.head_count_kv")
    assert kv.contents() == [0, 2, 0, 2]   # 0 KV heads: a short-convolution (recurrent) layer
    assert r.get_field("lfm2.shortconv.l_cache").contents() == 3
    names = {t.name: tuple(int(d) for d in t.shape) for t in r.tensors}
    assert names["blk.0.shortconv.conv.weight"] == (3, 64) and names["blk.0.shortconv.in_proj.weight"] == (64, 192)
    assert "blk.0.attn_q.weight" not in names and names["blk.1.attn_q_norm.weight"] == (16,)
    assert "token_embd_norm.weight" in names and "output.weight" not in names and "output_norm.weight" not in names
    s = {t.name for t in gguf.GGUFReader(paths["smollm3"]).tensors}
    assert {f"blk.{i}.attn_q.weight" for i in range(4)} <= s and "output.weight" not in s
    info = {name: inspect_gguf(p) for name, p in paths.items()}
    assert info["gemma3"]["sliding_window"] == 8 and info["gemma3"]["can_shift"] is True
    assert info["lfm2"]["can_shift"] is False and info["smollm3"]["can_shift"] is False
    # inspect validates for the default (mission) library, which knows gemma3 only
    assert info["gemma3"]["validation"]["ok"] and info["gemma3"]["validation"]["level"] == "vetting"
    for name in ("smollm3", "lfm2"):
        assert not info[name]["validation"]["ok"] and "lib='current'" in info[name]["validation"]["error"]


@pytest.mark.parametrize("name", ["smollm3", "lfm2"])
def test_the_mission_library_points_to_the_current_one(paths, name):
    """Loaded on the mission pin by choice (without one it loads on the current library by itself: the
    tests of issue 46 below), the refusal names the library that has the architecture."""
    with pytest.raises(pk.ModelLoadError, match=f"unknown model architecture '{name}'.*lib='current'"):
        pk.Model(paths[name], lib="patched")


# -- the API ---------------------------------------------------------------------------------------

def test_loads_and_decodes_batches_exactly(model):
    a = arch(model)
    assert model.native_library.api == "current"
    assert model.recurrent is (a == "lfm2")
    assert model.n_swa == (8 if a == "gemma3" else 0)
    assert model.k_shift_exact is (a == "gemma3")   # smollm3: layers without RoPE; lfm2: recurrent state
    prompts = [toks(17, 1), toks(9, 2), toks(31, 3)]
    with model.context(n_ctx=512, n_seq_max=4, **F32) as ctx:
        assert ctx.can_shift is (a == "gemma3")
        seqs = [ctx.new_sequence() for _ in prompts]
        out = ctx.decode(dict(zip(seqs, prompts)))
        for s, p in zip(seqs, prompts):
            assert out[s].shape == (model.n_vocab,) and np.isfinite(out[s]).all()
            assert close(out[s], fresh(model, p))
        nxt = ctx.decode({s: [5 + i] for i, s in enumerate(seqs)})
        for i, (s, p) in enumerate(zip(seqs, prompts)):
            assert close(nxt[s], fresh(model, p + [5 + i]))
        # the logits depend on the whole context, not only on the last tokens
        assert not close(fresh(model, prompts[2]), fresh(model, prompts[0][:5] + prompts[2][5:]))


def test_the_engine_generates_as_a_plain_decode_loop(model):
    prompt = toks(12, 2)
    want = greedy_run(model, prompt, 16, n_ctx=512)
    cfg = EngineConfig(n_ctx=512, parallel=4, prefix_cache=2, cache_ram=0, **F32)
    with Engine(model, cfg) as eng:
        h = eng.submit(prompt, GREEDY, max_tokens=16, n=4)
        eng.run_until_idle()
        assert [c.tokens for c in h.result()] == [want] * 4
        assert eng.stats.evaluated_tokens == 12, "the prompt is evaluated once for the 4 continuations"
        # a prompt that shares 15 tokens with a cached sequence of 28: a fork of 14 of them where
        # the memory can go back; lfm2's recurrent layers cannot, but the cached prompt (12 tokens)
        # left its checkpoint when the longer answer absorbed it: 12 forked, 3 evaluated
        again = eng.submit(prompt + want[:3], GREEDY, max_tokens=8)
        eng.run_until_idle()
        assert again.result()[0].tokens == want[3:11]
        assert eng.stats.evaluated_tokens == 12 + (3 if arch(model) == "lfm2" else 1)


def test_a_fork_continues_exactly(model):
    prompt = toks(40, 4)
    with model.context(n_ctx=512, n_seq_max=4, **F32) as ctx:
        a = ctx.new_sequence()
        a.extend(prompt)
        used = ctx.kv_stats().used_cells
        b = a.fork()
        assert ctx.kv_stats().used_cells == used, "a fork shares its parent's cells"
        assert close(b.extend([7, 8]), fresh(model, prompt + [7, 8]))
        assert close(a.extend([9]), fresh(model, prompt + [9]))   # the parent's own state, untouched by b
        if model.recurrent:
            assert not ctx.can_fork(a, 25)
            with pytest.raises(pk.InvalidInputError, match="recurrent layers"):
                a.fork(25)
            assert len(ctx.sequences) == 2 and a.tokens == prompt + [9]
        else:
            assert ctx.can_fork(a, 25)
            c = a.fork(25)
            assert close(c.extend(toks(5, 9)), fresh(model, prompt[:25] + toks(5, 9)))
        assert close(a.extend([10]), fresh(model, prompt + [9, 10]))


@pytest.fixture(scope="module", params=["smollm3", "gemma3-layer0", "lfm2"])
def cut_model(request, paths, models, current_lib):
    """The models of the cut tests. gemma3's K-shift is exact only where the cached K depend on the
    token and its position alone: its variant mixes tokens in layer 0 only (an 8-token window; the
    attention output of layers 1 and 2 is zero), so a removal by K-shift equals a fresh evaluation."""
    if request.param == "gemma3-layer0":
        zero = np.zeros((64, 64), np.float32)
        path = make_tiny_model(models / "new-gemma3-layer0.gguf", seed=3, **{
            **ARCHS["gemma3"], "tensor_overrides": {f"blk.{i}.attn_output.weight": zero for i in (1, 2)}})
    else:
        path = paths[request.param]
    with pk.Model(path, lib=current_lib) as m:
        yield m


# each cut of a sequence of 16 tokens, and the tokens it leaves (short, so that the 8-token window of
# the next position reaches back before the cut)
CUTS = {
    "truncate": (lambda s: s.truncate(10), lambda t: t[:10]),
    "remove-middle": (lambda s: s.remove(5, 12), lambda t: t[:5] + t[12:]),
    "remove-head": (lambda s: s.remove(0, 6), lambda t: t[6:]),
    "remove-recompute": (lambda s: s.remove(5, 12, recompute=True), lambda t: t[:5] + t[12:]),
    "fork-part": (lambda s: s.fork(10).close(), lambda t: t),
    "logits-recompute": (lambda s: s.logits(recompute=True), lambda t: t),
}


@pytest.mark.parametrize("cut", list(CUTS))
def test_a_cut_is_exact_or_refused_with_nothing_changed(cut_model, cut):
    """Every way of going back in a sequence: a continuation exactly as a fresh evaluation of the
    tokens the sequence says it holds, or InvalidInputError with the sequence, its cells and its
    continuation as before. lfm2 refuses all but what needs no state before the cut (a removal of
    the head re-evaluates the rest from position 0); the others go back exactly (gemma3 by a
    K-shift, smollm3 by re-evaluating)."""
    model = cut_model
    op, left = CUTS[cut]
    t = toks(16, 10)
    refused = model.recurrent and cut not in ("remove-head",)
    with model.context(n_ctx=256, n_seq_max=3, **F32) as ctx:
        other = ctx.new_sequence()
        other.extend(toks(8, 11))
        a = ctx.new_sequence()
        a.extend(t)
        used = ctx.kv_stats().used_cells
        if refused:
            with pytest.raises(pk.InvalidInputError, match="recurrent layers.*nothing was changed"):
                op(a)
            assert a.tokens == t and ctx.kv_stats().used_cells == used and len(ctx.sequences) == 2
        else:
            op(a)
        want = t if refused else left(t)
        assert a.tokens == want
        assert close(a.extend([9]), fresh(model, want + [9]))
        assert close(other.extend([4]), fresh(model, toks(8, 11) + [4]))


def test_a_window_the_swa_cache_dropped_is_refused(paths, current_lib):
    """The current llama.cpp's SWA cache reuses the cells of positions outside a sequence's window
    when it finds them before free ones: here b's positions 0..4 (the cells after a's truncated tail
    are b's oldest). A cut of b back to where the token attends to them is refused with nothing
    changed (it continued wrongly before: these logits differed by ~4); a cut whose window is
    still held is exact."""
    with pk.Model(paths["gemma3"], lib=current_lib) as model, \
            model.context(n_ctx=256, n_seq_max=3, **F32) as ctx:
        a, b = ctx.new_sequence(), ctx.new_sequence()
        a.extend(toks(100, 3))
        b.extend(toks(100, 4))
        a.truncate(95)                 # frees cells 95..99: the caches' search starts there
        b.extend(toks(10, 5))          # 5 free cells, then b's cells of positions 0..4 (masked: reused)
        tb = toks(100, 4) + toks(10, 5)
        used = ctx.kv_stats().used_cells
        for op in (lambda: b.truncate(6), lambda: b.fork(11), lambda: b.remove(3, 60),
                   lambda: b.remove(8, 60, recompute=True)):
            with pytest.raises(pk.InvalidInputError, match="sliding-window cache holds them only from position 5"):
                op()
            assert b.tokens == tb and ctx.kv_stats().used_cells == used and len(ctx.sequences) == 2
        assert not ctx.can_fork(b, 11) and ctx.can_fork(b, 12)
        b.truncate(12)                 # the window of position 12 is [5, 12): held
        assert close(b.extend([8]), fresh(model, tb[:12] + [8]))
        c = b.fork()
        assert close(c.extend([7]), fresh(model, tb[:12] + [8, 7]))
        assert close(a.extend([9]), fresh(model, toks(100, 3)[:95] + [9]))


def test_smollm3_layers_without_rope_are_not_k_shifted(current_lib, tmp_path):
    """llama.cpp's K-shift rotates the K of smollm3's layers without RoPE too (it skips only what
    rope_pattern marks, which smollm3 never sets): a removal by K-shift continued wrongly (logits
    off by ~12 here), so the context re-evaluates instead. The oracle is exact for a K-shift: layers
    0-2 mix no tokens (their attention output is zero), so the cached K of every layer depend only
    on the token and its position, and a correct shift equals a fresh evaluation."""
    zero = np.zeros((64, 64), np.float32)
    path = make_tiny_model(tmp_path / "smollm3-shift.gguf", arch="smollm3", n_layer=4,
                           tensor_overrides={f"blk.{i}.attn_output.weight": zero for i in range(3)})
    t = toks(30, 2)
    with pk.Model(path, lib=current_lib) as model, model.context(n_ctx=256, n_seq_max=2, **F32) as ctx:
        assert not ctx.can_shift
        a = ctx.new_sequence()
        a.extend(t)
        a.remove(5, 10)
        assert close(a.extend([7]), fresh(model, t[:5] + t[10:] + [7]))
        with pytest.raises(pk.LlamaError, match="cannot shift"):
            a.shift_out(1, 3)


# -- the command line and the server -----------------------------------------------------------------

def test_cli_run_smollm3_on_the_current_library(paths, current_lib):
    r = run_cli(["run", str(paths["smollm3"]), "--lib", "current", "-p", "the cache of the model", "-n", "8",
                 "--temp", "0", "--type-k", "f32", "--type-v", "f32", "--json", "-t", "2"])
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["library"] == "current" and out["outputs"][0]["tokens"] >= 1
    with pk.Model(paths["smollm3"], lib=current_lib) as m:
        want = []
        for tok in greedy_run(m, m.tokenize("the cache of the model"), 8, n_ctx=256):
            if m.is_eog(tok):
                break
            want.append(tok)
        assert out["outputs"][0]["text"] == b"".join(m.token_to_piece(t) for t in want).decode("utf-8", "replace")


def test_serve_lfm2_chat_on_the_current_library(paths, current_lib):
    """Chat on the hybrid model under a system prompt: a first turn, the same again (its prompt is a
    part of the cached conversation, which lfm2's recurrent layers cannot be forked from: the server
    kept a checkpoint at the end of the system prompt, so all of that is reused), a second turn
    extending the conversation (the whole of it reused), and another conversation under the same
    system prompt; every answer is the greedy continuation of the rendered prompt."""
    from test_server import ServerProc

    with pk.Model(paths["lfm2"], lib=current_lib) as m:
        def greedy_text(messages) -> str:
            ids = m.tokenize(m.apply_chat_template(messages), special=True)
            out = []
            for tok in greedy_run(m, ids, 8, n_ctx=512):
                if m.is_eog(tok):
                    break
                out.append(tok)
            return b"".join(m.token_to_piece(t) for t in out).decode("utf-8", "replace")

        system = {"role": "system", "content": "a model of the cache and the token, " * 6}
        sys_end = len(m.tokenize(m.apply_chat_template([system], add_generation_prompt=False), special=True))
        msgs = [system, {"role": "user", "content": "the cache of the model"}]
        with ServerProc(paths["lfm2"], "--lib", "current", "--ctx", "512", "--parallel", "2", "--type-k", "f32",
                        "--type-v", "f32", key=None) as s:
            import httpx

            cached, prompts = [], []
            for turn in range(4):
                if turn == 3:   # another conversation under the same system prompt
                    msgs = [system, {"role": "user", "content": "a token of the model"}]
                body = {"model": "new-lfm2", "messages": msgs, "max_tokens": 8, "temperature": 0}
                r = httpx.post(s.url + "/chat/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text + s.log()[-3000:]
                answer = r.json()["choices"][0]["message"]["content"]
                usage = r.json()["usage"]
                assert usage["completion_tokens"] >= 1
                assert answer == greedy_text(msgs), (turn, answer)
                cached.append(usage["prompt_tokens_details"]["cached_tokens"])
                prompts.append(usage["prompt_tokens"])
                if turn == 1:
                    msgs = msgs + [{"role": "assistant", "content": answer},
                                   {"role": "user", "content": "and the token"}]
            assert "Traceback" not in s.log()
            met = s.idle_metrics()   # the checkpoints and the forks from them, in /metrics
            assert met["pyllama_kv_prefix_checkpoints"] >= 1 and met["pyllama_kv_prefix_checkpoint_bytes"] > 0
            assert met["pyllama_kv_prefix_checkpoint_forks_total"] >= 2
        # turn 2 forks the whole cached conversation (the prompt of turn 1 and its answer)
        assert cached[0] == 0 and cached[1] == sys_end and cached[3] == sys_end, (cached, sys_end)
        assert cached[2] > prompts[1], (cached, prompts)


def test_context_shift_continues_exactly_or_re_evaluates_everything(cut_model):
    """An answer three times as long as the context: each context shift K-shifts where that is exact
    (the gemma3 variant), else cuts back to n_keep and re-evaluates the rest (smollm3), else, where
    the memory cannot go back to n_keep (lfm2's recurrent layers; gemma3's SWA cache once it reused
    the cells of that window), re-evaluates everything kept; the
    logits of the first decode after every shift are a fresh evaluation of the tokens then held."""
    from test_context_shift import Recorder

    model = cut_model
    cfg = EngineConfig(n_ctx=64, parallel=1, prefix_cache=1, **F32)
    with Engine(model, cfg) as eng:
        n = 3 * eng.n_ctx   # (the current llama.cpp pads the cache to 256 cells)
        rec = Recorder(eng.kv)
        eng.kv = rec
        h = eng.submit(toks(10, 7), GREEDY, max_tokens=n, n_keep=5)
        eng.run_until_idle()
        (c,) = h.result()
        st = eng.stats
    assert c.finish_reason == "length" and len(c.tokens) == n
    assert st.context_shifts >= 3 and h.usage.context_shifts == st.context_shifts
    if model.k_shift_exact:
        # gemma3 K-shifts, except where its SWA cache reused the cells of the window of position
        # n_keep (the cells freed by a shift are taken by later tokens, so a sequence's oldest cells
        # are reached again): those shifts re-evaluate
        assert 0 < st.shifts_reevaluated < st.context_shifts
    else:
        assert st.shifts_reevaluated == st.context_shifts
    assert rec.records, "no decode after a shift was recorded"
    for _, held, logits in rec.records:
        want = fresh(model, held)
        if model.k_shift_exact:
            # RoPE of a rotated key differs from RoPE at the new position by float rounding: 1e-4 of
            # the logits' size, as test_context_shift's K-shift bound (measured: 1.2e-3 of ~67)
            assert float(np.abs(logits - want).max()) <= 1e-4 * float(np.abs(want).max())
        else:
            assert close(logits, want)
    if model.recurrent:   # the 5 kept tokens were decoded again at every shift
        assert st.reevaluated_tokens >= st.context_shifts * 5


# Gemma 3's own template (its text part): the system prompt goes into the first user turn
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') + message['content'] | trim "
    "+ '<end_of_turn>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")


def test_the_servers_system_prompt_boundary_under_a_template_that_folds_it_into_the_first_turn(current_lib, tmp_path):
    """Gemma's template renders the system prompt into the first user turn, so the system messages
    alone render as BOS: the server's boundary for the engine's checkpoint (Server._system_end) is
    then where the first user message's content starts, the point where two conversations under the
    same system prompt part; ChatML's (lfm2 here) stays the end of the system message."""
    import functools
    from types import SimpleNamespace

    from pyllama_kv.chat.conversation import Transcripts
    from pyllama_kv.core.span import shared_prefix
    from pyllama_kv.server.app import Server

    system = {"role": "system", "content": "You answer in one short sentence about the notes. " * 3}
    kv = {**ARCHS["gemma3"]["kv_overrides"], "tokenizer.chat_template": GEMMA3_TEMPLATE}
    path = make_tiny_model(tmp_path / "gemma3-template.gguf", seed=3, **{**ARCHS["gemma3"], "kv_overrides": kv})
    for p in (path, make_tiny_model(tmp_path / "lfm2.gguf", seed=3, **ARCHS["lfm2"])):
        with pk.Model(p, lib=current_lib) as m:
            assert m.branch_checkpoints
            srv = SimpleNamespace(model=m, transcripts=Transcripts(m), template=None, template_name=None)
            srv._render = functools.partial(Server._render, srv)
            a, b = ([system, {"role": "user", "content": c}] for c in ("Hello there", "Bonjour"))
            ta, tb = (srv.transcripts.tokenize(m.apply_chat_template(x)) for x in (a, b))
            end = Server._system_end(srv, a, None, ta)
            alone = srv.transcripts.tokenize(m.apply_chat_template([system], add_generation_prompt=False))
            if p == path:   # the system messages alone: BOS; the boundary: where the two conversations part
                assert shared_prefix(alone, ta) < 16 and end == [shared_prefix(ta, tb)] and end[0] > 40, end
            else:           # ChatML: the end of the system message
                assert end == [len(alone)] and len(alone) > 40, end


# -- the library follows the model (issue 46) ------------------------------------------------------------

def test_a_model_only_the_current_library_loads_chooses_it(paths, tiny_model, current_lib, monkeypatch, capfd):
    """Without a choice (no lib, no $PYLLAMA_KV_LIB) a SmolLM3 or LFM2 file loads on the current library,
    said in one line on stderr and in Model.library; a choice made stays, with today's clear error."""
    monkeypatch.delenv("PYLLAMA_KV_LIB", raising=False)
    for name in ("smollm3", "lfm2"):
        with pk.Model(paths[name]) as m:
            assert m.library["variant"] == "current" and m.library["chosen"] == m.library_choice
            assert f"architecture {name!r}" in m.library_choice and m.tokenize("the cache")
        err = capfd.readouterr().err
        assert err.count("loads on the 'current' library") == 1, err
    with pk.Model(tiny_model) as m:   # an architecture the default library has: it stays
        assert m.library["variant"] == "patched" and not m.library_choice and "chosen" not in m.library
    with pytest.raises(pk.ModelLoadError, match="lib='current'"):
        pk.Model(paths["smollm3"], lib="patched")
    monkeypatch.setenv("PYLLAMA_KV_LIB", "patched")   # a choice too
    with pytest.raises(pk.ModelLoadError, match="lib='current'"):
        pk.Model(paths["smollm3"])


def test_run_and_serve_choose_the_current_library_for_it(paths, current_lib):
    from test_server import ServerProc

    if os.environ.get("PYLLAMA_KV_LIB"):
        pytest.skip("$PYLLAMA_KV_LIB chooses the library here (a device run)")
    r = run_cli(["run", str(paths["smollm3"]), "-p", "the cache of the model", "-n", "4", "--temp", "0", "--json",
                 "-t", "2"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["library"] == "current" and "loads on the 'current' library" in r.stderr
    with ServerProc(paths["lfm2"], "--ctx", "512", "--parallel", "1", key=None) as s:
        import httpx

        model = httpx.get(s.url + "/models", timeout=30).json()["data"][0]
        assert model["library"] == "current" and "architecture 'lfm2'" in model["library_chosen"]
        body = {"model": model["id"], "messages": [{"role": "user", "content": "the cache"}], "max_tokens": 4}
        assert httpx.post(s.url + "/chat/completions", json=body, timeout=60).status_code == 200


def test_a_model_that_needs_the_current_library_says_how_to_build_it(paths, monkeypatch):
    from pyllama_kv.core import model as model_mod

    monkeypatch.delenv("PYLLAMA_KV_LIB", raising=False)
    real = model_mod._kv.load_library

    def no_current(lib=None):
        if lib == "current":
            raise pk.LibraryError("no current build of libllama found")
        return real(lib)
    monkeypatch.setattr(model_mod._kv, "load_library", no_current)
    with pytest.raises(pk.LibraryError, match=r"architecture 'smollm3' needs the current llama.cpp.*not built.*"
                                              r"pyllama-kv build --pin current"):
        pk.Model(paths["smollm3"])
