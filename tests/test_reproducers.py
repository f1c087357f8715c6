"""The failures of the pinned revision, reproduced at the C level, and fixed by the patch series.

Every case runs scripts/reproduce_kv_failures.py in a subprocess (two of them abort the process on
the vanilla build)."""
from __future__ import annotations

import json
import signal

import pytest

from conftest import run_py

SCRIPT = "scripts/reproduce_kv_failures.py"


def _run(lib: str, case: str, env: dict | None = None):
    r = run_py([SCRIPT, "--lib", lib, "--case", case, "--json"], timeout=600, env=env)
    doc = json.loads(r.stdout) if r.returncode == 0 else None
    return r, (doc["cases"][case] if doc else None)


@pytest.fixture(scope="module")
def slot():
    return {lib: _run(lib, "slot") for lib in ("vanilla", "patched")}


def test_slot_vanilla_fails_with_half_the_cache_free(slot):
    r, c = slot["vanilla"]
    assert r.returncode == 0, r.stderr[-2000:]
    assert c["before"]["free_cells"] == 128 and c["before"]["largest_free_block"] < c["batch_tokens"]
    assert c["rc"] == 1, "vanilla llama_decode should fail to find a slot"
    assert c["after"] == c["before"], "a failed decode must leave the cache as it was"
    assert c["stats"] is None


def test_slot_patched_retries_after_defrag(slot):
    r, c = slot["patched"]
    assert r.returncode == 0, r.stderr[-2000:]
    assert c["rc"] == 0
    assert c["after"]["used_cells"] == 128 + c["batch_tokens"]
    assert c["stats"]["n_slot_retries"] == 1 and c["stats"]["n_slot_failures"] == 0
    assert c["stats"]["n_defrags"] == 1 and c["stats"]["n_defrag_moves"] > 0


@pytest.fixture(scope="module")
def holes():
    out = {lib: _run(lib, "defrag-holes") for lib in ("vanilla", "patched")}
    out["patched-graph"] = _run("patched", "defrag-holes", env={"LLAMA_KV_DEFRAG_GRAPH": "1"})
    return out


def test_defrag_vanilla_leaves_holes_beyond_one_graph(holes):
    r, c = holes["vanilla"]
    assert r.returncode == 0, r.stderr[-2000:]
    needed = c["before"]["holes_below_last_used"] // 2  # alternate cells: about half must move
    assert needed > c["max_moves_per_graph"]
    assert not c["after"]["packed"] and c["after"]["holes_below_last_used"] > 0


def test_defrag_patched_packs_completely_in_several_graphs(holes):
    """The graph path (device caches; forced here): as many graphs as the node limit requires."""
    r, c = holes["patched-graph"]
    assert r.returncode == 0, r.stderr[-2000:]
    assert c["after"]["packed"] and c["after"]["holes_below_last_used"] == 0
    assert c["after"]["used_cells"] == c["before"]["used_cells"]
    s = c["stats"]
    assert s["n_defrags"] == 1
    assert s["n_defrag_moves"] > c["max_moves_per_graph"]
    assert s["n_defrag_graphs"] == -(-s["n_defrag_moves"] // c["max_moves_per_graph"])  # ceil


def test_defrag_patched_packs_completely_with_memcpy_on_host(holes):
    """The host path (patch 0006): the same plan, copied with memcpy, no graphs."""
    r, c = holes["patched"]
    assert r.returncode == 0, r.stderr[-2000:]
    assert c["after"] == holes["patched-graph"][1]["after"]
    s = c["stats"]
    assert s["n_defrags"] == 1 and s["n_defrag_graphs"] == 0
    assert s["n_defrag_moves"] == holes["patched-graph"][1]["stats"]["n_defrag_moves"]


def test_defrag_abort_vanilla_kills_the_process():
    r, _ = _run("vanilla", "defrag-abort")
    assert r.returncode in (-signal.SIGABRT, 128 + signal.SIGABRT), (r.returncode, r.stderr[-2000:])
    assert "GGML_ASSERT" in r.stderr and "view_src" in r.stderr


def test_defrag_abort_patched_survives_and_packs():
    r, c = _run("patched", "defrag-abort")
    assert r.returncode == 0, r.stderr[-2000:]
    assert c["after"]["packed"] and c["decode_after"] == 0
    assert c["stats"]["n_defrags"] == 1 and c["stats"]["n_defrag_cells"] == 10


def test_bad_token_vanilla_terminates_the_process():
    r, _ = _run("vanilla", "bad-token")
    assert r.returncode != 0
    assert "terminate called" in r.stderr or "invalid token" in r.stderr


def test_bad_token_patched_returns_an_error_code():
    r, c = _run("patched", "bad-token")
    assert r.returncode == 0, r.stderr[-2000:]
    assert c["rc"] == -1 and c["after"]["used_cells"] == 1


def test_abort_after_a_mid_batch_retry_removes_every_moved_cell():
    """Patch 0002 remaps the uncommitted cells that its defrag moves; without that, llama_decode's own
    restore would clear the old cells and leave the moved ones behind."""
    r, c = _run("patched", "retry-abort")
    assert r.returncode == 0, r.stderr[-2000:]
    assert c["rc"] == 2, "the second micro-batch should have been aborted"
    assert c["stats"]["n_slot_retries"] == 1 and c["stats"]["n_defrags"] == 1
    assert c["cells_left_of_batch"] == 0
    assert c["after"]["used_cells"] == c["before"]["used_cells"]
