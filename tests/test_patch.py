"""The patch series: applies to a fresh tree, is idempotent, reverses byte-for-byte, fails loudly."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from pyllama_kv import _paths
from pyllama_kv.harness import patch as P, vendor as V

PIN = V.Pin.load()


def _digest(tree: Path) -> dict:
    return {str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tree.rglob("*")) if p.is_file()}


def _copy_fingerprinted(pin: V.Pin, vdir: Path, t: Path) -> Path:
    """A copy at ``t`` of the parts of the tree ``vdir`` that ``pin``'s fingerprint covers."""
    for part in pin.fingerprint_paths:
        src = vdir / part
        if src.is_dir():
            shutil.copytree(src, t / part)
        else:
            (t / part).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, t / part)
    return t


@pytest.fixture
def fresh_tree(tmp_path) -> Path:
    """A pristine copy of the parts of the pinned tree the fingerprint covers (proven pristine)."""
    t = _copy_fingerprinted(PIN, _paths.vendor_dir(), tmp_path / "llama.cpp")
    P.reverse(t)
    assert V.fingerprint(t, PIN.fingerprint_paths) == PIN.fingerprint_sha256, "copy is not the pinned pristine tree"
    return t


def test_series_has_one_concern_each_with_a_header():
    series = P.series()
    assert [p.name[:4] for p in series] == [f"{i:04d}" for i in range(1, len(series) + 1)]
    assert len(series) >= 5
    for p in series:
        text = p.path.read_text()
        head = text.split("\ndiff --git", 1)[0]
        assert p.subject() and p.subject() != p.name
        for word in ("What:", "Why:", "How to see it:"):
            assert word in head, f"{p.name} header lacks {word!r}"


def test_series_applies_to_a_fresh_tree(fresh_tree):
    st = P.state(fresh_tree)
    assert st.n_applied == 0 and st.conflict is None
    applied = P.apply(fresh_tree)
    assert applied == [p.name for p in P.series()]
    st = P.state(fresh_tree)
    assert st.complete
    assert "llama_kv_self_stats" in (fresh_tree / "include" / "llama.h").read_text()


def test_reapplying_is_a_no_op(fresh_tree):
    P.apply(fresh_tree)
    before = _digest(fresh_tree)
    assert P.apply(fresh_tree) == []
    assert _digest(fresh_tree) == before


def test_a_patch_applied_outside_the_tool_is_recorded(fresh_tree):
    """The record of applied patches (what an sdist carries, and what undoes an edited series) says
    what the tree holds: a patch the tree holds but the record lacks (applied by hand while it was
    written) is recorded by the next apply, which applies nothing."""
    P.apply(fresh_tree)
    last = P.series()[-1]
    (fresh_tree / P.RECORD / last.name).unlink()
    assert P.apply(fresh_tree) == []
    assert [p.name for p in P._recorded(fresh_tree)] == [p.name for p in P.series()]


def test_reverse_restores_the_tree_byte_for_byte(fresh_tree):
    pristine = _digest(fresh_tree)
    P.apply(fresh_tree)
    assert _digest(fresh_tree) != pristine
    reversed_ = P.reverse(fresh_tree)
    assert reversed_ == [p.name for p in reversed(P.series())]
    assert _digest(fresh_tree) == pristine
    assert P.reverse(fresh_tree) == []


def test_partial_series_is_detected_and_completed(fresh_tree):
    series = P.series()
    P.apply(fresh_tree, series[:3])
    st = P.state(fresh_tree, series)
    assert st.n_applied == 3 and st.conflict is None
    assert st.applied == [True, True, True] + [False] * (len(series) - 3)
    assert P.apply(fresh_tree, series) == [p.name for p in series[3:]]
    assert P.state(fresh_tree, series).complete


