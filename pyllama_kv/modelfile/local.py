"""The GGUF files already on this machine: the Hugging Face cache, Ollama's store and LM Studio's folder.

Each store is found the way its own tool finds it, and only read (nothing there is written, copied or
removed):

* **Hugging Face cache** (huggingface_hub's rule): ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
  ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``; a repo is
  ``models--OWNER--REPO/snapshots/COMMIT/PATH`` (a link to ``blobs/SHA256``, the hub's sha256 of
  the file). Names: ``OWNER/REPO/PATH`` (``OWNER/REPO@COMMIT/PATH`` for a snapshot no branch names).
* **Ollama** (Ollama's rule): ``$OLLAMA_MODELS``, else ``~/.ollama/models`` and, on Linux, the
  system service's ``/usr/share/ollama/.ollama/models``. A model is a manifest
  ``manifests/HOST/NAMESPACE/MODEL/TAG`` whose layer of media type
  ``application/vnd.ollama.image.model`` names the GGUF blob ``blobs/sha256-HEX``, which is loaded
  where it is. Names: ``ollama:MODEL:TAG`` (``ollama:NAMESPACE/MODEL:TAG``,
  ``ollama:HOST/NAMESPACE/MODEL:TAG`` outside the library; the tag defaults to ``latest``).
* **LM Studio** (LM Studio's rule): the folder ``~/.lmstudio-home-pointer`` names, else
  ``~/.lmstudio``, with its ``settings.json``'s ``downloadsFolder`` if set, else its ``models/``;
  and the older ``~/.cache/lm-studio/models``. A model is ``PUBLISHER/REPO/FILE.gguf`` there.
  Names: ``lmstudio:PUBLISHER/REPO/FILE.gguf``.

A manifest that points outside its store, a digest that is not a sha256, a blob that is not GGUF or
not the bytes its digest names: one :class:`LocalModelError` each.

Every read of a store is bounded, whatever is there (issue 45): a path is opened only when it is a
regular file (:func:`regular_file`: ``os.stat``, links followed, so a loop of links is an error and
not a hang; a FIFO, a device, a socket or a directory is never opened, and the open itself is
``O_NONBLOCK``, :func:`open_regular`); a small file read whole (a manifest, ``settings.json``, a ref)
has at most :data:`~pyllama_kv.limits.STORE_FILE_MAX_BYTES` bytes, a larger one refused from its size
unread, and its JSON at most :data:`~pyllama_kv.limits.STORE_JSON_MAX_DEPTH` levels, counted before it
is parsed (:func:`load_json`). A broken manifest is one listed entry with its one-line error, never a
broken listing.
"""
from __future__ import annotations

import json
import os
import re
import stat
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .._native import archs
from ..errors import GGUFFileError, ModelLoadError
from ..limits import STORE_FILE_MAX_BYTES, STORE_JSON_MAX_DEPTH
from .filehash import file_sha256
from .gguf import read_gguf_header
from .ggufsplit import part_name, split_name

OLLAMA_MODEL_MEDIA = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY, OLLAMA_LIBRARY = "registry.ollama.ai", "library"
_COMPONENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_DIGEST = re.compile(r"sha256[:-]([0-9a-f]{64})")
#: files beside a model that are not one (vision projectors)
_NOT_MODELS = re.compile(r"mmproj|projector", re.IGNORECASE)
MAX_DEPTH = 6   # how deep a store is walked


class LocalModelError(ModelLoadError):
    """A model of a local store cannot be found or used (one line, naming the store's file)."""


# ---------------------------------------------------------------------------------------------
# bounded reads: a regular file, of a bounded size, of a bounded JSON depth

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
#: the characters that can change a JSON text's nesting: a backslash pair (an escape, taken whole),
#: a quote, a bracket
_JSON_TOKENS = re.compile(r'\\.|["\[\]{}]', re.DOTALL)


