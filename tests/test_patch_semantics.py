"""Our patches must not change ordinary evaluation.

The series changes what happens when the cache fragments, shifts, is defragmented or is aborted; a
plain evaluation (prompts, several sequences in one batch, greedy generation steps, a fork) must give
the same logits, bit for bit, on the patched and on the vanilla build. Each build runs in its own
subprocess (two libllama builds in one process would share one libggml) and writes its logits to a
file; the test compares them.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import run_py

_EVAL = r"""
import json, sys
import numpy as np
import pyllama_kv as pk
lib, model, out, flash_attn = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
m = pk.Model(model, lib=lib)
# n_ubatch 32: the prompt batch is split into several micro-batches; 512 cells: no defrag, no retry
ctx = m.context(n_ctx=512, n_seq_max=4, n_batch=512, n_ubatch=32, type_k="f32", type_v="f32",
                flash_attn=flash_attn)
prompts = ["The KV cache of a model holds the keys and values of every token",
           "one two three",
           "a sequence forked from another shares its cells with it, and the rest of this prompt " * 2]
seqs = [ctx.new_sequence() for _ in prompts]
logits = []
res = ctx.decode({s: m.tokenize(p) for s, p in zip(seqs, prompts)})   # one llama_decode for all prompts
logits += [res[s] for s in seqs]
seqs.append(seqs[0].fork())                                           # a prefix copy (seq_cp)
for step in range(8):                                                 # greedy steps, one batch each
    nxt = {s: [int(np.argmax(s.logits()))] for s in seqs}
    nxt[seqs[-1]] = [(step * 7 + 11) % 200 + 3]                       # the fork takes another path
    res = ctx.decode(nxt)
    logits += [res[s] for s in seqs]
np.save(out, np.stack(logits))
st = ctx.kv_stats()
print(json.dumps({"variant": pk.library_info(lib).get("variant"), "used_cells": st.used_cells,
                  "defrags": st.defrags, "slot_retries": st.slot_retries, "tokens": [s.tokens for s in seqs]}))
"""


def _evaluate(lib: str, model, tmp_path, flash_attn: bool) -> tuple[np.ndarray, dict]:
    out = tmp_path / f"logits-{abs(hash(lib))}-{int(flash_attn)}.npy"
    r = run_py(["-c", _EVAL, lib, str(model), str(out), "1" if flash_attn else "0"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return np.load(out), json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("flash_attn", [False, True], ids=["no-fa", "fa"])
def test_plain_evaluation_is_identical_on_patched_and_vanilla(patched_lib, vanilla_lib, tiny_model, tmp_path,
                                                              flash_attn):
    got, info_p = _evaluate(patched_lib, tiny_model, tmp_path, flash_attn)
    want, info_v = _evaluate(vanilla_lib, tiny_model, tmp_path, flash_attn)
    assert info_p["variant"] == "patched" and info_v["variant"] == "vanilla"
    assert info_p["tokens"] == info_v["tokens"], "greedy generation took different paths"
    assert info_p["defrags"] == 0 and info_p["slot_retries"] == 0, "not an ordinary evaluation"
    assert info_p["used_cells"] == info_v["used_cells"]
    assert got.shape == want.shape == (3 + 8 * 4, got.shape[1])
    # the comparison means something: the sequences and the steps differ from each other
    assert np.abs(got[0] - got[1]).max() > 0.1 and np.abs(got[3] - got[-1]).max() > 0.1
    assert np.isfinite(got).all()
    diff = np.abs(got - want).max(axis=1)
    assert np.array_equal(got, want), f"logits differ from vanilla (max per row): {diff.tolist()}"
