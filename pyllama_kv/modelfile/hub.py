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
offline, the name of the cached blob, which is the sha256 the hub gave when it was fetched): a
mismatch removes the file from the cache and is one :class:`HubError`. The verdict is remembered
(:mod:`.filehash`), so a later use costs a ``stat``. A split model is merged once into one file
(:func:`.ggufsplit.merged`). The file is then validated and vetted on load like any other.
"""
from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from .download import Log, stderr_log
from .filehash import file_sha256, forget
from .ggufsplit import merged, split_name
from .local import _NOT_MODELS, hf_cache_dir

#: the quants taken, in this order, from a repo with several models and none named
PREFERRED = ("Q4_K_M", "Q4_K_S", "Q4_0", "Q5_K_M", "Q8_0")
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
NAME_RE = re.compile(rf"(?P<prefix>hf:|hf\.co/|huggingface\.co/)?(?P<repo>{_PART}/{_PART})"
                     rf"(?:@(?P<revision>{_PART}))?(?::(?P<quant>[A-Za-z0-9._-]{{1,40}})|/(?P<file>[^@:]+\.gguf))?",
                     re.IGNORECASE)
QUANT_RE = re.compile(r"(?:^|[-._/])((?:UD-)?(?:I?Q\d(?:_[A-Z0-9]{1,4}){0,2}|BF16|F16|F32|MXFP4(?:_MOE)?|TQ\d_0))"
                      r"(?=$|[-./])", re.IGNORECASE)
_SHA = re.compile(r"[0-9a-f]{64}")
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


def cached_listing(name: HubName) -> tuple[dict[str, str | None], str] | None:
    """Offline: the repo's files in the cache at the revision (file -> the sha256 its blob is named
    by), and the commit; None when the cache has no snapshot of it."""
    d = _repo_dir(name.repo)
    rev = name.revision or "main"
    commit = rev if re.fullmatch(r"[0-9a-f]{40}", rev) else None
    if commit is None:
        try:
            commit = (d / "refs" / rev).read_text().strip()
        except OSError:
            return None
    snap = d / "snapshots" / commit
    if not snap.is_dir():
        return None
    out: dict[str, str | None] = {}
    for p in snap.rglob("*"):
        if p.is_file():
            blob = Path(os.path.realpath(p)).name
            out[p.relative_to(snap).as_posix()] = blob if _SHA.fullmatch(blob) else None
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
    if isinstance(exc, errs.RepositoryNotFoundError):
        return HubError(f"{name.repo}: no such model repo on the Hugging Face hub{token}")
    if isinstance(exc, errs.RevisionNotFoundError):
        return HubError(f"{name.repo} has no revision {name.revision!r} (a branch, tag or commit)")
    if isinstance(exc, getattr(errs, "RemoteEntryNotFoundError", errs.EntryNotFoundError)):
        return HubError(f"{name.repo} has no file {file!r}")
    if isinstance(exc, errs.LocalEntryNotFoundError) or _is_network(exc):
        why = "HF_HUB_OFFLINE is set" if offline() else f"the hub cannot be reached ({_one_line(exc)})"
        return HubError(f"{what} is not in the Hugging Face cache ({hf_cache_dir()}) and {why}")
    if isinstance(exc, errs.HfHubHTTPError) or status is not None:
        return HubError(f"{what}: the hub answered HTTP {status}{token if status in (401, 403) else ''}")
    if isinstance(exc, OSError) or (type(exc).__module__ or "").startswith("httpx"):
        # huggingface_hub's size check of a finished transfer, or one that broke off: nothing kept
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
    """Take a download that is not the hub's bytes out of the cache: its blob and its link."""
    repo_dir = _repo_dir(name.repo).resolve()
    real = Path(os.path.realpath(path))
    for p in (path, real):
        if repo_dir in Path(os.path.realpath(p.parent)).parents:
            forget(p)
            p.unlink(missing_ok=True)


def verify(name: HubName, file: str, path: Path, expected: str | None, log: Log) -> None:
    """``path`` (the download of ``file``) is the hub's bytes: its sha256 is ``expected`` (the hub's)
    or, without one, the name of its blob (the hub's ETag); else it is removed and HubError."""
    if expected is None:
        blob = Path(os.path.realpath(path)).name
        expected = blob if _SHA.fullmatch(blob) else None
    if expected is None:
        log(f"{name.repo}/{file}: the hub gives no sha256 for it (not stored in LFS): not checked")
        return
    got = file_sha256(path)
    if got != expected:
        _remove(name, path)
        raise HubError(f"{name.repo}/{file}: sha256 mismatch: the hub says {expected}, the download is {got}; "
                       "it was removed from the cache: run again")


def download(name: HubName, log: Log = stderr_log) -> list[Path]:
    """The file(s) of the model ``name`` in the Hugging Face cache, downloaded if needed (with
    huggingface_hub's progress bar) and verified: its parts in order."""
    hf = _hf()
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
        verify(name, f, p, files.get(f), log)
        out.append(p)
    return out


def fetch(name: HubName | str, log: Log = stderr_log) -> Path:
    """The verified GGUF of the hub model ``name`` (a :class:`HubName` or a name :func:`parse`
    takes), downloaded into the Hugging Face cache on first use; a split model merged once."""
    if isinstance(name, str):
        parsed = parse(name.removeprefix("hf:"), explicit=True)
        if parsed is None:
            raise HubError(f"{name!r} is not a Hugging Face model name (OWNER/REPO[@REVISION][:QUANT] or "
                           "OWNER/REPO[@REVISION]/FILE.gguf)")
        name = parsed
    return merged(download(name, log), log)
