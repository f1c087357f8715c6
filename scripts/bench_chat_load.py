#!/usr/bin/env python3
"""Many people chatting at once: `pyllama-kv serve` (host tier on and off, on our pin and on the current
llama.cpp) against llama-server at our pin and the *current* llama-server (``pyllama-kv build --peer``),
one after another in one run. Prints JSON.

The load (issue 24's): ``--conversations`` chats of ``--turns`` turns, each starting with its own
document of ~``--doc-words`` words under one shared system prompt, served round-robin: turn t of
every chat is sent (``--clients`` requests in flight), and a chat's next turn comes only after all the
others have had theirs, so each conversation returns after the others have filled the cache. A turn's
messages are the chat so far (the answers as the server gave them) plus a new question. Streaming,
temperature 0, ``--max-tokens`` per answer.

Every server gets the same KV cells (``--ctx``), slots (``--clients``) and threads, and flash
attention as ``--flash-attn`` says, the same for all; or, with ``--defaults``, no flash-attention flag
at all: each side at its own default (ours: auto, off on the CPU; the pin's llama-server: off; the
current llama-server: auto, which resolves it from the backend; what a server's log says it chose,
where it says so, is in its row, ``flash_attn_log``):
  * ``ours``         ``pyllama-kv serve --lib patched --cache-ram MiB`` (prefixes evicted from the KV
                     cache are paged out to host memory and restored, not evaluated);
  * ``ours-no-tier`` the same with ``--cache-ram 0`` (evicted prefixes are dropped);
  * ``pin``          llama-server from our pinned, patched build (``build --tools``): ``-np C`` fixed slots
                     of ctx/C cells, its per-slot prompt cache;
  * ``ours-current`` ``pyllama-kv serve --lib current --cache-ram MiB``: ours on the current llama.cpp
                     (``build/current-*``, with its series ``patches/current/``: the host tier too),
                     measured next to ``current``;
  * ``current``      llama-server of the newest llama.cpp on the package index, ``-kvu`` (one unified
                     cache of ctx cells) and ``--cache-ram MiB`` (evicted slots saved to host RAM).

Reported per server: wall time, completion tokens/s, TTFT p50/p95 over all turns and over the later
turns, prompt tokens sent / evaluated / served from cache (usage.prompt_tokens_details.cached_tokens,
or llama-server's timings.prompt_n), the server process's peak RSS (VmHWM) and its growth over the
load (from VmRSS after a warm-up request: what the caches took), our host tier's bytes at the end,
errors; then the ratios of ours to each llama-server and to ours-no-tier, of ours-current to the
current llama-server (the same llama.cpp on both sides) and of ours to ours-current (our pin's series
against the current llama.cpp, under the same server). Ratios are of runs made one after another
here, so only they compare; a run with request errors compares with nothing: its comparisons have
no ratio (listed under "ratios_refused", with the errors, on stderr too) and the exit status is 1.

    .venv/bin/python scripts/bench_chat_load.py [--quick] [--defaults]
                                                [--only ours,ours-no-tier,pin,ours-current,current]
                                                [--rounds N] ...
"""
from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_server import (  # noqa: E402
    PEOPLE,
    PLACES,
    REASONS,
    TIMES,
    VERBS,
    Server,
    free_port,
    llama_server_path,
    one_request,
    percentile,
    prompt_reused,
    pyllama_kv_cmd,
    run_load,
)

from pyllama_kv.config import default_threads  # noqa: E402
from pyllama_kv.harness.peer import build_peer, find_peer_server  # noqa: E402
from pyllama_kv.modelfile import catalogue  # noqa: E402
from pyllama_kv.tools.bench import machine  # noqa: E402

# ours-current runs just before current: the two sides of the same llama.cpp, back to back
SERVERS = ("ours", "ours-no-tier", "pin", "ours-current", "current")
DEFAULT_MODEL = "smollm2-135m-instruct"


def document(rng: random.Random, words: int) -> str:
    out: list[str] = []
    while len(out) < words:
        out += (f"{rng.choice(PEOPLE).capitalize()} {rng.choice(VERBS)} the {rng.choice(PLACES)} "
                f"{rng.choice(TIMES)}, {rng.choice(REASONS)}.").split()
    return " ".join(out[:words])


def follow_up(rng: random.Random, turn: int) -> str:
    return (f"Question {turn + 1}: according to the notes, who {rng.choice(VERBS)} the {rng.choice(PLACES)}, "
            f"and when?")


