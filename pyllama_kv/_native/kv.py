"""The one thin layer that calls llama.cpp: every ``llama_*`` function the API uses, one method each.

The classes here own the C pointers (a model, a context, the batch arrays; a sampler chain's are
in sampler.py) and convert between cffi and Python/numpy. They validate nothing and decide nothing:
the API modules (model.py, context.py, sequence.py, sampling.py, state.py) check every argument
before calling in, and map return codes to exceptions. Nothing outside ``_native`` touches ``ffi`` or a ``llama_*``
function.

``NativeContext.L`` is the cffi library its calls go through; a benchmark may replace it with a
wrapper that times ``llama_decode`` (scripts/bench_binding.py).

Two API generations (see ffi.py): every object uses its library's ``ffi``, and the KV methods of
:class:`NativeContext` map onto the mission pin's ``llama_kv_self_*`` or, in :class:`CurrentContext`,
onto the current pin's ``llama_memory_*``. The current library has no cell view: a
:class:`~pyllama_kv._native.cells.CellShadow` mirrors which sequences hold which cells from the
calls that change them, so that ``used_cells`` and ``view`` answer alike on both (the view's cell
order is not the cache's there: ``caps.cell_view`` is False).
"""
from __future__ import annotations

import struct
from typing import Any, Callable, NamedTuple

import numpy as np

from ..errors import InvalidInputError, LibraryError
from .cells import CellShadow
from .ffi import Caps, CResource, Library, _callback_error, ffi, library_info, load
from .sampler import NativeSampler

__all__ = ["Caps", "CResource", "Library", "library_info", "load_library", "rpc_devices", "ModelInfo",
           "NativeModel", "NativeBatch", "NativeContext", "CurrentContext"]

_allocators: dict[int, Any] = {}


def _alloc(ffi_: Any, ctype: str, n: int) -> Any:
    """An uncleared ``ctype`` array of ``n`` from ``ffi_`` (one allocator per API generation's FFI)."""
    a = _allocators.get(id(ffi_))
    if a is None:
        a = _allocators[id(ffi_)] = ffi_.new_allocator(should_clear_after_alloc=False)
    return a(ctype, n)


def _written(ffi_: Any, size: int, write: Callable[[Any], int]) -> tuple[int, memoryview]:
    """``write(buffer)`` into a new numpy buffer of ``size`` bytes (numpy's large buffers take huge
    pages, so the first touch of a fresh one is cheap): (what it returned, a read-only view of the
    buffer, which keeps it alive)."""
    arr = np.empty(size, dtype=np.uint8)
    got = int(write(ffi_.from_buffer("uint8_t[]", arr)))
    arr.flags.writeable = False
    return got, arr.data


def load_library(lib=None) -> Library:
    """The loaded libllama for ``lib`` (a path, "patched", "vanilla" or None: see ffi.load)."""
    return load(lib)


def rpc_devices(lib: Library, endpoints: list[str]) -> Any | None:
    """The RPC devices of ``endpoints`` ("host:port", already checked) as the NULL-terminated
    ``ggml_backend_dev_t[]`` that llama_model_params.devices takes, made as common/arg.cpp
    add_rpc_devices makes them (the RPC registry's ggml_backend_rpc_add_device; they are not
    registered globally, so other models do not use them). None: the library has no RPC backend.
    Nothing is connected here: llama_model_load_from_file connects."""
    L, ffi = lib.lib, lib.ffi
    with lib.lock:
        reg = L.ggml_backend_reg_by_name(b"RPC")
        if reg == ffi.NULL:
            return None
        fn = L.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_device")
        if fn == ffi.NULL:
            return None
        add_device = ffi.cast("ggml_backend_dev_t (*)(const char *)", fn)
        devs = ffi.new("ggml_backend_dev_t[]", len(endpoints) + 1)   # the last stays NULL
        for i, ep in enumerate(endpoints):
            devs[i] = add_device(ep.encode())
            if devs[i] == ffi.NULL:  # pragma: no cover - the pinned function always makes one
                return None
    return devs


class ModelInfo(NamedTuple):
    """The sizes and vocabulary constants of a loaded model, as llama.cpp reports them."""

    n_vocab: int
    n_layer: int
    n_ctx_train: int
    n_embd: int
    n_head: int
    n_head_kv: int
    bos: int
    eos: int
    add_bos: bool
    rope_type: int
    has_encoder: bool
    desc: str
    size: int
    n_params: int
    recurrent: bool = False   # layers that keep recurrent state (recurrent or hybrid; current library only)
    # the sliding window of a cache that reuses the cells of positions outside it (llama_model_n_swa of
    # the current library; 0: none, and on the mission pin, whose SWA masks a full cache)
    n_swa: int = 0


