"""Grammars are untrusted input: bounded before llguidance sees them, compiled first where a crash
cannot hurt, and refused in one sentence.

Three things can go wrong with a grammar a client sends (tried on llguidance 1.9):

- a long chain of rules (Lark, GBNF) or of ``$ref`` (JSON schema) overflows llguidance's native stack
  while it compiles: the process dies (SIGSEGV at ~2,500 chained ``$defs``, ~2,800 Lark rules);
- llama.cpp's GBNF is translated to Lark by llguidance's pure-Python converter, superlinear in the
  length of rule chains (6.5 s at 2,000), holding the GIL;
- a grammar that compiles may still be one that nothing can follow (``{"$ref": "#"}``,
  ``root ::= root``: ``NoExtensionBias``) or too complex for the lexer; llguidance's messages then
  carry its parser state and the grammar text.

So: :func:`check_bounds` measures a grammar in linear time with no recursion (its size, its number of
rules or schema nodes, and the longest chain of references and nesting) and refuses one past the
limits of :mod:`pyllama_kv.limits`, far below the crash points; :func:`translate` and :func:`probe`
run in a worker process (``pyllama_kv._worker``, the chat templates' sandbox: killed at a time
limit, under a memory limit; :func:`job` is its entry point) so that the first compilation of a
grammar, the one that could crash or run away, is never the server's; :func:`plain` words llguidance's
errors as one sentence with none of its internals.

Standard library (and llguidance, imported when needed) only: the worker imports this module.
"""
from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import unquote

from ..errors import InvalidInputError
from ..limits import GRAMMAR_MAX_CHARS, GRAMMAR_MAX_DEPTH, GRAMMAR_MAX_RULES

#: the raw grammar kinds (``json_schema`` and ``json_object`` are schemas)
SCHEMA_KINDS = ("json_schema", "json_object")


class GrammarRefused(InvalidInputError):
    """A grammar past a bound, or one llguidance refuses: the message is one sentence for a client
    (sampling.grammar raises it to callers as a GrammarError)."""


# -- bounds -----------------------------------------------------------------------------------------


def _longest_path(succ: list[list[int]], roots: list[int]) -> int:
    """The longest path (in vertices) from ``roots`` through the graph ``succ`` with the back edges of
    a depth-first search left out (a cycle is counted once); iterative, linear in the edges."""
    n = len(succ)
    state = [0] * n              # 0 unseen, 1 on the stack, 2 done
    depth = [0] * n
    best = 0
    for r in roots:
        if state[r]:
            continue
        stack = [(r, 0)]
        state[r] = 1
        while stack:
            v, i = stack[-1]
            edges = succ[v]
            if i < len(edges):
                stack[-1] = (v, i + 1)
                w = edges[i]
                if state[w] == 0:
                    state[w] = 1
                    stack.append((w, 0))
                continue
            stack.pop()
            d = 1
            for w in edges:
                if state[w] == 2 and depth[w] + 1 > d:
                    d = depth[w] + 1
            depth[v] = d
            state[v] = 2
            best = max(best, d)
    return best


def _check_counts(what: str, n_rules: int, depth: int) -> None:
    if n_rules > GRAMMAR_MAX_RULES:
        raise GrammarRefused(f"the {what} has {n_rules} rules; at most {GRAMMAR_MAX_RULES} are allowed")
    if depth > GRAMMAR_MAX_DEPTH:
        raise GrammarRefused(f"the {what} nests or chains its rules {depth} levels deep; at most "
                             f"{GRAMMAR_MAX_DEPTH} are allowed")


