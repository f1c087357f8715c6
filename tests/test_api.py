"""The public API: models, contexts, sequences, errors, atomicity, sharing, threads, prefix cache."""
from __future__ import annotations

import json
import shutil
import threading

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import F32, held_positions, run_py, toks, write_unknown_arch_model

F32_ATOL = 1e-4  # f32 cache, no flash attention: observed differences are ~5e-6 (summation order)


@pytest.fixture(scope="module")
def model(tiny_model, pin_lib):
    m = pk.Model(tiny_model, lib=pin_lib)
    yield m
    m.close()


@pytest.fixture
def ctx(model):
    with model.context(n_ctx=256, n_seq_max=6, n_batch=64, n_ubatch=64, **F32) as c:
        yield c


@pytest.fixture(scope="module")
def ref(model):
    """A reference context: each call evaluates a token list from position 0 in a cleared cache."""
    c = model.context(n_ctx=256, n_seq_max=1, n_batch=64, n_ubatch=64, **F32)

    def logits(tokens):
        c.clear()
        s = c.sequences[0] if c.sequences else c.new_sequence()
        return s.extend(tokens)

    yield logits
    c.close()


def snapshot(ctx):
    """The sequences and their cells: in cache order where the library has a cell view, else the
    positions each sequence holds (the current pin)."""
    if not ctx.caps.cell_view:
        return {s.id: s.tokens for s in ctx.sequences}, held_positions(ctx), ctx.kv_stats().used_cells
    return ({s.id: s.tokens for s in ctx.sequences}, ctx.kv_view()[0].tolist(), ctx.kv_view()[1].tolist())


def mission_only(model, what: str) -> None:
    """Skip on a library without explicit defrag, slot retries and a cell view (the current pin)."""
    if not model.native_library.caps.defrag:
        pytest.skip(f"{what}: the mission pin's (the current llama.cpp has no defrag, writes batches into "
                    "scattered cells and has no cell view)")


# -- library and model ---------------------------------------------------------------------------


def test_library_info(patched_lib):
    from conftest import DEVICE_RUN

    if DEVICE_RUN:
        pytest.skip("device run: scripts/gpu_check.sh builds with CMake directly, so no build manifest says "
                    "the library's backend and revision")
    info = pk.library_info()
    assert info["path"] == patched_lib
    assert info["variant"] == "patched" and info["backend"] == "cpu"
    assert info["revision"].startswith("8733e0c")
    from pyllama_kv.harness import patch as P

    assert info["patches"] == [p.name for p in P.series()] and info["has_stats"]


def test_env_override_selects_the_vanilla_library(vanilla_lib):
    code = ("import json, pyllama_kv as pk; i = pk.library_info(); "
            "print(json.dumps([i['path'], i['variant'], i['has_stats']]))")
    r = run_py(["-c", code], env={"PYLLAMA_KV_LIB": vanilla_lib})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [vanilla_lib, "vanilla", False]


def test_library_order_bundled_then_env_and_origin_says_which(tmp_path, monkeypatch, patched_lib, vanilla_lib):
    """A library inside the package (pip install) comes before the builds; $PYLLAMA_KV_LIB and a lib
    argument come before it; library_info()["origin"] names the one used."""
    from pyllama_kv import _paths
    from pyllama_kv._native import locate

    assert locate.resolve()[1]["origin"] == "build"              # this checkout: no library in the package
    pkg = tmp_path / "lib"
    pkg.mkdir()
    shutil.copy2(patched_lib, pkg / locate.lib_name())
    (pkg / "build-info.json").write_text(json.dumps({"variant": "patched", "revision": "8733e0c", "backend": "cpu",
                                                     "patches": [{"name": "0001-x.patch", "sha256": "0"}]}))
    monkeypatch.setattr(_paths, "PACKAGE_LIB", pkg)
    monkeypatch.delenv("PYLLAMA_KV_LIB", raising=False)
    path, info = locate.resolve()
    assert path == (pkg / locate.lib_name()).resolve() and info["origin"] == "package"
    assert info["variant"] == "patched" and info["patches"] == ["0001-x.patch"]
    assert locate.resolve("patched")[1]["origin"] == "package"
    assert locate.resolve("vanilla")[1]["origin"] == "build"      # never bundled
    monkeypatch.setenv("PYLLAMA_KV_LIB", vanilla_lib)
    path, info = locate.resolve()
    assert str(path) == vanilla_lib and info["origin"] == "PYLLAMA_KV_LIB" and info["variant"] == "vanilla"
    path, info = locate.resolve(pkg / locate.lib_name())
    assert info["origin"] == "argument" and info["variant"] == "patched" and info["patches"] == ["0001-x.patch"]