class NativeModel:
    """A ``llama_model *`` and its vocabulary pointer."""

    __slots__ = ("lib", "L", "ffi", "ptr", "vocab")

    def __init__(self, lib: Library, ptr: Any):
        self.lib = lib
        self.L = lib.lib
        self.ffi = lib.ffi
        self.ptr = ptr
        self.vocab = self.L.llama_model_get_vocab(ptr)

    @classmethod
    def load(cls, lib: Library, path: bytes, n_gpu_layers: int, use_mmap: bool,
             devices: Any = None, vocab_only: bool = False) -> tuple[NativeModel | None, str]:
        """llama_model_load_from_file: (the model, "") or (None, llama.cpp's last error line).
        ``devices``: a NULL-terminated ``ggml_backend_dev_t[]`` (rpc_devices), or None for llama.cpp's
        default (every registered GPU). ``vocab_only``: the vocabulary and metadata, no tensors."""
        L = lib.lib
        params = L.llama_model_default_params()
        params.n_gpu_layers, params.vocab_only = n_gpu_layers, bool(vocab_only)
        if lib.api == "current":
            params.load_mode = L.LLAMA_LOAD_MODE_MMAP if use_mmap else L.LLAMA_LOAD_MODE_NONE
        else:
            params.use_mmap = bool(use_mmap)
        if devices is not None:
            params.devices = devices
        with lib.lock:
            lib.clear_errors()
            ptr = L.llama_model_load_from_file(path, params)
            err = lib.last_error()
        if ptr == lib.ffi.NULL:
            return None, err
        return cls(lib, ptr), ""

    def free(self) -> None:
        """llama_model_free."""
        self.L.llama_model_free(self.ptr)
        self.ptr = None

    def info(self, vocab_only: bool = False) -> ModelInfo:
        """The llama_model_* getters and llama_vocab_* constants (``vocab_only``: n_head aborts there)."""
        L, p, v, ffi, vo = self.L, self.ptr, self.vocab, self.ffi, vocab_only
        buf = ffi.new("char[256]")
        L.llama_model_desc(p, buf, 256)
        return ModelInfo(
            n_vocab=int(L.llama_vocab_n_tokens(v)), n_layer=int(L.llama_model_n_layer(p)),
            n_ctx_train=int(L.llama_model_n_ctx_train(p)) & 0xFFFFFFFF,   # a uint32 in the file
            n_head=0 if vo else int(L.llama_model_n_head(p)), n_head_kv=0 if vo else int(L.llama_model_n_head_kv(p)),
            n_embd=int(L.llama_model_n_embd(p)), bos=int(L.llama_vocab_bos(v)), eos=int(L.llama_vocab_eos(v)),
            add_bos=bool(L.llama_vocab_get_add_bos(v)), rope_type=int(L.llama_model_rope_type(p)),
            has_encoder=bool(L.llama_model_has_encoder(p)), desc=ffi.string(buf).decode("utf-8", "replace"),
            size=int(L.llama_model_size(p)), n_params=int(L.llama_model_n_params(p)),
            recurrent=self.lib.api == "current" and bool(L.llama_model_is_recurrent(p) or L.llama_model_is_hybrid(p)),
            n_swa=int(L.llama_model_n_swa(p)) if self.lib.api == "current" else 0)

    def tokenize(self, data: bytes, n_max: int, add_bos: bool, special: bool) -> tuple[int, list[int]]:
        """llama_tokenize into a buffer of n_max: (n, tokens); n < 0 when -n tokens are needed."""
        ffi = self.ffi
        buf = ffi.new("llama_token[]", n_max)
        self.lib.clear_errors()
        n = self.L.llama_tokenize(self.vocab, data, len(data), buf, n_max, bool(add_bos), bool(special))
        return n, (list(ffi.unpack(buf, n)) if n >= 0 else [])

    def token_to_piece(self, token: int, cap: int, special: bool) -> tuple[int, bytes]:
        """llama_token_to_piece into a buffer of cap bytes: (n, bytes); n < 0 when -n bytes are needed."""
        ffi = self.ffi
        buf = ffi.new("char[]", cap)
        n = self.L.llama_token_to_piece(self.vocab, token, buf, cap, 0, bool(special))
        return n, (ffi.unpack(buf, n) if n >= 0 else b"")

    def detokenize(self, tokens: np.ndarray, n_max: int, remove_special: bool,
                   unparse_special: bool) -> tuple[int, bytes]:
        """llama_detokenize of a contiguous int32 array: (n, bytes); n < 0 when -n bytes are needed."""
        ffi = self.ffi
        cbuf = ffi.from_buffer("llama_token[]", tokens)
        out = ffi.new("char[]", n_max)
        n = self.L.llama_detokenize(self.vocab, cbuf, tokens.size, out, n_max, bool(remove_special),
                                    bool(unparse_special))
        return n, (ffi.unpack(out, n) if n >= 0 else b"")

    def sep(self) -> int:
        """llama_vocab_sep (-1: none)."""
        return int(self.L.llama_vocab_sep(self.vocab))

    def is_eog(self, token: int) -> bool:
        """llama_vocab_is_eog."""
        return bool(self.L.llama_vocab_is_eog(self.vocab, token))

    def meta(self, key: bytes, size: int) -> tuple[int, bytes]:
        """llama_model_meta_val_str into size bytes: (n, the value, cut to size - 1 bytes); n < 0: absent."""
        ffi = self.ffi
        buf = ffi.new("char[]", size)
        n = self.L.llama_model_meta_val_str(self.ptr, key, buf, size)
        return n, (ffi.unpack(buf, min(n, size - 1)) if n >= 0 else b"")


