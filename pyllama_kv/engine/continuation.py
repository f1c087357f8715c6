"""What the engine's loop keeps: one continuation's state (:class:`Continuation`), the engine's
counters (:class:`EngineStats`), and the log-probabilities of a draw (:func:`token_logprobs`).
Written by :mod:`.scheduler` alone (the one loop); read by the server's metrics and the tests. And
:func:`default_sampler`, how a continuation draws its tokens."""
from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from ..prefixcache.tiers import TierStats
from .detok import TextStream
from .request import FINISH_REASONS, Request
from .speculate import SeqSpec, SpecStats


@dataclass
class EngineStats:
    steps: int = 0
    decode_calls: int = 0
    step_seconds: float = 0.0     # wall time of the steps that decoded something (all of step())
    decode_seconds: float = 0.0   # of which in the KV layer's decode (llama_decode and its logits)
    prompt_tokens: int = 0        # prompt tokens of admitted requests (their length, as Usage.prompt_tokens)
    evaluated_tokens: int = 0     # prompt tokens decoded (including resumed continuations)
    reused_tokens: int = 0        # prompt tokens served from cached cells
    generated_tokens: int = 0
    submitted: int = 0
    admitted: int = 0
    finished: dict = field(default_factory=lambda: {r: 0 for r in FINISH_REASONS})
    preempted: int = 0
    slot_failures: int = 0        # batches refused although the free cells sufficed (vanilla)
    context_shifts: int = 0       # full sequences shifted instead of finished
    shifts_reevaluated: int = 0   # of which by re-evaluating the kept tail (no K-shift possible)
    dropped_tokens: int = 0       # tokens dropped by context shifts
    reevaluated_tokens: int = 0   # tokens decoded again after a shift (re-evaluation path)
    truncated_prompts: int = 0    # prompts cut to fit the context
    truncated_tokens: int = 0     # prompt tokens dropped by truncation
    rejected: int = 0             # submits refused with QueueFullError
    queue_peak: int = 0
    idle_page_outs: int = 0       # idle cached prefixes paged out for being idle too long (limits.IDLE_PAGE_OUT_TOKENS)
    # the KV layer's host tier of paged-out prefixes (live TierStats; None for a KV without one)
    prefix_tier: TierStats | None = None
    # speculation's counters (live SpecStats)
    spec: SpecStats | None = None

    def as_dict(self) -> dict:
        return asdict(self)


class Continuation:
    """One continuation: its sequence, the tokens still to decode, its sampler and text stream. (Not
    a "slot": that word is llama.cpp's, for where a batch's cells go, as in slot failures.)"""

    __slots__ = ("req", "index", "seq", "pending", "tokens", "generated", "stream", "sampler", "close_sampler",
                 "logits", "reserve", "forked", "admit_order", "last_token", "boundaries", "constraint",
                 "checkpoints", "spec", "valid")

    def __init__(self, req: Request, index: int, tokens: list[int], sampler, reserve: int, admit_order: int,
                 boundaries: list[int] | None = None):
        self.req = req
        self.index = index
        self.seq: Hashable | None = None
        self.tokens = tokens            # everything this continuation holds or will hold
        self.pending: list[int] = []    # the tail of ``tokens`` not decoded yet
        self.generated = 0
        self.stream = TextStream(req.stop)
        self.sampler, self.close_sampler = sampler
        self.logits: np.ndarray | int | None = None   # (an int: the token, chosen in the graph)
        self.reserve = reserve
        self.forked = index > 0 or req.n == 1
        self.admit_order = admit_order
        self.last_token: int | None = None
        self.boundaries = list(req.boundaries if boundaries is None else boundaries)   # turn starts in tokens
        # its own grammar matcher (forks too): what this continuation's tokens have matched so far
        self.constraint = req.grammar.constraint() if req.grammar is not None else None
        # positions where the KV layer keeps a checkpoint of the state while the prompt goes in
        # (a recurrent model: KVCache.checkpoints_at); a prompt chunk ends at each
        self.checkpoints: list[int] = []
        # speculation (engine/speculate.py): its drafts' state (None: none for this continuation), and
        # while a draft is verified the positions its sequence holds for it (the rest are removed)
        self.spec: SeqSpec | None = None
        self.valid: int | None = None

    @property
    def prefilling(self) -> bool:
        return len(self.pending) > 1 or (len(self.pending) == 1 and self.last_token is None)


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple:
    """(token, its log-probability, the ``top`` most likely (token, log-probability)) under the raw
    distribution of ``logits``: a log-softmax before temperature, truncation and any grammar (what
    OpenAI reports)."""
    x = np.asarray(logits, dtype=np.float64)
    m = float(np.max(x))
    lse = m + float(np.log(np.sum(np.exp(x - m))))
    alts: tuple = ()
    if top > 0:
        k = min(top, x.size)
        idx = np.argpartition(x, x.size - k)[x.size - k:]
        idx = idx[np.argsort(-x[idx], kind="stable")]
        alts = tuple((int(i), float(x[i] - lse)) for i in idx)
    return (int(token), float(x[token] - lse), alts)



def default_sampler(req: Request, index: int, ctx, seeds: Iterator[int]):
    """(logits -> token, closer) for continuation ``index`` of ``req``: greedy is an argmax in numpy,
    anything else llama.cpp's sampler chain over ``ctx``, seeded with the request's seed + the
    continuation's index (without a seed: the next of ``seeds``)."""
    p = req.params
    if p.greedy and not p.penalized:
        return (lambda logits: int(np.argmax(logits))), None
    from ..sampling.sampler import Sampler

    seed = (p.seed + index if p.seed is not None else next(seeds)) & 0xFFFFFFFF
    assert ctx is not None   # (submit refused the request otherwise)
    if p.penalized:   # logit bias and penalties: llama.cpp's samplers at the head of the chain
        from ..sampling.penalties import PenalizedSampler

        pen = PenalizedSampler(ctx, p, seed=seed, last_n=req.max_tokens)
        return pen.sample_logits, pen.close
    smp = Sampler(ctx, temp=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p, seed=seed)
    return smp.sample_logits, smp.close
