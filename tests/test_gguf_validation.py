"""GGUF validation (issue 8, B8): a hostile model file is a ModelLoadError before llama.cpp sees it.

Each hostile file is the tiny model with overridden keys or tensors (make_tiny_model's kv_overrides
and tensor_overrides), or raw bytes for the structural cases. For every file that kills the process
without validation, a subprocess runs ``Model(path, validate=False)`` and the step that dies, so each
refusal is known to guard a real crash (and each test can fail). Valid files, tiny and with real
vocabularies, must still load and decode.
"""
from __future__ import annotations

import json
import math
import re
import signal
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

import pyllama_kv as pk
from conftest import ROOT, run_py
from pyllama_kv.modelfile.validate import (
    ARRAY,
    STRING,
    GGUFFileError,
    check_gguf_header,
    read_gguf_header,
    validate_gguf,
)
from pyllama_kv.tools.gguf import make_tiny_model, tiny_vocab
from pyllama_kv.tools.gguf_inspect import inspect_gguf

T = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType
N_TOK = len(tiny_vocab()[0])
TOKENS = tiny_vocab()[0]


def _mat(rows: int, cols: int, dtype=np.float32, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.1).astype(dtype)


def _per_layer(fmt: str, value, kinds: str = "", n_layer: int = 2) -> dict:
    return {fmt.format(i=i, x=x): value for i in range(n_layer) for x in (kinds or [""])}


# an 8-token BPE vocabulary without special token ids: llama.cpp's default BOS/EOS id 11 is out of range
_SMALL_BPE = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
              "tokenizer.ggml.tokens": [f"t{i}" for i in range(8)], "tokenizer.ggml.scores": None,
              "tokenizer.ggml.token_type": None, "tokenizer.ggml.merges": ["t 0"],
              "tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.eos_token_id": None,
              "tokenizer.ggml.unknown_token_id": None}
_SMALL_BPE_TENSORS = {"token_embd.weight": _mat(8, 64), "output.weight": _mat(8, 64)}

