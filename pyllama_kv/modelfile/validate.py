"""Validation of a GGUF model file before llama.cpp sees it.

A GGUF file is untrusted input, and the pinned llama.cpp (8733e0c) trusts much of it: a block_count
of 0 or a head_count_kv array of floats aborts the loader (GGML_ABORT / GGML_ASSERT), a tensor
dimension of 0 divides by zero in ``gguf_init_from_file`` (SIGFPE), a head_count that head_count_kv
does not divide aborts in ``ggml_can_mul_mat`` when a context is made, and f16 norm weights or a NaN
rms epsilon abort at the first decode. :func:`validate_gguf` refuses such files with a
:class:`~pyllama_kv.errors.ModelLoadError` that names the file, the key or tensor, its value and what
is expected. It reads only the header and the tensor table (never tensor data), with the runtime's
one GGUF reader, :mod:`pyllama_kv.modelfile.gguf` (strict, following ``gguf_init_from_file``); the reader's
names (read_gguf_header, GGUFHeader, KV, the GGUF value types...) stay importable from here.

What is checked, and where the pinned sources need it:

* **Structure** (ggml/src/gguf.cpp, llama-model-loader.cpp): magic, version 2 or 3, every read inside
  the file, no empty or duplicate key (an empty key aborts), value types 0..12 and no nested arrays,
  ``general.alignment`` a UINT32 power of two (another type aborts), tensor names under 64 bytes and
  unique, at most 4 dimensions, every dimension >= 1 (0 is SIGFPE) and an element count below 2^63,
  a ggml type the pinned ggml knows with rows a multiple of its block size, data offsets in order,
  and every tensor's data inside the file.
* **Architecture**: one the pinned llama.cpp implements (an unknown one and split files are
  refused). Only dense ``llama`` models (our tiny models, SmolLM2, Llama 2/3, Mistral 7B) get every
  check below: :func:`validate_gguf` returns True for them. For every other architecture (and
  mixture-of-experts llama models) it checks the structure, the hyperparameters every loader reads
  (context_length, embedding_length, block_count in [1, 512], expert counts) and the vocabulary,
  and returns False: :mod:`pyllama_kv.modelfile.vetting` then runs the model in a child process before this
  process loads it (``Model(..., validate="full")``, the default).
* **Hyperparameters of a llama model** (llama_model::load_hparams, llama-model-loader.cpp get_key/get_arr,
  llama-hparams.cpp, build_llama, ggml rope/rms_norm): every key the llama loader reads must have
  the exact GGUF type it reads (UINT32 scalars; per-layer arrays must be INT32, a FLOAT32 array
  aborts), and: block_count in [1, 512]; context_length in [1, 2^31-1] (llama_model_n_ctx_train()
  returns an int32); head_count >= 1, head_count_kv >= 1 dividing it (ggml_can_mul_mat);
  per-layer arrays of n_layer equal values (the llama loader shapes every layer with layer 0's);
  key_length == value_length == rope.dimension_count, even (build_llama and ggml_rope assert it);
  rms epsilon finite and > 0; rope freq_base, scaling factor and attn_factor finite (base and
  attn_factor > 0, factor >= 0); rope.scaling.type one of none/linear/yarn/longrope (another aborts);
  no expert_used_count without experts (aborts).
* **Tensors of a llama model** (llama_model::load_tensors, ggml-cpu binary ops, get_rows, mul_mat): exactly the
  tensors the llama loader creates (token_embd, output_norm, optional output and rope_freqs, per
  layer attn_norm/q/k/v/output, ffn_norm/gate/up/down and their optional biases), each of the
  shape it expects; norms, biases and rope_freqs f32 (binary ops and rope abort on other types);
  matrices of a type the CPU backend can multiply and gather; a q bias only where
  head_dim * head_count == embedding_length (else ggml_add aborts).
* **Vocabulary, every architecture** (llama_vocab::impl::load, token_to_piece, tokenize): tokenizer ``llama`` (SPM) or
  ``gpt2`` (BPE; ``bert`` aborts on byte tokens, a missing vocabulary aborts in tokenize); the token
  list an array of unique strings (duplicates abort); scores FLOAT32 and token types INT32 (or
  UINT32) arrays of the same length (other types abort, shorter ones are read out of bounds); BPE
  merges an array of strings (another type aborts); SPM byte tokens spelled ``<0xXX>``; every
  special token id llama.cpp ends up with in range (as it does: an id out of range falls back to
  the tokenizer's default, which must then be in range; print_info reads them unchecked); a BOS/EOS
  token wherever add_bos/add_eos needs one (tokenize asserts it).
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

import numpy as np

from .._native import archs
from ..errors import GGUFFileError, ModelLoadError
from ..limits import INT32_MAX, UINT32_MAX

# the reader lives in the runtime (pyllama_kv.modelfile.gguf); its names stay importable from here
from .gguf import (
    _INTEGER_TYPES,
    ARRAY,
    BOOL,
    FLOAT32,
    GGML_MAX_DIMS,
    GGML_TYPE_F32,
    GGUF_TYPE_NAMES,
    INT32,
    STRING,
    UINT16,
    UINT32,
    GGUFHeader,
    ggml_type_name,
    read_gguf_header,
)

LLAMA_MAX_LAYERS = 512     # llama-hparams.h

VALIDATED_ARCHITECTURES = ("llama",)

# the architectures the mission pin's llama.cpp knows (llama-arch.cpp LLM_ARCH_NAMES); each loaded
# library says its own (Library.caps.architectures), which the loader passes to the checks
KNOWN_ARCHITECTURES = archs.MISSION

# weight matrices: the types the CPU backend can multiply (type_traits_cpu has a vec_dot) and gather
# (get_rows, for token_embd); q8_1, q8_K, the integer types and f64 would crash in mul_mat
MATMUL_TYPES = frozenset((0, 1, 30, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 21, 22, 23,
                          29, 34, 35))


# ---------------------------------------------------------------------------------------------
# validation


class _Checker:
    """Typed access to the metadata: each getter returns the value or raises ModelLoadError."""

    def __init__(self, header: GGUFHeader):
        self.h = header
        self.kv = header.kv
        self.path = header.path

    def error(self, msg: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {msg}")

    def _get(self, key: str, required: bool, expected: str):
        kv = self.kv.get(key)
        if kv is None and required:
            raise self.error(f"{key} is missing: expected {expected}")
        return kv

    def u32(self, key: str, lo: int = 0, hi: int = UINT32_MAX, required: bool = False, default=None):
        expected = f"a UINT32 in [{lo}, {hi}]"
        kv = self._get(key, required, expected)
        if kv is None:
            return default
        if kv.type != UINT32:
            raise self.error(f"{key} is {kv.describe()}: expected {expected}")
        if not lo <= kv.value <= hi:
            raise self.error(f"{key} = {kv.value}: expected {expected}")
        return kv.value

    def u16(self, key: str):
        kv = self.kv.get(key)
        if kv is not None and kv.type != UINT16:
            raise self.error(f"{key} is {kv.describe()}: expected a UINT16")
        return None if kv is None else kv.value

    def f32(self, key: str, minimum: float, inclusive: bool, required: bool = False, default=None):
        expected = f"a finite FLOAT32 {'>=' if inclusive else '>'} {minimum:g}"
        kv = self._get(key, required, expected)
        if kv is None:
            return default
        if kv.type != FLOAT32:
            raise self.error(f"{key} is {kv.describe()}: expected {expected}")
        v = kv.value
        if not math.isfinite(v) or v < minimum or (v == minimum and not inclusive):
            raise self.error(f"{key} = {v!r}: expected {expected}")
        return v

    def string(self, key: str, required: bool = False):
        kv = self._get(key, required, "a STRING")
        if kv is None:
            return None
        if kv.type != STRING:
            raise self.error(f"{key} is {kv.describe()}: expected a STRING")
        return kv.value

    def boolean(self, key: str):
        kv = self.kv.get(key)
        if kv is not None and kv.type != BOOL:
            raise self.error(f"{key} is {kv.describe()}: expected a BOOL")
        return None if kv is None else kv.value

    def per_layer(self, key: str, n_layer: int, lo: int, hi: int, required: bool):
        """llama_model_loader::get_key_or_arr into uint32: a UINT32, or an INT32 array of n_layer
        values (a FLOAT32 array aborts, other types throw). The llama architecture shapes every layer's
        tensors with layer 0's value, so the values must be equal."""
        expected = f"a UINT32 in [{lo}, {hi}], or an INT32 array of {n_layer} such values"
        kv = self._get(key, required, expected)
        if kv is None:
            return None
        if kv.type == UINT32:
            if not lo <= kv.value <= hi:
                raise self.error(f"{key} = {kv.value}: expected {expected}")
            return kv.value
        if kv.type != ARRAY or kv.elem_type != INT32 or len(kv.value) != n_layer:
            raise self.error(f"{key} is {kv.describe()}: expected {expected}")
        vals = [int(v) & UINT32_MAX for v in kv.value]  # read as uint32, as llama.cpp does
        for il, v in enumerate(vals):
            if not lo <= v <= hi:
                raise self.error(f"{key}[{il}] = {v}: expected {expected}")
        if len(set(vals)) > 1:
            raise self.error(f"{key} = {vals}: the llama architecture needs the same value for every layer")
        return vals[0]

    def array(self, key: str, elem_types: tuple, length: int | None, required: bool):
        et = " or ".join(GGUF_TYPE_NAMES[t] for t in elem_types)
        expected = f"an array of {length if length is not None else ''} {et}".replace("  ", " ")
        kv = self._get(key, required, expected)
        if kv is None:
            return None
        if kv.type != ARRAY or kv.elem_type not in elem_types or (length is not None and len(kv.value) != length):
            raise self.error(f"{key} is {kv.describe()}: expected {expected}")
        return kv.value


