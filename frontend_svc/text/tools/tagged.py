"""Calls between an opening and a closing tag, anywhere in the text:

    Let me check.<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
    └ content ──┘└ open ───┘  └ one call object (or a JSON array of them) ───────────┘  └ close ────┘

Hermes and Qwen2.5 / Qwen3 write ``<tool_call>`` ... ``</tool_call>``, one object per pair;
Mistral writes ``[TOOL_CALLS]`` and a JSON array with no closing tag, or, with its newer
tokenizers (v11 on), the name and the arguments apart, one tag per call (``named_form``):

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

An opening tag that is not followed by a call object is text. A missing closing tag is
forgiven.
"""

from __future__ import annotations

import re

from .content import ContentSegments, join_segments
from .scan import CallObjectStream, Depth, call_from_value, decode_value, held_suffix
from .types import ParsedDelta, ParsedMessage, ToolCall, ToolCallDelta

_OUT, _PRE, _ARRAY, _IN, _AFTER_ITEM, _POST, _NAME, _NAMED_ARGS = range(8)
ARGS_TAG = "[ARGS]"
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_NAMED_HEAD = re.compile(r"([A-Za-z0-9_.\-]{1,64})\[ARGS\]")


def _may_become_named_head(text: str) -> bool:
    """Whether more text could still make ``text`` a name followed by [ARGS]."""
    m = _NAME_CHARS.match(text)
    return m is not None and ARGS_TAG.startswith(text[m.end() :]) and len(text) - m.end() < len(ARGS_TAG)


