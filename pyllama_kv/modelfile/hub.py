"""GGUF models from the Hugging Face hub by name, on ``huggingface_hub``: its cache layout
(``$HF_HUB_CACHE``, :func:`.local.hf_cache_dir`), ``HF_TOKEN``, ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``,
resumed downloads and its progress bars.

Names (:func:`parse`), wherever a MODEL is taken::

    OWNER/REPO                 the quant chosen by the rule below
    OWNER/REPO:QUANT           the GGUF whose name has QUANT (Q8_0, q4_k_m, UD-Q4_K_XL ...) as a word
    OWNER/REPO/PATH.gguf       that file
    OWNER/REPO@REVISION...     at a branch, tag or commit (REVISION: letters, digits, . _ -)

optionally prefixed ``hf:``, ``hf.co/`` or ``huggingface.co/``. Without ``hf:``, a name that is an
existing path, starts with ``/ . ~``, or is ``A/B.gguf`` is a path.

**The quant rule.** A repo's models are its ``*.gguf`` files (vision projectors, ``mmproj``, left
out), the parts of a split model (``-00001-of-00003.gguf``) counting as one. The only one is taken;
of several, the first of :data:`PREFERRED` (Q4_K_M, then Q4_K_S, Q4_0, Q5_K_M, Q8_0) that exactly one
matches; else an error that lists the quants to choose from.

After download each file's sha256 is checked against the hub's (the LFS sha256 of the repo listing;
offline, the name of the cached blob, which is the sha256 the hub gave when it was fetched; a file
not in LFS, the git sha1 its blob is named by): a mismatch removes the file from the cache and is one
:class:`HubError`. The verdict is remembered (:mod:`.filehash`), so a later use costs a ``stat``. A
file the hub cannot vouch for — offline, a snapshot link that leaves the repo's blobs or the cache,
or a blob named by no hash — is refused unless the caller asks for it (``trust_unverified``, the
CLI's :data:`TRUST_FLAG`). A split model is merged once into one file (:func:`.ggufsplit.merged`).
The file is then validated and vetted on load like any other.

The cache is read as huggingface_hub writes it: ``models--OWNER--REPO/snapshots/COMMIT/PATH`` links
to ``blobs/ETAG`` (a sha256 for a file in LFS or Xet, a git sha1 for another), which is the file or,
for a Xet file in huggingface_hub's shared blob store, a link to ``<cache>/blobs/XX/XETHASH``; refs
are small files read bounded (:func:`.local.read_small`).
"""
from __future__ import annotations

import fnmatch
import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from .download import Log, stderr_log
from .filehash import file_sha256, forget
from .ggufsplit import merged, split_name
from .local import _NOT_MODELS, LocalModelError, hf_cache_dir, open_regular, read_small

#: the quants taken, in this order, from a repo with several models and none named
PREFERRED = ("Q4_K_M", "Q4_K_S", "Q4_0", "Q5_K_M", "Q8_0")
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
NAME_RE = re.compile(rf"(?P<prefix>hf:|hf\.co/|huggingface\.co/)?(?P<repo>{_PART}/{_PART})"
                     rf"(?:@(?P<revision>{_PART}))?(?::(?P<quant>[A-Za-z0-9._-]{{1,40}})|/(?P<file>[^@:]+\.gguf))?",
                     re.IGNORECASE)
QUANT_RE = re.compile(r"(?:^|[-._/])((?:UD-)?(?:I?Q\d(?:_[A-Z0-9]{1,4}){0,2}|BF16|F16|F32|MXFP4(?:_MOE)?|TQ\d_0))"
                      r"(?=$|[-./])", re.IGNORECASE)
_SHA = re.compile(r"[0-9a-f]{64}")
_GIT_SHA1 = re.compile(r"[0-9a-f]{40}")
#: the CLI flag (and, as ``trust_unverified``, the keyword) that loads a file the hub cannot vouch for
TRUST_FLAG = "--trust-unverified"
INSTALL = "huggingface_hub is not installed: `pip install huggingface_hub` (a dependency of pyllama-kv)"


class HubError(ModelLoadError):
    """A model of the hub could not be found, chosen, downloaded or verified (one line; nothing
    half-written is left in the cache)."""


