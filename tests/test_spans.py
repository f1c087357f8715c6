"""Spans (issue 24, section 1): a compact host copy of a sequence's cells over [start, end), restored
onto a sequence that holds [0, start) with llama_state_seq_add_data (patch 0014; on the current pin,
patches/current/0001), exactly. Every test that takes ``model`` runs on both pins.

Exactness is checked on the bytes: a restored sequence's state (cells in position order, K and V of
every layer) equals the original's byte for byte, on an F32 model with an F32 and an F16 cache, with
V transposed (no flash attention) and not. Logits after a restore are compared too: the cells hold
the same bytes, but they may sit elsewhere in the cache, and attention sums over cells in cache
order, so the logits agree to F32 rounding (1e-5 here), not bitwise.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import run_py
from pyllama_kv.tools.gguf import make_tiny_model

CONFIGS = {"f32": dict(type_k="f32", type_v="f32", flash_attn=False),
           "f32-fa": dict(type_k="f32", type_v="f32", flash_attn=True),
           "f16": dict(type_k="f16", type_v="f16", flash_attn=False),
           "f16-fa": dict(type_k="f16", type_v="f16", flash_attn=True)}


@pytest.fixture(scope="module")
def model(tiny_model, pin_lib):
    with pk.Model(tiny_model, lib=pin_lib) as m:
        yield m


@pytest.fixture(params=list(CONFIGS))
def ctx(request, model):
    with model.context(n_ctx=256, n_seq_max=4, **CONFIGS[request.param]) as c:
        yield c


def tokens(model, n: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, model.n_vocab, n)]


def test_snapshot_then_restore_onto_a_fork_of_the_prefix_is_byte_exact(model, ctx):
    a = ctx.new_sequence()
    a.extend(tokens(model, 40))
    before = a.export_state().data
    span = a.snapshot(16)
    assert (span.start, span.end, len(span)) == (16, 40, 24) and span.tokens == tuple(a.tokens[16:])
    a_tokens = list(a.tokens)
    b = a.fork(16)                                   # shares a's cells for [0, 16)
    b.restore(span)
    assert b.tokens == a.tokens
    assert b.export_state().data == before           # K/V of every layer, byte for byte
    assert a.tokens == a_tokens and a.export_state().data == before   # a is untouched by b's restore
    nxt = tokens(model, 1, seed=1)
    la, lb = a.extend(nxt), b.extend(nxt)
    assert float(np.abs(la - lb).max()) < 1e-5
    st = ctx.kv_stats()
    assert st.used_cells == 16 + 2 * 25              # the prefix shared, each tail its own


def test_page_out_and_back_in(model, ctx):
    """What a prefix cache does with an idle tail: copy it out, free its cells, bring it back."""
    a = ctx.new_sequence()
    a.extend(tokens(model, 50, seed=2))
    before = a.export_state().data
    span = a.snapshot(20)
    a.truncate(20)
    assert ctx.kv_stats().used_cells == 20
    a.restore(span)
    assert a.export_state().data == before and len(a) == 50
    fresh = ctx.new_sequence()
    fresh.extend(a.tokens)
    # logits() recomputes the last token; the cells are byte-exact (above), but on a GPU an F16 cache
    # read from other cells sums in another order (measured 6e-3 on an H200)
    from conftest import cache_on_device

    tol = 1e-2 if cache_on_device(model) and ctx.type_k == "f16" else 1e-4
    assert float(np.abs(a.logits() - fresh.logits()).max()) < tol


def test_split_and_merge_are_inverse_and_restore_piecewise(model, ctx):
    a = ctx.new_sequence()
    a.extend(tokens(model, 30, seed=3))
    before = a.export_state().data
    whole = a.snapshot()
    head, tail = whole.split(12)
    assert (head.start, head.end, tail.start, tail.end) == (0, 12, 12, 30)
    assert head.merge(tail).data == whole.data and head.nbytes + tail.nbytes > whole.nbytes - 1
    c = ctx.new_sequence()
    c.restore(head)
    c.restore(tail)
    assert c.tokens == a.tokens and c.export_state().data == before
    with pytest.raises(pk.InvalidInputError, match="not adjacent"):
        tail.merge(head)
    with pytest.raises(pk.InvalidInputError, match="strictly inside"):
        whole.split(0)


def test_a_bad_restore_leaves_the_sequence_as_it_was(model):
    with model.context(n_ctx=64, n_seq_max=4, type_k="f32", type_v="f32") as ctx, \
            model.context(n_ctx=64, n_seq_max=2, type_k="f16", type_v="f16") as other:
        a = ctx.new_sequence()
        a.extend(tokens(model, 20, seed=4))
        span = a.snapshot(10)
        before = a.export_state().data
        for bad, err, match in ((span, pk.InvalidInputError, "goes on a sequence of 10 tokens; sequence"),
                                ("span", pk.InvalidInputError, "needs a Span"),
                                (a.snapshot(0, 5), pk.InvalidInputError, "goes on a sequence of 0 tokens")):
            with pytest.raises(err, match=match):
                a.restore(bad)
            assert a.export_state().data == before
        o = other.new_sequence()
        o.extend(a.tokens[:10])
        with pytest.raises(pk.InvalidInputError, match="other cache types"):
            o.restore(span)
        assert len(o) == 10 and other.kv_stats().used_cells == 10
        # no room: a's 20 cells, c's 14 and b's the rest (30 of 64; the current pin pads a cache to
        # 256 cells); a 10-cell span does not fit
        b = ctx.new_sequence()
        b.extend(tokens(model, ctx.n_ctx - 34, seed=5))
        c = a.fork(10)
        c.extend(tokens(model, 14, seed=6))
        with pytest.raises(pk.KVCacheFullError):
            d = a.fork(10)
            d.restore(span)
        assert a.export_state().data == before and len(d) == 10


def test_the_c_call_refuses_a_position_the_sequence_holds_and_keeps_its_cells(model):
    """llama_state_seq_add_data itself (below the Python checks): a span whose positions the
    destination holds already is refused with 0, and the destination keeps every cell."""
    with model.context(n_ctx=64, n_seq_max=2, type_k="f32", type_v="f32") as ctx:
        a = ctx.new_sequence()
        a.extend(tokens(model, 20, seed=7))
        before = a.export_state().data
        span = a.snapshot(5, 15)
        assert ctx._native.state_seq_add(span.data, a.id) == 0
        assert a.export_state().data == before and ctx.kv_stats().used_cells == 20


def test_a_span_of_another_model_is_refused(model, tmp_path):
    other = make_tiny_model(tmp_path / "other.gguf", seed=9)
    with pk.Model(other) as m2, m2.context(n_ctx=64, n_seq_max=2, type_k="f32", type_v="f32") as c2, \
            model.context(n_ctx=64, n_seq_max=2, type_k="f32", type_v="f32") as c1:
        s2 = c2.new_sequence()
        s2.extend(tokens(model, 12))
        span = s2.snapshot(4)
        s1 = c1.new_sequence()
        s1.extend(s2.tokens[:4])
        with pytest.raises(pk.InvalidInputError, match="another model"):
            s1.restore(span)


def test_the_vanilla_library_says_it_cannot_restore(tiny_model, vanilla_lib):
    with pk.Model(tiny_model, lib=vanilla_lib) as m, m.context(n_ctx=64, n_seq_max=2) as ctx:
        a = ctx.new_sequence()
        a.extend(tokens(m, 12))
        span = a.snapshot(6)
        a.truncate(6)
        with pytest.raises(pk.LibraryError, match="patch 0014"):
            a.restore(span)
        assert len(a) == 6 and ctx.kv_stats().used_cells == 6


INTERLEAVED_CODE = """
import hashlib, json, sys
import numpy as np
import pyllama_kv as pk
out = {}
with pk.Model(sys.argv[1], None if sys.argv[4] == "all" else int(sys.argv[4]), lib=sys.argv[2]) as m:
    for name, cfg in json.loads(sys.argv[3]).items():
        with m.context(n_ctx=256, n_seq_max=5, **cfg) as ctx:
            root = ctx.new_sequence()
            root.extend([(7 * i) % (m.n_vocab - 3) + 3 for i in range(9)])
            seqs = [root.fork() for _ in range(4)]
            for step in range(12):   # interleaved: each sequence's cells alternate with the others'
                ctx.decode({s: [(11 * step + 5 * k) % (m.n_vocab - 3) + 3] for k, s in enumerate(seqs)})
            a = seqs[1]   # 13 cell ranges from position 0, 12 from 4
            spans = [a.snapshot(4), a.snapshot(0), root.snapshot(0), a.snapshot(10, 15)]
            graphs = ctx._native.stats()["n_state_gather_graphs"]
            before = a.export_state().data
            a.truncate(4)
            a.restore(spans[0])
            assert a.export_state().data == before
            got = ctx.decode({s: [5 + k] for k, s in enumerate(seqs)})   # after the gathers' graphs
            out[name] = {"spans": [hashlib.sha256(bytes(s.data)).hexdigest() for s in spans], "graphs": graphs,
                         "state": hashlib.sha256(before).hexdigest(),
                         "next": hashlib.sha256(b"".join(np.asarray(got[s]).tobytes() for s in seqs)).hexdigest()}
