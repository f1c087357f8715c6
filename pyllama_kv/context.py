"""Moved to :mod:`pyllama_kv.core.context` (issue 31): this path works until the next release."""
from ._moved import alias

alias(__name__, "pyllama_kv.core.context")
