"""The three defrag paths of the patched build leave the same bytes in every used cell (patches 0006, 0011).

LLAMA_KV_DEFRAG_GRAPH (read by llama.cpp at every defrag) picks the path:

* unset: ``host``, memcpy on a cache in host memory (patch 0006);
* ``1``: ``gather``, the gather graphs (patch 0011): 2 nodes per layer for K and 2 for V (5 for a
  transposed f16 V, gathered through f32), whatever the number of moves;
* ``moves``: the per-move graphs (patch 0001): 6 nodes per layer and block move.

Each test fragments a cache the same way (scattered single cells, a range, every other cell, cells
shared by a fork), reads every sequence's state (``llama_state_seq_get_data``: positions and the raw
K and V bytes of its cells) in position order, defrags on one path, and reads the states again: the
bytes must be exactly those from before, on every path, and the cells must sit where the other paths
put them. The gather writes K and V straight into the cache (its get_rows result is a view of the
cache), so a wrong index or a race between its reads and writes shows up as changed bytes. Quantized
K/V: the gather copies rows as raw 4-byte words, so q8_0 and q4_0 stay on it
when a row is a multiple of 4 bytes (n_embd_k_gqa 64 here) and are exact by construction; with rows
of 18 or 34 bytes (n_embd_k_gqa 32) the per-move graphs run instead. A cache on an RPC server (not in
host memory) takes the gather graphs without being forced, and so does a cache on a GPU.

The models here run on the CPU (``n_gpu_layers=0``: a cache in host memory, where all three paths
exist) also when the suite runs on a GPU build (scripts/gpu_check.sh); the last test puts the cache
on the GPU when there is one.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_rpc import start_rpc_server, stop

import pyllama_kv as pk
from pyllama_kv.core.state import parse, reorder
from pyllama_kv.tools.gguf import make_tiny_model

N_CTX = 256
PATHS = {"host": None, "gather": "1", "moves": "moves"}

# type_k, type_v, flash attention (a quantized V needs flash attention; a transposed V is f16 or f32)
CONFIGS = [
    ("f32", "f32", False), ("f32", "f32", True), ("f16", "f16", False), ("f16", "f16", True),
    ("q8_0", "q8_0", True), ("q4_0", "q4_0", True), ("q8_0", "f16", False),
]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """2 layers, head size 32: n_embd_k_gqa 64, so quantized rows are 68 (q8_0) or 36 (q4_0) bytes."""
    return make_tiny_model(tmp_path_factory.mktemp("defrag") / "wide.gguf", n_embd=128, n_head=4, n_head_kv=2,
                           n_ff=256, seed=3)


@pytest.fixture(scope="module")
def narrow_model(tmp_path_factory):
    """2 layers, one KV head of size 32: n_embd_k_gqa 32, quantized rows of 34 (q8_0) or 18 (q4_0) bytes."""
    return make_tiny_model(tmp_path_factory.mktemp("defrag") / "narrow.gguf", n_embd=64, n_head=2, n_head_kv=1,
                           seed=4)


def _states(ctx: pk.Context, ids) -> dict:
    """Each sequence's state with its cells in position order: independent of where the cells sit."""
    out = {}
    for sid in ids:
        data = ctx._read_seq_state(sid)
        p = parse(data, N_CTX)
        out[sid] = reorder(data, p, np.argsort(p.pos, kind="stable"))
    return out


def _fragment(ctx: pk.Context, first_hole: int = 0) -> list[int]:
    rng = np.random.default_rng(7)
    seqs = [ctx.new_sequence() for _ in range(4)]
    for s in seqs:
        s.extend(rng.integers(3, 300, 48).tolist())
    seqs.append(seqs[3].fork())  # cells shared by two sequences
    rm = ctx._L.llama_kv_self_seq_rm
    for p in range(first_hole, 48, 3):
        rm(ctx._ptr, seqs[0].id, p, p + 1)
    rm(ctx._ptr, seqs[1].id, 10, 30)
    for p in range(1, 48, 2):
        rm(ctx._ptr, seqs[2].id, p, p + 1)
    return [s.id for s in seqs]


def _defrag(model: pk.Model, type_k: str, type_v: str, fa: bool, path: str | None, monkeypatch,
            first_hole: int = 0) -> dict:
    value = PATHS[path] if path is not None else None  # None: the library's choice
    if value is None:
        monkeypatch.delenv("LLAMA_KV_DEFRAG_GRAPH", raising=False)
    else:
        monkeypatch.setenv("LLAMA_KV_DEFRAG_GRAPH", value)
    with model.context(n_ctx=N_CTX, n_seq_max=5, n_batch=64, n_ubatch=32, n_threads=1, flash_attn=fa,
                       type_k=type_k, type_v=type_v) as ctx:
        ids = _fragment(ctx, first_hole)
        before = _states(ctx, ids)
        cells = ctx.kv_cells()
        holes = np.flatnonzero(cells[: int((cells != -1).sum())] == -1)  # the holes the defrag fills
        st0 = ctx.kv_stats()
        assert st0.holes > 0
        st = ctx.defrag()
        assert st.holes == 0 and st.moves > st0.moves
        assert _states(ctx, ids) == before, f"{path}: a cell's K/V bytes changed in the defrag"
        return {"cells": ctx.kv_cells(), "moves": st.moves - st0.moves, "graphs": st.graphs - st0.graphs,
                "nodes": st.nodes - st0.nodes, "lo": int(holes[0]), "hi": int(holes[-1] + 1)}


