"""`pip install`: an sdist that carries the patched llama.cpp tree, and a wheel that carries the
patched library, each installed into a fresh venv outside the checkout (issue 14).

The sdist is built from the checkout; pip builds the wheel from the sdist (compiling libllama once:
a minute or two on 2 cores), and the install test installs that wheel, as ``pip install <sdist>``
would. The venvs take their dependencies
(numpy, cffi, gguf, jinja2; scikit-build-core for the build) from pip's cache or the package index;
our package is always built afresh (--no-cache-dir for it). The programs run from a temporary
directory, with a download cache of their own that holds only the pinned archive (no registry of the
checkout's builds), and with no PYLLAMA_KV_* variable: nothing points back at the checkout.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from conftest import ROOT
from pyllama_kv.harness import build as _build, patch as _patch, vendor as _vendor

pytestmark = pytest.mark.slow

RUNTIME_DEPS = ["cffi>=1.15", "numpy>=1.22", "gguf>=0.10", "jinja2>=3.1"]
SERIES = [p.name for p in _patch.series()]
# the package tests' compiles, without optimisation (half the time) and as unity builds (a quarter less
# again: 38 against 50 s for libllama at -O0 on 2 cores) of 4 files each (llama.cpp's src/ in 8 units
# instead of 4 keeps both cores busy: 43 against 49 s for ggml and libllama); nothing they build is a benchmark
NO_OPT = [*(f"-DCMAKE_{lang}_FLAGS_RELEASE=-O0" for lang in ("C", "CXX")), "-DCMAKE_UNITY_BUILD=ON",
          "-DCMAKE_UNITY_BUILD_BATCH_SIZE=4"]

SMOKE = r"""
import json, sys
import numpy as np
import pyllama_kv as pk
from pyllama_kv.tools.gguf import make_tiny_model

info = pk.library_info()
path = make_tiny_model(sys.argv[1])
model = pk.Model(path)
with model.context(n_ctx=64, n_seq_max=2) as ctx:
    a = ctx.new_sequence()
    logits = a.extend([1, 2, 3, 4])
    b = a.fork()
    out = ctx.decode({a: [5], b: [6]})
    stats = ctx.kv_stats()
info.pop("system_info", None)
print(json.dumps({"info": info, "finite": bool(np.isfinite(logits).all()), "used": stats.used_cells,
                  "n_out": len(out), "file": pk.__file__}))
"""


def _env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYLLAMA_KV_", "PYTHON", "VIRTUAL_ENV", "CMAKE_ARGS"))}
    env.update(PYLLAMA_KV_CACHE=str(cache), PIP_DISABLE_PIP_VERSION_CHECK="1", GGML_NO_BACKTRACE="1")
    return env


def _run(cmd: list, cwd: Path, env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return p


def _ok(p: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert p.returncode == 0, f"{' '.join(p.args)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> tuple[Path, dict]:
    """A working directory outside the checkout and an environment that knows nothing of it."""
    base = tmp_path_factory.mktemp("outside")
    cache = base / "cache"
    (cache / "downloads").mkdir(parents=True)
    archive = _vendor.cached_archive(_vendor.Pin.load())
    if archive.is_file():  # the pinned source, so that `pyllama-kv vendor` needs no network
        os.symlink(archive, cache / "downloads" / archive.name)
    return base, _env(cache)


def _venv(where: Path, env: dict, deps: bool = True) -> Path:
    """A fresh venv (with no pip of its own: :func:`_pip` installs into it, 8 s less per venv)."""
    _ok(_run([sys.executable, "-m", "venv", "--without-pip", where], where.parent, env, timeout=300))
    py = where / "bin" / "python"
    if deps:
        _ok(_run(_pip(py, "install", "-q", *RUNTIME_DEPS), where.parent, env))
    return py


def _pip(py: Path, *args) -> list:
    """``pip ARGS`` for the environment of ``py``: this interpreter's pip, run as ``py`` (``--python``)."""
    return [sys.executable, "-m", "pip", "--python", py, *args]


