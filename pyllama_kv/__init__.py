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

from ._native.ffi import library_info
from .context import Context, KVStats
from .errors import (DecodeError, InvalidInputError, KVCacheFullError, LibraryError, LlamaError,
                     ModelLoadError)
from .model import Model
from .prefix import PrefixCache
from .sampling import Sampler
from .sequence import Sequence, SequenceState

__version__ = "0.1.0"

__all__ = [
    "Context", "DecodeError", "InvalidInputError", "KVCacheFullError", "KVStats", "LibraryError", "LlamaError",
    "Model", "ModelLoadError", "PrefixCache", "Sampler", "Sequence", "SequenceState", "library_info", "__version__",
]
