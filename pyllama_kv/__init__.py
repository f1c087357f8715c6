"""pyllama_kv: many sequences at once over a patched llama.cpp KV cache."""
from __future__ import annotations

__version__ = "0.1.0"
