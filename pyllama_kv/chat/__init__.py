"""Chats: chat templates rendered in a sandbox (``templates``: jinja2's immutable sandbox with caps,
``sandbox``, rendered in worker processes of ``pyllama_kv._worker``), conversations that keep their
tokens across turns (``conversation``), and tool calls (``toolcall``: formats, the grammar that
forces a call, parsing).

May import: ``core``, ``sampling`` (the tools' grammars), ``modelfile`` (the GGUF reader),
``config``, ``limits``, ``errors``. Imported by ``engine``, ``server`` and the CLI.

The chat-template functions are also reachable here, as before the move (``pyllama_kv.chat.templates.
apply_chat_template``, ...): this package's names are loaded when first used, so that a worker
process that imports ``pyllama_kv.chat.sandbox`` imports nothing else."""
from __future__ import annotations

import importlib as _importlib
import typing as _typing

_TEMPLATES = ("apply_chat_template", "chat_template", "check_messages", "check_tools", "get_template_limits",
              "read_chat_template", "render", "set_template_limits", "tokenize_rendered", "Rendered",
              "TemplateFailure", "TemplateLimits")


def __getattr__(name: str) -> _typing.Any:
    if name in _TEMPLATES:
        value = getattr(_importlib.import_module(".templates", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
