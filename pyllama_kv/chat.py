"""Chat templates: a GGUF's ``tokenizer.chat_template``, rendered the way Hugging Face transformers
renders it (jinja2, ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
``loopcontrols`` extension, ``bos_token``/``eos_token``, ``raise_exception``, ``strftime_now`` and a
``tojson`` filter with ``ensure_ascii=False``), so the text is byte for byte what the model saw.

A GGUF is untrusted input, and so is its template:

- the jinja2 sandbox refuses access to Python internals (``__globals__``, ``__class__``,
  ``__subclasses__``, ...) and the immutable variant refuses mutating ``messages`` in place;
- every failure (SecurityError, a syntax error, an undefined name used in an expression, a
  ``raise_exception`` call, a Python exception from a filter or method) becomes
  :class:`~pyllama_kv.errors.InvalidInputError` naming the template; nothing else escapes;
- the work is bounded: each ``range`` has at most ``jinja2.sandbox.MAX_RANGE`` items, every loop
  iteration and every call spends one unit of a budget of :data:`MAX_STEPS` per rendering, a
  rendering stops after :data:`MAX_SECONDS`, the output is capped at :data:`MAX_OUTPUT_CHARS`, and
  ``*``, ``**``, ``%``, ``center``/``indent`` and int arguments to calls refuse sizes above
  :data:`MAX_SIZE`. Limit left: a single C-level operation inside one step (one filter on one big
  string, ...) is not interrupted, but its inputs are bounded by the caps above.
"""
from __future__ import annotations

import contextvars
import json
import re
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

from .errors import InvalidInputError

MAX_OUTPUT_CHARS = 1 << 20      # characters of rendered text
MAX_STEPS = 1_000_000           # loop iterations + calls per rendering
MAX_SECONDS = 5.0               # wall clock per rendering
MAX_SIZE = 1 << 20              # repeat counts, widths, exponents, int arguments
MAX_TEMPLATE_CHARS = 1 << 20    # template source length

# the rendering's budget: a context variable, out of the template's reach (a template can assign any name)
_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("pyllama_kv_chat_budget", default=None)


class _Refused(Exception):
    """A resource limit was hit (becomes InvalidInputError)."""


class _Raised(Exception):
    """The template called raise_exception(message)."""


class _Budget:
    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def tick(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _Refused(f"it takes more than {MAX_STEPS} loop iterations and calls")
        if not self.steps & 1023 and time.monotonic() > self.deadline:
            raise _Refused(f"it runs for more than {MAX_SECONDS:g} s")



def _tick() -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.tick()


def _iterate(iterable):
    """Wraps the iterable of every ``{% for %}`` loop (compiled in as an imported name)."""
    for item in iterable:
        _tick()
        yield item


def _check_size(n: Any, what: str) -> None:
    if isinstance(n, int) and not isinstance(n, bool) and abs(n) > MAX_SIZE:
        raise _Refused(f"{what} {n} is larger than {MAX_SIZE}")


_PRINTF_NUM = re.compile(r"%[#0\- +]*(\d*)(?:\.(\d*))?")


def _check_printf(fmt: Any) -> None:
    if isinstance(fmt, str):
        for m in _PRINTF_NUM.finditer(fmt):
            for g in m.groups():
                if g and len(g) > 7 or g and int(g) > MAX_SIZE:
                    raise _Refused(f"a % format width of {g} is too large")


def _environment():
    import jinja2.ext
    from jinja2 import nodes, sandbox

    class Env(sandbox.ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "%"])

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for a, b in ((left, right), (right, left)):
                    if isinstance(a, (str, list, tuple, bytes)) and isinstance(b, int):
                        if len(a) * b > MAX_SIZE:
                            raise _Refused(f"a sequence repeated {b} times is larger than {MAX_SIZE}")
            elif operator == "**":
                _check_size(right, "an exponent of")
                if isinstance(right, int) and isinstance(left, int) and abs(left) > 1 and right > 4096:
                    raise _Refused(f"{left} ** {right} is too large")
            elif operator == "%":
                _check_printf(left)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            _tick()
            for a in (*args, *kwargs.values()):
                _check_size(a, "an argument of")
            return super().call(__context, __obj, *args, **kwargs)

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # as transformers: json.dumps, not jinja's HTML-safe variant
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    builtin_center, builtin_indent = env.filters["center"], env.filters["indent"]

    def center(value, width=80):
        _check_size(width, "a width of")
        return builtin_center(value, width)

    def indent(s, width=4, *args, **kwargs):
        _check_size(width, "a width of")
        if isinstance(width, str) and len(width) * (str(s).count("\n") + 1) > MAX_SIZE:
            raise _Refused("an indent that large")
        return builtin_indent(s, width, *args, **kwargs)

    builtin_format = env.filters["format"]

    def format_(value, *args, **kwargs):
        _check_printf(value)
        return builtin_format(value, *args, **kwargs)

    env.filters.update(tojson=tojson, center=center, indent=indent, format=format_)

    def raise_exception(message):
        raise _Raised(str(message))

    def strftime_now(fmt):
        return datetime.now().strftime(str(fmt))

    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env, nodes