def test_a_folder_with_patches_and_vendor_is_not_taken_for_a_checkout(tmp_path, monkeypatch):
    """An installed package run from a folder that merely holds patches/ and vendor/ keeps its own data;
    the folder counts as a checkout only with our pin and package in it too."""
    from pyllama_kv import _paths

    monkeypatch.delenv("PYLLAMA_KV_ROOT", raising=False)
    monkeypatch.setattr(_paths, "PACKAGE_DIR", tmp_path / "site-packages" / "pyllama_kv")  # as if installed
    other = tmp_path / "other"
    (other / "patches").mkdir(parents=True)
    (other / "vendor").mkdir()
    monkeypatch.chdir(other)
    assert _paths.checkout_root() is None
    (other / "vendor" / "llama.cpp.pin.json").write_text("{}")
    assert _paths.checkout_root() is None                  # the pin without our package
    (other / "vendor" / "llama.cpp.pin.json").unlink()
    (other / "pyllama_kv").mkdir()
    (other / "pyllama_kv" / "__init__.py").write_text("")
    assert _paths.checkout_root() is None                  # our package without the pin
    (other / "vendor" / "llama.cpp.pin.json").write_text("{}")
    assert _paths.checkout_root() == other


def test_missing_library_is_a_clear_error(tmp_path, tiny_model):
    with pytest.raises(pk.LibraryError, match="does not exist"):
        pk.Model(tiny_model, lib=tmp_path / "nope.so")


def test_model_properties_and_tokens(model):
    assert model.n_vocab > 256 + 3 and model.n_layer == 2 and model.n_ctx_train == 4096
    assert model.n_embd == 64 and model.n_head == 4 and model.n_head_kv == 2
    t = model.tokenize("the cache of a model")
    assert t[0] == model.bos
    assert model.detokenize(t).strip() == "the cache of a model"
    assert model.tokenize("x", add_bos=False)[0] != model.bos
    # any text tokenizes thanks to the byte tokens
    assert model.detokenize(model.tokenize("héllo ☃", add_bos=False)).strip() == "héllo ☃"
    assert len(t) == 6, "whole words of the tiny vocabulary are single tokens"
    assert model.token_to_piece(t[1]) == b" the"
    assert model.is_eog(model.eos)
    with pytest.raises(pk.InvalidInputError):
        model.detokenize([model.n_vocab])
    with pytest.raises(pk.InvalidInputError):
        model.token_to_piece(-1)


def test_token_pieces_and_ends_are_kept_and_still_checked(tiny_model):
    """token_to_piece and is_eog keep what they read (an engine streams and checks every token it
    draws): the same answers again, the special form apart, bad ids and a closed model refused as
    before."""
    with pk.Model(tiny_model) as m:
        t = m.tokenize("the cache", add_bos=False)[0]
        first = m.token_to_piece(t)
        assert m.token_to_piece(t) == first == b" the" and m._pieces[t] == first
        assert m.token_to_piece(m.eos, special=True) != m.token_to_piece(m.eos) == b""
        for _ in range(2):
            assert m.is_eog(m.eos) is True and m.is_eog(t) is False
        assert m._eog == {m.eos: True, t: False}
        for bad in (True, -1, m.n_vocab, 1.0):
            with pytest.raises(pk.InvalidInputError):
                m.token_to_piece(bad)
            with pytest.raises(pk.InvalidInputError):
                m.is_eog(bad)
    with pytest.raises(pk.InvalidInputError, match="closed"):
        m.token_to_piece(t)
    with pytest.raises(pk.InvalidInputError, match="closed"):
        m.is_eog(m.eos)


