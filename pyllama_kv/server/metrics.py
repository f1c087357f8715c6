"""``GET /metrics``: Prometheus text from prometheus_client, in a registry of the server's own.

The KV cache and the engine's counters are read from a :class:`Snapshot` that the engine takes when
asked, between two steps (``Engine.between_steps(Snapshot.take)``, as llama.cpp's server answers its
metrics task): the HTTP thread never calls into the context while the engine decodes, and an engine
nobody asks pays nothing. Latencies are histograms observed by the handlers.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..errors import LlamaError

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_P = "pyllama_kv_"
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, float("inf"))


@dataclass(frozen=True)
class Snapshot:
    """The engine and its cache between two steps (taken on the engine thread)."""

    kv: dict = field(default_factory=dict)        # KVStats.as_dict()
    stats: dict = field(default_factory=dict)     # EngineStats.as_dict()
    running_requests: int = 0
    running_sequences: int = 0
    waiting: int = 0
    at: float = 0.0
    embeddings: dict | None = None                # Engine.embedding_stats() (None: none asked for yet)

    @classmethod
    def take(cls, engine) -> Snapshot:
        """The snapshot of ``engine`` now: call it between steps (``engine.between_steps(Snapshot.take)``)."""
        try:
            kv = engine.kv.kv_stats()
        except LlamaError:   # a closed context (the server is shutting down): nothing to report
            kv = {}
        return cls(kv=kv, stats=engine.stats.as_dict(), running_requests=engine.running_requests,
                   running_sequences=engine.running, waiting=engine.waiting, at=time.time(),
                   embeddings=engine.embedding_stats())

    @classmethod
    async def ask(cls, engine) -> Snapshot:
        """Ask ``engine`` for a snapshot between two steps and await it (the event loop is not blocked)."""
        return await asyncio.wrap_future(engine.between_steps(cls.take))


class _EngineCollector:
    """Gauges and counters from the latest snapshot."""

    def __init__(self, server) -> None:
        self.server = server

    def collect(self):
        s: Snapshot = self.server.snapshot
        kv, st = s.kv, s.stats
        if kv:
            yield from _kv_metrics(kv)
        if st:
            yield from _engine_metrics(st)
            tier = st.get("prefix_tier") or {}
            if tier.get("enabled"):   # idle prefixes paged out (EngineConfig.cache_ram, cache_dir)
                yield from _host_metrics(tier)
                if tier.get("disk_budget_bytes"):   # and to files in --cache-dir
                    yield from _disk_metrics(tier, _gauge, _counter)
        yield from _embedding_metrics(s.embeddings or {})
        yield _gauge("requests_running", "requests generating or evaluating their prompt", s.running_requests)
        yield _gauge("sequences_running", "continuations holding a sequence", s.running_sequences)
        yield _gauge("requests_queued", "requests waiting for admission", s.waiting)
        yield from _router_metrics(s)


def _router_metrics(s: Snapshot):
    """The three gauges a cache-aware router reads (llm-d's, Dynamo's, Ray's), under vLLM's names too."""
    usage = s.kv["request_cells"] / s.kv["n_cells"] if s.kv and s.kv.get("n_cells") else 0.0
    yield _gauge("kv_usage", "the share of KV cells running requests hold (idle cached prefixes count as free: "
                 "they are evicted for a request), 0..1", usage)
    for name, doc, value in (("num_requests_running", "requests generating or evaluating their prompt",
                              s.running_requests),
                             ("num_requests_waiting", "requests waiting for admission", s.waiting),
                             ("kv_cache_usage_perc", "pyllama_kv_kv_usage, 0..1", usage)):
        yield GaugeMetricFamily("vllm:" + name, doc + " (vLLM's name, for routers)", value=value)


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(_P + name, doc, value=value)


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(_P + name, doc, value=value)


def _kv_metrics(kv: dict):
    """The KV cache's gauges, and the patched library's defrag counters (KVStats)."""
    yield _gauge("kv_cells", "KV cache cells", kv["n_cells"])
    yield _gauge("kv_used_cells", "KV cache cells held by a sequence (running or cached prefixes)",
                 kv["used_cells"])
    yield _gauge("kv_cached_cells", "KV cache cells held by idle cached prefixes (kept for reuse; evicted "
                 "when a request needs the room)", kv["cached_cells"])
    yield _gauge("kv_request_cells", "KV cache cells held by running requests alone (0 when idle: nothing "
                 "leaks)", kv["request_cells"])
    yield _gauge("kv_free_cells", "KV cache cells no sequence holds", kv["free_cells"])
    yield _gauge("kv_largest_free_block", "largest run of free cells (the biggest batch that fits without "
                 "a defrag)", kv["largest_free_block"])
    yield _gauge("kv_fragmentation", "1 - largest free block / free cells (0: the free cells are contiguous)",
                 kv["fragmentation"])
    yield _gauge("kv_holes", "runs of free cells followed by a used cell", kv["holes"])
    for key, name, doc in (("defrags", "kv_defrags", "defrags the patched library ran"),
                           ("moves", "kv_defrag_moves", "block moves of those defrags"),
                           ("cells_moved", "kv_defrag_cells_moved", "cells moved by those defrags"),
                           ("slot_retries", "kv_slot_retries",
                            "batches the patched library placed after a defrag (a vanilla build fails them)"),
                           ("slot_failures", "kv_library_slot_failures",
                            "batches the patched library could not place")):
        if kv.get(key) is not None:   # patched build only
            yield _counter(name, doc, kv[key])
    if kv.get("checkpoints") is not None:   # a hybrid or sliding-window model (PrefixCache.checkpoint_stats)
        yield _gauge("prefix_checkpoints", "checkpoints the prefix cache keeps where prompts branch (a recurrent "
                     "state, or an idle sequence of the branch's tokens under a sliding window)", kv["checkpoints"])
        yield _gauge("prefix_checkpoint_bytes", "host memory of the recurrent states kept as checkpoints",
                     kv["checkpoint_bytes"])
        yield _counter("prefix_checkpoint_forks", "prompts forked from a checkpoint", kv["checkpoint_forks"])


def _engine_metrics(st: dict):
    """The engine's counters (EngineStats)."""
    yield _counter("slot_failures", "batches refused although the free cells sufficed (fragmentation; "
                   "their prompts fail with an error)", st["slot_failures"])
    fin = CounterMetricFamily(_P + "finished", "continuations finished, by reason (a request with n=3 "
                              "counts 3)", labels=["reason"])
    for reason, v in st["finished"].items():
        fin.add_metric([reason], v)
    yield fin
    yield _counter("requests_submitted", "requests accepted by the engine", st["submitted"])
    yield _counter("requests_rejected", "requests refused because the queue was full (HTTP 429)",
                   st["rejected"])
    yield _counter("preempted", "continuations put back in the queue because the cache was full",
                   st["preempted"])
    yield _counter("idle_page_outs", "idle cached prefixes paged out to the host tier after 32 tokens decoded "
                   "without them (their cells cost every token an attention pass)", st["idle_page_outs"])
    yield _counter("prompt_tokens", "prompt tokens of admitted requests", st["prompt_tokens"])
    yield _counter("prompt_tokens_evaluated", "prompt tokens decoded", st["evaluated_tokens"])
    yield _counter("prompt_tokens_reused", "prompt tokens served from cached cells (not evaluated)",
                   st["reused_tokens"])
    yield _counter("completion_tokens", "tokens generated", st["generated_tokens"])
    yield _counter("decode_calls", "llama_decode calls", st["decode_calls"])
    yield _counter("step_seconds", "wall time of the engine's steps that decoded something (admission, "
                   "page-outs and restores, the decode, sampling and streaming)", st["step_seconds"])
    yield _counter("decode_seconds", "of which in llama_decode (and the copy of its logits)", st["decode_seconds"])
    yield from _spec_metrics(st.get("spec") or {})


def _spec_metrics(spec: dict):
    """Speculative decoding's counters (engine/speculate.py's SpecStats), by draft source."""
    on = GaugeMetricFamily(_P + "spec_on", "speculative decoding: 1 where it runs (the draft sources; the reason "
                           "when the model cannot: recurrent layers)", labels=["sources", "off_reason"])
    on.add_metric([spec.get("sources", "none"), spec.get("off_reason", "")],
                  float(spec.get("sources", "none") != "none" and not spec.get("off_reason")))
    yield on
    yield _counter("spec_steps", "verifications: a continuation's drafted tokens checked in a decode",
                   spec.get("steps", 0))
    for key, name, doc in (("drafted", "spec_drafted_tokens", "drafted tokens decoded and verified"),
                           ("accepted", "spec_accepted_tokens", "drafted tokens kept (each a decode step saved)")):
        fam = CounterMetricFamily(_P + name, doc, labels=["source"])
        for source, v in (spec.get("by_source") or {}).items():
            fam.add_metric([source], v.get(key, 0))
        yield fam


def _embedding_metrics(st: dict):
    """The embedding counters (engine/embeddings.py's EmbeddingStats; zero before the first request)."""
    for key, name, doc in (("requests", "embedding_requests", "embedding and rerank requests answered"),
                           ("inputs", "embedding_inputs", "inputs embedded (texts, token lists, rerank pairs)"),
                           ("tokens", "embedding_tokens", "tokens decoded for embeddings"),
                           ("decode_calls", "embedding_decode_calls", "embedding decodes (many inputs each)"),
                           ("rejected", "embedding_requests_rejected", "embedding requests refused because "
                            "their queue was full (HTTP 429)"),
                           ("cancelled", "embedding_requests_cancelled", "embedding requests dropped because "
                            "their client went away")):
        yield _counter(name, doc, st.get(key, 0))
    yield _gauge("embedding_requests_queued", "embedding requests waiting", st.get("waiting", 0))


def _host_metrics(tier: dict):
    """The host tier's gauges and counters (TierStats)."""
    yield _gauge("prefix_host_bytes", "K/V bytes of prefixes paged out to host memory",
                 tier["host_bytes"])
    yield _gauge("prefix_host_budget_bytes", "the bound on those bytes (--cache-ram)", tier["budget_bytes"])
    yield _gauge("prefix_host_tokens", "tokens whose K/V is paged out to host memory", tier["host_tokens"])
    yield _counter("prefix_paged_out_tokens", "tokens paged out of the KV cache", tier["paged_out_tokens"])
    yield _counter("prefix_paged_out_bytes", "bytes paged out of the KV cache", tier["paged_out_bytes"])
    yield _counter("prefix_restores", "prompts that restored paged-out prefixes", tier["restores"])
    yield _counter("prefix_restored_tokens", "prompt tokens restored from host memory or disk "
                   "(not evaluated)", tier["restored_tokens"])
    yield _counter("prefix_page_out_seconds", "wall time of page-outs (the copies out of the KV cache)",
                   tier["page_out_seconds"])
    yield _counter("prefix_restore_seconds", "wall time of restores from host memory or disk",
                   tier["restore_seconds"])
    yield _counter("prefix_host_evicted_bytes", "paged-out bytes dropped for the host budget",
                   tier["evicted_bytes"])
    yield _counter("prefix_page_outs_skipped", "evicted prefixes dropped, not paged out: evaluating them "
                   "again was measured cheaper (a cache in device memory)", tier["page_outs_skipped"])
    yield _gauge("eval_token_seconds", "the measured cost of evaluating one more token in a batch "
                 "(0: not measured yet)", tier["eval_token_seconds"])


def _disk_metrics(tier: dict, gauge, counter):
    """The disk tier's gauges and counters (TierStats' ``disk_*``)."""
    yield gauge("prefix_disk_bytes", "bytes of the span files in --cache-dir (any model's)", tier["disk_bytes"])
    yield gauge("prefix_disk_budget_bytes", "the bound on those bytes (--cache-dir-mib)", tier["disk_budget_bytes"])
    yield gauge("prefix_disk_files", "span files in --cache-dir (any model's)", tier["disk_files"])
    yield gauge("prefix_disk_tokens", "tokens whose K/V this model's span files hold", tier["disk_tokens"])
    yield counter("prefix_disk_writes", "span files written", tier["disk_writes"])
    yield counter("prefix_disk_written_bytes", "bytes of span files written", tier["disk_written_bytes"])
    yield counter("prefix_disk_write_errors", "span files that could not be written", tier["disk_write_errors"])
    yield counter("prefix_disk_not_stored", "spans larger than the directory's bound (not written)",
                  tier["disk_not_stored"])
    yield counter("prefix_disk_evictions", "span files deleted for the directory's bound, least recently used "
                  "first", tier["disk_evicted_files"])
    yield counter("prefix_disk_hits", "spans restored from a file (a file that shares only a prefix with the "
                  "prompt serves that prefix)", tier["disk_hits"])
    yield counter("prefix_disk_misses", "prompts that the disk was asked to continue and could not",
                  tier["disk_misses"])
    yield counter("prefix_disk_corrupt", "span files refused (corrupt, truncated, another model or version): "
                  "deleted, counted as misses too", tier["disk_corrupt"])
    yield counter("prefix_disk_restored_tokens", "prompt tokens restored from disk (not evaluated)",
                  tier["disk_restored_tokens"])


class Metrics:
    """The registry: the engine's snapshot, and the latency histograms and the HTTP counters the
    handlers fill."""

    def __init__(self, server) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(server))
        self.ttft = Histogram(_P + "time_to_first_token_seconds", "seconds from submit to the first token",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.latency = Histogram(_P + "request_duration_seconds", "seconds from the request's arrival to its "
                                 "last token", buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.client_disconnects = Counter(_P + "client_disconnects", "requests whose client went away before "
                                          "its answer, by stage (body: while sending its request body; "
                                          "preparing: while its grammar was compiled; "
                                          "generating: while it was being answered; embedding: while its "
                                          "inputs were waiting or embedded)", ["stage"],
                                          registry=self.registry)
        for stage in ("body", "preparing", "generating", "embedding"):
            self.client_disconnects.labels(stage)
        self.http_requests = Counter(_P + "http_requests", "HTTP requests answered, by endpoint (its path) and "
                                     "status (a stream counts its 200 when it starts)", ["endpoint", "status"],
                                     registry=self.registry)
        self.internal_errors = Counter(_P + "internal_errors", "requests answered 500 because of an unexpected "
                                       "error (its traceback is in the server's log)", registry=self.registry)

    def text(self) -> bytes:
        return generate_latest(self.registry)
