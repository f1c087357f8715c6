"""The semantics oracle: random operation sequences against a fresh evaluation and a model of the cells.

A hypothesis state machine runs extend, fork at random n, truncate, remove ranges, shift_out,
multi-sequence decode, defrag and close on several sequences of one small context that starts
fragmented (a filler sequence over all but the last 16 cells, with every other cell freed), so
decodes hit the patched slot retry and defrags move other sequences' cells. Two rules
(``remove_fork_remove``, ``burst``) run removals, shifts, forks, truncations and closes back to back
with no decode between them, so that a K-shift stays pending across a fork and a further removal
(the logits check decodes, which applies pending shifts; before these rules the oracle never saw
a pending shift meet a fork, and missed issue 8 A1).

After every step, two checks, cells first:

* **Cells, from C.** The machine keeps its own model of the cells: every computed token is a cell,
  a fork shares its parent's cells, a removal whose tail is shared with another sequence gives the
  tail new cells of its own (copy-on-write), a K-shifted private tail keeps its cells. The cache as
  llama.cpp reports it (``kv_view()``: per cell its position and holders; ``kv_stats()``,
  ``kv_cells()`` and ``llama_kv_self_used_cells``) must be exactly that: each live sequence holds
  positions 0..n-1 and nothing else, each cell is shared by exactly the sequences that should share
  it, the filler keeps its cells, closed ids hold none, and the used and free counts match. The free
  count that a ``KVCacheFullError`` is judged by is the model's, not the library's.
* **Logits.** For every live sequence, a fork of it decodes each probe token (``probes_for``: 4 for
  up to 16 tokens, 8 beyond) over all of its cells; the logits must equal those of a reference
  context fed the same tokens from position 0, within the configuration's tolerance. With no free
  cell for a probe, the sequence's last token is re-evaluated instead (a "fallback", weaker: it
  heals a wrong last cell); with that impossible too, the sequence goes unchecked (a "skip"). Both
  are counted and bounded.

Model. The oracle's models are ``make_tiny_model``'s with the query weights scaled by ``Q_SCALE``
(0.5): flatter attention, so that every cell weighs in the probes' logits. With the unscaled model
and one probe, one wrong cell moved the logits by as little as 2e-4 at 80 tokens (and 9 of 40
single wrong cells went unseen under the old 5e-2 tolerance at 20 tokens). Sequences never grow past
``MAX_LEN`` (32) tokens, the longest length the sensitivity test covers.

Tolerances: 3x the largest difference measured between correct operations and the fresh
evaluation, rounded up to two digits. Measured with this file's machines (PYLLAMA_KV_ORACLE_RANDOM=1:
8 runs of 50 examples x 30 steps per configuration, 11,000 to 16,000 checks each; patched build of
issue 8, 2 vCPU Xeon, f32 logits of magnitude ~6):

    configuration         largest difference   tolerance   source of the difference
    2l-f32                4.8e-6               1.5e-5      summation order (ubatch sizes, cell order)
    2l-f32-graphdefrag    4.8e-6               1.5e-5      same
    2l-f32-movesdefrag    (as 2l-f32)          1.5e-5      same (defrag paths leave the same bytes:
    2l-f32-fa-graphdefrag (as 2l-f32-fa)       2.9e-2      tests/test_defrag_paths.py)
    2l-f32-fa             9.7e-3               2.9e-2      flash attention casts K/V to f16 and sums V in
                                                           f16 in cell order: scattered cells round
                                                           differently from the reference's
    2l-f16                3.6e-3               1.1e-2      f16 K/V
    1l-f32-shift          3.1e-6               9.3e-6      summation order; K-shift rotation in f32
    1l-f16-fa-shift       6.7e-3               2.1e-2      f16 K/V re-rounded by the K-shift, and the above

The current pin's rows (``...@current``, issue 32; 7 runs, one derandomized, 1,800 to 3,800 checks
each; the current llama.cpp's CPU kernels, flash attention's among them):

    2l-f32@current            4.8e-6           1.5e-5
    2l-f32-fa@current         1.1e-2           3.3e-2
    2l-f16@current            3.5e-3           1.1e-2
    1l-f32-shift@current      3.8e-6           1.2e-5
    1l-f16-fa-shift@current   9.3e-3           2.8e-2

Sensitivity (``test_one_wrong_cell_exceeds_the_tolerance``): at every length up to MAX_LEN, in every
configuration, one wrong cell must move the probes' logits by ``SENSITIVITY_MARGIN`` times the
tolerance: 5x for a cell holding another token's K/V (what only the logits can see), 1.5x for a cell
one position too low (which the cell check also catches exactly, from the positions). Measured over
30 random trials at each length from 2 to 32: the smallest effect of a wrong token was 21x the
tolerance (1l-f16-fa-shift, 32 tokens: 0.44), of a wrong position 1.8x (1l-f16-fa-shift, 28 tokens:
0.039); the f32 configurations are thousands of times above theirs.

remove/shift_out use llama.cpp's K-shift, which equals a fresh evaluation only when the cached K/V
of a token depend on nothing but the token and its position: a 1-layer model. So the machines with
K-shifts use a 1-layer model; the 2-layer machines test everything else (fork, truncate, close,
remove with recompute, batched decode, defrag, retries), which is exact at any depth.

Budget: PYLLAMA_KV_ORACLE_EXAMPLES (default 50) examples of up to PYLLAMA_KV_ORACLE_STEPS (default
30) steps per machine, derandomized (the same examples every run) unless PYLLAMA_KV_ORACLE_RANDOM=1.
Every context runs one thread: these decodes are tiny, and ggml's barriers crawl when the suite's
other work holds the cores.
"""
from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pyllama_kv as pk
from conftest import DEVICE_F16_ATOL, DEVICE_F32_ATOL, cache_on_device
from pyllama_kv.tools.gguf import make_tiny_model