@lru_cache(maxsize=1)
def _env():
    return _environment()


@lru_cache(maxsize=16)
def _compile(source: str):
    """The template, with every ``{% for %}`` iterable wrapped in the rendering's budget."""
    env, nodes = _env()
    tree = env.parse(source)
    for loop in tree.find_all(nodes.For):
        wrap = nodes.ImportedName(f"{__name__}._iterate")
        loop.iter = nodes.Call(wrap, [loop.iter], [], None, None)
    return env.from_string(tree)


def _name(model) -> str:
    path = getattr(model, "path", None)
    return f"the chat template of {path.name}" if path is not None else "the chat template"


def read_chat_template(model) -> str | None:
    """The GGUF's ``tokenizer.chat_template`` (read from the file's header, in full), or None."""
    from .tools.gguf_check import STRING, GGUFFileError, read_gguf_header

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


def check_messages(messages) -> list[dict]:
    """``messages`` as plain dicts; InvalidInputError unless a list of {"role": str, "content": str}."""
    if not isinstance(messages, list):
        raise InvalidInputError(f"messages must be a list of {{'role': str, 'content': str}} dicts, "
                                f"got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidInputError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        if set(m) != {"role", "content"}:
            raise InvalidInputError(f"messages[{i}] must have exactly the keys 'role' and 'content', "
                                    f"got {sorted(map(repr, m))}")
        for k in ("role", "content"):
            if not isinstance(m[k], str):
                raise InvalidInputError(f"messages[{i}][{k!r}] must be a str, got {type(m[k]).__name__}")
        out.append({"role": str(m["role"]), "content": str(m["content"])})
    return out


def render(source: str, messages, add_generation_prompt: bool = True, *, bos_token: str = "",
           eos_token: str = "", name: str = "the chat template") -> str:
    """Render the chat template ``source`` in the sandbox (see the module docstring)."""
    import jinja2

    if not isinstance(add_generation_prompt, bool):
        raise InvalidInputError("add_generation_prompt must be a bool")
    msgs = check_messages(messages)
    if not isinstance(source, str):
        raise InvalidInputError(f"{name} must be a str, got {type(source).__name__}")
    if len(source) > MAX_TEMPLATE_CHARS:
        raise InvalidInputError(f"{name} is refused: {len(source)} characters, more than {MAX_TEMPLATE_CHARS}")
    token = _BUDGET.set(_Budget())
    try:
        template = _compile(source)
        parts, n = [], 0
        for chunk in template.generate(messages=msgs, add_generation_prompt=add_generation_prompt,
                                       bos_token=bos_token, eos_token=eos_token):
            n += len(chunk)
            if n > MAX_OUTPUT_CHARS:
                raise _Refused(f"its output is longer than {MAX_OUTPUT_CHARS} characters")
            parts.append(chunk)
            _tick()
        return "".join(parts)
    except _Raised as e:
        raise InvalidInputError(f"{name} raised an exception: {e}") from None
    except _Refused as e:
        raise InvalidInputError(f"{name} is refused: {e}") from None
    except jinja2.exceptions.SecurityError as e:
        raise InvalidInputError(f"{name} is refused: it tries to reach Python internals ({e})") from None
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise InvalidInputError(f"{name} is not a valid jinja2 template: {e} (line {e.lineno})") from None
    except jinja2.exceptions.TemplateError as e:
        raise InvalidInputError(f"{name} failed: {type(e).__name__}: {e}") from None
    except RecursionError:
        raise InvalidInputError(f"{name} is refused: it recurses too deeply") from None
    except MemoryError:
        raise InvalidInputError(f"{name} is refused: it runs out of memory") from None
    except Exception as e:
        raise InvalidInputError(f"{name} failed: {type(e).__name__}: {e}") from None
    finally:
        _BUDGET.reset(token)


def chat_template(model) -> str | None:
    """``model.chat_template``: read once from the file, cached on the model."""
    try:
        return model._chat_template_cached
    except AttributeError:
        pass
    t = read_chat_template(model)
    model._chat_template_cached = t
    return t


def apply_chat_template(model, messages, add_generation_prompt: bool = True, *, source: str | None = None,
                        name: str | None = None) -> str:
    """``model.apply_chat_template``: render the model's template with its own BOS/EOS texts; or,
    given ``source`` (a template from elsewhere, called ``name`` in errors), render that one with them."""
    if source is None:
        source = chat_template(model)
        name = _name(model)
    if source is None:
        check_messages(messages)
        raise InvalidInputError(f"{model.path.name} has no chat template (no tokenizer.chat_template in the GGUF)")
    model._check_open()
    return render(source, messages, add_generation_prompt, bos_token=_token_text(model, model.bos),
                  eos_token=_token_text(model, model.eos), name=name or "the chat template")


def tokenize_rendered(model, text: str, start: bool = True) -> list[int]:
    """The token ids of a rendered chat prompt: its special tokens (``<|im_start|>``...) parsed, and,
    at the ``start`` of a prompt, the model's BOS added unless the template wrote it already."""
    bos = _token_text(model, model.bos)
    return model.tokenize(text, add_bos=start and not (bos and text.startswith(bos)), special=True)