# name -> (make_tiny_model kwargs, regex the ModelLoadError must match besides the path)
HOSTILE = {
    # issue 8, B8
    "block_count_0": (dict(kv_overrides={"llama.block_count": 0}),
                      r"llama\.block_count = 0: expected a UINT32 in \[1, 512\]"),
    "head_count_kv_0": (dict(kv_overrides={"llama.attention.head_count_kv": 0},
                             tensor_overrides=_per_layer("blk.{i}.attn_{x}.weight", np.zeros((0, 64), np.float32),
                                                         "kv")),
                        r"tensor blk\.0\.attn_k\.weight has shape \[64, 0\]: dimension 1 is 0"),
    "head_count_kv_0_scalar": (dict(kv_overrides={"llama.attention.head_count_kv": 0}),
                               r"llama\.attention\.head_count_kv = 0: expected a UINT32 in \[1, "),
    "dim_0": (dict(tensor_overrides={"blk.0.attn_q.weight": np.zeros((0, 64), np.float32)}),
              r"tensor blk\.0\.attn_q\.weight has shape \[64, 0\]: dimension 1 is 0, expected >= 1"),
    "bert": (dict(kv_overrides={"tokenizer.ggml.model": "bert"}),
             r"byte token in a 'bert' \(WordPiece\) vocabulary"),
    "kv_heads_3": (dict(kv_overrides={"llama.attention.head_count_kv": 3},
                        tensor_overrides=_per_layer("blk.{i}.attn_{x}.weight", _mat(48, 64), "kv")),
                   r"head_count = 4 is not a multiple of llama\.attention\.head_count_kv = 3"),
    "f16_attn_norm": (dict(tensor_overrides={"blk.0.attn_norm.weight": np.ones(64, np.float16)}),
                      r"tensor blk\.0\.attn_norm\.weight is f16: .* must be f32"),
    "nan_eps": (dict(kv_overrides={"llama.attention.layer_norm_rms_epsilon": float("nan")}),
                r"layer_norm_rms_epsilon = nan: expected a finite FLOAT32 > 0"),
    "string_block_count": (dict(kv_overrides={"llama.block_count": ("2", T.STRING)}),
                           r"llama\.block_count is STRING '2': expected a UINT32"),
    "string_head_count": (dict(kv_overrides={"llama.attention.head_count": ("4", T.STRING)}),
                          r"llama\.attention\.head_count is STRING '4': expected a UINT32"),
    "ctx_train_u32_max": (dict(kv_overrides={"llama.context_length": 2**32 - 1}),
                          r"llama\.context_length = 4294967295: expected a UINT32 in \[1, 2147483647\]"),
    # the same classes, found by reading the pinned loader, vocabulary and graph
    "neg_eps": (dict(kv_overrides={"llama.attention.layer_norm_rms_epsilon": -1.0}),
                r"layer_norm_rms_epsilon = -1\.0: expected a finite FLOAT32 > 0"),
    "int_eps": (dict(kv_overrides={"llama.attention.layer_norm_rms_epsilon": (1, T.UINT32)}),
                r"layer_norm_rms_epsilon is UINT32 1: expected a finite FLOAT32"),
    "no_eps": (dict(kv_overrides={"llama.attention.layer_norm_rms_epsilon": None}),
               r"layer_norm_rms_epsilon is missing"),
    "inf_freq_base": (dict(kv_overrides={"llama.rope.freq_base": float("inf")}),
                      r"rope\.freq_base = inf: expected a finite FLOAT32 > 0"),
    "block_count_513": (dict(kv_overrides={"llama.block_count": 513}),
                        r"block_count = 513: expected a UINT32 in \[1, 512\]"),
    "no_head_count": (dict(kv_overrides={"llama.attention.head_count": None}), r"attention\.head_count is missing"),
    "no_ff": (dict(kv_overrides={"llama.feed_forward_length": None}), r"feed_forward_length is missing"),
    "ff_mismatch": (dict(kv_overrides={"llama.feed_forward_length": 96}),
                    r"tensor blk\.0\.ffn_gate\.weight has shape \[64, 128\], expected \[64, 96\]"),
    "float_head_array": (dict(kv_overrides={"llama.attention.head_count": ([4.0, 4.0], T.ARRAY, T.FLOAT32)}),
                         r"head_count is an array of 2 FLOAT32 .*expected a UINT32 .* or an INT32 array of 2"),
    "head_array_wrong_length": (dict(kv_overrides={"llama.attention.head_count": ([4, 4, 4], T.ARRAY, T.INT32)}),
                                r"head_count is an array of 3 INT32"),
    "kv_heads_array_varies": (dict(kv_overrides={"llama.attention.head_count_kv": ([2, 1], T.ARRAY, T.INT32)}),
                              r"head_count_kv = \[2, 1\]: the llama architecture needs the same value for every layer"),
    "kv_heads_8_of_4": (dict(kv_overrides={"llama.attention.head_count_kv": 8}), r"head_count = 4 is not a multiple"),
    "rope_scaling_bogus": (dict(kv_overrides={"llama.rope.scaling.type": "bogus"}),
                           r"rope\.scaling\.type = 'bogus': expected one of 'none', 'linear', 'yarn', 'longrope'"),
    "rope_factor_nan": (dict(kv_overrides={"llama.rope.scaling.factor": (float("nan"), T.FLOAT32)}),
                        r"rope\.scaling\.factor = nan"),
    "orig_ctx_u32_max": (dict(kv_overrides={"llama.rope.scaling.original_context_length": (2**32 - 1, T.UINT32)}),
                         r"original_context_length = 4294967295"),
    "expert_used_no_experts": (dict(kv_overrides={"llama.expert_used_count": (2, T.UINT32)}),
                               r"expert_used_count = 2: expected 0 in a model without experts"),
    "value_length_8": (dict(kv_overrides={"llama.attention.value_length": (8, T.UINT32)},
                            tensor_overrides=_per_layer("blk.{i}.attn_v.weight", _mat(16, 64))),
                       r"value_length = 8 differs from the key length 16"),
    "rope_dims_8": (dict(kv_overrides={"llama.rope.dimension_count": 8}),
                    r"rope\.dimension_count = 8: .*equal to the head size 16"),
    "odd_head_dim": (dict(n_embd=60, n_head=4, n_head_kv=2), r"head size \(rope dimensions\) is 15: it must be even"),
    "head_size_0": (dict(kv_overrides={"llama.attention.head_count": 128, "llama.attention.head_count_kv": 128}),
                    r"embedding_length = 64 < llama\.attention\.head_count = 128"),
    "rope_freqs_f16": (dict(tensor_overrides={"rope_freqs.weight": np.ones(8, np.float16)}),
                       r"tensor rope_freqs\.weight is f16: .* must be f32"),
    "rope_freqs_shape": (dict(tensor_overrides={"rope_freqs.weight": np.ones(16, np.float32)}),
                         r"tensor rope_freqs\.weight has shape \[16\], expected \[8\]"),
    "f16_bias": (dict(tensor_overrides={"blk.0.attn_output.bias": np.zeros(64, np.float16)}),
                 r"tensor blk\.0\.attn_output\.bias is f16"),
    "q_bias_mismatch": (dict(kv_overrides={"llama.attention.key_length": (24, T.UINT32),
                                           "llama.attention.value_length": (24, T.UINT32),
                                           "llama.rope.dimension_count": 24},
                             tensor_overrides={**_per_layer("blk.{i}.attn_q.weight", _mat(96, 64)),
                                               **_per_layer("blk.{i}.attn_output.weight", _mat(64, 96)),
                                               **_per_layer("blk.{i}.attn_{x}.weight", _mat(48, 64), "kv"),
                                               **_per_layer("blk.{i}.attn_q.bias", np.zeros(64, np.float32))}),
                        r"tensor blk\.0\.attn_q\.bias: a q bias needs head size x head_count \(96\) equal to "
                        r"embedding_length \(64\)"),
    "i32_weight": (dict(tensor_overrides={"blk.0.attn_q.weight": np.zeros((64, 64), np.int32)}),
                   r"tensor blk\.0\.attn_q\.weight is i32: not a weight type"),
    "q8_1_weight": (dict(tensor_overrides={"blk.0.attn_q.weight": (np.zeros((64, 2 * 40), np.uint8), Q.Q8_1)}),
                    r"tensor blk\.0\.attn_q\.weight is q8_1"),
    "missing_tensor": (dict(tensor_overrides={"blk.1.ffn_up.weight": None}),
                       r"tensor blk\.1\.ffn_up\.weight is missing"),
    "extra_tensor": (dict(tensor_overrides={"blk.0.attn_rot_embd": np.zeros(4, np.float32)}),
                     r"unexpected tensor blk\.0\.attn_rot_embd"),
    "vocab_embd_mismatch": (dict(tensor_overrides={"token_embd.weight": _mat(N_TOK - 1, 64)}),
                            rf"tensor token_embd\.weight has shape \[64, {N_TOK - 1}\], expected \[64, {N_TOK}\]"),
    "no_vocab": (dict(kv_overrides={"tokenizer.ggml.model": "no_vocab"}), r"tokenizer\.ggml\.model = 'no_vocab'"),
    "t5": (dict(kv_overrides={"tokenizer.ggml.model": "t5"}), r"tokenizer\.ggml\.model = 't5'"),
    "dup_tokens": (dict(kv_overrides={"tokenizer.ggml.tokens": TOKENS[:3] + ["<s>"] + TOKENS[4:]}),
                   r"token 3 b'<s>' repeats token 1: token texts must be unique"),
    "empty_token_collision": (dict(kv_overrides={"tokenizer.ggml.tokens": TOKENS[:3] + ["", "[EMPTY_3]"] + TOKENS[5:]}),
                              r"token 4 b'\[EMPTY_3\]' repeats token 3"),
    "tokens_ints": (dict(kv_overrides={"tokenizer.ggml.tokens": (list(range(N_TOK)), T.ARRAY, T.INT32)}),
                    r"tokenizer\.ggml\.tokens is an array of \d+ INT32 .*expected an array of STRING"),
    "scores_strings": (dict(kv_overrides={"tokenizer.ggml.scores": (["x"] * N_TOK, T.ARRAY, T.STRING)}),
                       rf"tokenizer\.ggml\.scores is an array of {N_TOK} STRING .*"
                       rf"expected an array of {N_TOK} FLOAT32"),
    "scores_short": (dict(kv_overrides={"tokenizer.ggml.scores": [0.0] * 10}),
                     rf"tokenizer\.ggml\.scores is an array of 10 FLOAT32 .*expected an array of {N_TOK} FLOAT32"),
    "token_type_scalar": (dict(kv_overrides={"tokenizer.ggml.token_type": (1, T.INT32)}),
                          r"tokenizer\.ggml\.token_type is INT32 1: expected an array"),
    "gpt2_merges_ints": (dict(kv_overrides={"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
                                            "tokenizer.ggml.merges": ([1, 2], T.ARRAY, T.INT32)}),
                         r"tokenizer\.ggml\.merges is an array of 2 INT32 .*expected an array of STRING"),
    "gpt2_no_merges": (dict(kv_overrides={"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2"}),
                       r"tokenizer\.ggml\.merges is missing"),
    "spm_bad_byte_token": (dict(kv_overrides={"tokenizer.ggml.tokens": TOKENS[:3] + ["<0xZZ>"] + TOKENS[4:],
                                              "tokenizer.ggml.token_type": [2, 3, 3, 6] + [1] * (N_TOK - 4)}),
                           r"token 3 b'<0xZZ>' has the byte type but is not spelled <0xXX>"),
    "small_bpe_vocab": (dict(kv_overrides=_SMALL_BPE, tensor_overrides=_SMALL_BPE_TENSORS),
                        r"the bos token id llama.cpp would use, 11 \(default\), is out of range for a vocabulary "
                        r"of 8 tokens"),
    "bos_and_default_out_of_range": (dict(kv_overrides={**_SMALL_BPE, "tokenizer.ggml.bos_token_id": 99,
                                                        "tokenizer.ggml.eos_token_id": 1},
                                          tensor_overrides=_SMALL_BPE_TENSORS),
                                    r"11 \(default; tokenizer\.ggml\.bos_token_id = 99 is out of range"),
    "bpe_add_bos_without_bos": (dict(kv_overrides={"tokenizer.ggml.model": "gpt2",
                                                   "tokenizer.ggml.pre": "chatglm-bpe",
                                                   "tokenizer.ggml.merges": ["a b"],
                                                   "tokenizer.ggml.bos_token_id": None}),
                                r"add_bos_token is set but the vocabulary has no BOS token"),
    "bos_id_string": (dict(kv_overrides={"tokenizer.ggml.bos_token_id": ("1", T.STRING)}),
                      r"tokenizer\.ggml\.bos_token_id is STRING '1': expected a UINT32"),
    "empty_key": (dict(kv_overrides={"": (1, T.UINT32)}), r"metadata entry \d+ has an empty key"),
    "alignment_string": (dict(kv_overrides={"general.alignment": ("32", T.STRING)}),
                         r"general\.alignment is STRING '32': expected a UINT32"),
    "arch_unknown": (dict(kv_overrides={"general.architecture": "nosucharch"}),
                     r"unknown model architecture 'nosucharch': no llama\.cpp library pyllama_kv builds "
                     r"implements it"),
    # another architecture gets the checks every loader needs: its own keys must be there
    "arch_qwen2": (dict(kv_overrides={"general.architecture": "qwen2"}),
                   r"qwen2\.context_length is missing: expected a UINT32 in \[1, 2147483647\]"),
    "arch_missing": (dict(kv_overrides={"general.architecture": None}), r"general\.architecture is missing"),
    "split": (dict(kv_overrides={"split.count": (2, T.UINT16)}),
              r"split\.count = 2: this is one part of a split GGUF model; merge the parts"),
}