def validate_gguf(path: str | os.PathLike, fd: int | None = None,
                  architectures: frozenset | None = None) -> bool:
    """Raise ModelLoadError unless ``path`` passes the static checks (see the module docstring).
    True: a dense llama model, validated completely (the pinned llama.cpp loads and runs it without
    crashing); False: another architecture, of which the structure, the common hyperparameters and
    the vocabulary were checked: :func:`pyllama_kv.modelfile.vetting.vet` decides the rest.

    Reads the header and tensor table only (of the open file ``fd`` if given, ``path`` naming it).
    Reusable anywhere a file is about to reach llama.cpp."""
    return validated_header(path, fd, architectures)[1]


def validated_header(path: str | os.PathLike, fd: int | None = None, architectures: frozenset | None = None,
                     header: GGUFHeader | None = None) -> tuple[GGUFHeader, bool]:
    """:func:`validate_gguf`, returning the header it read with the verdict (for a caller that needs
    the header too: the model's fingerprint). ``header``: the file's, read already (by
    :func:`read_header`)."""
    if header is not None:
        return header, check_gguf_header(header, architectures)
    return (h := read_header(path, fd)), check_gguf_header(h, architectures)


def read_header(path: str | os.PathLike, fd: int | None = None) -> GGUFHeader:
    """The GGUF header of ``path`` (or of the open file ``fd``), ModelLoadError (one line) when it
    cannot be read."""
    path = Path(path)
    if fd is None and not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if fd is None and not path.is_file():
        raise ModelLoadError(f"{path}: not a file")
    try:
        return read_gguf_header(path, fd)
    except GGUFFileError as exc:
        raise ModelLoadError(str(exc)) from None
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc}") from None


