"""Plain text around tool calls: released as it streams, except whitespace that only
separates calls; and the complete message, kept as the same parse goes.

A segment is the text between two calls (or before the first, or after the last). A
segment of only whitespace is dropped when the output holds any call, and kept when it
holds none, so "\\n" between two calls never reaches the client but a plain answer keeps
its trailing newline. A segment's text is held while it is all whitespace and released
with the first other character.

The complete message is the output's text with the spans that are calls cut out, by the
same rule. A parser records a span once its calls are whole and valid JSON, so a call that
max_tokens cut short, or whose text no JSON decoder reads, streams as a call but is text in
the message:

    Sure.\\n<tool_call>{"name": "f", ...}</tool_call>\\n<tool_call>{"name": "g", "argu
    └ text ┘└ a call: a span ───────────────────────┘└ text (g cut short) ──────────┘
    message: content 'Sure.\\n\\n<tool_call>{"name": "g", "argu', calls (f)
"""

from __future__ import annotations

from collections.abc import Sequence

from .types import ParsedMessage, ToolCall


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


class CallSpans:
    """The output's text as fed, and the spans of it that the complete message holds as calls.
    Positions count characters from the start of the output."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self.add = self._pieces.append  # once per delta: kept as cheap as a list append
        self._length = 0
        self._counted = 0  # pieces in _length
        self._spans: list[tuple[int, int]] = []
        self._calls: list[ToolCall] = []

    @property
    def length(self) -> int:
        """Characters fed so far."""
        self._length += sum(map(len, self._pieces[self._counted :]))
        self._counted = len(self._pieces)
        return self._length

    @property
    def end(self) -> int:
        """Where the last span ends (0 before the first)."""
        return self._spans[-1][1] if self._spans else 0

    def calls(self, start: int, end: int, calls: Sequence[ToolCall]) -> None:
        self._spans.append((start, end))
        self._calls.extend(calls)

    def extend(self, end: int) -> None:
        """The last span reaches on to ``end`` (separators after a call that are not text)."""
        self._spans[-1] = (self._spans[-1][0], end)

    def message(self) -> ParsedMessage:
        text = "".join(self._pieces)
        segments, pos = [], 0
        for start, end in self._spans:
            segments.append(text[pos:start])
            pos = end
        segments.append(text[pos:])
        return ParsedMessage(join_segments(segments, len(self._calls)), tuple(self._calls))


def join_segments(segments: Sequence[str], num_calls: int) -> str:
    """The complete-parse rule: the segments' text, whitespace-only ones dropped when there
    are calls."""
    if not num_calls:
        return "".join(segments)
    return "".join(s for s in segments if s and not s.isspace())
