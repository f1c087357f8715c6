"""Embedding requests in the engine's one loop.

An embedding request (``Engine.submit_embedding``: token arrays, checked) waits in a FIFO; each
engine step runs at most one embedding decode (whole inputs of the oldest requests, at most the
embedding batch), before the step's generation decode. So a server embeds while it chats, and a
generation step waits for one embedding batch at most: no second thread decodes beside the loop
(two contexts decoding at once would share the cores, and ggml's spinning threads crawl when they
outnumber the cores). The embeddings context (:class:`~pyllama_kv.core.embedding.Embedder`) is a
second llama.cpp context over the same model, made on the first request, with its own few cells:
an embedding needs no cache cell of the generation context and evicts nothing.

A request's Future gets its results (in input order) or its exception; a cancelled Future (the
client went away) is skipped at the next step. The queue is bounded (``max_queue`` requests
waiting: QueueFullError beyond).
"""
from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..core.embedding import Embedder, model_pooling, normalize_rows
from ..errors import InvalidInputError, QueueFullError

__all__ = ["EmbeddingQueue", "EmbeddingStats"]


@dataclass
class EmbeddingStats:
    requests: int = 0        # requests answered
    inputs: int = 0          # inputs embedded
    tokens: int = 0          # tokens decoded for them
    decode_calls: int = 0    # embedding decodes
    rejected: int = 0        # requests refused because the queue was full
    cancelled: int = 0       # requests dropped because their client went away


@dataclass
class _Job:
    inputs: list[np.ndarray]
    normalize: bool
    future: Future
    results: list = field(default_factory=list)
    next: int = 0            # the first input not decoded yet


class EmbeddingQueue:
    """The engine's embedding requests and its embeddings context (made on first use, on the loop
    thread). ``pooling``: the server's override (None: the model's); ``n_batch``: tokens per
    embedding decode, so the longest input."""

    def __init__(self, model, pooling: str | None, n_batch: int, n_threads: int | None, max_queue: int,
                 type_k: str = "f16", type_v: str = "f16"):
        self.model = model
        self.pooling = model_pooling(model, pooling)
        self.n_batch = max(1, min(n_batch, model.n_ctx_train))
        self.n_threads = n_threads
        # the engine's cache types where an embeddings context can take them (no quantized cells)
        self.cache_types = tuple(t if t in ("f32", "f16", "bf16") else "f16" for t in (type_k, type_v))
        self.max_queue = max_queue
        self.stats = EmbeddingStats()
        self._jobs: deque[_Job] = deque()
        self._lock = threading.Lock()
        self._embedder: Embedder | None = None

    def submit(self, inputs: list[np.ndarray], normalize: bool) -> Future:
        """Queue one request (any thread): its Future. The inputs are checked token arrays, each at most
        ``n_batch`` tokens (checked again when decoded); QueueFullError when ``max_queue`` wait already."""
        fut: Future = Future()
        with self._lock:
            if len(self._jobs) >= self.max_queue:
                self.stats.rejected += 1
                raise QueueFullError(f"the queue is full ({self.max_queue} embedding requests waiting): "
                                     "try again later")
            self._jobs.append(_Job(list(inputs), normalize, fut))
        return fut

    @property
    def waiting(self) -> int:
        return len(self._jobs)

    def has_work(self) -> bool:
        return bool(self._jobs)

    def _group(self) -> list[tuple[_Job, int]]:
        """The (job, input index) pairs of the next decode: whole inputs, oldest first."""
        out: list[tuple[_Job, int]] = []
        used = 0
        n_seqs = self._embedder.n_seqs if self._embedder is not None else 1
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            if job.future.cancelled():
                continue
            for i in range(job.next, len(job.inputs)):
                n = len(job.inputs[i])
                if out and (used + n > self.n_batch or len(out) >= n_seqs):
                    return out
                out.append((job, i))
                used += n
        return out

    def _drop_done(self) -> None:
        with self._lock:
            while self._jobs and (self._jobs[0].future.done() or self._jobs[0].future.cancelled()):
                job = self._jobs.popleft()
                if job.future.cancelled():
                    self.stats.cancelled += 1

    def step(self) -> int:
        """One embedding decode on the loop thread (made the embedder first when needed): the tokens
        decoded (0: nothing waited). A failure fails the requests of that decode, not the loop."""
        self._drop_done()
        if not self._jobs:
            return 0
        if self._embedder is None or self._embedder.closed:
            try:
                self._embedder = Embedder(self.model, self.pooling, n_batch=self.n_batch, n_threads=self.n_threads,
                                          type_k=self.cache_types[0], type_v=self.cache_types[1])
            except Exception as exc:   # (checked at submit: should not happen) every waiting request learns it
                self._fail([(j, 0) for j in list(self._jobs)], exc)
                return 0
        group = self._group()
        if not group:
            self._drop_done()
            return 0
        toks = [job.inputs[i] for job, i in group]
        try:   # decoded raw, each request's results normalised as it asked (the same arithmetic)
            raw = self._embedder.decode_group(toks, normalize=False)
        except Exception as exc:
            self._fail(group, exc)
            return 0
        self.stats.decode_calls += 1
        n = sum(len(t) for t in toks)
        self.stats.tokens += n
        for (job, i), r in zip(group, raw):
            job.results.append(normalize_rows(r) if job.normalize and self.pooling != "rank" else r)
            job.next = i + 1
            if job.next == len(job.inputs) and job.future.set_running_or_notify_cancel():
                self.stats.requests += 1
                self.stats.inputs += len(job.inputs)
                job.future.set_result(job.results)
        self._drop_done()
        return n

    def _fail(self, group: list[tuple[_Job, int]], exc: Exception) -> None:
        for job in {id(j): j for j, _ in group}.values():
            if not job.future.done() and job.future.set_running_or_notify_cancel():
                job.future.set_exception(exc)
        self._drop_done()

    def cancel_all(self) -> None:
        """Cancel every waiting request (the engine stops)."""
        with self._lock:
            jobs = list(self._jobs)
            self._jobs.clear()
        for job in jobs:
            job.future.cancel()

    def close(self) -> None:
        self.cancel_all()
        if self._embedder is not None:
            self._embedder.close()
            self._embedder = None


