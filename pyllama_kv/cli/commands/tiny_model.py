"""`pyllama-kv tiny-model`: write the random-weight tiny llama model the tests use."""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from ..common import UsageError, check_output_file, positive
from ..render import human_bytes, print_json


def register(subparsers) -> None:
    s = subparsers.add_parser("tiny-model", description="Write a random-weight llama GGUF with an SPM vocabulary "
                                                        "(with the 256 byte tokens, any text tokenizes). For tests, "
                                                        "demos and benchmarks; it says nothing.")
    s.add_argument("out", help="output .gguf path (its directory must exist; the file is replaced whole or not at all)")
    s.add_argument("--layers", type=int, default=2, help="n_layer (default 2)")
    s.add_argument("--embd", type=int, default=64, help="n_embd (default 64)")
    s.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    s.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    s.add_argument("--ff", type=int, default=128, help="feed-forward size (default 128)")
    s.add_argument("--ctx-train", type=int, default=4096, help="n_ctx_train (default 4096)")
    s.add_argument("--vocab-bytes", action=argparse.BooleanOptionalAction, default=True,
                   help="include the 256 <0xNN> byte tokens (default: yes; without them llama.cpp aborts on "
                        "text it cannot tokenize)")
    s.add_argument("--f16", action="store_true", help="store weights as f16 (default f32)")
    s.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    s.add_argument("--json", action="store_true", help="print the written model's summary as JSON")


def run(args) -> int:
    from ...tools.gguf import make_tiny_model
    from ...tools.gguf_inspect import inspect_gguf

    for name in ("layers", "embd", "heads", "kv_heads", "ff", "ctx_train"):
        positive("--" + name.replace("_", "-"), getattr(args, name))
    if args.embd % args.heads or args.heads % args.kv_heads:
        raise UsageError("--embd must be a multiple of --heads, and --heads a multiple of --kv-heads")
    if (args.embd // args.heads) % 2:
        raise UsageError("--embd / --heads (the head size) must be even: llama.cpp's rope needs pairs")
    path = check_output_file(args.out, "the model")
    # written in a temporary directory next to the target, then renamed over it: nothing is left
    # behind on any failure (a full disk, Ctrl-C), and the target is never half written
    tmpdir = tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        written = make_tiny_model(Path(tmpdir) / path.name, n_layer=args.layers, n_embd=args.embd,
                                  n_head=args.heads, n_head_kv=args.kv_heads, n_ff=args.ff,
                                  n_ctx_train=args.ctx_train, seed=args.seed, byte_tokens=args.vocab_bytes,
                                  dtype="f16" if args.f16 else "f32")
        os.replace(written, path)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    info = inspect_gguf(path)
    if args.json:
        print_json(info)
    else:
        print(f"wrote {path}: {info['n_layer']} layers, n_embd {info['n_embd']}, {info['vocab']['size']} tokens, "
              f"{human_bytes(info['file_bytes'])}")
    return 0
