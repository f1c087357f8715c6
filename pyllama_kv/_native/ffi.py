"""The one place where C meets Python: cffi declarations (ABI mode) and library loading.

Every C type and function pyllama_kv uses is declared in ``decl/*.h``, copied from the pinned
``llama.h`` (and ``ggml.h`` / ``ggml-backend.h`` for the few types and registry functions it needs).
``tests/test_ffi_header.py`` compiles these declarations against the vendored headers, so drift is
a test failure, not a crash.

Loading is ABI mode (``dlopen``), so the same package runs on the patched or the vanilla build.
Which library: ``PYLLAMA_KV_LIB`` (a path to a libllama) if set, else the patched build found
through the build manifests (locate.py; CPU first). Functions the loaded library lacks (the stats
API in a vanilla build) are reported by :meth:`Library.has` instead of failing at import.

Two API generations. The mission pin (8733e0c, May 2025: ``llama_kv_self_*``, the cell view, our
patch series) and the current pin (``vendor/llama.cpp-current``: ``llama_get_memory`` and
``llama_memory_*``, new ``llama_model_params``/``llama_context_params`` layouts) have different C
APIs. Each has its own declarations (``decl/*.h`` and ``decl/current/*.h``) and its own cffi FFI;
:class:`Library` finds out which one a file is from its exports *before* any declaration is bound
(``llama_get_memory`` present: current), and carries ``.ffi``, ``.api`` ("mission" | "current") and
``.caps`` (:class:`Caps`: what the library can do). Code above ``_native`` asks ``caps``, never the
pin's name.

llama.cpp's log goes to the Python logger ``pyllama_kv.llama`` (a NullHandler is attached to
``pyllama_kv``, so nothing prints unless the application configures logging).
"""
from __future__ import annotations

import _thread
import collections
import dataclasses
import functools
import logging
import os
import re
import threading
from pathlib import Path
from typing import Callable

import cffi

from ..errors import InvalidInputError, LibraryError
from ..limits import KV_CACHE_TYPES, QUANTIZED_KV_TYPES
from . import archs
from .locate import _one_line, resolve

DECL_DIR = Path(__file__).resolve().parent / "decl"


def _decl(name: str) -> str:
    """The declarations of decl/NAME, without their C comments."""
    text = re.sub(r"/\*.*?\*/", "", (DECL_DIR / name).read_text(), flags=re.S)
    return re.sub(r"//[^\n]*", "", text).lstrip("\n")


# C types. Struct layouts must match llama.h exactly (checked by tests/test_ffi_header.py).
TYPES_CDEF = _decl("llama_types.h")

# Functions present in every build of the pinned revision (llama.h's, and the ggml backend registry's).
FUNCS_CDEF = _decl("llama_funcs.h") + _decl("ggml_backend.h")

# Functions only our patched build exports (patches/0004-kv-stats-api.patch, 0014-state-seq-add-data.patch).
PATCHED_FUNCS_CDEF = _decl("llama_patched.h")

ffi = cffi.FFI()
ffi.cdef(TYPES_CDEF)
ffi.cdef(FUNCS_CDEF)
ffi.cdef(PATCHED_FUNCS_CDEF)

# the current pin's API generation (decl/current/*.h, checked against vendor/llama.cpp-current's headers)
CURRENT_TYPES_CDEF = _decl("current/llama_types.h")
CURRENT_FUNCS_CDEF = _decl("current/llama_funcs.h") + _decl("current/ggml_backend.h")

# functions only the current pin's series exports (patches/current/0001-state-seq-add-data.patch)
CURRENT_PATCHED_FUNCS_CDEF = _decl("current/llama_patched.h")


@functools.cache
def current_ffi() -> cffi.FFI:
    """The current generation's FFI, parsed on first use (a library of it loaded, or a test): the
    mission generation's ``ffi`` serves every process, this one only those that load the current pin
    (parsing it costs ~60 ms of every start-up otherwise)."""
    f = cffi.FFI()
    f.cdef(CURRENT_TYPES_CDEF)
    f.cdef(CURRENT_FUNCS_CDEF)
    f.cdef(CURRENT_PATCHED_FUNCS_CDEF)
    return f