def check_gguf_header(header: GGUFHeader, architectures: frozenset | None = None) -> bool:
    """The checks of :func:`validate_gguf` on an already read header. True: the file is validated
    completely (a dense llama model); False: only what holds for every architecture was checked
    (structure, the hyperparameters every loader reads, the vocabulary), and the file needs a
    vetting run (:mod:`pyllama_kv.modelfile.vetting`) before it is safe to load. ``architectures``:
    those the library that will load the file implements (its ``caps.architectures``; default: the
    mission pin's)."""
    c = _Checker(header)
    arch = c.string("general.architecture")
    if arch is None:
        raise c.error("general.architecture is missing: unknown model architecture")
    if arch not in (KNOWN_ARCHITECTURES if architectures is None else architectures):
        raise c.error(_unknown_architecture(arch))
    c.string("general.name")
    c.u32("general.file_type")
    n_split = c.u16("split.count")
    if n_split is not None and n_split > 1:
        raise c.error(f"split.count = {n_split}: this is one part of a split GGUF model; merge the parts into "
                      "one file first (llama.cpp's `llama-gguf-split --merge`)")
    if arch in VALIDATED_ARCHITECTURES and not _has_experts(c, arch):
        hp = _check_llama_hparams(c, arch)
        n_vocab = _check_vocab(c)
        _check_llama_tensors(c, hp, n_vocab)
        return True
    _check_common_hparams(c, arch)
    _check_vocab(c)
    return False


