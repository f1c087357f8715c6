"""GGUF helpers built on the ``gguf`` package: a tiny random llama model, and file inspection.

Neither function loads weights into llama.cpp: ``inspect_gguf`` reads the header and tensor table
with gguf's reader (memory-mapped, weights untouched).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

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
) -> Path:
    """Write a random-weight llama GGUF with an SPM vocabulary (any text tokenizes); return its path.

    The weights are scaled so that the next-token logits depend on the whole context (attention
    matters), which is what the KV-cache tests need. ``dtype`` is ``"f32"`` or ``"f16"``.
    """
    import gguf

    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must be a multiple of n_head, and n_head a multiple of n_head_kv")
    if dtype not in ("f32", "f16"):
        raise ValueError("dtype must be 'f32' or 'f16'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    np_dtype = np.float32 if dtype == "f32" else np.float16
    head_dim = n_embd // n_head
    n_embd_kv = head_dim * n_head_kv
    tokens, scores, types = tiny_vocab(byte_tokens)
    n_vocab = len(tokens)

    def mat(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * scale).astype(np_dtype)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    w.add_name("pyllama-kv tiny random llama")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    s_in = 1.0 / np.sqrt(n_embd)
    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd, 1.0))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", norm(n_embd))
        w.add_tensor(f"blk.{i}.attn_q.weight", mat(n_embd, n_embd, 2.0 * s_in))
        w.add_tensor(f"blk.{i}.attn_k.weight", mat(n_embd_kv, n_embd, 2.0 * s_in))
        w.add_tensor(f"blk.{i}.attn_v.weight", mat(n_embd_kv, n_embd, s_in))
        w.add_tensor(f"blk.{i}.attn_output.weight", mat(n_embd, n_embd, s_in))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", norm(n_embd))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(n_ff, n_embd, s_in))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(n_ff, n_embd, s_in))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(n_embd, n_ff, 1.0 / np.sqrt(n_ff)))
    w.add_tensor("output_norm.weight", norm(n_embd))
    w.add_tensor("output.weight", mat(n_vocab, n_embd, 2.0 * s_in))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------
# inspection

_TYPE_SIZES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
               "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32}


def kv_type_size(name: str) -> float:
    """Bytes per element of a KV cache type (block types averaged over their block)."""
    try:
        return _TYPE_SIZES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown KV cache type {name!r}: one of {', '.join(_TYPE_SIZES)}") from None


class GGUFFileError(ValueError):
    """Not a GGUF file, or a truncated/corrupt one."""


def _field_value(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # older gguf versions
        import gguf

        if f.types and f.types[0] == gguf.GGUFValueType.STRING:
            return bytes(f.parts[f.data[0]]).decode("utf-8", "replace")
        return f.parts[f.data[0]].tolist()[0] if f.data else None


def inspect_gguf(path: str | os.PathLike, n_ctx: int | None = None, n_seqs: int = 1,
                 type_k: str = "f16", type_v: str = "f16") -> dict:
    """Architecture, sizes, tensors and vocabulary of a GGUF file, and its KV cache cost.

    KV bytes per token = n_layer * (n_embd_k_gqa * size(type_k) + n_embd_v_gqa * size(type_v)).
    The cache holds n_ctx cells shared by all sequences (llama.cpp's unified cache), so the total is
    per-token bytes * n_ctx; ``n_seqs`` is reported with the average room per sequence.
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFFileError(f"{path}: not a GGUF file (magic {magic!r})")
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # the reader raises ValueError/IndexError/... on truncation
        raise GGUFFileError(f"{path}: truncated or corrupt GGUF ({type(exc).__name__}: {exc})") from None
    arch = _field_value(reader, "general.architecture") or "?"

    def hp(key: str):
        return _field_value(reader, f"{arch}.{key}")

    n_layer = hp("block_count")
    n_embd = hp("embedding_length")
    n_head = hp("attention.head_count")
    n_head_kv = hp("attention.head_count_kv") or n_head
    if isinstance(n_head_kv, list):
        n_head_kv = max(n_head_kv)
    if isinstance(n_head, list):
        n_head = max(n_head)
    key_len = hp("attention.key_length")
    val_len = hp("attention.value_length")
    head_dim = (n_embd // n_head) if (n_embd and n_head) else None
    n_embd_k = (key_len or head_dim or 0) * (n_head_kv or 0)
    n_embd_v = (val_len or head_dim or 0) * (n_head_kv or 0)
    n_ctx_train = hp("context_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_vocab = len(tokens.data) if tokens is not None else None

    types: dict[str, int] = {}
    n_params = 0
    n_bytes = 0
    for t in reader.tensors:
        tn = t.tensor_type.name.lower()
        types[tn] = types.get(tn, 0) + 1
        n_params += int(t.n_elements)
        n_bytes += int(t.n_bytes)

    out = {
        "path": str(path),
        "file_bytes": path.stat().st_size,
        "gguf_version": int(_field_value(reader, "GGUF.version") or 0) or None,
        "architecture": arch,
        "name": _field_value(reader, "general.name"),
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_head": n_head,
        "n_head_kv": n_head_kv,
        "n_ff": hp("feed_forward_length"),
        "n_ctx_train": n_ctx_train,
        "rope_dim": hp("rope.dimension_count"),
        "tensors": {"count": len(reader.tensors), "types": types, "params": n_params, "bytes": n_bytes},
        "vocab": {
            "model": _field_value(reader, "tokenizer.ggml.model"),
            "size": n_vocab,
            "bos": _field_value(reader, "tokenizer.ggml.bos_token_id"),
            "eos": _field_value(reader, "tokenizer.ggml.eos_token_id"),
        },
    }
    if n_layer and n_embd_k:
        sk, sv = kv_type_size(type_k), kv_type_size(type_v)
        per_token = n_layer * (n_embd_k * sk + n_embd_v * sv)
        ctx = n_ctx or n_ctx_train or 0
        out["kv_cache"] = {
            "n_ctx": ctx,
            "n_seqs": n_seqs,
            "type_k": type_k,
            "type_v": type_v,
            "n_embd_k_gqa": n_embd_k,
            "n_embd_v_gqa": n_embd_v,
            "bytes_per_token": per_token,
            "bytes_per_token_k": n_layer * n_embd_k * sk,
            "bytes_per_token_v": n_layer * n_embd_v * sv,
            "bytes_total": per_token * ctx,
            "cells_per_seq": ctx // max(1, n_seqs),
        }
    return out
