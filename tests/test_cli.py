"""The `pyllama-kv` entry point, run for real in subprocesses on the tiny model."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from conftest import ENTRY_POINT, ROOT, run_cli, run_py, write_unknown_arch_model


def test_the_entry_point_is_installed():
    # no skip when it is missing: run_cli would quietly fall back to `python -m pyllama_kv.cli.main`
    assert ENTRY_POINT.is_file(), f"the venv entry point {ENTRY_POINT} is missing: run `make setup` (pip install -e .)"


def _entry() -> str:
    if not ENTRY_POINT.is_file():
        pytest.fail(f"the venv entry point {ENTRY_POINT} is missing: run `make setup` (pip install -e .)")
    return str(ENTRY_POINT)


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1", GGML_NO_BACKTRACE="1", **extra)


def _run_bytes(args: list, input: bytes | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    """The entry point with bytes in argv and on stdin (run_cli is text only); output decoded leniently."""
    r = subprocess.run([_entry(), *args], input=input, capture_output=True, timeout=timeout, env=_env(), cwd=ROOT)
    return subprocess.CompletedProcess(r.args, r.returncode, r.stdout.decode("utf-8", "replace"),
                                       r.stderr.decode("utf-8", "replace"))


class _Lines:
    """Lines of a subprocess's pipe, read by a thread, so that a test can wait for one with a timeout."""

    def __init__(self, pipe):
        import queue
        import threading

        self.q: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, args=(pipe,), daemon=True).start()

    def _pump(self, pipe) -> None:
        for line in iter(pipe.readline, ""):
            self.q.put(line)
        self.q.put(None)

    def wait_for(self, pred, timeout: float = 60) -> str:
        import queue

        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no such line within {timeout} s; seen: {self.seen[-20:]}") from None
            if line is None:
                raise AssertionError(f"the pipe closed first; seen: {self.seen[-20:]}")
            self.seen.append(line)
            if pred(line):
                return line

    def rest(self, timeout: float = 60) -> str:
        import queue

        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the pipe stayed open for {timeout} s") from None
            if line is None:
                return "".join(self.seen)
            self.seen.append(line)


# A sitecustomize.py, put on PYTHONPATH, that changes the real entry point's process from inside:
# it announces the point on stderr and stalls there (so that a test sends SIGINT at a known moment),
# or makes a step fail. PYLLAMA_KV_TEST_HOOK picks the hook.
_HOOKS = r"""
import os, sys, time

hook = os.environ.get("PYLLAMA_KV_TEST_HOOK", "")

def stall(where):
    sys.stderr.write(f"HOOK: stalling in {where}\n")
    sys.stderr.flush()
    time.sleep(120)

if hook.startswith("stall-load"):  # the model's C load is done, Model() has not returned: still loading
    import pyllama_kv.core.model as _m
    _init = _m.Model.__init__
    _n = [0]
    def __init__(self, *a, **k):
        _init(self, *a, **k)
        _n[0] += 1
        if hook == "stall-load" or _n[0] == 2:  # stall-load-2: the second model only
            stall("Model()")
    _m.Model.__init__ = __init__
elif hook == "stall-prompt":  # the first decode is the prompt's
    import pyllama_kv.core.context as _c
    _decode = _c.Context.decode
    def decode(self, *a, **k):
        stall("decode")
        return _decode(self, *a, **k)
    _c.Context.decode = decode
elif hook == "disk-full-gguf":  # writing the tensors fails after the file was created
    import errno, gguf
    _wt = gguf.GGUFWriter.write_tensors_to_file
    def write_tensors_to_file(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    gguf.GGUFWriter.write_tensors_to_file = write_tensors_to_file
elif hook == "disk-full-map":  # the map cannot be saved after the workload ran
    import errno, matplotlib.figure
    def savefig(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    matplotlib.figure.Figure.savefig = savefig
elif hook == "inspect-bug":  # an exception that is no error of pyllama_kv: a bug
    import pyllama_kv.tools.gguf_inspect as _g
    def inspect_gguf(*a, **k):
        raise KeyError("boom")
    _g.inspect_gguf = inspect_gguf
"""


