"""The tiers of the prefix cache below the KV cache (issue 24): host memory, and optionally disk.

When :class:`~pyllama_kv.prefixcache.cache.PrefixCache` evicts an idle cached sequence to make room in the
context, its cells are paged out first: copied to host memory as :class:`~pyllama_kv.core.span.Span` s
(``Sequence.snapshot``), then freed. Paged-out prefixes live in a token trie of spans
(:class:`SpanTrie`): a node owns the tokens of positions ``[start, end)`` and the Span of their
cells, its children extend it. A sequence whose prefix is already in the trie stores only its own
tail, so conversations under one system prompt hold that prompt's K/V once in host memory (however
many of them are resident in the context at the same time, or paged out). A new prompt takes the
longest resident match; the trie's spans beyond it are restored (``Sequence.restore``, patch 0014:
a memcpy) onto the fork, or onto an empty sequence, instead of being evaluated.

The bytes held by spans never exceed ``budget`` (``cache_ram`` MiB): before a span is stored, least
recently used leaves are evicted (never a node with children, never one being restored); a span
that cannot fit is not stored. Only the spans' K/V bytes count (their token tuples and the trie's
nodes are a few percent more in Python objects).

With a ``cache_dir`` (:mod:`pyllama_kv.prefixcache.spanfile`), a span leaving host memory (evicted for the
budget, or too large to store) is written to a file first, and a prompt that the trie cannot
continue asks the directory, whose index is a token trie of the files' tokens walked the same way:
a file that shares any prefix with the prompt beyond what the sequence holds serves it, cut where
the prompt leaves it; the span is checked, restored, and put back in the trie.

The tiers need the patched library (restoring a span adds cells to a sequence that keeps its own);
on the vanilla one they are off and evicted prefixes are dropped (``TierStats.off_reason`` says why).
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from ..core import state as _state
from ..core.span import Span, shared_prefix
from ..errors import InvalidInputError, KVCacheFullError, LlamaError
from .spanfile import SpanDir

#: the page-out rule (Tiers.cheaper_to_evaluate): page-outs measured before it may drop a sequence
PAGE_OUT_EVIDENCE = 8
#: ... and every this many evicted sequences one is paged out all the same (its cost stays measured)
PAGE_OUT_PROBE = 8


@dataclass
class TierStats:
    """The prefix cache's counters, tier by tier (live: read them between calls)."""

    enabled: bool = False
    off_reason: str = ""         # why paging is off (cache_ram 0 and no cache_dir, or no patch 0014)
    # resident: idle cached sequences in the KV cache (cells shared between them counted for each)
    resident_sequences: int = 0
    resident_tokens: int = 0
    resident_bytes: int = 0
    # host memory: the trie of spans
    budget_bytes: int = 0
    host_bytes: int = 0          # K/V bytes held by spans now (<= budget_bytes, always)
    host_tokens: int = 0         # tokens whose cells are paged out to host memory now
    host_nodes: int = 0
    paged_out_tokens: int = 0    # cumulative: tokens copied out of the context (tails not already stored)
    paged_out_bytes: int = 0
    page_outs: int = 0           # evicted sequences that stored something
    page_out_seconds: float = 0.0  # cumulative: wall time of page-outs (the device-to-host copies)
    # the page-out rule (a cache in device memory): an evicted sequence is dropped, not paged out, while
    # a page-out and a restore cost more a token than evaluating the tokens again
    page_outs_skipped: int = 0   # cumulative: evicted sequences dropped because evaluating them again is cheaper
    eval_token_seconds: float = 0.0  # the last measured cost of evaluating a token (a device cache; 0: not yet)
    evicted_nodes: int = 0       # spans dropped from host memory for the budget (to disk, if there is one)
    evicted_bytes: int = 0
    not_stored: int = 0          # spans larger than what the budget could free (to disk, if there is one)
    # restores (host and disk) against evaluation
    restores: int = 0            # prompts that restored spans instead of evaluating them
    restored_tokens: int = 0     # tokens put back from host memory or disk (not evaluated)
    restore_seconds: float = 0.0  # cumulative: wall time of restores (host and disk)
    disk_restored_tokens: int = 0
    evaluated_tokens: int = 0    # prompt tokens that no tier held (evaluated)
    # disk: the span files of cache_dir (files and bytes: every span file there; tokens: this model's)
    disk_budget_bytes: int = 0   # 0: no disk tier
    disk_bytes: int = 0
    disk_files: int = 0
    disk_tokens: int = 0
    disk_writes: int = 0
    disk_written_bytes: int = 0
    disk_write_errors: int = 0
    disk_not_stored: int = 0     # spans larger than the directory's bound
    disk_evicted_files: int = 0  # deleted for the directory's bound
    disk_hits: int = 0           # spans restored from a file
    disk_misses: int = 0         # prompts that the disk was asked to continue and could not
    disk_corrupt: int = 0        # files refused (corrupt, truncated, another model or version): misses too

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


