"""OpenAI's Responses API (``POST /v1/responses``) as a translation onto chat requests.

The body is checked here and turned into a chat completion's body, which protocol.parse checks
again as a chat request (so every bound is the chat's one): ``input`` (a string or a list of items:
messages with ``input_text``/``output_text`` parts, ``function_call`` and ``function_call_output``)
becomes ``messages``, ``instructions`` a system message before them, ``tools`` (function tools) and
``tool_choice`` the chat's, ``text.format`` the ``response_format``, ``max_output_tokens`` the
``max_tokens``, ``truncation: "auto"`` the ``truncate`` extension. Errors of the translated request
name the client's fields (``tools[0].parameters``, ``text.format.schema``, ``input``).

``previous_response_id``: a response stored (``store``, the default) keeps its conversation (its input
after the previous ones, and its answer; not its instructions, as OpenAI's) in a bounded LRU
(:class:`ResponseStore`); a follow-up's prompt is that conversation and its new input, so the prefix
cache serves the conversation and only the new input is evaluated (``usage.input_tokens_details.
cached_tokens``).

Refused with a 400 naming the field: built-in tools (web_search, file_search, ...), image, file and
audio parts, other item types (reasoning, item_reference, ...), ``background``, ``conversation``,
``prompt``, ``include`` items, ``reasoning.summary``, ``top_logprobs``, ``max_tool_calls``,
``prompt_cache_key``. Accepted without effect: ``reasoning.effort`` (one of OpenAI's efforts),
``user``, ``safety_identifier``, ``service_tier`` auto/default, ``text.verbosity: "medium"``,
``text.format.description`` (a string), ``stream_options.include_obfuscation``, a message item's
``id``/``status`` and parts' ``annotations``. Every field the response object repeats (and the store
keeps) is typed first: no value of an unchecked shape is ever stored.

Bounds: at most ``limits.MAX_MESSAGES`` input items (the conversation a ``previous_response_id``
continues included) and ``limits.MAX_MESSAGE_PARTS`` parts per item, counted before any item is
translated.
"""
from __future__ import annotations

import json
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any

from ..chat import toolcall
from ..limits import (
    MAX_MESSAGE_PARTS,
    MAX_MESSAGES,
    RESPONSES_ENTRY_BYTES,
    RESPONSES_STORED,
    RESPONSES_STORED_BYTES,
)
from . import protocol
from .protocol import APIError, GenRequest, bad, check_count
from .relay import Bounds, Dialect, Piece, renamed, renamer, sse

#: the fields /v1/responses takes (honoured, or accepted as having no effect: see the module docstring)
FIELDS = frozenset(["model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                    "max_output_tokens", "temperature", "top_p", "stream", "stream_options", "previous_response_id",
                    "store", "metadata", "user", "safety_identifier", "service_tier", "truncation", "reasoning",
                    "background", "include"])
#: fields OpenAI has that this server does not honour: a 400 (``unsupported_parameter``) when set
UNSUPPORTED = ("conversation", "prompt", "prompt_cache_key", "prompt_cache_retention", "max_tool_calls",
               "top_logprobs", "context_management")

_rename = renamer((r"max_tokens", "max_output_tokens"), (r"response_format\.json_schema\.", "text.format."),
                  (r"response_format", "text.format"), (r"tools\[(\d+)\]\.function\.", r"tools[\1]."),
                  (r"tool_choice\.function\.", "tool_choice."), (r"messages", "input"), (r"truncate", "truncation"))

_ITEM_KEYS = {"message": {"type", "role", "content", "id", "status"},
              "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
              "function_call_output": {"type", "call_id", "output", "id", "status"}}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
#: OpenAI's values of ``reasoning.effort`` (accepted without effect: this server does not reason apart)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass
class ResponsesRequest(GenRequest):
    """A chat request made from a Responses body: ``history`` is the conversation a stored answer
    continues (the previous one's and the new input, without instructions); ``echo`` the body's
    fields the response object repeats."""

    history: list = field(default_factory=list)
    echo: dict = field(default_factory=dict)
    store: bool = True

    def param(self, name: str) -> str:
        return _rename(name)


