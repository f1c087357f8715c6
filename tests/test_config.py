"""One source of truth for options and limits (pyllama_kv.limits, pyllama_kv.config): the configs share
their KV cache fields instead of copying them, and every default and bound that appears in more than
one place agrees with the one definition. No model needed."""
from __future__ import annotations

import inspect
import subprocess
import sys
from dataclasses import fields

import pytest

from pyllama_kv import limits
from pyllama_kv.config import CacheConfig, ContextConfig, EngineConfig, SamplingParams
from pyllama_kv.errors import InvalidInputError
from pyllama_kv.modelfile.gguf import GGML_TYPES


def _names(cls) -> list[str]:
    return [f.name for f in fields(cls)]


def test_configs_extend_the_cache_config_instead_of_copying_it():
    from pyllama_kv.tools.workload import StressConfig

    cache = _names(CacheConfig)
    for cls in (ContextConfig, EngineConfig, StressConfig):
        assert issubclass(cls, CacheConfig)
        assert _names(cls)[:len(cache)] == cache
        for name in cache:   # the defaults are the cache config's
            assert getattr(cls(), name) == getattr(CacheConfig(), name), (cls, name)
    # the engine's context: its cache fields, parallel + prefix_cache sequence ids
    e = EngineConfig(n_ctx=256, parallel=3, prefix_cache=2, n_batch=128, n_ubatch=64, n_threads=2, type_k="f32")
    c = e.context()
    assert c.cache_kwargs() == e.cache_kwargs() and c.n_seq_max == 5
    # the old keywords still work, and the workload's engine is made from its cache fields
    s = StressConfig(parallel=4, n_ctx=512, steps=3, seed=1, sequential=True, n_threads=1)
    assert s.cache_kwargs()["n_ctx"] == 512 and s.n_threads == 1


def test_the_defaults_agree():
    from pyllama_kv.core.context import Context
    from pyllama_kv.core.model import Model
    from pyllama_kv.sampling.sampler import Sampler
    from pyllama_kv.tools.workload import StressConfig

    for fn in (Context.__init__, Model.context):
        for name, p in inspect.signature(fn).parameters.items():
            if p.default is not inspect.Parameter.empty:
                assert p.default == getattr(ContextConfig(), name), (fn, name)
    sp = SamplingParams()
    smp = inspect.signature(Sampler.__init__).parameters
    assert (smp["temp"].default, smp["top_k"].default, smp["top_p"].default, smp["min_p"].default) == \
        (sp.temperature, sp.top_k, sp.top_p, sp.min_p)
    assert ContextConfig().n_ctx == EngineConfig().n_ctx == StressConfig().n_ctx == limits.DEFAULT_N_CTX
    # on purpose: the workload reserves fewer output cells, so that the cache fills and fragments
    assert StressConfig().output_reserve < EngineConfig().output_reserve


def test_kv_cache_types_are_ggmls():
    from pyllama_kv._native import ffi

    assert list(limits.KV_CACHE_TYPES) == ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
    for name, t in limits.KV_CACHE_TYPES.items():
        tname, block, size = GGML_TYPES[t]
        assert tname == name
        assert (name in limits.QUANTIZED_KV_TYPES) == (block > 1)
        assert limits.kv_type_block(name) == block and limits.kv_type_size(name) == size / block
    assert ffi.GGML_TYPES is limits.KV_CACHE_TYPES and ffi.QUANTIZED_TYPES is limits.QUANTIZED_KV_TYPES
    with pytest.raises(InvalidInputError, match="not a KV cache type: one of f32, f16"):
        ContextConfig(type_k="q6_K")
    with pytest.raises(InvalidInputError, match="needs flash_attn"):
        EngineConfig(type_v="q8_0", flash_attn=False)
    assert EngineConfig(type_v="q8_0").flash_attn is None   # auto: a context turns it on for a quantized V
    assert ContextConfig(type_k="q8_0", type_v="q4_0", flash_attn=True).type_v == "q4_0"


