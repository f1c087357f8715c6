"""A loaded GGUF model: vocabulary, sizes, tokenization, and the factory for contexts."""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Iterable, Sequence as _Seq

import numpy as np

from ._native import ffi as _ffi
from .errors import InvalidInputError, LlamaError, ModelLoadError

ffi = _ffi.ffi
INT32_MAX = 2**31 - 1
# what the vocabulary functions return when llama.cpp threw an exception (patch 0005)
C_EXCEPTION = -(2**31)


def _validate_gguf(path: Path) -> None:
    """Refuse (ModelLoadError) a file that would make llama.cpp abort or misbehave, before it sees it:
    pyllama_kv.gguf_check.validate_gguf checks the structure, the architecture (llama only), every
    hyperparameter, tensor shape and type, and the vocabulary that the pinned loader and graph
    assert on or divide by, reading only the header and tensor table."""
    from .tools.gguf_check import validate_gguf

    validate_gguf(path)


class Model(_ffi.CResource):
    """A GGUF model loaded into llama.cpp.

    >>> model = Model("tiny.gguf")            # ModelLoadError on a missing/corrupt/unsupported file
    >>> model.n_vocab, model.n_layer, model.n_ctx_train
    >>> toks = model.tokenize("hello")        # [bos, ...]
    >>> with model.context(n_ctx=2048, n_seq_max=8) as ctx: ...

    ``lib`` selects the library: a path, ``"patched"`` / ``"vanilla"``, or None for the default
    (``$PYLLAMA_KV_LIB``, else the patched build). Close with :meth:`close` or ``with``; contexts made
    from a model keep it alive until they close.
    """

    def __init__(self, path: str | os.PathLike, n_gpu_layers: int = 0, *, lib=None,
                 use_mmap: bool = True, validate: bool = True):
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidInputError(f"the model path must be a str or os.PathLike, got {type(path).__name__}")
        self.path = Path(path)
        if "\0" in str(self.path):
            raise ModelLoadError("the model path contains a NUL byte")
        if validate:
            _validate_gguf(self.path)
        if isinstance(n_gpu_layers, bool) or not isinstance(n_gpu_layers, int) or not -1 <= n_gpu_layers <= INT32_MAX:
            raise InvalidInputError("n_gpu_layers must be an int >= -1 (-1: all layers)")
        self._lib = _ffi.load(lib)
        L = self._lib.lib
        params = L.llama_model_default_params()
        params.n_gpu_layers = 2**31 - 1 if n_gpu_layers == -1 else n_gpu_layers
        params.use_mmap = bool(use_mmap)
        with self._lib.lock:
            self._lib.clear_errors()
            ptr = L.llama_model_load_from_file(os.fsencode(self.path), params)
            err = self._lib.last_error()
        if ptr == ffi.NULL:
            raise ModelLoadError(f"llama.cpp could not load {self.path}" + (f": {err}" if err else ""))
        self._ptr = ptr
        self._lock = threading.RLock()
        # the identity a saved sequence state is checked against (the file as loaded now)
        from . import state as _state

        _state.model_fingerprint(self)
        self._contexts: set = set()
        self._vocab = L.llama_model_get_vocab(ptr)
        self.n_vocab: int = L.llama_vocab_n_tokens(self._vocab)
        self.n_layer: int = L.llama_model_n_layer(ptr)
        self.n_ctx_train: int = L.llama_model_n_ctx_train(ptr) & 0xFFFFFFFF   # a uint32 in the file
        self.n_embd: int = L.llama_model_n_embd(ptr)
        self.n_head: int = L.llama_model_n_head(ptr)
        self.n_head_kv: int = L.llama_model_n_head_kv(ptr)
        self.head_dim_k: int = self._head_dim("key_length")    # K and V head sizes (a quantized
        self.head_dim_v: int = self._head_dim("value_length")  # cache needs whole blocks)
        self.bos: int = L.llama_vocab_bos(self._vocab)
        self.eos: int = L.llama_vocab_eos(self._vocab)
        self.add_bos: bool = bool(L.llama_vocab_get_add_bos(self._vocab))
        self.rope_type: int = int(L.llama_model_rope_type(ptr))
        self.has_encoder: bool = bool(L.llama_model_has_encoder(ptr))
        buf = ffi.new("char[256]")
        L.llama_model_desc(ptr, buf, 256)
        self.desc: str = ffi.string(buf).decode("utf-8", "replace")
        self.size: int = int(L.llama_model_size(ptr))
        self.n_params: int = int(L.llama_model_n_params(ptr))
        self.n_gpu_layers = n_gpu_layers

    def _head_dim(self, key: str) -> int:
        arch = self.meta("general.architecture") or ""
        v = self.meta(f"{arch}.attention.{key}")
        try:
            return int(v) if v is not None else self.n_embd // max(1, self.n_head)
        except ValueError:
            return self.n_embd // max(1, self.n_head)

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._ptr is None

    @property
    def library(self) -> dict:
        """Information about the libllama this model runs on (see pyllama_kv.library_info)."""
        return dict(self._lib.info)

    def close(self) -> None:
        """Free the model. Open contexts are closed first (each under its own lock, so a context
        that is decoding finishes first; from a context's abort callback this raises
        InvalidInputError and the model stays open)."""
        if getattr(self, "_ptr", None) is None:
            return
        while True:
            with self._lock:
                if self._ptr is None:
                    return
                ctxs = list(self._contexts)
                if not ctxs:
                    self._lib.lib.llama_model_free(self._ptr)
                    self._ptr = None
                    return
            for c in ctxs:   # outside the model lock: a context's lock is always taken first
                c.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.desc}, n_vocab={self.n_vocab}, n_layer={self.n_layer}"
        return f"<pyllama_kv.Model {self.path.name}: {state}>"

    def _check_open(self) -> None:
        if self._ptr is None:
            raise InvalidInputError("the model is closed")

    # -- vocabulary -----------------------------------------------------------------------------

    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text`` (str, or UTF-8 bytes); ``add_bos`` adds the BOS token if the model
        uses one. Text the vocabulary cannot represent raises InvalidInputError."""
        if isinstance(text, str):
            data = text.encode("utf-8", "surrogatepass")
        elif isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
        else:
            raise InvalidInputError(f"tokenize needs str or bytes, got {type(text).__name__}")
        if len(data) > INT32_MAX // 2:
            raise InvalidInputError(f"text of {len(data)} bytes is too long to tokenize")
        n_max = len(data) + 8
        with self._lock:
            self._check_open()
            L = self._lib.lib
            for _ in range(2):
                buf = ffi.new("llama_token[]", n_max)
                self._lib.clear_errors()
                n = L.llama_tokenize(self._vocab, data, len(data), buf, n_max, bool(add_bos), bool(special))
                if n >= 0:
                    return list(ffi.unpack(buf, n))
                if n == C_EXCEPTION:
                    raise InvalidInputError(f"the vocabulary cannot tokenize this text: {self._lib.last_error() or 'llama.cpp failed'}")
                n_max = -n
        raise LlamaError("llama_tokenize failed")  # pragma: no cover

    def _token_id(self, token, what: str = "token") -> int:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
            raise InvalidInputError(f"{what} id must be an integer, got {type(token).__name__}")
        t = int(token)
        if not 0 <= t < self.n_vocab:
            raise InvalidInputError(f"{what} id {t} is out of range [0, {self.n_vocab})")
        return t

    def check_tokens(self, tokens: Iterable[int], what: str = "token") -> np.ndarray:
        """``tokens`` as an int32 array, or InvalidInputError if any id is out of range."""
        if isinstance(tokens, (str, bytes)):
            raise InvalidInputError(f"{what} ids must be integers, got {type(tokens).__name__} (tokenize text first)")
        try:
            arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(list(tokens))
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"{what} ids must be integers: {exc}") from None
        if arr.ndim != 1:
            raise InvalidInputError(f"{what} ids must be a flat sequence of integers")
        if arr.size and arr.dtype.kind not in "iu":
            raise InvalidInputError(f"{what} ids must be integers, got {arr.dtype} values")
        if arr.size:
            bad = (arr < 0) | (arr >= self.n_vocab)
            if bad.any():
                i = int(np.argmax(bad))
                raise InvalidInputError(f"{what} id {int(arr[i])} at index {i} is out of range [0, {self.n_vocab})")
        return arr.astype(np.int32, copy=False)

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character)."""
        t = self._token_id(token)
        with self._lock:
            self._check_open()
            buf = ffi.new("char[64]")
            n = self._lib.lib.llama_token_to_piece(self._vocab, t, buf, 64, 0, bool(special))
            if n < 0 and n != C_EXCEPTION:
                buf = ffi.new("char[]", -n)
                n = self._lib.lib.llama_token_to_piece(self._vocab, t, buf, -n, 0, bool(special))
            if n < 0:
                raise LlamaError(f"llama_token_to_piece failed for token {t}: {self._lib.last_error()}")
            return ffi.unpack(buf, n)

    def detokenize(self, tokens: _Seq[int], special: bool = False) -> str:
        """Text of ``tokens`` (invalid UTF-8 is replaced). Ids are validated first."""
        arr = self.check_tokens(tokens)
        if arr.size == 0:
            return ""
        if arr.size > INT32_MAX // 64:
            raise InvalidInputError(f"{arr.size} tokens are too many to detokenize at once")
        arr = np.ascontiguousarray(arr)
        cbuf = ffi.from_buffer("llama_token[]", arr)
        n_max = max(64, arr.size * 16)
        with self._lock:
            self._check_open()
            for _ in range(2):
                out = ffi.new("char[]", n_max)
                n = self._lib.lib.llama_detokenize(self._vocab, cbuf, arr.size, out, n_max, not special, bool(special))
                if n >= 0:
                    return ffi.unpack(out, n).decode("utf-8", "replace")
                if n == C_EXCEPTION:
                    break
                n_max = -n
        raise LlamaError(f"llama_detokenize failed: {self._lib.last_error()}")

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS, EOT, ...)."""
        t = self._token_id(token)
        with self._lock:
            self._check_open()
            return bool(self._lib.lib.llama_vocab_is_eog(self._vocab, t))

    def meta(self, key: str) -> str | None:
        """A metadata value of the GGUF file as a string (None if absent; arrays are abridged by
        llama.cpp)."""
        if not isinstance(key, str):
            raise InvalidInputError(f"meta key must be a str, got {type(key).__name__}")
        k = key.encode("utf-8", "surrogatepass")
        if b"\0" in k:
            raise InvalidInputError("meta key must not contain NUL")
        size = 4096
        with self._lock:
            self._check_open()
            for _ in range(2):
                buf = ffi.new("char[]", size)
                n = self._lib.lib.llama_model_meta_val_str(self._ptr, k, buf, size)
                if n < 0:
                    return None
                if n < size:
                    return ffi.unpack(buf, n).decode("utf-8", "replace")
                size = n + 1
        return ffi.string(buf).decode("utf-8", "replace")  # pragma: no cover

    # -- contexts -------------------------------------------------------------------------------

    def context(self, n_ctx: int = 2048, n_seq_max: int = 8, n_batch: int = 512, n_ubatch: int = 512,
                flash_attn: bool = False, type_k: str = "f16", type_v: str = "f16", **kwargs):
        """A new :class:`~pyllama_kv.context.Context` over this model (see its docstring)."""
        from .context import Context

        return Context(self, n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_batch, n_ubatch=n_ubatch,
                       flash_attn=flash_attn, type_k=type_k, type_v=type_v, **kwargs)
