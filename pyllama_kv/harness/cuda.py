"""The CUDA toolkit for `pyllama-kv build --backend cuda`: nvcc, cuBLAS, and the default architectures.

llama.cpp's CUDA backend needs nvcc and cuBLAS (headers and libraries). When the toolkit that holds
nvcc has no cuBLAS, ``--fetch-cublas`` gets NVIDIA's PyPI wheel for nvcc's CUDA version
(``nvidia-cublas`` ``M.m.*`` for CUDA 13 and later, ``nvidia-cublas-cu12`` for CUDA 12) with pip,
records its sha256, and builds a toolkit overlay in the cache:

    ~/.cache/pyllama-kv/downloads/nvidia_cublas-<version>-....whl   the wheel, as pip saved it
    ~/.cache/pyllama-kv/cuda/cublas-<M.m>.json                      which wheel, its size and sha256
    ~/.cache/pyllama-kv/cuda/cublas-<version>/{include,lib}         the wheel's headers and libraries
    ~/.cache/pyllama-kv/cuda/toolkit-<nvcc version>-<hash>/         the overlay: a toolkit root of
        bin/      symlinks to each file of nvcc's bin/ (nvcc finds its nvcc.profile and tools here)
        include/  symlinks to nvcc's headers and to the wheel's cublas*.h
        lib/      symlinks to nvcc's libraries and to the wheel's libcublas*.so.N, plus libcublas*.so
        lib64 -> lib, targets/<arch>-linux/{include,lib}, and a symlink for every other entry (nvvm, ...)
        overlay.json  what it was made from

CMake gets the overlay as ``CUDAToolkit_ROOT`` and its ``bin/nvcc`` as the CUDA compiler. A later
build (with or without ``--fetch-cublas``) reuses the overlay, or rebuilds it from the cached wheel
once its sha256 matches the record: no network.

``--cuda-arch`` defaults to the compute capabilities that ``nvidia-smi`` reports, or to
``DEFAULT_ARCHS`` when there is no GPU (nvcc compiles each architecture in turn: one architecture
builds several times faster).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

from .. import _paths
from ..errors import BuildError
from ..modelfile.download import Log, cached_ok, pip_download, sha256_file, stderr_log as _stderr

# Turing, Ampere (A100), Ampere (RTX 30), Ada (RTX 40, L4, L40), Hopper (H100, H200): the GPUs in
# common use that CUDA 12 and 13 both support
DEFAULT_ARCHS = "75;80;86;89;90"
FETCH_FLAG = "--fetch-cublas"


class CublasMissing(BuildError):
    """nvcc is there but cuBLAS is not: ``--fetch-cublas`` would get it."""


# ---------------------------------------------------------------------------------------------
# nvcc


def _nvcc_env_roots() -> list[Path]:
    return [Path(h) for h in (os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH", "CUDAToolkit_ROOT")) if h]


def find_nvcc() -> str:
    """nvcc from $CUDACXX, PATH, $CUDA_HOME / $CUDA_PATH / $CUDAToolkit_ROOT or /usr/local/cuda."""
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
    for h in _nvcc_env_roots() + [Path("/usr/local/cuda")]:
        if not nvcc and (h / "bin" / "nvcc").is_file():
            nvcc = str(h / "bin" / "nvcc")
    if not nvcc:
        raise BuildError(
            "--backend cuda needs the CUDA toolkit's compiler (nvcc), which was not found on PATH, in $CUDACXX, "
            "$CUDA_HOME/bin or /usr/local/cuda/bin. Install the CUDA toolkit (12.x or 13.x) and put nvcc on PATH."
        )
    return nvcc


def _nvcc_out(nvcc: str, *args: str) -> str:
    try:
        r = subprocess.run([nvcc, *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout + r.stderr


def nvcc_version(nvcc: str) -> str | None:
    """nvcc's full version ("13.0.88"), None when it does not say."""
    m = re.search(r"release \d+\.\d+, V(\d+\.\d+\.\d+)", _nvcc_out(nvcc, "--version"))
    return m.group(1) if m else None


def nvcc_root(nvcc: str) -> Path:
    """The toolkit root nvcc works from (its ``TOP``: nvcc may be a wrapper script elsewhere)."""
    m = re.search(r"^#\$ TOP=(.+)$", _nvcc_out(nvcc, "-dryrun", "-x", "cu", "-E", os.devnull), re.M)
    return Path(m.group(1).strip()).resolve() if m else Path(nvcc).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# cuBLAS


def _target_dir(root: Path) -> Path:
    return root / "targets" / f"{platform.machine()}-linux"


