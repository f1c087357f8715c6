"""The benchmark scripts keep working: each runs once in --quick mode and its JSON is checked for
shape and for correctness figures (failures, holes), never for speed."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from test_defrag_paths import gather_nodes

from conftest import ROOT, run_py
from pyllama_kv.harness.peer import find_peer_batched_bench


def _run(script: str) -> dict:
    r = run_py([f"scripts/{script}", "--quick", "--json"], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _machine(d):
    assert d["machine"]["cores"] >= 1 and d["machine"]["cpu"] and d["date"]


def test_bench_binding():
    """Ours against llama-batched-bench, one run: on the mission pin against its own, and (where
    `pyllama-kv build --peer` made the current llama-batched-bench) on the current pin against that
    one too, with the current pin's ratio to ours on the mission pin."""
    both = find_peer_batched_bench() is not None
    libs = ["patched", "current"] if both else ["patched"]
    r = run_py(["scripts/bench_binding.py", "--quick", "--json", "--lib", ",".join(libs)], timeout=600)
    if both and r.returncode != 0 and "printed no rows" in r.stderr and "its log was lost at exit" in r.stderr:
        # the current llama.cpp's logger is not flushed at exit (llama.cpp #22142): on a loaded machine
        # the C++ bench's rows can be lost in every retry; nothing of ours ran wrong
        pytest.skip("the current llama-batched-bench lost its output in every retry (llama.cpp #22142)")
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout)
    _machine(d)
    npl = d["settings"]["npl"]
    assert d["benchmark"] == "binding" and d["settings"]["libs"] == libs
    assert [(row["lib"], row["parallel"]) for row in d["rows"]] == [(lib, pl) for lib in libs for pl in npl]
    for row in d["rows"]:
        for k in ("cpp_pp_tps", "py_pp_tps", "cpp_tg_tps", "py_tg_tps", "pp_ratio", "tg_ratio", "engine_tg_tps"):
            assert row[k] > 0, row
        assert 0 <= row["py_tg_overhead"] < 1, row
    for lib in libs:
        assert d["by_lib"][lib]["min_ratio"] == min(min(row["pp_ratio"], row["tg_ratio"])
                                                    for row in d["rows"] if row["lib"] == lib)
    assert d["min_ratio"] == min(min(row["pp_ratio"], row["tg_ratio"]) for row in d["rows"])
    if not both:
        assert "current_vs_patched" not in d
        return
    assert d["libraries"]["current"]["batched_bench"] == str(find_peer_batched_bench())
    assert "current-" in d["libraries"]["current"]["libllama"], d["libraries"]
    assert [c["parallel"] for c in d["current_vs_patched"]] == npl
    assert all(v > 0 for c in d["current_vs_patched"] for k, v in c.items() if k != "parallel")


def test_bench_defrag():
    d = _run("bench_defrag.py")
    _machine(d)
    rows = d["rows"]
    n_layer = d["model"]["n_layer"]
    assert {r["path"] for r in rows} == {"gather", "moves", "host", "vanilla"}
    assert {r["flash_attn"] for r in rows} == {False, True}
    for r in rows:
        assert r["used_cells"] == r["n_cells"] // 2 and r["holes_before"] > 0
        assert r["ms"] > 0 and r["bytes_moved"] > 0 and r["numpy_copy_ms"] > 0 and r["ratio_to_numpy"] > 0
        if r["library"] == "patched":
            assert r["holes_after"] == 0 and r["moves"] > 0, r
            assert r["cells_moved"] == r["n_cells"] // 4  # half of the used cells sit above n_used
            if r["path"] == "host":  # memcpy on host (0006)
                assert r["graphs"] == 0 and r["nodes"] == 0, r
            elif r["path"] == "gather":  # a constant number of nodes per layer (0011), one graph at these sizes
                assert r["graphs"] == 1 and r["nodes"] == gather_nodes(n_layer, d["type_kv"], r["flash_attn"]), r
            else:  # 6 nodes per layer and move
                assert r["path"] == "moves" and r["nodes"] == 6 * n_layer * r["moves"], r
        else:
            # vanilla stops after one graph's worth of moves: at these sizes it must visibly leave holes,
            # or the comparison shows nothing
            assert r["path"] == "vanilla" and r["moves"] is None
            assert r["holes_after"] > 0 and r["cells_moved"] < r["n_cells"] // 4, r
    assert len(d["ratios"]) == 2 * len({r["n_cells"] for r in rows})
    for q in d["ratios"]:
        assert q["gather_nodes_per_graph"] <= q["node_limit_per_graph"] < q["moves_nodes_per_graph"], q
        assert q["gather_over_host"] > 0 and q["moves_over_host"] > 0 and q["host_over_copy"] > 0


