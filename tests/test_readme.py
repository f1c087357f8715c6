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


# --- the docs: README.md and docs/*.md -------------------------------------------------------------

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = "<!-- runnable -->"   # put on the line before a ```python block: the tests run it on the tiny model


def _python_blocks(text: str) -> list[tuple[bool, str]]:
    """(marked runnable, code) of every ```python block."""
    return [(bool(m.group(1)), m.group(2))
            for m in re.finditer(r"(" + re.escape(RUNNABLE) + r"\n)?```python\n(.*?)```", text, re.S)]


def _subparsers() -> dict:
    from pyllama_kv.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return dict(sub.choices)


def _options(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def test_docs_exist_and_readme_is_short():
    names = {p.name for p in DOCS}
    for name in ("serving.md", "prefix-cache.md", "context-shift.md", "robustness.md", "building.md", "patches.md",
                 "benchmarks.md", "testing.md", "models.md", "cli.md", "api.md", "engine.md", "architecture.md"):
        assert name in names, f"docs/{name} is missing"
    assert len(README.encode()) < 20_000, "README.md is meant to be read in five minutes: move detail to docs/"


def test_every_python_block_in_the_docs_compiles():
    n = 0
    for path in DOCS:
        for i, (_, code) in enumerate(_python_blocks(path.read_text())):
            compile(code, f"{path.name}, python block {i + 1}", "exec")   # a SyntaxError names the block
            n += 1
    assert n >= 10


def test_runnable_doc_examples_run(tiny_model, tmp_path):
    ran = []
    for path in DOCS[1:]:   # README's blocks run in the tests above
        for i, (runnable, code) in enumerate(_python_blocks(path.read_text())):
            if not runnable:
                continue
            assert '"model.gguf"' in code, f"{path.name} block {i + 1}: a runnable example loads \"model.gguf\""
            script = tmp_path / f"{path.stem}_{i + 1}.py"
            script.write_text(code.replace('"model.gguf"', repr(str(tiny_model))))
            r = run_py([str(script)])
            assert r.returncode == 0, f"{path.name} block {i + 1}:\n{r.stderr[-2000:]}"
            ran.append(f"{path.name}:{i + 1}")
    assert len(ran) >= 3, ran


def _command_mentions(text: str):
    """(command, the rest of its line up to the end of the code) for every `pyllama-kv COMMAND` in ``text``."""
    for m in re.finditer(r"pyllama-kv\s+([a-z][a-z0-9-]*)", text):
        rest = text[m.end():].split("\n", 1)[0].replace("\\|", "/")
        yield m.group(1), re.split(r"[`|#;)'\"]|&&", rest, maxsplit=1)[0]


def test_every_command_the_docs_name_exists_with_its_flags():
    subs = _subparsers()
    seen = set()
    for path in DOCS:
        text = path.read_text()
        for cmd, rest in _command_mentions(text):
            assert cmd in subs, f"{path.name} names `pyllama-kv {cmd}`, which is not a command"
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):
                assert flag in _options(subs[cmd]), f"{path.name}: `pyllama-kv {cmd}` has no {flag} ({rest!r})"
            seen.add(cmd)
        # the command tables: a first cell's `COMMAND [--flag ...]` spans name only flags the command has
        for row in re.findall(r"^\| (`[a-z][^\n]*?) \| ", text, re.M):
            for span in re.findall(r"`([^`]+)`", row):
                cmd = span.split()[0]
                if cmd in subs:
                    for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", span):
                        assert flag in _options(subs[cmd]), f"{path.name}'s table: `{cmd}` has no {flag}"
    assert {"serve", "run", "chat", "demo", "stress", "build"} <= seen


def _anchors(text: str) -> set[str]:
    """GitHub's anchors for the headings of ``text``."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out = set()
    for h in re.findall(r"^#{1,6} (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", h.strip().lower().replace("`", "")).replace(" ", "-")
        out.add(slug)
    return out


def test_relative_links_point_to_files_that_exist():
    n = 0
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue   # http:, https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            assert dest.exists(), f"{path.name} links to {target}, which does not exist"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest.read_text()), f"{path.name} links to {target}: no such heading"
            n += 1
    assert n >= 20


def test_tests_and_scripts_the_docs_name_exist():
    for path in DOCS:
        for name in set(re.findall(r"\b((?:tests|scripts)/[\w./-]+\.(?:py|sh))", path.read_text())):
            assert (ROOT / name).exists(), f"{path.name} names {name}, which does not exist"


def test_readme_embeddings_example_runs(models, tmp_path):
    from pyllama_kv.tools.gguf import make_tiny_model

    bert = make_tiny_model(models / "readme-bert.gguf", arch="bert", n_ctx_train=512)
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if ".embed(" in b]
    assert blocks, "the README has no embeddings example"
    script = tmp_path / "embed_example.py"
    script.write_text(blocks[0].replace('"embedder.gguf"', repr(str(bert))))
    r = run_py([str(script)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("(3, 64) [1. ")
