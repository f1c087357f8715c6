"""The OpenAI wire format: request bodies checked into a :class:`GenRequest`, and the JSON of
responses, stream chunks and errors.

Every field is either honoured or refused: a known field with a bad value, a field OpenAI has but
this server cannot honour (``echo``, ``suffix``, ``audio``, ``prediction``, image parts, ...) and an
unknown field all get HTTP 400 with OpenAI's error object, naming the field in ``param`` (nothing is
silently dropped). Accepted and without effect: ``user`` and ``safety_identifier`` (identifiers for
the caller's own records), ``store: false``, ``service_tier`` auto/default, ``modalities: ["text"]``,
``stream_options.include_obfuscation``; and ``null`` for any field means absent.

Tool calls: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (checked by
pyllama_kv.chat.toolcall, which also renders, forces and parses the calls); assistant messages with
``tool_calls`` (their ``arguments`` JSON text handed to the template as an object, as transformers'
templates expect) and ``tool`` messages (``tool_call_id`` required) in the history.

Structured output: ``response_format`` ``{"type": "json_schema", "json_schema": {"name", "schema",
"strict"}}`` or ``{"type": "json_object"}`` constrains the output with a grammar (llguidance, see
pyllama_kv.sampling.grammar); a schema it cannot compile is a 400 naming
``response_format.json_schema.schema``. ``logprobs``/``top_logprobs`` (chat) and ``logprobs``
(completions) report the raw distribution's log-probabilities.

Extensions (fields OpenAI does not have; each optional, the server's engine config when absent):

* ``context_shift`` (bool): when the conversation reaches the end of the context during the
  answer, drop the oldest half after the first ``n_keep`` tokens and go on (true, the default), or
  finish with ``finish_reason: "length"`` (false).
* ``n_keep`` (int >= -1): tokens at the start of the prompt that a shift or truncation never drops
  (-1: the whole prompt; at most half the context is kept).
* ``truncate`` (bool): a prompt longer than the context is cut after its first ``n_keep`` tokens
  instead of refused with ``context_length_exceeded`` (off by default).
* ``repeat_penalty`` (number in (0, 10], 1 = off) and ``penalty_last_n`` (tokens looked back over, -1
  = the whole answer, the default): llama.cpp's repetition penalty, beside OpenAI's
  ``frequency_penalty`` and ``presence_penalty``; all of them, and ``logit_bias``, are llama.cpp's
  penalties and logit-bias samplers at the head of the sampler chain.
* ``grammar`` (string): a GBNF grammar (llama.cpp's, when it defines ``root ::=``) or a Lark grammar
  (llguidance's dialect) the output must match; not with ``response_format``.
* ``speculative.n_max`` (int >= 0, llama-server's name): the most draft tokens a step of this request
  may verify (0: no speculation for it); the server's ``--spec-max`` when absent. Speculation never
  changes the answer, only the steps it takes.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from ..chat import toolcall
from ..chat.toolcall import ToolError, ToolSpec
from ..config import SamplingParams
from ..errors import InvalidInputError
from ..limits import (
    INT32_MAX,
    LOGIT_BIAS_MAX,
    MAX_MESSAGE_PARTS,
    MAX_MESSAGES,
    MAX_STOP_STRINGS as MAX_STOP,
    OPENAI_TEMPERATURE_MAX,
    PENALTY_MAX,
    REPEAT_PENALTY_MAX,
    SPEC_MAX_DRAFT,
    UINT32_MAX,
)
from ..sampling.grammar import Grammar, GrammarError

#: the engine's finish reasons as OpenAI's (cache_full and error are reported as errors instead)
FINISH = {"stop": "stop", "eos": "stop", "length": "length", "cancelled": "cancelled"}


class APIError(Exception):
    """An error answer: HTTP ``status`` with ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class GenRequest:
    """A checked request, ready for the engine (``prompt`` is still text or messages). Not the engine's
    queued ``engine.request.Request``, nor starlette's HTTP request (``HTTPRequest`` in app.py)."""

    kind: str                          # "chat" or "completion"
    model: str
    prompt: Any                        # messages (chat), or text / token ids (completion)
    params: SamplingParams
    max_tokens: int | None             # None: as many as the cap and the context allow
    stop: tuple[str, ...] = ()
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    context_shift: bool | None = None   # extensions (None: the engine's config)
    n_keep: int | None = None
    truncate: bool | None = None
    spec_max: int | None = None        # speculative.n_max: draft tokens a step at most (0: none)
    grammar: Grammar | None = None     # response_format json_schema / json_object, or the grammar extension
    grammar_param: str | None = None   # the field it came from (named by a 400 when it cannot compile)
    logprobs: int | None = None        # top alternatives per token (chat: top_logprobs; completions: logprobs)
    tools: ToolSpec | None = None      # tools, tool_choice, parallel_tool_calls (chat)
    tool_format: str = "generic"       # the model's tool-call format (set when the prompt is prepared)
    rendered: Any = None               # chat: the messages as the template rendered them (set when prepared)
    prompt_ids: list[int] | None = None   # chat: the tokens submitted for them
    boundaries: list[int] | None = None   # chat: where turns start in prompt_ids (the end of the system prompt)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def param(self, name: str) -> str:
        """A field of the chat request as the client's endpoint names it (the Responses and Messages
        dialects translate their bodies into chat requests; their requests rename)."""
        return name

    def engine_options(self) -> dict:
        """The extension fields the request set, as keyword arguments of ``Engine.submit``."""
        opts = {"context_shift": self.context_shift, "n_keep": self.n_keep, "truncate": self.truncate,
                "boundaries": self.boundaries, "spec_max": self.spec_max}
        return {k: v for k, v in opts.items() if v is not None}


