"""ggml's RPC backend (`pyllama-kv build --rpc`): the tiny model with every layer on an rpc-server
started on 127.0.0.1 (a free port) by these tests.

* logits equal to the local run (f32 weights and cache);
* the KV operations (batched decode, fork, remove, slot retry, defrag) keep giving the logits of
  a fresh local evaluation. The cache lives in the server's buffers, not in host memory, so the
  defrag takes the ggml-graph path without being forced to (kv_stats().graphs);
* an endpoint that is malformed, refuses, or accepts and never answers is an error naming it,
  in bounded time; a library without RPC is a LibraryError;
* an rpc-server killed mid-run: the pinned backend aborts the client process (GGML_ASSERT on the
  failed call), which the README says. Run in a subprocess.
"""
from __future__ import annotations

import argparse
import json
import logging
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import pyllama_kv as pk
from conftest import run_cli, run_py, toks
from pyllama_kv.core import model as M

F32_ATOL = 1e-4


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rpc_server_bin(builds) -> Path:
    b = builds.get(("patched", "cpu"))
    if b is None or not b.get("rpc") or "rpc-server" not in b.get("tools", []):
        pytest.fail("the patched-cpu build has no RPC backend or rpc-server: run `make setup` "
                    "(pyllama-kv build --rpc)")
    return Path(b["bin_dir"]) / "rpc-server"


def start_rpc_server(binary: Path, stdout=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    """rpc-server on 127.0.0.1 at a free port, once it answers HELLO (bounded wait; another try on a
    new port if the one found free was taken meanwhile)."""
    err = ""
    for _ in range(3):
        port = free_port()
        proc = subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                stdout=stdout, stderr=subprocess.PIPE)
        endpoint = f"127.0.0.1:{port}"
        for _ in range(200):
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                break
            try:
                M.probe_rpc(endpoint, timeout=1.0)
                return proc, endpoint
            except pk.ModelLoadError:
                time.sleep(0.1)
        stop(proc)
    pytest.fail(f"rpc-server did not start on 127.0.0.1 (exit {proc.returncode}): {err[-2000:]}")


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)
    if proc.stderr:
        proc.stderr.close()


@pytest.fixture(scope="module")
def server(rpc_server_bin):
    proc, endpoint = start_rpc_server(rpc_server_bin)
    yield endpoint
    stop(proc)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def remote(tiny_model, server):
    """The tiny model with every layer (and the output layer) on the rpc-server; its load log."""
    lg = logging.getLogger("pyllama_kv.llama")
    h, level = _Lines(), lg.level
    lg.addHandler(h)
    lg.setLevel(logging.INFO)
    try:
        m = pk.Model(tiny_model, rpc=[server])
    finally:
        lg.removeHandler(h)
        lg.setLevel(level)
    m.load_log = h.lines
    yield m
    m.close()


@pytest.fixture(scope="module")
def ref(tiny_model):
    """A fresh local evaluation from position 0 of a token list."""
    with pk.Model(tiny_model) as m, m.context(n_ctx=256, n_seq_max=1, n_batch=64, n_ubatch=64,
                                              type_k="f32", type_v="f32") as c:
        def logits(tokens):
            c.clear()
            s = c.sequences[0] if c.sequences else c.new_sequence()
            return s.extend(tokens)

        yield logits


def rctx(remote, **kw):
    kw = {"n_ctx": 256, "n_seq_max": 6, "n_batch": 64, "n_ubatch": 64, "type_k": "f32", "type_v": "f32", **kw}
    return remote.context(**kw)


def test_every_layer_runs_on_the_server(remote, server):
    assert remote.rpc == (server,) and remote.n_gpu_layers == -1
    log = "\n".join(remote.load_log)
    assert f"RPC[{server}] model buffer size" in log, log[-3000:]
    assert f"offloaded {remote.n_layer + 1}/{remote.n_layer + 1} layers" in log, log[-3000:]


def test_logits_equal_the_local_run(remote, ref):
    with rctx(remote) as c:
        for seed, n in ((0, 1), (1, 17), (2, 60)):
            s = c.new_sequence()
            t = toks(n, seed=seed)
            np.testing.assert_allclose(s.extend(t), ref(t), atol=F32_ATOL)
            t2 = toks(5, seed=seed + 10)
            np.testing.assert_allclose(s.extend(t2), ref(t + t2), atol=F32_ATOL)
            s.close()


