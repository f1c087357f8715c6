"""The generation engine: the one loop that serves many requests over one KV cache.

Each :meth:`Engine.step` is one ``decode``: one token for every continuation that is generating,
plus chunks of admitted prompts up to ``n_batch`` tokens (so a long prompt delays running streams by
one chunk at most). The engine samples right after its own decode, streams text deltas, and finishes
continuations by stop string, end-of-generation token, length, cancellation or a full cache.

* **Prefix reuse.** A prompt starts from the longest prefix the KV layer holds: a fork of an idle
  cached sequence (no recompute), or spans paged out to host memory (restored by a copy). Prompts
  and finished conversations are kept as idle cached sequences. A request whose prompt shares a
  long prefix with a prompt being evaluated right now (requests arriving together with one system
  prompt) waits for that prompt to be in, then forks it.
* **Room: the KV layer's call** (``engine/kv.py``). The scheduler never evicts: it asks the KV layer
  for room (``reserve`` at admission, ``make_room`` when a decode finds none), which pages idle
  prefixes out (or drops them) by its one rule, and says whether the room is there.
* **Admission.** A request enters when the KV layer finds room for its prompt (less the shared
  prefix) and an output reserve per continuation beside what running requests were promised, and
  sequence ids; otherwise it waits in a bounded queue (submit raises QueueFullError when that is
  full). With nothing running, the prompt alone has to fit (the reserve is a target, not a limit).
  Requests are admitted in arrival order, except that a smaller one may overtake a head that does
  not fit yet (at most 8 times, so the head is never starved). Only when a decode finds no room and
  the KV layer can make none is a running continuation preempted: put back in front of the queue
  with its tokens so far, and resumed (mostly from cached prefixes) when there is room.
* **Context shift.** A continuation whose sequence reaches the end of the context (``n_ctx``)
  does not end there (unless ``context_shift`` is off): as in Ollama's runner and llama.cpp's
  examples, its first ``n_keep`` tokens stay, half of the rest (the oldest) is dropped, and
  generation goes on. Where the cache can K-shift (patched build, a RoPE model, a cache type the
  device can rotate) and the kept tail is this sequence's own, the tail's cells are moved down in
  place (no decode); otherwise (the vanilla build, a cache that cannot shift, a tail whose cells a
  fork or a cached prefix shares) the sequence is cut after ``n_keep`` and the kept tail is
  evaluated again through the normal batches (Ollama's ``KvCacheCanShift`` -> reprocess), so
  forks never see a sibling's shift. Either way the sequence holds positions 0..n-1 afterwards.
* **Truncation.** A prompt that does not fit the context is refused, or with ``truncate`` cut
  after its first ``n_keep`` tokens, at one of the caller's turn ``boundaries`` when one is in
  reach (a chat turn is never split when it can be avoided), leaving room for the answer.
* **Submission.** ``submit`` checks and normalises its arguments through ``engine/admission.py``
  (every InvalidInputError it raises comes from there), then only builds the handle and queues.
* **Threads.** ``submit`` and ``cancel`` are safe from any thread. Either call :meth:`step` yourself
  (one thread), or :meth:`start` a loop thread.

Embeddings (``submit_embedding``, engine/embeddings.py) go through this loop too: a step runs at most
one embedding decode (on a second, embeddings context) before its generation decode.

Slot failures (the vanilla build refusing a batch that fits in scattered free cells) fail the
requests whose prompts were in that batch (finish "cache_full"), so the stress workload still shows
what an unpatched library does.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, TypeVar

import numpy as np

from ..config import EngineConfig, SamplingParams, spec_sources
from ..core.context import release_thread_pool
from ..errors import InvalidInputError, KVCacheFullError, LlamaError, QueueFullError
from ..prefixcache.cache import shared_prefix
from .admission import Limits, admit
from .continuation import Continuation as _Continuation, EngineStats, default_sampler
from .embeddings import EmbeddingQueue, EmbeddingRequests
from .kv import ContextKV, KVCache, context_kv
from .request import GRAMMAR_ERROR, Event, Request, RequestHandle
from .shift import ContextShifts
from .speculate import SpeculativeSteps, Speculator
from .stream import Streaming

if TYPE_CHECKING:
    from ..core.context import Context

T = TypeVar("T")

_LOOKAHEAD = 16        # waiting requests considered for admission per step
_MAX_OVERTAKES = 8     # times the head of the queue may be overtaken before everything waits for it
_MIN_SHARED = 16       # prompt tokens shared with a prompt being evaluated that are worth waiting for


class Engine(SpeculativeSteps, ContextShifts, Streaming, EmbeddingRequests):
    """Serve requests over one context (see the module docstring).

    >>> eng = Engine(model, EngineConfig(n_ctx=4096, parallel=8))
    >>> h = eng.submit(model.tokenize("Once upon a time"), max_tokens=32, params=GREEDY)
    >>> eng.run_until_idle(); h.result()[0].text
    """

    def __init__(self, model, config: EngineConfig | None = None, *, kv: KVCache | None = None,
                 n_vocab: int | None = None, token_piece: Callable[[int], bytes] | None = None,
                 is_eog: Callable[[int], bool] | None = None, sampler_factory=None, draft_model=None):
        self.config = config = config or EngineConfig()
        self.model = model
        # argmax requests' tokens chosen in the graph (not when the caller draws every token itself)
        self._in_graph = _sample_in_graph(model, config, kv, own_sampler=sampler_factory is not None)
        self._unsent: list = []
        self._own_ctx = None
        if kv is None:
            ctx = model.context(**config.context().context_kwargs())
            self._own_ctx = ctx
            kv = context_kv(ctx, config)
        self.kv = kv
        # stream a step's tokens while the next step's graph runs (engine/stream.py); a KV layer of the
        # caller's own, not a context's, streams serially (its decode has no between)
        auto = bool(getattr(model, "on_device", False))
        self._pipelined = isinstance(kv, ContextKV) and (auto if config.pipeline is None else config.pipeline)
        self.n_ctx = kv.n_cells
        # the batch within the context: a small context shrinks the batch to fit
        self.n_batch = max(1, min(config.n_batch, self.n_ctx))
        self.n_vocab = n_vocab if n_vocab is not None else model.n_vocab
        self._piece = token_piece or (lambda t: model.token_to_piece(t))
        self._is_eog = is_eog or model.is_eog
        self._make_sampler = sampler_factory or self._default_sampler
        self._llama_samplers = sampler_factory is None   # need the KV layer's context beyond greedy
        self.spec = Speculator(spec_sources(config.spec), config.spec_max,
                               recurrent=bool(getattr(model, "recurrent", False)),
                               sliding_window=getattr(model, "n_swa", 0) not in (0, None),
                               draft_model=self._draft_model(model, draft_model, config))
        self.stats = EngineStats(prefix_tier=getattr(kv, "tier_info", None), spec=self.spec.stats)
        self._ids = itertools.count(1)
        self._admit_counter = itertools.count()
        self._inbox: deque = deque()           # ("submit", Request) | ("cancel", Request)
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._resume: deque[_Continuation] = deque()    # preempted continuations, served first
        self._continuations: list[_Continuation] = []   # admitted, holding a sequence
        self._n_waiting = 0                    # for the queue bound, counted at submit
        self._thread: threading.Thread | None = None
        self._tasks: list = []                 # (fn, Future) for between_steps(), run by the loop thread
        self._stopping = False
        self._closed = False
        self._seed = itertools.count(int.from_bytes(os.urandom(4), "little"))
        self._embeddings: EmbeddingQueue | None = None   # made by the first embedding request
        self._embeddings_lock = threading.Lock()

    def _draft_model(self, model, draft, config: EngineConfig):
        """The draft model's side (its own context, mirror sequences), after its vocabulary is checked
        against the model's; None without one."""
        if draft is None:
            return None
        from ..speculation.draftmodel import DraftModel, check_vocab

        check_vocab(model, draft)
        return DraftModel(draft, config.parallel, self.n_ctx, n_threads=config.n_threads, type_k=config.type_k,
                          type_v=config.type_v)

    # -- submission (any thread) ----------------------------------------------------------------

    def submit(self, prompt: Sequence[int] | str, params: SamplingParams | None = None, *, max_tokens: int = 256,
               stop: Iterable[str] | str = (), n: int = 1, keep: bool | None = None,
               on_event: Callable[[Event], None] | None = None, context_shift: bool | None = None,
               n_keep: int | None = None, truncate: bool | None = None,
               boundaries: Iterable[int] | None = None, grammar=None, logprobs: int | None = None,
               spec_max: int | None = None) -> RequestHandle:
        """Queue a request; its handle streams events. ``prompt`` is token ids (or text, tokenized
        with BOS). ``n`` continuations are served by forking after the prompt. InvalidInputError for
        bad values, QueueFullError when the admission queue is full.

        ``context_shift``, ``n_keep`` and ``truncate`` override the engine's config for this request
        (see the module docstring); ``boundaries`` are indices into the prompt where a turn starts (a
        chat's messages), where truncation prefers to cut.

        ``grammar`` (a :class:`~pyllama_kv.sampling.grammar.Grammar`, or one compiled for this model with
        :func:`~pyllama_kv.sampling.grammar.compile_grammar`) constrains every continuation's output (its
        logits are masked before the sampler); a grammar that cannot compile is a GrammarError (an
        InvalidInputError). ``logprobs=k`` reports each token's log-probability and the k most likely
        alternatives (0..20) in the events and completions. ``spec_max`` caps the draft tokens of one
        step for this request (0: no speculation; None: the engine's ``spec_max``): speculation never
        changes the output, only how many tokens a step may give."""
        if self._closed:
            raise InvalidInputError("the engine is closed")
        sub = admit(self._limits(), prompt, params, max_tokens=max_tokens, stop=stop, n=n, keep=keep,
                    context_shift=context_shift, n_keep=n_keep, truncate=truncate, boundaries=boundaries,
                    grammar=grammar, logprobs=logprobs, spec_max=spec_max)
        handle = RequestHandle(next(self._ids), sub.n, len(sub.prompt), on_event)
        handle.usage.truncated_tokens = sub.truncated
        handle.submitted_at = time.perf_counter()
        req = sub.request(handle)
        handle.bind_cancel(lambda: self._post(("cancel", req)))
        self._enqueue(req, sub.truncated)
        return handle

    def _limits(self) -> Limits:
        """What this engine admits (read at each submit: the KV layer says how many ids it has)."""
        can_sample = not (self._llama_samplers and self.context is None)
        return Limits(config=self.config, n_ctx=self.n_ctx, parallel=self.kv.parallel, n_vocab=self.n_vocab,
                      model=self.model, can_sample=can_sample)

    def _enqueue(self, req: Request, truncated: int) -> None:
        """Into the inbox for the loop, or QueueFullError when ``max_queue`` requests wait already."""
        with self._cv:
            if self._n_waiting >= self.config.max_queue:
                self.stats.rejected += 1
                raise QueueFullError(f"the queue is full ({self.config.max_queue} requests waiting): try again later")
            self._n_waiting += 1
            self.stats.submitted += 1
            if truncated:
                self.stats.truncated_prompts += 1
                self.stats.truncated_tokens += truncated
            self.stats.queue_peak = max(self.stats.queue_peak, self._n_waiting)
            self._inbox.append(("submit", req))
            self._cv.notify_all()

    def cancel(self, handle: RequestHandle) -> None:
        """Cancel a request (any thread); it finishes "cancelled" at the next step."""
        handle.cancel()

    def _post(self, item) -> None:
        with self._cv:
            self._inbox.append(item)
            self._cv.notify_all()

    # -- state ---------------------------------------------------------------------------------

    @property
    def context(self) -> Context | None:
        """The :class:`~pyllama_kv.core.context.Context` the engine's KV cache is (None over a fake
        KVCache): for llama.cpp's samplers and for tools that read the cache. Read it between steps
        (:meth:`between_steps`, or on the thread that calls :meth:`step`)."""
        return self.kv.context

    @property
    def running(self) -> int:
        """Continuations holding a sequence."""
        return len(self._continuations)

    @property
    def running_requests(self) -> int:
        """Requests with a continuation holding a sequence."""
        return len({id(s.req) for s in list(self._continuations)})   # (a copy: read from other threads too)

    @property
    def alive(self) -> bool:
        """Whether the loop thread of :meth:`start` is running."""
        t = self._thread
        return t is not None and t.is_alive() and not self._stopping

    @property
    def waiting(self) -> int:
        """Requests and preempted continuations waiting for admission."""
        with self._cv:
            return self._n_waiting + len(self._resume)

    def has_work(self) -> bool:
        emb = self._embeddings
        return bool(self._continuations or self._waiting or self._resume or self._inbox or self._unsent
                    or (emb is not None and emb.has_work()))

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> int:
        """One decode (see the module docstring); returns the tokens decoded (0 when idle)."""
        t0 = time.perf_counter()
        self._drain_inbox()
        emb = self._embeddings
        n_emb = emb.step() if emb is not None and emb.has_work() else 0   # one embedding decode at most
        self._admit()
        tb = time.perf_counter()
        batch, owners, outputs = self._build_batch()
        if not batch:
            self._send_unsent()
            return n_emb
        st = self.stats   # idle prefixes unused for limits.IDLE_PAGE_OUT_TOKENS by the end of this decode go first
        st.steps, decoded, tp = st.steps + 1, st.evaluated_tokens + st.generated_tokens, time.perf_counter()
        st.idle_page_outs += self.kv.page_out_idle(decoded, sum(map(len, batch.values())))
        tb += time.perf_counter() - tp   # (their copy is not this batch's cost: the cost rule's measure)
        # the cost rule's measure: what a step of generation (and drafts) costs, drafting, sampling and
        # verifying included; a step with a prompt chunk is another kind of batch (cheaper a token)
        generation_only = not any(owners[seq].prefilling for seq in batch)
        n = 0
        try:
            n = self._step(batch, owners, outputs)
        finally:
            now = time.perf_counter()
            self.stats.step_seconds += now - t0
            if generation_only:
                self.spec.decoded(n, now - tb)
        return n

    def _step(self, batch: dict, owners: dict, outputs: dict) -> int:
        out = self._decode(batch, owners, outputs)
        n = 0
        for seq, logits in out.items():
            cont = owners[seq]
            took = len(batch[seq])
            n += took
            was_prefill = cont.prefilling
            del cont.pending[:took]
            if was_prefill:
                self.stats.evaluated_tokens += took
                if cont.checkpoints:
                    self._keep_checkpoint(cont)
            if cont.pending:
                continue   # a prompt chunk: more to come
            if isinstance(logits, list) or (not isinstance(logits, int) and logits.ndim == 2):
                self._verify(cont, logits)   # a drafted continuation: a row per position from its next token on
                continue
            cont.logits = logits
            self._after_decode(cont)
        return n

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Step until nothing runs or waits (or ``max_steps``); returns the steps taken."""
        k = 0
        while self.has_work() and (max_steps is None or k < max_steps):
            self.step()
            k += 1
        return k

    def start(self, on_step: Callable[[Engine], None] | None = None) -> None:
        """Run the loop on a thread of its own (daemon) until :meth:`stop`. ``on_step(engine)``, if
        given, is called on that thread once before the first step and after every step. To read the
        engine or its cache from another thread, ask :meth:`between_steps` instead (only when asked)."""
        if self._thread is not None:
            return
        self._stopping = False
        release_thread_pool()   # this thread's OpenMP workers would slow every decode of the loop's
        self._thread = threading.Thread(target=self._loop, args=(on_step,), name="pyllama-kv-engine", daemon=True)
        self._thread.start()

    def between_steps(self, fn: Callable[[Engine], T]) -> Future[T]:
        """Run ``fn(engine)`` on the loop thread between two steps, as llama.cpp's server answers its
        metrics task: the one place where another thread's view of the engine and its cache (a
        metrics snapshot, ``engine.context.kv_stats()``) is taken without racing a decode. Returns a
        Future of its result (or of its exception). Without a loop thread (:meth:`start` not called,
        or stopping), ``fn`` runs now on the calling thread: then call it from the thread that steps."""
        fut: Future[T] = Future()
        with self._cv:
            if self.alive:
                self._tasks.append((fn, fut))
                self._cv.notify_all()
                return fut
        self._run_tasks([(fn, fut)])
        return fut

    def _keep_checkpoint(self, cont: _Continuation) -> None:
        """A prompt chunk ended: the KV layer keeps a checkpoint when it ended at one of the points."""
        held = len(cont.tokens) - len(cont.pending)
        if held == cont.checkpoints[0]:
            self.kv.checkpoint(cont.seq)
        cont.checkpoints = [p for p in cont.checkpoints if p > held]

    def _run_tasks(self, tasks: list) -> None:
        for fn, fut in tasks:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self))
            except BaseException as exc:   # the asker gets it; the loop goes on
                fut.set_exception(exc)

    def _loop(self, on_step: Callable[[Engine], None] | None = None) -> None:
        def after() -> None:
            if on_step is not None:
                try:
                    on_step(self)
                except Exception:   # an observer's bug must not stop the engine
                    pass

        after()
        while True:
            with self._cv:
                while not self._stopping and not self.has_work() and not self._tasks:
                    self._cv.wait(0.5)
                tasks, self._tasks = self._tasks, []
                stopping = self._stopping
            self._run_tasks(tasks)   # (after stop(): what was asked before is still answered)
            if stopping:
                return
            if not self.has_work():
                continue
            try:
                self.step()
            except Exception as exc:   # never let one bad step end the loop
                self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
            after()

    def stop(self, cancel: bool = True, timeout: float | None = 30.0) -> None:
        """Stop the loop thread: cancel what runs and waits (``cancel``), or finish it first."""
        if not cancel:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.has_work() and (deadline is None or time.monotonic() < deadline):
                if self._thread is None:
                    self.step()
                else:
                    time.sleep(0.01)
        else:
            self._cancel_everything()
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if cancel:
            self._drain_inbox()
            self._cancel_everything(now=True)
        self._send_unsent()

    def close(self) -> None:
        """Stop, cancel everything, and close the context the engine made."""
        if self._closed:
            return
        self.stop(cancel=True)
        self._closed = True
        if self._embeddings is not None:
            self._embeddings.close()
        if self.spec.draft_model is not None:
            self.spec.draft_model.close()
        if self._own_ctx is not None:
            self._own_ctx.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals: inbox, admission -------------------------------------------------------------

    def _drain_inbox(self) -> None:
        with self._cv:
            items = list(self._inbox)
            self._inbox.clear()
        for kind, req in items:
            if kind == "submit":
                if req.cancelled:
                    continue
                self._waiting.append(req)
            else:
                self._cancel_request(req)

    def _cancel_request(self, req: Request) -> None:
        if req.cancelled or req.handle.done:
            return
        req.cancelled = True
        if req in self._waiting:
            self._waiting.remove(req)
        if not req.admitted:   # waiting, or still in the inbox (skipped when drained)
            self._dequeued()
        for cont in [s for s in self._resume if s.req is req]:
            self._resume.remove(cont)
            self._finish(cont, "cancelled", release=False)
        for cont in [s for s in self._continuations if s.req is req]:
            self._finish(cont, "cancelled", keep=False)
        # continuations never started (n > 1 before the fork) end too
        self._end_unstarted(req, "cancelled")

    def _end_unstarted(self, req: Request, reason: str, error: str | None = None) -> None:
        for c in req.handle.completions:
            if c.finish_reason is None and not any(s.req is req and s.index == c.index
                                                   for s in itertools.chain(self._continuations, self._resume)):
                self._emit(req, c.index, "", (), reason, error)

    def _dequeued(self) -> None:
        with self._cv:
            self._n_waiting -= 1

    def _promised(self) -> int:
        """Cells promised to admitted continuations: their prompt tokens still to decode, and what
        is left of their output reserves."""
        return sum(len(s.pending) + max(0, s.reserve - s.generated) for s in self._continuations)

    def _admit(self) -> None:
        # preempted continuations first
        while self._resume:
            cont = self._resume[0]
            if not self._reserve(cont.tokens, 1, max(0, cont.reserve - cont.generated)):
                return
            self._resume.popleft()
            if cont.constraint is not None:   # rebuilt from its tokens, not trusted across the pause
                cont.constraint.replay()
            self._place(cont, cont.tokens)
        # requests in arrival order; a later one may overtake the head when the head does not fit,
        # but only a bounded number of times (the head is not starved by a stream of small ones)
        i = 0
        while i < len(self._waiting) and i < _LOOKAHEAD:
            req = self._waiting[i]
            if i > 0 and self._waiting[0].skipped >= _MAX_OVERTAKES:
                return
            reserve = min(req.max_tokens, self.config.output_reserve)
            if self._waits_for_prefix(req) or not self._reserve(req.prompt, req.n, reserve * req.n):
                i += 1
                continue
            del self._waiting[i]
            if i > 0:
                self._waiting[0].skipped += 1
            self._dequeued()
            req.admitted = True
            self.stats.admitted += 1
            self.stats.prompt_tokens += len(req.prompt)
            order = next(self._admit_counter)
            cont = _Continuation(req, 0, list(req.prompt), self._make_sampler(req, 0), reserve, order)
            self._place(cont, req.prompt)
            req.handle.usage.reused_tokens += len(req.prompt) - len(cont.pending)
            self.stats.reused_tokens += len(req.prompt) - len(cont.pending)

    def _waits_for_prefix(self, req: Request) -> bool:
        """Whether a prompt being evaluated now shares at least _MIN_SHARED more of ``req``'s prompt
        than the cache holds (requests that arrive together with one system prompt): then ``req``
        waits until that prompt is in and remembered, and forks it instead of evaluating it again."""
        if self.config.prefix_cache == 0:
            return False
        toks = req.prompt[:-1]
        shared = max((shared_prefix(s.tokens, toks) for s in self._continuations if s.prefilling), default=0)
        return shared >= _MIN_SHARED and shared >= self.kv.match(req.prompt) + _MIN_SHARED

    def _reserve(self, tokens: list[int], n_ids: int, reserve: int) -> bool:
        """Ask the KV layer for room to start ``tokens`` now with ``reserve`` cells for its output and
        ``n_ids`` ids, beside what running continuations were promised; whether it is there (the KV
        layer evicts idle prefixes for it, by its rule). With nothing running the reserve is a
        target, not a limit: the prompt and one more cell are enough, since nothing else would ever
        free cells for it."""
        ids = n_ids + sum(s.req.n - 1 for s in self._continuations if not s.forked)   # forks still to come
        cells = reserve + self._promised() if self._continuations else 1
        return self.kv.reserve(tokens, cells, ids)

    def _place(self, cont: _Continuation, tokens: list[int]) -> None:
        seq, n = self.kv.start(tokens)
        cont.seq = seq
        cont.pending = list(tokens[n:])
        cont.checkpoints = self.kv.checkpoints_at(tokens, cont.boundaries, n)
        if cont.checkpoints and cont.checkpoints[0] == n:   # the fork ends at a point already
            self.kv.checkpoint(seq)
            del cont.checkpoints[0]
        self._continuations.append(cont)

    # -- internals: batch, decode, sampling ------------------------------------------------------

    def _build_batch(self) -> tuple[dict, dict, dict]:
        """{seq: tokens} of the next decode, {seq: continuation}, and {seq: outputs} for the drafted
        continuations (their next token, then their draft: a row of logits for each)."""
        batch: dict = {}
        owners: dict = {}
        budget = self.n_batch
        gen = [s for s in self._continuations if not s.prefilling and s.pending]
        for s in gen:
            batch[s.seq] = [s.pending[0]]
            owners[s.seq] = s
            budget -= 1
        for s in sorted((s for s in self._continuations if s.prefilling), key=lambda s: s.admit_order):
            if budget <= 0:
                break
            take = min(budget, len(s.pending))
            if s.checkpoints:   # the chunk ends where a checkpoint is kept
                at = len(s.tokens) - len(s.pending)
                take = min(take, max(1, s.checkpoints[0] - at))
            batch[s.seq] = s.pending[:take]
            owners[s.seq] = s
            budget -= take
        outputs = self._drafts(gen, batch, budget) if self.spec.on and gen else {}
        return batch, owners, outputs

    def _decode(self, batch: dict, owners: dict, outputs: dict) -> dict:
        while batch:
            try:
                self.stats.decode_calls += 1
                t = time.perf_counter()
                try:
                    kw: dict = {"outputs": outputs} if outputs else {}
                    if self._in_graph:   # (a sequence's kind is its request's: the graph changes rarely)
                        kw["greedy"] = [seq for seq in batch if owners[seq].req.argmax]
                    if self._unsent:   # pipelined: streamed while the device computes (engine/stream.py)
                        kw["between"] = self._send_unsent
                    out = self.kv.decode(batch, **kw)
                finally:
                    dt = time.perf_counter() - t
                    self.stats.decode_seconds += dt
                return out
            except KVCacheFullError as exc:
                if outputs:   # drafts are the first to go: a draft never preempts anything
                    self._drop_drafts(batch, owners, outputs)
                    continue
                needed = sum(len(t) for t in batch.values())
                if needed <= self.kv.free_cells():
                    done = self._slot_failure(batch, owners, exc)
                    if done is not None:
                        return done
                    continue
                if self.kv.make_room(needed):
                    continue
                victim = self._victim(batch, owners)
                batch.pop(victim.seq)
                self._preempt(victim)
            except LlamaError as exc:
                # a failure that is not about room (compute error, abort): end what was in the batch
                for seq in list(batch):
                    self._finish(owners[seq], "error", error=str(exc), keep=False)
                return {}
        return {}

    def _slot_failure(self, batch: dict, owners: dict, exc: Exception) -> dict | None:
        """The library refused a batch that fits in the free cells (fragmentation, vanilla build):
        the prompts in it fail (None: decode the rest again); a batch of generation tokens only is
        decoded one sequence at a time, and those results are returned."""
        self.stats.slot_failures += 1
        prefill = [seq for seq in batch if owners[seq].prefilling]
        msg = f"no KV cache slot although the free cells suffice (the cache is fragmented): {exc}"
        if prefill:
            for seq in prefill:
                batch.pop(seq)
                self._finish(owners[seq], "cache_full", error=msg, keep=False)
            return None
        # generation only: one sequence at a time; those that still fail end
        results = {}
        for seq in list(batch):
            try:
                self.stats.decode_calls += 1
                results.update(self.kv.decode({seq: batch[seq]}))
            except KVCacheFullError:
                self.stats.slot_failures += 1
                self._finish(owners[seq], "cache_full", error=msg, keep=False)
        return results

    def _victim(self, batch: dict, owners: dict) -> _Continuation:
        """The continuation to preempt: of the most recently admitted request, prompts first."""
        cands = [owners[s] for s in batch]
        return max(cands, key=lambda s: (s.admit_order, s.prefilling, s.index))

    def _preempt(self, cont: _Continuation) -> None:
        self.stats.preempted += 1
        self.spec.forget(cont)
        # what it holds, plus what it has yet to decode, is redone on resume (mostly from cache)
        self.kv.finish(cont.seq, keep=True)
        cont.seq = None
        cont.pending = []
        self._continuations.remove(cont)
        self._resume.appendleft(cont)

    def _after_decode(self, cont: _Continuation) -> None:
        req = cont.req
        if not cont.forked:
            # the prompt is in: remember it for later requests, then fork the other continuations
            self.kv.remember(cont.seq)
            cont.forked = True
            for i in range(1, req.n):
                child = _Continuation(req, i, list(cont.tokens), self._make_sampler(req, i), cont.reserve,
                                      cont.admit_order, cont.boundaries)
                child.seq = self.kv.fork(cont.seq)
                child.logits = cont.logits
                self._continuations.append(child)
                self._sample(child)
        elif cont.last_token is None and cont.generated == 0:
            self.kv.remember(cont.seq)
        self._sample(cont)

    def _sample(self, cont: _Continuation) -> None:
        """Draw the next token from ``cont.logits`` (under its grammar's mask), stream it, and either
        finish the continuation (end of generation, grammar, stop string, length, full context) or
        queue the token for the next decode."""
        req = cont.req
        raw = cont.logits
        assert raw is not None
        cont.logits = None
        if isinstance(raw, int):   # the token itself: the argmax, chosen in the graph (Request.argmax)
            tok = raw
        else:
            logits = self._masked(cont, raw)
            if logits is None:
                return   # (the grammar allowed no token: finished)
            tok = cont.sampler(logits)
        if req.handle.ttft is None:
            req.handle.ttft = time.perf_counter() - req.handle.submitted_at
        if not req.params.ignore_eos and self._is_eog(tok):
            self._finish(cont, "eos")
            return
        con = cont.constraint
        cut = False   # the grammar took the token (its mask allowed it) but can go no further
        if con is not None and not con.accept(tok):
            if not con.at_limit:
                why = f"the sampled token {tok} was not allowed: {con.error}"
                self._finish(cont, "error", error=GRAMMAR_ERROR + why)
                return
            cut = True
        stopped = self._take(cont, tok, raw)
        if cut:   # (a broken matcher is also done: this is not a completed grammar)
            self._finish(cont, "length")
            return
        if stopped or (con is not None and con.done):   # a stop string, or a complete grammar: nothing may follow
            self._finish(cont, "stop")
            return
        self._continue(cont, tok)

    def _masked(self, cont: _Continuation, raw: np.ndarray) -> np.ndarray | None:
        """The logits the sampler sees: ``raw``, or a copy under the grammar's mask (forks share their
        first logits). None when the grammar allows no token: the continuation is finished then, "stop"
        for a complete grammar, "length" at llguidance's parser limits, "error" for a broken matcher."""
        con = cont.constraint
        if con is None:
            return raw
        logits = con.mask(raw)
        if logits is None:
            if con.at_limit:   # llguidance's parser limits: the output is cut here
                self._finish(cont, "length")
                return None
            err = con.error
            self._finish(cont, "error" if err else "stop", error=GRAMMAR_ERROR + err if err else None)
        return logits

    def _continue(self, cont: _Continuation, tok: int) -> None:
        """``tok`` is decoded next, unless the answer reached max_tokens or the context is full and
        cannot shift ("length")."""
        req = cont.req
        if cont.generated >= req.max_tokens:
            self._finish(cont, "length")
            return
        cont.pending = [tok]
        cont.last_token = tok
        # the end of the context: the sequence would hold n_ctx positions after this token
        if len(cont.tokens) >= self.n_ctx and not (req.context_shift and self._shift(cont)):
            self._finish(cont, "length")

    def _finish(self, cont: _Continuation, reason: str, error: str | None = None, keep: bool | None = None,
                release: bool = True) -> None:
        self._send_unsent()   # (what this continuation drew goes before its end)
        req = cont.req
        tail = cont.stream.flush() if reason in ("eos", "length") else ""
        comp = req.handle.completions[cont.index]
        comp.context_tokens = list(cont.tokens)
        comp.boundaries = list(cont.boundaries)
        if release and cont.seq is not None:
            if cont.valid is not None:   # finished inside a verification: the rest of the draft goes
                self.kv.truncate(cont.seq, cont.valid)
            keep = req.keep if keep is None else keep
            self.kv.finish(cont.seq, keep=keep)
            if keep and reason in ("eos", "stop", "length"):
                start = req.handle.usage.reused_tokens if cont.index == 0 else len(req.prompt)
                self.spec.finished(cont.tokens, start - 16)
        cont.seq = None
        self.spec.forget(cont)
        if cont in self._continuations:
            self._continuations.remove(cont)
        if cont.close_sampler is not None:
            cont.close_sampler()
            cont.close_sampler = None
        self._emit(req, cont.index, tail, (), reason, error)
        if not cont.forked:
            # the prompt never completed: the other continuations end the same way
            self._end_unstarted(req, reason, error)

    def _cancel_everything(self, now: bool = False) -> None:
        if self._embeddings is not None:
            self._embeddings.cancel_all()
        with self._cv:
            reqs = [r for k, r in self._inbox if k == "submit"]
        running = {id(s.req): s.req for s in itertools.chain(self._continuations, self._resume)}
        reqs += list(self._waiting) + list(running.values())
        for r in reqs:
            if now:
                self._cancel_request(r)
            else:
                r.handle.cancel()

    def _fail_all(self, msg: str) -> None:
        for cont in list(self._continuations):
            self._finish(cont, "error", error=msg, keep=False)

    def _default_sampler(self, req: Request, index: int):
        return default_sampler(req, index, self.context, self._seed)


def _sample_in_graph(model, config: EngineConfig, kv: KVCache | None, own_sampler: bool) -> bool:
    """Whether argmax requests' tokens are chosen in the graph (``config.backend_sampling``; auto: where
    the library can and the model's layers are on a GPU; never with the caller's own sampler_factory).
    InvalidInputError for on where it cannot."""
    want = config.backend_sampling
    if want is False or (want is None and own_sampler):
        return False
    if own_sampler:
        raise InvalidInputError("backend_sampling chooses greedy tokens in the graph: not with a sampler_factory")
    lib = getattr(model, "native_library", None)
    can = lib is not None and lib.caps.backend_sampling and (kv is None or kv.context is not None)
    if want is None:
        return bool(can and getattr(model, "on_device", False))
    if not can:
        raise InvalidInputError("backend_sampling needs a llama.cpp library that samples in the graph "
                                "(llama_set_sampler: the current pin, --lib current) and the engine's own context")
    return True