# a function only the current generation exports: what Library looks at before binding a
# generation's declarations
_PROBE = cffi.FFI()
_PROBE.cdef("void * llama_get_memory(void *);")

# the KV cache types (name -> ggml type id) and the quantized ones, under the names scripts use here
GGML_TYPES = KV_CACHE_TYPES
QUANTIZED_TYPES = QUANTIZED_KV_TYPES

log = logging.getLogger("pyllama_kv.llama")
logging.getLogger("pyllama_kv").addHandler(logging.NullHandler())

_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}


# every function of FUNCS_CDEF: a library must export them all to be loaded (checked at load, so that a
# wrong library is a LibraryError naming the file, not an AttributeError in the middle of a call)
def _func_names(cdef: str) -> tuple[str, ...]:
    return tuple(m.group(1) for m in (re.search(r"(\w+)\s*\(", decl) for decl in cdef.split(";")) if m)


REQUIRED_FUNCS: tuple[str, ...] = _func_names(FUNCS_CDEF)
CURRENT_REQUIRED_FUNCS: tuple[str, ...] = _func_names(CURRENT_FUNCS_CDEF)

# per API generation: its FFI and the functions a library of it must export
_GENERATIONS: dict[str, tuple[Callable[[], cffi.FFI], tuple[str, ...]]] = {
    "mission": (lambda: ffi, REQUIRED_FUNCS), "current": (current_ffi, CURRENT_REQUIRED_FUNCS)}


@dataclasses.dataclass(frozen=True)
class Caps:
    """What a loaded library can do; the layers above ``_native`` decide by these, never by the pin.

    ``api``: the API generation ("mission" or "current"), for messages and library_info only."""

    api: str
    defrag: bool                   # an explicit defrag exists (llama_kv_self_defrag: the mission pin)
    safe_defrag: bool              # defrag and defrag_thold cannot abort the process (patch 0003)
    stats: bool                    # llama_kv_self_stats' defrag/retry counters (patch 0004)
    cell_view: bool                # a per-cell view of the cache (llama_kv_cache_view: the mission pin)
    span_restore: bool             # a span restored onto a sequence keeping its prefix (patch 0014)
    span_range_read: bool          # a position range of a sequence's state read alone (patch 0017; current/0003)
    state_io: bool                 # sequence states in the byte format core/state.py validates
    kv_shift: bool                 # a K-shift is trusted where the context says it can (patch 0009; current)
    slot_retry: bool               # a batch finds cells whenever enough are free (defrag-and-retry, or
                                   # batches written into non-contiguous cells)
    scattered_cells: bool          # batches go into non-contiguous cells: the largest free block is all free cells
    partial_remove_may_fail: bool  # seq_rm may refuse a partial range (recurrent/SWA memory): bool false
    recurrent_checkpoints: bool    # a sequence's recurrent state read and written alone
                                   # (llama_state_seq_*_ext with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
    flash_attn_auto: bool          # flash attention "auto" (on where the backend has it)
    backend_sampling: bool = False  # a sequence's sampler chain runs in the graph (llama_set_sampler: current)
    # head sizes the GPU backend has flash-attention kernels for, where the library has no "auto" of
    # its own (the mission pin: patch 0015 makes CUDA claim exactly these; others run on the CPU)
    gpu_flash_attn_head_sizes: frozenset = frozenset()
    architectures: frozenset = frozenset()   # the model architectures it implements (archs.py)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["architectures"] = len(self.architectures)   # a count: the names are in _native/archs.py
        d["gpu_flash_attn_head_sizes"] = sorted(self.gpu_flash_attn_head_sizes)
        return d