def gather_nodes(n_layer: int, type_v: str, fa: bool, on_cpu: bool = True) -> int:
    """Nodes of one gather graph over all layers (patch 0011): per layer, K takes a source view and the
    gather into the cache (2); V the same (2), or without flash attention (a transposed V) in f16 a source
    view, the gather into f32, a reshape, the destination view and the copy (5). A cache in CPU memory
    reads the transposed V's indices through one zero-stride view per graph (+1); other devices get them
    as an input, which is not a node."""
    per_layer = 2 + (5 if not fa and type_v == "f16" else 2)
    return n_layer * per_layer + (1 if not fa and on_cpu else 0)


def _check_paths(model: pk.Model, type_k: str, type_v: str, fa: bool, monkeypatch, gather: bool) -> dict:
    got = {path: _defrag(model, type_k, type_v, fa, path, monkeypatch) for path in PATHS}
    for path in ("gather", "moves"):
        np.testing.assert_array_equal(got[path]["cells"], got["host"]["cells"])
    n_layer = model.n_layer
    assert got["host"]["graphs"] == 0 and got["host"]["nodes"] == 0
    mv = got["moves"]
    assert mv["graphs"] >= 1 and mv["nodes"] == 6 * n_layer * mv["moves"]
    g = got["gather"]
    if gather:  # one graph, a constant number of nodes per layer
        assert g["graphs"] == 1 and g["nodes"] == gather_nodes(n_layer, type_v, fa), g
    else:       # rows the gather cannot copy as 4-byte words: the per-move graphs
        assert g["graphs"] == mv["graphs"] and g["nodes"] == mv["nodes"], g
    return got


@pytest.mark.parametrize("type_k,type_v,fa", CONFIGS, ids=[f"{k}-{v}-fa{int(fa)}" for k, v, fa in CONFIGS])
def test_defrag_paths_leave_the_same_bytes(wide_model, patched_lib, type_k, type_v, fa, monkeypatch):
    with pk.Model(wide_model, 0, lib=patched_lib) as m:
        _check_paths(m, type_k, type_v, fa, monkeypatch, gather=True)


@pytest.mark.parametrize("type_kv", ["q8_0", "q4_0"])
def test_quantized_rows_off_4_bytes_stay_on_the_per_move_graphs(narrow_model, patched_lib, type_kv, monkeypatch):
    with pk.Model(narrow_model, 0, lib=patched_lib) as m:
        _check_paths(m, type_kv, type_kv, True, monkeypatch, gather=False)


# (flash attention, the memory bound, cells per graph): a graph holds the indices (4 bytes per cell) and,
# for a transposed f16 V, one layer's f32 temporary (4 * n_embd_v_gqa = 256 bytes per cell)
CHUNKS = [(True, 64, 16), (False, 2600, 10), (False, 1, 1)]


@pytest.mark.parametrize("fa,max_bytes,cells", CHUNKS, ids=[f"fa{int(fa)}-{b}B" for fa, b, _ in CHUNKS])
def test_gather_chunked_by_cells(wide_model, patched_lib, fa, max_bytes, cells, monkeypatch):
    """A small memory bound splits the gather into graphs of a few cells (down to one): still exact, and
    every graph holds all the layers."""
    monkeypatch.setenv("LLAMA_KV_DEFRAG_GATHER_MAX_BYTES", str(max_bytes))
    with pk.Model(wide_model, 0, lib=patched_lib) as m:
        g = _defrag(m, "f16", "f16", fa, "gather", monkeypatch)
        monkeypatch.delenv("LLAMA_KV_DEFRAG_GATHER_MAX_BYTES")
        host = _defrag(m, "f16", "f16", fa, "host", monkeypatch)
    np.testing.assert_array_equal(g["cells"], host["cells"])
    assert g["graphs"] > 2 and g["nodes"] == g["graphs"] * gather_nodes(m.n_layer, "f16", fa), g
    # the rewritten range is [first hole, used cells): as many graphs as chunks of `cells` cover it
    assert (g["graphs"] - 1) * cells < g["hi"] - g["lo"] <= g["graphs"] * cells, g


