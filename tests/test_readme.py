"""The README stays true: its commands come first, its API example runs, its CLI table is complete."""
from __future__ import annotations

import re

from conftest import ROOT, run_py

README = (ROOT / "README.md").read_text()


def test_readme_starts_with_the_two_commands():
    first_block = README.split("```", 2)[1]
    assert "make demo" in first_block and "make test" in first_block
    assert README.index("make demo") < 400


def test_readme_api_example_runs(tiny_model, tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    code = blocks[0].replace('"model.gguf"', repr(str(tiny_model)))
    script = tmp_path / "example.py"
    script.write_text(code)
    r = run_py([str(script)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "KVStats(" in r.stdout


def test_readme_lists_every_command():
    from pyllama_kv.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in sub.choices:
        assert f"`{name}" in README, f"README does not mention `{name}`"


def test_readme_engine_example_runs(tiny_model, tmp_path):
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "pyllama_kv.engine" in b]
    assert blocks, "the README has no engine example"
    code = f"import pyllama_kv as pk\nmodel = pk.Model({str(tiny_model)!r})\n" + blocks[0]
    script = tmp_path / "engine_example.py"
    script.write_text(code)
    r = run_py([str(script)])
    assert r.returncode == 0, r.stderr[-2000:]
    reasons = [line.split(" ", 1)[0] for line in r.stdout.splitlines() if line]
    assert len([x for x in reasons if x in ("length", "stop", "eos")]) == 4, r.stdout