def find_cublas(roots: list[Path]) -> tuple[Path | None, Path | None]:
    """cublas_v2.h and libcublas.so* under the first of ``roots`` (and system dirs) that have them."""
    inc_dirs: list[Path] = []
    lib_dirs: list[Path] = []
    for r in roots:
        inc_dirs += [r / "include", _target_dir(r) / "include"]
        lib_dirs += [r / "lib64", r / "lib", _target_dir(r) / "lib", r / "lib" / f"{platform.machine()}-linux-gnu"]
    header = next((d / "cublas_v2.h" for d in inc_dirs if (d / "cublas_v2.h").is_file()), None)
    lib = next((p for d in lib_dirs if d.is_dir() for p in sorted(d.glob("libcublas.so*"))), None)
    return header, lib


def wheel_requirement(version: str) -> str:
    """The pip requirement for the cuBLAS wheel that matches nvcc ``version`` ("13.0.88")."""
    major, minor = (int(x) for x in version.split(".")[:2])
    if major < 12:
        raise BuildError(f"--fetch-cublas supports CUDA 12 and newer; nvcc is CUDA {major}.{minor}: "
                         "install cuBLAS with your toolkit")
    name = "nvidia-cublas" if major >= 13 else f"nvidia-cublas-cu{major}"
    return f"{name}>={major}.{minor},<{major}.{minor + 1}"


def _cuda_cache() -> Path:
    return _paths.cache_dir() / "cuda"


def _record_path(version: str) -> Path:
    return _cuda_cache() / f"cublas-{'.'.join(version.split('.')[:2])}.json"


def fetch_wheel(version: str, log: Log = _stderr) -> tuple[Path, dict]:
    """The cuBLAS wheel for nvcc ``version``: from the cache when its sha256 matches the record,
    else downloaded with pip into ``~/.cache/pyllama-kv/downloads`` and recorded. Returns the wheel
    and its record (requirement, filename, version, size, sha256)."""
    record_file = _record_path(version)
    downloads = _paths.cache_dir() / "downloads"
    record = json.loads(record_file.read_text()) if record_file.is_file() else None
    if record:
        wheel = downloads / record["filename"]
        if wheel.is_file() and cached_ok(wheel, record["sha256"], log):
            return wheel, record
    req = wheel_requirement(version)
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="download-", dir=downloads) as tmp:
        log(f"downloading {req} (cuBLAS for CUDA {version}, about 400 MB) with pip ...")
        rc, lines = pip_download(["--only-binary", ":all:", req], tmp, log)
        got = sorted(Path(tmp).glob("*.whl"))
        if rc != 0 or len(got) != 1:
            tail = "\n".join(lines[-15:])
            raise BuildError(f"pip could not download {req} (exit {rc}).\n{tail}")
        sha = sha256_file(got[0])
        if record and record["filename"] == got[0].name and record["sha256"] != sha:
            raise BuildError(f"sha256 mismatch for the downloaded {got[0].name}: recorded {record['sha256']}, "
                             f"got {sha}. Delete {record_file} to accept the new file.")
        wheel = downloads / got[0].name
        os.replace(got[0], wheel)
    record = {"requirement": req, "filename": wheel.name, "version": wheel.name.split("-")[1],
              "size": wheel.stat().st_size, "sha256": sha}
    record_file.parent.mkdir(parents=True, exist_ok=True)
    record_file.write_text(json.dumps(record, indent=2) + "\n")
    log(f"saved {wheel} (sha256 {sha}, recorded in {record_file})")
    return wheel, record