EXAMPLES = int(os.environ.get("PYLLAMA_KV_ORACLE_EXAMPLES", "50"))
SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=int(os.environ.get("PYLLAMA_KV_ORACLE_STEPS", "30")),
                    deadline=None, derandomize=not os.environ.get("PYLLAMA_KV_ORACLE_RANDOM"),
                    suppress_health_check=list(HealthCheck))

Q_SCALE = 0.5
PROBES = (5, 77, 301, 640, 150, 420, 33, 777)
MAX_LEN = 32   # no sequence grows longer: the sensitivity test covers every length the oracle checks


def probes_for(n: int) -> tuple:
    """The probe tokens for a sequence of ``n`` tokens: one wrong cell weighs less in a longer one."""
    return PROBES[:4] if n <= 16 else PROBES


_models: dict = {}
RUN_STATS: dict = {}


def _model(tmp_root, n_layer: int, lib: str = "patched") -> pk.Model:
    """The oracle's model of ``n_layer`` layers on ``lib`` (patched: the mission pin's build; current)."""
    if (n_layer, lib) not in _models:
        import gguf

        from conftest import _lib

        p = tmp_root / f"oracle-{n_layer}l.gguf"
        if not p.exists():
            make_tiny_model(p, n_layer=n_layer, seed=7 + n_layer)
            r = gguf.GGUFReader(p, "r+")  # flatter attention: scale the query weights in place
            for t in r.tensors:
                if t.name.endswith("attn_q.weight"):
                    t.data[...] *= Q_SCALE
            del r
        _models[(n_layer, lib)] = pk.Model(p, lib=_lib(lib))
    return _models[(n_layer, lib)]


def _lib_of(name: str) -> str:
    """A configuration named ``...@current`` runs on the current pin's library (issue 32)."""
    return "current" if name.endswith("@current") else "patched"


def _context_kwargs(flash_attn: bool, kv_type: str) -> dict:
    return dict(n_ctx=256 if flash_attn else 128, flash_attn=flash_attn, type_k=kv_type, type_v=kv_type)


token_lists = st.lists(st.integers(3, 900), min_size=1, max_size=12)