def server_cmd(name: str, model: Path, port: int, args) -> list[str]:
    """The command of server ``name``; with ``args.defaults`` no server gets a flash-attention flag."""
    common = ["-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", str(args.ctx),
              "-np", str(args.clients), "-t", str(args.threads), "-tb", str(args.threads),
              "-b", "512", "-ub", "512", "-ngl", "0", "--metrics", "--no-webui"]
    fa = None if args.defaults else args.flash_attn
    # --template: one chat template for every server (a model without one: llama-server would fall back
    # to ChatML on its own, ours refuses chats)
    tpl = ["--chat-template-file", args.template] if args.template else []
    if name == "pin":   # -fa is a switch at the pin
        return [str(llama_server_path()), *common, "-cb", *(["-fa"] if fa == "on" else []), *tpl]
    if name == "current":
        exe = find_peer_server()
        assert exe is not None
        return [str(exe), *common, "-kvu", "--cache-ram", str(args.cache_ram), *(["-fa", fa] if fa else []), *tpl]
    # ours-no-tier turns the tier off
    ram = 0 if name == "ours-no-tier" else args.cache_ram
    return [*pyllama_kv_cmd(), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--ctx", str(args.ctx), "--parallel", str(args.clients), "--threads", str(args.threads),
            "--batch", "512", "--lib", "current" if name == "ours-current" else "patched",
            "--cache-ram", str(ram), "--prefix-cache", str(args.prefix_cache), *(["--flash-attn", fa] if fa else []),
            *(["--template", args.template] if args.template else [])]


FA_LOG = re.compile(r"(flash.?attn|flash attention)\b.*?\b(enabled|disabled|on|off|auto)\b", re.IGNORECASE)


def flash_attn_log(log_path: Path) -> str | None:
    """The last line of a server's log that says what flash attention it runs with (llama.cpp's
    context log; the current pin's auto says what it resolved), or None when it says nothing."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    hits = [ln.strip() for ln in lines if FA_LOG.search(ln)]
    return hits[-1][:200] if hits else None


def rss_mib(pid: int, key: str = "VmHWM") -> float | None:
    """The process's peak (VmHWM) or current (VmRSS) resident memory, MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def run_server(name: str, model: Path, args, chats: list[list[dict]], log_dir: Path) -> dict:
    port = free_port()
    cmd = server_cmd(name, model, port, args)
    print(f"{name}: starting {' '.join(cmd)}", file=sys.stderr)
    srv = Server(name, cmd, port, log_dir)
    rng = random.Random(args.seed + 7)
    per_turn: list[list[dict]] = []
    t_wall = 0.0
    with srv:
        model_id = srv.model_id()
        with httpx.Client() as c:   # one tiny request first: no server's first-request setup counts
            one_request(c, srv.url, model_id, [{"role": "user", "content": "Hello"}], 1)
        rss_start = rss_mib(srv.proc.pid, "VmRSS") if srv.proc else None
        m0 = srv.metrics()
        histories = [list(m) for m in chats]
        for turn in range(args.turns):
            if turn:
                for h in histories:
                    h.append({"role": "user", "content": follow_up(rng, turn)})
            results, wall = run_load(srv.url, model_id, histories, args.clients, args.max_tokens,
                                     f"{name} turn {turn + 1}")
            t_wall += wall
            for h, r in zip(histories, results):
                h.append({"role": "assistant", "content": r["text"]})
            per_turn.append(results)
        rss = rss_mib(srv.proc.pid) if srv.proc else None
        m1 = srv.metrics()
        tier = {k: v for k, v in m1.items() if k.startswith("pyllama_kv_prefix_host_bytes")}
        # ours: where the engine's time went (its step, llama_decode, page-outs and restores of the tiers)
        secs = {k.removeprefix("pyllama_kv_").removesuffix("_total"): round(v - m0.get(k, 0.0), 2)
                for k, v in m1.items() if k.startswith("pyllama_kv_") and k.endswith("seconds_total")}
        log_tail = srv.log_tail(3)
    fa_log = flash_attn_log(srv.log_path)
    allr = [r for turn in per_turn for r in turn]
    ok = [r for r in allr if r["error"] is None]
    later = [r for turn in per_turn[1:] for r in turn if r["error"] is None]

    def p(xs: list[float], q: float) -> float | None:
        v = percentile(xs, q)
        return None if v is None else round(v, 3)

    prompt = sum(r["prompt_tokens"] or 0 for r in ok)
    cached, _ = prompt_reused(ok)
    completion = sum(r["completion_tokens"] if r["completion_tokens"] is not None else r["chunks"] for r in ok)
    return {
        "server": name, "requests": len(allr), "errors": len(allr) - len(ok),
        "error_samples": sorted({r["error"] for r in allr if r["error"]})[:3],
        "wall_s": round(t_wall, 1), "completion_tokens": completion,
        "completion_tps": round(completion / t_wall, 2) if t_wall else None,
        "ttft_p50_s": p([r["ttft"] for r in ok], 0.5), "ttft_p95_s": p([r["ttft"] for r in ok], 0.95),
        "later_ttft_p50_s": p([r["ttft"] for r in later], 0.5),
        "later_ttft_p95_s": p([r["ttft"] for r in later], 0.95),
        "prompt_tokens": prompt, "prompt_cached": cached,
        "prompt_evaluated": None if cached is None else prompt - cached,
        "peak_rss_mib": rss, "rss_after_warmup_mib": rss_start,
        "rss_growth_mib": None if rss is None or rss_start is None else round(rss - rss_start, 1),
        "tier_host_mib_end": round(next(iter(tier.values())) / 2**20, 1) if tier else None,
        "flash_attn_log": fa_log, "seconds": secs or None,
        # llama_decode calls over the load: ours' engine counter, or llama-server's n_decode_total
        "decode_calls": next((round(m1[k] - m0.get(k, 0.0)) for k in ("pyllama_kv_decode_calls_total",
                                                                     "llamacpp:n_decode_total") if k in m1), None),
        "log_tail": log_tail if len(allr) != len(ok) else None,
    }


