"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as a translation
onto chat requests, with Anthropic's answers, stream events and error shape.

The body becomes a chat completion's body that protocol.parse checks again (every bound is the chat's
one): ``system`` (a string or text blocks) a system message; ``messages`` with text, ``tool_use``
(an assistant's calls) and ``tool_result`` blocks (tool messages; ``is_error`` prefixes the result
with ``Error: ``); ``tools`` (``input_schema``) function tools; ``tool_choice`` auto / any (a call
is forced) / tool (that one is) / none, ``disable_parallel_tool_use`` at most one call;
``stop_sequences`` the ``stop``; ``max_tokens`` (required, as Anthropic's), ``temperature`` (0 to 1),
``top_p``, ``top_k``. Errors of the translated request name the client's fields
(``tools[0].input_schema``, ``stop_sequences``).

Answers: ``stop_reason`` end_turn, max_tokens, stop_sequence (with ``stop_sequence``: the one that
matched) or tool_use; ``usage`` as Anthropic counts it: ``input_tokens`` evaluated,
``cache_read_input_tokens`` served from the prefix cache (their sum is the prompt).

Structured output: ``output_config.format`` (``{type: json_schema, schema}``) constrains the answer with
the chat's grammar machinery (not with active tools).

Accepted without effect: ``metadata.user_id``, ``user_profile_id``, ``service_tier`` auto/standard_only,
``speed: standard``, ``thinking: {type: disabled}``, ``output_config.effort``, ``cache_control`` at the
top and on any block or tool (the prefix cache keeps every prompt). Refused with a 400 naming the
field: image, document and thinking blocks, server tools (``tools[i].type`` other than custom),
``thinking`` enabled, ``container``, ``mcp_servers``, ``context_management``, ``output_format`` (the
clients send ``output_config.format``), ``diagnostics``, ``inference_geo``, ``workspace_id``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Callable

from starlette.responses import Response

from ..chat import toolcall
from ..limits import MAX_MESSAGE_PARTS, MAX_MESSAGES, MAX_STOP_STRINGS
from . import protocol
from .protocol import APIError, GenRequest, bad, check_count
from .relay import Bounds, Dialect, Piece, error_response as _json_error, renamed, renamer, sse

FIELDS = frozenset(["model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p",
                    "top_k", "metadata", "tools", "tool_choice", "service_tier", "thinking", "output_config",
                    "cache_control", "speed", "user_profile_id"])
#: the fields of /v1/messages/count_tokens
COUNT_FIELDS = frozenset(["model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
                          "cache_control"])
UNSUPPORTED = ("container", "mcp_servers", "context_management", "output_format", "diagnostics", "inference_geo",
               "workspace_id")

_rename = renamer((r"stop(?![_\w])", "stop_sequences"),
                  (r"parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
                  (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
                  (r"tools\[(\d+)\]\.function\.", r"tools[\1]."), (r"tool_choice\.function\.", "tool_choice."),
                  (r"response_format\.json_schema\.schema", "output_config.format.schema"),
                  (r"response_format", "output_config.format"))

#: HTTP status -> Anthropic's error type
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 529: "overloaded_error"}
_STOP = {"eos": "end_turn", "stop": "end_turn", "length": "max_tokens", "cancelled": "end_turn"}


def error_body(e: APIError) -> dict:
    typ = _ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": typ, "message": e.message}}


def error_response(e: APIError) -> Response:
    """An error in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    return _json_error(e, error_body(e))


@dataclass
class MessagesRequest(GenRequest):
    def param(self, name: str) -> str:
        return _rename(name)


def _keys(obj: dict, allowed, where: str) -> None:
    for k, v in obj.items():
        if k not in allowed and k != "cache_control" and v is not None:
            raise bad(f"{where}.{k}", f"{where}.{k} is not supported by this server", code="unsupported_parameter")


def _text_blocks(v, where: str) -> str:
    """A string, or text blocks joined (the only blocks allowed there)."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad(where, f"{where} must be a string or a list of text blocks")
    check_count(v, where, MAX_MESSAGE_PARTS, "blocks")
    out = []
    for j, b in enumerate(v):
        q = f"{where}[{j}]"
        if not isinstance(b, dict) or b.get("type") != "text":
            kind = b.get("type") if isinstance(b, dict) else None
            raise bad(q, f"{q} is a {kind!r} block: only text blocks are supported there", code="unsupported_parameter")
        _keys(b, {"type", "text"}, q)
        if not isinstance(b.get("text"), str):
            raise bad(f"{q}.text", f"{q}.text must be a string")
        out.append(b["text"])
    return "".join(out)


def _block(b, q: str, role: str, msg: dict, results: list[dict]) -> None:
    """One content block into the chat message ``msg`` (text, an assistant's tool_use) or ``results``
    (a user's tool_result, a tool message)."""
    kind = b.get("type") if isinstance(b, dict) else None
    allowed = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}[role]
    if kind not in allowed:
        raise bad(q, f"{q} is a {kind!r} block: {role} messages take {' and '.join(allowed)} blocks here",
                  code="unsupported_parameter")
    if kind == "text":
        _keys(b, {"type", "text", "citations"}, q)
        if not isinstance(b.get("text"), str):
            raise bad(f"{q}.text", f"{q}.text must be a string")
        msg["content"] += b["text"]
        return
    if kind == "tool_use":
        _keys(b, {"type", "id", "name", "input"}, q)
        for k in ("id", "name"):
            if not isinstance(b.get(k), str) or not b[k]:
                raise bad(f"{q}.{k}", f"{q}.{k} is required (a string)", code="missing_required_parameter")
        if not isinstance(b.get("input", {}), dict):
            raise bad(f"{q}.input", f"{q}.input must be an object")
        msg.setdefault("tool_calls", []).append(
            {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b.get("input", {})}})
        return
    _keys(b, {"type", "tool_use_id", "content", "is_error"}, q)
    if not isinstance(b.get("tool_use_id"), str) or not b["tool_use_id"]:
        raise bad(f"{q}.tool_use_id", f"{q}.tool_use_id is required (a string)", code="missing_required_parameter")
    if b.get("is_error") is not None and not isinstance(b["is_error"], bool):
        raise bad(f"{q}.is_error", f"{q}.is_error must be true or false")
    text = _text_blocks(b.get("content") or "", f"{q}.content")
    results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                    "content": "Error: " + text if b.get("is_error") else text})


