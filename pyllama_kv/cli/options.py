"""The options of ContextConfig, SamplingParams and EngineConfig (pyllama_kv.config), defined once and
mapped onto argparse flags, and the parsed flags mapped back into the dataclasses.

A flag's default is its dataclass field's default (a command may override it, e.g. ``run`` makes one
continuation by default), and its help text shows that default. ``dest`` is the field's name, so
``from_args(SamplingParams, args)`` picks the fields a command has flags for; the dataclass then
validates them, and its error is reported with the flag's name instead of the field's.
"""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields
from typing import Any, Callable, TypeVar

from ..config import ContextConfig, EngineConfig, SamplingParams, default_threads, on_off, on_off_auto
from ..errors import InvalidInputError
from ..limits import DEFAULT_N_CTX, KV_CACHE_TYPES, POOLING_TYPES
from .common import UsageError

T = TypeVar("T")


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass ``cls``'s field ``name``."""
    for f in fields(cls):
        if f.name == name:
            if f.default is not MISSING:
                return f.default
            if f.default_factory is not MISSING:
                return f.default_factory()
            raise KeyError(f"{cls.__name__}.{name} has no default")
    raise KeyError(f"{cls.__name__} has no field {name}")


@dataclass(frozen=True)
class Flag:
    """One option: the dataclass field it sets, its flags, its help ("{default}" is the default).
    ``cls`` None: an option of no dataclass (its default is None; ``dest`` is ``field``)."""

    cls: type | None
    field: str
    flags: tuple[str, ...]
    help: str
    type: Callable[[str], Any] | None = int
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    action: str | None = None   # "store_true": a switch (default False; no type, no value)

    @property
    def default(self) -> Any:
        if self.action == "store_true":
            return False
        return None if self.cls is None else field_default(self.cls, self.field)

    @property
    def name(self) -> str:
        return self.flags[-1]


def _rpc_endpoints(text: str) -> list[str]:
    """--rpc HOST:PORT,...: the endpoints, checked as pk.Model checks them."""
    from ..core.model import parse_rpc

    try:
        return parse_rpc(text)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _validate_help() -> str:
    from ..modelfile.vetting import DEFAULT_VALIDATE, VALIDATE_HELP

    levels = "; ".join(f"{k}: {v}" for k, v in VALIDATE_HELP.items())
    return f"how a GGUF file is checked before llama.cpp reads it (default {DEFAULT_VALIDATE}): {levels}"


def _threads_help() -> str:
    return f"CPU threads (default: every core this process may use, {default_threads()} here)"


_KV_TYPES = ", ".join(KV_CACHE_TYPES)

