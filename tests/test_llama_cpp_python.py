"""llama-cpp-python (0.3.9, installed by `make setup` with CMAKE_ARGS=-DLLAMA_BUILD=OFF, which
compiles nothing) runs on our patched library through LLAMA_CPP_LIB_PATH, and its greedy tokens
equal ours on the tiny model."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import run_py

SCRIPT = r"""
import json, sys
import llama_cpp
model, prompt, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = llama_cpp.Llama(model_path=model, n_ctx=256, n_batch=64, verbose=False, seed=0)
out = []
for t in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
    out.append(int(t))
    if len(out) == n:
        break
print(json.dumps({"tokens": out, "lib": str(llama_cpp.llama_cpp._base_path),
                  "has_stats": hasattr(llama_cpp.llama_cpp._lib, "llama_kv_self_stats")}))
"""


def test_llama_cpp_python_greedy_tokens_equal_ours(tiny_model, builds, tmp_path):
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.fail("llama-cpp-python is not installed: `make setup` installs it (CMAKE_ARGS=-DLLAMA_BUILD=OFF)")
    b = builds[("patched", "cpu")]
    bin_dir = str(Path(b["lib"]).parent)
    prompt = [1] + list(range(300, 340, 3))
    n = 24
    script = tmp_path / "gen.py"
    script.write_text(SCRIPT)
    r = run_py([str(script), str(tiny_model), json.dumps(prompt), str(n)], env={"LLAMA_CPP_LIB_PATH": bin_dir})
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = json.loads(r.stdout.strip().splitlines()[-1])
    assert theirs["lib"] == bin_dir and theirs["has_stats"], "llama-cpp-python did not load our patched library"

    with pk.Model(tiny_model) as m, m.context(n_ctx=256, n_seq_max=1, n_batch=64, n_ubatch=64) as c:
        s = c.new_sequence()
        logits = s.extend(prompt)
        ours = []
        for _ in range(n):
            t = int(np.argmax(logits))
            ours.append(t)
            logits = s.extend([t])
    assert ours == theirs["tokens"]
