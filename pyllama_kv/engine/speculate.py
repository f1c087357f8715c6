"""The engine's speculation (issue 47): which generating continuations get drafts this step, and how
many tokens, and what verifications teach.

:class:`Speculator` is owned by the engine and never touches the KV cache: each step the scheduler
asks :meth:`Speculator.drafts` for the continuations that generate (each already has its next token
to decode), puts every draft into the same decode as everything else, verifies (samples every drafted
position in order with the continuation's own sampler, keeps the drafted tokens up to the first one
not drawn, removes the cells of the rest) and reports back with :meth:`Speculator.verified`. Draft
sources: ``ngram`` (the continuation's own prompt and output, :class:`~pyllama_kv.speculation.drafts.
PromptLookup`) and ``cache`` (every conversation the engine finished, :class:`~pyllama_kv.speculation.
drafts.SuffixIndex`); how many tokens pay is :class:`~pyllama_kv.speculation.policy.SpecPolicy`'s rule.

Off for a model whose sequences cannot drop their last positions for sure (recurrent layers keep only
the state after their last token; a sliding-window cache may reuse the cells of the window a removal
goes back to: :attr:`Speculator.off_reason`), and for a request that asked for none.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..limits import SPEC_INDEX_TOKENS, SPEC_SOURCES as SOURCES
from ..speculation.draftmodel import DraftModel
from ..speculation.drafts import Draft, PromptLookup, SuffixIndex
from ..speculation.policy import SeqAcceptance, SpecPolicy

if TYPE_CHECKING:
    from .continuation import Continuation
    from .kv import KVCache


@dataclass
class SpecStats:
    """Counters of speculation (the engine's; ``EngineStats.spec``)."""

    steps: int = 0          # verifications (a continuation's drafted tokens checked in a decode)
    drafted: int = 0        # drafted tokens decoded
    accepted: int = 0       # of which kept (each one a decode step saved)
    by_source: dict = field(default_factory=lambda: {s: {"drafted": 0, "accepted": 0} for s in (*SOURCES, "draft")})
    sources: str = "none"   # the draft sources on (EngineConfig.spec)
    off_reason: str = ""    # why speculation is off for this engine's model ("" where it is on or not asked)

    def as_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "by_source": {k: dict(v) for k, v in self.by_source.items()}, "sources": self.sources,
                "off_reason": self.off_reason}


class SeqSpec:
    """One continuation's speculation state: its own-token lookup, its acceptance record, and the
    draft in the batch being decoded (``draft``: tokens after its next token; ``source``, ``match``)."""

    __slots__ = ("lookup", "record", "draft", "source", "match")

    def __init__(self) -> None:
        self.lookup = PromptLookup()
        self.record = SeqAcceptance()
        self.draft: list[int] = []
        self.source = ""
        self.match = 0


class Speculator:
    """Drafts and the cost rule of one engine (see the module docstring)."""

    def __init__(self, sources: Sequence[str], spec_max: int, recurrent: bool = False, sliding_window: bool = False,
                 draft_model: DraftModel | None = None):
        self.sources = tuple(sources) + (("draft",) if draft_model is not None else ())
        self.draft_model = draft_model
        self.spec_max = spec_max
        self.policy = SpecPolicy(max_draft=spec_max)
        self.index = SuffixIndex(SPEC_INDEX_TOKENS) if "cache" in self.sources else None
        #: why speculation is off for every continuation of this engine ("": it is on where asked)
        self.off_reason = ""
        if not self.sources:
            self.off_reason = "off (spec none)"
        elif recurrent:
            self.off_reason = ("off for this model: its recurrent layers keep only the state after the last "
                               "token, so rejected draft tokens cannot be removed")
        elif sliding_window:
            self.off_reason = ("off for this model: its sliding-window cache may reuse the cells of the positions "
                               "that removing rejected draft tokens goes back to")
        self.stats = SpecStats(sources=",".join(self.sources) or "none",
                               off_reason=self.off_reason if self.sources else "")

    @property
    def on(self) -> bool:
        return not self.off_reason

    def propose(self, tokens: Sequence[int], state: SeqSpec, k: int) -> Draft | None:
        """The best draft of up to ``k`` tokens for a continuation holding ``tokens`` (its next token
        last): the source whose match is the longest (its own tokens first among equals)."""
        best: Draft | None = None
        if "ngram" in self.sources:
            best = state.lookup.propose(tokens, k)
        if self.index is not None:
            d = self.index.propose(tokens, k)
            if d is not None and (best is None or d.match > best.match):
                best = d
        return best

    def propose_all(self, wanted: Sequence[tuple[object, Sequence[int], SeqSpec, int]], base: int, generating: int,
                    room: int) -> dict[object, Draft]:
        """The best draft for each of ``wanted`` [(key, tokens, state, the most draft tokens)]: the own
        tokens' and the index's (:meth:`propose`), and the draft model's where the cost rule could take
        its tokens at its acceptance so far (it runs a decode per drafted token: not when they would
        not pay); per key the one whose tokens are the likeliest to be accepted."""
        out = {key: d for key, tokens, st, k in wanted if (d := self.propose(tokens, st, k)) is not None}
        dm = self.draft_model
        if dm is not None:
            acc = self.policy.acceptance
            rate = {key: st.record.blend(acc.rate("draft", 0)) for key, _t, st, _k in wanted}
            worth = self.policy.allocate(base, generating, [(key, rate[key], k) for key, _t, _s, k in wanted], room,
                                         count=False)
            ask = [(key, tokens, worth[key]) for key, tokens, _s, _k in wanted if worth.get(key)]
            for key, d in dm.propose(ask).items():
                cur = out.get(key)
                if cur is None or rate[key] > acc.rate(cur.source, cur.match):
                    out[key] = d
        return out

    def forget(self, key: object) -> None:
        """Continuation ``key`` is done (finished or preempted): the draft model's mirror of it goes."""
        if self.draft_model is not None:
            self.draft_model.forget(key)

    def allocate(self, base: int, generating: int, offers: list[tuple[object, SeqSpec, Draft]],
                 room: int) -> dict[object, int]:
        """Draft tokens per continuation key this step (the cost rule over every offer at once)."""
        acc = self.policy.acceptance
        rated = [(key, st.record.blend(acc.rate(d.source, d.match)), len(d.tokens)) for key, st, d in offers]
        return self.policy.allocate(base, generating, rated, room)

    def decoded(self, tokens: int, seconds: float) -> None:
        """A step that decoded ``tokens`` tokens took ``seconds``, drafting, sampling and verifying
        included (the cost rule's measure)."""
        self.policy.cost.observe(tokens, seconds)

    def verified(self, state: SeqSpec, accepted: int) -> None:
        """The draft in ``state`` was verified and its first ``accepted`` tokens kept."""
        drafted = len(state.draft)
        if not drafted:
            return
        self.policy.acceptance.observe(state.source, state.match, drafted, accepted)
        state.record.observe(drafted, accepted)
        st = self.stats
        st.steps += 1
        st.drafted += drafted
        st.accepted += accepted
        src = st.by_source[state.source]
        src["drafted"] += drafted
        src["accepted"] += accepted
        state.draft = []

    def finished(self, tokens: Sequence[int], start: int) -> None:
        """A conversation finished holding ``tokens``; those from ``start`` on are new to the index."""
        if self.index is not None and self.on:
            self.index.add(tokens[max(0, start):])