#: every option of the config dataclasses that a command exposes, keyed by field name
FLAGS: dict[str, Flag] = {f.field: f for f in (
    # SamplingParams: how one request draws tokens
    Flag(SamplingParams, "temperature", ("--temp",), "temperature; 0 (or less) is greedy (default {default})", float,
         metavar="TEMP"),
    Flag(SamplingParams, "top_k", ("--top-k",), "top-k sampling, 0 disables (default {default})"),
    Flag(SamplingParams, "top_p", ("--top-p",), "top-p sampling, 1 disables (default {default})", float),
    Flag(SamplingParams, "min_p", ("--min-p",), "min-p sampling, 0 disables (default {default})", float),
    Flag(SamplingParams, "seed", ("--seed",), "sampling seed; continuation i uses seed+i (default: random)"),
    # ContextConfig: one KV cache
    Flag(ContextConfig, "n_ctx", ("--ctx",), "KV cache cells (default {default})", metavar="N"),
    Flag(ContextConfig, "n_threads", ("-t", "--threads"), "", metavar="N"),
    Flag(ContextConfig, "type_k", ("--type-k",), f"K cache type: {_KV_TYPES} (default {{default}})", str,
         metavar="TYPE"),
    Flag(ContextConfig, "type_v", ("--type-v",), f"V cache type: {_KV_TYPES}; a quantized one needs "
         "--flash-attn on (default {default})", str, metavar="TYPE"),
    Flag(ContextConfig, "flash_attn", ("--flash-attn",), "flash attention: on, off or auto (default auto: on "
         "the current library, llama.cpp's own auto, on where the backend has a kernel, the CPU's included; on "
         "the mission pin's, on where the model's layers are on a GPU with a kernel for its head size, off on the "
         "CPU; on is faster on a long or full cache, and the V cache is then not transposed)", on_off_auto,
         metavar="on|off|auto"),
    Flag(ContextConfig, "n_batch", ("--batch",), "tokens per decode (default {default})", metavar="N"),
    # EngineConfig: the generation engine
    Flag(EngineConfig, "parallel", ("--parallel",), "continuations generated at once (default {default})",
         metavar="N"),
    Flag(EngineConfig, "max_queue", ("--max-queue",), "requests waiting for admission; more are refused "
         "(default {default})", metavar="N"),
    Flag(EngineConfig, "max_tokens", ("--max-tokens-cap",), "the largest max_tokens a request may ask for; "
         "also the default (default {default})", metavar="N"),
    Flag(EngineConfig, "prefix_cache", ("--prefix-cache",), "idle cached sequences kept for prefix reuse "
         "(system prompts, conversations) (default {default})", metavar="N"),
    Flag(EngineConfig, "cache_ram", ("--cache-ram",), "MiB of host memory for cached prefixes evicted from the KV "
         "cache: paged out and restored (a memcpy) instead of evaluated again, a shared prefix stored once; 0: "
         "dropped (default {default})", metavar="MiB"),
    Flag(EngineConfig, "cache_dir", ("--cache-dir",), "a directory for cached prefixes that leave host memory: "
         "spans written to checked files (keyed by the model and the tokens) and restored from them instead of "
         "evaluated; a corrupt or foreign file is a miss (default: none)", str, metavar="DIR"),
    Flag(EngineConfig, "cache_dir_mib", ("--cache-dir-mib",), "the bound on the files in --cache-dir, least "
         "recently used deleted first (default {default})", metavar="MiB"),
    Flag(EngineConfig, "context_shift", ("--context-shift",), "at the end of the context, keep the first --keep "
         "tokens, drop half of the rest and go on (on), or stop the answer (off) (default: on)", on_off,
         metavar="on|off"),
    Flag(EngineConfig, "pooling", ("--pooling",), "how embeddings pool a sequence's token vectors (llama-server's "
         "--pooling): mean, cls (the first token), last, rank (a reranker's score, for /v1/rerank) or none (one "
         "vector per token; /v1/embeddings refuses it) (default: the model's GGUF says; none if it says nothing)",
         str, metavar="TYPE", choices=tuple(POOLING_TYPES)),
    Flag(EngineConfig, "spec", ("--spec",), "speculative decoding: none, or the draft sources, a comma list of "
         "ngram (each answer's own prompt and output) and cache (every conversation this engine finished): drafts "
         "are verified in the same decode as everything else, the output is the same (at any temperature and "
         "seed), and a cost rule measured on this machine drafts only where it pays (off for a model with "
         "recurrent layers or a sliding-window cache) (default {default})", str, metavar="none|ngram[,cache]"),
    Flag(EngineConfig, "spec_max", ("--spec-max",), "the most draft tokens an answer gets in one step "
         "(default {default})", metavar="N"),
    Flag(EngineConfig, "pipeline", ("--pipeline",), "stream each step's tokens while the next step runs on the "
         "device (llama_decode returns before a GPU has run the graph): on, off, or auto (on where the model's "
         "layers are on a GPU; on the CPU it would delay the stream by a step); the output does not change "
         "(default: auto)", on_off_auto, metavar="on|off|auto"),
    Flag(EngineConfig, "backend_sampling", ("--backend-sampling",), "greedy answers (no penalties, grammar or "
         "logprobs) take their tokens from an argmax in llama.cpp's graph (its backend sampling: on a GPU no "
         "logits row comes back): on, off, or auto (on where the library can, the current one, and the model's "
         "layers are on a GPU); the output does not change (default: off)", on_off_auto, metavar="on|off|auto"),
    Flag(EngineConfig, "n_keep", ("--keep",), "tokens at the start that a context shift never drops; -1: the whole "
         "prompt (default {default})", metavar="N"),
    # the model: how its file is checked (pk.Model(..., validate=...)) and where its layers run
    Flag(None, "validate", ("--validate",), "", str, metavar="LEVEL", choices=("full", "static", "off")),
    Flag(None, "n_gpu_layers", ("-ngl", "--n-gpu-layers"), "layers offloaded to the GPU; -1: all (default: all "
         "when the library has a GPU backend and finds a GPU, else 0)", int, metavar="N"),
    Flag(None, "rpc", ("--rpc",), "offload every layer to the rpc-server processes at these endpoints (ggml's RPC "
         "backend, a library built with `pyllama-kv build --rpc`); never expose rpc-server to an untrusted "
         "network", _rpc_endpoints, metavar="HOST:PORT[,HOST:PORT...]"),
    Flag(None, "draft_model", ("--draft-model",), "speculative decoding with a draft model: a smaller model with "
         "the same vocabulary (a path or a name, as MODEL; loaded on the same library), whose greedy continuation "
         "is drafted for every answer and verified in the same decode (with --spec's sources, the likeliest draft "
         "wins); the output does not change", str, metavar="MODEL"),
    # the MODEL name: a Hugging Face file the hub cannot vouch for (hub.TRUST_FLAG, hub.verify)
    Flag(None, "trust_unverified", ("--trust-unverified",), "load a Hugging Face model file that no hash of the "
         "hub vouches for (offline: a cached snapshot link that points outside the cache, or a blob named by no "
         "hash), which is refused without this flag; it is still validated before llama.cpp reads it", None,
         action="store_true"),
)}


