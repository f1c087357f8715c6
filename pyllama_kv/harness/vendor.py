"""Fetch, verify and unpack a pinned llama.cpp tree (`pyllama-kv vendor [--pin mission|current|all]`).

There are two pins (``_paths.PINS``): ``mission`` (``vendor/llama.cpp.pin.json`` into
``vendor/llama.cpp``, the default) and ``current`` (``vendor/current.pin.json`` into
``vendor/llama.cpp-current``). Each pin the llama.cpp revision, the archive that carries it
(the ``llama-cpp-python`` sdist on PyPI, whose ``vendor/llama.cpp/`` is exactly that revision) with
its sha256, and a fingerprint of the unpatched tree. The archive is downloaded with pip (so the
machine's index settings apply) into ``~/.cache/pyllama-kv/downloads`` once; later runs use the
cache and no network.

Unpacking is defensive: only the pinned sub-directory is taken, no member may escape the target
(absolute paths, ``..``, links pointing outside), and the tree is unpacked into a temporary
directory next to ``vendor/llama.cpp`` and swapped in only once it is complete and its fingerprint
matches. Any failure leaves an existing ``vendor/llama.cpp`` exactly as it was.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import subprocess
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from .. import _paths
from ..errors import HarnessError
from ..modelfile.download import Log, cached_ok, pip_download, sha256_file, stderr_log as _stderr

MARKER = ".pyllama-kv-vendor.json"



class VendorError(HarnessError):
    """The pinned source could not be fetched, verified or unpacked. Nothing was changed."""


@dataclass(frozen=True)
class Pin:
    """A pin file: which llama.cpp, in which archive, with which hashes. ``name``: "mission" or "current"."""

    revision: str
    package: str
    version: str
    filename: str
    sha256: str
    subdir: str
    fingerprint_paths: tuple[str, ...]
    fingerprint_sha256: str
    name: str = _paths.DEFAULT_PIN
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def load(cls, path: Path | None = None, name: str = _paths.DEFAULT_PIN, root: Path | None = None) -> Pin:
        """The pin ``name`` of the checkout (or of the installed package), or the pin file at ``path``."""
        path = path or pin_file(name, root)
        try:
            data = json.loads(Path(path).read_text())
            src = data["source"]
            fp = data["fingerprint"]
            return cls(
                revision=data["revision"],
                package=src["package"],
                version=src["version"],
                filename=src["filename"],
                sha256=src["sha256"].lower(),
                subdir=src["subdir"].strip("/"),
                fingerprint_paths=tuple(fp["paths"]),
                fingerprint_sha256=fp["sha256"].lower(),
                name=name,
                raw=data,
            )
        except (OSError, ValueError, KeyError) as exc:
            raise VendorError(f"cannot read the pin file {path}: {exc}") from exc


def pin_file(name: str, root: Path | None = None) -> Path:
    try:
        return _paths.pin_path(root, name)
    except ValueError as exc:  # an unknown pin name
        raise VendorError(str(exc)) from None


def pin_names(choice: str) -> list[str]:
    """The pins a ``--pin`` value names: one of ``_paths.PINS``, or "all"."""
    if choice == "all":
        return list(_paths.PINS)
    if choice not in _paths.PINS:
        raise VendorError(f"unknown pin {choice!r}: choose one of {', '.join(_paths.PINS)} or all")
    return [choice]


def fingerprint(tree: Path, paths: tuple[str, ...] | list[str]) -> str:
    """sha256 over the sorted ``"<sha256>  <relative path>"`` lines of every file under ``paths``."""
    tree = Path(tree)
    lines = []
    for part in paths:
        p = tree / part
        if p.is_file():
            files = [p]
        elif p.is_dir():
            files = [x for x in p.rglob("*") if x.is_file()]
        else:
            files = []
        for f in files:
            lines.append(f"{sha256_file(f)}  {f.relative_to(tree).as_posix()}\n")
    lines.sort()
    return hashlib.sha256("".join(lines).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# download


def cached_archive(pin: Pin) -> Path:
    return _paths.cache_dir() / "downloads" / pin.filename


def fetch(pin: Pin, log: Log = _stderr) -> Path:
    """Return the verified pinned archive, downloading it into the cache if needed."""
    target = cached_archive(pin)
    if target.is_file() and cached_ok(target, pin.sha256, log):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="download-", dir=target.parent) as tmp:
        log(f"downloading {pin.package}=={pin.version} (sdist, {pin.filename}) with pip ...")
        rc, lines = pip_download(["--no-binary", ":all:", f"{pin.package}=={pin.version}"], tmp, log)
        got_file = Path(tmp) / pin.filename
        if not got_file.is_file():
            tail = "\n".join(lines[-15:])
            raise VendorError(
                f"pip could not download {pin.package}=={pin.version} (exit {rc}).\n{tail}\n"
                f"If you have the file, put it at {target} or run `pyllama-kv vendor --source PATH`."
            )
        got = sha256_file(got_file)
        if got != pin.sha256:
            raise VendorError(
                f"sha256 mismatch for the downloaded {pin.filename}: expected {pin.sha256}, got {got}"
            )
        os.replace(got_file, target)
    log(f"saved {target}")
    return target


# ---------------------------------------------------------------------------------------------
# safe extraction


def _member_rel(name: str, prefix: str) -> str | None:
    """Path of a member relative to ``prefix`` ('' means the archive root), or None if outside."""
    name = name.rstrip("/")
    if name.startswith("./"):
        name = name[2:]
    if not prefix:
        return name
    if name == prefix:
        return ""
    if name.startswith(prefix + "/"):
        return name[len(prefix) + 1:]
    return None


def _check_rel(rel: str, what: str) -> None:
    p = PurePosixPath(rel)
    if rel.startswith("/") or p.is_absolute() or ".." in p.parts or "\\" in rel or ":" in p.parts[0]:
        raise VendorError(f"unsafe path in archive: {what!r} would escape the target directory")


def _check_link(rel: str, linkname: str, what: str) -> None:
    if linkname.startswith("/"):
        raise VendorError(f"unsafe link in archive: {what!r} -> {linkname!r} points outside the tree")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(rel), linkname))
    if resolved == ".." or resolved.startswith("../") or resolved.startswith("/"):
        raise VendorError(f"unsafe link in archive: {what!r} -> {linkname!r} points outside the tree")


def _skip(rel: str) -> bool:
    # the sdist carries a `.git` file pointing at the parent's submodule dir: meaningless here
    top = rel.split("/", 1)[0]
    return top == ".git"


def safe_extract(archive: Path, subdir: str, target: Path) -> int:
    """Extract the members of ``archive`` under ``subdir`` into ``target``; return the file count.

    Raises VendorError for unreadable/truncated archives, unsafe members, or a missing subdir.
    ``target`` must be an empty directory; on error it may hold a partial tree (callers use a
    temporary directory).
    """
    prefix = subdir.strip("/")
    try:
        tf = tarfile.open(archive, "r:*")
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise VendorError(f"{archive} is not a readable tar archive: {exc}") from exc
    with tf:
        try:
            n_files, hardlinks = _extract_members(tf, prefix, target)
        except (tarfile.TarError, EOFError, zlib.error) as exc:
            raise VendorError(f"{archive} is truncated or corrupt: {exc}") from exc
    n_files += _copy_hardlinks(target, hardlinks)
    _check_links_inside(target)
    if n_files == 0:
        raise VendorError(f"{archive} has no files under {prefix or '/'}")
    return n_files


def _extract_members(tf: tarfile.TarFile, prefix: str, target: Path) -> tuple[int, list[tuple[str, str]]]:
    """Write the files, directories and symlinks under ``prefix`` into ``target``, each checked first;
    return the file count and the hard links (path, target path), copied once everything is out."""
    n_files = 0
    hardlinks: list[tuple[str, str]] = []
    for m in tf:
        rel = _member_rel(m.name, prefix)
        if rel is None or rel == "" or _skip(rel):
            continue
        _check_rel(rel, m.name)
        out = target / rel
        if m.isdir():
            out.mkdir(parents=True, exist_ok=True)
        elif m.isfile():
            out.parent.mkdir(parents=True, exist_ok=True)
            src = tf.extractfile(m)
            assert src is not None
            with src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.chmod(out, 0o755 if m.mode & 0o111 else 0o644)
            n_files += 1
        elif m.issym():
            _check_link(rel, m.linkname, m.name)
            out.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(m.linkname, out)
        elif m.islnk():
            link_rel = _member_rel(m.linkname, prefix)
            if link_rel is None:
                raise VendorError(f"unsafe link in archive: {m.name!r} -> {m.linkname!r} "
                                  "points outside the tree")
            _check_rel(link_rel, m.linkname)
            hardlinks.append((rel, link_rel))
        else:
            raise VendorError(f"unsupported member in archive: {m.name!r} (not a file, dir or link)")
    return n_files, hardlinks


def _copy_hardlinks(target: Path, hardlinks: list[tuple[str, str]]) -> int:
    """Each hard link as a copy of the file it names (which the archive must hold); return the count."""
    for rel, link_rel in hardlinks:
        link_src = target / link_rel
        if not link_src.is_file():
            raise VendorError(f"hard link {rel!r} -> {link_rel!r}: target is missing from the archive")
        shutil.copy2(link_src, target / rel)
    return len(hardlinks)


def _check_links_inside(target: Path) -> None:
    """No symlink may resolve outside the tree, even through another link."""
    real_target = target.resolve()
    for p in target.rglob("*"):
        if p.is_symlink():
            try:
                p.resolve().relative_to(real_target)
            except ValueError:
                raise VendorError(f"unsafe link in archive: {p.relative_to(target)} "
                                  "resolves outside the tree") from None


def _find_tree_prefix(archive: Path) -> str:
    """The member prefix of a llama.cpp tree in a source tarball (the dir holding include/llama.h + src/)."""
    try:
        with tarfile.open(archive, "r:*") as tf:
            names = tf.getnames()
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise VendorError(f"{archive} is not a readable tar archive: {exc}") from exc
    cands = []
    nameset = {n.rstrip("/") for n in names}
    for n in nameset:
        if n == "include/llama.h" or n.endswith("/include/llama.h"):
            pre = n[: -len("include/llama.h")].rstrip("/")
            if any(x.startswith((pre + "/src/") if pre else "src/") for x in nameset):
                cands.append(pre)
    if not cands:
        raise VendorError(f"{archive} does not hold a llama.cpp tree (no include/llama.h next to src/)")
    return min(cands, key=len)


# ---------------------------------------------------------------------------------------------
# the vendor step


@dataclass
class VendorResult:
    path: Path
    revision: str
    source: str
    changed: bool
    files: int = 0
    pin: str = _paths.DEFAULT_PIN


def read_marker(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _copy_source_dir(src: Path, tmp: Path) -> int:
    ignore = shutil.ignore_patterns(".git", "build", "build-*", "__pycache__")
    shutil.copytree(src, tmp, symlinks=True, ignore=ignore, dirs_exist_ok=True)
    return sum(1 for p in tmp.rglob("*") if p.is_file())


def _git_head(path: Path) -> str | None:
    if not (path / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def install_tree(
    archive: Path | None,
    subdir: str,
    dest: Path,
    expected_fingerprint: tuple[tuple[str, ...], str] | None,
    marker: dict,
    expected_sha256: str | None = None,
    source_dir: Path | None = None,
) -> int:
    """Unpack (or copy) a tree into a temporary dir beside ``dest``, verify it, then swap it in.

    On any error the temporary dir is removed and ``dest`` is untouched.
    """
    if expected_sha256 is not None and archive is not None:
        got = sha256_file(archive)
        if got != expected_sha256:
            raise VendorError(f"sha256 mismatch for {archive}: expected {expected_sha256}, got {got}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".llama.cpp.tmp-", dir=dest.parent))
    old: Path | None = None
    try:
        if source_dir is not None:
            n = _copy_source_dir(source_dir, tmp)
        else:
            assert archive is not None
            n = safe_extract(archive, subdir, tmp)
        if not (tmp / "include" / "llama.h").is_file():
            raise VendorError("the unpacked tree has no include/llama.h: not a llama.cpp source tree")
        if expected_fingerprint is not None:
            paths, want = expected_fingerprint
            got = fingerprint(tmp, paths)
            if got != want:
                raise VendorError(
                    f"the source tree is not the pinned revision {marker.get('revision', '?')[:12]}: "
                    f"fingerprint of {', '.join(paths)} is {got[:16]}..., expected {want[:16]}..."
                )
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if dest.exists() or dest.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=".llama.cpp.old-", dir=dest.parent))
            os.rename(dest, old / "tree")
        os.rename(tmp, dest)
        tmp = None  # type: ignore[assignment]
        return n
    except BaseException:
        if old is not None and not dest.exists():
            os.rename(old / "tree", dest)  # put the previous tree back
        raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def pinned_source(pin: Pin) -> str:
    """How a marker names the pinned archive."""
    return f"{pin.package}=={pin.version} sdist"


def unpack_pinned(pin: Pin, dest: Path, log: Log = _stderr) -> int:
    """Fetch the pinned archive (cache first, hash-checked) and install its llama.cpp tree at ``dest``,
    proven pristine by the pin's fingerprint, with its marker. Returns the number of files."""
    archive = fetch(pin, log)
    marker = {"pin": pin.name, "revision": pin.revision, "source": pinned_source(pin), "sha256": pin.sha256,
              "fingerprint": pin.fingerprint_sha256}
    log(f"unpacking {pin.subdir}/ into {dest} ...")
    return install_tree(archive, pin.subdir, dest, (pin.fingerprint_paths, pin.fingerprint_sha256), marker,
                        expected_sha256=pin.sha256)