def _keys(obj: dict, allowed, where: str) -> None:
    for k, v in obj.items():
        if k not in allowed and v is not None:
            raise bad(f"{where}.{k}", f"{where}.{k} is not supported by this server", code="unsupported_parameter")


def _text_parts(v, where: str) -> str:
    """A string, or ``input_text``/``output_text`` parts joined (images, files and audio refused)."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad(where, f"{where} must be a string or a list of input_text parts")
    check_count(v, where, MAX_MESSAGE_PARTS, "parts")
    out = []
    for j, p in enumerate(v):
        q = f"{where}[{j}]"
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text"):
            kind = p.get("type") if isinstance(p, dict) else None
            raise bad(q, f"{q} is a {kind!r} part: only input_text and output_text parts are supported "
                         "(this server serves text models)", code="unsupported_parameter")
        _keys(p, {"type", "text", "annotations", "logprobs"}, q)
        if not isinstance(p.get("text"), str):
            raise bad(f"{q}.text", f"{q}.text must be a string")
        out.append(p["text"])
    return "".join(out)


def _call(item: dict, where: str) -> dict:
    """A ``function_call`` item as a chat tool call (its arguments as an object)."""
    for k in ("call_id", "name", "arguments"):
        if not isinstance(item.get(k), str) or (k != "arguments" and not item[k]):
            raise bad(f"{where}.{k}", f"{where}.{k} is required (a string)", code="missing_required_parameter")
    try:
        args = json.loads(item["arguments"]) if item["arguments"].strip() else {}
    except (ValueError, RecursionError):
        raise bad(f"{where}.arguments", f"{where}.arguments is not valid JSON") from None
    if not isinstance(args, dict):
        raise bad(f"{where}.arguments", f"{where}.arguments must be a JSON object (as a string)")
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": args}}


def _item(item, i: int, out: list[dict]) -> None:
    """One input item appended to the chat messages ``out`` (a function call joins the assistant
    message before it)."""
    p = f"input[{i}]"
    if not isinstance(item, dict):
        raise bad(p, f"{p} must be an object (a message, function_call or function_call_output item)")
    kind = item.get("type") or "message"
    if kind not in _ITEM_KEYS:
        raise bad(f"{p}.type", f"{p}.type {kind!r} is not supported: items are message, function_call and "
                               "function_call_output", code="unsupported_parameter")
    _keys(item, _ITEM_KEYS[kind], p)
    if kind == "function_call":
        call = _call(item, p)
        if out and out[-1]["role"] == "assistant":
            out[-1].setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not item["call_id"]:
            raise bad(f"{p}.call_id", f"{p}.call_id is required (a string)", code="missing_required_parameter")
        if item.get("output") is None:
            raise bad(f"{p}.output", f"{p}.output is required", code="missing_required_parameter")
        out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text_parts(item["output"],
                                                                                         f"{p}.output")})
    else:
        role = item.get("role")
        if role not in _ROLES:
            raise bad(f"{p}.role", f"{p}.role must be one of user, assistant, system, developer; got {role!r}")
        if item.get("content") is None:
            raise bad(f"{p}.content", f"{p}.content is required", code="missing_required_parameter")
        out.append({"role": _ROLES[role], "content": _text_parts(item["content"], f"{p}.content")})


def _input(v, before: int = 0) -> list[dict]:
    """``input`` as chat messages; its items counted first (``before``: the messages of the stored
    conversation it continues), so that too many are refused before any is translated."""
    if isinstance(v, str):
        return [{"role": "user", "content": v}]
    if not isinstance(v, list) or not v:
        raise bad("input", "input must be a string or a non-empty list of items")
    if before + len(v) > MAX_MESSAGES:
        raise bad("input", f"input has {len(v)} items" + (f" after the {before} messages of previous_response_id's "
                  "conversation" if before else "") + f"; at most {MAX_MESSAGES} are allowed in one request")
    out: list[dict] = []
    for i, item in enumerate(v):
        _item(item, i, out)
    return out


def _tools(v) -> list | None:
    """Function tools ``{type: function, name, description, parameters, strict}`` as the chat's."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad("tools", "tools must be a list of {type: function, name, description, parameters} objects")
    check_count(v, "tools", toolcall.MAX_TOOLS, "tools")
    out = []
    for i, t in enumerate(v):
        p = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(p, f"{p} must be an object {{type: function, name, description, parameters}}")
        if t.get("type") != "function":
            raise bad(f"{p}.type", f"{p}.type {t.get('type')!r} is not supported: only function tools are "
                                   "(built-in tools such as web_search and file_search are not)",
                      code="unsupported_parameter")
        _keys(t, {"type", "name", "description", "parameters", "strict"}, p)
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(v):
    if isinstance(v, dict):
        if v.get("type") != "function":
            raise bad("tool_choice.type", f"tool_choice.type {v.get('type')!r} is not supported: a string "
                      "(none, auto, required) or {type: function, name}", code="unsupported_parameter")
        _keys(v, {"type", "name"}, "tool_choice")
        return {"type": "function", "function": {"name": v.get("name")}}
    return v


