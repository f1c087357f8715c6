"""Apply, check, detect and reverse our patch series on a llama.cpp tree (`pyllama-kv patch`).

The series is ``patches/0*.patch``, applied in name order with ``git apply`` (which works outside
a git repository). The series is treated as a stack: a tree holds the first *k* patches, for some
k. Detection runs on a scratch copy of the files the series touches:

* *k* is the first patch that ``git apply --check`` accepts (the earlier ones are applied);
* the guess is proven by forward-applying k..n-1 in order, then reverse-applying the whole series.

Anything else (a patch that neither applies nor reverses, a hand-edited file) is a conflict, reported
with the patch's name and git's words about the hunk. Every write to the real tree is first done on
the scratch copy, so a failure leaves the tree exactly as it was.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import _paths
from ..errors import HarnessError


class PatchError(HarnessError):
    """A patch does not apply (or reverse). The tree was not changed."""

    def __init__(self, message: str, patch: str | None = None, detail: str = ""):
        super().__init__(message + (f"\n{detail}" if detail else ""))
        self.patch = patch
        self.detail = detail


@dataclass(frozen=True)
class Patch:
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    def files(self) -> list[str]:
        """Paths (relative to the tree) that this patch touches."""
        out: list[str] = []
        for line in self.path.read_text(errors="replace").splitlines():
            m = re.match(r"^diff --git a/(\S+) b/(\S+)", line)
            if m:
                out.extend({m.group(1), m.group(2)})
        return out

    def subject(self) -> str:
        for line in self.path.read_text(errors="replace").splitlines():
            if line.startswith("Subject:"):
                return re.sub(r"^Subject:\s*(\[PATCH[^\]]*\]\s*)?", "", line).strip()
        return self.name


def series(patches_dir: Path | None = None) -> list[Patch]:
    d = Path(patches_dir) if patches_dir else _paths.patches_dir()
    return [Patch(p) for p in sorted(d.glob("[0-9]*.patch"))]


def _git_apply(tree: Path, patch: Patch, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # never let git discover an enclosing repository (ours): plain "better patch" mode
    env["GIT_CEILING_DIRECTORIES"] = str(Path(tree).resolve().parent)
    for var in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE"):
        env.pop(var, None)
    return subprocess.run(
        ["git", "apply", "--whitespace=nowarn", *args, str(patch.path.resolve())],
        cwd=tree, env=env, capture_output=True, text=True,
    )


def _detail(proc: subprocess.CompletedProcess) -> str:
    return "\n".join("    " + ln for ln in (proc.stderr or proc.stdout).strip().splitlines())


class _Scratch:
    """A scratch copy of the files a series touches, to try applies without touching the tree."""

    def __init__(self, tree: Path, patches: list[Patch]):
        self.tree = Path(tree)
        self.dir = Path(tempfile.mkdtemp(prefix="pyllama-kv-patch-"))
        self.root = self.dir / "tree"
        self.root.mkdir()
        files = sorted({f for p in patches for f in p.files()})
        for rel in files:
            src = self.tree / rel
            if src.is_file():
                dst = self.root / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> _Scratch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class SeriesState:
    patches: list[Patch]
    n_applied: int          # how many of the first patches are applied (valid when not conflict)
    conflict: str | None    # patch name that breaks the stack model, or None
    detail: str = ""

    @property
    def applied(self) -> list[bool]:
        return [i < self.n_applied and self.conflict is None for i in range(len(self.patches))]

    @property
    def complete(self) -> bool:
        return self.conflict is None and self.n_applied == len(self.patches)


def state(tree: Path | None = None, patches: list[Patch] | None = None) -> SeriesState:
    """Which patches of the series the tree holds (see the module docstring)."""
    tree = Path(tree) if tree else _paths.vendor_dir()
    patches = series() if patches is None else patches
    if not tree.is_dir():
        raise PatchError(f"{tree} does not exist: run `pyllama-kv vendor` first")
    with _Scratch(tree, patches) as s:
        k = len(patches)
        for i, p in enumerate(patches):
            if _git_apply(s.root, p, "--check").returncode == 0:
                k = i
                break
        # prove it: the rest apply in order, then the whole series reverses (last first)
        for i in range(k, len(patches)):
            proc = _git_apply(s.root, patches[i])
            if proc.returncode != 0:
                return SeriesState(patches, k, patches[i].name, _detail(proc))
        for i in range(len(patches) - 1, -1, -1):
            proc = _git_apply(s.root, patches[i], "--reverse")
            if proc.returncode != 0:
                return SeriesState(patches, k, patches[i].name, _detail(proc))
    return SeriesState(patches, k, None)


def _apply_all(tree: Path, todo: list[Patch], reverse: bool) -> None:
    args = ("--reverse",) if reverse else ()
    verb = "reverse" if reverse else "apply"
    # rehearse the whole run on a scratch copy first: a failure must leave the tree untouched
    with _Scratch(tree, todo) as s:
        for p in todo:
            proc = _git_apply(s.root, p, *args)
            if proc.returncode != 0:
                raise PatchError(f"patch {p.name} does not {verb} cleanly; the tree was not changed", p.name,
                                 _detail(proc))
    done: list[Patch] = []
    for p in todo:
        proc = _git_apply(tree, p, *args)
        if proc.returncode != 0:  # should not happen after the rehearsal; undo what we did
            undo = () if reverse else ("--reverse",)
            for q in reversed(done):
                _git_apply(tree, q, *undo)
            raise PatchError(f"patch {p.name} failed to {verb}; the tree was restored", p.name, _detail(proc))
        done.append(p)


def _require_consistent(st: SeriesState) -> None:
    if st.conflict:
        raise PatchError(
            f"the tree does not match the series at patch {st.conflict} (hand edits, or a patch that no longer "
            f"applies to this revision); the tree was not changed",
            st.conflict, st.detail,
        )


RECORD = ".pyllama-kv-applied"


def _recorded(tree: Path) -> list[Patch]:
    """The patches this tool applied to ``tree`` last time, as they were then."""
    d = Path(tree) / RECORD
    return [Patch(p) for p in sorted(d.glob("[0-9]*.patch"))] if d.is_dir() else []


def _record(tree: Path, applied: list[Patch]) -> None:
    d = Path(tree) / RECORD
    if d.exists():
        shutil.rmtree(d)
    if applied:
        d.mkdir()
        for p in applied:
            shutil.copy2(p.path, d / p.name)


def _record_matches(tree: Path, held: list[Patch]) -> bool:
    """Whether the record of ``tree`` is exactly ``held``: the same patches, byte for byte."""
    rec = _recorded(tree)
    return [p.name for p in rec] == [p.name for p in held] and \
        all(a.path.read_bytes() == b.path.read_bytes() for a, b in zip(rec, held))


def _undo_changed_series(tree: Path, st: SeriesState) -> bool:
    """If the tree holds an older version of the series (a patch was edited since), reverse it with
    the recorded copies. Returns True if it did."""
    if not st.conflict:
        return False
    old = _recorded(tree)
    if not old:
        return False
    ost = state(tree, old)
    if ost.conflict or not ost.complete:
        return False
    _apply_all(tree, list(reversed(old)), reverse=True)
    _record(tree, [])
    return True


def apply(tree: Path | None = None, patches: list[Patch] | None = None) -> list[str]:
    """Apply the patches the tree does not hold yet; return their names (empty: nothing to do).

    When the tree holds an older version of the series (recorded at the last apply), that version is
    reversed first, so editing a patch and re-running is enough.
    """
    tree = Path(tree) if tree else _paths.vendor_dir()
    patches = series() if patches is None else patches
    st = state(tree, patches)
    if _undo_changed_series(tree, st):
        st = state(tree, patches)
    _require_consistent(st)
    todo = patches[st.n_applied:]
    if todo:
        _apply_all(tree, todo, reverse=False)
    # the record says what the tree holds, however it came to hold it (a patch applied by hand while
    # it was written is found applied by the reverse-check, and recorded here)
    held = patches[: st.n_applied + len(todo)]
    if todo or not _record_matches(tree, held):
        _record(tree, held)
    return [p.name for p in todo]


def check(tree: Path | None = None, patches: list[Patch] | None = None) -> SeriesState:
    """Would the rest of the series apply? Raises PatchError if not; changes nothing."""
    tree = Path(tree) if tree else _paths.vendor_dir()
    patches = series() if patches is None else patches
    st = state(tree, patches)
    _require_consistent(st)
    return st


def reverse(tree: Path | None = None, patches: list[Patch] | None = None) -> list[str]:
    """Reverse the applied patches (last first); return their names."""
    tree = Path(tree) if tree else _paths.vendor_dir()
    patches = series() if patches is None else patches
    st = state(tree, patches)
    old = [p.name for p in reversed(_recorded(tree))]
    if _undo_changed_series(tree, st):
        return old
    _require_consistent(st)
    todo = list(reversed(patches[: st.n_applied]))
    if todo:
        _apply_all(tree, todo, reverse=True)
    _record(tree, [])
    return [p.name for p in todo]
