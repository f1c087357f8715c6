"""The one place where C meets Python: cffi declarations (ABI mode) and library loading.

Every C type and function pyllama_kv uses is declared here, copied from the pinned ``llama.h``
(and ``ggml.h`` for the few types it needs). ``tests/test_ffi_header.py`` compiles these
declarations against the vendored header, so drift is a test failure, not a crash.

Loading is ABI mode (``dlopen``), so the same package runs on the patched or the vanilla build.
Which library: ``PYLLAMA_KV_LIB`` (a path to a libllama) if set, else the patched build found
through the harness's build manifests (CPU first). Functions the loaded library lacks (the stats
API in a vanilla build) are reported by :meth:`Library.has` instead of failing at import.

llama.cpp's log goes to the Python logger ``pyllama_kv.llama`` (a NullHandler is attached to
``pyllama_kv``, so nothing prints unless the application configures logging).
"""
from __future__ import annotations

import _thread
import collections
import logging
import os
import re
import threading
from pathlib import Path

import cffi

from . import _paths
from .errors import InvalidInputError, LibraryError

# C types. Struct layouts must match llama.h exactly (checked by tests/test_ffi_header.py).
TYPES_CDEF = r"""
typedef int32_t llama_token;
typedef int32_t llama_pos;
typedef int32_t llama_seq_id;

struct llama_model;
struct llama_context;
struct llama_vocab;
struct llama_sampler;
struct llama_model_kv_override;
struct llama_model_tensor_buft_override;
struct ggml_tensor;
typedef struct ggml_backend_device * ggml_backend_dev_t;

enum ggml_log_level {
    GGML_LOG_LEVEL_NONE  = 0,
    GGML_LOG_LEVEL_DEBUG = 1,
    GGML_LOG_LEVEL_INFO  = 2,
    GGML_LOG_LEVEL_WARN  = 3,
    GGML_LOG_LEVEL_ERROR = 4,
    GGML_LOG_LEVEL_CONT  = 5,
};

enum ggml_type {
    GGML_TYPE_F32    = 0,
    GGML_TYPE_F16    = 1,
    GGML_TYPE_Q4_0   = 2,
    GGML_TYPE_Q4_1   = 3,
    GGML_TYPE_Q5_0   = 6,
    GGML_TYPE_Q5_1   = 7,
    GGML_TYPE_Q8_0   = 8,
    GGML_TYPE_IQ4_NL = 20,
    GGML_TYPE_BF16   = 30,
};

enum llama_rope_type {
    LLAMA_ROPE_TYPE_NONE = -1,
    LLAMA_ROPE_TYPE_NORM = 0,
};

enum llama_rope_scaling_type {
    LLAMA_ROPE_SCALING_TYPE_UNSPECIFIED = -1,
    LLAMA_ROPE_SCALING_TYPE_NONE        = 0,
};

enum llama_pooling_type {
    LLAMA_POOLING_TYPE_UNSPECIFIED = -1,
    LLAMA_POOLING_TYPE_NONE        = 0,
};

enum llama_attention_type {
    LLAMA_ATTENTION_TYPE_UNSPECIFIED = -1,
    LLAMA_ATTENTION_TYPE_CAUSAL      = 0,
};

enum llama_split_mode {
    LLAMA_SPLIT_MODE_NONE  = 0,
    LLAMA_SPLIT_MODE_LAYER = 1,
    LLAMA_SPLIT_MODE_ROW   = 2,
};

typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
typedef bool (*ggml_abort_callback)(void * data);
typedef bool (*ggml_backend_sched_eval_callback)(struct ggml_tensor * t, bool ask, void * user_data);
typedef bool (*llama_progress_callback)(float progress, void * user_data);

typedef struct llama_batch {
    int32_t n_tokens;
    llama_token  *  token;
    float        *  embd;
    llama_pos    *  pos;
    int32_t      *  n_seq_id;
    llama_seq_id ** seq_id;
    int8_t       *  logits;
} llama_batch;

struct llama_model_params {
    ggml_backend_dev_t * devices;
    const struct llama_model_tensor_buft_override * tensor_buft_overrides;
    int32_t n_gpu_layers;
    enum llama_split_mode split_mode;
    int32_t main_gpu;
    const float * tensor_split;
    llama_progress_callback progress_callback;
    void * progress_callback_user_data;
    const struct llama_model_kv_override * kv_overrides;
    bool vocab_only;
    bool use_mmap;
    bool use_mlock;
    bool check_tensors;
};

struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_batch;
    uint32_t n_ubatch;
    uint32_t n_seq_max;
    int32_t  n_threads;
    int32_t  n_threads_batch;
    enum llama_rope_scaling_type rope_scaling_type;
    enum llama_pooling_type      pooling_type;
    enum llama_attention_type    attention_type;
    float    rope_freq_base;
    float    rope_freq_scale;
    float    yarn_ext_factor;
    float    yarn_attn_factor;
    float    yarn_beta_fast;
    float    yarn_beta_slow;
    uint32_t yarn_orig_ctx;
    float    defrag_thold;
    ggml_backend_sched_eval_callback cb_eval;
    void * cb_eval_user_data;
    enum ggml_type type_k;
    enum ggml_type type_v;
    bool logits_all;
    bool embeddings;
    bool offload_kqv;
    bool flash_attn;
    bool no_perf;
    ggml_abort_callback abort_callback;
    void *              abort_callback_data;
};

typedef struct llama_sampler_chain_params {
    bool no_perf;
} llama_sampler_chain_params;

typedef struct llama_token_data {
    llama_token id;
    float logit;
    float p;
} llama_token_data;

typedef struct llama_token_data_array {
    llama_token_data * data;
    size_t size;
    int64_t selected;
    bool sorted;
} llama_token_data_array;

struct llama_kv_cache_view_cell {
    llama_pos pos;
};

struct llama_kv_cache_view {
    int32_t n_cells;
    int32_t n_seq_max;
    int32_t token_count;
    int32_t used_cells;
    int32_t max_contiguous;
    int32_t max_contiguous_idx;
    struct llama_kv_cache_view_cell * cells;
    llama_seq_id * cells_sequences;
};

struct llama_kv_stats {
    int32_t  n_cells;
    int32_t  used_cells;
    uint64_t n_defrags;
    uint64_t n_defrag_moves;
    uint64_t n_defrag_cells;
    uint64_t n_defrag_graphs;
    uint64_t n_slot_retries;
    uint64_t n_slot_failures;
    uint64_t t_defrag_us;
};
"""