def file_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a FIFO", ...), for one that is not a regular file."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def regular_file(path: str | os.PathLike, error: type[ModelLoadError] = ModelLoadError,
                 what: str | None = None) -> os.stat_result:
    """``os.stat(path)`` (links followed) when ``path`` is a regular file; else ``error`` (one line
    naming ``what``, default the path): a missing file, a loop of links, a directory, a FIFO (whose
    open would block), a device or a socket, none of which is ever opened."""
    label = what or str(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{label}: no such file") from None
    except (OSError, ValueError) as exc:   # ELOOP: a loop of links; ValueError: a NUL byte
        raise error(f"{label}: cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{label} is {file_kind(st.st_mode)}, not a file")
    return st


def open_regular(path: str | os.PathLike, error: type[ModelLoadError] = ModelLoadError,
                 what: str | None = None) -> int:
    """``path`` opened for reading (a descriptor the caller closes) when it is a regular file: checked
    by :func:`regular_file` first, opened ``O_NONBLOCK`` (a FIFO swapped in meanwhile cannot block the
    open) and checked again on the open file."""
    regular_file(path, error, what)
    label = what or str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise error(f"{label}: cannot be read: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{label} is {file_kind(mode)}, not a file")
    return fd


def read_small(path: str | os.PathLike, what: str | None = None, cap: int = STORE_FILE_MAX_BYTES) -> bytes:
    """The bytes of the small store file ``path`` (a manifest, a settings file, a ref): a regular file
    (:func:`open_regular`) of at most ``cap`` bytes; a larger one is refused from its size, unread.
    LocalModelError (one line) otherwise."""
    label = what or str(path)
    fd = open_regular(path, LocalModelError, label)
    try:
        size = os.fstat(fd).st_size
        if size > cap:
            raise LocalModelError(f"{label}: {size} bytes, more than the {cap} a store's file may have (not read)")
        chunks, got = [], 0
        while got <= cap:
            chunk = os.read(fd, cap + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as exc:
        raise LocalModelError(f"{label}: cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if got > cap:   # it grew after the stat
        raise LocalModelError(f"{label}: more than the {cap} bytes a store's file may have (not read)")
    return b"".join(chunks)


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in the JSON ``text`` (brackets inside strings left out),
    counted without parsing it: one pass over its quotes, brackets and escapes."""
    depth = deepest = 0
    in_string = False
    for tok in _JSON_TOKENS.findall(text):
        if tok == '"':
            in_string = not in_string
        elif in_string or tok[0] == "\\":
            continue
        elif tok in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def load_json(path: str | os.PathLike, what: str | None = None) -> object:
    """The JSON of the small store file ``path`` (:func:`read_small`), its nesting checked (at most
    :data:`~pyllama_kv.limits.STORE_JSON_MAX_DEPTH` levels) before it is parsed. LocalModelError (one
    line) for a file that cannot be read or is not such JSON."""
    label = what or str(path)
    data = read_small(path, label)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LocalModelError(f"{label}: not JSON (not UTF-8 at byte {exc.start})") from None
    depth = json_depth(text)
    if depth > STORE_JSON_MAX_DEPTH:
        raise LocalModelError(f"{label}: JSON nested {depth} levels deep, more than {STORE_JSON_MAX_DEPTH} "
                              "(not parsed)")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise LocalModelError(f"{label}: not JSON ({_one_line(exc)})") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def _env_path(name: str) -> Path | None:
    v = os.environ.get(name)
    return Path(os.path.expandvars(os.path.expanduser(v))) if v else None


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, by huggingface_hub's rule (read at each call)."""
    hub = _env_path("HF_HUB_CACHE") or _env_path("HUGGINGFACE_HUB_CACHE")
    if hub:
        return hub
    home = _env_path("HF_HOME") or (_env_path("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return home / "hub"


def ollama_dirs() -> list[Path]:
    """Ollama's model stores: ``$OLLAMA_MODELS`` alone when set, else the user's and the Linux service's."""
    env = _env_path("OLLAMA_MODELS")
    if env:
        return [env]
    out = [Path.home() / ".ollama" / "models"]
    if sys.platform.startswith("linux"):
        out.append(Path("/usr/share/ollama/.ollama/models"))
    return out


def lmstudio_dirs() -> list[Path]:
    """LM Studio's models folders: its home's (``~/.lmstudio-home-pointer`` or ``~/.lmstudio``;
    ``settings.json``'s ``downloadsFolder`` when set, else ``models/``), then the older one."""
    home = Path.home() / ".lmstudio"
    try:   # (bounded reads: a FIFO or a huge file there is passed over, as a missing one)
        pointed = read_small(Path.home() / ".lmstudio-home-pointer").decode("utf-8", "replace").strip()
        home = Path(pointed) if pointed and "\0" not in pointed else home
    except LocalModelError:
        pass
    models = home / "models"
    try:
        settings = load_json(home / "settings.json")
        folder = settings.get("downloadsFolder") if isinstance(settings, dict) else None
        models = Path(os.path.expanduser(folder)) if isinstance(folder, str) and folder and "\0" not in folder \
            else models
    except LocalModelError:
        pass
    return [models, Path.home() / ".cache" / "lm-studio" / "models"]


@dataclass
class LocalModel:
    """One model found on disk: ``name`` is what a MODEL argument takes."""

    name: str
    store: str                      # "huggingface" | "ollama" | "lmstudio"
    path: str                       # the GGUF (the first part of a split model)
    size: int                       # bytes, all parts
    parts: int = 1
    architecture: str | None = None
    loads_with: list[str] = field(default_factory=list)
    error: str | None = None        # why its header could not be read

    def describe(self) -> None:
        """Fill in architecture, loads_with and error from the file's header."""
        try:
            arch, pre = read_gguf_header(self.path).loader_needs()
        except (GGUFFileError, OSError) as exc:
            self.error = str(exc)
            return
        self.architecture = arch
        self.loads_with = archs.loads_with(arch, pre)

    def as_dict(self) -> dict:
        return asdict(self)


def _walk_ggufs(root: Path, depth: int = MAX_DEPTH):
    """The ``*.gguf`` files under ``root`` (links followed, each directory once, ``depth`` levels)."""
    seen: set = set()
    stack = [(root, 0)]
    while stack:
        d, level = stack.pop()
        try:
            key = d.stat()
            if (key.st_dev, key.st_ino) in seen:
                continue
            seen.add((key.st_dev, key.st_ino))
            entries = sorted(os.scandir(d), key=lambda e: e.name, reverse=True)
        except OSError:
            continue
        for e in entries:
            if e.name.startswith("."):
                continue
            if e.is_dir() and level + 1 < depth:
                stack.append((Path(e.path), level + 1))
            elif e.name.lower().endswith(".gguf") and not _NOT_MODELS.search(e.name) and e.is_file():
                yield Path(e.path)


def group_parts(files: list[Path]) -> list[list[Path]]:
    """``files`` as models: a whole file alone, the parts of a split model together (in order; a
    model whose parts are not all there is left out)."""
    out: list = []
    sets: dict = {}
    for f in files:
        s = split_name(f.name)
        if s is None:
            out.append([f])
        else:
            sets.setdefault((f.parent, s[0], s[2]), {})[s[1]] = f
    for (_, _, count), got in sets.items():
        if len(got) == count:
            out.append([got[i] for i in range(1, count + 1)])
    return sorted(out, key=lambda g: str(g[0]))


def _size(parts: list[Path]) -> int:
    return sum(p.stat().st_size for p in parts)


# ---------------------------------------------------------------------------------------------
# Hugging Face cache


def _hf_refs(repo_dir: Path) -> dict[str, str]:
    """commit -> the branch or tag naming it (``main`` first)."""
    out: dict[str, str] = {}
    refs = repo_dir / "refs"
    for ref in sorted(refs.rglob("*"), key=lambda p: p.name != "main") if refs.is_dir() else []:
        try:
            if ref.is_file():
                out.setdefault(read_small(ref).decode("ascii", "replace").strip(), ref.relative_to(refs).as_posix())
        except LocalModelError:
            continue
    return out


def scan_hf() -> list[LocalModel]:
    root = hf_cache_dir()
    out = []
    for repo_dir in sorted(root.glob("models--*--*")):
        owner, _, repo = repo_dir.name[len("models--"):].partition("--")
        refs = _hf_refs(repo_dir)
        for snap in sorted((repo_dir / "snapshots").glob("*")):
            rev = refs.get(snap.name, snap.name)
            at = "" if rev == "main" else f"@{rev}"
            for parts in group_parts(list(_walk_ggufs(snap))):
                out.append(LocalModel(f"{owner}/{repo}{at}/{parts[0].relative_to(snap).as_posix()}", "huggingface",
                                      str(parts[0]), _size(parts), len(parts)))
    return out


# ---------------------------------------------------------------------------------------------
# Ollama


def _ollama_name(rel: tuple[str, ...]) -> str:
    host, ns, model, tag = rel
    if host == OLLAMA_REGISTRY:
        return f"{model}:{tag}" if ns == OLLAMA_LIBRARY else f"{ns}/{model}:{tag}"
    return f"{host}/{ns}/{model}:{tag}"


def _model_layer_digest(manifest: Path) -> str:
    """The sha256 (hex) of the model layer of the Ollama manifest ``manifest``, read bounded
    (:func:`load_json`)."""
    data = load_json(manifest, f"{manifest} (an Ollama manifest)")
    try:
        layers = [la for la in data["layers"] if la.get("mediaType") == OLLAMA_MODEL_MEDIA]  # type: ignore[index]
    except (KeyError, TypeError, AttributeError) as exc:
        raise LocalModelError(f"{manifest}: not an Ollama manifest ({_one_line(exc)})") from None
    if len(layers) != 1:
        raise LocalModelError(f"{manifest}: {len(layers)} layers of type {OLLAMA_MODEL_MEDIA}, expected 1")
    m = _DIGEST.fullmatch(str(layers[0].get("digest")))
    if not m:
        raise LocalModelError(f"{manifest}: the model layer's digest {str(layers[0].get('digest'))[:80]!r} "
                              "is not a sha256")
    return m[1]


def ollama_blob(root: Path, manifest: Path) -> Path:
    """The GGUF blob a manifest names, checked: inside ``root/blobs``, a sha256 digest, a regular file
    (a link that loops or a FIFO is an error, never a hang), GGUF."""
    digest = _model_layer_digest(manifest)
    blobs = Path(os.path.realpath(root / "blobs"))
    blob = root / "blobs" / f"sha256-{digest}"
    if not os.path.lexists(blob) and os.path.lexists(root / "blobs" / f"sha256:{digest}"):
        blob = root / "blobs" / f"sha256:{digest}"   # older Ollama's blob names
    real = Path(os.path.realpath(blob))   # (a loop of links is not followed for ever: stat says so below)
    if blobs not in real.parents:
        raise LocalModelError(f"{manifest}: its model layer points outside the store ({real})")
    if not os.path.lexists(blob):
        raise LocalModelError(f"{manifest}: its model blob {blob} is missing")
    fd = open_regular(blob, LocalModelError, f"{manifest}: its model blob {blob}")
    try:
        magic = os.pread(fd, 4, 0)
    except OSError as exc:
        raise LocalModelError(f"{blob} (the model of {manifest}) cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if magic != b"GGUF":
        raise LocalModelError(f"{blob} (the model of {manifest}) is not a GGUF file")
    return blob


def _ollama_manifests(root: Path):
    top = root / "manifests"
    for p in sorted(top.glob("*/*/*/*")):
        if not p.is_dir():   # (a FIFO or a loop of links too: listed with its error)
            yield p, p.relative_to(top).parts


def scan_ollama() -> list[LocalModel]:
    out = []
    for root in ollama_dirs():
        for manifest, rel in _ollama_manifests(root):
            name = f"ollama:{_ollama_name(rel)}"
            try:   # a broken manifest is this entry's one-line error, never the listing's
                blob = ollama_blob(root, manifest)
                size = os.stat(blob).st_size
            except (LocalModelError, OSError) as exc:
                out.append(LocalModel(name, "ollama", str(manifest), 0, error=" ".join(str(exc).split())))
                continue
            out.append(LocalModel(name, "ollama", str(blob), size))
    return out


def resolve_ollama(name: str) -> Path:
    """``MODEL[:TAG]``, ``NAMESPACE/MODEL[:TAG]`` or ``HOST/NAMESPACE/MODEL[:TAG]`` (no ``ollama:``)
    as the GGUF blob in Ollama's store, its sha256 checked against its digest (remembered)."""
    base, sep, tag = name.rpartition(":")
    if not sep or "/" in tag:
        base, tag = name, ""
    comps = base.split("/")
    rel = ([OLLAMA_REGISTRY, OLLAMA_LIBRARY] + comps if len(comps) == 1 else
           [OLLAMA_REGISTRY] + comps if len(comps) == 2 else comps) + [tag or "latest"]
    if len(rel) != 4 or not all(_COMPONENT.fullmatch(c) and ".." not in c for c in rel):
        raise LocalModelError(f"ollama:{name}: not an Ollama model name (MODEL[:TAG], NAMESPACE/MODEL[:TAG])")
    roots = ollama_dirs()
    for root in roots:
        manifest = root / "manifests" / Path(*rel)
        if os.path.lexists(manifest) and not manifest.is_dir():
            blob = ollama_blob(root, manifest)
            digest = blob.name[len("sha256-"):]
            if file_sha256(blob) != digest:
                raise LocalModelError(f"{blob} (ollama:{name}) is not the bytes its name says (sha256 mismatch): "
                                      f"`ollama pull {name}` fetches it again")
            return blob
    known = sorted(m.name for m in scan_ollama())
    raise LocalModelError(f"ollama:{name}: not in Ollama's store ({', '.join(map(str, roots))}); "
                          f"it has: {', '.join(known) or 'nothing'}")


# ---------------------------------------------------------------------------------------------
# LM Studio


def scan_lmstudio() -> list[LocalModel]:
    out = []
    for root in lmstudio_dirs():
        for parts in group_parts(list(_walk_ggufs(root, depth=4))):
            out.append(LocalModel(f"lmstudio:{parts[0].relative_to(root).as_posix()}", "lmstudio", str(parts[0]),
                                  _size(parts), len(parts)))
    return out


def resolve_lmstudio(name: str) -> list[Path]:
    """``PUBLISHER/REPO/FILE.gguf`` (no ``lmstudio:``) as the file(s) in LM Studio's folder: the parts,
    in order, of a split model."""
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or not name.lower().endswith(".gguf"):
        raise LocalModelError(f"lmstudio:{name}: not an LM Studio model (PUBLISHER/REPO/FILE.gguf)")
    for root in lmstudio_dirs():
        p = root / rel
        if p.is_file():
            s = split_name(p.name)
            if s is None:
                return [p]
            parts = [p.with_name(part_name(s[0], i, s[2])) for i in range(1, s[2] + 1)]
            missing = [q.name for q in parts if not q.is_file()]
            if missing:
                raise LocalModelError(f"lmstudio:{name}: parts missing beside it: {', '.join(missing)}")
            return parts
    known = sorted(m.name for m in scan_lmstudio())
    raise LocalModelError(f"lmstudio:{name}: not in LM Studio's folder ({', '.join(map(str, lmstudio_dirs()))}); "
                          f"it has: {', '.join(known) or 'nothing'}")


def scan(stores: tuple[str, ...] = ("huggingface", "ollama", "lmstudio")) -> list[LocalModel]:
    """Every model found in ``stores``, described (architecture, which library loads it)."""
    found: list[LocalModel] = []
    for store, fn in (("huggingface", scan_hf), ("ollama", scan_ollama), ("lmstudio", scan_lmstudio)):
        if store in stores:
            found.extend(fn())
    for m in found:
        if m.error is None:
            m.describe()
    return found


def store_dirs() -> dict[str, list[str]]:
    """Where each store is looked for (whether or not it exists)."""
    return {"huggingface": [str(hf_cache_dir())], "ollama": [str(p) for p in ollama_dirs()],
            "lmstudio": [str(p) for p in lmstudio_dirs()]}
