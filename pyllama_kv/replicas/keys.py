"""The prompt tokens of an HTTP request, as a replica would evaluate them: what the router matches
against the blocks each replica reports (:class:`~pyllama_kv.replicas.routing.CacheRouter`).

The ingress holds the model's vocabulary alone (``Model(path, vocab_only=True)``: no tensors) and
parses a body with the same dialects the server answers with (chat, completions, Messages, and
Responses without ``previous_response_id``), renders a chat with the same template and tool format,
and tokenizes it as the server does. Only the request's leading blocks decide its route, so a
difference at the tail (the server tokenizes a conversation's earlier answers as it generated them,
the ingress as their text) moves nothing but the last blocks. A body the ingress cannot read has no
key (None): it is routed by load alone, and the replica answers its error.
"""
from __future__ import annotations

import json
import logging

from ..chat import toolcall
from ..chat.templates import apply_chat_template, chat_template, tokenize_rendered
from ..server import messages, responses
from ..server.relay import Bounds, Dialect, OpenAIDialect

log = logging.getLogger("pyllama_kv.replicas")

__all__ = ["RouteKeys"]


class RouteKeys:
    """Prompt tokens of request bodies, by endpoint path (:meth:`tokens`). ``model``: a Model (its
    vocabulary is enough); ``template``: the chat template the replicas render with instead of the
    model's (``serve --template``), or None; ``parallel``, ``max_tokens_cap``: the replicas' bounds
    (a body they would refuse has no key)."""

    def __init__(self, model, template: str | None = None, parallel: int = 64, max_tokens_cap: int = 1 << 30):
        self.model = model
        self.template = template
        bounds = Bounds(parallel, max_tokens_cap, model.check_tokens)

        def no_piece(token: int) -> bytes:   # (answers are the replicas' to write)
            return b""
        self.dialects: dict[str, Dialect] = {
            "/v1/chat/completions": OpenAIDialect("chat", bounds, no_piece),
            "/v1/completions": OpenAIDialect("completion", bounds, no_piece),
            "/v1/messages": messages.MessagesDialect(bounds, no_piece),
            "/v1/responses": responses.ResponsesDialect(bounds, responses.ResponseStore()),
        }

    @staticmethod
    def stored_response(path: str, body: bytes) -> str | None:
        """The id of the stored Responses answer a request continues (``previous_response_id``), reads
        or deletes (``/v1/responses/{id}``); None for any other request."""
        if path.startswith("/v1/responses/"):
            return path[len("/v1/responses/"):] or None
        if path != "/v1/responses" or b"previous_response_id" not in body:
            return None
        try:
            rid = json.loads(body).get("previous_response_id")
        except (ValueError, AttributeError):
            return None
        return rid if isinstance(rid, str) else None

    def tokens(self, path: str, body: bytes) -> list[int] | None:
        """The prompt tokens of a POST to ``path`` with ``body``; None for another path, a body that
        does not parse, or a Responses request that continues a stored one (its earlier turns are in
        one replica's store, not in the body)."""
        dialect = self.dialects.get(path)
        if dialect is None or not body:
            return None
        try:
            data = json.loads(body)
            if path == "/v1/responses" and isinstance(data, dict) and data.get("previous_response_id"):
                return None
            req = dialect.parse(data)
            if req.kind != "chat":
                p = req.prompt
                return self.model.tokenize(p, add_bos=True, special=True) if isinstance(p, str) else list(p)
            fmt = toolcall.detect_format(self.template or chat_template(self.model))
            msgs, tools = toolcall.prepare(fmt, req.tools, req.prompt)
            rendered = apply_chat_template(self.model, msgs, True, source=self.template, tools=tools)
            return tokenize_rendered(self.model, rendered, True)
        except Exception as exc:   # noqa: BLE001 - any body the replica must answer (an error, most likely)
            log.debug("no route key for %s: %s", path, exc)
            return None
