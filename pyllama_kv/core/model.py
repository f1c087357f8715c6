"""A loaded GGUF model: vocabulary, sizes, tokenization, and the factory for contexts.

Package interface (what contexts and samplers use; nothing else of the package reads a Model's
private attributes): ``Model.native_library`` (the loaded :class:`~pyllama_kv._native.kv.Library`,
which samplers build their chains with), ``Model.open_native_context(owner, adopt, **params)``
(a llama.cpp context made under the model's lock, so the model cannot be closed meanwhile, given to
``adopt``, and ``owner`` registered: :meth:`Model.close` closes it first), ``Model.forget_context(owner)`` (the
owner closed its native context) and ``Model.check_open()``. The model's lock is taken after a
context's lock, never before.

Vocabulary calls (tokenize, detokenize, token_to_piece, is_eog, meta) take no lock that generation
needs: llama.cpp's vocabulary and metadata are read-only once the model is loaded, and its tokenizer
is thread-safe (llama-server tokenizes in its HTTP threads while its main loop decodes), so a long
tokenization in one thread never holds up another thread's decode or detokenization. Each is counted
while it runs, and :meth:`Model.close` waits for those running to finish before it frees the model.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import struct
import sys
import threading
from collections.abc import Iterable, Sequence as _Seq
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from .._native import archs as _archs, kv as _kv
from ..config import ContextConfig as _CC
from ..errors import InvalidInputError, LibraryError, LlamaError, ModelLoadError
from ..limits import INT32_MAX, INT32_MIN

if TYPE_CHECKING:
    from ..modelfile.gguf import GGUFHeader

# what the vocabulary functions return when llama.cpp threw an exception (patch 0005)
C_EXCEPTION = INT32_MIN


# ggml's RPC protocol at the pin (ggml/include/ggml-rpc.h, ggml-rpc.cpp): a client's first command is
# HELLO (1 byte, then a uint64 request size of 0); the server answers a uint64 size (3) and
# major.minor.patch. The pinned client accepts major 2, minor <= 0.
RPC_CMD_HELLO = 14
RPC_PROTO = (2, 0)
#: seconds each RPC endpoint gets to accept a connection and answer HELLO before loading gives up
RPC_TIMEOUT = 5.0
_ENDPOINT = re.compile(r"([A-Za-z0-9._-]{1,253}):([0-9]{1,5})")
# endpoints that an open Model of this process is connected to (llama.cpp keeps one connection per
# endpoint, and rpc-server serves one client at a time: a second connection would not be answered)
_rpc_open: dict[str, int] = {}
_rpc_lock = threading.Lock()
_NO_LOCK = contextlib.nullcontext()


def parse_rpc(rpc) -> list[str]:
    """``rpc`` (``"host:port"``, ``"host:port,host:port"`` or a list of them) as a list of endpoints;
    InvalidInputError for one the pinned RPC client would misread (it splits at the first ``:``,
    resolves IPv4 names only and aborts on a port that is not a number)."""
    items = rpc.split(",") if isinstance(rpc, str) else rpc
    if isinstance(items, (bytes, bytearray)) or not isinstance(items, Iterable):
        raise InvalidInputError(f"rpc must be a list of 'host:port' strings, got {type(rpc).__name__}")
    out: list[str] = []
    for ep in items:
        if not isinstance(ep, str):
            raise InvalidInputError(f"an rpc endpoint must be a 'host:port' string, got {type(ep).__name__}")
        ep = ep.strip()
        m = _ENDPOINT.fullmatch(ep)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise InvalidInputError(f"rpc endpoint {ep!r} is not HOST:PORT (an IPv4 address or a host name, "
                                    "and a port 1-65535)")
        if ep in out:
            raise InvalidInputError(f"rpc endpoint {ep} is given twice")
        out.append(ep)
    if not out:
        raise InvalidInputError("rpc is empty: give at least one 'host:port' of a running rpc-server")
    return out


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the connection was closed")
        data += chunk
    return data


def probe_rpc(endpoint: str, timeout: float | None = None) -> tuple[int, int, int]:
    """Connect to the rpc-server at ``endpoint`` and exchange HELLO, each step within ``timeout``
    seconds (default :data:`RPC_TIMEOUT`): its protocol version, or ModelLoadError naming the
    endpoint. The pinned client itself would block without limit on an unreachable host, and abort
    on a server that does not answer."""
    timeout = RPC_TIMEOUT if timeout is None else timeout
    host, port = endpoint.rsplit(":", 1)
    what = f"RPC server {endpoint}"
    try:
        ip = str(socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (OSError, UnicodeError) as exc:
        raise ModelLoadError(f"{what}: cannot resolve {host} to an IPv4 address ({exc})") from None
    try:
        with socket.create_connection((ip, int(port)), timeout=timeout) as sock:
            sock.sendall(struct.pack("<BQ", RPC_CMD_HELLO, 0))
            size = struct.unpack("<Q", _recv_exactly(sock, 8))[0]
            version = tuple(_recv_exactly(sock, 3)) if size == 3 else ()
    except socket.timeout:
        raise ModelLoadError(f"{what} did not answer within {timeout:g}s: is the host up, is rpc-server running "
                             "there, and is no other program using it (it serves one client at a time)?") from None
    except ConnectionRefusedError:
        raise ModelLoadError(f"{what} refused the connection: is rpc-server running there on port {port}?") from None
    except OSError as exc:
        raise ModelLoadError(f"{what}: cannot connect: {exc.strerror or exc}") from None
    if len(version) != 3:
        raise ModelLoadError(f"{what} is not an rpc-server (it does not answer ggml's RPC HELLO)")
    if version[0] != RPC_PROTO[0] or version[1] > RPC_PROTO[1]:
        raise ModelLoadError(f"{what} speaks RPC protocol {'.'.join(map(str, version))}, this libllama "
                             f"speaks {RPC_PROTO[0]}.{RPC_PROTO[1]}: run an rpc-server of the same llama.cpp "
                             "revision (`pyllama-kv build --rpc` builds it)")
    return version[0], version[1], version[2]


def _validate_gguf(path: Path, fd: int, header: GGUFHeader, level: str, lib: _kv.Library, n_gpu_layers: int,
                   use_mmap: bool) -> GGUFHeader:
    """Refuse (ModelLoadError) a file that would make llama.cpp abort or misbehave, before it sees it
    (``level`` "full" or "static"; see :mod:`pyllama_kv.modelfile.vetting`): the static checks of
    pyllama_kv.modelfile.validate (complete for dense llama models; structure, common hyperparameters
    and vocabulary for the others), then, at "full", a vetting run in a child process for a file the
    static checks could not validate completely (cached by the file's sha256). Reads the open file
    ``fd`` (``path`` names it in messages; ``header``: its header, read already); returns it."""
    from ..modelfile.validate import validated_header

    header, complete = validated_header(path, fd, lib.caps.architectures, header)
    if not complete and level == "full":
        from ..modelfile.vetting import vet

        vet(path, lib.path, n_gpu_layers=n_gpu_layers, use_mmap=use_mmap, fd=fd)
    return header


def _load_chosen(lib, why: str) -> _kv.Library:
    """The library ``lib``; ``why`` (not empty: chosen for the model, see _library_for) is said on
    stderr, and a current library that is not built is a LibraryError that says how to build it."""
    if not why:
        return _kv.load_library(lib)
    try:
        loaded = _kv.load_library(lib)
    except LibraryError as exc:
        raise LibraryError(f"{why}, which is not built: `make setup` in a checkout, or `pyllama-kv build --pin "
                           f"current` ({exc})") from None
    print(f"pyllama-kv: {why}", file=sys.stderr, flush=True)
    return loaded


def _library_for(path: Path, lib, header: GGUFHeader | None) -> tuple[object, str]:
    """The ``lib`` to load ``path`` with, and why when it is not the one asked for: without a choice
    (``lib`` None and no ``$PYLLAMA_KV_LIB``), a model whose architecture or pre-tokenizer the default
    (mission) llama.cpp lacks and the current one has loads on the current library; an explicit choice
    stays (and is refused, with a hint, by validation)."""
    if lib is not None or os.environ.get("PYLLAMA_KV_LIB") or header is None:
        return lib, ""
    arch, pre = header.loader_needs()
    if _archs.implements("mission", arch, pre) or not _archs.implements("current", arch, pre):
        return lib, ""
    what = f"architecture {arch!r}" if not _archs.implements("mission", arch) else f"pre-tokenizer {pre!r}"
    return "current", f"{path.name}: its {what} needs the current llama.cpp, so it loads on the 'current' library"


class Model(_kv.CResource):
    """A GGUF model loaded into llama.cpp.

    >>> model = Model("tiny.gguf")            # ModelLoadError on a missing/corrupt/unsupported file
    >>> model.n_vocab, model.n_layer, model.n_ctx_train
    >>> toks = model.tokenize("hello")        # [bos, ...]
    >>> with model.context(n_ctx=2048, n_seq_max=8) as ctx: ...

    ``lib`` selects the library: a path, ``"patched"`` / ``"vanilla"`` / ``"current"``, or None for the
    default (``$PYLLAMA_KV_LIB``, else the patched build; a model only the current llama.cpp loads, by its
    architecture or pre-tokenizer, loads on the current library, said in one line on stderr and in
    :attr:`library_choice` and ``library["chosen"]``). Close with :meth:`close` or ``with``; contexts made
    from a model keep it alive until they close. ``trust_unverified``: an offline Hugging Face file the
    hub cannot vouch for is loaded, not refused (:func:`pyllama_kv.modelfile.hub.verify`).
    ``vocab_only``: the vocabulary and metadata alone, no tensors read (a router's tokenizer): it
    tokenizes and renders chats; a context of it is an InvalidInputError.

    ``n_gpu_layers``: the last N layers (and, past the layer count, the output) go to the GPU;
    -1 for all. The default (None) is all of them on a library built with a GPU backend
    (``pyllama-kv build --backend cuda|metal``) that finds a GPU, else 0 (CPU).

    ``rpc``: ``["host:port", ...]`` of ``rpc-server`` processes (ggml's RPC backend; a library built
    with ``pyllama-kv build --rpc``) to offload layers to: the last ``n_gpu_layers`` layers (default:
    all of them) are split over those servers, the rest run on this machine's CPU (a local GPU is
    not used then: run an rpc-server here too and list it). Each endpoint is checked first
    (connect and HELLO, :data:`RPC_TIMEOUT` seconds each): one that cannot be reached is a
    ModelLoadError naming it. A server that dies later aborts this process (the pinned backend
    asserts on a failed RPC call).

    ``validate`` (a GGUF file is untrusted input; :mod:`pyllama_kv.modelfile.vetting` has the details):
    ``"full"`` (default, or True): no file may kill this process, whatever its architecture: a
    dense llama model is checked statically, any other architecture gets the generic static checks
    and a vetting run in a child process, once per file (the verdict is cached by its sha256).
    ``"static"``: the static checks only (complete for llama; a lying file of another architecture
    can still abort). ``"off"`` (or False): llama.cpp reads the file unchecked.
    """

    # long: the checks in the order loading needs them, then every public attribute a Model has,
    # declared here in one place
    def __init__(self, path: str | os.PathLike, n_gpu_layers: int | None = None, *, lib=None,
                 use_mmap: bool = True, validate: bool | str = "full", rpc=None, trust_unverified: bool = False,
                 vocab_only: bool = False):
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidInputError(f"the model path must be a str or os.PathLike, got {type(path).__name__}")
        self.path = Path(path)
        if "\0" in str(self.path):
            raise ModelLoadError("the model path contains a NUL byte")
        # a name (catalogue, Hugging Face, ollama:, lmstudio:) or a split model's part: one GGUF file
        from ..modelfile import names

        self.path = names.resolve(path, trust_unverified=bool(trust_unverified))
        if not isinstance(use_mmap, bool):
            raise InvalidInputError(f"use_mmap must be a bool, got {type(use_mmap).__name__}")
        if not isinstance(vocab_only, bool):
            raise InvalidInputError(f"vocab_only must be a bool, got {type(vocab_only).__name__}")
        #: the vocabulary and metadata alone (no tensors): it tokenizes and renders chats, no context
        self.vocab_only = vocab_only
        from ..modelfile.vetting import validate_level

        level = validate_level(validate)
        endpoints = parse_rpc(rpc) if rpc is not None else []
        if n_gpu_layers is not None and (isinstance(n_gpu_layers, bool) or not isinstance(n_gpu_layers, int)
                                         or not -1 <= n_gpu_layers <= INT32_MAX):
            raise InvalidInputError("n_gpu_layers must be an int >= -1 (-1: all layers)")
        fd = None
        load_path: Path = self.path
        if level != "off":
            from ..modelfile.vetting import fd_path, open_model_file

            fd = open_model_file(self.path)
            load_path = Path(fd_path(fd))
        try:
            header = None
            if fd is not None:
                from ..modelfile.validate import read_header

                header = read_header(self.path, fd)
            lib, self.library_choice = _library_for(self.path, lib, header)
            self._lib = _load_chosen(lib, self.library_choice)
            gpus = bool(self._lib.gpu_devices())
            if n_gpu_layers is None:   # every layer where they can go: rpc servers, else a GPU of this library
                n_gpu_layers = -1 if endpoints or gpus else 0
            if fd is not None:
                assert header is not None
                # a vetting child runs on this machine's devices (rpc endpoints serve one client at a time)
                header = _validate_gguf(self.path, fd, header, level, self._lib, 0 if endpoints else n_gpu_layers,
                                        use_mmap)
            native = self._load(load_path, n_gpu_layers, use_mmap, endpoints, vocab_only)
            # the identity a saved sequence state is checked against (the file as loaded now)
            from . import state as _state

            _state.model_fingerprint(self, load_path, header)
        finally:
            if fd is not None:
                os.close(fd)
        self._contexts: set = set()
        # the tensors of the file as validated (None with validation off: read when asked)
        self._tensor_names: frozenset[str] | None = \
            frozenset(t.name for t in header.tensors) if header is not None else None
        self._embedders: dict = {}   # Model.embed's embedders, by pooling
        info = native.info(vocab_only)
        self.n_vocab: int = info.n_vocab
        self.n_layer: int = info.n_layer
        self.n_ctx_train: int = info.n_ctx_train   # a uint32 in the file
        self.n_embd: int = info.n_embd
        self.n_head: int = info.n_head
        self.n_head_kv: int = info.n_head_kv
        self.head_dim_k: int = self._head_dim("key_length")    # K and V head sizes (a quantized
        self.head_dim_v: int = self._head_dim("value_length")  # cache needs whole blocks)
        self.bos: int = info.bos
        self.eos: int = info.eos
        self.sep: int = native.sep()   # BERT's [SEP] (-1: none); rerank pairs need it
        self.add_bos: bool = info.add_bos
        self.rope_type: int = info.rope_type
        self.has_encoder: bool = info.has_encoder
        # layers that keep recurrent state (recurrent or hybrid): no partial removal or partial copy,
        # but a fork at a checkpoint of that state where the library reads and writes it alone
        self.recurrent: bool = info.recurrent
        self.recurrent_checkpoints: bool = info.recurrent and self._lib.caps.recurrent_checkpoints
        # the sliding window of a cache that reuses the cells of positions outside it (0: none, or a
        # cache that keeps them): a cut back to a position whose window it no longer holds is refused
        self.n_swa: int = info.n_swa
        # whether a prefix cache keeps checkpoints where prompts branch (PrefixCache.keeps_checkpoints):
        # a recurrent model's state, or a sliding-window model's sequence of exactly the branch's tokens
        self.branch_checkpoints: bool = self.recurrent_checkpoints or (self.n_swa > 0 and not self.recurrent)
        # whether a K-shift continues exactly: RoPE in every layer (llama.cpp rotates the K of
        # archs.NOPE_LAYERS' layers without it all the same) and no recurrent state (a shift of
        # positions takes no token out of it)
        self.k_shift_exact: bool = info.rope_type != -1 and not info.recurrent and \
            self.meta("general.architecture") not in _archs.NOPE_LAYERS
        self.desc: str = info.desc
        self.size: int = info.size
        self.n_params: int = info.n_params
        self.n_gpu_layers = n_gpu_layers
        # layers on a GPU of this machine (not only on RPC servers): flash attention's auto turns on
        self.on_gpu: bool = bool(n_gpu_layers) and not endpoints and gpus

    def _load(self, load_path: Path, n_gpu_layers: int, use_mmap: bool, endpoints: list[str],
              vocab_only: bool = False) -> _kv.NativeModel:
        """llama_model_load_from_file on ``load_path`` (the checked open file, or the path itself
        with validation off), the RPC devices connected first; sets _native, _lock and the count of
        vocabulary calls."""
        self.rpc: tuple[str, ...] = ()
        with _rpc_lock if endpoints else _NO_LOCK:
            devices = None
            if endpoints:
                devices = _kv.rpc_devices(self._lib, endpoints)
                if devices is None:
                    raise LibraryError(f"{self._lib.path} was built without ggml's RPC backend: rebuild it with "
                                       "`pyllama-kv build --rpc` to use rpc servers")
                for ep in endpoints:
                    if not _rpc_open.get(ep):   # else this process is connected already
                        probe_rpc(ep)
            native, err = _kv.NativeModel.load(self._lib, os.fsencode(load_path),
                                               INT32_MAX if n_gpu_layers == -1 else n_gpu_layers, bool(use_mmap),
                                               devices, vocab_only)
            if native is None:
                raise ModelLoadError(f"llama.cpp could not load {self.path}" + (f": {err}" if err else ""))
            for ep in endpoints:
                _rpc_open[ep] = _rpc_open.get(ep, 0) + 1
            self.rpc = tuple(endpoints)
        self._native: _kv.NativeModel | None = native
        self._lock = threading.RLock()
        # vocabulary calls running (they take no model lock), per thread: close() waits until none is
        self._vocab_calls: dict[int, int] = {}
        self._vocab_idle = threading.Condition(threading.Lock())
        self._pieces: dict[int, bytes] = {}   # token_to_piece's answers (special=False): a vocabulary never changes
        self._eog: dict[int, bool] = {}       # is_eog's answers, likewise
        return native

    def _head_dim(self, key: str) -> int:
        arch = self.meta("general.architecture") or ""
        v = self.meta(f"{arch}.attention.{key}")
        try:
            return int(v) if v is not None else self.n_embd // max(1, self.n_head)
        except ValueError:
            return self.n_embd // max(1, self.n_head)

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str | None = None, *, quant: str | None = None,
                        revision: str | None = None, trust_unverified: bool = False, **kwargs) -> Model:
        """A GGUF model of the Hugging Face hub, downloaded into the Hugging Face cache on first use
        (huggingface_hub: ``HF_TOKEN``, ``HF_ENDPOINT``, ``HF_HUB_OFFLINE``), its sha256 checked
        against the hub's, then loaded as :class:`Model` (``kwargs`` are its arguments).

        >>> Model.from_pretrained("bartowski/Qwen2.5-0.5B-Instruct-GGUF")          # Q4_K_M by default
        >>> Model.from_pretrained("bartowski/Qwen2.5-0.5B-Instruct-GGUF", quant="Q8_0")
        >>> Model.from_pretrained("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "*q4_0.gguf")  # a file or a glob

        ``filename``: a file of the repo or a glob pattern (exactly one model must match); ``quant``:
        a quant its file name has (``Q8_0``); neither: the quant rule of
        :mod:`pyllama_kv.modelfile.hub` (the only model, else Q4_K_M, Q4_K_S, Q4_0, Q5_K_M, Q8_0).
        ``revision``: a branch, tag or commit. ModelLoadError (one line) for a repo that does not
        exist, is gated without a token, has no GGUF or no model matching, or cannot be reached and
        is not cached. ``trust_unverified``: offline, a cached file the hub cannot vouch for (not a link
        into the repo's blobs) is loaded instead of refused."""
        from ..modelfile import hub

        if not isinstance(repo_id, str) or hub.parse(repo_id, explicit=True) != hub.HubName(repo_id):
            raise InvalidInputError(f"repo_id must be 'OWNER/REPO', got {repo_id!r}")
        if filename is not None and quant is not None:
            raise InvalidInputError("give filename or quant, not both")
        return cls(hub.fetch(hub.HubName(repo_id, revision, quant, filename), trust_unverified=bool(trust_unverified)),
                   **kwargs)

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._native is None

    @property
    def _ptr(self):
        """The raw ``llama_model *`` (None once closed): for tests and scripts that call C directly."""
        n = self._native
        return None if n is None else n.ptr

    @property
    def library(self) -> dict:
        """Information about the libllama this model runs on (see pyllama_kv.library_info); ``chosen``:
        why it is not the default library (the model needs the current llama.cpp), when so."""
        out = dict(self._lib.info)
        if self.library_choice:
            out["chosen"] = self.library_choice
        return out

    @property
    def on_device(self) -> bool:
        """Whether some of its layers, and so their KV cache, are in a device's memory (a GPU of its
        library, or RPC servers): a copy out of such a cache is a transfer, and a defrag of it takes
        the gather graphs, not the host memcpy path."""
        return bool(self.n_gpu_layers) and bool(self.rpc or self._lib.gpu_devices())

    @property
    def native_library(self) -> _kv.Library:
        """The loaded libllama (:class:`~pyllama_kv._native.kv.Library`) this model's contexts and
        samplers call (package interface; :attr:`library` is its public description)."""
        return self._lib

    def open_native_context(self, owner, adopt: Callable[[_kv.NativeContext], None],
                            **params) -> _kv.NativeContext:
        """llama_init_from_model for ``owner`` (a Context): ``params`` are
        :meth:`~pyllama_kv._native.kv.NativeContext.create`'s. Under the model's lock, so the model
        cannot be closed meanwhile: the new native context is given to ``adopt`` first, then ``owner``
        is registered (closed first by :meth:`close`, until it calls :meth:`forget_context`).
        InvalidInputError when the model is closed, LlamaError when llama.cpp refuses."""
        with self._lock:
            self.check_open()
            native_model = self._native
            assert native_model is not None
            native, err = _kv.NativeContext.create(self._lib, native_model, **params)
            if native is None:
                raise LlamaError("llama.cpp could not create the context" + (f": {err}" if err else ""))
            adopt(native)
            self._contexts.add(owner)
            return native

    def forget_context(self, owner) -> None:
        """``owner`` freed the native context :meth:`open_native_context` made for it."""
        self._contexts.discard(owner)

    def close(self) -> None:
        """Free the model. Open contexts are closed first (each under its own lock, so a context
        that is decoding finishes first; from a context's abort callback this raises
        InvalidInputError and the model stays open); then vocabulary calls running in other threads
        finish (none starts once the model is closing: they raise InvalidInputError). From within a
        vocabulary call of its own thread (a log handler) this raises InvalidInputError and the model
        stays open."""
        if getattr(self, "_native", None) is None:
            return
        while True:
            with self._lock:
                native = self._native
                if native is None:
                    return
                ctxs = list(self._contexts)
                if not ctxs:
                    with self._vocab_idle:
                        if threading.get_ident() in self._vocab_calls:   # (a log handler, under the call)
                            raise InvalidInputError("the model cannot be closed from within one of its own "
                                                    "vocabulary calls")
                        self._native = None   # (no vocabulary call starts from here on)
                        while self._vocab_calls:
                            self._vocab_idle.wait()
                    native.free()
                    if self.rpc:
                        with _rpc_lock:
                            for ep in self.rpc:
                                _rpc_open[ep] -= 1
                    return
            for c in ctxs:   # outside the model lock: a context's lock is always taken first
                c.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.desc}, n_vocab={self.n_vocab}, n_layer={self.n_layer}"
        return f"<pyllama_kv.Model {self.path.name}: {state}>"

    def check_open(self) -> None:
        """InvalidInputError when the model is closed."""
        if self._native is None:
            raise InvalidInputError("the model is closed")

    # -- vocabulary -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _vocab(self):
        """The native model for one vocabulary or metadata call, without the model's lock (read-only
        after load, thread-safe in llama.cpp): counted while it runs, so that :meth:`close` frees the
        model only after it. InvalidInputError when the model is closed or closing."""
        me = threading.get_ident()
        with self._vocab_idle:
            native = self._native
            if native is None:
                raise InvalidInputError("the model is closed")
            self._vocab_calls[me] = self._vocab_calls.get(me, 0) + 1
        try:
            yield native
        finally:
            with self._vocab_idle:
                if self._vocab_calls[me] > 1:
                    self._vocab_calls[me] -= 1
                else:
                    del self._vocab_calls[me]
                    if not self._vocab_calls:
                        self._vocab_idle.notify_all()

    def tokenize(self, text: str | bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text`` (str, or UTF-8 bytes); ``add_bos`` adds the BOS token if the model
        uses one. Text the vocabulary cannot represent raises InvalidInputError."""
        if not isinstance(add_bos, bool) or not isinstance(special, bool):
            raise InvalidInputError("add_bos and special must be bools")
        if isinstance(text, str):
            data = text.encode("utf-8", "surrogatepass")
        elif isinstance(text, (bytes, bytearray, memoryview)):
            data = bytes(text)
        else:
            raise InvalidInputError(f"tokenize needs str or bytes, got {type(text).__name__}")
        if len(data) > INT32_MAX // 2:
            raise InvalidInputError(f"text of {len(data)} bytes is too long to tokenize")
        n_max = len(data) + 8
        with self._vocab() as native:
            for _ in range(2):
                n, toks = native.tokenize(data, n_max, bool(add_bos), bool(special))
                if n >= 0:
                    return toks
                if n == C_EXCEPTION:
                    why = self._lib.last_error() or "llama.cpp failed"
                    raise InvalidInputError(f"the vocabulary cannot tokenize this text: {why}")
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
        """``tokens`` as an int32 array, or InvalidInputError if any id is out of range: the one range
        check of token ids (prompts, logit_bias keys, a grammar's token references), whatever their size."""
        if isinstance(tokens, (str, bytes)):
            raise InvalidInputError(f"{what} ids must be integers, got {type(tokens).__name__} (tokenize text first)")
        try:
            arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(list(tokens))
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"{what} ids must be integers: {exc}") from None
        if arr.ndim != 1:
            raise InvalidInputError(f"{what} ids must be a flat sequence of integers")
        if arr.size and arr.dtype == object:   # Python ints past int64 (or a mix of types)
            for i, t in enumerate(arr.tolist()):
                if isinstance(t, bool) or not isinstance(t, int):
                    raise InvalidInputError(f"{what} ids must be integers, got {type(t).__name__} at index {i}")
                if not 0 <= t < self.n_vocab:
                    raise InvalidInputError(f"{what} id {t} at index {i} is out of range [0, {self.n_vocab})")
        if arr.size and arr.dtype.kind not in "iu":
            raise InvalidInputError(f"{what} ids must be integers, got {arr.dtype} values")
        if arr.size:
            bad = (arr < 0) | (arr >= self.n_vocab)
            if bad.any():
                i = int(np.argmax(bad))
                raise InvalidInputError(f"{what} id {int(arr[i])} at index {i} is out of range [0, {self.n_vocab})")
        return arr.astype(np.int32, copy=False)

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The bytes of one token (may be part of a UTF-8 character). Kept once asked (not ``special``):
        an engine streams every token it generates through here."""
        if type(token) is int and not special and self._native is not None:
            known = self._pieces.get(token)   # (only ids that passed the checks below are keys)
            if known is not None:
                return known
        t = self._token_id(token)
        with self._vocab() as native:
            n, piece = native.token_to_piece(t, 64, bool(special))
            if n < 0 and n != C_EXCEPTION:
                n, piece = native.token_to_piece(t, -n, bool(special))
            if n < 0:
                raise LlamaError(f"llama_token_to_piece failed for token {t}: {self._lib.last_error()}")
        if not special:
            self._pieces[t] = piece
        return piece

    def detokenize(self, tokens: _Seq[int], special: bool = False) -> str:
        """Text of ``tokens`` (invalid UTF-8 is replaced). Ids are validated first."""
        arr = self.check_tokens(tokens)
        if arr.size == 0:
            return ""
        if arr.size > INT32_MAX // 64:
            raise InvalidInputError(f"{arr.size} tokens are too many to detokenize at once")
        arr = np.ascontiguousarray(arr)
        n_max = max(64, arr.size * 16)
        with self._vocab() as native:
            for _ in range(2):
                n, out = native.detokenize(arr, n_max, not special, bool(special))
                if n >= 0:
                    return out.decode("utf-8", "replace")
                if n == C_EXCEPTION:
                    break
                n_max = -n
        raise LlamaError(f"llama_detokenize failed: {self._lib.last_error()}")

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends generation (EOS, EOT, ...). Kept once asked: an engine asks for every
        token it draws."""
        if type(token) is int and self._native is not None:
            known = self._eog.get(token)   # (only ids that passed the checks below are keys)
            if known is not None:
                return known
        t = self._token_id(token)
        with self._vocab() as native:
            eog = bool(native.is_eog(t))
        self._eog[t] = eog
        return eog

    def meta(self, key: str) -> str | None:
        """A metadata value of the GGUF file as a string (None if absent; arrays are abridged by
        llama.cpp)."""
        if not isinstance(key, str):
            raise InvalidInputError(f"meta key must be a str, got {type(key).__name__}")
        k = key.encode("utf-8", "surrogatepass")
        if b"\0" in k:
            raise InvalidInputError("meta key must not contain NUL")
        size = 4096
        with self._vocab() as native:
            for _ in range(2):
                n, val = native.meta(k, size)
                if n < 0:
                    return None
                if n < size:
                    return val.decode("utf-8", "replace")
                size = n + 1
        return val.decode("utf-8", "replace")  # pragma: no cover

    @property
    def chat_template(self) -> str | None:
        """The GGUF's ``tokenizer.chat_template`` in full (read from the file once), or None."""
        from ..chat import templates as chat

        return chat.chat_template(self)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, *, tools: list | None = None) -> str:
        """Render ``messages`` (a list of ``{"role": str, "content": str}``, which may carry
        ``tool_calls``, ``tool_call_id`` and ``name`` too) with the model's chat template, sandboxed as
        transformers does (see pyllama_kv.chat.templates), ``tools`` (OpenAI function definitions) as the
        template's ``tools`` variable; InvalidInputError if the model has none or the template fails
        or is refused."""
        from ..chat import templates as chat

        return chat.apply_chat_template(self, messages, add_generation_prompt, tools=tools)

    def tensor_names(self) -> frozenset[str]:
        """The names of the file's tensors (read with its header: as validated, or now when validation is off)."""
        if self._tensor_names is None:
            from ..modelfile.gguf import read_gguf_header

            self._tensor_names = frozenset(t.name for t in read_gguf_header(self.path).tensors)
        return self._tensor_names

    @property
    def can_generate(self) -> bool:
        """False for an encoder without a language-model head (BERT family): embeddings only."""
        from .embedding import ENCODER_ARCHS

        return (self.meta("general.architecture") or "") not in ENCODER_ARCHS

    # -- embeddings -----------------------------------------------------------------------------

    def embedder(self, pooling: str | None = None, **kwargs):
        """A new :class:`~pyllama_kv.core.embedding.Embedder` (an embeddings context) over this model:
        ``pooling`` None is the GGUF's; ``n_batch``, ``n_seqs``, ``n_threads`` as its docstring says."""
        from .embedding import Embedder

        return Embedder(self, pooling, **kwargs)

    def embed(self, inputs, pooling: str | None = None, normalize: bool = True):
        """Embeddings of ``inputs``, batched over sequences (many inputs per llama_decode).

        ``inputs``: a str, a list of token ids, or a list of those (at most ``limits.MAX_EMBED_INPUTS``);
        text is tokenized with the model's special tokens, as llama.cpp's ``llama-embedding`` does.
        ``pooling``: None (the GGUF's ``{arch}.pooling_type``; ``none`` for a model without one),
        ``"mean"``, ``"cls"``, ``"last"``, ``"rank"`` (a reranker's score) or ``"none"``.
        ``normalize``: Euclidean normalisation (llama.cpp's default; never applied to rank scores).

        Returns, for one input, a float32 array: (n_embd,) pooled, (n_tokens, n_embd) with pooling
        ``none``, (1,) with ``rank``; for a list, a (n_inputs, n_embd) array (``none``: a list of
        arrays). Each input is at most 2048 tokens (and the model's n_ctx_train). Bad input raises
        InvalidInputError before any C call. The embeddings context is made on first use and kept
        (one per pooling) until the model is closed.
        """
        from .embedding import check_pooling, embed_inputs, model_pooling

        if not isinstance(normalize, bool):
            raise InvalidInputError(f"normalize must be a bool, got {type(normalize).__name__}")
        key = model_pooling(self, check_pooling(pooling))
        toks, single = embed_inputs(self, inputs)
        with self._lock:
            self.check_open()
            emb = self._embedders.get(key)
            if emb is None or emb.closed:
                emb = self._embedders[key] = self.embedder(key)
        emb.check(toks)
        out = emb.embed(toks, normalize)
        assert out is not None
        if single:
            return out[0]
        return out if key == "none" else np.stack(out)

    def rerank(self, query: str, documents: list[str], top_n: int | None = None) -> list[tuple[int, float]]:
        """Relevance of each document to ``query`` by a reranker model (rank pooling), as llama-server's
        ``/v1/rerank`` formats the pairs (BOS query EOS SEP document EOS): ``(index, score)`` pairs, the
        most relevant first, the first ``top_n`` of them (None: all). InvalidInputError for a model that
        is not a reranker."""
        from .embedding import check_reranker, rerank_tokens

        if not isinstance(query, str) or not isinstance(documents, (list, tuple)) or not documents \
                or not all(isinstance(d, str) for d in documents):
            raise InvalidInputError("rerank needs a query (str) and a non-empty list of documents (str)")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
            raise InvalidInputError(f"top_n must be a positive int or None, got {top_n!r}")
        check_reranker(self)
        q = self.tokenize(query, add_bos=False, special=True)
        pairs = [rerank_tokens(self, q, self.tokenize(d, add_bos=False, special=True)) for d in documents]
        scores = self.embed(pairs, pooling="rank", normalize=False)
        order = sorted(range(len(documents)), key=lambda i: -float(scores[i][0]))
        return [(i, float(scores[i][0])) for i in order[:top_n]]

    # -- contexts -------------------------------------------------------------------------------

    def context(self, n_ctx: int = _CC.n_ctx, n_seq_max: int = _CC.n_seq_max, n_batch: int = _CC.n_batch,
                n_ubatch: int = _CC.n_ubatch, flash_attn: bool | None = _CC.flash_attn, type_k: str = _CC.type_k,
                type_v: str = _CC.type_v, **kwargs):
        """A new :class:`~pyllama_kv.core.context.Context` over this model (see its docstring; the defaults
        are :class:`~pyllama_kv.config.ContextConfig`'s)."""
        from .context import Context

        return Context(self, n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=n_batch, n_ubatch=n_ubatch,
                       flash_attn=flash_attn, type_k=type_k, type_v=type_v, **kwargs)
