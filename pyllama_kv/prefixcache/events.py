"""KV events: the prefix cache's contents as fixed-size blocks, and their changes, in vLLM's format.

A router that spreads requests over replicas (llm-d's precise prefix scorer, NVIDIA Dynamo's KV
router, Ray's KV-aware router) learns what each replica's engine holds from *KV events*: vLLM's
``BlockStored`` (block hashes, the parent's hash, the token ids, the block size, the medium),
``BlockRemoved`` and ``AllBlocksCleared``. Our cache keeps token runs of any length, not blocks, so
this module cuts what it holds into blocks of ``block_size`` tokens:

* **A block** is positions ``[i*B, (i+1)*B)`` of a token sequence; its **hash** chains the previous
  block's: ``blake2b(parent || tokens as little-endian int32, digest_size=8)`` read as a big-endian
  unsigned 64-bit integer, the parent of block 0 being 0 (reported as ``None``). So the same prefix
  has the same hashes in every replica and every run, and a block's hash names its whole prefix.
* **A medium** is where the block's cells are: ``"GPU"`` the context's own KV cache (vLLM's name for
  the engine's cache, whatever the backend), ``"CPU"`` the host-memory tier, ``"DISK"`` the span
  files. A block is held in a medium when one holding of that medium (:meth:`PrefixCache.holdings
  <pyllama_kv.prefixcache.cache.PrefixCache.holdings>`) has all its cells; a block whose cells
  straddle two holdings is not announced (a router sees at most what is there, never more).
* **The events** (:meth:`BlockLedger.update`) are the difference between two readings, in an order
  a subscriber can apply as it goes: removals deepest block first (no block is left without its
  parent), then stores parent first, consecutive blocks of one sequence in one ``BlockStored``. The
  first reading starts with ``AllBlocksCleared`` (a replica that restarts says so).

Pure: the engine reads the holdings between steps and calls :meth:`BlockLedger.update`; the server
encodes the events (``pyllama_kv.server.kvevents``).
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["MEDIA", "AllBlocksCleared", "BlockLedger", "BlockRemoved", "BlockStored", "Holding", "block_hashes",
           "from_wire", "to_wire"]

#: the media, in the order a reading lists them
MEDIA = ("GPU", "CPU", "DISK")

#: a holding: the tokens of positions [0, end) (at least), and the positions [start, end) whose cells
#: the medium holds
Holding = tuple[Sequence[int], int, int]


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str
    lora_id: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def to_wire(events: Iterable[KVEvent]) -> list[list]:
    """vLLM's arrays of ``events`` (msgpack-ready; ``msgspec``'s ``array_like`` structs, tagged by the
    class name first): ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
    medium]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]``."""
    out: list[list] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(["BlockStored", e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id,
                        e.medium])
        elif isinstance(e, BlockRemoved):
            out.append(["BlockRemoved", e.block_hashes, e.medium])
        else:
            out.append(["AllBlocksCleared"])
    return out


def from_wire(arrays: Iterable) -> list[KVEvent]:
    """The events of vLLM's arrays (:func:`to_wire`'s inverse; vLLM's own events too: a medium missing
    is "GPU"); ValueError for an array that is none of them."""
    out: list[KVEvent] = []
    for a in arrays:
        if not isinstance(a, (list, tuple)) or not a:
            raise ValueError(f"not a KV event: {a!r}"[:200])
        tag = a[0].decode() if isinstance(a[0], bytes) else a[0]
        if tag == "BlockStored" and len(a) >= 5:
            medium = a[6] if len(a) > 6 and a[6] is not None else "GPU"
            out.append(BlockStored(list(a[1]), a[2], list(a[3]), int(a[4]), medium, a[5] if len(a) > 5 else None))
        elif tag == "BlockRemoved" and len(a) >= 2:
            out.append(BlockRemoved(list(a[1]), a[2] if len(a) > 2 and a[2] is not None else "GPU"))
        elif tag == "AllBlocksCleared":
            out.append(AllBlocksCleared())
        else:
            raise ValueError(f"not a KV event: {a!r}"[:200])
    return out


def _hash(parent: int, data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(parent.to_bytes(8, "big") + data, digest_size=8).digest(), "big")


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The hashes of the whole blocks of ``tokens`` (see the module docstring)."""
    arr = np.asarray(tokens, dtype="<i4")
    out, parent = [], 0
    for i in range(len(arr) // block_size):
        parent = _hash(parent, arr[i * block_size:(i + 1) * block_size].tobytes())
        out.append(parent)
    return out


@dataclass
class _Block:
    parent: int        # 0 for block 0
    depth: int         # the block's index in its sequence
    tokens: bytes      # little-endian int32


class BlockLedger:
    """What was announced, per medium, and :meth:`update`, the events from one reading to the next.
    Not thread-safe: one reader (the engine's loop thread) calls it."""

    def __init__(self, block_size: int):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.held: dict[str, dict[int, _Block]] = {m: {} for m in MEDIA}
        self._known: dict[tuple[int, bytes], int] = {}   # (parent, tokens) -> hash, for the held blocks
        self._started = False

    def _blocks(self, tokens: Sequence[int], start: int, end: int) -> Iterable[tuple[int, _Block]]:
        """The blocks wholly inside positions [start, end) of ``tokens``, in order."""
        b = self.block_size
        arr = np.asarray(tokens[:end], dtype="<i4")
        parent, known = 0, self._known
        for i in range(end // b):
            data = arr[i * b:(i + 1) * b].tobytes()
            h = known.get((parent, data))
            if h is None:
                h = known[(parent, data)] = _hash(parent, data)
            if i * b >= start:
                yield h, _Block(parent, i, data)
            parent = h

    def update(self, holdings: dict[str, Iterable[Holding]]) -> list[KVEvent]:
        """The events that take the last reading to ``holdings`` (a medium missing holds nothing)."""
        events: list[KVEvent] = []
        if not self._started:
            self._started = True
            events.append(AllBlocksCleared())
        now: dict[str, dict[int, _Block]] = {}
        order: dict[str, list[int]] = {}
        for m in MEDIA:
            blocks: dict[int, _Block] = {}
            seq: list[int] = []
            for tokens, start, end in holdings.get(m, ()):
                for h, blk in self._blocks(tokens, start, end):
                    if h not in blocks:
                        blocks[h] = blk
                        seq.append(h)
            now[m], order[m] = blocks, seq
        for m in MEDIA:
            gone = [h for h in self.held[m] if h not in now[m]]
            if gone:
                gone.sort(key=lambda h: -self.held[m][h].depth)
                events.append(BlockRemoved(gone, m))
        for m in MEDIA:
            events.extend(self._stored(m, now[m], order[m]))
        self.held = now
        self._known = {(blk.parent, blk.tokens): h for m in MEDIA for h, blk in now[m].items()}
        return events

    def _stored(self, m: str, now: dict[int, _Block], order: list[int]) -> list[BlockStored]:
        old = self.held[m]
        runs: list[tuple[list[int], list[bytes]]] = []
        last = None
        for h in order:
            if h in old:
                last = None
                continue
            blk = now[h]
            if last is not None and blk.parent == last:
                runs[-1][0].append(h)
                runs[-1][1].append(blk.tokens)
            else:
                runs.append(([h], [blk.tokens]))
            last = h
        out = []
        for hashes, datas in runs:
            parent = now[hashes[0]].parent
            toks = np.frombuffer(b"".join(datas), dtype="<i4").tolist()
            out.append(BlockStored(hashes, parent if now[hashes[0]].depth else None, toks, self.block_size, m))
        return out

    def blocks(self, medium: str) -> set[int]:
        """The hashes announced as held in ``medium``."""
        return set(self.held[medium])