class KVMachine(RuleBasedStateMachine):
    # set by make_machine()
    tmp_root = None
    n_layer = 2
    flash_attn = False
    kv_type = "f32"
    shifts = False
    name = ""

    def __init__(self):
        super().__init__()
        m = _model(self.tmp_root, self.n_layer, _lib_of(self.name))
        self.m = m
        kw = _context_kwargs(self.flash_attn, self.kv_type)
        self.ctx = m.context(n_seq_max=8, n_batch=32, n_ubatch=16, n_threads=1, **kw)
        self.ref = m.context(n_seq_max=1 + len(PROBES), n_batch=64, n_ubatch=64, n_threads=1, **kw)
        self.ref_seq = self.ref.new_sequence()
        self.atol = tolerance(self.name, cache_on_device(m))
        self.live: list[pk.Sequence] = []
        self.cells: dict = {}       # the model: sequence -> cell ids, position i holding cells[s][i]
        self.next_cell = 0
        self.filler_cells: list[int] = []
        self.stats = Counter()
        self.max_err = 0.0
        self.ref_memo: dict = {}

    @initialize()
    def fragment(self):
        """A filler sequence over all but the last 16 cells, with every other cell freed: one-cell holes,
        so that a batch of more than 16 tokens, or any batch once the last cells are taken, needs the
        patched slot retry."""
        c = self.ctx
        filler = c.new_sequence()
        n = c.n_ctx - 16
        filler.extend(list(np.arange(n) % 500 + 3))
        for p in range(0, n, 2):
            assert c._native.seq_rm(filler.id, p, p + 1)  # raw: holes, no shift
        # the filler only holds cells: never used through the API again (its tokens no longer match its cells)
        self.filler = filler
        self.filler_cells = list(range(1, n, 2))  # positions of the cells it keeps

    def teardown(self):
        st_ = self.ctx.kv_stats()
        agg = RUN_STATS.setdefault(self.name, Counter())
        for k in ("graphs", "slot_retries", "defrags", "moves"):
            agg[k] += getattr(st_, k) or 0
        for k, v in self.stats.items():
            agg[k] = max(agg[k], v) if k.startswith("max_") else agg[k] + v
        agg["machines"] += 1
        agg["max_err"] = max(agg["max_err"], self.max_err)
        self.ctx.close()
        self.ref.close()

    # -- the model of the cells -----------------------------------------------------------------

    def _new_cells(self, k: int) -> list[int]:
        self.next_cell += k
        return list(range(self.next_cell - k, self.next_cell))

    def _holders(self) -> dict:
        """cell -> (position, ids of the live sequences holding it)."""
        out: dict = {}
        for s in self.live:
            for p, c in enumerate(self.cells[s]):
                pos, ids = out.setdefault(c, (p, set()))
                assert pos == p, "oracle model: a shared cell at two positions"
                ids.add(s.id)
        return out

    def _shared(self, s, cells) -> bool:
        """Whether another live sequence holds any of ``cells``."""
        cells = set(cells)
        return any(cells.intersection(self.cells[o]) for o in self.live if o is not s)

    def _want(self) -> Counter:
        want = Counter((p, frozenset(ids)) for p, ids in self._holders().values())
        want.update((p, frozenset([self.filler.id])) for p in self.filler_cells)
        return want

    def _free(self) -> int:
        """Free cells by the model: what the library must report, and what a KVCacheFullError is judged by."""
        return self.ctx.n_ctx - len(self.filler_cells) - len(set().union(*self.cells.values()))

    def _full_ok(self, needed: int, free_before: int, exc):
        """A KVCacheFullError is only acceptable when the cells really are not there."""
        self.stats["full"] += 1
        assert needed > free_before, f"KVCacheFullError with {free_before} free cells for {needed} tokens: {exc}"

    # -- operations (rules and bursts) ----------------------------------------------------------

    def _pick(self, i):
        return self.live[i % len(self.live)]

    def _fork(self, s, frac):
        n = int(round(frac * len(s)))
        c = s.fork(n)
        assert c.tokens == s.tokens[:n]
        self.live.append(c)
        self.cells[c] = self.cells[s][:n]
        return c

    def _truncate(self, s, frac):
        n = int(frac * len(s))
        want = s.tokens[:n]
        s.truncate(n)
        assert s.tokens == want
        del self.cells[s][n:]

    def _remove(self, s, a, b, recompute):
        lo, hi = sorted((int(a * len(s)), int(b * len(s))))
        self._remove_range(s, lo, hi, recompute)

    def _shift_out(self, s, keep, discard):
        keep = min(keep, len(s))
        discard = min(discard, len(s) - keep)
        self._remove_range(s, keep, keep + discard, False, shift_out=True)

    def _remove_range(self, s, lo, hi, recompute, shift_out=False):
        before = s.tokens
        free = self._free()
        cells = self.cells[s]
        tail = cells[hi:]
        try:
            if shift_out:
                s.shift_out(lo, hi - lo)
            else:
                s.remove(lo, hi, recompute=recompute)
        except pk.KVCacheFullError as e:  # copy-on-write needs cells for the re-evaluated tail
            self._full_ok(len(tail), free, e)
            assert s.tokens == before, "a failed removal changed the sequence"
            return
        assert s.tokens == before[:lo] + before[hi:]
        if lo == hi:
            return
        if tail and (recompute or self._shared(s, tail)):
            tail = self._new_cells(len(tail))  # copy-on-write (or recompute): cells of its own
        self.cells[s] = cells[:lo] + tail

    def _close(self, s):
        s.close()
        self.live.remove(s)
        del self.cells[s]

    # -- rules ----------------------------------------------------------------------------------

    @precondition(lambda self: self.ctx.free_sequence_ids > 1)
    @rule(tokens=token_lists)
    def new(self, tokens):
        s = self.ctx.new_sequence()
        free = self._free()
        self.live.append(s)
        self.cells[s] = []
        try:
            s.extend(tokens)
            self.cells[s] = self._new_cells(len(tokens))
        except pk.KVCacheFullError as e:
            self._full_ok(len(tokens), free, e)
            assert len(s) == 0

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), tokens=token_lists)
    def extend(self, i, tokens):
        s = self._pick(i)
        tokens = tokens[:MAX_LEN - len(s)]
        if not tokens:
            return
        before = s.tokens
        free = self._free()
        try:
            s.extend(tokens)
        except pk.KVCacheFullError as e:
            self._full_ok(len(tokens), free, e)
            assert s.tokens == before, "a failed extend changed the sequence"
            return
        assert s.tokens == before + tokens
        self.cells[s] += self._new_cells(len(tokens))

    @precondition(lambda self: self.live and self.ctx.free_sequence_ids > 1)
    @rule(i=st.integers(0, 99), frac=st.floats(0, 1))
    def fork(self, i, frac):
        self._fork(self._pick(i), frac)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), frac=st.floats(0, 1))
    def truncate(self, i, frac):
        self._truncate(self._pick(i), frac)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), a=st.floats(0, 1), b=st.floats(0, 1), recompute=st.booleans())
    def remove(self, i, a, b, recompute):
        # K-shifts only where they are exact (1 layer); elsewhere the exact re-evaluation
        self._remove(self._pick(i), a, b, recompute or not self.shifts)

    @precondition(lambda self: self.shifts and self.live)
    @rule(i=st.integers(0, 99), keep=st.integers(0, 6), discard=st.integers(0, 8))
    def shift_out(self, i, keep, discard):
        self._shift_out(self._pick(i), keep, discard)

    @precondition(lambda self: self.shifts and self.live and self.ctx.free_sequence_ids > 1)
    @rule(i=st.integers(0, 99), a=st.floats(0, 1), b=st.floats(0, 1), frac=st.floats(0.5, 1),
          c=st.floats(0, 1), d=st.floats(0, 1), in_child=st.booleans())
    def remove_fork_remove(self, i, a, b, frac, c, d, in_child):
        """A removal (its K-shift pending), a fork of the shifted sequence, and a removal in one of
        the two, with no decode between them."""
        s = self._pick(i)
        self._remove(s, a, b, False)
        child = self._fork(s, frac)
        self._remove(child if in_child else s, c, d, False)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def burst(self, data):
        """2 to 6 removals, shifts, forks, truncations and closes back to back, no decode between them."""
        ops = ["remove", "fork", "truncate", "close"] + (["shift_out"] if self.shifts else [])
        for _ in range(data.draw(st.integers(2, 6), label="n_ops")):
            if not self.live:
                return
            op = data.draw(st.sampled_from(ops), label="op")
            s = self._pick(data.draw(st.integers(0, 99), label="i"))
            if op == "remove":
                a, b = data.draw(st.floats(0, 1)), data.draw(st.floats(0, 1))
                self._remove(s, a, b, not self.shifts or data.draw(st.booleans(), label="recompute"))
            elif op == "shift_out":
                self._shift_out(s, data.draw(st.integers(0, 6)), data.draw(st.integers(0, 8)))
            elif op == "fork" and self.ctx.free_sequence_ids > 1:
                self._fork(s, data.draw(st.floats(0, 1)))
            elif op == "truncate":
                self._truncate(s, data.draw(st.floats(0, 1)))
            elif op == "close":
                self._close(s)

    @precondition(lambda self: len(self.live) >= 2)
    @rule(data=st.data())
    def decode_many(self, data):
        k = data.draw(st.integers(2, len(self.live)))
        idx = data.draw(st.lists(st.integers(0, len(self.live) - 1), min_size=k, max_size=k, unique=True))
        batch = {self.live[j]: data.draw(token_lists)[:MAX_LEN - len(self.live[j])] for j in idx}
        batch = {s: t for s, t in batch.items() if t}
        if not batch:
            return
        before = {s: s.tokens for s in batch}
        free = self._free()
        try:
            out = self.ctx.decode(batch)
        except pk.KVCacheFullError as e:
            self._full_ok(sum(len(t) for t in batch.values()), free, e)
            for s in batch:
                assert s.tokens == before[s], "a failed decode changed a sequence"
            return
        assert set(out) == set(batch)
        for s, t in batch.items():
            assert s.tokens == before[s] + t
            self.cells[s] += self._new_cells(len(t))

    @precondition(lambda self: self.ctx.caps.defrag)
    @rule()
    def defrag(self):
        st_ = self.ctx.defrag()
        assert st_.holes == 0 and st_.largest_free_block == st_.free_cells

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def close(self, i):
        self._close(self._pick(i))

    # -- the oracle -----------------------------------------------------------------------------

    @invariant()
    def the_cache_holds_what_the_sequences_should(self):
        # cells first: the logits check decodes, which applies pending K-shifts
        self._check_cells()
        self._check_logits()

    def _check_cells(self):
        ctx = self.ctx
        from conftest import cell_rows

        if not ctx.caps.cell_view:   # the current API: positions from C, sharing from the binding's shadow
            self._check_positions()
        pos, seqs = cell_rows(ctx)
        if not ctx.caps.cell_view:
            seqs = np.where(seqs < ctx.n_seq_max, seqs, -1)   # not the spare id
            seqs = np.sort(seqs, axis=1)[:, ::-1]             # holders first
        used = seqs[:, 0] >= 0
        got = Counter((p, frozenset(x for x in row if x >= 0))
                      for p, row in zip(pos[used].tolist(), seqs[used].tolist()))
        want = self._want()
        if got != want:
            by_seq = {}
            for name, cnt in (("got", got), ("want", want)):
                for (p, ids), k in cnt.items():
                    for sid in ids:
                        by_seq.setdefault(sid, {"got": [], "want": []})[name] += [p] * k
            bad = {sid: {k: sorted(v) for k, v in d.items()}
                   for sid, d in by_seq.items() if Counter(d["got"]) != Counter(d["want"])}
            shared_got = sorted((p, sorted(ids)) for (p, ids), k in got.items() if len(ids) > 1 for _ in range(k))
            shared_want = sorted((p, sorted(ids)) for (p, ids), k in want.items() if len(ids) > 1 for _ in range(k))
            raise AssertionError(
                f"the cache does not hold what the sequences should: positions per sequence id {bad}; "
                f"shared cells (position, holders) got {shared_got}, want {shared_want}")
        for s in self.live:
            assert len(self.cells[s]) == len(s)
        n_used = sum(want.values())
        if not ctx.caps.cell_view:
            return
        st_ = ctx.kv_stats()
        assert (st_.used_cells, st_.free_cells, st_.n_cells) == (n_used, ctx.n_ctx - n_used, ctx.n_ctx), st_
        assert int(ctx._L.llama_kv_self_used_cells(ctx._ptr)) == n_used, "llama.cpp's used-cell counter is off"
        occ = ctx.kv_cells()
        assert int((occ == -1).sum()) == ctx.n_ctx - n_used
        assert int((occ == -2).sum()) == sum(k for (_, ids), k in want.items() if len(ids) > 1)

    def _check_positions(self):
        """From C, where the library has no cell view: the smallest and largest position of every
        sequence (llama_memory_seq_pos_min/max): 0 and n-1 for a live one, none for a closed id, the
        filler's first and last odd position. A wrong position inside a sequence is the logits'
        to catch (the sensitivity test's position trials); the sharing of cells is checked against
        the binding's shadow of them, its own bookkeeping, not llama.cpp's."""
        ctx = self.ctx
        L_, mem = ctx._L, ctx._native.mem
        live = {s.id: len(s) for s in self.live}
        for sid in range(ctx.n_seq_max):
            lo, hi = int(L_.llama_memory_seq_pos_min(mem, sid)), int(L_.llama_memory_seq_pos_max(mem, sid))
            if sid == self.filler.id:
                want = (self.filler_cells[0], self.filler_cells[-1])
            else:
                n = live.get(sid, 0)
                want = (0, n - 1) if n else (-1, -1)
            assert (lo, hi) == want, f"sequence {sid} holds positions [{lo}, {hi}] in C, want {want}"

    def _fresh(self, tokens: tuple, probes: bool) -> list:
        """The reference: ``tokens`` evaluated from position 0 in a clean cache, then each probe (one
        decode for all of them, a fork each); or, with ``probes`` false, the next-token logits of the
        tokens themselves. Memoized per machine: most sequences are unchanged from one step to the next."""
        key = (tokens, probes)
        if key not in self.ref_memo:
            self.ref.clear()
            want = [self.ref_seq.extend(list(tokens))]
            if probes:
                forks = {self.ref_seq.fork(): p for p in probes_for(len(tokens))}
                out = self.ref.decode({f: [p] for f, p in forks.items()})
                want = [out[f] for f in forks]
                for f in forks:
                    f.close()
            self.ref_memo[key] = want
        return self.ref_memo[key]

    def _check_logits(self):
        free = self._free()
        for s in self.live:
            if len(s) == 0:
                continue
            # probe without touching s: a fork shares all of s's cells, and one more token attends to
            # every one of them (re-evaluating s's last token would heal a corrupted last cell)
            got = []
            try:
                t = s.fork()
                try:
                    for p in probes_for(len(s)):
                        got.append(t.extend([p]))
                        t.truncate(len(s))
                finally:
                    t.close()
                probes = True
            except pk.KVCacheFullError:  # not one free cell: re-evaluate the last token instead
                assert free == 0, f"the probe found no free cell, with {free} free"
                self.stats["fallback"] += 1
                last_shared = self._shared(s, self.cells[s][-1:])
                try:
                    got = [s.logits(recompute=True)]
                except pk.KVCacheFullError:
                    assert last_shared, "logits(recompute=True) refused although the last cell is its own"
                    self.stats["skipped"] += 1
                    continue
                self.cells[s][-1:] = self._new_cells(1)
                free = self._free()
                probes = False
            self.stats["checked"] += 1
            self.stats["max_len"] = max(self.stats["max_len"], len(s))
            want = self._fresh(tuple(s.tokens), probes)
            err = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
            self.max_err = max(self.max_err, err)
            b = f"max_err_len{len(s) // 16 * 16}"
            self.stats[b] = max(self.stats[b], err)
            assert err <= self.atol, f"sequence {s.id} ({len(s)} tokens) differs from a fresh evaluation by {err}"