@dataclass(frozen=True)
class HubName:
    repo: str
    revision: str | None = None
    quant: str | None = None
    file: str | None = None          # a path in the repo, or a glob pattern (``*Q4_K_M.gguf``)

    def __str__(self) -> str:
        at = f"@{self.revision}" if self.revision else ""
        return f"{self.repo}{at}" + (f"/{self.file}" if self.file else f":{self.quant}" if self.quant else "")


def parse(spec: str, explicit: bool = False) -> HubName | None:
    """``spec`` as a hub name, or None when it is not one (see the module's rules). ``explicit``:
    ``spec`` is known not to be a path (it had ``hf:``)."""
    m = NAME_RE.fullmatch(spec)
    if not m:
        return None
    if not (explicit or m["prefix"]):
        if spec.startswith((".", "~", "/")) or Path(spec).exists():
            return None
        if m["file"] is None and m["quant"] is None and m["revision"] is None and spec.lower().endswith(".gguf"):
            return None     # A/B.gguf: a path that does not exist
    return HubName(m["repo"], m["revision"], m["quant"], m["file"])


def quants(path: str) -> list[str]:
    return [q.upper() for q in QUANT_RE.findall(path)]


def _matches(path: str, quant: str) -> bool:
    return re.search(rf"(?:^|[-._/]){re.escape(quant)}(?=$|[-./])", path, re.IGNORECASE) is not None


def models_of(files: list[str]) -> list[list[str]]:
    """A repo's files as its models: each ``*.gguf`` alone, the parts of a split model together."""
    out: list = []
    sets: dict = {}
    for f in sorted(files):
        base = f.rsplit("/", 1)[-1]
        if not f.lower().endswith(".gguf") or _NOT_MODELS.search(base):
            continue
        s = split_name(base)
        if s is None:
            out.append([f])
        else:
            sets.setdefault((f.rsplit("/", 1)[0] if "/" in f else "", s[0], s[2]), {})[s[1]] = f
    for (_, _, count), got in sets.items():
        out.append([got.get(i, "") for i in range(1, count + 1)])
    return sorted(out, key=lambda m: m[0] or min(x for x in m if x))


def _label(model: list[str]) -> str:
    first = next(x for x in model if x)
    return ",".join(quants(first)) or first


def choose(name: HubName, files: list[str]) -> list[str]:
    """The file(s) of the model ``name`` asks for, among the repo's ``files``: its parts in order."""
    models = models_of(files)
    if not models:
        shown = ", ".join(sorted(files)[:8]) + (", ..." if len(files) > 8 else "")
        raise HubError(f"{name.repo} has no GGUF file ({shown or 'it is empty'}): pyllama-kv loads GGUF; "
                            "look for a GGUF repo of this model (often OWNER/NAME-GGUF)")
    available = ", ".join(_label(m) for m in models)
    if name.file:
        glob = any(c in name.file for c in "*?[")
        hit = [m for m in models if any(fnmatch.fnmatch(f, name.file) if glob else f == name.file for f in m)]
        if not hit and not glob and name.file in files:
            hit = [[name.file]]
        if len(hit) != 1:
            raise HubError(f"{name.repo} has {'no' if not hit else len(hit)} GGUF model(s) matching {name.file}"
                                f" (it has: {', '.join(m[0] for m in models)})")
        return _whole(name, hit[0])
    if name.quant:
        hit = [m for m in models if _matches(next(x for x in m if x), name.quant)]
        if len(hit) != 1:
            what = "no GGUF" if not hit else f"{len(hit)} GGUF models ({', '.join(m[0] for m in hit)})"
            raise HubError(f"{name.repo} has {what} matching :{name.quant}: give one of its quants "
                                f"({available}) or a file ({name.repo}/FILE.gguf)")
        return _whole(name, hit[0])
    if len(models) == 1:
        return _whole(name, models[0])
    for q in PREFERRED:
        hit = [m for m in models if _matches(next(x for x in m if x), q)]
        if len(hit) == 1:
            return _whole(name, hit[0])
    raise HubError(f"{name.repo} has {len(models)} GGUF models and none is the default "
                        f"({'/'.join(PREFERRED)}): choose one, {name.repo}:QUANT ({available})")