SIGABRT, SIGFPE, SIGSEGV = signal.SIGABRT, signal.SIGFPE, signal.SIGSEGV
# without validation these kill the process: case -> (the step that dies, its signal). Not listed:
# small_bpe_vocab reads id_to_token[11] of an 8-token vocabulary in print_info, out of bounds: it
# kills the process only sometimes.
CRASHES = {
    "block_count_0": ("model", SIGABRT),         # llama_hparams::n_head(0): GGML_ABORT
    "head_count_kv_0": ("model", SIGFPE),        # gguf_init_from_file: INT64_MAX / ne[1]
    "dim_0": ("model", SIGFPE),
    "bert": ("model", SIGABRT),                  # token_to_byte on a WPM byte token
    "kv_heads_3": ("context", SIGABRT),          # ggml_can_mul_mat
    "f16_attn_norm": ("decode", SIGABRT),        # binary_op: unsupported types
    "nan_eps": ("decode", SIGABRT),              # rms_norm: eps >= 0
    "neg_eps": ("decode", SIGABRT),
    "float_head_array": ("model", SIGABRT),      # get_arr: FLOAT32 into uint32
    "kv_heads_array_varies": ("context", SIGABRT),
    "rope_scaling_bogus": ("model", SIGABRT),
    "expert_used_no_experts": ("model", SIGABRT),
    "value_length_8": ("context", SIGABRT),      # build_llama: n_embd_head_v == n_embd_head_k
    "odd_head_dim": ("decode", SIGABRT),         # rope: n_dims % 2 == 0
    "rope_freqs_f16": ("model", SIGABRT),        # ggml_rope_impl: freq factors f32
    "f16_bias": ("decode", SIGABRT),
    "q_bias_mismatch": ("context", SIGABRT),     # ggml_add: ggml_can_repeat
    "i32_weight": ("decode", SIGSEGV),           # mul_mat without a vec_dot
    "dup_tokens": ("model", SIGABRT),            # id_to_token.size() == token_to_id.size()
    "empty_token_collision": ("model", SIGABRT),
    "tokens_ints": ("model", SIGABRT),           # gguf_get_arr_str on an INT32 array
    "scores_strings": ("model", SIGABRT),        # gguf_get_arr_data on a STRING array
    "gpt2_merges_ints": ("model", SIGABRT),
    "empty_key": ("model", SIGABRT),             # gguf_kv: !key.empty()
    "alignment_string": ("model", SIGABRT),      # gguf_get_val_u32 on a STRING
}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    made: dict = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_tiny_model(d / f"{name}.gguf", **HOSTILE[name][0])
        return made[name]
    return get


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_file_is_refused_with_a_useful_message(hostile, name):
    """validate_gguf (pure Python: it cannot crash the test process) names the file, the key or
    tensor, the value and what is expected."""
    path = hostile(name)
    with pytest.raises(pk.ModelLoadError) as e:
        validate_gguf(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: "), msg
    assert re.search(HOSTILE[name][1], msg), msg


MODEL_ALL = r"""
import json, sys
import pyllama_kv as pk
for path in sys.argv[2:]:
    print(json.dumps(path), flush=True)          # the last line names the file if llama.cpp kills us
    try:
        pk.Model(path, lib=sys.argv[1])
        print(json.dumps("loaded"), flush=True)
    except pk.ModelLoadError as exc:
        print(json.dumps(str(exc)), flush=True)
"""


def test_model_refuses_every_hostile_file_before_llama_cpp_sees_it(hostile, pin_lib):
    """Model(path) on every hostile file, in one subprocess (without validation many would kill it),
    on both pins: the checks run in Python before either llama.cpp reads the file."""
    paths = [str(hostile(name)) for name in HOSTILE]
    r = run_py(["-c", MODEL_ALL, pin_lib, *paths])
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert lines[0::2] == paths
    for name, path, msg in zip(HOSTILE, paths, lines[1::2]):
        assert msg.startswith(f"{path}: ") and re.search(HOSTILE[name][1], msg), (name, msg)


PROBE = r"""
import sys
import pyllama_kv as pk
path, stage = sys.argv[1], sys.argv[2]
print("model", flush=True)
m = pk.Model(path, validate=False)
if stage != "model":
    print("context", flush=True)
    ctx = m.context(n_ctx=64, n_seq_max=1)
    if stage != "context":
        print("decode", flush=True)
        ctx.new_sequence().extend([1, 5, 7])
print("survived", flush=True)
"""


@pytest.mark.parametrize("name", list(CRASHES))
def test_without_validation_the_file_kills_the_process(hostile, name):
    stage, sig = CRASHES[name]
    r = run_py(["-c", PROBE, str(hostile(name)), stage])
    steps = r.stdout.split()
    assert r.returncode == -sig, (name, r.returncode, r.stdout, r.stderr[-2000:])
    assert steps and steps[-1] == stage and "survived" not in steps, (name, r.stdout)


def test_n_ctx_train_beyond_int32_is_refused(hostile):
    """llama.cpp keeps n_ctx_train as a uint32 but returns it as an int32: 2^32-1 reads back as -1
    (llama_model_n_ctx_train), and the context code compares it with int32 sizes. Validation keeps
    context_length in [1, 2^31-1]."""
    path = hostile("ctx_train_u32_max")
    code = ("import sys, pyllama_kv as pk; m = pk.Model(sys.argv[1], validate=False); "
            "print(m._lib.lib.llama_model_n_ctx_train(m._ptr))")
    r = run_py(["-c", code, str(path)])
    assert r.returncode == 0 and r.stdout.split()[-1] == "-1", (r.stdout, r.stderr[-2000:])
    with pytest.raises(pk.ModelLoadError, match="context_length = 4294967295"):
        pk.Model(path)


def test_inspect_raises_its_own_error_never_a_raw_one(hostile):
    """inspect_gguf (`pyllama-kv inspect`) on every hostile file: a report that says validation failed,
    or GGUFFileError (a ValueError the CLI reports in one line), never TypeError & co."""
    for name in HOSTILE:
        path = hostile(name)
        try:
            info = inspect_gguf(path)
        except GGUFFileError as exc:
            assert str(exc).startswith(f"{path}: ")
            continue
        assert info["validation"]["ok"] is False, name
        assert re.search(HOSTILE[name][1], info["validation"]["error"]), (name, info["validation"])
    with pytest.raises(GGUFFileError, match=r"llama\.block_count is STRING '2': expected an integer"):
        inspect_gguf(hostile("string_block_count"))


# ---------------------------------------------------------------------------------------------
# valid files must still load and run

_Q8 = {f"blk.{i}.{n}.weight": (gguf.quants.quantize(_mat(r, c, seed=i), Q.Q8_0), Q.Q8_0)
       for i in range(2) for n, r, c in (("attn_q", 64, 64), ("attn_k", 32, 64), ("attn_v", 32, 64),
                                          ("attn_output", 64, 64), ("ffn_gate", 128, 64), ("ffn_up", 128, 64),
                                          ("ffn_down", 64, 128))}
VALID = {
    "default": {},
    "one_layer": dict(n_layer=1, seed=1),
    "no_vocab_bytes": dict(byte_tokens=False),
    "f16": dict(dtype="f16"),
    "tied_output": dict(tensor_overrides={"output.weight": None}),
    "per_layer_arrays": dict(kv_overrides={"llama.attention.head_count": ([4, 4], T.ARRAY, T.INT32),
                                           "llama.attention.head_count_kv": ([2, 2], T.ARRAY, T.INT32),
                                           "llama.feed_forward_length": ([128, 128], T.ARRAY, T.INT32)}),
    "biases_and_rope_freqs": dict(tensor_overrides={
        **_per_layer("blk.{i}.attn_{x}.bias", np.full(64, 0.01, np.float32), ["q", "output"]),
        **_per_layer("blk.{i}.attn_{x}.bias", np.full(32, 0.01, np.float32), "kv"),
        **_per_layer("blk.{i}.ffn_{x}.bias", np.full(128, 0.01, np.float32), ["gate", "up"]),
        **_per_layer("blk.{i}.ffn_down.bias", np.full(64, 0.01, np.float32)),
        "rope_freqs.weight": np.linspace(1, 4, 8, dtype=np.float32)}),
    "head_size_32_not_embd_over_heads": dict(
        kv_overrides={"llama.attention.key_length": (32, T.UINT32), "llama.attention.value_length": (32, T.UINT32),
                      "llama.rope.dimension_count": 32},
        tensor_overrides={**_per_layer("blk.{i}.attn_q.weight", _mat(128, 64)),
                          **_per_layer("blk.{i}.attn_output.weight", _mat(64, 128)),
                          **_per_layer("blk.{i}.attn_{x}.weight", _mat(64, 64), "kv")}),
    "yarn": dict(kv_overrides={"llama.rope.scaling.type": ("yarn", T.STRING),
                               "llama.rope.scaling.factor": (2.0, T.FLOAT32),
                               "llama.rope.scaling.original_context_length": (2048, T.UINT32),
                               "llama.rope.scaling.attn_factor": (1.0, T.FLOAT32),
                               "llama.vocab_size": (N_TOK, T.UINT32)}),
    "q8_0": dict(tensor_overrides=_Q8),
    "bad_special_id_ignored_as_llama_cpp_does": dict(
        kv_overrides={"tokenizer.ggml.padding_token_id": (10**6, T.UINT32)}),
}


@pytest.mark.parametrize("name", list(VALID))
def test_valid_models_are_accepted_and_run(tmp_path, name):
    path = make_tiny_model(tmp_path / f"{name}.gguf", **VALID[name])
    assert validate_gguf(path) is True   # a dense llama model: validated completely, statically
    assert inspect_gguf(path)["validation"] == {"ok": True, "error": None, "level": "static"}
    with pk.Model(path) as m:
        with m.context(n_ctx=64, n_seq_max=1) as ctx:
            logits = ctx.new_sequence().extend([1, 5, 7])
    assert logits.shape == (m.n_vocab,) and np.isfinite(logits).all()


def _graft_vocab(src: Path, out: Path, pre: str | None = None, extra: dict | None = None) -> Path:
    """The tiny model with a real vocabulary (every tokenizer.* key of ``src``), tied f16 embeddings."""
    h = read_gguf_header(src)
    kv: dict = {k: None for k in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                                  "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_bos_token",
                                  "tokenizer.ggml.add_eos_token")}
    for k, v in h.kv.items():
        if k.startswith("tokenizer."):
            if v.type == ARRAY:
                kv[k] = (v.value if v.elem_type == STRING else v.value.tolist(), T.ARRAY, T(v.elem_type))
            else:
                kv[k] = (v.value, T(v.type))
    if pre is not None:
        kv["tokenizer.ggml.pre"] = (pre, T.STRING)
    kv.update(extra or {})
    n = len(h.kv["tokenizer.ggml.tokens"].value)
    return make_tiny_model(out, kv_overrides=kv, tensor_overrides={"token_embd.weight": _mat(n, 64, np.float16),
                                                                   "output.weight": None})


