"""Constrained decoding: a grammar per continuation, enforced by masking its logits (llguidance).

A :class:`Grammar` says what the output must be: a JSON schema (OpenAI's ``response_format``
``json_schema``), any JSON object (``json_object``), or a raw grammar as an extension: Lark (and
llama.cpp's GBNF, which llguidance converts) or a regular expression. It is compiled against a
model's vocabulary into a :class:`CompiledGrammar` (a schema or grammar llguidance cannot compile
is an :class:`GrammarError` naming the problem in one sentence), which hands every continuation its
own :class:`Constraint`: the matcher state of that one token stream.

A grammar is untrusted input (pyllama_kv.sampling.grammar_check): a Grammar past the bounds of
pyllama_kv.limits (GRAMMAR_MAX_CHARS, GRAMMAR_MAX_RULES, GRAMMAR_MAX_DEPTH) is refused when it is
built, before llguidance sees it; :func:`compile_grammar` compiles it first in a worker process (killed
past GRAMMAR_TIME_LIMIT, under GRAMMAR_MEMORY_LIMIT, cancellable), where a crash or a runaway of
llguidance cannot take the caller, and checks that a matcher can start (a grammar nothing can
follow, such as ``{"$ref": "#"}``, is refused there); only then is it compiled in this process.

The tokenizer llguidance needs (the bytes of every token, the end-of-generation and special ids) is
built from the :class:`~pyllama_kv.Model`'s own vocabulary, once per model (:func:`tokenizer_for`),
not from a Hugging Face tokenizer: any GGUF works.

The engine uses a Constraint thus (``pyllama_kv.engine``): :meth:`Constraint.mask` the logits before
the sampler (tokens the grammar does not allow become ``-inf``; a copy, since forks share logits),
draw, :meth:`Constraint.accept` the token. The continuation ends ``stop`` when the grammar is
complete (nothing more can follow), ``eos`` when the model ends it where the grammar allows, and
``length`` at ``max_tokens`` when the grammar never completes, or earlier where it forces an endless
run (:attr:`Constraint.at_limit`: GBNF ``root ::= "a" root``, where llguidance runs out of Earley items
following the forced tokens). A grammar that breaks otherwise while generating (too complex for
llguidance's per-token limits past a free choice) ends the continuation with an error (the server
answers a 400, or an SSE error event once streaming, naming the grammar's field). A preempted continuation replays its
tokens into a fresh state when it resumes (:meth:`Constraint.replay`).
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _worker as _template_worker
from ..errors import InvalidInputError
from ..limits import GRAMMAR_MEMORY_LIMIT, GRAMMAR_TIME_LIMIT
from . import grammar_check as _grammar_check
from .grammar_check import GrammarRefused

#: grammar kinds: "json_schema" (a schema), "json_object" (any JSON object), "lark", "gbnf", "regex"
KINDS = ("json_schema", "json_object", "lark", "gbnf", "regex")


class GrammarError(InvalidInputError):
    """A grammar or schema that cannot be compiled (the message names the problem)."""


def _llg():
    try:
        import llguidance
    except ImportError as exc:   # pragma: no cover - the server extra installs it
        raise GrammarError("constrained decoding needs the llguidance package (pip install 'pyllama-kv[server]')") \
            from exc
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a continuation's output must match. Build with the class methods."""

    kind: str
    source: str          # the schema as JSON text, or the grammar / regex text

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(self.source, str):
            raise GrammarError("a grammar's source must be a string")
        try:
            _grammar_check.check_bounds(self.kind, self.source)
        except GrammarRefused as e:
            raise GrammarError(f"invalid {self.kind.replace('_', ' ')}: {e}") from None

    @classmethod
    def json_schema(cls, schema: dict | str | bool) -> Grammar:
        """Output that is JSON valid against ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except RecursionError:
                raise GrammarError("invalid json schema: the schema nests too deeply") from None
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object")
        if schema is False:
            raise GrammarError("invalid json schema: the schema false allows no value at all")
        if schema is True:   # any JSON value: the empty schema says the same
            schema = {}
        try:
            text = json.dumps(schema)
        except RecursionError:
            raise GrammarError("invalid json schema: the schema nests too deeply") from None
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"invalid json schema: {exc}") from None
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's ``json_object`` mode)."""
        return cls("json_object", '{"type": "object"}')

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """A Lark grammar (llguidance's dialect; ``start`` is the start rule)."""
        return cls("lark", text)

    @classmethod
    def gbnf(cls, text: str) -> Grammar:
        """A llama.cpp GBNF grammar (``root`` is the start rule)."""
        return cls("gbnf", text)

    @classmethod
    def regex(cls, text: str) -> Grammar:
        """Output that matches a regular expression (Rust regex syntax)."""
        return cls("regex", text)

    @classmethod
    def from_file(cls, path, kind: str | None = None) -> Grammar:
        """A grammar file: ``.json`` is a JSON schema, ``.gbnf`` GBNF, ``.lark`` Lark, ``.regex`` a
        regular expression (or say which with ``kind``)."""
        from pathlib import Path

        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise GrammarError(f"cannot read the grammar file {str(p)!r}: {exc}") from None
        if kind is None:
            kind = {".json": "json_schema", ".gbnf": "gbnf", ".lark": "lark", ".regex": "regex"}.get(p.suffix.lower())
            if kind is None:
                # a GBNF grammar defines ``root ::=``; anything else is taken as Lark
                kind = "gbnf" if "::=" in text else "lark"
        if kind == "json_schema":
            return cls.json_schema(text)
        return cls(kind, text)

    @property
    def what(self) -> str:
        """The grammar's kind in words ("json schema", "gbnf", ...)."""
        return self.kind.replace("_", " ")

    def llguidance(self) -> str:
        """The llguidance grammar definition, translated in this process (GrammarError when it cannot
        be translated); :func:`compile_grammar` translates in a worker instead."""
        _llg()
        try:
            return _grammar_check.translate(self.kind, self.source)
        except GrammarRefused as exc:
            raise GrammarError(f"invalid {self.what}: {exc}") from None