def _whole(name: HubName, model: list[str]) -> list[str]:
    if not all(model):
        have = [i + 1 for i, f in enumerate(model) if f]
        raise HubError(f"{name.repo}: the split model {next(x for x in model if x)} has parts {have} "
                            f"of {len(model)}: the repo is incomplete")
    return model


# ---------------------------------------------------------------------------------------------
# the hub, through huggingface_hub


def _hf():
    try:
        import huggingface_hub
    except ImportError:
        raise HubError(INSTALL) from None
    return huggingface_hub


def offline() -> bool:
    """HF_HUB_OFFLINE (read at each call, as huggingface_hub reads it at import)."""
    v = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return v.upper() in ("1", "ON", "YES", "TRUE")


def endpoint() -> str | None:
    return os.environ.get("HF_ENDPOINT", "").rstrip("/") or None


def _repo_dir(repo: str) -> Path:
    return hf_cache_dir() / ("models--" + repo.replace("/", "--"))


def _ref(name: HubName, commit: bool = True) -> str | None:
    """The text of the cache's ref of ``name``'s revision, read bounded (a FIFO or a huge file is a
    HubError: huggingface_hub reads it whole, unbounded), or None when the cache has no such ref.
    ``commit``: it must name a commit (HubError otherwise), as offline, where the snapshot it names is
    the one loaded; online huggingface_hub writes the hub's commit over it."""
    ref = _repo_dir(name.repo) / "refs" / (name.revision or "main")
    if not os.path.lexists(ref):
        return None
    try:
        text = read_small(ref, f"{ref} (a ref of the Hugging Face cache)").decode("ascii", "replace").strip()
    except LocalModelError as exc:
        raise HubError(str(exc)) from None
    if commit and not _GIT_SHA1.fullmatch(text):
        raise HubError(f"{ref} (a ref of the Hugging Face cache) names no commit ({text[:60]!r})")
    return text


def cache_blob(name: HubName, path: str | os.PathLike[str]) -> tuple[str | None, str]:
    """What the cache says the snapshot file ``path`` is: the name of the repo's blob it links to
    (the hub's ETag when it was downloaded: a sha256, or a git sha1 for a file not in LFS) and "", or
    None and why the cache cannot say (a link that leaves the repo's blobs, a blob that resolves
    outside the cache, a file that is no link)."""
    path = os.fspath(path)
    try:
        link = os.readlink(path)
    except OSError:
        return None, "it is not a link to a blob of the cache"
    blob = os.path.join(os.path.dirname(path), link)
    if os.path.realpath(os.path.dirname(blob)) != os.path.realpath(_repo_dir(name.repo) / "blobs"):
        return None, f"its link points outside the repo's blobs ({link})"
    real, cache = os.path.realpath(blob), os.path.realpath(hf_cache_dir())
    if os.path.commonpath([real, cache]) != cache:   # (huggingface_hub's shared blob store is inside)
        return None, f"its blob resolves outside the Hugging Face cache ({real})"
    return os.path.basename(blob), ""


def cached_listing(name: HubName) -> tuple[dict[str, str | None], str] | None:
    """Offline: the repo's files in the cache at the revision (file -> the sha256 its blob is named
    by, None when the cache cannot vouch for it: :func:`cache_blob`), and the commit; None when the
    cache has no snapshot of it."""
    rev = name.revision or "main"
    commit = rev if _GIT_SHA1.fullmatch(rev) else _ref(name)
    if commit is None:
        return None
    snap = _repo_dir(name.repo) / "snapshots" / commit
    if not snap.is_dir():
        return None
    out: dict[str, str | None] = {}
    for p in snap.rglob("*"):
        if p.is_file():
            blob = cache_blob(name, p)[0]
            out[p.relative_to(snap).as_posix()] = blob if blob and _SHA.fullmatch(blob) else None
    return out, commit


def _is_network(exc: BaseException) -> bool:
    """The hub could not be reached: a connection refused or timed out, or huggingface_hub's
    offline mode (not a transfer that broke off: that is a failed download)."""
    n = type(exc).__name__
    return "Connect" in n or n in ("OfflineModeIsEnabled", "ProxyError") or n.endswith("ConnectTimeout")