def test_limits_are_applied_once():
    # sequence ids: a context's n_seq_max, an engine's parallel + prefix_cache
    assert ContextConfig(n_seq_max=limits.MAX_SEQUENCES).n_seq_max == limits.MAX_SEQUENCES
    assert EngineConfig(parallel=limits.MAX_SEQUENCES, prefix_cache=0).context().n_seq_max == limits.MAX_SEQUENCES
    for bad in (dict(n_seq_max=limits.MAX_SEQUENCES + 1), dict(n_threads=limits.MAX_THREADS + 1),
                dict(n_ubatch=0), dict(flash_attn="yes"), dict(defrag_thold=float("nan")),
                dict(n_ctx=limits.INT32_MAX + 1)):
        with pytest.raises(InvalidInputError):
            ContextConfig(**bad)
    with pytest.raises(InvalidInputError, match="parallel \\+ prefix_cache"):
        EngineConfig(parallel=limits.MAX_SEQUENCES, prefix_cache=1)
    # the batch within the context, once, for every config
    for cfg in (ContextConfig(n_ctx=64), EngineConfig(n_ctx=64).context()):
        assert (cfg.n_batch, cfg.n_ubatch) == (64, 64)
    # and the graph within the batch (llama.cpp's rule; EngineConfig(n_batch=32) used to be the only one)
    for cfg in (ContextConfig(n_batch=32), EngineConfig(n_batch=32), EngineConfig(n_batch=32).context()):
        assert (cfg.n_batch, cfg.n_ubatch) == (32, 32)
    assert ContextConfig(defrag_thold=5).defrag_thold == 5.0   # any finite number, as llama.cpp takes
    # the library's temperature range is wider than OpenAI's (on purpose: see limits)
    assert SamplingParams(temperature=limits.TEMPERATURE_MAX).temperature == limits.TEMPERATURE_MAX
    assert limits.OPENAI_TEMPERATURE_MAX < limits.TEMPERATURE_MAX
    for kw in (dict(temperature=limits.TEMPERATURE_MAX + 1), dict(presence_penalty=limits.PENALTY_MAX + 0.1),
               dict(repeat_penalty=0), dict(logit_bias={1: limits.LOGIT_BIAS_MAX + 1}),
               dict(seed=limits.UINT32_MAX + 1)):
        with pytest.raises(InvalidInputError):
            SamplingParams(**kw)


def test_default_n_ctx_and_prompt_fit():
    assert limits.default_n_ctx(4096) == limits.DEFAULT_N_CTX
    assert limits.default_n_ctx(512) == 512
    assert limits.prompt_too_long(7, 8) is None
    why = limits.prompt_too_long(8, 8)
    assert why is not None and "8 tokens" in why and "holds 8" in why


def test_limits_and_config_import_no_numpy():
    code = "import sys, pyllama_kv.limits, pyllama_kv.config; print('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_the_flash_attn_flag_maps_onto_the_configs():
    import argparse

    from pyllama_kv.cli import options
    from pyllama_kv.cli.common import UsageError

    p = argparse.ArgumentParser()
    options.add(p, "flash_attn", "type_v")
    assert options.from_args(EngineConfig, p.parse_args([])).flash_attn is None   # auto
    assert options.from_args(EngineConfig, p.parse_args(["--flash-attn", "on"])).flash_attn is True
    assert options.from_args(ContextConfig, p.parse_args(["--flash-attn", "off"])).flash_attn is False
    # a quantized V cache needs it: a usage error that names the flag's value
    assert options.from_args(EngineConfig, p.parse_args(["--flash-attn", "on", "--type-v", "q8_0"])).type_v == "q8_0"
    with pytest.raises(UsageError, match="flash_attn"):
        options.from_args(EngineConfig, p.parse_args(["--flash-attn", "off", "--type-v", "q8_0"]))
    assert options.from_args(EngineConfig, p.parse_args(["--flash-attn", "auto"])).flash_attn is None
    with pytest.raises(SystemExit):
        p.parse_args(["--flash-attn", "maybe"])
