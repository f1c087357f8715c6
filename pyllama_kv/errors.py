"""The exceptions of pyllama_kv. Every error of ours is a :class:`LlamaError`; a failure of an API call
is one of these (or TypeError for an argument of the wrong type).

The tree (the CLI's exit code for each: ``pyllama_kv.cli.main``)::

    LlamaError
      LibraryError          libllama missing, unloadable, or lacking a function
      ModelLoadError        a model file refused or not loadable (catalogue.CatalogueError too)
      GGUFFileError         not GGUF / truncated / unreadable values (also a ValueError)
      InvalidInputError     bad input caught before C (also a ValueError; constrain.GrammarError too)
      KVCacheFullError      no room in the KV cache
      DecodeError           llama_decode failed otherwise
      QueueFullError        the engine's admission queue is full
      HarnessError          fetching, patching, building llama.cpp (VendorError, PatchError, BuildError)
      cli.common.CLIError   the command line's own errors (UsageError: a wrong command line)
"""
from __future__ import annotations


class LlamaError(Exception):
    """Base class of everything the API raises about llama.cpp, a model or a context."""


class LibraryError(LlamaError):
    """libllama could not be found or loaded, or lacks a function the call needs."""


class ModelLoadError(LlamaError):
    """The model file is missing, not GGUF, truncated, refused by validation (pyllama_kv.modelfile.validate:
    a hyperparameter, tensor or vocabulary llama.cpp would crash on, or an architecture other than
    llama), or one llama.cpp cannot load."""


class GGUFFileError(LlamaError, ValueError):
    """Not a GGUF file, a truncated or corrupt one, or one whose values have types that cannot be read
    (pyllama_kv.modelfile.gguf, the GGUF reader). Loading a model turns it into a ModelLoadError. It is also a
    ValueError, as it was before it joined LlamaError, so that callers catching ValueError still do."""


class InvalidInputError(LlamaError, ValueError):
    """Bad input caught before it reached C: token id out of range, empty batch, position or sequence
    out of range, a closed sequence or one from another context."""


class KVCacheFullError(LlamaError):
    """The KV cache has no room for the batch, even after a full defrag. Nothing was changed."""


class DecodeError(LlamaError):
    """llama_decode failed for another reason (aborted, compute error). Nothing was changed."""


class QueueFullError(LlamaError):
    """The engine's admission queue is full: try again later (a server answers 429)."""


class HarnessError(LlamaError):
    """Base class of the build harness's errors (fetching, patching and building llama.cpp:
    VendorError, PatchError, BuildError). Not raised by the runtime API; a LlamaError like every
    error of ours, so that one ``except LlamaError`` catches whatever pyllama_kv reports."""


class BuildError(HarnessError):
    """The build could not be configured or compiled; the message says why and what to do
    (pyllama_kv.harness.build and .cuda)."""