@pytest.mark.parametrize("vocab,pre", [("starcoder", "smollm"),      # SmolLM2's kind: 49152-token BPE
                                       ("llama-spm", None), ("deepseek-coder", None),
                                       ("bert-bge", None)])            # WordPiece: BGE embedding models
def test_real_vocabularies_are_accepted_and_run(tmp_path, vocab, pre):
    path = _graft_vocab(ROOT / "vendor/llama.cpp/models" / f"ggml-vocab-{vocab}.gguf", tmp_path / "m.gguf", pre)
    assert validate_gguf(path) is True
    with pk.Model(path) as m:
        toks = m.tokenize("Hello world, the KV cache")
        # WordPiece lowercases
        assert len(toks) >= 3 and m.detokenize(toks).strip().lower().endswith("the kv cache")
        with m.context(n_ctx=64, n_seq_max=1) as ctx:
            assert np.isfinite(ctx.new_sequence().extend(toks)).all()


def test_the_llama_vocabularies_of_the_pinned_tree_pass_the_vocabulary_checks():
    """The vocab-only llama files llama.cpp tests its tokenizers with: only their (absent) tensors
    are refused."""
    names = ["llama-spm", "llama-bpe", "deepseek-coder", "deepseek-llm", "aquila"]
    for name in names:
        path = ROOT / "vendor/llama.cpp/models" / f"ggml-vocab-{name}.gguf"
        with pytest.raises(pk.ModelLoadError, match=r"tensor token_embd\.weight is missing"):
            check_gguf_header(read_gguf_header(path))


