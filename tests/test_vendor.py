"""The vendor step: verified, defensive unpacking that never damages an existing tree."""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from pyllama_kv.harness import vendor as V

SUB = "pkg-1.0/vendor/llama.cpp"


def _tar(path: Path, members: list[tuple], gz: bool = True) -> Path:
    """members: (name, bytes) for files, (name, None, linkname) for symlinks, (name, "hard", target)."""
    with tarfile.open(path, "w:gz" if gz else "w") as tf:
        for m in members:
            name = m[0]
            if len(m) == 2:
                data = m[1]
                ti = tarfile.TarInfo(name)
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
            elif m[1] is None:
                ti = tarfile.TarInfo(name)
                ti.type = tarfile.SYMTYPE
                ti.linkname = m[2]
                tf.addfile(ti)
            else:
                ti = tarfile.TarInfo(name)
                ti.type = tarfile.LNKTYPE
                ti.linkname = m[2]
                tf.addfile(ti)
    return path


def _good_members(extra: list[tuple] = ()) -> list[tuple]:
    return [
        (f"{SUB}/include/llama.h", b"// llama.h\n"),
        (f"{SUB}/src/llama.cpp", b"// src\n"),
        (f"{SUB}/CMakeLists.txt", b"project(x)\n"),
        (f"{SUB}/.git", b"gitdir: ../../.git/modules/vendor/llama.cpp\n"),
        ("pkg-1.0/other/file.txt", b"not taken\n"),
        *extra,
    ]


def _fp_of(members) -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for name, data in [m for m in members if len(m) == 2 and m[0].startswith(SUB + "/")]:
            rel = name[len(SUB) + 1:]
            if rel == ".git":
                continue
            p = Path(d) / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        return V.fingerprint(Path(d), ["CMakeLists.txt", "include", "src"])


@pytest.fixture
def dest(tmp_path) -> Path:
    """An existing vendor tree that every failure must leave untouched."""
    d = tmp_path / "vendor" / "llama.cpp"
    (d / "include").mkdir(parents=True)
    (d / "include" / "llama.h").write_text("// the existing tree\n")
    return d


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _install(archive: Path, dest: Path, sha: str | None, fp: str | None):
    marker = {"revision": "test"}
    fingerprint = (("CMakeLists.txt", "include", "src"), fp) if fp else None
    return V.install_tree(archive, SUB, dest, fingerprint, marker, expected_sha256=sha)


def test_good_archive_installs_only_the_subdir_and_drops_git_file(tmp_path, dest):
    members = _good_members()
    a = _tar(tmp_path / "a.tar.gz", members)
    n = _install(a, dest, V.sha256_file(a), _fp_of(members))
    assert n == 3
    assert (dest / "include" / "llama.h").read_bytes() == b"// llama.h\n"
    assert not (dest / ".git").exists() and not (dest / "other").exists()
    assert json.loads((dest / V.MARKER).read_text())["revision"] == "test"
    assert not list(dest.parent.glob(".llama.cpp.*")), "temporary dirs left behind"


def test_wrong_hash_is_refused_and_tree_untouched(tmp_path, dest):
    a = _tar(tmp_path / "a.tar.gz", _good_members())
    before = _snapshot(dest)
    with pytest.raises(V.VendorError, match="sha256 mismatch"):
        _install(a, dest, "0" * 64, None)
    assert _snapshot(dest) == before


