"""`pyllama-kv`: the command line.

Every subcommand has --help; data-producing ones have --json. Errors are one line on stderr and exit
code 1 (no traceback unless --debug; main() is the one place that maps exceptions to that line).
Ctrl-C exits 130, after the summary of what was done (run, stress, demo) or a line saying what it
interrupted; a closed stdout (`| head`) ends quietly with 141.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

EXIT_ERROR = 1
EXIT_USAGE = 2


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code EXIT_ERROR."""


# what the command is doing, for the line main() prints when Ctrl-C stops it there
_phase: str | None = None


def _set_phase(what: str | None) -> None:
    global _phase
    _phase = what


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


# ---------------------------------------------------------------------------------------------
# harness commands


def cmd_vendor(args) -> int:
    from ..harness import vendor

    if args.fingerprint:
        pin = vendor.Pin.load()
        tree = Path(args.fingerprint)
        if not (tree / "include" / "llama.h").is_file():
            raise CLIError(f"{tree} is not a llama.cpp tree (no include/llama.h)")
        fp = vendor.fingerprint(tree, pin.fingerprint_paths)
        if args.json:
            _print_json({"tree": str(tree), "paths": list(pin.fingerprint_paths), "sha256": fp,
                         "matches_pin": fp == pin.fingerprint_sha256})
        else:
            print(fp)
        return 0
    res = vendor.vendor(source=Path(args.source) if args.source else None, force=args.force, log=_log)
    if args.json:
        _print_json({"path": str(res.path), "revision": res.revision, "source": res.source,
                     "changed": res.changed, "files": res.files})
    return 0


def cmd_patch(args) -> int:
    from .. import _paths
    from ..harness import patch

    tree = Path(args.tree) if args.tree else _paths.vendor_dir()
    if args.status:
        st = patch.state(tree)
        rows = [{"name": p.name, "subject": p.subject(), "applied": a} for p, a in zip(st.patches, st.applied)]
        if args.json:
            _print_json({"tree": str(tree), "patches": rows, "conflict": st.conflict})
        else:
            for r in rows:
                print(f"{'applied ' if r['applied'] else 'pending '} {r['name']}  {r['subject']}")
            if st.conflict:
                print(f"conflict at {st.conflict}:\n{st.detail}")
        return 1 if st.conflict else 0
    if args.check:
        st = patch.check(tree)
        todo = [p.name for p in st.patches[st.n_applied:]]
        if args.json:
            _print_json({"tree": str(tree), "applied": [p.name for p in st.patches[:st.n_applied]], "would_apply": todo})
        else:
            print(f"{st.n_applied} applied; {len(todo)} would apply cleanly" + (f": {', '.join(todo)}" if todo else ""))
        return 0
    if args.reverse:
        names = patch.reverse(tree)
        verb = "reversed"
    else:
        names = patch.apply(tree)
        verb = "applied"
    if args.json:
        _print_json({"tree": str(tree), verb: names})
    elif names:
        for n in names:
            _log(f"{verb} {n}")
    else:
        _log(f"nothing to do: the series is {'not applied' if args.reverse else 'already applied'} in {tree}")
    return 0


def cmd_build(args) -> int:
    from ..harness import build

    m = build.build(
        variant="vanilla" if args.vanilla else "patched",
        backend=args.backend,
        tools=args.tools,
        cuda_arch=args.cuda_arch,
        jobs=args.jobs,
        force=args.force,
        extra_cmake=args.cmake_arg,
        log=_log,
    )
    if args.json:
        _print_json(m)
    else:
        print(m["lib"])
    return 0


def cmd_status(args) -> int:
    from ..harness import build

    st = build.status()
    if args.json:
        _print_json(st)
        return 0
    v = st["vendor"]
    print(f"llama.cpp revision  {st['revision']}  ({st['pin']['source']}, cached: {'yes' if st['pin']['cached'] else 'no'})")
    print(f"vendor tree         {v['path']}: {v['state']}")
    for p in st["patches"]:
        print(f"  {'[x]' if p['applied'] else '[ ]'} {p['name']}")
    if not st["builds"]:
        print("builds              none (run `pyllama-kv build`)")
    for b in st["builds"]:
        print(f"build {b['variant']}-{b['backend']:<6} {b['lib']}" + (f"  (stale: {b['stale']})" if b["stale"] else ""))
    return 0


# ---------------------------------------------------------------------------------------------
# model commands


def _setup_logging(debug: bool) -> None:
    if debug:
        import logging

        logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s", stream=sys.stderr)


