"""The models people already have (issue 34): Hugging Face repos by name, through huggingface_hub, against
a fake hub on 127.0.0.1 (HF_ENDPOINT); the GGUFs in the Hugging Face cache, a fake Ollama store and a fake
LM Studio folder, all in temporary directories. No network; the real loading code runs."""
from __future__ import annotations

import hashlib
import http.server
import json
import re
import threading
import urllib.parse
from pathlib import Path

import pytest

from conftest import run_cli
from pyllama_kv.modelfile import ggufsplit, hub, local
from pyllama_kv.tools.gguf import make_tiny_model

pytest.importorskip("huggingface_hub")
import pyllama_kv as pk  # noqa: E402

COMMIT = "a" * 40
TOKEN = "hf_fake_token"
#: seconds the fake hub serves at most, whatever happens to the test that started it
HUB_LIFETIME = 600


class FakeHub:
    """What huggingface_hub asks a hub for: the repo listing (``/api/models/OWNER/REPO[/revision/REV]``)
    and ``/OWNER/REPO/resolve/REV/PATH`` (HEAD and GET, with X-Repo-Commit, ETag/X-Linked-Etag (the
    sha256), X-Linked-Size and ranges), and its errors: 404 RepoNotFound/RevisionNotFound/EntryNotFound,
    401 GatedRepo. Per file, a fault: ``short`` (a transfer that ends early, every time), ``cut-once`` (the
    first transfer breaks off, a resumed one completes it), ``badhash`` (bytes that are not the sha256
    the listing gives)."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.faults: dict[tuple[str, str], str] = {}
        self.gated: set[str] = set()
        self.requests: list[str] = []
        self.cut: set = set()
        hub_ = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_HEAD(self):
                hub_.answer(self, body=False)

            def do_GET(self):
                hub_.answer(self, body=True)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()
        self.timer = threading.Timer(HUB_LIFETIME, self.stop)   # stops itself
        self.timer.daemon = True
        self.timer.start()

    def stop(self):
        self.timer.cancel()
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo: str, files: dict[str, bytes]):
        self.repos[repo] = files

    def lfs_sha(self, repo: str, name: str) -> str:
        data = self.repos[repo][name]
        if self.faults.get((repo, name)) == "badhash":
            data = data[:-1] + bytes([data[-1] ^ 1])   # the listing names other bytes than those served
        return hashlib.sha256(data).hexdigest()

    @staticmethod
    def error(h, status: int, code: str | None, body=True):
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("Content-Length", "0")
        h.end_headers()

    def answer(self, h, body: bool):
        url = urllib.parse.urlsplit(h.path)
        path = urllib.parse.unquote(url.path)
        self.requests.append(f"{h.command} {path} {h.headers.get('Range', '')}".strip())
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path)
        if m:
            return self.listing(h, m[1], m[2] or "main", body)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self.resolve(h, m[1], m[2], m[3], body)
        return self.error(h, 404, None)

    def check_repo(self, h, repo: str, rev: str) -> bool:
        if repo not in self.repos:
            self.error(h, 404, "RepoNotFound")
            return False
        if repo in self.gated and h.headers.get("Authorization") != f"Bearer {TOKEN}":
            self.error(h, 401, "GatedRepo")
            return False
        if rev not in ("main", COMMIT):
            self.error(h, 404, "RevisionNotFound")
            return False
        return True

    def listing(self, h, repo: str, rev: str, body: bool):
        if not self.check_repo(h, repo, rev):
            return
        siblings = [{"rfilename": n, "size": len(d), "blobId": hashlib.sha1(d).hexdigest(),
                     **({"lfs": {"sha256": self.lfs_sha(repo, n), "size": len(d), "pointerSize": 134}}
                        if n.endswith(".gguf") else {})}
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
            return self.error(h, 404, "EntryNotFound")
        data = self.repos[repo][name]
        fault = self.faults.get((repo, name))
        etag = self.lfs_sha(repo, name) if name.endswith(".gguf") else hashlib.sha1(data).hexdigest()
        start = 0
        rng = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range", ""))
        if body and rng:
            start = int(rng[1])
        send = data[start:]
        if body and fault == "short":
            send = send[:len(send) // 2]          # the whole answer, but too short
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{etag}"')
        if name.endswith(".gguf"):
            h.send_header("X-Linked-Etag", f'"{etag}"')
            h.send_header("X-Linked-Size", str(len(data)))
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
    return {"a": a.read_bytes(), "b": b.read_bytes(), **{p.name: p.read_bytes() for p in parts}}


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
    and returned for the commands it starts."""
    home = tmp_path / "home"
    home.mkdir()
    e = {"HOME": str(home), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"),
         "OLLAMA_MODELS": str(tmp_path / "ollama"), "PYLLAMA_KV_CACHE": str(tmp_path / "pk-cache"),
         "HF_ENDPOINT": fake_hub.url, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "10",
         "HF_TOKEN": "", "HF_HUB_OFFLINE": "0", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    for k, v in e.items():
        monkeypatch.setenv(k, v)
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


def test_split_merge_roundtrip(tmp_path):
    m = make_tiny_model(tmp_path / "t.gguf")
    parts = ggufsplit.split(m, 3, tmp_path, prefix="t")
    assert [p.name for p in parts] == [f"t-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert ggufsplit.merge(parts, tmp_path / "m.gguf").read_bytes() == m.read_bytes()
    with pytest.raises(pk.ModelLoadError, match="expected part 1 of 3"):
        ggufsplit.merge([parts[0], parts[2], parts[1]], tmp_path / "bad.gguf")
    assert not (tmp_path / "bad.gguf").exists() and not list(tmp_path.glob(".*part"))


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
        assert m.path.read_bytes() == ggufs["a"] and m.n_layer == 2
    assert len(_blobs(env)) == 3


@pytest.mark.parametrize("spec, message", [
    ("tiny/nosuch-GGUF", "tiny/nosuch-GGUF: no such model repo on the Hugging Face hub"),
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
    # huggingface_hub tried again after the transfer broke off (from where it had written, or from 0)
    assert len([r for r in fake_hub.requests if r.startswith("GET /tiny/faults-GGUF/resolve/main/cut-")]) == 2


def test_offline_and_not_cached(env, monkeypatch, fake_hub):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n = len(fake_hub.requests)
    with pytest.raises(pk.ModelLoadError, match="tiny/tiny-GGUF:Q8_0 is not in the Hugging Face cache .* and "
                                                "HF_HUB_OFFLINE is set"):
        pk.Model("tiny/tiny-GGUF:Q8_0")
    assert len(fake_hub.requests) == n


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
        assert m.path.read_bytes() == ggufs["a"]
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
    errors = [ln for ln in r.stderr.splitlines() if "no such model repo on the Hugging Face hub" in ln]
    assert len(errors) == 1, r.stderr
