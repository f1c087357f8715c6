"""The real model end to end: SmolLM2-135M-Instruct (Q4_1, the catalogue's model) and its F32 copy.

* greedy tokens through pyllama_kv's engine equal llama-cpp-python's on the same (patched) library;
* on the F32 copy with an f32 cache, every KV operation (fork, truncate, exact removal, batched
  decode, defrag) leaves logits equal to a fresh evaluation of the same tokens. Quantized matmul
  kernels give different logits for different batch shapes (up to ~0.7 on the Q4_1 file), F32 ones
  agree to ~1e-5, so exactness is checked on the F32 copy only;
* the engine's n=4 forked greedy continuations each equal one greedy run;
* streamed text deltas add up to the detokenized tokens across split UTF-8 characters, and a stop
  string split across two tokens is matched;
* the GGUF's chat template renders ChatML.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import run_py
from pyllama_kv.config import default_threads
from pyllama_kv.engine import Engine, EngineConfig, SamplingParams
from pyllama_kv.modelfile.validate import ggml_type_name, read_gguf_header

TOL = 1e-3            # logits of a KV operation vs a fresh evaluation, F32 weights and cache
GREEDY_ALL = SamplingParams(temperature=0.0, ignore_eos=True)   # exactly max_tokens tokens, like llama-cpp-python


def _chat(model: pk.Model, question: str) -> list[int]:
    text = model.apply_chat_template([{"role": "user", "content": question}])
    return model.tokenize(text, special=True)


# ---------------------------------------------------------------------------------------------
# llama-cpp-python on the same library

LCPP = r"""
import json, sys
import llama_cpp
model, prompts, n, threads = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = llama_cpp.Llama(model_path=model, n_ctx=512, n_batch=64, n_ubatch=64, n_threads=threads,
                      n_threads_batch=threads, verbose=False, seed=0)
out = []
for prompt in prompts:
    llm.reset()   # no prefix reuse between prompts: every prompt is evaluated in the same batches as ours
    toks = []
    for t in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
        toks.append(int(t))
        if len(toks) == n:
            break
    out.append(toks)