CONFIGS = [
    # name, n_layer, flash_attn, kv_type, shifts
    ("2l-f32", 2, False, "f32", False),
    ("2l-f32-graphdefrag", 2, False, "f32", False),  # defrag through the gather graphs instead of memcpy
    ("2l-f32-fa-graphdefrag", 2, True, "f32", False),  # the same with V not transposed
    ("2l-f32-movesdefrag", 2, False, "f32", False),  # defrag through the per-move graphs
    ("2l-f32-fa", 2, True, "f32", False),
    ("2l-f16", 2, False, "f16", False),
    ("1l-f32-shift", 1, False, "f32", True),
    ("1l-f16-fa-shift", 1, True, "f16", True),
    # the current pin (issue 32): every configuration without a defrag (it has none)
    ("2l-f32@current", 2, False, "f32", False),
    ("2l-f32-fa@current", 2, True, "f32", False),
    ("2l-f16@current", 2, False, "f16", False),
    ("1l-f32-shift@current", 1, False, "f32", True),
    ("1l-f16-fa-shift@current", 1, True, "f16", True),
]
# 3x the largest difference measured in correct operations (table in the module docstring)
TOLERANCE = {"2l-f32": 1.5e-5, "2l-f32-graphdefrag": 1.5e-5, "2l-f32-fa-graphdefrag": 2.9e-2,
             "2l-f32-movesdefrag": 1.5e-5, "2l-f32-fa": 2.9e-2, "2l-f16": 1.1e-2,
             "1l-f32-shift": 9.3e-6, "1l-f16-fa-shift": 2.1e-2}
