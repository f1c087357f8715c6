"""pyllama_kv: many sequences at once over a patched llama.cpp KV cache.

>>> import pyllama_kv as pk
>>> model = pk.Model("model.gguf")
>>> with model.context(n_ctx=2048, n_seq_max=8) as ctx:
...     a = ctx.new_sequence()
...     logits = a.extend(model.tokenize("Once upon a time"))
...     b = a.fork()                          # prefix copy: shares a's cells
...     out = ctx.decode({a: [42], b: [7]})   # one llama_decode for both
...     ctx.kv_stats()
"""
from __future__ import annotations

import importlib as _importlib
import typing as _typing

# The public names, imported on first use (PEP 562): `import pyllama_kv` alone loads no numpy, cffi
# or C library, so the CLI starts fast and the harness (vendor/patch/build, standard library only)
# runs where nothing else is installed yet, as in a package build's isolated environment.
_LAZY = {
    "library_info": "._native.ffi",
    "Checkpoint": ".core.checkpoint",
    "Context": ".core.context", "KVStats": ".core.context",
    "ChatTemplate": ".chat.conversation", "Conversation": ".chat.conversation",
    "DecodeError": ".errors", "GGUFFileError": ".errors", "InvalidInputError": ".errors", "KVCacheFullError": ".errors",
    "LibraryError": ".errors", "LlamaError": ".errors", "ModelLoadError": ".errors",
    "Model": ".core.model",
    "PrefixCache": ".prefixcache.cache",
    "Sampler": ".sampling.sampler",
    "Sequence": ".core.sequence", "SequenceState": ".core.sequence",
    "Span": ".core.span",
}

if _typing.TYPE_CHECKING:
    from ._native.ffi import library_info
    from .chat.conversation import ChatTemplate, Conversation
    from .core.checkpoint import Checkpoint
    from .core.context import Context, KVStats
    from .core.model import Model
    from .core.sequence import Sequence, SequenceState
    from .core.span import Span
    from .errors import (
        DecodeError,
        GGUFFileError,
        InvalidInputError,
        KVCacheFullError,
        LibraryError,
        LlamaError,
        ModelLoadError,
    )
    from .prefixcache.cache import PrefixCache
    from .sampling.sampler import Sampler


def __getattr__(name: str) -> _typing.Any:
    if name == "__version__":   # importlib.metadata is slow to import: read on first use
        value = globals()["__version__"] = _version()
        return value
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


def _version() -> str:
    """The installed distribution's version (pyproject.toml is the one place it is written); in a
    source tree that was never installed, read from that pyproject.toml."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pyllama-kv")
    except PackageNotFoundError:
        import re
        from pathlib import Path

        try:
            text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
        except OSError:
            return "0+unknown"
        m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.MULTILINE)
        return m.group(1) if m else "0+unknown"


if _typing.TYPE_CHECKING:
    __version__: str

__all__ = [
    "ChatTemplate", "Checkpoint", "Context", "Conversation", "DecodeError", "GGUFFileError", "InvalidInputError",
    "KVCacheFullError", "KVStats", "LibraryError", "LlamaError", "Model", "ModelLoadError", "PrefixCache", "Sampler",
    "Sequence", "SequenceState", "Span", "library_info", "__version__",
]