# -- field checks ----------------------------------------------------------------------------------


def _number(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"{name} must be a number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(name, f"{name}={v} is out of range {'(' if lo_open else '['}{lo}, {hi}]")
    return float(v)


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"{name} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise bad(name, f"{name}={v} is out of range [{lo}, {hi}]")
    return v


def _bool(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false, got {v!r}")
    return v


def check_count(v: list, name: str, limit: int, what: str = "items") -> None:
    """A 400 naming ``name`` when the list ``v`` has more than ``limit`` items: checked before any of
    them is looked at (see limits.MAX_MESSAGES)."""
    if len(v) > limit:
        raise bad(name, f"{name} has {len(v)} {what}; at most {limit} are allowed in one request")


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if isinstance(v, list) and len(v) > MAX_STOP:
        raise bad("stop", f"stop has {len(v)} strings; at most {MAX_STOP} are allowed")
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop", "stop must be a string or a list of strings")
    return tuple(s for s in v if s)


_COMMON = frozenset(["model", "max_tokens", "temperature", "top_p", "min_p", "top_k", "n", "stream", "stream_options",
                     "stop", "seed", "frequency_penalty", "presence_penalty", "repeat_penalty", "penalty_last_n",
                     "logit_bias", "logprobs", "response_format", "grammar", "context_shift", "n_keep", "truncate",
                     "user", "safety_identifier", "store", "service_tier", "speculative.n_max"])
#: the fields each endpoint honours (or accepts as having no effect: see the module docstring)
FIELDS = {"chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                             "parallel_tool_calls", "modalities"},
          "completion": _COMMON | {"prompt"}}
#: fields OpenAI has that this server does not honour: a 400 (``unsupported_parameter``) when set
UNSUPPORTED = {"chat": ("audio", "prediction", "functions", "function_call", "reasoning_effort", "verbosity",
                        "web_search_options", "metadata", "prompt_cache_key", "prompt_cache_retention",
                        "prompt_cache_options", "moderation"),
               "completion": ("echo", "suffix", "best_of", "metadata")}


def _fields(body: dict, kind: str) -> None:
    """A 400 for every field set (not null) that this server does not honour."""
    for name, v in body.items():
        if v is None or name in FIELDS[kind]:
            continue
        if name == "best_of" and v == 1:
            continue
        if name in UNSUPPORTED[kind]:
            raise bad(name, f"{name} is not supported by this server", code="unsupported_parameter")
        raise bad(name, f"{name} is not a field of {'/v1/chat/completions' if kind == 'chat' else '/v1/completions'}"
                        " (see docs/serving.md for the fields this server takes)", code="unknown_parameter")
    if body.get("store") not in (None, False):
        raise bad("store", "store: true is not supported by this server (nothing is stored)",
                  code="unsupported_parameter")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise bad("service_tier", "service_tier must be auto or default here", code="unsupported_parameter")
    for name in ("user", "safety_identifier"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise bad(name, f"{name} must be a string")
    if kind == "chat" and body.get("modalities") not in (None, ["text"]):
        raise bad("modalities", 'modalities must be ["text"]: this server writes text only',
                  code="unsupported_parameter")


MAX_LOGIT_BIAS = 1024


def _logit_bias(body: dict, check_tokens=None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: {"token id": bias in [-100, 100]} (ids as strings in JSON), the ids in
    the model's range (``check_tokens``; without it, llama.cpp's int32)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad("logit_bias", "logit_bias must be an object mapping token ids to biases")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"logit_bias has {len(v)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out = []
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit()):
            raise bad("logit_bias", f"logit_bias keys must be token ids, got {k!r}")
        if (isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b)
                or not -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX):
            raise bad("logit_bias", f"logit_bias[{k}] must be a number in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}], "
                                    f"got {b!r}")
        out.append((int(k), float(b)))
    ids = [t for t, _ in out]
    try:
        if check_tokens is not None:
            check_tokens(ids, "logit_bias token")
        elif any(t > INT32_MAX for t in ids):
            raise InvalidInputError(f"logit_bias token id {max(ids)} is out of range [0, {INT32_MAX}]")
    except InvalidInputError as e:
        raise bad("logit_bias", str(e)) from None
    return tuple(out)