class NativeBatch:
    """Reusable llama_batch arrays of capacity ``cap``, filled through the numpy views ``np_token``,
    ``np_pos``, ``np_sid`` and ``np_out`` (one sequence id per token: ``n_seq_id`` is all 1), made
    with ``lib``'s FFI (the mission one when None): a batch goes only to a context of that library."""

    def __init__(self, cap: int, lib: Library | None = None):
        ffi_ = ffi if lib is None else lib.ffi
        self._make(cap, ffi_)

    def _make(self, cap: int, ffi: Any) -> None:
        self.cap = cap
        self.token = ffi.new("llama_token[]", cap)
        self.pos = ffi.new("llama_pos[]", cap)
        self.n_seq_id = ffi.new("int32_t[]", cap)
        self.sid = ffi.new("llama_seq_id[]", cap)
        self.sidp = ffi.new("llama_seq_id *[]", cap)
        self.out = ffi.new("int8_t[]", cap)
        self.np_token = np.frombuffer(ffi.buffer(self.token), dtype=np.int32)
        self.np_pos = np.frombuffer(ffi.buffer(self.pos), dtype=np.int32)
        self.np_sid = np.frombuffer(ffi.buffer(self.sid), dtype=np.int32)
        self.np_out = np.frombuffer(ffi.buffer(self.out), dtype=np.int8)
        np.frombuffer(ffi.buffer(self.n_seq_id), dtype=np.int32)[:] = 1
        base = int(ffi.cast("uintptr_t", self.sid))
        np.frombuffer(ffi.buffer(self.sidp), dtype=np.uintp)[:] = base + 4 * np.arange(cap, dtype=np.uintp)
        self.batch = ffi.new("llama_batch *")
        self.batch.token = self.token
        self.batch.embd = ffi.NULL
        self.batch.pos = self.pos
        self.batch.n_seq_id = self.n_seq_id
        self.batch.seq_id = self.sidp
        self.batch.logits = self.out


