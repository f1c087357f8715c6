"""``pyllama-kv inspect``: what a GGUF file is (architecture, sizes, head size, sliding window,
tensors and types, vocabulary, chat template, whether its cache can K-shift, the KV cache a context
would take), read without loading weights: the header and tensor table through the runtime's GGUF
reader, :mod:`pyllama_kv.modelfile.gguf` (memory-mapped, weights untouched), checked with
:mod:`pyllama_kv.modelfile.validate`."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import limits
from .._native.archs import NOPE_LAYERS
from ..errors import GGUFFileError, InvalidInputError, ModelLoadError
from ..modelfile.gguf import _INTEGER_TYPES, ARRAY as _ARRAY, STRING as _STRING, ggml_type_name, read_gguf_header
from ..modelfile.validate import check_gguf_header

__all__ = ["inspect_gguf", "kv_type_size"]

def kv_type_size(name: str) -> float:
    """Bytes per element of a KV cache type (block types averaged over their block; any case)."""
    try:
        return limits.kv_type_size(name.lower())
    except KeyError:
        raise InvalidInputError(f"unknown KV cache type {name!r}: one of {', '.join(limits.KV_CACHE_TYPES)}") \
            from None


def _hparam(header, key: str):
    """A hyperparameter as inspect reports it: None if absent, an int, or a list of ints (per-layer
    arrays). GGUFFileError for a value that is no integer (a string, a float): the sizes derived from
    it would be meaningless."""
    kv = header.kv.get(key)
    if kv is None:
        return None
    if kv.type in _INTEGER_TYPES:
        return int(kv.value)
    if kv.type == _ARRAY and kv.elem_type in _INTEGER_TYPES:
        return [int(v) for v in kv.value]
    raise GGUFFileError(f"{header.path}: {key} is {kv.describe()}: expected an integer")


def _metadata(header, key: str):
    """A metadata value as it is (a str, a number, a bool), or None; arrays as their length."""
    kv = header.kv.get(key)
    if kv is None:
        return None
    return f"<array of {len(kv.value)}>" if kv.type == _ARRAY else kv.value


# llama_model_is_recurrent, llama_model_is_hybrid (the current pin's) and llama_model_rope_type
# (LLAMA_ROPE_TYPE_NONE) at the pins: no K-shift
_RECURRENT = frozenset(("mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "jamba", "falcon-h1", "plamo2",
                        "granitehybrid", "lfm2", "lfm2moe", "nemotron_h", "nemotron_h_moe", "qwen3next",
                        "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp",
                        "deepseek4", "minimax-01"))
_NO_ROPE = frozenset(("gpt2", "gptj", "mpt", "refact", "bloom", "jina-bert-v2", "t5", "t5encoder", "jais",
                      "wavtokenizer-dec")) | _RECURRENT


def _can_shift(arch: str, type_k: str) -> tuple[bool | None, str]:
    """Whether a context's cache can K-shift (llama_kv_self_can_shift), as far as the header tells,
    and why. A quantized K cache is decided by its backend when the context is made (patch 0007)."""
    if arch in _RECURRENT:
        return False, "a recurrent (or hybrid) model keeps no per-position state in its recurrent layers"
    if arch in _NO_ROPE:
        return False, "the model has no rotary positions to shift"
    if arch in NOPE_LAYERS:
        return False, "llama.cpp would rotate the K of its layers without RoPE too (re-evaluated instead)"
    if type_k.lower() in ("f32", "f16", "bf16"):
        return True, f"the {type_k} K cache is shifted in place"
    return None, f"a {type_k} K cache: decided by the backend when the context is made (else re-evaluated)"


def inspect_gguf(path: str | os.PathLike, n_ctx: int | None = None, parallel: int = 1,
                 type_k: str = "f16", type_v: str = "f16") -> dict:
    """Architecture, sizes, tensors and vocabulary of a GGUF file, and its KV cache cost.

    KV bytes per token = n_layer * (n_embd_k_gqa * size(type_k) + n_embd_v_gqa * size(type_v)).
    The cache holds n_ctx cells shared by all sequences (llama.cpp's unified cache), so the total is
    per-token bytes * n_ctx; ``parallel`` (sequences sharing the cache, as serve's ``--parallel``) is
    reported with the average room per sequence.

    Reads the header and tensor table with :func:`pyllama_kv.modelfile.gguf.read_gguf_header` (never the
    weights). ``validation`` says how ``Model(path)`` checks the file: ``ok`` False with the ``error``
    for a refusal; ``level`` "static" for a file validated completely by the static checks (a dense
    llama model), "vetting" for one that gets a vetting run in a child process (another
    architecture), with the cached verdict (``vetted``: True, False, or None when never vetted).
    Raises FileNotFoundError, OSError, or GGUFFileError for a file that is not GGUF, is truncated or
    corrupt, or has a hyperparameter that is not an integer.
    """
    path = Path(path)
    if path.is_dir():
        raise GGUFFileError(f"{path}: is a directory, not a GGUF file")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    header = read_gguf_header(path)
    arch_kv = header.kv.get("general.architecture")
    arch = arch_kv.value if arch_kv is not None and arch_kv.type == _STRING else "?"
    shape = _shape(header, arch)
    validation = _validation(header, path)
    swa = _hparam(header, f"{arch}.attention.sliding_window")
    template = header.kv.get("tokenizer.chat_template")
    can_shift, shift_why = _can_shift(arch, type_k)
    out = {
        "path": str(path),
        "file_bytes": header.file_size,
        "gguf_version": header.version,
        "architecture": arch,
        "name": _metadata(header, "general.name"),
        **shape,
        "sliding_window": swa,
        "chat_template": template is not None and template.type == _STRING and bool(template.value),
        "can_shift": can_shift,
        "can_shift_why": shift_why,
        "tensors": _tensor_summary(header),
        "vocab": _vocab_summary(header),
        "validation": validation,
    }
    kv_cache = _kv_cache(shape, n_ctx, parallel, type_k, type_v)
    if kv_cache is not None:
        out["kv_cache"] = kv_cache
    return out


def _shape(header, arch: str) -> dict:
    """The hyperparameters inspect reports, in its order (head sizes from the head count when the
    file gives none; per-layer head counts as their largest)."""
    def hp(key: str):
        return _hparam(header, f"{arch}.{key}")

    n_layer = hp("block_count")
    n_embd = hp("embedding_length")
    n_head = hp("attention.head_count")
    n_head_kv = hp("attention.head_count_kv") or n_head
    if isinstance(n_head_kv, list):
        n_head_kv = max(n_head_kv, default=None)
    if isinstance(n_head, list):
        n_head = max(n_head, default=None)
    key_len = hp("attention.key_length")
    val_len = hp("attention.value_length")
    n_ff = hp("feed_forward_length")
    n_ctx_train = hp("context_length")
    rope_dim = hp("rope.dimension_count")
    head_dim = (n_embd // n_head) if (isinstance(n_embd, int) and isinstance(n_head, int) and n_head > 0) else None
    return {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "n_head_kv": n_head_kv, "n_ff": n_ff,
            "n_ctx_train": n_ctx_train, "rope_dim": rope_dim, "head_dim_k": key_len or head_dim,
            "head_dim_v": val_len or head_dim}


def _tensor_summary(header) -> dict:
    """The tensor count, the count per ggml type, the parameters and the bytes of the weights."""
    types: dict[str, int] = {}
    n_params = 0
    n_bytes = 0
    for t in header.tensors:
        tn = ggml_type_name(t.type).lower()
        types[tn] = types.get(tn, 0) + 1
        n_params += t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]
        n_bytes += t.nbytes
    return {"count": len(header.tensors), "types": types, "params": n_params, "bytes": n_bytes}


def _vocab_summary(header) -> dict:
    tokens = header.kv.get("tokenizer.ggml.tokens")
    return {
        "model": _metadata(header, "tokenizer.ggml.model"),
        "size": len(tokens.value) if tokens is not None and tokens.type == _ARRAY else None,
        "bos": _metadata(header, "tokenizer.ggml.bos_token_id"),
        "eos": _metadata(header, "tokenizer.ggml.eos_token_id"),
    }


def _validation(header, path: Path) -> dict:
    """How Model(path) checks the file: see inspect_gguf's ``validation``."""
    try:
        complete = check_gguf_header(header)
        validation: dict[str, Any] = {"ok": True, "error": None, "level": "static" if complete else "vetting"}
        if not complete:
            validation["vetted"] = _vetted(path)
    except ModelLoadError as exc:
        validation = {"ok": False, "error": str(exc), "level": "static"}
    return validation


def _kv_cache(shape: dict, n_ctx: int | None, parallel: int, type_k: str, type_v: str) -> dict | None:
    """The KV cache's cost for ``n_ctx`` cells (the training context when None); None when the
    header does not give the sizes."""
    n_layer, n_ctx_train = shape["n_layer"], shape["n_ctx_train"]
    n_embd_k = (shape["head_dim_k"] or 0) * (shape["n_head_kv"] or 0)
    n_embd_v = (shape["head_dim_v"] or 0) * (shape["n_head_kv"] or 0)
    if not (isinstance(n_layer, int) and n_layer > 0 and n_embd_k > 0):
        return None
    sk, sv = kv_type_size(type_k), kv_type_size(type_v)
    per_token = n_layer * (n_embd_k * sk + n_embd_v * sv)
    ctx = n_ctx or (n_ctx_train if isinstance(n_ctx_train, int) else 0) or 0
    return {
        "n_ctx": ctx,
        "parallel": parallel,
        "type_k": type_k,
        "type_v": type_v,
        "n_embd_k_gqa": n_embd_k,
        "n_embd_v_gqa": n_embd_v,
        "bytes_per_token": per_token,
        "bytes_per_token_k": n_layer * n_embd_k * sk,
        "bytes_per_token_v": n_layer * n_embd_v * sv,
        "bytes_total": per_token * ctx,
        "cells_per_seq": ctx // max(1, parallel),
    }


def _vetted(path: Path) -> bool | None:
    """The cached vetting verdict of ``path`` on the default library (None: none cached, or no library)."""
    from ..modelfile.vetting import cached_verdict

    try:
        from .._native.locate import resolve

        lib_path, _info = resolve(None)
    except Exception:
        return None
    v = cached_verdict(path, lib_path)
    return None if v is None else v.ok
