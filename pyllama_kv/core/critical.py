"""A context's critical section: its re-entrant lock, with Ctrl-C held back while the section runs
and re-entry from a callback refused (``with ctx.critical():``).

:class:`LockState` is the state the section reads and writes, owned by one context: the lock, whether
the context is inside a C call that may call back into Python (``busy``: decode, update), and how
deep the thread holding the lock is nested (``depth``). :class:`Critical` is one entry into it.
"""
from __future__ import annotations

import threading

from ..errors import InvalidInputError
from . import _signals

__all__ = ["Critical", "LockState"]


class LockState:
    """A context's lock and the two facts about it that its critical sections check."""

    __slots__ = ("lock", "busy", "depth")

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.busy = False   # inside a C call that may call back into Python (decode, update)
        self.depth = 0      # nesting of critical sections on the thread holding the lock


class Critical:
    """One entry into a context's critical section: the lock, Ctrl-C held back, re-entrant calls from
    a callback refused."""

    __slots__ = ("state", "sig")

    def __init__(self, state: LockState):
        self.state = state
        self.sig: _signals.defer_sigint | None = None

    def __enter__(self) -> None:
        st = self.state
        st.lock.acquire()
        if st.busy:
            st.lock.release()
            raise InvalidInputError(
                "the context is inside llama_decode: it cannot be used from its own abort callback "
                "(or log handler, or decode's between) on the decoding thread")
        st.depth += 1
        if st.depth > 1:   # nested on this thread: the outer section holds Ctrl-C back already
            self.sig = None
            return
        self.sig = _signals.defer_sigint()
        self.sig.__enter__()

    def __exit__(self, *exc) -> None:
        try:
            self.state.depth -= 1
            self.state.lock.release()
        finally:
            if self.sig is not None:
                self.sig.__exit__(*exc)   # delivers a held-back Ctrl-C, now that the state is whole
