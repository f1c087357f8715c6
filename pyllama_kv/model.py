"""A loaded GGUF model: vocabulary, sizes, tokenization, and the factory for contexts."""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Iterable, Sequence as _Seq

import numpy as np

from . import _ffi
from .errors import InvalidInputError, LlamaError, ModelLoadError

ffi = _ffi.ffi


def _validate_gguf(path: Path) -> None:
    """Catch what would make llama.cpp abort or misbehave, before it sees the file."""
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if not path.is_file():
        raise ModelLoadError(f"{path}: not a file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc}") from exc
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    # a full structural read (header, metadata, tensor table, data bounds) with gguf's reader
    from .gguf_tools import GGUFFileError, inspect_gguf

    try:
        inspect_gguf(path)
    except GGUFFileError as exc:
        raise ModelLoadError(str(exc)) from None


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
        self.path = Path(path)
        if validate:
            _validate_gguf(self.path)
        if not isinstance(n_gpu_layers, int) or n_gpu_layers < -1:
            raise InvalidInputError("n_gpu_layers must be an int >= -1 (-1: all layers)")
        self._lib = _ffi.load(lib)
        L = self._lib.lib
        params = L.llama_model_default_params()
        params.n_gpu_layers = 2**31 - 1 if n_gpu_layers == -1 else n_gpu_layers
        params.use_mmap = bool(use_mmap)
        with self._lib.lock:
            self._lib.clear_errors()
            ptr = L.llama_model_load_from_file(str(self.path).encode(), params)
            err = self._lib.last_error()
        if ptr == ffi.NULL:
            raise ModelLoadError(f"llama.cpp could not load {self.path}" + (f": {err}" if err else ""))
        self._ptr = ptr
        self._lock = threading.RLock()
        self._contexts: set = set()
        self._vocab = L.llama_model_get_vocab(ptr)
        self.n_vocab: int = L.llama_vocab_n_tokens(self._vocab)
        self.n_layer: int = L.llama_model_n_layer(ptr)
        self.n_ctx_train: int = L.llama_model_n_ctx_train(ptr)
        self.n_embd: int = L.llama_model_n_embd(ptr)
        self.n_head: int = L.llama_model_n_head(ptr)
        self.n_head_kv: int = L.llama_model_n_head_kv(ptr)
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

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._ptr is None

    @property
    def library(self) -> dict:
        """Information about the libllama this model runs on (see pyllama_kv.library_info)."""
        return dict(self._lib.info)

    def close(self) -> None:
        """Free the model. Open contexts are closed first."""
        with self._lock:
            for c in list(self._contexts):
                c.close()
            if self._ptr is not None:
                self._lib.lib.llama_model_free(self._ptr)
                self._ptr = None

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.desc}, n_vocab={self.n_vocab}, n_layer={self.n_layer}"
        return f"<pyllama_kv.Model {self.path.name}: {state}>"

    def _check_open(self) -> None:
        if self._ptr is None:
            raise InvalidInputError("the model is closed")

    # -- vocabulary -----------------------------------------------------------------------------

    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_bos`` adds the BOS token if the model uses one."""
        self._check_open()
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        n_max = len(data) + 8
        L = self._lib.lib
        for _ in range(2):
            buf = ffi.new("llama_token[]", n_max)
            n = L.llama_tokenize(self._vocab, data, len(data), buf, n_max, bool(add_bos), bool(special))
            if n >= 0:
                return list(ffi.unpack(buf, n))
            n_max = -n
        raise LlamaError("llama_tokenize failed")  # pragma: no cover

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
        self._check_open()
        self.check_tokens([token])
        buf = ffi.new("char[64]")
        n = self._lib.lib.llama_token_to_piece(self._vocab, int(token), buf, 64, 0, bool(special))
        if n < 0:
            buf = ffi.new("char[]", -n)
            n = self._lib.lib.llama_token_to_piece(self._vocab, int(token), buf, -n, 0, bool(special))
        return ffi.unpack(buf, n)

    def detokenize(self, tokens: _Seq[int], special: bool = False) -> str:
        """Text of ``tokens`` (invalid UTF-8 is replaced). Ids are validated first."""
        self._check_open()
        arr = self.check_tokens(tokens)
        if arr.size == 0:
            return ""
        cbuf = ffi.from_buffer("llama_token[]", np.ascontiguousarray(arr))
        n_max = max(64, arr.size * 16)
        for _ in range(2):
            out = ffi.new("char[]", n_max)
            n = self._lib.lib.llama_detokenize(self._vocab, cbuf, arr.size, out, n_max, not special, bool(special))
            if n >= 0:
                return ffi.unpack(out, n).decode("utf-8", "replace")
            n_max = -n
        raise LlamaError("llama_detokenize failed")  # pragma: no cover

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS, EOT, ...)."""
        self._check_open()
        return bool(self._lib.lib.llama_vocab_is_eog(self._vocab, int(token)))

    def meta(self, key: str) -> str | None:
        """A metadata value of the GGUF file as a string (None if absent)."""
        self._check_open()
        buf = ffi.new("char[4096]")
        n = self._lib.lib.llama_model_meta_val_str(self._ptr, key.encode(), buf, 4096)
        return None if n < 0 else ffi.string(buf).decode("utf-8", "replace")

    # -- contexts -------------------------------------------------------------------------------

    def context(self, n_ctx: int = 2048, n_seq_max: int = 8, n_batch: int = 512, n_ubatch: int = 512,
                flash_attn: bool = False, type_k: str = "f16", type_v: str = "f16", **kwargs):
        """A new :class:`~pyllama_kv.context.Context` over this model (see its docstring)."""
        from .context import Context

        return Context(self, n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_batch, n_ubatch=n_ubatch,
                       flash_attn=flash_attn, type_k=type_k, type_v=type_v, **kwargs)