def _pointer(root: Any, frag: str) -> Any:
    """The value the JSON pointer ``frag`` (``/a/b``, already percent-decoded) names in ``root``, or None."""
    node = root
    for part in frag.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _resolver(schema: Any, nodes: list[Any]):
    """A function from a ``$ref`` (and the resource it is written in: the nearest schema with an
    ``$id``, else the root) to the schema it names in ``schema`` (None when it names none): local
    pointers (``#/$defs/a``, percent-encoded or not), ``$id``s (absolute or relative, matched whole or
    by their last segments) with a pointer or an ``$anchor`` after them."""
    ids: dict[str, Any] = {}
    for x in nodes:
        if isinstance(x, dict):
            if isinstance(x.get("$id"), str):
                ids.setdefault(x["$id"].rstrip("#"), x)
            if isinstance(x.get("$anchor"), str):
                ids.setdefault("#" + x["$anchor"], x)

    by_last: dict[str, list[str]] = {}   # an $id's last segment -> the $ids that end with it
    for k in ids:
        by_last.setdefault(k.rsplit("/", 1)[-1], []).append(k)

    def base_of(ref: str) -> Any:
        if ref == "":
            return schema
        if ref in ids:
            return ids[ref]
        for k in by_last.get(ref.rsplit("/", 1)[-1], ()):   # a relative $id or $ref against an absolute one
            if k.endswith("/" + ref) or ref.endswith("/" + k):
                return ids[k]
        return None

    def resolve(ref: str, within: Any = schema) -> Any:
        """``ref`` as written in a schema of the resource ``within`` (a ``#...`` ref is relative to it)."""
        ref = unquote(ref)
        if ref in ids:
            return ids[ref]
        base, _, frag = ref.partition("#")
        root = within if base == "" else base_of(base)
        if root is None or frag == "":
            return root
        return _pointer(root, frag) if frag.startswith("/") else ids.get("#" + frag)

    return resolve


def schema_bounds(schema: Any) -> None:
    """Refuse a JSON schema (already parsed) with more than GRAMMAR_MAX_RULES objects, or whose
    nesting and ``$ref`` chains together run deeper than GRAMMAR_MAX_DEPTH JSON levels (objects and
    arrays on the longest path, a ``$ref`` a step to its target)."""
    ids: dict[int, int] = {}
    nodes: list[Any] = []
    resource: list[Any] = []                       # each node's resource: the nearest schema with an $id
    todo: list[tuple[Any, Any]] = [(schema, schema)]
    while todo:                                    # every object and array, once
        x, res = todo.pop()
        if isinstance(x, (dict, list)) and id(x) not in ids:
            if isinstance(x, dict) and isinstance(x.get("$id"), str):
                res = x
            ids[id(x)] = len(nodes)
            nodes.append(x)
            resource.append(res)
            if len(nodes) > 4 * GRAMMAR_MAX_RULES:
                raise GrammarRefused(f"the schema has more than {4 * GRAMMAR_MAX_RULES} objects and arrays")
            todo.extend((k, res) for k in (x.values() if isinstance(x, dict) else x))
    resolve = _resolver(schema, nodes)
    succ: list[list[int]] = []
    for i, x in enumerate(nodes):
        kids = x.values() if isinstance(x, dict) else x
        edges = [ids[id(k)] for k in kids if isinstance(k, (dict, list))]
        ref = x.get("$ref") if isinstance(x, dict) else None
        if isinstance(ref, str):
            # a $ref it cannot follow is refused: it could not measure the chain behind it, and
            # llguidance fetches nothing from outside the schema either
            target = resolve(ref, resource[i])
            if not isinstance(target, (dict, list, bool)):
                shown = ref if len(ref) <= 60 else ref[:57] + "..."
                raise GrammarRefused(f"its $ref {shown!r} names no schema within it (only refs to its own "
                                     "definitions are supported)")
            if isinstance(target, (dict, list)):
                edges.append(ids[id(target)])
        succ.append(edges)
    n_schemas = sum(1 for x in nodes if isinstance(x, dict))
    _check_counts("schema", n_schemas, _longest_path(succ, [0]) if nodes else 0)


