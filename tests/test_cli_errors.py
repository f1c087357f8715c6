"""The CLI's one error choke point (pyllama_kv.cli.main): which exception gives which exit code and
what is printed. In-process (main() called directly) on the tiny model: no model is loaded except
where a library has to be resolved."""
from __future__ import annotations

import importlib
import inspect

import pytest

from pyllama_kv.cli.common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE, CLIError, UsageError
from pyllama_kv.errors import LlamaError

cli_main = importlib.import_module("pyllama_kv.cli.main")   # pyllama_kv.cli.main is also the function


def _run(capsys, argv: list[str]) -> tuple[int, list[str], str]:
    """main(argv): exit code, the non-empty stderr lines, stdout."""
    rc = cli_main.main(argv)
    out, err = capsys.readouterr()
    return rc, [ln for ln in err.splitlines() if ln.strip()], out


def test_usage_errors_exit_2_with_one_line(capsys, tiny_model, tmp_path):
    m = str(tiny_model)
    cases = [
        (["run", m, "--system", "be brief", "-p", "hi"], "--system needs --chat"),
        (["run", m, "--template", str(tmp_path / "t.jinja"), "-p", "hi"], "--template needs --chat"),
        (["run", m, "-p", "x", "--parallel", "0"], "--parallel must be at least 1"),
        (["run", m, "-p", "x", "--parallel", "300"], "--parallel must be at most 256"),
        (["run", m, "-p", "x", "-f", str(tmp_path / "p.txt")], "not both"),
        (["run", m, "-p", "x", "--top-p", "5"], "--top-p=5.0 is out of range"),   # a dataclass's check, flag-named
        (["stress", m, "--steps", "0"], "--steps must be at least 1"),
        (["tiny-model", str(tmp_path / "t.gguf"), "--embd", "65"], "multiple of --heads"),
        (["inspect", m, "--type-k", "q9_9"], "--type-k: unknown KV cache type"),
    ]
    for argv, msg in cases:
        rc, lines, out = _run(capsys, argv)
        assert rc == EXIT_USAGE, (argv, rc, lines)
        assert len(lines) == 1 and msg in lines[0], (argv, lines)
        assert lines[0].startswith(f"pyllama-kv {argv[0]}: error: ") and "Traceback" not in lines[0], lines
    assert not (tmp_path / "t.gguf").exists()


def test_argparse_errors_exit_2_too(capsys, tiny_model):
    with pytest.raises(SystemExit) as e:
        cli_main.main(["run", str(tiny_model), "--parallel", "many"])
    assert e.value.code == EXIT_USAGE and "invalid int value" in capsys.readouterr().err


def test_user_errors_exit_1_with_one_line(capsys, tiny_model, tmp_path):
    notgguf = tmp_path / "x.gguf"
    notgguf.write_text("hello")
    cases = [
        (["inspect", str(notgguf)], "not a GGUF file"),                              # GGUFFileError
        (["run", str(notgguf), "-p", "x"], "not a GGUF file"),                       # ModelLoadError
        (["inspect", str(tmp_path / "missing.gguf")], "no such file"),               # OSError
        (["run", str(tiny_model), "-p", "x", "--ctx", "100000"], "larger than the model supports"),  # CLIError
        (["run", str(tiny_model), "-p", "x", "--lib", str(tmp_path / "nope.so")], "does not exist"),  # LibraryError
        (["run", str(tiny_model), "-p", "x", "-ngl", "-2"], "n_gpu_layers must be an int >= -1"),  # InvalidInputError
        # the mission pin cannot sample in the graph: said at start, naming the flag
        (["serve", str(tiny_model), "--port", "0", "--backend-sampling", "on"], "--backend-sampling: backend_"),
    ]
    for argv, msg in cases:
        rc, lines, _ = _run(capsys, argv)
        assert rc == EXIT_ERROR, (argv, rc, lines)
        assert len(lines) == 1 and msg in lines[0] and "internal error" not in lines[0], (argv, lines)


def test_stress_lib_honours_the_environment(capsys, tiny_model, tmp_path, monkeypatch):
    # without --lib, stress loads what every command loads: $PYLLAMA_KV_LIB (it used to be "patched")
    monkeypatch.setenv("PYLLAMA_KV_LIB", str(tmp_path / "from-env.so"))
    rc, lines, _ = _run(capsys, ["stress", str(tiny_model), "--steps", "2"])
    assert rc == EXIT_ERROR and len(lines) == 1 and "from-env.so" in lines[0] and "does not exist" in lines[0], lines
    help_text = cli_main.build_parser(["stress"])._subparsers._group_actions[0].choices["stress"].format_help()
    assert "PYLLAMA_KV_LIB" in help_text


@pytest.mark.parametrize("exc", [KeyError("boom"), ValueError("boom"), TypeError("boom")])
def test_a_bug_shows_its_traceback(capsys, tiny_model, monkeypatch, exc):
    # a bare ValueError or TypeError from our code is a bug, not a user's error: it is no longer
    # printed as if it were one
    import pyllama_kv.tools.gguf_inspect as g

    def inspect_gguf(*a, **k):
        raise exc

    monkeypatch.setattr(g, "inspect_gguf", inspect_gguf)
    rc = cli_main.main(["inspect", str(tiny_model)])
    err = capsys.readouterr().err
    assert rc == EXIT_ERROR
    assert "Traceback (most recent call last)" in err and "in inspect_gguf" in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"pyllama-kv inspect: error: internal error: {type(exc).__name__}: "), last
    assert "a bug in pyllama-kv" in last


def test_ctrl_c_exits_130(capsys, tiny_model, monkeypatch):
    import pyllama_kv.tools.gguf_inspect as g

    def inspect_gguf(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(g, "inspect_gguf", inspect_gguf)
    rc, lines, _ = _run(capsys, ["inspect", str(tiny_model)])
    assert rc == EXIT_INTERRUPTED and lines == ["pyllama-kv inspect: interrupted"], lines


def test_the_exit_code_table():
    from pyllama_kv import errors

    assert cli_main.exit_code(UsageError("x")) == EXIT_USAGE
    assert cli_main.exit_code(CLIError("x")) == EXIT_ERROR
    assert cli_main.exit_code(OSError("x")) == EXIT_ERROR
    for name, cls in vars(errors).items():
        if isinstance(cls, type) and issubclass(cls, BaseException):
            assert issubclass(cls, LlamaError), name
            assert cli_main.exit_code(cls("x")) == EXIT_ERROR, name
    for exc in (ValueError("x"), TypeError("x"), KeyError("x"), RuntimeError("x")):
        assert cli_main.exit_code(exc) is None


# the modules whose exception classes are public (raised to callers of the API, the harness or the CLI)
_PUBLIC_ERROR_MODULES = ("errors", "modelfile.gguf", "modelfile.catalogue", "modelfile.validate", "sampling.grammar",
                         "sampling.grammar_check", "chat.toolcall", "tools.gguf", "tools.gguf_inspect",
                         "harness.vendor",
                         "harness.patch", "harness.build", "harness.cuda", "cli.common")


@pytest.mark.parametrize("name", _PUBLIC_ERROR_MODULES)
def test_every_error_of_ours_is_a_llama_error(name):
    mod = importlib.import_module(f"pyllama_kv.{name}")
    found = [cls for _, cls in inspect.getmembers(mod, inspect.isclass)
             if issubclass(cls, BaseException) and cls.__module__.startswith("pyllama_kv")]
    for cls in found:
        assert issubclass(cls, LlamaError), f"{cls.__module__}.{cls.__qualname__} is not a LlamaError"