def test_truncated_archive_is_refused_and_tree_untouched(tmp_path, dest):
    big = [(f"{SUB}/src/big{i}.bin", bytes(range(256)) * 400) for i in range(8)]
    a = _tar(tmp_path / "a.tar", _good_members(big), gz=False)
    t = tmp_path / "t.tar"
    t.write_bytes(a.read_bytes()[: a.stat().st_size // 2])
    before = _snapshot(dest)
    with pytest.raises(V.VendorError, match="truncated|corrupt|not a readable"):
        _install(t, dest, None, None)
    assert _snapshot(dest) == before
    # gzip truncated too
    g = _tar(tmp_path / "g.tar.gz", _good_members(big))
    tg = tmp_path / "tg.tar.gz"
    tg.write_bytes(g.read_bytes()[: g.stat().st_size // 2])
    with pytest.raises(V.VendorError, match="truncated|corrupt|not a readable"):
        _install(tg, dest, None, None)
    assert _snapshot(dest) == before


@pytest.mark.parametrize("evil", [
    (f"{SUB}/../../../escape.txt", b"x"),
    (f"{SUB}/src/../../../../escape.txt", b"x"),
    (f"{SUB}/link", None, "/etc/passwd"),
    (f"{SUB}/src/link", None, "../../../../outside"),
    (f"{SUB}/hard", "hard", "/etc/passwd"),
])
def test_paths_or_links_escaping_the_target_are_refused(tmp_path, dest, evil):
    a = _tar(tmp_path / "evil.tar.gz", _good_members([evil]))
    before = _snapshot(dest)
    with pytest.raises(V.VendorError, match="unsafe"):
        _install(a, dest, None, None)
    assert _snapshot(dest) == before
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path.parent / "escape.txt").exists()


def test_a_tree_that_is_not_the_pinned_revision_is_refused(tmp_path, dest):
    a = _tar(tmp_path / "a.tar.gz", _good_members())
    before = _snapshot(dest)
    with pytest.raises(V.VendorError, match="not the pinned revision"):
        _install(a, dest, None, "f" * 64)
    assert _snapshot(dest) == before


def test_missing_subdir_is_refused(tmp_path, dest):
    a = _tar(tmp_path / "a.tar.gz", [("elsewhere/include/llama.h", b"x")])
    with pytest.raises(V.VendorError):
        _install(a, dest, None, None)


def test_not_an_archive(tmp_path, dest):
    p = tmp_path / "x.tar.gz"
    p.write_bytes(b"this is not a tarball")
    with pytest.raises(V.VendorError, match="not a readable"):
        _install(p, dest, None, None)


def test_source_tarball_prefix_detection(tmp_path):
    a = _tar(tmp_path / "src.tar.gz", [("llama.cpp-8733e0c/include/llama.h", b"x"),
                                        ("llama.cpp-8733e0c/src/a.cpp", b"y"),
                                        ("llama.cpp-8733e0c/examples/llama.swiftui/include/llama.h", b"z")])
    assert V._find_tree_prefix(a) == "llama.cpp-8733e0c"


@pytest.mark.parametrize("name", ["mission", "current"])
def test_pin_file_is_consistent(name):
    """The pin's hashes are the real ones, recomputed here without vendor.py: its sha256 is that of
    the cached archive, and its fingerprint that of the archive's llama.cpp tree, read straight from
    the tarball (the pristine tree: our patches are never in the archive)."""
    from pyllama_kv import _paths

    raw = json.loads(_paths.pin_path(pin=name).read_text())
    src, fp = raw["source"], raw["fingerprint"]
    pin = V.Pin.load(name=name)
    assert (pin.revision, pin.sha256, pin.subdir, pin.fingerprint_paths, pin.fingerprint_sha256) == (
        raw["revision"], src["sha256"], src["subdir"], tuple(fp["paths"]), fp["sha256"])
    # the mission pin names the full hash; the current one the short hash its sdist names
    assert len(pin.revision) == (40 if name == "mission" else 9) and int(pin.revision, 16) >= 0
    assert src["filename"] == f"{src['package'].replace('-', '_')}-{src['version']}.tar.gz"

    archive = V.cached_archive(pin)
    if not archive.is_file():
        pytest.fail(f"the pinned archive is not cached at {archive}: run `make setup` (pyllama-kv vendor --pin {name})")
    h = hashlib.sha256()
    with open(archive, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    assert h.hexdigest() == src["sha256"], "the pin's sha256 is not that of the archive it names"

    prefix = src["subdir"].strip("/") + "/"
    lines = []
    with tarfile.open(archive, "r:gz") as tf:
        for m in tf:
            if not (m.isfile() and m.name.startswith(prefix)):
                continue
            rel = m.name[len(prefix):]
            if any(rel == p or rel.startswith(p + "/") for p in fp["paths"]):
                lines.append(f"{hashlib.sha256(tf.extractfile(m).read()).hexdigest()}  {rel}\n")
    assert any(ln.endswith("  include/llama.h\n") for ln in lines), f"no {prefix}include/llama.h in the archive"
    assert hashlib.sha256("".join(sorted(lines)).encode()).hexdigest() == fp["sha256"], \
        "the pin's fingerprint is not that of the archive's tree"


def test_one_pin_file_for_the_current_llama_cpp():
    """The current pin and the peer's llama-server share one pin file (no second copy to drift)."""
    from pyllama_kv import _paths
    from pyllama_kv.harness import peer

    root = _paths.checkout_root()
    assert not (root / "vendor" / "peer.pin.json").exists()
    assert peer.peer_pin_path() == _paths.pin_path(pin="current") == root / "vendor" / "current.pin.json"
    assert _paths.vendor_dir(pin="current") == root / "vendor" / "llama.cpp-current"
    assert _paths.patches_dir(pin="current") == root / "patches" / "current"
    mission, current = V.Pin.load(), V.Pin.load(name="current")
    assert (mission.name, current.name) == ("mission", "current")
    assert current.filename != mission.filename and current.revision != mission.revision
    with pytest.raises(V.VendorError, match="unknown pin"):
        V.Pin.load(name="newest")


@pytest.mark.parametrize("name", ["mission", "current"])
def test_vendored_tree_is_the_pinned_revision_and_cached(name):
    """The real vendor dir came from the pinned, cached archive; the pristine fingerprint matches
    once our patches are taken out (checked on a copy in test_patch.py)."""
    from pyllama_kv import _paths

    pin = V.Pin.load(name=name)
    marker = V.read_marker(_paths.vendor_dir(pin=name))
    assert marker and marker["revision"] == pin.revision and marker["fingerprint"] == pin.fingerprint_sha256
    cached = V.cached_archive(pin)
    assert cached.is_file() and V.sha256_file(cached) == pin.sha256


def test_vendor_again_is_a_no_op_without_network():
    """A second `vendor` uses what is there: it must not download (no pip is run)."""
    from conftest import run_cli

    r = run_cli(["vendor", "--json"], env={"PIP_INDEX_URL": "http://127.0.0.1:9/nowhere", "PIP_NO_INDEX": "1"})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["changed"] is False
    r = run_cli(["vendor", "--pin", "all", "--json"],
                env={"PIP_INDEX_URL": "http://127.0.0.1:9/nowhere", "PIP_NO_INDEX": "1"})
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["pin"], x["changed"]) for x in rows] == [("mission", False), ("current", False)]
    assert rows[1]["path"].endswith("vendor/llama.cpp-current") and rows[1]["revision"] == "0c1e57098"


def test_real_archive_from_cache_unpacks_to_the_pinned_tree(tmp_path, monkeypatch):
    """The whole pipeline on the real pinned sdist, offline: cache hit (pip never runs), sha256,
    safe extraction, fingerprint of the pristine tree. (The current pin's archive goes the same way in
    test_current_pin_unpacks_beside_the_mission_tree_from_the_cache_alone: unpacking it twice cost 8 s.)"""
    pin = V.Pin.load()

    def no_pip(*a, **k):
        raise AssertionError("fetch() ran a subprocess although the archive is cached")

    monkeypatch.setattr(V.subprocess, "run", no_pip)
    archive = V.fetch(pin, log=lambda m: None)
    dest = tmp_path / "llama.cpp"
    n = V.install_tree(archive, pin.subdir, dest, (pin.fingerprint_paths, pin.fingerprint_sha256),
                       {"revision": pin.revision}, expected_sha256=pin.sha256)
    assert n > 1000
    assert (dest / "include" / "llama.h").is_file() and not (dest / ".git").exists()


def _current_root(tmp_path, **pin_changes) -> Path:
    """A project root with the current pin (``pin_changes`` rewrite its fields: sha256, fingerprint)
    and an existing current tree that every failure must leave as it is."""
    from pyllama_kv import _paths

    root = tmp_path / "proj"
    (root / "vendor").mkdir(parents=True)
    raw = json.loads(_paths.pin_path(pin="current").read_text())
    if "sha256" in pin_changes:
        raw["source"]["sha256"] = pin_changes["sha256"]
    if "fingerprint" in pin_changes:
        raw["fingerprint"]["sha256"] = pin_changes["fingerprint"]
    (root / "vendor" / "current.pin.json").write_text(json.dumps(raw))
    existing = root / "vendor" / "llama.cpp-current"
    (existing / "include").mkdir(parents=True)
    (existing / "include" / "llama.h").write_text("// keep me\n")
    return root


def _cache_with_the_real_archive(tmp_path, monkeypatch) -> Path:
    """A cache of its own holding (a link to) the real current archive, whose path it returns; pip may
    not run."""
    pin = V.Pin.load(name="current")
    real = V.cached_archive(pin)
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    (cache / "downloads" / pin.filename).symlink_to(real)
    monkeypatch.setenv("PYLLAMA_KV_CACHE", str(cache))

    def no_pip(args, dest, log):
        return 1, ["ERROR: no network in this test"]

    monkeypatch.setattr(V, "pip_download", no_pip)
    return real


def test_current_pin_with_a_wrong_hash_is_refused_and_the_tree_untouched(tmp_path, monkeypatch):
    real = _cache_with_the_real_archive(tmp_path, monkeypatch)
    root = _current_root(tmp_path, sha256="0" * 64)
    existing = root / "vendor" / "llama.cpp-current"
    before = _snapshot(existing)
    # the cached file does not have the pinned hash: it is dropped and fetched again, which fails here
    with pytest.raises(V.VendorError, match="pip could not download"):
        V.vendor(root=root, pin_name="current", log=lambda m: None)
    assert _snapshot(existing) == before
    pin = V.Pin.load(name="current")
    with pytest.raises(V.VendorError, match="sha256 mismatch"):
        V.install_tree(real, pin.subdir, existing, None, {}, expected_sha256="0" * 64)
    assert _snapshot(existing) == before


def test_current_pin_with_a_wrong_fingerprint_is_refused_and_the_tree_untouched(tmp_path, monkeypatch):
    _cache_with_the_real_archive(tmp_path, monkeypatch)
    root = _current_root(tmp_path, fingerprint="f" * 64)
    existing = root / "vendor" / "llama.cpp-current"
    before = _snapshot(existing)
    with pytest.raises(V.VendorError, match="not the pinned revision 0c1e57098"):
        V.vendor(root=root, pin_name="current", log=lambda m: None)
    assert _snapshot(existing) == before
    assert not list((root / "vendor").glob(".llama.cpp.*"))


def test_current_pin_unpacks_beside_the_mission_tree_from_the_cache_alone(tmp_path, monkeypatch):
    _cache_with_the_real_archive(tmp_path, monkeypatch)
    root = _current_root(tmp_path)
    res = V.vendor(root=root, pin_name="current", log=lambda m: None)
    tree = root / "vendor" / "llama.cpp-current"
    assert res.changed and res.pin == "current" and res.path == tree
    marker = V.read_marker(tree)
    assert marker["pin"] == "current" and marker["revision"] == "0c1e57098"
    pin = V.Pin.load(name="current")
    assert V.fingerprint(tree, pin.fingerprint_paths) == pin.fingerprint_sha256
    assert not (root / "vendor" / "llama.cpp").exists()           # the mission tree is not touched
    again = V.vendor(root=root, pin_name="current", log=lambda m: None)
    assert not again.changed


def _mini_root(tmp_path) -> Path:
    """A project root with our pin and no vendor tree yet."""
    from pyllama_kv import _paths

    root = tmp_path / "proj"
    (root / "vendor").mkdir(parents=True)
    (root / "vendor" / "llama.cpp.pin.json").write_bytes(_paths.pin_path().read_bytes())
    return root


def test_source_dir_at_the_pinned_revision_is_accepted(tmp_path, builds):
    """`vendor --source DIR`: the vanilla build's source copy is the pristine pinned tree."""
    src = Path(builds[("vanilla", "cpu")]["dir"]).parent / "src-vanilla" / "llama.cpp"
    root = _mini_root(tmp_path)
    res = V.vendor(source=src, root=root, log=lambda m: None)
    assert res.changed and (root / "vendor" / "llama.cpp" / "include" / "llama.h").is_file()
    assert V.read_marker(root / "vendor" / "llama.cpp")["source"] == str(src.resolve())


def test_source_dir_of_another_revision_is_refused_and_changes_nothing(tmp_path, builds):
    import shutil

    src = Path(builds[("vanilla", "cpu")]["dir"]).parent / "src-vanilla" / "llama.cpp"
    other = tmp_path / "other"
    for part in ("CMakeLists.txt", "include", "src", "ggml/include"):
        s = src / part
        (other / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(s, other / part) if s.is_dir() else shutil.copy2(s, other / part)
    (other / "src" / "llama.cpp").write_text("// a different revision\n")
    root = _mini_root(tmp_path)
    existing = root / "vendor" / "llama.cpp"
    (existing / "include").mkdir(parents=True)
    (existing / "include" / "llama.h").write_text("// keep me\n")
    before = _snapshot(existing)
    with pytest.raises(V.VendorError, match="not the pinned revision"):
        V.vendor(source=other, root=root, log=lambda m: None)
    assert _snapshot(existing) == before
    assert not list((root / "vendor").glob(".llama.cpp.*"))


def test_download_with_a_wrong_hash_is_refused_and_not_cached(tmp_path, monkeypatch):
    """fetch() runs pip; what pip saved must match the pinned sha256 before it enters the cache."""
    import dataclasses

    monkeypatch.setenv("PYLLAMA_KV_CACHE", str(tmp_path / "cache"))
    pin = dataclasses.replace(V.Pin.load(), filename="fake-1.0.tar.gz", sha256="0" * 64)

    class FakePip:
        def __init__(self, cmd, **kw):
            dest = Path(cmd[cmd.index("-d") + 1])
            (dest / "fake-1.0.tar.gz").write_bytes(b"not what was pinned")
            self.stdout = iter(["Collecting fake==1.0\n", "Saved ./fake-1.0.tar.gz\n"])

        def wait(self):
            return 0

    monkeypatch.setattr(V.subprocess, "Popen", FakePip)
    logs = []
    with pytest.raises(V.VendorError, match="sha256 mismatch"):
        V.fetch(pin, log=logs.append)
    assert not (tmp_path / "cache" / "downloads" / "fake-1.0.tar.gz").exists()
    assert any("pip: Collecting" in m for m in logs)


def test_failed_download_says_what_to_do(tmp_path, monkeypatch):
    import dataclasses

    monkeypatch.setenv("PYLLAMA_KV_CACHE", str(tmp_path / "cache"))
    pin = dataclasses.replace(V.Pin.load(), filename="fake-1.0.tar.gz")

    class FailingPip:
        def __init__(self, cmd, **kw):
            self.stdout = iter(["ERROR: Could not find a version that satisfies the requirement\n"])

        def wait(self):
            return 1

    monkeypatch.setattr(V.subprocess, "Popen", FailingPip)
    with pytest.raises(V.VendorError, match="--source PATH") as ei:
        V.fetch(pin, log=lambda m: None)
    assert "Could not find a version" in str(ei.value)
