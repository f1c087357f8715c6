"""The engine's name for the prefix cache's tiers, which live in the prefix-cache layer
(:mod:`pyllama_kv.prefixcache.tiers`, :mod:`pyllama_kv.prefixcache.spanfile`,
:class:`pyllama_kv.prefixcache.cache.PrefixCache`): the engine imports it, never the reverse."""
from __future__ import annotations

import os

from ..prefixcache.cache import PrefixCache
from ..prefixcache.tiers import SpanTrie, Tiers, TierStats, can_restore

__all__ = ["PagingPrefixCache", "SpanTrie", "TierStats", "Tiers", "can_restore"]


class PagingPrefixCache(PrefixCache):
    """A :class:`~pyllama_kv.prefixcache.cache.PrefixCache` with the engine's argument order: ``cache_ram_mib``
    MiB of host memory for paged-out prefixes, and an optional ``cache_dir``."""

    def __init__(self, ctx, max_sequences: int | None, cache_ram_mib: int,
                 cache_dir: str | os.PathLike | None = None, cache_dir_mib: int = 1024):
        super().__init__(ctx, max_sequences=max_sequences, cache_ram=cache_ram_mib, cache_dir=cache_dir,
                         cache_dir_mib=cache_dir_mib)
