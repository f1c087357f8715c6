"""Both builds exist, are found through `status`, and differ exactly by the patch series."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli, run_py
from pyllama_kv.harness import build as B, patch as P


def test_status_json_lists_both_builds():
    r = run_cli(["status", "--json"])
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["revision"] == "8733e0cf6eefc7c7752297cc22d0836706f4222c"
    assert st["vendor"]["state"] == "patched"
    assert [p["applied"] for p in st["patches"]] == [True] * len(P.series())
    assert {p["name"] for p in st["patches"]} == {p.name for p in P.series()}
    by = {(b["variant"], b["backend"]): b for b in st["builds"]}
    for key in (("patched", "cpu"), ("vanilla", "cpu")):
        b = by[key]
        assert Path(b["lib"]).is_absolute() and Path(b["lib"]).is_file()
        assert b["stale"] is None
    assert by[("patched", "cpu")]["patches"] == [p.name for p in P.series()]
    assert by[("vanilla", "cpu")]["patches"] == []


def test_status_text_and_help():
    r = run_cli(["status"])
    assert r.returncode == 0 and "patched" in r.stdout and "libllama" in r.stdout
    for cmd in ("vendor", "patch", "build", "status"):
        r = run_cli([cmd, "--help"])
        assert r.returncode == 0 and "usage: pyllama-kv " + cmd in r.stdout


def _exports(lib: str) -> set[str]:
    """The dynamic symbols ``lib`` defines, read with binutils' nm (installed with the C toolchain
    that builds libllama). Without nm, or when it cannot read the library, the test fails: a skip
    would hide a library that does not export what it should."""
    try:
        out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True)
    except OSError as exc:
        pytest.fail(f"cannot run nm to list the symbols of {lib}: {exc} (install binutils)")
    if out.returncode != 0:
        pytest.fail(f"nm -D --defined-only {lib} failed with exit code {out.returncode}: {out.stderr.strip()[-500:]}")
    syms = {ln.split()[-1] for ln in out.stdout.splitlines() if ln.strip()}
    if not syms:
        pytest.fail(f"nm found no dynamic symbols in {lib}")
    return syms


def test_patched_exports_stats_vanilla_does_not(patched_lib, vanilla_lib):
    for fn in ("llama_kv_self_stats", "llama_state_seq_add_data"):   # patches 0004 and 0014
        assert fn in _exports(patched_lib) and fn not in _exports(vanilla_lib), fn
    assert "llama_decode" in _exports(vanilla_lib)


def test_binding_reports_the_stats_api_as_unavailable_on_vanilla(patched_lib, vanilla_lib):
    code = ("import json, pyllama_kv._native.ffi as f; "
            "print(json.dumps([f.load(p).has('llama_kv_self_stats') for p in ('patched', 'vanilla')]))")
    r = run_py(["-c", code])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [True, False]


def test_manifest_records_what_was_built(builds):
    for (variant, backend), b in builds.items():
        m = B.read_manifest(Path(b["dir"]))
        assert m["variant"] == variant and m["backend"] == backend
        assert m["revision"].startswith("8733e0c")
        assert "-DBUILD_SHARED_LIBS=ON" in m["cmake_flags"] and "-DLLAMA_CURL=OFF" in m["cmake_flags"]
        assert Path(m["log"]).is_file()
        if variant == "patched":
            assert [p["sha256"] for p in m["patches"]] == [p.sha256 for p in P.series()]


def test_a_changed_patch_makes_the_build_stale(builds, tmp_path):
    b = builds[("patched", "cpu")]
    m = B.read_manifest(Path(b["dir"]))
    wanted = {k: m[k] for k in ("revision", "variant", "backend", "patches", "cmake_flags", "tools")}
    assert B.stale_reason(m, wanted) is None
    changed = json.loads(json.dumps(wanted))
    changed["patches"][0]["sha256"] = "0" * 64
    assert B.stale_reason(m, changed) == "patches changed"
    flags = dict(wanted, cmake_flags=wanted["cmake_flags"] + ["-DGGML_AVX512=OFF"])
    assert B.stale_reason(m, flags) == "cmake_flags changed"
    assert B.stale_reason(None, wanted) == "not built"


def test_build_is_reused_when_up_to_date():
    r = run_cli(["build", "--json"])
    assert r.returncode == 0, r.stderr
    assert "up to date" in r.stderr
    m = json.loads(r.stdout)
    # without --rpc/--no-rpc a build keeps the RPC backend that `make setup` (build --rpc) gave it
    assert m["variant"] == "patched" and m["rpc"] is True and "-DGGML_RPC=ON" in m["cmake_flags"]


def test_status_shows_the_rpc_backend_and_rpc_server():
    r = run_cli(["status", "--json"])
    assert r.returncode == 0, r.stderr
    by = {(b["variant"], b["backend"]): b for b in json.loads(r.stdout)["builds"]}
    p = by[("patched", "cpu")]
    assert p["rpc"] is True and "rpc-server" in p["tools"] and (Path(p["bin_dir"]) / "rpc-server").is_file()
    assert by[("vanilla", "cpu")]["rpc"] is False
    r = run_cli(["status"])
    assert r.returncode == 0 and any("patched-cpu" in ln and "(RPC)" in ln for ln in r.stdout.splitlines())


def test_rpc_is_a_flag_value_switched_in_place():
    """--rpc / --no-rpc set GGML_RPC ON / OFF; not saying either gives no flag (a build made before
    the option stays up to date), and switching reconfigures the build directory in place."""
    on, off, unset = B.cmake_flags("cpu", rpc=True), B.cmake_flags("cpu", rpc=False), B.cmake_flags("cpu")
    assert "-DGGML_RPC=ON" in on and "-DGGML_RPC=OFF" in off and not any("GGML_RPC" in f for f in unset)
    assert (B._rpc_in(on), B._rpc_in(off), B._rpc_in(unset)) == (True, False, None)
    assert not B._needs_fresh_dir("cmake_flags changed", unset, on)
    assert not B._needs_fresh_dir("cmake_flags changed", on, off)


def test_cuda_without_cublas_says_what_is_missing(monkeypatch, tmp_path):
    """This machine kind has nvcc but no cuBLAS: the error must name cuBLAS and how to get it."""
    fake = tmp_path / "cuda"
    (fake / "bin").mkdir(parents=True)
    nvcc = fake / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho nvcc\n")
    nvcc.chmod(0o755)
    for v in ("CUDA_HOME", "CUDA_PATH", "CUDAToolkit_ROOT"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("CUDACXX", str(nvcc))
    monkeypatch.setattr(B, "_find_cuda", B._find_cuda)  # the real check
    real_is_file = Path.is_file

    def no_system_cublas(p):
        return False if "cublas" in p.name else real_is_file(p)

    monkeypatch.setattr(Path, "is_file", no_system_cublas)
    real_glob = Path.__dict__["glob"]
    monkeypatch.setattr(Path, "glob", lambda self, pat: iter(()) if "cublas" in pat else real_glob(self, pat))
    with pytest.raises(B.BuildError, match="cuBLAS"):
        B._find_cuda()


def test_metal_is_refused_off_macos():
    import platform

    if platform.system() == "Darwin":
        pytest.skip("on macOS metal is the default backend")
    r = run_cli(["build", "--backend", "metal"])
    assert r.returncode == 1 and "macOS" in r.stderr and "Traceback" not in r.stderr


def test_vanilla_build_is_made_from_the_pristine_pinned_tree(builds):
    """The vanilla variant's source is the vendor tree with the series reversed: it must be exactly
    the pinned upstream tree (fingerprint of the pin)."""
    from pyllama_kv.harness import vendor as V

    m = B.read_manifest(Path(builds[("vanilla", "cpu")]["dir"]))
    pin = V.Pin.load()
    assert V.fingerprint(Path(m["source_dir"]), pin.fingerprint_paths) == pin.fingerprint_sha256
    r = run_cli(["vendor", "--fingerprint", m["source_dir"], "--json"])
    assert r.returncode == 0 and json.loads(r.stdout)["matches_pin"] is True


def test_a_changed_flag_value_reconfigures_in_place():
    """Asking for a tool that needs another CMake value (LLAMA_BUILD_SERVER for llama-server) must not
    throw the build directory away; a flag no longer given must (CMake's cache would keep it)."""
    assert "llama-server" in B.TOOLS and "-DLLAMA_BUILD_SERVER=ON" in B.cmake_flags("cpu")
    old = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=OFF"]
    new = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON"]
    assert not B._needs_fresh_dir("cmake_flags changed", old, new)
    assert not B._needs_fresh_dir("tools not built", new, new)
    assert B._needs_fresh_dir("cmake_flags changed", old + ["-DGGML_AVX512=OFF"], new)
    assert B._needs_fresh_dir("forced", new, new) and B._needs_fresh_dir("backend changed", new, new)
