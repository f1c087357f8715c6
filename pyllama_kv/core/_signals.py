"""Ctrl-C and critical sections: a SIGINT that arrives while the KV cache is half-changed is held
back until the change is complete (or rolled back), then delivered to the handler that was there.

Only the main thread receives Python's signals, so only there is anything deferred. While a signal
is pending, :func:`interrupt_pending` is true: the context's abort callback reads it to stop a long
``llama_decode`` early, so Ctrl-C during a prompt evaluation still answers within a graph node,
and the KeyboardInterrupt is raised once the decode has been rolled back.
"""
from __future__ import annotations

import signal
import threading
from typing import Literal

try:   # the C functions, without the enum conversions of the signal module's wrappers (hot path)
    from _signal import getsignal as _getsignal, signal as _setsignal
except ImportError:  # pragma: no cover
    _getsignal, _setsignal = signal.getsignal, signal.signal
_SIGINT = int(signal.SIGINT)

_depth = 0
_pending: tuple | None = None   # (signum, frame) of a SIGINT held back
_saved = None                   # the handler that was installed before the outermost section


def _hold(signum, frame) -> None:
    global _pending
    _pending = (signum, frame)


def interrupt_pending() -> bool:
    """Whether a SIGINT held back in the current critical section will raise KeyboardInterrupt when
    delivered (the default handler): then a long decode may stop early. A SIGINT for a handler of the
    application's own (a graceful shutdown, say) never aborts a decode; it is delivered after it."""
    return _pending is not None and _saved is signal.default_int_handler


class defer_sigint:
    """``with defer_sigint(): ...`` holds back SIGINT for the block (main thread only; nests)."""

    __slots__ = ("active",)

    def __enter__(self) -> defer_sigint:
        global _depth, _saved
        self.active = threading.current_thread() is threading.main_thread()
        if not self.active:
            return self
        if _depth == 0:
            old = _getsignal(_SIGINT)
            # SIG_IGN / SIG_DFL / a handler installed from C are left alone: nothing to defer
            if callable(old) and old is not _hold:
                _saved = old
                _setsignal(_SIGINT, _hold)
            else:
                _saved = None
        _depth += 1
        return self

    def __exit__(self, *exc) -> Literal[False]:
        global _depth, _pending, _saved
        if not self.active:
            return False
        _depth -= 1
        if _depth == 0 and _saved is not None:
            handler, _saved = _saved, None
            held, _pending = _pending, None
            _setsignal(_SIGINT, handler)
            if held is not None:
                handler(*held)     # the default handler raises KeyboardInterrupt here
        return False
