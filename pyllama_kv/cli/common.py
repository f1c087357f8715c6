"""What every command shares: the user-facing errors, the phase that Ctrl-C reports, argument checks,
and opening a model."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from ..errors import LlamaError

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130       # 128 + SIGINT
EXIT_BROKEN_PIPE = 141       # 128 + SIGPIPE


class CLIError(LlamaError):
    """A user-facing error about the world the command met (a file, a model, a library): printed as
    one line, exit code EXIT_ERROR."""


class UsageError(CLIError):
    """The command line itself is wrong, whatever the files it names: flags that need another flag or
    exclude each other, a flag's value out of its range, a missing argument. One line, exit code
    EXIT_USAGE, as argparse's own errors."""


# what the command is doing, for the line main() prints when Ctrl-C stops it there
_phase: str | None = None


def set_phase(what: str | None) -> None:
    global _phase
    _phase = what


def phase() -> str | None:
    return _phase


def setup_logging(debug: bool) -> None:
    if debug:
        import logging

        logging.basicConfig(level=logging.DEBUG, format="%(name)s: %(message)s", stream=sys.stderr)


def positive(name: str, v: int | None, minimum: int = 1) -> None:
    """UsageError unless flag ``name``'s value ``v`` is None or at least ``minimum``."""
    if v is not None and v < minimum:
        raise UsageError(f"{name} must be at least {minimum}, got {v}")


#: the help of every MODEL argument
MODEL_HELP = ("a GGUF file, or a name: OWNER/REPO[:QUANT] or OWNER/REPO/FILE.gguf on Hugging Face, ollama:NAME, "
              "lmstudio:PATH (`pyllama-kv models --local`), or a catalogue name (`pyllama-kv models`)")


def open_model(path: str, lib: str | None, rpc: list[str] | None = None, validate: str | None = None,
               n_gpu_layers: int | None = None):
    """The model at ``path`` on library ``lib``; with ``rpc`` (the --rpc endpoints), every layer runs
    on those rpc-server processes; ``validate`` is the --validate level (None: the default);
    ``n_gpu_layers`` is -ngl (None: pk.Model's default, every layer on a GPU library)."""
    from ..modelfile.vetting import DEFAULT_VALIDATE

    _check_model_file(path, validate or DEFAULT_VALIDATE, rpc, n_gpu_layers)
    from .. import Model

    return Model(path, n_gpu_layers, lib=lib, rpc=rpc, validate=validate or DEFAULT_VALIDATE)


def _check_model_file(path: str, validate: str, rpc: list[str] | None, n_gpu_layers: int | None) -> None:
    """What pk.Model checks first, in its order, before importing it (numpy, the C declarations): a
    missing or unreadable file is reported without that cost, in the same words. Whatever it does not
    cover (--rpc, an -ngl out of range, --validate off) is left to pk.Model."""
    from ..limits import INT32_MAX
    from ..modelfile.names import resolve
    from ..modelfile.vetting import open_model_file, validate_level

    if rpc is not None or (n_gpu_layers is not None and not -1 <= n_gpu_layers <= INT32_MAX):
        return
    resolved = resolve(path)
    if validate_level(validate) != "off":
        os.close(open_model_file(resolved))


def open_draft_model(model, draft: str | None, trust_unverified: bool = False, validate: str | None = None):
    """``--draft-model``'s model (None without one), on ``model``'s library (its vocabulary is checked
    against the model's by the engine)."""
    if draft is None:
        return None
    from ..modelfile.names import resolve

    return open_model(str(resolve(draft, trust_unverified=trust_unverified)), model.library["path"],
                      validate=validate)


def check_ctx(model, n_ctx: int | None, flag: str = "--ctx") -> None:
    if n_ctx and n_ctx > model.n_ctx_train:
        raise CLIError(f"{flag} {n_ctx} is larger than the model supports (n_ctx_train {model.n_ctx_train})")


def context_size(model, n_ctx: int | None, flag: str = "--ctx") -> int:
    """The cells of the context a command makes: ``n_ctx`` (CLIError when the model supports fewer),
    or without one pyllama_kv.limits.default_n_ctx (the default, or the model's n_ctx_train if smaller)."""
    from ..limits import default_n_ctx

    check_ctx(model, n_ctx, flag)
    return n_ctx or default_n_ctx(model.n_ctx_train)


def check_output_file(out: str, what: str) -> Path:
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


def read_template(path: str | None) -> str | None:
    """The source of a ``--template FILE`` (None without one); CLIError when it cannot be read."""
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        raise CLIError(f"cannot read the template file: {path} is a directory")
    try:
        return p.read_text(encoding="utf-8")
    except OSError as exc:
        raise CLIError(f"cannot read the template file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise CLIError(f"cannot read the template file {path}: it is not UTF-8 text") from None


def chat_template(model, source: str | None = None, file: str | None = None):
    """The conversation's :class:`~pyllama_kv.chat.conversation.ChatTemplate`: the model's, or ``source``
    (read from the ``--template`` ``file``). CLIError naming --template when the model has none."""
    from ..chat.conversation import ChatTemplate

    if source is None and model.chat_template is None:
        raise CLIError(f"{model.path.name} has no chat template (no tokenizer.chat_template in the GGUF): "
                       "give one with --template FILE")
    return ChatTemplate(model, source, f"the template {file}" if file else None)


def add_lib_flag(parser) -> None:
    """``--lib``: which libllama the command loads; without it, what pk.Model loads ($PYLLAMA_KV_LIB,
    else the patched build), as in every command."""
    parser.add_argument("--lib", default=None, metavar="patched|vanilla|current|PATH",
                        help="libllama to use: patched (the mission pin with our series), vanilla (the same pin "
                             "without it), current (the current llama.cpp: `pyllama-kv build --pin current`) or a "
                             "path (default: $PYLLAMA_KV_LIB if set, else the one pip compiled into the package, else "
                             "patched; a model only the current llama.cpp loads, by its architecture or pre-tokenizer, "
                             "loads on current, said in one line)")


def add_deprecated_flag(parser, old: str, new: str, dest: str, **kw) -> None:
    """Accept ``old`` as a hidden alias of ``new`` (the value goes to ``dest``), with a warning on stderr."""

    class _Alias(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            print(f"pyllama-kv: {old} is deprecated, use {new}", file=sys.stderr)
            setattr(namespace, self.dest, values)

    parser.add_argument(old, dest=dest, action=_Alias, help=argparse.SUPPRESS, **kw)


def lib_label(lib: str | None) -> str:
    """A short name of the library ``lib`` (a --lib value, None: the default) names, for progress and tables."""
    name = lib or os.environ.get("PYLLAMA_KV_LIB") or "patched"
    return name if name in ("patched", "vanilla", "current") else Path(name).name
