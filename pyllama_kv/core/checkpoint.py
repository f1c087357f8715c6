"""Checkpoints: the recurrent state of a sequence after its first n tokens, kept in host memory.

A model whose layers keep recurrent state (LFM2's short convolutions, Mamba, gated delta-nets: a
*hybrid* model when attention layers sit between them) holds, per sequence, only the state after
its last token: the attention cells of earlier positions can be shared (forked) at any position,
the recurrent state cannot be rolled back. A :class:`Checkpoint` is that state, taken when the
sequence held exactly ``tokens`` (``seq.checkpoint()``, :meth:`pyllama_kv.Sequence.checkpoint`). A
fork of the first ``n`` tokens of a sequence that holds more (``seq.fork(n, checkpoint=ck)``) shares
the attention cells of those ``n`` positions and takes its recurrent state from a checkpoint of
the same ``n`` tokens, so the fork continues exactly as a fresh evaluation of them would.

The state is llama.cpp's own bytes (``llama_state_seq_get_data_ext`` with
``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``: the recurrent layers alone, a few hundred KiB for a 1B
hybrid model, not the attention cells), bound to the model it came from. It needs a library with
``caps.recurrent_checkpoints`` (the current pin).

This is what the prefix cache keeps where its trie branches (the end of a system prompt, of a
turn), so that a hybrid model's later prompts evaluate only what no cached prefix holds
(:mod:`pyllama_kv.prefixcache.checkpoints`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Checkpoint"]


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """The recurrent state of a sequence that held exactly ``tokens`` (see the module docstring).
    ``model`` is the fingerprint of the model file it belongs to (``core.state.model_fingerprint``):
    a fork refuses another model's, and takes one made by another Model object of the same file."""

    tokens: np.ndarray            # int32, read-only
    data: bytes                   # llama.cpp's partial sequence state
    model: str = field(repr=False, default="")

    @property
    def n(self) -> int:
        """How many tokens the state follows."""
        return int(self.tokens.size)

    @property
    def n_bytes(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        return f"Checkpoint(n={self.n}, {self.n_bytes} bytes)"

    @classmethod
    def of(cls, tokens, data: bytes, model: str) -> Checkpoint:
        t = np.array(tokens, dtype=np.int32)
        t.flags.writeable = False
        return cls(tokens=t, data=data, model=model)