def test_kv_operations_stay_exact(remote, ref):
    with rctx(remote) as c:
        seqs = [c.new_sequence() for _ in range(4)]
        out = c.decode({s: toks(12 + i, seed=i) for i, s in enumerate(seqs)})   # batched decode
        for s in seqs:
            np.testing.assert_allclose(out[s], ref(s.tokens), atol=F32_ATOL)
        f = seqs[0].fork(7)                                                        # fork
        np.testing.assert_allclose(f.extend(toks(4, seed=20)), ref(f.tokens), atol=F32_ATOL)
        seqs[1].remove(3, 6, recompute=True)                                       # remove
        np.testing.assert_allclose(seqs[1].logits(recompute=True), ref(seqs[1].tokens), atol=F32_ATOL)
        seqs[2].truncate(5)
        seqs[3].close()
        assert c.kv_stats().holes > 0
        st = c.defrag()                                                            # defrag: graph path
        assert st.holes == 0 and st.defrags == 1 and st.moves > 0 and st.graphs > 0, st
        for s in (seqs[0], seqs[1], seqs[2], f):
            np.testing.assert_allclose(s.logits(recompute=True), ref(s.tokens), atol=F32_ATOL)
            np.testing.assert_allclose(s.extend(toks(3, seed=30)), ref(s.tokens), atol=F32_ATOL)


def test_slot_retry_defragments_the_remote_cache(remote, ref):
    """The patched retry (a batch that fits only after a defrag) on the remote cache."""
    with rctx(remote, n_seq_max=40, n_batch=256, n_ubatch=256) as c:
        seqs = [c.new_sequence() for _ in range(32)]
        c.decode({s: toks(8, seed=i) for i, s in enumerate(seqs)})
        for s in seqs[::2]:
            s.close()
        assert c.kv_stats().largest_free_block == 8
        s = c.new_sequence()
        np.testing.assert_allclose(s.extend(toks(16, seed=99)), ref(s.tokens), atol=F32_ATOL)
        st = c.kv_stats()
        assert st.slot_retries == 1 and st.slot_failures == 0 and st.defrags == 1 and st.graphs > 0, st
        for x in seqs[1::2]:
            np.testing.assert_allclose(x.logits(recompute=True), ref(x.tokens), atol=F32_ATOL)


def test_models_share_a_server_within_a_process(tiny_model, remote, server, ref, rpc_server_bin):
    """llama.cpp keeps one connection per endpoint in a process, and rpc-server serves one client at
    a time: a second model on a server this process already uses is not probed (a probe would
    never be answered); once every model on a server is closed, a new one connects again."""
    with pk.Model(tiny_model, rpc=[server]) as m2, m2.context(n_ctx=64, n_seq_max=1, type_k="f32",
                                                                 type_v="f32") as c:
        t = toks(9, seed=5)
        np.testing.assert_allclose(c.new_sequence().extend(t), ref(t), atol=F32_ATOL)
    with rctx(remote) as c:   # the first model still works
        np.testing.assert_allclose(c.new_sequence().extend(t), ref(t), atol=F32_ATOL)
    proc, ep = start_rpc_server(rpc_server_bin)
    try:
        for _ in range(2):
            with pk.Model(tiny_model, rpc=ep) as m, m.context(n_ctx=64, n_seq_max=1, type_k="f32",
                                                               type_v="f32") as c:
                np.testing.assert_allclose(c.new_sequence().extend(t), ref(t), atol=F32_ATOL)
        assert M._rpc_open[ep] == 0
    finally:
        stop(proc)


def test_the_cli_runs_on_an_rpc_server(tiny_model, rpc_server_bin, tmp_path):
    """`run --rpc HOST:PORT`: the same greedy text as the local run, and the server served it."""
    args = ["run", str(tiny_model), "-p", "hello there", "-n", "6", "--temp", "0", "--type-k", "f32",
            "--type-v", "f32", "--json"]
    local = run_cli(args)
    assert local.returncode == 0, local.stderr[-2000:]
    with open(tmp_path / "rpc-server.out", "w") as out:
        proc, ep = start_rpc_server(rpc_server_bin, stdout=out)
        try:
            r = run_cli(args + ["--rpc", ep])
        finally:
            stop(proc)
    assert r.returncode == 0, r.stderr[-2000:]
    texts = [[o["text"] for o in json.loads(x.stdout)["outputs"]] for x in (local, r)]
    assert texts[0] == texts[1]
    assert (tmp_path / "rpc-server.out").read_text().count("Accepted client connection") >= 2  # probe, load
    bad = run_cli(args + ["--rpc", f"127.0.0.1:{free_port()}"])
    assert bad.returncode == 1 and "refused the connection" in bad.stderr and "Traceback" not in bad.stderr
    usage = run_cli(args + ["--rpc", "nohost"])
    assert usage.returncode == 2 and "--rpc" in usage.stderr and "HOST:PORT" in usage.stderr


# -- what is refused, and how fast ----------------------------------------------------------------


@pytest.mark.parametrize("bad", ["localhost", "h:0", "h:65536", "h:x", "[::1]:50052", "a b:1", "", ",",
                                 ["127.0.0.1:1", "127.0.0.1:1"], [5], b"h:1"])
