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
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .._native import archs
from ..errors import GGUFFileError, ModelLoadError
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
    try:
        pointed = (Path.home() / ".lmstudio-home-pointer").read_text().strip()
        home = Path(pointed) if pointed else home
    except OSError:
        pass
    models = home / "models"
    try:
        folder = json.loads((home / "settings.json").read_text()).get("downloadsFolder")
        models = Path(os.path.expanduser(folder)) if isinstance(folder, str) and folder else models
    except (OSError, ValueError, AttributeError):
        pass
    return [models, Path.home() / ".cache" / "lm-studio" / "models"]


def loads_with(arch: str | None) -> list[str]:
    """The libraries (``lib`` values) whose llama.cpp implements ``arch`` (:data:`archs.BY_API`)."""
    return [lib for names, lib in archs.BY_API.values() if arch in names]


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
            kv = read_gguf_header(self.path).kv.get("general.architecture")
        except (GGUFFileError, OSError) as exc:
            self.error = str(exc)
            return
        self.architecture = str(kv.value) if kv is not None else None
        self.loads_with = loads_with(self.architecture)

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
            out.setdefault(ref.read_text().strip(), ref.relative_to(refs).as_posix())
        except OSError:
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


def ollama_blob(root: Path, manifest: Path) -> Path:
    """The GGUF blob a manifest names, checked: inside ``root/blobs``, a sha256 digest, GGUF."""
    try:
        data = json.loads(manifest.read_text())
        layers = [la for la in data["layers"] if la.get("mediaType") == OLLAMA_MODEL_MEDIA]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise LocalModelError(f"{manifest}: not an Ollama manifest ({exc})") from None
    if len(layers) != 1:
        raise LocalModelError(f"{manifest}: {len(layers)} layers of type {OLLAMA_MODEL_MEDIA}, expected 1")
    m = _DIGEST.fullmatch(str(layers[0].get("digest")))
    if not m:
        raise LocalModelError(f"{manifest}: the model layer's digest {layers[0].get('digest')!r} is not a sha256")
    blobs = (root / "blobs").resolve()
    blob = root / "blobs" / f"sha256-{m[1]}"
    if not blob.exists() and (root / "blobs" / f"sha256:{m[1]}").exists():
        blob = root / "blobs" / f"sha256:{m[1]}"   # older Ollama's blob names
    if blobs not in blob.resolve().parents:
        raise LocalModelError(f"{manifest}: its model layer points outside the store ({blob.resolve()})")
    if not blob.is_file():
        raise LocalModelError(f"{manifest}: its model blob {blob} is missing")
    with open(blob, "rb") as f:
        if f.read(4) != b"GGUF":
            raise LocalModelError(f"{blob} (the model of {manifest}) is not a GGUF file")
    return blob


def _ollama_manifests(root: Path):
    top = root / "manifests"
    for p in sorted(top.glob("*/*/*/*")):
        if p.is_file():
            yield p, p.relative_to(top).parts


def scan_ollama() -> list[LocalModel]:
    out = []
    for root in ollama_dirs():
        for manifest, rel in _ollama_manifests(root):
            name = f"ollama:{_ollama_name(rel)}"
            try:
                blob = ollama_blob(root, manifest)
            except LocalModelError as exc:
                out.append(LocalModel(name, "ollama", str(manifest), 0, error=str(exc)))
                continue
            out.append(LocalModel(name, "ollama", str(blob), blob.stat().st_size))
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
        if manifest.is_file():
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
