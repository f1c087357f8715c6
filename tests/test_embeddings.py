"""Embeddings and rerank (issue 33, items 1, 2 and 6): Model.embed / Model.rerank, and `pyllama-kv serve`'s
/v1/embeddings (the official openai client, float and base64), Ollama's /api/embed and /v1/rerank.

Models: tiny F32 models from the project's generator: a BERT encoder (llama.cpp's ``bert``, mean pooling
in its GGUF), a BERT reranker (rank pooling, with the ``cls``/``cls.output`` head) and a llama decoder
embedded with a pooling override (mean, last).

Exactness (<= 1e-5, F32 weights): ``llama-embedding`` (examples/embedding) is not among the tools our
build makes (harness/build.py builds llama-server and llama-batched-bench), and building it would compile
llama.cpp once more; so each vector is compared with two references that are llama.cpp's own:

* llama.cpp's ``llama-server --embeddings`` (and ``--reranking``) from the patched build, on the same
  file and text: its /v1/embeddings vectors (normalised as llama-embedding normalises them,
  common_embd_normalize(…, 2)) and its /v1/rerank scores;
* a single-sequence decode of the same tokens with the plain C calls (cffi, no pyllama_kv code on the
  path): llama_init_from_model with embeddings on, one llama_decode, llama_get_embeddings_seq, as
  llama-embedding's batch_decode does for one prompt, normalised here in numpy.

Our vectors come from batches of many sequences in one decode, so the comparison also checks that
batching over sequences changes nothing beyond rounding.

Servers run on 127.0.0.1 on a free port, their loops bounded; no timing is asserted.
"""
from __future__ import annotations

import base64
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

import pyllama_kv as pk
from conftest import DEVICE_RUN
from pyllama_kv._native.ffi import ffi
from pyllama_kv.harness import build as _build
from pyllama_kv.limits import POOLING_TYPES
from pyllama_kv.tools.gguf import make_tiny_model
from test_server import ServerProc, wait_healthy

TEXTS = ["the cache model", "a fork of the sequence", "people work here", "batch prefix token defrag",
         "the old man and the sea"]
TOL = 1e-5


@pytest.fixture(scope="module")
def bert_path(models) -> Path:
    return make_tiny_model(models / "bert.gguf", arch="bert", n_ctx_train=512, seed=3)


@pytest.fixture(scope="module")
def reranker_path(models) -> Path:
    return make_tiny_model(models / "reranker.gguf", arch="bert", pooling="rank", n_ctx_train=512, seed=4)


@pytest.fixture(scope="module")
def bert(bert_path):
    with pk.Model(bert_path) as m:
        yield m


@pytest.fixture(scope="module")
def reranker(reranker_path):
    with pk.Model(reranker_path) as m:
        yield m


@pytest.fixture(scope="module")
def decoder(tiny_model):
    with pk.Model(tiny_model) as m:
        yield m


# -- references -----------------------------------------------------------------------------------


def c_reference(model: pk.Model, tokens: list[int], pooling: str) -> np.ndarray:
    """One sequence's pooled vector from the plain C calls (see the module docstring), normalised as
    common_embd_normalize(..., 2) does (the norm in double); rank: the raw score."""
    L = model.native_library.lib
    p = L.llama_context_default_params()
    p.n_ctx = p.n_batch = p.n_ubatch = 512
    p.n_seq_max = 1
    p.n_threads = p.n_threads_batch = 1
    p.embeddings = True
    p.pooling_type = POOLING_TYPES[pooling]
    p.type_k = p.type_v = 0   # an F32 cache (a decoder's cells within the decode)
    ctx = L.llama_init_from_model(model._ptr, p)
    assert ctx != ffi.NULL
    try:
        n = len(tokens)
        tok, pos, nsid = ffi.new("llama_token[]", tokens), ffi.new("llama_pos[]", list(range(n))), \
            ffi.new("int32_t[]", [1] * n)
        sid = ffi.new("llama_seq_id[]", [0] * n)
        sidp = ffi.new("llama_seq_id *[]", [sid + i for i in range(n)])
        out = ffi.new("int8_t[]", [1] * n)
        batch = ffi.new("llama_batch *")
        batch.n_tokens, batch.token, batch.embd, batch.pos = n, tok, ffi.NULL, pos
        batch.n_seq_id, batch.seq_id, batch.logits = nsid, sidp, out
        assert L.llama_decode(ctx, batch[0]) == 0
        width = 1 if pooling == "rank" else model.n_embd
        v = np.frombuffer(ffi.buffer(L.llama_get_embeddings_seq(ctx, 0), 4 * width), dtype=np.float32).copy()
    finally:
        L.llama_free(ctx)
    if pooling == "rank":
        return v
    norm = float(np.sqrt(np.sum(v.astype(np.float64) ** 2)))
    return (v * np.float32(1.0 / norm if norm > 0 else 0.0)).astype(np.float32)


