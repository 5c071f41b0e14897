"""Calls that make up the whole output, as JSON, with no tag around them:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}
    [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

Llama 3.x writes one object per call (``parameters``), optionally after ``<|python_tag|>``
and separated by ``;``; the generic JSON format (for models with no native one) is a call
object or a JSON array of them. The output is calls only if, past leading whitespace and
the optional tag, it starts with ``{`` (or ``[`` where arrays are allowed) and that value is
a call; otherwise all of it is content. Text after the last call is content. In the
complete message the calls end at the first one that is not whole and valid JSON.

The states, one method each (see tagged.py):

    start ──{ or [──▶ next ──{──▶ in_call ──a call──▶ next (past a separator: next again)
      │                 │              └──no call──▶ content_rest
      └──other──────────┴──other───────────────────▶ content_rest
"""

from __future__ import annotations

from collections.abc import Callable

from .content import CallSpans, ContentSegments
from .scan import CallObjectStream
from .types import ParsedDelta, ParsedMessage, ToolCallDelta

State = Callable[[ParsedDelta], bool]


class LeadingCallParser:
    """``feed`` each text delta, then ``finish`` once; ``message`` is then the complete parse."""

    def __init__(self, prefix_tag: str | None, separators: str, allow_array: bool) -> None:
        self.prefix_tag, self.separators, self.allow_array = prefix_tag, separators, allow_array
        self._state: State = self._start
        self._tag = prefix_tag  # until it is seen once
        self._buf = ""  # text not yet consumed, always the end of the output so far
        self._consumed = ""  # raw text consumed before the first call was recognised
        self._call = CallObjectStream()
        self._spans = CallSpans()
        self._message_open = True  # the message takes calls until one is not whole and valid
        self._content = ContentSegments()
        self._index = -1
        self._in_array = False
        self._gap = ""  # whitespace before the current object, text again if it is no call

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        self._spans.add(text)
        while self._buf and self._state(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._index < 0:
            out.content += self._content.add(self._consumed + self._buf)  # never a call: all text
        elif self._state == self._content_rest:
            out.content += self._content.add(self._buf)
        elif self._state == self._in_call and not self._call.named:
            out.content += self._content.add(self._gap + self._call.text)  # cut short: text
        self._buf = self._consumed = ""
        out.content += self._content.finish()
        return out

    def message(self) -> ParsedMessage:
        return self._spans.message()

    # --- the states

    def _start(self, out: ParsedDelta) -> bool:
        """The output's start: whitespace, the optional tag once, then a call or an array."""
        stripped = self._buf.lstrip()
        tag = self._tag
        if tag and stripped.startswith(tag):
            self._consumed += self._buf[: len(self._buf) - len(stripped) + len(tag)]
            self._buf = stripped[len(tag) :]
            self._tag = None
            return True
        if not stripped or (tag and tag.startswith(stripped)):
            return False  # only whitespace or part of the tag so far
        if stripped[0] == "{" or (stripped[0] == "[" and self.allow_array):
            self._consumed += self._buf[: len(self._buf) - len(stripped)]
            self._buf = stripped
            if stripped[0] == "[":
                self._consumed += "["
                self._buf = stripped[1:]
                self._in_array = True
            self._state = self._next
        else:
            self._to_content()
        return True

    def _content_rest(self, out: ParsedDelta) -> bool:
        """Everything from here on is text."""
        out.content += self._content.add(self._buf)
        self._buf = ""
        return False

    def _next(self, out: ParsedDelta) -> bool:
        """Between calls: the next object, a separator, or the start of text."""
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        if stripped[0] == "{":
            if self._index >= 0:
                self._gap = self._buf[: len(self._buf) - len(stripped)]
            else:
                self._consumed += self._buf[: len(self._buf) - len(stripped)]
            self._buf = stripped
            self._call, self._state = CallObjectStream(), self._in_call
        elif self._index >= 0 and stripped[0] in self.separators + (",]" if self._in_array else ""):
            self._buf = stripped[1:]
            if stripped[0] == "]":
                self._in_array = False
            if self._message_open:
                self._spans.extend(self._here())
        else:
            self._to_content()
        return True

    def _in_call(self, out: ParsedDelta) -> bool:
        """A call object: its name once it closes its string, its arguments as they come."""
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
            return False
        self._buf = piece.leftover
        if piece.not_a_call is not None:
            if self._index < 0:
                self._buf = self._consumed + self._buf
                self._consumed = ""
            else:
                self._buf = self._gap + piece.not_a_call + self._buf
            self._state = self._content_rest
            return True
        if piece.call is None:
            self._message_open = False  # streamed as a call, but no valid JSON: text from here
        elif self._message_open:
            self._spans.calls(self._spans.end, self._here(), [piece.call])
        self._state = self._next
        return True

    def _here(self) -> int:
        return self._spans.length - len(self._buf)

    def _to_content(self) -> None:
        """Everything from here on is text (from the start, if no call was found)."""
        if self._index < 0:
            self._buf = self._consumed + self._buf
            self._consumed = ""
        self._state = self._content_rest