def test_conflicting_patch_fails_with_its_name_and_changes_nothing(fresh_tree, tmp_path):
    series = P.series()
    # a patch of ours that no longer applies: a hunk against text that is not in the tree
    bad = tmp_path / "patches" / "0006-conflicting.patch"
    bad.parent.mkdir()
    for p in series:
        shutil.copy2(p.path, bad.parent / p.name)
    bad.write_text(
        "Subject: [PATCH] conflicting\n\nWhat: x\n---\n"
        "diff --git a/src/llama-context.cpp b/src/llama-context.cpp\n"
        "--- a/src/llama-context.cpp\n+++ b/src/llama-context.cpp\n"
        "@@ -1,3 +1,3 @@\n-this line is not in the file\n+replacement\n context that does not exist\n"
        " more context\n"
    )
    full = P.series(bad.parent)
    before = _digest(fresh_tree)
    with pytest.raises(P.PatchError) as ei:
        P.apply(fresh_tree, full)
    assert "0006-conflicting.patch" in str(ei.value)
    assert "src/llama-context.cpp" in str(ei.value)  # git names the file and hunk
    assert _digest(fresh_tree) == before, "a failed apply must leave the tree exactly as it was"
    with pytest.raises(P.PatchError):
        P.check(fresh_tree, full)


def test_hand_edited_tree_is_a_conflict(fresh_tree):
    P.apply(fresh_tree)
    f = fresh_tree / "src" / "llama-context.cpp"
    f.write_text(f.read_text().replace("ctx->decode(batch)", "ctx->decode(batch) /* edited */"))
    before = _digest(fresh_tree)
    st = P.state(fresh_tree)
    assert st.conflict is not None
    with pytest.raises(P.PatchError, match="does not match the series"):
        P.reverse(fresh_tree)
    assert _digest(fresh_tree) == before


def test_cli_patch_status_json(fresh_tree):
    import json

    from conftest import run_cli

    r = run_cli(["patch", "--status", "--json", "--tree", str(fresh_tree)])
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    n = len(P.series())
    assert [p["applied"] for p in doc["patches"]] == [False] * n
    r = run_cli(["patch", "--check", "--tree", str(fresh_tree)])
    assert r.returncode == 0 and f"{n} would apply" in r.stdout
    r = run_cli(["patch", "--tree", str(fresh_tree)])
    assert r.returncode == 0
    r = run_cli(["patch", "--status", "--json", "--tree", str(fresh_tree)])
    assert [p["applied"] for p in json.loads(r.stdout)["patches"]] == [True] * n


def test_an_edited_patch_replaces_the_old_version_on_apply(fresh_tree, tmp_path):
    """Edit a patch, run `patch` again: the old version (recorded at apply time) is reversed first."""
    P.apply(fresh_tree)
    d = tmp_path / "edited"
    d.mkdir()
    for p in P.series():
        shutil.copy2(p.path, d / p.name)
    p4 = next(d.glob("0004-*.patch"))
    text = p4.read_text()
    assert "// cells in the cache" in text
    p4.write_text(text.replace("// cells in the cache", "// cells in the KV cache"))
    edited = P.series(d)
    assert P.state(fresh_tree, edited).conflict is not None
    applied = P.apply(fresh_tree, edited)
    assert applied == [p.name for p in edited]
    assert "// cells in the KV cache" in (fresh_tree / "include" / "llama.h").read_text()
    assert P.state(fresh_tree, edited).complete
    P.reverse(fresh_tree, edited)
    assert V.fingerprint(fresh_tree, PIN.fingerprint_paths) == PIN.fingerprint_sha256


# ---------------------------------------------------------------------------------------------
# the current pin's series (patches/current/): the same machinery, with zero patches and with one

CURRENT = V.Pin.load(name="current")


