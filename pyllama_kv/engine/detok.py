"""Incremental text of one generated sequence.

Token pieces are bytes, and a multi-byte UTF-8 character may be split across tokens: the stream
emits only whole characters. Stop strings may also be split across tokens: text that could be the
start of a stop string is held back until it is known not to be one, and a matched stop string is
never emitted (nor anything after it).
"""
from __future__ import annotations

import codecs
from collections.abc import Iterable


class TextStream:
    """``feed(piece)`` -> (text to emit now, whether a stop string ended the text)."""

    def __init__(self, stop: Iterable[str] = ()):
        self._stop = [s for s in stop if s]
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._held = ""
        self.text = ""          # everything emitted so far
        self.stopped = False

    def feed(self, piece: bytes) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        new = self._dec.decode(piece)
        if not new:
            return "", False
        buf = self._held + new
        if not self._stop:
            self._held = ""
            self.text += buf
            return buf, False
        cut = -1
        for s in self._stop:
            i = buf.find(s)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut != -1:
            out = buf[:cut]
            self._held = ""
            self.text += out
            self.stopped = True
            return out, True
        keep = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        out = buf[:len(buf) - keep]
        self._held = buf[len(buf) - keep:]
        self.text += out
        return out, False

    def flush(self) -> str:
        """The end of the stream (not by a stop string): held-back text, and an incomplete
        character as U+FFFD."""
        if self.stopped:
            return ""
        out = self._held + self._dec.decode(b"", final=True)
        self._held = ""
        self.text += out
        return out