# Functions present in every build of the pinned revision.
FUNCS_CDEF = r"""
struct llama_model_params          llama_model_default_params(void);
struct llama_context_params        llama_context_default_params(void);
struct llama_sampler_chain_params  llama_sampler_chain_default_params(void);

void llama_backend_init(void);
void llama_log_set(ggml_log_callback log_callback, void * user_data);
const char * llama_print_system_info(void);
bool llama_supports_gpu_offload(void);

struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
void llama_model_free(struct llama_model * model);
struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
void llama_free(struct llama_context * ctx);

uint32_t llama_n_ctx      (const struct llama_context * ctx);
uint32_t llama_n_batch    (const struct llama_context * ctx);
uint32_t llama_n_ubatch   (const struct llama_context * ctx);
uint32_t llama_n_seq_max  (const struct llama_context * ctx);

const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
enum llama_rope_type       llama_model_rope_type(const struct llama_model * model);
int32_t llama_model_n_ctx_train(const struct llama_model * model);
int32_t llama_model_n_embd     (const struct llama_model * model);
int32_t llama_model_n_layer    (const struct llama_model * model);
int32_t llama_model_n_head     (const struct llama_model * model);
int32_t llama_model_n_head_kv  (const struct llama_model * model);
int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
uint64_t llama_model_size(const struct llama_model * model);
uint64_t llama_model_n_params(const struct llama_model * model);
bool llama_model_has_encoder(const struct llama_model * model);
int32_t llama_model_meta_val_str(const struct llama_model * model, const char * key, char * buf, size_t buf_size);

int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
llama_token llama_vocab_bos(const struct llama_vocab * vocab);
llama_token llama_vocab_eos(const struct llama_vocab * vocab);
bool llama_vocab_get_add_bos(const struct llama_vocab * vocab);

int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
                       llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf, int32_t length,
                             int32_t lstrip, bool special);
int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
                         char * text, int32_t text_len_max, bool remove_special, bool unparse_special);

struct llama_kv_cache_view llama_kv_cache_view_init(const struct llama_context * ctx, int32_t n_seq_max);
void llama_kv_cache_view_free(struct llama_kv_cache_view * view);
void llama_kv_cache_view_update(const struct llama_context * ctx, struct llama_kv_cache_view * view);

int32_t llama_kv_self_n_tokens(const struct llama_context * ctx);
int32_t llama_kv_self_used_cells(const struct llama_context * ctx);
void llama_kv_self_clear(struct llama_context * ctx);
bool llama_kv_self_seq_rm(struct llama_context * ctx, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
void llama_kv_self_seq_cp(struct llama_context * ctx, llama_seq_id seq_id_src, llama_seq_id seq_id_dst,
                          llama_pos p0, llama_pos p1);
void llama_kv_self_seq_keep(struct llama_context * ctx, llama_seq_id seq_id);
void llama_kv_self_seq_add(struct llama_context * ctx, llama_seq_id seq_id, llama_pos p0, llama_pos p1,
                           llama_pos delta);
llama_pos llama_kv_self_seq_pos_max(struct llama_context * ctx, llama_seq_id seq_id);
void llama_kv_self_defrag(struct llama_context * ctx);
bool llama_kv_self_can_shift(const struct llama_context * ctx);
void llama_kv_self_update(struct llama_context * ctx);

size_t llama_state_seq_get_size(struct llama_context * ctx, llama_seq_id seq_id);
size_t llama_state_seq_get_data(struct llama_context * ctx, uint8_t * dst, size_t size, llama_seq_id seq_id);
size_t llama_state_seq_set_data(struct llama_context * ctx, const uint8_t * src, size_t size, llama_seq_id dest_seq_id);

int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads, int32_t n_threads_batch);
int32_t llama_n_threads(struct llama_context * ctx);
void llama_set_abort_callback(struct llama_context * ctx, ggml_abort_callback abort_callback, void * abort_callback_data);
float * llama_get_logits(struct llama_context * ctx);
float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);

struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
struct llama_sampler * llama_sampler_init_greedy(void);
struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
struct llama_sampler * llama_sampler_init_top_k(int32_t k);
struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
struct llama_sampler * llama_sampler_init_temp(float t);
struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
void llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p);
void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
void llama_sampler_reset(struct llama_sampler * smpl);
void llama_sampler_free(struct llama_sampler * smpl);
"""