TOLERANCE.update({"2l-f32@current": 1.5e-5, "2l-f32-fa@current": 3.3e-2, "2l-f16@current": 1.1e-2,
                  "1l-f32-shift@current": 1.2e-5, "1l-f16-fa-shift@current": 2.8e-2})


def tolerance(name: str, on_device: bool) -> float:
    """TOLERANCE[name]; for a cache in device memory at least the GPU's (conftest): an H200 gave 5.2e-3
    on 2l-f32-graphdefrag and 1.3e-2 on 2l-f16 in correct runs (NVIDIA_TF32_OVERRIDE=0), where the CPU
    stays below 5e-6 and 3.7e-3. So on a GPU the oracle sees a wrong state of short sequences and gross
    errors, not every single wrong cell of a long one (as little as 2e-4, above): the CPU run is the
    exact one."""
    if not on_device:
        return TOLERANCE[name]
    return max(TOLERANCE[name], DEVICE_F16_ATOL if "f16" in name else DEVICE_F32_ATOL)


# LLAMA_KV_DEFRAG_GRAPH per configuration (read by llama.cpp at every defrag): the defrag path
DEFRAG_GRAPH = {"graphdefrag": "1", "movesdefrag": "moves"}


def make_machine(name, n_layer, fa, kv, shifts, tmp_root):
    return type(f"KV_{name.replace('-', '_')}", (KVMachine,), dict(
        tmp_root=tmp_root, n_layer=n_layer, flash_attn=fa, kv_type=kv, shifts=shifts, name=name))