print(json.dumps(out))
"""


def interleaved_run(tiny_model, lib: str, cfgs: dict, env: dict, ngl: str = "all") -> dict:
    """INTERLEAVED_CODE in a subprocess with ``env`` added: per context config, the hashes of four spans
    and of the whole state of a sequence whose cells interleave with three others', patch 0019's
    gather graphs, and the logits of the decode after them. The caller's own LLAMA_STATE_IO_GATHER
    settings never reach it (empty is unset for the patch)."""
    unset = dict.fromkeys(("LLAMA_STATE_IO_GATHER", "LLAMA_STATE_IO_GATHER_MAX_BYTES",
                           "LLAMA_STATE_IO_GATHER_TEST_FAIL"), "")
    r = run_py(["-c", INTERLEAVED_CODE, str(tiny_model), lib, json.dumps(cfgs), ngl], env={**unset, **env})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_windowed_state_reads_give_the_same_bytes(tiny_model, patched_lib):
    """Patch 0016's device path (windows of nearby cell ranges, 2D transfers of a transposed V),
    forced on host memory with LLAMA_STATE_IO_WINDOWS=1, writes the same bytes as the in-place path, for
    a sequence whose cells interleave with three others', with V transposed and not; each restore
    is byte-exact."""
    cfgs = {k: CONFIGS[k] for k in ("f16", "f16-fa")}
    runs = [interleaved_run(tiny_model, patched_lib, cfgs, {"LLAMA_STATE_IO_WINDOWS": forced}) for forced in ("0", "1")]
    assert runs[0] == runs[1] and len(runs[0]) == 2


def test_the_gathered_state_reads_give_the_same_bytes(tiny_model, patched_lib):
    """Patch 0019 gathers a sequence's cells on the device (get_rows graphs) before one copy per layer.
    Forced on host memory (LLAMA_STATE_IO_GATHER=1) it writes the same span bytes as the plain read,
    for F32 and F16 caches with V transposed and not, for an interleaved sequence, its prefix, a shared
    root and a middle range: in one graph per snapshot, chunked into many (a 300-byte bound), and when
    the third graph of each snapshot fails to allocate (the rest read as before). The decode after the
    gathers gives the same logits, bit for bit (no cell moved); on host memory the default reads in
    place (no graph). On a device also a model with one layer on the device and one in host memory,
    by the default rule: the device layer's cells gathered, the host layer's read in place."""
    cfgs = {k: CONFIGS[k] for k in ("f32", "f32-fa", "f16", "f16-fa")}

    with pk.Model(tiny_model, lib=patched_lib) as m:
        on_device = m.on_device
    if on_device:
        half = {name: interleaved_run(tiny_model, patched_lib, cfgs, env, ngl="1")
                for name, env in (("plain", {"LLAMA_STATE_IO_GATHER": "0"}), ("default", {}))}
        for cfg in cfgs:
            assert half["default"][cfg]["spans"] == half["plain"][cfg]["spans"], cfg
            assert half["default"][cfg]["graphs"] > 0 and half["plain"][cfg]["graphs"] == 0, cfg
    runs = {name: interleaved_run(tiny_model, patched_lib, cfgs, env) for name, env in (
        ("plain", {"LLAMA_STATE_IO_GATHER": "0"} if on_device else {}),
        ("one graph", {"LLAMA_STATE_IO_GATHER": "1"}),
        ("chunked", {"LLAMA_STATE_IO_GATHER": "1", "LLAMA_STATE_IO_GATHER_MAX_BYTES": "300"}),
        ("failing", {"LLAMA_STATE_IO_GATHER": "1", "LLAMA_STATE_IO_GATHER_MAX_BYTES": "300",
                     "LLAMA_STATE_IO_GATHER_TEST_FAIL": "2"}))}
    plain = runs["plain"]
    for name, run in runs.items():
        for cfg in cfgs:
            assert run[cfg]["spans"] == plain[cfg]["spans"], (name, cfg)
            assert run[cfg]["next"] == plain[cfg]["next"], (name, cfg)
    graphs = {name: [run[cfg]["graphs"] for cfg in cfgs] for name, run in runs.items()}
    assert graphs["plain"] == [0] * 4 and graphs["one graph"] == [4] * 4, graphs
    assert graphs["failing"] == [2 * 4] * 4, graphs   # two graphs of each of the 4 snapshots, then the reads
    assert min(graphs["chunked"]) > 4 * 3, graphs


def test_a_span_read_by_range_equals_the_span_cut_from_the_whole_state(model, ctx):
    """Patch 0017 (current/0003 on the current library) reads only the span's cells; the bytes equal
    those cut out of the whole sequence's state, for cells in position order and for cells that
    interleave with another sequence's."""
    import dataclasses

    assert ctx.caps.span_range_read
    a = ctx.new_sequence()
    a.extend(tokens(model, 20, seed=5))
    b = a.fork(12)
    for k in range(6):   # a's and b's new cells alternate
        ctx.decode({a: [3 + k], b: [9 + k]})
    whole = dataclasses.replace(ctx.caps, span_range_read=False)
    for seq, start in ((a, 0), (a, 12), (a, 20), (b, 12), (b, 15)):
        by_range = seq.snapshot(start)
        ranged_caps, ctx.caps = ctx.caps, whole
        try:
            cut = seq.snapshot(start)
        finally:
            ctx.caps = ranged_caps
        assert (by_range.start, by_range.tokens) == (cut.start, cut.tokens)
        assert bytes(by_range.data) == bytes(cut.data) and by_range.layout == cut.layout
    # and such a span goes back exactly
    before = b.export_state().data
    span = b.snapshot(13)
    b.truncate(13)
    b.restore(span)
    assert b.export_state().data == before