def _hook_env(tmp_path, hook: str) -> dict:
    d = tmp_path / "hooks"
    d.mkdir(exist_ok=True)
    (d / "sitecustomize.py").write_text(_HOOKS)
    path = os.pathsep.join(x for x in (str(d), os.environ.get("PYTHONPATH", "")) if x)
    return {"PYTHONPATH": path, "PYLLAMA_KV_TEST_HOOK": hook}


def test_tiny_model_and_inspect(tmp_path):
    out = tmp_path / "m.gguf"
    r = run_cli(["tiny-model", str(out), "--layers", "3", "--embd", "32", "--heads", "4", "--kv-heads", "2",
                 "--ff", "64", "--seed", "5", "--json"])
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["n_layer"] == 3 and info["n_embd"] == 32 and out.is_file()
    r = run_cli(["inspect", str(out), "--ctx", "1024", "--parallel", "4", "--json"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["architecture"] == "llama" and d["n_head_kv"] == 2
    assert d["tensors"]["count"] == 3 + 9 * 3 and d["tensors"]["types"] == {"f32": 30}
    kv = d["kv_cache"]
    # 3 layers x (K 16 f16 + V 16 f16) = 3 * (16*2 + 16*2) bytes per token
    assert kv["n_embd_k_gqa"] == 16 and kv["bytes_per_token"] == 3 * (16 * 2 + 16 * 2)
    assert kv["bytes_total"] == kv["bytes_per_token"] * 1024 and kv["cells_per_seq"] == 256
    assert kv["parallel"] == 4
    r = run_cli(["inspect", str(out), "--ctx", "1024", "--seqs", "4", "--json"])   # the deprecated name
    assert r.returncode == 0 and "--seqs is deprecated" in r.stderr, r.stderr
    assert json.loads(r.stdout)["kv_cache"]["cells_per_seq"] == 256
    r = run_cli(["inspect", str(out), "--type-k", "q8_0", "--type-v", "q8_0", "--json"])
    assert json.loads(r.stdout)["kv_cache"]["bytes_per_token"] == pytest.approx(3 * 32 * 34 / 32)
    r = run_cli(["inspect", str(out)])
    assert r.returncode == 0 and "KV cache" in r.stdout and "per token" in r.stdout
    r = run_cli(["tiny-model", str(tmp_path / "x.gguf"), "--embd", "30", "--heads", "4"])
    assert r.returncode == 2 and "multiple" in r.stderr   # a usage error


def test_run_parallel_json(tiny_model):
    r = run_cli(["run", str(tiny_model), "-p", "the model of the cache", "-n", "12", "--parallel", "3",
                 "--seed", "7", "--json"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["parallel"] == 3 and len(d["outputs"]) == 3
    assert d["prompt_tokens"] == 6 and d["reused_tokens"] == 12
    assert all(o["tokens"] + (o["stop"] == "eos") >= 1 for o in d["outputs"])
    assert d["generated_tokens"] == sum(o["tokens"] for o in d["outputs"])
    assert d["kv"]["used_cells"] <= 6 + 3 * 12 and d["library"] == "patched"
    assert d["generation_tokens_per_s"] > 0
    # the same seed gives the same texts
    r2 = run_cli(["run", str(tiny_model), "-p", "the model of the cache", "-n", "12", "--parallel", "3",
                  "--seed", "7", "--json"])
    assert [o["text"] for o in json.loads(r2.stdout)["outputs"]] == [o["text"] for o in d["outputs"]]


def test_run_streams_with_prefixes_and_reads_stdin_and_files(tiny_model, tmp_path):
    r = run_cli(["run", str(tiny_model), "-n", "8", "--parallel", "2", "--seed", "1"], input="the cache")
    assert r.returncode == 0, r.stderr
    assert "[0]" in r.stdout and "[1]" in r.stdout
    assert "prompt" in r.stderr and "generation" in r.stderr and "KV cache" in r.stderr
    f = tmp_path / "prompt.txt"
    f.write_text("the cache of the model")
    r = run_cli(["run", str(tiny_model), "-f", str(f), "-n", "4", "--temp", "0", "--json"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["prompt_tokens"] == 5 + 1  # whole words of the tiny vocabulary, plus BOS


def test_run_greedy_matches_the_api(tiny_model):
    import pyllama_kv as pk

    r = run_cli(["run", str(tiny_model), "-p", "the", "-n", "10", "--temp", "0", "--json"])
    text = json.loads(r.stdout)["outputs"][0]["text"]
    with pk.Model(tiny_model) as m, m.context(n_ctx=256, n_seq_max=1) as c:
        s = c.new_sequence()
        lg = s.extend(m.tokenize("the"))
        out = []
        for _ in range(10):
            t = int(np.argmax(lg))
            if m.is_eog(t):
                break
            out.append(t)
            lg = s.extend([t])
        assert b"".join(m.token_to_piece(t) for t in out).decode("utf-8", "replace") == text



def test_run_parallel_greedy_forks_equal_a_single_run(tiny_model):
    # --parallel 4 is one engine request with n=4, forked after the prompt: greedy on an f32 cache,
    # the 4 continuations are the single run's, token for token
    args = ["run", str(tiny_model), "-p", "the cache of the model", "-n", "24", "--temp", "0",
            "--type-k", "f32", "--type-v", "f32", "--json"]
    r1, r4 = run_cli(args), run_cli(args + ["--parallel", "4"])
    assert r1.returncode == 0 and r4.returncode == 0, r1.stderr + r4.stderr
    one, four = json.loads(r1.stdout)["outputs"], json.loads(r4.stdout)["outputs"]
    assert len(one) == 1 and len(four) == 4 and one[0]["tokens"] > 0
    single = (one[0]["text"], one[0]["tokens"], one[0]["stop"])
    assert [(o["text"], o["tokens"], o["stop"]) for o in four] == [single] * 4
    assert json.loads(r4.stdout)["reused_tokens"] == 3 * 6

@pytest.fixture(scope="module")
def stress_pair(tiny_model):
    res = {}
    for lib in ("vanilla", "patched"):
        r = run_cli(["stress", str(tiny_model), "--lib", lib, "--seed", "0", "--steps", "200", "--json"])
        assert r.returncode == 0, r.stderr[-2000:]
        res[lib] = json.loads(r.stdout)
    return res


def test_stress_fails_on_vanilla_not_on_patched(stress_pair):
    v, p = stress_pair["vanilla"], stress_pair["patched"]
    assert v["library"]["variant"] == "vanilla" and p["library"]["variant"] == "patched"
    assert v["slot_failures"] > 0 and v["free_at_failures"] > 0
    assert p["slot_failures"] == 0 and p["failed_requests"] == 0
    assert p["kv"]["slot_retries"] > 0 and p["kv"]["defrags"] >= p["kv"]["slot_retries"]
    assert p["kv"]["moves"] > 0 and p["kv"]["graphs"] == 0 and 0 <= p["kv"]["defrag_share"] < 1  # memcpy on host
    assert v["kv"]["defrags"] is None
    for d in (v, p):
        assert d["steps"] == 200 and d["decode_calls"] >= 200 and d["tokens"] > 0 and d["tokens_per_s"] > 0
        assert 0 < d["peak_fragmentation"] <= 1
        assert d["requests"]["arrived"] >= d["requests"]["started"] >= d["requests"]["completed"]


def test_stress_table_and_progress(tiny_model):
    r = run_cli(["stress", str(tiny_model), "--steps", "40", "--parallel", "4", "--ctx", "1024"])
    assert r.returncode == 0, r.stderr
    assert "slot failures" in r.stdout and "tokens/s" in r.stdout and "peak fragmentation" in r.stdout
    assert "40/40 steps" in r.stderr  # progress


def test_stress_map_png(tiny_model, tmp_path):
    import matplotlib.image as mpimg

    png = tmp_path / "map.png"
    r = run_cli(["stress", str(tiny_model), "--steps", "60", "--map", str(png), "--json"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["map"] == str(png)
    img = mpimg.imread(png)
    h, w = img.shape[:2]
    assert 250 <= h <= 1100 and 500 <= w <= 1700
    rgb = (img[..., :3] * 255).astype(np.uint8).reshape(-1, 3)
    colours = {tuple(c) for c in np.unique(rgb, axis=0)}
    assert (255, 255, 255) in colours  # free cells (and the margins)
    tab20 = {tuple(int(round(x * 255)) for x in c) for c in __import__("matplotlib").colormaps["tab20"].colors}
    assert len(colours & tab20) >= 3, "expected one colour per sequence"


def test_map_without_matplotlib_is_a_clear_error(tiny_model, tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None; from pyllama_kv.cli.main import main; "
            f"sys.exit(main(['stress', {str(tiny_model)!r}, '--steps', '5', '--map', {str(tmp_path / 'm.png')!r}]))")
    r = run_py(["-c", code])
    assert r.returncode == 1
    assert "matplotlib" in r.stderr and "Traceback" not in r.stderr


def test_bad_inputs_give_one_line_and_exit_1(tiny_model, tmp_path):
    notgguf = tmp_path / "x.gguf"
    notgguf.write_text("hello")
    trunc = tmp_path / "t.gguf"
    trunc.write_bytes(tiny_model.read_bytes()[:5000])
    unk = write_unknown_arch_model(tmp_path / "u.gguf")
    m = str(tiny_model)
    cases = [
        (["run", str(tmp_path / "missing.gguf"), "-p", "x"], "no such file"),
        (["run", str(notgguf), "-p", "x"], "not a GGUF file"),
        (["run", str(trunc), "-p", "x"], "truncated"),
        (["run", str(unk), "-p", "x"], "unknown model architecture"),
        (["run", m, "-p", "x", "--ctx", "100000"], "larger than the model supports"),
        (["run", m, "-p", "x", "--lib", str(tmp_path / "nope.so")], "does not exist"),
        (["stress", m, "--lib", str(tmp_path / "nope.so"), "--steps", "2"], "does not exist"),
        (["stress", m, "--ctx", "100000", "--steps", "2"], "larger than the model supports"),
        (["inspect", str(notgguf)], "not a GGUF file"),
        (["inspect", str(trunc)], "truncated"),
        (["inspect", str(tmp_path / "missing.gguf")], "no such file"),
        (["inspect", str(tmp_path)], "is a directory"),  # was "no such file"
    ]
    for args, msg in cases:
        r = run_cli(args)
        assert r.returncode == 1, (args, r.returncode, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1, (args, r.stderr)
        assert msg in lines[0] and "Traceback" not in r.stderr, (args, r.stderr)
        assert "internal error" not in lines[0], (args, r.stderr)
    r = run_cli(["--debug", "run", str(tmp_path / "missing.gguf"), "-p", "x"])
    assert r.returncode != 0 and "Traceback" in r.stderr


def _write_string_hparams_model(path):
    """A GGUF whose hyperparameters are strings: gguf_tools once raised a raw TypeError on it."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("llama.block_count", "two")
    w.add_string("llama.embedding_length", "64")
    w.add_string("llama.attention.head_count", "4")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_every_error_is_one_line_and_a_bug_says_so(tiny_model, tmp_path):
    odd = _write_string_hparams_model(tmp_path / "odd.gguf")
    for args in (["inspect", str(odd)], ["inspect", str(odd), "--json"], ["run", str(odd), "-p", "x"]):
        r = run_cli(args)
        assert r.returncode == 1, (args, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "Traceback" not in r.stderr, (args, r.stderr)
        assert lines[0].startswith(f"pyllama-kv {args[0]}: error: "), lines
    # an exception that is not one of pyllama_kv's errors is a bug: its traceback, then a last line
    # that names it as such (tests/test_cli_errors.py has the rest of the exit-code table)
    env = _hook_env(tmp_path, "inspect-bug")
    r = run_cli(["inspect", str(tiny_model)], env=env)
    assert r.returncode == 1 and "Traceback" in r.stderr and "KeyError" in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "pyllama-kv inspect: error: internal error: KeyError: 'boom' (a bug in pyllama-kv"), r.stderr
    r = run_cli(["--debug", "inspect", str(tiny_model)], env=env)
    assert r.returncode != 0 and "Traceback" in r.stderr and "KeyError" in r.stderr


def test_a_closed_pipe_ends_quietly(tiny_model):
    # `pyllama-kv run ... | head -c 20`: the reader goes away; no "Broken pipe" error, no traceback
    p = subprocess.Popen([_entry(), "run", str(tiny_model), "-p", "the", "-n", "3000", "--ctx", "4096",
                          "--seed", "1", "--temp", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_env(), cwd=ROOT)
    try:
        p.stdout.read(20)
        p.stdout.close()
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    err = err.decode("utf-8", "replace")
    assert p.returncode == 141, err
    assert "Broken pipe" not in err and "Traceback" not in err and "Exception ignored" not in err, err


def test_non_utf8_paths_are_printed_back_as_given(tmp_path):
    out = os.fsencode(str(tmp_path)) + b"/caf\xe9.gguf"  # a Latin-1 file name
    # a user's en_US.UTF-8 locale has a strict stdout (the C and C.UTF-8 locales here do not)
    env = _env(PYTHONIOENCODING="utf-8:strict")
    r = subprocess.run([_entry(), "tiny-model", out, "--layers", "1"], capture_output=True, env=env, cwd=ROOT)
    assert r.returncode == 0 and r.stderr == b"", r.stderr
    assert os.path.isfile(out) and r.stdout.startswith(b"wrote " + out + b": ")


def test_ctrl_c_stops_run_with_a_summary(tiny_model):
    cmd = [str(ENTRY_POINT), "run", str(tiny_model), "-p", "the", "-n", "3000", "--ctx", "4096", "--parallel", "2",
           "--seed", "3"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        out = _Lines(p.stdout)
        out.wait_for(lambda ln: ln.startswith("["))  # generation has started
        p.send_signal(signal.SIGINT)
        err = _Lines(p.stderr).rest()
        assert p.wait(timeout=60) == 130, err
    finally:
        p.kill()
    assert "interrupted while generating" in err and "generation" in err and "Traceback" not in err


@pytest.mark.parametrize("phase,as_json", [("load", False), ("prompt", False), ("prompt", True)])
def test_ctrl_c_while_loading_or_evaluating_the_prompt(tiny_model, tmp_path, phase, as_json):
    # a real SIGINT to the real entry point, at a known moment: a hook stalls there and says so
    cmd = [_entry(), "run", str(tiny_model), "-p", "the cache of the model", "-n", "50", "--parallel", "2",
           "--seed", "3"] + (["--json"] if as_json else [])
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=_env(**_hook_env(tmp_path, f"stall-{phase}")))
    try:
        err = _Lines(p.stderr)
        err.wait_for(lambda ln: ln.startswith("HOOK: stalling"))
        p.send_signal(signal.SIGINT)
        stderr = err.rest()
        out = p.stdout.read()
        assert p.wait(timeout=60) == 130, stderr
    finally:
        p.kill()
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith("HOOK:")]
    if phase == "load":  # nothing was done yet: one clear line
        assert lines == ["pyllama-kv run: interrupted while loading the model"], stderr
        assert out == ""
        return
    # the summary of what was done: the prompt was not evaluated, nothing was generated
    if as_json:
        d = json.loads(out)
        assert d["interrupted"] is True and d["interrupted_while"] == "evaluating the prompt"
        assert d["prompt_tokens"] == 6 and d["generated_tokens"] == 0 and d["reused_tokens"] == 0
        assert [o["stop"] for o in d["outputs"]] == ["interrupted"] * 2 and "kv" in d
    else:
        assert any(ln.startswith("prompt ") and "interrupted" in ln for ln in lines), stderr
        assert any(ln.startswith("generation  0 tokens") and "stop: interrupted" in ln for ln in lines), stderr
        assert any(ln.startswith("KV cache") and "[interrupted while evaluating the prompt]" in ln
                   for ln in lines), stderr


def test_ctrl_c_in_the_demo_shows_what_ran(tmp_path):
    # Ctrl-C while the demo loads its second (patched) model: the vanilla results are shown, exit 130
    p = subprocess.Popen([_entry(), "demo", "--tiny", "--quick"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env=_env(**_hook_env(tmp_path, "stall-load-2")))
    try:
        err = _Lines(p.stderr)
        err.wait_for(lambda ln: ln.startswith("HOOK: stalling"), timeout=300)
        p.send_signal(signal.SIGINT)
        stderr = err.rest()
        out = p.stdout.read()
        assert p.wait(timeout=60) == 130, stderr
    finally:
        p.kill()
    assert "Traceback" not in stderr and "interrupted while loading the model (patched)" in stderr, stderr
    lines = out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("decode calls"))
    assert lines[i - 1].split() == ["vanilla"] and "slot failures" in out, out  # the table of what ran


def test_non_utf8_prompts_are_tokenized_as_bytes(tiny_model, tmp_path):
    import pyllama_kv as pk

    prompt = b"\xff\xfe the \xe9t\xe9 \x80 cache"  # Latin-1 and stray bytes: not UTF-8
    with pk.Model(tiny_model) as m:
        want = m.tokenize(prompt)
    f = tmp_path / "latin1.txt"
    f.write_bytes(prompt)
    routes = [
        (["-p", prompt], None),    # argv: the bytes the user gave, not a "surrogates not allowed" error
        ([], prompt),              # piped stdin
        (["-f", "-"], prompt),     # stdin named
        (["-f", str(f)], None),    # a file
    ]
    for extra, stdin in routes:
        r = _run_bytes(["run", str(tiny_model), *extra, "-n", "3", "--temp", "0", "--json"], input=stdin)
        assert r.returncode == 0, (extra, r.stderr)
        d = json.loads(r.stdout)
        assert d["prompt_tokens"] == len(want), extra
    # the text output too (streamed, not JSON)
    r = _run_bytes(["run", str(tiny_model), "-p", prompt, "-n", "3", "--temp", "0"])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert f"prompt      {len(want)} tokens" in r.stderr


def test_tiny_model_refuses_a_directory_and_a_missing_parent_and_leaves_nothing(tmp_path):
    d = tmp_path / "out"
    d.mkdir()
    (d / "keep").write_text("x")
    before = sorted(p.name for p in tmp_path.iterdir())
    cases = [
        ([str(d)], "is a directory"),                            # was: wrote out.tmp, then failed
        ([str(d) + "/"], "is a directory"),
        ([str(tmp_path / "new")+ "/"], "is a directory"),        # a name ending in / is meant as a directory
        ([str(tmp_path / "no" / "such" / "m.gguf")], "does not exist"),  # was: made no/such silently
        ([str(d / "keep" / "m.gguf")], "not a directory"),
        ([""], "empty path"),
    ]
    for args, msg in cases:
        r = run_cli(["tiny-model", *args])
        assert r.returncode == 1, (args, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and msg in lines[0] and "Traceback" not in r.stderr, (args, r.stderr)
        assert sorted(p.name for p in tmp_path.iterdir()) == before, args
        assert sorted(p.name for p in d.iterdir()) == ["keep"], args
    # a failure while writing (the disk fills up): no partial model, no temporary file
    r = run_cli(["tiny-model", str(d / "m.gguf")], env=_hook_env(tmp_path, "disk-full-gguf"))
    assert r.returncode == 1 and "No space left" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert sorted(p.name for p in d.iterdir()) == ["keep"]
    # an existing model is replaced whole, or left as it was
    good = d / "m.gguf"
    assert run_cli(["tiny-model", str(good), "--layers", "1"]).returncode == 0
    data = good.read_bytes()
    r = run_cli(["tiny-model", str(good), "--layers", "3"], env=_hook_env(tmp_path, "disk-full-gguf"))
    assert r.returncode == 1 and good.read_bytes() == data
    assert sorted(p.name for p in d.iterdir()) == ["keep", "m.gguf"]


def test_stress_map_path_is_checked_first_and_reported_as_written(tiny_model, tmp_path):
    d = tmp_path / "maps"
    d.mkdir()
    afile = tmp_path / "afile"
    afile.write_text("x")
    bad = [
        (str(d), "is a directory"),                       # was: wrote maps.png, printed "map: maps"
        (str(tmp_path / "nodir" / "m.png"), "does not exist"),  # was: ran the workload, then failed
        (str(afile / "m.png"), "not a directory"),
        (str(d / "m.nosuchformat"), "cannot write .nosuchformat"),
    ]
    for m, msg in bad:
        r = run_cli(["stress", str(tiny_model), "--steps", "20", "--map", m])
        assert r.returncode == 1, (m, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and msg in lines[0], (m, r.stderr)  # no progress line: the workload never ran
        assert "steps" not in r.stderr and "Traceback" not in r.stderr and r.stdout == ""
    assert list(d.iterdir()) == [] and not (tmp_path / "maps.png").exists()
    # no suffix: .png is added, and the path printed is the one written
    r = run_cli(["stress", str(tiny_model), "--steps", "10", "--map", str(d / "occ")])
    assert r.returncode == 0, r.stderr
    assert f"map: {d / 'occ.png'}" in r.stdout.splitlines() and (d / "occ.png").is_file()
    assert sorted(p.name for p in d.iterdir()) == ["occ.png"]
    r = run_cli(["stress", str(tiny_model), "--steps", "10", "--map", str(d / "occ2"), "--json"])
    assert r.returncode == 0 and json.loads(r.stdout)["map"] == str(d / "occ2.png") and (d / "occ2.png").is_file()


def test_stress_results_survive_a_map_that_cannot_be_saved(tiny_model, tmp_path):
    d = tmp_path / "maps"
    d.mkdir()
    env = _hook_env(tmp_path, "disk-full-map")
    r = run_cli(["stress", str(tiny_model), "--steps", "10", "--map", str(d / "m.png")], env=env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "slot failures" in r.stdout and "peak fragmentation" in r.stdout  # the results table, first
    assert "No space left" in r.stderr.splitlines()[-1] and "map:" not in r.stdout
    r = run_cli(["stress", str(tiny_model), "--steps", "10", "--map", str(d / "m.png"), "--json"], env=env)
    assert r.returncode == 1
    res = json.loads(r.stdout)
    assert res["steps"] == 10 and "No space left" in res["map_error"] and "map" not in res
    assert list(d.iterdir()) == []  # no partial image, no temporary file


def test_lib_that_is_not_libllama_is_one_line(tiny_model, tmp_path, patched_lib):
    from pathlib import Path

    not_llama = sorted(Path(patched_lib).parent.glob("libggml-base.so*"))  # a real .so without llama_*
    assert not_llama, f"no libggml-base.so next to {patched_lib}"
    text = tmp_path / "text.so"
    text.write_text("not a library")
    m = str(tiny_model)
    libs = [(str(not_llama[0]), "is not a usable libllama: it does not export llama_"),
            (str(tmp_path), "is a directory"), (str(text), "cannot load"),
            (str(tmp_path / "nope.so"), "does not exist"), ("", "empty")]
    for lib, msg in libs:
        for args in (["run", m, "-p", "x", "--lib", lib], ["stress", m, "--steps", "2", "--lib", lib]):
            r = run_cli(args)
            assert r.returncode == 1, (args, r.stderr)
            lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
            assert len(lines) == 1 and msg in lines[0] and "Traceback" not in r.stderr, (args, r.stderr)
            assert "internal error" not in lines[0], lines


def test_ffi_load_raises_only_library_error(tiny_model, tmp_path, patched_lib):
    # Model(lib=<a .so without the llama symbols>) was an AttributeError: now a LibraryError naming
    # the file and a missing function. And no value of lib gets anything but LibraryError out of load.
    (tmp_path / "text.so").write_text("hello")
    code = f"""
import os, pathlib, sys
from pyllama_kv import Model
from pyllama_kv._native import ffi as _ffi
from pyllama_kv.errors import LibraryError
not_llama = sorted(pathlib.Path({patched_lib!r}).parent.glob("libggml-base.so*"))[0]
class BadPath(os.PathLike):
    def __fspath__(self):
        return 5
values = [0, 5, -1, 3.5, b"", "", "  ", "\\0", "x\\0y", b"/nonexistent.so", "/nonexistent.so", {str(tmp_path)!r},
          pathlib.Path({str(tmp_path)!r}), {str(tmp_path / "text.so")!r}, str(not_llama), "/dev/null",
          "~no-such-user-here/x.so", "a" * 5000, BadPath(), object(), ["x"], {{"a": 1}}, sys.executable]
for v in values:
    try:
        _ffi.load(v)
    except LibraryError:
        continue
    print("NOT A LibraryError:", repr(v)[:60])
    sys.exit(1)
os.environ["PYLLAMA_KV_LIB"] = {str(tmp_path)!r}
try:
    _ffi.load(None)
    sys.exit("loaded a directory")
except LibraryError as e:
    assert "is a directory" in str(e), e
del os.environ["PYLLAMA_KV_LIB"]
try:
    Model({str(tiny_model)!r}, lib=str(not_llama))
    sys.exit("loaded a library without llama_*")
except LibraryError as e:
    msg = str(e)
assert not_llama.name in msg and "llama_model_default_params" in msg, msg
print("OK", msg)
"""
    r = run_py(["-c", code])
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


def test_tiny_demo_finishes():
    r = run_cli(["demo", "--tiny", "--quick", "-t", "1"], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "vanilla" in r.stdout and "patched" in r.stdout and "slot failures" in r.stdout
    assert "[3]" in r.stdout  # the run --parallel 4 part
    kv = [ln for ln in r.stderr.splitlines() if ln.startswith("KV cache")]
    assert len(kv) == 1 and kv[0].endswith("threads 1"), r.stderr[-2000:]  # -t reaches the final run too


def test_real_model_demo(real_model):
    """`make demo`'s job, shortened: on the real model the vanilla build refuses batches and fails requests,
    the patched one refuses none and completes at least as many; then 4 readable chat answers from one
    prompt evaluated once, and the KV stats while they hold their cells."""
    r = run_cli(["demo", "--quick", "--json"], timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(r.stdout)
    van, pat = d["stress"]["vanilla"], d["stress"]["patched"]
    assert van["slot_failures"] > 0 and van["failed_requests"] > 0
    assert pat["slot_failures"] == 0 and pat["failed_requests"] == 0 and pat["kv"]["slot_retries"] > 0
    assert pat["requests"]["completed"] >= van["requests"]["completed"] > 0
    c = d["chat"]
    assert "<|im_start|>assistant" in c["prompt"] and c["prompt_reused"] == 3 * c["prompt_tokens"]
    assert len(c["answers"]) == 4 and len({a["text"] for a in c["answers"]}) > 1   # sampled, not copies
    for a in c["answers"]:
        words = a["text"].split()
        assert len(words) >= 3 and sum(w.isascii() and w.strip(".,!?'\"").isalpha() for w in words) >= len(words) / 2
    once = c["prompt_tokens"] + c["generated_tokens"]   # the prompt stored once, shared by the 4 answers
    assert once - 4 <= c["kv_cells"]["used"] <= once    # (a last sampled token is not decoded)


def test_every_command_has_help():
    from pyllama_kv.cli.main import COMMANDS

    for cmd in COMMANDS:
        r = run_cli([cmd, "--help"])
        assert r.returncode == 0 and f"usage: pyllama-kv {cmd}" in r.stdout
    r = run_cli([])
    assert r.returncode == 2 and "COMMAND" in r.stdout
