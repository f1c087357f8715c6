"""`pyllama-kv`: the command line.

A registry of commands (one module each under ``commands/``, imported only when that command runs or
its help is asked for), the global flags, and the one place where exceptions become exit codes
(:func:`exit_code`, :data:`EXIT_CODES`):

==========================================================  ====  ==========================================
what                                                        exit  output on stderr
==========================================================  ====  ==========================================
a wrong command line: argparse's errors, UsageError         2     usage (argparse) or one line
(``--system`` without ``--chat``, a flag's value out of
range, ``-p`` with ``-f``, no prompt)
an error of ours: LlamaError (LibraryError,                 1     one line (a HarnessError adds its detail,
ModelLoadError, GGUFFileError, InvalidInputError, ...,            e.g. a patch's failing hunk)
HarnessError, CLIError)
OSError (a file or device: no space left, permission)       1     one line
Ctrl-C (KeyboardInterrupt)                                  130   the summary of what was done (run,
                                                                  stress, demo) or what it interrupted
a closed stdout (``| head``: BrokenPipeError)               141   nothing
anything else: a bug (a bare ValueError, TypeError,         1     the traceback, then one line saying it
KeyError... from our code)                                        is an internal error
==========================================================  ====  ==========================================

``--debug`` shows the traceback of every error (and llama.cpp's log).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Iterable, Sequence

from ..errors import HarnessError, LlamaError
from .common import EXIT_BROKEN_PIPE, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE, UsageError, phase, set_phase
from .render import log

#: command -> (module under commands/, one-line summary); the order of `pyllama-kv --help`
COMMANDS: dict[str, tuple[str, str]] = {
    "vendor": ("vendor", "fetch the pinned llama.cpp into vendor/llama.cpp (cached download)"),
    "patch": ("patch", "apply our KV-cache patch series to vendor/llama.cpp"),
    "build": ("build", "build libllama (patched by default, or --vanilla)"),
    "status": ("status", "pinned revision, vendor tree, patches and builds"),
    "run": ("run", "generate N continuations of a prompt at once (prefix copy + batched decode)"),
    "chat": ("chat", "chat with a model, multi-turn: each turn evaluates only the new messages"),
    "serve": ("serve", "an OpenAI-compatible HTTP server: many requests batched over one KV cache"),
    "inspect": ("inspect", "architecture, sizes, tensors, vocabulary and KV cache cost of a GGUF file"),
    "pull": ("pull", "fetch a model of the catalogue into ~/.cache/pyllama-kv/models (verified, cached)"),
    "models": ("models", "list the model catalogue and mark what is cached"),
    "tiny-model": ("tiny_model", "write the random-weight tiny llama model the tests use"),
    "stress": ("stress", "a seeded server-like workload that fragments the cache; failures, defrags, speed"),
    "demo": ("demo", "the main job on the real model: vanilla vs patched under load, chat answers forked, KV stats"),
}


def command_module(name: str):
    return importlib.import_module(f"{__package__}.commands.{COMMANDS[name][0]}")


def _version_text() -> str:
    """The package version, the pinned llama.cpp revision and our patches (from the checkout, or the
    copies inside an installed package), and where the library would be loaded from."""
    from .. import __version__, _paths
    from .._native import locate

    try:  # the pin file, read without importing the harness
        rev = str(json.loads(_paths.pin_path().read_text())["revision"])[:12]
    except Exception:
        rev = "?"
    patches = sorted(p.stem for p in _paths.patches_dir().glob("[0-9]*.patch"))
    lines = [f"pyllama-kv {__version__}", f"llama.cpp {rev} (pinned) + {len(patches)} KV-cache patches:"]
    lines += [f"  {p}" for p in patches]
    try:
        path, info = locate.resolve()
        lines.append(f"library: {path} ({info.get('origin')}, {info.get('variant')}, {info.get('backend')})")
    except Exception as exc:  # no library yet: --version still answers
        lines.append(f"library: none found ({str(exc).splitlines()[0]})")
    return "\n".join(lines)


class _Version(argparse.Action):
    """--version, worked out only when asked for."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(_version_text())  # on stdout, as argparse's own version action does
        parser.exit()


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser, with the full options of ``commands`` (default: all of them); the others are
    listed with their summary only, so that their modules are not imported."""
    full = set(COMMANDS if commands is None else commands)
    p = argparse.ArgumentParser(
        prog="pyllama-kv",
        description="Run GGUF models with many sequences at once over a patched llama.cpp KV cache.",
        epilog="Run `pyllama-kv COMMAND --help` for each command's options.",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks and llama.cpp's log")
    p.add_argument("--version", action=_Version,
                   help="show the version, the pinned llama.cpp revision, our patches and the library in use, and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show tracebacks and llama.cpp's log")
    add_parser = sub.add_parser

    def add_command_parser(name, **kw):   # every command: --debug after it too, and its summary as help
        kw.setdefault("help", COMMANDS[name][1])
        return add_parser(name, parents=[common], **kw)

    sub.add_parser = add_command_parser  # type: ignore[method-assign]
    for name, (_, summary) in COMMANDS.items():
        if name in full:
            command_module(name).register(sub)
        else:
            sub.add_parser(name, description=summary, add_help=False)
    return p


def _command_in(argv: Sequence[str]) -> str | None:
    """The command named in ``argv``: its first word that is not a flag (the global flags take no value)."""
    for a in argv:
        if a == "--":
            return None
        if not a.startswith("-"):
            return a
    return None


# ---------------------------------------------------------------------------------------------
# errors: the one place an exception becomes the CLI's output and exit code


#: exception class -> exit code, the first match wins; an exception that matches none is a bug
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (UsageError, EXIT_USAGE),     # the command line is wrong (a CLIError, so before LlamaError)
    (LlamaError, EXIT_ERROR),     # every error of ours (errors.py): the API's, the harness's, CLIError
    (OSError, EXIT_ERROR),        # a file or device: not found, permission, no space left
)


def exit_code(exc: BaseException) -> int | None:
    """The exit code of an error the user can act on (EXIT_CODES), or None: a bug."""
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return None


def _report_error(command: str | None, exc: BaseException) -> int:
    """An error of ours (or an OSError): one line on stderr (a harness error adds its detail, e.g. a
    patch's failing hunk), its exit code. Anything else is a bug: its traceback, then one line that
    says so, exit EXIT_ERROR."""
    import traceback

    code = exit_code(exc)
    msg = str(exc).strip()
    first, _, rest = msg.partition("\n")
    if code is None:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        log(f"pyllama-kv {command}: error: internal error: {type(exc).__name__}" + (f": {first}" if first else "")
            + " (a bug in pyllama-kv: the traceback above says where)")
        return EXIT_ERROR
    log(f"pyllama-kv {command}: error: {first or type(exc).__name__}")
    if rest and isinstance(exc, HarnessError):
        log(rest)
    return code


def _quiet_stdout() -> None:
    """After a broken pipe: stdout goes to /dev/null, so that the exit-time flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    name = _command_in(argv)
    parser = build_parser([name] if name in COMMANDS else [])
    args = parser.parse_args(argv)
    if not hasattr(args, "debug"):
        args.debug = False
    if not args.command:
        parser.print_help()
        return EXIT_USAGE
    set_phase(None)
    try:  # paths given as non-UTF-8 bytes are printed back as those bytes, not a UnicodeEncodeError
        sys.stdout.reconfigure(errors="surrogateescape")  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):  # not a text stream of ours (tests, pipes replaced)
        pass
    try:
        return int(command_module(args.command).run(args) or 0)
    except KeyboardInterrupt:
        log(f"pyllama-kv {args.command}: interrupted" + (f" while {phase()}" if phase() else ""))
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `pyllama-kv ... | head`: the reader has gone; end quietly, as cat does
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    except Exception as exc:
        if args.debug:
            raise
        return _report_error(args.command, exc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