@pytest.fixture(scope="module")
def oracle_root(tmp_path_factory):
    yield tmp_path_factory.mktemp("oracle")
    for m in _models.values():
        m.close()
    _models.clear()


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_semantics_oracle(cfg, oracle_root, monkeypatch):
    for key, value in DEFRAG_GRAPH.items():
        if key in cfg[0]:
            monkeypatch.setenv("LLAMA_KV_DEFRAG_GRAPH", value)
    machine = make_machine(*cfg, oracle_root)
    machine.TestCase.settings = SETTINGS
    machine.TestCase().runTest()


def test_oracle_exercised_fragmentation_retries_and_defrags():
    """The runs above must really have gone through the patched slot retry and moved cells, in every
    configuration; an oracle that never fragments proves little."""
    if not RUN_STATS:
        pytest.skip("the oracle machines did not run (deselected)")
    print(json.dumps(RUN_STATS, indent=1, sort_keys=True))
    on_device = any(cache_on_device(m) for m in _models.values())
    for name, v in RUN_STATS.items():
        if _lib_of(name) == "patched":   # the current pin has no slot retry or defrag: it needs none
            assert v["slot_retries"] > 0 and v["defrags"] >= v["slot_retries"] and v["moves"] > 0, (name, v)
        # a sequence is checked through a re-evaluation of its last token (fallback) only when no cell
        # is free, and goes unchecked (skip) only when, besides, its last cell is shared. Measured
        # (8 random runs per configuration): fallbacks 0 to 18% of the checks of a run, 5% at most on
        # average; skips 0. The default run has none of either.
        assert v["fallback"] <= 0.2 * v["checked"] and v["skipped"] <= 0.01 * v["checked"], (name, v)
        assert v["max_len"] <= MAX_LEN and v["max_err"] <= tolerance(name, on_device), (name, v)
    # every defrag path ran: graphs only where forced, memcpy elsewhere (a cache on a GPU: graphs always)
    mission = [c[0] for c in CONFIGS if _lib_of(c[0]) == "patched"]
    graph_cfgs = [k for k in mission if on_device or any(key in k for key in DEFRAG_GRAPH)]
    assert all(RUN_STATS.get(k, {"graphs": 1})["graphs"] > 0 for k in graph_cfgs), RUN_STATS
    assert all(v["graphs"] == 0 for k, v in RUN_STATS.items() if k in mission and k not in graph_cfgs), RUN_STATS


