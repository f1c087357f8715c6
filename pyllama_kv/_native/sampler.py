"""A llama.cpp sampler chain over logits the caller passes (:class:`NativeSampler`): the samplers of
``sampling/`` run on it, and on the current pin a chain also runs in the graph
(:meth:`~pyllama_kv._native.kv.CurrentContext.set_sampler`)."""
from __future__ import annotations

import numpy as np

from .ffi import Library


class NativeSampler:
    """A llama.cpp sampler chain and a reusable candidate array of n_vocab entries."""

    _CAND = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])

    def __init__(self, lib: Library, n_vocab: int):
        """llama_sampler_chain_init (empty chain; add samplers with the add_* methods)."""
        self.L = lib.lib
        self.api = lib.api
        ffi = self.ffi = lib.ffi
        self.n_vocab = n_vocab
        self.ptr = self.L.llama_sampler_chain_init(self.L.llama_sampler_chain_default_params())
        self._cand = ffi.new("llama_token_data[]", n_vocab)
        self._cand_np = np.frombuffer(ffi.buffer(self._cand), dtype=self._CAND)
        self._arr = ffi.new("llama_token_data_array *")
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self.in_graph = False   # attached to a context's sequence once (CurrentContext.set_sampler): never again

    def add_greedy(self) -> None:
        """llama_sampler_init_greedy, added to the chain."""
        self.L.llama_sampler_chain_add(self.ptr, self.L.llama_sampler_init_greedy())

    def add_top_k(self, k: int) -> None:
        """llama_sampler_init_top_k, added to the chain."""
        self.L.llama_sampler_chain_add(self.ptr, self.L.llama_sampler_init_top_k(k))

    def add_top_p(self, p: float, min_keep: int) -> None:
        """llama_sampler_init_top_p, added to the chain."""
        self.L.llama_sampler_chain_add(self.ptr, self.L.llama_sampler_init_top_p(p, min_keep))

    def add_min_p(self, p: float, min_keep: int) -> None:
        """llama_sampler_init_min_p, added to the chain."""
        self.L.llama_sampler_chain_add(self.ptr, self.L.llama_sampler_init_min_p(p, min_keep))

    def add_temp(self, t: float) -> None:
        """llama_sampler_init_temp, added to the chain."""
        self.L.llama_sampler_chain_add(self.ptr, self.L.llama_sampler_init_temp(t))

    def add_penalties(self, last_n: int, repeat: float, freq: float, present: float) -> None:
        """llama_sampler_init_penalties, added to the chain (it counts the tokens it accepts)."""
        if self.api == "current":   # the current llama.h takes n_vocab first
            smpl = self.L.llama_sampler_init_penalties(self.n_vocab, last_n, repeat, freq, present)
        else:
            smpl = self.L.llama_sampler_init_penalties(last_n, repeat, freq, present)
        self.L.llama_sampler_chain_add(self.ptr, smpl)

    def add_logit_bias(self, bias: dict[int, float]) -> None:
        """llama_sampler_init_logit_bias, added to the chain (it copies the array)."""
        arr = self.ffi.new("llama_logit_bias[]", max(1, len(bias)))
        for i, (tok, b) in enumerate(bias.items()):
            arr[i].token = tok
            arr[i].bias = b
        self.L.llama_sampler_chain_add(self.ptr, self.L.llama_sampler_init_logit_bias(self.n_vocab, len(bias), arr))

    def add_dist(self, seed: int) -> None:
        """llama_sampler_init_dist, added to the chain."""
        self.L.llama_sampler_chain_add(self.ptr, self.L.llama_sampler_init_dist(seed))

    def apply(self, logits: np.ndarray, top_k: int = 0) -> int:
        """llama_sampler_apply over n_vocab float32 logits: the selected token id, or -1 if none.
        With ``0 < top_k < n_vocab`` (the chain's own top-k) only the ``top_k`` largest logits are
        passed: the chain would keep just those, and its per-draw cost over 49k candidates drops
        (only which of several logits tied at the k-th value are kept can differ)."""
        c = self._cand_np
        n = self.n_vocab
        live = None
        if logits.min() == -np.inf:
            # masked tokens (a grammar's): never drawn, so left out; tens of thousands of tied -inf
            # would also make argpartition ten times slower
            live = np.flatnonzero(logits != -np.inf).astype(np.int32)
        if live is not None and (top_k <= 0 or top_k >= live.size):
            n = live.size
            c = c[:n]
            c["id"] = live
            c["logit"] = logits[live]
        elif 0 < top_k < n:
            sub = logits if live is None else logits[live]
            ids = np.argpartition(sub, sub.size - top_k)[sub.size - top_k:].astype(np.int32)
            if live is not None:
                ids = live[ids]
            n = len(ids)
            c = c[:n]
            c["id"] = ids
            c["logit"] = logits[ids]
        else:
            c["id"] = self._ids
            c["logit"] = logits
        c["p"] = 0.0
        a = self._arr
        a.data = self._cand
        a.size = n
        a.selected = -1
        a.sorted = False
        self.L.llama_sampler_apply(self.ptr, a)
        if not 0 <= a.selected < a.size:
            return -1
        return int(a.data[a.selected].id)

    def accept(self, token: int) -> None:
        """llama_sampler_accept."""
        self.L.llama_sampler_accept(self.ptr, token)

    def free(self) -> None:
        """llama_sampler_free, once; nothing for a chain that was attached to a sequence (``in_graph``):
        the context it went to frees it (:meth:`release`), since llama.cpp may still hold it."""
        if not self.in_graph:
            self.release()

    def release(self) -> None:
        """llama_sampler_free, once, whoever attached it: for the context that owns the chain."""
        if self.ptr is not None:
            self.L.llama_sampler_free(self.ptr)
            self.ptr = None