# (ours, reference): what each ratio compares. ours-current/current is the same llama.cpp on both
# sides; ours/ours-current is our pin's series against the current llama.cpp, under the same server
PAIRS = (("ours", "pin"), ("ours", "current"), ("ours", "ours-no-tier"), ("ours-current", "current"),
         ("ours", "ours-current"))


def _failures(row: dict) -> str | None:
    """Why a run's figures compare with nothing (request errors, or it did not start); None if none."""
    if row.get("started") is False or row.get("errors"):
        return f"{row['server']} had {row.get('errors')} request errors: {row.get('error_samples')}"
    return None


def ratios(rows: list[dict]) -> tuple[dict, dict[str, list[str]]]:
    """The ratios of each pair of PAIRS, and the comparisons refused (name: why). A run with
    request errors compares with nothing: its figures are of fewer (or failed) requests than the
    other's, so a ratio would say something about the errors, not the servers."""
    by = {r["server"]: r for r in rows}
    out: dict = {}
    refused: dict[str, list[str]] = {}
    for ours, ref in PAIRS:
        a, b = by.get(ours), by.get(ref)
        if not a or not b:
            continue
        why = [w for w in (_failures(a), _failures(b)) if w]
        if why:
            refused[f"{ours}/{ref}"] = why
            continue
        if a.get("wall_s") and b.get("wall_s") and a.get("completion_tps") and b.get("completion_tps"):
            out[f"{ours}/{ref}"] = {
                "completion_tps": round(a["completion_tps"] / b["completion_tps"], 3),
                "later_ttft_p95": (round(a["later_ttft_p95_s"] / b["later_ttft_p95_s"], 3)
                                   if a.get("later_ttft_p95_s") and b.get("later_ttft_p95_s") else None),
                "wall": round(a["wall_s"] / b["wall_s"], 3),
            }
    return out, refused