def _response_format(body: dict) -> Grammar | None:
    """OpenAI's ``response_format``: text, json_object, or json_schema ({name, schema, strict})."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad("response_format", "response_format must be an object with a type")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_object()
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad("response_format.json_schema", "response_format.json_schema must be an object "
                      "{name, schema, strict}")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise bad("response_format.json_schema.name", "response_format.json_schema.name must be a string")
        if js.get("strict") is not None and not isinstance(js.get("strict"), bool):
            raise bad("response_format.json_schema.strict", "response_format.json_schema.strict must be a bool")
        schema = js.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise bad("response_format.json_schema.schema", "response_format.json_schema.schema must be an object")
        try:
            return Grammar.json_schema(schema)
        except GrammarError as e:
            raise bad("response_format.json_schema.schema", f"response_format.json_schema.schema: {e}",
                      code="invalid_grammar") from None
    raise bad("response_format.type", f"response_format.type {kind!r} is not one of text, json_object, json_schema")


def _grammar(body: dict) -> tuple[Grammar | None, str | None]:
    """The output constraint: ``response_format``, or the ``grammar`` extension (GBNF when it
    defines ``root ::=``, else Lark); not both."""
    g = _response_format(body)
    raw = body.get("grammar")
    if raw is None:
        return g, "response_format" if g is not None else None
    if not isinstance(raw, str) or not raw.strip():
        raise bad("grammar", "grammar must be a non-empty string (GBNF or Lark)")
    if g is not None:
        raise bad("grammar", "give either response_format or grammar, not both")
    try:
        return Grammar("gbnf" if "::=" in raw else "lark", raw), "grammar"
    except GrammarError as e:
        raise bad("grammar", f"grammar: {e}", code="invalid_grammar") from None


def _logprobs(body: dict, kind: str) -> int | None:
    """Chat: ``logprobs`` (bool) and ``top_logprobs`` (0..20); completions: ``logprobs`` (0..5)."""
    if kind == "chat":
        on = _bool(body, "logprobs")
        top = _integer(body, "top_logprobs", 0, 20)
        if top is not None and not on:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        return (top or 0) if on else None
    return _integer(body, "logprobs", 0, 5)


_MESSAGE_KEYS = frozenset(["role", "content", "name", "tool_calls", "tool_call_id"])
_MESSAGE_NULL = frozenset(["refusal", "function_call", "audio"])   # accepted when null (or refusal: ignored)


def _content(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        check_count(content, f"messages[{i}].content", MAX_MESSAGE_PARTS, "parts")
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or not isinstance(p.get("type"), str):
                raise bad(f"messages[{i}].content[{j}]", f"messages[{i}].content[{j}] must be a content part "
                                                         "{type: text, text}")
            if p["type"] != "text":
                raise bad(f"messages[{i}].content[{j}]", f"messages[{i}].content[{j}] is a {p['type']!r} part: "
                          "only text parts are supported (this server serves text models)",
                          code="unsupported_parameter")
            if not isinstance(p.get("text"), str):
                raise bad(f"messages[{i}].content[{j}].text", f"messages[{i}].content[{j}].text must be a string")
            parts.append(p["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", f"messages[{i}].content must be a string or a list of text parts")


def _tool_calls(v, i: int) -> list[dict]:
    """An assistant message's ``tool_calls`` as the template takes them: arguments as an object."""
    p = f"messages[{i}].tool_calls"
    if not isinstance(v, list):
        raise bad(p, f"{p} must be a list of {{id, type: function, function: {{name, arguments}}}}")
    check_count(v, p, MAX_MESSAGE_PARTS, "calls")
    out = []
    for j, c in enumerate(v):
        q = f"{p}[{j}]"
        if not isinstance(c, dict):
            raise bad(q, f"{q} must be an object {{id, type: function, function: {{name, arguments}}}}")
        if c.get("type", "function") != "function":
            raise bad(f"{q}.type", f"{q}.type must be 'function'")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise bad(f"{q}.id", f"{q}.id must be a string")
        f = c.get("function")
        if not isinstance(f, dict):
            raise bad(f"{q}.function", f"{q}.function must be an object {{name, arguments}}")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise bad(f"{q}.function.name", f"{q}.function.name is required (a string)")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise bad(f"{q}.function.arguments", f"{q}.function.arguments is not valid JSON") from None
        if not isinstance(args, dict):
            raise bad(f"{q}.function.arguments", f"{q}.function.arguments must be a JSON object (as a string)")
        call: dict = {"type": "function", "function": {"name": f["name"], "arguments": args}}
        if c.get("id") is not None:
            call["id"] = c["id"]
        out.append(call)
    return out