class EmbeddingRequests:
    """The engine's embedding requests, a base of :class:`~pyllama_kv.engine.scheduler.Engine` (one
    object, whose ``__init__`` sets what is declared here): one embedding decode per step, in its loop."""

    model: Any
    config: Any
    _embeddings: EmbeddingQueue | None
    _embeddings_lock: threading.Lock
    _closed: bool
    _cv: threading.Condition

    @property
    def embeddings(self) -> EmbeddingQueue:
        """The engine's embedding requests and embeddings context (made on first use; its pooling is
        ``config.pooling``, else the model's)."""
        with self._embeddings_lock:
            if self._embeddings is None:
                cfg = self.config
                self._embeddings = EmbeddingQueue(self.model, cfg.pooling, cfg.n_batch, cfg.n_threads, cfg.max_queue,
                                                  cfg.type_k, cfg.type_v)
            return self._embeddings

    def embedding_stats(self) -> dict | None:
        """The embedding counters (EmbeddingStats as a dict), None before the first embedding request."""
        emb = self._embeddings
        return None if emb is None else {**asdict(emb.stats), "waiting": emb.waiting}

    def submit_embedding(self, inputs: list, normalize: bool = True) -> Future:
        """Queue an embedding request (any thread): ``inputs`` are checked token arrays (core.embedding's
        embed_inputs), each at most ``embeddings.n_batch`` tokens. Its Future gets one result per input
        (see Embedder.embed); cancel it to drop the request. QueueFullError when the queue is full."""
        if self._closed:
            raise InvalidInputError("the engine is closed")
        fut = self.embeddings.submit(inputs, normalize)
        with self._cv:
            self._cv.notify_all()
        return fut
