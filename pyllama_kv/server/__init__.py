"""`pyllama-kv serve`: an OpenAI-compatible HTTP server over the generation engine.

One engine thread owns the context and the KV cache; the HTTP handlers (starlette on uvicorn) only
parse, tokenize, submit to the engine and relay its events (see app.py). ``ServerConfig`` is light;
the app itself needs the ``[server]`` extra (starlette, uvicorn, prometheus_client).
"""
from __future__ import annotations

from .config import ServerConfig

__all__ = ["ServerConfig"]
