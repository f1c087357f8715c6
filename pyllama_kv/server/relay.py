"""From the engine's events to an endpoint's wire: the one path every generating endpoint shares.

Each endpoint is a :class:`Dialect`: it checks its request body into a
:class:`~pyllama_kv.server.protocol.GenRequest` (a chat or a completion, as the engine takes it), turns
the finished completions into its answer, writes its errors, and gives a stream encoder for one
request. The server (app.py) does the rest once for all of them: limits, model check, prompt and
grammar preparation, submit, waiting or streaming, cancellation when the client goes away, metrics.

A stream encoder gets :class:`Piece` s, not engine events: a :class:`Relay` turns each event into
content that may go out now (with tools, text that may be a call is held back) and, when a
continuation ends, the rest of its content and the tool calls parsed from it.

Dialects: OpenAI's chat completions and completions (here, over protocol.py's shapes), the Responses
API (responses.py) and Anthropic's Messages API (messages.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from starlette.responses import Response

from ..chat import toolcall
from . import protocol
from .protocol import APIError, GenRequest


def sse(obj, event: str | None = None) -> str:
    """One server-sent event: ``data: JSON`` (with an ``event:`` line when named)."""
    data = "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"
    return f"event: {event}\n{data}" if event else data


def error_response(e: APIError, body: dict | None = None) -> Response:
    """The error as ASCII JSON (``body``: another shape than OpenAI's): a message may quote the
    client's text, lone surrogates included (valid in JSON as escapes, not encodable as UTF-8)."""
    return Response(json.dumps(e.body() if body is None else body), status_code=e.status, headers=e.headers,
                    media_type="application/json")


def renamer(*pairs: tuple[str, str]) -> Callable[[str], str]:
    """A dialect's names for the chat request's fields: each ``(pattern, replacement)`` is applied where
    a field name starts (in a ``param`` or in an error's message), in order."""
    rules = [(re.compile(r"(?<![\w.\[\]])" + pat), rep) for pat, rep in pairs]

    def rename(text: str) -> str:
        for rx, rep in rules:
            text = rx.sub(rep, text)
        return text
    return rename


def renamed(e: APIError, rename: Callable[[str], str]) -> APIError:
    """``e`` (raised for the translated chat request) naming the client's own fields, in its message
    too (Anthropic's errors have no ``param``)."""
    e.param = rename(e.param) if e.param else e.param
    e.message = rename(e.message)
    if e.param and e.param not in e.message:
        e.message = f"{e.param}: {e.message}"
    return e


@dataclass(frozen=True)
class Bounds:
    """What the engine admits, for the dialects' checks: continuations at once, the max_tokens cap,
    and the model's range check of token ids."""

    parallel: int
    max_tokens_cap: int
    check_tokens: Callable | None = None


@dataclass
class Piece:
    """Content of continuation ``index`` that may go out now (``text``, possibly empty, with its
    log-probabilities from the engine and ``offset``: characters of the continuation before it); or,
    with ``end``, the content held back until it ended, the ``calls`` parsed from it and the engine's
    ``finish`` reason."""

    index: int
    text: str = ""
    logprobs: Any = None
    offset: int = 0
    end: bool = False
    finish: str | None = None
    calls: list[dict] = field(default_factory=list)


class Relay:
    """One request's events as pieces; with active tools, each continuation's text goes through a
    :class:`~pyllama_kv.chat.toolcall.StreamParser`."""

    def __init__(self, req: GenRequest):
        self.open = req.n
        self.offsets = [0] * req.n
        spec = req.tools if req.kind == "chat" and req.tools is not None and req.tools.active else None
        self.parsers = [toolcall.StreamParser(req.tool_format, spec) for _ in range(req.n)] if spec else None

    def pieces(self, ev) -> list[Piece]:
        """The pieces of one engine event (not an error: the server answers those)."""
        i = ev.index
        text = ev.text if self.parsers is None else self.parsers[i].feed(ev.text)
        out = [Piece(i, text, ev.logprobs, self.offsets[i])] if text or ev.logprobs else []
        self.offsets[i] += len(ev.text)
        if ev.finish_reason is not None:
            self.open -= 1
            rest, calls = self.parsers[i].finish() if self.parsers is not None else ("", [])
            out.append(Piece(i, rest, None, self.offsets[i], end=True, finish=ev.finish_reason, calls=calls))
        return out


class Dialect:
    """An endpoint's wire format (the base: what each one must say). ``endpoint``: its path."""

    endpoint = ""

    def parse(self, body) -> GenRequest:
        raise NotImplementedError

    def answer(self, req: GenRequest, completions, usage) -> dict:
        """The whole answer of a request that did not stream."""
        raise NotImplementedError

    def stream(self, req: GenRequest, handle):
        """The encoder of one streamed request: ``start()``, ``piece(p)``, ``end(completions, usage)``
        and ``error(e)``, each a list of SSE strings."""
        raise NotImplementedError

    def error(self, e: APIError) -> Response:
        return error_response(e)


class OpenAIDialect(Dialect):
    """``/v1/chat/completions`` (kind "chat") and ``/v1/completions``: protocol.py's shapes."""

    def __init__(self, kind: str, bounds: Bounds, piece: Callable[[int], bytes]):
        self.kind = kind
        self.endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        self.bounds = bounds
        self.piece = piece

    def parse(self, body) -> GenRequest:
        b = self.bounds
        return protocol.parse(body, self.kind, parallel=b.parallel, max_tokens_cap=b.max_tokens_cap,
                              check_tokens=b.check_tokens)

    def answer(self, req: GenRequest, completions, usage) -> dict:
        return protocol.response(req, completions, usage, self.piece)

    def stream(self, req: GenRequest, handle) -> ChatStream:
        return ChatStream(req, self.piece)


class ChatStream:
    """OpenAI's chunks: text deltas, one finish chunk per continuation, [usage], ``[DONE]``."""

    def __init__(self, req: GenRequest, piece: Callable[[int], bytes]):
        self.req = req
        self.token_piece = piece
        self.tools = req.kind == "chat" and req.tools is not None and req.tools.active

    def start(self) -> list[str]:
        if self.req.kind != "chat":
            return []
        # with tools: no content yet (null beside tool calls, as OpenAI's)
        return [sse(protocol.chunk(self.req, i, None if self.tools else "", role=True)) for i in range(self.req.n)]

    def piece(self, p: Piece) -> list[str]:
        req = self.req
        if not p.end:
            lp = protocol.logprobs_json(req, p.logprobs, self.token_piece, p.offset) if p.logprobs else None
            if lp is None and not p.text:
                return []
            return [sse(protocol.chunk(req, p.index, p.text or (None if self.tools else ""), logprobs=lp))]
        out = [sse(protocol.chunk(req, p.index, p.text))] if p.text else []
        for delta in protocol.tool_call_deltas(p.calls):
            out.append(sse(protocol.chunk(req, p.index, None, tool_calls=delta)))
        finish = "tool_calls" if p.calls else p.finish
        out.append(sse(protocol.chunk(req, p.index, None if req.kind == "chat" else "", finish)))
        return out

    def end(self, completions, usage) -> list[str]:
        tail = [sse(protocol.usage_chunk(self.req, usage))] if self.req.include_usage else []
        return tail + ["data: [DONE]\n\n"]

    def error(self, e: APIError) -> list[str]:
        return [sse(e.body()), "data: [DONE]\n\n"]
