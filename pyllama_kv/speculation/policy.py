"""The cost rule: how many draft tokens each continuation gets in a step (issue 47, item 6).

A step decodes ``B`` tokens (prompt chunks and one token per generating continuation) and yields one
token per generating continuation. Drafting ``k`` more tokens for a continuation whose drafted tokens
are each accepted with probability ``a`` (in order: the j-th is kept only if all before it were) yields
``a + a^2 + ... + a^k`` more tokens on average, and makes the decode ``B + k`` tokens long. So a step
takes the draft tokens in order of their expected gain ``a^j`` (over every continuation at once) and
stops where one more would lower the step's expected tokens per second,
``(generating + gains) / seconds(B + drafted)``, and takes none unless that beats the step without
drafts by ``MIN_GAIN`` (the numbers are estimates). A step's seconds are the whole step's (drafting,
the decode, sampling and verifying every row). On this 2-core CPU a token in the batch costs about half
a decode step, so only drafts accepted most of the time are worth it; on a GPU, where a step of 8
tokens costs about one of 1, far more are. Nothing is drafted where it does not pay: a load without
repetition runs as without speculation.

* :class:`BatchCost`: seconds a decode of B tokens takes here, learned from the engine's decodes (an
  exponentially weighted mean per size, between and past the sizes seen: the line through them). A
  test gives it costs instead of timings.
* :class:`Acceptance`: how often drafted tokens are accepted, per source and match length (a longer
  match is trusted more), learned from every verification, lowered by each continuation's own recent
  acceptance where that is worse (so a continuation whose drafts keep failing stops getting them).
* :class:`SpecPolicy`: both, and :meth:`SpecPolicy.allocate`. Until two batch sizes were measured it
  cannot weigh a draft: every ``EXPLORE_EVERY`` steps it lets a few draft tokens through (that
  measures the cost of a longer batch and the acceptance).
"""
from __future__ import annotations

import bisect
import heapq
from collections.abc import Hashable, Sequence

__all__ = ["Acceptance", "BatchCost", "SeqAcceptance", "SpecPolicy"]

#: match-length buckets of Acceptance (a draft found by a match of at least these many tokens)
MATCH_BUCKETS = (0, 4, 8, 16, 32)
#: the prior acceptance of a drafted token per bucket, before any verification (pseudo-counts PRIOR_N)
PRIOR_RATE = (0.3, 0.45, 0.6, 0.7, 0.8)
PRIOR_N = 4.0
#: a count's weight halves after this many verifications of its bucket
HALF_LIFE = 64
#: a continuation's own history weighs like this many drafted tokens of the bucket's rate
OWN_PRIOR = 6.0
#: steps (with a draft on offer) between exploratory drafts, each making the decode one of the batch
#: sizes of EXPLORE_SIZES not measured yet: a CPU's cost is not a line (SmolLM2 here: 16 tokens took
#: 107 ms, 12 took 123 ms, 1 took 16 ms), so the sizes a rule may take are measured, not guessed
EXPLORE_EVERY = 8
EXPLORE_SIZES = (2, 4, 8, 16, 32)
#: a probe adds at most this many draft tokens to the batch, or doubles it if that is more
EXPLORE_MAX = 8
#: the weight of the newest decode in a size's mean
COST_WEIGHT = 0.25
#: drafts are taken only when the step's expected tokens per second beat the step without them by this
#: share: the costs and rates are estimates (a busy 2-core CPU's step times swing by 10%), and a draft
#: taken on an estimate's error is a loss, so a marginal gain is left alone
MIN_GAIN = 0.05


class BatchCost:
    """Seconds a decode of ``B`` tokens takes: a weighted mean of the decodes of each size seen, and
    between or past those sizes the line through the nearest two (never below the smaller's time)."""

    def __init__(self) -> None:
        self._t: dict[int, float] = {}
        self._sizes: list[int] = []

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or seconds <= 0.0:
            return
        old = self._t.get(tokens)
        if old is None:
            bisect.insort(self._sizes, tokens)
            self._t[tokens] = seconds
        else:
            self._t[tokens] = old + COST_WEIGHT * (seconds - old)

    @property
    def known(self) -> int:
        """How many batch sizes were measured."""
        return len(self._sizes)

    @property
    def measured(self) -> frozenset[int]:
        """The batch sizes measured."""
        return frozenset(self._t)

    def seconds(self, tokens: int) -> float | None:
        """The estimate for a decode of ``tokens`` tokens; None while fewer than two sizes were seen
        (one size says nothing about what one more token costs), unless it is that size."""
        t = self._t.get(tokens)
        if t is not None:
            return t
        s = self._sizes
        if len(s) < 2:
            return None
        i = bisect.bisect_left(s, tokens)
        lo, hi = (s[0], s[1]) if i == 0 else (s[-2], s[-1]) if i >= len(s) else (s[i - 1], s[i])
        tl, th = self._t[lo], self._t[hi]
        slope = max(0.0, (th - tl) / (hi - lo))
        return max(1e-9, tl + slope * (tokens - lo))