def _caps(api: str, has) -> Caps:
    """The capabilities of a library of generation ``api`` whose exports ``has(name)`` tells."""
    if api == "current":
        return Caps(api="current", defrag=False, safe_defrag=False, stats=False, cell_view=False,
                    # states need pending K-shifts applied before they are read (patches/current/0002)
                    span_restore=has("llama_state_seq_add_data") and has("llama_memory_update"),
                    span_range_read=has("llama_state_seq_get_data_range") and has("llama_memory_update"),
                    state_io=has("llama_memory_update"),
                    kv_shift=True, slot_retry=True,
                    scattered_cells=True, recurrent_checkpoints=True,
                    partial_remove_may_fail=True, flash_attn_auto=True, architectures=archs.CURRENT,
                    backend_sampling=has("llama_set_sampler"))
    patched = has("llama_kv_self_stats")
    return Caps(api="mission", defrag=True, safe_defrag=patched, stats=patched, cell_view=True,
                span_restore=has("llama_state_seq_add_data"),
                span_range_read=has("llama_state_seq_get_data_range"), state_io=True, kv_shift=patched,
                slot_retry=patched, scattered_cells=False, recurrent_checkpoints=False,
                partial_remove_may_fail=False, flash_attn_auto=False,
                gpu_flash_attn_head_sizes=frozenset({64, 80, 96, 112, 128, 256}), architectures=archs.MISSION)


def _api_of(path: Path) -> str:
    """The API generation of the library at ``path``, from its exports (OSError/ValueError when it
    cannot be loaded at all)."""
    probe = _PROBE.dlopen(str(path))
    try:
        getattr(probe, "llama_get_memory")  # noqa: B009 - cffi binds the symbol on access: AttributeError when absent
        return "current"
    except AttributeError:
        return "mission"


def _callback_error(exc_type, exc_value, tb) -> None:
    """cffi's onerror for our callbacks: an exception raised before the callback's own try block (a
    Ctrl-C whose Python handler ran at the callback's entry) cannot go into C; a KeyboardInterrupt
    is handed back to the main thread as a new SIGINT, anything else is dropped."""
    if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
        _thread.interrupt_main()


