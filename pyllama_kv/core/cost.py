"""What evaluating tokens costs a context, measured as it runs (issue 35: the page-out rule).

A decode of n tokens takes about ``a + b * n`` seconds: ``a`` is the call's fixed cost (on a GPU,
reading the weights once), ``b`` what one more token in the batch adds. :class:`EvalCost` fits that
line through the context's recent decodes (least squares, each decode's weight halving every
``HALF_LIFE`` decodes), so that ``per_token()`` is ``b``: what evaluating a dropped prefix again costs
per token when it rides along in a later batch. The prefix cache's tiers weigh a page-out against it
(:meth:`pyllama_kv.prefixcache.tiers.Tiers.page_out`).

No estimate (None) until enough decodes of different sizes were seen: a generation-only load (every
batch the same size) says nothing about the per-token cost.

The decodes are timed with :attr:`EvalCost.clock` (``time.perf_counter`` unless one is given): the
context reads it before and after each decode, so a test gives it a clock that advances by a known
cost per token and checks the arithmetic and the wiring without the machine's timing.
"""
from __future__ import annotations

import time
from collections.abc import Callable

#: a decode's weight halves after this many newer decodes
HALF_LIFE = 64
#: decodes seen before there is an estimate
MIN_DECODES = 16
#: the batch sizes' spread (weighted standard deviation over mean) needed for a slope
MIN_SPREAD = 0.25


class EvalCost:
    """A least-squares line ``seconds = a + b * tokens`` through recent decodes, exponentially
    weighted. The context that owns it alone calls :meth:`observe` (after each successful decode, timed
    with :attr:`clock`: seconds as a float, read once before the decode and once after it)."""

    __slots__ = ("_keep", "_w", "_x", "_y", "_xx", "_xy", "decodes", "clock")

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._keep = 0.5 ** (1.0 / HALF_LIFE)
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.decodes = 0

    def observe(self, tokens: int, seconds: float) -> None:
        """Count one decode of ``tokens`` tokens that took ``seconds``."""
        k = self._keep
        x, y = float(tokens), float(seconds)
        self._w = self._w * k + 1.0
        self._x = self._x * k + x
        self._y = self._y * k + y
        self._xx = self._xx * k + x * x
        self._xy = self._xy * k + x * y
        self.decodes += 1

    def per_token(self) -> float | None:
        """Seconds one more token adds to a decode (the line's slope), or None while unknown: fewer
        than MIN_DECODES decodes, batch sizes too alike, or a slope that is not positive (noise)."""
        if self.decodes < MIN_DECODES:
            return None
        w, x = self._w, self._x
        var = w * self._xx - x * x          # w^2 times the sizes' weighted variance
        if var <= 0.0 or var < (MIN_SPREAD * x) ** 2:
            return None
        slope = (w * self._xy - x * self._y) / var
        return slope if slope > 0.0 else None