# -- the tokenizer, once per model -----------------------------------------------------------------


@dataclass
class VocabInfo:
    """What llguidance needs of a vocabulary: every token's bytes (special tokens marked with a 0xff
    prefix, as llguidance expects), the end-of-generation ids and the special ids."""

    tokens: list[bytes]
    eos_ids: list[int]
    special_ids: list[int]
    bos: int | None


def vocab_info(model) -> VocabInfo:
    """Read ``model``'s vocabulary: a control token renders empty as text and as its name with
    ``special=True`` (llama.cpp's rule), so that is what marks it special."""
    tokens: list[bytes] = []
    special: list[int] = []
    eos: list[int] = []
    piece = model.token_to_piece
    for t in range(model.n_vocab):
        b = piece(t)
        if not b:
            s = piece(t, special=True)
            if s:
                special.append(t)
                tokens.append(b"\xff" + s)
                if model.is_eog(t):
                    eos.append(t)
                continue
        tokens.append(b)
    if model.eos >= 0 and model.eos not in eos:
        eos.insert(0, model.eos)
    elif model.eos in eos:   # the model's own EOS first: llguidance's main EOS
        eos.remove(model.eos)
        eos.insert(0, model.eos)
    return VocabInfo(tokens, eos, special, model.bos if model.bos >= 0 else None)


class _Wrapped:
    """The object llguidance's TokenizerWrapper reads (token bytes, EOS/BOS/special ids, a tokenize call)."""

    def __init__(self, info: VocabInfo, tokenize):
        self.eos_token_id = info.eos_ids[0] if info.eos_ids else None
        self.bos_token_id = info.bos
        self.tokens = info.tokens
        self.special_token_ids = info.special_ids
        self._tokenize = tokenize

    def __call__(self, text) -> list[int]:
        return self._tokenize(text.encode("utf-8") if isinstance(text, str) else bytes(text))


