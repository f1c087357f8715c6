"""The models people already have (issue 34): Hugging Face repos by name, through huggingface_hub, against
a fake hub on 127.0.0.1 (HF_ENDPOINT); the GGUFs in the Hugging Face cache, a fake Ollama store and a fake
LM Studio folder, all in temporary directories. No network; the real loading code runs."""
from __future__ import annotations

import hashlib
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import huggingface_hub  # a dependency of the package (pyproject.toml): never skipped
import huggingface_hub.constants as hf_constants
import numpy as np
import pytest

import pyllama_kv as pk
from conftest import DEVICE_RUN, run_cli
from pyllama_kv.modelfile import ggufsplit, hub, local
from pyllama_kv.modelfile.gguf import read_gguf_header
from pyllama_kv.tools.gguf import make_tiny_model

COMMIT = "a" * 40
TOKEN = "hf_fake_token"
#: seconds the fake hub serves at most, whatever happens to the test that started it
HUB_LIFETIME = 600


def git_blob_sha1(data: bytes) -> str:
    """The git blob id of ``data``: the hub's ETag (and ``blobId``) of a file not in LFS."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _server(answer, tag: str) -> http.server.ThreadingHTTPServer:
    """A threaded HTTP/1.1 server on 127.0.0.1 at a free port whose HEAD and GET go to ``answer(handler,
    body)``, serving in a daemon thread."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def do_HEAD(self):
            answer(self, body=False)

        def do_GET(self):
            answer(self, body=True)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True,
                     name=f"fake-{tag}").start()
    return server