def _smoke(py: Path, cwd: Path, env: dict) -> dict:
    p = _ok(_run([py, "-c", SMOKE, cwd / "tiny.gguf"], cwd, env, timeout=300))
    got = json.loads(p.stdout.strip().splitlines()[-1])
    site = _ok(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"], cwd, env)).stdout.strip()
    info = got["info"]
    assert got["file"].startswith(site), got["file"]            # the installed package, not the checkout
    assert info["origin"] == "package", info
    assert info["path"].startswith(site) and "/pyllama_kv/lib/" in info["path"], info
    assert info["variant"] == "patched" and info["has_stats"] is True, info
    assert info["patches"] == SERIES, info
    assert info["revision"] == _vendor.Pin.load().revision
    assert got["finite"] and got["used"] == 6 and got["n_out"] == 2, got
    return got


def _python_build(kind: str, out: Path) -> Path:
    """`python -m build --sdist|--wheel` of the checkout (its patched vendor tree) into ``out``."""
    _ok(_run([sys.executable, "-m", "build", f"--{kind}", "--outdir", out], ROOT, dict(os.environ)))
    (f,) = out.glob("pyllama_kv-*.tar.gz" if kind == "sdist" else "pyllama_kv-*.whl")
    return f


def test_an_editable_install_finds_the_library_cmake_put_in_site_packages(tmp_path, monkeypatch):
    """A plain `pip install -e .` (scikit-build-core's "redirect" mode) leaves the code in the checkout and
    installs lib/ into site-packages/pyllama_kv/, which the package's __path__ lists first."""
    import pyllama_kv
    from pyllama_kv import _paths

    assert _paths._package_lib() == _paths.PACKAGE_DIR / "lib"     # the checkout's own, with no install tree
    site = tmp_path / "site-packages" / "pyllama_kv"
    (site / "lib").mkdir(parents=True)
    monkeypatch.setattr(pyllama_kv, "__path__", [str(site), *pyllama_kv.__path__])
    assert _paths._package_lib() == site.resolve() / "lib"


@pytest.fixture(scope="module")
def sdist(tmp_path_factory, builds) -> Path:
    return _python_build("sdist", tmp_path_factory.mktemp("sdist"))


def test_sdist_carries_the_patched_tree_and_no_build_outputs(sdist):
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
        top = names[0].split("/")[0]
        rel = {n.split("/", 1)[1] for n in names if "/" in n}
        llama_h = tf.extractfile(f"{top}/vendor/llama.cpp/include/llama.h")
        assert llama_h is not None
        header = llama_h.read().decode()
    assert "llama_kv_self_stats" in header                       # the tree in the sdist is patched
    assert {"CMakeLists.txt", "pyproject.toml", "LICENSE", "vendor/llama.cpp.pin.json",
            "vendor/llama.cpp/LICENSE", "pyllama_kv/py.typed"} <= rel
    assert {f"patches/{n}" for n in SERIES} <= rel
    assert {f"vendor/llama.cpp/.pyllama-kv-applied/{n}" for n in SERIES} <= rel
    assert not [n for n in rel if n.startswith(("build/", ".venv/", "dist/")) or "__pycache__" in n]
    assert not [n for n in rel if n.startswith(("vendor/llama.cpp/tools/", "vendor/llama.cpp/models/"))]
    # ggml-kompute's vendored Kompute (never built) stays out: sdist.include would otherwise win over exclude
    assert not [n for n in rel if n.startswith("vendor/llama.cpp/ggml/src/ggml-kompute/kompute/")]
    assert Path(sdist).stat().st_size < 5_000_000


@pytest.fixture(scope="module")
def wheel(sdist, outside, tmp_path_factory) -> Path:
    """The wheel pip builds from the sdist (``pip wheel``: what ``pip install <sdist>`` does before it
    installs), outside the checkout: this module's one compile of the patched library. Compiled
    without optimisation and as a unity build (NO_OPT; the tests run a tiny model on it, never a
    benchmark), through ``CMAKE_ARGS``, the switch users pass backend flags with (the release flags are `make`'s
    builds', from the same sources)."""
    out = tmp_path_factory.mktemp("wheel")
    base, env = outside
    no_opt = dict(env, CMAKE_ARGS=" ".join(NO_OPT))
    _ok(_run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", out, sdist], base, no_opt,
             timeout=1200))
    (f,) = out.glob("pyllama_kv-*.whl")
    return f