print(json.dumps({"tokens": out, "lib": str(llama_cpp.llama_cpp._base_path)}))
"""


def test_greedy_tokens_equal_llama_cpp_python(real_model, builds, tmp_path):
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.fail("llama-cpp-python is not installed: `make setup` installs it (CMAKE_ARGS=-DLLAMA_BUILD=OFF)")
    bin_dir = str(Path(builds[("patched", "cpu")]["lib"]).parent)
    n, threads = 24, default_threads()
    with pk.Model(real_model) as m:
        prompts = [
            _chat(m, "What is the capital of France?"),
            m.tokenize("The history of the printing press begins"),
            m.tokenize("Le café de la gare, à Zürich, coûte 4 € — «très cher» dit-on. 日本の首都は"),
        ]
        # the engine, as the CLI runs it: prompt chunks of n_batch, then one token per step; no prefix
        # cache, so that each prompt is evaluated in the same batches as in llama-cpp-python
        cfg = EngineConfig(n_ctx=512, parallel=1, prefix_cache=0, n_batch=64, n_ubatch=64, n_threads=threads)
        ours = []
        with Engine(m, cfg) as eng:
            for p in prompts:
                h = eng.submit(p, GREEDY_ALL, max_tokens=n)
                eng.run_until_idle()
                (c,) = h.result()
                assert c.finish_reason == "length"
                ours.append(c.tokens)
    script = tmp_path / "lcpp.py"
    script.write_text(LCPP)
    r = run_py([str(script), str(real_model), json.dumps(prompts), str(n), str(threads)],
               env={"LLAMA_CPP_LIB_PATH": bin_dir})
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    assert theirs["lib"] == bin_dir, "llama-cpp-python did not load our patched library"
    for p, a, b in zip(prompts, ours, theirs["tokens"]):
        assert len(a) == n
        assert a == b, f"prompt {p[:8]}...: ours {a} != llama-cpp-python {b}"


# ---------------------------------------------------------------------------------------------
# the F32 copy, and the exactness of KV operations on it

def test_f32_copy_is_faithful(real_model, real_f32_model):
    """Every metadata field copied as is, in order (strings, the vocabulary arrays, the chat
    template), but general.file_type; every tensor F32 and equal to the dequantized source. Read
    back with pyllama_kv's own GGUF parser, not the gguf package that wrote it."""
    import gguf

    src, dst = read_gguf_header(real_model), read_gguf_header(real_f32_model)
    assert list(dst.kv) == list(src.kv)
    for key, kv in src.kv.items():
        got = dst.kv[key]
        assert (got.type, got.elem_type) == (kv.type, kv.elem_type), key
        if key == "general.file_type":
            assert got.value == gguf.LlamaFileType.ALL_F32 != kv.value
        elif isinstance(kv.value, np.ndarray):
            assert np.array_equal(got.value, kv.value), key
        else:
            assert got.value == kv.value, key
    assert [(t.name, t.ne) for t in dst.tensors] == [(t.name, t.ne) for t in src.tensors]
    assert {ggml_type_name(t.type) for t in dst.tensors} == {"f32"}
    assert "q4_1" in {ggml_type_name(t.type) for t in src.tensors}
    raw_src = np.memmap(real_model, np.uint8, "r")
    raw_dst = np.memmap(real_f32_model, np.uint8, "r")
    for t, u in zip(src.tensors, dst.tensors):
        if t.name not in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight", "output_norm.weight"):
            continue
        rows = t.ne[1] * t.ne[2] * t.ne[3]
        data = raw_src[src.data_offset + t.offset:][:t.nbytes].reshape(rows, -1)
        want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(t.type)).reshape(-1)
        got = raw_dst[dst.data_offset + u.offset:][:u.nbytes].view(np.float32)
        assert np.array_equal(got, want), t.name


@pytest.fixture(scope="module")
def f32(real_f32_model):
    with pk.Model(real_f32_model) as m:
        yield m


class Fresh:
    """Logits of a fresh evaluation (one batch, an empty cache) to compare a sequence against."""

    def __init__(self, model: pk.Model):
        self.model = model
        self.ctx = model.context(n_ctx=512, n_seq_max=1, type_k="f32", type_v="f32")
        self.seq = self.ctx.new_sequence()
        self.max_diff = 0.0

    def logits(self, tokens: list[int]) -> np.ndarray:
        self.ctx.clear()
        return self.seq.extend(tokens)

    def check(self, seq: pk.Sequence, logits: np.ndarray | None = None) -> float:
        """Assert that ``logits`` (default: the sequence's own) equal a fresh evaluation of its tokens."""
        got = seq.logits() if logits is None else logits
        d = float(np.abs(got - self.logits(seq.tokens)).max())
        self.max_diff = max(self.max_diff, d)
        assert d < TOL, f"sequence {seq.id} ({len(seq)} tokens): logits differ from a fresh evaluation by {d}"
        return d


@pytest.fixture
def fresh(f32):
    ref = Fresh(f32)
    yield ref
    print(f"max |logits - fresh| = {ref.max_diff:.2e}")
    ref.ctx.close()


@pytest.fixture
def ctx(f32):
    with f32.context(n_ctx=512, n_seq_max=6, type_k="f32", type_v="f32") as c:
        yield c


TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his "
        "father had taught him, and lit the lamp before the ships came in from the northern sea.")