def _llama_server_bin() -> Path | None:
    for b in _build.find_builds():
        if b.get("variant") == "patched" and "llama-server" in b.get("tools", []):
            p = Path(b["bin_dir"]) / "llama-server"
            if p.exists():
                return p
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama.cpp's own llama-server on 127.0.0.1 (a free port), waited for with a bounded loop."""

    def __init__(self, model: Path, *args: str, timeout: float = 60.0):
        binary = _llama_server_bin()
        if binary is None:
            if DEVICE_RUN:
                pytest.skip("device run: no llama-server built there")
            pytest.fail("llama-server is not built: `make setup` builds it (pyllama-kv build --tools)")
        self.url = f"http://127.0.0.1:{_free_port()}"
        port = self.url.rsplit(":", 1)[1]
        self.proc = subprocess.Popen([str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", port, "-t", "1",
                                      "-c", "512", "-b", "512", "-ub", "512", *args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        if not wait_healthy(self.url, self.proc, timeout):
            self.stop()
            raise AssertionError("llama-server did not become healthy")

    def post(self, path: str, body: dict) -> dict:
        r = httpx.post(self.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# -- the API: exactness ---------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_bert_batched_equals_single_sequence_c_decode(bert, pooling):
    got = bert.embed(TEXTS, pooling=pooling)
    assert got.shape == (len(TEXTS), bert.n_embd) and got.dtype == np.float32
    for text, v in zip(TEXTS, got):
        ref = c_reference(bert, bert.tokenize(text, add_bos=True, special=True), pooling)
        assert np.abs(v - ref).max() <= TOL
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_decoder_with_a_pooling_equals_single_sequence_c_decode(decoder, pooling):
    with decoder.embedder(pooling, type_k="f32", type_v="f32") as emb:
        got = emb.embed([np.asarray(decoder.tokenize(t, special=True), dtype=np.int32) for t in TEXTS])
    for text, v in zip(TEXTS, got):
        assert np.abs(v - c_reference(decoder, decoder.tokenize(text, special=True), pooling)).max() <= TOL


def test_bert_equals_llama_server_embeddings(bert, bert_path):
    srv = LlamaServer(bert_path, "--embeddings")
    try:
        theirs = srv.post("/v1/embeddings", {"input": TEXTS})["data"]
        cls = srv.post("/v1/embeddings", {"input": TEXTS[:2]})   # (the GGUF's pooling: mean)
    finally:
        srv.stop()
    ours = bert.embed(TEXTS)
    for d in theirs:
        assert np.abs(ours[d["index"]] - np.asarray(d["embedding"], dtype=np.float32)).max() <= TOL
    assert len(cls["data"]) == 2


def test_decoder_last_pooling_equals_llama_server(decoder, tiny_model):
    srv = LlamaServer(tiny_model, "--embeddings", "--pooling", "last", "-ctk", "f32", "-ctv", "f32")
    try:
        theirs = srv.post("/v1/embeddings", {"input": TEXTS})["data"]
    finally:
        srv.stop()
    with decoder.embedder("last", type_k="f32", type_v="f32") as emb:
        ours = emb.embed([np.asarray(decoder.tokenize(t, special=True), dtype=np.int32) for t in TEXTS])
    for d in theirs:
        assert np.abs(ours[d["index"]] - np.asarray(d["embedding"], dtype=np.float32)).max() <= TOL


def test_rerank_scores_equal_llama_server_and_the_c_decode(reranker, reranker_path):
    query, docs = "the cache", ["a cache model", "the old sea", "people", "the cache of the model"]
    ours = reranker.rerank(query, docs)
    assert sorted(i for i, _ in ours) == list(range(len(docs)))
    assert [s for _, s in ours] == sorted((s for _, s in ours), reverse=True)
    srv = LlamaServer(reranker_path, "--reranking")
    try:
        theirs = srv.post("/v1/rerank", {"query": query, "documents": docs})["results"]
    finally:
        srv.stop()
    by = dict(ours)
    for r in theirs:
        assert abs(by[r["index"]] - r["relevance_score"]) <= TOL
    q = reranker.tokenize(query, add_bos=False, special=True)
    for i, d in enumerate(docs):
        toks = [reranker.bos, *q, reranker.eos, reranker.sep, *reranker.tokenize(d, add_bos=False, special=True),
                reranker.eos]
        assert abs(by[i] - float(c_reference(reranker, toks, "rank")[0])) <= TOL
    assert reranker.rerank(query, docs, top_n=2) == ours[:2]


# -- the API: shapes and refusals -------------------------------------------------------------------


def test_embed_shapes_token_ids_and_normalisation(bert):
    one = bert.embed("the cache model")
    assert one.shape == (bert.n_embd,)
    toks = bert.tokenize("the cache model", special=True)
    assert np.abs(bert.embed(toks) - one).max() <= TOL
    assert np.abs(bert.embed(np.asarray(toks, dtype=np.int64)) - one).max() <= TOL
    both = bert.embed([toks, "the cache model"])
    assert both.shape == (2, bert.n_embd) and np.abs(both[0] - both[1]).max() <= TOL
    raw = bert.embed("the cache model", normalize=False)
    assert abs(float(np.linalg.norm(raw)) - 1.0) > 1e-3
    assert np.abs(raw / np.linalg.norm(raw) - one).max() <= TOL
    per_token = bert.embed(["the cache", "model"], pooling="none")
    assert [a.shape for a in per_token] == [(len(bert.tokenize("the cache", special=True)), bert.n_embd),
                                            (len(bert.tokenize("model", special=True)), bert.n_embd)]
    assert reranker_like_shape(bert) == (bert.n_embd,)


def reranker_like_shape(model) -> tuple:
    with model.embedder("cls", n_batch=64, n_seqs=4) as emb:
        return emb.embed([np.asarray(model.tokenize("x", special=True), dtype=np.int32)])[0].shape


def test_many_inputs_span_several_decodes(bert):
    texts = [f"{w} the cache model {i}" for i, w in enumerate(TEXTS * 30)]   # 150 inputs: more than 64 per decode
    got = bert.embed(texts)
    assert got.shape == (150, bert.n_embd)
    assert np.abs(got[0] - bert.embed(texts[0])).max() <= TOL
    assert np.abs(got[149] - bert.embed(texts[149])).max() <= TOL


@pytest.mark.parametrize("inputs,match", [
    ([], "non-empty"),
    ([[]], "no tokens"),
    ([[1, 2], [5, 10**6]], "out of range"),
    ([[1, -3]], "out of range"),
    ([["a"]], "integers"),
    ([3.5], "str or a list"),
    ({"a": 1}, "inputs must be"),
    ([[1] * 600], "1 to 512"),
    (["x"] * 3000, "at most 2048"),
])
def test_bad_inputs_raise_before_c(bert, inputs, match):
    with pytest.raises(pk.InvalidInputError, match=match):
        bert.embed(inputs)
    assert bert.embed("still alive").shape == (bert.n_embd,)


def test_bad_arguments_and_non_rerankers_are_refused(bert, decoder, reranker):
    with pytest.raises(pk.InvalidInputError, match="pooling must be"):
        bert.embed("x", pooling="max")
    with pytest.raises(pk.InvalidInputError, match="normalize"):
        bert.embed("x", normalize="yes")
    for m in (bert, decoder):   # rank pooling on a model without the head would abort in llama.cpp
        with pytest.raises(pk.InvalidInputError, match="reranker"):
            m.embed("x", pooling="rank")
        with pytest.raises(pk.InvalidInputError, match="reranker"):
            m.rerank("q", ["d"])
    for args in (("q", []), (3, ["d"]), ("q", ["d", 4])):
        with pytest.raises(pk.InvalidInputError):
            reranker.rerank(*args)
    with pytest.raises(pk.InvalidInputError, match="top_n"):
        reranker.rerank("q", ["d"], top_n=0)
    with pytest.raises(pk.InvalidInputError, match="n_batch"):
        bert.embedder(n_batch=0)
    assert not bert.can_generate and decoder.can_generate


def test_closing_the_model_closes_its_embedders(bert_path):
    m = pk.Model(bert_path)
    emb = m.embedder()
    m.embed("x")
    m.close()
    assert emb.closed
    with pytest.raises(pk.InvalidInputError, match="closed"):
        m.embed("x")


# -- the server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_server(bert_path):
    with ServerProc(bert_path, "--parallel", "1", "--batch", "256") as s:
        yield s


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.root + path, json=body, headers=server.headers(), timeout=60)


def test_openai_client_float_and_base64_equal_the_library(bert_server, bert):
    client = bert_server.client()
    ref = bert.embed(TEXTS)
    # no encoding_format: the client asks for base64 and decodes it; "float": JSON numbers; "base64" given
    # explicitly: the client hands the string back as it came
    for kw in ({}, {"encoding_format": "float"}, {"encoding_format": "base64"}):
        r = client.embeddings.create(model="bert", input=TEXTS, **kw)
        assert [d.index for d in r.data] == list(range(len(TEXTS)))
        for d in r.data:
            v = d.embedding if not isinstance(d.embedding, str) else np.frombuffer(base64.b64decode(d.embedding), "<f4")
            assert np.abs(np.asarray(v, dtype=np.float32) - ref[d.index]).max() <= TOL
        assert r.usage.prompt_tokens == sum(len(bert.tokenize(t, special=True)) for t in TEXTS)
    raw = post(bert_server, "/v1/embeddings", {"input": "the cache model", "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.abs(vec - ref[0]).max() <= TOL
    toks = bert.tokenize(TEXTS[1], special=True)
    r = client.embeddings.create(model="bert", input=[toks, toks], encoding_format="float", user="u1",
                                 dimensions=bert.n_embd)
    assert np.abs(np.asarray(r.data[1].embedding) - ref[1]).max() <= TOL


def test_ollama_embed(bert_server, bert):
    r = post(bert_server, "/api/embed", {"model": "bert", "input": TEXTS[:2], "keep_alive": "5m"})
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()["embeddings"], dtype=np.float32)
    assert np.abs(got - bert.embed(TEXTS[:2])).max() <= TOL
    long = " ".join(["the cache model"] * 200)   # more than the 256-token batch: Ollama's truncate (default on)
    assert post(bert_server, "/api/embed", {"model": "bert", "input": long}).status_code == 200
    r = post(bert_server, "/api/embed", {"model": "bert", "input": long, "truncate": False})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/embeddings", {}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [[1, 2], "x", 5]}, "input"),
    ("/v1/embeddings", {"input": [[1, 10**7]]}, "input"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "dimensions": "64"}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "user": 5}, "user"),
    ("/v1/embeddings", {"input": "x", "temperature": 1}, "temperature"),
    ("/v1/embeddings", {"input": " ".join(["the cache model"] * 200)}, "input[0]"),
    ("/v1/embeddings", {"input": ["x"] * 2049}, "input"),
    ("/api/embed", {"input": "x"}, "model"),
    ("/api/embed", {"model": "bert", "input": "x", "options": {"temperature": 1}}, "options"),
    ("/v1/rerank", {"query": "q", "documents": ["d"]}, None),
    ("/v1/chat/completions", {"model": "bert", "messages": [{"role": "user", "content": "hi"}]}, None),
])
def test_bad_requests_are_400s_and_the_server_keeps_serving(bert_server, bert, path, body, param):
    r = post(bert_server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    r = post(bert_server, "/v1/embeddings", {"input": "the cache model", "encoding_format": "float"})
    assert r.status_code == 200 and np.abs(np.asarray(r.json()["data"][0]["embedding"]) - bert.embed(
        "the cache model")).max() <= TOL


def test_unknown_model_is_a_404_and_metrics_count(bert_server):
    assert post(bert_server, "/v1/embeddings", {"model": "nope", "input": "x"}).status_code == 404
    before = bert_server.metrics()
    assert post(bert_server, "/v1/embeddings", {"input": ["a b", "c d", "e"]}).status_code == 200
    after = bert_server.metrics()
    assert after["pyllama_kv_embedding_requests_total"] == before.get("pyllama_kv_embedding_requests_total", 0) + 1
    assert after["pyllama_kv_embedding_inputs_total"] == before.get("pyllama_kv_embedding_inputs_total", 0) + 3


def test_rerank_endpoint(reranker_path, reranker):
    s = ServerProc(reranker_path, "--parallel", "1")
    try:
        query, docs = "the cache", ["a cache model", "the old sea", "people"]
        ours = reranker.rerank(query, docs)
        for path in ("/v1/rerank", "/rerank"):
            r = post(s, path, {"model": "reranker", "query": query, "documents": docs, "top_n": 2,
                               "return_documents": True})
            assert r.status_code == 200, r.text
            res = r.json()["results"]
            assert [x["index"] for x in res] == [i for i, _ in ours[:2]]
            assert all(abs(x["relevance_score"] - dict(ours)[x["index"]]) <= TOL for x in res)
            assert res[0]["document"] == {"text": docs[res[0]["index"]]}
        for body, param in (({"documents": ["d"]}, "query"), ({"query": "q", "documents": []}, "documents"),
                            ({"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
                            ({"query": "q", "texts": ["d"]}, "texts")):
            r = post(s, "/v1/rerank", body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = post(s, "/v1/embeddings", {"input": "x"})   # a reranker's output is a score, not an embedding
        assert r.status_code == 400 and "rerank" in r.json()["error"]["message"]
    finally:
        s.stop()


def test_a_decoder_server_embeds_while_it_chats(tiny_model, decoder):
    """Embeddings go through the engine's one loop, between generation steps: chats and embeddings
    interleave, both answered (no timing asserted)."""
    s = ServerProc(tiny_model, "--pooling", "mean", "--parallel", "2", "--ctx", "1024", "--type-k", "f32",
                   "--type-v", "f32")
    try:
        client = s.client()
        with ThreadPoolExecutor(4) as pool:
            chats = [pool.submit(client.completions.create, model="tiny", prompt="the cache model", max_tokens=40,
                                 temperature=0) for _ in range(2)]
            embs = [pool.submit(client.embeddings.create, model="tiny", input=TEXTS, encoding_format="float")
                    for _ in range(3)]
            for c in chats:
                assert c.result().usage.completion_tokens > 0
            with decoder.embedder("mean", type_k="f32", type_v="f32") as emb:
                ref = emb.embed([np.asarray(decoder.tokenize(t, special=True), dtype=np.int32) for t in TEXTS])
            for e in embs:
                got = np.asarray([d.embedding for d in e.result().data], dtype=np.float32)
                assert np.abs(got - ref).max() <= TOL
    finally:
        s.stop()


def test_serve_pooling_rank_on_a_non_reranker_is_refused_at_start(bert_path):
    from conftest import ENTRY_POINT, ROOT

    cmd = [str(ENTRY_POINT), "serve", str(bert_path), "--port", "0", "--pooling", "rank"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0 and "reranker" in r.stderr
    r = subprocess.run([str(ENTRY_POINT), "serve", str(bert_path), "--pooling", "max"], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "--pooling" in r.stderr
