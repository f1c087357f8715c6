"""Streaming a continuation's tokens, a base of :class:`~pyllama_kv.engine.scheduler.Engine` (one
object, whose ``__init__`` sets what is declared here): each generated token is counted, its text
(a stop string included) and log-probabilities go to the request's handle as an event.

**The pipelined loop** (``EngineConfig.pipeline``). On a GPU ``llama_decode`` returns once the graph is
queued, and the device computes while the host goes on until it reads an output. With the pipeline on,
a step's tokens are counted and decoded next as before, but their text and events are sent while the
next step's graph runs (``Context.decode``'s ``between``): the text stream, the events and what the
handles' consumers do with them (a server's queues) overlap the device. Only tokens of a request
without stop strings wait so (a stop string is the one decision that depends on the text: those are
streamed at once), so the tokens, texts and finish reasons are the serial loop's; an event of a token
comes before any later event of its continuation (a finish sends what waits first). On the CPU the
decode has run when it returns, so the wait would add a step to the stream's latency: auto is on only
where the model's layers are on a GPU."""
from __future__ import annotations

from typing import Callable

import numpy as np

from .continuation import Continuation, EngineStats, token_logprobs
from .request import Event, Request


class Streaming:
    """The loop's streaming (written by the one loop, like the rest of the engine)."""

    stats: EngineStats
    _piece: Callable[[int], bytes]
    _pipelined: bool
    _unsent: list   # [(continuation, token, logprobs)]: counted, not streamed yet (pipelined)

    def _take(self, cont: Continuation, tok: int, raw: np.ndarray | int) -> bool:
        """Count ``tok`` as generated and stream its text (with its log-probabilities when asked),
        now or, pipelined, during the next decode; whether a stop string ended the text."""
        req = cont.req
        cont.generated += 1
        self.stats.generated_tokens += 1
        req.handle.usage.completion_tokens += 1
        cont.tokens.append(tok)   # (not decoded yet: pending, or the end of a finished answer)
        lps = None
        if req.logprobs is not None and not isinstance(raw, int):   # (an argmax request asks none)
            lps = (token_logprobs(raw, tok, req.logprobs),)   # (now: the logits are the decode's until the next)
        if self._pipelined and not req.stop:
            self._unsent.append((cont, tok, lps))
            return False
        return self._send(cont, tok, lps)

    def _send(self, cont: Continuation, tok: int, lps: tuple | None) -> bool:
        text, stopped = cont.stream.feed(self._piece(tok))
        self._emit(cont.req, cont.index, text, (tok,), None, logprobs=lps)
        return stopped

    def _send_unsent(self) -> None:
        """Stream the tokens that wait (in the order they were drawn)."""
        while self._unsent:
            items, self._unsent = self._unsent, []
            for cont, tok, lps in items:
                self._send(cont, tok, lps)

    def _emit(self, req: Request, index: int, text: str, tokens: tuple, reason: str | None,
              error: str | None = None, logprobs: tuple | None = None) -> None:
        if reason is not None:
            self.stats.finished[reason] += 1
        req.handle.deliver(Event(req.handle.id, index, text, tuple(tokens), reason, error, logprobs))