def test_a_range_whose_cells_are_out_of_position_order_is_put_in_order(model, ctx):
    """A sequence's later positions in lower cells (a batch placed in cells freed before it): the range
    read gives its cells in cache order, and the span holds them in position order, byte-equal to the
    span cut out of the whole state."""
    import dataclasses

    from pyllama_kv.core import state as _state

    spacer = ctx.new_sequence()
    spacer.extend(tokens(model, 24, seed=7))
    a = ctx.new_sequence()
    a.extend(tokens(model, 40, seed=8))
    spacer.close()                      # the lowest cells are free again
    a.extend(tokens(model, 8, seed=9))  # so positions 40..47 go below 0..39
    raw = ctx._native.state_seq_range_read(a.id, 30, 48)
    assert raw is not None
    _, order = _state.position_order(raw, 18, a.id, ctx.n_ctx, first=30)
    assert not np.array_equal(order, np.arange(order.size)), "the cells came in position order: nothing tested"
    by_range = a.snapshot(30)
    whole = dataclasses.replace(ctx.caps, span_range_read=False)
    ranged_caps, ctx.caps = ctx.caps, whole
    try:
        cut = a.snapshot(30)
    finally:
        ctx.caps = ranged_caps
    assert bytes(by_range.data) == bytes(cut.data) and by_range.tokens == cut.tokens