#: called with (the tokens of positions [0, span.end), span) for a span leaving host memory
Spill = Callable[[Sequence[int], Span], object]


class SpanTrie:
    """A token trie whose nodes own the Span of their tokens (see the module docstring). ``spill``
    receives every span that leaves it for the budget, and every span too large to store."""

    def __init__(self, budget_bytes: int, stats: TierStats | None = None, spill: Spill | None = None):
        self.budget = int(budget_bytes)
        self.root = _Node(0, (), None, None)
        self.nbytes = 0
        self._clock = itertools.count(1)
        self.stats = stats if stats is not None else TierStats()
        self.stats.enabled, self.stats.budget_bytes = True, self.budget
        self.spill = spill

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

    def _path_tokens(self, node: _Node) -> list[int]:
        """The tokens of positions [0, node.end)."""
        parts = []
        n: _Node | None = node
        while n is not None and n is not self.root:
            parts.append(n.tokens)
            n = n.parent
        return [t for p in reversed(parts) for t in p]

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def holdings(self):
        """``(tokens, start, end)`` for every node holding a span: positions [start, end) of its path's
        tokens are in host memory, ``start`` the start of the run of spans that ends at it."""
        for n in self._nodes():
            if n.span is None:
                continue
            start, up = n.start, n.parent
            while up is not None and up is not self.root and up.span is not None:
                start, up = up.start, up.parent
            yield self._path_tokens(n), start, n.end

    # -- storing --------------------------------------------------------------------------------

    def _drop(self, node: _Node) -> None:
        assert node.parent is not None and not node.children and node.span is not None
        if self.spill is not None:
            self.spill(self._path_tokens(node), node.span)
        del node.parent.children[node.tokens[0]]
        self.nbytes -= node.span.nbytes
        st = self.stats
        st.evicted_nodes += 1
        st.evicted_bytes += node.span.nbytes
        st.host_tokens -= len(node.tokens)
        st.host_nodes -= 1
        st.host_bytes = self.nbytes

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
        is ``node`` (now the tail). Adds ``layout.n_bytes(0)`` bytes (one more state header)."""
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
        as a leaf, within the budget (a span that cannot fit goes to ``spill``). Returns the tokens
        stored (0: already there, or no room)."""
        tokens = [int(t) for t in tokens]
        path = self._walk(tokens)
        parent, pos, cut = self.root, 0, None
        if path:
            node, k = path[-1]   # k >= 1: a child is found by its first token
            pos = node.start + k
            if k < len(node.tokens):
                cut = node       # diverging inside a node: its common part becomes a node of its own
            else:
                parent = node
        anchor = cut if cut is not None else parent
        self.touch([anchor])
        if pos >= len(tokens):
            return 0
        protect = set()
        n: _Node | None = anchor
        while n is not None:
            protect.add(id(n))
            n = n.parent
        span = snapshot(pos, len(tokens))
        need = span.nbytes + (span.layout.n_bytes(0) if cut is not None else 0)
        if need > self.budget or not self._evict_to(self.budget - need, protect):
            self.stats.not_stored += 1
            if self.spill is not None:
                self.spill(tokens, span)
            return 0
        if cut is not None:
            parent = self._split(cut, pos)
        leaf = _Node(pos, span.tokens, span, parent)
        parent.children[leaf.tokens[0]] = leaf
        self.touch([leaf])
        self.nbytes += span.nbytes
        st = self.stats
        st.host_bytes, st.host_nodes, st.host_tokens = self.nbytes, st.host_nodes + 1, st.host_tokens + len(span)
        st.paged_out_tokens += len(span)
        st.paged_out_bytes += span.nbytes
        st.page_outs += 1
        self._evict_to(self.budget, set())   # a no-op unless the split's header was miscounted
        return len(span)

    def clear(self) -> None:
        """Drop every span (not spilled)."""
        self.root = _Node(0, (), None, None)
        self.nbytes = 0
        st = self.stats
        st.host_bytes = st.host_tokens = st.host_nodes = 0


