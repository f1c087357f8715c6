"""The child process of a vetting run (:mod:`pyllama_kv.modelfile.vetting`): it loads the model and
uses it once at every stage that has crashed llama.cpp on a file the static checks cannot validate
completely (load, context, tokenize, decode a batch and a token, fork, K-shift, defrag, state where the
library has it), printing each stage's name before it starts and the verdict as a JSON line last. The
parent reads those lines; a crash here kills only this process.
``python -m pyllama_kv.core.vetting_child PATH --lib LIB``."""
from __future__ import annotations

import json
import sys

from ..errors import InvalidInputError
from ..modelfile.vetting import _VET_TEXT, VET_CTX
from .model import Model


def vet_here(path: str, lib: str, n_gpu_layers: int, use_mmap: bool) -> dict:
    """Load ``path`` and use it once at every stage (printing each stage's name first), in this process."""
    def stage(name: str) -> None:
        print(f"stage {name}", flush=True)

    stage("load")
    model = Model(path, n_gpu_layers, lib=lib, use_mmap=use_mmap, validate="off")
    stage("context")
    n_ctx = max(1, min(VET_CTX, model.n_ctx_train))
    # one thread: a vetting run must not compete with a process that is serving (ggml's threads spin)
    with model.context(n_ctx=n_ctx, n_seq_max=2, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=1) as ctx:
        stage("tokenize")
        try:
            toks = model.tokenize(_VET_TEXT, add_bos=True, special=True)
        except InvalidInputError:   # a vocabulary that cannot spell this text: its first ids instead
            toks = list(range(min(8, model.n_vocab)))
        model.detokenize(toks)
        # a multi-token batch (the context already built the worst-case graph), within the context
        n = max(1, min(len(toks), 8, n_ctx // 4))
        toks = (toks * (n // max(1, len(toks)) + 1))[:n]
        stage("decode batch")
        a = ctx.new_sequence()
        a.extend(toks)
        stage("decode token")
        a.extend([toks[-1]])
        stage("fork")
        b = a.fork()
        ctx.decode({a: [toks[0]], b: [toks[-1]]})
        stage("k-shift")
        can_shift = bool(ctx.can_shift)
        if can_shift and len(a.tokens) > 4 and len(a.tokens) + 1 <= n_ctx:
            a.shift_out(1, 2)
            a.extend([toks[0]])
        stage("defrag")
        b.close()
        ctx.defrag()
        if ctx.can_save_state:   # not a recurrent or sliding-window memory, whose states the binding does not read
            stage("state")
            st = a.export_state()
            a.close()
            c = ctx.import_sequence(st)
            c.extend([toks[0]])
    model.close()
    return {"ok": True, "can_shift": can_shift}


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m pyllama_kv.core.vetting_child",
                                description="Vet a GGUF model in this process (the parent of a vetting run "
                                            "reads the stages and the verdict on stdout).")
    p.add_argument("path")
    p.add_argument("--lib", required=True)
    p.add_argument("--n-gpu-layers", type=int, default=0)
    p.add_argument("--mmap", type=int, default=1)
    a = p.parse_args(argv)
    try:
        result = vet_here(a.path, a.lib, a.n_gpu_layers, bool(a.mmap))
    except Exception as exc:   # a clean refusal by llama.cpp (a missing tensor throws in the loader)
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result), flush=True)
    return 0 if result.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
