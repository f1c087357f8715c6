"""The embeddings and rerank wire formats: /v1/embeddings (OpenAI), /api/embed (Ollama) and /v1/rerank
(llama-server's, Jina's shape): the bodies checked into an :class:`EmbedRequest` (a 400 naming the field
otherwise, with :mod:`.protocol`'s errors) and the answers written. The chats' wire format is
:mod:`.protocol`'s."""
from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from ..limits import INT32_MAX, MAX_EMBED_INPUTS
from .protocol import _flag, _integer, _only, bad


@dataclass
class EmbedRequest:
    """A checked embeddings or rerank body. ``inputs``: texts or token-id lists (embeddings), documents
    (rerank); the model's range check of token ids is the caller's."""

    kind: str                          # "openai", "ollama" or "rerank"
    model: str | None
    inputs: list                       # str | list[int] each
    encoding_format: str = "float"     # openai: "float" or "base64"
    dimensions: int | None = None      # accepted only when it is the model's n_embd
    truncate: bool = False             # ollama: cut an input longer than the server embeds (its default)
    query: str = ""                    # rerank
    top_n: int | None = None           # rerank: the first top_n results (None: all)
    return_documents: bool = False     # rerank: each result carries its document's text


#: the fields each endpoint takes (anything else is a 400 naming it)
EMBED_FIELDS = {"openai": ("model", "input", "encoding_format", "dimensions", "user"),
                "ollama": ("model", "input", "truncate", "dimensions", "keep_alive", "options"),
                "rerank": ("model", "query", "documents", "top_n", "return_documents", "user")}


def _embed_input(v, name: str) -> list:
    """OpenAI's ``input``: a string, a list of strings, a list of token ids, or a list of those lists;
    each non-empty, at most MAX_EMBED_INPUTS of them. Returned as a list of inputs."""
    def is_ids(x) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(v, str) or is_ids(v):
        v = [v]
    if not isinstance(v, list) or not v:
        raise bad(name, f"{name} must be a string, a list of strings, a list of token ids or a list of those "
                        "(not empty)", code="missing_required_parameter" if v is None else "invalid_value")
    if len(v) > MAX_EMBED_INPUTS:
        raise bad(name, f"{name} has {len(v)} items; at most {MAX_EMBED_INPUTS} are embedded in one request")
    for i, x in enumerate(v):
        if isinstance(x, str):
            if not x:
                raise bad(name, f"{name}[{i}] is an empty string")
        elif not is_ids(x):
            raise bad(name, f"{name}[{i}] must be a non-empty string or a non-empty list of token ids")
    return list(v)


def parse_embeddings(body, kind: str = "openai") -> EmbedRequest:
    """``POST /v1/embeddings`` (kind "openai": ``input``, ``encoding_format`` float or base64, ``dimensions``
    (only the model's own: checked by the caller), ``user``) or Ollama's ``POST /api/embed`` (kind
    "ollama": ``input`` strings, ``truncate`` (default true), ``keep_alive`` accepted without effect,
    ``options`` refused unless empty)."""
    body = _only(body, EMBED_FIELDS[kind])
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad("model", "model must be a non-empty string (see GET /v1/models)")
    if kind == "ollama" and model is None:
        raise bad("model", "model is required (a string: see GET /api/tags or /v1/models)",
                  code="missing_required_parameter")
    inputs = _embed_input(body.get("input"), "input")
    req = EmbedRequest(kind=kind, model=model, inputs=inputs, dimensions=_integer(body, "dimensions", 1, INT32_MAX))
    if kind == "openai":
        fmt = body.get("encoding_format")
        if fmt not in (None, "float", "base64"):
            raise bad("encoding_format", f"encoding_format must be 'float' or 'base64', got {fmt!r}")
        req.encoding_format = fmt or "float"
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise bad("user", "user must be a string")
    else:
        req.truncate = _flag(body, "truncate", True) if body.get("truncate") is not None else True
        if body.get("options") not in (None, {}):
            raise bad("options", "options (model parameters) are not supported by this endpoint: the server's "
                                 "flags set them", code="unsupported_parameter")
    return req


def parse_rerank(body) -> EmbedRequest:
    """llama-server's ``POST /v1/rerank`` (Jina's shape): ``query`` (a string), ``documents`` (strings),
    ``top_n`` (the first n results, most relevant first), ``return_documents``, ``model``, ``user``."""
    body = _only(body, EMBED_FIELDS["rerank"])
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad("model", "model must be a non-empty string (see GET /v1/models)")
    query = body.get("query")
    if not isinstance(query, str):
        raise bad("query", "query is required (a string)", code="missing_required_parameter")
    docs = body.get("documents")
    if isinstance(docs, list) and len(docs) > MAX_EMBED_INPUTS:
        raise bad("documents", f"documents has {len(docs)} items; at most {MAX_EMBED_INPUTS} in one request")
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise bad("documents", "documents is required (a non-empty list of strings)",
                  code="missing_required_parameter" if docs is None else "invalid_value")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user", "user must be a string")
    return EmbedRequest(kind="rerank", model=model, inputs=list(docs), query=query,
                        top_n=_integer(body, "top_n", 1, INT32_MAX),
                        return_documents=_flag(body, "return_documents", False))


def embeddings_response(req: EmbedRequest, model_id: str, vectors: list, n_tokens: int) -> dict:
    """The answer of /v1/embeddings (OpenAI's list of embedding objects, base64: little-endian float32)
    or /api/embed (Ollama's ``embeddings``)."""
    if req.kind == "ollama":
        return {"model": req.model or model_id, "embeddings": [v.tolist() for v in vectors],
                "prompt_eval_count": n_tokens}
    data = []
    for i, v in enumerate(vectors):
        emb: Any = base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") \
            if req.encoding_format == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "data": data, "model": req.model or model_id,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}


def rerank_response(req: EmbedRequest, model_id: str, scores: list[float], n_tokens: int) -> dict:
    """The answer of /v1/rerank: ``results`` (index, relevance_score[, document]), most relevant first."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n]
    results = []
    for i in order:
        r: dict = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            r["document"] = {"text": req.inputs[i]}
        results.append(r)
    return {"object": "list", "model": req.model or model_id, "results": results,
            "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}}
