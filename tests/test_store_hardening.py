"""Hostile model stores and paths (issue 45, item 5): every read of an Ollama store, an LM Studio folder,
the Hugging Face cache or a plain MODEL path is bounded. A manifest nested too deep or too big, a blob
that links to itself, a FIFO where a file should be: one line each (exit 1 at the CLI), one broken
entry never breaks a listing, and nothing hangs. Whatever could block runs in a subprocess with a
timeout (run_cli), so that the code of before fails these tests instead of hanging them."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

import pyllama_kv as pk
from conftest import run_cli
from pyllama_kv import limits
from pyllama_kv.modelfile import local, names
from pyllama_kv.tools.gguf import make_tiny_model

#: seconds a command may take here: a hang (a FIFO opened for reading) is a failure, not a stuck suite
TIMEOUT = 60
LIB = ("registry.ollama.ai", "library")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> bytes:
    return make_tiny_model(tmp_path_factory.mktemp("gguf") / "t.gguf").read_bytes()


@pytest.fixture
def env(tmp_path, monkeypatch) -> dict:
    """Every store in a temporary directory, no network: set here and returned for the commands."""
    home = tmp_path / "home"
    home.mkdir()
    e = {"HOME": str(home), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
         "OLLAMA_MODELS": str(tmp_path / "ollama"), "PYLLAMA_KV_CACHE": str(tmp_path / "pk-cache"),
         "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    for k, v in e.items():
        monkeypatch.setenv(k, v)
    return e


def ollama_model(root: Path, model: str, data: bytes | None = None, manifest: str | None = None) -> Path:
    """A model ``model:latest`` in the Ollama store ``root``: its blob (``data``) and its manifest (or the
    text ``manifest`` instead); returns the blob's path."""
    data = data if data is not None else b"GGUF"
    sha = hashlib.sha256(data).hexdigest()
    blob = root / "blobs" / f"sha256-{sha}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    path = root / "manifests" / Path(*LIB, model, "latest")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(manifest if manifest is not None else json.dumps(
        {"schemaVersion": 2, "layers": [{"mediaType": local.OLLAMA_MODEL_MEDIA, "digest": f"sha256:{sha}",
                                         "size": len(data)}]}))
    return blob