def _error(hf, name: HubName, exc: BaseException, file: str | None = None) -> HubError:
    """huggingface_hub's exception ``exc`` as one line."""
    errs = hf.errors
    what = f"{name.repo}/{file}" if file else str(name)
    token = "" if hf.get_token() else " (no token: set HF_TOKEN or run `hf auth login` for a private repo)"
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, errs.GatedRepoError):
        return HubError(f"{name.repo} is gated: accept its conditions on https://huggingface.co/{name.repo} and set "
                        "HF_TOKEN to a token of that account (or `hf auth login`)")
    if isinstance(exc, errs.RepositoryNotFoundError):   # the hub's 401 (no token) or 404 RepoNotFound
        return HubError(f"no such repo or it is gated/private: {name.repo} on {endpoint() or 'the Hugging Face hub'}"
                        + (token or " (the token sent has no access to it)"))
    if isinstance(exc, errs.RevisionNotFoundError):
        return HubError(f"{name.repo} has no revision {name.revision!r} (a branch, tag or commit)")
    if isinstance(exc, getattr(errs, "RemoteEntryNotFoundError", errs.EntryNotFoundError)):
        return HubError(f"{name.repo} has no file {file!r}")
    if isinstance(exc, errs.LocalEntryNotFoundError) or _is_network(exc):
        why = "HF_HUB_OFFLINE is set" if offline() else f"the hub cannot be reached ({_one_line(exc)})"
        return HubError(f"{what} is not in the Hugging Face cache ({hf_cache_dir()}) and {why}")
    if isinstance(exc, errs.HfHubHTTPError) or status is not None:
        return HubError(f"{what}: the hub answered HTTP {status}{token if status in (401, 403) else ''}")
    if isinstance(exc, OSError) or (type(exc).__module__ or "").startswith("httpx") or \
            (file is not None and isinstance(exc, RuntimeError)):
        # huggingface_hub's size check of a finished transfer, one that broke off, or hf_xet's transfer
        # of a Xet-backed file (its errors are RuntimeErrors, "File reconstruction error: ..."): nothing kept
        return HubError(f"{what}: the download failed, nothing was kept: {_one_line(exc)}")
    return HubError(f"{what}: {type(exc).__name__}: {_one_line(exc)}")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("..." if len(text) > 300 else "")


def listing(hf, name: HubName) -> tuple[dict[str, str | None], str | None]:
    """The repo's files at the revision (file -> its sha256 on the hub, None for a file not in LFS)
    and the commit: from the hub, or offline (or with the hub unreachable) from the cache."""
    if offline():
        got = cached_listing(name)
        if got is None:
            raise HubError(f"{name} is not in the Hugging Face cache ({hf_cache_dir()}) and HF_HUB_OFFLINE is "
                           "set: run once online to download it")
        return got
    try:
        info = hf.HfApi(endpoint=endpoint()).model_info(name.repo, revision=name.revision, files_metadata=True)
    except Exception as exc:  # huggingface_hub's and httpx's errors, as one line
        if _is_network(exc) and (got := cached_listing(name)) is not None:
            return got
        raise _error(hf, name, exc) from None
    return {s.rfilename: (s.lfs.sha256 if s.lfs else None) for s in info.siblings or []}, info.sha


def _remove(name: HubName, path: Path) -> None:
    """Take a download that is not the hub's bytes out of the cache: its snapshot link, the repo's
    blob it links to, and the file itself (in the repo, or in huggingface_hub's shared blob store),
    each only when it is inside the cache."""
    cache = os.path.realpath(hf_cache_dir())
    chain = [path]
    if os.path.islink(path):
        chain.append(Path(os.path.join(os.path.dirname(path), os.readlink(path))))
    chain.append(Path(os.path.realpath(path)))
    for p in chain:
        parent = os.path.realpath(p.parent)
        if os.path.commonpath([parent, cache]) == cache and parent != cache:
            forget(p)
            p.unlink(missing_ok=True)


def git_blob_sha1(fd: int) -> str:
    """The git blob id of the open file ``fd``'s bytes (the hub's ETag of a file not in LFS)."""
    size = os.fstat(fd).st_size
    h = hashlib.sha1(b"blob %d\0" % size)
    off = 0
    while chunk := os.pread(fd, 1 << 20, off):
        h.update(chunk)
        off += len(chunk)
    return h.hexdigest()