def test_wheel_contains_the_libraries_the_data_and_the_licenses(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    libs = {n.rsplit("/", 1)[1] for n in names if n.startswith("pyllama_kv/lib/")}
    assert {_build.lib_name(), "libggml.so", "libggml-base.so", "libggml-cpu.so", "build-info.json"} <= libs
    assert "pyllama_kv/_data/llama.cpp.pin.json" in names
    assert {f"pyllama_kv/_data/patches/{n}" for n in SERIES} <= names
    assert {"pyllama_kv/py.typed", "pyllama_kv/modelfile/catalogue.json",
            "pyllama_kv/_native/decl/llama_funcs.h"} <= names
    dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
    assert {f"{dist_info}/licenses/LICENSE", f"{dist_info}/licenses/LICENSE-llama.cpp"} <= names
    assert "-py3-none-" in wheel.name                             # shared libraries only: any Python 3
    meta = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: MIT" in meta and "Classifier: Typing :: Typed" in meta
    assert not [n for n in names if "__pycache__" in n or n.startswith(("include/", "bin/", "lib/"))]


def test_the_sdists_wheel_installs_into_a_fresh_venv_runs_outside_the_checkout_and_builds_vanilla(wheel, outside):
    """What ``pip install <sdist>`` gives (the wheel pip built from the sdist, never from pip's cache:
    the ``wheel`` fixture), in a fresh venv outside the checkout: the package's own library runs, the
    CLI reports the pin and the series it ships, and it vendors, checks the series and builds the vanilla
    library into the cache, where ``lib="vanilla"`` finds it."""
    base, env = outside
    py = _venv(base / "venv", env)
    p = _ok(_run(_pip(py, "install", "--no-deps", wheel), base, env))
    assert "Successfully installed pyllama-kv" in p.stdout
    _smoke(py, base, env)
    cli = base / "venv" / "bin" / "pyllama-kv"
    st = json.loads(_ok(_run([cli, "status", "--json"], base, env)).stdout)
    assert st["revision"] == _vendor.Pin.load().revision
    assert [p["name"] for p in st["patches"]] == SERIES          # the series shipped inside the package
    assert st["package_library"]["patches"] == SERIES
    ver = _ok(_run([cli, "--version"], base, env)).stdout
    assert "pyllama-kv " in ver and _vendor.Pin.load().revision[:12] in ver and SERIES[-1][:-6] in ver
    assert "(package, patched, cpu)" in ver
    cache = Path(env["PYLLAMA_KV_CACHE"])
    if not (cache / "downloads" / _vendor.Pin.load().filename).exists():
        pytest.fail("the pinned archive is not in the download cache: `make setup` puts it there (pyllama-kv vendor)")
    # the vanilla library for comparisons: vendored and built into the cache, found by lib="vanilla"
    _ok(_run([cli, "vendor"], base, env))
    assert (cache / "src" / "llama.cpp" / "include" / "llama.h").is_file()
    chk = _ok(_run([cli, "patch", "--check"], base, env))
    assert f"0 applied; {len(SERIES)} would apply cleanly" in chk.stdout, chk.stdout + chk.stderr
    # compiled without optimisation (NO_OPT, through --cmake-arg, which this checks too)
    _ok(_run([cli, "build", "--vanilla", *(f"--cmake-arg={f}" for f in NO_OPT)], base, env, timeout=1200))
    p = _ok(_run([py, "-c", "import json, pyllama_kv as pk; i = pk.library_info('vanilla'); i.pop('system_info'); "
                      "print(json.dumps(i))"], base, env))
    info = json.loads(p.stdout.strip().splitlines()[-1])
    assert info["variant"] == "vanilla" and info["has_stats"] is False, info
    assert info["path"].startswith(str(cache / "builds")), info
    manifest = json.loads((Path(info["path"]).parent.parent.parent / "manifest.json").read_text())
    assert set(NO_OPT) <= set(manifest["cmake_flags"]), manifest["cmake_flags"]


def test_cuda_without_cublas_stops_with_our_message(sdist, outside):
    from pyllama_kv.harness import cuda

    try:
        nvcc = cuda.find_nvcc()
    except _build.BuildError:
        pytest.skip("no nvcc here: CMake stops earlier, at the missing toolkit")
    header, lib = cuda.find_cublas([cuda.nvcc_root(nvcc), Path("/usr/local/cuda"), Path("/usr")])
    if header and lib:
        pytest.skip("cuBLAS is installed here: a CUDA pip install would compile for most of an hour")
    base, env = outside
    py = _venv(base / "venv-cuda", env, deps=False)
    env = dict(env, CMAKE_ARGS="-DGGML_CUDA=on")
    p = _run(_pip(py, "install", "--no-cache-dir", "--no-deps", sdist), base, env)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert "pyllama-kv: -DGGML_CUDA=on" in out and "not cuBLAS" in out and "--fetch-cublas" in out, out[-3000:]
    assert "ggml-cuda" not in out.split("pyllama-kv: -DGGML_CUDA=on")[0]  # stopped before ggml's CUDA CMake


# ---------------------------------------------------------------------------------------------
# the source step of the package build (harness/source.py), without compiling

def _source_step(root: Path, work: Path, cache: Path, pin: str = "mission") -> subprocess.CompletedProcess:
    """Run the step as CMakeLists.txt does (PYTHONPATH = the source tree), with no site-packages at
    all (-S): nothing but the standard library, as in pip's isolated build environment, and no
    editable install of the checkout to find."""
    env = _env(cache)
    env["PYTHONPATH"] = str(root)
    return _run([sys.executable, "-S", "-m", "pyllama_kv.harness.source", "--work", work,
                 "--info", work / "build-info.json", "--pin", pin], root, env)


def _fake_checkout(tmp_path: Path, with_tree: str | None) -> Path:
    """A copy of the checkout's package, pin and patches; vendor/llama.cpp absent or a pristine copy."""
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "pyllama_kv", root / "pyllama_kv", ignore=shutil.ignore_patterns("__pycache__", "lib"))
    shutil.copytree(ROOT / "patches", root / "patches")
    (root / "vendor").mkdir()
    shutil.copy2(ROOT / "vendor" / "llama.cpp.pin.json", root / "vendor")
    shutil.copy2(ROOT / "vendor" / "current.pin.json", root / "vendor")
    if with_tree == "pristine":
        shutil.copytree(ROOT / "vendor" / "llama.cpp", root / "vendor" / "llama.cpp", symlinks=True,
                        ignore=shutil.ignore_patterns("models", "docs", "tools", "examples", "tests", ".git"))
        _patch.reverse(root / "vendor" / "llama.cpp", _patch.series(root / "patches"))
    return root