# ---------------------------------------------------------------------------------------------
# structure: what gguf_init_from_file refuses or crashes on, from raw bytes

def _s(b: bytes | str) -> bytes:
    b = b.encode() if isinstance(b, str) else b
    return struct.pack("<Q", len(b)) + b


def _u32(v: int) -> tuple:
    return (4, struct.pack("<I", v))


def _raw_gguf(path: Path, kvs=(), tensors=(), data: bytes = b"", version: int = 3) -> Path:
    """kvs: (key, GGUF type, payload bytes); tensors: (name, dims, ggml type, offset)."""
    out = bytearray(b"GGUF" + struct.pack("<Iqq", version, len(tensors), len(kvs)))
    for key, t, payload in kvs:
        out += _s(key) + struct.pack("<i", t) + payload
    for name, dims, t, offset in tensors:
        out += _s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<q", d) for d in dims)
        out += struct.pack("<iQ", t, offset)
    out += b"\0" * (-len(out) % 32) + data
    path.write_bytes(bytes(out))
    return path


_ARCH = ("general.architecture", 8, _s("llama"))
_F32_4 = [("t", [4], 0, 0)]
STRUCTURE = {
    "version_1": (dict(version=1), r"GGUF version 1 is not supported"),
    "version_4": (dict(version=4), r"GGUF version 4 is not supported"),
    "empty_key": (dict(kvs=[("", *_u32(1))]), r"metadata entry 0 has an empty key"),
    "duplicate_key": (dict(kvs=[("a", *_u32(1)), ("a", *_u32(2))]), r"duplicate metadata key 'a'"),
    "nested_array": (dict(kvs=[("a", 9, struct.pack("<iQ", 9, 1))]), r"a is an array of invalid GGUF type 9"),
    "bad_value_type": (dict(kvs=[("a", 13, b"")]), r"a has invalid GGUF type 13"),
    "alignment_array": (dict(kvs=[("general.alignment", 9, struct.pack("<iQI", 4, 1, 32))]),
                        r"general\.alignment is an array of 1 UINT32 \[32\]: expected a UINT32"),
    "alignment_48": (dict(kvs=[("general.alignment", *_u32(48))]), r"general\.alignment = 48: expected a power of 2"),
    "five_dims": (dict(tensors=[("t", [1, 1, 1, 1, 1], 0, 0)]), r"tensor t has 5 dimensions"),
    "negative_dim": (dict(tensors=[("t", [-1], 0, 0)]), r"tensor t has shape \[-1\]: dimension 0 is -1"),
    "dim0_zero": (dict(tensors=[("t", [0, 4], 0, 0)]), r"dimension 0 is 0, expected >= 1"),
    "dim3_zero": (dict(tensors=[("t", [4, 1, 1, 0], 0, 0)]), r"dimension 3 is 0"),
    "overflow": (dict(tensors=[("t", [2**32, 2**31], 0, 0)]), r"2\^63 elements or more"),
    "removed_type": (dict(tensors=[("t", [32], 4, 0)]), r"tensor t has invalid ggml type 4"),
    "type_39": (dict(tensors=[("t", [32], 39, 0)]), r"invalid ggml type 39"),
    "block_size": (dict(tensors=[("t", [33], 2, 0)]), r"type q4_0 has rows of 33 elements, not a multiple of its "
                                                       r"block size 32"),
    "offset_order": (dict(tensors=[("t", [4], 0, 0), ("u", [4], 0, 0)], data=b"\0" * 64),
                     r"tensor u has data offset 0, expected 32"),
    "data_past_eof": (dict(tensors=_F32_4, data=b"\0" * 8), r"truncated or corrupt GGUF: the data of tensor t"),
    "long_name": (dict(tensors=[("x" * 64, [4], 0, 0)]), r"tensor name 'x{64}' is invalid"),
    "duplicate_tensor": (dict(tensors=[("t", [4], 0, 0), ("t", [4], 0, 32)], data=b"\0" * 64),
                         r"duplicate tensor name 't'"),
    "huge_string": (dict(kvs=[("a", 8, struct.pack("<Q", 2**62))]), r"truncated or corrupt GGUF: a at byte"),
    "huge_array": (dict(kvs=[("a", 9, struct.pack("<iQ", 8, 2**40))]),
                   r"truncated or corrupt GGUF: the \d+ strings of a"),
    "no_architecture_after_structure": (dict(kvs=[("general.name", 8, _s("x"))], tensors=_F32_4, data=b"\0" * 16),
                                        r"general\.architecture is missing"),
}


