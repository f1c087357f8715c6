"""`pyllama-kv run`: N continuations of one prompt, served by the generation engine.

The prompt is one request with ``n=--parallel`` continuations: the engine evaluates it once, forks
it N-1 times and decodes all continuations together, one token each per step. This command only
submits the request and renders the engine's events: streamed text (``[i]``-prefixed for N>1) and
a summary (prompt and generation tokens/s, reused tokens, KV cache stats), also when Ctrl-C stops it.
With ``--chat`` the prompt is one user message (after ``--system``), rendered with the model's chat
template (or ``--template FILE``) before it is tokenized.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ...config import CacheConfig as _CACHE
from ...errors import InvalidInputError
from ...limits import MAX_SEQUENCES, prompt_too_long
from .. import options
from ..common import (
    EXIT_INTERRUPTED,
    MODEL_HELP,
    CLIError,
    UsageError,
    add_lib_flag,
    chat_template,
    context_size,
    open_draft_model,
    open_model,
    positive,
    read_template,
    set_phase,
    setup_logging,
)
from ..render import Streamer, log, print_json

DEFAULT_N_PREDICT = 64


def register(subparsers) -> None:
    s = subparsers.add_parser("run", description="Evaluate the prompt once, fork it into N sequences (prefix copies: "
                                                 "no recompute), then decode all sequences together, one batch per "
                                                 "step. Streams the text (prefixed by sequence for N>1) and ends with "
                                                 "a summary.")
    s.add_argument("model", help=MODEL_HELP)
    s.add_argument("-p", "--prompt", help="the prompt text")
    s.add_argument("-f", "--file", help="read the prompt from a file ('-' for stdin); stdin is read when piped")
    s.add_argument("--chat", action="store_true",
                   help="the prompt is a user message: render it with the model's chat template first")
    s.add_argument("--system", metavar="TEXT", help="with --chat: the system prompt (default: the template's own)")
    s.add_argument("--template", metavar="FILE",
                   help="with --chat: a jinja2 chat template to use instead of the model's")
    s.add_argument("-n", "--n-predict", type=int, default=DEFAULT_N_PREDICT,
                   help="tokens to generate per sequence (default %(default)s)")
    options.add(s, "parallel", "n_ctx", "temperature", "top_k", "top_p", "min_p", "seed",
                defaults={"parallel": 1, "n_ctx": None},
                helps={"n_ctx": "KV cache cells " + options.CTX_DEFAULT_HELP})
    add_lib_flag(s)
    options.add(s, "n_threads", "type_k", "type_v", "flash_attn", "n_gpu_layers", "rpc", "validate", "context_shift",
                "n_keep", "trust_unverified", "spec", "spec_max", "draft_model")
    s.add_argument("--json", action="store_true", help="print the texts and the summary as JSON (no streaming)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", help="constrain the output to JSON valid against this JSON schema")
    g.add_argument("--grammar", metavar="FILE",
                   help="constrain the output to a grammar: GBNF (.gbnf), Lark (.lark) or a regex (.regex)")


@dataclass
class RunSpec:
    """What `run` does, independent of argparse (the demo builds one directly)."""

    model: str
    prompt: bytes
    params: object                 # SamplingParams, with its seed drawn (reported in the summary)
    n_predict: int = DEFAULT_N_PREDICT
    parallel: int = 1
    n_ctx: int | None = None       # None: limits.default_n_ctx (the default, or the model's n_ctx_train)
    n_threads: int | None = None
    type_k: str = _CACHE.type_k
    type_v: str = _CACHE.type_v
    flash_attn: bool | None = _CACHE.flash_attn
    lib: str | None = None
    json: bool = False
    chat: bool = False             # render the prompt (UTF-8) as one user message with the chat template
    system: str | None = None      # with chat: the system message
    template: str | None = None    # with chat: a template's source instead of the model's
    template_file: str | None = None
    rpc: list[str] | None = None   # --rpc: every layer on these rpc-server endpoints
    n_gpu_layers: int | None = None   # -ngl (None: pk.Model's default)
    validate: str | None = None    # --validate: how the GGUF is checked (None: the default)
    context_shift: bool = True     # --context-shift: go on past the end of the context
    n_keep: int | None = None      # --keep: tokens a context shift keeps (None: EngineConfig's)
    grammar: object = None         # --json-schema / --grammar: a pyllama_kv.sampling.grammar.Grammar
    trust_unverified: bool = False  # --trust-unverified: a hub file no hash vouches for is loaded
    spec: str = "none"             # --spec: speculative decoding's draft sources
    spec_max: int = 32             # --spec-max
    draft_model: str | None = None  # --draft-model: a MODEL whose greedy continuation is drafted


def read_prompt(prompt: str | None, file: str | None) -> bytes:
    """The prompt as bytes: tokenized as given, so a prompt that is not UTF-8 (in argv, a file or on
    stdin) is not an error. UsageError for both -p and -f, or neither (and no stdin piped)."""
    if prompt is not None and file is not None:
        raise UsageError("give the prompt with -p or -f, not both")
    if prompt is not None:
        return os.fsencode(prompt)  # the bytes of argv, undoing Python's surrogateescape
    stdin = getattr(sys.stdin, "buffer", None)
    if file is not None:
        if file == "-":
            if stdin is None:
                raise CLIError("-f -: there is no stdin to read the prompt from")
            return stdin.read()
        path = Path(file)
        if path.is_dir():
            raise CLIError(f"cannot read the prompt file: {path} is a directory")
        try:
            return path.read_bytes()
        except OSError as exc:
            raise CLIError(f"cannot read the prompt file: {exc}") from None
    if stdin is not None and not sys.stdin.isatty():
        return stdin.read()
    raise UsageError("no prompt: use -p TEXT, -f FILE, or pipe the prompt on stdin")


def run(args) -> int:
    import random

    setup_logging(args.debug)
    if not args.chat and (args.system is not None or args.template is not None):
        raise UsageError(f"{'--system' if args.system is not None else '--template'} needs --chat")
    positive("--parallel", args.parallel)
    positive("-n", args.n_predict, 0)
    positive("--ctx", args.n_ctx)
    positive("-t", args.n_threads)
    params = options.sampling(args, seed=random.randrange(2**31))
    template = read_template(args.template) if args.chat else None
    grammar = None
    if args.json_schema or args.grammar:
        from ...sampling.grammar import Grammar, GrammarError

        try:
            grammar = (Grammar.from_file(args.json_schema, "json_schema") if args.json_schema
                       else Grammar.from_file(args.grammar))
        except GrammarError as e:
            raise CLIError(str(e)) from None
    set_phase("reading the prompt")
    prompt = read_prompt(args.prompt, args.file)
    return generate(RunSpec(model=args.model, prompt=prompt, params=params, n_predict=args.n_predict,
                            parallel=args.parallel, n_ctx=args.n_ctx, n_threads=args.n_threads,
                            type_k=args.type_k, type_v=args.type_v, flash_attn=args.flash_attn, lib=args.lib,
                            json=args.json,
                            chat=args.chat, system=args.system, template=template, template_file=args.template,
                            rpc=args.rpc, n_gpu_layers=args.n_gpu_layers, validate=args.validate,
                            context_shift=args.context_shift,
                            n_keep=args.n_keep, grammar=grammar, trust_unverified=args.trust_unverified,
                            spec=args.spec, spec_max=args.spec_max, draft_model=args.draft_model))


def engine_config(spec: RunSpec, n_ctx: int):
    """The engine for one request of ``spec.parallel`` continuations: as many sequence ids, no prefix
    cache (nothing comes after), finished continuations not kept."""
    from ...config import EngineConfig

    n_batch = max(options.field_default(EngineConfig, "n_batch"), spec.parallel)
    return options.build(EngineConfig, n_ctx=n_ctx, parallel=spec.parallel, prefix_cache=0, n_batch=n_batch,
                         n_threads=spec.n_threads, type_k=spec.type_k, type_v=spec.type_v,
                         flash_attn=spec.flash_attn, max_queue=1,
                         max_tokens=max(1, spec.n_predict), keep_finished=False, context_shift=spec.context_shift,
                         spec=spec.spec, spec_max=spec.spec_max,
                         **({} if spec.n_keep is None else {"n_keep": spec.n_keep}))


def generate(spec: RunSpec) -> int:
    """Load the model, serve the request, print the outputs and the summary. Exit code 130 when
    Ctrl-C stopped it (after the summary of what was done)."""
    if spec.parallel > MAX_SEQUENCES:
        raise UsageError(f"--parallel must be at most {MAX_SEQUENCES}, got {spec.parallel}")
    set_phase("loading the model")  # Ctrl-C until the model is open: main() says so, in one line
    model = open_model(options.model_path(spec.model, spec.trust_unverified), spec.lib, spec.rpc, spec.validate,
                       spec.n_gpu_layers)
    draft = None
    try:
        set_phase("loading the draft model")
        draft = open_draft_model(model, spec.draft_model, spec.trust_unverified, spec.validate)
        n_ctx = context_size(model, spec.n_ctx)
        set_phase("tokenizing the prompt")
        if spec.chat:
            template = chat_template(model, spec.template, spec.template_file)
            toks = template.prompt(spec.prompt.decode("utf-8", "replace"), spec.system)
        else:
            toks = model.tokenize(spec.prompt)
        why = prompt_too_long(len(toks), n_ctx)
        if why is not None:
            raise CLIError(f"{why}: shorten it or give a larger --ctx")
        cfg = engine_config(spec, n_ctx)
        grammar = None
        if spec.grammar is not None:
            from ...sampling.grammar import GrammarError, compile_grammar

            try:
                grammar = compile_grammar(model, spec.grammar)   # type: ignore[arg-type]
            except GrammarError as e:
                raise CLIError(str(e)) from None
        set_phase("creating the context")
        from ...engine.oneshot import EngineSession

        try:   # hold: the summary reads the cache after the request
            session = EngineSession(model, cfg, hold=True, draft_model=draft)
        except InvalidInputError as exc:   # a draft model of another vocabulary
            raise CLIError(f"--draft-model: {exc}") from None
        return _serve(spec, model, session, toks, grammar)
    finally:
        if draft is not None:
            draft.close()
        model.close()


def _serve(spec: RunSpec, model, session, toks: list[int], grammar) -> int:
    """Submit, step the engine until the request is done, render its events; the summary also when
    Ctrl-C stops it (during the prompt or the generation): exit 130 then. Closes ``session``."""
    n = spec.parallel
    stream = Streamer(n, out=sys.stdout) if not spec.json else None
    ctx = session.ctx
    t_prompt = t_gen = 0.0
    t0 = t_gen0 = time.perf_counter()
    prompt_done = False

    def on_events(batch: list) -> None:
        nonlocal prompt_done, t_gen0, t_prompt
        if not prompt_done:   # the first tokens: the prompt is in
            prompt_done = True
            t_gen0 = time.perf_counter()
            t_prompt = t_gen0 - t0
            set_phase("generating")
        if stream is not None and spec.n_predict > 0:
            for ev in batch:
                stream.add(ev.index, ev.text)

    interrupted = None   # what Ctrl-C interrupted
    set_phase("evaluating the prompt")
    try:
        h = session.submit(toks, spec.params, max_tokens=max(1, spec.n_predict), n=n, keep=False,
                           grammar=grammar)
        try:
            session.run(h, on_events)
            t_gen = time.perf_counter() - t_gen0
        except KeyboardInterrupt:
            if prompt_done:
                interrupted = "generating"
                t_gen = time.perf_counter() - t_gen0
            else:
                interrupted = "evaluating the prompt"
                t_prompt = time.perf_counter() - t0
        set_phase("printing the summary")
        if stream is not None:
            stream.finish()
        st = ctx.kv_stats()
        n_threads = ctx.n_threads
        comps = h.completions   # before close(): that cancels what Ctrl-C left running
        counts = [min(len(c.tokens), spec.n_predict) for c in comps]
        texts = [c.text if spec.n_predict > 0 else "" for c in comps]
        stop = [c.finish_reason or "interrupted" for c in comps]
    finally:
        try:
            session.close()
        except Exception:
            if interrupted is None:   # after Ctrl-C mid-step, the summary matters more than the cleanup
                raise
    summary = _summary(spec, model, n_prompt=len(toks), n_threads=n_threads, prompt_done=prompt_done,
                       t_prompt=t_prompt, gen_total=sum(counts), t_gen=t_gen, usage=h.usage, interrupted=interrupted,
                       st=st)
    if spec.json:
        summary["outputs"] = [{"seq": i, "text": texts[i], "tokens": counts[i], "stop": stop[i]} for i in range(n)]
        print_json(summary)
    else:
        _print_summary(summary, st, stop)
    return EXIT_INTERRUPTED if interrupted else 0


def _summary(spec: RunSpec, model, *, n_prompt: int, n_threads: int, prompt_done: bool, t_prompt: float,
             gen_total: int, t_gen: float, usage, interrupted: str | None, st) -> dict:
    """The run's summary (printed, or the JSON document without its outputs)."""
    n = spec.parallel
    return {
        "model": str(spec.model),
        "library": model.library.get("variant"),
        "seed": getattr(spec.params, "seed", None),
        "parallel": n,
        "threads": n_threads,
        "prompt_tokens": n_prompt,
        "prompt_seconds": round(t_prompt, 4),
        "prompt_tokens_per_s": round(n_prompt / t_prompt, 1) if t_prompt > 0 and prompt_done else None,
        "generated_tokens": gen_total,
        "generation_seconds": round(t_gen, 4),
        "generation_tokens_per_s": round(gen_total / t_gen, 1) if t_gen > 0 else None,
        "reused_tokens": n_prompt * (n - 1) if prompt_done else 0,
        "context_shifts": usage.context_shifts,
        "dropped_tokens": usage.dropped_tokens,
        "spec": spec.spec,
        "draft_model": spec.draft_model,
        "draft_tokens": usage.draft_tokens,
        "draft_accepted": usage.draft_accepted,
        "interrupted": interrupted is not None,
        "interrupted_while": interrupted,
        "kv": st.as_dict(),
    }