def median_ratios(per_round: list[tuple[dict, dict[str, list[str]]]], out: dict) -> tuple[dict, dict[str, list[str]]]:
    """One round's ratios as they are; of several, each ratio's median over the rounds that have it (the
    rounds' own under ``out["ratios_by_round"]``), and every round's refusals."""
    if len(per_round) == 1:
        return per_round[0]
    out["ratios_by_round"] = [r for r, _ in per_round]
    refused: dict[str, list[str]] = {}
    for _, ref in per_round:
        for k, why in ref.items():
            refused.setdefault(k, []).extend(why)
    merged: dict = {}
    for pair in dict.fromkeys(k for r, _ in per_round for k in r):
        vals = [r[pair] for r, _ in per_round if pair in r]
        merged[pair] = {m: (round(statistics.median(v[m] for v in vals), 3)
                            if all(v.get(m) is not None for v in vals) else None) for m in vals[0]}
    return merged, refused


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"catalogue name or GGUF path (default {DEFAULT_MODEL})")
    ap.add_argument("--conversations", type=int, default=24, help="chats (default 24)")
    ap.add_argument("--turns", type=int, default=4, help="turns per chat (default 4)")
    ap.add_argument("--doc-words", type=int, default=250, help="words of each chat's own document (default 250)")
    ap.add_argument("--clients", type=int, default=4, help="requests in flight, and every server's slots (default 4)")
    ap.add_argument("--ctx", type=int, default=None,
                    help="KV cells of every server (default 4096; 512 with --quick, where the current "
                         "llama-server fails some requests: give it 1024)")
    ap.add_argument("--cache-ram", type=int, default=1024,
                    help="MiB of host memory for evicted prefixes, ours and current (default 1024)")
    ap.add_argument("--max-tokens", type=int, default=24, help="max_tokens of each answer (default 24)")
    ap.add_argument("--prefix-cache", type=int, default=4,
                    help="our servers' idle cached sequences kept in the KV cache (serve's default, 4)")
    ap.add_argument("-t", "--threads", type=int, default=default_threads(), help="CPU threads of every server")
    ap.add_argument("--flash-attn", choices=("on", "off"), default="off",
                    help="flash attention for every server (default off: the pin's default; the current "
                         "llama-server's own default is auto)")
    ap.add_argument("--defaults", action="store_true",
                    help="no flash-attention flag for any server: each at its own default (cells, slots, "
                         "threads, batch and --cache-ram stay the same for all: they define the load)")
    ap.add_argument("--only", default=",".join(SERVERS), help=f"servers, of {','.join(SERVERS)} (default all)")
    ap.add_argument("--template", metavar="FILE", help="a jinja2 chat template every server renders the chats with "
                    "(for a model without one; default: each model's own)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the servers this many times, the order reversed every other round (A B, B A, ...: "
                         "a server that goes first is not always the one that warms the machine); each ratio is "
                         "then the median of the rounds' (default 1)")
    ap.add_argument("--quick", action="store_true", help="a small load (a smoke run, not a measurement)")
    ap.add_argument("--json", action="store_true", help="compact JSON")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    if not only or any(s not in SERVERS for s in only):
        ap.error(f"--only takes a comma-separated list of {', '.join(SERVERS)}")
    if args.quick:
        args.conversations, args.turns, args.doc_words, args.max_tokens = 5, 2, 40, 4
        args.ctx = args.ctx or 512
    args.ctx = args.ctx or 4096
    if min(args.conversations, args.turns, args.doc_words, args.clients, args.ctx, args.max_tokens, args.rounds) < 1:
        ap.error("--conversations, --turns, --doc-words, --clients, --ctx, --max-tokens and --rounds must be >= 1")
    if "current" in only and find_peer_server() is None:
        print("current: the peer llama-server is not built; building it (`pyllama-kv build --peer`) ...",
              file=sys.stderr)
        build_peer(log=lambda m: print(m, file=sys.stderr))
    model_path = catalogue.resolve(args.model)
    rng = random.Random(args.seed)
    system = ("You are a careful assistant. Answer each question in one short sentence, using only the "
              "notes the user gives you.")
    chats = [[{"role": "system", "content": system},
              {"role": "user", "content": f"Notes:\n{document(rng, args.doc_words)}\n\n{follow_up(rng, 0)}"}]
             for _ in range(args.conversations)]
    out: dict = {
        "benchmark": "chat-load", "machine": machine(), "date": time.strftime("%Y-%m-%d"), "model": str(model_path),
        "settings": {**{k: getattr(args, k) for k in ("conversations", "turns", "doc_words", "clients", "ctx",
                                                      "cache_ram", "max_tokens", "threads", "seed")},
                     # "defaults": no flag given, each server chose (its row's flash_attn_log says what)
                     "flash_attn": "defaults" if args.defaults else args.flash_attn,
                     "host_tier": {n: n != "ours-no-tier" for n in only if n.startswith("ours")}},
        "peer": (lambda p: str(p) if p else None)(find_peer_server()),
        "rows": [],
    }
    rounds: list[list[dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            rounds.append([])
            for name in (only if r % 2 == 0 else only[::-1]):
                try:
                    row = run_server(name, model_path, args, chats, Path(tmp))
                except RuntimeError as exc:
                    row = {"server": name, "errors": args.conversations * args.turns, "started": False,
                           "error_samples": [str(exc)[:500]]}
                if args.rounds > 1:
                    row["round"] = r
                rounds[-1].append(row)
                out["rows"].append(row)
                print(f"{name}: {json.dumps({k: row.get(k) for k in ('wall_s', 'completion_tps', 'later_ttft_p95_s', 'prompt_evaluated', 'prompt_cached', 'peak_rss_mib', 'errors')})}",  # noqa: E501
                      file=sys.stderr)
    out["ratios"], refused = median_ratios([ratios(rows) for rows in rounds], out)
    if refused:
        out["ratios_refused"] = refused
    print(json.dumps(out, indent=None if args.json else 2))
    for name, why in refused.items():
        print(f"{name}: no ratio, {'; '.join(why)}", file=sys.stderr)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
