"""Admission: what a submission must be before the engine queues it.

:func:`admit` checks and normalises :meth:`Engine.submit`'s arguments into a :class:`Submission`
(token ids, defaults from the engine's config filled in, the prompt truncated to fit the context
when allowed, the grammar compiled for the model): every InvalidInputError (GrammarError included)
a caller can get from ``submit`` comes from here, before the request has a handle or an id. It
reads the engine only through :class:`Limits`, so it runs without a model (``model=None``: token
ids only) and is tested as a function. Truncation and the index bookkeeping it shares with the
scheduler's context shift (:func:`drop_range`) live here too.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import EngineConfig, SamplingParams, int_param
from ..errors import InvalidInputError
from ..limits import MAX_STOP_STRINGS, SPEC_MAX_DRAFT, prompt_too_long
from .request import Request, RequestHandle


@dataclass(frozen=True)
class Limits:
    """What an engine admits, read from it when a request is submitted."""

    config: EngineConfig     # the defaults (context_shift, truncate, n_keep, keep_finished) and max_tokens
    n_ctx: int               # cells of the context: a prompt must leave one for the first token
    parallel: int            # the most continuations a request may ask for
    n_vocab: int             # token ids (logit_bias) and grammars must fit it
    #: tokenizes text prompts, checks token ids and compiles Grammars; None: token ids only, checked
    #: as integers (an engine over a fake KVCache)
    model: Any = None
    #: whether sampling other than greedy is available (False: llama.cpp's samplers would be needed,
    #: and the KV cache has no context for them)
    can_sample: bool = True


@dataclass(frozen=True)
class Submission:
    """A submission as checked and normalised by :func:`admit`: what a :class:`Request` holds, less
    its handle."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    n: int
    keep: bool
    context_shift: bool
    n_keep: int
    boundaries: list[int] = field(default_factory=list)
    grammar: Any = None
    logprobs: int | None = None
    spec_max: int | None = None
    truncated: int = 0       # prompt tokens truncation dropped

    def request(self, handle: RequestHandle) -> Request:
        """The engine's Request for this submission, answered through ``handle``."""
        return Request(prompt=self.prompt, params=self.params, max_tokens=self.max_tokens, stop=self.stop, n=self.n,
                       handle=handle, keep=self.keep, context_shift=self.context_shift, n_keep=self.n_keep,
                       boundaries=self.boundaries, grammar=self.grammar, logprobs=self.logprobs,
                       spec_max=self.spec_max)