def test_bench_stress():
    d = _run("bench_stress.py")
    _machine(d)
    for r in d["rows"]:
        # the workload must fragment the cache: vanilla fails to place batches, patched retries them
        assert r["vanilla"]["slot_failures"] > 0 and r["patched"]["slot_retries"] > 0, r
        assert r["patched"]["slot_failures"] == 0 and r["patched"]["failed_requests"] == 0
        assert r["sequential"]["slot_failures"] == 0
        assert r["vanilla"]["defrag_share"] is None and 0 <= r["patched"]["defrag_share"] < 1
        assert r["patched_vs_vanilla_tps"] > 0 and r["patched_vs_sequential_tps"] > 0


def test_bench_prefix():
    d = _run("bench_prefix.py")
    _machine(d)
    R, P, T = d["requests"], d["prefix"], d["tail"]
    assert d["full"]["tokens_evaluated"] == R * (P + T)
    assert d["cache"]["tokens_evaluated"] == d["ideal"]["tokens_evaluated"] == P + R * T
    assert d["speedup_full_over_cache"] > 0 and d["overhead_cache_over_ideal"] > 0


def test_bench_real(real_model):
    # one thread: on a busy machine, threads that wait for each other slow every column down badly
    r = run_py(["scripts/bench_real.py", "--quick", "--json", "-t", "1", "--npl", "1,4"], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout)
    _machine(d)
    s = d["settings"]
    assert d["benchmark"] == "real" and [r["parallel"] for r in d["rows"]] == s["npl"] == [1, 4]
    for row in d["rows"]:
        e, c, p = row["engine_tps"], row["batched_bench_tps"], row["llama_cpp_python_tps"]
        assert e > 0 and c > 0 and p > 0
        assert abs(row["engine_vs_batched_bench"] - e / c) < 0.01 * e / c + 0.002
        assert abs(row["engine_vs_llama_cpp_python"] - e / p) < 0.01 * e / p + 0.002
        # every continuation generated the same count (EOS ignored), as batched-bench does
        assert row["engine_generated"] == [s["tg"]] and row["engine_finish"] == ["length"], row
    # llama-cpp-python ran on our patched library, and its greedy tokens equal the engine's
    assert d["checks"]["llama_cpp_python_on_ours"] and d["checks"]["greedy_npl1_equal"], d["checks"]
    ch = d["chat"]
    assert ch["cold_reused_tokens"] == 0 and ch["no_reuse_reused_tokens"] == 0
    # the reuse covers the system prompt, and the question is evaluated
    assert ch["system_tokens"] <= ch["reused_tokens"] < min(ch["prompt_tokens"])
    assert ch["cold_ms"] > 0 and ch["reuse_ms"] > 0 and ch["no_reuse_ms"] > 0 and ch["speedup"] > 0
    t = d["targets"]
    by_npl = {row["parallel"]: row for row in d["rows"]}
    assert t["engine_vs_batched_bench_met"] == all(row["engine_vs_batched_bench"] >= t["engine_vs_batched_bench"]
                                                   for row in d["rows"])
    assert t["engine_vs_llama_cpp_python_met"] == (
        by_npl[t["engine_vs_llama_cpp_python_at"]]["engine_vs_llama_cpp_python"] >= t["engine_vs_llama_cpp_python"])
    assert t["met"] == (t["engine_vs_batched_bench_met"] and t["engine_vs_llama_cpp_python_met"])