def _open_model(path: str, lib: str | None):
    from .. import Model

    return Model(path, lib=lib)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def _positive(name: str, v: int | None, minimum: int = 1) -> None:
    if v is not None and v < minimum:
        raise CLIError(f"{name} must be at least {minimum}, got {v}")


def cmd_inspect(args) -> int:
    from ..tools.gguf import inspect_gguf

    _positive("--seqs", args.seqs)
    _positive("--ctx", args.ctx)
    if Path(args.model).is_dir():
        raise CLIError(f"{args.model} is a directory, not a GGUF file")
    info = inspect_gguf(args.model, n_ctx=args.ctx, n_seqs=args.seqs, type_k=args.type_k, type_v=args.type_v)
    if args.json:
        _print_json(info)
        return 0
    t = info["tensors"]
    print(f"file          {info['path']} ({_human_bytes(info['file_bytes'])}, GGUF v{info['gguf_version']})")
    print(f"architecture  {info['architecture']}" + (f"  ({info['name']})" if info.get("name") else ""))
    print(f"layers        {info['n_layer']}   n_embd {info['n_embd']}   heads {info['n_head']} (kv {info['n_head_kv']})"
          f"   n_ff {info['n_ff']}   n_ctx_train {info['n_ctx_train']}")
    types = ", ".join(f"{k} x{v}" for k, v in sorted(t["types"].items()))
    print(f"tensors       {t['count']} ({types}), {t['params']:,} parameters, {_human_bytes(t['bytes'])}")
    v = info["vocab"]
    print(f"vocabulary    {v['model']}, {v['size']} tokens (bos {v['bos']}, eos {v['eos']})")
    val = info.get("validation") or {}
    print(f"validation    {'ok' if val.get('ok') else 'refused: ' + str(val.get('error'))}")
    kv = info.get("kv_cache")
    if kv:
        print(f"KV cache      {_human_bytes(kv['bytes_per_token'])} per token "
              f"(K {kv['type_k']}: {_human_bytes(kv['bytes_per_token_k'])}, V {kv['type_v']}: {_human_bytes(kv['bytes_per_token_v'])})")
        print(f"              {_human_bytes(kv['bytes_total'])} for n_ctx {kv['n_ctx']} cells, shared by {kv['n_seqs']} "
              f"sequence(s): {kv['cells_per_seq']} cells each on average")
    return 0


