"""Token sampling with llama.cpp's sampler chain (top-k -> top-p -> min-p -> temperature -> seeded draw)."""
from __future__ import annotations

import numpy as np

from .._native import kv as _kv
from .._native.sampler import NativeSampler
from ..config import SamplingParams
from ..core.context import Context
from ..errors import InvalidInputError


def add_sampling_stages(native: NativeSampler, p: SamplingParams, seed: int) -> None:
    """The drawing end of a llama.cpp sampler chain for ``p`` (after any logit bias and penalties):
    greedy, or top-k, top-p, min-p, temperature and a draw seeded with ``seed`` (taken modulo 2**32)."""
    if p.greedy:
        native.add_greedy()
        return
    if p.top_k > 0:
        native.add_top_k(p.top_k)
    if p.top_p < 1.0:
        native.add_top_p(p.top_p, 1)
    if p.min_p > 0.0:
        native.add_min_p(p.min_p, 1)
    native.add_temp(p.temperature)
    # llama.cpp reads seed 0xFFFFFFFF (LLAMA_DEFAULT_SEED) as "draw a random seed": that one value is
    # drawn with its neighbour's stream, so that every seed is reproducible
    native.add_dist(min(seed & 0xFFFFFFFF, 0xFFFFFFFE))


_SP = SamplingParams


class Sampler(_kv.CResource):
    """A llama.cpp sampler chain. ``temp <= 0`` means greedy (argmax); top-k, top-p, min-p and the
    temperature default to :class:`~pyllama_kv.config.SamplingParams`' values.

    ``sample(seq)`` draws the next token for ``seq`` from its next-token logits: those of its last
    decode, whenever that was (decoding other sequences in between does not matter), or freshly
    computed when the sequence changed since (see Sequence.logits). ``sample_logits(logits)`` draws
    from any float32 array of n_vocab logits. Each draw advances the chain's seeded generator, so a
    Sampler gives one reproducible stream of draws; use one per sequence for independent streams.
    """

    # the defaults are SamplingParams' (llama.cpp's common ones, min_p 0.05 included), but the seed on
    # purpose: a Sampler is one reproducible stream (seed 0), a request draws a random seed unless given
    def __init__(self, ctx, temp: float = _SP.temperature, top_k: int = _SP.top_k, top_p: float = _SP.top_p,
                 seed: int = 0, min_p: float = _SP.min_p):
        if not isinstance(ctx, Context):
            raise InvalidInputError(f"Sampler needs a pyllama_kv.Context, got {type(ctx).__name__}")
        ctx.check_open()
        if temp is None or top_k is None or top_p is None or min_p is None:
            raise InvalidInputError("temp, top_k, top_p and min_p must be numbers")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise InvalidInputError(f"seed must be an integer, got {type(seed).__name__}")
        # one validation of every value (SamplingParams); seeds are taken modulo 2**32
        if isinstance(temp, (int, float)) and not isinstance(temp, bool) and temp < 0:
            temp = 0.0   # any temp <= 0 is greedy
        self.params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                     seed=int(seed) & 0xFFFFFFFF)
        self._ctx = ctx
        self._n_vocab = ctx.model.n_vocab
        p = self.params
        self.temp, self.top_k, self.top_p, self.min_p, self.seed = p.temperature, p.top_k, p.top_p, p.min_p, p.seed
        native = NativeSampler(ctx.model.native_library, self._n_vocab)
        assert p.seed is not None   # always set above
        add_sampling_stages(native, p, p.seed)
        self._native = native

    _native: NativeSampler | None = None   # until built, and once closed

    @property
    def closed(self) -> bool:
        return self._native is None

    def sample(self, seq) -> int:
        """The next token for ``seq`` (see the class docstring)."""
        ctx = self._ctx
        with ctx.critical():
            ctx.check_open()
            if self._native is None:
                raise InvalidInputError("the sampler is closed")
            # the context's record, lent (it is the only writer; recomputed when the sequence changed)
            return self._draw(ctx.sequence_logits_lent(seq))

    def sample_logits(self, logits) -> int:
        """A token drawn from ``logits`` (n_vocab floats)."""
        try:
            raw = np.asarray(logits)
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"logits must be an array of numbers: {exc}") from None
        if raw.dtype.kind not in "fiu":
            raise InvalidInputError(f"logits must be real numbers, got {raw.dtype}")
        arr = raw.astype(np.float32, copy=False)
        if arr.shape != (self._n_vocab,):
            raise InvalidInputError(f"logits must have shape ({self._n_vocab},), got {arr.shape}")
        if not np.isfinite(arr).any():
            raise InvalidInputError("logits has no finite value")
        with self._ctx.critical():
            if self._native is None:
                raise InvalidInputError("the sampler is closed")
            return self._draw(arr)

    def _draw(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        native = self._native
        assert native is not None
        tok = native.apply(logits, self.top_k)
        if tok < 0:
            raise InvalidInputError("the sampler chain selected no token")
        native.accept(tok)
        return tok

    def close(self) -> None:
        """Free the sampler chain (waits for a sample() running on another thread)."""
        ctx = getattr(self, "_ctx", None)
        if ctx is None or getattr(self, "_native", None) is None:
            return
        with ctx.critical():
            native = self._native
            if native is not None:
                self._native = None
                native.free()