def one_error_line(r) -> str:
    """The one line of a failed command: exit 1, no traceback, not an internal error."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "internal error" not in lines[0], r.stderr[-2000:]
    return lines[0]


def deep_manifest(levels: int) -> str:
    return '{"layers": ' + "[" * levels + "]" * levels + "}"


# ---------------------------------------------------------------------------------------------
# Ollama: a manifest nested too deep, one too big, a blob that links to itself


def test_deep_manifest_is_one_entry_not_a_broken_listing(env, gguf):
    root = Path(env["OLLAMA_MODELS"])
    good = ollama_model(root, "good", gguf)
    ollama_model(root, "deep", manifest=deep_manifest(100_000))     # a RecursionError in json.loads
    with pytest.raises(pk.ModelLoadError, match=f"nested 100001 levels deep, more than "
                                                f"{limits.STORE_JSON_MAX_DEPTH}") as e:
        local.resolve_ollama("deep")
    assert "\n" not in str(e.value)
    listed = {m.name: m for m in local.scan(("ollama",))}
    assert listed["ollama:good:latest"].path == str(good) and listed["ollama:good:latest"].error is None
    assert "nested" in (listed["ollama:deep:latest"].error or "")
    with pytest.raises(pk.ModelLoadError, match="ollama:nosuch: not in Ollama's store.*it has: "
                                                "ollama:deep:latest, ollama:good:latest"):
        names.resolve("ollama:nosuch")      # the error of an unknown name scans the store

    r = run_cli(["models", "--local"], env=env, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    lines = {ln.split()[0]: ln for ln in r.stdout.splitlines() if ln.strip()}
    assert "llama" in lines["ollama:good:latest"] and "unusable:" in lines["ollama:deep:latest"]
    line = one_error_line(run_cli(["run", "ollama:nosuch", "-p", "x"], env=env, timeout=TIMEOUT))
    assert "not in Ollama's store" in line and "ollama:good:latest" in line
    assert "nested" in one_error_line(run_cli(["inspect", "ollama:deep"], env=env, timeout=TIMEOUT))


def test_json_depth_counts_brackets_outside_strings():
    assert local.json_depth('{"a": [1, {"b": "[[[[{{{{"}], "c": "\\"]]]"}') == 3
    assert local.json_depth("[" * 50 + "]" * 50) == 50
    assert local.json_depth('"[[[\\\\"[[') == 2     # an escaped backslash ends no string


def test_manifest_over_the_cap_is_refused_unread(env, gguf):
    """A 1 GiB manifest (sparse: no disk) is refused from its size: the process reads next to nothing
    of it (counted by the kernel: /proc/self/io's rchar), where it read it whole before."""
    root = Path(env["OLLAMA_MODELS"])
    ollama_model(root, "good", gguf)
    blob = ollama_model(root, "huge", gguf)
    manifest = root / "manifests" / Path(*LIB, "huge", "latest")
    os.truncate(manifest, 1 << 30)
    io = Path("/proc/self/io")
    before = _rchar(io)
    with pytest.raises(pk.ModelLoadError, match=f"1073741824 bytes, more than the {limits.STORE_FILE_MAX_BYTES} "
                                                "a store's file may have \\(not read\\)"):
        local.resolve_ollama("huge")
    listed = {m.name: m for m in local.scan(("ollama",))}
    assert "not read" in (listed["ollama:huge:latest"].error or "") and listed["ollama:good:latest"].error is None
    if before is not None:
        read = _rchar(io) - before
        assert read < 16 << 20, f"{read} bytes read"
    assert blob.is_file()


def _rchar(io: Path) -> int | None:
    try:
        return int(next(ln for ln in io.read_text().splitlines() if ln.startswith("rchar:")).split()[1])
    except (OSError, StopIteration, ValueError):
        return None


def test_blob_that_links_to_itself(env, gguf):
    root = Path(env["OLLAMA_MODELS"])
    ollama_model(root, "good", gguf)
    blob = ollama_model(root, "loop", b"GGUF loop")
    blob.unlink()
    blob.symlink_to(blob.name)                                   # blobs/sha256-X -> sha256-X
    with pytest.raises(pk.ModelLoadError, match="its model blob .* cannot be read: Too many levels of symbolic "
                                                "links") as e:
        pk.Model("ollama:loop")
    assert "\n" not in str(e.value)
    listed = {m.name: m for m in local.scan(("ollama",))}
    assert "symbolic links" in (listed["ollama:loop:latest"].error or "")
    assert listed["ollama:good:latest"].error is None
    assert "symbolic links" in one_error_line(run_cli(["run", "ollama:loop", "-p", "x"], env=env, timeout=TIMEOUT))


# ---------------------------------------------------------------------------------------------
# FIFOs: never opened (an open for reading blocks until a writer comes)


def test_fifo_as_a_model_path(env, tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for cmd in (["run", str(fifo), "-p", "x"], ["inspect", str(fifo)], ["serve", str(fifo), "--port", "0"]):
        line = one_error_line(run_cli(cmd, env=env, timeout=TIMEOUT, input=""))
        assert f"{fifo} is a FIFO, not a GGUF file" in line, (cmd, line)
    with pytest.raises(pk.ModelLoadError, match="is a directory, not a GGUF file"):
        names.resolve(tmp_path)


def test_fifos_in_the_stores(env, gguf):
    """A FIFO as a blob, a manifest, LM Studio's home pointer and settings, a Hugging Face ref: the
    listing lists what it can (each broken Ollama entry with its line) and returns."""
    root = Path(env["OLLAMA_MODELS"])
    ollama_model(root, "good", gguf)
    blob = ollama_model(root, "fifoblob", b"GGUF fifo")
    blob.unlink()
    os.mkfifo(blob)
    ollama_model(root, "fifomanifest", gguf)
    manifest = root / "manifests" / Path(*LIB, "fifomanifest", "latest")
    manifest.unlink()
    os.mkfifo(manifest)
    home = Path(env["HOME"])
    os.mkfifo(home / ".lmstudio-home-pointer")
    (home / ".lmstudio").mkdir()
    os.mkfifo(home / ".lmstudio" / "settings.json")
    lms = home / ".lmstudio" / "models" / "pub" / "repo"
    lms.mkdir(parents=True)
    (lms / "m-Q8_0.gguf").write_bytes(gguf)
    repo = Path(env["HF_HUB_CACHE"]) / "models--tiny--fifo-GGUF"
    (repo / "refs").mkdir(parents=True)
    os.mkfifo(repo / "refs" / "main")
    snap = repo / "snapshots" / ("b" * 40)
    snap.mkdir(parents=True)
    (snap / "m-Q4_K_M.gguf").write_bytes(gguf)

    r = run_cli(["models", "--local", "--json"], env=env, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr
    got = {m["name"]: m for m in json.loads(r.stdout)["models"]}
    assert got["ollama:good:latest"]["error"] is None and got["ollama:good:latest"]["architecture"] == "llama"
    assert "is a FIFO, not a file" in got["ollama:fifoblob:latest"]["error"]
    assert "is a FIFO, not a file" in got["ollama:fifomanifest:latest"]["error"]
    assert got["lmstudio:pub/repo/m-Q8_0.gguf"]["architecture"] == "llama"
    assert got[f"tiny/fifo-GGUF@{'b' * 40}/m-Q4_K_M.gguf"]["architecture"] == "llama"
    line = one_error_line(run_cli(["inspect", "ollama:fifoblob"], env=env, timeout=TIMEOUT))
    assert "is a FIFO, not a file" in line
    line = one_error_line(run_cli(["inspect", "tiny/fifo-GGUF:Q4_K_M"], env=env, timeout=TIMEOUT))
    assert "refs/main (a ref of the Hugging Face cache) is a FIFO, not a file" in line