SENSITIVITY_MARGIN = {"token": 5.0, "position": 1.5}
SENS_LENGTHS = (2, 4, 8, 12, 16, 17, 20, 24, 28, MAX_LEN)
SENS_TRIALS = 8


def one_wrong_cell(model: pk.Model, flash_attn: bool, kv_type: str, lengths, trials: int, seed: int = 0) -> dict:
    """{length: (smallest, median) of the probes' largest logit difference, for one wrong cell} over
    ``trials`` random token lists per length, for two kinds of wrong cell in an otherwise correct cache:

    * ``token``: cell k holds the K/V of another token (computed over the same prefix), every other
      cell is the right one (the cell is taken from a sequence evaluated with the other token);
    * ``position``: cell k sits one position too low (K-shifted by -1, as a miscounted shift leaves it).
    """
    rng = np.random.default_rng(seed)
    out = {"token": {}, "position": {}}
    with model.context(n_seq_max=3, n_batch=64, n_ubatch=64, n_threads=1, **_context_kwargs(flash_attn, kv_type)) as c:
        s, other = c.new_sequence(), c.new_sequence()
        native = c._native
        last_position_probed = c.caps.cell_view   # the mission pin decodes after any position

        def probe() -> np.ndarray:
            f = s.fork()
            res = []
            for p in probes_for(len(s)):
                res.append(f.extend([p]))
                f.truncate(len(s))
            f.close()
            return np.stack(res)

        for n in lengths:
            d_tok, d_pos = [], []
            for _ in range(trials):
                t = rng.integers(3, 901, n).tolist()
                c.clear()
                s.extend(t)
                right = probe()
                k = int(rng.integers(0, n))
                other.extend(t[:k] + [3 + (t[k] - 3 + int(rng.integers(1, 898))) % 898])
                assert native.seq_rm(s.id, k, k + 1)
                native.seq_cp(other.id, s.id, k, k + 1)  # s now holds other's cell k
                d_tok.append(float(np.abs(probe() - right).max()))
                if not last_position_probed and n <= 2:
                    continue
                c.clear()
                s.extend(t)
                # the current llama.cpp refuses a decode after a last position one too low (its positions
                # must stay consecutive), and the oracle's C check (_check_positions) sees that cell
                # exactly: there only the cells before it need the logits
                k = int(rng.integers(1, n if last_position_probed else n - 1))
                native.seq_add(s.id, k, k + 1, -1)
                d_pos.append(float(np.abs(probe() - right).max()))
            out["token"][n] = (min(d_tok), float(np.median(d_tok)))
            if d_pos:
                out["position"][n] = (min(d_pos), float(np.median(d_pos)))
    return out


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_one_wrong_cell_exceeds_the_tolerance(cfg, oracle_root):
    """The oracle's logits check can only catch a wrong cell that moves the logits past the tolerance:
    at every length the oracle checks (up to MAX_LEN), one wrong cell (a wrong token's K/V, or a
    wrong position) must move the probes' logits by SENSITIVITY_MARGIN times the configuration's
    tolerance, in every trial (SENS_TRIALS per length)."""
    name, n_layer, fa, kv, _ = cfg
    tol = TOLERANCE[name]
    got = one_wrong_cell(_model(oracle_root, n_layer, _lib_of(name)), fa, kv, SENS_LENGTHS, SENS_TRIALS)
    table = {kind: {n: round(v[0] / tol, 1) for n, v in d.items()} for kind, d in got.items()}
    for kind, d in got.items():
        for n, (smallest, _) in d.items():
            assert smallest >= SENSITIVITY_MARGIN[kind] * tol, (
                f"{name}: one wrong cell ({kind}) in {n} tokens moved the logits by only {smallest:.3g}, "
                f"tolerance {tol:.3g}; smallest effect / tolerance per length: {table}")
