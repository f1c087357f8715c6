"""Token sampling with llama.cpp's sampler chain (top-k -> top-p -> temperature -> seeded draw)."""
from __future__ import annotations

from . import _ffi
from .errors import InvalidInputError

ffi = _ffi.ffi


class Sampler(_ffi.CResource):
    """A llama.cpp sampler chain. ``temp <= 0`` means greedy (argmax).

    ``sample(seq)`` draws the next token from the logits of ``seq``'s last decode; it must come right
    after the decode that produced them (the usual generation loop), as llama.cpp samples from the
    context's output buffer without copying it.
    """

    def __init__(self, ctx, temp: float = 0.8, top_k: int = 40, top_p: float = 0.95, seed: int = 0):
        if temp is None or top_k is None or top_p is None:
            raise InvalidInputError("temp, top_k and top_p must be numbers")
        if top_k < 0:
            raise InvalidInputError("top_k must be >= 0 (0: disabled)")
        if not 0.0 < top_p <= 1.0:
            raise InvalidInputError("top_p must be in (0, 1]")
        self._ctx = ctx
        L = self._L = ctx._L
        self.temp, self.top_k, self.top_p, self.seed = float(temp), int(top_k), float(top_p), int(seed)
        self._ptr = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if self.temp <= 0:
            L.llama_sampler_chain_add(self._ptr, L.llama_sampler_init_greedy())
        else:
            if self.top_k > 0:
                L.llama_sampler_chain_add(self._ptr, L.llama_sampler_init_top_k(self.top_k))
            if self.top_p < 1.0:
                L.llama_sampler_chain_add(self._ptr, L.llama_sampler_init_top_p(self.top_p, 1))
            L.llama_sampler_chain_add(self._ptr, L.llama_sampler_init_temp(self.temp))
            L.llama_sampler_chain_add(self._ptr, L.llama_sampler_init_dist(self.seed & 0xFFFFFFFF))

    def sample(self, seq) -> int:
        ctx = self._ctx
        with ctx.lock:
            ctx._own(seq)
            serial, idx = ctx._last_out.get(seq.id, (-1, -1))
            if serial != ctx._decode_serial:
                raise InvalidInputError(
                    f"sequence {seq.id} has no logits from the latest decode: sample right after decoding it")
            return int(self._L.llama_sampler_sample(self._ptr, ctx._ptr, idx))

    def close(self) -> None:
        if self._ptr is not None:
            self._L.llama_sampler_free(self._ptr)
            self._ptr = None