def _print_summary(s: dict, st, stop: list[str]) -> None:
    n = s["parallel"]
    log("")
    if s["interrupted_while"] != "evaluating the prompt":
        log(f"prompt      {s['prompt_tokens']} tokens in {s['prompt_seconds'] * 1000:.1f} ms "
            f"({s['prompt_tokens_per_s']} tok/s), evaluated once and shared by {n} sequence(s): "
            f"{s['reused_tokens']} tokens reused")
    else:
        log(f"prompt      {s['prompt_tokens']} tokens: interrupted after {s['prompt_seconds'] * 1000:.1f} ms, "
            "before it was evaluated")
    log(f"generation  {s['generated_tokens']} tokens in {s['generation_seconds'] * 1000:.1f} ms "
        f"({s['generation_tokens_per_s']} tok/s), {n} sequence(s) per decode; stop: {', '.join(sorted(set(stop)))}"
        + (f"; {s['context_shifts']} context shifts dropped {s['dropped_tokens']} tokens"
           if s["context_shifts"] else ""))
    if s["spec"] != "none" or s["draft_model"]:
        d, a = s["draft_tokens"], s["draft_accepted"]
        src = ",".join(x for x in (s["spec"] if s["spec"] != "none" else "", s["draft_model"] and "draft model") if x)
        log(f"drafts      {src}: {d} drafted, {a} accepted" + (f" ({a / d:.0%})" if d else "")
            + f"; {a} decode steps saved")
    where = s["interrupted_while"]
    log(f"KV cache    {st.used_cells}/{st.n_cells} cells used, largest free block {st.largest_free_block}, "
        f"defrags {st.defrags if st.defrags is not None else 'n/a (vanilla)'}, seed {s['seed']}, "
        f"threads {s['threads']}" + (f"  [interrupted while {where}]" if where else ""))
