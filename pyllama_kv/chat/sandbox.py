"""The chat-template sandbox: jinja2's immutable sandbox with resource caps, rendering in the calling
thread. pyllama_kv.chat.templates runs it in worker processes (pyllama_kv._worker) that are killed at the
time limit and run under a memory limit; the caps here make most refusals precise and fast.

Standard library and jinja2 only (the worker imports nothing else). See pyllama_kv.chat.templates for the
threat model.

What is capped here, per rendering (the numbers are :class:`TemplateLimits` fields):

- time: every loop iteration, call and filter checks the deadline (and spends one of ``max_steps``);
- integers: ``*`` and ``**`` on ints are refused *before* computing when the result would have more
  than ``max_int_bits`` bits, and every arithmetic result is checked (so a chain cannot grow one);
- strings and sequences: every operation that can build a value much larger than its inputs is
  estimated before it runs and refused above ``max_size`` characters/items: ``*``, ``+``, ``~``,
  ``%``-formatting (widths and precisions, ``*`` ones included, and every ``%s`` argument),
  ``str.format``/``format_map`` (each field, widths included), the methods ``replace``, ``join``,
  ``center``/``ljust``/``rjust``/``zfill``, ``expandtabs``, ``translate``, ``to_bytes``, and the
  filters ``center``, ``indent``, ``wordwrap``, ``format``, ``replace``, ``join``, ``sum``,
  ``batch``, ``slice``, ``string``, ``tojson``, ``pprint`` and the other text filters; ``{{ }}``
  output and ``~`` check the size of what they turn into text (containers included); the result of
  every call and filter is checked too;
- the output is at most ``max_output_chars``; the template source at most ``max_template_chars``;
- globals: ``range`` (jinja's, at most 100000 items), ``dict``, ``namespace``, ``cycler``,
  ``joiner``, ``raise_exception``, ``strftime_now``; jinja's ``lipsum`` is removed.

What is left to the worker process's limits: a value that the estimates above miss by a small factor
(``repr`` escapes, case mappings), totals accumulated over many steps (each bounded, and the steps and
time too), and anything a future jinja adds.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import itertools
import json
import re
import time
import types
from collections.abc import Mapping
from datetime import datetime
from typing import Any


@dataclasses.dataclass(frozen=True)
class TemplateLimits:
    """The limits of one chat-template rendering (the defaults are the documented ones)."""

    time_limit: float = 5.0
    """seconds of wall clock per rendering; the worker process is killed when it runs past them"""
    memory_limit: int = 512 << 20
    """bytes of address space of a worker process (RLIMIT_AS)"""
    workers: int = 2
    """worker processes that render at the same time (started on demand, reused)"""
    isolate: bool = True
    """render in worker processes; False renders in the calling thread with only the in-process caps
    (then a single C-level operation is not interrupted, and memory is not bounded as a whole)"""
    max_output_chars: int = 1 << 20
    """characters of rendered text"""
    max_steps: int = 1_000_000
    """loop iterations + calls + filters per rendering"""
    max_size: int = 1 << 20
    """characters or items of one value an operation builds; widths, precisions, repeat counts"""
    max_int_bits: int = 8192
    """bits of an integer an arithmetic operation builds"""
    max_template_chars: int = 1 << 20
    """characters of template source"""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "isolate":
                if not isinstance(v, bool):
                    raise ValueError("isolate must be a bool")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{f.name} must be a positive number, got {v!r}")
            elif f.name not in ("time_limit",) and not isinstance(v, int):
                raise ValueError(f"{f.name} must be an int, got {v!r}")


DEFAULT_LIMITS = TemplateLimits()


class Refused(Exception):
    """A limit was hit (the message says which)."""


class TimeUp(Refused):
    """The rendering ran past its time (depends on the machine's load: not cached)."""


class Raised(Exception):
    """The template called raise_exception(message)."""


class TemplateFailure(Exception):
    """A rendering failed: ``kind`` (raised, refused, timeout, died, syntax, failed) and ``detail``."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(kind, detail)
        self.kind, self.detail = kind, detail

    def message(self, name: str) -> str:
        return message(self.kind, self.detail, name)


def message(kind: str, detail: str, name: str) -> str:
    """The InvalidInputError text for a failure of ``kind`` in the template called ``name``."""
    if kind == "raised":
        return f"{name} raised an exception: {detail}"
    if kind in ("refused", "timeout", "died"):
        return f"{name} is refused: {detail}"
    if kind == "syntax":
        return f"{name} is not a valid jinja2 template: {detail}"
    return f"{name} failed: {detail}"


# the rendering's budget: a context variable, out of the template's reach (a template can assign any name)
class _Budget:
    def __init__(self, limits: TemplateLimits, seconds: float) -> None:
        self.limits = limits
        self.seconds = seconds
        self.steps = 0
        self.deadline = time.monotonic() + seconds

    def tick(self) -> None:
        self.steps += 1
        if self.steps > self.limits.max_steps:
            raise Refused(f"it takes more than {self.limits.max_steps} loop iterations and calls")
        if time.monotonic() > self.deadline:
            raise TimeUp(f"it runs for more than {self.limits.time_limit:g} s")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("pyllama_kv_template_budget", default=None)


def _limits() -> TemplateLimits:
    b = _BUDGET.get()
    return b.limits if b is not None else DEFAULT_LIMITS


def _tick() -> None:
    b = _BUDGET.get()
    if b is not None:
        b.tick()


def _iterate(iterable):
    """Wraps the iterable of every ``{% for %}`` loop (compiled in as an imported name)."""
    for item in iterable:
        _tick()
        yield item


# -- sizes -----------------------------------------------------------------------------------------

def _int_size(n: int) -> int:
    return n.bit_length() // 3 + 2          # >= the decimal digits, with the sign


def str_size(x: Any, limit: int) -> int:
    """An estimate of ``len(str(x))`` (exact for str; for containers the sum over their reprs, each
    str item counted as its length + 2): counting stops once past ``limit``. Iterative, so neither
    deep nesting nor cycles (counted once per path) can make it recurse; its work is O(limit)."""
    if isinstance(x, str):
        return len(x)
    total = 0
    exit_ = object()
    stack: list[Any] = [x]
    on_path: set[int] = set()
    while stack:
        o = stack.pop()
        if type(o) is tuple and len(o) == 2 and o[0] is exit_:
            on_path.discard(o[1])
            continue
        if isinstance(o, str):
            total += len(o) + 2
        elif isinstance(o, (bytes, bytearray)):
            total += 4 * len(o) + 3
        elif isinstance(o, bool) or o is None:
            total += 5
        elif isinstance(o, int):
            total += _int_size(o)
        elif isinstance(o, float):
            total += 25
        elif isinstance(o, (list, tuple, set, frozenset, dict)) or _namespace_attrs(o) is not None:
            total += 2
            if id(o) in on_path:
                continue
            on_path.add(id(o))
            stack.append((exit_, id(o)))
            items: Any = o
            if not isinstance(o, (list, tuple, set, frozenset, dict)):
                total += 12
                items = _namespace_attrs(o)
            if isinstance(items, dict):
                for k, v in items.items():
                    total += 4
                    stack.append(k)
                    stack.append(v)
                    if total > limit:
                        return total
            else:
                for v in items:
                    total += 2
                    stack.append(v)
                    if total > limit:
                        return total
        else:
            total += 64
        if total > limit:
            return total
    return total


def _namespace_attrs(o: Any) -> dict | None:
    from jinja2.utils import Namespace

    if isinstance(o, Namespace):
        attrs = getattr(o, "_Namespace__attrs", None)
        return attrs if isinstance(attrs, dict) else {}
    return None


def _check(size: int, what: str) -> None:
    limit = _limits().max_size
    if size > limit:
        raise Refused(f"{what} would be longer than {limit} characters or items")


def _check_text(x: Any, what: str = "a value turned into text") -> None:
    _check(str_size(x, _limits().max_size), what)


def _check_width(n: Any, what: str) -> int:
    """``n`` as a width/count (0 unless an int), refused above max_size."""
    if isinstance(n, int) and not isinstance(n, bool):
        if abs(n) > _limits().max_size:
            raise Refused(f"{what} of {n} is larger than {_limits().max_size}")
        return abs(n)
    return 0


def _check_int(x: Any, what: str = "an arithmetic result") -> Any:
    if isinstance(x, int) and not isinstance(x, bool):
        bits = _limits().max_int_bits
        if x.bit_length() > bits:
            raise Refused(f"{what} has more than {bits} bits")
    return x


def _check_result(x: Any, what: str) -> Any:
    if isinstance(x, (str, bytes, bytearray, list, tuple, dict, set, frozenset)):
        _check(len(x), what)
    return _check_int(x, what)


def _digits(s: str, what: str) -> int:
    if len(s) > 9:
        raise Refused(f"{what} of {s[:12]}... is too large")
    return int(s)


# -- formatting --------------------------------------------------------------------------------------

_PRINTF = re.compile(r"%(?:\(([^)]*)\))?([-#0 +]*)(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.?)", re.S)


def printf_size(fmt: str, values: Any) -> int:
    """An upper estimate of ``len(fmt % values)`` (widths and precisions, ``*`` ones included, and
    the size of every argument), refused above max_size."""
    limit = _limits().max_size
    args = list(values) if isinstance(values, tuple) else [values]
    mapping = values if isinstance(values, Mapping) else None
    i = 0
    total = len(fmt)

    def take():
        nonlocal i
        v = args[i] if i < len(args) else None
        i += 1
        return v

    for m in _PRINTF.finditer(fmt):
        key, _flags, width, prec, conv = m.groups()
        w = _check_width(take(), "a % format width") if width == "*" else \
            _digits(width, "a % format width") if width else 0
        p = _check_width(take(), "a % format precision") if prec == "*" else \
            _digits(prec, "a % format precision") if prec else 0
        _check(max(w, p), "a % format width or precision")
        if conv == "%":
            total += max(w, 1)
            continue
        if key is not None:
            try:
                v = mapping[key] if mapping is not None else None
            except Exception:
                v = None
        else:
            v = take()
        if conv in ("s", "r", "a"):
            n = str_size(v, limit) * (1 if conv == "s" else 10)
            if prec:
                n = min(n, p)
        elif isinstance(v, int):
            n = max(_int_size(v), p) + 2
        else:
            n = p + 320                          # a float: up to 309 digits before the point
        total += max(w, n)
        _check(total, "a % formatted string")
    return total


def _spec_width(spec: str) -> int:
    """The largest number in a str.format spec (its width or precision), refused above max_size."""
    return max((_check_width(_digits(d, "a format width"), "a format width") for d in re.findall(r"\d+", spec)),
               default=0)


def _formatters():
    from jinja2.sandbox import SandboxedEscapeFormatter, SandboxedFormatter

    class Bounded(SandboxedFormatter):
        """str.format in the sandbox, with each field's size (widths included) added up and capped."""

        total = 0

        def convert_field(self, value: Any, conversion: str | None) -> Any:
            if conversion is not None:
                _check(str_size(value, _limits().max_size) * 10, "a converted format field")
            return super().convert_field(value, conversion)

        def format_field(self, value: Any, format_spec: str) -> Any:
            _tick()
            n = max(_spec_width(format_spec), str_size(value, _limits().max_size))
            self.total += n
            _check(self.total, "a formatted string")
            return super().format_field(value, format_spec)

    class BoundedEscape(Bounded, SandboxedEscapeFormatter):
        pass

    return Bounded, BoundedEscape


# -- methods of builtin objects ---------------------------------------------------------------------

def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _replace_size(s: Any, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, type(s)) or not isinstance(new, type(s)):
        return len(s)
    n = len(s) + 1 if not old else s.count(old)
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(0, len(new) - len(old))


def _join_size(sep: Any, items: list) -> int:
    limit = _limits().max_size
    total = len(sep) * max(0, len(items) - 1)
    for it in items:
        total += len(it) if isinstance(it, (str, bytes)) else str_size(it, limit)
        if total > limit:
            break
    return total


def _check_method(obj: Any, args: tuple, kwargs: dict) -> tuple:
    """Estimates the result of the builtin methods that can amplify (before they run); returns the
    args, with an iterable to join materialized."""
    if not isinstance(obj, types.BuiltinMethodType):
        return args
    s, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if isinstance(s, (str, bytes, bytearray)):
        what = f"the result of .{name}()"
        if name in ("center", "ljust", "rjust", "zfill"):
            _check(max(len(s), _check_width(_arg(args, kwargs, 0, "width"), "a width")), what)
        elif name == "expandtabs":
            tab = _check_width(_arg(args, kwargs, 0, "tabsize", 8), "a tab size")
            tabs = s.count("\t") if isinstance(s, str) else s.count(b"\t")
            _check(len(s) + tabs * tab, what)
        elif name == "replace":
            _check(_replace_size(s, _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"),
                                 _arg(args, kwargs, 2, "count", -1)), what)
        elif name == "join" and args:
            items = []
            for it in args[0]:
                _tick()
                items.append(it)
            _check(_join_size(s, items), what)
            return (items, *args[1:])
        elif name == "translate":
            table = _arg(args, kwargs, 0, "table")
            longest = 1
            if isinstance(table, Mapping):
                longest = max([len(v) for v in table.values() if isinstance(v, (str, bytes))] + [1])
            _check(len(s) * longest, what)
    elif isinstance(s, int) and name == "to_bytes":
        _check(_check_width(_arg(args, kwargs, 0, "length", 1), "a length"), "the result of .to_bytes()")
    return args


def _concat(*parts: Any) -> str:
    """``a ~ b``: the sizes first, then jinja's str_join."""
    limit = _limits().max_size
    total = 0
    for p in parts:
        total += str_size(p, limit)
        _check(total, "a ~ concatenation")
    return "".join([str(p) for p in parts])


def _finalize(value: Any) -> Any:
    """Every ``{{ }}`` value, before it becomes text."""
    if not isinstance(value, str):
        _check_text(value, "a value output as text")
    return value


# -- filters -------------------------------------------------------------------------------------------

# filters that turn their value into text (or JSON, or markup): the value's text size is checked first
_TEXT_FILTERS = frozenset(["capitalize", "center", "e", "escape", "forceescape", "format", "indent", "lower",
                           "pprint", "replace", "safe", "string", "striptags", "title", "tojson", "trim",
                           "truncate", "upper", "urlencode", "urlize", "wordcount", "wordwrap", "xmlattr"])


def _estimate_filter(name: str, args: tuple, kwargs: dict) -> None:
    if not args:
        return
    v, rest = args[0], args[1:]
    if name in _TEXT_FILTERS:
        _check_text(v, f"the input of |{name}")
    n = len(v) if isinstance(v, str) else 0
    what = f"the result of |{name}"
    if name == "center":
        _check(max(n, _check_width(_arg(rest, kwargs, 0, "width", 80), "a width")), what)
    elif name == "indent":
        w = _arg(rest, kwargs, 0, "width", 4)
        w = len(w) if isinstance(w, str) else _check_width(w, "an indent")
        _check(n + w * (str(v).count("\n") + 1), what)
    elif name == "wordwrap":
        wrap = _arg(rest, kwargs, 2, "wrapstring")
        _check(n * (1 + (len(wrap) if isinstance(wrap, str) else 1)), what)
    elif name == "format":
        printf_size(str(v), kwargs or tuple(rest))
    elif name == "replace":
        _check(_replace_size(str(v), _arg(rest, kwargs, 0, "old"), _arg(rest, kwargs, 1, "new"),
                             _arg(rest, kwargs, 2, "count")), what)
    elif name == "truncate":
        end = _arg(rest, kwargs, 2, "end", "...")
        _check(n + (len(end) if isinstance(end, str) else 0), what)
    elif name in ("batch", "slice"):
        _check_width(_arg(rest, kwargs, 0, "linecount" if name == "batch" else "slices"), f"|{name}'s count")
    elif name == "round":
        _check_width(_arg(rest, kwargs, 0, "precision"), "a precision")


def _wrap_filter(name: str, f):
    from jinja2.utils import _PassArg

    skip = 1 if _PassArg.from_obj(f) is not None else 0

    @functools.wraps(f)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _tick()
        _estimate_filter(name, args[skip:], kwargs)
        return _check_result(f(*args, **kwargs), f"the result of |{name}")

    return bounded


def _join_filter():
    from jinja2.filters import make_attrgetter
    from jinja2.utils import pass_environment

    def collect(environment, value, attribute) -> list:
        """The items of ``value`` (their ``attribute`` if given), one step counted per item."""
        if attribute is not None:
            value = map(make_attrgetter(environment, attribute), value)
        items = []
        for it in value:
            _tick()
            items.append(it)
        return items

    @pass_environment
    def join(environment, value, d="", attribute=None):
        items = collect(environment, value, attribute)
        _check(_join_size(str(d), items), "the result of |join")
        return str(d).join(map(str, items))

    @pass_environment
    def sum_(environment, iterable, attribute=None, start=0):
        items = collect(environment, iterable, attribute)
        if not isinstance(start, (int, float)):
            size = len(start) if hasattr(start, "__len__") else 0
            for it in items:
                size += len(it) if hasattr(it, "__len__") else 0
            _check(size, "the result of |sum")
            if isinstance(start, (list, tuple)) and all(type(it) is type(start) for it in items):
                return type(start)(itertools.chain(start, *items))   # linear, where sum() is quadratic
        return sum(items, start)

    return join, sum_


# -- the environment ---------------------------------------------------------------------------------

def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an arithmetic operation whose result would pass the limits, before it is computed:
    a product or power of too many bits, a repetition, concatenation or %-format too large."""
    limits = _limits()
    ints = (isinstance(left, int) and isinstance(right, int))
    if operator == "*":
        if ints:
            if left.bit_length() + right.bit_length() > limits.max_int_bits + 1:
                raise Refused(f"a product would have more than {limits.max_int_bits} bits")
        else:
            for a, b in ((left, right), (right, left)):
                if isinstance(a, (str, bytes, list, tuple)) and isinstance(b, int):
                    _check(len(a) * b, f"a sequence repeated {b} times")
    elif operator == "**":
        if ints and right > 0 and abs(left) > 1:
            if right > limits.max_int_bits or (abs(left).bit_length() - 1) * right > limits.max_int_bits:
                raise Refused(f"{left if left.bit_length() < 64 else 'a big number'} ** {right} "
                              f"would have more than {limits.max_int_bits} bits")
    elif operator == "+":
        if isinstance(left, (str, bytes, list, tuple)) and isinstance(right, (str, bytes, list, tuple)):
            _check(len(left) + len(right), "a + concatenation")
    elif operator == "%" and isinstance(left, str):
        printf_size(left, right)


def _str_format(env, value, bounded, bounded_escape):
    """``str.format``/``format_map`` (and Markup's) bound to the bounded formatters; None for any
    other value (jinja's sandbox then treats it as usual)."""
    if not isinstance(value, (types.MethodType, types.BuiltinMethodType)) or \
            value.__name__ not in ("format", "format_map") or not isinstance(value.__self__, str):
        return None
    from markupsafe import Markup

    f_self = value.__self__
    is_map = value.__name__ == "format_map"
    if isinstance(f_self, Markup):
        formatter = bounded_escape(env, escape=f_self.escape)
    else:
        formatter = bounded(env)

    def format_(*args, **kwargs):
        if is_map:
            if kwargs or len(args) != 1:
                raise TypeError("format_map() takes exactly one argument")
            return type(f_self)(formatter.vformat(f_self, (), args[0]))
        return type(f_self)(formatter.vformat(f_self, args, kwargs))

    return format_


def _environment():
    import jinja2.ext
    from jinja2 import nodes, sandbox

    bounded, bounded_escape = _formatters()

    class Env(sandbox.ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["+", "-", "*", "/", "//", "%", "**"])

        def call_binop(self, context, operator, left, right):
            _tick()
            _check_binop(operator, left, right)
            return _check_int(super().call_binop(context, operator, left, right))

        def wrap_str_format(self, value):
            return _str_format(self, value, bounded, bounded_escape)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            _tick()
            args = _check_method(__obj, args, kwargs)
            return _check_result(super().call(__context, __obj, *args, **kwargs), "the result of a call")

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], finalize=_finalize)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # as transformers: json.dumps, not jinja's HTML-safe variant
        if indent is not None:
            _check_width(indent, "an indent")
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    join, sum_ = _join_filter()
    env.filters.update(tojson=tojson, join=join, sum=sum_)
    for name, f in list(env.filters.items()):
        env.filters[name] = _wrap_filter(name, f)

    def raise_exception(message):
        raise Raised(str(message))

    def strftime_now(fmt):
        fmt = str(fmt)
        _check(len(fmt) * 8, "the result of strftime_now")
        return datetime.now().strftime(fmt)

    env.globals.pop("lipsum", None)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env, nodes


@functools.lru_cache(maxsize=1)
def _env():
    return _environment()


def prepare() -> None:
    """Import jinja2 and build the sandboxed environment now (a worker process does it once, before
    its memory limit is set)."""
    _env()


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    """The template: every ``{% for %}`` iterable wrapped in the rendering's budget, every ``~`` a
    call to :func:`_concat`."""
    from jinja2.visitor import NodeTransformer

    env, nodes = _env()
    tree = env.parse(source)
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Call(nodes.ImportedName(f"{__name__}._iterate"), [loop.iter], [], None, None)
    concat = nodes.ImportedName(f"{__name__}._concat")

    class Concats(NodeTransformer):
        def visit_Concat(self, node):
            node = self.generic_visit(node)
            return nodes.Call(concat, list(node.nodes), [], None, None, lineno=node.lineno)

    tree = Concats().visit(tree)
    return env.from_string(tree)


def render_inline(source: str, messages: list[dict], add_generation_prompt: bool, bos_token: str, eos_token: str,
                  limits: TemplateLimits = DEFAULT_LIMITS, seconds: float | None = None,
                  tools: list | None = None) -> str:
    """Render in the calling thread with the caps above; :class:`TemplateFailure` on any failure.
    ``seconds``: the deadline (default ``limits.time_limit``). ``tools``: the template's ``tools``
    variable (OpenAI-style function definitions, plain JSON data), None when the request has none
    (transformers passes None too)."""
    import jinja2

    if len(source) > limits.max_template_chars:
        raise TemplateFailure("refused", f"{len(source)} characters, more than {limits.max_template_chars}")
    token = _BUDGET.set(_Budget(limits, limits.time_limit if seconds is None else seconds))
    try:
        template = _compile(source)
        parts, n = [], 0
        for chunk in template.generate(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                       bos_token=bos_token, eos_token=eos_token):
            n += len(chunk)
            if n > limits.max_output_chars:
                raise Refused(f"its output is longer than {limits.max_output_chars} characters")
            parts.append(chunk)
            _tick()
        return "".join(parts)
    except Raised as e:
        raise TemplateFailure("raised", str(e)) from None
    except TimeUp as e:
        raise TemplateFailure("timeout", str(e)) from None
    except Refused as e:
        raise TemplateFailure("refused", str(e)) from None
    except jinja2.exceptions.SecurityError as e:
        raise TemplateFailure("refused", f"it tries to reach Python internals ({e})") from None
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TemplateFailure("syntax", f"{e} (line {e.lineno})") from None
    except jinja2.exceptions.TemplateError as e:
        raise TemplateFailure("failed", f"{type(e).__name__}: {e}") from None
    except RecursionError:
        raise TemplateFailure("refused", "it recurses too deeply") from None
    except MemoryError:
        raise TemplateFailure("refused", "it runs out of memory") from None
    except Exception as e:
        raise TemplateFailure("failed", f"{type(e).__name__}: {e}") from None
    finally:
        _BUDGET.reset(token)