def test_bench_server():
    d = _run("bench_server.py")
    _machine(d)
    s = d["settings"]
    assert d["benchmark"] == "server" and [r["server"] for r in d["rows"]] == s["servers"]
    assert s["servers"] == ["patched", "vanilla", "llama-server"]
    assert s["llama_server_ctx_per_slot"] * s["clients"] == s["n_ctx_total"]
    by = {r["server"]: r for r in d["rows"]}
    for r in d["rows"]:
        assert r["requests"] == s["requests"] and r["completion_tokens"] > 0 and r["completion_tps"] > 0, r
        assert 0 < r["ttft_p50_s"] <= r["ttft_p95_s"] and 0 < r["latency_p50_s"] <= r["latency_p95_s"], r
        assert r["ttft_p50_s"] <= r["latency_p50_s"] and r["ttft_p95_s"] <= r["latency_p95_s"], r
        assert r["prompt_evaluated"] + r["prompt_reused"] == r["prompt_tokens"] > 0, r
    # the patched server answers everything and evaluates the shared system prompts once, not per request
    assert by["patched"]["errors"] == 0 and by["llama-server"]["errors"] == 0
    assert by["patched"]["prompt_reused"] >= (s["requests"] - s["clients"]) * min(s["system_prompt_tokens"]), by
    assert d["targets"]["patched_no_errors"] is True
    for k in ("patched/llama-server", "vanilla/llama-server"):
        assert all(v > 0 for v in d["ratios"][k].values())