def _messages(v) -> list[dict]:
    """Anthropic's messages as chat messages: a user's tool results first (as tool messages), then its
    text; an assistant's text and tool calls in one message."""
    if not isinstance(v, list) or not v:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    check_count(v, "messages", MAX_MESSAGES, "messages")
    out: list[dict] = []
    for i, m in enumerate(v):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(p, f"{p} must be an object {{role, content}}")
        _keys(m, {"role", "content"}, p)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{p}.role", f"{p}.role must be user or assistant, got {role!r}")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"{p}.content", f"{p}.content must be a string or a list of content blocks")
        check_count(content, f"{p}.content", MAX_MESSAGE_PARTS, "blocks")
        msg: dict[str, Any] = {"role": role, "content": ""}
        results: list[dict] = []
        for j, b in enumerate(content):
            _block(b, f"{p}.content[{j}]", role, msg, results)
        out += results
        if msg["content"] or msg.get("tool_calls") or not results:
            out.append(msg)
    return out


def _tools(v) -> list | None:
    """Anthropic's client tools ``{name, description, input_schema}`` as chat function tools."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad("tools", "tools must be a list of {name, description, input_schema} objects")
    check_count(v, "tools", toolcall.MAX_TOOLS, "tools")
    out = []
    for i, t in enumerate(v):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(p, f"{p} must be an object {{name, description, input_schema}}")
        if t.get("type") not in (None, "custom"):
            raise bad(f"{p}.type", f"{p}.type {t['type']!r} is not supported: only client tools (custom) are "
                                   "(server tools such as web_search, bash or text_editor are not)",
                      code="unsupported_parameter")
        _keys(t, {"type", "name", "description", "input_schema"}, p)
        if not isinstance(t.get("input_schema"), dict):
            raise bad(f"{p}.input_schema", f"{p}.input_schema is required (a JSON schema object)",
                      code="missing_required_parameter")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice as the chat's ``tool_choice`` and ``parallel_tool_calls``."""
    if v is None:
        return None, None
    if not isinstance(v, dict) or v.get("type") not in ("auto", "any", "tool", "none"):
        raise bad("tool_choice", "tool_choice must be {type: auto | any | tool | none} (tool: with a name)")
    _keys(v, {"type", "name", "disable_parallel_tool_use"}, "tool_choice")
    off = v.get("disable_parallel_tool_use")
    if off is not None and not isinstance(off, bool):
        raise bad("tool_choice.disable_parallel_tool_use",
                  "tool_choice.disable_parallel_tool_use must be true or false")
    kind = v["type"]
    if kind == "tool":
        if not isinstance(v.get("name"), str):
            raise bad("tool_choice.name", "tool_choice.name is required (a string)", code="missing_required_parameter")
        choice: Any = {"type": "function", "function": {"name": v["name"]}}
    else:
        choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
    return choice, (not off) if off is not None else None


