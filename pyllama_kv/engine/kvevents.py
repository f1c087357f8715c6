"""The engine's KV events: what its prefix cache stores and drops, as vLLM's block events
(:mod:`pyllama_kv.prefixcache.events` defines the blocks, the hashes and the media).

``KVEventSource(engine, block_size).poll()`` returns the events since its last call; call it on the
engine's loop thread (``Engine.start(on_step=...)``, after every step) or between steps. A reading is
taken only when the cache's change key moved (an admission, a finished request, a page-out, an
eviction): most steps cost one tuple comparison.
"""
from __future__ import annotations

from ..prefixcache.events import BlockLedger, KVEvent, from_wire, to_wire

__all__ = ["KVEventSource", "from_wire", "to_wire"]


class KVEventSource:
    """The events of one engine's prefix cache (see the module docstring)."""

    def __init__(self, engine, block_size: int):
        self.engine = engine
        self.ledger = BlockLedger(block_size)
        self._key: tuple | None = None

    def poll(self) -> list[KVEvent]:
        """The events since the last call ([] when nothing changed; the first call starts with
        AllBlocksCleared). On the loop thread or between steps only."""
        holdings = getattr(self.engine.kv, "holdings", None)
        key, read = holdings() if holdings is not None else ((), dict)   # no prefix cache: nothing held
        if key == self._key:
            return []
        self._key = key
        return self.ledger.update(read())
