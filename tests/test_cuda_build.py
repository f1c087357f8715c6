"""`build --backend cuda` without compiling anything: the default architectures, cuBLAS from a (fake)
PyPI wheel into a toolkit overlay, the missing-cuBLAS error, the CMake flags and the CLI flags.
The real CUDA build is scripts/check_cuda_build.sh (about 20 minutes; not part of the suite)."""
from __future__ import annotations

import json
import platform
import shutil
import zipfile
from pathlib import Path

import pytest

from conftest import run_cli
from pyllama_kv.harness import build as B, cuda as C

SYSTEM_FIND_CUBLAS = C.find_cublas
WHEEL = "nvidia_cublas-13.0.9.9-py3-none-manylinux_2_27_x86_64.whl"
FAKE_NVCC = """#!/bin/sh
case "$*" in
  *--version*) echo "Cuda compilation tools, release 13.0, V13.0.88" ;;
  *-dryrun*) echo "#\\$ TOP=$(dirname "$0")/.." ;;
esac
"""


def _exe(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def fake_toolkit(root: Path) -> Path:
    """A toolkit root like this machine's: nvcc (a script), its headers and libraries, no cuBLAS."""
    _exe(root / "bin" / "nvcc", FAKE_NVCC)
    (root / "bin" / "nvcc.profile").write_text("TOP = $(_HERE_)/..\n")
    for f in ("include/cuda_runtime.h", "lib/libcudart.so.13", "nvvm/bin/cicc"):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text(f)
    (root / "lib" / "libcudart.so").symlink_to("libcudart.so.13")
    return root


def fake_wheel(path: Path) -> Path:
    """The layout of NVIDIA's nvidia-cublas 13 wheel, with tiny files."""
    with zipfile.ZipFile(path, "w") as z:
        for m in ("nvidia/cu13/include/cublas_v2.h", "nvidia/cu13/include/cublas_api.h",
                  "nvidia/cu13/lib/libcublas.so.13", "nvidia/cu13/lib/libcublasLt.so.13",
                  "nvidia_cublas-13.0.9.9.dist-info/METADATA"):
            z.writestr(m, m)
    return path


@pytest.fixture()
def toolkit(tmp_path, monkeypatch):
    """A fake nvcc as $CUDACXX, a clean cache, and cuBLAS looked for only in the fake toolkit."""
    root = fake_toolkit(tmp_path / "cuda")
    for v in ("CUDA_HOME", "CUDA_PATH", "CUDAToolkit_ROOT"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("CUDACXX", str(root / "bin" / "nvcc"))
    monkeypatch.setenv("PYLLAMA_KV_CACHE", str(tmp_path / "cache"))
    real = C.find_cublas
    monkeypatch.setattr(C, "find_cublas", lambda roots: real([r for r in roots if tmp_path in r.parents]))
    return root


def fake_pip(monkeypatch, wheel: Path, calls: list) -> None:
    def pip_download(args, dest, log):
        calls.append(args)
        shutil.copy(wheel, Path(dest) / WHEEL)
        return 0, [f"Saved {WHEEL}"]

    monkeypatch.setattr(C, "pip_download", pip_download)


# ---------------------------------------------------------------------------------------------


def test_default_arch_without_a_gpu_is_the_documented_list(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    assert C.default_arch() == C.DEFAULT_ARCHS == "75;80;86;89;90"
    r = run_cli(["build", "--help"])
    assert C.DEFAULT_ARCHS in r.stdout.replace("\n", " ") and "--fetch-cublas" in r.stdout


def test_default_arch_is_the_gpus_that_nvidia_smi_lists(tmp_path, monkeypatch):
    _exe(tmp_path / "nvidia-smi", '#!/bin/sh\n[ "$1" = --query-gpu=compute_cap ] && printf "9.0\\n8.6\\n9.0\\n"\n')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert C.default_arch() == "86;90"


def test_cmake_flags_for_cuda_have_no_vmm_and_the_overlay(monkeypatch):
    info = {"root": "/cache/cuda/toolkit-13.0.88-x", "nvcc": "/cache/cuda/toolkit-13.0.88-x/bin/nvcc"}
    flags = B.cmake_flags("cuda", cuda_arch="90", cuda_info=info)
    assert "-DGGML_CUDA=ON" in flags and "-DGGML_CUDA_NO_VMM=ON" in flags
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in flags
    assert "-DCUDAToolkit_ROOT=/cache/cuda/toolkit-13.0.88-x" in flags
    assert "-DCMAKE_CUDA_COMPILER=/cache/cuda/toolkit-13.0.88-x/bin/nvcc" in flags
    monkeypatch.setattr(C, "default_arch", lambda: "80;90")
    assert "-DCMAKE_CUDA_ARCHITECTURES=80;90" in B.cmake_flags("cuda", cuda_info=info)
    assert not any("CUDA" in f and "=ON" in f for f in B.cmake_flags("cpu"))


def test_build_passes_fetch_cublas_on(monkeypatch):
    seen = []

    def find_cuda(fetch_cublas=False, log=None):
        seen.append(fetch_cublas)
        raise B.BuildError("stop here")

    monkeypatch.setattr(B, "_find_cuda", find_cuda)
    for fetch in (True, False):
        with pytest.raises(B.BuildError, match="stop here"):
            B.build(backend="cuda", fetch_cublas=fetch)
    assert seen == [True, False]


def test_missing_cublas_names_fetch_cublas(toolkit):
    with pytest.raises(C.CublasMissing) as e:
        C.find_toolkit(fetch=False)
    assert isinstance(e.value, B.BuildError)
    msg = str(e.value)
    assert "pyllama-kv build --backend cuda --fetch-cublas" in msg and "nvidia-cublas>=13.0,<13.1" in msg
    assert not (C._paths.cache_dir() / "downloads").exists()  # nothing downloaded without the flag


def test_cli_missing_cublas_says_the_command_and_never_waits(toolkit, tmp_path):
    if all(SYSTEM_FIND_CUBLAS([Path("/usr/local/cuda"), Path("/usr")])):
        pytest.skip("this machine has cuBLAS: the build would start")
    env = {"CUDACXX": str(toolkit / "bin" / "nvcc"), "PYLLAMA_KV_CACHE": str(tmp_path / "cache")}
    r = run_cli(["build", "--backend", "cuda", "--cuda-arch", "90"], env=env, timeout=60, input="y\n")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "`pyllama-kv build --backend cuda --cuda-arch 90 --fetch-cublas`" in r.stderr
    assert "[y/N]" not in r.stderr  # not a terminal: no question, no download
    assert not (tmp_path / "cache" / "downloads").exists()


def test_cli_offers_the_download_on_a_terminal(monkeypatch):
    from pyllama_kv.cli.commands import build as cmd
    from pyllama_kv.cli.main import build_parser

    calls = []

    def fake_build(**kw):
        calls.append(kw["fetch_cublas"])
        if not kw["fetch_cublas"]:
            raise C.CublasMissing(f"cuBLAS is missing. Run `{C.fetch_command()}` to get it.")
        return {"lib": "/x/libllama.so"}

    monkeypatch.setattr(B, "build", fake_build)
    args = build_parser(["build"]).parse_args(["build", "--backend", "cuda", "--cuda-arch", "90"])
    assert args.fetch_cublas is False and args.cuda_arch == "90"
    assert build_parser(["build"]).parse_args(["build", "--fetch-cublas"]).fetch_cublas is True
    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert cmd.run(args) == 0 and calls == [False, True]
    calls.clear()
    monkeypatch.setattr("builtins.input", lambda prompt: "")
    monkeypatch.setattr("sys.argv", ["pyllama-kv", "build", "--backend", "cuda"])
    with pytest.raises(C.CublasMissing, match="Run `pyllama-kv build --backend cuda --fetch-cublas` to get it"):
        cmd.run(args)
    assert calls == [False]


def test_fetch_makes_the_overlay_and_then_works_from_the_cache_alone(toolkit, tmp_path, monkeypatch):
    wheel = fake_wheel(tmp_path / WHEEL)
    calls: list = []
    fake_pip(monkeypatch, wheel, calls)
    got = C.find_toolkit(fetch=True)
    assert calls == [["--only-binary", ":all:", "nvidia-cublas>=13.0,<13.1"]]
    ov = Path(got["root"])
    assert ov.parent == C._paths.cache_dir() / "cuda" and got["nvcc"] == str(ov / "bin" / "nvcc")
    record = json.loads((C._paths.cache_dir() / "cuda" / "cublas-13.0.json").read_text())
    assert record["filename"] == WHEEL and record["version"] == "13.0.9.9"
    assert record["sha256"] == C.sha256_file(wheel) == got["cublas_wheel"]["sha256"]

    # the layout CMake's FindCUDAToolkit and nvcc need
    assert (ov / "bin" / "nvcc").resolve() == (toolkit / "bin" / "nvcc").resolve()
    assert (ov / "bin" / "nvcc.profile").is_file()
    assert (ov / "include" / "cuda_runtime.h").is_file() and (ov / "include" / "cublas_v2.h").is_file()
    for lib in ("libcublas", "libcublasLt"):
        assert (ov / "lib" / f"{lib}.so").resolve() == (ov / "lib" / f"{lib}.so.13").resolve()
        assert (ov / "lib" / f"{lib}.so").read_text().endswith(f"lib/{lib}.so.13")
    assert (ov / "lib" / "libcudart.so").is_file() and (ov / "lib64").resolve() == (ov / "lib").resolve()
    tdir = ov / "targets" / f"{platform.machine()}-linux"
    assert (tdir / "include" / "cublas_v2.h").is_file() and (tdir / "lib" / "libcublas.so").is_file()
    assert (ov / "nvvm" / "bin" / "cicc").is_file()
    assert C.nvcc_root(got["nvcc"]) == ov.resolve()  # nvcc works from the overlay, not the real root

    # later runs: no pip, with the overlay and (removed) without it
    def no_pip(*a):
        raise AssertionError("pip was called")

    monkeypatch.setattr(C, "pip_download", no_pip)
    assert C.find_toolkit(fetch=False)["root"] == str(ov)
    shutil.rmtree(ov)
    assert C.find_toolkit(fetch=True)["root"] == str(ov) and (ov / "include" / "cublas_v2.h").is_file()


def test_a_changed_cached_wheel_is_downloaded_again(toolkit, tmp_path, monkeypatch):
    wheel = fake_wheel(tmp_path / WHEEL)
    calls: list = []
    fake_pip(monkeypatch, wheel, calls)
    ov = Path(C.find_toolkit(fetch=True)["root"])
    shutil.rmtree(ov)
    cached = C._paths.cache_dir() / "downloads" / WHEEL
    cached.write_bytes(b"not the wheel")
    C.find_toolkit(fetch=True)
    assert len(calls) == 2 and C.sha256_file(cached) == C.sha256_file(wheel)


def test_a_wheel_without_cublas_is_refused(tmp_path):
    with zipfile.ZipFile(tmp_path / "x.whl", "w") as z:
        z.writestr("nvidia/cu13/include/other.h", "x")
    with pytest.raises(B.BuildError, match="not a cuBLAS wheel"):
        C.unpack_wheel(tmp_path / "x.whl", tmp_path / "out")


def test_a_toolkit_with_cublas_is_used_as_it_is(toolkit, monkeypatch):
    """cuBLAS in nvcc's own toolkit: no download, no overlay, CMake finds the toolkit by itself."""
    for f in ("include/cublas_v2.h", "lib/libcublas.so.13"):
        (toolkit / f).write_text(f)
    monkeypatch.setattr(C, "pip_download", None)
    got = C.find_toolkit(fetch=True)
    assert got["cublas_header"] == str(toolkit / "include" / "cublas_v2.h") and "root" not in got
    assert not (C._paths.cache_dir() / "cuda").exists()
    flags = B.cmake_flags("cuda", cuda_arch="90", cuda_info=got)
    assert "-DGGML_CUDA_NO_VMM=ON" in flags and not any("CUDAToolkit_ROOT" in f for f in flags)