def _messages(v) -> list[dict]:
    """OpenAI chat messages as the template's dicts: {"role", "content"} (text parts joined), with
    ``tool_calls`` (arguments as objects), ``tool_call_id`` and ``name`` where given."""
    if not isinstance(v, list) or not v:
        raise bad("messages", "messages must be a non-empty list of {role, content} objects")
    check_count(v, "messages", MAX_MESSAGES, "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object")
        for k, x in m.items():
            if k not in _MESSAGE_KEYS and not (k in _MESSAGE_NULL and (x is None or k == "refusal")):
                raise bad(f"messages[{i}].{k}", f"messages[{i}].{k} is not supported by this server",
                          code="unsupported_parameter")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"messages[{i}].role", f"messages[{i}].role must be a non-empty string")
        msg: dict = {"role": "system" if role == "developer" else role, "content": _content(m.get("content"), i)}
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise bad(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls: only assistant messages have them")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], i)
        for k in ("tool_call_id", "name"):
            if m.get(k) is not None:
                if not isinstance(m[k], str):
                    raise bad(f"messages[{i}].{k}", f"messages[{i}].{k} must be a string")
                msg[k] = m[k]
        if role == "tool" and "tool_call_id" not in msg:
            raise bad(f"messages[{i}].tool_call_id", f"messages[{i}].tool_call_id is required in a tool message",
                      code="missing_required_parameter")
        out.append(msg)
    return out


def _prompt(v) -> str | list[int]:
    """A completion prompt: a string, or token ids (also as a one-element list of either)."""
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]
    if isinstance(v, str):
        if not v:
            raise bad("prompt", "prompt must not be empty")
        return v
    if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return list(v)
    raise bad("prompt", "prompt must be a non-empty string or a list of token ids (one prompt per request)")