def _schema_text_bounds(text: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise GrammarRefused("the schema nests too deeply") from None
    except ValueError as e:
        raise GrammarRefused(f"the schema is not valid JSON: {e}") from None


_STRING = r'"(?:[^"\\\n]|\\.)*"'
# GBNF: strings, character classes and comments are skipped; a rule is ``name ::=``
_GBNF_TOKEN = re.compile(r"(" + _STRING + r"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*)"
                         r"|([A-Za-z_][A-Za-z0-9_-]*)\s*(::=)?|([()])|\S")
# Lark (llguidance's dialect): strings, /regex/flags, // comments and <[token ids]> / <|special|>
# references are skipped; %json/%regex/%lark take a {...} block; a rule is ``name:`` (``name[attrs].prio:``)
# at a line's start
_LARK_TOKEN = re.compile(
    r"(" + _STRING + r"|/(?![/*])(?:[^/\\\n]|\\.)+/[imslux]*|//[^\n]*|<\[[^\]]*\]>|<[^<>\s]*>)"
    r"|(%(?:json|regex|lark)\b)|([A-Za-z_][A-Za-z0-9_]*)|([(\[{])|([)\]}])|(\S)")
_LARK_DEFINE = re.compile(r"[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\[[^\]\n]*\])?(?:\.-?\d+)?[ \t]*:(?!:)")
_SPACE = re.compile(r"\s+")


def _json_block(text: str, i: int) -> int:
    """The end of the balanced ``{...}`` (JSON strings respected) that starts at or after ``i``."""
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    if i >= n or text[i] != "{":
        raise GrammarRefused("a %json, %regex or %lark directive must be followed by a {...} block")
    level, in_str, esc = 0, False, False
    for j in range(i, n):
        c = text[j]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == "{":
            level += 1
        elif c == "}":
            level -= 1
            if level == 0:
                return j + 1
    raise GrammarRefused("a %json, %regex or %lark block is not closed")


class _Rules:
    """The rule graph a scan builds: rule names, references from the current rule, nesting."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.succ: list[list[int]] = []
        self.current = -1
        self.nest = 0
        self.max_nest = 0

    def rule(self, name: str) -> int:
        i = self.index.get(name)
        if i is None:
            i = self.index[name] = len(self.succ)
            self.succ.append([])
            if len(self.succ) > GRAMMAR_MAX_RULES:
                raise GrammarRefused(f"the grammar has more than {GRAMMAR_MAX_RULES} rules")
        return i

    def define(self, name: str) -> None:
        self.current = self.rule(name)
        self.nest = 0

    def refer(self, name: str) -> None:
        j = self.rule(name)
        if self.current >= 0:
            self.succ[self.current].append(j)

    def open(self) -> None:
        self.nest += 1
        self.max_nest = max(self.max_nest, self.nest)

    def finish(self, what: str, start: str) -> None:
        roots = [self.index[start]] if start in self.index else []
        roots += range(len(self.succ))
        _check_counts(what, len(self.succ), max(_longest_path(self.succ, roots), self.max_nest))


def _lark_bounds(text: str, rules: _Rules | None = None) -> None:
    r = _Rules() if rules is None else rules
    pos, line_start, n = 0, True, len(text)
    while pos < n:
        sp = _SPACE.match(text, pos)
        if sp:
            line_start = line_start or "\n" in sp.group()
            pos = sp.end()
            continue
        if line_start:
            d = _LARK_DEFINE.match(text, pos)
            line_start = False
            if d:
                r.define(d.group(1))
                pos = d.end()
                continue
        m = _LARK_TOKEN.match(text, pos)
        assert m is not None   # its last alternative matches any non-space
        directive, name, opening, closing = m.group(2, 3, 4, 5)
        pos = m.end()
        if directive:
            end = _json_block(text, pos)
            block = text[pos:end]
            if directive == "%json":
                schema_bounds(_schema_text_bounds(block))
            elif directive == "%lark":
                _lark_bounds(block.strip()[1:-1], r)
            pos = end
        elif name:
            r.refer(name)
        elif opening:
            r.open()
        elif closing:
            r.nest = max(0, r.nest - 1)
    if rules is None:
        r.finish("grammar", "start")


def _gbnf_bounds(text: str) -> None:
    r = _Rules()
    for m in _GBNF_TOKEN.finditer(text):
        skip, name, defines, paren = m.group(1, 2, 3, 4)
        if skip:
            continue
        if name and defines:
            r.define(name)
        elif name:
            r.refer(name)
        elif paren == "(":
            r.open()
        elif paren == ")":
            r.nest = max(0, r.nest - 1)
    r.finish("grammar", "root")


def check_bounds(kind: str, source: str) -> None:
    """GrammarRefused when ``source`` (a grammar of ``kind``) is past a bound of pyllama_kv.limits:
    GRAMMAR_MAX_CHARS characters, GRAMMAR_MAX_RULES rules (or schema objects), GRAMMAR_MAX_DEPTH
    levels of chained references and nesting. Linear time, no recursion."""
    if len(source) > GRAMMAR_MAX_CHARS:
        raise GrammarRefused(f"it has {len(source)} characters; at most {GRAMMAR_MAX_CHARS} are allowed")
    if kind in SCHEMA_KINDS:
        schema_bounds(_schema_text_bounds(source))
    elif kind == "lark":
        _lark_bounds(source)
    elif kind == "gbnf":
        _gbnf_bounds(source)


def token_references(kind: str, source: str) -> list[int]:
    """The token ids a Lark grammar names (``<[5]>``, ``<[5-9,12]>``, ``<[^5]>``; both ends of a
    range), read as its scanner reads it: never inside a string, a regular expression or a comment."""
    if kind != "lark":
        return []
    out: list[int] = []
    pos, n = 0, len(source)
    while pos < n:
        sp = _SPACE.match(source, pos)
        if sp:
            pos = sp.end()
            continue
        m = _LARK_TOKEN.match(source, pos)
        assert m is not None
        pos = m.end()
        skip, directive = m.group(1, 2)
        if directive:
            end = _json_block(source, pos)
            if directive == "%lark":
                out += token_references("lark", source[pos:end].strip()[1:-1])
            pos = end
        elif skip and skip.startswith("<[") and skip.endswith("]>"):
            for part in skip[2:-2].lstrip("^").split(","):
                out += [int(e) for e in (x.strip() for x in part.split("-")) if e.isdigit()]
    return out


# -- llguidance, in the worker ---------------------------------------------------------------------------

# JSON as compact as OpenAI's structured outputs write it, so that a model cannot spend its tokens on
# whitespace (llguidance's default lets whitespace repeat without bound)
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def parser_limits() -> Any:
    """llguidance's limits with its verbose errors off (they carry the parser state and the grammar)."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def translate(kind: str, source: str) -> str:
    """The llguidance grammar for ``source`` (GrammarRefused when it cannot be translated)."""
    import llguidance as llg

    try:
        if kind in SCHEMA_KINDS:
            return llg.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(source)
        if kind == "gbnf":
            return llg.grammar_from("gbnf", source)
        return llg.LLMatcher.grammar_from_lark(source)
    except RecursionError:
        raise GrammarRefused("it nests too deeply") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise GrammarRefused(plain(str(exc), kind)) from None


#: llguidance's words for a grammar nothing can follow, and for one past its limits
_NEVER_ENDS = ("NoExtensionBias",)
_TOO_COMPLEX = ("LexerTooComplex", "too many expressions", "Too many items", "fuel", "max_grammar_size",
                "too many states", "lexer too complex", "grammar too large", "too deeply nested")


def limit_error(err: str) -> bool:
    """Whether llguidance's ``err`` says a parser or lexer limit was reached (not a wrong grammar)."""
    return any(w.lower() in err.lower() for w in _TOO_COMPLEX)


_POSITION = re.compile(r"^(?:at )?(\d+)\((\d+)\):\s*")
_GBNF_FAILED = "Failed to convert the grammar from GBNF to Lark:"


def plain(err: str, kind: str | None = None) -> str:
    """llguidance's error as one sentence: what is wrong (and, in a Lark grammar, where), never its
    parser state, its list of the model's special tokens or the grammar's text."""
    if any(w in err for w in _NEVER_ENDS):
        return "nothing can follow it: a rule or $ref refers to itself with no way to end"
    if limit_error(err):
        return "it is too complex for the grammar engine's limits (its lexer or parser ran out of room)"
    text = err.replace("<non-verbose/>", "").strip()
    if not text:
        return "it cannot be compiled"
    if "regex parse error" in text:   # the regex crate's report: the pattern, a caret, then "error: why"
        why = [ln.strip()[len("error:"):].strip() for ln in text.splitlines() if ln.strip().startswith("error:")]
        return "a regular expression in it does not parse" + (f": {why[0]}" if why else "")
    line = text.splitlines()[0]
    if line.startswith(_GBNF_FAILED):   # llguidance's converter echoes the grammar after the position
        line = "not valid GBNF: " + line[len(_GBNF_FAILED):].strip().split(", '")[0]
    where = ""
    m = _POSITION.match(line)
    if m:
        line = line[m.end():]
        if kind in (None, "lark"):    # (a GBNF grammar's positions are in its translation: not given)
            where = f"at line {m.group(1)}, column {m.group(2)}: "
    line = line.split("; following special tokens are available")[0]
    line = re.sub(r"\s*\(at [^()]*(?:\([^()]*\))?[^()]*\)", "", line)   # the lexeme it stopped at
    line = line.replace("lexer error", "it does not parse").replace("parser error:", "").strip() or "it does not parse"
    line = where + line
    return line if len(line) <= 200 else line[:197] + "..."


class _Vocab:
    """A vocabulary sent by the caller: tokens as latin-1 text (bytes), eos, special and bos ids."""

    def __init__(self, v: dict) -> None:
        self.tokens = [t.encode("latin-1") for t in v["tokens"]]
        self.eos_token_id = v["eos"][0] if v["eos"] else None
        self.bos_token_id = v.get("bos")
        self.special_token_ids = list(v["special"])
        self.eos = list(v["eos"])
        self._ids: dict[bytes, int] = {}
        for i, t in enumerate(self.tokens):
            if t and not t.startswith(b"\xff"):
                self._ids.setdefault(t, i)
        self._longest = max((len(t) for t in self._ids), default=1)
        self.fast: Any = None   # llguidance's own greedy tokenizer, once there is one

    def __call__(self, text: bytes) -> list[int]:
        """Greedy longest match: enough for checking a grammar (the caller's matcher uses the model's)."""
        if self.fast is not None:
            try:
                return self.fast(bytes(text).decode("utf-8"))
            except UnicodeDecodeError:
                pass
        out, i, n = [], 0, len(text)
        while i < n:
            for k in range(min(self._longest, n - i), 0, -1):
                t = self._ids.get(bytes(text[i:i + k]))
                if t is not None:
                    out.append(t)
                    i += k
                    break
            else:
                i += 1
        return out


_tokenizers: dict[str, Any] = {}


def probe(text: str, vocab_key: str, vocab: dict | None, kind: str | None = None) -> dict:
    """Compile the llguidance grammar ``text`` against the vocabulary ``vocab_key`` and compute its
    first mask: ``{}`` when a matcher can start, ``{"error": sentence}`` when not, ``{"need_vocab":
    True}`` when this worker has not been sent that vocabulary yet."""
    import llguidance as llg

    tok = _tokenizers.get(vocab_key)
    if tok is None:
        if vocab is None:
            return {"need_vocab": True}
        v = _Vocab(vocab)
        tok = llg.LLTokenizer(llg.TokenizerWrapper(v), n_vocab=len(v.tokens), eos_token=v.eos or None)
        v.fast = tok.greedy_tokenize   # (Rust: a forced run of a megabyte tokenizes in milliseconds)
        _tokenizers.clear()            # one vocabulary at a time: a server has one model
        _tokenizers[vocab_key] = tok
    limits = parser_limits()
    err = llg.LLMatcher.validate_grammar(text, tok, limits=limits)
    if err:
        return {"error": plain(err, kind)}
    m = llg.LLMatcher(tok, text, log_level=0, limits=limits)
    # the first mask, then the tokens the grammar forces and the mask after them (a schema's pattern
    # builds its lexer only after the forced '"'): a few steps, as far as nothing is left to choose
    for _ in range(PROBE_STEPS):
        if not m.is_error():
            m.compute_logit_bias()
        if m.is_error():
            break
        forced = m.compute_ff_tokens()
        if not forced or m.is_error():
            break
        m.consume_tokens(forced)
    if m.is_error() and not endless(m.get_error()):
        return {"error": plain(m.get_error(), kind)}
    return {}


#: steps of forced tokens :func:`probe` follows
PROBE_STEPS = 4


def endless(err: str) -> bool:
    """llguidance ran out of Earley items following forced tokens: a grammar that forces an endless
    run (``root ::= "a" root``). Generating it is fine: the output is cut with ``length``."""
    return "Too many items" in err and "ff_tokens" in err


def job(req: dict) -> dict:
    """The worker's grammar job: bounds, translation and, with a vocabulary, a probe. ``{"text":
    llguidance grammar}`` or ``{"error": sentence}`` (or ``{"need_vocab": True}``)."""
    try:
        check_bounds(req["kind"], req["source"])
        text = translate(req["kind"], req["source"])
        if req.get("vocab_key"):
            got = probe(text, req["vocab_key"], req.get("vocab"), req["kind"])
            if got:
                return got
        else:
            import llguidance as llg

            err = llg.LLMatcher.validate_grammar(text, limits=parser_limits())
            if err:
                return {"error": plain(err, req["kind"])}
        return {"text": text}
    except GrammarRefused as e:
        return {"error": str(e)}
    except RecursionError:
        return {"error": "it nests too deeply"}
