"""Chat templates: a GGUF's ``tokenizer.chat_template``, rendered the way Hugging Face transformers
renders it (jinja2, ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
``loopcontrols`` extension, ``bos_token``/``eos_token``, ``raise_exception``, ``strftime_now`` and a
``tojson`` filter with ``ensure_ascii=False``), so the text is byte for byte what the model saw; and
the prompt's tokens, with control tokens only where the template wrote them.

Threat model. A GGUF is untrusted input, and so is its template (and a ``--template`` file); the
messages are untrusted too (a server's clients). What is guaranteed:

- no escape: the jinja2 sandbox refuses access to Python internals (``__globals__``, ``__class__``,
  ``__subclasses__``, ...), the immutable variant refuses mutating ``messages`` in place, and the
  globals are ``range`` (at most 100000 items), ``dict``, ``namespace``, ``cycler``, ``joiner``,
  ``raise_exception`` and ``strftime_now`` (jinja's ``lipsum`` is removed);
- bounded time and memory: a rendering runs in a worker process (pyllama_kv._worker) under a
  memory limit (``RLIMIT_AS``), and the caller waits at most ``time_limit`` seconds for it: past that
  the worker is killed. A template that loops, recurses, or builds a huge integer or string in one
  operation cannot block the calling thread, the server's event loop or the engine, and takes no more
  than ``memory_limit`` bytes of address space. Inside the worker, caps refuse most such templates
  early and precisely (pyllama_kv.chat.sandbox): ``*``/``**`` on integers above ``max_int_bits``
  bits before computing, every string-building operation above ``max_size`` characters before it
  runs, ``max_steps`` loop iterations and calls, ``max_output_chars`` of output;
- every failure (a refused operation, the time or memory limit, a syntax error, an undefined name in
  an expression, ``raise_exception``, a Python exception) is
  :class:`~pyllama_kv.errors.InvalidInputError` naming the template; nothing else escapes (except
  :class:`~pyllama_kv.errors.LlamaError` when no worker process can be started at all);
- no forged control tokens: text that came from the messages (contents and roles) is tokenized with
  special-token parsing off, so ``<|im_end|>`` typed by a user stays plain text (see
  :func:`apply_chat_template` and :func:`tokenize_rendered`).

The limits are :class:`TemplateLimits` (defaults: ``time_limit`` 5 s, ``memory_limit`` 512 MiB,
``workers`` 2, ``max_output_chars`` 2**20, ``max_steps`` 10**6, ``max_size`` 2**20,
``max_int_bits`` 8192, ``max_template_chars`` 2**20); :func:`set_template_limits` changes them for
the process, ``$PYLLAMA_KV_TEMPLATE_LIMITS`` (``field=value,...``) for a server or the CLI. A
worker takes about 25 MB and 0.1 s to start (once: it is reused), and a rendering through it about
0.15 ms more than one in the calling thread (0.38 vs 0.24 ms for a 4-message SmolLM2 chat);
identical renderings (template, messages, options) come from a small cache (0.02 ms).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
import threading
import weakref
from typing import Any

from .. import _worker as _template_worker
from ..errors import InvalidInputError, LlamaError
from ..limits import MAX_CONTROL_TEXTS
from . import sandbox as _template_sandbox
from .sandbox import TemplateFailure, TemplateLimits

__all__ = ["Rendered", "TemplateLimits", "apply_chat_template", "chat_template", "check_messages", "check_tools",
           "get_template_limits", "read_chat_template", "render", "set_template_limits", "tokenize_rendered"]

LIMITS_ENV = "PYLLAMA_KV_TEMPLATE_LIMITS"
_LIMITS: TemplateLimits | None = None
_LIMITS_LOCK = threading.Lock()


def _limits_from_env() -> TemplateLimits:
    """The defaults, changed by ``$PYLLAMA_KV_TEMPLATE_LIMITS`` (``field=value,...``, e.g.
    ``time_limit=2,memory_limit=1073741824``): how a server or the CLI gets other limits."""
    spec = os.environ.get(LIMITS_ENV, "").strip()
    changes: dict[str, Any] = {}
    types = {f.name: f.type for f in dataclasses.fields(TemplateLimits)}
    try:
        for item in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep or key not in types:
                raise ValueError(f"{item!r} is not field=value with a field of {', '.join(types)}")
            value = value.strip()
            if key == "isolate":
                if value.lower() not in ("0", "1", "true", "false"):
                    raise ValueError(f"isolate must be true or false, got {value!r}")
                changes[key] = value.lower() in ("1", "true")
            else:
                changes[key] = float(value) if key == "time_limit" else int(value)
        return TemplateLimits(**changes)
    except ValueError as e:
        raise LlamaError(f"${LIMITS_ENV}: {e}") from None


def get_template_limits() -> TemplateLimits:
    """The limits every rendering of this process uses: the defaults (:class:`TemplateLimits`),
    changed by ``$PYLLAMA_KV_TEMPLATE_LIMITS`` and :func:`set_template_limits`."""
    global _LIMITS
    if _LIMITS is None:
        with _LIMITS_LOCK:
            if _LIMITS is None:
                _LIMITS = _limits_from_env()
    return _LIMITS


def set_template_limits(limits: TemplateLimits | None = None, **changes: Any) -> TemplateLimits:
    """Set the limits (a TemplateLimits, and/or field=value changes to the current ones; no
    arguments: the defaults); returns the previous ones. Workers with another memory limit are
    replaced at their next use."""
    global _LIMITS
    current = get_template_limits()
    with _LIMITS_LOCK:
        old = current
        base = limits if limits is not None else (old if changes else TemplateLimits())
        try:
            _LIMITS = dataclasses.replace(base, **changes)
        except (TypeError, ValueError) as e:
            raise InvalidInputError(f"bad chat-template limits: {e}") from None
        _CACHE.clear()
        return old


class _Cache:
    """Renderings of identical requests (template, messages, options, limits): texts and the
    template's own failures, at most 64 entries and 8 Mi characters."""

    def __init__(self, entries: int = 64, chars: int = 8 << 20) -> None:
        self.entries, self.chars = entries, chars
        self.lock = threading.Lock()
        self.data: collections.OrderedDict[bytes, tuple[str, str]] = collections.OrderedDict()
        self.size = 0
        self.hits = 0     # renderings answered from the cache (for tests and measurements)
        self.misses = 0   # renderings that went to the renderer (a worker, or inline)

    def get(self, key: bytes) -> tuple[str, str] | None:
        with self.lock:
            v = self.data.get(key)
            if v is not None:
                self.data.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
            return v

    def put(self, key: bytes, value: tuple[str, str]) -> None:
        n = len(value[1])
        if n > self.chars // 4:
            return
        with self.lock:
            if key in self.data:
                return
            self.data[key] = value
            self.size += n
            while len(self.data) > self.entries or self.size > self.chars:
                _, old = self.data.popitem(last=False)
                self.size -= len(old[1])

    def clear(self) -> None:
        with self.lock:
            self.data.clear()
            self.size = 0