def _sampling(body: dict, check_tokens) -> dict[str, Any]:
    """The SamplingParams fields a body sets (each checked against its bound), by name."""
    sp: dict[str, Any] = {}
    for name, lo, hi, lo_open in (("temperature", 0.0, OPENAI_TEMPERATURE_MAX, False), ("top_p", 0.0, 1.0, True),
                                  ("min_p", 0.0, 1.0, False)):
        x = _number(body, name, lo, hi, lo_open)
        if x is not None:
            sp[name] = x
    for name, lo, hi in (("frequency_penalty", -PENALTY_MAX, PENALTY_MAX),
                         ("presence_penalty", -PENALTY_MAX, PENALTY_MAX), ("repeat_penalty", 0.0, REPEAT_PENALTY_MAX)):
        x = _number(body, name, lo, hi, lo_open=name == "repeat_penalty")
        if x is not None:
            sp[name] = x
    last_n = _integer(body, "penalty_last_n", -1, 1 << 20)
    if last_n is not None:
        sp["penalty_last_n"] = last_n
    bias = _logit_bias(body, check_tokens)
    if bias:
        sp["logit_bias"] = bias
    top_k = _integer(body, "top_k", 0, 1 << 30)
    if top_k is not None:
        sp["top_k"] = top_k
    seed = _integer(body, "seed", -(2**63), 2**64 - 1)   # OpenAI's int64 (and uint64, as some clients send)
    if seed is not None:
        sp["seed"] = seed & UINT32_MAX   # the sampler's seeds are 32-bit
    return sp


def _include_usage(body: dict) -> bool:
    """``stream_options.include_usage`` (the only option besides include_obfuscation, which is ignored)."""
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad("stream_options", "stream_options must be an object")
    if opts:
        for k in opts:
            if k not in ("include_usage", "include_obfuscation"):
                raise bad(f"stream_options.{k}", f"stream_options.{k} is not supported by this server",
                          code="unsupported_parameter")
    return bool(opts and opts.get("include_usage") is True)


def _tools(body: dict, grammar: Grammar | None, grammar_param: str | None) -> ToolSpec | None:
    """A chat's ``tools``, ``tool_choice`` and ``parallel_tool_calls``; active tools exclude an output grammar."""
    try:
        tools = toolcall.check_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    except ToolError as e:
        raise bad(e.param, str(e)) from None
    if tools is not None and tools.active and grammar is not None:
        raise bad(grammar_param, f"{grammar_param} cannot be combined with tools (unless tool_choice is none)")
    return tools


