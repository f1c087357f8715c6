"""`pyllama-kv chat`: a multi-turn conversation with a model, served by the generation engine.

Every turn renders the whole conversation with the model's chat template (or ``--template FILE``)
and submits it to the engine with ``keep=True``. The engine keeps the finished turn (prompt and
answer) as a cached sequence and starts the next turn as a fork of it, so only the new messages are
evaluated. So that the next prompt really starts with the cached tokens, the conversation
(:class:`pyllama_kv.chat.conversation.Conversation`, whose docstring states the token-stability contract)
keeps the token ids it submitted and generated, and appends only the tokens of the newly rendered
text.

A conversation that outgrows the context goes on (``--context-shift``, on by default): a prompt that
does not fit is truncated by whole turns from the oldest (the system prompt stays: it is the
request's ``n_keep``), and an answer that reaches the end of the context shifts it (half of what
follows the system prompt is dropped). The conversation then keeps the tokens the engine kept, so
the next turn still starts from the cached cells. ``/stats`` counts what was dropped.
"""
from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from ...chat.conversation import Conversation
from ...errors import InvalidInputError
from .. import options
from ..common import (
    MODEL_HELP,
    CLIError,
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
from ..render import Streamer, log

DEFAULT_ANSWER_TOKENS = 512

COMMANDS_HELP = """\
/stats   turns, tokens evaluated, reused and dropped (this turn and in total), speed, KV cache cells
/reset   forget the conversation (its KV cells are freed); the system prompt stays
/help    this list
/exit    leave (so does Ctrl-D, or Ctrl-C twice at the prompt)
Ctrl-C during an answer stops it; the partial answer stays in the conversation."""


def register(subparsers) -> None:
    import argparse

    s = subparsers.add_parser(
        "chat", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Chat with a model, turn after turn. Each turn keeps the KV cells of the conversation so\n"
                    "far, so only the new message is evaluated (/stats shows the reused tokens). With stdin\n"
                    "not a terminal, every line is one user message and the answers are printed plainly (or\n"
                    "as JSON with --json), so a conversation can be scripted.",
        epilog="commands at the prompt (a line that starts with /):\n" + COMMANDS_HELP + "\n\n"
               "When the conversation no longer fits the context (--ctx), its oldest turns are dropped (the\n"
               "system prompt stays) and it goes on; /stats counts the dropped tokens. With --context-shift\n"
               "off the turn is refused instead: /reset starts a new one.")
    s.add_argument("model", help=MODEL_HELP)
    s.add_argument("--system", metavar="TEXT", help="the system prompt (default: the template's own, if any)")
    s.add_argument("--template", metavar="FILE",
                   help="a jinja2 chat template to use instead of the model's (rendered in the same sandbox); "
                        "needed when the model has none")
    s.add_argument("-n", "--n-predict", type=int, default=DEFAULT_ANSWER_TOKENS,
                   help="tokens per answer at most (default %(default)s)")
    options.add(s, "n_ctx", "temperature", "top_k", "top_p", "min_p", "seed", defaults={"n_ctx": None},
                helps={"n_ctx": "KV cache cells: the whole conversation must fit " + options.CTX_DEFAULT_HELP})
    add_lib_flag(s)
    options.add(s, "n_threads", "n_gpu_layers", "rpc", "validate", "cache_ram", "cache_dir", "cache_dir_mib",
                "trust_unverified")
    options.add(s, "spec", "spec_max", "draft_model")
    options.add(s, "context_shift", "n_keep", defaults={"n_keep": None},
                helps={"n_keep": "tokens at the start that truncation and context shifts never drop "
                                 "(default: the system prompt's)"})
    s.add_argument("--json", action="store_true",
                   help="print one JSON object per turn (answer, finish_reason, usage) instead of streaming")


# ---------------------------------------------------------------------------------------------
# the session: the conversation (pyllama_kv.chat.conversation) on an engine


class Session:
    """The engine (an EngineSession), the conversation, and what each turn cost."""

    def __init__(self, model, engine, conv: Conversation, params, n_predict: int, as_json: bool,
                 context_shift: bool = True, n_keep: int | None = None):
        self.model, self.engine, self.ctx = model, engine, engine.ctx
        self.conv = conv
        self.params = params
        self.n_predict = n_predict
        self.as_json = as_json
        self.context_shift = context_shift   # truncate prompts and shift answers instead of refusing
        self.n_keep = n_keep                 # None: the system prompt's tokens (the conversation's n_keep)
        self.turns = 0
        self.total = {"evaluated_tokens": 0, "reused_tokens": 0, "completion_tokens": 0, "dropped_tokens": 0,
                      "context_shifts": 0}
        self.last: dict | None = None
        self._handle = None
        self._stop = False

    def _on_sigint(self, signum, frame) -> None:
        self._stop = True
        if self._handle is not None:
            self._handle.cancel()

    def turn(self, user: str) -> dict:
        """One user message and the answer, streamed (or as one JSON object). Ctrl-C stops the
        answer; the partial answer stays in the conversation."""
        self._stop, self._handle = False, None
        old = signal.signal(signal.SIGINT, self._on_sigint)
        try:
            return self._turn(user)
        finally:
            signal.signal(signal.SIGINT, old)
            self._handle = None

    def _turn(self, user: str) -> dict:
        n_ctx = self.ctx.n_ctx
        msgs, text, toks = self.conv.next_prompt(user)
        if not self.context_shift and len(toks) + 1 >= n_ctx:
            msg = (f"the conversation no longer fits the context: the next prompt is {len(toks)} tokens, the "
                   f"context holds {n_ctx} (--ctx). /reset starts a new conversation")
            return self._report({"turn": self.turns + 1, "answer": "", "finish_reason": "context_full", "error": msg})
        if self._stop:   # Ctrl-C while rendering: nothing was submitted
            return self._report({"turn": self.turns + 1, "answer": "", "finish_reason": "interrupted"})
        stream = None if self.as_json else Streamer(1)
        t0 = time.perf_counter()
        t_first = None
        n_keep = self.n_keep if self.n_keep is not None else self.conv.n_keep
        h = self._handle = self.engine.submit(toks, self.params, max_tokens=self.n_predict, keep=True,
                                              context_shift=self.context_shift, truncate=self.context_shift,
                                              n_keep=n_keep, boundaries=self.conv.next_boundaries)
        if self._stop:
            h.cancel()

        def on_events(batch: list) -> None:
            nonlocal t_first
            if t_first is None:
                t_first = time.perf_counter()
            if stream is not None:
                for ev in batch:
                    stream.add(0, ev.text)

        self.engine.run(h, on_events)
        t_end = time.perf_counter()
        if stream is not None:
            stream.finish()
        c = h.completions[0]
        reason = "interrupted" if c.finish_reason == "cancelled" else c.finish_reason
        self.conv.answered(msgs, text, toks, c, cells_kept=reason in ("eos", "length", "stop"))
        self.turns += 1
        usage = h.usage
        evaluated = usage.prompt_tokens - usage.reused_tokens
        dropped = usage.truncated_tokens + usage.dropped_tokens
        for k, v in (("evaluated_tokens", evaluated), ("reused_tokens", usage.reused_tokens),
                     ("completion_tokens", usage.completion_tokens), ("dropped_tokens", dropped),
                     ("context_shifts", usage.context_shifts)):
            self.total[k] += v
        t_first = t_first or t_end
        res = {"turn": self.turns, "answer": c.text, "finish_reason": reason,
               "usage": {"prompt_tokens": usage.prompt_tokens, "reused_tokens": usage.reused_tokens,
                         "evaluated_tokens": evaluated, "completion_tokens": usage.completion_tokens,
                         "dropped_tokens": dropped, "truncated_tokens": usage.truncated_tokens,
                         "context_shifts": usage.context_shifts},
               "prompt_seconds": round(t_first - t0, 4), "generation_seconds": round(t_end - t_first, 4)}
        if c.error:
            res["error"] = c.error
        elif reason == "length" and not self.context_shift and len(toks) + usage.completion_tokens + 1 >= n_ctx:
            res["error"] = "the context is full: /reset starts a new conversation"
        self.last = res
        return self._report(res)

    def _report(self, res: dict) -> dict:
        if self.as_json:
            print(json.dumps(res, ensure_ascii=False), flush=True)
        elif res.get("error"):
            log(res["error"])
        elif res["finish_reason"] == "interrupted":
            log("[answer interrupted: the partial answer stays in the conversation]")
        return res

    def reset(self) -> None:
        self.conv.reset()
        self.engine.forget()   # the cached turns: every cell of the conversation is freed
        self.last = None

    def stats(self) -> dict:
        st = self.ctx.kv_stats()
        out: dict = {"turns": self.turns, "last_turn": None, "total": dict(self.total),
                     "kv": {"used_cells": st.used_cells, "free_cells": st.n_cells - st.used_cells,
                            "n_cells": st.n_cells},
                     "prefix_tier": self.engine.kv.tier_stats()}   # host and disk tiers (TierStats)
        if self.last is not None:
            u, ps, gs = self.last["usage"], self.last["prompt_seconds"], self.last["generation_seconds"]
            out["last_turn"] = dict(u, prompt_tokens_per_s=round(u["evaluated_tokens"] / ps, 1) if ps > 0 else None,
                                    generation_tokens_per_s=round(u["completion_tokens"] / gs, 1) if gs > 0 else None)
        return out

    def print_stats(self) -> None:
        s = self.stats()
        if self.as_json:
            print(json.dumps({"stats": s}), flush=True)
            return
        t, kv, last = s["total"], s["kv"], s["last_turn"]
        lines = [f"turns       {s['turns']}"]
        if last is not None:
            lines.append(f"last turn   prompt {last['prompt_tokens']} tokens: {last['evaluated_tokens']} evaluated, "
                         f"{last['reused_tokens']} reused from the cache; answer {last['completion_tokens']} tokens")
            lines.append(f"speed       prompt {last['prompt_tokens_per_s']} tok/s, "
                         f"generation {last['generation_tokens_per_s']} tok/s (last turn)")
        lines.append(f"total       {t['evaluated_tokens']} prompt tokens evaluated, {t['reused_tokens']} reused; "
                     f"{t['completion_tokens']} generated")
        shift = "on" if self.context_shift else "off"
        lines.append(f"context     {t['dropped_tokens']} tokens dropped to fit {kv['n_cells']} cells "
                     f"({t['context_shifts']} context shifts; --context-shift {shift})")
        lines.append(f"KV cache    {kv['used_cells']} of {kv['n_cells']} cells used, {kv['free_cells']} free")
        print("\n".join(lines), flush=True)


# ---------------------------------------------------------------------------------------------
# the command


def _read_line(tty: bool) -> str | None:
    """The next line typed or piped (None at EOF)."""
    if tty:
        try:
            return input("> ")
        except EOFError:
            print()
            return None
    raw = sys.stdin.buffer.readline()
    if not raw:
        return None
    return raw.decode("utf-8", "replace").rstrip("\r\n")


def run(args) -> int:
    import random

    setup_logging(args.debug)
    positive("-n", args.n_predict)
    positive("--ctx", args.n_ctx)
    positive("-t", args.n_threads)
    params = options.sampling(args, seed=random.randrange(2**31))
    source = read_template(args.template)
    set_phase("loading the model")
    model = open_model(options.model_path(args.model, args.trust_unverified), args.lib, args.rpc, args.validate,
                       args.n_gpu_layers)
    draft = None
    try:
        draft = open_draft_model(model, args.draft_model, args.trust_unverified, args.validate)
        n_ctx = context_size(model, args.n_ctx)
        template = chat_template(model, source, args.template)
        cfg = options.build(options.EngineConfig, n_ctx=n_ctx, parallel=1, prefix_cache=2, n_threads=args.n_threads,
                            max_queue=1, max_tokens=args.n_predict, keep_finished=True, cache_ram=args.cache_ram,
                            cache_dir=args.cache_dir, cache_dir_mib=args.cache_dir_mib,
                            context_shift=args.context_shift, truncate=args.context_shift, spec=args.spec,
                            spec_max=args.spec_max,
                            **({} if args.n_keep is None else {"n_keep": args.n_keep}))
        set_phase("creating the context")
        from ...engine.oneshot import EngineSession

        try:
            session = EngineSession(model, cfg, draft_model=draft)
        except InvalidInputError as exc:   # a draft model of another vocabulary
            raise CLIError(f"--draft-model: {exc}") from None
        with session as engine:
            return _session(args, model, engine, cfg, Conversation(template, args.system), params)
    finally:
        if draft is not None:
            draft.close()
        model.close()


def _session(args, model, engine, cfg, conv: Conversation, params) -> int:
    sess = Session(model, engine, conv, params, args.n_predict, args.json, context_shift=cfg.context_shift,
                   n_keep=args.n_keep)
    ctx = engine.ctx
    tty = sys.stdin.isatty()
    set_phase(None)
    if tty:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        log(f"chatting with {Path(model.path).name} ({ctx.n_ctx} cells of context). /help lists the commands, "
            "Ctrl-C stops an answer, Ctrl-D exits.")
    # Ctrl-C raises only while a line is read; one that lands between reads (while a command prints,
    # or while the first Ctrl-C is answered) is held and acted on before the next read, so that two
    # in a row always exit 0 and never escape the loop
    reading, held = [False], [0]

    def on_sigint(signum, frame) -> None:
        if reading[0]:
            raise KeyboardInterrupt
        held[0] += 1

    previous = signal.signal(signal.SIGINT, on_sigint)
    interrupted_once = False
    try:
        while True:
            try:
                if held[0]:
                    held[0] = 0
                    raise KeyboardInterrupt
                reading[0] = True
                try:
                    line = _read_line(tty)
                finally:
                    reading[0] = False
                if line is None:
                    return 0
                interrupted_once = False
                if not _do(sess, line):
                    return 0
            except KeyboardInterrupt:   # not during an answer: clears the line; twice in a row exits
                if interrupted_once:
                    if tty:
                        print()
                    return 0
                interrupted_once = True
                if tty:
                    print()
                log("(Ctrl-C again or Ctrl-D to exit)")
    finally:
        signal.signal(signal.SIGINT, previous)


def _do(sess: Session, line: str) -> bool:
    """Run one line: a command or a user message. False: exit."""
    from ...errors import InvalidInputError

    cmd = line.strip()
    if not cmd:
        return True
    if cmd.startswith("/"):
        word = cmd.split()[0].lower()
        if word in ("/exit", "/quit"):
            return False
        if word == "/stats":
            sess.print_stats()
        elif word == "/reset":
            sess.reset()
            log("the conversation is forgotten and its KV cells are freed")
        elif word == "/help":
            log(COMMANDS_HELP)
        else:
            log(f"unknown command {word}: /help lists the commands")
        return True
    try:
        sess.turn(line)
    except InvalidInputError as exc:   # e.g. the template refused this conversation: say why, go on
        log(f"error: {exc}")
    return True