def _throwaway_patch(tree: Path, patches: Path, name: str = "0001-throwaway.patch") -> Path:
    """A one-concern patch with our header that adds a line to ``tree``'s include/llama.h, made by git."""
    import subprocess

    work = patches.parent / "diff-work"
    for side in ("a", "b"):
        (work / side / "include").mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / "include" / "llama.h", work / side / "include" / "llama.h")
    b = work / "b" / "include" / "llama.h"
    lines = b.read_text().splitlines(keepends=True)
    b.write_text("".join(lines[:1] + ["// a throwaway line of a test patch\n"] + lines[1:]))
    diff = subprocess.run(["git", "diff", "--no-index", "--no-prefix", "a/include/llama.h", "b/include/llama.h"],
                          cwd=work, capture_output=True, text=True)
    assert diff.returncode == 1 and "diff --git a/include/llama.h b/include/llama.h" in diff.stdout, diff.stderr
    patches.mkdir(parents=True, exist_ok=True)
    p = patches / name
    p.write_text("Subject: [PATCH] a throwaway line in llama.h\n\nWhat: adds a comment line.\nWhy: a test.\n"
                 "How to see it: grep the line.\n---\n" + diff.stdout)
    shutil.rmtree(work)
    return p


@pytest.fixture
def current_tree(tmp_path) -> Path:
    """A pristine copy of the parts of the current pin's tree its fingerprint covers (proven pristine)."""
    t = _copy_fingerprinted(CURRENT, _paths.vendor_dir(pin="current"), tmp_path / "llama.cpp-current")
    P.reverse(t, P.series(_paths.patches_dir(pin="current")))
    assert V.fingerprint(t, CURRENT.fingerprint_paths) == CURRENT.fingerprint_sha256, "not the pristine current tree"
    return t


def test_current_series_follows_the_same_header_rules():
    d = _paths.patches_dir(pin="current")
    assert d.is_dir() and d == _paths.patches_dir() / "current"
    series = P.series(d)
    assert [p.name[:4] for p in series] == [f"{i:04d}" for i in range(1, len(series) + 1)]
    for p in series:
        head = p.path.read_text().split("\ndiff --git", 1)[0]
        assert p.subject() and p.subject() != p.name
        for word in ("What:", "Why:", "How to see it:"):
            assert word in head, f"{p.name} header lacks {word!r}"
    # the mission series is patches/0*.patch only: the current pin's files are not part of it
    assert not [p for p in P.series() if p.path.parent != _paths.patches_dir()]


def test_an_empty_series_is_complete_and_changes_nothing(current_tree):
    before = _digest(current_tree)
    st = P.state(current_tree, [])
    assert st.complete and st.n_applied == 0 and st.conflict is None and st.applied == []
    assert P.check(current_tree, []).complete
    assert P.apply(current_tree, []) == [] and P.reverse(current_tree, []) == []
    assert _digest(current_tree) == before and not (current_tree / P.RECORD).exists()


def test_a_one_patch_series_applies_reverses_and_fails_loudly(current_tree, tmp_path):
    series = P.series(tmp_path / "series")  # none yet
    assert series == []
    _throwaway_patch(current_tree, tmp_path / "series")
    series = P.series(tmp_path / "series")
    pristine = _digest(current_tree)
    st = P.state(current_tree, series)
    assert (st.n_applied, st.conflict, st.complete) == (0, None, False)
    assert P.apply(current_tree, series) == ["0001-throwaway.patch"]
    assert "a throwaway line" in (current_tree / "include" / "llama.h").read_text()
    assert P.state(current_tree, series).complete and P.apply(current_tree, series) == []
    assert P.reverse(current_tree, series) == ["0001-throwaway.patch"]
    assert _digest(current_tree) == pristine
    # a hand edit where the patch goes: a conflict named after the patch, the tree left as it is
    h = current_tree / "include" / "llama.h"
    lines = h.read_text().splitlines(keepends=True)
    h.write_text("".join(lines[:1] + ["// edited by hand\n"] + lines[1:]))
    edited = _digest(current_tree)
    with pytest.raises(P.PatchError, match="0001-throwaway.patch"):
        P.apply(current_tree, series)
    with pytest.raises(P.PatchError, match="0001-throwaway.patch"):
        P.check(current_tree, series)
    assert _digest(current_tree) == edited


def _current_root(tmp_path) -> Path:
    """A checkout root (for $PYLLAMA_KV_ROOT) with the current pin, a small current tree and no series."""
    root = tmp_path / "proj"
    (root / "vendor").mkdir(parents=True)
    shutil.copy2(_paths.pin_path(pin="current"), root / "vendor" / "current.pin.json")
    tree = root / "vendor" / "llama.cpp-current"
    (tree / "include").mkdir(parents=True)
    shutil.copy2(_paths.vendor_dir(pin="current") / "include" / "llama.h", tree / "include" / "llama.h")
    (root / "patches" / "current").mkdir(parents=True)
    return root


