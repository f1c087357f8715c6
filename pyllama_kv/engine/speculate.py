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

Off for a continuation whose sequence cannot drop its last positions (recurrent layers keep only the
state after their last token: :attr:`Speculator.off_reason`) or whose request asked for none.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..limits import SPEC_INDEX_TOKENS, SPEC_SOURCES as SOURCES
from ..speculation.drafts import Draft, PromptLookup, SuffixIndex
from ..speculation.policy import SeqAcceptance, SpecPolicy


@dataclass
class SpecStats:
    """Counters of speculation (the engine's; ``EngineStats.spec``)."""

    steps: int = 0          # verifications (a continuation's drafted tokens checked in a decode)
    drafted: int = 0        # drafted tokens decoded
    accepted: int = 0       # of which kept (each one a decode step saved)
    by_source: dict = field(default_factory=lambda: {s: {"drafted": 0, "accepted": 0} for s in SOURCES})

    def as_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
                "by_source": {k: dict(v) for k, v in self.by_source.items()}}


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

    def __init__(self, sources: Sequence[str], spec_max: int, recurrent: bool = False):
        self.sources = tuple(sources)
        self.spec_max = spec_max
        self.policy = SpecPolicy(max_draft=spec_max)
        self.index = SuffixIndex(SPEC_INDEX_TOKENS) if "cache" in self.sources else None
        self.stats = SpecStats()
        #: why speculation is off for every continuation of this engine ("": it is on where asked)
        self.off_reason = ""
        if not self.sources:
            self.off_reason = "off (spec none)"
        elif recurrent:
            self.off_reason = ("off for this model: its recurrent layers keep only the state after the last "
                               "token, so rejected draft tokens cannot be removed")

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

    def allocate(self, base: int, generating: int, offers: list[tuple[object, SeqSpec, Draft]],
                 room: int) -> dict[object, int]:
        """Draft tokens per continuation key this step (the cost rule over every offer at once)."""
        acc = self.policy.acceptance
        rated = [(key, st.record.blend(acc.rate(d.source, d.match)), len(d.tokens)) for key, st, d in offers]
        return self.policy.allocate(base, generating, rated, room)

    def decoded(self, tokens: int, seconds: float) -> None:
        """A decode of ``tokens`` tokens took ``seconds`` (the cost rule's measure)."""
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
