"""Embeddings and rerank scores: a llama.cpp context made with ``embeddings = true`` and a pooling type.

Contract (what :class:`Embedder` guarantees):

* **Validation first.** Token ids, input lengths, the pooling type and the model's fitness for it
  (rank pooling needs a reranker's classification head) are checked in Python before any C call;
  bad input raises :class:`~pyllama_kv.errors.InvalidInputError` and the process lives. (llama.cpp
  aborts on a non-causal batch bigger than its ubatch, on a mean-pooled sequence split between two
  ubatches, and on rank pooling without ``cls`` tensors: none of them can reach it from here.)
* **Batched over sequences**, as llama.cpp's ``examples/embedding`` does: many inputs in one
  ``llama_decode``, input i of a decode under sequence id i, the cells cleared before each decode;
  a decode holds whole inputs only (at most ``n_batch`` tokens, and ``n_batch == n_ubatch``, so one
  decode is one graph: pooling sees every token of its sequence, and a non-causal encoder sees the
  whole batch).
* **Pooling** is the context's (``llama_pooling_type``): the GGUF's ``{arch}.pooling_type`` unless
  overridden (llama-server's ``--pooling``): ``mean``, ``cls`` (the first token), ``last``, ``rank``
  (one score per input, from a reranker's head) or ``none`` (one vector per token).
* **Normalisation** is llama.cpp's ``common_embd_normalize(..., 2)`` (Euclidean, the sum in double);
  never applied to rank scores.

An embedder holds no sequence between calls, so it is not a :class:`~pyllama_kv.core.context.Context`
(which owns cells and the table of what each sequence holds): it owns only its native context, made
and registered through the model's interface for contexts (``open_native_context``), so that closing
the model closes it first.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .._native import kv as _kv
from ..config import default_threads
from ..errors import DecodeError, InvalidInputError
from ..limits import INT32_MAX, KV_CACHE_TYPES, MAX_EMBED_INPUTS, MAX_SEQUENCES, POOLING_TYPES

if TYPE_CHECKING:
    from .model import Model

__all__ = ["Embedder", "ENCODER_ARCHS", "check_pooling", "model_pooling", "pack", "rerank_tokens",
           "normalize_rows", "embed_inputs"]

#: architectures without a language-model head at the pin: embeddings only (no generation)
ENCODER_ARCHS = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "t5encoder"})
#: architectures whose loader reads ``{arch}.pooling_type`` at the pin (llama_model::load_hparams); the
#: others pool as ``none`` unless told otherwise
_POOLING_ARCHS = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "qwen2", "qwen2vl"})
#: what llama.cpp's rank pooling runs (llm_graph_context::build_pooling; loaded for ``bert`` only). Without
#: ``cls`` it aborts; without ``cls.output`` its score is a vector, of which the pin reads a wrong float
_RANK_TENSORS = ("cls.weight", "cls.bias", "cls.output.weight", "cls.output.bias")
_NAMES = {v: k for k, v in POOLING_TYPES.items()}
#: inputs one decode takes at most (sequence ids of the embeddings context)
DEFAULT_SEQS = 64


def check_pooling(pooling) -> str | None:
    """``pooling`` checked: None (the model's) or one of limits.POOLING_TYPES' names."""
    if pooling is None:
        return None
    if not isinstance(pooling, str) or pooling not in POOLING_TYPES:
        raise InvalidInputError(f"pooling must be one of {', '.join(POOLING_TYPES)} (or None: the model's), "
                                f"got {pooling!r}")
    return pooling


def model_pooling(model: Model, pooling: str | None = None) -> str:
    """The pooling an embeddings context of ``model`` applies: ``pooling`` if given, else the GGUF's
    (for the architectures whose loader reads it), else ``none``; as llama_context's constructor
    decides (the Embedder checks its answer against llama_pooling_type)."""
    p = check_pooling(pooling)
    if p is not None:
        return p
    arch = model.meta("general.architecture") or ""
    v = model.meta(f"{arch}.pooling_type") if arch in _POOLING_ARCHS else None
    try:
        return _NAMES.get(int(v), "none") if v is not None else "none"
    except ValueError:
        return "none"


def check_reranker(model: Model) -> None:
    """InvalidInputError unless ``model`` can run rank pooling (a ``bert`` with a classification head)."""
    arch = model.meta("general.architecture") or ""
    names = model.tensor_names()
    missing = [t for t in _RANK_TENSORS if t not in names]
    if arch != "bert" or missing:
        why = f"its architecture is {arch!r}" if arch != "bert" else f"it has no {missing[0]} tensor"
        raise InvalidInputError(f"rank pooling needs a reranker (a bert model with a classification head: "
                                f"{', '.join(_RANK_TENSORS)}); {model.path.name} is not one: {why}")


def normalize_rows(v: np.ndarray) -> np.ndarray:
    """llama.cpp's Euclidean normalisation (common_embd_normalize, embd_norm 2) of each row of ``v``:
    the norm summed in double, a zero vector stays zero."""
    norm = np.sqrt(np.sum(v.astype(np.float64) ** 2, axis=-1, keepdims=True))
    scale = np.where(norm > 0.0, 1.0 / np.where(norm > 0.0, norm, 1.0), 0.0).astype(np.float32)
    return (v * scale).astype(np.float32)


def pack(lengths: Sequence[int], n_batch: int, n_seqs: int) -> list[list[int]]:
    """Input indices grouped into decodes, in order: each group at most ``n_batch`` tokens and ``n_seqs``
    inputs (every length is 1..n_batch)."""
    groups: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if cur and (used + n > n_batch or len(cur) >= n_seqs):
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    return groups


def rerank_tokens(model: Model, query: Sequence[int], doc: Sequence[int]) -> list[int]:
    """One rerank input as llama-server formats it (format_rerank): BOS query EOS SEP doc EOS."""
    bos, eos, sep = model.bos, model.eos, model.sep
    for name, t in (("BOS", bos), ("EOS", eos), ("SEP", sep)):
        if not 0 <= t < model.n_vocab:
            raise InvalidInputError(f"the model's vocabulary has no {name} token: rerank pairs cannot be formatted")
    return [bos, *query, eos, sep, *doc, eos]


def embed_inputs(model: Model, inputs) -> tuple[list[np.ndarray], bool]:
    """``inputs`` of Model.embed as token arrays, and whether it was one input: a str (tokenized with
    the model's special tokens, as llama-embedding does), a sequence of token ids (a list or a 1-D
    integer array), or a list of those (at most MAX_EMBED_INPUTS)."""
    def one(x, i: int | None) -> np.ndarray:
        where = "" if i is None else f" (input {i})"
        if isinstance(x, str):
            toks = np.asarray(model.tokenize(x, add_bos=True, special=True), dtype=np.int32)
        elif isinstance(x, (list, tuple, np.ndarray)):
            try:
                toks = model.check_tokens(x, "input")
            except InvalidInputError as e:
                raise InvalidInputError(f"{e}{where}") from None
        else:
            raise InvalidInputError(f"an input must be a str or a list of token ids, got {type(x).__name__}{where}")
        if toks.size == 0:
            raise InvalidInputError(f"an input has no tokens{where}: embed at least one token")
        return toks

    if isinstance(inputs, str) or (isinstance(inputs, np.ndarray) and inputs.ndim == 1):
        return [one(inputs, None)], True
    if isinstance(inputs, (list, tuple)) and inputs and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in inputs):
        return [one(list(inputs), None)], True
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise InvalidInputError("inputs must be a str, a list of token ids, or a non-empty list of those")
    if len(inputs) > MAX_EMBED_INPUTS:
        raise InvalidInputError(f"{len(inputs)} inputs; at most {MAX_EMBED_INPUTS} are embedded in one call")
    return [one(x, i) for i, x in enumerate(inputs)], False


class Embedder(_kv.CResource):
    """An embeddings context over ``model`` (see the module docstring).

    >>> with model.embedder(pooling="mean") as emb:
    ...     vecs = emb.embed([model.tokenize("a cache"), model.tokenize("a model")])

    ``n_batch``: the most tokens one decode takes, and so the longest input (brought down to the
    model's n_ctx_train); ``n_seqs``: the most inputs one decode takes; ``type_k``/``type_v``: the cache
    types of a decoder's cells within one decode (f16, llama.cpp's default; f32 for exactness checks).
    """

    def __init__(self, model: Model, pooling: str | None = None, *, n_batch: int = 2048,
                 n_seqs: int = DEFAULT_SEQS, n_threads: int | None = None, type_k: str = "f16",
                 type_v: str = "f16"):
        model.check_open()
        for name, t in (("type_k", type_k), ("type_v", type_v)):
            if t not in ("f32", "f16", "bf16"):   # (a quantized cache needs flash attention and block sizes)
                raise InvalidInputError(f"{name} must be f32, f16 or bf16 for embeddings, got {t!r}")
        for name, v, hi in (("n_batch", n_batch, INT32_MAX), ("n_seqs", n_seqs, MAX_SEQUENCES),
                            ("n_threads", 1 if n_threads is None else n_threads, 512)):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise InvalidInputError(f"{name} must be an int in [1, {hi}], got {v!r}")
        self.model = model
        self.pooling: str = model_pooling(model, pooling)
        if self.pooling == "rank":
            check_reranker(model)
        self.n_batch = min(n_batch, model.n_ctx_train)
        self.n_seqs = min(n_seqs, self.n_batch)
        self.n_embd: int = model.n_embd
        self.n_threads = n_threads or default_threads()
        self._lock = threading.RLock()
        self._batch = _kv.NativeBatch(self.n_batch, model.native_library)
        # n_ubatch == n_batch: one decode is one graph (whole sequences for pooling; a non-causal
        # encoder must see its batch at once); the cells hold one decode
        model.open_native_context(self, self._adopt, n_ctx=self.n_batch, n_batch=self.n_batch,
                                  n_ubatch=self.n_batch, n_seq_max=self.n_seqs, flash_attn=False,
                                  type_k=KV_CACHE_TYPES[type_k], type_v=KV_CACHE_TYPES[type_v],
                                  n_threads=self.n_threads, defrag_thold=None, embeddings=True,
                                  pooling_type=POOLING_TYPES[self.pooling])
        assert self._native is not None
        got = _NAMES.get(self._native.pooling_type())
        if got != self.pooling:   # pragma: no cover - model_pooling follows llama_context's constructor
            self.close()
            raise InvalidInputError(f"llama.cpp pools {got!r} where {self.pooling!r} was expected")

    _native: _kv.NativeContext | None = None

    def _adopt(self, native: _kv.NativeContext) -> None:
        self._native = native

    @property
    def closed(self) -> bool:
        return self._native is None

    def close(self) -> None:
        """Free the native context (the model closes it first when it is closed)."""
        if getattr(self, "_native", None) is None:
            return
        with self._lock:
            native, self._native = self._native, None
            if native is not None:
                native.free()
                self.model.forget_context(self)

    def __repr__(self) -> str:
        return f"<pyllama_kv.Embedder pooling={self.pooling} n_batch={self.n_batch}{' closed' if self.closed else ''}>"

    def check(self, inputs: Sequence[np.ndarray]) -> None:
        """InvalidInputError unless every input (a checked token array) fits one decode."""
        for i, toks in enumerate(inputs):
            if not 1 <= len(toks) <= self.n_batch:
                raise InvalidInputError(f"input {i} has {len(toks)} tokens; an input to embed has 1 to "
                                        f"{self.n_batch} (the embedding batch)")

    def embed(self, inputs: Sequence[np.ndarray], normalize: bool = True,
              should_stop: Callable[[], bool] | None = None) -> list[np.ndarray] | None:
        """One result per input (checked token arrays, as :func:`embed_inputs` makes them): a vector of
        n_embd floats (mean, cls, last), a (tokens, n_embd) array (none) or one score (rank, shape (1,)).
        ``should_stop`` is asked between decodes; True: None is returned."""
        self.check(inputs)
        out: list[np.ndarray] = []
        for group in pack([len(t) for t in inputs], self.n_batch, self.n_seqs):
            if should_stop is not None and should_stop():
                return None
            out.extend(self.decode_group([inputs[i] for i in group], normalize))
        return out

    def decode_group(self, inputs: Sequence[np.ndarray], normalize: bool = True) -> list[np.ndarray]:
        """The results of ``inputs`` (checked token arrays, together at most n_batch tokens and n_seqs
        inputs) from one llama_decode."""
        lens = [len(t) for t in inputs]
        n = sum(lens)
        if not inputs or len(inputs) > self.n_seqs or n > self.n_batch or min(lens) < 1:
            raise InvalidInputError(f"{len(inputs)} inputs of {n} tokens do not make one embedding decode "
                                    f"(1 to {self.n_seqs} inputs, at most {self.n_batch} tokens)")
        with self._lock:
            native = self._native
            if native is None:
                raise InvalidInputError("the embedder is closed")
            batch = self._batch
            batch.np_token[:n] = np.concatenate(inputs)
            batch.np_pos[:n] = np.concatenate([np.arange(k, dtype=np.int32) for k in lens])
            batch.np_sid[:n] = np.repeat(np.arange(len(inputs), dtype=np.int32), lens)
            batch.np_out[:n] = 1
            native.clear()
            rc = native.decode(batch, n)
            if rc != 0:
                raise DecodeError(f"llama_decode failed with code {rc} in an embedding batch"
                                  + (f": {self.model.native_library.last_error()}" if rc < 0 else ""))
            return self._read(native, lens, normalize)

    def _read(self, native: _kv.NativeContext, lens: list[int], normalize: bool) -> list[np.ndarray]:
        if self.pooling == "none":
            rows = native.embeddings_rows(sum(lens), self.n_embd)
            if rows is None:   # pragma: no cover - an embeddings context has them
                raise DecodeError("llama.cpp returned no token embeddings")
            if normalize:
                rows = normalize_rows(rows)
            bounds = np.cumsum([0, *lens])
            return [rows[bounds[i]:bounds[i + 1]].copy() for i in range(len(lens))]
        width = 1 if self.pooling == "rank" else self.n_embd
        out = []
        for s in range(len(lens)):
            v = native.embeddings_seq(s, width)
            if v is None:   # pragma: no cover - every sequence of the batch is pooled
                raise DecodeError(f"llama.cpp returned no pooled embedding for sequence {s}")
            out.append(normalize_rows(v) if normalize and self.pooling != "rank" else v)
        return out