def test_fork_matches_fresh(f32, ctx, fresh):
    toks = f32.tokenize(TEXT)
    a = ctx.new_sequence()
    a.extend(toks)
    b = a.fork()                 # shares all of a's cells
    c = a.fork(len(toks) // 2)   # shares the first half
    out = ctx.decode({a: f32.tokenize(" Tonight", add_bos=False), b: f32.tokenize(" Then", add_bos=False),
                      c: f32.tokenize(" a storm", add_bos=False)})
    for s in (a, b, c):
        fresh.check(s, out[s])
    for s in (a, b, c):          # and a step further, each on its own
        fresh.check(s, s.extend([f32.tokenize(" the", add_bos=False)[0]]))


def test_truncate_matches_fresh(f32, ctx, fresh):
    toks = f32.tokenize(TEXT)
    a = ctx.new_sequence()
    a.extend(toks)
    b = a.fork()
    a.truncate(len(toks) - 9)
    fresh.check(a, a.extend(f32.tokenize(" and then", add_bos=False)))
    a.truncate(len(toks) - 12)
    fresh.check(a)                                        # the last kept token re-evaluated over the cache
    fresh.check(b, b.logits(recompute=True))              # the fork kept its cells


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared-with-fork"])
def test_exact_remove_matches_fresh(f32, ctx, fresh, shared):
    toks = f32.tokenize(TEXT)
    a = ctx.new_sequence()
    a.extend(toks)
    b = a.fork() if shared else None
    a.remove(5, 17, recompute=True)
    assert a.tokens == toks[:5] + toks[17:]
    fresh.check(a)
    fresh.check(a, a.extend(f32.tokenize(" Every", add_bos=False)))
    if b is not None:
        assert b.tokens == toks
        fresh.check(b, b.logits(recompute=True))


def test_batched_decode_matches_fresh(f32, ctx, fresh):
    prompts = [TEXT, "Water boils at one hundred degrees", "def fibonacci(n):\n    if n < 2:",
               "Once upon a time, in a small village"]
    seqs = [ctx.new_sequence() for _ in prompts]
    out = ctx.decode({s: f32.tokenize(p) for s, p in zip(seqs, prompts)})   # four prompts, one batch
    for s in seqs:
        fresh.check(s, out[s])
    for _ in range(4):   # generation: one greedy token per sequence, all in one batch
        out = ctx.decode({s: [int(np.argmax(out[s]))] for s in seqs})
        for s in seqs:
            fresh.check(s, out[s])


def test_defrag_matches_fresh(f32, ctx, fresh):
    # interleaved sequences: generate them one token per step so their cells alternate, then free
    # some to leave a comb of holes, defragment, and check the survivors
    prompts = [TEXT, "Water boils at one hundred degrees", "Once upon a time, in a small village",
               "The quick brown fox"]
    seqs = [ctx.new_sequence() for _ in prompts]
    out = ctx.decode({s: f32.tokenize(p) for s, p in zip(seqs, prompts)})
    for _ in range(12):
        out = ctx.decode({s: [int(np.argmax(out[s]))] for s in seqs})
    seqs[1].close()
    seqs[3].truncate(4)
    before = ctx.kv_stats()
    assert before.holes > 0
    after = ctx.defrag()
    assert after.holes == 0 and after.defrags > before.defrags and after.cells_moved > before.cells_moved
    for s in (seqs[0], seqs[2], seqs[3]):
        fresh.check(s, s.logits(recompute=True))
    out = ctx.decode({s: f32.tokenize(" and", add_bos=False) for s in (seqs[0], seqs[2], seqs[3])})
    for s in (seqs[0], seqs[2], seqs[3]):
        fresh.check(s, out[s])


# ---------------------------------------------------------------------------------------------
# the engine on the real model

def test_engine_n4_equals_single_greedy_runs(f32):
    prompt = _chat(f32, "Name three colours of the rainbow.")
    cfg = EngineConfig(n_ctx=512, parallel=4, prefix_cache=0, type_k="f32", type_v="f32")
    with Engine(f32, cfg) as eng:
        h4 = eng.submit(prompt, GREEDY_ALL, max_tokens=24, n=4)
        eng.run_until_idle()
        h1 = eng.submit(prompt, GREEDY_ALL, max_tokens=24, n=1)
        eng.run_until_idle()
        assert eng.stats.reused_tokens == 0   # the single run evaluated its prompt afresh
    (single,) = h1.result()
    assert len(single.tokens) == 24 and single.text == f32.detokenize(single.tokens)
    assert [c.index for c in h4.result()] == [0, 1, 2, 3]
    for c in h4.result():
        assert (c.tokens, c.text, c.finish_reason) == (single.tokens, single.text, "length"), f"continuation {c.index}"


def _stream(model, prompt, max_tokens, stop=()):
    cfg = EngineConfig(n_ctx=512, parallel=1, prefix_cache=0)
    with Engine(model, cfg) as eng:
        h = eng.submit(prompt, SamplingParams(temperature=0.0), max_tokens=max_tokens, stop=stop)
        eng.run_until_idle()
    events = list(h)
    (c,) = h.result()
    return events, c


def _splits_characters(model, tokens) -> bool:
    """Whether some token's piece is not whole UTF-8 (a character split across tokens)."""
    for t in tokens:
        try:
            model.token_to_piece(t).decode("utf-8")
        except UnicodeDecodeError:
            return True
    return False


def test_streamed_deltas_add_up_across_split_characters(real_model):
    with pk.Model(real_model) as m:
        events, c = _stream(m, _chat(m, "Write the word 'hello' in Japanese."), max_tokens=32)
        tokens = [t for ev in events for t in ev.tokens]
        text = "".join(ev.text for ev in events)
        assert tokens == c.tokens and text == c.text
        assert text == m.detokenize(tokens)
        assert "\ufffd" not in "".join(ev.text for ev in events[:-1])   # no delta ends inside a character
        assert any(ord(ch) > 0x7F for ch in text), f"no multi-byte characters in {text!r}"
        assert _splits_characters(m, tokens), "no character was split across tokens: the test proves nothing"


def test_stop_string_split_across_tokens(real_model):
    with pk.Model(real_model) as m:
        prompt = m.tokenize("The capital of France is Paris. The capital of Germany is")
        _, ref = _stream(m, prompt, max_tokens=24)
        pieces = [m.token_to_piece(t).decode("utf-8") for t in ref.tokens]
        assert "".join(pieces) == ref.text
        # a stop string made of the end of one token and the start of the next, first seen there
        ends = list(itertools.accumulate(len(p) for p in pieces))   # text offset after each token
        stop = None
        for k in range(1, len(pieces) - 1):
            left, right = pieces[k], pieces[k + 1]
            cand = left[-2:] + right[:2]
            if len(left.strip()) >= 2 and len(right.strip()) >= 2 and ref.text.find(cand) == ends[k] - 2:
                stop = cand
                break
        assert stop is not None, f"no stop string spanning two tokens found in {pieces}"
        events, c = _stream(m, prompt, max_tokens=24, stop=["never appears", stop])
        cut = ref.text.find(stop)
        assert (c.text, c.finish_reason) == (ref.text[:cut], "stop")
        assert "".join(ev.text for ev in events) == c.text
        assert c.tokens == ref.tokens[:len(c.tokens)]


# ---------------------------------------------------------------------------------------------
# chat template

def test_chat_template_renders_chatml(real_model):
    with pk.Model(real_model) as m:
        assert m.chat_template is not None and "<|im_start|>" in m.chat_template
        msgs = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Quelle est la capitale de la France ? 🇫🇷"}]
        text = m.apply_chat_template(msgs)
        assert text == (
            "<|im_start|>system\nYou answer in one word.<|im_end|>\n"
            "<|im_start|>user\nQuelle est la capitale de la France ? 🇫🇷<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        toks = m.tokenize(text, special=True)
        im_start = m.tokenize("<|im_start|>", add_bos=False, special=True)
        assert len(im_start) == 1 and toks.count(im_start[0]) == 3   # ChatML's markers are single tokens