def _options(body: dict, allowed: frozenset) -> None:
    for name, v in body.items():
        if v is None or name in allowed:
            continue
        if name in UNSUPPORTED:
            raise bad(name, f"{name} is not supported by this server", code="unsupported_parameter")
        raise bad(name, f"{name} is not a field of this endpoint (see docs/serving.md for the fields this server "
                        "takes)", code="unknown_parameter")
    md = body.get("metadata")
    if md is not None:
        if not isinstance(md, dict):
            raise bad("metadata", "metadata must be an object {user_id}")
        _keys(md, {"user_id"}, "metadata")
        if md.get("user_id") is not None and not isinstance(md["user_id"], str):
            raise bad("metadata.user_id", "metadata.user_id must be a string")
    if body.get("service_tier") not in (None, "auto", "standard_only"):
        raise bad("service_tier", "service_tier must be auto or standard_only here", code="unsupported_parameter")
    _output_config(body.get("output_config"))
    cc = body.get("cache_control")
    if cc is not None and (not isinstance(cc, dict) or cc.get("type") != "ephemeral"):
        raise bad("cache_control", "cache_control must be {type: ephemeral}")
    if body.get("speed") not in (None, "standard"):
        raise bad("speed", "speed must be standard here", code="unsupported_parameter")
    if body.get("user_profile_id") is not None and not isinstance(body["user_profile_id"], str):
        raise bad("user_profile_id", "user_profile_id must be a string")
    stops = body.get("stop_sequences")
    if isinstance(stops, list):
        check_count(stops, "stop_sequences", MAX_STOP_STRINGS, "strings")
    if stops is not None and (not isinstance(stops, list) or not all(isinstance(x, str) for x in stops)):
        raise bad("stop_sequences", "stop_sequences must be a list of strings")
    th = body.get("thinking")
    if th is not None and th != {"type": "disabled"}:
        raise bad("thinking", "thinking is not supported by this server (only {type: disabled})",
                  code="unsupported_parameter")
    if body.get("temperature") is not None:
        protocol._number(body, "temperature", 0.0, 1.0)


def _output_config(v) -> None:
    """``output_config``: ``effort`` (accepted, no effect) and ``format`` (``{type: json_schema, schema}``)."""
    if v is None:
        return
    if not isinstance(v, dict):
        raise bad("output_config", "output_config must be an object {effort, format}")
    _keys(v, {"effort", "format"}, "output_config")
    if v.get("effort") not in (None, "low", "medium", "high", "xhigh", "max"):
        raise bad("output_config.effort", "output_config.effort must be low, medium, high, xhigh or max")
    f = v.get("format")
    if f is not None:
        if not isinstance(f, dict) or f.get("type") != "json_schema":
            raise bad("output_config.format", "output_config.format must be {type: json_schema, schema}")
        _keys(f, {"type", "schema"}, "output_config.format")
        if f.get("schema") is None:
            raise bad("output_config.format.schema", "output_config.format.schema is required",
                      code="missing_required_parameter")


def _response_format(body: dict) -> dict | None:
    f = (body.get("output_config") or {}).get("format") if isinstance(body.get("output_config"), dict) else None
    return {"type": "json_schema", "json_schema": {"schema": f["schema"]}} if f else None


