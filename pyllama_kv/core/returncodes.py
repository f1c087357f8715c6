"""``llama_decode``'s return code -> the exception the package raises (pure: the context gathers
what the message needs and raises the result, after rolling the decode back).

llama.cpp's codes: 1 no slot for the batch (the cache is full even after the patched build's defrag
and retry), 2 aborted by the abort callback, -1 an invalid batch, anything else a compute error.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from ..errors import DecodeError, InvalidInputError, KVCacheFullError
from . import _signals

if TYPE_CHECKING:
    from .kvstats import KVStats

__all__ = ["decode_error"]


def decode_error(rc: int, err: str | None, *, stats: Callable[[], KVStats], patched: bool,
                 abort_exc: BaseException | None) -> BaseException:
    """The exception for return code ``rc`` (not 0). ``err``: llama.cpp's last error line; ``stats``:
    the cache's stats now (read only for a full cache); ``abort_exc``: what the user's abort callback
    raised, if it did (a KeyboardInterrupt or SystemExit is returned as it is, to be re-raised);
    ``patched``: whether the library places a batch whenever enough cells are free (the patched
    build's defrag-and-retry, the current library's non-contiguous placement: ``caps.slot_retry``)."""
    if rc == 1:
        st = stats()
        return KVCacheFullError(
            f"no room in the KV cache for the batch ({st.free_cells} of {st.n_cells} cells free, largest free "
            f"block {st.largest_free_block}{'' if patched else '; this library does not defragment'})"
        )
    if rc == 2:
        if abort_exc is not None:
            if not isinstance(abort_exc, Exception):   # KeyboardInterrupt, SystemExit: re-raised as is
                return abort_exc
            exc = DecodeError(f"decode aborted: the abort callback raised {type(abort_exc).__name__}: {abort_exc}; "
                              "nothing was changed")
            exc.__cause__ = abort_exc
            return exc
        if _signals.interrupt_pending():
            return DecodeError("decode interrupted (Ctrl-C); nothing was changed")
        return DecodeError("decode aborted by the abort callback; nothing was changed")
    if rc == -1:
        return InvalidInputError(f"llama_decode rejected the batch: {err or 'invalid input'}")
    return DecodeError(f"llama_decode failed with code {rc}" + (f": {err}" if err else ""))
