"""Chat templates render in worker processes, so that no template can block the calling process.

A worker is ``python -I -c ...`` running :func:`main`: it imports jinja2 and the sandbox
(pyllama_kv.chat.sandbox), limits its own address space (``RLIMIT_AS`` = ``memory_limit``),
then answers one request at a time on its stdin/stdout (a 4-byte big-endian length, then JSON; JSON
and never pickle, so a worker can send nothing but data). The calling side (:func:`render`) waits for
the answer with ``poll`` and a deadline: past ``time_limit`` it kills the worker (SIGKILL: a big-integer
operation holding the worker's GIL cannot delay it) and the rendering is refused. Whatever a template
does, the caller waits at most ``time_limit`` for it, and a worker never holds more than
``memory_limit`` bytes of address space.

Workers are reused (a pool of at most ``workers``, started on demand; a killed one is replaced on the
next rendering), start in their own session (a terminal's Ctrl-C is not theirs), are killed at exit,
and outlive a parent that dies by at most one rendering: an idle worker reads EOF and exits, a busy
one has a CPU-time limit per rendering (``RLIMIT_CPU``, ``time_limit`` + 2 s: SIGXCPU kills it).
(Not PR_SET_PDEATHSIG: it fires when the *thread* that started the worker ends, and a server starts
them from pool threads that come and go.)

The same workers run a grammar's first compilation (:func:`grammar_job`, pyllama_kv.sampling.grammar_check), in
a pool of their own with their own memory limit: llguidance can overflow its native stack on a
hostile grammar, and llama.cpp's GBNF is translated by pure Python that holds the GIL. A grammar job
can also be cancelled (its client left): the worker is killed within 50 ms.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from .chat.sandbox import TemplateFailure, TemplateLimits

_HEADER = struct.Struct(">I")
MAX_MESSAGE = 1 << 30          # bytes of one JSON message
START_TIMEOUT = 60.0           # seconds for a worker to start (import jinja2), on a loaded machine


class WorkerError(RuntimeError):
    """A worker could not be started (not the template's fault)."""


class _Died(Exception):
    pass


# -- framing ---------------------------------------------------------------------------------------------

def _write(fd: int, obj: Any) -> None:
    data = json.dumps(obj).encode("ascii")   # ensure_ascii: lone surrogates travel as \\udxxx escapes
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


class Cancelled(Exception):
    """The caller gave up on a job (its client left): the worker was killed."""


def _read_exact(fd: int, n: int, deadline: float | None, cancel: threading.Event | None = None) -> bytes:
    chunks, got = [], 0
    poller = None
    if deadline is not None:
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while got < n:
        if poller is not None and deadline is not None:
            left = deadline - time.monotonic()
            wait = left if cancel is None else min(left, 0.05)   # a cancel is seen within 50 ms
            if left <= 0 or not poller.poll(max(1, int(wait * 1000 + 0.999))):
                if time.monotonic() >= deadline:
                    raise TimeoutError
                if cancel is not None and cancel.is_set():
                    raise Cancelled
                continue
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            raise _Died
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _read(fd: int, deadline: float | None, cancel: threading.Event | None = None) -> Any:
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline, cancel))
    if n > MAX_MESSAGE:
        raise _Died
    return json.loads(_read_exact(fd, n, deadline, cancel))


# -- the worker process ------------------------------------------------------------------------------------

