"""Constrained decoding: a grammar per continuation, enforced by masking its logits (llguidance).

A :class:`Grammar` says what the output must be: a JSON schema (OpenAI's ``response_format``
``json_schema``), any JSON object (``json_object``), or a raw grammar as an extension: Lark (and
llama.cpp's GBNF, which llguidance converts) or a regular expression. It is compiled against a
model's vocabulary into a :class:`CompiledGrammar` (a schema or grammar llguidance cannot compile
is an :class:`GrammarError` naming the problem), which hands every continuation its own
:class:`Constraint`: the matcher state of that one token stream.

The tokenizer llguidance needs (the bytes of every token, the end-of-generation and special ids) is
built from the :class:`~pyllama_kv.Model`'s own vocabulary, once per model (:func:`tokenizer_for`),
not from a Hugging Face tokenizer: any GGUF works.

The engine uses a Constraint thus (``pyllama_kv.engine``): :meth:`Constraint.mask` the logits before
the sampler (tokens the grammar does not allow become ``-inf``; a copy, since forks share logits),
draw, :meth:`Constraint.accept` the token. The continuation ends ``stop`` when the grammar is
complete (nothing more can follow), ``eos`` when the model ends it where the grammar allows, and
``length`` at ``max_tokens`` when the grammar never completes. A preempted continuation replays its
tokens into a fresh state when it resumes (:meth:`Constraint.replay`).
"""
from __future__ import annotations

import json
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidInputError

#: grammar kinds: "json_schema" (a schema), "json_object" (any JSON object), "lark", "gbnf", "regex"
KINDS = ("json_schema", "json_object", "lark", "gbnf", "regex")

# JSON as compact as OpenAI's structured outputs write it, so that a model cannot spend its tokens on
# whitespace (llguidance's default lets whitespace repeat without bound)
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


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

    @classmethod
    def json_schema(cls, schema: dict | str | bool) -> Grammar:
        """Output that is JSON valid against ``schema`` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("a JSON schema must be an object")
        return cls("json_schema", json.dumps(schema))

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

    def llguidance(self) -> str:
        """The llguidance grammar definition (GrammarError when it cannot even be translated)."""
        llg = _llg()
        try:
            if self.kind in ("json_schema", "json_object"):
                return llg.LLMatcher.grammar_from_json_schema(self.source, defaults=_JSON_OPTIONS)
            if self.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(self.source)
            if self.kind == "gbnf":
                return llg.grammar_from("gbnf", self.source)
            return llg.LLMatcher.grammar_from_lark(self.source)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"invalid {self.kind.replace('_', ' ')}: {exc}") from None


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
        return tok


# -- compiled grammars and per-continuation state ----------------------------------------------------


class CompiledGrammar:
    """A grammar compiled against one tokenizer; :meth:`constraint` gives each continuation its own
    matcher (a copy of a fresh one: the grammar is compiled once)."""

    def __init__(self, grammar: Grammar, tokenizer, n_vocab: int):
        llg = _llg()
        self.grammar = grammar
        self.n_vocab = n_vocab
        text = grammar.llguidance()
        err = llg.LLMatcher.validate_grammar(text, tokenizer)
        if err:
            raise GrammarError(f"invalid {grammar.kind.replace('_', ' ')}: {err}")
        m = llg.LLMatcher(tokenizer, text, log_level=0)
        if m.is_error():
            raise GrammarError(f"invalid {grammar.kind.replace('_', ' ')}: {m.get_error()}")
        self._proto = m

    def constraint(self) -> Constraint:
        return Constraint(self._proto.deep_copy(), self.n_vocab)


def compile_grammar(model, grammar: Grammar) -> CompiledGrammar:
    """``grammar`` compiled for ``model`` (GrammarError naming the problem)."""
    if not isinstance(grammar, Grammar):
        raise GrammarError(f"grammar must be a pyllama_kv.constrain.Grammar, got {type(grammar).__name__}")
    return CompiledGrammar(grammar, tokenizer_for(model), model.n_vocab)


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
        """Advance by ``token``; False when the grammar does not allow it (the matcher is broken)."""
        self.tokens.append(int(token))
        return bool(self._m.consume_token(int(token)))

    @property
    def done(self) -> bool:
        """No more tokens can follow (the grammar is complete, or the matcher broke)."""
        return bool(self._m.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None if self._m.is_error() else None

    def replay(self) -> None:
        """Rebuild the state from a fresh matcher and the tokens accepted so far (after preemption)."""
        toks = self.tokens
        self._m = self._fresh.deep_copy()
        self.tokens = []
        for t in toks:
            self.accept(t)
