"""The exceptions of pyllama_kv's API. Every failure of a call is one of these (or TypeError)."""
from __future__ import annotations


class LlamaError(Exception):
    """Base class of everything the API raises about llama.cpp, a model or a context."""


class LibraryError(LlamaError):
    """libllama could not be found or loaded, or lacks a function the call needs."""


class ModelLoadError(LlamaError):
    """The model file is missing, not GGUF, truncated, refused by validation (pyllama_kv.gguf_check:
    a hyperparameter, tensor or vocabulary llama.cpp would crash on, or an architecture other than
    llama), or one llama.cpp cannot load."""


class InvalidInputError(LlamaError, ValueError):
    """Bad input caught before it reached C: token id out of range, empty batch, position or sequence
    out of range, a closed sequence or one from another context."""


class KVCacheFullError(LlamaError):
    """The KV cache has no room for the batch, even after a full defrag. Nothing was changed."""


class DecodeError(LlamaError):
    """llama_decode failed for another reason (aborted, compute error). Nothing was changed."""


class QueueFullError(LlamaError):
    """The engine's admission queue is full: try again later (a server answers 429)."""


class HarnessError(Exception):
    """Base class of the build harness's errors (fetching, patching and building llama.cpp:
    VendorError, PatchError, BuildError). Not raised by the runtime API."""