def test_malformed_endpoints_are_refused_before_c(tiny_model, bad):
    with pytest.raises(pk.InvalidInputError, match="rpc"):
        pk.Model(tiny_model, rpc=bad)


def test_endpoints_parse_as_a_list_or_a_comma_string():
    assert M.parse_rpc("a:1, b.example:50052") == ["a:1", "b.example:50052"]
    assert M.parse_rpc(("10.0.0.2:1",)) == ["10.0.0.2:1"]


def test_the_cli_option(tiny_model):
    from pyllama_kv.cli import options

    p = argparse.ArgumentParser()
    options.add(p, "rpc")
    assert p.parse_args([]).rpc is None
    assert p.parse_args(["--rpc", "127.0.0.1:5,h:6"]).rpc == ["127.0.0.1:5", "h:6"]
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--rpc", "nohost"])
    assert e.value.code == 2


def test_a_refused_endpoint_is_a_load_error_naming_it(tiny_model):
    ep = f"127.0.0.1:{free_port()}"   # nothing listens there
    with pytest.raises(pk.ModelLoadError, match=f"RPC server {ep} refused"):
        pk.Model(tiny_model, rpc=[ep])


def test_a_silent_endpoint_is_a_load_error_in_bounded_time(tiny_model):
    """Something that accepts connections and never answers (a busy rpc-server serves one client
    at a time; any other program): the pinned client would wait forever. In a subprocess, so that
    a hang is a failed test (the timeout), not a hung suite."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as lst:
        lst.bind(("127.0.0.1", 0))
        lst.listen(4)   # the kernel completes connections; nothing ever reads them
        ep = f"127.0.0.1:{lst.getsockname()[1]}"
        code = textwrap.dedent(f"""
            import pyllama_kv as pk, pyllama_kv.core.model as M
            M.RPC_TIMEOUT = 1.0
            try:
                pk.Model({str(tiny_model)!r}, rpc=[{ep!r}])
            except pk.ModelLoadError as e:
                print("ModelLoadError:", e)
        """)
        r = run_py(["-c", code], timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"ModelLoadError: RPC server {ep} did not answer within 1s" in r.stdout, r.stdout


def test_a_library_without_rpc_says_so(tiny_model, vanilla_lib):
    """The vanilla build is made without --rpc (make setup). In a fresh process: libggml-base.so is
    shared by soname, so a process that loaded the patched build first finds its RPC registry."""
    code = textwrap.dedent(f"""
        import pyllama_kv as pk
        try:
            pk.Model({str(tiny_model)!r}, lib="vanilla", rpc=["127.0.0.1:1"])
        except pk.LibraryError as e:
            print("LibraryError:", e)
    """)
    r = run_py(["-c", code], timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "LibraryError:" in r.stdout and "without ggml's RPC backend" in r.stdout, r.stdout
    assert "pyllama-kv build --rpc" in r.stdout, r.stdout


# -- a server that dies ---------------------------------------------------------------------------


KILL_MID_RUN = """
import subprocess, sys, time
import pyllama_kv as pk
import pyllama_kv.core.model as M

binary, model = sys.argv[1], sys.argv[2]
port = int(sys.argv[3])
ep = f"127.0.0.1:{port}"
srv = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(200):
        try:
            M.probe_rpc(ep, timeout=1.0)
            break
        except pk.ModelLoadError:
            time.sleep(0.1)
    m = pk.Model(model, rpc=[ep])
    c = m.context(n_ctx=64, n_seq_max=1, n_batch=16, n_ubatch=16, type_k="f32", type_v="f32")
    s = c.new_sequence()
    s.extend([5, 6, 7])
    print("decoded before the kill", flush=True)
finally:
    srv.kill()
    srv.wait()
print("rpc-server killed", flush=True)
try:
    s.extend([8, 9])
    print("decode after the kill: returned", flush=True)
except Exception as e:
    print("decode after the kill:", type(e).__name__, e, flush=True)
"""


def test_killing_the_server_mid_run_aborts_the_client(tiny_model, rpc_server_bin):
    """Observed at the pin: the next RPC call fails, and ggml-rpc.cpp asserts on it
    (``GGML_ASSERT(status)``): the client process aborts. There is no error path to turn into an
    exception without patching ggml-rpc; the README says so (run rpc-server under a supervisor,
    and the client where a crash is acceptable, e.g. a server behind a restarting supervisor)."""
    r = run_py(["-c", KILL_MID_RUN, str(rpc_server_bin), str(tiny_model), str(free_port())], timeout=120)
    assert "decoded before the kill" in r.stdout and "rpc-server killed" in r.stdout, (r.stdout, r.stderr[-3000:])
    assert "decode after the kill" not in r.stdout, r.stdout
    assert r.returncode != 0 and "GGML_ASSERT(status) failed" in r.stderr, (r.returncode, r.stderr[-3000:])
    assert "ggml-rpc.cpp" in r.stderr, r.stderr[-3000:]
