"""How a decode is cut into ``llama_decode`` calls: the plan ``[(seq_id, tokens, first_pos)]`` of
:meth:`pyllama_kv.core.context.Context.decode` in chunks of at most ``n_batch`` tokens, each chunk
written into the context's one reusable batch with one output per entry that ends in it. Pure but
for filling the batch's arrays; the context calls llama.cpp and keeps the table."""
from __future__ import annotations

from collections.abc import Sequence as _Seq
from typing import TYPE_CHECKING, Union

__all__ = ["POLL_TOKENS", "Piece", "chunk_plan", "fast_tokens", "fill_batch"]

#: decodes of at least this many tokens poll for Ctrl-C from the abort callback (a prompt chunk);
#: smaller ones (generation steps) are short enough to finish before the interrupt is delivered
POLL_TOKENS = 32

if TYPE_CHECKING:
    import numpy as np

    #: (seq_id, tokens, first position): one sequence's new tokens in a decode
    Plan = list[tuple[int, Union[list[int], np.ndarray], int]]
#: (entry of the plan, lo, hi, first position of the entry): tokens [lo, hi) of one entry in a chunk
Piece = tuple[int, int, int, int]


def fast_tokens(toks, n_vocab: int) -> list | None:
    """``toks`` itself when it is a list of in-range Python ints (the common case, checked without
    numpy); None when the general check must decide."""
    if type(toks) is not list or not toks:
        return None
    for t in toks:
        if type(t) is not int:
            return None
    if min(toks) < 0 or max(toks) >= n_vocab:
        return None
    return toks


def chunk_plan(plan: Plan, cap: int) -> list[list[Piece]]:
    """``plan`` flattened into chunks of at most ``cap`` tokens, in order."""
    chunks: list[list[Piece]] = []
    cur: list[Piece] = []
    room = cap
    for e, (_sid, toks, pos0) in enumerate(plan):
        lo = 0
        while lo < len(toks):
            take = min(room, len(toks) - lo)
            cur.append((e, lo, lo + take, pos0))
            lo += take
            room -= take
            if room == 0:
                chunks.append(cur)
                cur, room = [], cap
    if cur:
        chunks.append(cur)
    return chunks


def fill_batch(b, plan: Plan, chunk: _Seq[Piece], n_outs: _Seq[int] | None = None) -> tuple[int, list[tuple[int, int]]]:
    """Write ``chunk`` into the batch ``b`` (a :class:`~pyllama_kv._native.kv.NativeBatch`): tokens,
    positions, sequence ids and output flags. ``n_outs[e]``: how many of entry ``e``'s last tokens get
    an output (None: one each, its last). Returns (the number of tokens, [(entry, batch index)] for each
    output in the chunk: the rows of logits it gets, in order; an entry's rows in position order)."""
    # one numpy assignment per array (lists built in Python are cheaper than a numpy call per
    # sequence for the many small pieces of a generation step)
    tok: list[int] = []
    pos: list[int] = []
    sid_l: list[int] = []
    outs = []
    for e, lo, hi, pos0 in chunk:
        sid, toks, _ = plan[e]
        k = hi - lo
        base = len(tok)
        tok.extend(toks[lo:hi] if (lo or hi != len(toks)) else toks)
        pos.extend(range(pos0 + lo, pos0 + hi))
        sid_l.extend([sid] * k)
        first = len(toks) - (1 if n_outs is None else n_outs[e])   # the entry's first token with an output
        for i in range(max(lo, first), hi):
            outs.append((e, base + i - lo))
    n = len(tok)
    b.np_token[:n] = tok
    b.np_pos[:n] = pos
    b.np_sid[:n] = sid_l
    b.np_out[:n] = 0
    if outs:
        b.np_out[[bidx for _, bidx in outs]] = 1
    else:  # a chunk that ends no entry: llama.cpp still wants one output
        b.np_out[n - 1] = 1
    return n, outs
