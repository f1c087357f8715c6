"""Penalties and logit bias through llama.cpp's sampler chain.

:class:`PenalizedSampler` is a :class:`~pyllama_kv.sampling.sampler.Sampler` whose chain starts, as
llama.cpp's common sampler does, with ``llama_sampler_init_logit_bias`` and
``llama_sampler_init_penalties`` (frequency, presence and repeat penalties over the last
``penalty_last_n`` accepted tokens), then top-k, top-p, min-p, temperature and the seeded draw (or
greedy). Every drawn token is accepted into the chain, so the penalties count the continuation's own
tokens (the prompt is not counted: OpenAI's penalties are about the generated text).

The chain sees the whole vocabulary (no top-k prefilter): a penalty or a bias can move a token into
or out of the top k.
"""
from __future__ import annotations

import numpy as np

from .._native.sampler import NativeSampler
from ..config import SamplingParams
from ..errors import InvalidInputError
from .sampler import Sampler, add_sampling_stages


def build_chain(lib, n_vocab: int, p: SamplingParams, seed: int, last_n: int) -> NativeSampler:
    """logit bias -> penalties -> (greedy | top-k -> top-p -> min-p -> temp -> dist)."""
    native = NativeSampler(lib, n_vocab)
    if p.logit_bias:
        bias: dict[int, float] = {}
        for tok, b in p.logit_bias:
            if tok >= n_vocab:
                raise InvalidInputError(f"logit_bias token {tok} is out of range [0, {n_vocab})")
            bias[tok] = bias.get(tok, 0.0) + b
        native.add_logit_bias(bias)
    if p.frequency_penalty or p.presence_penalty or p.repeat_penalty != 1.0:
        native.add_penalties(last_n, p.repeat_penalty, p.frequency_penalty, p.presence_penalty)
    add_sampling_stages(native, p, seed)
    return native


class PenalizedSampler(Sampler):
    """A Sampler with ``params``' logit bias and penalties at the head of its chain (see the module
    docstring). ``last_n``: the tokens the penalties look back over (the answer's length, say)."""

    def __init__(self, ctx, params: SamplingParams, seed: int = 0, last_n: int = 64):
        super().__init__(ctx, temp=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed,
                         min_p=params.min_p)
        if params.penalty_last_n >= 0:
            last_n = params.penalty_last_n
        plain = self._native
        self._native = None
        if plain is not None:
            plain.free()
        self.params = params
        self._native = build_chain(ctx.model.native_library, self._n_vocab, params, seed, max(0, int(last_n)))

    def _draw(self, logits: np.ndarray) -> int:
        native = self._native
        assert native is not None
        tok = native.apply(logits, 0)
        if tok < 0:
            raise InvalidInputError("the sampler chain selected no token")
        native.accept(tok)
        return tok