# Functions only our patched build exports (patches/0004-kv-stats-api.patch).
PATCHED_FUNCS_CDEF = r"""
struct llama_kv_stats llama_kv_self_stats(const struct llama_context * ctx);
"""

ffi = cffi.FFI()
ffi.cdef(TYPES_CDEF)
ffi.cdef(FUNCS_CDEF)
ffi.cdef(PATCHED_FUNCS_CDEF)

GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}
QUANTIZED_TYPES = {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl"}

log = logging.getLogger("pyllama_kv.llama")
logging.getLogger("pyllama_kv").addHandler(logging.NullHandler())

_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}


# every function of FUNCS_CDEF: a library must export them all to be loaded (checked at load, so that a
# wrong library is a LibraryError naming the file, not an AttributeError in the middle of a call)
REQUIRED_FUNCS: tuple[str, ...] = tuple(
    m.group(1) for m in (re.search(r"(\w+)\s*\(", decl) for decl in FUNCS_CDEF.split(";")) if m
)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


class Library:
    """A loaded libllama: the cffi handle ``lib`` plus what we know about the build."""

    def __init__(self, path: Path, info: dict):
        self.path = path
        self.info = info
        try:
            self.lib = ffi.dlopen(str(path))
        except (OSError, ValueError) as exc:
            # cffi's message: "cannot load library 'P': P: REASON.  Additionally, ctypes.util...": keep REASON
            reason = _one_line(exc).split(" Additionally, ")[0]
            reason = reason.replace(f"cannot load library '{path}': ", "").replace(f"{path}: ", "")
            raise LibraryError(f"cannot load {path}: {reason}") from None
        # a library that loads but is not a libllama of the pinned revision (libz, an older llama.cpp)
        # would otherwise fail later with AttributeError at the first missing function
        missing = [name for name in REQUIRED_FUNCS if not self._exports(name)]
        if missing:
            try:
                ffi.dlclose(self.lib)
            except Exception:  # pragma: no cover - nothing more to free
                pass
            more = f" (and {len(missing) - 1} more of the {len(REQUIRED_FUNCS)} functions pyllama_kv needs)" \
                if len(missing) > 1 else ""
            raise LibraryError(f"{path} is not a usable libllama: it does not export {missing[0]}{more}")
        self._has: dict[str, bool] = {}
        self.lock = threading.RLock()
        self._pending = ""
        self._pending_level = logging.INFO
        # recent error lines, so that a NULL from C can be explained in the exception
        self.recent_errors: collections.deque[str] = collections.deque(maxlen=8)
        self._log_cb = ffi.callback("void(enum ggml_log_level, const char *, void *)", self._on_log)
        self.lib.llama_log_set(self._log_cb, ffi.NULL)
        self.lib.llama_backend_init()
        self.info["has_stats"] = self.has("llama_kv_self_stats")
        if self.info.get("variant") in (None, "unknown"):
            self.info["variant"] = "patched" if self.info["has_stats"] else "vanilla"

    def _exports(self, name: str) -> bool:
        try:
            getattr(self.lib, name)
            return True
        except AttributeError:
            return False

    def has(self, name: str) -> bool:
        """Whether the loaded library exports ``name`` (e.g. the patched-only stats API)."""
        if name not in self._has:
            self._has[name] = self._exports(name)
        return self._has[name]

    @property
    def patched(self) -> bool:
        return bool(self.info.get("has_stats"))

    def _on_log(self, level, text, _user) -> None:
        try:
            msg = ffi.string(text).decode("utf-8", "replace") if text != ffi.NULL else ""
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