@pytest.mark.parametrize("with_tree", [None, "pristine"])
def test_source_step_patches_a_copy_when_no_patched_tree_is_at_hand(tmp_path, with_tree, builds):
    archive = _vendor.cached_archive(_vendor.Pin.load())
    if not archive.is_file():
        pytest.fail("the pinned archive is not cached: `make setup` puts it there (pyllama-kv vendor)")
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    os.symlink(archive, cache / "downloads" / archive.name)
    root = _fake_checkout(tmp_path, with_tree)
    before = _vendor.fingerprint(root / "vendor" / "llama.cpp", ["src", "include"]) if with_tree else None
    work = tmp_path / "work"
    p = _ok(_source_step(root, work, cache))
    tree = Path(p.stdout.strip().splitlines()[-1])
    assert tree == work / "llama.cpp"                                  # a copy in the build dir
    assert _patch.state(tree, _patch.series(root / "patches")).complete
    assert "llama_kv_self_stats" in (tree / "include" / "llama.h").read_text()
    info = json.loads((work / "build-info.json").read_text())
    assert info["variant"] == "patched" and [x["name"] for x in info["patches"]] == SERIES
    assert "patched at build time" in info["source"]
    if with_tree:  # the pristine vendor tree was neither used nor touched
        assert "not the pinned tree with all" in p.stderr
        assert _vendor.fingerprint(root / "vendor" / "llama.cpp", ["src", "include"]) == before


