#!/usr/bin/env python3
"""C-level reproducers of the KV-cache failures our patch series fixes. Prints JSON.

Each case drives libllama directly through the raw cffi handle (pyllama_kv._native.ffi: no Python-side
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
  view-shift    the KV view's positions while a K-shift is pending (seq_rm + seq_add, no decode yet)
                vanilla: pos + delta, the shift counted twice (-1..13 for 2..16); patched: 2..16
  state-after-shift  a K-shift is pending when its cells are freed, and a sequence state is restored
                into them (1 layer, f32 cache)
                vanilla: the freed cells keep the pending delta, and the next decode rotates the
                restored K by it (logits off); patched: a cell's delta goes with its data
  shift-abort   a K-shift is pending and the next llama_decode is aborted by the abort callback; then
                the same token is decoded again (1 layer, f32 cache: a K-shift is exact)
                vanilla: the aborted shift graph's deltas are cleared, logits off by ~4;
                patched: the shift runs to completion, logits equal a fresh evaluation
  defrag-abort-graph  llama_kv_self_defrag + update under an aborting callback (set
                LLAMA_KV_DEFRAG_GRAPH=1 for the patched graph path)
                vanilla: the cell metadata moves, K/V do not: logits off; patched: K/V moved too
  shift-bf16    K-shift of a bf16 K cache
                vanilla: the process aborts (ggml-cpu rope has no bf16); patched: f32 round trip
  quant-head    q8_0 K cache on a model with head size 16 (half a quantization block)
                vanilla: the context is created, K is never stored (logits far from an f32 cache),
                and the K-shift aborts the process; patched: llama_init_from_model refuses (NULL)
  c-api-throw   tokenize text that an SPM vocabulary without byte tokens cannot map, token_to_piece,
                detokenize and the vocab getters with an out-of-range id, a NULL model path
                vanilla: uncaught std::out_of_range terminates the process;
                patched: INT32_MIN (tokenize, token_to_piece, detokenize), NULL, NAN, ..., logged

  stale-restore a failed decode, a defrag that moves another sequence into the failed batch's cells,
                a second failed decode: vanilla empties the moved cells again; patched does not (0010)

Run a case that may abort in a subprocess (the tests do). Usage:
  python scripts/reproduce_kv_failures.py --lib vanilla --case slot --json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import cffi

from pyllama_kv._native import ffi as _ffi
from pyllama_kv.tools.gguf import make_tiny_model

ffi = _ffi.ffi
CASES = ("slot", "defrag-holes", "defrag-abort", "bad-token", "retry-abort", "view-shift", "shift-abort",
         "state-after-shift", "defrag-abort-graph", "shift-bf16", "quant-head", "c-api-throw", "stale-restore")
TYPE_F32, TYPE_F16, TYPE_Q8_0, TYPE_BF16 = (_ffi.GGML_TYPES[t] for t in ("f32", "f16", "q8_0", "bf16"))


class Raw:
    """Just enough C calls to build the scenarios."""

    def __init__(self, lib: str, model_path: Path, n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int,
                 type_k: int = TYPE_F16, type_v: int = TYPE_F16, flash_attn: bool = False, need_ctx: bool = True):
        self.L_obj = _ffi.load(lib)
        L = self.L = self.L_obj.lib
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(model_path).encode(), mp)
        assert self.model != ffi.NULL, "model failed to load"
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_ubatch, n_seq_max
        cp.n_threads = cp.n_threads_batch = 2
        cp.type_k, cp.type_v, cp.flash_attn = type_k, type_v, flash_attn
        self.ctx = L.llama_init_from_model(self.model, cp)
        if self.ctx == ffi.NULL:
            assert not need_ctx, "context failed to create"
            return
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

    def logits(self) -> list[float]:
        """Logits of the last output of the last decode."""
        p = self.L.llama_get_logits_ith(self.ctx, -1)
        return list(ffi.unpack(p, self.n_vocab))

    def fresh(self, tokens: list[int], seq: int) -> list[float]:
        """Logits after evaluating ``tokens`` from position 0 in (empty) sequence ``seq``."""
        assert self.decode([(t, i, seq) for i, t in enumerate(tokens)]) == 0
        return self.logits()

    def positions(self, seq: int) -> list[int]:
        """Positions of the cells of ``seq`` as the KV view reports them (sorted)."""
        self.L.llama_kv_cache_view_update(self.ctx, self.view)
        v = self.view
        return sorted(int(v.cells[i].pos) for i in range(v.n_cells)
                      if any(v.cells_sequences[i * v.n_seq_max + j] == seq for j in range(v.n_seq_max)))

    def errors(self) -> list[str]:
        return list(getattr(self.L_obj, "recent_errors", []))

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
    max_moves_per_graph = (max_nodes - 2 * n_layer) // (6 * n_layer)
    return {"case": "defrag-holes", "n_layer": n_layer, "max_moves_per_graph": max_moves_per_graph,
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


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def _abort_always():
    return ffi.callback("bool(void *)", lambda _d: True)


def case_view_shift(lib: str, model_dir: Path) -> dict:
    mp = make_tiny_model(model_dir / "tiny-2l.gguf", n_layer=2)
    r = Raw(lib, mp, n_ctx=128, n_batch=128, n_ubatch=128, n_seq_max=2)
    assert r.decode([(10 + i, i, 0) for i in range(20)]) == 0
    r.L.llama_kv_self_seq_rm(r.ctx, 0, 2, 5)
    r.L.llama_kv_self_seq_add(r.ctx, 0, 5, -1, -3)  # K-shift pending: positions 5..19 are now 2..16
    pending = r.positions(0)
    r.L.llama_kv_self_update(r.ctx)                # apply it
    applied = r.positions(0)
    return {"case": "view-shift", "expected": list(range(17)), "pending": pending, "applied": applied}


def case_state_after_shift(lib: str, model_dir: Path) -> dict:
    mp = make_tiny_model(model_dir / "tiny-1l.gguf", n_layer=1, seed=1)
    r = Raw(lib, mp, n_ctx=128, n_batch=128, n_ubatch=128, n_seq_max=2, type_k=TYPE_F32, type_v=TYPE_F32)
    L, toks = r.L, list(range(10, 20))
    assert r.decode([(t, i, 0) for i, t in enumerate(toks)]) == 0  # cells 0..9
    n = L.llama_state_seq_get_size(r.ctx, 0)
    state = ffi.new("uint8_t[]", n)
    assert L.llama_state_seq_get_data(r.ctx, state, n, 0) == n
    L.llama_kv_self_seq_rm(r.ctx, 0, 2, 4)
    L.llama_kv_self_seq_add(r.ctx, 0, 4, -1, -2)  # K-shift pending on cells 4..9
    L.llama_kv_self_seq_rm(r.ctx, 0, -1, -1)      # ... and their data removed
    restored = int(L.llama_state_seq_set_data(r.ctx, state, n, 1))  # into cells 0..9 again
    positions = r.positions(1)
    rc = r.decode([(42, len(toks), 1)])
    got = r.logits()
    want = r.fresh(toks + [42], 0)
    return {"case": "state-after-shift", "state_bytes": n, "restored": restored, "positions": positions,
            "rc": rc, "max_abs_diff_vs_fresh": _max_diff(got, want)}


def case_shift_abort(lib: str, model_dir: Path) -> dict:
    # 1 layer, f32 cache: the K/V of a token depend only on it and its position, so a K-shift is exact
    mp = make_tiny_model(model_dir / "tiny-1l.gguf", n_layer=1, seed=1)
    r = Raw(lib, mp, n_ctx=128, n_batch=128, n_ubatch=128, n_seq_max=2, type_k=TYPE_F32, type_v=TYPE_F32)
    toks = list(range(10, 40))
    assert r.decode([(t, i, 0) for i, t in enumerate(toks)]) == 0
    r.L.llama_kv_self_seq_rm(r.ctx, 0, 2, 10)
    r.L.llama_kv_self_seq_add(r.ctx, 0, 10, -1, -8)  # K-shift pending
    kept = toks[:2] + toks[10:]
    cb = _abort_always()
    r.L.llama_set_abort_callback(r.ctx, cb, ffi.NULL)
    rc_aborted = r.decode([(42, len(kept), 0)])      # applies the shift first, then is aborted
    r.L.llama_set_abort_callback(r.ctx, ffi.NULL, ffi.NULL)
    positions_after_abort = r.positions(0)
    rc = r.decode([(42, len(kept), 0)])
    got = r.logits()
    want = r.fresh(kept + [42], 1)
    return {"case": "shift-abort", "rc_aborted": rc_aborted, "rc": rc, "n_kept": len(kept),
            "positions_after_abort": positions_after_abort, "max_abs_diff_vs_fresh": _max_diff(got, want)}


def case_defrag_abort_graph(lib: str, model_dir: Path) -> dict:
    mp = make_tiny_model(model_dir / "tiny-1l.gguf", n_layer=1, seed=1)
    # n_ubatch 64: the worst-case reserve after the defrag stays inside the cache on vanilla (see defrag-abort)
    r = Raw(lib, mp, n_ctx=256, n_batch=256, n_ubatch=64, n_seq_max=3, type_k=TYPE_F32, type_v=TYPE_F32)
    mine = list(range(10, 30))
    assert r.decode([(100 + i, i, 0) for i in range(20)]) == 0  # cells 0..19: another sequence
    assert r.decode([(t, i, 1) for i, t in enumerate(mine)]) == 0  # cells 20..39
    r.L.llama_kv_self_seq_rm(r.ctx, 0, -1, -1)  # 20 free cells before ours: the defrag moves them all
    before = r.cache()
    cb = _abort_always()
    r.L.llama_set_abort_callback(r.ctx, cb, ffi.NULL)
    r.L.llama_kv_self_defrag(r.ctx)
    r.L.llama_kv_self_update(r.ctx)
    r.L.llama_set_abort_callback(r.ctx, ffi.NULL, ffi.NULL)
    after = r.cache()
    rc = r.decode([(42, len(mine), 1)])
    got = r.logits()
    want = r.fresh(mine + [42], 2)
    return {"case": "defrag-abort-graph", "graph_path": os.environ.get("LLAMA_KV_DEFRAG_GRAPH", "") == "1",
            "before": before, "after": after, "rc": rc, "max_abs_diff_vs_fresh": _max_diff(got, want),
            "stats": r.stats()}


def case_stale_restore(lib: str, model_dir: Path) -> dict:
    """Two failed decodes with a defrag between them: the second must not clear the first one's
    (already rolled back) cells, where the defrag has since moved another sequence."""
    mp = make_tiny_model(model_dir / "tiny-1l.gguf", n_layer=1, seed=1)
    r = Raw(lib, mp, n_ctx=64, n_batch=16, n_ubatch=16, n_seq_max=5, type_k=TYPE_F32, type_v=TYPE_F32)
    toks = {s: [(1 + s + 7 * i) % 200 + 1 for i in range(10)] for s in range(4)}
    for s in (0, 1, 2):                                   # x, y, w: cells 0..9, 10..19, 20..29
        assert r.decode([(t, i, s) for i, t in enumerate(toks[s])]) == 0
    r.L.llama_kv_self_seq_rm(r.ctx, 1, -1, -1)            # y leaves a hole at 10..19
    cb = _abort_always()
    r.L.llama_set_abort_callback(r.ctx, cb, ffi.NULL)
    rc_first = r.decode([(t, i, 3) for i, t in enumerate(toks[3])])   # z lands in the hole, aborted
    r.L.llama_set_abort_callback(r.ctx, ffi.NULL, ffi.NULL)
    r.L.llama_kv_self_defrag(r.ctx)
    r.L.llama_kv_self_update(r.ctx)                       # w moves into 10..19
    w_after_defrag = r.positions(2)
    r.L.llama_set_abort_callback(r.ctx, cb, ffi.NULL)
    rc_second = r.decode([(5, 10, 0)])                    # x: aborted again
    r.L.llama_set_abort_callback(r.ctx, ffi.NULL, ffi.NULL)
    w_after = r.positions(2)
    rc = r.decode([(42, 10, 2)])
    got = r.logits()
    want = r.fresh(toks[2] + [42], 4)
    return {"case": "stale-restore", "rc_first": rc_first, "rc_second": rc_second,
            "w_after_defrag": w_after_defrag, "w_after": w_after, "rc": rc,
            "max_abs_diff_vs_fresh": _max_diff(got, want)}


def case_shift_bf16(lib: str, model_dir: Path) -> dict:
    mp = make_tiny_model(model_dir / "tiny-1l.gguf", n_layer=1, seed=1)
    r = Raw(lib, mp, n_ctx=128, n_batch=128, n_ubatch=128, n_seq_max=2, type_k=TYPE_BF16, type_v=TYPE_F16)
    assert r.decode([(t, i, 0) for i, t in enumerate([5, 6, 7, 8])]) == 0
    can_shift = bool(r.L.llama_kv_self_can_shift(r.ctx))
    r.L.llama_kv_self_seq_rm(r.ctx, 0, 0, 1)
    r.L.llama_kv_self_seq_add(r.ctx, 0, 1, -1, -1)
    print("K-shift of a bf16 cache", file=sys.stderr, flush=True)
    rc = r.decode([(9, 3, 0)])  # vanilla aborts in here
    got = r.logits()
    want = r.fresh([6, 7, 8, 9], 1)
    return {"case": "shift-bf16", "can_shift": can_shift, "rc": rc, "max_abs_diff_vs_fresh": _max_diff(got, want)}


def case_quant_head(lib: str, model_dir: Path) -> dict:
    mp = make_tiny_model(model_dir / "tiny-1l.gguf", n_layer=1, seed=1)  # n_embd 64, 4 heads: head size 16
    toks = list(range(10, 30))
    ref = Raw(lib, mp, n_ctx=128, n_batch=128, n_ubatch=128, n_seq_max=1, type_k=TYPE_F32, type_v=TYPE_F32)
    want = ref.fresh(toks, 0)
    r = Raw(lib, mp, n_ctx=128, n_batch=128, n_ubatch=128, n_seq_max=1, type_k=TYPE_Q8_0, need_ctx=False)
    out = {"case": "quant-head", "head_size": 16, "block_size": 32, "context_created": r.ctx != ffi.NULL,
           "errors": r.errors()}
    if r.ctx == ffi.NULL:
        return out
    out["max_abs_diff_vs_f32_cache"] = _max_diff(r.fresh(toks, 0), want)
    print("progress: " + json.dumps(out), file=sys.stderr, flush=True)
    r.L.llama_kv_self_seq_rm(r.ctx, 0, 0, 1)
    r.L.llama_kv_self_seq_add(r.ctx, 0, 1, -1, -1)
    out["rc_after_shift"] = r.decode([(9, len(toks) - 1, 0)])  # vanilla aborts in the K-shift
    return out


def case_c_api_throw(lib: str, model_dir: Path) -> dict:
    mp = make_tiny_model(model_dir / "tiny-nobytes.gguf", n_layer=1, byte_tokens=False)
    r = Raw(lib, mp, n_ctx=64, n_batch=64, n_ubatch=64, n_seq_max=1)
    L, out = r.L, {"case": "c-api-throw"}
    text = "h\u00e9llo".encode()
    buf = ffi.new("llama_token[]", 64)
    errors = getattr(r.L_obj, "recent_errors", None)

    def call(name, fn):
        """out[name] = fn(), and the error lines llama.cpp logged during the call."""
        if errors is not None:
            errors.clear()
        out[name] = fn()
        out["errors"][name] = list(errors or [])

    out["errors"] = {}
    print("tokenize", file=sys.stderr, flush=True)
    # vanilla terminates in here
    call("tokenize", lambda: int(L.llama_tokenize(r.vocab, text, len(text), buf, 64, True, False)))
    call("tokenize_ascii", lambda: int(L.llama_tokenize(r.vocab, b"hello", 5, buf, 64, True, False)))
    cbuf = ffi.new("char[]", 64)
    call("token_to_piece", lambda: int(L.llama_token_to_piece(r.vocab, r.n_vocab, cbuf, 64, 0, False)))
    bad = ffi.new("llama_token[]", [1, r.n_vocab])
    call("detokenize", lambda: int(L.llama_detokenize(r.vocab, bad, 2, cbuf, 64, False, False)))
    # vocab getters that pyllama_kv does not declare: a small FFI of their own on the same library
    gffi = cffi.FFI()
    gffi.cdef("struct llama_vocab; const char * llama_vocab_get_text(const struct llama_vocab *, int32_t);"
              "float llama_vocab_get_score(const struct llama_vocab *, int32_t);"
              "int llama_vocab_get_attr(const struct llama_vocab *, int32_t);")
    G = gffi.dlopen(str(r.L_obj.path))
    gv = gffi.cast("struct llama_vocab *", int(ffi.cast("uintptr_t", r.vocab)))
    call("vocab_get_text_is_null", lambda: G.llama_vocab_get_text(gv, r.n_vocab) == gffi.NULL)
    call("vocab_get_score_is_nan", lambda: math.isnan(G.llama_vocab_get_score(gv, r.n_vocab)))
    call("vocab_get_attr", lambda: int(G.llama_vocab_get_attr(gv, -1)))
    call("model_load_null_path",
         lambda: L.llama_model_load_from_file(ffi.NULL, L.llama_model_default_params()) == ffi.NULL)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default="patched", help="patched, vanilla, or a path to libllama (default: patched)")
    ap.add_argument("--case", choices=CASES + ("all",), default="all")
    ap.add_argument("--model-dir", help="where to write the tiny models (default: a temporary dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON document (the default prints it indented)")
    args = ap.parse_args(argv)
    fns = {"slot": case_slot, "defrag-holes": case_defrag_holes, "defrag-abort": case_defrag_abort,
           "bad-token": case_bad_token, "retry-abort": case_retry_abort, "view-shift": case_view_shift,
           "state-after-shift": case_state_after_shift, "shift-abort": case_shift_abort,
           "stale-restore": case_stale_restore,
           "defrag-abort-graph": case_defrag_abort_graph,
           "shift-bf16": case_shift_bf16, "quant-head": case_quant_head, "c-api-throw": case_c_api_throw}
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
