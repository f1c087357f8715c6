"""Token sampling with llama.cpp's sampler chain (top-k -> top-p -> min-p -> temperature -> seeded draw)."""
from __future__ import annotations

import numpy as np

from ._native import ffi as _ffi
from .config import SamplingParams
from .errors import InvalidInputError

ffi = _ffi.ffi


class Sampler(_ffi.CResource):
    """A llama.cpp sampler chain. ``temp <= 0`` means greedy (argmax).

    ``sample(seq)`` draws the next token for ``seq`` from its next-token logits: those of its last
    decode, whenever that was (decoding other sequences in between does not matter), or freshly
    computed when the sequence changed since (see Sequence.logits). ``sample_logits(logits)`` draws
    from any float32 array of n_vocab logits. Each draw advances the chain's seeded generator, so a
    Sampler gives one reproducible stream of draws; use one per sequence for independent streams.
    """

    def __init__(self, ctx, temp: float = 0.8, top_k: int = 40, top_p: float = 0.95, seed: int = 0,
                 min_p: float = 0.0):
        from .context import Context

        if not isinstance(ctx, Context):
            raise InvalidInputError(f"Sampler needs a pyllama_kv.Context, got {type(ctx).__name__}")
        ctx._check_open()
        if temp is None or top_k is None or top_p is None or min_p is None:
            raise InvalidInputError("temp, top_k, top_p and min_p must be numbers")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise InvalidInputError(f"seed must be an integer, got {type(seed).__name__}")
        self._ptr = None
        # one validation of every value (SamplingParams); seeds are taken modulo 2**32
        if isinstance(temp, (int, float)) and not isinstance(temp, bool) and temp < 0:
            temp = 0.0   # any temp <= 0 is greedy
        self.params = SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                                     seed=int(seed) & 0xFFFFFFFF)
        self._ctx = ctx
        self._n_vocab = ctx.model.n_vocab
        L = self._L = ctx._L
        p = self.params
        self.temp, self.top_k, self.top_p, self.min_p, self.seed = p.temperature, p.top_k, p.top_p, p.min_p, p.seed
        ptr = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if p.greedy:
            L.llama_sampler_chain_add(ptr, L.llama_sampler_init_greedy())
        else:
            if p.top_k > 0:
                L.llama_sampler_chain_add(ptr, L.llama_sampler_init_top_k(p.top_k))
            if p.top_p < 1.0:
                L.llama_sampler_chain_add(ptr, L.llama_sampler_init_top_p(p.top_p, 1))
            if p.min_p > 0.0:
                L.llama_sampler_chain_add(ptr, L.llama_sampler_init_min_p(p.min_p, 1))
            L.llama_sampler_chain_add(ptr, L.llama_sampler_init_temp(p.temperature))
            L.llama_sampler_chain_add(ptr, L.llama_sampler_init_dist(p.seed))
        self._ptr = ptr
        # the candidate array, reused: {id, logit, p} per token, ids filled once
        n = self._n_vocab
        self._cand = ffi.new("llama_token_data[]", n)
        self._cand_np = np.frombuffer(ffi.buffer(self._cand), dtype=np.dtype(
            [("id", np.int32), ("logit", np.float32), ("p", np.float32)]))
        self._cand_arr = ffi.new("llama_token_data_array *")

    @property
    def closed(self) -> bool:
        return self._ptr is None

    def sample(self, seq) -> int:
        """The next token for ``seq`` (see the class docstring)."""
        ctx = self._ctx
        with ctx._critical():
            ctx._check_open()
            if self._ptr is None:
                raise InvalidInputError("the sampler is closed")
            ctx._own(seq)
            logits = seq._logits
            if logits is None:
                logits = seq.logits()
            return self._draw(logits)

    def sample_logits(self, logits) -> int:
        """A token drawn from ``logits`` (n_vocab floats)."""
        arr = np.asarray(logits, dtype=np.float32)
        if arr.shape != (self._n_vocab,):
            raise InvalidInputError(f"logits must have shape ({self._n_vocab},), got {arr.shape}")
        if not np.isfinite(arr).any():
            raise InvalidInputError("logits has no finite value")
        with self._ctx._critical():
            if self._ptr is None:
                raise InvalidInputError("the sampler is closed")
            return self._draw(arr)

    def _draw(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return int(np.argmax(logits))
        c = self._cand_np
        c["id"] = np.arange(self._n_vocab, dtype=np.int32)
        c["logit"] = logits
        c["p"] = 0.0
        a = self._cand_arr
        a.data = self._cand
        a.size = self._n_vocab
        a.selected = -1
        a.sorted = False
        self._L.llama_sampler_apply(self._ptr, a)
        if not 0 <= a.selected < a.size:
            raise InvalidInputError("the sampler chain selected no token")
        tok = int(a.data[a.selected].id)
        self._L.llama_sampler_accept(self._ptr, tok)
        return tok

    def close(self) -> None:
        """Free the sampler chain (waits for a sample() running on another thread)."""
        ctx = getattr(self, "_ctx", None)
        if ctx is None or getattr(self, "_ptr", None) is None:
            return
        with ctx._critical():
            if self._ptr is not None:
                self._L.llama_sampler_free(self._ptr)
                self._ptr = None
