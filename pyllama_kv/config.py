"""Options, defined once: validated dataclasses that the API, the engine and every CLI command share.

``SamplingParams`` says how one request draws tokens; ``CacheConfig`` how a KV cache is made (its size,
batch sizes, cache types and threads), and each config that makes one extends it instead of copying
its fields: ``ContextConfig`` (a context: adds its sequence ids), ``EngineConfig`` (the generation
engine's admission and batching policy; its context is ``EngineConfig.context()``) and the stress
workload's ``StressConfig``. Each is validated in ``__post_init__`` (InvalidInputError), so a bad value
is refused where it is written, and the CLI maps its flags onto these fields (``cli/options.py``)
instead of repeating defaults. The bounds themselves are :mod:`pyllama_kv.limits`'.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, fields

from .errors import InvalidInputError
from .limits import (
    DEFAULT_N_CTX,
    INT32_MAX,
    KV_CACHE_TYPES,
    LOGIT_BIAS_MAX,
    MAX_SEQUENCES,
    MAX_THREADS,
    PENALTY_MAX,
    POOLING_TYPES,
    QUANTIZED_KV_TYPES,
    REPEAT_PENALTY_MAX,
    SPEC_MAX_DRAFT,
    SPEC_SOURCES,
    TEMPERATURE_MAX,
    UINT32_MAX,
)

KV_TYPES = tuple(KV_CACHE_TYPES)   # the names, for callers of this module


def default_threads() -> int:
    """The CPU cores this process may run on (llama.cpp's own default is a fixed 4)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, n)


def on_off(text: str) -> bool:
    """A command-line switch's value: on/off (also true/false, yes/no, 1/0); ValueError otherwise."""
    t = str(text).strip().lower()
    if t in ("on", "true", "yes", "1"):
        return True
    if t in ("off", "false", "no", "0"):
        return False
    raise ValueError(f"expected on or off, got {text!r}")


def on_off_auto(text: str) -> bool | None:
    """A command-line switch that may also be left to the program: on/off as :func:`on_off`, or auto (None)."""
    if str(text).strip().lower() == "auto":
        return None
    try:
        return on_off(text)
    except ValueError:
        raise ValueError(f"expected on, off or auto, got {text!r}") from None


def int_param(name: str, v, lo: int, hi: int = INT32_MAX) -> int:
    """``v`` as an int in [lo, hi], else InvalidInputError (bools and floats are refused; numpy
    integers are fine)."""
    if isinstance(v, bool) or not isinstance(v, int):
        import numpy as np

        if not isinstance(v, np.integer):
            raise InvalidInputError(f"{name} must be an integer, got {type(v).__name__}")
    v = int(v)
    if not lo <= v <= hi:
        raise InvalidInputError(f"{name}={v} is out of range [{lo}, {hi}]")
    return v


_int = int_param


def _num(name: str, v, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        try:
            import numpy as np

            if not isinstance(v, (np.integer, np.floating)):
                raise TypeError
        except TypeError:
            raise InvalidInputError(f"{name} must be a number, got {type(v).__name__}") from None
    v = float(v)
    if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
        raise InvalidInputError(f"{name}={v} is out of range {'(' if lo_open else '['}{lo}, {hi}]")
    return v


def spec_sources(spec: str) -> tuple[str, ...]:
    """``EngineConfig.spec`` ("none", or a comma list of limits.SPEC_SOURCES) as a tuple of sources (empty:
    off); InvalidInputError otherwise."""
    if not isinstance(spec, str):
        raise InvalidInputError(f"spec must be a str, got {type(spec).__name__}")
    names = tuple(s.strip() for s in spec.split(",") if s.strip())
    if names in ((), ("none",)):
        return ()
    bad = [s for s in names if s not in SPEC_SOURCES]
    if bad or len(set(names)) != len(names):
        raise InvalidInputError(f"spec must be 'none' or a comma list of {', '.join(SPEC_SOURCES)}, got {spec!r}")
    return names


class _Config:
    def as_dict(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True)
class SamplingParams(_Config):
    """How one request draws its tokens (llama.cpp's sampler chain: top-k, top-p, min-p,
    temperature, then a seeded draw). ``temperature == 0`` is greedy (argmax)."""

    temperature: float = 0.8
    top_k: int = 40          # 0: off
    top_p: float = 0.95      # 1: off
    min_p: float = 0.05      # 0: off
    seed: int | None = None  # None: a random seed per request
    ignore_eos: bool = False  # keep generating past end-of-generation tokens (benchmarks)
    # llama.cpp's penalties sampler over the last ``penalty_last_n`` generated tokens (-1: the whole answer)
    frequency_penalty: float = 0.0   # OpenAI's: minus this times the count of the token so far
    presence_penalty: float = 0.0    # OpenAI's: minus this once the token has occurred
    repeat_penalty: float = 1.0      # llama.cpp's: occurred tokens' logits divided (positive) or multiplied by it
    penalty_last_n: int = -1
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias) pairs added to the logits first

    def __post_init__(self) -> None:
        object.__setattr__(self, "temperature", _num("temperature", self.temperature, 0.0, TEMPERATURE_MAX))
        object.__setattr__(self, "top_k", _int("top_k", self.top_k, 0))
        object.__setattr__(self, "top_p", _num("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        object.__setattr__(self, "min_p", _num("min_p", self.min_p, 0.0, 1.0))
        if self.seed is not None:
            object.__setattr__(self, "seed", _int("seed", self.seed, 0, UINT32_MAX))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidInputError("ignore_eos must be a bool")
        for name in ("frequency_penalty", "presence_penalty"):
            object.__setattr__(self, name, _num(name, getattr(self, name), -PENALTY_MAX, PENALTY_MAX))
        object.__setattr__(self, "repeat_penalty",
                           _num("repeat_penalty", self.repeat_penalty, 0.0, REPEAT_PENALTY_MAX, lo_open=True))
        object.__setattr__(self, "penalty_last_n", _int("penalty_last_n", self.penalty_last_n, -1))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            pairs = tuple((_int("logit_bias token", t, 0), _num("logit_bias value", b, -LOGIT_BIAS_MAX, LOGIT_BIAS_MAX))
                          for t, b in bias)
        except (TypeError, ValueError):
            raise InvalidInputError("logit_bias must be (token id, bias) pairs or a {token id: bias} dict") from None
        object.__setattr__(self, "logit_bias", pairs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether the penalties or the logit bias change the logits (llama.cpp's chain is needed)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repeat_penalty != 1.0 or self.logit_bias)


GREEDY = SamplingParams(temperature=0.0)


def _bool(name: str, v) -> bool:
    """``v`` as a bool (numpy's bool too), else InvalidInputError."""
    if not isinstance(v, bool):
        import numpy as np

        if not isinstance(v, np.bool_):
            raise InvalidInputError(f"{name} must be a bool, got {type(v).__name__}")
    return bool(v)


@dataclass(frozen=True)
class CacheConfig(_Config):
    """A KV cache: its cells, batch sizes, cache types and threads; the fields that ContextConfig,
    EngineConfig and the workload's StressConfig share (each extends this class).

    ``n_batch`` is the most tokens one decode takes, ``n_ubatch`` the most one compute graph takes;
    as llama.cpp does, a batch is never bigger than the cache (``n_batch`` is brought down to ``n_ctx``)
    nor a graph than the batch (``n_ubatch`` to ``n_batch``). A quantized V cache needs ``flash_attn``.
    ``flash_attn`` None is auto: on the current library, llama.cpp's own "auto" (on where the backend
    has a kernel, the CPU's included); on the mission pin's, on where the model's layers are on a GPU
    whose backend has a kernel for the model's head size (faster there, and a V cache that is not
    transposed is copied out in a few transfers) and off on the CPU; a quantized V cache turns it on.
    """

    n_ctx: int = DEFAULT_N_CTX
    n_batch: int = 512
    n_ubatch: int = 512
    flash_attn: bool | None = None   # None: auto (see the class docstring)
    type_k: str = "f16"
    type_v: str = "f16"
    n_threads: int | None = None   # None: every core this process may use

    def __post_init__(self) -> None:
        for name in ("n_ctx", "n_batch", "n_ubatch"):
            object.__setattr__(self, name, _int(name, getattr(self, name), 1))
        # the batch within the context (a batch of more tokens than the cache has cells can never fit),
        # the graph's within the batch: both brought down as llama.cpp does (llama_context's constructor)
        object.__setattr__(self, "n_batch", min(self.n_batch, self.n_ctx))
        object.__setattr__(self, "n_ubatch", min(self.n_ubatch, self.n_batch))
        for name in ("type_k", "type_v"):
            t = getattr(self, name)
            if not isinstance(t, str) or t not in KV_CACHE_TYPES:
                raise InvalidInputError(f"{name}={t!r} is not a KV cache type: one of {', '.join(KV_CACHE_TYPES)}")
        if self.flash_attn is not None:
            object.__setattr__(self, "flash_attn", _bool("flash_attn", self.flash_attn))
        if self.type_v in QUANTIZED_KV_TYPES and self.flash_attn is False:
            raise InvalidInputError(f"a quantized V cache (type_v={self.type_v!r}) needs flash_attn=True")
        if self.n_threads is not None:
            object.__setattr__(self, "n_threads", _int("n_threads", self.n_threads, 1, MAX_THREADS))

    def cache_kwargs(self) -> dict:
        """The CacheConfig fields of this config, as keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(CacheConfig)}


# How many sequences, in two words, llama.cpp's: ``n_seq_max`` is how many sequence ids a *context* has
# (llama_context_params.n_seq_max: Context, ContextConfig, PrefixCache's bound); ``parallel`` is how many
# continuations the *engine* runs at once, each holding one id (llama-server's --parallel: EngineConfig,
# the KV layer's KVCache.parallel, StressConfig, and the --parallel flag of serve, run, stress and
# inspect). The engine's context has ``n_seq_max = parallel + prefix_cache``.
@dataclass(frozen=True)
class ContextConfig(CacheConfig):
    """One context (see Context): a KV cache shared by ``n_seq_max`` sequence ids, and llama.cpp's
    automatic defrag threshold (None: off; below 0 or above 1 it never triggers)."""

    n_seq_max: int = 8
    defrag_thold: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "n_seq_max", _int("n_seq_max", self.n_seq_max, 1, MAX_SEQUENCES))
        if self.defrag_thold is not None:
            try:
                t = _num("defrag_thold", self.defrag_thold, -math.inf, math.inf)
            except InvalidInputError:
                raise InvalidInputError(f"defrag_thold must be a finite number or None, got {self.defrag_thold!r}") \
                    from None
            object.__setattr__(self, "defrag_thold", t)

    def context_kwargs(self) -> dict:
        """Keyword arguments for ``Model.context`` / ``Context``."""
        return self.as_dict()


@dataclass(frozen=True)
class EngineConfig(CacheConfig):
    """The generation engine: one context (``context()``: the CacheConfig fields, and
    ``parallel + prefix_cache`` sequence ids), ``parallel`` sequences generating at once.

    Admission: a request enters when its prompt (less the prefix it reuses) and an output reserve
    of ``min(max_tokens, output_reserve)`` cells per continuation fit beside what running requests
    were promised; otherwise it waits in a queue of at most ``max_queue`` requests (a full queue
    refuses new ones); a later request may overtake one that does not fit yet, a bounded number of
    times. Idle cached prefixes (``prefix_cache`` sequence ids) are evicted before a
    request waits for cells; an evicted prefix is paged out to at most ``cache_ram`` MiB of host
    memory (a token trie of spans, a shared prefix stored once; patched library) and restored, not
    evaluated, when a prompt comes back to it (0: dropped); with ``cache_dir``, spans leaving host
    memory are written to files there (at most ``cache_dir_mib`` MiB, keyed by the model and the
    tokens, checked when read back) and restored from disk the same way. Preemption (a running
    continuation put back in the queue, resumed later with its tokens so far) happens only when the
    cache fills beyond the reserves.

    Context shift and truncation (each also a per-request option of ``Engine.submit``): a
    continuation whose sequence reaches ``n_ctx`` keeps its first ``n_keep`` tokens, drops half of
    the rest (the oldest) and goes on (``context_shift``; off: it finishes "length"); a prompt that
    does not fit is cut after its first ``n_keep`` tokens, at a turn boundary when the caller gave
    some (``truncate``; off: it is refused). ``n_keep`` -1 keeps the whole prompt; at most half the
    context is ever kept, so that a shift always frees a quarter of it.
    """

    parallel: int = 8            # continuations generating at once (sequence ids for requests)
    prefix_cache: int = 4        # extra sequence ids that keep idle prompts for prefix reuse
    cache_ram: int = 256         # MiB of host memory for idle prefixes paged out of the cache (0: dropped)
    cache_dir: str | None = None  # a directory for paged-out prefixes leaving host memory (None: no disk tier)
    cache_dir_mib: int = 1024    # the bound on the span files in cache_dir
    max_queue: int = 64          # requests waiting for admission; more are refused (QueueFullError)
    output_reserve: int = 64     # cells reserved per continuation at admission
    max_tokens: int = 4096       # the cap on one request's max_tokens
    keep_finished: bool = True   # cache a finished sequence (prompt + answer) for the next turn
    context_shift: bool = True   # a full sequence drops half its tokens after n_keep and goes on
    n_keep: int = 4              # tokens a context shift or truncation keeps at the start (-1: the prompt)
    truncate: bool = False       # cut a prompt that does not fit the context (else it is refused)
    pooling: str | None = None   # embeddings: llama.cpp's pooling (limits.POOLING_TYPES; None: the model's)
    spec: str = "none"           # speculative decoding's draft sources: "none", or a comma list of ngram, cache
    spec_max: int = 32           # the most draft tokens a continuation gets in one step
    # greedy answers' tokens chosen in the graph (llama.cpp's backend sampling: only the token comes back,
    # not a logits row): True, False, None auto (where the library can and the model's layers are on a GPU)
    backend_sampling: bool | None = False
    # stream a step's tokens while the next step's graph runs on the device: True, False, None auto
    # (where the model's layers are on a GPU; on the CPU it would delay the stream by a step)
    pipeline: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pooling is not None and (not isinstance(self.pooling, str) or self.pooling not in POOLING_TYPES):
            raise InvalidInputError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        object.__setattr__(self, "parallel", _int("parallel", self.parallel, 1, MAX_SEQUENCES))
        for name in ("context_shift", "truncate"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(f"{name} must be a bool")
        object.__setattr__(self, "n_keep", _int("n_keep", self.n_keep, -1))
        object.__setattr__(self, "prefix_cache", _int("prefix_cache", self.prefix_cache, 0, MAX_SEQUENCES - 1))
        if self.parallel + self.prefix_cache > MAX_SEQUENCES:
            raise InvalidInputError(f"parallel + prefix_cache must be <= {MAX_SEQUENCES} (a context's sequence ids)")
        object.__setattr__(self, "max_queue", _int("max_queue", self.max_queue, 0))
        object.__setattr__(self, "cache_ram", _int("cache_ram", self.cache_ram, 0))
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, (str, os.PathLike)) or not os.fspath(self.cache_dir):
                raise InvalidInputError(f"cache_dir must be a directory path, got {self.cache_dir!r}")
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))
        object.__setattr__(self, "cache_dir_mib", _int("cache_dir_mib", self.cache_dir_mib, 1))
        object.__setattr__(self, "output_reserve", _int("output_reserve", self.output_reserve, 0))
        object.__setattr__(self, "max_tokens", _int("max_tokens", self.max_tokens, 1))
        object.__setattr__(self, "spec_max", _int("spec_max", self.spec_max, 1, SPEC_MAX_DRAFT))
        object.__setattr__(self, "spec", ",".join(spec_sources(self.spec)) or "none")
        for name in ("backend_sampling", "pipeline"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _bool(name, getattr(self, name)))
        self.context()  # validates the context's own fields (its sequence ids)

    def context(self) -> ContextConfig:
        """The engine's context: this config's CacheConfig fields, ``parallel + prefix_cache`` ids."""
        return ContextConfig(**self.cache_kwargs(), n_seq_max=self.parallel + self.prefix_cache)
