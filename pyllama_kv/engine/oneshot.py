"""Requests served one at a time in the calling thread: a context, the KV policy over it and an
engine, made from one :class:`~pyllama_kv.config.EngineConfig` and closed together.

What `pyllama-kv run`, `chat` and `demo` share: each makes an :class:`EngineSession`, submits a
request, steps the engine until the request is done (rendering its events after each step), and
closes everything, also when Ctrl-C stops it. A server runs the engine on its own thread instead
(:meth:`Engine.start <pyllama_kv.engine.Engine.start>`).

>>> with EngineSession(model, EngineConfig(n_ctx=2048, parallel=4, prefix_cache=0), hold=True) as s:
...     h = s.generate(model.tokenize("Once upon a time"), GREEDY, max_tokens=32, n=4,
...                    on_events=lambda evs: print("".join(e.text for e in evs), end=""))
...     stats = s.ctx.kv_stats()      # the answers' cells are still held: hold=True
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from ..config import EngineConfig, SamplingParams
from .kv import ContextKV, HoldingKV, context_kv
from .request import Event, RequestHandle
from .scheduler import Engine

__all__ = ["EngineSession"]


class EngineSession:
    """A context made from ``config`` (``config.context()``), the KV policy over it and an engine.

    ``hold``: finished sequences keep their cells until :meth:`close` (the engine may still take
    them back when it needs room), for a caller that reads the cache after its request (the
    summary of `run`, the stats of the demo); otherwise finished sequences are freed, or kept in the
    prefix cache (``config.prefix_cache``, ``config.cache_ram``) for the next request to reuse (chat).

    Not thread-safe: the calling thread submits and steps. :meth:`close` (or ``with``) closes the
    engine and the context; the model stays open."""

    def __init__(self, model, config: EngineConfig, *, hold: bool = False, draft_model=None):
        self.model = model
        self.config = config
        self.ctx = model.context(**config.context().context_kwargs())
        try:
            self.kv: ContextKV = context_kv(self.ctx, config, hold=hold)
            self.engine = Engine(model, config, kv=self.kv, draft_model=draft_model)
        except BaseException:
            self.ctx.close()
            raise
        self._events: list[Event] = []
        self._closed = False

    def submit(self, prompt: Sequence[int] | str, params: SamplingParams | None = None, **kwargs) -> RequestHandle:
        """Queue a request (:meth:`Engine.submit <pyllama_kv.engine.Engine.submit>`'s arguments, but
        ``on_event``): its events are collected for :meth:`run`. Nothing is decoded until then."""
        if "on_event" in kwargs:
            raise TypeError("EngineSession.submit takes no on_event: give run() an on_events")
        return self.engine.submit(prompt, params, on_event=self._events.append, **kwargs)

    def run(self, handle: RequestHandle, on_events: Callable[[list[Event]], None] | None = None) -> RequestHandle:
        """Step the engine until ``handle`` is done; after each step that produced events, call
        ``on_events`` with them (in order). A KeyboardInterrupt (Ctrl-C) propagates between or inside
        steps: ``handle`` then holds what was done, and :meth:`close` cancels the rest."""
        while not handle.done:
            self.engine.step()
            if self._events:
                batch, self._events[:] = self._events[:], []
                if on_events is not None:
                    on_events(batch)
        if self._events:   # the last step's events, if the handle finished before they were passed
            batch, self._events[:] = self._events[:], []
            if on_events is not None:
                on_events(batch)
        return handle

    def generate(self, prompt: Sequence[int] | str, params: SamplingParams | None = None, *,
                 on_events: Callable[[list[Event]], None] | None = None, **kwargs) -> RequestHandle:
        """:meth:`submit` then :meth:`run`: one request served to the end; its handle."""
        return self.run(self.submit(prompt, params, **kwargs), on_events)

    def forget(self) -> None:
        """Free the cells of every cached (idle) sequence: the prefix cache is emptied."""
        self.kv.cache.clear()

    def close(self) -> None:
        """Cancel what runs, free what is held and cached, close the engine and the context."""
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.close()
            if isinstance(self.kv, HoldingKV):
                self.kv.release()
            self.forget()
        finally:
            self.ctx.close()

    def __enter__(self) -> EngineSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