def main(argv: list[str]) -> None:
    """The worker: ``argv`` is [memory_limit]."""
    import resource

    memory_limit = int(argv[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fin, fout = 0, os.dup(1)
    os.dup2(2, 1)                      # nothing but answers on the answer pipe
    from .chat import sandbox as sandbox

    sandbox.prepare()                  # jinja2 imported and the environment built before the limit
    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    except (ValueError, OSError):
        pass
    _write(fout, {"ready": os.getpid()})
    while True:
        try:
            req = _read(fin, None)
        except _Died:
            return
        if req.get("job") == "grammar":    # a grammar's first compilation (pyllama_kv.sampling.grammar_check)
            resp = _grammar_job(req, resource, memory_limit)
        else:
            resp = _render_job(req, sandbox, resource, memory_limit)
        del req
        try:
            _write(fout, resp)
        except MemoryError:
            os._exit(3)


def _render_job(req: dict, sandbox, resource, memory_limit: int) -> dict:
    try:
        limits = TemplateLimits(**req["limits"])
        _cpu_limit(resource, limits.time_limit + 2)
        text = sandbox.render_inline(req["source"], req["messages"], req["add_generation_prompt"],
                                     req["bos_token"], req["eos_token"], limits, seconds=req["seconds"],
                                     tools=req.get("tools"))
        return {"text": text}
    except TemplateFailure as e:
        return {"kind": e.kind, "detail": e.detail}
    except MemoryError:
        return {"kind": "refused", "detail": f"it runs out of memory (more than {memory_limit} bytes)"}
    except Exception as e:   # a bad request: not expected from pyllama_kv.chat.templates
        return {"kind": "failed", "detail": f"{type(e).__name__}: {e}"}


def _grammar_job(req: dict, resource, memory_limit: int) -> dict:
    from .sampling import grammar_check as _grammar_check

    _cpu_limit(resource, float(req.get("seconds", 10.0)) + 2)
    try:
        return _grammar_check.job(req)
    except MemoryError:
        return {"error": f"compiling it runs out of memory (more than {memory_limit} bytes)"}
    except Exception as e:   # llguidance's own failures: worded without its internals
        return {"error": _grammar_check.plain(f"{type(e).__name__}: {e}")}


def _cpu_limit(resource, seconds: float) -> None:
    """SIGXCPU (which kills) once this rendering has used ``seconds`` of CPU time."""
    try:
        r = resource.getrusage(resource.RUSAGE_SELF)
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = int(r.ru_utime + r.ru_stime + seconds) + 1
        if hard == resource.RLIM_INFINITY or soft <= hard:
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    except (ValueError, OSError):
        pass


# -- the calling side -------------------------------------------------------------------------------------

class _Worker:
    def __init__(self, memory_limit: int) -> None:
        self.memory_limit = memory_limit
        code = (f"import sys; sys.path[:] = {sys.path!r}; "
                "from pyllama_kv._worker import main; main(sys.argv[1:])")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c", code, str(memory_limit)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
                start_new_session=True, close_fds=True)
        except OSError as e:
            raise WorkerError(f"cannot start a chat-template worker process: {e}") from None
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.wfd, self.rfd = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        try:
            ready = _read(self.rfd, time.monotonic() + START_TIMEOUT)
        except (TimeoutError, _Died, ValueError, OSError):
            self.kill()
            raise WorkerError("a chat-template worker process did not start (is jinja2 importable, "
                              f"and is the memory limit of {memory_limit} bytes enough for Python?)") from None
        if not isinstance(ready, dict) or "ready" not in ready:
            self.kill()
            raise WorkerError("a chat-template worker process did not start")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.kill()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:   # pragma: no cover (SIGKILL)
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


class _Pool:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.idle: list[_Worker] = []
        self.live = 0
        self.pid = os.getpid()
        self.started = 0      # workers started (for tests and measurements)
        self.killed = 0       # workers killed after a rendering (time limit, or died) (likewise)

    def _forked(self) -> None:
        # in a forked child the parent's workers are not ours: forget them (their pipes are shared)
        if os.getpid() != self.pid:
            self.cond = threading.Condition()
            self.idle, self.live, self.pid = [], 0, os.getpid()

    def acquire(self, memory_limit: int, workers: int, cancel: threading.Event | None = None) -> _Worker:
        """An idle worker, or a new one while fewer than ``workers`` live; waits for one otherwise
        (Cancelled when ``cancel`` is set meanwhile)."""
        self._forked()
        with self.cond:
            while True:
                while self.idle:
                    w = self.idle.pop()
                    if w.alive() and w.memory_limit == memory_limit:
                        return w
                    w.kill()
                    self.live -= 1
                if self.live < workers:
                    self.live += 1
                    break
                self.cond.wait(None if cancel is None else 0.05)
                if cancel is not None and cancel.is_set():
                    raise Cancelled
        try:
            w = _Worker(memory_limit)
        except BaseException:
            with self.cond:
                self.live -= 1
                self.cond.notify()
            raise
        self.started += 1
        return w

    def release(self, w: _Worker, reuse: bool) -> None:
        if not reuse:
            w.kill()
        with self.cond:
            if not reuse:
                self.killed += 1
            if reuse and w.alive() and os.getpid() == self.pid:
                self.idle.append(w)
            else:
                self.live -= 1
            self.cond.notify()

    def close(self) -> None:
        if os.getpid() != self.pid:
            return
        with self.cond:
            idle, self.idle = self.idle, []
            self.live -= len(idle)
        for w in idle:
            w.kill()


_POOL = _Pool()                 # chat templates
GRAMMAR_POOL = _Pool()          # grammars (a pool of its own: its memory limit differs)
atexit.register(_POOL.close)
atexit.register(GRAMMAR_POOL.close)


def call(pool: _Pool, req: dict, time_limit: float, memory_limit: int, workers: int,
         cancel: threading.Event | None = None) -> Any:
    """Send ``req`` to a worker of ``pool`` and return its answer within ``time_limit`` seconds:
    TimeoutError past it, Cancelled when ``cancel`` is set first (the worker is killed in both
    cases), _Died when the worker dies; WorkerError if none could be started."""
    w = pool.acquire(memory_limit, workers, cancel)
    reuse = False
    try:
        deadline = time.monotonic() + time_limit
        _write(w.wfd, req)
        resp = _read(w.rfd, deadline, cancel)
        reuse = True
        return resp
    except TimeoutError:   # (an OSError)
        raise
    except (OSError, ValueError):
        raise _Died from None
    finally:
        pool.release(w, reuse)


def grammar_job(req: dict, time_limit: float, memory_limit: int, workers: int = 2,
                cancel: threading.Event | None = None) -> dict:
    """A grammar job (pyllama_kv.sampling.grammar_check.job) in a worker: its answer, or ``{"error": ...}``
    when the worker ran past ``time_limit``, ran out of memory or crashed; Cancelled when
    ``cancel`` was set first."""
    req = {**req, "job": "grammar", "seconds": time_limit}
    try:
        resp = call(GRAMMAR_POOL, req, time_limit, memory_limit, workers, cancel)
    except TimeoutError:
        return {"error": f"compiling it takes more than {time_limit:g} s"}
    except _Died:
        return {"error": "compiling it crashed the grammar engine (in a worker process, which was replaced)"}
    except WorkerError as e:
        return {"error": str(e)}
    if not isinstance(resp, dict):
        return {"error": "its grammar worker answered nonsense"}
    return resp


def render(source: str, messages: list[dict], add_generation_prompt: bool, bos_token: str, eos_token: str,
           limits: TemplateLimits, tools: list | None = None) -> str:
    """Render in a worker within ``limits.time_limit`` seconds: the text, or TemplateFailure
    (WorkerError if no worker could be started)."""
    req = {"source": source, "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
           "bos_token": bos_token, "eos_token": eos_token, "limits": dataclasses.asdict(limits),
           "seconds": limits.time_limit * 0.9}   # the worker's own check, before the kill
    try:
        resp = call(_POOL, req, limits.time_limit, limits.memory_limit, limits.workers)
    except TimeoutError:
        raise TemplateFailure("timeout", f"it runs for more than {limits.time_limit:g} s "
                                         "(its worker process was killed)") from None
    except _Died:
        raise TemplateFailure("died", "its worker process died (out of memory, "
                                      f"more than {limits.memory_limit} bytes, or crashed)") from None
    if isinstance(resp, dict) and isinstance(resp.get("text"), str):
        return resp["text"]
    if isinstance(resp, dict) and isinstance(resp.get("kind"), str) and isinstance(resp.get("detail"), str):
        raise TemplateFailure(resp["kind"], resp["detail"])
    raise TemplateFailure("failed", "its worker process answered nonsense")
