"""Tool calls (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``): the format a model's
chat template uses, what the prompt gets, the grammar that forces a call, and the parsing of the
model's output into OpenAI ``tool_calls``.

Formats, detected from the template's text (:func:`detect_format`):

* ``hermes`` (Qwen2.5, Hermes, and every template that writes ``<tool_call>``): the template renders
  the tools; the model answers ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call, possibly after some text.
* ``llama3`` (Llama 3.x templates: ``<|start_header_id|>`` and tools): the template renders the
  tools; the model answers ``{"name": ..., "parameters": {...}}`` (its ``<|python_tag|>`` is a
  control token, not in the text); one call.
* ``mistral`` (templates that write ``[TOOL_CALLS]``): the model answers ``[TOOL_CALLS][{"name": ...,
  "arguments": {...}}, ...]`` (``[TOOL_CALLS]`` is a control token in Mistral's vocabularies, so the
  text may start at ``[``); tool call ids are 9 alphanumeric characters, as Mistral's templates
  demand (ids in the history that are not are mapped to such ids).
* ``generic``: any other template (one with no tool support, like SmolLM2's ChatML). The tools are
  described in a system message (added, or appended to the first one), and the model answers one
  JSON object: ``{"tool_calls": [{"name": ..., "arguments": {...}}]}`` or ``{"response": "..."}``
  (llama.cpp's generic format, with a list of calls). Assistant ``tool_calls`` in the history are
  rendered as that JSON, and ``tool`` results as user messages ``Result of the tool call NAME (id
  ID):\nCONTENT``, since such templates know no ``tool`` role.

``tool_choice``: ``none`` (tools are not rendered, nothing is parsed), ``auto`` (the model chooses;
for ``generic`` the grammar allows a call or a response, for the native formats the output is parsed
when it has the format), ``required`` and a named function (a grammar built from the tools'
parameter schemas forces a call in the model's format, so the answer always parses).
``parallel_tool_calls: false``: at most one call.
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidInputError
from ..sampling.grammar import Grammar, GrammarError

FORMATS = ("hermes", "llama3", "mistral", "generic")
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
_ALNUM = string.ascii_letters + string.digits


class ToolError(InvalidInputError):
    """A malformed tool definition or tool_choice; ``param`` names the field (OpenAI's ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def detect_format(template: str | None) -> str:
    """The tool-call format of a chat template's source (one of :data:`FORMATS`)."""
    t = template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|start_header_id|>" in t and ("ipython" in t or "tools" in t):
        return "llama3"
    return "generic"


@dataclass(frozen=True)
class ToolSpec:
    """The tool settings of a request: ``tools`` (OpenAI's dicts, checked), ``choice`` ("none",
    "auto", "required" or "function": the one called ``name``), ``parallel``."""

    tools: tuple
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Tools are rendered and calls parsed (there are tools and tool_choice is not none)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice in ("required", "function")

    def functions(self) -> list[dict]:
        """The ``function`` objects a call may name (all of them, or the named one)."""
        fns = [t["function"] for t in self.tools]
        return [f for f in fns if f["name"] == self.name] if self.choice == "function" else fns

    def names(self) -> set[str]:
        return {f["name"] for f in self.functions()}

    def parameter_grammars(self) -> list[tuple[Grammar, str]]:
        """Each tool's parameters as a grammar, with the field it came from
        (``tools[i].function.parameters``): what the server compiles before it renders the tools."""
        return [(Grammar.json_schema(t["function"]["parameters"]), f"tools[{i}].function.parameters")
                for i, t in enumerate(self.tools)]


def _schema_ok(schema: Any, where: str) -> None:
    """``schema`` within the grammar bounds (pyllama_kv.sampling.grammar_check, in linear time, no llguidance):
    llguidance itself checks it in a grammar worker when the server prepares the request
    (:meth:`ToolSpec.parameter_grammars`), never in the caller's process."""
    try:
        Grammar.json_schema(schema)
    except GrammarError as e:
        raise ToolError(where, f"{where} is not a JSON schema this server can use: {e}") from None


def check_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolSpec | None:
    """OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` checked (ToolError naming
    the field); None when there are no tools and tool_choice asks for none."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError("parallel_tool_calls", "parallel_tool_calls must be true or false")
    if tools is not None:
        if not isinstance(tools, list):
            raise ToolError("tools", "tools must be a list of {type: function, function: {name, description, "
                                     "parameters}} objects")
        if len(tools) > MAX_TOOLS:
            raise ToolError("tools", f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed")
    seen: set[str] = set()
    checked = [_check_tool(f"tools[{i}]", t, seen) for i, t in enumerate(tools or [])]
    choice, fname = "auto", None
    if tool_choice is not None:
        choice, fname = _check_tool_choice(tool_choice, seen)
        if choice in ("required", "function") and not checked:
            raise ToolError("tool_choice", f"tool_choice {choice!r} needs tools")
    if not checked:
        return None
    return ToolSpec(tuple(checked), choice, fname, True if parallel_tool_calls is None else parallel_tool_calls)


def _check_tool(p: str, t: Any, seen: set[str]) -> dict:
    """One entry of ``tools`` (``p``: its place, for messages) checked and normalized; its name is
    added to ``seen``, the names before it."""
    if not isinstance(t, dict):
        raise ToolError(p, f"{p} must be an object {{type: function, function: {{...}}}}")
    if t.get("type") != "function":
        raise ToolError(f"{p}.type", f"{p}.type must be 'function', got {t.get('type')!r}")
    extra = set(t) - {"type", "function"}
    if extra:
        raise ToolError(f"{p}.{sorted(extra)[0]}", f"{p}.{sorted(extra)[0]} is not supported")
    fn = t.get("function")
    if not isinstance(fn, dict):
        raise ToolError(f"{p}.function", f"{p}.function must be an object {{name, description, parameters}}")
    extra = set(fn) - {"name", "description", "parameters", "strict"}
    if extra:
        k = sorted(extra)[0]
        raise ToolError(f"{p}.function.{k}", f"{p}.function.{k} is not a field of a function definition")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"{p}.function.name", f"{p}.function.name is required (a string)")
    if not NAME_RE.match(name):
        raise ToolError(f"{p}.function.name", f"{p}.function.name {name!r} must be 1-64 characters of "
                                              "a-z, A-Z, 0-9, _ and -")
    if name in seen:
        raise ToolError(f"{p}.function.name", f"{p}.function.name {name!r} is given twice")
    seen.add(name)
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise ToolError(f"{p}.function.description", f"{p}.function.description must be a string")
    if fn.get("strict") is not None and not isinstance(fn.get("strict"), bool):
        raise ToolError(f"{p}.function.strict", f"{p}.function.strict must be true or false")
    params = fn.get("parameters")
    if params is not None:
        where = f"{p}.function.parameters"
        if not isinstance(params, dict):
            raise ToolError(where, f"{where} must be a JSON schema object")
        if params.get("type", "object") != "object":
            raise ToolError(where, f"{where} must be a schema of an object (type 'object'), "
                                   f"got type {params.get('type')!r}")
        _schema_ok(params, where)
    f: dict[str, Any] = {"name": name}
    if desc is not None:
        f["description"] = desc
    f["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": f}


def _check_tool_choice(tool_choice: Any, names: set[str]) -> tuple[str, str | None]:
    """``tool_choice`` (not None) checked against the tools' ``names``: the choice and, for a
    named function, its name."""
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ToolError("tool_choice", f"tool_choice must be none, auto, required or "
                                           f"{{type: function, function: {{name}}}}, got {tool_choice!r}")
        return tool_choice, None
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function":
            raise ToolError("tool_choice.type", "tool_choice.type must be 'function'")
        tf = tool_choice.get("function")
        if not isinstance(tf, dict) or not isinstance(tf.get("name"), str):
            raise ToolError("tool_choice.function.name", "tool_choice.function.name is required (a string)")
        if tf["name"] not in names:
            raise ToolError("tool_choice.function.name", f"tool_choice names the function {tf['name']!r}, "
                                                         "which is not in tools")
        return "function", tf["name"]
    raise ToolError("tool_choice", "tool_choice must be a string or an object")


# -- ids -------------------------------------------------------------------------------------------------


def new_id(fmt: str) -> str:
    """A fresh tool call id: ``call_`` and 24 random characters (Mistral: 9 alphanumerics)."""
    n = 9 if fmt == "mistral" else 24
    s = "".join(secrets.choice(_ALNUM) for _ in range(n))
    return s if fmt == "mistral" else "call_" + s


def _mistral_id(i: Any) -> Any:
    if not isinstance(i, str) or re.fullmatch(r"[A-Za-z0-9]{9}", i):
        return i
    return hashlib.sha256(i.encode("utf-8", "surrogatepass")).hexdigest()[:9]


# -- the prompt -------------------------------------------------------------------------------------------


def _compact(x: Any) -> str:
    return json.dumps(x, ensure_ascii=False)


def generic_instructions(spec: ToolSpec) -> str:
    """The system text that describes the tools to a template without tool support."""
    fns = spec.functions()
    calls = '{"tool_calls": [{"name": <function name>, "arguments": <arguments as a JSON object>}' + \
            (", ..." if spec.parallel else "") + "]}"
    lines = ["You can call the following tools (JSON function definitions):"]
    lines += [_compact({"type": "function", "function": f}) for f in fns]
    lines.append("")
    if spec.forced:
        what = f"the function {spec.name}" if spec.choice == "function" else "one of these tools"
        lines.append(f"Call {what}: respond with one JSON object only, {calls}")
    else:
        lines.append(f"Respond with one JSON object only: either {calls} to call tools, or "
                     '{"response": <your answer to the user, a string>} to answer the user directly. '
                     "Once the tool results you need are there, answer with the response object.")
    return "\n".join(lines)


def prepare(fmt: str, spec: ToolSpec | None, messages: list[dict]) -> tuple[list[dict], list | None]:
    """The messages and the template's ``tools`` variable for a request: the native formats render
    tools and tool messages through the template; ``generic`` gets the system instructions and its
    history rewritten (see the module docstring)."""
    active = spec is not None and spec.active
    if fmt != "generic":
        msgs = messages
        if fmt == "mistral":
            msgs = []
            for m in messages:
                m = dict(m)
                if m.get("tool_calls"):
                    m["tool_calls"] = [{**c, "id": _mistral_id(c.get("id"))} if isinstance(c, dict) else c
                                       for c in m["tool_calls"]]
                if "tool_call_id" in m:
                    m["tool_call_id"] = _mistral_id(m["tool_call_id"])
                msgs.append(m)
        return msgs, list(spec.tools) if active and spec is not None else None
    names: dict[str, Any] = {}
    out: list[dict] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                f = c.get("function", c) if isinstance(c, dict) else {}
                calls.append({"name": f.get("name"), "arguments": f.get("arguments", {})})
                if isinstance(c, dict) and isinstance(c.get("id"), str):
                    names[c["id"]] = f.get("name")
            out.append({"role": m["role"], "content": _compact({"tool_calls": calls})})
        elif m["role"] == "tool":
            tid = m.get("tool_call_id")
            fname = m.get("name") or names.get(tid or "")
            out.append({"role": "user", "content": f"Result of the tool call {fname or ''} (id {tid}):\n"
                                                   f"{m['content']}"})
        else:
            out.append({"role": m["role"], "content": m["content"] or ""})
    if active and spec is not None:
        text = generic_instructions(spec)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": (out[0]["content"] + "\n\n" + text) if out[0]["content"] else text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


# -- the grammar ------------------------------------------------------------------------------------------


def _own_resource(params: dict, name: str) -> dict:
    """A tool's parameters as a schema resource of their own (an ``$id``, unless they have one): their
    local refs (``#/$defs/x``, as pydantic writes them) then resolve against them, not against the
    schema of the call they are embedded in."""
    return params if "$id" in params else {"$id": f"urn:pyllama-kv:tool:{name}", **params}


def _call_schema(fns: list[dict], args_key: str) -> dict:
    alts = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                              args_key: _own_resource(f["parameters"], f["name"])},
             "required": ["name", args_key], "additionalProperties": False} for f in fns]
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


def _calls_schema(spec: ToolSpec, args_key: str = "arguments") -> dict:
    s: dict = {"type": "array", "items": _call_schema(spec.functions(), args_key), "minItems": 1}
    if not spec.parallel:
        s["maxItems"] = 1
    return s


def grammar(fmt: str, spec: ToolSpec | None) -> Grammar | None:
    """The grammar the output must match: for ``generic`` whenever tools are active (a call, or a
    response unless forced), for the native formats when a call is forced; else None."""
    if spec is None or not spec.active:
        return None
    if fmt == "generic":
        calls = {"type": "object", "properties": {"tool_calls": _calls_schema(spec)}, "required": ["tool_calls"],
                 "additionalProperties": False}
        if spec.forced:
            return Grammar.json_schema(calls)
        resp = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                "additionalProperties": False}
        return Grammar.json_schema({"anyOf": [calls, resp]})
    if not spec.forced:
        return None
    if fmt == "llama3":
        return Grammar.json_schema(_call_schema(spec.functions(), "parameters"))
    if fmt == "mistral":
        return Grammar.json_schema(_calls_schema(spec))
    body = {**_call_schema(spec.functions(), "arguments"),
            "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    call = 'call: "<tool_call>\\n" body "\\n</tool_call>"'
    start = 'start: call ("\\n" call)*' if spec.parallel else "start: call"
    return Grammar.lark(f"{start}\n{call}\nbody: %json {json.dumps(body)}\n")


# -- parsing ----------------------------------------------------------------------------------------------


def _call(fmt: str, spec: ToolSpec, obj: Any, args_keys: tuple[str, ...]) -> dict | None:
    """One parsed call as OpenAI's ``{id, type, function: {name, arguments}}``, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in spec.names():
        return None
    args: Any = {}
    for k in args_keys:
        if k in obj:
            args = obj[k]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": new_id(fmt), "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _json_values(text: str) -> list[Any] | None:
    """The JSON values ``text`` holds one after the other (separated by whitespace or ``;``), or None."""
    dec = json.JSONDecoder()
    out: list[Any] = []
    i, n = 0, len(text)
    while True:
        while i < n and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i >= n:
            return out
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(v)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def parse(fmt: str, spec: ToolSpec | None, text: str) -> tuple[str | None, list[dict]]:
    """The answer's ``content`` and ``tool_calls``. Output that is not a well-formed call of a known
    tool (in the format) is plain content: ``(text, [])``. With calls, the content is the text before
    them (right-stripped), None when that is empty; generic's ``{"response": ...}`` is its string."""
    if spec is None or not spec.active:
        return text, []
    try:
        if fmt == "hermes":
            content, calls = _parse_hermes(spec, text)
        elif fmt in ("llama3", "mistral"):
            content, calls = _parse_json_calls(fmt, spec, text)
        else:
            content, calls = _parse_generic(fmt, spec, text)
    except (ValueError, TypeError, RecursionError):
        return text, []
    if not calls:
        return content, []
    if not spec.parallel:
        calls = calls[:1]
    return content, calls


# The readers of parse, one per format: (content, calls), with (text, []) (or generic's response
# string) for output that is not a well-formed call; a malformed JSON raises ValueError.

def _parse_hermes(spec: ToolSpec, text: str) -> tuple[str | None, list[dict]]:
    """Hermes: ``<tool_call>{...}</tool_call>`` blocks, nothing but space between and after them."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls: list[dict] = []
    pos = start
    for m in _HERMES.finditer(text, start):
        if text[pos:m.start()].strip():
            return text, []
        obj = json.loads(m.group(1))
        c = _call("hermes", spec, obj, ("arguments", "parameters"))
        if c is None:
            return text, []
        calls.append(c)
        pos = m.end()
    if not calls or text[pos:].strip():
        return text, []
    return text[:start].rstrip() or None, calls


def _parse_json_calls(fmt: str, spec: ToolSpec, text: str) -> tuple[str | None, list[dict]]:
    """Llama 3 and Mistral: the whole answer is JSON calls (objects or lists of them), after
    ``<|python_tag|>`` or ``[TOOL_CALLS]``."""
    body = text.strip()
    if fmt == "mistral" and body.startswith("[TOOL_CALLS]"):
        body = body[len("[TOOL_CALLS]"):]
    if fmt == "llama3" and body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):]
    values = _json_values(body) if body[:1] in "{[" and body else None
    if not values:
        return text, []
    calls: list[dict] = []
    objs = [o for v in values for o in (v if isinstance(v, list) else [v])]
    for o in objs:
        c = _call(fmt, spec, o, ("parameters", "arguments") if fmt == "llama3" else ("arguments",))
        if c is None:
            return text, []
        calls.append(c)
    return (None, calls) if calls else (text, [])


def _parse_generic(fmt: str, spec: ToolSpec, text: str) -> tuple[str | None, list[dict]]:
    """Generic: one JSON object, ``{"tool_calls": [...]}``, ``{"tool_call": {...}}`` or
    ``{"response": "..."}``."""
    obj = json.loads(text)
    if not isinstance(obj, dict):
        return text, []
    if isinstance(obj.get("response"), str) and "tool_calls" not in obj:
        return obj["response"], []
    raw = obj.get("tool_calls", [obj["tool_call"]] if "tool_call" in obj else None)
    if not isinstance(raw, list) or not raw:
        return text, []
    calls: list[dict] = []
    for o in raw:
        c = _call(fmt, spec, o, ("arguments", "parameters"))
        if c is None:
            return text, []
        calls.append(c)
    return None, calls


class StreamParser:
    """One continuation's streamed text, when tools are active: :meth:`feed` returns the content
    that can go out now (never text that may turn out to be a call), :meth:`finish` the rest of the
    content and the calls, as :func:`parse` finds them in the whole text (so a streamed answer
    accumulates to the non-streamed one)."""

    def __init__(self, fmt: str, spec: ToolSpec):
        self.fmt, self.spec = fmt, spec
        self.text = ""
        self.sent = 0          # characters of text streamed as content
        self.holding = fmt == "generic"

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.holding:
            return ""
        t = self.text
        if self.fmt == "hermes":
            if "<tool_call>" in t:
                self.holding = True
                return ""
            cut = len(t)
            marker = "<tool_call>"
            for k in range(min(len(marker) - 1, len(t)), 0, -1):
                if t.endswith(marker[:k]):
                    cut = len(t) - k
                    break
            cut = len(t[:cut].rstrip())
        else:
            s = t.lstrip()
            starts = ("{", "[", "<|python_tag|>")   # what a call may start with (after whitespace)
            if any(s.startswith(m) for m in starts):
                self.holding = True
                return ""
            if not s or any(m.startswith(s) for m in starts):
                return ""
            cut = len(t)
        if cut <= self.sent:
            return ""
        out = t[self.sent:cut]
        self.sent = cut
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """The content not streamed yet ("" if none) and the calls."""
        content, calls = parse(self.fmt, self.spec, self.text)
        sent = self.text[:self.sent]
        content = content or ""
        return (content[len(sent):] if content.startswith(sent) else ""), calls