class SpeculativeSteps:
    """The loop's part of speculation, a base of :class:`~pyllama_kv.engine.scheduler.Engine` (one
    object, whose ``__init__`` sets what is declared here): drafts into a step's batch, and their
    verification after its decode."""

    spec: Speculator
    kv: KVCache
    n_ctx: int

    def _sample(self, cont: Continuation) -> None:   # the Engine's: draw, stream, finish or continue
        raise NotImplementedError

    def _drafts(self, gen: list[Continuation], batch: dict, room: int) -> dict:
        """Add the drafts the cost rule takes this step to ``batch`` (see engine/speculate.py);
        {seq: rows of logits wanted} for the drafted continuations."""
        wanted = []
        for s in gen:
            k = self._draft_room(s)
            if k <= 0:
                continue
            if s.spec is None:
                s.spec = SeqSpec()
            wanted.append((s, s.tokens, s.spec, k))
        base = sum(len(t) for t in batch.values())
        found = self.spec.propose_all(wanted, base, len(gen), room) if wanted else {}
        offers = [(s.seq, st, found[s]) for s, _t, st, _k in wanted if s in found]
        if not offers:
            return {}
        take = self.spec.allocate(base, len(gen), offers, room)
        outputs = {}
        for seq, st, d in offers:
            k = take.get(seq, 0)
            if k:
                st.draft, st.source, st.match = d.tokens[:k], d.source, d.match
                batch[seq] = batch[seq] + st.draft
                outputs[seq] = k + 1
        return outputs

    def _draft_room(self, cont: Continuation) -> int:
        """How many draft tokens ``cont`` may take: none when its request asked for none or wants a
        token or two more; never past the context (no shift can start inside a verification) or its
        max_tokens."""
        req = cont.req
        k = self.spec.spec_max if req.spec_max is None else req.spec_max
        return min(k, req.max_tokens - cont.generated - 1, self.n_ctx - len(cont.tokens) - 2)

    def _drop_drafts(self, batch: dict, owners: dict, outputs: dict) -> None:
        for seq in outputs:
            st = owners[seq].spec
            assert st is not None
            batch[seq] = batch[seq][:1]
            st.draft = []
        outputs.clear()

    def _verify(self, cont: Continuation, rows: np.ndarray | list[int]) -> None:
        """``rows``: the logits after ``cont``'s next token and after each of its draft's tokens (or the
        argmax tokens themselves, chosen in the graph: an argmax request's). Each is
        sampled in order as a step without speculation would (the same sampler, grammar, stop strings
        and stream), and the draft is kept up to the first token the sampler did not draw; that token
        (or, all kept, the one after the draft) is the next to decode. The cells of the rest go."""
        st = cont.spec
        assert st is not None
        draft = st.draft
        cont.valid = len(cont.tokens)   # positions the sequence holds for it: the next token's is in now
        accepted = 0
        for i, row in enumerate(rows):
            cont.logits = row
            before = cont.generated
            self._sample(cont)
            if cont.seq is None or cont.generated == before or i >= len(draft) or cont.tokens[-1] != draft[i]:
                break   # finished, or the sampler drew another token (the next to decode) than the draft's
            accepted += 1
            cont.valid = len(cont.tokens)   # the drafted token drawn is decoded already
            cont.pending = []
        self.spec.verified(st, accepted)
        usage = cont.req.handle.usage
        usage.draft_tokens += len(draft)
        usage.draft_accepted += accepted
        if cont.seq is not None:
            self.kv.truncate(cont.seq, cont.valid)
        cont.valid = None
