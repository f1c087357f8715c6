#!/usr/bin/env python3
"""C-level reproducers of the KV-cache failures our patch series fixes. Prints JSON.

Each case drives libllama directly through the raw cffi handle (pyllama_kv._ffi: no Python-side
validation, no high-level API), on a tiny random model made with the gguf package:

  slot          decode a batch that fits in the free cells while they are scattered in small holes
                vanilla: llama_decode returns 1; patched: defrag + retry, returns 0
  defrag-holes  one explicit defrag of a many-layer model (few moves fit in one graph) with more
                single-cell holes than that
                vanilla: holes remain; patched: packed, in several graphs
  defrag-abort  explicit defrag + update when the used cells end past n_ctx - n_ubatch
                vanilla: the process aborts (GGML_ASSERT in ggml_view_1d); patched: returns
  bad-token     llama_decode with token id n_vocab
                vanilla: uncaught C++ exception terminates the process; patched: returns -1
  retry-abort   (patched) the first micro-batch lands in a hole at the end of the cache, the second
                finds no slot, the retry's defrag moves the first one's uncommitted cells, then the
                second is aborted: llama_decode must remove every cell of the batch, wherever it moved

Run a case that may abort in a subprocess (the tests do). Usage:
  python scripts/reproduce_kv_failures.py --lib vanilla --case slot --json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyllama_kv import _ffi  # noqa: E402
from pyllama_kv.gguf_tools import make_tiny_model  # noqa: E402

ffi = _ffi.ffi
CASES = ("slot", "defrag-holes", "defrag-abort", "bad-token", "retry-abort")


class Raw:
    """Just enough C calls to build the scenarios."""

    def __init__(self, lib: str, model_path: Path, n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int):
        self.L_obj = _ffi.load(lib)
        L = self.L = self.L_obj.lib
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(model_path).encode(), mp)
        assert self.model != ffi.NULL, "model failed to load"
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_ubatch, n_seq_max
        cp.n_threads = cp.n_threads_batch = 2
        self.ctx = L.llama_init_from_model(self.model, cp)
        assert self.ctx != ffi.NULL, "context failed to create"
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.view = ffi.new("struct llama_kv_cache_view *", L.llama_kv_cache_view_init(self.ctx, n_seq_max))

    def decode(self, items: list[tuple[int, int, int]]) -> int:
        """items: (token, pos, seq_id); the last token outputs logits."""
        n = len(items)
        tok = ffi.new("llama_token[]", [t for t, _, _ in items])
        pos = ffi.new("llama_pos[]", [p for _, p, _ in items])
        nsq = ffi.new("int32_t[]", [1] * n)
        sids = [ffi.new("llama_seq_id[1]", [s]) for _, _, s in items]
        sidp = ffi.new("llama_seq_id *[]", sids)
        out = ffi.new("int8_t[]", [0] * (n - 1) + [1])
        b = ffi.new("llama_batch *")
        b.n_tokens, b.token, b.embd, b.pos, b.n_seq_id, b.seq_id, b.logits = n, tok, ffi.NULL, pos, nsq, sidp, out
        return int(self.L.llama_decode(self.ctx, b[0]))

    def cache(self) -> dict:
        self.L.llama_kv_cache_view_update(self.ctx, self.view)
        v = self.view
        n_cells, used = v.n_cells, v.used_cells
        out = {"n_cells": n_cells, "used_cells": used, "free_cells": n_cells - used,
               "largest_free_block": v.max_contiguous, "packed": v.max_contiguous == n_cells - used}
        # holes below the last used cell
        occ = [v.cells_sequences[i * v.n_seq_max] >= 0 for i in range(n_cells)]
        last = max((i for i, o in enumerate(occ) if o), default=-1)
        out["holes_below_last_used"] = sum(1 for i in range(last) if not occ[i])
        return out

    def stats(self) -> dict | None:
        if not self.L_obj.has("llama_kv_self_stats"):
            return None
        s = self.L.llama_kv_self_stats(self.ctx)
        return {k: int(getattr(s, k)) for k in ("n_defrags", "n_defrag_moves", "n_defrag_cells", "n_defrag_graphs",
                                                "n_slot_retries", "n_slot_failures")}


def case_slot(lib: str, model_dir: Path) -> dict:
    mp = make_tiny_model(model_dir / "tiny-2l.gguf", n_layer=2)
    r = Raw(lib, mp, n_ctx=256, n_batch=256, n_ubatch=256, n_seq_max=64)
    # 32 sequences of 8 tokens fill the cache; close every other one: 128 cells free, in 8-cell holes
    for s in range(32):
        assert r.decode([(10 + i, i, s) for i in range(8)]) == 0
    for s in range(0, 32, 2):
        r.L.llama_kv_self_seq_rm(r.ctx, s, -1, -1)
    before = r.cache()
    rc = r.decode([(20 + i, i, 40) for i in range(16)])  # 16 tokens: fit in the 128 free cells
    return {"case": "slot", "batch_tokens": 16, "before": before, "rc": rc, "after": r.cache(), "stats": r.stats()}


def case_defrag_holes(lib: str, model_dir: Path) -> dict:
    n_layer = 256
    mp = make_tiny_model(model_dir / "tiny-256l.gguf", n_layer=n_layer, n_embd=32, n_head=2, n_head_kv=1, n_ff=32)
    r = Raw(lib, mp, n_ctx=512, n_batch=512, n_ubatch=64, n_seq_max=1)
    assert r.decode([(10 + i % 50, i, 0) for i in range(400)]) == 0
    for p in range(0, 400, 2):  # 200 single-cell holes
        r.L.llama_kv_self_seq_rm(r.ctx, 0, p, p + 1)
    before = r.cache()
    r.L.llama_kv_self_defrag(r.ctx)
    r.L.llama_kv_self_update(r.ctx)
    max_nodes = max(65536, 5 * (9 * n_layer + 3))
    return {"case": "defrag-holes", "n_layer": n_layer, "max_moves_per_graph": (max_nodes - 2 * n_layer) // (6 * n_layer),
            "before": before, "after": r.cache(), "stats": r.stats()}


def case_defrag_abort(lib: str, model_dir: Path) -> dict:
    mp = make_tiny_model(model_dir / "tiny-2l.gguf", n_layer=2)
    r = Raw(lib, mp, n_ctx=256, n_batch=256, n_ubatch=128, n_seq_max=1)
    assert r.decode([(10 + i % 50, i, 0) for i in range(200)]) == 0
    r.L.llama_kv_self_seq_rm(r.ctx, 0, 0, 10)  # holes at the front: the defrag moves 10 cells
    before = r.cache()
    print("defragmenting: used cells end at 200 > n_ctx - n_ubatch = 128", file=sys.stderr, flush=True)
    r.L.llama_kv_self_defrag(r.ctx)
    r.L.llama_kv_self_update(r.ctx)  # vanilla aborts in here
    rc = r.decode([(11, 200, 0)])
    return {"case": "defrag-abort", "before": before, "after": r.cache(), "decode_after": rc, "stats": r.stats()}


def case_bad_token(lib: str, model_dir: Path) -> dict:
    mp = make_tiny_model(model_dir / "tiny-2l.gguf", n_layer=2)
    r = Raw(lib, mp, n_ctx=256, n_batch=256, n_ubatch=256, n_seq_max=1)
    assert r.decode([(10, 0, 0)]) == 0
    rc = r.decode([(r.n_vocab, 1, 0)])  # vanilla: terminate called after throwing ...
    return {"case": "bad-token", "token": r.n_vocab, "rc": rc, "after": r.cache()}


def case_retry_abort(lib: str, model_dir: Path) -> dict:
    mp = make_tiny_model(model_dir / "tiny-2l.gguf", n_layer=2)
    r = Raw(lib, mp, n_ctx=256, n_batch=64, n_ubatch=8, n_seq_max=80)
    for s in range(64):  # 256 cells, 4 per sequence
        assert r.decode([(10 + i, i, s) for i in range(4)]) == 0
    for s in list(range(0, 62, 2)) + [62, 63]:  # 4-cell holes, one 8-cell hole at the end
        r.L.llama_kv_self_seq_rm(r.ctx, s, -1, -1)
    calls = []
    cb = ffi.callback("bool(void *)", lambda _d: calls.append(1) is None and False)
    r.L.llama_set_abort_callback(r.ctx, cb, ffi.NULL)
    assert r.decode([(20 + i, i, 70) for i in range(8)]) == 0  # calibrate one 8-token micro-batch
    per_ubatch = len(calls)
    r.L.llama_kv_self_seq_rm(r.ctx, 70, -1, -1)
    calls.clear()
    cb2 = ffi.callback("bool(void *)", lambda _d: (calls.append(1) is None and len(calls) > per_ubatch))
    r.L.llama_set_abort_callback(r.ctx, cb2, ffi.NULL)
    before = r.cache()
    rc = r.decode([(30 + i, i, 71) for i in range(16)])  # two micro-batches of 8: the second is aborted
    r.L.llama_set_abort_callback(r.ctx, ffi.NULL, ffi.NULL)
    r.L.llama_kv_cache_view_update(r.ctx, r.view)
    v = r.view
    left = sum(1 for i in range(v.n_cells) for j in range(v.n_seq_max) if v.cells_sequences[i * v.n_seq_max + j] == 71)
    return {"case": "retry-abort", "rc": rc, "before": before, "after": r.cache(), "cells_left_of_batch": left,
            "stats": r.stats()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default="patched", help="patched, vanilla, or a path to libllama (default: patched)")
    ap.add_argument("--case", choices=CASES + ("all",), default="all")
    ap.add_argument("--model-dir", help="where to write the tiny models (default: a temporary dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON document (the default prints it indented)")
    args = ap.parse_args(argv)
    fns = {"slot": case_slot, "defrag-holes": case_defrag_holes, "defrag-abort": case_defrag_abort,
           "bad-token": case_bad_token, "retry-abort": case_retry_abort}
    cases = CASES if args.case == "all" else (args.case,)
    with tempfile.TemporaryDirectory() as tmp:
        mdir = Path(args.model_dir) if args.model_dir else Path(tmp)
        mdir.mkdir(parents=True, exist_ok=True)
        info = _ffi.load(args.lib).info
        results = {"lib": info.get("path"), "variant": info.get("variant"), "cases": {}}
        for c in cases:
            results["cases"][c] = fns[c](args.lib, mdir)
    print(json.dumps(results, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