class NativeContext:
    """A ``llama_context *`` of the mission pin's API, with its KV cache view (for ``view_seq_max``
    sequence ids). :meth:`create` makes a :class:`CurrentContext` for a library of the current API."""

    def __init__(self, lib: Library, ptr: Any, view_seq_max: int):
        self.lib = lib
        self.L = lib.lib
        self.ffi = lib.ffi
        self.ptr = ptr
        self._view = self.ffi.new("struct llama_kv_cache_view *", self.L.llama_kv_cache_view_init(ptr, view_seq_max))
        self._abort_cb: Any = None

    @classmethod
    def create(cls, lib: Library, model: NativeModel, *, n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int,
               flash_attn: bool | None, type_k: int, type_v: int, n_threads: int,
               defrag_thold: float | None, embeddings: bool = False,
               pooling_type: int | None = None) -> tuple[NativeContext | None, str]:
        """llama_init_from_model: (the context, "") or (None, llama.cpp's last error line).
        ``embeddings``/``pooling_type``: an embeddings context (pooling None: the model's).
        ``flash_attn`` None: "auto" (only where ``caps.flash_attn_auto``; the caller checked)."""
        L = lib.lib
        p = L.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = n_ubatch
        p.n_seq_max = n_seq_max
        p.type_k = type_k
        p.type_v = type_v
        p.no_perf = True
        p.n_threads = n_threads
        p.n_threads_batch = n_threads
        p.embeddings = bool(embeddings)
        if pooling_type is not None:
            p.pooling_type = pooling_type
        current = lib.api == "current"
        if current:
            # one cell buffer for all sequences: seq_cp shares cells (forks) instead of copying a
            # per-sequence buffer, which aborts on a partial range
            p.kv_unified = True
            # the output buffer is sized for max(outputs, n_seq_max) rows and asserted to fit in
            # n_outputs_max (default n_batch): more sequences than n_batch aborted the process at the
            # first decode (llama-context.cpp, output_reserve)
            p.n_outputs_max = max(n_batch, n_seq_max)
            # a sequence whose outputs are sampled in the graph may have a row for each of its batch's
            # tokens (a draft's verification), not llama.cpp's default of one
            p.n_outputs_max_per_seq = 0
            p.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_AUTO if flash_attn is None else
                                 L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        else:
            p.flash_attn = bool(flash_attn)
            if defrag_thold is not None:
                p.defrag_thold = float(defrag_thold)
        with lib.lock:
            lib.clear_errors()
            ptr = L.llama_init_from_model(model.ptr, p)
            err = lib.last_error()
        if ptr == lib.ffi.NULL:
            return None, err
        return (CurrentContext if current else cls)(lib, ptr, n_seq_max), ""

    def free(self) -> None:
        """llama_kv_cache_view_free and llama_free."""
        self.L.llama_kv_cache_view_free(self._view)
        self.L.llama_free(self.ptr)
        self.ptr = None

    def sizes(self) -> tuple[int, int, int]:
        """(llama_n_ctx, llama_n_batch, llama_n_ubatch)."""
        L, p = self.L, self.ptr
        return int(L.llama_n_ctx(p)), int(L.llama_n_batch(p)), int(L.llama_n_ubatch(p))

    def can_shift(self) -> bool:
        """llama_kv_self_can_shift."""
        return bool(self.L.llama_kv_self_can_shift(self.ptr))

    # -- decoding

    def decode(self, batch: NativeBatch, n_tokens: int) -> int:
        """llama_decode of the first n_tokens entries of ``batch``: its return code."""
        b = batch.batch
        b.n_tokens = n_tokens
        return self.L.llama_decode(self.ptr, b[0])

    def logits(self, n_rows: int, n_vocab: int) -> np.ndarray:
        """A copy of the first n_rows output rows of llama_get_logits, float32 (n_rows, n_vocab)."""
        return self.logits_view(n_rows, n_vocab).copy()

    def logits_view(self, n_rows: int, n_vocab: int) -> np.ndarray:
        """The same rows as a read-only view of llama.cpp's buffer: valid until the next decode."""
        ptr = self.L.llama_get_logits(self.ptr)
        rows = np.frombuffer(self.ffi.buffer(ptr, n_rows * n_vocab * 4), dtype=np.float32)
        rows.flags.writeable = False
        return rows.reshape(n_rows, n_vocab)

    # -- embeddings (a context made with embeddings=True)

    def pooling_type(self) -> int:
        """llama_pooling_type: the pooling the context applies (llama.h's enum value)."""
        return int(self.L.llama_pooling_type(self.ptr))

    def embeddings_seq(self, seq_id: int, n: int) -> np.ndarray | None:
        """A copy of llama_get_embeddings_seq's ``n`` floats for seq_id (None: NULL, no such sequence)."""
        ptr = self.L.llama_get_embeddings_seq(self.ptr, seq_id)
        if ptr == self.ffi.NULL:
            return None
        return np.frombuffer(self.ffi.buffer(ptr, n * 4), dtype=np.float32).copy()

    def embeddings_rows(self, n_rows: int, n_embd: int) -> np.ndarray | None:
        """A copy of the first n_rows output rows of llama_get_embeddings (pooling none), float32
        (n_rows, n_embd); None when NULL."""
        ptr = self.L.llama_get_embeddings(self.ptr)
        if ptr == self.ffi.NULL:
            return None
        rows = np.frombuffer(self.ffi.buffer(ptr, n_rows * n_embd * 4), dtype=np.float32)
        return rows.reshape(n_rows, n_embd).copy()

    def set_abort_poll(self, poll: Callable[[Any], bool]) -> None:
        """Make ``poll(user_data)`` (never raising) the abort callback that enable_abort installs; a
        Ctrl-C that lands before poll's own handler runs is handed back to the main thread."""
        self._abort_cb = self.ffi.callback("bool(void *)", poll, onerror=_callback_error)

    def enable_abort(self, on: bool) -> None:
        """llama_set_abort_callback: the poll of set_abort_poll when ``on``, else none."""
        if on:
            self.L.llama_set_abort_callback(self.ptr, self._abort_cb, self.ffi.NULL)
        else:
            self.L.llama_set_abort_callback(self.ptr, self.ffi.NULL, self.ffi.NULL)

    # -- the KV cache

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """llama_kv_self_seq_rm: drop the cells of seq_id with position in [p0, p1) (-1: open end).
        False: the memory refused a partial range and nothing changed."""
        return bool(self.L.llama_kv_self_seq_rm(self.ptr, seq_id, p0, p1))

    def seq_pos_min(self, seq_id: int) -> int:
        """0: the mission pin's cache drops no position a sequence holds (its sliding window is a mask
        over a full cache)."""
        return 0

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """llama_kv_self_seq_cp: dst also holds src's cells with position in [p0, p1)."""
        self.L.llama_kv_self_seq_cp(self.ptr, src, dst, p0, p1)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """llama_kv_self_seq_add: shift positions [p0, p1) of seq_id by delta (applied by update)."""
        self.L.llama_kv_self_seq_add(self.ptr, seq_id, p0, p1, delta)

    def clear(self) -> None:
        """llama_kv_self_clear."""
        self.L.llama_kv_self_clear(self.ptr)

    def defrag(self) -> None:
        """llama_kv_self_defrag: schedule a defrag (run by update)."""
        self.L.llama_kv_self_defrag(self.ptr)

    def update(self) -> None:
        """llama_kv_self_update: apply pending shifts and a scheduled defrag."""
        self.L.llama_kv_self_update(self.ptr)

    def used_cells(self) -> int:
        """llama_kv_self_used_cells."""
        return int(self.L.llama_kv_self_used_cells(self.ptr))

    def view(self) -> tuple[np.ndarray, np.ndarray]:
        """llama_kv_cache_view_update, read: (pos (n_cells,), seqs (n_cells, view_seq_max)), int32 copies."""
        self.L.llama_kv_cache_view_update(self.ptr, self._view)
        v = self._view
        n = v.n_cells
        pos = np.frombuffer(self.ffi.buffer(v.cells, n * 4), dtype=np.int32).copy()
        seqs = np.frombuffer(self.ffi.buffer(v.cells_sequences, n * v.n_seq_max * 4), dtype=np.int32)
        return pos, seqs.reshape(n, v.n_seq_max).copy()

    def stats(self) -> dict[str, int]:
        """llama_kv_self_stats (patched build only): its fields by their C names."""
        s = self.L.llama_kv_self_stats(self.ptr)
        return {k: int(getattr(s, k)) for k in ("n_cells", "used_cells", "n_defrags", "n_defrag_moves",
                                                 "n_defrag_cells", "n_defrag_graphs", "n_slot_retries",
                                                 "n_slot_failures", "t_defrag_us", "n_defrag_nodes",
                                                 "n_state_gather_graphs")}

    # -- sequence states

    def state_seq_size(self, seq_id: int) -> int:
        """llama_state_seq_get_size."""
        return int(self.L.llama_state_seq_get_size(self.ptr, seq_id))

    def state_seq_get(self, seq_id: int, size: int, copy: bool = True) -> tuple[int, bytes | memoryview]:
        """llama_state_seq_get_data into size bytes: (bytes written, the buffer: bytes, or with
        ``copy=False`` a read-only view of the numpy buffer C wrote into: no copy)."""
        if not copy:
            return _written(self.ffi, size, lambda buf: self.L.llama_state_seq_get_data(self.ptr, buf, size, seq_id))
        buf = _alloc(self.ffi, "uint8_t[]", size)
        got = int(self.L.llama_state_seq_get_data(self.ptr, buf, size, seq_id))
        return got, self.ffi.buffer(buf, size)[:]

    def state_seq_read(self, seq_id: int, copy: bool = True) -> bytes | memoryview | None:
        """The state of seq_id in the mission format (core/state.py's docstring): bytes, or with
        ``copy=False`` a read-only view of the buffer C wrote; None when llama.cpp could not size it
        or wrote another size."""
        n = self.state_seq_size(seq_id)
        if n == 0:
            return None
        got, data = self.state_seq_get(seq_id, n, copy)
        return data if got == n else None

    def state_seq_range_read(self, seq_id: int, p0: int, p1: int) -> memoryview | None:
        """The state of the cells of seq_id with positions in [p0, p1) alone, in the mission format
        (core/state.py's docstring), as a read-only view of the buffer C wrote
        (llama_state_seq_get_size_range and _get_data_range: patch 0017); None when llama.cpp could not
        write it (a library without the range read: ``caps.span_range_read``)."""
        try:
            n = int(self.L.llama_state_seq_get_size_range(self.ptr, seq_id, p0, p1))
        except AttributeError:   # a library without the patch
            return None
        if n == 0:
            return None
        got, data = _written(self.ffi, n,
                             lambda buf: self.L.llama_state_seq_get_data_range(self.ptr, buf, n, seq_id, p0, p1))
        return data if got == n else None

    def state_seq_whole_read(self, seq_id: int) -> bytes | None:
        """llama_state_seq_get_data of seq_id as the library writes it (any memory: its recurrent state
        and sliding-window cache included), not translated or parsed: for
        :meth:`state_seq_whole_write` in this process only. None when it could not be written whole."""
        data = NativeContext.state_seq_read(self, seq_id)   # the raw read (a subclass translates its own)
        assert data is None or isinstance(data, bytes)
        return data

    def state_seq_whole_write(self, data: bytes, seq_id: int, n_tokens: int) -> int:
        """llama_state_seq_set_data of what :meth:`state_seq_whole_read` gave (its ``n_tokens``
        positions) into seq_id, whose cells it replaces: the bytes read (0 on failure: llama.cpp then
        leaves seq_id empty)."""
        return int(self.L.llama_state_seq_set_data(self.ptr, self.ffi.from_buffer("uint8_t[]", data), len(data),
                                                   seq_id))

    def state_seq_set(self, data: bytes, seq_id: int) -> int:
        """llama_state_seq_set_data: the bytes read (0 on failure)."""
        return int(self.L.llama_state_seq_set_data(self.ptr, self.ffi.from_buffer("uint8_t[]", data), len(data),
                                                   seq_id))

    def recurrent_state_get(self, seq_id: int) -> bytes:
        raise LibraryError(f"{self.lib.path}: a sequence's recurrent state alone is read by the current API only")

    def recurrent_state_set(self, data: bytes, seq_id: int) -> bool:
        raise LibraryError(f"{self.lib.path}: a sequence's recurrent state alone is written by the current API only")

    def _no_backend_sampling(self) -> LibraryError:
        return LibraryError(f"{self.lib.path}: sampling in the graph (llama_set_sampler) is the current API's only")

    def set_sampler(self, seq_id: int, sampler: NativeSampler | None) -> bool:
        raise self._no_backend_sampling()

    def attach_greedy(self, seq_id: int, n_vocab: int) -> bool:
        raise self._no_backend_sampling()

    def sampled_ids(self) -> frozenset[int]:
        """The sequence ids with a sampler chain in the graph (none: this API has no backend sampling)."""
        return frozenset()

    def sampled_token(self, i: int) -> int:
        raise self._no_backend_sampling()

    def state_seq_add(self, data: bytes | memoryview, seq_id: int) -> int | None:
        """llama_state_seq_add_data (patch 0014): the bytes read (0 on failure); None when the library
        lacks it (the vanilla build)."""
        try:
            fn = self.L.llama_state_seq_add_data
        except AttributeError:
            return None
        return int(fn(self.ptr, self.ffi.from_buffer("uint8_t[]", data), len(data), seq_id))


