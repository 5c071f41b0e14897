"""Plain text around tool calls: released as it streams, except whitespace that only
separates calls.

A segment is the text between two calls (or before the first, or after the last). A
segment of only whitespace is dropped when the output holds any call, and kept when it
holds none, so "\\n" between two calls never reaches the client but a plain answer keeps
its trailing newline. A segment's text is held while it is all whitespace and released
with the first other character.
"""

from __future__ import annotations

from collections.abc import Sequence


class ContentSegments:
    def __init__(self) -> None:
        self._pending = ""
        self._segment_has_text = False
        self.num_calls = 0

    def add(self, text: str) -> str:
        if self._segment_has_text:
            return text
        self._pending += text
        if self._pending.isspace() or not self._pending:
            return ""
        self._segment_has_text = True
        out, self._pending = self._pending, ""
        return out

    def call_starts(self) -> None:
        self._pending = ""
        self._segment_has_text = False
        self.num_calls += 1

    def finish(self) -> str:
        out = "" if self.num_calls else self._pending
        self._pending = ""
        return out


def join_segments(segments: Sequence[str], num_calls: int) -> str:
    """The complete-parse rule: the segments' text, whitespace-only ones dropped when there
    are calls."""
    if not num_calls:
        return "".join(segments)
    return "".join(s for s in segments if s and not s.isspace())
