"""Output shared by the commands: log lines, JSON, sizes, streamed text, progress and tables.

Data goes to stdout (text, tables, JSON); everything about the run (progress, summaries of a
streamed run, errors) goes to stderr, so ``pyllama-kv run ... > out.txt`` keeps only the text.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Callable, TextIO


def log(msg: str = "") -> None:
    print(msg, file=sys.stderr, flush=True)


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def na(v) -> object:
    return "n/a" if v is None else v


def table(columns: Sequence[str], rows: Sequence[tuple[str, Sequence[object]]]) -> str:
    """A text table: a header of ``columns``, then one line per ``(label, cells)``, cells right-aligned."""
    cells = [[str(c) for c in row] for _, row in rows]
    w0 = max((len(label) for label, _ in rows), default=0) + 2
    ws = [max(len(n), *(len(c[j]) for c in cells)) + 3 for j, n in enumerate(columns)]
    lines = [" " * w0 + "".join(n.rjust(w) for n, w in zip(columns, ws))]
    for (label, _), row in zip(rows, cells):
        lines.append(label.ljust(w0) + "".join(c.rjust(w) for c, w in zip(row, ws)))
    return "\n".join(lines)


class Streamer:
    """Prints generated text as it comes: raw for one continuation, line-prefixed ``[i]`` for several.
    Takes the engine's text deltas (whole characters)."""

    def __init__(self, n: int, out: TextIO | None = None, width: int = 72):
        self.n = n
        self.out = out or sys.stdout
        self.width = width
        self.buf = [""] * n

    def add(self, i: int, text: str) -> None:
        if not text:
            return
        if self.n == 1:
            self.out.write(text)
            self.out.flush()
            return
        self.buf[i] += text
        while "\n" in self.buf[i] or len(self.buf[i]) >= self.width:
            if "\n" in self.buf[i][: self.width + 1]:
                line, self.buf[i] = self.buf[i].split("\n", 1)
            else:
                line, self.buf[i] = self.buf[i][: self.width], self.buf[i][self.width:]
            self.out.write(f"[{i}] {line}\n")
            self.out.flush()

    def finish(self) -> None:
        if self.n == 1:
            self.out.write("\n")
        else:
            for i in range(self.n):
                if self.buf[i]:
                    self.out.write(f"[{i}] {self.buf[i]}\n")
                self.buf[i] = ""
        self.out.flush()


class Progress:
    """A workload's progress on stderr: a bar redrawn in place on a terminal, a line per tenth otherwise."""

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
                log(f"  {self.label:<8} {step}/{total} steps, {tps:,.0f} tok/s, slot failures {res.slot_failures}")


def _defrag_time(d: dict) -> str:
    secs = d["kv"].get("defrag_seconds")
    if secs is None:
        return "n/a"
    return f"{secs * 1000:.1f} ms ({d['kv'].get('defrag_share', 0):.1%})"


_STRESS_ROWS: list[tuple[str, Callable[[dict], object]]] = [
    ("decode calls", lambda d: d["decode_calls"]),
    ("tokens (evaluated + gen)", lambda d: f"{d['evaluated_tokens']} + {d['gen_tokens']}"),
    ("tokens/s", lambda d: d["tokens_per_s"]),
    ("requests completed", lambda d: d["requests"]["completed"]),
    ("slot failures", lambda d: d["slot_failures"]),
    ("  free cells at failure", lambda d: f"{d['free_at_failures']:.0%}" if d["free_at_failures"] is not None else "-"),
    ("requests failed", lambda d: d["failed_requests"]),
    ("preempted (cache full)", lambda d: d["preempted"]),
    ("prefix tokens reused", lambda d: d["reused_tokens"]),
    ("slot retries", lambda d: na(d["kv"].get("slot_retries"))),
    ("defrags", lambda d: na(d["kv"].get("defrags"))),
    ("  block moves", lambda d: na(d["kv"].get("moves"))),
    ("  graphs", lambda d: na(d["kv"].get("graphs"))),
    ("  time in defrag", _defrag_time),
    ("peak fragmentation", lambda d: f"{d['peak_fragmentation']:.0%}"),
]


def stress_table(results: Sequence[tuple[str, dict]]) -> str:
    """The stress workload's results (StressResult.as_dict()), one column per library."""
    return table([name for name, _ in results], [(label, [fn(d) for _, d in results]) for label, fn in _STRESS_ROWS])