def parse(body, kind: str, *, parallel: int, max_tokens_cap: int,
          check_tokens: Callable[[list[int], str], Any] | None = None) -> GenRequest:
    """Check a request body of ``/v1/chat/completions`` (kind "chat") or ``/v1/completions``.
    ``check_tokens``: the model's range check of token ids (:meth:`pyllama_kv.Model.check_tokens`),
    applied to the ``logit_bias`` keys."""
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required (a string: see GET /v1/models)", code="missing_required_parameter")
    _fields(body, kind)   # (every field named and typed before the messages' items are looked at)
    if kind == "chat":
        if "messages" not in body:
            raise bad("messages", "messages is required", code="missing_required_parameter")
        prompt: Any = _messages(body["messages"])
    else:
        if "prompt" not in body:
            raise bad("prompt", "prompt is required", code="missing_required_parameter")
        prompt = _prompt(body["prompt"])
    max_tokens = _integer(body, "max_tokens", 1, max_tokens_cap)
    if kind == "chat" and max_tokens is None:
        max_tokens = _integer(body, "max_completion_tokens", 1, max_tokens_cap)
    sp = _sampling(body, check_tokens)
    n = _integer(body, "n", 1, parallel)
    stream = _bool(body, "stream")
    include_usage = _include_usage(body)
    grammar, grammar_param = _grammar(body)
    tools = _tools(body, grammar, grammar_param) if kind == "chat" else None
    try:
        params = SamplingParams(**sp)
    except InvalidInputError as e:   # (each field was checked above: a bound of the library's own)
        raise bad(None, str(e)) from None
    return GenRequest(kind=kind, model=model, prompt=prompt, params=params, max_tokens=max_tokens,
                      stop=_stop(body), n=n or 1, stream=stream, include_usage=include_usage,
                      context_shift=_bool(body, "context_shift") if body.get("context_shift") is not None else None,
                      n_keep=_integer(body, "n_keep", -1, INT32_MAX),
                      truncate=_bool(body, "truncate") if body.get("truncate") is not None else None,
                      spec_max=_integer(body, "speculative.n_max", 0, SPEC_MAX_DRAFT),
                      grammar=grammar, grammar_param=grammar_param, logprobs=_logprobs(body, kind), tools=tools)


# -- responses -------------------------------------------------------------------------------------


def usage(u) -> dict:
    """OpenAI's usage object from the engine's :class:`~pyllama_kv.engine.Usage`."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.reused_tokens}}


def timings(u) -> dict:
    """llama-server's ``timings`` fields that clients read for speculative decoding: the drafted tokens
    verified (``draft_n``) and those kept (``draft_n_accepted``), and the prompt tokens evaluated and
    served from cache (``prompt_n``, ``cache_n``)."""
    return {"prompt_n": u.prompt_tokens - u.reused_tokens, "cache_n": u.reused_tokens,
            "predicted_n": u.completion_tokens, "draft_n": u.draft_tokens, "draft_n_accepted": u.draft_accepted}


def _head(req: GenRequest, chunk: bool) -> dict:
    if req.kind == "chat":
        return {"id": f"chatcmpl-{req.id}", "object": "chat.completion.chunk" if chunk else "chat.completion",
                "created": req.created, "model": req.model}
    return {"id": f"cmpl-{req.id}", "object": "text_completion", "created": req.created, "model": req.model}


def _token(piece: Callable[[int], bytes], t: int, lp: float) -> dict:
    b = piece(t)
    return {"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b)}


def logprobs_json(req: GenRequest, entries, piece: Callable[[int], bytes], offset: int = 0) -> dict | None:
    """The ``logprobs`` of a choice from the engine's (token, logprob, top) entries: chat's
    ``{"content": [{token, logprob, bytes, top_logprobs}]}``, or the completions' legacy
    ``{tokens, token_logprobs, top_logprobs, text_offset}`` (``offset``: characters before these)."""
    if req.logprobs is None or entries is None:
        return None
    if req.kind == "chat":
        return {"content": [{**_token(piece, t, lp), "top_logprobs": [_token(piece, a, alp) for a, alp in top]}
                            for t, lp, top in entries], "refusal": None}
    tokens, lps, tops, offsets = [], [], [], []
    for t, lp, top in entries:
        text = piece(t).decode("utf-8", "replace")
        tokens.append(text)
        lps.append(lp)
        tops.append({piece(a).decode("utf-8", "replace"): alp for a, alp in top} if req.logprobs else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def response(req: GenRequest, completions, u, piece: Callable[[int], bytes] | None = None) -> dict:
    """The whole answer of a non-streaming request."""
    choices = []
    for c in completions:
        fr = FINISH.get(c.finish_reason or "", c.finish_reason)
        lp = logprobs_json(req, c.logprobs or [], piece) if piece is not None else None
        if req.kind == "chat":
            msg: dict = {"role": "assistant", "content": c.text}
            if req.tools is not None and req.tools.active:
                content, calls = toolcall.parse(req.tool_format, req.tools, c.text)
                msg["content"] = content
                if calls:
                    msg["tool_calls"] = calls
                    fr = "tool_calls"
            choices.append({"index": c.index, "message": msg, "finish_reason": fr, "logprobs": lp})
        else:
            choices.append({"index": c.index, "text": c.text, "finish_reason": fr, "logprobs": lp})
    return {**_head(req, False), "choices": choices, "usage": usage(u), "timings": timings(u)}


def chunk(req: GenRequest, index: int, text: str | None, finish_reason: str | None = None,
          role: bool = False, logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
    """One stream chunk: a text delta of continuation ``index`` and/or its finish reason, or
    ``tool_calls`` deltas (OpenAI's ``{index, id, type, function: {name, arguments}}`` pieces)."""
    fr = FINISH.get(finish_reason, finish_reason) if finish_reason else None
    if req.kind == "chat":
        delta: dict = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls is not None:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "finish_reason": fr, "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": fr, "logprobs": logprobs}
    return {**_head(req, True), "choices": [choice]}


