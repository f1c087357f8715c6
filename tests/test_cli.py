"""The `pyllama-kv` entry point, run for real in subprocesses on the tiny model."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ENTRY_POINT, ROOT, run_cli, run_py, write_unknown_arch_model

pytestmark = pytest.mark.skipif(not ENTRY_POINT.exists(), reason="the venv entry point is missing (make setup)")


def test_tiny_model_and_inspect(tmp_path):
    out = tmp_path / "m.gguf"
    r = run_cli(["tiny-model", str(out), "--layers", "3", "--embd", "32", "--heads", "4", "--kv-heads", "2",
                 "--ff", "64", "--seed", "5", "--json"])
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["n_layer"] == 3 and info["n_embd"] == 32 and out.is_file()
    r = run_cli(["inspect", str(out), "--ctx", "1024", "--seqs", "4", "--json"])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["architecture"] == "llama" and d["n_head_kv"] == 2
    assert d["tensors"]["count"] == 3 + 9 * 3 and d["tensors"]["types"] == {"f32": 30}
    kv = d["kv_cache"]
    # 3 layers x (K 16 f16 + V 16 f16) = 3 * (16*2 + 16*2) bytes per token
    assert kv["n_embd_k_gqa"] == 16 and kv["bytes_per_token"] == 3 * (16 * 2 + 16 * 2)
    assert kv["bytes_total"] == kv["bytes_per_token"] * 1024 and kv["cells_per_seq"] == 256
    r = run_cli(["inspect", str(out), "--type-k", "q8_0", "--type-v", "q8_0", "--json"])
    assert json.loads(r.stdout)["kv_cache"]["bytes_per_token"] == pytest.approx(3 * 32 * 34 / 32)
    r = run_cli(["inspect", str(out)])
    assert r.returncode == 0 and "KV cache" in r.stdout and "per token" in r.stdout
    r = run_cli(["tiny-model", str(tmp_path / "x.gguf"), "--embd", "30", "--heads", "4"])
    assert r.returncode == 1 and "multiple" in r.stderr


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
    r = run_cli(["stress", str(tiny_model), "--steps", "40", "--seqs", "4", "--ctx", "1024"])
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
    code = ("import sys; sys.modules['matplotlib'] = None; from pyllama_kv.cli import main; "
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
        (["run", m, "-p", "x", "--parallel", "0"], "--parallel must be at least 1"),
        (["run", m, "-p", "x", "--lib", str(tmp_path / "nope.so")], "does not exist"),
        (["stress", m, "--lib", str(tmp_path / "nope.so"), "--steps", "2"], "does not exist"),
        (["stress", m, "--ctx", "100000", "--steps", "2"], "larger than the model supports"),
        (["inspect", str(notgguf)], "not a GGUF file"),
        (["inspect", str(trunc)], "truncated"),
        (["inspect", str(tmp_path / "missing.gguf")], "no such file"),
    ]
    for args, msg in cases:
        r = run_cli(args)
        assert r.returncode == 1, (args, r.returncode, r.stderr)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1, (args, r.stderr)
        assert msg in lines[0] and "Traceback" not in r.stderr, (args, r.stderr)
    r = run_cli(["--debug", "run", str(tmp_path / "missing.gguf"), "-p", "x"])
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_ctrl_c_stops_run_with_a_summary(tiny_model):
    cmd = [str(ENTRY_POINT), "run", str(tiny_model), "-p", "the", "-n", "3000", "--ctx", "4096", "--parallel", "2",
           "--seed", "3"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    line = p.stdout.readline()  # generation has started
    assert line.startswith("[")
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert "interrupted" in err and "generation" in err and "Traceback" not in err


def test_demo_finishes():
    r = run_cli(["demo", "--quick"], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "vanilla" in r.stdout and "patched" in r.stdout and "slot failures" in r.stdout
    assert "[3]" in r.stdout  # the run --parallel 4 part


def test_every_command_has_help():
    for cmd in ("vendor", "patch", "build", "status", "run", "inspect", "tiny-model", "stress", "demo"):
        r = run_cli([cmd, "--help"])
        assert r.returncode == 0 and f"usage: pyllama-kv {cmd}" in r.stdout
    r = run_cli([])
    assert r.returncode == 2 and "COMMAND" in r.stdout
