"""Hostile chat templates (issue 26, item 1): every one is an InvalidInputError within the time limit,
with bounded memory, whether the in-process caps or the worker process's limits stop it; a template
that freezes its renderer does not freeze a server (/health answers, SIGTERM stops it)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from conftest import ROOT, run_py
from pyllama_kv.chat import templates as chat

BIG = "{% set s = 'x' * 1000000 %}"

# one operation that builds a huge value (or a chain that does), by family
HOSTILE = {
    # big integers: one operation holds the GIL for minutes
    "pow_chain": "{% set a = ((9 ** 4096) ** 4096) ** 4096 %}",
    "pow_right_assoc": "{{ 9 ** 4096 ** 4096 }}",
    "pow_big_base": "{% set b = 7 ** 4000 %}{{ b ** 3 }}",
    "mul_chain": ("{% set ns = namespace(x=2 ** 8000) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
                  "{% endfor %}"),
    "int_filter_mul": "{% set n = ('9' * 4000)|int %}{{ n * n * n }}",
    # %-formatting: widths, precisions, * widths, many arguments
    "printf_star": "{{ '%*d' % (300000000, 1) }}",
    "printf_width": "{{ '%300000000d' % 1 }}",
    "printf_precision": "{{ '%.300000000f' % 1.0 }}",
    "printf_star_precision": "{{ '%.*f' % (300000000, 1.0) }}",
    "printf_many": BIG + "{{ ('%(a)s' * 300) % {'a': s} }}",
    "printf_repr": BIG + "{{ '%r' % ([s] * 300,) }}",
    "format_filter_star": "{{ '%*s'|format(300000000, 'a') }}",
    "format_filter_kwargs": BIG + "{{ ('%(a)s' * 300)|format(a=s) }}",
    # str.format
    "format_width": "{{ '{:>300000000}'.format(1) }}",
    "format_nested_width": "{{ '{:>{}}'.format(1, 300000000) }}",
    "format_precision": "{{ '{:.300000000f}'.format(1.0) }}",
    "format_many": BIG + "{{ ('{0}' * 300).format(s) }}",
    "format_map": BIG + "{{ ('{a}' * 300).format_map({'a': s}) }}",
    "format_repr": BIG + "{{ '{!r}'.format([s] * 300) }}",
    # replace, join, concatenation, repetition
    "replace_method": BIG + "{{ s.replace('x', 'y' * 300) }}",
    "replace_filter": BIG + "{{ s|replace('x', 'y' * 300) }}",
    "replace_empty": BIG + "{{ s.replace('', 'yyy') }}",
    "join_filter": BIG + "{{ ([s] * 300)|join }}",
    "join_method": BIG + "{{ ''.join([s] * 300) }}",
    "join_separator": BIG + "{{ s.join(['a'] * 300) }}",
    "join_attribute": BIG + "{{ ([{'a': s}] * 300)|join(attribute='a') }}",
    "concat_tilde": ("{% set ns = namespace(s='x' * 1000) %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}"
                     "{% endfor %}{{ ns.s|length }}"),
    "concat_plus": ("{% set ns = namespace(s='x' * 1000) %}{% for i in range(30) %}{% set ns.s = ns.s + ns.s %}"
                    "{% endfor %}{{ ns.s|length }}"),
    "list_plus": ("{% set ns = namespace(l=[1] * 1000) %}{% for i in range(30) %}{% set ns.l = ns.l + ns.l %}"
                  "{% endfor %}{{ ns.l|length }}"),
    "repeat_str": "{{ 'x' * 300000000 }}",
    "repeat_list": "{{ ([1] * 1000) * 1000000 }}",
    "sum_lists": "{{ ([['x'] * 1000] * 3000)|sum(start=[]) }}",
    # padding, widths, other amplifying methods and filters
    "center_filter": "{{ 'x'|center(300000000) }}",
    "center_method": "{{ 'x'.center(300000000) }}",
    "ljust": "{{ 'x'.ljust(300000000) }}",
    "zfill": "{{ '1'.zfill(300000000) }}",
    "indent": "{{ ('x\n' * 500000)|indent(300) }}",
    "indent_str": "{{ ('x\n' * 500000)|indent('y' * 300) }}",
    "wordwrap": "{{ ('a ' * 500000)|wordwrap(1, wrapstring='x' * 300) }}",
    "expandtabs": "{{ ('\t' * 1000000).expandtabs(300) }}",
    "translate": "{{ ('a' * 1000000).translate({97: 'b' * 300}) }}",
    "to_bytes": "{{ (1).to_bytes(300000000, 'big') }}",
    "slice": "{{ [1]|slice(300000000)|list }}",
    "batch": "{{ [1]|batch(300000000, 'x')|list }}",
    "strftime": "{{ strftime_now('%Y' * 500000) }}",
    # values turned into text
    "output_list": BIG + "{{ [s] * 300 }}",
    "string_filter": BIG + "{{ ([s] * 300)|string }}",
    "tojson": BIG + "{{ ([s] * 300)|tojson }}",
    "pprint": BIG + "{{ ([s] * 300)|pprint }}",
    "deep_nesting": ("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}"
                     "{% endfor %}{{ ns.l }}"),
    # globals
    "lipsum": "{{ lipsum(100000, false, 1000, 1000) }}",
}

# with the in-process caps lifted, the worker's limits alone: the time limit (kill) and the memory limit
UNCAPPED = {
    "pow_chain": ("{% set a = ((9 ** 4096) ** 4096) ** 4096 %}", r"runs for more than 2 s"),
    "repeat_str": ("{{ 'x' * 10000000000 }}", r"out of memory|process died"),
    "printf_star": ("{{ '%*d' % (600000000, 1) }}", r"out of memory|process died"),
}

SCRIPT = textwrap.dedent("""
    import json, resource, sys
    from pyllama_kv import _worker as _template_worker
    from pyllama_kv.chat import templates as chat
    cases, uncapped = json.loads(sys.stdin.read())
    out = {}
    msgs = [{"role": "user", "content": "hi"}]
    pool = _template_worker._POOL

    def counts():
        return {"started": pool.started, "killed": pool.killed, "rendered": chat._CACHE.misses}

    def delta(before):
        return {k: v - before[k] for k, v in counts().items()}

    for mode, limits in (("worker", chat.TemplateLimits()), ("inline", chat.TemplateLimits(isolate=False))):
        for name, src in cases.items():
            before = counts()
            try:
                text = chat.render(src, msgs, limits=limits)
                r = {"ok": len(text)}
            except chat.InvalidInputError as e:
                r = {"error": str(e)}
            except BaseException as e:
                r = {"other": f"{type(e).__name__}: {e}"}
            r.update(delta(before))
            out[f"{mode}:{name}"] = r
    out["hostile"] = counts()
    lifted = chat.TemplateLimits(time_limit=2.0, memory_limit=256 << 20, max_int_bits=10**12, max_size=10**12)
    for name, (src, _) in uncapped.items():
        before = counts()
        try:
            chat.render(src, msgs, limits=lifted)
            r = {"ok": 0}
        except chat.InvalidInputError as e:
            r = {"error": str(e)}
        r.update(delta(before))
        out[f"uncapped:{name}"] = r
    before = counts()
    out["after"] = chat.render("{{ messages[0].content }}", msgs, limits=lifted)
    out["after_counts"] = delta(before)
    _template_worker._POOL.close()
    # this process's own peak (VmHWM: per address space, reset by exec). ru_maxrss would not do: Linux
    # carries it across fork+exec, so it reports the pytest process's RSS at the fork (1.6 GB in a full run)
    out["self_maxrss_kib"] = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    out["children_maxrss_kib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    out.update(counts())
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def results():
    """Every hostile template rendered in a subprocess (bounded in time): through the worker, in
    process (the caps alone), and with the caps lifted (the worker's limits alone)."""
    p = subprocess.run([sys.executable, "-c", SCRIPT], input=json.dumps([HOSTILE, UNCAPPED]), capture_output=True,
                       text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["worker", "inline"])
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_refused_fast(results, mode, name):
    r = results[f"{mode}:{name}"]
    assert "error" in r, r
    assert r["error"].startswith("the chat template "), r
    assert "lipsum" in r["error"] if name == "lipsum" else "is refused" in r["error"], r
    # the caps refuse before anything big is built: the renderer answers itself, never the time or
    # memory limit (no "runs for more than", no dead worker), and no worker is killed or replaced
    assert "runs for more than" not in r["error"] and "process died" not in r["error"], r
    assert "out of memory" not in r["error"], r
    assert r["rendered"] == 1 and r["killed"] == 0, r
    assert r["started"] == (1 if (mode, name) == ("worker", next(iter(HOSTILE))) else 0), r


@pytest.mark.parametrize("name", sorted(UNCAPPED))
def test_worker_limits_alone_bound_time_and_memory(results, name):
    import re

    r = results[f"uncapped:{name}"]
    assert "error" in r and re.search(UNCAPPED[name][1], r["error"]), r
    assert r["rendered"] == 1, r
    if "runs for more than" in r["error"]:
        # the time limit: the worker was killed at the deadline (the refusal's kind is "timeout")
        assert r["killed"] == 1, r
    elif "process died" in r["error"]:
        assert r["killed"] == 1, r
    else:   # the worker's MemoryError: it answered, and is reused
        assert r["killed"] == 0, r


def test_memory_stays_bounded_and_workers_restart(results):
    assert results["after"] == "hi" and results["after_counts"]["rendered"] == 1
    # the calling process never built the big values; no worker went past its address-space limit
    assert results["self_maxrss_kib"] < 400 * 1024, results["self_maxrss_kib"]
    assert results["children_maxrss_kib"] < 512 * 1024, results["children_maxrss_kib"]
    # one worker for the default limits (reused across ~50 refusals, none killed), one for the lifted
    # limits' memory limit, and one more for each killed one (the time limit's, a dead one's)
    assert results["hostile"]["started"] == 1 and results["hostile"]["killed"] == 0, results["hostile"]
    assert 1 <= results["killed"] <= len(UNCAPPED), results["killed"]
    assert results["started"] == 2 + results["killed"], (results["started"], results["killed"])
    assert results["rendered"] == 2 * len(HOSTILE) + len(UNCAPPED) + 1


# ordinary templates must render as plain jinja2 renders them (the caps are not in the way)
ORDINARY = (
    "{{ bos_token }}{% set ns = namespace(sys='') %}{% for m in messages %}"
    "{% if m.role == 'system' %}{% set ns.sys = m.content|trim %}{% endif %}{% endfor %}"
    "{{ '%-8s|%5d|%.2f|%s' % ('a', 42, 3.14159, ns.sys) }}{{ '{:>6}|{:<4}|{!r}'.format('b', 7, 'c') }}"
    "{{ ['x', 'y', 'z']|join(', ') }}|{{ 'abc'.replace('b', 'BB') }}|{{ 'ab' * 3 }}|{{ 'q' ~ 1 ~ 'r' }}"
    "{{ 2 ** 64 }}|{{ 10 * 10 }}|{{ 7 // 2 }}|{{ [1, 2] + [3] }}|{{ 'hi'|center(8) }}|{{ 'a\nb'|indent(2) }}"
    "{{ messages|length }}{{ messages[-1]|tojson }}{{ 'x'|upper }}{{ [3, 1, 2]|sort|list }}"
    "{{ {'k': 1}|dictsort }}{{ 'a-b'.split('-') }}{{ 1700000000 }}{{ '%d' % 1700000000 }}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if not loop.last %}\n{% endif %}{% endfor %}"
)


def test_ordinary_template_renders_as_plain_jinja2():
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x: json.dumps(x, ensure_ascii=False)
    msgs = [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Héllo ✓"}]
    want = env.from_string(ORDINARY).render(messages=msgs, bos_token="<s>", eos_token="</s>",
                                            add_generation_prompt=True)
    for isolate in (True, False):
        got = chat.render(ORDINARY, msgs, bos_token="<s>", eos_token="</s>",
                          limits=chat.TemplateLimits(isolate=isolate))
        assert got == want


def test_limits_are_options(monkeypatch):
    assert chat.TemplateLimits().time_limit == 5.0 and chat.TemplateLimits().memory_limit == 512 << 20
    old = chat.set_template_limits(time_limit=1.5)
    try:
        assert chat.get_template_limits().time_limit == 1.5 and old == chat.TemplateLimits()
        with pytest.raises(chat.InvalidInputError, match="time_limit"):
            chat.set_template_limits(time_limit=-1)
    finally:
        chat.set_template_limits(old)
    monkeypatch.setenv(chat.LIMITS_ENV, "time_limit=2.5, memory_limit=1073741824,isolate=false")
    assert chat._limits_from_env() == chat.TemplateLimits(time_limit=2.5, memory_limit=1 << 30, isolate=False)
    monkeypatch.setenv(chat.LIMITS_ENV, "nosuch=1")
    with pytest.raises(chat.LlamaError, match="PYLLAMA_KV_TEMPLATE_LIMITS"):
        chat._limits_from_env()


def test_refusals_are_cached_and_timeouts_are_not():
    """Counted, not timed: a cap's refusal is answered from the cache (no rendering reaches the
    renderer), a time-limit refusal (kind "timeout") is rendered again each time."""
    lim = chat.TemplateLimits(time_limit=1.0, max_steps=10**9)
    src = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}{# cache-test #}"
    src_fast = "{{ 'x' * 300000000 }}{# cache-test #}"
    cache = chat._CACHE
    m0, h0 = cache.misses, cache.hits
    with pytest.raises(chat.InvalidInputError, match="runs for more than 1 s"):
        chat.render(src, [], limits=lim)
    with pytest.raises(chat.InvalidInputError, match="is refused") as e:
        chat.render(src_fast, [], limits=lim)
    assert "runs for more than" not in str(e.value)
    assert (cache.misses - m0, cache.hits - h0) == (2, 0)
    with pytest.raises(chat.InvalidInputError, match="is refused"):
        chat.render(src_fast, [], limits=lim)
    assert (cache.misses - m0, cache.hits - h0) == (2, 1)     # from the cache: no rendering
    with pytest.raises(chat.InvalidInputError, match="runs for more than 1 s"):
        chat.render(src, [], limits=lim)
    assert (cache.misses - m0, cache.hits - h0) == (3, 1)     # rendered again: its refusal depends on the time


# ---------------------------------------------------------------------------------------------
# a server whose model's template freezes its renderer

FREEZE = "{% set a = ((9 ** 4096) ** 4096) ** 4096 %}{% for m in messages %}{{ m.content }}{% endfor %}"


def _template_workers(pid: int) -> dict[int, float]:
    """The chat-template worker processes of process ``pid`` (its children running
    pyllama_kv._worker, not zombies): pid -> CPU seconds they have used."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if st[0] != "Z" and int(st[1]) == pid and b"pyllama_kv._worker" in cmd:
            out[int(d)] = (int(st[11]) + int(st[12])) / tick
    return out


# CPU seconds after which a worker is past its start (~0.15 s: python -I, jinja2, the environment)
# and inside the rendering: the frozen one is the only rendering that burns CPU
BUSY_CPU = 0.6


def _busy_worker(pid: int, pending: threading.Thread) -> int:
    """The worker of ``pid`` that renders the freezing template (bounded: while ``pending`` runs)."""
    deadline = time.monotonic() + 60
    while pending.is_alive() and time.monotonic() < deadline:
        busy = [w for w, cpu in _template_workers(pid).items() if cpu >= BUSY_CPU]
        if busy:
            return busy[0]
        time.sleep(0.05)
    raise AssertionError("no worker was seen rendering the freezing template")


def test_freezing_template_does_not_stop_the_server(models, monkeypatch):
    """The in-process caps lifted (only the worker's limits left), a template that holds its
    renderer's GIL for minutes: the request is a 400 (kind "timeout": its worker killed), /health
    answers while that worker is rendering, and SIGTERM stops the server with such a rendering in
    flight. (Before the worker processes, this froze the server.) Seen through the processes, not
    timed: the worker that renders, and whether it is still alive."""
    from pyllama_kv.tools.gguf import make_tiny_model
    from test_server import ServerProc

    path = make_tiny_model(models / "freeze.gguf", kv_overrides={"tokenizer.chat_template": FREEZE})
    monkeypatch.setenv("PYLLAMA_KV_TEMPLATE_LIMITS", "time_limit=3,max_int_bits=1000000000000")
    s = ServerProc(path, "--ctx", "256", key=None)
    try:
        url = s.url + "/chat/completions"
        body = {"model": "freeze", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        box: dict = {}

        def post():
            try:
                box["r"] = httpx.post(url, json=body, timeout=60)
            except Exception as e:   # noqa: BLE001 (reported below)
                box["r"] = e

        t = threading.Thread(target=post, daemon=True)
        t.start()
        busy = _busy_worker(s.proc.pid, t)
        answered = 0                 # /health answers that came back while the rendering went on
        for _ in range(600):         # bounded: the worker is killed at the time limit
            if not (t.is_alive() and _alive(busy)):
                break
            assert httpx.get(s.root + "/health", timeout=30).status_code == 200
            if t.is_alive() and _alive(busy) and busy in _template_workers(s.proc.pid):
                answered += 1
            time.sleep(0.05)
        assert answered >= 1, "/health did not answer while the worker was rendering"
        t.join(60)
        assert not t.is_alive()
        r = box["r"]
        assert isinstance(r, httpx.Response) and r.status_code == 400, r
        assert "runs for more than 3 s (its worker process was killed)" in r.json()["error"]["message"], r.text
        assert not _alive(busy) and busy not in _template_workers(s.proc.pid)   # killed by the pool
        # SIGTERM with a freezing render in flight: the server stops (wait() is bounded: it raises)
        t = threading.Thread(target=post, daemon=True)
        t.start()
        busy = _busy_worker(s.proc.pid, t)
        s.proc.send_signal(signal.SIGTERM)
        s.proc.wait(30)
        t.join(60)
    finally:
        s.stop(timeout=10)
        if s.proc.poll() is None:   # pragma: no cover
            s.proc.kill()
    assert "Traceback" not in s.log(), s.log()


def test_module_imports_nothing_but_jinja2():
    """The worker runs the template sandbox (pyllama_kv.chat.sandbox) with jinja2 and the standard
    library only: the chat package loads its names only when they are used."""
    code = ("import sys; import pyllama_kv._worker, pyllama_kv.chat.sandbox as s; s._env(); "
            "print(sorted(m for m in sys.modules if m.startswith('pyllama_kv')))")
    p = run_py(["-c", code], timeout=60)
    assert p.returncode == 0, p.stderr
    assert eval(p.stdout) == ["pyllama_kv", "pyllama_kv._worker", "pyllama_kv.chat", "pyllama_kv.chat.sandbox"]


def test_a_worker_does_not_outlive_its_parent_by_more_than_one_rendering():
    """The parent dies while its worker is frozen in one big-integer operation (minutes, in little
    memory): the worker's CPU limit for the rendering (time_limit + 2 s) kills it; an idle worker
    exits on EOF. The workers were started from a thread that has ended since (which must not kill
    them)."""
    code = textwrap.dedent("""
        import os, sys, threading, time, dataclasses
        from pyllama_kv import _worker as W
        from pyllama_kv.chat import templates as chat
        lim = chat.TemplateLimits(time_limit=1.0, max_int_bits=10**12)
        box = {}
        def start():
            box.update(idle=W._Worker(lim.memory_limit), busy=W._Worker(lim.memory_limit))
        t = threading.Thread(target=start)
        t.start(); t.join()
        time.sleep(0.5)
        assert box["busy"].alive() and box["idle"].alive()
        W._write(box["busy"].wfd, {"source": "{% set a = 3 ** 100000000 %}", "messages": [],
                                  "add_generation_prompt": True, "bos_token": "", "eos_token": "",
                                  "limits": dataclasses.asdict(lim), "seconds": 0.9})
        time.sleep(0.5)
        print(box["busy"].proc.pid, box["idle"].proc.pid, flush=True)
        os._exit(0)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    pids = [int(x) for x in p.stdout.split()]
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        time.sleep(0.2)
    assert not alive, f"workers {alive} outlived their parent"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_concurrent_renderings_share_the_pool():
    """8 threads render at once through 2 workers, while a template that runs into the time limit
    holds one of them: every rendering is right, and the ordinary ones are not held up by it: all
    of them are done while it still runs (an order of events, not a timing), through the other
    worker alone (no worker started or killed for them)."""
    from concurrent.futures import ThreadPoolExecutor

    from pyllama_kv import _worker as _template_worker

    pool_ = _template_worker._POOL
    lim = chat.TemplateLimits(time_limit=3.0, max_steps=10**9)
    slow = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}{# concurrent #}"
    slow_done = threading.Event()
    slow_started = threading.Event()

    def slow_one():
        slow_started.set()
        try:
            with pytest.raises(chat.InvalidInputError, match="runs for more than 3 s"):
                chat.render(slow, [], limits=lim)
        finally:
            slow_done.set()

    def one(i: int) -> bool:
        assert chat.render("{{ messages[0].content }}!", [{"role": "user", "content": f"n{i}"}], limits=lim) == f"n{i}!"
        return slow_done.is_set()

    _template_worker._POOL.close()    # no idle worker of an earlier test
    started, killed, rendered = pool_.started, pool_.killed, chat._CACHE.misses
    with ThreadPoolExecutor(8) as pool:
        s = pool.submit(slow_one)
        assert slow_started.wait(60)
        after_slow = list(pool.map(one, range(200)))
        assert not slow_done.is_set(), "the ordinary renderings waited for the slow one"
        s.result()
    assert not any(after_slow)
    assert chat._CACHE.misses - rendered == 201
    # two workers (the pool's size); the slow one's worker answers its own timeout or is killed
    assert pool_.started - started <= 2 and pool_.killed - killed <= 1