def _vouched(name: HubName, path: Path, expected: str | None) -> tuple[str | None, str, str]:
    """What ``path`` must hash to, the hash (``sha256`` or ``git sha1``) and why nothing when the
    cache cannot vouch for it: ``expected`` (the hub's sha256), else the name of its blob."""
    if expected is not None:
        return expected, "sha256", ""
    blob, why = cache_blob(name, path)
    if blob is not None and _SHA.fullmatch(blob):
        return blob, "sha256", ""
    if blob is not None and _GIT_SHA1.fullmatch(blob):
        return blob, "git sha1", ""
    return None, "", why or f"its blob's name {str(blob)[:80]!r} is no hash the hub gives"


def verify(name: HubName, file: str, path: Path, expected: str | None, log: Log,
           trust_unverified: bool = False) -> None:
    """``path`` (the download of ``file``, a regular file) is the hub's bytes: its sha256 is ``expected``
    (the hub's) or, without one, the name of its blob in the cache (the hub's ETag: a sha256, or a
    git sha1 for a file not in LFS); else it is removed and HubError. A file the hub cannot vouch for
    (:func:`cache_blob`) is a HubError that names :data:`TRUST_FLAG`, unless ``trust_unverified``."""
    want, kind, why = _vouched(name, path, expected)
    if want is None:
        if not trust_unverified:
            raise HubError(f"{name.repo}/{file}: refused: the hub cannot vouch for {path} ({why}); to load it "
                           f"unverified, pass {TRUST_FLAG} (trust_unverified=True in Python)")
        log(f"{name.repo}/{file}: not verified ({why}): loaded anyway, as {TRUST_FLAG} asks")
        return
    fd = open_regular(path, HubError, f"{name.repo}/{file} ({path})")
    try:
        got = file_sha256(path, fd) if kind == "sha256" else git_blob_sha1(fd)
    except OSError as exc:
        raise HubError(f"{name.repo}/{file} ({path}) cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if got != want:
        _remove(name, path)
        raise HubError(f"{name.repo}/{file}: {kind} mismatch: the hub says {want}, the download is {got}; "
                       "it was removed from the cache: run again")


def download(name: HubName, log: Log = stderr_log, trust_unverified: bool = False) -> list[Path]:
    """The file(s) of the model ``name`` in the Hugging Face cache, downloaded if needed (with
    huggingface_hub's progress bar) and verified (:func:`verify`): its parts in order."""
    hf = _hf()
    _ref(name, commit=False)   # a hostile ref (a FIFO, a huge file) is refused before huggingface_hub reads it
    files, _ = listing(hf, name)
    chosen = choose(name, list(files))
    cache = str(hf_cache_dir())
    out = []
    for f in chosen:
        if not isinstance(hf.try_to_load_from_cache(name.repo, f, cache_dir=cache, revision=name.revision), str):
            log(f"downloading {name.repo}/{f} from {endpoint() or 'the Hugging Face hub'} into {cache} ...")
        try:
            p = Path(hf.hf_hub_download(name.repo, f, revision=name.revision, cache_dir=cache, endpoint=endpoint(),
                                        local_files_only=offline()))
        except Exception as exc:  # huggingface_hub's and httpx's errors, as one line
            raise _error(hf, name, exc, f) from None
        verify(name, f, p, files.get(f), log, trust_unverified)
        out.append(p)
    return out


def fetch(name: HubName | str, log: Log = stderr_log, *, trust_unverified: bool = False) -> Path:
    """The verified GGUF of the hub model ``name`` (a :class:`HubName` or a name :func:`parse`
    takes), downloaded into the Hugging Face cache on first use; a split model merged once.
    ``trust_unverified``: a file the hub cannot vouch for is loaded (with a log line), not refused."""
    if isinstance(name, str):
        parsed = parse(name.removeprefix("hf:"), explicit=True)
        if parsed is None:
            raise HubError(f"{name!r} is not a Hugging Face model name (OWNER/REPO[@REVISION][:QUANT] or "
                           "OWNER/REPO[@REVISION]/FILE.gguf)")
        name = parsed
    return merged(download(name, log, trust_unverified), log)
