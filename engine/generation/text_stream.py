"""Incremental detokenization with stop strings, one row at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

INCOMPLETE_CHARACTER = "\ufffd"


class TextStream:
    """Incremental detokenization plus stop strings for one row.

    Detokenization decodes a small window of ids (``ids[prefix_offset:]`` against
    ``ids[prefix_offset:read_offset]``), as vLLM and transformers' TextStreamer do, so each
    token costs two short decodes whatever the completion's length, and holds text back while
    it ends in an incomplete character. Stop strings: the released text never ends with a
    prefix of a stop string (that suffix waits in ``pending``), so a stop string is always
    found whole inside ``pending`` + the new text.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.pending = ""
        self.parts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _detokenize(self, token_id: int | None, *, final: bool) -> str:
        if token_id is not None:
            self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        current = self._decode(self.ids[self.prefix_offset :])
        if len(current) > len(prefix) and (final or not current.endswith(INCOMPLETE_CHARACTER)):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return current[len(prefix) :]
        return ""

    def push(self, token_id: int | None, *, final: bool) -> tuple[str, bool]:
        """Add a token (None: only flush) and return (released text, whether a stop string ended it).

        ``final`` releases everything held back: the row ends with this token.
        """
        delta = self._detokenize(token_id, final=final)
        if not delta and not final:
            return "", False
        window = self.pending + delta
        if self.stop:
            found = [index for index in (window.find(stop) for stop in self.stop) if index >= 0]
            if found:
                released = window[: min(found)]
                self.pending = ""
                self.parts.append(released)
                return released, True
        hold = 0 if final else self._held_suffix(window)
        released = window[: len(window) - hold]
        self.pending = window[len(window) - hold :]
        self.parts.append(released)
        return released, False

    def _held_suffix(self, window: str) -> int:
        """The length of the longest suffix of ``window`` that is a proper prefix of a stop string."""
        if not self.stop:
            return 0
        longest = min(len(window), max(len(stop) for stop in self.stop) - 1)
        for size in range(longest, 0, -1):
            suffix = window[-size:]
            if any(stop.startswith(suffix) for stop in self.stop):
                return size
        return 0