def _unknown_architecture(arch: str) -> str:
    """The refusal of an architecture the loading library lacks, naming a library that has it."""
    have = [lib for names, lib in archs.BY_API.values() if arch in names]
    if have:
        return (f"unknown model architecture {arch!r} for this llama.cpp library; the {have[0]!r} library "
                f"implements it: load the model with lib={have[0]!r} (--lib {have[0]} on the command line)")
    return f"unknown model architecture {arch!r}: no llama.cpp library pyllama_kv builds implements it"


def _has_experts(c: _Checker, arch: str) -> bool:
    kv = c.kv.get(arch + ".expert_count")
    return kv is not None and kv.type in _INTEGER_TYPES and not isinstance(kv.value, np.ndarray) and kv.value > 0


def _check_common_hparams(c: _Checker, arch: str) -> None:
    """What llama_model::load_hparams reads for every architecture before its own keys (a wrong type
    aborts in get_key, a block_count past LLAMA_MAX_LAYERS overflows its per-layer arrays)."""
    A = arch + "."
    c.u32(A + "context_length", 1, INT32_MAX, required=True)
    c.u32(A + "embedding_length", 1, INT32_MAX, required=True)
    c.u32(A + "block_count", 1, LLAMA_MAX_LAYERS, required=True)
    c.u32(A + "expert_count", 0, INT32_MAX, default=0)
    c.u32(A + "expert_used_count", 0, INT32_MAX, default=0)