_CURRENT_MAGIC = 0xAF143CD8   # llama-context.cpp's io_magic: the first field of a one-sequence state


def _current_to_mission(buf: np.ndarray, seq_id: int) -> np.ndarray | None:
    """The current API's one-sequence state ``buf`` (uint8) in the mission format, in a new array;
    None unless it is [magic][seq_id][1 stream][cell_count][cells of (pos, 1, seq_id)][the data]."""
    if buf.size < 16:
        return None
    magic, _sid, n_stream, c = struct.unpack_from("=IiII", buf.data, 0)
    meta_end = 16 + 12 * c
    if magic != _CURRENT_MAGIC or n_stream != 1 or buf.size < meta_end:
        return None
    meta = buf[16:meta_end].view(np.int32).reshape(c, 3)
    if c and ((meta[:, 1] != 1).any() or (meta[:, 2] != seq_id).any()):
        return None
    out = np.empty(4 + 8 * c + (buf.size - meta_end), dtype=np.uint8)
    out[:4] = np.frombuffer(struct.pack("=I", c), dtype=np.uint8)
    cells = out[4:4 + 8 * c].view(np.int32).reshape(c, 2)
    cells[:, 0] = meta[:, 0]
    cells[:, 1] = 0
    out[4 + 8 * c:] = buf[meta_end:]
    return out