_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_vocabs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> (key, the worker's payload)
_tok_lock = threading.Lock()
#: seconds the last tokenizer build took (read by scripts/bench_constrained.py)
last_build_seconds = 0.0


def build_tokenizer(info: VocabInfo, tokenize) -> Any:
    """An llguidance LLTokenizer from a vocabulary (``tokenize``: bytes -> token ids, no BOS)."""
    llg = _llg()
    wrapped = llg.TokenizerWrapper(_Wrapped(info, tokenize))
    return llg.LLTokenizer(wrapped, n_vocab=len(info.tokens), eos_token=info.eos_ids or None)


def tokenizer_for(model) -> Any:
    """``model``'s llguidance tokenizer, built on first use and kept while the model lives."""
    global last_build_seconds
    with _tok_lock:
        tok = _tokenizers.get(model)
        if tok is None:
            t0 = time.perf_counter()
            info = vocab_info(model)
            tok = build_tokenizer(info, lambda text: model.tokenize(text, add_bos=False, special=False))
            last_build_seconds = time.perf_counter() - t0
            _tokenizers[model] = tok
            payload = {"tokens": [t.decode("latin-1") for t in info.tokens], "eos": info.eos_ids,
                       "special": info.special_ids, "bos": info.bos}
            key = hashlib.sha256(json.dumps(payload).encode("ascii")).hexdigest()
            _vocabs[model] = (key, payload)
        return tok


def _worker_vocab(model) -> tuple[str, dict]:
    """The vocabulary as a grammar worker takes it (built with the tokenizer), and its key."""
    tokenizer_for(model)
    with _tok_lock:
        return _vocabs[model]


# -- compiled grammars and per-continuation state ----------------------------------------------------


class CompiledGrammar:
    """A grammar compiled against one tokenizer; :meth:`constraint` gives each continuation its own
    matcher (a copy of a fresh one: the grammar is compiled once)."""

    def __init__(self, grammar: Grammar, tokenizer, n_vocab: int, text: str | None = None):
        """``text``: the llguidance grammar a worker translated and checked (:func:`compile_grammar`);
        without it the grammar is translated and checked here."""
        llg = _llg()
        self.grammar = grammar
        self.n_vocab = n_vocab
        limits = _grammar_check.parser_limits()
        if text is None:
            text = grammar.llguidance()
            err = llg.LLMatcher.validate_grammar(text, tokenizer, limits=limits)
            if err:
                raise GrammarError(f"invalid {grammar.what}: {_grammar_check.plain(err, grammar.kind)}")
        m = llg.LLMatcher(tokenizer, text, log_level=0, limits=limits)
        if m.is_error():
            raise GrammarError(f"invalid {grammar.what}: {_grammar_check.plain(m.get_error(), grammar.kind)}")
        self._proto = m

    def constraint(self) -> Constraint:
        return Constraint(self._proto.deep_copy(), self.n_vocab)


def check_in_worker(model, grammar: Grammar, cancel: threading.Event | None = None) -> str:
    """Translate ``grammar`` and check that a matcher for ``model``'s vocabulary can start, in a grammar
    worker process (pyllama_kv._worker): the llguidance grammar text, or GrammarError in one
    sentence (past GRAMMAR_TIME_LIMIT seconds, out of GRAMMAR_MEMORY_LIMIT bytes, or crashed included).
    ``cancel``: set it to give up (the worker is killed; raises ``_template_worker.Cancelled``)."""
    key, payload = _worker_vocab(model)
    req: dict = {"kind": grammar.kind, "source": grammar.source, "vocab_key": key}
    resp = _template_worker.grammar_job(req, GRAMMAR_TIME_LIMIT, GRAMMAR_MEMORY_LIMIT, cancel=cancel)
    if resp.get("need_vocab"):   # a worker new to this vocabulary: once per worker
        req["vocab"] = payload
        resp = _template_worker.grammar_job(req, GRAMMAR_TIME_LIMIT, GRAMMAR_MEMORY_LIMIT, cancel=cancel)
    if isinstance(resp.get("text"), str):
        return resp["text"]
    raise GrammarError(f"invalid {grammar.what}: {resp.get('error') or 'it cannot be compiled'}")


def compile_grammar(model, grammar: Grammar, *, isolate: bool = True,
                    cancel: threading.Event | None = None) -> CompiledGrammar:
    """``grammar`` compiled for ``model`` (GrammarError naming the problem in one sentence). Token ids
    the grammar names are checked against the vocabulary (:meth:`Model.check_tokens`). With
    ``isolate`` (the default) it is first compiled in a worker process (:func:`check_in_worker`), so
    that a grammar that crashes or stalls llguidance costs a worker, not this process."""
    if not isinstance(grammar, Grammar):
        raise GrammarError(f"grammar must be a pyllama_kv.sampling.grammar.Grammar, got {type(grammar).__name__}")
    refs = _grammar_check.token_references(grammar.kind, grammar.source)
    if refs:
        try:
            model.check_tokens(refs, "grammar token")
        except InvalidInputError as e:
            raise GrammarError(f"invalid {grammar.what}: {e}") from None
    text = check_in_worker(model, grammar, cancel) if isolate else None
    return CompiledGrammar(grammar, tokenizer_for(model), model.n_vocab, text)


class GrammarCache:
    """Grammars for one model, by kind and text, as a server sees them again and again (agents send
    the same schema and tools with every request): compiled grammars (the last ``entries``), and the
    verdicts of grammars only checked (``verdicts``: a tool's parameters), refusals included, so that a
    hostile grammar costs a worker's time once. One compilation of a grammar at a time: a caller that
    asks for a grammar being compiled waits for that one (``cancel`` still gives up). Thread-safe."""

    def __init__(self, model, entries: int = 64, verdicts: int = 4096):
        self.model = model
        self.entries, self.max_verdicts = entries, verdicts
        self._compiled: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._verdicts: OrderedDict[tuple[str, str], GrammarError | None] = OrderedDict()
        self._busy: dict[tuple[str, str], threading.Event] = {}
        self._lock = threading.Lock()

    def peek(self, grammar: Grammar, compiled: bool = True) -> CompiledGrammar | GrammarError | bool | None:
        """What the cache knows without work: the compiled grammar (``compiled``) or True (a checked
        one), the refusal (a GrammarError), or None."""
        key = (grammar.kind, grammar.source)
        with self._lock:
            if key in self._verdicts and self._verdicts[key] is not None:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
            if compiled:
                hit = self._compiled.get(key)
                if hit is not None:
                    self._compiled.move_to_end(key)
                return hit
            if key in self._verdicts or key in self._compiled:
                return True
            return None

    def _once(self, grammar: Grammar, compiled: bool, cancel: threading.Event | None):
        key = (grammar.kind, grammar.source)
        while True:
            hit = self.peek(grammar, compiled)
            if isinstance(hit, GrammarError):
                raise hit
            if hit is not None:
                return hit
            with self._lock:
                busy = self._busy.get(key)
                if busy is None:
                    self._busy[key] = threading.Event()
                    break
            while not busy.wait(0.05):   # another thread compiles it: wait for its verdict
                if cancel is not None and cancel.is_set():
                    raise _template_worker.Cancelled
        try:
            result: CompiledGrammar | GrammarError | None
            try:
                if compiled:
                    result = compile_grammar(self.model, grammar, cancel=cancel)
                else:
                    check_in_worker(self.model, grammar, cancel)
                    result = None
            except GrammarError as e:
                result = e
            with self._lock:
                self._verdicts[key] = result if isinstance(result, GrammarError) else None
                while len(self._verdicts) > self.max_verdicts:
                    self._verdicts.popitem(last=False)
                if isinstance(result, CompiledGrammar):
                    self._compiled[key] = result
                    while len(self._compiled) > self.entries:
                        self._compiled.popitem(last=False)
        finally:
            with self._lock:
                self._busy.pop(key).set()
        if isinstance(result, GrammarError):
            raise result
        return result if compiled else True

    def compile(self, grammar: Grammar, cancel: threading.Event | None = None) -> CompiledGrammar:
        """``grammar`` compiled (:func:`compile_grammar`), from the cache when it is there; GrammarError."""
        return self._once(grammar, True, cancel)

    def check(self, grammar: Grammar, cancel: threading.Event | None = None) -> None:
        """GrammarError unless ``grammar`` compiles (checked in a worker, :func:`check_in_worker`)."""
        self._once(grammar, False, cancel)


class Constraint:
    """One continuation's matcher: mask its logits, accept its tokens."""

    def __init__(self, matcher, n_vocab: int):
        self._m = matcher
        self._fresh = matcher.deep_copy()
        self.n_vocab = n_vocab
        self.tokens: list[int] = []     # accepted so far (replayed on resume)
        words = (n_vocab + 31) // 32
        self._bits = np.zeros(words, dtype=np.int32)
        self.mask_seconds = 0.0         # time spent computing masks (benchmarks)
        self.masks = 0

    def allowed(self) -> np.ndarray:
        """A bool array of n_vocab: the tokens the grammar allows next."""
        t0 = time.perf_counter()
        b = self._bits
        self._m.unsafe_compute_mask_ptr(b.ctypes.data, b.nbytes)
        out = np.unpackbits(b.view(np.uint8), bitorder="little")[:self.n_vocab].view(bool)
        self.mask_seconds += time.perf_counter() - t0
        self.masks += 1
        return out

    def mask(self, logits: np.ndarray) -> np.ndarray | None:
        """A copy of ``logits`` with the disallowed tokens at -inf; None when the grammar allows no
        token at all (it is complete, or broken: see :attr:`error`)."""
        ok = self.allowed()
        if not ok.any() or self._m.is_error():
            return None
        return np.where(ok, np.asarray(logits, dtype=np.float32), np.float32(-np.inf))

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False when the grammar does not allow it or the parser reached its
        limits (:attr:`at_limit`): the matcher is broken either way."""
        self.tokens.append(int(token))
        return bool(self._m.consume_token(int(token)))

    @property
    def at_limit(self) -> bool:
        """The matcher broke following the tokens an endless grammar forces (``root ::= "a" root``:
        llguidance runs out of Earley items), not on a disallowed token or a grammar too complex to go
        on: the output so far is cut there as at ``max_tokens``. Any other break is an error."""
        return bool(self._m.is_error()) and _grammar_check.endless(self._m.get_error())

    @property
    def done(self) -> bool:
        """No more tokens can follow (the grammar is complete, or the matcher broke)."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        """Why the matcher broke, in one sentence (none of llguidance's internals), or None."""
        return _grammar_check.plain(self._m.get_error()) if self._m.is_error() else None

    def replay(self) -> None:
        """Rebuild the state from a fresh matcher and the tokens accepted so far (after preemption)."""
        toks = self.tokens
        self._m = self._fresh.deep_copy()
        self.tokens = []
        for t in toks:
            self.accept(t)