def _check_llama_hparams(c: _Checker, arch: str) -> dict:
    A = arch + "."
    c.u32(A + "context_length", 1, INT32_MAX, required=True)
    n_embd = c.u32(A + "embedding_length", 1, INT32_MAX, required=True)
    n_layer = c.u32(A + "block_count", 1, LLAMA_MAX_LAYERS, required=True)
    n_expert = c.u32(A + "expert_count", 0, INT32_MAX, default=0)
    n_expert_used = c.u32(A + "expert_used_count", 0, INT32_MAX, default=0)
    if n_expert > 0:   # pragma: no cover - check_gguf_header sends a llama MoE model to vetting
        raise c.error(f"{A}expert_count = {n_expert}: mixture-of-experts models are vetted, not checked here")
    if n_expert_used:
        raise c.error(f"{A}expert_used_count = {n_expert_used}: expected 0 in a model without experts "
                      "(llama.cpp aborts on it)")
    n_ff = c.per_layer(A + "feed_forward_length", n_layer, 1, INT32_MAX, required=True)
    n_head = c.per_layer(A + "attention.head_count", n_layer, 1, INT32_MAX, required=True)
    n_head_kv = c.per_layer(A + "attention.head_count_kv", n_layer, 1, INT32_MAX, required=False)
    if n_head_kv is None:
        n_head_kv = n_head
    if n_head % n_head_kv:
        raise c.error(f"{A}attention.head_count = {n_head} is not a multiple of {A}attention.head_count_kv = "
                      f"{n_head_kv}: each KV head must serve a whole number of query heads "
                      "(llama.cpp aborts in ggml_can_mul_mat)")
    c.boolean(A + "rope.scaling.finetuned")
    c.u32(A + "rope.scaling.original_context_length", 0, INT32_MAX)
    c.f32(A + "rope.freq_base", 0.0, inclusive=False)
    scaling = c.string(A + "rope.scaling.type")
    if scaling is not None and scaling not in ("none", "linear", "yarn", "longrope"):
        raise c.error(f"{A}rope.scaling.type = {scaling!r}: expected one of 'none', 'linear', 'yarn', "
                      "'longrope' (llama.cpp aborts on others)")
    c.f32(A + "rope.scaling.factor", 0.0, inclusive=True)
    c.f32(A + "rope.scale_linear", 0.0, inclusive=True)
    c.f32(A + "rope.scaling.attn_factor", 0.0, inclusive=False)
    head_default = n_embd // n_head
    head_k = c.u32(A + "attention.key_length", 1, INT32_MAX, default=head_default)
    head_v = c.u32(A + "attention.value_length", 1, INT32_MAX, default=head_default)
    if head_k == 0 or head_v == 0:
        raise c.error(f"{A}embedding_length = {n_embd} < {A}attention.head_count = {n_head}: the head size "
                      f"would be 0")
    if head_v != head_k:
        raise c.error(f"{A}attention.value_length = {head_v} differs from the key length {head_k}: the llama "
                      "graph needs them equal (llama.cpp aborts)")
    n_rot = c.u32(A + "rope.dimension_count", 1, INT32_MAX, default=head_k)
    if n_rot != head_k:
        raise c.error(f"{A}rope.dimension_count = {n_rot}: the llama architecture needs it equal to the head "
                      f"size {head_k}")
    if n_rot % 2:
        raise c.error(f"the head size (rope dimensions) is {n_rot}: it must be even (ggml's rope aborts on odd "
                      "sizes)")
    if head_k * max(n_head, n_head_kv) > INT32_MAX:
        raise c.error(f"head size {head_k} x {n_head} heads is too large")
    c.u32(A + "vocab_size")
    c.f32(A + "attention.layer_norm_rms_epsilon", 0.0, inclusive=False, required=True)
    return {"n_embd": n_embd, "n_layer": n_layer, "n_ff": n_ff, "n_head": n_head, "n_head_kv": n_head_kv,
            "head_k": head_k, "head_v": head_v, "n_rot": n_rot}


_SPM_BYTE = re.compile(rb"<0x[0-9A-Fa-f]{2}>\Z")
TOKEN_TYPE_BYTE = 6
NULL_TOKEN = -1
_SPECIAL_IDS = (  # llama_vocab::impl::load, in its order (the deprecated keys last)
    ("bos", "bos"), ("eos", "eos"), ("eot", "eot"), ("eom", "eom"), ("unknown", "unk"),
    ("seperator", "sep"), ("padding", "pad"), ("mask", "mask"), ("fim_pre", "fim_pre"),
    ("fim_suf", "fim_suf"), ("fim_mid", "fim_mid"), ("fim_pad", "fim_pad"), ("fim_rep", "fim_rep"),
    ("fim_sep", "fim_sep"), ("prefix", "fim_pre"), ("suffix", "fim_suf"), ("middle", "fim_mid"),
)
_BPE_PRE_ADD_BOS = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "tekken", "chameleon")


