"""`pyllama-kv inspect`: what a GGUF file holds, and what its KV cache costs."""
from __future__ import annotations

from pathlib import Path

from .. import options
from ..common import MODEL_HELP, CLIError, UsageError, add_deprecated_flag, positive
from ..render import human_bytes, print_json


def register(subparsers) -> None:
    s = subparsers.add_parser("inspect", description="Read a GGUF file's header with the gguf package (weights are "
                                                     "not loaded) and report its architecture, sizes, tensors, "
                                                     "vocabulary, and the KV cache bytes per token and in total for "
                                                     "a context.")
    s.add_argument("model", help=MODEL_HELP)
    options.add(s, "n_ctx", "type_k", "type_v", defaults={"n_ctx": None},
                helps={"n_ctx": "context cells for the KV total (default: n_ctx_train)"})
    s.add_argument("--parallel", type=int, default=1,
                   help="sequences sharing the cache, as serve's --parallel (default 1)")
    add_deprecated_flag(s, "--seqs", "--parallel", "parallel", type=int)
    options.add(s, "trust_unverified")
    s.add_argument("--json", action="store_true", help="print as JSON")


def run(args) -> int:
    from ...errors import InvalidInputError
    from ...tools.gguf_inspect import inspect_gguf, kv_type_size

    positive("--parallel", args.parallel)
    positive("--ctx", args.n_ctx)
    for flag, name in (("--type-k", args.type_k), ("--type-v", args.type_v)):
        try:
            kv_type_size(name)
        except InvalidInputError as exc:
            raise UsageError(f"{flag}: {exc}") from None
    args.model = options.model_path(args.model, args.trust_unverified)  # a name: its GGUF, fetched or found
    if Path(args.model).is_dir():
        raise CLIError(f"{args.model} is a directory, not a GGUF file")
    info = inspect_gguf(args.model, n_ctx=args.n_ctx, parallel=args.parallel, type_k=args.type_k, type_v=args.type_v)
    if args.json:
        print_json(info)
        return 0
    t = info["tensors"]
    print(f"file          {info['path']} ({human_bytes(info['file_bytes'])}, GGUF v{info['gguf_version']})")
    print(f"architecture  {info['architecture']}" + (f"  ({info['name']})" if info.get("name") else ""))
    print(f"layers        {info['n_layer']}   n_embd {info['n_embd']}   heads {info['n_head']} "
          f"(kv {info['n_head_kv']})   n_ff {info['n_ff']}   n_ctx_train {info['n_ctx_train']}")
    types = ", ".join(f"{k} x{v}" for k, v in sorted(t["types"].items()))
    print(f"tensors       {t['count']} ({types}), {t['params']:,} parameters, {human_bytes(t['bytes'])}")
    print(f"attention     head size {info['head_dim_k']}" + (f"/{info['head_dim_v']}" if info['head_dim_v']
          != info['head_dim_k'] else "") + "   sliding window " + (str(info['sliding_window'])
          if info['sliding_window'] else "none"))
    v = info["vocab"]
    print(f"vocabulary    {v['model']}, {v['size']} tokens (bos {v['bos']}, eos {v['eos']})   chat template "
          + ("yes" if info["chat_template"] else "no (chat needs --template)"))
    shift = {True: "yes", False: "no", None: "maybe"}[info["can_shift"]]
    print(f"K-shift       {shift}: {info['can_shift_why']}")
    print(f"validation    {_validation(info.get('validation') or {})}")
    kv = info.get("kv_cache")
    if kv:
        print(f"KV cache      {human_bytes(kv['bytes_per_token'])} per token "
              f"(K {kv['type_k']}: {human_bytes(kv['bytes_per_token_k'])}, "
              f"V {kv['type_v']}: {human_bytes(kv['bytes_per_token_v'])})")
        print(f"              {human_bytes(kv['bytes_total'])} for n_ctx {kv['n_ctx']} cells, shared by "
              f"{kv['parallel']} sequence(s): {kv['cells_per_seq']} cells each on average")
    return 0


def _validation(val: dict) -> str:
    if not val.get("ok"):
        return "refused: " + str(val.get("error"))
    if val.get("level") == "static":
        return "ok (every check of a dense llama model, statically)"
    vetted = {True: "vetted ok (cached)", False: "refused by an earlier vetting run (cached)",
              None: "not vetted yet: the first load runs it in a child process"}[val.get("vetted")]
    return f"structure and vocabulary ok; {vetted}"
