"""The generation engine: one loop serving many requests over one KV cache (see scheduler.py)."""
from __future__ import annotations

from ..config import GREEDY, EngineConfig, SamplingParams
from .detok import TextStream
from .kv import ContextKV, HoldingKV, KVCache
from .request import FINISH_REASONS, Completion, Event, RequestHandle, Usage
from .scheduler import Engine, EngineStats

__all__ = ["Completion", "ContextKV", "Engine", "EngineConfig", "EngineStats", "Event", "FINISH_REASONS", "GREEDY",
           "HoldingKV", "KVCache", "RequestHandle", "SamplingParams", "TextStream", "Usage"]