def _check_vocab(c: _Checker) -> int:
    T = "tokenizer.ggml."
    model = c.string(T + "model", required=True)
    if model not in ("llama", "gpt2", "bert"):
        why = {"no_vocab": "without a vocabulary llama.cpp aborts in tokenize and detokenize",
               "none": "without a vocabulary llama.cpp aborts in tokenize and detokenize"}.get(model)
        raise c.error(f"{T}model = {model!r}: pyllama_kv runs the 'llama' (SentencePiece), 'gpt2' (BPE) and "
                      f"'bert' (WordPiece) tokenizers, for every architecture" + (f" ({why})" if why else ""))
    pre = c.string(T + "pre")
    c.u32(T + "token_type_count")
    for k in ("add_space_prefix", "remove_extra_whitespaces"):
        c.boolean(T + k)
    add_bos_key = c.boolean(T + "add_bos_token")
    add_eos_key = c.boolean(T + "add_eos_token")

    tokens = c.array(T + "tokens", (STRING,), None, required=True)
    n = len(tokens)
    if not 1 <= n <= INT32_MAX:
        raise c.error(f"{T}tokens has {n} tokens: expected 1 to {INT32_MAX}")
    c.array(T + "scores", (FLOAT32,), n, required=False)
    types = c.array(T + "token_type", (INT32, UINT32), n, required=False)
    if model == "gpt2":
        c.array(T + "merges", (STRING,), None, required=True)
    _check_token_texts(c, model, tokens, types)
    _check_special_ids(c, model, pre, n, add_bos_key, add_eos_key)
    return n


def _check_token_texts(c: _Checker, model: str, tokens: list, types) -> None:
    """Token texts llama.cpp can load: all distinct, and SPM byte tokens spelled ``<0xXX>``."""
    T = "tokenizer.ggml."
    n = len(tokens)
    # llama.cpp maps token text -> id and aborts unless every text is unique (an empty text counts as
    # "[EMPTY_<id>]")
    texts = [t if t else b"[EMPTY_%d]" % i for i, t in enumerate(tokens)]
    if len(set(texts)) != n:
        seen: dict = {}
        for i, t in enumerate(texts):
            if t in seen:
                raise c.error(f"{T}tokens: token {i} {t!r} repeats token {seen[t]}: token texts must be unique "
                              "(llama.cpp aborts on duplicates)")
            seen[t] = i
    if model == "bert" and types is not None and (types == TOKEN_TYPE_BYTE).any():
        i = int(np.flatnonzero(types == TOKEN_TYPE_BYTE)[0])
        raise c.error(f"{T}token_type[{i}] is a byte token in a 'bert' (WordPiece) vocabulary: llama.cpp's WPM "
                      "tokenizer aborts on byte tokens")
    if model == "llama" and types is not None:
        for i in np.flatnonzero(types == TOKEN_TYPE_BYTE).tolist():
            if not _SPM_BYTE.match(tokens[i]):
                raise c.error(f"{T}tokens: token {i} {tokens[i]!r} has the byte type but is not spelled <0xXX>")


def _check_special_ids(c: _Checker, model: str, pre: str | None, n: int, add_bos_key: bool | None,
                       add_eos_key: bool | None) -> None:
    """The special token ids llama.cpp ends up with: the tokenizer's defaults, replaced by a key's
    value if that is in range (an id out of range is ignored with a warning), must all be in range,
    and a BOS or EOS that is added must exist."""
    T = "tokenizer.ggml."
    if model == "llama":
        ids = {"bos": 1, "eos": 2, "unk": 0}
        add_bos, add_eos = True, False
    elif model == "bert":   # WPM: tokenizing with specials always adds [CLS] (bos) and [SEP]
        ids = {"bos": 101, "unk": 100, "sep": 102, "pad": 0, "mask": 103}
        add_bos, add_eos = True, False
    else:
        ids = {"bos": 11, "eos": 11}
        if pre in ("glm4", "chatglm-bpe"):
            ids["bos"] = NULL_TOKEN
        add_bos, add_eos = pre in _BPE_PRE_ADD_BOS, False
    src = {name: "default" for name in ids}
    for kname, slot in _SPECIAL_IDS:
        key = f"{T}{kname}_token_id"
        v = c.u32(key)
        if v is not None and v < n:
            ids[slot], src[slot] = v, key
        elif v is not None:
            src[slot] = f"{src.get(slot, 'default')}; {key} = {v} is out of range, so llama.cpp ignores it"
    key_of = {slot: kname for kname, slot in reversed(_SPECIAL_IDS)}
    for slot, v in ids.items():
        if v != NULL_TOKEN and not 0 <= v < n:
            raise c.error(f"the {slot} token id llama.cpp would use, {v} ({src[slot]}), is out of range for a "
                          f"vocabulary of {n} tokens: give a valid {T}{key_of[slot]}_token_id")
    if add_bos_key is not None:
        add_bos = add_bos_key
    if add_eos_key is not None:
        add_eos = add_eos_key
    if add_bos and ids.get("bos", NULL_TOKEN) == NULL_TOKEN:
        raise c.error(f"{T}add_bos_token is set but the vocabulary has no BOS token (llama.cpp aborts in tokenize)")
    if add_eos and ids.get("eos", NULL_TOKEN) == NULL_TOKEN:
        raise c.error(f"{T}add_eos_token is set but the vocabulary has no EOS token (llama.cpp aborts in tokenize)")