def _check_output_file(out: str, what: str) -> Path:
    """``out`` as a file path to write, or CLIError: not a directory, and its directory must exist
    (nothing is created silently) and be writable."""
    path = Path(out)
    if not out:
        raise CLIError(f"an empty path: give the path of the file to write {what} to")
    if path.is_dir() or out.endswith(("/", os.sep)):
        raise CLIError(f"{out} is a directory: give the path of the file to write {what} to")
    parent = path.parent
    if not parent.exists():
        raise CLIError(f"cannot write {out}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise CLIError(f"cannot write {out}: {parent} is not a directory")
    try:  # really try (os.access says yes to root on a read-only file system)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise CLIError(f"cannot write {out}: {exc.strerror or exc}") from None
    return path


def cmd_tiny_model(args) -> int:
    from ..tools.gguf import inspect_gguf, make_tiny_model

    for name in ("layers", "embd", "heads", "kv_heads", "ff", "ctx_train"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    if args.embd % args.heads or args.heads % args.kv_heads:
        raise CLIError("--embd must be a multiple of --heads, and --heads a multiple of --kv-heads")
    if (args.embd // args.heads) % 2:
        raise CLIError("--embd / --heads (the head size) must be even: llama.cpp's rope needs pairs")
    path = _check_output_file(args.out, "the model")
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
        _print_json(info)
    else:
        print(f"wrote {path}: {info['n_layer']} layers, n_embd {info['n_embd']}, {info['vocab']['size']} tokens, "
              f"{_human_bytes(info['file_bytes'])}")
    return 0


class _Streamer:
    """Prints generated text as it comes: raw for one sequence, line-prefixed by sequence for several."""

    def __init__(self, n: int, out=None, width: int = 72):
        import codecs

        self.n = n
        self.out = out or sys.stdout
        self.width = width
        self.dec = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(n)]
        self.buf = [""] * n
        self.text = [""] * n

    def add(self, i: int, piece: bytes) -> None:
        s = self.dec[i].decode(piece)
        self.text[i] += s
        if self.n == 1:
            self.out.write(s)
            self.out.flush()
            return
        self.buf[i] += s
        while "\n" in self.buf[i] or len(self.buf[i]) >= self.width:
            if "\n" in self.buf[i][: self.width + 1]:
                line, self.buf[i] = self.buf[i].split("\n", 1)
            else:
                line, self.buf[i] = self.buf[i][: self.width], self.buf[i][self.width:]
            self.out.write(f"[{i}] {line}\n")
            self.out.flush()

    def finish(self) -> None:
        for i in range(self.n):
            tail = self.dec[i].decode(b"", final=True)
            self.text[i] += tail
            if self.n == 1:
                self.out.write(tail + "\n")
            else:
                self.buf[i] += tail
                if self.buf[i]:
                    self.out.write(f"[{i}] {self.buf[i]}\n")
                self.buf[i] = ""
        self.out.flush()


def _read_prompt(args) -> bytes:
    """The prompt as bytes: tokenized as given, so a prompt that is not UTF-8 (in argv, a file or on
    stdin) is not an error."""
    if args.prompt is not None and args.file is not None:
        raise CLIError("give the prompt with -p or -f, not both")
    if args.prompt is not None:
        return os.fsencode(args.prompt)  # the bytes of argv, undoing Python's surrogateescape
    stdin = getattr(sys.stdin, "buffer", None)
    if args.file is not None:
        if args.file == "-":
            if stdin is None:
                raise CLIError("-f -: there is no stdin to read the prompt from")
            return stdin.read()
        path = Path(args.file)
        if path.is_dir():
            raise CLIError(f"cannot read the prompt file: {path} is a directory")
        try:
            return path.read_bytes()
        except OSError as exc:
            raise CLIError(f"cannot read the prompt file: {exc}") from None
    if stdin is not None and not sys.stdin.isatty():
        return stdin.read()
    raise CLIError("no prompt: use -p TEXT, -f FILE, or pipe the prompt on stdin")


def cmd_run(args) -> int:
    import random

    _setup_logging(args.debug)
    _positive("--parallel", args.parallel)
    _positive("-n", args.n_predict, 0)
    _positive("--ctx", args.ctx)
    _positive("-t", args.threads)
    _set_phase("reading the prompt")
    prompt = _read_prompt(args)
    seed = args.seed if args.seed is not None and args.seed >= 0 else random.randrange(2**31)
    _set_phase("loading the model")  # Ctrl-C until the model is open: main() says so, in one line
    model = _open_model(args.model, args.lib)
    ctx = None
    try:
        if args.ctx and args.ctx > model.n_ctx_train:
            raise CLIError(f"--ctx {args.ctx} is larger than the model supports (n_ctx_train {model.n_ctx_train})")
        n_ctx = args.ctx or min(2048, model.n_ctx_train)
        _set_phase("tokenizing the prompt")
        toks = model.tokenize(prompt)
        if len(toks) >= n_ctx:
            raise CLIError(f"the prompt has {len(toks)} tokens, which does not fit in --ctx {n_ctx}")
        _set_phase("creating the context")
        ctx = model.context(n_ctx=n_ctx, n_seq_max=args.parallel, n_batch=max(512, args.parallel),
                            n_ubatch=512, n_threads=args.threads)
        return _generate(args, model, ctx, toks, seed)
    finally:
        if ctx is not None:
            ctx.close()
        model.close()


def _generate(args, model, ctx, toks: list[int], seed: int) -> int:
    """Evaluate the prompt, fork, decode; print the outputs and the summary of what was done, also
    when Ctrl-C stops it (during the prompt or the generation): exit 130 then."""
    import time

    from .. import Sampler
    from ..errors import KVCacheFullError

    N = args.parallel
    stream = _Streamer(N, out=sys.stdout) if not args.json else None
    texts = [b""] * N
    counts = [0] * N
    stop = ["length"] * N
    interrupted = None  # what Ctrl-C interrupted
    t_prompt = t_gen = 0.0
    where = "evaluating the prompt"
    _set_phase(where)
    t_prompt0 = t_gen0 = time.perf_counter()
    try:
        root = ctx.new_sequence()
        root.extend(toks)
        t_prompt = time.perf_counter() - t_prompt0
        seqs = [root] + [root.fork() for _ in range(N - 1)]
        samplers = [Sampler(ctx, temp=args.temp, top_k=args.top_k, top_p=args.top_p, seed=seed + i) for i in range(N)]
        nxt = [samplers[i].sample(root) for i in range(N)]
        live = list(range(N)) if args.n_predict > 0 else []
        where = "generating"
        _set_phase(where)
        t_gen0 = time.perf_counter()
        while live:
            batch = {}
            for i in list(live):
                t = nxt[i]
                if model.is_eog(t):
                    stop[i] = "eos"
                    live.remove(i)
                    continue
                piece = model.token_to_piece(t)
                texts[i] += piece
                counts[i] += 1
                if stream:
                    stream.add(i, piece)
                if counts[i] >= args.n_predict:
                    live.remove(i)
                    continue
                batch[seqs[i]] = [t]
            if not batch:
                break
            try:
                ctx.decode(batch)
            except KVCacheFullError:  # cache full: stop with what we have
                for i in live:
                    stop[i] = "cache full"
                break
            for i in live:
                nxt[i] = samplers[i].sample(seqs[i])
        t_gen = time.perf_counter() - t_gen0
    except KeyboardInterrupt:
        interrupted = where
        if where == "generating":
            t_gen = time.perf_counter() - t_gen0
            for i in live:
                stop[i] = "interrupted"
        else:
            t_prompt = time.perf_counter() - t_prompt0
            stop = ["interrupted"] * N
    _set_phase("printing the summary")
    if stream:
        stream.finish()
    st = ctx.kv_stats()
    gen_total = sum(counts)
    prompt_done = interrupted != "evaluating the prompt"
    summary = {
        "model": str(args.model),
        "library": model.library.get("variant"),
        "seed": seed,
        "parallel": N,
        "threads": ctx.n_threads,
        "prompt_tokens": len(toks),
        "prompt_seconds": round(t_prompt, 4),
        "prompt_tokens_per_s": round(len(toks) / t_prompt, 1) if t_prompt > 0 and prompt_done else None,
        "generated_tokens": gen_total,
        "generation_seconds": round(t_gen, 4),
        "generation_tokens_per_s": round(gen_total / t_gen, 1) if t_gen > 0 else None,
        "reused_tokens": len(toks) * (N - 1) if prompt_done else 0,
        "interrupted": interrupted is not None,
        "interrupted_while": interrupted,
        "kv": st.as_dict(),
    }
    if args.json:
        summary["outputs"] = [{"seq": i, "text": texts[i].decode("utf-8", "replace"), "tokens": counts[i], "stop": stop[i]}
                              for i in range(N)]
        _print_json(summary)
    else:
        _log("")
        if prompt_done:
            _log(f"prompt      {len(toks)} tokens in {t_prompt * 1000:.1f} ms ({summary['prompt_tokens_per_s']} tok/s), "
                 f"evaluated once and shared by {N} sequence(s): {summary['reused_tokens']} tokens reused")
        else:
            _log(f"prompt      {len(toks)} tokens: interrupted after {t_prompt * 1000:.1f} ms, before it was evaluated")
        _log(f"generation  {gen_total} tokens in {t_gen * 1000:.1f} ms ({summary['generation_tokens_per_s']} tok/s), "
             f"{N} sequence(s) per decode; stop: {', '.join(sorted(set(stop)))}")
        _log(f"KV cache    {st.used_cells}/{st.n_cells} cells used, largest free block {st.largest_free_block}, "
             f"defrags {st.defrags if st.defrags is not None else 'n/a (vanilla)'}, seed {seed}, threads {ctx.n_threads}"
             + (f"  [interrupted while {interrupted}]" if interrupted else ""))
    return 130 if interrupted else 0


def _stress_table(results: list[tuple[str, dict]]) -> str:
    rows = [
        ("decode calls", lambda d: d["decode_calls"]),
        ("tokens (prompt + gen)", lambda d: f"{d['prompt_tokens']} + {d['gen_tokens']}"),
        ("tokens/s", lambda d: d["tokens_per_s"]),
        ("requests completed", lambda d: d["requests"]["completed"]),
        ("slot failures", lambda d: d["slot_failures"]),
        ("  free cells at failure", lambda d: f"{d['free_at_failures']:.0%}" if d["free_at_failures"] is not None else "-"),
        ("requests failed", lambda d: d["failed_requests"]),
        ("preempted (cache full)", lambda d: d["preempted"]),
        ("prefix tokens reused", lambda d: d["reused_tokens"]),
        ("slot retries", lambda d: _na(d["kv"].get("slot_retries"))),
        ("defrags", lambda d: _na(d["kv"].get("defrags"))),
        ("  block moves", lambda d: _na(d["kv"].get("moves"))),
        ("  graphs", lambda d: _na(d["kv"].get("graphs"))),
        ("  time in defrag", lambda d: f"{d['kv']['defrag_seconds'] * 1000:.1f} ms ({d['kv'].get('defrag_share', 0):.1%})"
         if d["kv"].get("defrag_seconds") is not None else "n/a"),
        ("peak fragmentation", lambda d: f"{d['peak_fragmentation']:.0%}"),
    ]
    names = [n for n, _ in results]
    cells = [[str(fn(d)) for _, d in results] for _, fn in rows]
    w0 = max(len(r[0]) for r in rows) + 2
    ws = [max(len(n), *(len(c[j]) for c in cells)) + 3 for j, n in enumerate(names)]
    lines = [" " * w0 + "".join(n.rjust(w) for n, w in zip(names, ws))]
    for (label, _), row in zip(rows, cells):
        lines.append(label.ljust(w0) + "".join(c.rjust(w) for c, w in zip(row, ws)))
    return "\n".join(lines)


def _na(v):
    return "n/a" if v is None else v


class _Progress:
    def __init__(self, label: str, enabled: bool = True):
        self.label = label
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last = -1

    def __call__(self, step: int, total: int, res) -> None:
        if not self.enabled:
            return
        frac = step / max(total, 1)
        tps = res.tokens / res.seconds if res.seconds > 0 else 0.0
        if self.tty:
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r  {self.label:<8} [{bar:<30}] {step}/{total} steps  {tps:,.0f} tok/s  "
                             f"slot failures {res.slot_failures}   ")
            if step == total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        else:
            tenth = int(frac * 10)
            if tenth != self.last:
                self.last = tenth
                _log(f"  {self.label:<8} {step}/{total} steps, {tps:,.0f} tok/s, slot failures {res.slot_failures}")


def _check_map_path(out: str) -> Path:
    """The file ``--map`` will write, checked before the workload runs: matplotlib is there, the
    format is one it writes (no suffix: .png is added, as matplotlib would), and the file can be
    written. CLIError otherwise."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise CLIError("--map needs matplotlib: pip install 'pyllama-kv[map]' (or pip install matplotlib)") from None
    path = Path(out)
    if out and not out.endswith(("/", os.sep)) and not path.is_dir() and not path.suffix:
        path = path.with_name(path.name + ".png")
    formats = Figure().canvas.get_supported_filetypes()
    if path.suffix and path.suffix[1:].lower() not in formats:
        raise CLIError(f"--map {out}: matplotlib cannot write {path.suffix} files; use .png "
                       f"(or one of {', '.join('.' + f for f in sorted(formats))})")
    return _check_output_file(str(path) if path != Path(out) else out, "the map")


def _stress_once(model_path: str, lib: str, cfg, label: str, progress: bool):
    """Run the workload once; return the result dict and the occupancy map (when cfg.record_map)."""
    from ..tools.workload import run_stress

    _set_phase(f"loading the model ({label})")
    model = _open_model(model_path, lib)
    try:
        if cfg.n_ctx > model.n_ctx_train:
            raise CLIError(f"--ctx {cfg.n_ctx} is larger than the model supports (n_ctx_train {model.n_ctx_train})")
        _set_phase(f"starting the workload ({label})")  # run_stress itself stops cleanly on Ctrl-C
        res, occ = run_stress(model, cfg, progress=_Progress(label, progress))
    finally:
        model.close()
    return res.as_dict(), occ


def _stress_config(args):
    from ..tools.workload import StressConfig

    _positive("--seqs", args.seqs)
    _positive("--ctx", args.ctx)
    _positive("--steps", args.steps)
    _positive("-t", args.threads)
    return StressConfig(n_seqs=args.seqs, n_ctx=args.ctx, steps=args.steps, seed=args.seed,
                        sequential=args.sequential, n_threads=args.threads)


def cmd_stress(args) -> int:
    from ..tools.workload import draw_map

    _setup_logging(args.debug)
    cfg = _stress_config(args)
    map_path = _check_map_path(args.map) if args.map is not None else None  # before the workload, not after
    cfg.record_map = map_path is not None
    label = args.lib if args.lib in ("patched", "vanilla") else Path(args.lib).name
    d, occ = _stress_once(args.model, args.lib, cfg, label, progress=not args.json)
    rc = 130 if d.get("interrupted") else 0
    if not args.json:  # the results first: a failure to draw the map must not lose them
        print(_stress_table([(label, d)]), flush=True)
    map_error = None
    if map_path is not None:
        _set_phase("drawing the map")
        try:
            if occ is None:
                raise CLIError("no step ran, so there is no map to draw")
            written = draw_map(occ, map_path, title=f"KV cache occupancy, {label} ({d['steps']} steps, seed {cfg.seed}); "
                                                    "white: free, dark grey: shared prefix")
            d["map"] = str(written)
        except KeyboardInterrupt:
            map_error, rc = "interrupted while drawing the map", 130
        except Exception as exc:
            if args.debug:
                raise
            map_error, rc = f"could not write the map {map_path}: {' '.join(str(exc).split())}", EXIT_ERROR
        if map_error:
            d["map_error"] = map_error
    if args.json:
        _print_json(d)
    elif "map" in d:
        print(f"map: {d['map']}")
    if map_error:
        _log(f"pyllama-kv stress: error: {map_error}")
    return rc


def cmd_demo(args) -> int:
    import dataclasses

    from .. import _paths
    from ..tools.gguf import make_tiny_model

    _setup_logging(args.debug)
    mdir = _paths.cache_dir() / "models"
    mpath = mdir / "tiny-demo-2l-64.gguf"
    if not mpath.is_file():
        _log(f"making the built-in tiny model at {mpath} ...")
        make_tiny_model(mpath, n_layer=2, n_embd=64, seed=0)
    steps = 120 if args.quick else 300
    cfg = _stress_config(argparse.Namespace(seqs=8, ctx=2048, steps=steps, seed=args.seed, sequential=False,
                                            threads=args.threads))
    print(f"pyllama-kv demo: a server-like workload ({cfg.n_seqs} requests at once, {cfg.n_ctx} KV cells, "
          f"{cfg.steps} steps, seed {cfg.seed}) on the vanilla and the patched llama.cpp\n")
    results = []
    for lib in ("vanilla", "patched"):
        try:
            d, _ = _stress_once(str(mpath), lib, dataclasses.replace(cfg), lib, progress=not args.json)
        except KeyboardInterrupt:
            if not results or args.json:
                raise  # main() says what was interrupted
            print()
            print(_stress_table(results))
            _log(f"pyllama-kv demo: interrupted while {_phase}")
            return 130
        results.append((lib, d))
        if d.get("interrupted"):  # Ctrl-C: show what ran, and stop there
            break
    if args.json:
        _print_json({"model": str(mpath), "stress": {k: v for k, v in results}})
        return 130 if results[-1][1].get("interrupted") else 0
    if results[-1][1].get("interrupted"):
        print()
        print(_stress_table(results))
        _log(f"pyllama-kv demo: interrupted during the {results[-1][0]} workload")
        return 130
    van, pat = results[0][1], results[1][1]
    print()
    print(_stress_table(results))
    print()
    if van["slot_failures"]:
        print(f"vanilla: {van['slot_failures']} batches refused (\"failed to find KV cache slot\") with on average "
              f"{van['free_at_failures']:.0%} of the cache free; {van['failed_requests']} requests failed.")
    print(f"patched: {pat['slot_failures']} refused; {pat['kv'].get('slot_retries')} slot searches recovered by a full "
          f"defrag ({pat['kv'].get('moves')} block moves, {pat['kv'].get('defrag_share', 0):.1%} of the run); "
          f"{pat['tokens']} tokens processed vs {van['tokens']}.")
    print("\nNow 4 continuations of one prompt: evaluated once, forked 3 times, decoded together:\n")
    run_argv = ["run", str(mpath), "-p", "The KV cache of the model", "-n", "24", "--parallel", "4",
                "--seed", str(args.seed)]
    if args.threads is not None:
        run_argv += ["--threads", str(args.threads)]
    run_args = build_parser().parse_args(run_argv)
    run_args.debug = args.debug
    return cmd_run(run_args)


# ---------------------------------------------------------------------------------------------
# parser


def _version_text() -> str:
    from .. import __version__

    try:
        from ..harness.vendor import Pin

        rev = Pin.load().revision[:12]
    except Exception:  # no checkout around: the package alone
        rev = "?"
    return f"pyllama-kv {__version__} (llama.cpp {rev} + our KV-cache patches)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pyllama-kv",
        description="Run GGUF models with many sequences at once over a patched llama.cpp KV cache.",
        epilog="Run `pyllama-kv COMMAND --help` for each command's options.",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks and llama.cpp's log")
    p.add_argument("--version", action="version", version=_version_text())
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks and llama.cpp's log")
    _add = sub.add_parser

    def add_parser(name, **kw):
        return _add(name, parents=[common], **kw)

    sub.add_parser = add_parser  # type: ignore[method-assign]

    s = sub.add_parser("vendor", help="fetch the pinned llama.cpp into vendor/llama.cpp (cached download)",
                       description="Fetch the pinned llama.cpp source (the llama-cpp-python sdist from PyPI, "
                                   "sha256-checked, cached in ~/.cache/pyllama-kv) into vendor/llama.cpp.")
    s.add_argument("--source", metavar="PATH", help="use an existing llama.cpp checkout or tarball at the pinned revision")
    s.add_argument("--force", action="store_true", help="replace vendor/llama.cpp even if it already holds the pin")
    s.add_argument("--fingerprint", metavar="DIR", help="print the fingerprint of an unpatched llama.cpp tree (for a new pin)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_vendor)

    s = sub.add_parser("patch", help="apply our KV-cache patch series to vendor/llama.cpp",
                       description="Apply patches/*.patch in order (idempotent). A patch that does not apply "
                                   "fails with its name and hunk, and the tree is left unchanged.")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="only check that the rest of the series would apply")
    g.add_argument("--status", action="store_true", help="list which patches are applied")
    g.add_argument("--reverse", action="store_true", help="reverse the applied patches")
    s.add_argument("--tree", metavar="DIR", help="llama.cpp tree to work on (default: vendor/llama.cpp)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_patch)

    s = sub.add_parser("build", help="build libllama (patched by default, or --vanilla)",
                       description="Build libllama with CMake into build/<variant>-<backend>/ (reused when up to date).")
    s.add_argument("--vanilla", action="store_true", help="build the same revision without our patches")
    s.add_argument("--backend", choices=["cpu", "cuda", "metal"], default=None,
                   help="compute backend (default: metal on macOS, cpu elsewhere)")
    s.add_argument("--cuda-arch", metavar="ARCHS", help="CMAKE_CUDA_ARCHITECTURES for --backend cuda (default: native)")
    s.add_argument("--tools", action="store_true", help="also build llama.cpp's llama-batched-bench (for benchmarks)")
    s.add_argument("-j", "--jobs", type=int, help="parallel compile jobs (default: all cores)")
    s.add_argument("--force", action="store_true", help="rebuild even if up to date")
    s.add_argument("--cmake-arg", action="append", metavar="-DX=Y", help="extra CMake argument (repeatable)")
    s.add_argument("--json", action="store_true", help="print the build manifest as JSON")
    s.set_defaults(func=cmd_build)

    s = sub.add_parser("status", help="pinned revision, vendor tree, patches and builds",
                       description="Show the pinned revision, the vendor tree's state, which patches are "
                                   "applied, and each build with its library path.")
    s.add_argument("--json", action="store_true", help="print as JSON")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("run", help="generate N continuations of a prompt at once (prefix copy + batched decode)",
                       description="Evaluate the prompt once, fork it into N sequences (prefix copies: no recompute), "
                                   "then decode all sequences together, one batch per step. Streams the text "
                                   "(prefixed by sequence for N>1) and ends with a summary.")
    s.add_argument("model", help="GGUF model file")
    s.add_argument("-p", "--prompt", help="the prompt text")
    s.add_argument("-f", "--file", help="read the prompt from a file ('-' for stdin); stdin is read when piped")
    s.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate per sequence (default 64)")
    s.add_argument("--parallel", type=int, default=1, metavar="N", help="continuations generated at once (default 1)")
    s.add_argument("--ctx", type=int, help="KV cache cells (default: min(2048, the model's n_ctx_train))")
    s.add_argument("--temp", type=float, default=0.8, help="temperature; <= 0 is greedy (default 0.8)")
    s.add_argument("--top-k", type=int, default=40, help="top-k sampling, 0 disables (default 40)")
    s.add_argument("--top-p", type=float, default=0.95, help="top-p sampling (default 0.95)")
    s.add_argument("--seed", type=int, default=-1, help="sampling seed; sequence i uses seed+i (default: random)")
    s.add_argument("--lib", default=None, metavar="patched|vanilla|PATH", help="libllama to use (default: patched)")
    s.add_argument("-t", "--threads", type=int, help="CPU threads (default: llama.cpp's choice)")
    s.add_argument("--json", action="store_true", help="print the texts and the summary as JSON (no streaming)")
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("inspect", help="architecture, sizes, tensors, vocabulary and KV cache cost of a GGUF file",
                       description="Read a GGUF file's header with the gguf package (weights are not loaded) and "
                                   "report its architecture, sizes, tensors, vocabulary, and the KV cache bytes per "
                                   "token and in total for a context.")
    s.add_argument("model", help="GGUF model file")
    s.add_argument("--ctx", type=int, help="context cells for the KV total (default: n_ctx_train)")
    s.add_argument("--seqs", type=int, default=1, help="sequences sharing the cache (default 1)")
    s.add_argument("--type-k", default="f16", help="K cache type (default f16)")
    s.add_argument("--type-v", default="f16", help="V cache type (default f16)")
    s.add_argument("--json", action="store_true", help="print as JSON")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("tiny-model", help="write the random-weight tiny llama model the tests use",
                       description="Write a random-weight llama GGUF with an SPM vocabulary (with the 256 byte "
                                   "tokens, any text tokenizes). For tests, demos and benchmarks; it says nothing.")
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
    s.set_defaults(func=cmd_tiny_model)

    s = sub.add_parser("stress", help="a seeded server-like workload that fragments the cache; failures, defrags, speed",
                       description="Requests arrive with prompts of random length (some sharing a prefix, served by "
                                   "fork), generate a random number of tokens and leave, so the cache fragments. "
                                   "Reports decode calls, tokens/s, slot failures (batches refused although enough "
                                   "cells were free), defrags, moves, graphs, retries and peak fragmentation.")
    s.add_argument("model", help="GGUF model file")
    s.add_argument("--lib", default="patched", metavar="patched|vanilla|PATH", help="libllama to use (default: patched)")
    s.add_argument("--seqs", type=int, default=8, help="requests served at once (default 8)")
    s.add_argument("--ctx", type=int, default=2048, help="KV cache cells (default 2048)")
    s.add_argument("--steps", type=int, default=300, help="decode steps (default 300)")
    s.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    s.add_argument("--sequential", action="store_true", help="serve the same requests one after another (no fragmentation)")
    s.add_argument("--map", metavar="FILE.png", help="draw the cache occupancy over time into this image (needs "
                                                     "matplotlib; .png is added to a name without a suffix; "
                                                     "checked before the workload runs)")
    s.add_argument("-t", "--threads", type=int, help="CPU threads (default: llama.cpp's choice)")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=cmd_stress)

    s = sub.add_parser("demo", help="the main job on the built-in tiny model: vanilla vs patched under stress, then run",
                       description="Make the tiny model in ~/.cache/pyllama-kv/models, run `stress` on the vanilla "
                                   "and the patched build side by side, print the comparison, then a short "
                                   "`run --parallel 4`.")
    s.add_argument("--seed", type=int, default=0, help="workload and sampling seed (default 0)")
    s.add_argument("--quick", action="store_true", help="a shorter workload")
    s.add_argument("-t", "--threads", type=int, help="CPU threads (default: llama.cpp's choice)")
    s.add_argument("--json", action="store_true", help="print the stress results as JSON")
    s.set_defaults(func=cmd_demo)

    return p


def _error_types() -> tuple[type, ...]:
    """The exceptions that are a user's error, not a bug: every error class of pyllama_kv, and OSError
    and ValueError (a file that cannot be read or written, a value out of range)."""
    try:
        from ..harness.build import BuildError
        from ..errors import LlamaError
        from ..tools.gguf import GGUFFileError
        from ..harness.patch import PatchError
        from ..harness.vendor import VendorError
    except ImportError:  # pragma: no cover - a broken installation: report what we can
        return (CLIError, OSError, ValueError)
    return (CLIError, VendorError, PatchError, BuildError, LlamaError, GGUFFileError, OSError, ValueError)


def _report_error(command: str | None, exc: Exception) -> int:
    """The one place an exception becomes the CLI's output: one line on stderr (a patch or build
    failure adds its detail), exit code EXIT_ERROR. An exception outside pyllama_kv's errors is a bug:
    it is named as an internal error, still in one line; --debug shows its traceback."""
    msg = str(exc).strip()
    first, _, rest = msg.partition("\n")
    detailed = tuple(t for t in _error_types() if t.__name__ in ("PatchError", "BuildError"))
    if not isinstance(exc, _error_types()):
        first = f"internal error: {type(exc).__name__}" + (f": {first}" if first else "") + \
            " (run with --debug for the traceback)"
    _log(f"pyllama-kv {command}: error: {first or type(exc).__name__}")
    if rest and detailed and isinstance(exc, detailed):
        _log(rest)
    return EXIT_ERROR


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "debug"):
        args.debug = False
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    _set_phase(None)
    try:  # paths given as non-UTF-8 bytes are printed back as those bytes, not a UnicodeEncodeError
        sys.stdout.reconfigure(errors="surrogateescape")  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):  # not a text stream of ours (tests, pipes replaced)
        pass
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        _log(f"pyllama-kv {args.command}: interrupted" + (f" while {_phase}" if _phase else ""))
        return 130
    except BrokenPipeError:  # `pyllama-kv ... | head`: the reader has gone; end quietly, as cat does
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # so that the exit-time flush does not fail again
        except (OSError, ValueError, AttributeError):
            pass
        return 128 + 13  # SIGPIPE
    except Exception as exc:
        if args.debug:
            raise
        return _report_error(args.command, exc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