class Acceptance:
    """Decayed counts of drafted tokens accepted and tried, per (source, match bucket)."""

    def __init__(self) -> None:
        self._keep = 0.5 ** (1.0 / HALF_LIFE)
        self._c: dict[tuple[str, int], list[float]] = {}

    @staticmethod
    def bucket(match: int) -> int:
        return bisect.bisect_right(MATCH_BUCKETS, match) - 1

    def rate(self, source: str, match: int) -> float:
        b = self.bucket(match)
        acc, tried = self._c.get((source, b), (0.0, 0.0))
        return (acc + PRIOR_N * PRIOR_RATE[b]) / (tried + PRIOR_N)

    def observe(self, source: str, match: int, drafted: int, accepted: int) -> None:
        """A verification of ``drafted`` tokens kept the first ``accepted``: that many accepted, and one
        refused unless all were kept."""
        c = self._c.setdefault((source, self.bucket(match)), [0.0, 0.0])
        c[0] = c[0] * self._keep + accepted
        c[1] = c[1] * self._keep + accepted + (1 if accepted < drafted else 0)


class SeqAcceptance:
    """One continuation's own recent record (decayed like Acceptance's), which can lower the bucket's
    rate for it, never raise it (:meth:`blend`)."""

    __slots__ = ("acc", "tried")

    def __init__(self) -> None:
        self.acc = 0.0
        self.tried = 0.0

    def observe(self, drafted: int, accepted: int) -> None:
        k = 0.5 ** (1.0 / 16)
        self.acc = self.acc * k + accepted
        self.tried = self.tried * k + accepted + (1 if accepted < drafted else 0)

    def blend(self, bucket_rate: float) -> float:
        """The bucket's rate, lowered by this continuation's own record where that is worse, never
        raised by it: a record earned on long matches (a copied file: 99%) says nothing of the same
        continuation's short ones (a 3-token match in it: about half), and taking those at the record's
        rate wastes a step's batch (measured on the code load: 17% of drafted tokens refused)."""
        return min(bucket_rate, (self.acc + OWN_PRIOR * bucket_rate) / (self.tried + OWN_PRIOR))


class SpecPolicy:
    """The cost rule of an engine (see the module docstring): ``cost`` and ``acceptance`` are learned
    as it runs (the engine reports each decode and each verification); :meth:`allocate` decides."""

    def __init__(self, max_draft: int = 16) -> None:
        self.max_draft = max_draft
        self.cost = BatchCost()
        self.acceptance = Acceptance()
        self._steps = 0

    def allocate(self, base: int, generating: int, offers: Sequence[tuple[Hashable, float, int]],
                 room: int, count: bool = True) -> dict[Hashable, int]:
        """Draft tokens per continuation for a step of ``base`` tokens that yields ``generating``
        tokens without drafts. ``offers``: (key, the acceptance rate of each of its drafted tokens, the
        draft's length); ``room``: tokens the batch may still take. {key: k} for k > 0 only.
        ``count`` False: a question asked before the step's drafts are known (not a step)."""
        if count:
            self._steps += 1
        room = max(0, room)
        if not offers or room == 0 or generating == 0:
            return {}
        if count and self._steps % EXPLORE_EVERY == 1:
            probe = self._explore(base, offers, room)
            if probe:
                return probe
        t0 = self.cost.seconds(base)
        if t0 is None or self.cost.seconds(base + 1) is None:
            return {}
        # every drafted token's expected gain, best first (a continuation's j-th: rate^j)
        # (i: the offer's index, so that equal gains never compare keys)
        heap = [(-rate, i, 1, rate, min(n, self.max_draft)) for i, (_k, rate, n) in enumerate(offers)
                if n > 0 and rate > 0]
        heapq.heapify(heap)
        best_m, best_v, gain, m = 0, generating / t0 * (1.0 + MIN_GAIN), 0.0, 0
        took: list[Hashable] = []
        while heap and m < room:
            g, i, j, rate, n = heapq.heappop(heap)
            gain -= g
            m += 1
            took.append(offers[i][0])
            if j < n:
                heapq.heappush(heap, (-(rate ** (j + 1)), i, j + 1, rate, n))
            t = self.cost.seconds(base + m)
            if t is not None and (generating + gain) / t > best_v:
                best_m, best_v = m, (generating + gain) / t
        out: dict[Hashable, int] = {}
        for key in took[:best_m]:
            out[key] = out.get(key, 0) + 1
        return out

    def _explore(self, base: int, offers, room: int) -> dict[Hashable, int]:
        """The likeliest draft, cut so that the decode is the smallest size of EXPLORE_SIZES above
        ``base`` and at most ``max(base, EXPLORE_MAX)`` above it, not measured yet ({} when every one
        it can reach is)."""
        key, _rate, n = max(offers, key=lambda o: o[1])
        for size in EXPLORE_SIZES:
            k = size - base
            # at most EXPLORE_MAX more tokens or doubling the batch: a probe costs its step's time, and
            # a large model on a CPU (a 3B model's step of 32 tokens: ~4 s) must not pay that to learn
            # that drafts do not pay there
            if 0 < k <= min(n, room, self.max_draft, max(base, EXPLORE_MAX)) and size not in self.cost.measured:
                return {key: k}
        return {}