_CACHE = _Cache()


def _name(model) -> str:
    path = getattr(model, "path", None)
    return f"the chat template of {path.name}" if path is not None else "the chat template"


def read_chat_template(model) -> str | None:
    """The GGUF's ``tokenizer.chat_template`` (read from the file's header, in full), or None."""
    from ..modelfile.gguf import STRING, GGUFFileError, read_gguf_header

    try:
        kv = read_gguf_header(model.path).kv.get("tokenizer.chat_template")
    except (GGUFFileError, OSError):
        # unreadable here (validate=False on an odd file, file gone): what llama.cpp has
        return model.meta("tokenizer.chat_template")
    if kv is None or kv.type != STRING:
        return None
    return kv.value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _token_text(model, token: int) -> str:
    if token is None or token < 0:
        return ""
    try:
        return model.token_to_piece(token, special=True).decode("utf-8", "replace")
    except Exception:
        return ""


MAX_DEPTH = 64   # nesting of the data in messages and tools (tool schemas, call arguments)
#: message keys besides role and content (what transformers' templates read for tool use)
MESSAGE_EXTRAS = ("tool_calls", "tool_call_id", "name")


def _plain(x: Any, where: str, depth: int = 0) -> Any:
    """``x`` copied as plain JSON data (dict with str keys, list, str, int, finite float, bool,
    None); InvalidInputError naming ``where`` otherwise. What a template sees, and what travels to
    the worker process."""
    if depth > MAX_DEPTH:
        raise InvalidInputError(f"{where} is nested more than {MAX_DEPTH} levels deep")
    if x is None or isinstance(x, (str, bool, int)):
        return str(x) if isinstance(x, str) else (x if isinstance(x, bool) or x is None else int(x))
    if isinstance(x, float):
        if x != x or x in (float("inf"), float("-inf")):
            raise InvalidInputError(f"{where} must be finite, got {x!r}")
        return float(x)
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if not isinstance(k, str):
                raise InvalidInputError(f"{where} has a key that is not a str: {k!r}")
            out[str(k)] = _plain(v, f"{where}[{k!r}]", depth + 1)
        return out
    if isinstance(x, list):
        return [_plain(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(x)]
    raise InvalidInputError(f"{where} must be JSON data (dict, list, str, number, bool, None), "
                            f"got {type(x).__name__}")


def check_messages(messages) -> list[dict]:
    """``messages`` as plain dicts; InvalidInputError unless a list of {"role": str, "content": str}
    dicts, which may also carry what tool use needs: ``tool_calls`` (a list of dicts, as
    transformers takes them: ``{"type": "function", "function": {"name", "arguments"}}``; then
    ``content`` may be None), ``tool_call_id`` and ``name`` (str)."""
    if not isinstance(messages, list):
        raise InvalidInputError(f"messages must be a list of {{'role': str, 'content': str}} dicts, "
                                f"got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidInputError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        if not {"role", "content"} <= set(m) or not set(m) <= {"role", "content", *MESSAGE_EXTRAS}:
            raise InvalidInputError(f"messages[{i}] must have the keys 'role' and 'content' (and optionally "
                                    f"{', '.join(map(repr, MESSAGE_EXTRAS))}), got {sorted(map(repr, m))}")
        calls = m.get("tool_calls")
        for k in ("role", "content", "tool_call_id", "name"):
            if k not in m or (k == "content" and m[k] is None and calls is not None):
                continue
            if not isinstance(m[k], str):
                raise InvalidInputError(f"messages[{i}][{k!r}] must be a str, got {type(m[k]).__name__}")
        msg: dict[str, Any] = {"role": str(m["role"]), "content": None if m["content"] is None else str(m["content"])}
        if calls is not None:
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise InvalidInputError(f"messages[{i}]['tool_calls'] must be a list of dicts")
            msg["tool_calls"] = _plain(calls, f"messages[{i}]['tool_calls']")
        for k in ("tool_call_id", "name"):
            if k in m:
                msg[k] = str(m[k])
        out.append(msg)
    return out


def check_tools(tools) -> list[dict] | None:
    """``tools`` (the template's ``tools`` variable) as plain data: None, or a list of dicts."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidInputError("tools must be a list of dicts (OpenAI function definitions)")
    return _plain(tools, "tools")


def render(source: str, messages, add_generation_prompt: bool = True, *, bos_token: str = "",
           eos_token: str = "", name: str = "the chat template", limits: TemplateLimits | None = None,
           tools: list | None = None) -> str:
    """Render the chat template ``source`` in the sandbox, in a worker process (see the module
    docstring); ``limits`` default to :func:`get_template_limits`. ``tools``: the template's
    ``tools`` variable (a list of OpenAI-style ``{"type": "function", "function": {...}}`` dicts),
    None when there are none, as transformers passes it."""
    if not isinstance(add_generation_prompt, bool):
        raise InvalidInputError("add_generation_prompt must be a bool")
    msgs = check_messages(messages)
    tools = check_tools(tools)
    if not isinstance(source, str):
        raise InvalidInputError(f"{name} must be a str, got {type(source).__name__}")
    limits = limits or get_template_limits()
    if len(source) > limits.max_template_chars:
        raise InvalidInputError(f"{name} is refused: {len(source)} characters, more than {limits.max_template_chars}")
    key = hashlib.blake2b(json.dumps([source, msgs, tools, add_generation_prompt, bos_token, eos_token,
                                      dataclasses.astuple(limits)]).encode("ascii"), digest_size=20).digest()
    hit = _CACHE.get(key)
    if hit is None:
        try:
            if limits.isolate:
                text = _template_worker.render(source, msgs, add_generation_prompt, bos_token, eos_token, limits,
                                               tools=tools)
            else:
                text = _template_sandbox.render_inline(source, msgs, add_generation_prompt, bos_token, eos_token,
                                                       limits, tools=tools)
            hit = ("", text)
        except TemplateFailure as e:
            hit = (e.kind, e.detail)
        except _template_worker.WorkerError as e:
            raise LlamaError(str(e)) from None
        if hit[0] not in ("timeout", "died"):   # those depend on the machine's load
            _CACHE.put(key, hit)
    if hit[0]:
        raise InvalidInputError(_template_sandbox.message(hit[0], hit[1], name))
    return hit[1]


# model -> its chat template (None: the file has none), read once per model; kept here, not on the
# model, so that chat code writes no attribute of another layer's object
_MODEL_TEMPLATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chat_template(model) -> str | None:
    """``model.chat_template``: read once from the file, cached per model."""
    try:
        return _MODEL_TEMPLATES[model]
    except KeyError:
        pass
    t = read_chat_template(model)
    _MODEL_TEMPLATES[model] = t
    return t


class Rendered(str):
    """A rendered chat prompt: a str (the text), which also knows its ``plain`` spans, the
    ``(start, end)`` ranges of control-token text that came from the messages, which
    :func:`tokenize_rendered` tokenizes with special-token parsing off. Slicing keeps the spans
    (``text[len(past):]`` is still a Rendered); other str operations return a plain str."""

    plain: tuple[tuple[int, int], ...]

    def __new__(cls, text: str, plain=()) -> Rendered:
        self = super().__new__(cls, text)
        self.plain = tuple(plain)
        return self

    def __getitem__(self, key) -> Rendered:
        part = str.__getitem__(self, key)
        if not self.plain:
            return Rendered(part)
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:   # no use for it: all plain, to be safe
                return Rendered(part, [(0, len(part))] if part else ())
            return Rendered(part, [(max(a, start) - start, min(b, stop) - start)
                                   for a, b in self.plain if a < stop and b > start])
        i = key + len(self) if key < 0 else key
        return Rendered(part, [(0, 1)] if any(a <= i < b for a, b in self.plain) else ())

    def __reduce__(self):
        return (Rendered, (str(self), self.plain))


def _special_text(model, token: int) -> str | None:
    """The text of ``token`` if it is one that special-token parsing makes (control or unknown: its
    piece is empty unless special=True); "" if that text is not UTF-8; None for other tokens."""
    cache = model.__dict__.setdefault("_chat_special_texts", {})
    try:
        return cache[token]
    except KeyError:
        pass
    try:
        special = model.token_to_piece(token, special=True)
        text: str | None = None
        if special and not model.token_to_piece(token, special=False):
            try:
                text = special.decode("utf-8")
            except UnicodeDecodeError:
                text = ""
    except LlamaError:
        text = None
    if len(cache) < 1 << 16:
        cache[token] = text
    return text


def _control_texts(model, s: str) -> frozenset[str] | None:
    """The texts of the control tokens that special-token parsing finds in the message string ``s``
    (empty for ordinary text), or None if one cannot be located in ``s`` as text (then the whole
    string is to be plain)."""
    cache = model.__dict__.setdefault("_chat_control_texts", collections.OrderedDict())
    hit = cache.get(s, False)
    if hit is not False:
        return hit
    try:
        # the tokens only special-token parsing makes (control or unknown: _special_text), if any
        texts = {_special_text(model, t) for t in set(model.tokenize(s, add_bos=False, special=True))} - {None}
        found: frozenset[str] | None = frozenset()
        if texts:
            found = frozenset(t for t in texts if t) if all(t and t in s for t in texts) else None
    except InvalidInputError:   # text the vocabulary cannot tokenize: tokenizing the prompt says so
        found = frozenset()
    if len(s) <= 1 << 16:
        cache[s] = found
        while len(cache) > 256:
            cache.popitem(last=False)
    return found


#: the supplementary private use area (planes 15 and 16, but their last two noncharacters), where
#: placeholders are taken from
_PUA_FIRST, _PUA_LAST = 0xF0000, 0x10FFFD
_PUA = re.compile("[\U000F0000-\U0010FFFD]")


def _placeholders(n: int, texts) -> list[str]:
    """``n`` characters of the supplementary private use area that occur in none of ``texts``: the
    characters of that area the texts use are collected in one pass over them, then the first ``n``
    others taken (linear in the texts' length plus ``n``, whatever characters they use)."""
    used: set[str] = set()
    for t in texts:
        used.update(_PUA.findall(t))
    out: list[str] = []
    for cp in range(_PUA_FIRST, _PUA_LAST + 1):
        c = chr(cp)
        if c not in used:
            out.append(c)
            if len(out) == n:
                return out
    raise InvalidInputError(f"the messages use {len(used)} private-use characters: too many to mark "
                            f"{n} control-token texts")


def _strings(x: Any):
    """Every str in the plain data ``x``: values and dict keys."""
    if isinstance(x, str):
        yield x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield k
            yield from _strings(v)
    elif isinstance(x, list):
        for v in x:
            yield from _strings(v)


def _map_strings(x: Any, f) -> Any:
    if isinstance(x, str):
        return f(x)
    if isinstance(x, dict):
        return {f(k): _map_strings(v, f) for k, v in x.items()}
    if isinstance(x, list):
        return [_map_strings(v, f) for v in x]
    return x


def apply_chat_template(model, messages, add_generation_prompt: bool = True, *, source: str | None = None,
                        name: str | None = None, tools: list | None = None) -> Rendered:
    """``model.apply_chat_template``: render the model's template with its own BOS/EOS texts; or,
    given ``source`` (a template from elsewhere, called ``name`` in errors), render that one with them.
    ``tools`` is the template's ``tools`` variable (see :func:`render`).

    The result is a :class:`Rendered`. Control-token text inside any string of the messages or the
    tools (a role, a content, a tool call's arguments, a tool's description; say ``<|im_end|>``,
    which the tokenizer would parse as the control token) is handed to the template as a placeholder
    character (one the template, the messages, the tools and BOS/EOS do not contain), and each
    placeholder in the output is put back as the same text, marked plain: tokenize_rendered then
    tokenizes it as ordinary characters. Messages without control-token text (the usual case) are
    rendered as they are, so the text is byte for byte the template's. A template that inspects or
    rewrites that text (``replace('<|im_end|>', '')``, ``split``) sees the placeholder instead; a
    string where a control token is found but its text cannot be (not UTF-8) is handed over as one
    placeholder for the whole string."""
    if source is None:
        source = chat_template(model)
        name = _name(model)
    if source is None:
        check_messages(messages)
        raise InvalidInputError(f"{model.path.name} has no chat template (no tokenizer.chat_template in the GGUF)")
    model.check_open()
    if not isinstance(add_generation_prompt, bool):
        raise InvalidInputError("add_generation_prompt must be a bool")
    msgs = check_messages(messages)
    tools = check_tools(tools)
    bos, eos = _token_text(model, model.bos), _token_text(model, model.eos)
    name = name or "the chat template"
    strings = {x for x in _strings([msgs, tools]) if x}
    found = {s: _control_texts(model, s) for s in strings}
    texts = set().union(*[f for f in found.values() if f])
    whole = [s for s, f in found.items() if f is None]
    if not texts and not whole:
        return Rendered(render(source, msgs, add_generation_prompt, bos_token=bos, eos_token=eos, name=name,
                               tools=tools))
    ordered = sorted(texts, key=lambda t: (-len(t), t)) + sorted(whole)
    pattern = re.compile("|".join(re.escape(t) for t in ordered[:len(texts)])) if texts else None
    # each spelling is tokenized on its own later: too many are refused before anything is rendered
    spelled = len(whole) + sum(len(pattern.findall(s)) for s in strings if found.get(s)) if pattern else len(whole)
    if spelled > MAX_CONTROL_TEXTS:
        raise _too_many_spellings(ordered[0], spelled)
    marks = _placeholders(len(ordered), [source, bos, eos, *strings])
    to_mark = dict(zip(ordered, marks))

    def mark(s: str) -> str:
        if s in to_mark and found.get(s) is None:
            return to_mark[s]
        return pattern.sub(lambda m: to_mark[m.group()], s) if pattern is not None and found.get(s) else s

    marked = _map_strings(msgs, mark)
    text = render(source, marked, add_generation_prompt, bos_token=bos, eos_token=eos, name=name,
                  tools=_map_strings(tools, mark))
    out = _restore(text, dict(zip(marks, ordered)))
    if len(out.plain) > MAX_CONTROL_TEXTS:   # (a template that repeats a message)
        raise _too_many_spellings(ordered[0], len(out.plain))
    return out


def _too_many_spellings(example: str, n: int) -> InvalidInputError:
    return InvalidInputError(f"the messages spell control tokens (such as {example[:40]!r}) {n} times in the "
                             f"rendered chat; at most {MAX_CONTROL_TEXTS}")


def _restore(text: str, back: dict[str, str]) -> Rendered:
    """``text`` with each placeholder of ``back`` put back as its text, marked plain: one pass over the
    private-use characters of ``text`` (one regular expression, whatever the placeholders)."""
    out: list[str] = []
    plain: list[tuple[int, int]] = []
    pos = start = 0
    for m in _PUA.finditer(text):
        original = back.get(m.group())
        if original is None:
            continue
        out.append(text[start:m.start()])
        pos += m.start() - start
        out.append(original)
        plain.append((pos, pos + len(original)))
        pos += len(original)
        start = m.end()
    out.append(text[start:])
    return Rendered("".join(out), plain)


def tokenize_rendered(model, text: str, start: bool = True) -> list[int]:
    """The token ids of a rendered chat prompt: its special tokens (``<|im_start|>``...) parsed, and,
    at the ``start`` of a prompt, the model's BOS added unless the template wrote it already.

    ``text`` is what :func:`apply_chat_template` returned (or a slice of it): its plain spans
    (control-token text that came from the messages) are tokenized with special-token parsing off,
    each on its own, so no token spans their boundaries (the text around them is tokenized in pieces
    too: at those boundaries the ids can differ from tokenizing the whole, as when the text is typed).
    A plain str is taken as trusted text: all of its special tokens are parsed."""
    plain = text.plain if isinstance(text, Rendered) else ()
    raw = str.__str__(text)
    bos = _token_text(model, model.bos)
    wrote_bos = bool(bos) and raw.startswith(bos) and not (plain and plain[0][0] < len(bos))
    add_bos = start and not wrote_bos
    if not plain:
        return model.tokenize(raw, add_bos=add_bos, special=True)
    out: list[int] = []
    first = True
    pos = 0
    for a, b in [*plain, (len(raw), len(raw))]:
        for part, special in ((raw[pos:a], True), (raw[a:b], False)):
            if part:
                out += model.tokenize(part, add_bos=add_bos and first, special=special)
                first = False
        pos = b
    if first and add_bos:
        out = model.tokenize("", add_bos=True, special=True)
    return out
