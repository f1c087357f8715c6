"""`pyllama-kv chat` and `run --chat`, run for real in subprocesses (the real model, greedy, short answers)."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time

import pytest

from conftest import ENTRY_POINT, ROOT, run_cli

GREEDY = ["--temp", "0", "--ctx", "1024", "-t", "2"]
Q1 = "What is the capital of France?"
Q2 = "And of Germany?"

# a template of our own, for the tiny model (which has none)
SIMPLE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}<assistant>{% endif %}")


def _chat(model, lines: list[str], *extra: str, timeout: int = 300) -> tuple[list[dict], subprocess.CompletedProcess]:
    r = run_cli(["chat", str(model), "--json", *extra], input="".join(f"{ln}\n" for ln in lines), timeout=timeout)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return [json.loads(ln) for ln in r.stdout.splitlines()], r


def _one_line_error(r: subprocess.CompletedProcess, code: int = 1) -> str:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def smol(real_model):
    import pyllama_kv as pk

    with pk.Model(real_model) as m:
        yield m


def test_turn_two_evaluates_only_the_new_messages_and_reset_frees_the_conversation(real_model, smol):
    out, _ = _chat(real_model, [Q1, Q2, "/stats", "/reset", "/stats", Q1], "-n", "24", *GREEDY)
    t1, t2, stats, stats_after_reset, t3 = out
    assert t1["finish_reason"] in ("eos", "length") and t1["answer"]
    u1, u2 = t1["usage"], t2["usage"]
    assert u1["reused_tokens"] == 0 and u1["evaluated_tokens"] == u1["prompt_tokens"]
    # turn 2 is a fork of turn 1 (prompt + answer); only a length-cut answer's last token was never evaluated
    held = u1["prompt_tokens"] + u1["completion_tokens"] - (t1["finish_reason"] == "length")
    assert u2["reused_tokens"] == held
    assert u2["evaluated_tokens"] == u2["prompt_tokens"] - held
    # a fresh render of the same conversation is as long, and would all be evaluated
    msgs = [{"role": "user", "content": Q1}, {"role": "assistant", "content": t1["answer"]},
            {"role": "user", "content": Q2}]
    fresh = smol.tokenize(smol.apply_chat_template(msgs), special=True)
    assert len(fresh) == u2["prompt_tokens"] and u2["evaluated_tokens"] < len(fresh) // 2
    assert stats["stats"]["turns"] == 2 and stats["stats"]["last_turn"]["reused_tokens"] == held
    assert stats["stats"]["kv"]["used_cells"] >= u2["prompt_tokens"]
    # /reset: every cell of the conversation is freed, the system prompt included (nothing is cached)
    assert stats_after_reset["stats"]["kv"]["used_cells"] == 0
    assert t3["usage"]["reused_tokens"] == 0 and t3["usage"]["prompt_tokens"] == u1["prompt_tokens"]
    assert t3["answer"] == t1["answer"]


def test_chat_answer_equals_run_chat_and_system_changes_the_prompt(real_model, smol):
    system = "You are a pirate. Answer like one."
    (chat,), _ = _chat(real_model, [Q1], "-n", "24", "--system", system, *GREEDY)
    r = run_cli(["run", str(real_model), "--chat", "-p", Q1, "--system", system, "-n", "24", "--json", *GREEDY])
    assert r.returncode == 0, r.stderr
    run = json.loads(r.stdout)
    assert run["outputs"][0]["text"] == chat["answer"] and chat["answer"]
    # the prompt is the rendered template, system message first
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": Q1}]
    want = smol.tokenize(smol.apply_chat_template(msgs), special=True)
    assert run["prompt_tokens"] == chat["usage"]["prompt_tokens"] == len(want)
    (plain,), _ = _chat(real_model, [Q1], "-n", "24", *GREEDY)
    default = smol.tokenize(smol.apply_chat_template([{"role": "user", "content": Q1}]), special=True)
    assert plain["usage"]["prompt_tokens"] == len(default) != len(want)
    assert plain["answer"] != chat["answer"]


def test_run_chat_parallel_forks_the_rendered_prompt(real_model, smol):
    # (three answers, not necessarily equal: Q4_1 matmuls differ with the batch shape)
    r = run_cli(["run", str(real_model), "--chat", "-p", Q1, "-n", "12", "--parallel", "3", "--json", *GREEDY])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert len(d["outputs"]) == 3 and all(o["text"] for o in d["outputs"])
    want = smol.tokenize(smol.apply_chat_template([{"role": "user", "content": Q1}]), special=True)
    assert d["prompt_tokens"] == len(want) and d["reused_tokens"] == 2 * len(want)


def test_kept_token_ids_are_the_prefix_even_when_bpe_would_merge_them(smol):
    # the answer's tokens as generated ("Hel" + "lo", not "Hello"): the next prompt starts with them,
    # where re-tokenizing the rendered text would not (and the cached cells would not match)
    from pyllama_kv.chat.conversation import ChatTemplate, Conversation
    from pyllama_kv.engine import Completion

    conv = Conversation(ChatTemplate(smol), None)
    msgs, text, toks = conv.next_prompt("Say hello")
    answer = smol.tokenize("Hel", add_bos=False) + smol.tokenize("lo", add_bos=False)
    assert smol.tokenize("Hello", add_bos=False) != answer
    conv.answered(msgs, text, toks, Completion(0, "Hello", answer, "eos"), cells_kept=True)
    _, text2, toks2 = conv.next_prompt("Again")
    assert toks2[:len(toks) + len(answer)] == toks + answer
    assert smol.tokenize(text2, add_bos=False, special=True)[:len(toks) + len(answer)] != toks + answer
    assert text2.startswith(text + "Hello")


def _wait_output(p: subprocess.Popen, timeout: float = 120) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([p.stdout], [], [], 1.0)
        if ready:
            return os.read(p.stdout.fileno(), 4096)
    raise AssertionError("no output")


def test_ctrl_c_stops_the_answer_and_the_session_goes_on(real_model):
    lines = "Write a very long story about a dragon.\nWhat is 2+2?\n/stats\n"
    p = subprocess.Popen([str(ENTRY_POINT), "chat", str(real_model), "-n", "400", *GREEDY], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1", GGML_NO_BACKTRACE="1"))
    try:
        p.stdin.write(lines.encode())
        p.stdin.close()
        first = _wait_output(p)        # the first answer is streaming
        p.send_signal(signal.SIGINT)
        rest = p.stdout.read()
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 0, err
    finally:
        p.kill()
    out = (first + rest).decode()
    assert "Traceback" not in err
    assert "[answer interrupted" in err
    assert "turns       2" in out     # the second question was answered after the interrupted one


def test_ctrl_c_twice_at_the_prompt_exits_0(tiny_model, tmp_path):
    (tmp_path / "t.jinja").write_text(SIMPLE)
    p = subprocess.Popen([str(ENTRY_POINT), "chat", str(tiny_model), "--template", str(tmp_path / "t.jinja")],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1", GGML_NO_BACKTRACE="1"))
    try:
        p.stdin.write(b"/stats\n")
        p.stdin.flush()
        out = b""
        while not out.endswith(b"free\n"):
            out += _wait_output(p)     # then it waits for the next line
        p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        err = b""
        while b"Ctrl-C again" not in err and time.monotonic() < deadline:
            if select.select([p.stderr], [], [], 1.0)[0]:
                err += os.read(p.stderr.fileno(), 4096)
        assert b"Ctrl-C again" in err and p.poll() is None   # the first one only cleared the line
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=60) == 0
    finally:
        p.kill()
    assert b"Traceback" not in err + p.stderr.read()


def test_a_terminal_session(tiny_model, tmp_path):
    # stdin a terminal: the prompt, the streamed answer, the commands, Ctrl-D exits 0
    import pty

    (tmp_path / "t.jinja").write_text(SIMPLE)
    master, slave = pty.openpty()
    p = subprocess.Popen([str(ENTRY_POINT), "chat", str(tiny_model), "--template", str(tmp_path / "t.jinja"),
                          "-n", "8", "--temp", "0"], stdin=slave, stdout=slave, stderr=slave, cwd=ROOT,
                         env=dict(os.environ, PYTHONUNBUFFERED="1", GGML_NO_BACKTRACE="1", TERM="dumb"))
    os.close(slave)
    seen = b""

    def wait_for(s: bytes) -> None:
        nonlocal seen
        deadline = time.monotonic() + 120
        while s not in seen and time.monotonic() < deadline:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:
                    break
        assert s in seen, seen

    try:
        wait_for(b"> ")
        os.write(master, b"the cache\n")
        wait_for(b"\n> ")
        seen = b""
        os.write(master, b"/stats\n")
        wait_for(b"free\r\n> ")           # (a Ctrl-D typed before readline waits again may be lost)
        assert b"turns       1" in seen and b"KV cache" in seen
        os.write(master, b"\x04")
        assert p.wait(timeout=60) == 0
    finally:
        p.kill()
        os.close(master)
    assert b"Traceback" not in seen


def test_custom_template_and_a_full_context(tiny_model, tmp_path):
    (tmp_path / "t.jinja").write_text(SIMPLE)
    long = "the cache " * 40
    # with --context-shift off (on, the default, truncates and goes on: tests/test_context_shift.py)
    out, r = _chat(tiny_model, ["hi", long, "/reset", "hi"], "--template", str(tmp_path / "t.jinja"),
                   "--ctx", "64", "-n", "4", "--temp", "0", "--context-shift", "off", timeout=120)
    t1, full, t3 = out
    assert t1["finish_reason"] == "length" and t1["usage"]["completion_tokens"] == 4
    assert full["finish_reason"] == "context_full" and "/reset" in full["error"]
    assert t3["usage"]["prompt_tokens"] == t1["usage"]["prompt_tokens"] and t3["answer"] == t1["answer"]


def test_bad_inputs_are_one_line(tiny_model, real_model, tmp_path):
    line = _one_line_error(run_cli(["chat", str(tiny_model)], input="hi\n"))
    assert "has no chat template" in line and "--template" in line
    line = _one_line_error(run_cli(["run", str(tiny_model), "--chat", "-p", "hi"]))
    assert "has no chat template" in line
    line = _one_line_error(run_cli(["chat", str(tiny_model), "--template", str(tmp_path / "nope.jinja")], input=""))
    assert "cannot read the template file" in line and "nope.jinja" in line
    line = _one_line_error(run_cli(["chat", str(tiny_model), "--template", str(tmp_path)], input=""))
    assert "is a directory" in line
    hostile = tmp_path / "hostile.jinja"
    hostile.write_text("{{ cycler.__init__.__globals__ }}")
    line = _one_line_error(run_cli(["chat", str(real_model), "--template", str(hostile)], input="hi\n"))
    assert "refused" in line and "hostile.jinja" in line
    raising = tmp_path / "raising.jinja"
    raising.write_text("{{ raise_exception('roles must alternate') }}")
    line = _one_line_error(run_cli(["run", str(real_model), "--chat", "--template", str(raising), "-p", "hi"]))
    assert "roles must alternate" in line
    r = run_cli(["run", str(real_model), "--system", "be brief", "-p", "hi"])
    assert "--system needs --chat" in _one_line_error(r, code=2)
    assert "--template needs --chat" in _one_line_error(
        run_cli(["run", str(real_model), "--template", str(raising), "-p", "hi"]), code=2)


def test_help_describes_the_commands():
    r = run_cli(["chat", "--help"])
    assert r.returncode == 0
    for word in ("/stats", "/reset", "/exit", "--system", "--template", "--json", "starts a new one"):
        assert word in r.stdout