def unpack_wheel(wheel: Path, dest: Path) -> Path:
    """The wheel's cuBLAS headers and libraries in ``dest/include`` and ``dest/lib`` (made once)."""
    if (dest / ".complete").is_file():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            kind = parts[-2] if len(parts) >= 2 else ""
            if info.is_dir() or kind not in ("include", "lib") or ".." in parts:
                continue
            out = tmp / kind / parts[-1]
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    if not (tmp / "include" / "cublas_v2.h").is_file() or not list((tmp / "lib").glob("libcublas.so*")):
        shutil.rmtree(tmp, ignore_errors=True)
        raise BuildError(f"{wheel} holds no cublas_v2.h and libcublas.so: not a cuBLAS wheel")
    (tmp / ".complete").write_text(wheel.name + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def _link_entries(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for e in sorted(src.iterdir()):
        if not (dest / e.name).exists():
            (dest / e.name).symlink_to(e)


def make_overlay(root: Path, cublas: Path, dest: Path, info: dict) -> Path:
    """A toolkit root at ``dest`` that is the toolkit at ``root`` plus the cuBLAS of ``cublas``
    (``unpack_wheel``'s layout), all symlinks; ``info`` goes to its overlay.json."""
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lib_src = next((d for d in (root / "lib64", root / "lib", _target_dir(root) / "lib") if d.is_dir()), None)
    inc_src = next((d for d in (root / "include", _target_dir(root) / "include") if d.is_dir()), None)
    if lib_src is None or inc_src is None or not (root / "bin").is_dir():
        raise BuildError(f"{root} does not look like a CUDA toolkit (bin/, include/ and lib/ expected)")
    _link_entries(root / "bin", tmp / "bin")
    _link_entries(cublas / "include", tmp / "include")
    _link_entries(inc_src.resolve(), tmp / "include")
    _link_entries(cublas / "lib", tmp / "lib")
    _link_entries(lib_src.resolve(), tmp / "lib")
    for so in sorted((cublas / "lib").glob("*.so.*")):  # the unversioned names the linker looks for
        plain = tmp / "lib" / so.name.split(".so.")[0]
        plain = plain.with_name(plain.name + ".so")
        if not plain.exists():
            plain.symlink_to(so.name)
    (tmp / "lib64").symlink_to("lib")
    tdir = _target_dir(tmp)
    tdir.mkdir(parents=True)
    (tdir / "include").symlink_to(Path("..", "..", "include"))
    (tdir / "lib").symlink_to(Path("..", "..", "lib"))
    for e in sorted(root.iterdir()):
        if e.name not in ("bin", "include", "lib", "lib64", "targets"):
            (tmp / e.name).symlink_to(e.resolve())
    (tmp / "overlay.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest


def overlay_dir(root: Path, version: str) -> Path:
    tag = hashlib.sha256(str(root).encode()).hexdigest()[:8]
    return _cuda_cache() / f"toolkit-{version}-{tag}"


def _overlay_info(d: Path) -> dict | None:
    try:
        info = json.loads((d / "overlay.json").read_text())
    except (OSError, ValueError):
        return None
    return info if (d / "include" / "cublas_v2.h").is_file() and (d / "bin" / "nvcc").exists() else None


def fetch_command() -> str:
    return f"pyllama-kv build --backend cuda {FETCH_FLAG}"


def find_toolkit(fetch: bool = False, log: Log = _stderr) -> dict:
    """nvcc and cuBLAS: the toolkit's own, else the overlay in the cache, else (``fetch``) a new
    overlay. Returns what the manifest records; with an overlay, also what CMake needs (``root``:
    CUDAToolkit_ROOT, ``nvcc``: its nvcc). Raises CublasMissing (naming --fetch-cublas) when there is
    no cuBLAS and ``fetch`` is off."""
    nvcc = find_nvcc()
    root = nvcc_root(nvcc)
    header, lib = find_cublas(_nvcc_env_roots() + [root, Path("/usr/local/cuda"), Path("/usr")])
    if header and lib:
        return {"nvcc": nvcc, "cublas_header": str(header), "cublas_lib": str(lib)}
    version = nvcc_version(nvcc)
    if version:
        overlay = overlay_dir(root, version)
        info = _overlay_info(overlay)
        if info is not None:
            log(f"using the CUDA toolkit overlay {overlay}")
        elif fetch:
            wheel, record = fetch_wheel(version, log)
            cublas = unpack_wheel(wheel, _cuda_cache() / f"cublas-{record['version']}")
            info = {"nvcc_root": str(root), "nvcc_version": version, "cublas_wheel": record}
            make_overlay(root, cublas, overlay, info)
            log(f"CUDA toolkit overlay (nvcc {version} + cuBLAS {record['version']}): {overlay}")
        if info is not None:
            return {"nvcc": str(overlay / "bin" / "nvcc"), "root": str(overlay),
                    "cublas_header": str(overlay / "include" / "cublas_v2.h"),
                    "cublas_lib": str(overlay / "lib" / "libcublas.so"), "cublas_wheel": info["cublas_wheel"]}
    missing = ", ".join(what for what, got in (("cublas_v2.h (headers)", header), ("libcublas.so (library)", lib))
                        if got is None)
    req = f" `{wheel_requirement(version)}`" if version and int(version.split(".")[0]) >= 12 else ""
    raise CublasMissing(
        f"--backend cuda: found nvcc at {nvcc}, but cuBLAS is missing: {missing}. llama.cpp's CUDA backend "
        f"links cuBLAS. Run `{fetch_command()}` to download NVIDIA's PyPI wheel{req} (about 400 MB) into "
        f"{_paths.cache_dir()} and build with it, or install cuBLAS with your toolkit (Debian/Ubuntu: "
        "`apt install libcublas-dev-<major>-<minor>` from NVIDIA's repository) or point CUDA_HOME / "
        "CUDAToolkit_ROOT at a toolkit that has it."
    )


# ---------------------------------------------------------------------------------------------
# architectures


def default_arch() -> str:
    """CMAKE_CUDA_ARCHITECTURES when --cuda-arch is not given: the compute capabilities of the GPUs
    that ``nvidia-smi`` lists ("90" for an H100), else ``DEFAULT_ARCHS``."""
    smi = shutil.which("nvidia-smi")
    out = ""
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
    caps = sorted({line.strip().replace(".", "") for line in out.splitlines()
                   if re.fullmatch(r"\d+\.\d+", line.strip())}, key=int)
    return ";".join(caps) or DEFAULT_ARCHS