def test_gather_graphs_start_at_aligned_cells(wide_model, patched_lib, monkeypatch):
    """On a device every graph starts at a multiple of 256 cells (Vulkan's get_rows wants its destination at an
    aligned offset): the rewritten range starts at the aligned cell below the first hole, and the chunks are
    multiples of the alignment. Here the CPU is told to align to 10 cells; chunks of 16 round down to 10."""
    monkeypatch.setenv("LLAMA_KV_DEFRAG_GATHER_ALIGN", "10")
    monkeypatch.setenv("LLAMA_KV_DEFRAG_GATHER_MAX_BYTES", "64")  # 16 cells of indices
    with pk.Model(wide_model, 0, lib=patched_lib) as m:
        g = _defrag(m, "f16", "f16", True, "gather", monkeypatch, first_hole=13)
        host = _defrag(m, "f16", "f16", True, "host", monkeypatch, first_hole=13)
    np.testing.assert_array_equal(g["cells"], host["cells"])
    assert g["lo"] == 13 and g["graphs"] == -(-(g["hi"] - 10) // 10), g   # from cell 10, 10 cells a graph
    assert g["graphs"] != -(-(g["hi"] - 13) // 16), g                      # not from 13, 16 a graph


@pytest.mark.parametrize("fail_at", [0, 2])
def test_a_gather_graph_that_cannot_be_allocated_hands_over_to_the_per_move_graphs(
        wide_model, patched_lib, fail_at, monkeypatch):
    """Out of device memory for a gather graph (simulated at graph `fail_at`): the per-move graphs do all the
    moves, after the gather graphs that ran, and the bytes are the host path's."""
    monkeypatch.setenv("LLAMA_KV_DEFRAG_GATHER_MAX_BYTES", "2600")  # 10 cells a graph
    monkeypatch.setenv("LLAMA_KV_DEFRAG_GATHER_TEST_FAIL", str(fail_at))
    with pk.Model(wide_model, 0, lib=patched_lib) as m:
        g = _defrag(m, "f16", "f16", False, "gather", monkeypatch)
        monkeypatch.delenv("LLAMA_KV_DEFRAG_GATHER_TEST_FAIL")
        host = _defrag(m, "f16", "f16", False, "host", monkeypatch)
        mv = _defrag(m, "f16", "f16", False, "moves", monkeypatch)
    np.testing.assert_array_equal(g["cells"], host["cells"])
    assert g["graphs"] == fail_at + mv["graphs"], g
    assert g["nodes"] == fail_at * gather_nodes(m.n_layer, "f16", False) + mv["nodes"], g


def test_vanilla_keeps_its_graph_defrag(wide_model, vanilla_lib, monkeypatch):
    """The unpatched build ignores LLAMA_KV_DEFRAG_GRAPH and moves cells with its per-move graphs,
    which pack these few moves in one graph: the same bytes and the same cells as the patched paths."""
    monkeypatch.setenv("LLAMA_KV_DEFRAG_GRAPH", "1")
    with pk.Model(wide_model, 0, lib=vanilla_lib) as m:
        with m.context(n_ctx=N_CTX, n_seq_max=5, n_batch=64, n_ubatch=32, n_threads=1) as ctx:
            ids = _fragment(ctx)
            before = _states(ctx, ids)
            assert ctx.kv_stats().holes > 0
            st = ctx.defrag()
            assert st.holes == 0 and st.nodes is None
            assert _states(ctx, ids) == before


@pytest.mark.parametrize("fa", [False, True], ids=["fa0", "fa1"])
def test_a_cache_on_an_rpc_server_takes_the_gather_graphs(wide_model, patched_lib, builds, fa, monkeypatch):
    b = builds.get(("patched", "cpu"))
    if b is None or "rpc-server" not in b.get("tools", []):
        from conftest import DEVICE_RUN

        if DEVICE_RUN:
            pytest.skip("device run: no rpc-server build there")
        pytest.fail("the patched-cpu build has no rpc-server: run `make setup` (pyllama-kv build --rpc)")
    proc, endpoint = start_rpc_server(Path(b["bin_dir"]) / "rpc-server")
    try:
        with pk.Model(wide_model, lib=patched_lib, rpc=[endpoint]) as m:
            g = _defrag(m, "f16", "f16", fa, None, monkeypatch)
            mv = _defrag(m, "f16", "f16", fa, "moves", monkeypatch)
    finally:
        stop(proc)
    np.testing.assert_array_equal(g["cells"], mv["cells"])
    assert g["graphs"] == 1 and g["nodes"] == gather_nodes(m.n_layer, "f16", fa, on_cpu=False), g
    assert mv["nodes"] == 6 * m.n_layer * mv["moves"], mv


@pytest.mark.parametrize("fa", [False, True], ids=["fa0", "fa1"])
def test_a_cache_on_the_gpu_takes_the_gather_graphs(wide_model, patched_lib, fa, monkeypatch):
    """On a GPU build with a GPU (every layer offloaded, the cache in device memory), the default path
    is the gather graphs, exact, with the per-move graphs as the reference. Skipped without a GPU."""
    with pk.Model(wide_model, lib=patched_lib) as m:
        if not m._lib.gpu_devices():
            pytest.skip("no GPU: the library found none (a CPU build, or a machine without one)")
        g = _defrag(m, "f16", "f16", fa, None, monkeypatch)
        mv = _defrag(m, "f16", "f16", fa, "moves", monkeypatch)
    np.testing.assert_array_equal(g["cells"], mv["cells"])
    assert g["graphs"] >= 1 and g["nodes"] == g["graphs"] * gather_nodes(m.n_layer, "f16", fa, on_cpu=False), g