def can_restore(ctx) -> bool:
    """Whether a span can be restored in the context: its library has llama_state_seq_add_data (patch
    0014) and its model's memory is a plain KV cache (``ctx.no_restore_reason`` says why not)."""
    return bool(getattr(ctx, "can_restore", False))


def context_layout(ctx) -> _state.Layout:
    """The layout of the context's sequence states (cache types, row sizes, V layout)."""
    return ctx.cache_layout()


class _Rate:
    """Seconds per token of recent copies (each copy's weight halves after ``HALF_LIFE`` newer ones),
    and how many copies were counted."""

    HALF_LIFE = 16

    def __init__(self) -> None:
        self._keep = 0.5 ** (1.0 / self.HALF_LIFE)
        self.tokens = self.seconds = 0.0
        self.count = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * self._keep + tokens
        self.seconds = self.seconds * self._keep + seconds
        self.count += 1

    def per_token(self) -> float:
        """0.0 before anything was counted."""
        return self.seconds / self.tokens if self.tokens else 0.0


class Tiers:
    """Host memory (a :class:`SpanTrie` of ``budget_bytes``) and optionally a directory
    (:class:`~pyllama_kv.prefixcache.spanfile.SpanDir`) for the prefixes a context pages out."""

    def __init__(self, ctx, budget_bytes: int, stats: TierStats, cache_dir=None, cache_dir_bytes: int = 0):
        self.stats = stats
        self.disk: SpanDir | None = None
        if cache_dir is not None:
            self.disk = SpanDir(cache_dir, cache_dir_bytes, _state.model_fingerprint(ctx.model),
                                context_layout(ctx), stats)
        self.trie = SpanTrie(budget_bytes, stats, spill=self._spill if self.disk is not None else None)
        self._weigh = bool(ctx.cache_on_device)   # the page-out rule (cheaper_to_evaluate) applies
        self._eval_cost = ctx.eval_cost
        self._candidates = 0
        self._paged = _Rate()      # the copies of page-outs that stored tokens
        self._restored = _Rate()   # the copies of restores

    def _spill(self, tokens: Sequence[int], span: Span) -> None:
        """Write a span leaving host memory to disk; never raises (the trie is mid-eviction)."""
        assert self.disk is not None
        try:
            self.disk.put(tokens, span)
        except (LlamaError, OSError):
            self.stats.disk_write_errors += 1

    def page_out(self, seq) -> int:
        """Store what the tiers lack of ``seq``'s cells (the sequence is unchanged); the tokens stored
        in host memory. A sequence whose cells cannot be copied (not a clean [0, n)) stores nothing,
        and so does one that :meth:`cheaper_to_evaluate` says to drop (asked only when the trie lacks
        some of its tokens: storing nothing new costs nothing)."""
        if not len(seq):
            return 0
        tokens = seq.tokens
        if self._weigh and self.trie.matched(tokens) < len(tokens) and self.cheaper_to_evaluate():
            return 0
        copied = [0.0]

        def snapshot(a: int, b: int) -> Span:   # the copy out of the cache, timed for the rule
            t = time.perf_counter()
            try:
                return seq.snapshot(a, b)
            finally:
                copied[0] += time.perf_counter() - t

        t0 = time.perf_counter()
        try:
            n = self.trie.insert(tokens, snapshot)
        except LlamaError:
            n = 0
        finally:
            self.stats.page_out_seconds += time.perf_counter() - t0
        if n:
            self._paged.add(n, copied[0])
        return n

    def cheaper_to_evaluate(self) -> bool:
        """The page-out rule, for a cache in device memory (``Context.cache_on_device``), where a
        page-out is a transfer that can cost more than the evaluation it saves (on an H200, 8B
        shapes: 0.29 ms a token paged out, 0.06 restored, against ~0.1 evaluated). True (and counted
        in ``page_outs_skipped``) when, as measured in this context lately, copying a token out and
        restoring it costs more than evaluating it again (``Context.eval_cost``). The copy and restore
        costs are of the copies alone (``seq.snapshot``, ``seq.restore``), each a recent average
        (:class:`_Rate`). Never before ``PAGE_OUT_EVIDENCE`` page-outs and an evaluation estimate, and
        never for every ``PAGE_OUT_PROBE``-th evicted sequence, which keeps the page-out cost
        measured. It assumes the prefix comes back (a restore saves its evaluation), so that it
        drops only what would cost more even then. A cache in host memory always pages out (a memcpy)."""
        if not self._weigh:
            return False
        st = self.stats
        ev = self._eval_cost.per_token()
        if ev is None:
            return False
        st.eval_token_seconds = ev
        if self._paged.count < PAGE_OUT_EVIDENCE:
            return False
        self._candidates += 1
        if self._candidates % PAGE_OUT_PROBE == 0:
            return False
        if self._paged.per_token() + self._restored.per_token() <= ev:
            return False
        st.page_outs_skipped += 1
        return True

    def _restore(self, seq, span: Span, make_room: Callable[[], bool] | None) -> bool:
        """``seq.restore(span)``, evicting with ``make_room`` while the cache is full; False when it
        does not fit. InvalidInputError (a span the context refuses) propagates."""
        while True:
            try:
                t = time.perf_counter()
                seq.restore(span)
                self._restored.add(len(span), time.perf_counter() - t)
                return True
            except KVCacheFullError:
                if make_room is None or not make_room():
                    return False

    def restore_into(self, seq, tokens: Sequence[int], limit: int,
                     make_room: Callable[[], bool] | None = None) -> int:
        """Restore the stored spans for ``tokens[len(seq):limit]`` onto ``seq`` (which holds a prefix
        of ``tokens``): host memory first, then the directory; returns the tokens restored. Stops
        early, with ``seq`` valid, when the cache has no room (``make_room()``, if given, is asked
        to evict first)."""
        t0 = time.perf_counter()
        try:
            return self._restore_into(seq, tokens, limit, make_room)
        finally:
            self.stats.restore_seconds += time.perf_counter() - t0

    def _restore_into(self, seq, tokens: Sequence[int], limit: int, make_room: Callable[[], bool] | None) -> int:
        tokens = [int(t) for t in tokens]
        got = disk_got = 0
        plan = self.trie.spans_for(tokens, len(seq), limit)
        for node, _ in plan:
            node.pins += 1
        full = False
        try:
            for _, span in plan:
                if not self._restore(seq, span, make_room):
                    full = True
                    break
                got += len(span)
        finally:
            for node, _ in plan:
                node.pins -= 1
        if plan and got:
            self.trie.touch([plan[-1][0]])
        looked = False
        while self.disk is not None and not full and len(seq) < limit:
            looked = True
            found = self.disk.find(tokens, len(seq), limit)
            if found is None:
                break
            span, name = found
            try:
                if not self._restore(seq, span, make_room):
                    break
            except InvalidInputError:
                self.disk.reject(name)
                break
            got += len(span)
            disk_got += len(span)
            self.stats.disk_hits += 1
            self._keep(tokens[:span.end], span)
        if looked and not disk_got:
            self.stats.disk_misses += 1
        if got:
            self.stats.restores += 1
            self.stats.restored_tokens += got
            self.stats.disk_restored_tokens += disk_got
        return got

    def _keep(self, tokens: list[int], span: Span) -> None:
        """Put a span read from disk in host memory too, when the trie holds its parent prefix."""
        if self.trie.matched(tokens) < span.start:
            return

        def cut(a: int, b: int) -> Span:
            return span if a == span.start else span.split(a)[1]

        # not counted as paged out: these cells come from disk, not from the context
        st = self.stats
        before = (st.paged_out_tokens, st.paged_out_bytes, st.page_outs)
        self.trie.insert(tokens, cut)
        st.paged_out_tokens, st.paged_out_bytes, st.page_outs = before

    def matched(self, tokens: Sequence[int], held: int = 0) -> int:
        """How many leading ``tokens`` a sequence holding ``tokens[:held]`` (an idle cached prefix's
        cells) could have from the tiers: host memory's, then the files' that continue it (by the
        directory's index as it is: no file is read or touched)."""
        pos = max(held, self.trie.matched(tokens))
        if self.disk is not None:
            pos = self.disk.covered(tokens, pos, touch=False, sync=False)
        return pos

    def clear(self) -> None:
        """Drop the spans in host memory (files stay)."""
        self.trie.clear()