@pytest.mark.parametrize("name", list(STRUCTURE))
def test_structural_problems_are_refused(tmp_path, name):
    kwargs, pattern = STRUCTURE[name]
    path = _raw_gguf(tmp_path / f"{name}.gguf", **kwargs)
    with pytest.raises(pk.ModelLoadError) as e:
        validate_gguf(path)
    assert str(e.value).startswith(f"{path}: ") and re.search(pattern, str(e.value)), str(e.value)


def test_truncation_anywhere_is_refused(tiny_model, tmp_path):
    data = tiny_model.read_bytes()
    header_end = read_gguf_header(tiny_model).data_offset
    for cut in sorted({0, 3, 4, 7, 24, 100, 1000, header_end // 2, header_end - 1, header_end,
                       len(data) // 2, len(data) - 1}):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(pk.ModelLoadError, match="truncated|not a GGUF file"):
            validate_gguf(p)


def test_validate_gguf_is_a_reusable_function(tiny_model, tmp_path):
    assert validate_gguf(tiny_model) is True and validate_gguf(str(tiny_model)) is True
    with pytest.raises(pk.ModelLoadError, match="no such file"):
        validate_gguf(tmp_path / "missing.gguf")
    with pytest.raises(pk.ModelLoadError, match="not a file"):
        validate_gguf(tmp_path)
    (tmp_path / "x.gguf").write_bytes(b"GGML....")
    with pytest.raises(pk.ModelLoadError, match="not a GGUF file"):
        validate_gguf(tmp_path / "x.gguf")


def test_header_reader_reads_what_the_writer_wrote(tiny_model):
    h = read_gguf_header(tiny_model)
    assert h.version == 3 and h.kv["llama.block_count"].value == 2
    assert math.isclose(h.kv["llama.attention.layer_norm_rms_epsilon"].value, 1e-5, rel_tol=1e-6)
    assert len(h.kv["tokenizer.ggml.tokens"].value) == N_TOK and h.kv["tokenizer.ggml.tokens"].value[1] == b"<s>"
    t = {x.name: x for x in h.tensors}
    assert t["token_embd.weight"].shape == (64, N_TOK) and t["blk.0.attn_k.weight"].shape == (64, 32)
    assert h.data_offset + t["output.weight"].offset + t["output.weight"].nbytes <= h.file_size


def test_a_wordpiece_vocabulary_with_a_byte_token_is_refused(tmp_path):
    """llama.cpp's WPM tokenizer aborts on a byte token (token_to_byte): refused before loading."""
    import gguf

    src = ROOT / "vendor/llama.cpp/models/ggml-vocab-bert-bge.gguf"
    n = len(read_gguf_header(src).kv["tokenizer.ggml.tokens"].value)
    types = [1] * n
    types[500] = 6
    bad = _graft_vocab(src, tmp_path / "bad.gguf", None,
                       {"tokenizer.ggml.token_type": (types, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)})
    with pytest.raises(pk.ModelLoadError, match=r"byte token in a 'bert'"):
        check_gguf_header(read_gguf_header(bad))


def test_an_architecture_only_the_current_library_has_names_it(tmp_path):
    """A SmolLM3 file on the mission pin's library: the refusal says which library implements it and
    how to choose it; with the current library's architectures the file passes that check."""
    from pyllama_kv._native import archs

    path = make_tiny_model(tmp_path / "m.gguf", kv_overrides={"general.architecture": "smollm3"})
    with pytest.raises(pk.ModelLoadError, match=r"unknown model architecture 'smollm3' for this llama\.cpp "
                                                 r"library; the 'current' library implements it: load the model "
                                                 r"with lib='current' \(--lib current"):
        check_gguf_header(read_gguf_header(path))
    with pytest.raises(pk.ModelLoadError, match=r"smollm3\.context_length is missing"):
        check_gguf_header(read_gguf_header(path), archs.CURRENT)
