"""The host-memory tier of the engine's prefix cache (issue 24, first tier): a prefix cache larger
than the KV cache.

When an idle cached prefix sequence is evicted to make room in the context, its cells are paged out
first: copied to host memory as :class:`~pyllama_kv.span.Span` s (``Sequence.snapshot``), then freed.
Paged-out prefixes live in a token trie of spans (:class:`SpanTrie`): a node owns the tokens of
positions ``[start, end)`` and the Span of their cells, its children extend it. A sequence whose
prefix is already in the trie stores only its own tail, so conversations under one system prompt
hold that prompt's K/V once. A new prompt takes the longest match among the resident sequences and
the trie; when the trie's is longer, its spans are restored (``Sequence.restore``, patch 0014: a
memcpy) onto a fork of the resident part, or onto an empty sequence, instead of being evaluated.

The bytes held by spans never exceed ``budget`` (``EngineConfig.cache_ram``): before a span is stored,
least recently used leaves are evicted (never a node with children, never one being restored); a span
that cannot fit is not stored. Only the spans' K/V bytes count (their token tuples and the trie's
nodes are a few percent more in Python objects).

The tier needs the patched library (restoring a span adds cells to a sequence that keeps its own);
on the vanilla one it is off and evicted prefixes are dropped, as before (``PagingPrefixCache.tier``
is None and its ``tier_info.off_reason`` says why).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from ..errors import KVCacheFullError, LlamaError
from ..prefix import PrefixCache, shared_prefix
from ..span import Span


@dataclass
class TierStats:
    enabled: bool = False
    off_reason: str = ""         # why the tier is off (cache_ram 0, or a library without patch 0014)
    budget_bytes: int = 0
    host_bytes: int = 0          # K/V bytes held by spans now (<= budget_bytes)
    host_tokens: int = 0         # tokens whose cells are paged out now
    host_nodes: int = 0
    paged_out_tokens: int = 0    # cumulative: tokens copied out of the context (tails not already stored)
    paged_out_bytes: int = 0
    page_outs: int = 0           # evicted sequences that stored something
    restores: int = 0            # prompts that restored spans instead of evaluating them
    restored_tokens: int = 0     # tokens put back from host memory (not evaluated)
    evicted_nodes: int = 0       # spans dropped from host memory for the budget
    evicted_bytes: int = 0
    not_stored: int = 0          # spans larger than what the budget could free

    def as_dict(self) -> dict:
        return asdict(self)


class _Node:
    __slots__ = ("start", "tokens", "span", "children", "parent", "used", "pins")

    def __init__(self, start: int, tokens: tuple[int, ...], span: Span | None, parent: _Node | None):
        self.start = start
        self.tokens = tokens
        self.span = span
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.used = 0
        self.pins = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class SpanTrie:
    """A token trie whose nodes own the Span of their tokens (see the module docstring)."""

    def __init__(self, budget_bytes: int, stats: TierStats | None = None):
        self.budget = int(budget_bytes)
        self.root = _Node(0, (), None, None)
        self.nbytes = 0
        self._clock = itertools.count(1)
        self.stats = stats if stats is not None else TierStats()
        self.stats.enabled, self.stats.budget_bytes = True, self.budget

    # -- walking --------------------------------------------------------------------------------

    def _walk(self, tokens: Sequence[int]) -> list[tuple[_Node, int]]:
        """The nodes along ``tokens`` with how many of each node's tokens match (all but the last: all)."""
        path: list[tuple[_Node, int]] = []
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            k = shared_prefix(child.tokens, tokens[pos:pos + len(child.tokens)])
            path.append((child, k))
            if k < len(child.tokens):
                break
            node, pos = child, pos + k
        return path

    def matched(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the trie holds."""
        path = self._walk(tokens)
        return path[-1][0].start + path[-1][1] if path else 0

    def spans_for(self, tokens: Sequence[int], start: int, end: int) -> list[tuple[_Node, Span]]:
        """The spans that cover positions ``[start, min(end, what the trie holds))`` of ``tokens`` (cut
        at both ends as needed), with their nodes, in order."""
        end = min(end, self.matched(tokens[:end]))
        if end <= start:
            return []
        out: list[tuple[_Node, Span]] = []
        for node, _ in self._walk(tokens[:end]):
            if node.end <= start:
                continue
            span = node.span
            assert span is not None
            if span.start < start:
                span = span.split(start)[1]
            if span.end > end:
                span = span.split(end)[0]
            out.append((node, span))
        return out

    def touch(self, nodes) -> None:
        t = next(self._clock)
        for n in nodes:
            while n is not None and n is not self.root:
                n.used = t
                n = n.parent

    # -- storing --------------------------------------------------------------------------------

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _drop(self, node: _Node) -> None:
        assert node.parent is not None and not node.children and node.span is not None
        del node.parent.children[node.tokens[0]]
        self.nbytes -= node.span.nbytes
        self.stats.evicted_nodes += 1
        self.stats.evicted_bytes += node.span.nbytes
        self.stats.host_tokens -= len(node.tokens)
        self.stats.host_nodes -= 1
        self.stats.host_bytes = self.nbytes

    def _evict_to(self, limit: int, protect: set) -> bool:
        """Drop least recently used leaves (not in ``protect``, not pinned) until at most ``limit``
        bytes are held; False when that cannot be done."""
        while self.nbytes > limit:
            leaves = [n for n in self._nodes() if not n.children and not n.pins and id(n) not in protect]
            if not leaves:
                return False
            self._drop(min(leaves, key=lambda n: n.used))
        return True

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node`` at position ``at`` (strictly inside it): returns the new head, whose only child
        is ``node`` (now the tail)."""
        assert node.span is not None and node.parent is not None
        head_span, tail_span = node.span.split(at)
        head = _Node(node.start, head_span.tokens, head_span, node.parent)
        head.used = node.used
        node.parent.children[head.tokens[0]] = head
        self.nbytes += head_span.nbytes + tail_span.nbytes - node.span.nbytes
        node.start, node.tokens, node.span, node.parent = tail_span.start, tail_span.tokens, tail_span, head
        head.children[node.tokens[0]] = node
        self.stats.host_nodes += 1
        self.stats.host_bytes = self.nbytes
        return head

    def insert(self, tokens: Sequence[int], snapshot: Callable[[int, int], Span]) -> int:
        """Store ``tokens``: the part the trie lacks is copied with ``snapshot(start, end)`` and added
        as a leaf, within the budget. Returns the tokens stored (0: already there, or no room)."""
        tokens = [int(t) for t in tokens]
        path = self._walk(tokens)
        parent, pos = self.root, 0
        if path:
            node, k = path[-1]   # k >= 1: a child is found by its first token
            pos = node.start + k
            # diverging inside a node, the common part becomes a node of its own
            parent = self._split(node, pos) if k < len(node.tokens) else node
        self.touch([parent])
        if pos >= len(tokens):
            return 0
        protect = set()
        n: _Node | None = parent
        while n is not None:
            protect.add(id(n))
            n = n.parent
        span = snapshot(pos, len(tokens))
        if self.nbytes + span.nbytes > self.budget and (
                span.nbytes > self.budget or not self._evict_to(self.budget - span.nbytes, protect)):
            self.stats.not_stored += 1
            self._evict_to(self.budget, set())   # a split may have added a few header bytes
            return 0
        leaf = _Node(pos, span.tokens, span, parent)
        parent.children[leaf.tokens[0]] = leaf
        self.touch([leaf])
        self.nbytes += span.nbytes
        st = self.stats
        st.host_bytes, st.host_nodes, st.host_tokens = self.nbytes, st.host_nodes + 1, st.host_tokens + len(span)
        st.paged_out_tokens += len(span)
        st.paged_out_bytes += span.nbytes
        st.page_outs += 1
        self._evict_to(self.budget, set())
        return len(span)


def can_restore(ctx) -> bool:
    """Whether the context's library has llama_state_seq_add_data (patch 0014)."""
    native = getattr(ctx, "_native", None)
    return native is not None and getattr(native.L, "llama_state_seq_add_data", None) is not None


class PagingPrefixCache(PrefixCache):
    """A :class:`~pyllama_kv.prefix.PrefixCache` whose evictions page idle sequences out to a
    :class:`SpanTrie` of at most ``cache_ram_mib`` MiB before closing them."""

    def __init__(self, ctx, max_sequences: int | None, cache_ram_mib: int):
        super().__init__(ctx, max_sequences=max_sequences)
        self.tier: SpanTrie | None = None
        self.tier_info = TierStats()   # live: the engine's stats hold this object
        if cache_ram_mib <= 0:
            self.tier_info.off_reason = "cache_ram is 0"
        elif not can_restore(ctx):
            self.tier_info.off_reason = ("the library has no llama_state_seq_add_data (patch 0014): evicted "
                                         "prefixes are dropped, not paged out")
        else:
            self.tier = SpanTrie(cache_ram_mib << 20, self.tier_info)

    def _evict_one(self, keep=None) -> bool:
        if self.tier is not None:
            victim = next((s for s in self._idle.values() if s is not keep), None)
            if victim is not None and len(victim):
                try:
                    self.tier.insert(victim.tokens, victim.snapshot)
                except LlamaError:
                    pass   # its cells are not a clean [0, n): it is dropped as before
        return super()._evict_one(keep=keep)

    def restore_into(self, seq, tokens: Sequence[int], limit: int) -> int:
        """Restore the trie's spans for ``tokens[len(seq):limit]`` onto ``seq`` (which holds a prefix
        of ``tokens``); returns the tokens restored. Stops early, with ``seq`` valid, when the cache
        has no room for a span."""
        if self.tier is None:
            return 0
        got = 0
        plan = self.tier.spans_for(tokens, len(seq), limit)
        for node, _ in plan:
            node.pins += 1
        try:
            for _, span in plan:
                try:
                    seq.restore(span)
                except KVCacheFullError:
                    break
                got += len(span)
        finally:
            for node, _ in plan:
                node.pins -= 1
        if got:
            self.tier.touch([plan[-1][0]])
            self.tier.stats.restores += 1
            self.tier.stats.restored_tokens += got
            seq.prefix_reused = len(seq)
        return got

    def tier_stats(self) -> dict:
        """The tier's counters (TierStats.as_dict(): ``enabled`` and, when off, ``off_reason``)."""
        return self.tier_info.as_dict()