def test_model_load_errors(tmp_path, tiny_model):
    with pytest.raises(pk.ModelLoadError, match="no such file"):
        pk.Model(tmp_path / "missing.gguf")
    p = tmp_path / "text.gguf"
    p.write_text("not a model at all")
    with pytest.raises(pk.ModelLoadError, match="not a GGUF file"):
        pk.Model(p)
    data = tiny_model.read_bytes()
    for cut in (100, len(data) // 2, len(data) - 10):
        t = tmp_path / f"trunc{cut}.gguf"
        t.write_bytes(data[:cut])
        with pytest.raises(pk.ModelLoadError, match="truncated|corrupt|could not load"):
            pk.Model(t)
    u = write_unknown_arch_model(tmp_path / "unknown.gguf")
    with pytest.raises(pk.ModelLoadError, match="nosucharch"):
        pk.Model(u)


def test_context_parameter_errors(model):
    with pytest.raises(pk.InvalidInputError, match="n_ctx_train"):
        model.context(n_ctx=model.n_ctx_train * 2)
    with model.context(n_ctx=256, n_batch=32, n_ubatch=64) as c:   # the graph within the batch, as llama.cpp
        assert c.n_ubatch == 32 <= c.n_batch
    with pytest.raises(pk.InvalidInputError, match="n_ubatch"):
        model.context(n_ctx=256, n_ubatch=0)
    with pytest.raises(pk.InvalidInputError, match="flash_attn"):
        model.context(n_ctx=256, type_v="q8_0", flash_attn=False)
    with pytest.raises(pk.InvalidInputError, match="KV cache type"):
        model.context(n_ctx=256, type_k="f8")
    with pytest.raises(pk.InvalidInputError):
        model.context(n_ctx=0)


# -- sequences ------------------------------------------------------------------------------------


def test_extend_matches_a_fresh_evaluation(ctx, ref):
    a = ctx.new_sequence()
    la = a.extend(toks(20))
    assert la.dtype == np.float32 and la.shape == (ctx.model.n_vocab,)
    assert a.tokens == toks(20) and len(a) == 20
    np.testing.assert_allclose(la, ref(toks(20)), atol=F32_ATOL)
    la2 = a.extend(toks(5, seed=1))
    np.testing.assert_allclose(la2, ref(toks(20) + toks(5, seed=1)), atol=F32_ATOL)


def test_the_model_is_sensitive_to_context(ref):
    """The oracle can only catch a corrupted cell if the logits depend on the context."""
    a, b = toks(20), toks(20)
    b[2] = (b[2] + 1) % 600 + 3
    assert np.abs(ref(a) - ref(b)).max() > 0.05


def test_batched_decode_of_many_sequences(ctx, ref):
    seqs = [ctx.new_sequence() for _ in range(4)]
    out = ctx.decode({s: toks(5 + i, seed=i) for i, s in enumerate(seqs)})
    assert set(out) == set(seqs)
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(out[s], ref(toks(5 + i, seed=i)), atol=F32_ATOL)
    # more than n_batch (64) tokens in one call: split internally, same result
    out = ctx.decode({seqs[0]: toks(50, seed=9), seqs[1]: toks(40, seed=8)})
    np.testing.assert_allclose(out[seqs[0]], ref(toks(5, seed=0) + toks(50, seed=9)), atol=F32_ATOL)


def test_fork_shares_cells_without_recompute(ctx, ref):
    a = ctx.new_sequence()
    a.extend(toks(30))
    used = ctx.kv_stats().used_cells
    b = a.fork(12)
    assert ctx.kv_stats().used_cells == used, "a fork must not use new cells"
    assert b.tokens == toks(30)[:12]
    assert ((ctx.cell_holders() >= 0).sum(axis=1) > 1).sum() == 12  # shared cells
    lb = b.extend(toks(4, seed=5))
    np.testing.assert_allclose(lb, ref(toks(30)[:12] + toks(4, seed=5)), atol=F32_ATOL)
    c = a.fork()
    assert ctx.kv_stats().used_cells == used + 4, "a fork must not use new cells"
    # re-evaluate c's last token over the cells it shares with a: what the fork really holds
    np.testing.assert_allclose(c.logits(recompute=True), ref(toks(30)), atol=F32_ATOL)


def test_siblings_are_unaffected_by_remove_truncate_and_shift(ctx, ref, one_layer_model):
    a = ctx.new_sequence()
    a.extend(toks(30))
    b = a.fork(20)
    b.extend(toks(5, seed=3))
    want_b = ref(b.tokens)
    a.remove(3, 10)            # shifts a's tail, which shares cells [10, 20) with b: copy-on-write
    np.testing.assert_allclose(b.logits(recompute=True), want_b, atol=F32_ATOL)
    a.truncate(2)
    np.testing.assert_allclose(b.logits(recompute=True), want_b, atol=F32_ATOL)
    a.close()
    np.testing.assert_allclose(b.logits(recompute=True), want_b, atol=F32_ATOL)
    c = b.fork()
    c.shift_out(4, 6)
    np.testing.assert_allclose(b.logits(recompute=True), want_b, atol=F32_ATOL)
    assert c.tokens == b.tokens[:4] + b.tokens[10:]


def test_remove_recompute_is_exact_in_any_model(ctx, ref):
    a = ctx.new_sequence()
    a.extend(toks(30))
    a.remove(5, 9, recompute=True)
    assert a.tokens == toks(30)[:5] + toks(30)[9:]
    np.testing.assert_allclose(a.logits(recompute=True), ref(a.tokens), atol=F32_ATOL)


def test_kshift_remove_is_exact_in_a_one_layer_model(one_layer_model):
    with pk.Model(one_layer_model) as m:
        kw = dict(n_ctx=256, n_batch=64, n_ubatch=64, **F32)
        with m.context(n_seq_max=2, **kw) as c, m.context(n_seq_max=1, **kw) as r:
            a = c.new_sequence()
            a.extend(toks(40))
            used = c.kv_stats().used_cells
            a.remove(5, 15)       # K-shift: no decode, cells freed
            assert c.kv_stats().used_cells == used - 10
            a.shift_out(2, 3)
            s = r.new_sequence()
            np.testing.assert_allclose(a.logits(recompute=True), s.extend(a.tokens), atol=F32_ATOL)


def test_shift_out_refused_when_the_model_cannot_shift(ctx):
    a = ctx.new_sequence()
    a.extend(toks(10))
    ctx.can_shift = False
    with pytest.raises(pk.LlamaError, match="cannot shift"):
        a.shift_out(2, 3)
    assert a.tokens == toks(10)


def test_sequence_ids_run_out_and_come_back(ctx):
    seqs = [ctx.new_sequence() for _ in range(ctx.n_seq_max)]
    with pytest.raises(pk.LlamaError, match="in use"):
        ctx.new_sequence()
    seqs[3].close()
    s = ctx.new_sequence()
    assert s.id == 3 and len(s) == 0


# -- bad input: a clear exception, the process alive, nothing changed ----------------------------


def test_bad_inputs_raise_and_change_nothing(model, ctx):
    a = ctx.new_sequence()
    a.extend(toks(10))
    b = a.fork(4)
    other = model.context(n_ctx=64, n_seq_max=1)
    foreign = other.new_sequence()
    closed = ctx.new_sequence()
    closed.close()
    before = snapshot(ctx)
    bad = [
        (lambda: a.extend([model.n_vocab]), pk.InvalidInputError),
        (lambda: a.extend([-1]), pk.InvalidInputError),
        (lambda: a.extend([]), pk.InvalidInputError),
        (lambda: a.extend(["x"]), pk.InvalidInputError),
        (lambda: a.extend([1.5]), pk.InvalidInputError),
        (lambda: ctx.decode({}), pk.InvalidInputError),
        (lambda: ctx.decode({a: [5], b: [model.n_vocab + 7]}), pk.InvalidInputError),
        (lambda: ctx.decode({foreign: [5]}), pk.InvalidInputError),
        (lambda: ctx.decode({closed: [5]}), pk.InvalidInputError),
        (lambda: closed.extend([5]), pk.InvalidInputError),
        (lambda: a.fork(11), pk.InvalidInputError),
        (lambda: a.fork(-1), pk.InvalidInputError),
        (lambda: a.remove(5, 3), pk.InvalidInputError),
        (lambda: a.remove(0, 11), pk.InvalidInputError),
        (lambda: a.truncate(20), pk.InvalidInputError),
        (lambda: a.shift_out(8, 5), pk.InvalidInputError),
        (lambda: a.remove("1", 2), pk.InvalidInputError),
        (lambda: a.extend(toks(300)), pk.KVCacheFullError),
        (lambda: ctx.new_sequence().logits(), pk.InvalidInputError),
    ]
    for fn, exc in bad:
        with pytest.raises(exc):
            fn()
        # new_sequence() in the last case takes an id; everything else must be untouched
        now = snapshot(ctx)
        assert {k: v for k, v in now[0].items() if v} == {k: v for k, v in before[0].items() if v}
        assert now[1:] == before[1:]
    other.close()
    assert a.tokens == toks(10)


def test_vanilla_out_of_range_token_never_reaches_c(tiny_model, vanilla_lib):
    """On vanilla, such a token kills the process in C (tests/test_reproducers.py). The wrapper must
    refuse it in Python: the subprocess survives and reports the exception."""
    code = f"""
import pyllama_kv as pk
m = pk.Model({str(tiny_model)!r}, lib={vanilla_lib!r})
assert not m.library["has_stats"]
c = m.context(n_ctx=64, n_seq_max=1)
s = c.new_sequence()
s.extend([5, 6])
try:
    s.extend([m.n_vocab])
except pk.InvalidInputError as e:
    print("refused:", e)
print("alive", s.tokens)
"""
    r = run_py(["-c", code])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "refused:" in r.stdout and "alive [5, 6]" in r.stdout


# -- atomicity ------------------------------------------------------------------------------------


def test_aborted_decode_leaves_every_sequence_as_before(ctx):
    a, b = ctx.new_sequence(), ctx.new_sequence()
    a.extend(toks(10))
    b.extend(toks(6, seed=2))
    before = snapshot(ctx)
    ctx.abort_callback = lambda: True
    with pytest.raises(pk.DecodeError, match="abort"):
        ctx.decode({a: toks(3, seed=4), b: toks(4, seed=5)})
    ctx.abort_callback = None
    assert snapshot(ctx) == before
    a.extend([7])  # still usable


def test_failure_in_a_later_chunk_rolls_back_the_earlier_ones(ctx):
    a = ctx.new_sequence()
    a.extend(toks(4))
    calls = []

    def count():
        calls.append(1)
        return False

    ctx.abort_callback = count
    b = ctx.new_sequence()
    b.extend(toks(60, seed=1))       # one chunk of 60 tokens
    per_chunk = len(calls)
    b.close()
    assert per_chunk > 0
    calls.clear()
    ctx.abort_callback = lambda: (calls.append(1) or len(calls) > per_chunk)
    before = snapshot(ctx)
    with pytest.raises(pk.DecodeError):
        a.extend(toks(120, seed=3))  # two chunks of n_batch=64: the second is aborted
    ctx.abort_callback = None
    assert len(calls) > per_chunk
    assert snapshot(ctx) == before
    assert ctx.kv_stats().used_cells == 4


def test_cache_full_leaves_state_and_names_the_numbers(model):
    with model.context(n_ctx=64, n_seq_max=2, n_batch=64, n_ubatch=64) as c:
        a = c.new_sequence()
        a.extend(toks(c.n_ctx - 14))   # 14 cells left (the current pin pads 64 cells to 256)
        b = c.new_sequence()
        before = snapshot(c)
        with pytest.raises(pk.KVCacheFullError, match=f"14 of {c.n_ctx}"):
            b.extend(toks(20))
        assert snapshot(c) == before


# -- fragmentation through the API ----------------------------------------------------------------


def _fragment(c):
    seqs = [c.new_sequence() for _ in range(32)]
    c.decode({s: toks(8, seed=i) for i, s in enumerate(seqs)})
    for s in seqs[::2]:
        s.close()
    return seqs[1::2]


def test_fragmentation_vanilla_raises_patched_retries(tiny_model, vanilla_lib):
    kw = dict(n_ctx=256, n_seq_max=40, n_batch=256, n_ubatch=256)
    results = {}
    for lib in ("vanilla", "patched"):
        with pk.Model(tiny_model, lib=lib) as m, m.context(**kw) as c:
            live = _fragment(c)
            st = c.kv_stats()
            assert st.free_cells == 128 and st.largest_free_block == 8 and st.holes == 16
            before = snapshot(c)
            s = c.new_sequence()
            try:
                s.extend(toks(16, seed=99))
                results[lib] = ("ok", c.kv_stats())
            except pk.KVCacheFullError as e:
                assert "128 of 256 cells free" in str(e)
                assert snapshot(c)[1:] == before[1:] and len(s) == 0
                results[lib] = ("full", c.kv_stats())
            for x in live:  # the others survived either way
                assert len(x) == 8
    assert results["vanilla"][0] == "full" and results["vanilla"][1].slot_retries is None
    status, st = results["patched"]
    assert status == "ok" and st.slot_retries == 1 and st.slot_failures == 0 and st.defrags == 1
    assert st.holes == 0 and st.used_cells == 144


@pytest.mark.parametrize("graph", [False, True], ids=["memcpy", "graph"])
def test_explicit_defrag_packs_and_counts(model, ctx, ref, graph, monkeypatch):
    """Both execution paths of the patched defrag: memcpy for a host cache (0006), ggml graphs
    otherwise (forced here with LLAMA_KV_DEFRAG_GRAPH=1; always for a cache on a GPU)."""
    mission_only(model, "explicit defrag packs and counts")
    from conftest import cache_on_device

    graph = graph or cache_on_device(model)
    if graph:
        monkeypatch.setenv("LLAMA_KV_DEFRAG_GRAPH", "1")
    seqs = [ctx.new_sequence() for _ in range(6)]
    ctx.decode({s: toks(10, seed=i) for i, s in enumerate(seqs)})
    seqs[0].close()
    seqs[2].close()
    seqs[4].truncate(3)
    assert ctx.kv_stats().holes > 0
    st = ctx.defrag()
    assert st.holes == 0 and st.defrags == 1 and st.moves > 0 and st.graphs == (1 if graph else 0)
    assert st.largest_free_block == st.free_cells and st.defrag_seconds > 0
    for s in (seqs[1], seqs[3], seqs[4], seqs[5]):
        np.testing.assert_allclose(s.logits(recompute=True), ref(s.tokens), atol=F32_ATOL)


def test_automatic_defrag_is_refused_on_vanilla(tiny_model, vanilla_lib):
    with pk.Model(tiny_model, lib="vanilla") as m:
        with pytest.raises(pk.InvalidInputError, match="vanilla"):
            m.context(n_ctx=256, defrag_thold=0.1)


def test_automatic_defrag_on_patched(model):
    """llama.cpp's own threshold-driven defrag (defrag_thold) runs inside decode: safe when patched."""
    mission_only(model, "automatic defrag on patched")
    # llama.cpp only considers windows of >= 2048 cells, and defragments at the decode after the one
    # that measured the fragmentation
    with model.context(n_ctx=4096, n_seq_max=4, n_batch=64, n_ubatch=64, **F32,
                       defrag_thold=0.1) as c:
        seqs = [c.new_sequence() for _ in range(4)]
        for k in range(14):
            c.decode({s: toks(40, seed=10 * k + i) for i, s in enumerate(seqs)})
        seqs[0].close()
        seqs[2].close()
        seqs[1].extend([5])
        seqs[1].extend([6])
        st = c.kv_stats()
        assert st.defrags >= 1 and st.holes == 0
        got = seqs[3].logits(recompute=True)
    with model.context(n_ctx=1024, n_seq_max=1, n_batch=64, n_ubatch=64, **F32) as r:
        np.testing.assert_allclose(got, r.new_sequence().extend(seqs[3].tokens), atol=F32_ATOL)


def test_vanilla_defrag_is_refused_when_it_would_abort(tiny_model, vanilla_lib):
    with pk.Model(tiny_model, lib="vanilla") as m, m.context(n_ctx=256, n_seq_max=2, n_batch=256, n_ubatch=128) as c:
        a, b = c.new_sequence(), c.new_sequence()
        a.extend(toks(40))
        b.extend(toks(60))
        a.close()                      # 40 free cells before b's 60: safe to pack (60 + 128 <= 256)
        st = c.defrag()
        assert st.holes == 0 and st.defrags is None
        a = c.new_sequence()
        a.extend(toks(40))
        b.extend(toks(100))            # b ends at cell 200 > 256 - 128
        a.close()
        before = snapshot(c)
        with pytest.raises(pk.LlamaError, match="would abort"):
            c.defrag()
        assert snapshot(c) == before


# -- kv maps --------------------------------------------------------------------------------------


def test_kv_cells_and_view(ctx):
    mission_only(ctx.model, "the cell view")
    a, b = ctx.new_sequence(), ctx.new_sequence()
    a.extend(toks(5))
    b.extend(toks(3))
    c = a.fork(2)
    occ = ctx.kv_cells()
    assert occ.shape == (ctx.n_ctx,) and occ.dtype == np.int32
    assert (occ == -2).sum() == 2 and (occ == a.id).sum() == 3 and (occ == b.id).sum() == 3
    assert (occ == -1).sum() == ctx.n_ctx - 8
    pos, seqs = ctx.kv_view()
    assert seqs.shape == (ctx.n_ctx, ctx.n_seq_max)
    assert sorted(pos[(seqs == c.id).any(axis=1)].tolist()) == [0, 1]


# -- threads --------------------------------------------------------------------------------------


def test_one_context_from_several_threads(model, ref):
    with model.context(n_ctx=512, n_seq_max=8, n_batch=64, n_ubatch=64, **F32) as c:
        seqs = [c.new_sequence() for _ in range(4)]
        errors = []

        def work(i):
            try:
                for k in range(6):
                    seqs[i].extend(toks(3, seed=100 * i + k))
                    if k == 3:
                        f = seqs[i].fork(2)
                        f.close()
            except Exception as e:  # pragma: no cover
                errors.append(e)

        ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors
        for i, s in enumerate(seqs):
            want = sum((toks(3, seed=100 * i + k) for k in range(6)), [])
            assert s.tokens == want
            np.testing.assert_allclose(s.logits(recompute=True), ref(want), atol=F32_ATOL)


# -- prefix cache ---------------------------------------------------------------------------------


def test_prefix_cache_reuses_the_longest_prefix(model, ref):
    with model.context(n_ctx=512, n_seq_max=8, n_batch=64, n_ubatch=64, **F32) as c:
        pc = pk.PrefixCache(c, max_sequences=3)
        prefix = toks(40)
        r1 = pc.acquire(prefix + toks(5, seed=1))
        assert r1.reused_tokens == 0
        r2 = pc.acquire(prefix + toks(6, seed=2))
        assert r2.reused_tokens == 40 and pc.last_reused_tokens == 40
        with pytest.warns(DeprecationWarning):   # the old names still read, with a warning
            assert r2.prefix_reused == 40 and pc.last_reused == 40
        np.testing.assert_allclose(r2.logits(), ref(prefix + toks(6, seed=2)), atol=F32_ATOL)
        r3 = pc.acquire(prefix[:20])
        assert r3.reused_tokens == 19  # the last token is always evaluated
        np.testing.assert_allclose(r3.logits(), ref(prefix[:20]), atol=F32_ATOL)
        assert pc.stats.requests == 3 and pc.stats.reused_tokens == 59
        assert pc.stats.evaluated_tokens == 45 + 6 + 1
        for r in (r1, r2, r3):
            pc.release(r)
        assert len(pc) <= 3
        # LRU eviction frees ids when they run out
        held = [pc.acquire(toks(10, seed=50 + i)) for i in range(6)]
        assert pc.stats.evictions > 0
        for h in held:
            h.close()
        pc.clear()
        assert len(pc) == 0


def test_export_and_import_a_sequence(model, ctx, ref):
    a = ctx.new_sequence()
    a.extend(toks(25))
    a.remove(3, 6)  # a pending K-shift must be applied before the cells are copied
    state = a.export_state()
    assert state.tokens == a.tokens and len(state.data) > 0
    with model.context(n_ctx=256, n_seq_max=2, n_batch=64, n_ubatch=64, **F32) as other:
        b = other.import_sequence(state)
        assert b.tokens == a.tokens
        np.testing.assert_allclose(b.logits(), a.logits(), atol=F32_ATOL)
        used = other.kv_stats().used_cells
        with pytest.raises(pk.InvalidInputError):
            other.import_sequence(b"junk")
        with model.context(n_ctx=16, n_seq_max=1, flash_attn=False) as small:
            with pytest.raises(pk.InvalidInputError, match="K type"):  # an f16 cache: refused before C
                small.import_sequence(state)
            assert small.kv_stats().used_cells == 0 and small.free_sequence_ids == 1
        assert other.kv_stats().used_cells == used


def test_llama_log_goes_to_python_logging(tiny_model, caplog):
    import logging

    with caplog.at_level(logging.DEBUG, logger="pyllama_kv.llama"):
        with pk.Model(tiny_model) as m, m.context(n_ctx=64, n_seq_max=1):
            pass
    recs = [r for r in caplog.records if r.name == "pyllama_kv.llama"]
    assert recs and any("llama_context" in r.getMessage() or "llama_model" in r.getMessage() for r in recs)
    assert all(not r.getMessage().endswith("\n") for r in recs)


def _cells_by_sequence(c):
    """{seq id: sorted positions}: what each sequence holds, independent of where the cells are."""
    pos, seqs = c.kv_view()
    out = {}
    for p, row in zip(pos.tolist(), seqs.tolist()):
        for s in row:
            if s >= 0:
                out.setdefault(s, []).append(p)
    return {k: sorted(v) for k, v in out.items()}


def test_api_rollback_removes_a_batch_aborted_after_a_mid_batch_retry(model, ref):
    """The API's rollback (Context.decode), on the hardest path: a batch of 72 tokens is two
    llama_decode calls (n_batch 64). In the first, the first micro-batch lands in a hole above the
    used cells, the second finds no slot, and the retry's defrag moves the first one; that call
    completes, so llama.cpp commits its 64 cells. The second call is aborted: llama.cpp restores only
    that call's cells, and the 64 committed ones, wherever the defrag put them, must be removed by the
    API (llama_kv_self_seq_rm from the sequence's first new position), leaving every other sequence
    exactly as it was.

    llama.cpp's own restore of cells that a defrag moved *within* one aborted call (patch 0002's
    remap) plays no part here; it is tested without the API in
    tests/test_reproducers.py::test_abort_after_a_mid_batch_retry_removes_every_moved_cell."""
    mission_only(model, "api rollback removes a batch aborted after a mid batch retry")
    with model.context(n_ctx=256, n_seq_max=80, n_batch=64, n_ubatch=8, **F32) as c:
        seqs = [c.new_sequence() for _ in range(64)]
        c.decode({s: toks(4, seed=i) for i, s in enumerate(seqs)})          # 256 cells, 4 per sequence
        # 4-cell holes, and one 8-cell hole at the very end: the first micro-batch lands there, above
        # the used cells, so the defrag of the retry moves it
        for s in seqs[0:62:2] + seqs[62:]:
            s.close()
        live = [s for s in seqs if not s.closed]
        st = c.kv_stats()
        assert st.largest_free_block == 8 and st.free_cells == 8 + 4 * 31
        before = _cells_by_sequence(c)

        calls = []
        x = c.new_sequence()
        c.abort_callback = lambda: calls.append(1) and False
        probe = c.new_sequence()
        probe.extend(toks(8, seed=500))   # calibrate: polls of one 8-token micro-batch
        per_ubatch = len(calls)
        probe.close()
        assert per_ubatch > 0 and c.kv_stats().largest_free_block == 8
        calls.clear()
        c.abort_callback = lambda: (calls.append(1) or len(calls) > 8 * per_ubatch)
        with pytest.raises(pk.DecodeError):
            x.extend(toks(72, seed=501))  # llama_decode of 64 tokens (8 micro-batches), then of 8
        c.abort_callback = None
        assert len(calls) == 8 * per_ubatch + 1, "the abort must come in the second llama_decode call"
        st = c.kv_stats()
        assert st.slot_retries == 1 and st.defrags == 1, st
        assert len(x) == 0
        assert _cells_by_sequence(c) == before, "the first call's cells (moved by the defrag) were not all removed"
        for s in live[:5]:
            np.testing.assert_allclose(s.logits(recompute=True), ref(s.tokens), atol=F32_ATOL)


def test_sampler_top_k_prefilter_draws_what_the_full_chain_draws(model, ctx):
    """Sampler passes the chain only the top_k largest logits; with distinct logits the seeded draws are
    exactly those of the chain over all n_vocab candidates (top-k then keeps the same tokens)."""
    from pyllama_kv._native import sampler as native_sampler

    rng = np.random.default_rng(0)
    for top_k in (1, 5, 40):
        smp = pk.Sampler(ctx, temp=0.9, top_k=top_k, top_p=0.9, min_p=0.02, seed=7)
        full = native_sampler.NativeSampler(model._lib, model.n_vocab)
        full.add_top_k(top_k)
        full.add_top_p(0.9, 1)
        full.add_min_p(0.02, 1)
        full.add_temp(0.9)
        full.add_dist(7)
        try:
            for _ in range(200):
                logits = (rng.standard_normal(model.n_vocab) * 3).astype(np.float32)
                want = full.apply(logits)          # every candidate
                full.accept(want)
                assert smp.sample_logits(logits) == want
        finally:
            full.free()
            smp.close()


def test_every_seed_is_reproducible_including_llama_cpps_random_marker(ctx):
    """llama.cpp takes seed 0xFFFFFFFF as "random"; pk.Sampler gives it a fixed stream like any seed."""
    rng = np.random.default_rng(1)
    logits = [(rng.standard_normal(ctx.model.n_vocab) * 0.5).astype(np.float32) for _ in range(40)]

    def draws(seed):
        with pk.Sampler(ctx, temp=1.5, top_k=0, top_p=1.0, seed=seed) as smp:
            return [smp.sample_logits(x) for x in logits]

    for seed in (0xFFFFFFFF, -1, 7):
        assert draws(seed) == draws(seed), seed


def test_the_package_root_holds_the_shared_modules_and_no_old_paths():
    """The flat modules of before the folders (issue 31) are gone (issue 46: no release carried them):
    an old path is a ModuleNotFoundError, and the root holds only the modules every layer shares."""
    import importlib

    from conftest import ROOT

    for old in ("context", "model", "sequence", "span", "state", "prefix", "tier", "spanfile", "penalties",
                "constrain", "conversation", "toolcall", "gguf", "vetting", "catalogue", "tools.gguf_check",
                "engine.tier", "_moved"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"pyllama_kv.{old}")
    root = sorted(p.stem for p in (ROOT / "pyllama_kv").glob("*.py"))
    assert root == ["__init__", "_paths", "_worker", "config", "errors", "limits"], root
    # the two names that became packages keep their functions
    from pyllama_kv.chat import apply_chat_template, chat_template  # noqa: F401
    from pyllama_kv.sampling import Sampler
    assert Sampler is pk.Sampler


def test_default_gpu_layers_follow_the_library(tiny_model):
    """n_gpu_layers=None means every layer on a library that finds a GPU, none on a CPU build; the
    library names its GPUs (none here unless the suite runs on a GPU build, scripts/gpu_check.sh)."""
    with pk.Model(tiny_model) as m:
        gpus = m._lib.gpu_devices()
        assert all(isinstance(g, str) and g for g in gpus)
        assert m.n_gpu_layers == (-1 if gpus else 0)
    with pk.Model(tiny_model, 0) as m:
        assert m.n_gpu_layers == 0
    with pytest.raises(pk.InvalidInputError, match="n_gpu_layers"):
        pk.Model(tiny_model, -2)