def _manifest_builds() -> list[dict]:
    # reading manifests only (no subprocess): the API never runs anything
    from .build import find_builds

    try:
        return find_builds(_paths.project_root())
    except (OSError, ValueError, TypeError):  # an unreadable build dir or a damaged manifest
        return []


def resolve(lib: str | os.PathLike | None = None) -> tuple[Path, dict]:
    """Path and build info of the library to load.

    ``lib`` may be a path, ``"patched"`` or ``"vanilla"`` (the CPU build of that variant, else any
    backend), or None: ``$PYLLAMA_KV_LIB``, else the patched build.
    """
    if lib is None:
        lib = os.environ.get("PYLLAMA_KV_LIB") or "patched"
    if isinstance(lib, (bytes, os.PathLike)):
        try:
            lib = os.fsdecode(lib)
        except (TypeError, ValueError) as exc:
            raise LibraryError(f"lib must be a path, 'patched' or 'vanilla': {_one_line(exc)}") from None
    if not isinstance(lib, str):
        raise LibraryError(f"lib must be a path, 'patched', 'vanilla' or None, not {type(lib).__name__}")
    name = lib
    if not name.strip():
        raise LibraryError("lib is an empty string: give a path to a libllama, 'patched' or 'vanilla'")
    if "\0" in name:
        raise LibraryError(f"library path {name!r} contains a NUL byte")
    builds = _manifest_builds()
    if name in ("patched", "vanilla"):
        cands = [b for b in builds if b.get("variant") == name]
        cands.sort(key=lambda b: (b.get("backend") != "cpu", b.get("backend", "")))
        if not cands:
            raise LibraryError(
                f"no {name} build of libllama found under {_paths.build_root()}: run `make setup` "
                f"(or `pyllama-kv build{' --vanilla' if name == 'vanilla' else ''}`), or set PYLLAMA_KV_LIB"
            )
        b = cands[0]
        return Path(b["lib"]).resolve(), _info_from_manifest(b)
    try:
        path = Path(name).expanduser()
    except RuntimeError:  # "~user" of an unknown user
        path = Path(name)
    try:
        if path.is_dir():
            raise LibraryError(f"library {path} is a directory, not a libllama file")
        if not path.is_file():
            raise LibraryError(f"library {path} does not exist" if not path.exists() else
                               f"library {path} is not a regular file")
        path = path.resolve()
    except (OSError, ValueError, RuntimeError) as exc:  # a NUL byte, a symlink loop, a name too long
        raise LibraryError(f"library {name!r}: {_one_line(exc)}") from None
    for b in builds:
        try:
            if Path(b["lib"]).resolve() == path:
                return path, _info_from_manifest(b)
        except (OSError, ValueError, RuntimeError, TypeError, KeyError):
            continue
    return path, {"path": str(path), "variant": "unknown", "revision": None, "patches": [], "backend": None}


def _info_from_manifest(b: dict) -> dict:
    return {
        "path": str(Path(b["lib"]).resolve()),
        "variant": b.get("variant"),
        "revision": b.get("revision"),
        "patches": [p.get("name") for p in (b.get("patches") or []) if isinstance(p, dict)],
        "backend": b.get("backend"),
        "built_at": b.get("built_at"),
    }


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
    out["system_info"] = ffi.string(loaded.lib.llama_print_system_info()).decode("utf-8", "replace")
    return out