def _mission_to_current(data: bytes | memoryview, seq_id: int) -> np.ndarray:
    """A mission-format one-sequence state (checked by the caller) framed as the current API reads
    it; a state of 0 cells is the frame alone (that API reads no layer headers then)."""
    a = np.frombuffer(data, dtype=np.uint8)
    (c,) = struct.unpack_from("=I", data, 0)
    rest = a[4 + 8 * c:] if c else a[:0]
    out = np.empty(16 + 12 * c + rest.size, dtype=np.uint8)
    out[:16] = np.frombuffer(struct.pack("=IiII", _CURRENT_MAGIC, seq_id, 1, c), dtype=np.uint8)
    cells = out[16:16 + 12 * c].view(np.int32).reshape(c, 3)
    cells[:, 0] = a[4:4 + 8 * c].view(np.int32).reshape(c, 2)[:, 0]
    cells[:, 1] = 1
    cells[:, 2] = seq_id
    out[16 + 12 * c:] = rest
    return out


class CurrentContext(NativeContext):
    """A ``llama_context *`` of the current pin's API: the KV calls go to ``llama_memory_*`` on
    ``llama_get_memory(ctx)``; there is no defrag (a no-op), an explicit update only with
    patches/current/0002 (else llama_decode applies pending shifts itself), no cell view (``view``
    and ``used_cells`` come from the :class:`CellShadow`) and no stats counters."""

    def __init__(self, lib: Library, ptr: Any, view_seq_max: int):
        self.lib = lib
        self.L = lib.lib
        self.ffi = lib.ffi
        self.ptr = ptr
        self.mem = self.L.llama_get_memory(ptr)
        self._abort_cb = None
        self.cells = CellShadow(int(self.L.llama_n_ctx(ptr)), view_seq_max)
        self._chains: dict[int, NativeSampler] = {}   # the chains attached by set_sampler, by sequence id

    def free(self) -> None:
        """llama_free, then the sampler chains attached to its sequences."""
        self.L.llama_free(self.ptr)
        self.ptr = None
        for chain in self._chains.values():
            chain.release()
        self._chains.clear()

    def can_shift(self) -> bool:
        """llama_memory_can_shift."""
        return bool(self.L.llama_memory_can_shift(self.mem))

    def set_sampler(self, seq_id: int, sampler: NativeSampler | None) -> bool:
        """llama_set_sampler: ``sampler``'s chain (None: none) samples ``seq_id``'s outputs in the graph
        from the next decode on (a graph reservation then: not a per-request switch). Whether it runs
        there. While every output of a decode has one, llama.cpp copies no logits: read
        :meth:`sampled_token`, not the logits, for those rows.

        The context owns an attached chain from then on: it frees the one a later call replaces or
        removes, and those still attached when it is freed. A chain goes into one graph once
        (llama.cpp aborts the process on a second attachment, to any sequence): InvalidInputError
        then, before the C call."""
        if sampler is not None:
            if sampler.in_graph:
                raise InvalidInputError("this sampler chain was attached to a sequence before: llama.cpp "
                                        "takes a chain into a graph once, make a new one")
            sampler.in_graph = True   # (llama.cpp initialised it for its backend, whatever it answers)
        ok = bool(self.L.llama_set_sampler(self.ptr, seq_id, self.ffi.NULL if sampler is None else sampler.ptr))
        old = self._chains.pop(seq_id, None)
        if ok and sampler is not None:
            self._chains[seq_id] = sampler
        elif sampler is not None:
            sampler.release()   # refused: llama.cpp keeps no pointer to it
        if old is not None and old is not sampler:
            old.release()
        return ok

    def attach_greedy(self, seq_id: int, n_vocab: int) -> bool:
        """A new greedy chain on ``seq_id`` (:meth:`set_sampler`): its outputs' tokens are the argmax,
        chosen in the graph. Whether the library took it."""
        chain = NativeSampler(self.lib, n_vocab)
        chain.add_greedy()
        return self.set_sampler(seq_id, chain)

    def sampled_ids(self) -> frozenset[int]:
        """The sequence ids with a chain attached."""
        return frozenset(self._chains)

    def sampled_token(self, i: int) -> int:
        """llama_get_sampled_token_ith: the token the backend sampler chose for output row ``i`` (-1:
        the last row) of the last decode; -1 when none was sampled there."""
        return int(self.L.llama_get_sampled_token_ith(self.ptr, i))

    def decode(self, batch: NativeBatch, n_tokens: int) -> int:
        """llama_decode; on success the shadow learns the new cells (one per token)."""
        rc = super().decode(batch, n_tokens)
        if rc == 0:
            self.cells.add(batch.np_sid[:n_tokens], batch.np_pos[:n_tokens])
        return rc

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """llama_memory_seq_rm; False: the memory (recurrent, SWA) refused a partial range, nothing changed."""
        ok = bool(self.L.llama_memory_seq_rm(self.mem, seq_id, p0, p1))
        if ok:
            self.cells.rm(seq_id, p0, p1)
        return ok

    def seq_pos_min(self, seq_id: int) -> int:
        """llama_memory_seq_pos_min: the smallest position the memory holds for seq_id (-1: none). A
        sliding-window cache raises it when it reuses the cells of positions outside the window."""
        return int(self.L.llama_memory_seq_pos_min(self.mem, seq_id))

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """llama_memory_seq_cp (the unified cache shares the cells)."""
        self.L.llama_memory_seq_cp(self.mem, src, dst, p0, p1)
        self.cells.cp(src, dst, p0, p1)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """llama_memory_seq_add (applied by the next llama_decode)."""
        self.L.llama_memory_seq_add(self.mem, seq_id, p0, p1, delta)
        self.cells.shift(seq_id, p0, p1, delta)

    def clear(self) -> None:
        """llama_memory_clear, data included."""
        self.L.llama_memory_clear(self.mem, True)
        self.cells.clear()

    def defrag(self) -> None:
        """Nothing: the current library writes batches into non-contiguous cells and has no defrag."""

    def update(self) -> None:
        """llama_memory_update (patches/current/0002): apply pending K-shifts now, as llama_decode would
        first; nothing on an unpatched build, where only the next llama_decode applies them."""
        try:
            fn = self.L.llama_memory_update
        except AttributeError:
            return
        fn(self.ptr)

    def used_cells(self) -> int:
        """The cells some sequence holds (the shadow's count; llama.h has no counter)."""
        return self.cells.used()

    def view(self) -> tuple[np.ndarray, np.ndarray]:
        """The shadow's (pos, seqs), shaped as the mission view: which sequences hold each used
        cell and at which position, the used cells first (not the cache's cell order)."""
        return self.cells.view()

    # the recurrent state alone (a hybrid model's recurrent layers; llama.h: "work only with partial
    # states, such as SWA KV cache or recurrent cache")
    _PARTIAL_ONLY = 1   # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY

    def recurrent_state_get(self, seq_id: int) -> bytes:
        """llama_state_seq_get_data_ext(PARTIAL_ONLY): the recurrent state of seq_id after its last
        token (for a hybrid model, without its attention cells); b"" when the library wrote nothing."""
        size = int(self.L.llama_state_seq_get_size_ext(self.ptr, seq_id, self._PARTIAL_ONLY))
        buf = _alloc(self.ffi, "uint8_t[]", max(size, 1))
        got = int(self.L.llama_state_seq_get_data_ext(self.ptr, buf, size, seq_id, self._PARTIAL_ONLY))
        return self.ffi.buffer(buf, got)[:] if got == size else b""

    def recurrent_state_set(self, data: bytes, seq_id: int) -> bool:
        """llama_state_seq_set_data_ext(PARTIAL_ONLY): seq_id's recurrent state replaced by ``data``
        (its attention cells untouched); False when the library refused it (then seq_id's recurrent
        state is cleared)."""
        return int(self.L.llama_state_seq_set_data_ext(self.ptr, self.ffi.from_buffer("uint8_t[]", data), len(data),
                                                       seq_id, self._PARTIAL_ONLY)) == len(data)

    def stats(self) -> dict[str, int]:
        raise LibraryError(f"{self.lib.path} has no KV cache counters (llama_kv_self_stats is patch 0004 of the "
                           "mission pin's series)")

    # -- sequence states: the current API frames a one-sequence state with a header ([u32 magic][i32
    # seq_id][u32 n_stream]), lists each cell's sequence id and writes no layer headers after a
    # cell count of 0; the layers above see the mission format (core/state.py) on both pins,
    # translated here. A cell extension (M-RoPE's 2D position, a PLE token) makes a state
    # untranslatable: reading one gives None.

    def state_seq_read(self, seq_id: int, copy: bool = True) -> bytes | memoryview | None:
        """The state of seq_id in the mission format: bytes, or with ``copy=False`` a read-only view of
        the translation (one copy less); for an empty sequence just its cell count (4 bytes: this API
        writes no layer headers then); None when llama.cpp could not write it or it is not a plain KV
        cache's one-sequence state."""
        raw = super().state_seq_read(seq_id, copy=False)
        out = None if raw is None else _current_to_mission(np.frombuffer(raw, dtype=np.uint8), seq_id)
        if out is None:
            return None
        if copy:
            return out.tobytes()
        out.flags.writeable = False
        return out.data

    def _write_state(self, fn: Any, data: bytes | memoryview, seq_id: int) -> int:
        """``fn`` (set or add) of the mission-format ``data`` translated: the bytes of ``data`` it
        stands for when C read all of the translation, else 0 (or what C read, when not 0)."""
        cur = _mission_to_current(data, seq_id)
        got = int(fn(self.ptr, self.ffi.from_buffer("uint8_t[]", cur), cur.size, seq_id))
        if got != cur.size:
            return got
        (c,) = struct.unpack_from("=I", data, 0)   # the shadow learns the cells placed
        pos = np.frombuffer(data, dtype=np.int32, count=2 * c, offset=4)[0::2]
        self.cells.add(np.full(c, seq_id, dtype=np.int32), pos)
        return len(data)

    def state_seq_whole_write(self, data: bytes, seq_id: int, n_tokens: int) -> int:
        self.cells.rm(seq_id, -1, -1)   # replaced; the shadow learns positions 0..n_tokens-1 once placed
        got = super().state_seq_whole_write(data, seq_id, n_tokens)
        if got == len(data):
            self.cells.add(np.full(n_tokens, seq_id, dtype=np.int32), np.arange(n_tokens, dtype=np.int32))
        return got

    def state_seq_set(self, data: bytes, seq_id: int) -> int:
        """llama_state_seq_set_data of the mission-format ``data`` (see :meth:`_write_state`): the
        sequence's cells are replaced."""
        self.cells.rm(seq_id, -1, -1)
        return self._write_state(self.L.llama_state_seq_set_data, data, seq_id)

    def state_seq_add(self, data: bytes | memoryview, seq_id: int) -> int | None:
        """llama_state_seq_add_data (patches/current/0001) of the mission-format ``data``; None when
        the library lacks it (an unpatched current build)."""
        try:
            fn = self.L.llama_state_seq_add_data
        except AttributeError:
            return None
        return self._write_state(fn, data, seq_id)

    def state_seq_range_read(self, seq_id: int, p0: int, p1: int) -> memoryview | None:
        """The range read (patches/current/0003) translated to the mission format (see
        :meth:`state_seq_read`); None when llama.cpp could not write it or it is not a plain KV
        cache's one-sequence state."""
        raw = super().state_seq_range_read(seq_id, p0, p1)   # in this API's format (current/0003)
        out = None if raw is None else _current_to_mission(np.frombuffer(raw, dtype=np.uint8), seq_id)
        if out is None:
            return None
        out.flags.writeable = False
        return out.data