def test_bench_server_commands_of_the_current_pair(monkeypatch):
    """ours-current is serve on the current library; current is the peer llama-server with one unified
    cache (-kvu) of the same cells, slots, threads, batch and flash attention."""
    spec = importlib.util.spec_from_file_location("bench_server", ROOT / "scripts" / "bench_server.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "find_peer_server", lambda: Path("/peer/llama-server"))
    oc = bench.server_cmd("ours-current", Path("m.gguf"), 1, 8192, 8, 2, 512, 0, {}, True)
    cur = bench.server_cmd("current", Path("m.gguf"), 1, 8192, 8, 2, 512, 0, {}, True)
    assert oc[oc.index("--lib") + 1] == "current" and oc[oc.index("--flash-attn") + 1] == "on"
    assert cur[0] == "/peer/llama-server" and "-kvu" in cur and cur[cur.index("-fa") + 1] == "on"
    for flag, ours in (("-c", "--ctx"), ("-np", "--parallel"), ("-t", "--threads"), ("-b", "--batch")):
        assert cur[cur.index(flag) + 1] == oc[oc.index(ours) + 1], flag


def test_bench_chat_load():
    """The many-chats load over HTTP: ours with the tier, llama-server at the pin and ours on the
    current llama.cpp (the current llama-server needs `build --peer`, 18 minutes: the benchmark, not
    the suite, builds it)."""
    r = run_py(["scripts/bench_chat_load.py", "--quick", "--json", "--only", "ours,pin,ours-current"], timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout)
    _machine(d)
    s = d["settings"]
    assert d["benchmark"] == "chat-load" and [row["server"] for row in d["rows"]] == ["ours", "pin", "ours-current"]
    for row in d["rows"]:
        assert row["errors"] == 0 and row["requests"] == s["conversations"] * s["turns"], row
        assert row["completion_tokens"] > 0 and row["peak_rss_mib"] > 0, row
        assert row["prompt_evaluated"] + row["prompt_cached"] == row["prompt_tokens"] > 0, row
        assert 0 < row["later_ttft_p50_s"] <= row["later_ttft_p95_s"], row
    # both pins page evicted prefixes out to the host tier (the current one through patches/current/)
    assert s["host_tier"] == {"ours": True, "ours-current": True}
    by = {row["server"]: row for row in d["rows"]}
    assert by["ours-current"]["tier_host_mib_end"] is not None and by["ours"]["tier_host_mib_end"] is not None
    assert set(d["ratios"]) == {"ours/pin", "ours/ours-current"}
    assert all(v > 0 for k in d["ratios"] for v in d["ratios"][k].values())


@pytest.mark.parametrize("arch", ["lfm2", "gemma3"])
def test_bench_hybrid_reuse(arch):
    """A hybrid model's prefix reuse, and a sliding-window model's (gemma3, a window of 32 tokens,
    far shorter than the system prompt), ours only (the current llama-server needs `build --peer`):
    after the first request every one evaluates about its new tokens, and a second conversation under
    the same system prompt forks all of it (lfm2: exactly the system prompt, from its checkpoint;
    gemma3: the longest prefix it shares with A, which the SWA cache still holds)."""
    r = run_py(["scripts/bench_hybrid_reuse.py", "--only", "ours-current", "--system-words", "60", "--turns", "3",
                "--max-tokens", "8", "--arch", arch, "--window", "32"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    d = json.loads(r.stdout)
    _machine(d)
    assert d["model"].startswith(f"tiny {arch}")
    rows = d["servers"]["ours-current"]
    assert [(x["conversation"], x["turn"]) for x in rows] == [("A", 1), ("A", 2), ("A", 3), ("B", 1), ("C", 1),
                                                             ("A", 4)]
    for x in rows:
        assert x["cached"] + x["evaluated"] == x["prompt_tokens"] > 0, x
    b = rows[3]
    assert b["cached"] >= d["system_prompt_tokens"] > 32 and b["evaluated"] <= b["new"], b
    if arch == "lfm2":
        assert b["cached"] == d["system_prompt_tokens"] and b["evaluated"] == b["new"], b
    for x in rows[1:]:   # an answer's end token is the most that goes beyond the new tokens
        assert x["evaluated"] <= x["new"] + 1, x


def _load_chat_bench():
    spec = importlib.util.spec_from_file_location("bench_chat_load", ROOT / "scripts" / "bench_chat_load.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_chat_load_commands(monkeypatch):
    """Equal flags: every server the same flash attention, ours-current on the current library with the
    host tier (ours-no-tier without); --defaults: no flash-attention flag for any server, the rest unchanged."""
    bench = _load_chat_bench()
    monkeypatch.setattr(bench, "find_peer_server", lambda: Path("/peer/llama-server"))
    monkeypatch.setattr(bench, "llama_server_path", lambda: Path("/pin/llama-server"))
    ap = bench.argparse.Namespace(ctx=512, clients=4, threads=2, cache_ram=1024, flash_attn="on", defaults=False,
                                  prefix_cache=4, template=None)
    cmds = {n: bench.server_cmd(n, Path("m.gguf"), 1, ap) for n in bench.SERVERS}
    assert not any("--template" in c or "--chat-template-file" in c for c in cmds.values())
    oc = cmds["ours-current"]
    assert oc[oc.index("--lib") + 1] == "current" and oc[oc.index("--cache-ram") + 1] == "1024"
    assert cmds["ours-no-tier"][cmds["ours-no-tier"].index("--cache-ram") + 1] == "0"
    assert oc[oc.index("--flash-attn") + 1] == "on" and cmds["pin"][-1] == "-fa"
    assert cmds["current"][cmds["current"].index("-fa") + 1] == "on"
    for n in ("ours", "ours-no-tier", "ours-current"):   # the same cells, slots and threads as ours
        assert cmds[n][cmds[n].index("--ctx"):cmds[n].index("--lib")] == cmds["ours"][
            cmds["ours"].index("--ctx"):cmds["ours"].index("--lib")]
    ap.defaults = True
    for n in bench.SERVERS:
        cmd = bench.server_cmd(n, Path("m.gguf"), 1, ap)
        assert "-fa" not in cmd and "--flash-attn" not in cmd, cmd
        assert [a for a in cmds[n] if a not in ("-fa", "--flash-attn", "on")] == cmd
    ap.template = "t.jinja"   # one template for every server
    for n in bench.SERVERS:
        cmd = bench.server_cmd(n, Path("m.gguf"), 1, ap)
        flag = "--template" if n.startswith("ours") else "--chat-template-file"
        assert cmd[cmd.index(flag) + 1] == "t.jinja", cmd


def test_bench_chat_load_gives_no_ratio_for_a_run_with_errors():
    """A run with request errors compares with nothing: no ratio (its figures are of fewer or failed
    requests), the comparison listed as refused with the errors; the others still compare."""
    bench = _load_chat_bench()

    def row(server, errors=0, **kw):
        return {"server": server, "errors": errors, "error_samples": ["HTTP 500"] if errors else [],
                "wall_s": 10.0, "completion_tps": 5.0, "later_ttft_p95_s": 0.5, **kw}

    ok = [row("ours", completion_tps=10.0), row("pin"), row("ours-no-tier", wall_s=20.0)]
    r, refused = bench.ratios(ok)
    assert refused == {} and set(r) == {"ours/pin", "ours/ours-no-tier"}
    assert r["ours/pin"] == {"completion_tps": 2.0, "later_ttft_p95": 1.0, "wall": 1.0}
    # errors on the reference's side: that comparison alone is refused
    r, refused = bench.ratios([row("ours"), row("pin", errors=3), row("ours-no-tier")])
    assert set(r) == {"ours/ours-no-tier"} and set(refused) == {"ours/pin"}
    assert "pin had 3 request errors" in refused["ours/pin"][0] and "HTTP 500" in refused["ours/pin"][0]
    # errors on ours: every comparison is refused; a server that did not start is refused too
    r, refused = bench.ratios([row("ours", errors=1), row("pin"),
                               {"server": "current", "errors": 10, "started": False, "error_samples": ["x"]}])
    assert r == {} and set(refused) == {"ours/pin", "ours/current"}
    # ours on the current library against the current llama-server, and ours against it
    r, refused = bench.ratios([row("ours", completion_tps=10.0), row("ours-current"), row("current", wall_s=5.0)])
    assert refused == {} and set(r) == {"ours/current", "ours-current/current", "ours/ours-current"}
    assert r["ours-current/current"] == {"completion_tps": 1.0, "later_ttft_p95": 1.0, "wall": 2.0}


def test_bench_chat_load_takes_the_median_of_its_rounds():
    """--rounds N: each ratio is the median over the rounds (each round's kept), refusals of any round
    listed; one round is reported as it is."""
    bench = _load_chat_bench()
    one = ({"a/b": {"completion_tps": 1.0, "later_ttft_p95": None, "wall": 2.0}}, {})
    out: dict = {}
    assert bench.median_ratios([one], out) == one and "ratios_by_round" not in out
    rounds = [({"a/b": {"completion_tps": t, "later_ttft_p95": 1.0, "wall": w}}, {}) for t, w in
              ((0.8, 1.3), (1.2, 0.9), (1.0, 1.0))]
    rounds.append(({}, {"a/c": ["c had 2 request errors"]}))
    r, refused = bench.median_ratios(rounds, out)
    assert r == {"a/b": {"completion_tps": 1.0, "later_ttft_p95": 1.0, "wall": 1.0}}
    assert refused == {"a/c": ["c had 2 request errors"]} and len(out["ratios_by_round"]) == 4


def test_bench_grammar_flood():
    """Hostile grammars flood the server while another client probes it: the server lives, the chains
    are refused, the grammars within the bounds are served, and the probe never fails (its latency is
    the benchmark's to print, not this test's to judge)."""
    d = _run("bench_grammar_flood.py")
    assert d["alive_after"] and not d["server_exited"], d
    assert d["quiet"]["errors"] == 0 and d["flood_run"]["errors"] == 0, d
    assert set(d["flood_answers"]) == {"200", "400"} and sum(d["flood_answers"].values()) == d["flood"], d
    assert d["flood_run"]["completion"]["n"] >= 1 and all(v is not None for v in d["ratios"].values()), d


def test_bench_embeddings():
    """Ours against llama-server --embeddings on a tiny BERT: every text answered by both, the same vectors."""
    d = _run("bench_embeddings.py")
    _machine(d)
    assert d["benchmark"] == "embeddings" and [r["server"] for r in d["rows"]] == ["pyllama-kv", "llama-server"]
    for r in d["rows"]:
        assert r["errors"] == 0 and r["texts_per_s"] > 0 and r["tokens_per_s"] > 0, r
    assert d["ratio_ours_over_llama_server"] > 0
    assert d["first_vector_max_abs_diff"] is not None and d["first_vector_max_abs_diff"] <= 1e-4


def test_bench_hostile():
    """Each hostile request is answered (the ones past the bounds refused with a 400), the quiet chat
    answers beside every one, and the store's probe is refused whole (its ratios are the benchmark's to
    print, not this test's to judge)."""
    d = _run("bench_hostile.py")
    rows = d["rows"]
    assert set(rows) == {"tokenize-specials", "tokenize-pieces", "chat-specials", "responses-items", "placeholders",
                         "store-nested"}, rows
    assert rows["tokenize-specials"]["status"] == rows["tokenize-pieces"]["status"] == 200, rows
    assert all(rows[k]["status"] == 400 for k in ("chat-specials", "responses-items", "placeholders")), rows
    assert all(r["chat_over_quiet"] > 0 for k, r in rows.items() if k != "store-nested"), rows
    assert rows["store-nested"]["statuses"] == {"400": 4}, rows