def _format(v) -> dict | None:
    """``text`` ({format, verbosity}) as a chat ``response_format``."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise bad("text", "text must be an object {format, verbosity}")
    _keys(v, {"format", "verbosity"}, "text")
    if v.get("verbosity") not in (None, "medium"):
        raise bad("text.verbosity", "text.verbosity must be medium here", code="unsupported_parameter")
    f = v.get("format")
    if f is None:
        return None
    if not isinstance(f, dict) or not isinstance(f.get("type"), str):
        raise bad("text.format", "text.format must be an object with a type (text, json_object, json_schema)")
    if f["type"] != "json_schema":
        _keys(f, {"type"}, "text.format")
        return {"type": f["type"]}
    _keys(f, {"type", "name", "schema", "strict", "description"}, "text.format")
    for k in ("name", "description"):   # (repeated by the response object, and stored)
        if f.get(k) is not None and not isinstance(f[k], str):
            raise bad(f"text.format.{k}", f"text.format.{k} must be a string")
    if f.get("schema") is None:
        raise bad("text.format.schema", "text.format.schema is required", code="missing_required_parameter")
    return {"type": "json_schema", "json_schema": {k: f[k] for k in ("name", "schema", "strict") if k in f}}


def _options(body: dict) -> None:
    """The fields accepted with one value only, or that take no part in the chat request."""
    for name, v in body.items():
        if v is None or name in FIELDS:
            continue
        if name in UNSUPPORTED:
            raise bad(name, f"{name} is not supported by this server", code="unsupported_parameter")
        raise bad(name, f"{name} is not a field of /v1/responses (see docs/serving.md for the fields this server "
                        "takes)", code="unknown_parameter")
    if body.get("background") not in (None, False):
        raise bad("background", "background: true is not supported (answers are streamed or waited for)",
                  code="unsupported_parameter")
    inc = body.get("include")
    if inc is not None and inc != []:
        raise bad("include", "include must be empty here (no extra output data is supported)",
                  code="unsupported_parameter")
    _reasoning(body.get("reasoning"))
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise bad("truncation", "truncation must be auto or disabled")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", "stream_options must be an object")
        _keys(opts, {"include_obfuscation"}, "stream_options")
    for name in ("store",):
        protocol._bool(body, name)
    for name in ("instructions", "previous_response_id"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad(name, f"{name} must be a string")
    _metadata(body.get("metadata"))


def _reasoning(v) -> None:
    """``reasoning``: ``{effort}``, one of OpenAI's efforts (repeated by the response object, and stored)."""
    if v is None:
        return
    if not isinstance(v, dict):
        raise bad("reasoning", "reasoning must be an object {effort}")
    _keys(v, {"effort"}, "reasoning")
    if v.get("effort") is not None and v["effort"] not in REASONING_EFFORTS:
        raise bad("reasoning.effort", f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}")