def _chat_body(body) -> dict:
    """The chat completion's body for a Messages body."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object", code="invalid_json")
    if body.get("messages") is None:
        raise bad("messages", "messages is required", code="missing_required_parameter")
    # the other fields typed before any message is translated
    choice, parallel = _tool_choice(body.get("tool_choice"))
    tools = _tools(body.get("tools"))
    system = body.get("system")
    msgs = ([{"role": "system", "content": _text_blocks(system, "system")}] if system is not None else []) \
        + _messages(body["messages"])
    chat = {"model": body.get("model"), "messages": msgs, "max_tokens": body.get("max_tokens"),
            "stop": body.get("stop_sequences"), "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "top_k": body.get("top_k"), "stream": body.get("stream"), "tools": tools,
            "tool_choice": choice, "parallel_tool_calls": parallel, "response_format": _response_format(body)}
    return {k: v for k, v in chat.items() if v is not None}


def _usage(u, output: bool = True) -> dict:
    out = {"input_tokens": u.prompt_tokens - u.reused_tokens, "cache_creation_input_tokens": 0,
           "cache_read_input_tokens": u.reused_tokens}
    return {**out, "output_tokens": u.completion_tokens} if output else out


def _tool_id(call: dict) -> str:
    return "toolu_" + call["id"].removeprefix("call_")


class MessagesDialect(Dialect):
    endpoint = "/v1/messages"

    def __init__(self, bounds: Bounds, piece: Callable[[int], bytes]):
        self.bounds = bounds
        self.piece = piece

    def _parse(self, body, allowed: frozenset, max_tokens_cap: int) -> MessagesRequest:
        if isinstance(body, dict):
            _options(body, allowed)
        b = self.bounds
        try:
            req = protocol.parse(_chat_body(body), "chat", parallel=b.parallel, max_tokens_cap=max_tokens_cap,
                                 check_tokens=b.check_tokens)
        except APIError as e:
            raise renamed(e, _rename) from None
        return MessagesRequest(**{f.name: getattr(req, f.name) for f in fields(GenRequest)})

    def parse(self, body) -> MessagesRequest:
        if isinstance(body, dict) and body.get("max_tokens") is None:
            raise bad("max_tokens", "max_tokens is required", code="missing_required_parameter")
        return self._parse(body, FIELDS, self.bounds.max_tokens_cap)

    def parse_count(self, body) -> MessagesRequest:
        """A ``/v1/messages/count_tokens`` body (no max_tokens: nothing is generated)."""
        return self._parse(body, COUNT_FIELDS, self.bounds.max_tokens_cap)

    def stop(self, req: GenRequest, c) -> tuple[str, str | None]:
        """The stop_reason of a continuation without tool calls, and the stop sequence that ended it:
        the one its tokens' text has where its answer ends."""
        if c.finish_reason == "stop" and req.stop:
            full = b"".join(self.piece(t) for t in c.tokens).decode("utf-8", "replace")
            for s in req.stop:
                if full.startswith(s, len(c.text)):
                    return "stop_sequence", s
        return _STOP.get(c.finish_reason or "", "end_turn"), None

    def message(self, req: GenRequest, content: list[dict], stop: tuple[str | None, str | None], usage) -> dict:
        return {"id": f"msg_{req.id}", "type": "message", "role": "assistant", "model": req.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": _usage(usage)}

    def answer(self, req, completions, usage) -> dict:
        c = completions[0]
        text, calls = toolcall.parse(req.tool_format, req.tools, c.text)
        blocks: list[dict] = [{"type": "text", "text": text}] if text or not calls else []
        blocks += [{"type": "tool_use", "id": _tool_id(k), "name": k["function"]["name"],
                    "input": json.loads(k["function"]["arguments"])} for k in calls]
        return self.message(req, blocks, ("tool_use", None) if calls else self.stop(req, c), usage)

    def stream(self, req, handle) -> MessagesStream:
        return MessagesStream(self, req, handle)

    def error(self, e: APIError) -> Response:
        return error_response(e)


class MessagesStream:
    """Anthropic's events: message_start, ping, per content block content_block_start,
    content_block_delta (text_delta or input_json_delta)..., content_block_stop; then message_delta
    (stop_reason, stop_sequence, usage) and message_stop; an ``error`` event for a failure."""

    def __init__(self, dialect: MessagesDialect, req: GenRequest, handle):
        self.dialect, self.req, self.handle = dialect, req, handle
        self.blocks = 0            # content blocks started
        self.text_open = False
        self.calls: list[dict] = []

    @staticmethod
    def _event(kind: str, **kw) -> str:
        return sse({"type": kind, **kw}, event=kind)

    def start(self) -> list[str]:
        u = {**_usage(self.handle.usage, output=False), "output_tokens": 0}
        msg = {**self.dialect.message(self.req, [], (None, None), self.handle.usage), "usage": u}
        return [self._event("message_start", message=msg), self._event("ping")]

    def piece(self, p: Piece) -> list[str]:
        out = []
        if p.text or (p.end and not p.calls and not self.text_open and not self.blocks):
            if not self.text_open:
                self.text_open = True
                out.append(self._event("content_block_start", index=self.blocks,
                                       content_block={"type": "text", "text": ""}))
            if p.text:
                out.append(self._event("content_block_delta", index=self.blocks,
                                       delta={"type": "text_delta", "text": p.text}))
        if p.end:
            if self.text_open:
                out.append(self._event("content_block_stop", index=self.blocks))
                self.blocks += 1
                self.text_open = False
            for call in p.calls:
                i = self.blocks
                out += [self._event("content_block_start", index=i, content_block={
                            "type": "tool_use", "id": _tool_id(call), "name": call["function"]["name"], "input": {}}),
                        self._event("content_block_delta", index=i,
                                    delta={"type": "input_json_delta", "partial_json": call["function"]["arguments"]}),
                        self._event("content_block_stop", index=i)]
                self.blocks += 1
            self.calls = p.calls
        return out

    def end(self, completions, usage) -> list[str]:
        stop = ("tool_use", None) if self.calls else self.dialect.stop(self.req, completions[0])
        return [self._event("message_delta", delta={"stop_reason": stop[0], "stop_sequence": stop[1]},
                            usage=_usage(usage)),
                self._event("message_stop")]

    def error(self, e: APIError) -> list[str]:
        return [sse(error_body(e), event="error")]
