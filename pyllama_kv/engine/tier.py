"""Deprecated (issue 31): the engine's old names for the prefix cache and its tiers, which live in
:mod:`pyllama_kv.prefixcache` (the engine's KV layer holds a :class:`~pyllama_kv.prefixcache.cache.PrefixCache`
itself). Each name here warns and is the prefix-cache layer's own object; this module goes in the next
release. ``PagingPrefixCache`` is :class:`~pyllama_kv.prefixcache.cache.PrefixCache` (its arguments were
PrefixCache's, in the same order: ``ctx, max_sequences, cache_ram, cache_dir, cache_dir_mib``)."""
from __future__ import annotations

import importlib
import warnings

from ..prefixcache.tiers import TierStats

#: old name -> (module, name) of the new home
_MOVED = {
    "PagingPrefixCache": ("pyllama_kv.prefixcache.cache", "PrefixCache"),
    "SpanTrie": ("pyllama_kv.prefixcache.tiers", "SpanTrie"),
    "Tiers": ("pyllama_kv.prefixcache.tiers", "Tiers"),
    "can_restore": ("pyllama_kv.prefixcache.tiers", "can_restore"),
}

# TierStats stays a plain re-export, without a warning, while engine/scheduler.py imports it from here
__all__ = ["TierStats"]


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, new = _MOVED[name]
    warnings.warn(f"{__name__}.{name} has moved to {module}.{new}; the old name works until the next release",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), new)
