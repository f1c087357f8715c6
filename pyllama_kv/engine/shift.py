"""Context shift, a base of :class:`~pyllama_kv.engine.scheduler.Engine` (one object, whose
``__init__`` sets what is declared here): a continuation whose sequence reaches the end of the context
keeps its first ``n_keep`` tokens, drops half of the rest and goes on (see the scheduler's docstring)."""
from __future__ import annotations

from ..errors import InvalidInputError
from .admission import drop_range
from .continuation import Continuation, EngineStats
from .kv import KVCache


class ContextShifts:
    """The loop's context shift (written by the one loop, like the rest of the engine)."""

    kv: KVCache
    stats: EngineStats

    def _shift(self, cont: Continuation) -> bool:
        """Context shift of a full continuation: keep ``n_keep`` tokens, drop half of the rest (the
        oldest), by a K-shift of the kept tail where the cache can, else by cutting the sequence after
        ``n_keep`` (after nothing, where its memory cannot go back there) and re-evaluating the rest
        in the next batches. False when nothing can be dropped."""
        req = cont.req
        held = len(cont.tokens) - len(cont.pending)       # positions the sequence holds
        n_keep = min(req.n_keep, held)
        discard = (held - n_keep) // 2
        if discard < 1:
            return False
        end = n_keep + discard
        if not self.kv.shift(cont.seq, n_keep, discard):
            # re-evaluate: the sequence keeps [0, n_keep); the kept tail (with the pending token) is
            # decoded again at its new positions, chunked and batched like a prompt
            kept = n_keep
            try:
                self.kv.truncate(cont.seq, n_keep)
            except InvalidInputError:
                # a memory that cannot go back to n_keep (recurrent layers; a sliding-window cache
                # that reused the cells of older positions): the kept start is decoded again too
                self.kv.truncate(cont.seq, 0)
                kept = 0
            cont.pending = cont.tokens[kept:n_keep] + cont.tokens[end:]
            self.stats.shifts_reevaluated += 1
            self.stats.reevaluated_tokens += len(cont.pending) - 1
        # (K-shift: positions [end, held) are now [n_keep, held - discard), nothing to decode)
        del cont.tokens[n_keep:end]
        if cont.spec is not None:   # its own tokens' index is of the list before the cut
            cont.spec.lookup.reset()
        cont.boundaries = drop_range(cont.boundaries, n_keep, end)
        cont.checkpoints = []
        self.stats.context_shifts += 1
        self.stats.dropped_tokens += discard
        usage = req.handle.usage
        usage.context_shifts += 1
        usage.dropped_tokens += discard
        return True