def admit(limits: Limits, prompt: Sequence[int] | str, params: SamplingParams | None = None, *,
          max_tokens: int = 256, stop: Iterable[str] | str = (), n: int = 1, keep: bool | None = None,
          context_shift: bool | None = None, n_keep: int | None = None, truncate: bool | None = None,
          boundaries: Iterable[int] | None = None, grammar=None, logprobs: int | None = None,
          spec_max: int | None = None) -> Submission:
    """``submit``'s arguments checked against ``limits`` (InvalidInputError, naming the argument) and
    normalised (see :meth:`Engine.submit` for their meaning). The checks run in a fixed order, so a
    submission with several faults is always refused for the same one."""
    cfg = limits.config
    params = params or SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidInputError("params must be a SamplingParams")
    toks = _prompt_tokens(limits, prompt)
    if (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
            or not 1 <= max_tokens <= cfg.max_tokens):
        raise InvalidInputError(f"max_tokens must be an integer in [1, {cfg.max_tokens}]")
    shift = cfg.context_shift if context_shift is None else context_shift
    trunc = cfg.truncate if truncate is None else truncate
    for name, v in (("context_shift", shift), ("truncate", trunc)):
        if not isinstance(v, bool):
            raise InvalidInputError(f"{name} must be a bool or None")
    keep_n = cfg.n_keep if n_keep is None else int_param("n_keep", n_keep, -1)
    keep_n = min(len(toks) if keep_n < 0 else keep_n, limits.n_ctx // 2)
    bounds = _boundaries(boundaries, len(toks))
    toks, bounds, truncated = _fit(limits.n_ctx, toks, bounds, keep_n, max_tokens, trunc)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= limits.parallel:
        raise InvalidInputError(f"n must be an integer in [1, {limits.parallel}] (the engine's parallel)")
    stops = _stops(stop)
    keep = cfg.keep_finished if keep is None else bool(keep)
    if grammar is not None:
        grammar = _compiled_grammar(limits, grammar)
    if logprobs is not None:
        logprobs = int_param("logprobs", logprobs, 0, 20)
    if spec_max is not None:
        spec_max = int_param("spec_max", spec_max, 0, SPEC_MAX_DRAFT)
    _check_sampling(limits, params)
    return Submission(prompt=toks, params=params, max_tokens=max_tokens, stop=stops, n=n, keep=keep,
                      context_shift=shift, n_keep=keep_n, boundaries=bounds, grammar=grammar, logprobs=logprobs,
                      spec_max=spec_max, truncated=truncated)


def _prompt_tokens(limits: Limits, prompt: Sequence[int] | str) -> list[int]:
    """The prompt's token ids (text is tokenized with BOS), checked against the model's vocabulary."""
    model = limits.model
    if isinstance(prompt, str):
        prompt = model.tokenize(prompt)
    toks = model.check_tokens(prompt).tolist() if model is not None else [int(t) for t in prompt]
    if not toks:
        raise InvalidInputError("the prompt is empty")
    return toks


def _fit(n_ctx: int, toks: list[int], bounds: list[int], n_keep: int, max_tokens: int,
         truncate: bool) -> tuple[list[int], list[int], int]:
    """A prompt that fits the context as it is, or (``truncate``) cut to leave room for the answer:
    (tokens, boundaries, tokens dropped). InvalidInputError when it does not fit and may not be cut."""
    too_long = prompt_too_long(len(toks), n_ctx)
    if not too_long:
        return toks, bounds, 0
    if not truncate:
        raise InvalidInputError(f"{too_long}: shorten it, use a larger context, or let the engine "
                                "truncate it (truncate=True)")
    room = max(1, min(max_tokens, (n_ctx - n_keep) // 2))
    return truncate_prompt(toks, n_ctx - room, n_keep, bounds)


def _stops(stop: Iterable[str] | str) -> tuple[str, ...]:
    """The stop strings as a tuple, empty ones dropped."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise InvalidInputError(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings")
    return tuple(s for s in stops if s)


def _compiled_grammar(limits: Limits, grammar):
    """``grammar`` compiled for the model (a Grammar needs the model; a CompiledGrammar must be one
    for this vocabulary); GrammarError otherwise."""
    from ..sampling.grammar import CompiledGrammar, Grammar, GrammarError, compile_grammar

    if isinstance(grammar, Grammar):
        if limits.model is None:
            raise GrammarError("a Grammar needs the engine's model: pass a CompiledGrammar")
        grammar = compile_grammar(limits.model, grammar)
    elif not isinstance(grammar, CompiledGrammar):
        raise GrammarError(f"grammar must be a Grammar or a CompiledGrammar, got {type(grammar).__name__}")
    if grammar.n_vocab != limits.n_vocab:
        raise GrammarError(f"the grammar was compiled for {grammar.n_vocab} tokens; "
                           f"the model has {limits.n_vocab}")
    return grammar


def _check_sampling(limits: Limits, params: SamplingParams) -> None:
    """Whether the engine can sample as ``params`` asks, with logit_bias tokens in its vocabulary."""
    if not limits.can_sample and (params.penalized or not params.greedy):
        raise InvalidInputError("sampling other than greedy needs llama.cpp's samplers, which need a KV cache "
                                "over a context: pass sampler_factory to an engine over another KVCache")
    for t, _ in params.logit_bias:
        if t >= limits.n_vocab:
            raise InvalidInputError(f"logit_bias token {t} is out of range [0, {limits.n_vocab})")


# -- truncation and shifting: index bookkeeping -----------------------------------------------------


def _boundaries(boundaries: Iterable[int] | None, n: int) -> list[int]:
    """The caller's turn boundaries as sorted, distinct indices inside (0, n); InvalidInputError for
    anything but integers."""
    if boundaries is None:
        return []
    out = set()
    for b in boundaries:
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
            raise InvalidInputError(f"boundaries must be token indices (integers), got {b!r}")
        if 0 < int(b) < n:
            out.add(int(b))
    return sorted(out)


def drop_range(boundaries: list[int], lo: int, hi: int) -> list[int]:
    """``boundaries`` after the tokens [lo, hi) were dropped (those inside the range go)."""
    d = hi - lo
    return sorted({b if b <= lo else b - d for b in boundaries if b <= lo or b >= hi})


def truncate_prompt(tokens: list[int], target: int, n_keep: int,
                    boundaries: Sequence[int] = ()) -> tuple[list[int], list[int], int]:
    """``tokens`` cut to at most ``target`` tokens: the first ``n_keep`` stay, and the oldest tokens
    after them are dropped, up to the first of the ``boundaries`` (turn starts) that drops enough, so
    that a turn is not split; exactly enough when no boundary is in reach (the last turn alone is too
    long). Returns (tokens, boundaries re-indexed, tokens dropped)."""
    need = len(tokens) - target
    if need <= 0:
        return list(tokens), list(boundaries), 0
    n_keep = max(0, min(n_keep, target - 1))
    end = n_keep + need
    at_turn = [b for b in boundaries if end <= b < len(tokens)]
    if at_turn:
        end = min(at_turn)
    return tokens[:n_keep] + tokens[end:], drop_range(list(boundaries), n_keep, end), end - n_keep