def _metadata(v) -> None:
    """OpenAI's metadata: at most 16 string keys (64 characters) to strings (512 characters)."""
    if v is None:
        return
    if not isinstance(v, dict) or len(v) > 16:
        raise bad("metadata", "metadata must be an object of at most 16 string pairs")
    for k, x in v.items():
        if len(k) > 64 or not isinstance(x, str) or len(x) > 512:
            raise bad(f"metadata.{k}", f"metadata.{k}: keys are at most 64 characters, values strings of at most "
                                       "512")


# -- the store -----------------------------------------------------------------------------------------


def _compact(x) -> bytes:
    """``x`` as compact ASCII JSON: what the store keeps (a lone surrogate stays valid, as an escape)."""
    return json.dumps(x, separators=(",", ":")).encode("ascii")


class ResponseStore:
    """Stored responses, by id, least recently used first out: at most ``max_items``, holding at most
    ``max_bytes`` of memory together (a response larger than that is not kept).

    Each is kept as compact JSON, its conversation and its response object as two bytes objects, and
    counted by the memory those take (``sys.getsizeof``) and ``entry_bytes`` for its id and its place in
    the table: what is counted is what is held, whatever the shapes (an empty list is 2 bytes here, where
    the list object would take 56). :meth:`conversation` decodes a copy; :meth:`answer` gives the JSON as
    kept. Thread-safe."""

    def __init__(self, max_items: int = RESPONSES_STORED, max_bytes: int = RESPONSES_STORED_BYTES,
                 entry_bytes: int = RESPONSES_ENTRY_BYTES):
        self.max_items, self.max_bytes, self.entry_bytes = max_items, max_bytes, entry_bytes
        self._items: OrderedDict[str, tuple[bytes, bytes, int, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def held(self) -> int:
        """The memory the stored responses are counted for (at most ``max_bytes``)."""
        return self._bytes

    def put(self, rid: str, conversation: list[dict], response: dict) -> None:
        """Keep ``response`` (a JSON object) and the ``conversation`` it ended (a list of chat messages)
        as ``rid``, dropping the least recently used ones until the bounds hold."""
        conv, resp = _compact(conversation), _compact(response)
        size = sys.getsizeof(conv) + sys.getsizeof(resp) + sys.getsizeof(rid) + self.entry_bytes
        with self._lock:
            self._drop(rid)
            if size > self.max_bytes:
                return
            self._items[rid] = (conv, resp, len(conversation), size)
            self._bytes += size
            while len(self._items) > self.max_items or self._bytes > self.max_bytes:
                self._drop(next(iter(self._items)))

    def _drop(self, rid: str) -> bool:
        entry = self._items.pop(rid, None)
        if entry is not None:
            self._bytes -= entry[3]
        return entry is not None

    def _get(self, rid: str, param: str | None) -> tuple[bytes, bytes, int, int]:
        with self._lock:
            entry = self._items.get(rid)
            if entry is not None:
                self._items.move_to_end(rid)
                return entry
        if param is not None:
            raise bad(param, f"{param}: no stored response has the id {rid!r} (responses are stored with store: "
                             "true, and the oldest are dropped)", code="previous_response_not_found")
        raise APIError(404, f"no stored response has the id {rid!r}", param="id", code="not_found")

    def length(self, rid: str) -> int:
        """The messages of the conversation response ``rid`` ended (a 400 naming previous_response_id when
        not kept)."""
        return self._get(rid, "previous_response_id")[2]

    def conversation(self, rid: str) -> list[dict]:
        """The conversation response ``rid`` ended, a new copy (a 400 naming previous_response_id when not
        kept)."""
        return json.loads(self._get(rid, "previous_response_id")[0])

    def answer(self, rid: str) -> bytes:
        """The response object ``rid`` as stored: its JSON (a 404 when not kept)."""
        return self._get(rid, None)[1]

    def delete(self, rid: str) -> dict:
        with self._lock:
            if self._drop(rid):
                return {"id": rid, "object": "response.deleted", "deleted": True}
        raise APIError(404, f"no stored response has the id {rid!r}", param="id", code="not_found")


# -- the dialect -----------------------------------------------------------------------------------------


def _usage(u) -> dict:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.reused_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _message_item(req: GenRequest, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": f"msg_{req.id}", "status": status, "role": "assistant", "content": content}


def _call_item(req: GenRequest, k: int, call: dict, status: str, arguments: str | None = None) -> dict:
    fn = call["function"]
    return {"type": "function_call", "id": f"fc_{req.id}_{k}", "call_id": call["id"], "name": fn["name"],
            "arguments": fn["arguments"] if arguments is None else arguments, "status": status}


class ResponsesDialect(Dialect):
    endpoint = "/v1/responses"

    def __init__(self, bounds: Bounds, store: ResponseStore):
        self.bounds = bounds
        self.store = store

    def parse(self, body) -> ResponsesRequest:
        if not isinstance(body, dict):
            raise bad(None, "the request body must be a JSON object", code="invalid_json")
        _options(body)
        if body.get("input") is None:
            raise bad("input", "input is required", code="missing_required_parameter")
        # every other field typed, and the items counted, before any item is translated
        fmt, tools, choice = _format(body.get("text")), _tools(body.get("tools")), _tool_choice(body.get("tool_choice"))
        prev = body.get("previous_response_id")
        new = _input(body["input"], self.store.length(prev) if prev else 0)
        history = (self.store.conversation(prev) if prev else []) + new
        msgs = ([{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []) + history
        chat = {"model": body.get("model"), "messages": msgs, "max_tokens": body.get("max_output_tokens"),
                "temperature": body.get("temperature"), "top_p": body.get("top_p"), "stream": body.get("stream"),
                "tools": tools, "tool_choice": choice,
                "parallel_tool_calls": body.get("parallel_tool_calls"), "response_format": fmt,
                "user": body.get("user"), "safety_identifier": body.get("safety_identifier"),
                "service_tier": body.get("service_tier"),
                "truncate": True if body.get("truncation") == "auto" else None}
        b = self.bounds
        try:
            req = protocol.parse({k: v for k, v in chat.items() if v is not None}, "chat", parallel=b.parallel,
                                 max_tokens_cap=b.max_tokens_cap, check_tokens=b.check_tokens)
        except APIError as e:
            raise renamed(e, _rename) from None
        out = ResponsesRequest(**{f.name: getattr(req, f.name) for f in fields(GenRequest)}, history=history,
                               echo=body, store=body.get("store") is not False)
        return out

    def response(self, req: ResponsesRequest, status: str, output: list, usage=None, error=None) -> dict:
        """The response object (``status``: in_progress, completed, incomplete or failed)."""
        b = req.echo
        fmt = (b.get("text") or {}).get("format") or {"type": "text"}
        return {"id": f"resp_{req.id}", "object": "response", "created_at": req.created, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
                "model": req.model, "output": output, "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
                "previous_response_id": b.get("previous_response_id"),
                "reasoning": {"effort": (b.get("reasoning") or {}).get("effort"), "summary": None},
                "service_tier": "default", "store": req.store, "temperature": req.params.temperature,
                "text": {"format": fmt, "verbosity": "medium"}, "tool_choice": b.get("tool_choice") or "auto",
                "tools": b.get("tools") or [], "top_p": req.params.top_p,
                "truncation": b.get("truncation") or "disabled",
                "usage": _usage(usage) if usage is not None else None, "user": b.get("user"),
                "metadata": b.get("metadata") or {}}

    def finished(self, req: ResponsesRequest, content: str | None, calls: list[dict], finish: str | None,
                 usage) -> dict:
        """The final response object of an answer (``content`` and parsed ``calls``), stored when asked."""
        done = "incomplete" if finish == "length" else "completed"   # (the message item's status too)
        output = [_message_item(req, content or "", done)] if content is not None or not calls else []
        output += [_call_item(req, k, c, "completed") for k, c in enumerate(calls)]
        resp = self.response(req, "incomplete" if finish == "length" else "completed", output, usage)
        if req.store:
            msg: dict[str, Any] = {"role": "assistant", "content": content or ""}
            if calls:
                msg["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}} for c in calls]
            self.store.put(resp["id"], req.history + [msg], resp)
        return resp

    def answer(self, req, completions, usage) -> dict:
        c = completions[0]
        content, calls = toolcall.parse(req.tool_format, req.tools, c.text)
        return self.finished(req, content, calls, c.finish_reason, usage)

    def stream(self, req, handle) -> ResponsesStream:
        return ResponsesStream(self, req)


class ResponsesStream:
    """The Responses API's events, in its order: response.created, response.in_progress; per output
    item, output_item.added, (content_part.added, output_text.delta..., output_text.done,
    content_part.done | function_call_arguments.delta, .done), output_item.done; then
    response.completed (response.incomplete at max_output_tokens), or error and response.failed."""

    def __init__(self, dialect: ResponsesDialect, req: ResponsesRequest):
        self.dialect, self.req = dialect, req
        self.seq = 0
        self.text: str | None = None     # the message's text so far (None: no message item yet)
        self.calls: list[dict] = []
        self.finish: str | None = None

    def _event(self, kind: str, **kw) -> str:
        self.seq += 1
        return sse({"type": kind, "sequence_number": self.seq - 1, **kw}, event=kind)

    def start(self) -> list[str]:
        r = self.dialect.response(self.req, "in_progress", [])
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def _text(self, delta: str) -> list[str]:
        out = []
        req = self.req
        if self.text is None:
            self.text = ""
            out.append(self._event("response.output_item.added", output_index=0,
                                   item=_message_item(req, None, "in_progress")))
            out.append(self._event("response.content_part.added", item_id=f"msg_{req.id}", output_index=0,
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        if delta:
            self.text += delta
            out.append(self._event("response.output_text.delta", item_id=f"msg_{req.id}", output_index=0,
                                   content_index=0, delta=delta, logprobs=[]))
        return out

    def _close(self, finish: str | None) -> list[str]:
        req, text = self.req, self.text or ""
        done = "incomplete" if finish == "length" else "completed"
        ids = {"item_id": f"msg_{req.id}", "output_index": 0, "content_index": 0}
        return [self._event("response.output_text.done", **ids, text=text, logprobs=[]),
                self._event("response.content_part.done", **ids,
                            part={"type": "output_text", "text": text, "annotations": []}),
                self._event("response.output_item.done", output_index=0,
                            item=_message_item(req, text, done))]

    def _call(self, k: int, call: dict) -> list[str]:
        i = k + (self.text is not None)
        item_id, args = f"fc_{self.req.id}_{k}", call["function"]["arguments"]
        return [self._event("response.output_item.added", output_index=i,
                            item=_call_item(self.req, k, call, "in_progress", "")),
                self._event("response.function_call_arguments.delta", item_id=item_id, output_index=i, delta=args),
                self._event("response.function_call_arguments.done", item_id=item_id, output_index=i,
                            name=call["function"]["name"], arguments=args),
                self._event("response.output_item.done", output_index=i,
                            item=_call_item(self.req, k, call, "completed"))]

    def piece(self, p: Piece) -> list[str]:
        out = self._text(p.text) if p.text or (p.end and not p.calls) else []
        if p.end:
            if self.text is not None:
                out += self._close(p.finish)
            for k, call in enumerate(p.calls):
                out += self._call(k, call)
            self.calls, self.finish = p.calls, p.finish
        return out

    def end(self, completions, usage) -> list[str]:
        r = self.dialect.finished(self.req, self.text, self.calls, self.finish, usage)
        return [self._event("response.incomplete" if r["status"] == "incomplete" else "response.completed",
                            response=r)]

    def error(self, e: APIError) -> list[str]:
        r = self.dialect.response(self.req, "failed", [], error={"code": e.code or e.type, "message": e.message})
        return [self._event("error", code=e.code, message=e.message, param=e.param),
                self._event("response.failed", response=r)]
