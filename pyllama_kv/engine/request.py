"""What a caller submits to the engine and what comes back: requests, events, handles."""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import SamplingParams

#: why a continuation ended
FINISH_REASONS = ("stop", "length", "eos", "cancelled", "cache_full", "error")
#: how the error of a continuation that ended "error" because its grammar broke starts (the server
#: answers those as the client's fault, naming the field the grammar came from)
GRAMMAR_ERROR = "grammar: "


#: (token id, its log-probability, the top alternatives as (token id, log-probability) pairs)
TokenLogprob = tuple[int, float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class Event:
    """A piece of one continuation's output: a text delta (never a split UTF-8 character, never
    part of a stop string) and the tokens it came from. The last event of a continuation has a
    ``finish_reason`` (and an ``error`` message for "error" and "cache_full")."""

    request_id: int
    index: int                     # which continuation (0 .. n-1)
    text: str
    tokens: tuple[int, ...] = ()
    finish_reason: str | None = None
    error: str | None = None
    #: with ``submit(logprobs=k)``: per token of ``tokens``, (token, logprob, ((token, logprob), ...) of
    #: the k most likely), from the raw distribution (before temperature, truncation and any grammar)
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass
class Completion:
    """One finished continuation."""

    index: int
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    #: the tokens the continuation's sequence held at the end (the prompt as evaluated, less what
    #: truncation and context shifts dropped, then the answer): a next turn that starts with them
    #: reuses the cached cells. None for a continuation that never started.
    context_tokens: list[int] | None = None
    #: the caller's turn boundaries (``submit(boundaries=...)``) as indices into ``context_tokens``
    boundaries: list[int] | None = None
    #: with ``submit(logprobs=k)``: one entry per token of ``tokens`` (see Event.logprobs)
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0        # tokens of the prompt (after truncation: what the model was given)
    reused_tokens: int = 0        # of which served from cached cells (not evaluated)
    completion_tokens: int = 0    # tokens generated, all continuations together
    truncated_tokens: int = 0     # prompt tokens dropped so that the prompt fits the context
    dropped_tokens: int = 0       # tokens dropped by context shifts, all continuations together
    context_shifts: int = 0       # context shifts, all continuations together
    draft_tokens: int = 0         # speculative decoding: drafted tokens verified, all continuations together
    draft_accepted: int = 0       # of which kept (each a step saved)

    @property
    def dropped_total(self) -> int:
        """Every token the model no longer sees: truncated from the prompt or shifted out."""
        return self.truncated_tokens + self.dropped_tokens


class RequestHandle:
    """The caller's side of a submitted request: iterate it for events (blocking), or wait for
    :meth:`result`. Thread-safe; events are produced on the engine's thread. The engine reaches it
    through two hooks only: :meth:`bind_cancel` (at submit) and :meth:`deliver` (each event)."""

    def __init__(self, rid: int, n: int, prompt_tokens: int, on_event: Callable[[Event], None] | None):
        self.id = rid
        self.n = n
        self.usage = Usage(prompt_tokens=prompt_tokens)
        self.completions = [Completion(index=i) for i in range(n)]
        self.ttft: float | None = None            # seconds from submit to the first token
        self.submitted_at = 0.0
        self._on_event = on_event
        self._events: queue.SimpleQueue[Event | None] = queue.SimpleQueue()
        self._done = threading.Event()
        self._open = n
        self._cancel: Callable[[], None] | None = None

    # -- engine side: the two hooks the engine calls (never the caller) --------------------------

    def bind_cancel(self, cancel: Callable[[], None]) -> None:
        """The engine's hook, set once at submit: what :meth:`cancel` calls (it posts a cancellation
        to the engine's loop)."""
        self._cancel = cancel

    def deliver(self, ev: Event) -> None:
        """The engine's hook, called on its thread for each event: fold ``ev`` into its completion,
        queue it for iteration, call ``on_event``, and mark the handle done after the last
        continuation's last event."""
        c = self.completions[ev.index]
        c.text += ev.text
        c.tokens.extend(ev.tokens)
        if ev.logprobs is not None:
            if c.logprobs is None:
                c.logprobs = []
            c.logprobs.extend(ev.logprobs)
        if ev.finish_reason is not None:
            c.finish_reason = ev.finish_reason
            c.error = ev.error
            self._open -= 1
        self._events.put(ev)
        if self._on_event is not None:
            try:
                self._on_event(ev)
            except Exception:   # a consumer's bug must not stop the engine
                pass
        if self._open == 0:
            self._events.put(None)
            self._done.set()

    # -- caller side -----------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop generating: the request finishes with "cancelled" and its cells are freed at the
        engine's next step."""
        if self._cancel is not None and not self.done:
            self._cancel()

    def __iter__(self) -> Iterator[Event]:
        while True:
            ev = self._events.get()
            if ev is None:
                self._events.put(None)   # later iterations end at once
                return
            yield ev

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> list[Completion]:
        """The completions, once every continuation has finished (TimeoutError after ``timeout``)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} has not finished")
        return self.completions

    def __repr__(self) -> str:
        state = "done" if self.done else "running"
        return f"<RequestHandle {self.id} n={self.n} {state}>"


@dataclass
class Request:
    """A request as the engine holds it (built by Engine.submit from an admission.Submission)."""

    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    n: int
    handle: RequestHandle
    keep: bool = True
    context_shift: bool = False   # shift a full sequence instead of finishing it "length"
    n_keep: int = 0               # tokens a shift keeps at the start (already clamped)
    boundaries: list[int] = field(default_factory=list)   # turn starts in ``prompt`` (sorted)
    grammar: Any = None           # a constrain.CompiledGrammar: each continuation gets its own matcher
    logprobs: int | None = None   # report log-probabilities with this many top alternatives
    spec_max: int | None = None   # draft tokens a step at most (None: the engine's spec_max; 0: no speculation)
    admitted: bool = False
    cancelled: bool = False
    skipped: int = 0          # times a later request was admitted before this one

    @property
    def argmax(self) -> bool:
        """Whether its tokens are the argmax of the model's logits alone (greedy; no penalties, logit
        bias, grammar or log-probabilities): what a greedy chain in the graph can choose."""
        p = self.params
        return p.greedy and not p.penalized and self.grammar is None and self.logprobs is None