def _check_llama_tensors(c: _Checker, hp: dict, n_vocab: int) -> None:
    n_embd, n_ff = hp["n_embd"], hp["n_ff"]
    n_q = hp["head_k"] * hp["n_head"]
    n_k = hp["head_k"] * hp["n_head_kv"]
    n_v = hp["head_v"] * hp["n_head_kv"]
    MAT, F32 = "matrix", "f32"
    # name -> (ne, kind, required), as llama_model::load_tensors creates them for LLM_ARCH_LLAMA
    want: dict[str, tuple] = {
        "token_embd.weight": ((n_embd, n_vocab), MAT, True),
        "output_norm.weight": ((n_embd,), F32, True),
        "output.weight": ((n_embd, n_vocab), MAT, False),
        "rope_freqs.weight": ((hp["n_rot"] // 2,), F32, False),
    }
    for i in range(hp["n_layer"]):
        p = f"blk.{i}."
        want.update({
            p + "attn_norm.weight": ((n_embd,), F32, True),
            p + "attn_q.weight": ((n_embd, n_q), MAT, True),
            p + "attn_k.weight": ((n_embd, n_k), MAT, True),
            p + "attn_v.weight": ((n_embd, n_v), MAT, True),
            p + "attn_output.weight": ((n_q, n_embd), MAT, True),
            p + "attn_q.bias": ((n_embd,), F32, False),
            p + "attn_k.bias": ((n_v,), F32, False),
            p + "attn_v.bias": ((n_v,), F32, False),
            p + "attn_output.bias": ((n_embd,), F32, False),
            p + "ffn_norm.weight": ((n_embd,), F32, True),
            p + "ffn_gate.weight": ((n_embd, n_ff), MAT, True),
            p + "ffn_down.weight": ((n_ff, n_embd), MAT, True),
            p + "ffn_up.weight": ((n_embd, n_ff), MAT, True),
            p + "ffn_gate.bias": ((n_ff,), F32, False),
            p + "ffn_down.bias": ((n_embd,), F32, False),
            p + "ffn_up.bias": ((n_ff,), F32, False),
        })
    have = {t.name: t for t in c.h.tensors}
    for name, (ne, kind, required) in want.items():
        t = have.get(name)
        if t is None:
            if required:
                raise c.error(f"tensor {name} is missing")
            continue
        ne4 = tuple(ne) + (1,) * (GGML_MAX_DIMS - len(ne))
        if t.ne != ne4:
            raise c.error(f"tensor {name} has shape {list(t.shape)}, expected {list(ne)}")
        if kind == F32 and t.type != GGML_TYPE_F32:
            raise c.error(f"tensor {name} is {ggml_type_name(t.type)}: norm, bias and rope tensors must be f32 "
                          "(llama.cpp aborts on other types)")
        if kind == MAT and t.type not in MATMUL_TYPES:
            raise c.error(f"tensor {name} is {ggml_type_name(t.type)}: not a weight type llama.cpp's CPU backend "
                          "can multiply")
        if name.endswith("attn_q.bias") and n_q != n_embd:
            raise c.error(f"tensor {name}: a q bias needs head size x head_count ({n_q}) equal to "
                          f"embedding_length ({n_embd}) (llama.cpp aborts otherwise)")
    for t in c.h.tensors:
        if t.name not in want:
            raise c.error(f"unexpected tensor {t.name}: the llama architecture does not use it (llama.cpp "
                          "refuses the file)")