def usage_chunk(req: GenRequest, u) -> dict:
    """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
    return {**_head(req, True), "choices": [], "usage": usage(u), "timings": timings(u)}


def tool_call_deltas(calls: list[dict]) -> list[list[dict]]:
    """The stream deltas of parsed calls: per call, one with its index, id, type and name (empty
    arguments), then one with its arguments (what the openai client's stream helpers accumulate)."""
    out = []
    for j, c in enumerate(calls):
        out.append([{"index": j, "id": c["id"], "type": "function",
                     "function": {"name": c["function"]["name"], "arguments": ""}}])
        out.append([{"index": j, "function": {"arguments": c["function"]["arguments"]}}])
    return out


# -- llama-server's utility endpoints: /tokenize, /detokenize, /apply-template ---------------------------


def _only(body, allowed: tuple[str, ...]) -> dict:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object", code="invalid_json")
    for k in body:
        if k not in allowed:
            raise bad(k, f"{k} is not a field of this endpoint (it takes {', '.join(allowed)})",
                      code="unknown_parameter")
    return body


def _flag(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false")
    return v


def parse_tokenize(body) -> tuple[str, bool, bool, bool]:
    """llama-server's ``/tokenize``: ``content`` (a string), ``add_special`` (BOS, default false),
    ``parse_special`` (control tokens spelled in the text, default true), ``with_pieces``."""
    body = _only(body, ("content", "add_special", "parse_special", "with_pieces"))
    content = body.get("content")
    if not isinstance(content, str):
        raise bad("content", "content is required (a string)", code="missing_required_parameter")
    return (content, _flag(body, "add_special", False), _flag(body, "parse_special", True),
            _flag(body, "with_pieces", False))


def parse_detokenize(body) -> list:
    """llama-server's ``/detokenize``: ``tokens`` (a list of token ids; checked against the model by
    the caller)."""
    body = _only(body, ("tokens",))
    toks = body.get("tokens")
    if not isinstance(toks, list):
        raise bad("tokens", "tokens is required (a list of token ids)", code="missing_required_parameter")
    return toks


def parse_apply_template(body) -> list[dict]:
    """llama-server's ``/apply-template``: ``messages`` as in a chat completion."""
    body = _only(body, ("messages",))
    if "messages" not in body:
        raise bad("messages", "messages is required", code="missing_required_parameter")
    return _messages(body["messages"])
