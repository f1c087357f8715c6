"""Sampling: llama.cpp's sampler chain over a context (``sampler``: :class:`Sampler`, public as
``pk.Sampler``), its penalties and logit bias (``penalties``), grammars that constrain the output
(``grammar``: llguidance; ``grammar_check``: the bounds and the worker job that keep a hostile
grammar from crashing or stalling the caller), and log-probabilities.

May import: ``core``, ``_native``, ``config``, ``limits``, ``errors``. Imported by ``chat``
(tool grammars), ``engine``, ``server`` and the CLI.

``pyllama_kv.sampling.Sampler`` (and the module's other names) work as before the move."""
from __future__ import annotations

import importlib as _importlib
import typing as _typing

_SAMPLER = ("Sampler", "add_sampling_stages")
__all__ = ["Sampler", "add_sampling_stages"]

if _typing.TYPE_CHECKING:
    from .sampler import Sampler, add_sampling_stages


def __getattr__(name: str) -> _typing.Any:
    if name in _SAMPLER:
        value = getattr(_importlib.import_module(".sampler", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