class FakeHub:
    """What huggingface_hub asks a hub for, answered as the real hub answers (issue 45 checked each
    against huggingface_hub 2.4's code: utils/_http.py, file_download.py, utils/_xet.py):

    * the repo listing ``/api/models/OWNER/REPO[/revision/REV]``: the siblings' ``size``, ``blobId`` and
      ``lfs`` (sha256) only with ``?blobs=true`` (``model_info(files_metadata=True)``), else their names;
    * ``/OWNER/REPO/resolve/REV/PATH`` (HEAD and GET): a file in LFS is a **302 to a CDN** of another
      origin (:attr:`cdn`, a second server: huggingface_hub does not follow it on HEAD, and never sends
      the token there) with X-Repo-Commit, X-Linked-Etag (the sha256) and X-Linked-Size; a file not in
      LFS is answered in place, its ETag its git blob sha1. A **Xet-backed** file (:attr:`xet`) adds
      ``X-Xet-Hash``, ``X-Xet-Refresh-Route`` and a ``Link: <...>; rel="xet-auth"``, its 302 going to a
      bridge path that serves the bytes over plain HTTP (as cas-bridge does); the refresh route answers
      the CAS URL and token headers, and the CAS (``/cas/...`` on the CDN) has no reconstruction: this
      fake serves no Xet protocol, so the tests take the HTTP path (HF_HUB_DISABLE_XET) except where
      they check what a failed Xet transfer gives;
    * its errors: a repo that is not there (or private) is **401 with X-Error-Code RepoNotFound** when
      no token is sent and 404 RepoNotFound with one; 401 GatedRepo without a token; 404
      RevisionNotFound and EntryNotFound.

    Per file, a fault of the CDN: ``short`` (a transfer that ends early, every time), ``cut-once`` (the
    first transfer breaks off, a resumed one completes it), ``badhash`` (bytes that are not the sha256
    the hub gives). Both servers stop themselves after :data:`HUB_LIFETIME` seconds."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.faults: dict[tuple[str, str], str] = {}
        self.gated: set[str] = set()
        self.xet: set[str] = set()            # repos whose LFS files are Xet-backed
        self.plain: set[tuple[str, str]] = set()   # GGUF files not in LFS (every other .gguf is)
        self.requests: list[str] = []         # "METHOD /path?query Range" at the hub, "CDN METHOD ..." at the CDN
        self.cdn_auth: list[str] = []         # Authorization headers the CDN received (none, ever)
        self.cut: set = set()
        self.server = _server(self.answer, "hub")
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.cdn = _server(self.answer_cdn, "cdn")
        self.cdn_url = f"http://127.0.0.1:{self.cdn.server_address[1]}"
        self.timer = threading.Timer(HUB_LIFETIME, self.stop)   # stops itself
        self.timer.daemon = True
        self.timer.start()

    def stop(self):
        self.timer.cancel()
        for server in (self.server, self.cdn):
            server.shutdown()
            server.server_close()

    def add(self, repo: str, files: dict[str, bytes]):
        self.repos[repo] = files

    def in_lfs(self, repo: str, name: str) -> bool:
        return name.endswith(".gguf") and (repo, name) not in self.plain

    def lfs_sha(self, repo: str, name: str) -> str:
        data = self.repos[repo][name]
        if self.faults.get((repo, name)) == "badhash":
            data = data[:-1] + bytes([data[-1] ^ 1])   # the hub names other bytes than the CDN serves
        return hashlib.sha256(data).hexdigest()

    @staticmethod
    def xet_hash(data: bytes) -> str:
        return hashlib.sha256(b"xet:" + data).hexdigest()   # (a Xet merkle hash is 64 hex digits too)

    @staticmethod
    def error(h, status: int, code: str | None, message: str | None = None):
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        if message:
            h.send_header("X-Error-Message", message)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("Content-Length", "0")
        h.end_headers()

    def answer(self, h, body: bool):
        url = urllib.parse.urlsplit(h.path)
        path = urllib.parse.unquote(url.path)
        self.requests.append(f"{h.command} {path}{'?' + url.query if url.query else ''} "
                             f"{h.headers.get('Range', '')}".strip())
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/xet-read-token/([^/]+)", path)
        if m:
            return self.xet_token(h, m[1], m[2])
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            blobs = urllib.parse.parse_qs(url.query).get("blobs", [""])[0].lower() == "true"
            return self.listing(h, m[1], m[2] or "main", body, blobs)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self.resolve(h, m[1], m[2], m[3], body)
        return self.error(h, 404, None)

    def check_repo(self, h, repo: str, rev: str) -> bool:
        token = h.headers.get("Authorization") == f"Bearer {TOKEN}"
        if repo not in self.repos:   # the real hub cannot tell "none" from "not yours" to an anonymous caller
            if token:
                self.error(h, 404, "RepoNotFound", "Repository not found")
            else:
                self.error(h, 401, "RepoNotFound", "Invalid username or password.")
            return False
        if repo in self.gated and not token:
            self.error(h, 401, "GatedRepo", f"Access to model {repo} is restricted.")
            return False
        if rev not in ("main", COMMIT):
            self.error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return False
        return True

    def listing(self, h, repo: str, rev: str, body: bool, blobs: bool):
        if not self.check_repo(h, repo, rev):
            return
        siblings = [{"rfilename": n, **({"size": len(d), "blobId": git_blob_sha1(d),
                                          **({"lfs": {"sha256": self.lfs_sha(repo, n), "size": len(d),
                                                      "pointerSize": 134}} if self.in_lfs(repo, n) else {})}
                                         if blobs else {})}
                    for n, d in self.repos[repo].items()]
        data = json.dumps({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                           "gated": "auto" if repo in self.gated else False, "siblings": siblings}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def resolve(self, h, repo: str, rev: str, name: str, body: bool):
        if not self.check_repo(h, repo, rev):
            return
        if name not in self.repos[repo]:
            return self.error(h, 404, "EntryNotFound", "Entry not found")
        data = self.repos[repo][name]
        if not self.in_lfs(repo, name):   # not in LFS: the bytes, here, its ETag the git blob id
            return self.send(h, data, body, {"X-Repo-Commit": COMMIT, "ETag": f'"{git_blob_sha1(data)}"'})
        sha = self.lfs_sha(repo, name)
        quoted = urllib.parse.quote(f"{repo}/{name}")
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"',
                   "X-Linked-Size": str(len(data)), "Content-Length": "0"}
        if repo in self.xet:
            xh = self.xet_hash(data)
            route = f"/api/models/{repo}/xet-read-token/{COMMIT}"
            headers.update({"X-Xet-Hash": xh, "X-Xet-Refresh-Route": route,
                            "Link": f'<{self.url}{route}>; rel="xet-auth", '
                                    f'<{self.cdn_url}/cas/v1/reconstructions/{xh}>; rel="xet-reconstruction-info"',
                            "Location": f"{self.cdn_url}/xet-bridge/{quoted}?X-Xet-Signed-Range=bytes%3D0-"})
        else:
            headers["Location"] = f"{self.cdn_url}/lfs/{quoted}?X-Amz-Signature=fake&X-Amz-Expires=3600"
        h.send_response(302)
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()

    def xet_token(self, h, repo: str, rev: str):
        if not self.check_repo(h, repo, rev):
            return
        exp = str(int(time.time()) + 3600)
        data = json.dumps({"casUrl": f"{self.cdn_url}/cas", "accessToken": "xet-fake", "exp": int(exp)}).encode()
        self.send(h, data, True, {"X-Xet-Cas-Url": f"{self.cdn_url}/cas", "X-Xet-Access-Token": "xet-fake",
                                  "X-Xet-Token-Expiration": exp, "Content-Type": "application/json"})

    @staticmethod
    def send(h, data: bytes, body: bool, headers: dict[str, str], status: int = 200):
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)

    def answer_cdn(self, h, body: bool):
        url = urllib.parse.urlsplit(h.path)
        path = urllib.parse.unquote(url.path)
        self.requests.append(f"CDN {h.command} {path} {h.headers.get('Range', '')}".strip())
        if h.headers.get("Authorization"):
            self.cdn_auth.append(h.headers["Authorization"])
        m = re.fullmatch(r"/(?:lfs|xet-bridge)/([^/]+/[^/]+)/(.+)", path)
        if not m or m[2] not in self.repos.get(m[1], {}):   # the CAS too: no Xet protocol here
            return self.send(h, b"", body, {}, status=404)
        self.cdn_file(h, m[1], m[2], body)

    def cdn_file(self, h, repo: str, name: str, body: bool):
        data = self.repos[repo][name]
        fault = self.faults.get((repo, name))
        start = 0
        rng = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range", ""))
        if body and rng:
            start = int(rng[1])
        send = data[start:]
        if body and fault == "short":
            send = send[:len(send) // 2]          # the whole answer, but too short
        h.send_response(206 if start else 200)
        h.send_header("ETag", f'"{hashlib.md5(data).hexdigest()}"')   # the CDN's own, as S3's
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(len(send)))
        h.end_headers()
        if not body:
            return
        if fault == "cut-once" and (repo, name) not in self.cut:
            self.cut.add((repo, name))        # the transfer breaks off half way; a resumed one completes
            h.wfile.write(send[:len(send) // 2])
            h.wfile.flush()
            h.close_connection = True
            return
        h.wfile.write(send)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("ggufs")
    a, b = make_tiny_model(d / "a.gguf"), make_tiny_model(d / "b.gguf", seed=3)
    parts = ggufsplit.split(a, 3, d, prefix="tiny-Q4_K_M")
    merged = ggufsplit.merge(parts, d / "merged.gguf")   # "a" as llama-gguf-split --merge writes it
    return {"a": a.read_bytes(), "b": b.read_bytes(), "a-merged": merged.read_bytes(),
            **{p.name: p.read_bytes() for p in parts}}


@pytest.fixture(scope="module")
def fake_hub(ggufs):
    h = FakeHub()
    h.add("tiny/tiny-GGUF", {"tiny-Q4_K_M.gguf": ggufs["a"], "tiny-Q8_0.gguf": ggufs["b"],
                             "README.md": b"# tiny\n", "mmproj-tiny-f16.gguf": ggufs["b"]})
    h.add("tiny/split-GGUF", {n: d for n, d in ggufs.items() if "-of-" in n})
    h.add("tiny/many-GGUF", {"tiny-Q6_K.gguf": ggufs["a"], "tiny-Q3_K_S.gguf": ggufs["b"]})
    h.add("tiny/nogguf", {"model.safetensors": b"x" * 10, "config.json": b"{}"})
    h.add("tiny/gated-GGUF", {"tiny-Q4_K_M.gguf": ggufs["a"]})
    h.gated.add("tiny/gated-GGUF")
    h.add("tiny/xet-GGUF", {"tiny-Q4_K_M.gguf": ggufs["a"], "README.md": b"# xet\n"})
    h.xet.add("tiny/xet-GGUF")
    h.add("tiny/plain-GGUF", {"tiny-Q4_K_M.gguf": ggufs["a"]})
    h.plain.add(("tiny/plain-GGUF", "tiny-Q4_K_M.gguf"))
    h.add("tiny/faults-GGUF", {"short-Q4_K_M.gguf": ggufs["a"], "cut-Q4_K_M.gguf": ggufs["a"],
                               "bad-Q4_K_M.gguf": ggufs["b"]})
    h.faults.update({("tiny/faults-GGUF", "short-Q4_K_M.gguf"): "short",
                     ("tiny/faults-GGUF", "cut-Q4_K_M.gguf"): "cut-once",
                     ("tiny/faults-GGUF", "bad-Q4_K_M.gguf"): "badhash"})
    yield h
    h.stop()


@pytest.fixture
def env(tmp_path, monkeypatch, fake_hub) -> dict:
    """Every store in a temporary directory, HF_ENDPOINT at the fake hub, no token: set in this process
    and returned for the commands it starts. Xet off (HF_HUB_DISABLE_XET, and huggingface_hub's
    constant, read at its import): the fake hub serves no Xet protocol, so huggingface_hub takes the
    302 to the CDN, as it does without hf_xet."""
    home = tmp_path / "home"
    home.mkdir()
    e = {"HOME": str(home), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
         "OLLAMA_MODELS": str(tmp_path / "ollama"), "PYLLAMA_KV_CACHE": str(tmp_path / "pk-cache"),
         "HF_ENDPOINT": fake_hub.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "10",
         "HF_TOKEN": "", "HF_HUB_OFFLINE": "0", "XDG_CACHE_HOME": str(tmp_path / "xdg"),
         "HF_HUB_DISABLE_XET": "1", "HF_XET_CACHE": str(tmp_path / "xet")}
    for k, v in e.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    return e


def _blobs(env) -> list[str]:
    d = Path(env["HF_HUB_CACHE"])
    return sorted(p.name for p in d.rglob("blobs/*")) if d.exists() else []


# ---------------------------------------------------------------------------------------------
# names and the quant rule


@pytest.mark.parametrize("spec, want", [
    ("owner/repo", hub.HubName("owner/repo")),
    ("owner/repo:Q8_0", hub.HubName("owner/repo", quant="Q8_0")),
    ("owner/repo/sub/file-Q4_K_M.gguf", hub.HubName("owner/repo", file="sub/file-Q4_K_M.gguf")),
    ("owner/repo@v1.0:q4_k_m", hub.HubName("owner/repo", "v1.0", "q4_k_m")),
    ("hf:owner/repo.gguf", hub.HubName("owner/repo.gguf")),
    ("hf.co/owner/repo:Q4_K_M", hub.HubName("owner/repo", quant="Q4_K_M")),
    ("models/file.gguf", None), ("./owner/repo", None), ("/abs/path", None), ("~/x/y", None),
    ("just-a-name", None), ("a/b/c", None),
])
def test_parse_names(spec, want):
    assert hub.parse(spec) == want


def test_quant_rule():
    files = ["x-Q8_0.gguf", "x-Q4_K_M.gguf", "x-Q4_K_S.gguf", "mmproj-x-f16.gguf", "README.md"]
    assert hub.choose(hub.HubName("o/r"), files) == ["x-Q4_K_M.gguf"]
    assert hub.choose(hub.HubName("o/r", quant="q8_0"), files) == ["x-Q8_0.gguf"]
    assert hub.choose(hub.HubName("o/r"), ["x-Q8_0.gguf", "x-Q4_0.gguf"]) == ["x-Q4_0.gguf"]
    assert hub.choose(hub.HubName("o/r"), ["only-IQ2_XS.gguf"]) == ["only-IQ2_XS.gguf"]
    split = [f"Q4_K_M/x-Q4_K_M-0000{i}-of-00002.gguf" for i in (2, 1)]
    assert hub.choose(hub.HubName("o/r"), [*split, "x-Q8_0.gguf"]) == sorted(split)
    assert hub.choose(hub.HubName("o/r", file="*Q8_0.gguf"), files) == ["x-Q8_0.gguf"]
    with pytest.raises(pk.ModelLoadError, match="none is the default.*Q6_K, Q3_K_S|Q3_K_S, Q6_K"):
        hub.choose(hub.HubName("o/r"), ["x-Q6_K.gguf", "x-Q3_K_S.gguf"])
    with pytest.raises(pk.ModelLoadError, match="no GGUF matching :Q2_K"):
        hub.choose(hub.HubName("o/r", quant="Q2_K"), files)
    with pytest.raises(pk.ModelLoadError, match="parts \\[1\\] of 2"):
        hub.choose(hub.HubName("o/r"), [split[1]])
    with pytest.raises(pk.ModelLoadError, match="no GGUF file"):
        hub.choose(hub.HubName("o/r"), ["model.safetensors"])


def assert_merge_of(merged: Path, whole: Path) -> None:
    """``merged`` is ``whole`` as ``llama-gguf-split --merge`` writes it: the same metadata and then
    split.no 0, split.tensors.count and split.count 0 (last), the same tensors, the same data."""
    m, w = read_gguf_header(merged), read_gguf_header(whole)
    assert list(m.kv)[:len(w.kv)] == list(w.kv)
    assert all(m.kv[k].type == kv.type and np.array_equal(np.asarray(m.kv[k].value, dtype=object),
                                                          np.asarray(kv.value, dtype=object)) for k, kv in w.kv.items())
    assert {k: kv.value for k, kv in list(m.kv.items())[len(w.kv):]} == \
        {"split.no": 0, "split.tensors.count": len(w.tensors), "split.count": 0}
    def info(h):
        return [(t.name, t.type, t.ne, t.offset) for t in h.tensors]

    assert info(m) == info(w)
    assert merged.read_bytes()[m.data_offset:] == whole.read_bytes()[w.data_offset:]


def test_split_merge_roundtrip(tmp_path):
    m = make_tiny_model(tmp_path / "t.gguf")
    parts = ggufsplit.split(m, 3, tmp_path, prefix="t")
    assert [p.name for p in parts] == [f"t-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert_merge_of(ggufsplit.merge(parts, tmp_path / "m.gguf"), m)
    with pytest.raises(pk.ModelLoadError, match="expected part 1 of 3"):
        ggufsplit.merge([parts[0], parts[2], parts[1]], tmp_path / "bad.gguf")
    assert not (tmp_path / "bad.gguf").exists() and not list(tmp_path.glob(".*part"))


def gguf_split_binary() -> Path | None:
    """llama.cpp's ``llama-gguf-split``: $PYLLAMA_KV_GGUF_SPLIT, else a build's (``build/*/cmake/bin``,
    ``build/*/bin``), else on PATH."""
    if os.environ.get("PYLLAMA_KV_GGUF_SPLIT"):
        return Path(os.environ["PYLLAMA_KV_GGUF_SPLIT"])
    root = Path(__file__).resolve().parent.parent
    found = sorted(root.glob("build/*/cmake/bin/llama-gguf-split")) + sorted(root.glob("build/*/bin/llama-gguf-split"))
    which = shutil.which("llama-gguf-split")
    return found[0] if found else Path(which) if which else None


def test_merge_is_llama_gguf_split(tmp_path, patched_lib):
    """Against llama.cpp's own tool: its parts load through our merge, which writes its --merge's bytes;
    our split with its plan (7 tensors a part) writes its parts' bytes."""
    tool = gguf_split_binary()
    if tool is None:   # `make setup` builds it with the patched library's tools (harness.build.TOOLS)
        if DEVICE_RUN:
            pytest.skip("device run: no llama-gguf-split built there")
        pytest.fail("no llama-gguf-split: `make setup` builds it (pyllama-kv build --tools), or set "
                    "$PYLLAMA_KV_GGUF_SPLIT")
    whole = make_tiny_model(tmp_path / "t.gguf")            # 21 tensors
    for args, prefix in ((["--split-max-tensors", "8"], "uneven"), (["--split-max-tensors", "7"], "even")):
        r = subprocess.run([str(tool), "--split", *args, str(whole), str(tmp_path / prefix)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    for prefix in ("uneven", "even"):
        parts = [tmp_path / ggufsplit.part_name(prefix, i, 3) for i in (1, 2, 3)]
        theirs = tmp_path / f"{prefix}-theirs.gguf"
        r = subprocess.run([str(tool), "--merge", str(parts[0]), str(theirs)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr
        assert ggufsplit.merge(parts, tmp_path / f"{prefix}-ours.gguf").read_bytes() == theirs.read_bytes()
        assert_merge_of(theirs, whole)
    with pk.Model(tmp_path / ggufsplit.part_name("uneven", 1, 3), lib=patched_lib) as m, \
            pk.Model(whole, lib=patched_lib) as w:                        # its parts, merged by us, loaded
        assert m.path.read_bytes() == (tmp_path / "uneven-theirs.gguf").read_bytes() and m.n_layer == 2
        toks = m.tokenize("hello world")
        with m.context(n_ctx=64) as a, w.context(n_ctx=64) as b:
            assert np.array_equal(a.new_sequence().extend(toks), b.new_sequence().extend(toks))
    (tmp_path / "ours").mkdir()
    ours = ggufsplit.split(whole, 3, tmp_path / "ours", prefix="even")
    assert [p.read_bytes() for p in ours] == [(tmp_path / ggufsplit.part_name("even", i, 3)).read_bytes()
                                             for i in (1, 2, 3)]


# ---------------------------------------------------------------------------------------------
# the hub


def test_from_pretrained_downloads_verifies_loads(env, ggufs, patched_lib, fake_hub):
    with pk.Model.from_pretrained("tiny/tiny-GGUF", lib=patched_lib) as m:   # the rule: Q4_K_M
        assert m.path.read_bytes() == ggufs["a"] and Path(env["HF_HUB_CACHE"]) in m.path.parents
        assert m.tokenize("hello")
    with pk.Model.from_pretrained("tiny/tiny-GGUF", quant="q8_0", lib=patched_lib) as m:
        assert m.path.read_bytes() == ggufs["b"]
    with pk.Model.from_pretrained("tiny/tiny-GGUF", "*Q8_0.gguf", revision=COMMIT, lib=patched_lib) as m:
        assert m.path.read_bytes() == ggufs["b"]
    assert not any(n.endswith(".incomplete") for n in _blobs(env))
    with pytest.raises(pk.InvalidInputError, match="OWNER/REPO"):
        pk.Model.from_pretrained("not a repo")


def test_split_model_downloads_whole_and_loads(env, ggufs, patched_lib):
    with pk.Model("hf:tiny/split-GGUF", lib=patched_lib) as m:
        assert m.path.parent == Path(env["PYLLAMA_KV_CACHE"]) / "merged"
        assert m.path.read_bytes() == ggufs["a-merged"] and m.n_layer == 2
    assert len(_blobs(env)) == 3


@pytest.mark.parametrize("spec, message", [
    ("tiny/nosuch-GGUF", "no such repo or it is gated/private: tiny/nosuch-GGUF on http://127.0.0.1:"),
    ("tiny/nogguf", "tiny/nogguf has no GGUF file"),
    ("tiny/many-GGUF", "has 2 GGUF models and none is the default"),
    ("tiny/tiny-GGUF:Q2_K", "has no GGUF matching :Q2_K: give one of its quants"),
    ("tiny/tiny-GGUF/nosuch.gguf", "no GGUF model.* matching nosuch.gguf"),
    ("tiny/tiny-GGUF@nosuch", "has no revision 'nosuch'"),
    ("tiny/gated-GGUF", "tiny/gated-GGUF is gated: accept its conditions"),
])
def test_hub_errors_are_one_line(env, spec, message):
    with pytest.raises(pk.ModelLoadError, match=message) as e:
        pk.Model(spec)
    assert "\n" not in str(e.value)
    assert _blobs(env) == []


def test_gated_repo_with_a_token(env, monkeypatch, ggufs, patched_lib):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pk.Model("tiny/gated-GGUF", lib=patched_lib) as m:
        assert m.path.read_bytes() == ggufs["a"]


def test_faulty_transfers(env, ggufs, patched_lib, fake_hub):
    with pytest.raises(pk.ModelLoadError, match="short-Q4_K_M.gguf: the download failed, nothing was kept"):
        pk.Model("tiny/faults-GGUF/short-Q4_K_M.gguf")
    assert _blobs(env) == []
    with pytest.raises(pk.ModelLoadError, match="bad-Q4_K_M.gguf: sha256 mismatch: the hub says [0-9a-f]{64}, "
                                                "the download is [0-9a-f]{64}; it was removed from the cache"):
        pk.Model("tiny/faults-GGUF/bad-Q4_K_M.gguf")
    assert _blobs(env) == []
    snaps = Path(env["HF_HUB_CACHE"]) / "models--tiny--faults-GGUF" / "snapshots"
    assert not [p for p in snaps.rglob("*.gguf")]
    with pk.Model("tiny/faults-GGUF/cut-Q4_K_M.gguf", lib=patched_lib) as m:   # broken off once: tried again
        assert m.path.read_bytes() == ggufs["a"]
    # huggingface_hub tried again at the CDN after the transfer broke off (from where it had written, or from 0)
    assert len([r for r in fake_hub.requests if r.startswith("CDN GET /lfs/tiny/faults-GGUF/cut-")]) == 2


def test_offline_and_not_cached(env, monkeypatch, fake_hub):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n = len(fake_hub.requests)
    with pytest.raises(pk.ModelLoadError, match="tiny/tiny-GGUF:Q8_0 is not in the Hugging Face cache .* and "
                                                "HF_HUB_OFFLINE is set"):
        pk.Model("tiny/tiny-GGUF:Q8_0")
    assert len(fake_hub.requests) == n


# ---------------------------------------------------------------------------------------------
# the hub as the real one answers (issue 45): a 302 to a CDN, Xet headers, ?blobs=true, 401 RepoNotFound


def _http(method: str, url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """One request, redirects not followed: (status, headers, body)."""

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *a, **k):
            return None

    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.build_opener(NoRedirect).open(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_fake_hub_answers_as_the_real_hub(fake_hub, ggufs):
    sha = hashlib.sha256(ggufs["a"]).hexdigest()
    status, h, _ = _http("HEAD", f"{fake_hub.url}/tiny/tiny-GGUF/resolve/main/tiny-Q4_K_M.gguf")
    assert status == 302 and h["Location"].startswith(fake_hub.cdn_url + "/") and fake_hub.cdn_url != fake_hub.url
    assert h["X-Linked-Etag"] == f'"{sha}"' and h["X-Linked-Size"] == str(len(ggufs["a"]))
    assert h["X-Repo-Commit"] == COMMIT and "X-Xet-Hash" not in h
    status, h, _ = _http("HEAD", f"{fake_hub.url}/tiny/xet-GGUF/resolve/main/tiny-Q4_K_M.gguf")
    assert status == 302 and re.fullmatch(r"[0-9a-f]{64}", h["X-Xet-Hash"]) and h["X-Linked-Etag"] == f'"{sha}"'
    assert h["X-Xet-Refresh-Route"] == f"/api/models/tiny/xet-GGUF/xet-read-token/{COMMIT}"
    assert 'rel="xet-auth"' in h["Link"] and "/xet-bridge/" in h["Location"]
    status, h, body = _http("GET", f"{fake_hub.url}/tiny/tiny-GGUF/resolve/main/README.md")   # not in LFS
    assert status == 200 and body == b"# tiny\n" and h["ETag"] == f'"{git_blob_sha1(body)}"'
    plain = json.loads(_http("GET", f"{fake_hub.url}/api/models/tiny/tiny-GGUF")[2])["siblings"]
    blobs = json.loads(_http("GET", f"{fake_hub.url}/api/models/tiny/tiny-GGUF?blobs=true")[2])["siblings"]
    assert all(set(f) == {"rfilename"} for f in plain)
    assert {f["rfilename"]: f["lfs"]["sha256"] for f in blobs if "lfs" in f}["tiny-Q4_K_M.gguf"] == sha
    for path in ("/api/models/tiny/nosuch-GGUF", "/tiny/nosuch-GGUF/resolve/main/x.gguf"):
        status, h, _ = _http("GET", fake_hub.url + path)
        assert (status, h["X-Error-Code"]) == (401, "RepoNotFound")   # no token: 401, as the real hub
        status, h, _ = _http("GET", fake_hub.url + path, {"Authorization": f"Bearer {TOKEN}"})
        assert (status, h["X-Error-Code"]) == (404, "RepoNotFound")


def test_listing_asks_for_the_blobs(env, fake_hub, ggufs):
    """The hub lists sha256s only to ``?blobs=true``: the listing asks for them (the sha256 a download
    is checked against), and a file not in LFS has none."""
    files, commit = hub.listing(huggingface_hub, hub.HubName("tiny/tiny-GGUF"))
    assert files["tiny-Q4_K_M.gguf"] == hashlib.sha256(ggufs["a"]).hexdigest() and files["README.md"] is None
    assert commit == COMMIT
    assert [r for r in fake_hub.requests if r.startswith("GET /api/models/tiny/tiny-GGUF?") and "blobs=" in r]


def test_no_such_repo_with_and_without_a_token(env, monkeypatch, fake_hub):
    """The real hub answers a missing (or private, or gated) repo 401 RepoNotFound to a caller without a
    token, 404 to one with: one line either way, that says it may be private or gated."""
    what = f"no such repo or it is gated/private: tiny/nosuch-GGUF on {fake_hub.url}"
    with pytest.raises(pk.ModelLoadError) as e:
        hub.fetch("tiny/nosuch-GGUF")
    assert str(e.value) == f"{what} (no token: set HF_TOKEN or run `hf auth login` for a private repo)"
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(pk.ModelLoadError) as e:
        hub.fetch("tiny/nosuch-GGUF:Q8_0")
    assert str(e.value) == f"{what} (the token sent has no access to it)"
    assert _blobs(env) == []


def test_download_goes_to_the_cdn_without_the_token(env, monkeypatch, ggufs, fake_hub):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    n = len(fake_hub.requests)
    path = hub.fetch("tiny/gated-GGUF")
    assert path.read_bytes() == ggufs["a"]
    asked = fake_hub.requests[n:]
    assert "HEAD /tiny/gated-GGUF/resolve/main/tiny-Q4_K_M.gguf" in asked
    assert "CDN GET /lfs/tiny/gated-GGUF/tiny-Q4_K_M.gguf" in asked
    assert not [r for r in asked if r.startswith("GET /tiny/gated-GGUF/resolve/")]   # the bytes came from the CDN
    assert fake_hub.cdn_auth == []                                                  # and the token stayed home


def test_xet_backed_file_over_http(env, ggufs, fake_hub):
    """Without Xet (no hf_xet, or HF_HUB_DISABLE_XET) huggingface_hub takes the 302 to the bridge: the
    file is the hub's bytes, checked against its sha256."""
    path = hub.fetch("tiny/xet-GGUF")
    assert path.read_bytes() == ggufs["a"]
    assert "CDN GET /xet-bridge/tiny/xet-GGUF/tiny-Q4_K_M.gguf" in fake_hub.requests


def test_xet_transfer_that_fails_is_one_line(env, monkeypatch, fake_hub):
    """With hf_xet, huggingface_hub asks the refresh route for a CAS token and hands the transfer to
    hf_xet, and this fake's CAS has nothing: one line, nothing kept."""
    pytest.importorskip("hf_xet")
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", False)
    for k, v in {"HF_HUB_DISABLE_XET": "0", "HF_XET_CLIENT_RETRY_MAX_ATTEMPTS": "1",
                 "HF_XET_CLIENT_RETRY_MAX_DURATION": "1s", "HF_XET_CLIENT_RECONSTRUCTION_API_VERSION": "1"}.items():
        monkeypatch.setenv(k, v)
    n = len(fake_hub.requests)
    with pytest.raises(pk.ModelLoadError, match="tiny/xet-GGUF/tiny-Q4_K_M.gguf: the download failed, nothing was "
                                                "kept") as e:
        hub.fetch("tiny/xet-GGUF")
    assert "\n" not in str(e.value)
    assert f"GET /api/models/tiny/xet-GGUF/xet-read-token/{COMMIT}" in fake_hub.requests[n:]
    assert [b for b in _blobs(env) if not b.endswith(".lock")] == []


def test_offline_file_in_the_shared_blob_store(env, monkeypatch, ggufs, fake_hub):
    """huggingface_hub (2.x, Xet) keeps a Xet file once per cache: the repo's ``blobs/SHA256`` links to
    ``<cache>/blobs/XX/XETHASH``. Offline, such a file is the sha256 its repo blob is named by (its
    target's name is a Xet hash, not its sha256)."""
    shared = pytest.importorskip("huggingface_hub.utils._shared_blobs")
    path = hub.fetch("tiny/xet-GGUF")
    blob = Path(os.path.realpath(path))
    xet = fake_hub.xet_hash(ggufs["a"])
    assert shared.publish_blob_to_shared_store(blob_path=str(blob), xet_hash=xet, cache_dir=env["HF_HUB_CACHE"],
                                               expected_size=len(ggufs["a"]))
    assert blob.is_symlink() and Path(os.path.realpath(path)).name == xet
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = hub.fetch("tiny/xet-GGUF")
    assert again == path and again.read_bytes() == ggufs["a"]


def test_offline_link_outside_the_cache_is_refused(env, monkeypatch, ggufs, tmp_path):
    """Offline, a snapshot file whose link leaves the repo's blobs (or whose blob leaves the cache) is
    one the hub cannot vouch for, whatever its name says: refused, unless asked for by name."""
    path = hub.fetch("tiny/tiny-GGUF:Q8_0")
    sha = hashlib.sha256(ggufs["b"]).hexdigest()
    elsewhere = tmp_path / "elsewhere" / sha            # named by its own sha256: proves nothing
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(ggufs["b"])
    path.unlink()
    path.symlink_to(elsewhere)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(pk.ModelLoadError, match="tiny/tiny-GGUF/tiny-Q8_0.gguf: refused: the hub cannot vouch for "
                                                ".*its link points outside the repo's blobs.*; to load it "
                                                "unverified, pass --trust-unverified \\(trust_unverified=True") as e:
        hub.fetch("tiny/tiny-GGUF:Q8_0")
    assert "\n" not in str(e.value)
    logs: list[str] = []
    assert hub.fetch("tiny/tiny-GGUF:Q8_0", logs.append, trust_unverified=True) == path
    assert [ln for ln in logs if "not verified" in ln and "--trust-unverified" in ln]
    r = run_cli(["inspect", "tiny/tiny-GGUF:Q8_0"], env={**env, "HF_HUB_OFFLINE": "1"})
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "--trust-unverified" in lines[0], r.stderr
    r = run_cli(["inspect", "tiny/tiny-GGUF:Q8_0", "--trust-unverified", "--json"], env={**env, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0 and json.loads(r.stdout)["architecture"] == "llama", r.stderr

    blob = Path(env["HF_HUB_CACHE"]) / "models--tiny--tiny-GGUF" / "blobs" / sha   # a blob that leaves the cache
    path.unlink()
    path.symlink_to(os.path.relpath(blob, path.parent))
    blob.unlink()
    blob.symlink_to(elsewhere)
    with pytest.raises(pk.ModelLoadError, match="its blob resolves outside the Hugging Face cache"):
        hub.fetch("tiny/tiny-GGUF:Q8_0")
    assert elsewhere.read_bytes() == ggufs["b"]


def test_file_not_in_lfs_is_checked_by_its_git_sha1(env, monkeypatch, ggufs, fake_hub):
    """A file not in LFS has no sha256 at the hub: its ETag, the name of its blob, is its git blob sha1,
    which is checked (online and offline) instead of nothing."""
    logs: list[str] = []
    path = hub.fetch("tiny/plain-GGUF", logs.append)
    assert path.read_bytes() == ggufs["a"] and Path(os.path.realpath(path)).name == git_blob_sha1(ggufs["a"])
    assert not [ln for ln in logs if "not checked" in ln or "not verified" in ln]
    real = Path(os.path.realpath(path))
    real.write_bytes(ggufs["b"])                                # the cache's copy changed under it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(pk.ModelLoadError, match="tiny/plain-GGUF/tiny-Q4_K_M.gguf: git sha1 mismatch: the hub says "
                                                f"{git_blob_sha1(ggufs['a'])}, the download is "
                                                f"{git_blob_sha1(ggufs['b'])}; it was removed from the cache"):
        hub.fetch("tiny/plain-GGUF")
    assert not os.path.lexists(path) and not os.path.lexists(real)


def test_offline_ref_that_names_no_commit(env, monkeypatch):
    refs = Path(env["HF_HUB_CACHE"]) / "models--tiny--tiny-GGUF" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("../../../../elsewhere")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(pk.ModelLoadError, match="refs/main \\(a ref of the Hugging Face cache\\) names no commit"):
        hub.fetch("tiny/tiny-GGUF")


def test_cli_run_downloads_with_progress_then_offline(env, fake_hub):
    # huggingface_hub draws its bar on a terminal; TQDM_POSITION=-1 is its switch to draw it anyway
    r = run_cli(["run", "tiny/tiny-GGUF:Q4_K_M", "-p", "hello", "-n", "3", "--lib", "patched"],
                env={**env, "TQDM_POSITION": "-1"})
    assert r.returncode == 0, r.stderr
    assert "downloading tiny/tiny-GGUF/tiny-Q4_K_M.gguf" in r.stderr and "100%" in r.stderr   # the progress bar
    n = len(fake_hub.requests)
    again = run_cli(["run", "tiny/tiny-GGUF:Q4_K_M", "-p", "hello", "-n", "3", "--lib", "patched"],
                    env={**env, "HF_HUB_OFFLINE": "1"})
    assert again.returncode == 0, again.stderr
    assert "downloading" not in again.stderr and len(fake_hub.requests) == n
    info = run_cli(["inspect", "tiny/tiny-GGUF", "--json"], env={**env, "HF_HUB_OFFLINE": "1"})
    assert info.returncode == 0 and json.loads(info.stdout)["architecture"] == "llama"
    pulled = run_cli(["pull", "tiny/tiny-GGUF:Q8_0", "--json"], env=env)
    assert pulled.returncode == 0 and json.loads(pulled.stdout)["path"].startswith(env["HF_HUB_CACHE"])
    bad = run_cli(["run", "tiny/faults-GGUF/bad-Q4_K_M.gguf", "-p", "x"], env=env)
    assert bad.returncode == 1 and "sha256 mismatch" in bad.stderr
    assert len([ln for ln in bad.stderr.splitlines() if "error" in ln]) == 1


# ---------------------------------------------------------------------------------------------
# the GGUFs already on disk


def _ollama(root: Path, name: tuple[str, ...], data: bytes, digest: str | None = None) -> Path:
    sha = hashlib.sha256(data).hexdigest()
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    (blobs / f"sha256-{sha}").write_bytes(data)
    manifest = root / "manifests" / Path(*name)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "config": {"digest": "sha256:" + "0" * 64},
                                    "layers": [{"mediaType": "application/vnd.ollama.image.template",
                                                "digest": "sha256:" + "1" * 64, "size": 10},
                                               {"mediaType": local.OLLAMA_MODEL_MEDIA,
                                                "digest": digest or f"sha256:{sha}", "size": len(data)}]}))
    return blobs / f"sha256-{sha}"


def test_local_stores(env, ggufs, patched_lib, tmp_path):
    oll = Path(env["OLLAMA_MODELS"])
    blob = _ollama(oll, ("registry.ollama.ai", "library", "tiny", "latest"), ggufs["a"])
    _ollama(oll, ("hf.co", "tiny", "tiny-GGUF", "Q8_0"), ggufs["b"])
    lms = Path(env["HOME"]) / ".lmstudio" / "models" / "tiny" / "tiny-GGUF"
    lms.mkdir(parents=True)
    (lms / "tiny-Q8_0.gguf").write_bytes(ggufs["b"])
    for n, d in ggufs.items():
        if "-of-" in n:
            (lms / n).write_bytes(d)
    assert pk.Model("tiny/tiny-GGUF:Q8_0", lib=patched_lib).path.is_file()   # into the Hugging Face cache

    r = run_cli(["models", "--local", "--json"], env=env)
    assert r.returncode == 0, r.stderr
    got = {m["name"]: m for m in json.loads(r.stdout)["models"]}
    assert set(got) == {"tiny/tiny-GGUF/tiny-Q8_0.gguf", "ollama:tiny:latest", "ollama:hf.co/tiny/tiny-GGUF:Q8_0",
                        "lmstudio:tiny/tiny-GGUF/tiny-Q8_0.gguf",
                        "lmstudio:tiny/tiny-GGUF/tiny-Q4_K_M-00001-of-00003.gguf"}
    assert {m["store"] for m in got.values()} == {"huggingface", "ollama", "lmstudio"}
    assert all(m["architecture"] == "llama" and "patched" in m["loads_with"] and "current" in m["loads_with"]
               for m in got.values())
    assert got["ollama:tiny:latest"]["path"] == str(blob) and got["ollama:tiny:latest"]["size"] == len(ggufs["a"])
    assert got["lmstudio:tiny/tiny-GGUF/tiny-Q4_K_M-00001-of-00003.gguf"]["parts"] == 3
    text = run_cli(["models", "--local"], env=env)
    assert "ollama:tiny:latest" in text.stdout and "--lib patched, current" in text.stdout

    with pk.Model("ollama:tiny", lib=patched_lib) as m:          # read in place, never copied
        assert m.path == blob
    with pk.Model("ollama:hf.co/tiny/tiny-GGUF:Q8_0", lib=patched_lib) as m:
        assert m.path.read_bytes() == ggufs["b"]
    with pk.Model("lmstudio:tiny/tiny-GGUF/tiny-Q4_K_M-00001-of-00003.gguf", lib=patched_lib) as m:
        assert m.path.read_bytes() == ggufs["a-merged"]
    run = run_cli(["run", "lmstudio:tiny/tiny-GGUF/tiny-Q8_0.gguf", "-p", "hi", "-n", "2"], env=env)
    assert run.returncode == 0, run.stderr


def test_bad_ollama_stores(env, ggufs, tmp_path):
    oll = Path(env["OLLAMA_MODELS"])
    lib = ("registry.ollama.ai", "library")
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(ggufs["a"])
    sha = hashlib.sha256(ggufs["a"]).hexdigest()
    _ollama(oll, (*lib, "escape", "latest"), b"GGUF", digest=f"sha256:{sha}")
    (oll / "blobs" / f"sha256-{sha}").symlink_to(outside)          # a blob link that leaves the store
    _ollama(oll, (*lib, "dots", "latest"), b"GGUF", digest="../../outside.gguf")
    _ollama(oll, (*lib, "notgguf", "latest"), b"PK\x03\x04 not a model")
    lying = _ollama(oll, (*lib, "lying", "latest"), ggufs["b"])
    lying.write_bytes(ggufs["a"])                                      # not the bytes its digest names
    cases = {"escape": "points outside the store", "dots": "is not a sha256", "notgguf": "is not a GGUF file",
             "lying": "sha256 mismatch", "nosuch": "not in Ollama's store", "../x": "not an Ollama model name"}
    for name, message in cases.items():
        with pytest.raises(pk.ModelLoadError, match=message) as e:
            pk.Model(f"ollama:{name}")
        assert "\n" not in str(e.value)
    r = run_cli(["run", "ollama:notgguf", "-p", "x"], env=env)
    assert r.returncode == 1 and "is not a GGUF file" in r.stderr
    listed = {m.name: m for m in local.scan(("ollama",))}
    assert "outside the store" in (listed["ollama:escape:latest"].error or "")
    assert listed["ollama:lying:latest"].error is None       # listing reads headers; using it checks the digest
    assert outside.read_bytes() == ggufs["a"]


@pytest.mark.parametrize("cmd", [["serve"], ["chat"], ["inspect"], ["pull"], ["run", "-p", "x"]])
def test_every_model_argument_takes_hub_names(env, cmd):
    """Each command's MODEL goes through the one resolver: a hub name's error is its one line, exit 1."""
    r = run_cli([cmd[0], "tiny/nosuch-GGUF", *cmd[1:]], env=env, input="")
    assert r.returncode == 1, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "no such repo or it is gated/private: tiny/nosuch-GGUF" in ln]
    assert len(errors) == 1, r.stderr
