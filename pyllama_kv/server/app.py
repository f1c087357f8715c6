"""The ASGI app (starlette) and its runner (uvicorn), over one :class:`~pyllama_kv.engine.Engine`.

Ollama's runner model: the engine's thread owns the context and runs the one loop; a handler only
parses and tokenizes the request, submits it, and relays the engine's events, which the engine
thread hands to the asyncio loop (``call_soon_threadsafe`` into a queue per request).

Every generating endpoint takes the same path (:meth:`Server._serve`): its wire format is a
:class:`~pyllama_kv.server.relay.Dialect` (chat and completions: protocol.py; the Responses API:
responses.py; Anthropic's Messages API: messages.py), which checks the body into a chat or completion
request and writes the answer, the stream and the errors; limits, cancellation and metrics are here,
once.

* Prefix reuse: requests are submitted with the engine's ``keep_finished`` (on by default): a prompt
  is remembered as an idle cached sequence as soon as it is evaluated, and a finished request's
  prompt + answer replaces it, so a later request forks the longest cached prefix (a shared system
  prompt, or the conversation so far) instead of evaluating it again. Idle cached sequences are
  evicted before a request has to wait for cells.
* Nothing lost, nothing leaked: a client that goes away (streaming or not) has its request
  cancelled, and the engine frees its cells at its next step. Every failure becomes a JSON error
  (tracebacks go to the server's log only). A client that goes away — while sending its body or
  while waiting for its answer — is not a failure: it is counted (``client_disconnects``), not
  logged.
* Shutdown (SIGINT/SIGTERM): uvicorn stops accepting; running requests get ``shutdown_grace``
  seconds to finish, then are cancelled; the engine and its context are closed; exit 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator

import anyio
import anyio.to_thread
import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from .._worker import Cancelled
from ..chat import toolcall
from ..chat.conversation import Transcripts
from ..chat.templates import Rendered, apply_chat_template, chat_template
from ..core.embedding import embed_inputs, rerank_tokens
from ..core.span import shared_prefix
from ..engine.request import GRAMMAR_ERROR
from ..errors import InvalidInputError, LlamaError, QueueFullError
from ..limits import CHECKPOINT_MIN_TOKENS, prompt_too_long
from ..sampling.grammar import Grammar, GrammarCache, GrammarError
from . import embedproto, messages, protocol, responses
from .base import ServerBase, _Gone
from .config import ServerConfig
from .kvevents import KVEventPublisher
from .metrics import CONTENT_TYPE, Metrics, Snapshot
from .protocol import APIError, GenRequest
from .relay import Bounds, Dialect, OpenAIDialect, Relay, error_response

log = logging.getLogger("pyllama_kv.server")

_UNKNOWN = object()   # (a grammar the cache does not know yet)

#: threads that compile grammars not in the cache (each waits for a grammar worker, then builds the
#: matcher here): apart from the threads every request renders and tokenizes on
GRAMMAR_THREADS = 4
#: tokens a chunk of a /tokenize answer with pieces holds (each chunk made on a worker thread)
PIECES_CHUNK = 2048

_ERROR_FINISH = {"cache_full": (503, "server_error", "kv_cache_full"), "error": (500, "server_error", "engine_error")}


_error = error_response   # (OpenAI's error object)


def _utf8(text: str) -> bytes:
    """JSON text (or an SSE event of it) written with ``ensure_ascii=False``, as UTF-8: a lone surrogate
    a client sent (valid in a JSON string as an escape, not encodable as UTF-8) is written as that escape
    again, instead of failing the answer."""
    return text.encode("utf-8", "backslashreplace")


class _JSON(JSONResponse):
    """starlette's JSONResponse for answers that may repeat the client's text (see :func:`_utf8`)."""

    def render(self, content) -> bytes:
        return _utf8(json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")))


class Server(ServerBase):
    """The app over ``engine`` (not started yet; the app's lifespan starts and closes it).

    ``model_names``: the names a request's ``model`` may give (the first is the id /v1/models lists).
    ``template``: a chat template's source to render every chat with instead of the model's (``serve
    --template FILE``, called ``template_name`` in errors); None: the model's own.
    """

    def __init__(self, model, engine, config: ServerConfig, model_names: list[str], library: str | None = None,
                 template: str | None = None, template_name: str | None = None):
        self.model = model
        self.template, self.template_name = template, template_name
        self.engine = engine
        self.config = config
        self.model_id = model_names[0]
        self.model_names = set(model_names)
        self.library = library
        self.created = int(time.time())
        self.snapshot = Snapshot()
        self.metrics = Metrics(self)
        self.shutting_down = False
        #: --kv-events: the prefix cache's changes over ZeroMQ, in vLLM's format (None: off)
        self.kv_events = KVEventPublisher(config.kv_events, config.kv_events_block_size) \
            if config.kv_events else None
        self._key_digest = hashlib.sha256((config.api_key or "").encode("latin-1")).digest()
        self._grace: threading.Timer | None = None
        self._piece = functools.lru_cache(maxsize=1 << 16)(model.token_to_piece)
        # control tokens as their text (/tokenize's pieces)
        self._piece_json = functools.lru_cache(maxsize=1 << 16)(self._one_piece_json)
        # compiled grammars and verdicts by text: agents send the same schema and tools again and again,
        # and a hostile grammar costs a worker's time once
        self.grammars = GrammarCache(model)
        self._grammar_threads = anyio.CapacityLimiter(GRAMMAR_THREADS)
        # chats come back whole: their earlier answers are tokenized as the cache holds them
        self.transcripts = Transcripts(model)
        self.can_generate = model.can_generate   # False: an encoder (BERT family), embeddings only
        # the generating endpoints' wire formats (relay.Dialect), over the one engine path (_serve)
        bounds = Bounds(engine.config.parallel, engine.config.max_tokens, model.check_tokens)
        self.response_store = responses.ResponseStore()
        self.dialects: dict[str, Dialect] = {
            "chat": OpenAIDialect("chat", bounds, self._piece),
            "completion": OpenAIDialect("completion", bounds, self._piece),
            "responses": responses.ResponsesDialect(bounds, self.response_store),
            "messages": messages.MessagesDialect(bounds, self._piece)}
        self.anthropic = self.dialects["messages"]
        anthropic = messages.error_response
        routes = [
            self._route("/v1/chat/completions", self.chat, "POST"),
            self._route("/v1/completions", self.completions, "POST"),
            self._route("/v1/responses", self.responses, "POST"),
            self._route("/v1/responses/{id}", self.stored_response, "GET"),
            self._route("/v1/responses/{id}", self.delete_response, "DELETE"),
            self._route("/v1/messages", self.messages, "POST", errors=anthropic),
            self._route("/v1/messages/count_tokens", self.count_tokens, "POST", errors=anthropic),
            self._route("/v1/models", self.models, "GET"),
            self._route("/v1/models/{model:path}", self.model_info, "GET"),
            self._route("/health", self.health, "GET", auth=False),
            self._route("/metrics", self.metrics_text, "GET"),
            self._route("/tokenize", self.tokenize, "POST"),
            self._route("/detokenize", self.detokenize, "POST"),
            self._route("/apply-template", self.apply_template, "POST"),
            # embeddings and rerank (issue 33: the section "embeddings and rerank" below)
            self._route("/v1/embeddings", self.embeddings, "POST"),
            self._route("/api/embed", self.ollama_embed, "POST"),
            self._route("/v1/rerank", self.rerank, "POST"),
            self._route("/rerank", self.rerank, "POST"),
        ]
        self.app = Starlette(routes=routes, lifespan=self._lifespan,
                             exception_handlers={HTTPException: self._http_error, Exception: self._internal_error})

    # -- endpoints --------------------------------------------------------------------------------

    async def health(self, request: HTTPRequest) -> Response:
        ok = self.engine.alive and not self.shutting_down
        eng = self.engine   # (two counts: no need to wait for a step to end)
        return JSONResponse({"status": "ok" if ok else "unavailable", "requests_running": eng.running_requests,
                             "requests_queued": eng.waiting}, status_code=200 if ok else 503)

    def _model_object(self) -> dict:
        """OpenAI's model object, with the llama.cpp library it runs on (``library``: its variant;
        ``library_chosen``: why, when the model chose it, see Model.library_choice)."""
        out = {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "pyllama-kv",
               "library": self.library}
        why = getattr(self.model, "library_choice", "")
        if why:
            out["library_chosen"] = why
        return out

    async def models(self, request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def model_info(self, request: HTTPRequest) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_object())

    async def metrics_text(self, request: HTTPRequest) -> Response:
        self.snapshot = await Snapshot.ask(self.engine)   # taken by the engine between two steps
        return Response(self.metrics.text(), media_type=CONTENT_TYPE)

    # -- llama-server's utility endpoints (its request and answer shapes) ------------------------

    async def tokenize(self, request: HTTPRequest) -> Response:
        """``{"content", "add_special", "parse_special", "with_pieces"}`` -> ``{"tokens": [...]}`` (with
        pieces: ``[{"id", "piece"}]``, a piece that is not whole UTF-8 as its list of bytes). Tokenized,
        and each piece and the answer's JSON made, on a worker thread: per-token work never runs on the
        event loop."""
        args = protocol.parse_tokenize(await self._body(request))
        return await run_in_threadpool(self._tokenize, *args)

    def _tokenize(self, content: str, add_special: bool, parse_special: bool, with_pieces: bool) -> Response:
        m = self.model
        try:
            toks = m.tokenize(content, add_bos=add_special, special=parse_special)
        except InvalidInputError as e:
            raise protocol.bad("content", f"content: {e}") from None
        if not with_pieces:
            return JSONResponse({"tokens": toks})
        # each token's {"id", "piece"} JSON is made once (cached), and the answer is sent in chunks, each
        # joined on a worker thread: a long list never holds the GIL long enough to stall the engine
        piece = self._piece_json

        def chunks():
            yield '{"tokens":['
            for i in range(0, len(toks), PIECES_CHUNK):
                yield ("," if i else "") + ",".join([piece(t) for t in toks[i:i + PIECES_CHUNK]])
            yield "]}"
        return StreamingResponse(chunks(), media_type="application/json")

    def _one_piece_json(self, token: int) -> str:
        """``{"id": token, "piece": ...}`` as JSON: the piece's text, or its list of bytes when it is not
        whole UTF-8 (llama-server's shape)."""
        b = self.model.token_to_piece(token, special=True)
        try:
            piece: str | list[int] = b.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(b)
        return json.dumps({"id": token, "piece": piece}, separators=(",", ":"))

    async def detokenize(self, request: HTTPRequest) -> Response:
        """``{"tokens": [...]}`` -> ``{"content": text}`` (control tokens as their text, as llama-server
        renders them); a 400 naming ``tokens`` for an id out of range. Checked and detokenized on a worker
        thread."""
        raw = protocol.parse_detokenize(await self._body(request))
        return await run_in_threadpool(self._detokenize, raw)

    def _detokenize(self, raw: list) -> Response:
        try:
            toks = self.model.check_tokens(raw)
        except InvalidInputError as e:
            raise protocol.bad("tokens", str(e)) from None
        return JSONResponse({"content": self.model.detokenize(toks, special=True)})

    async def apply_template(self, request: HTTPRequest) -> Response:
        """``{"messages": [...]}`` -> ``{"prompt": text}``: the chat template applied (in its sandbox), with
        the generation prompt, as a chat completion would see it (checked and rendered on a worker thread)."""
        return await run_in_threadpool(self._apply_template, await self._body(request))

    def _apply_template(self, body) -> Response:
        msgs = protocol.parse_apply_template(body)
        try:
            text = self._render(msgs)
        except InvalidInputError as e:
            raise protocol.bad("messages", str(e)) from None
        return _JSON({"prompt": str(text)})

    # -- embeddings and rerank (the engine's loop runs them: engine/embeddings.py) ---------------

    async def embeddings(self, request: HTTPRequest) -> Response:
        """OpenAI's ``POST /v1/embeddings``."""
        return await self._embeddings(request, "openai")

    async def ollama_embed(self, request: HTTPRequest) -> Response:
        """Ollama's ``POST /api/embed``."""
        return await self._embeddings(request, "ollama")

    async def _embeddings(self, request: HTTPRequest, kind: str) -> Response:
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        req = await run_in_threadpool(embedproto.parse_embeddings, await self._body(request), kind)
        if req.model is not None:
            self._check_model(req.model)
        pooling = self.engine.embeddings.pooling
        if pooling in ("rank", "none"):
            why = "it is a reranker: its scores are served at /v1/rerank" if pooling == "rank" else \
                "its pooling is none (one vector per token): start the server with --pooling mean, cls or last"
            raise APIError(400, f"{self.model_id} does not serve embeddings of whole inputs: {why}",
                           code="model_not_supported")
        if req.dimensions is not None and req.dimensions != self.model.n_embd:
            raise protocol.bad("dimensions", f"dimensions={req.dimensions}: this model's embeddings have "
                               f"{self.model.n_embd} dimensions (other sizes are not supported)",
                               code="unsupported_parameter")
        toks = await run_in_threadpool(self._embedding_tokens, req.inputs, req.truncate)
        vectors = await self._embed(request, toks, normalize=True)
        if vectors is None:
            return Response(status_code=499)
        n = sum(len(t) for t in toks)
        return await run_in_threadpool(
            lambda: _JSON(embedproto.embeddings_response(req, self.model_id, vectors, n)))

    def _fit(self, toks, name: str, truncate: bool = False):
        """``toks`` within the embedding batch (cut when ``truncate``), else a 400 naming ``name``."""
        limit = self.engine.embeddings.n_batch
        if len(toks) <= limit:
            return toks
        if truncate:
            return toks[:limit]
        raise protocol.bad(name, f"{name} has {len(toks)} tokens; this server embeds at most {limit} tokens per "
                           "input (its batch: serve --batch, within the model's n_ctx_train)",
                           code="context_length_exceeded")

    def _embedding_tokens(self, inputs: list, truncate: bool) -> list:
        """Each input's tokens (text with the model's special tokens, as llama-server), checked."""
        out = []
        for i, x in enumerate(inputs):
            try:
                toks = embed_inputs(self.model, [x])[0][0]
            except InvalidInputError as e:
                raise protocol.bad("input", f"input[{i}]: {e}") from None
            out.append(self._fit(toks, f"input[{i}]", truncate))
        return out

    async def rerank(self, request: HTTPRequest) -> Response:
        """llama-server's ``POST /v1/rerank`` (and ``/rerank``): a reranker's relevance of each document to
        the query, most relevant first."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        req = await run_in_threadpool(embedproto.parse_rerank, await self._body(request))
        if req.model is not None:
            self._check_model(req.model)
        pooling = self.engine.embeddings.pooling
        if pooling != "rank":
            raise APIError(400, f"{self.model_id} is not a reranker (its pooling is {pooling}): /v1/rerank needs a "
                           "reranker GGUF (pooling rank)", code="model_not_supported")
        toks = await run_in_threadpool(self._rerank_tokens, req)
        scores = await self._embed(request, toks, normalize=False)
        if scores is None:
            return Response(status_code=499)
        n = sum(len(t) for t in toks)
        return await run_in_threadpool(
            lambda: _JSON(embedproto.rerank_response(req, self.model_id, [float(v[0]) for v in scores], n)))

    def _rerank_tokens(self, req) -> list:
        m = self.model
        try:
            q = m.tokenize(req.query, add_bos=False, special=True)
            out = []
            for i, d in enumerate(req.inputs):
                toks = rerank_tokens(m, q, m.tokenize(d, add_bos=False, special=True))
                out.append(np.asarray(self._fit(toks, f"documents[{i}]"), dtype=np.int32))
            return out
        except InvalidInputError as e:
            raise protocol.bad(None, str(e)) from None

    async def _embed(self, request: HTTPRequest, toks: list, normalize: bool) -> list | None:
        """Submit to the engine and await the results; None when the client went away first (the request
        is dropped from the engine's queue)."""
        try:
            fut = self.engine.submit_embedding(toks, normalize)
        except QueueFullError as e:
            raise APIError(429, str(e), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
        except InvalidInputError as e:
            raise protocol.bad(None, str(e)) from None
        waiting = asyncio.wrap_future(fut)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        gone = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not waiting.done():
            fut.cancel()
            self.metrics.client_disconnects.labels("embedding").inc()
            return None
        if waiting.cancelled():   # the engine stopped (shutdown)
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        exc = waiting.exception()
        if isinstance(exc, InvalidInputError):
            raise protocol.bad(None, str(exc)) from None
        if exc is not None:
            raise APIError(500, f"the embedding failed: {type(exc).__name__}: {exc}", "server_error",
                           code="engine_error")
        return waiting.result()

    async def chat(self, request: HTTPRequest) -> Response:
        return await self._serve(request, self.dialects["chat"])

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._serve(request, self.dialects["completion"])

    async def responses(self, request: HTTPRequest) -> Response:
        return await self._serve(request, self.dialects["responses"])

    async def messages(self, request: HTTPRequest) -> Response:
        return await self._serve(request, self.dialects["messages"])

    async def stored_response(self, request: HTTPRequest) -> Response:
        """``GET /v1/responses/{id}``: a stored response (``store``: true, not evicted yet), its JSON as kept."""
        return Response(self.response_store.answer(request.path_params["id"]), media_type="application/json")

    async def delete_response(self, request: HTTPRequest) -> Response:
        """``DELETE /v1/responses/{id}``: forget a stored response."""
        return JSONResponse(self.response_store.delete(request.path_params["id"]))

    async def count_tokens(self, request: HTTPRequest) -> Response:
        """Anthropic's ``POST /v1/messages/count_tokens``: the prompt's tokens, rendered and tokenized
        exactly as ``/v1/messages`` would (tools included)."""
        assert isinstance(self.anthropic, messages.MessagesDialect)
        req = await run_in_threadpool(self.anthropic.parse_count, await self._body(request))
        self._check_model(req.model)
        toks = await run_in_threadpool(self._prepare, req)
        return JSONResponse({"input_tokens": len(toks)})

    def _check_model(self, name: str) -> None:
        if name not in self.model_names:
            raise APIError(404, f"the model {name!r} does not exist: this server serves {self.model_id!r}",
                           param="model", code="model_not_found")

    @staticmethod
    def _grammars_of(req: GenRequest) -> list[tuple[Grammar, str, bool]]:
        """The grammars a request needs, each with the field it came from and whether it is compiled
        (the output's grammar: response_format, grammar, or the one that shapes a tool call) or only
        checked (each tool's parameters, ``tools[i].function.parameters``: the tools are rendered
        only with schemas llguidance takes)."""
        out = [(g, req.param(f), False) for g, f in req.tools.parameter_grammars()] \
            if req.tools is not None and req.tools.active else []
        g = req.grammar
        if g is not None:
            field = req.grammar_param or "grammar"
            if field == "response_format" and g.kind == "json_schema":
                field = "response_format.json_schema.schema"
            out.append((g, req.param(field), True))
        return out

    def _known(self, needed: list[tuple[Grammar, str, bool]]):
        """The output's compiled grammar (None without one) when the cache knows every grammar of
        ``needed``, a 400 for a known refusal, or ``_UNKNOWN``: the event loop's fast path."""
        out = None
        for g, field, compiled in needed:
            hit = self.grammars.peek(g, compiled)
            if isinstance(hit, GrammarError):
                raise protocol.bad(field, f"{field}: {hit}", code="invalid_grammar")
            if hit is None:
                return _UNKNOWN
            if compiled:
                out = hit
        return out

    def _compile(self, needed: list[tuple[Grammar, str, bool]], cancel: threading.Event | None = None):
        """Check each tool's parameters, then compile the output's grammar (on a thread of the grammar
        limiter; constrain.GrammarCache: cached by text, refusals too, one compilation of a grammar at
        a time); the output's compiled grammar, or a 400 naming the field of the first that cannot be
        compiled. The first compilation of a grammar runs in a grammar worker process: one that crashes
        or stalls llguidance costs a worker, never this server."""
        out = None
        for g, field, compiled in needed:
            try:
                if compiled:
                    out = self.grammars.compile(g, cancel)
                else:
                    self.grammars.check(g, cancel)
            except GrammarError as e:
                raise protocol.bad(field, f"{field}: {e}", code="invalid_grammar") from None
        return out

    def _check_length(self, req: GenRequest, toks: list[int]) -> None:
        cfg = self.engine.config
        truncate = req.truncate if req.truncate is not None else cfg.truncate
        why = None if truncate else prompt_too_long(len(toks), self.engine.n_ctx)   # truncate: the engine cuts it
        if why:
            raise protocol.bad(req.param("messages" if req.kind == "chat" else "prompt"), why,
                               code="context_length_exceeded")

    def _prepare(self, req: GenRequest) -> list[int]:
        """The prompt's token ids (on a worker thread: rendering and tokenizing take a while), and with
        tools, the grammar that forces or shapes a call (``req.grammar``)."""
        toks = self._tokens(req)
        try:
            g = toolcall.grammar(req.tool_format, req.tools) if req.kind == "chat" else None
        except GrammarError as e:   # (each tool's parameters were in bounds: their combination is not)
            raise protocol.bad(req.param("tools"), f"{req.param('tools')}: {e}", code="invalid_grammar") from None
        if g is not None:
            req.grammar, req.grammar_param = g, "tools"
        return toks

    async def _prepared(self, request: HTTPRequest, req: GenRequest) -> tuple[list[int], object]:
        """The prompt's tokens and the compiled grammar. Grammars not in the cache are compiled on
        threads of their own limiter (GRAMMAR_THREADS), so that a flood of grammars waiting for the
        grammar workers never holds the threads other requests render and tokenize on; given up when
        the client leaves meanwhile (a grammar worker compiling is killed then): _Gone("preparing")."""
        toks = await run_in_threadpool(self._prepare, req)
        self._check_length(req, toks)   # before any grammar costs a worker's time
        needed = self._grammars_of(req)
        known = self._known(needed)
        if known is not _UNKNOWN:
            return toks, known
        cancel = threading.Event()
        work = asyncio.ensure_future(anyio.to_thread.run_sync(self._compile, needed, cancel,
                                                              limiter=self._grammar_threads))

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        gone = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            cancel.set()
            with contextlib.suppress(Exception):
                await work
            raise _Gone("preparing")
        try:
            return toks, work.result()
        except Cancelled:   # pragma: no cover - only set above
            raise _Gone("preparing") from None

    def _tokens(self, req: GenRequest) -> list[int]:
        """The prompt's token ids."""
        m = self.model
        param = req.param("messages" if req.kind == "chat" else "prompt")
        try:
            if req.kind == "chat":
                req.tool_format = toolcall.detect_format(self.template or chat_template(m))
                msgs, tools = toolcall.prepare(req.tool_format, req.tools, req.prompt)
                req.rendered = self._render(msgs, tools=tools)
                req.prompt_ids = self.transcripts.tokenize(req.rendered)
                req.boundaries = self._system_end(msgs, tools, req.prompt_ids)
                return req.prompt_ids
            if isinstance(req.prompt, str):
                return m.tokenize(req.prompt, add_bos=True, special=True)
            return m.check_tokens(req.prompt).tolist()
        except InvalidInputError as e:
            raise protocol.bad(param, str(e)) from None

    def _render(self, msgs: list, add_generation_prompt: bool = True, tools: list | None = None) -> Rendered:
        """``msgs`` rendered with the server's chat template (``template``, else the model's)."""
        return apply_chat_template(self.model, msgs, add_generation_prompt, source=self.template,
                                   name=self.template_name, tools=tools)

    def _system_end(self, msgs: list, tools: list | None, prompt_ids: list[int]) -> list[int] | None:
        """Where the leading system messages end in ``prompt_ids``, for a model with recurrent layers or a
        sliding-window cache (Model.branch_checkpoints): the engine keeps a checkpoint there, so that
        every conversation under the same system prompt forks all of it (PrefixCache.keeps_checkpoints).
        None for other models, or when the messages start with no system message (or are nothing else).
        A template that renders the system prompt into the first user turn (Gemma's) renders the
        system messages alone as little more than BOS: there the end is where the first user message's
        content starts, found as where two renderings with different contents part."""
        m = self.model
        if not m.branch_checkpoints:
            return None
        k = next((i for i, msg in enumerate(msgs) if msg.get("role") not in ("system", "developer")), len(msgs))
        if k == 0 or k == len(msgs):
            return None

        def rendered(extra: list) -> list[int]:
            return self.transcripts.tokenize(self._render(msgs[:k] + extra, add_generation_prompt=False, tools=tools))
        try:
            b = shared_prefix(rendered([]), prompt_ids)
            if b < CHECKPOINT_MIN_TOKENS:
                x, y = (rendered([{"role": "user", "content": c}]) for c in ("x", "y"))
                b = shared_prefix(x[:shared_prefix(x, y)], prompt_ids)
        except InvalidInputError:
            return None   # a template that refuses a conversation of system messages alone
        return [b] if CHECKPOINT_MIN_TOKENS <= b < len(prompt_ids) else None

    async def _serve(self, request: HTTPRequest, dialect: Dialect) -> Response:
        """A generating endpoint, whatever its dialect: check the body into a chat or completion request,
        prepare and submit it, then answer it whole or stream it."""
        t0 = time.perf_counter()
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        if not self.can_generate:
            raise APIError(400, f"{self.model_id} is an embedding model (no language-model head): it serves "
                           "/v1/embeddings (and /v1/rerank for a reranker), not completions",
                           code="model_not_supported")
        req = await run_in_threadpool(dialect.parse, await self._body(request))   # (per item: off the loop)
        self._check_model(req.model)
        toks, grammar = await self._prepared(request, req)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cfg = self.engine.config

        stream = req.stream

        def deliver(ev) -> None:   # (on the engine's thread)
            # an answer sent whole waits for the last event of each continuation alone: a wake-up of the
            # event loop per token costs the decode a core's slice (2 cores: the decode took 2x as long)
            if stream or ev.finish_reason is not None:
                loop.call_soon_threadsafe(events.put_nowait, ev)
        try:
            handle = self.engine.submit(toks, req.params, max_tokens=req.max_tokens or cfg.max_tokens, stop=req.stop,
                                        n=req.n, on_event=deliver, grammar=grammar, logprobs=req.logprobs,
                                        **req.engine_options())
        except QueueFullError as e:
            raise APIError(429, str(e), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
        except InvalidInputError as e:
            raise protocol.bad(None, str(e)) from None
        if req.stream:
            return StreamingResponse(self._stream(req, handle, events, t0, dialect.stream(req, handle)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if not await self._wait(request, req, handle, events):
            return Response(status_code=499)   # nobody is there to read it
        comps = handle.completions   # complete: each is filled in before its last event is sent
        err = self._failure(comps, req)
        if err is not None:
            return dialect.error(err)
        self._observe(handle, t0)
        return await run_in_threadpool(self._answer, dialect, req, comps, handle.usage)

    def _answer(self, dialect: Dialect, req: GenRequest, comps, usage) -> Response:
        """A whole answer, on a worker thread (its transcript kept, its JSON made: per-token work)."""
        self._remember(req, comps)
        return _JSON(dialect.answer(req, comps, usage))

    def _remember(self, req: GenRequest, comps) -> None:
        """Keep each chat answer whose cells the cache holds as it was generated (finished by eos or
        length, the prompt neither truncated nor shifted) for the chat's next turn (Transcripts). Not
        an answer a grammar shaped (response_format, tools): forced tokens are often not the ones
        tokenizing its text gives, and the model reads such a history worse (SmolLM2 called a tool
        again instead of answering its result), so those are tokenized as text next turn."""
        if req.rendered is None or req.prompt_ids is None or req.grammar is not None:
            return
        for c in comps:
            if (c.finish_reason in ("eos", "length") and c.tokens
                    and c.context_tokens == req.prompt_ids + list(c.tokens)):
                self.transcripts.remember(req.rendered, req.prompt_ids, c.text, c.tokens)

    def _observe(self, handle, t0: float) -> None:
        if handle.ttft is not None:
            self.metrics.ttft.observe(handle.ttft)
        self.metrics.latency.observe(time.perf_counter() - t0)

    @staticmethod
    def _failure(completions, req: GenRequest | None = None) -> APIError | None:
        for c in completions:
            if c.finish_reason == "error" and (c.error or "").startswith(GRAMMAR_ERROR) and req is not None:
                # the grammar broke while generating: the client's grammar, not the server, is at fault
                field = req.grammar_param or "grammar"
                if field == "response_format" and req.grammar is not None and req.grammar.kind == "json_schema":
                    field = "response_format.json_schema.schema"
                field = req.param(field)
                msg = f"{field}: the output cannot go on under this grammar: {c.error[len(GRAMMAR_ERROR):]}"
                return APIError(400, msg, "invalid_request_error", param=field, code="invalid_grammar")
            if c.finish_reason in _ERROR_FINISH:
                status, typ, code = _ERROR_FINISH[c.finish_reason]
                return APIError(status, c.error or f"the request failed ({c.finish_reason})", typ, code=code)
        return None

    async def _wait(self, request: HTTPRequest, req: GenRequest, handle, events: asyncio.Queue) -> bool:
        """Wait for every continuation of a request that does not stream; False when the client went
        away first (the request is cancelled then, and counted)."""
        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        gone = asyncio.ensure_future(disconnected())
        open_ = req.n   # counted from the events: handle.done may be set a moment after the last one arrives
        try:
            while open_:
                get = asyncio.ensure_future(events.get())
                done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    handle.cancel()
                    self.metrics.client_disconnects.labels("generating").inc()
                    return False
                open_ -= get.result().finish_reason is not None
        finally:
            gone.cancel()
            if open_:   # cancelled (the grace time of a shutdown ran out)
                handle.cancel()
        return True

    def _end(self, req: GenRequest, handle, enc) -> list[str]:
        """A stream's last events, on a worker thread (its transcript kept, the whole answer's objects made)."""
        self._remember(req, handle.completions)
        return list(enc.end(handle.completions, handle.usage))

    async def _stream(self, req: GenRequest, handle, events: asyncio.Queue, t0: float, enc) -> AsyncIterator[bytes]:
        """The SSE events of the dialect's encoder ``enc`` for the engine's events (a Relay's pieces). A
        client that goes away cancels the request (starlette cancels this generator)."""
        relay = Relay(req)
        try:
            for s in enc.start():
                yield _utf8(s)
            while relay.open:
                ev = await events.get()
                if ev.finish_reason in _ERROR_FINISH:
                    handle.cancel()
                    err = self._failure([handle.completions[ev.index]], req)
                    assert err is not None
                    for s in enc.error(err):
                        yield _utf8(s)
                    return
                for p in relay.pieces(ev):
                    for s in enc.piece(p):
                        yield _utf8(s)
            self._observe(handle, t0)
            for s in await run_in_threadpool(self._end, req, handle, enc):
                yield _utf8(s)
        except (asyncio.CancelledError, GeneratorExit):   # the client went away (starlette cancels the stream)
            if relay.open:
                self.metrics.client_disconnects.labels("generating").inc()
            raise
        except (LlamaError, ValueError) as e:   # should not happen: say so in the stream, not in a traceback
            log.exception("error while streaming")
            self.metrics.internal_errors.inc()
            for s in enc.error(APIError(500, f"internal server error: {type(e).__name__}", "server_error")):
                yield _utf8(s)
        finally:
            if relay.open:
                handle.cancel()


# -- running it ---------------------------------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, except that the first SIGINT/SIGTERM also starts the engine's grace period,
    and that the signal is not raised again after the graceful shutdown (uvicorn does, which would
    end the process by the signal instead of with exit code 0). Nor are the former handlers put back:
    the process is ending (see :func:`run`), and a second SIGTERM while the engine closed (a
    supervisor that repeats it) found the default handler back and ended the process by the signal."""

    def __init__(self, config: uvicorn.Config, server: Server):
        super().__init__(config)
        self.pyllama_server = server

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.handle_exit)
        yield

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        self.pyllama_server.begin_shutdown()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (OSError when it cannot be had)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def run(server: Server, sock: socket.socket, debug: bool = False) -> bool:
    """Serve on ``sock`` until SIGINT/SIGTERM; whether the server started (False: see its log). For a
    process that ends after it (the CLI): SIGINT and SIGTERM stay handled by the server, and SIGTERM
    is ignored once it has closed, so that one repeated during the shutdown changes nothing and the
    exit code stays 0."""
    grace = server.config.shutdown_grace
    cfg = uvicorn.Config(server.app, log_level="info" if debug else "warning", access_log=debug, lifespan="on",
                         timeout_graceful_shutdown=int(grace) + 5, server_header=False)
    us = _Uvicorn(cfg, server)
    try:
        us.run(sockets=[sock])
    finally:
        server.shutting_down = True
        server.close()
        if threading.current_thread() is threading.main_thread():
            # the process ends now; Python's finalization would put back SIGTERM's default action
            # (ending it by the signal), but leaves an ignored signal ignored
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return bool(us.started)