def _same_revision(head: str, pin: Pin) -> bool:
    """A git HEAD is the pinned revision (the current pin names a short hash)."""
    return head == pin.revision or (len(pin.revision) < 40 and head.startswith(pin.revision))


def vendor(
    source: Path | None = None,
    force: bool = False,
    root: Path | None = None,
    log: Log = _stderr,
    pin_name: str = _paths.DEFAULT_PIN,
) -> VendorResult:
    """Make the pin's tree (``vendor/llama.cpp`` for the mission pin, ``vendor/llama.cpp-current`` for
    the current one) hold the pinned revision. Idempotent; see the module docstring."""
    pin = Pin.load(name=pin_name, root=root)
    dest = _paths.vendor_dir(root, pin_name)
    marker_now = read_marker(dest) if dest.exists() else None
    # the same revision under another fingerprint (the pin file now covers more paths) is vendored
    # again, so that the marker and the pristine checks agree with the pin file
    if (not force and source is None and marker_now and marker_now.get("revision") == pin.revision
            and marker_now.get("fingerprint", pin.fingerprint_sha256) == pin.fingerprint_sha256):
        log(f"{dest} already holds llama.cpp {pin.revision[:12]} (from {marker_now.get('source')})")
        return VendorResult(dest, pin.revision, str(marker_now.get("source")), changed=False, pin=pin.name)

    fp = (pin.fingerprint_paths, pin.fingerprint_sha256)
    t0 = time.monotonic()
    if source is None:
        n = unpack_pinned(pin, dest, log)
        src_desc = pinned_source(pin)
    else:
        source = Path(source).expanduser().resolve()
        if not source.exists():
            raise VendorError(f"--source {source}: no such file or directory")
        marker = {"pin": pin.name, "revision": pin.revision, "source": str(source),
                  "fingerprint": pin.fingerprint_sha256}
        if source.is_dir():
            head = _git_head(source)
            if head is not None and not _same_revision(head, pin):
                raise VendorError(f"--source {source} is a git checkout of {head[:12]}, "
                                  f"not the pinned {pin.revision[:12]}")
            log(f"copying {source} into {dest} ...")
            n = install_tree(None, "", dest, fp, marker, source_dir=source)
        else:
            prefix = _find_tree_prefix(source)
            marker["sha256"] = sha256_file(source)
            log(f"unpacking {source}:{prefix or '/'} into {dest} ...")
            n = install_tree(source, prefix, dest, fp, marker)
        src_desc = str(source)
    log(f"vendored llama.cpp {pin.revision[:12]} ({pin.name} pin): {n} files in {time.monotonic() - t0:.1f}s")
    return VendorResult(dest, pin.revision, src_desc, changed=True, files=n, pin=pin.name)