def test_cli_patch_pin_current_with_zero_and_one_patch(tmp_path):
    import json

    from conftest import run_cli

    root = _current_root(tmp_path)
    env = {"PYLLAMA_KV_ROOT": str(root)}
    tree = root / "vendor" / "llama.cpp-current"

    def cli(*args):
        return run_cli(["patch", "--pin", "current", *args], env=env)

    r = cli("--status", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert (doc["pin"], doc["tree"], doc["patches"], doc["conflict"]) == ("current", str(tree), [], None)
    r = cli("--status")
    assert r.returncode == 0 and "no patches in" in r.stdout
    assert cli().returncode == 0 and cli("--check").returncode == 0

    _throwaway_patch(tree, root / "patches" / "current")
    r = cli("--check")
    assert r.returncode == 0 and "1 would apply cleanly: 0001-throwaway.patch" in r.stdout
    r = cli("--json")
    assert r.returncode == 0 and json.loads(r.stdout)["applied"] == ["0001-throwaway.patch"]
    r = cli("--status", "--json")
    assert [(p["name"], p["applied"]) for p in json.loads(r.stdout)["patches"]] == [("0001-throwaway.patch", True)]
    r = cli("--reverse", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["reversed"] == ["0001-throwaway.patch"]
    (tree / "include" / "llama.h").write_text("// not the file the patch was made for\n")
    r = cli("--status")
    assert r.returncode == 1 and "conflict at 0001-throwaway.patch" in r.stdout
    r = cli()
    assert r.returncode != 0 and "0001-throwaway.patch" in r.stderr and "Traceback" not in r.stderr


def test_the_peer_builds_from_the_current_tree_without_its_series(tmp_path, monkeypatch):
    """`build --peer` uses the current pin's tree itself while it holds none of the series, and an
    unpatched copy once it holds some: the peer is never patched."""
    from pyllama_kv.harness import peer

    root = _current_root(tmp_path)
    tree = root / "vendor" / "llama.cpp-current"
    (tree / V.MARKER).write_text('{"revision": "0c1e57098"}')
    monkeypatch.setenv("PYLLAMA_KV_CACHE", str(tmp_path / "cache"))
    assert peer._pristine_tree(CURRENT, root, log=lambda m: None) == tree
    _throwaway_patch(tree, root / "patches" / "current")
    series = P.series(root / "patches" / "current")
    pristine = (tree / "include" / "llama.h").read_bytes()
    P.apply(tree, series)
    # source directories named models stay in the copy (the current tree builds src/models and
    # tools/mtmd/models); only the top level's vocabulary files are left out
    for d in ("models", "src/models", "tools/mtmd/models"):
        (tree / d).mkdir(parents=True, exist_ok=True)
        (tree / d / "models.h").write_text("// " + d + "\n")
    copy = peer._pristine_tree(CURRENT, root, log=lambda m: None)
    assert copy == tmp_path / "cache" / "peer" / "0c1e57098" / "src"
    assert P.state(copy, series).n_applied == 0 and P.state(tree, series).complete
    assert (copy / "include" / "llama.h").read_bytes() == pristine
    assert (copy / "src/models/models.h").is_file() and (copy / "tools/mtmd/models/models.h").is_file()
    assert not (copy / "models").exists()


def test_every_file_the_series_touches_is_in_the_pin_fingerprint():
    """The pristine check (vendor, reverse, the fixtures above) covers the fingerprint's paths only: a
    patch outside them (0015 edits ggml-cuda) would apply unchecked. Every path a patch names is inside."""
    import re

    for patch in P.series():
        for path in re.findall(r"^diff --git a/(\S+) b/", patch.path.read_text(), flags=re.M):
            assert any(path == fp or path.startswith(fp + "/") for fp in PIN.fingerprint_paths), (patch.name, path)
