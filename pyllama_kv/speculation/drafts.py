"""Draft sources without a second model: token continuations seen before.

* :class:`PromptLookup`: one continuation's own tokens (its prompt and what it generated): the earlier
  occurrences of their last ``n_min`` tokens, and what followed the one whose match extends furthest back
  (llama.cpp's ``ngram-simple`` and llama-cpp-python's prompt lookup take the most recent one).
* :class:`SuffixIndex`: what the engine cached (every finished conversation, prompt and answer, as the
  prefix cache keeps it): the same search over all of them at once (SuffixDecoding's global tree, as an
  index of short n-grams with the match extended backwards), so that a tool call, a file or a template
  answer seen in another conversation is proposed again. Bounded by tokens, least recently added out.

A draft is a :class:`Draft`: its tokens, its source and how many tokens of context matched (the
policy trusts a longer match more). Both sources are pure Python over token ids, run on the engine's
loop thread, and cost a few dict lookups a step and at most a few hundred token comparisons (their
candidates' matches, extended backwards).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["Draft", "PromptLookup", "SuffixIndex"]

#: the n-gram a continuation's own tokens are searched by: measured on the code-editing load
#: (scripts/bench_spec.py), 2-grams propose too often to be trusted
NGRAM_MIN = 3
#: earlier occurrences of an n-gram compared by how far their match extends back (the most recent kept):
#: a line of a file repeated with other names (``for x in records[:limit]:``) is found at its own place,
#: not at the most recent line that ends the same (measured offline on the code load's F32 answers, 8
#: tokens a draft: 2.51 tokens a step with 16, 2.49 with 8, 2.52 with 32, 2.44 with the most recent
#: occurrence alone); a common n-gram (indentation) costs at most this many comparisons a step
CANDIDATES = 16
#: the last tokens indexed, compared before each search: a list changed behind the index is indexed anew
SEEN = 8
#: context tokens compared to measure a match (how far it extends back before the n-gram)
MAX_MATCH = 64


def _match_back(seq: Sequence[int], j: int, context: Sequence[int], end: int, m: int, limit: int) -> int:
    """How far the match of ``seq`` ending at ``j`` with ``context`` ending at ``end`` extends back, from the
    ``m`` tokens known to match, at most ``limit`` (which must keep ``end - m`` at 0 or more)."""
    while m < limit and m <= j and seq[j - m] == context[end - m]:
        m += 1
    return m


class Draft(NamedTuple):
    tokens: list[int]   # what is proposed to follow the context, in order
    source: str         # "ngram" (the continuation's own tokens), "cache" (the suffix index)
    match: int          # context tokens that matched where it was found (at least the source's n_min)


class PromptLookup:
    """Drafts from one token list that grows at its end (a continuation's ``tokens``): the ``n_min``-grams
    ending at every position but the last are indexed as the list grows (of each, its position, or the
    positions of its ``candidates`` most recent occurrences once it repeats); :meth:`reset` after the list
    changed otherwise (a context shift cut it)."""

    __slots__ = ("n_min", "candidates", "_index", "_done", "_seen")

    def __init__(self, n_min: int = NGRAM_MIN, candidates: int = CANDIDATES):
        if n_min < 1 or candidates < 1:
            raise ValueError(f"need n_min >= 1 and candidates >= 1, got {n_min}, {candidates}")
        self.n_min, self.candidates = n_min, candidates
        # an n-gram seen once holds its position (most do: no list for them), a repeated one its positions
        self._index: dict[tuple, int | list[int]] = {}
        self._done = 0   # positions indexed: the n-grams ending at 0 .. _done - 1
        self._seen: tuple = ()   # the last tokens indexed (a list changed behind our back is indexed anew)

    def reset(self) -> None:
        self._index.clear()
        self._done = 0
        self._seen = ()

    def _catch_up(self, tokens: Sequence[int]) -> None:
        end = len(tokens) - 1   # the last position is the suffix searched for, not indexed yet
        if end < self._done or tuple(tokens[self._done - len(self._seen):self._done]) != self._seen:
            self.reset()
        n, index, keep = self.n_min, self._index, self.candidates
        for j in range(max(self._done, n - 1), end):
            key = tuple(tokens[j + 1 - n:j + 1])
            at = index.get(key)
            if at is None:
                index[key] = j
            elif isinstance(at, int):
                index[key] = [at, j]
            else:
                at.append(j)
                if len(at) > 2 * keep:   # trimmed now and then, not at every occurrence
                    del at[:-keep]
        self._done = max(self._done, end)
        self._seen = tuple(tokens[max(0, self._done - max(SEEN, n)):self._done])

    def propose(self, tokens: Sequence[int], k: int) -> Draft | None:
        """Up to ``k`` tokens that followed the earlier occurrence of the last ``n_min`` tokens whose match
        extends furthest back (of the ``candidates`` most recent; at most MAX_MATCH tokens compared; the
        most recent among equals). None: the last ``n_min`` tokens did not occur before."""
        if k <= 0 or len(tokens) <= self.n_min:
            return None
        self._catch_up(tokens)
        end = len(tokens) - 1
        at = self._index.get(tuple(tokens[end + 1 - self.n_min:]))
        if at is None:
            return None
        best_m, best_j = 0, -1
        for j in ((at,) if isinstance(at, int) else reversed(at[-self.candidates:])):   # most recent first
            # the match's length, extended backwards (the policy trusts a longer one more)
            m = _match_back(tokens, j, tokens, end, self.n_min, MAX_MATCH)
            if m > best_m:
                best_m, best_j = m, j
                if m >= MAX_MATCH:   # none can match further back
                    break
        out = list(tokens[best_j + 1:best_j + 1 + k])
        return Draft(out, "ngram", best_m) if out else None


class SuffixIndex:
    """Token documents (finished conversations), indexed by every ``key``-gram: a proposal is what
    followed the occurrence of the context's last ``key`` tokens whose match extends furthest back
    (at most ``max_match`` tokens compared), most recent first among equals. At most ``max_tokens``
    tokens are kept: the oldest documents go first."""

    def __init__(self, max_tokens: int = 1 << 20, key: int = 4, max_match: int = MAX_MATCH, per_key: int = 8):
        if key < 1 or max_match < key or per_key < 1 or max_tokens < 1:
            raise ValueError("SuffixIndex needs key >= 1, max_match >= key, per_key >= 1, max_tokens >= 1")
        self.key, self.max_match, self.per_key, self.max_tokens = key, max_match, per_key, max_tokens
        self._docs: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._index: dict[tuple, deque] = {}
        self._next_id = 0
        self.tokens = 0   # tokens held by the documents

    def __len__(self) -> int:
        return len(self._docs)

    def add(self, tokens: Sequence[int]) -> None:
        """Index ``tokens`` as a new document (too short for one key: ignored); evict the oldest
        documents past ``max_tokens`` (a document longer than that keeps its last ``max_tokens``)."""
        doc = tuple(int(t) for t in tokens[-self.max_tokens:])
        if len(doc) <= self.key:
            return
        did = self._next_id
        self._next_id += 1
        self._docs[did] = doc
        self.tokens += len(doc)
        k = self.key
        for j in range(k - 1, len(doc) - 1):   # n-grams with at least one token after them
            q = self._index.get(doc[j + 1 - k:j + 1])
            if q is None:
                q = self._index[doc[j + 1 - k:j + 1]] = deque(maxlen=self.per_key)
            q.appendleft((did, j))
        while self.tokens > self.max_tokens and len(self._docs) > 1:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        did, doc = self._docs.popitem(last=False)
        self.tokens -= len(doc)
        k = self.key
        for j in range(k - 1, len(doc) - 1):
            key = doc[j + 1 - k:j + 1]
            q = self._index.get(key)
            if q is None:
                continue
            kept = [e for e in q if e[0] != did]
            if kept:
                q.clear()
                q.extend(kept)
            else:
                del self._index[key]

    def propose(self, context: Sequence[int], k: int) -> Draft | None:
        """Up to ``k`` tokens that followed the best occurrence of the end of ``context`` (None: its
        last ``key`` tokens occur in no document)."""
        if k <= 0 or len(context) < self.key:
            return None
        q = self._index.get(tuple(int(t) for t in context[len(context) - self.key:]))
        if not q:
            return None
        best: tuple[int, int, int] | None = None   # (match, doc id, position)
        limit = min(self.max_match, len(context))
        for did, j in q:
            doc = self._docs.get(did)
            if doc is None:
                continue
            m = _match_back(doc, j, context, len(context) - 1, self.key, limit)
            if best is None or m > best[0]:
                best = (m, did, j)
        if best is None:
            return None
        m, did, j = best
        out = list(self._docs[did][j + 1:j + 1 + k])
        return Draft(out, "cache", m) if out else None
