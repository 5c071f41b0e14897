"""Calls that make up the whole output, as JSON, with no tag around them:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}
    [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

Llama 3.x writes one object per call (``parameters``), optionally after ``<|python_tag|>``
and separated by ``;``; the generic JSON format (for models with no native one) is a call
object or a JSON array of them. The output is calls only if, past leading whitespace and
the optional tag, it starts with ``{`` (or ``[`` where arrays are allowed) and that value is
a call; otherwise all of it is content. Text after the last call is content.
"""

from __future__ import annotations

from .content import ContentSegments, join_segments
from .scan import CallObjectStream, call_from_value, decode_value
from .types import ParsedDelta, ParsedMessage, ToolCall, ToolCallDelta

_START, _CONTENT, _NEXT, _IN = range(4)


class LeadingCallParser:
    def __init__(self, prefix_tag: str | None, separators: str, allow_array: bool) -> None:
        self.prefix_tag, self.separators, self.allow_array = prefix_tag, separators, allow_array
        self._state = _START
        self._buf = ""
        self._consumed = ""  # raw text consumed before the first call was recognised
        self._call: CallObjectStream | None = None
        self._content = ContentSegments()
        self._index = -1
        self._in_array = False
        self._gap = ""  # whitespace before the current object, text again if it is no call

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        self._run(out)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._index < 0:
            out.content += self._content.add(self._consumed + self._buf)  # never a call: all text
        elif self._state == _CONTENT:
            out.content += self._content.add(self._buf)
        elif self._state == _IN and self._call is not None and not self._call.named:
            out.content += self._content.add(self._gap + self._call.text)  # cut short: text
        self._buf = self._consumed = ""
        out.content += self._content.finish()
        return out

    def _run(self, out: ParsedDelta) -> None:
        while self._buf:
            if self._state == _START:
                stripped = self._buf.lstrip()
                tag = self.prefix_tag
                if tag and stripped.startswith(tag):
                    self._consumed += self._buf[: len(self._buf) - len(stripped) + len(tag)]
                    self._buf = stripped[len(tag) :]
                    self.prefix_tag = None  # once
                    continue
                if not stripped or (tag and tag.startswith(stripped)):
                    return  # wait: only whitespace or part of the tag so far
                if stripped[0] == "{" or (stripped[0] == "[" and self.allow_array):
                    self._consumed += self._buf[: len(self._buf) - len(stripped)]
                    self._buf = stripped
                    if stripped[0] == "[":
                        self._consumed += "["
                        self._buf = stripped[1:]
                        self._in_array = True
                    self._state = _NEXT
                else:
                    self._to_content(out)
            elif self._state == _CONTENT:
                out.content += self._content.add(self._buf)
                self._buf = ""
            elif self._state == _NEXT:
                stripped = self._buf.lstrip()
                if not stripped:
                    return
                if stripped[0] == "{":
                    if self._index >= 0:
                        self._gap = self._buf[: len(self._buf) - len(stripped)]
                    else:
                        self._consumed += self._buf[: len(self._buf) - len(stripped)]
                    self._buf = stripped
                    self._call = CallObjectStream()
                    self._state = _IN
                elif self._index >= 0 and stripped[0] in self.separators + (",]" if self._in_array else ""):
                    self._buf = stripped[1:]
                    if stripped[0] == "]":
                        self._in_array = False
                else:
                    self._to_content(out)
            else:  # _IN
                assert self._call is not None
                chunk, self._buf = self._buf, ""
                piece = self._call.feed(chunk)
                if self._index < 0:
                    self._consumed += chunk[: len(chunk) - len(piece.leftover)]
                if piece.name is not None:
                    if self._index < 0:
                        self._consumed = ""
                    self._content.call_starts()
                    self._index += 1
                    out.tool_calls.append(ToolCallDelta(self._index, piece.name, piece.arguments))
                elif piece.arguments:
                    out.tool_calls.append(ToolCallDelta(self._index, None, piece.arguments))
                if not piece.done:
                    return
                self._buf = piece.leftover
                if piece.not_a_call is not None:
                    if self._index < 0:
                        self._buf = self._consumed + self._buf
                        self._consumed = ""
                    else:
                        self._buf = self._gap + piece.not_a_call + self._buf
                    self._state = _CONTENT
                else:
                    self._state = _NEXT

    def _to_content(self, out: ParsedDelta) -> None:
        """Everything from here on is text (from the start, if no call was found)."""
        if self._index < 0:
            self._buf = self._consumed + self._buf
            self._consumed = ""
        self._state = _CONTENT


def parse_leading(text: str, prefix_tag: str | None, separators: str, allow_array: bool) -> ParsedMessage:
    """The complete parse of a whole output, by the same rules."""
    pos = len(text) - len(text.lstrip())
    if prefix_tag and text.startswith(prefix_tag, pos):
        pos += len(prefix_tag)
    calls: list[ToolCall] = []
    in_array = False
    gap = pos  # where the text after the last call starts, whitespace included
    while True:
        gap = pos
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        ch = text[pos]
        if calls and (ch in separators or (in_array and ch in ",]")):
            in_array = in_array and ch != "]"
            pos += 1
            continue
        if not calls and ch == "[" and allow_array and not in_array:
            in_array = True
            pos += 1
            continue
        decoded = decode_value(text, pos) if ch == "{" else None
        call = call_from_value(decoded[0]) if decoded else None
        if call is None or decoded is None:
            break
        calls.append(ToolCall(*call))
        pos = decoded[1]
    if not calls:
        return ParsedMessage(text)
    return ParsedMessage(join_segments(["", text[gap:]], len(calls)), tuple(calls))
