"""Both builds exist, are found through `status`, and differ exactly by the patch series."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from conftest import run_cli, run_py
from pyllama_kv import _paths
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
        # manifests written before the second pin do not name it: those are all of the mission pin
        assert m.get("pin", B.variant_pin(variant)) == B.variant_pin(variant) == b["pin"]
        assert m["revision"].startswith("8733e0c" if b["pin"] == "mission" else "0c1e57098")
        assert "-DBUILD_SHARED_LIBS=ON" in m["cmake_flags"]
        assert ("-DLLAMA_CURL=OFF" in m["cmake_flags"]) == (b["pin"] == "mission")  # the option is gone there
        assert Path(m["log"]).is_file()
        series = P.series(_paths.patches_dir(pin=b["pin"]))
        if variant != "vanilla":
            assert [p["sha256"] for p in m["patches"]] == [p.sha256 for p in series]


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


# ---------------------------------------------------------------------------------------------
# the second pin: the current llama.cpp, built as the third library "current"

MISSION_FLAGS = [  # the mission builds' flags before the second pin: unchanged, so those builds stay up to date
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
    "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF",
]


def test_cmake_flags_per_pin():
    assert B.cmake_flags("cpu") == MISSION_FLAGS
    cur = B.cmake_flags("cpu", pin="current", rpc=True)
    # the current llama.cpp: no curl option any more, no OpenSSL, no app binary, no web UI download
    assert not any(f.startswith("-DLLAMA_CURL") for f in cur)
    for f in ("-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF",
              "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DGGML_RPC=ON"):
        assert f in cur, f
    assert "-DGGML_CUDA=ON" in B.cmake_flags("cuda", pin="current", cuda_arch="90")
    assert B.variant_pin("current") == "current" and B.variant_pin("vanilla") == "mission"
    with pytest.raises(B.BuildError, match="unknown variant"):
        B.variant_pin("newest")


def test_what_a_current_build_records():
    """The manifest of a current build names its pin, revision and series (patches/current/)."""
    w = B._wanted("current", "cpu", B.cmake_flags("cpu", pin="current", rpc=True), True, None)
    assert (w["pin"], w["variant"], w["revision"]) == ("current", "current", "0c1e57098")
    assert w["pin_source"] == "llama-cpp-python==0.3.36 sdist"
    assert w["patches"] == [{"name": p.name, "sha256": p.sha256} for p in P.series(_paths.patches_dir(pin="current"))]
    assert w["tools"] == ["llama-batched-bench", "llama-server", "llama-gguf-split", "ggml-rpc-server"]
    m = B._wanted("patched", "cpu", MISSION_FLAGS, False, None)
    assert (m["pin"], m["revision"][:7], m["tools"]) == ("mission", "8733e0c", [])


def test_current_build_exports_the_new_memory_api(current_lib):
    """The current library is the new C API (checked by its symbols: loading it needs the binding's
    declarations of that API): llama_memory_*, no llama_kv_self_* and none of the mission patches'
    functions but the ones its own series adds (patches/current/0001-0003)."""
    syms = _exports(current_lib)
    for fn in ("llama_get_memory", "llama_memory_seq_rm", "llama_memory_seq_cp", "llama_decode",
               "llama_state_seq_get_size_ext", "llama_max_parallel_sequences",
               "llama_state_seq_add_data", "llama_memory_update", "llama_state_seq_get_data_range"):
        assert fn in syms, fn
    for fn in ("llama_kv_self_stats", "llama_kv_self_seq_rm", "llama_kv_self_defrag"):
        assert fn not in syms, fn


def test_the_current_build_is_listed_with_its_pin(current_lib):
    r = run_cli(["status", "--json"])
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    cur = st["pins"]["current"]
    assert cur["revision"] == "0c1e57098" and cur["cached"] and cur["vendor"]["revision"] == "0c1e57098"
    assert cur["vendor"]["state"] in ("pristine", "patched")
    assert [p["name"] for p in cur["patches"]] == [p.name for p in P.series(_paths.patches_dir(pin="current"))]
    assert st["pins"]["mission"]["revision"] == st["revision"]
    by = {(b["variant"], b["backend"]): b for b in st["builds"]}
    b = by[("current", "cpu")]
    assert (b["pin"], b["revision"], b["stale"], b["lib"]) == ("current", "0c1e57098", None, current_lib)
    assert Path(b["dir"]).name == "current-cpu"
    assert (by[("patched", "cpu")]["pin"], by[("vanilla", "cpu")]["pin"]) == ("mission", "mission")
    m = B.read_manifest(Path(b["dir"]))
    assert (m["variant"], m["pin"], m["revision"]) == ("current", "current", "0c1e57098")
    assert m["cmake_flags"][: len(B.PIN_FLAGS["current"])] == B.PIN_FLAGS["current"]
    # (built from a checkout's vendor/llama.cpp-current: the build dir may be shared between checkouts)
    assert Path(m["source_dir"]).name == "llama.cpp-current" and Path(m["log"]).is_file()
    r = run_cli(["status"])
    assert r.returncode == 0 and any("current-cpu" in ln and "current pin" in ln for ln in r.stdout.splitlines())
    r = run_cli(["build", "--pin", "current", "--json"])
    assert r.returncode == 0 and "up to date" in r.stderr, r.stderr
    assert json.loads(r.stdout)["lib"] == current_lib


def test_resolve_current_finds_that_build(current_lib):
    from pyllama_kv._native import locate

    path, info = locate.resolve("current")
    assert str(path) == str(Path(current_lib).resolve())
    assert (info["variant"], info["pin"], info["revision"], info["origin"]) == ("current", "current", "0c1e57098",
                                                                             "build")
    _, patched = locate.resolve("patched")
    assert (patched["variant"], patched["pin"]) == ("patched", "mission")


def test_resolve_current_without_a_build_says_how_to_make_it(tmp_path, monkeypatch):
    from pyllama_kv import errors
    from pyllama_kv._native import locate

    monkeypatch.setenv("PYLLAMA_KV_ROOT", str(tmp_path / "root"))
    monkeypatch.setenv("PYLLAMA_KV_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("PYLLAMA_KV_LIB", raising=False)
    monkeypatch.setattr(locate, "bundled", lambda: None)
    with pytest.raises(errors.LibraryError, match="pyllama-kv build --pin current"):
        locate.resolve("current")
    # a build made (a manifest and a library file): found; "patched" does not take it
    d = tmp_path / "root" / "build" / "current-cpu"
    d.mkdir(parents=True)
    (d / "libllama.so").write_bytes(b"")
    (d / "manifest.json").write_text(json.dumps({"variant": "current", "pin": "current", "revision": "0c1e57098",
                                                 "backend": "cpu", "lib": str(d / "libllama.so"), "patches": []}))
    path, info = locate.resolve("current")
    assert path == (d / "libllama.so").resolve() and info["pin"] == "current"
    with pytest.raises(errors.LibraryError, match="no patched build"):
        locate.resolve("patched")
    # the package compiled from the current pin: the default and "current" load it, "patched" does not
    pkg = {"lib": str(d / "libllama.so"), "variant": "current", "pin": "current", "origin": "package"}
    monkeypatch.setattr(locate, "bundled", lambda: pkg)
    assert locate.resolve()[1]["origin"] == "package" and locate.resolve("current")[1]["origin"] == "package"
    with pytest.raises(errors.LibraryError, match="no patched build"):
        locate.resolve("patched")


def test_lib_flags_name_the_current_library():
    from pyllama_kv import _paths

    for cmd in ("run", "chat", "serve"):
        r = run_cli([cmd, "--help"])
        assert r.returncode == 0 and "patched|vanilla|current|PATH" in r.stdout.replace("\n", ""), cmd
    src = "".join(p.read_text() for p in (_paths.PACKAGE_DIR).rglob("*.py"))
    assert "patched|vanilla|PATH" not in src


def test_vanilla_is_a_mission_build_only():
    r = run_cli(["build", "--pin", "current", "--vanilla"])
    assert r.returncode == 1 and "--vanilla" in r.stderr and "Traceback" not in r.stderr


def test_status_without_the_second_pin_file(tmp_path):
    """A package installed before the second pin has no current.pin.json: status still answers."""
    root = tmp_path / "proj"
    (root / "vendor").mkdir(parents=True)
    (root / "patches").mkdir()
    (root / "vendor" / "llama.cpp.pin.json").write_bytes(_paths.pin_path().read_bytes())
    st = B.status(root)
    assert st["pins"]["current"]["vendor"]["state"] == "no pin file" and "current.pin.json" in st["pins"]["current"][
        "error"]
    assert st["vendor"]["state"] == "missing" and st["builds"] == []