#: --ctx of the commands that size the context to the model (common.context_size): the help's tail
CTX_DEFAULT_HELP = f"(default: min({DEFAULT_N_CTX}, the model's n_ctx_train))"

#: flags whose help text is computed (it names this machine's core count, or the validation levels)
_HELP_FUNCS: dict[str, Callable[[], str]] = {"n_threads": _threads_help, "validate": _validate_help}


def add(parser: argparse.ArgumentParser, *names: str, defaults: dict[str, Any] | None = None,
        helps: dict[str, str] | None = None) -> None:
    """Add the flags of the fields ``names`` to ``parser``. ``defaults`` overrides a field's
    default for this command; ``helps`` its help text (which may use "{default}" too)."""
    defaults = defaults or {}
    helps = helps or {}
    for name in names:
        f = FLAGS[name]
        default = defaults.get(name, f.default)
        text = helps.get(name) or (_HELP_FUNCS[name]() if name in _HELP_FUNCS else f.help)
        text = text.format(default=default)
        kw: dict[str, Any] = {"dest": f.field, "default": default, "help": text}
        if f.action is not None:
            kw["action"] = f.action
        if f.type is not None:
            kw["type"] = f.type
        if f.metavar:
            kw["metavar"] = f.metavar
        if f.choices:
            kw["choices"] = f.choices
        parser.add_argument(*f.flags, **kw)


def model_path(model: str, trust_unverified: bool = False) -> str:
    """A MODEL argument as the GGUF file a command opens (pyllama_kv.modelfile.names.resolve: a name
    fetched or found, a regular file checked), with --trust-unverified's value."""
    from ..modelfile.names import resolve

    return str(resolve(model, trust_unverified=trust_unverified))


def values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``cls`` that ``args`` has flags for, as keyword arguments."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}


def build(cls: Callable[..., T], **kwargs: Any) -> T:
    """``cls(**kwargs)``, with a validation error worded with the flags' names (a UsageError: one line,
    exit 2)."""
    try:
        return cls(**kwargs)
    except InvalidInputError as exc:
        msg = str(exc)
        for f in FLAGS.values():
            if msg.startswith(f.field) and msg[len(f.field):len(f.field) + 1] in ("=", " ", ""):
                msg = f.name + msg[len(f.field):]
                break
        raise UsageError(msg) from None


def from_args(cls: Callable[..., T], args: argparse.Namespace, **overrides: Any) -> T:
    """A ``cls`` (ContextConfig, SamplingParams, EngineConfig) from the parsed flags, plus ``overrides``."""
    kw = values(cls, args)  # type: ignore[arg-type]
    kw.update(overrides)
    return build(cls, **kw)


def sampling(args: argparse.Namespace, seed: int | None = None) -> SamplingParams:
    """SamplingParams from the flags: a temperature <= 0 is greedy, and a negative or missing seed
    is ``seed`` (the caller's random draw, so that it can report it)."""
    kw = values(SamplingParams, args)
    if kw.get("temperature") is not None and kw["temperature"] < 0:
        kw["temperature"] = 0.0
    if kw.get("seed") is None or kw["seed"] < 0:
        kw["seed"] = seed
    return build(SamplingParams, **kw)