class TaggedCallParser:
    """Incremental parse; ``feed`` each text delta, then ``finish`` once."""

    def __init__(self, open_tag: str, close_tag: str | None, allow_array: bool, named_form: bool = False) -> None:
        self.open_tag, self.close_tag, self.allow_array = open_tag, close_tag, allow_array
        self.named_form = named_form
        self._name = ""  # named form: the call's name, until its arguments start
        self._depth: Depth | None = None  # named form: the arguments' depth, once they started
        self._state = _OUT
        self._buf = ""  # text not yet consumed by the current state
        self._block = ""  # the raw text of the current block, handed back if it is no call
        self._call: CallObjectStream | None = None
        self._content = ContentSegments()
        self._index = -1  # the current call's index
        self._named = False  # the current block released a call's name
        self._in_array = False

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        self._run(out)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state in (_PRE, _ARRAY, _IN, _NAME, _NAMED_ARGS):
            if not self._named:
                self._text(out, self._block + self._buf)  # a block cut short before any call: text
        else:
            self._text(out, self._buf)
        self._buf = self._block = ""
        self._state = _OUT
        out.content += self._content.finish()
        return out

    def _text(self, out: ParsedDelta, text: str) -> None:
        out.content += self._content.add(text)

    def _run(self, out: ParsedDelta) -> None:
        while self._buf:
            if self._state == _OUT:
                k = self._buf.find(self.open_tag)
                if k < 0:
                    keep = held_suffix(self._buf, [self.open_tag])
                    self._text(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._text(out, self._buf[:k])
                self._block = self.open_tag
                self._buf = self._buf[k + len(self.open_tag) :]
                self._named = False
                self._state = _PRE
            elif self._state in (_PRE, _ARRAY):
                stripped = self._buf.lstrip()
                if not stripped:
                    return
                self._block += self._buf[: len(self._buf) - len(stripped)]
                self._buf = stripped
                if stripped[0] == "{":
                    self._call = CallObjectStream()
                    self._state = _IN
                elif stripped[0] == "[" and self._state == _PRE and self.allow_array:
                    self._block += "["
                    self._buf = stripped[1:]
                    self._in_array = True
                    self._state = _ARRAY
                elif self.named_form and self._state == _PRE and _NAME_CHARS.match(stripped[0]):
                    self._state = _NAME
                else:
                    self._state = _OUT  # the tag opened no call: it is text
                    self._text(out, self._block)
                    self._block = ""
            elif self._state == _IN:
                assert self._call is not None
                chunk, self._buf = self._buf, ""
                piece = self._call.feed(chunk)
                self._block += chunk[: len(chunk) - len(piece.leftover)]
                if piece.name is not None:
                    self._content.call_starts()
                    self._index += 1
                    self._named = True
                    out.tool_calls.append(ToolCallDelta(self._index, piece.name, piece.arguments))
                elif piece.arguments:
                    out.tool_calls.append(ToolCallDelta(self._index, None, piece.arguments))
                if not piece.done:
                    return
                self._buf = piece.leftover
                if piece.not_a_call is not None:
                    self._text(out, self._block)
                    self._block = ""
                    self._state = _OUT
                else:
                    self._state = _AFTER_ITEM if self._in_array else _POST
            elif self._state == _AFTER_ITEM:
                stripped = self._buf.lstrip()
                if not stripped:
                    return
                self._buf = stripped[1:] if stripped[0] in ",]" else stripped
                if stripped[0] == ",":
                    self._state = _ARRAY
                else:
                    self._in_array = False
                    self._state = _POST
            elif self._state == _NAME:
                head = _NAMED_HEAD.match(self._buf)
                if head is None:
                    if _may_become_named_head(self._buf):
                        return
                    self._state = _OUT  # no name and [ARGS]: the tag is text
                    self._text(out, self._block)
                    self._block = ""
                    continue
                self._name, self._depth = head.group(1), None
                self._block += head.group(0)
                self._buf = self._buf[head.end() :]
                self._state = _NAMED_ARGS
            elif self._state == _NAMED_ARGS:
                self._named_args(out)
                if self._state == _NAMED_ARGS:
                    return
            else:  # _POST: the closing tag, if the format has one
                stripped = self._buf.lstrip()
                if self.close_tag is None:
                    self._state = _OUT
                elif self.close_tag.startswith(stripped):
                    if stripped == self.close_tag:
                        self._buf = ""
                        self._state = _OUT
                    return
                elif stripped.startswith(self.close_tag):
                    self._buf = stripped[len(self.close_tag) :]
                    self._state = _OUT
                else:
                    self._state = _OUT  # no closing tag: the rest is text
                self._block = ""

    def _named_args(self, out: ParsedDelta) -> None:
        """The arguments object of a named call, streamed as written until it closes."""
        if self._depth is None:
            stripped = self._buf.lstrip()
            if not stripped:
                return
            if stripped[0] != "{":
                self._state = _OUT  # [ARGS] not followed by an object: text
                self._text(out, self._block)
                self._block = ""
                return
            self._block += self._buf[: len(self._buf) - len(stripped)]
            self._buf = stripped
            self._depth = Depth()
            self._content.call_starts()
            self._index += 1
            self._named = True
            out.tool_calls.append(ToolCallDelta(self._index, self._name, ""))
        depth = self._depth
        for i, ch in enumerate(self._buf):
            depth.step(ch)
            if depth.depth == 0:
                out.tool_calls.append(ToolCallDelta(self._index, None, self._buf[: i + 1]))
                self._buf = self._buf[i + 1 :]
                self._block = ""
                self._state = _OUT
                return
        if self._buf:
            out.tool_calls.append(ToolCallDelta(self._index, None, self._buf))
        self._buf = ""


def _named_call(text: str, j: int) -> tuple[ToolCall, int] | None:
    """A named-form call (``name[ARGS]{...}``) at ``text[j:]`` and the index past it."""
    head = _NAMED_HEAD.match(text, j)
    if head is None:
        return None
    k = head.end()
    while k < len(text) and text[k].isspace():
        k += 1
    decoded = decode_value(text, k) if text.startswith("{", k) else None
    if decoded is None or not isinstance(decoded[0], dict):
        return None
    return ToolCall(head.group(1), text[k : decoded[1]]), decoded[1]


def parse_tagged(
    text: str, open_tag: str, close_tag: str | None, allow_array: bool, named_form: bool = False
) -> ParsedMessage:
    """The complete parse of a whole output, by the same rules."""
    segments: list[str] = [""]
    calls: list[ToolCall] = []
    pos = 0
    while True:
        k = text.find(open_tag, pos)
        if k < 0:
            segments[-1] += text[pos:]
            break
        j = k + len(open_tag)
        while j < len(text) and text[j].isspace():
            j += 1
        named = _named_call(text, j) if named_form else None
        if named is not None:
            segments[-1] += text[pos:k]
            calls.append(named[0])
            segments.append("")
            pos = named[1]
            continue
        decoded = decode_value(text, j) if j < len(text) and text[j] in ("{[" if allow_array else "{") else None
        items: list[tuple[str, str]] | None = None
        end = j
        if decoded is not None:
            value, end = decoded
            found = [call_from_value(item) for item in (value if isinstance(value, list) else [value])]
            items = [c for c in found if c is not None] if found and all(found) else None
        if not items:
            segments[-1] += text[pos:j] if decoded is None else text[pos : k + len(open_tag)]
            pos = j if decoded is None else k + len(open_tag)
            continue
        segments[-1] += text[pos:k]
        calls.extend(ToolCall(name, args) for name, args in items)
        segments.append("")
        w = end
        while w < len(text) and text[w].isspace():
            w += 1
        pos = w + len(close_tag) if close_tag is not None and text.startswith(close_tag, w) else end
    return ParsedMessage(join_segments(segments, len(calls)), tuple(calls))