def test_source_step_uses_a_patched_vendor_tree_in_place(tmp_path, builds):
    root = _fake_checkout(tmp_path, None)
    tree = root / "vendor" / "llama.cpp"
    shutil.copytree(ROOT / "vendor" / "llama.cpp", tree, symlinks=True,
                    ignore=shutil.ignore_patterns("models", "docs", "tools", "examples", "tests", ".git"))
    p = _ok(_source_step(root, tmp_path / "work", tmp_path / "cache"))
    assert Path(p.stdout.strip().splitlines()[-1]) == tree
    assert not (tmp_path / "work" / "llama.cpp").exists()


def test_cmake_configure_builds_its_own_source_whatever_pyllama_kv_root_says(tmp_path, builds):
    """A PYLLAMA_KV_ROOT exported in the shell that runs `pip install` must not change the tree compiled:
    CMakeLists.txt pins it to the source it configures."""
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("no cmake on PATH")
    root = _fake_checkout(tmp_path, None)
    shutil.copy2(ROOT / "CMakeLists.txt", root)
    shutil.copytree(ROOT / "vendor" / "llama.cpp", root / "vendor" / "llama.cpp", symlinks=True,
                    ignore=shutil.ignore_patterns("models", "docs", "tools", "examples", "tests", ".git"))
    decoy = tmp_path / "decoy"                       # no pin, no patches: the step would fail there
    decoy.mkdir()
    env = dict(_env(tmp_path / "cache"), PYLLAMA_KV_ROOT=str(decoy))
    p = _ok(_run([cmake, "-S", root, "-B", tmp_path / "cmake-build", f"-DPython_EXECUTABLE={sys.executable}"],
                 tmp_path, env, timeout=600))
    assert f"pyllama-kv: llama.cpp source: {root / 'vendor' / 'llama.cpp'} (mission pin, backend cpu)" in p.stdout, \
        p.stdout[-3000:]


def test_source_step_of_the_current_pin(tmp_path):
    """-DPYLLAMA_KV_PIN=current: the step prepares the current llama.cpp with its series (patches/current/,
    which may be empty) from the cached archive, and the build info says "current"."""
    pin = _vendor.Pin.load(name="current")
    archive = _vendor.cached_archive(pin)
    if not archive.is_file():
        pytest.skip("the current pin's archive is not cached: this would download it")
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    os.symlink(archive, cache / "downloads" / archive.name)
    root = _fake_checkout(tmp_path, None)
    work = tmp_path / "work"
    p = _ok(_source_step(root, work, cache, pin="current"))
    tree = Path(p.stdout.strip().splitlines()[-1])
    assert tree == work / "llama.cpp-current"
    current = _patch.series(root / "patches" / "current")
    assert _patch.state(tree, current).complete
    info = json.loads((work / "build-info.json").read_text())
    assert (info["variant"], info["pin"], info["revision"]) == ("current", "current", pin.revision)
    assert [x["name"] for x in info["patches"]] == [x.name for x in current]
    assert not (root / "vendor" / "llama.cpp").exists()   # the mission pin is not needed for it


def test_the_package_build_has_a_documented_pin_switch():
    cml = (ROOT / "CMakeLists.txt").read_text()
    assert 'set(PYLLAMA_KV_PIN "mission" CACHE STRING' in cml and "--pin ${PYLLAMA_KV_PIN}" in cml
    assert "vendor/current.pin.json" in cml
    assert "cmake.define.PYLLAMA_KV_PIN=current" in (ROOT / "docs" / "building.md").read_text()