class Library:
    """A loaded libllama: the cffi handle ``lib`` plus what we know about the build."""

    def __init__(self, path: Path, info: dict):
        self.path = path
        self.info = info
        try:
            self.api = _api_of(path)
            make_ffi, required = _GENERATIONS[self.api]
            self.ffi = make_ffi()
            self.lib = self.ffi.dlopen(str(path))
        except (OSError, ValueError) as exc:
            # cffi's message: "cannot load library 'P': P: REASON.  Additionally, ctypes.util...": keep REASON
            reason = _one_line(exc).split(" Additionally, ")[0]
            reason = reason.replace(f"cannot load library '{path}': ", "").replace(f"{path}: ", "")
            raise LibraryError(f"cannot load {path}: {reason}") from None
        # a library that loads but is not a libllama of the pinned revision (libz, an older llama.cpp)
        # would otherwise fail later with AttributeError at the first missing function
        missing = [name for name in required if not self._exports(name)]
        if missing:
            try:
                self.ffi.dlclose(self.lib)
            except Exception:  # pragma: no cover - nothing more to free
                pass
            more = f" (and {len(missing) - 1} more of the {len(required)} functions pyllama_kv needs)" \
                if len(missing) > 1 else ""
            raise LibraryError(f"{path} is not a usable libllama: it does not export {missing[0]}{more}")
        self._has: dict[str, bool] = {}
        self.lock = threading.RLock()
        self._pending = ""
        self._pending_level = logging.INFO
        # recent error lines, so that a NULL from C can be explained in the exception
        self.recent_errors: collections.deque[str] = collections.deque(maxlen=8)
        self._log_cb = self.ffi.callback("void(enum ggml_log_level, const char *, void *)", self._on_log,
                                         onerror=_callback_error)
        self.lib.llama_log_set(self._log_cb, self.ffi.NULL)
        self.lib.llama_backend_init()
        self.caps = _caps(self.api, self.has)
        self.info["has_stats"] = self.caps.stats
        self.info["api"] = self.api
        self.info["caps"] = self.caps.as_dict()
        if self.info.get("variant") in (None, "unknown"):
            self.info["variant"] = "patched" if self.info["has_stats"] else "vanilla"

    def _exports(self, name: str) -> bool:
        try:
            getattr(self.lib, name)
            return True
        except AttributeError:
            return False

    def gpu_devices(self) -> list[str]:
        """The names of the GPU devices this library's backends found (CUDA, Metal, ...; RPC servers
        are not among them until a model connects them): empty on a CPU build or a machine
        without a GPU."""
        L, ffi = self.lib, self.ffi
        with self.lock:
            devs = [L.ggml_backend_dev_get(i) for i in range(L.ggml_backend_dev_count())]
            return [ffi.string(L.ggml_backend_dev_name(d)).decode("utf-8", "replace") for d in devs
                    if L.ggml_backend_dev_type(d) == L.GGML_BACKEND_DEVICE_TYPE_GPU]

    def has(self, name: str) -> bool:
        """Whether the loaded library exports ``name`` (e.g. the patched-only stats API)."""
        if name not in self._has:
            self._has[name] = self._exports(name)
        return self._has[name]

    def max_parallel_sequences(self) -> int | None:
        """llama_max_parallel_sequences() where the library has it (the current API), else None."""
        if self.api != "current":
            return None
        return int(self.lib.llama_max_parallel_sequences())

    @property
    def patched(self) -> bool:
        return bool(self.info.get("has_stats"))

    def _on_log(self, level, text, _user) -> None:
        try:
            msg = self.ffi.string(text).decode("utf-8", "replace") if text != ffi.NULL else ""
            if level == 5:  # CONT: continues the previous message
                lvl = self._pending_level
            else:
                lvl = _LEVELS.get(level, logging.INFO)
                if self._pending:
                    self._emit(self._pending_level, self._pending)
                    self._pending = ""
                self._pending_level = lvl
            self._pending += msg
            if self._pending.endswith("\n"):
                self._emit(lvl, self._pending.rstrip("\n"))
                self._pending = ""
        except KeyboardInterrupt:
            # Ctrl-C landed in this callback: it cannot be raised into C, so hand it back to the main
            # thread as a new SIGINT (it goes through the handler, so a critical section defers it)
            _thread.interrupt_main()
        except BaseException:  # never raise into C
            pass

    def _emit(self, lvl: int, msg: str) -> None:
        if lvl >= logging.ERROR:
            self.recent_errors.append(msg.strip())
        if log.isEnabledFor(lvl):
            log.log(lvl, "%s", msg)

    def last_error(self) -> str:
        """The most specific recent error line of llama.cpp (the first of the last failure), without
        the C function name prefix."""
        if not self.recent_errors:
            return ""
        msg = self.recent_errors[0]
        return re.sub(r"^[a-z_][a-z0-9_]*: ", "", msg)

    def clear_errors(self) -> None:
        self.recent_errors.clear()


class CResource:
    """Mixin for objects owning a C resource: ``close()`` frees it; ``with`` and garbage collection
    call ``close()`` too."""

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # A copy would share the C pointer and free it twice: refused (share the object itself).
    def __copy__(self):
        raise InvalidInputError(f"a {type(self).__name__} owns a C resource and cannot be copied: share the object")

    def __deepcopy__(self, memo):
        self.__copy__()

    def __reduce_ex__(self, protocol):
        raise InvalidInputError(f"a {type(self).__name__} owns a C resource and cannot be pickled")

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_libs: dict[str, Library] = {}
_libs_lock = threading.Lock()


def load(lib: str | os.PathLike | None = None) -> Library:
    """The loaded library for ``lib`` (see :func:`resolve`); loaded once per path per process."""
    path, info = resolve(lib)
    key = str(path)
    with _libs_lock:
        if key not in _libs:
            _libs[key] = Library(path, info)
        return _libs[key]


def library_info(lib: str | os.PathLike | None = None) -> dict:
    """path, variant, revision, patches applied and backend of the library the API would use."""
    loaded = load(lib)
    out = dict(loaded.info)
    out["system_info"] = loaded.ffi.string(loaded.lib.llama_print_system_info()).decode("utf-8", "replace")
    return out
