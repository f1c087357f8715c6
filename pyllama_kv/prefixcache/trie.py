"""The prefix cache's one token trie: a radix tree over int32 token arrays whose items hang at the
node where their tokens end, each node knowing the least *rank* of the items below it.

Two indexes use it: the idle cached sequences of :class:`~pyllama_kv.prefixcache.cache.PrefixCache`
(:mod:`pyllama_kv.prefixcache.eviction`: ranked by last use, so the longest match is found without
comparing the prompt with every sequence) and the disk tier's index of span files
(:class:`~pyllama_kv.prefixcache.spanfile.TokenIndex`: ranked by the position a file starts at).
The host tier's :class:`~pyllama_kv.prefixcache.tiers.SpanTrie` is a trie of spans of its own (its
nodes own the K/V of their tokens)."""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Generic, TypeVar

import numpy as np

from ..core.span import shared_prefix

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

#: the rank of an empty subtree (above any rank an item has)
NO_RANK = 1 << 62


class Node:
    """A node of a :class:`TokenTrie`: the tokens of positions ``[start, end)``, the items whose tokens
    end here, and ``least``, the least rank in its subtree (:data:`NO_RANK` when it has no item)."""

    __slots__ = ("start", "tokens", "children", "parent", "items", "least")

    def __init__(self, start: int, tokens: np.ndarray, parent: Node | None):
        self.start = start
        self.tokens = tokens
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.items: dict = {}
        self.least = NO_RANK

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class TokenTrie(Generic[K, V]):
    """Items (a key and a value) by their tokens; ``rank(value)`` orders them (an int below
    :data:`NO_RANK`; :meth:`rerank` after it changes). Every node but the root has an item in its
    subtree, and one without items has at least two children (nodes are split on insert, pruned
    and merged on remove), so a walk visits at most one node per branch point of the stored tokens."""

    node_class: type[Node] = Node

    def __init__(self, rank: Callable[[V], int]):
        self._rank = rank
        self.root = self.node_class(0, np.zeros(0, np.int32), None)
        self._where: dict[K, Node] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def values(self) -> Iterator[V]:
        for key, node in self._where.items():
            yield node.items[key]

    def nodes_and_values(self) -> Iterator[tuple[Node, V]]:
        for key, node in self._where.items():
            yield node, node.items[key]

    def path_tokens(self, node: Node) -> np.ndarray:
        """The tokens of positions [0, node.end)."""
        parts = []
        n: Node | None = node
        while n is not None:
            parts.append(n.tokens)
            n = n.parent
        return np.concatenate(parts[::-1]) if parts else np.zeros(0, np.int32)

    def _recount(self, node: Node | None) -> None:
        """``least`` of ``node`` and its ancestors, from their items and children."""
        rank = self._rank
        while node is not None:
            node.least = min(min((rank(v) for v in node.items.values()), default=NO_RANK),
                             min((c.least for c in node.children.values()), default=NO_RANK))
            node = node.parent

    def insert(self, key: K, value: V, tokens: Sequence[int] | np.ndarray) -> None:
        """Hold ``value`` under ``key`` (replacing what ``key`` held), its tokens ``tokens``."""
        if key in self._where:
            self.remove(key)
        tokens = np.asarray(tokens, dtype=np.int32)
        node, depth, n = self.root, 0, len(tokens)
        while depth < n:
            child = node.children.get(int(tokens[depth]))
            if child is None:
                leaf = self.node_class(depth, tokens[depth:].copy(), node)
                node.children[int(tokens[depth])] = leaf
                node, depth = leaf, n
                break
            k = shared_prefix(child.tokens, tokens[depth:depth + len(child.tokens)])
            if k < len(child.tokens):
                child = self._split(child, depth + k)
            node, depth = child, depth + k
        node.items[key] = value
        self._where[key] = node
        self._recount(node)

    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node`` at depth ``at`` (strictly inside it); returns the new head (``node``, now the
        tail, keeps its items: they end where it ends)."""
        assert node.parent is not None and node.start < at < node.end
        k = at - node.start
        head = self.node_class(node.start, node.tokens[:k].copy(), node.parent)
        head.least = node.least
        node.parent.children[int(head.tokens[0])] = head
        node.start, node.tokens, node.parent = at, node.tokens[k:].copy(), head
        head.children[int(node.tokens[0])] = node
        return head

    def remove(self, key: K) -> None:
        """Forget ``key`` (nothing if it is not held); prunes and merges nodes left empty."""
        node = self._where.pop(key, None)
        if node is None:
            return
        del node.items[key]
        while node.parent is not None and not node.items and not node.children:
            parent = node.parent
            del parent.children[int(node.tokens[0])]
            node = parent
        if node.parent is not None and not node.items and len(node.children) == 1:
            (child,) = node.children.values()   # merge a node that only leads to one child into it
            child.tokens = np.concatenate((node.tokens, child.tokens))
            child.start, child.parent = node.start, node.parent
            node.parent.children[int(child.tokens[0])] = child
            node = child
        self._recount(node)

    def rerank(self, key: K) -> None:
        """The rank of ``key``'s value changed: bring its node's and ancestors' ``least`` up to date."""
        self._recount(self._where[key])

    def path(self, tokens: Sequence[int] | np.ndarray) -> list[tuple[Node, int]]:
        """The nodes that ``tokens`` walks into, root excluded, each with the tokens that the items
        below it and not below the next share with ``tokens`` (the last node's items all share
        exactly that many; the walk ends where ``tokens`` leave the trie or end)."""
        n = len(tokens)
        node, depth = self.root, 0
        out: list[tuple[Node, int]] = []
        while depth < n:
            child = node.children.get(int(tokens[depth]))
            if child is None:
                break
            k = shared_prefix(child.tokens, tokens[depth:depth + len(child.tokens)])
            depth += k
            out.append((child, depth))
            if k < len(child.tokens):
                break
            node = child
        return out

    def least(self, node: Node) -> V | None:
        """The value of least rank in ``node``'s subtree (None when it has none)."""
        rank = self._rank
        while node.least < NO_RANK:
            for v in node.items.values():
                if rank(v) == node.least:
                    return v
            node = next(c for c in node.children.values() if c.least == node.least)
        return None

    def longest(self, tokens: Sequence[int] | np.ndarray) -> tuple[V | None, int]:
        """The value sharing the most leading tokens with ``tokens`` and how many (the least rank of
        those that share that many); ``(None, 0)`` when none shares any."""
        p = self.path(tokens)
        if not p:
            return None, 0
        node, shared = p[-1]
        return self.least(node), shared

    def prefixes(self, tokens: Sequence[int] | np.ndarray) -> list[V]:
        """The values whose tokens are a prefix of ``tokens`` (``tokens`` itself included)."""
        out = list(self.root.items.values())
        for node, shared in self.path(tokens):
            if shared == node.end:
                out.extend(node.items.values())
        return out
