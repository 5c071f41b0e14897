"""Calls between an opening and a closing tag, anywhere in the text:

    Let me check.<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>
    └ content ──┘└ open ───┘  └ one call object (or a JSON array of them) ───────────┘  └ close ────┘

Hermes and Qwen2.5 / Qwen3 write ``<tool_call>`` ... ``</tool_call>``, one object per pair;
Mistral writes ``[TOOL_CALLS]`` and a JSON array with no closing tag, or, with its newer
tokenizers (v11 on), the name and the arguments apart, one tag per call (``named_form``):

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

An opening tag that is not followed by a call object is text. A missing closing tag is
forgiven. A block (opening tag to closing tag) is calls in the complete message when all
of it is valid: every object a call that decodes, an array closed.

The states, one method each; a state consumes what it can of the buffer and returns
whether to go on (False: wait for more text):

    outside ──tag──▶ after_tag ──{──▶ in_call ──▶ closing ──▶ outside
                        │  └──[──▶ array_item ──{──▶ in_call ──▶ after_item ──,──▶ array_item
                        │                                           └──]──▶ closing
                        └─name─▶ call_name ──[ARGS]──▶ before_arguments ──{──▶ named_arguments ──▶ outside
"""

from __future__ import annotations

import re
from collections.abc import Callable

from .content import CallSpans, ContentSegments
from .scan import CallObjectStream, Depth, decode_value, held_suffix
from .types import ParsedDelta, ParsedMessage, ToolCall, ToolCallDelta

ARGS_TAG = "[ARGS]"
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_NAMED_HEAD = re.compile(r"([A-Za-z0-9_.\-]{1,64})\[ARGS\]")

State = Callable[[ParsedDelta], bool]


def _may_become_named_head(text: str) -> bool:
    """Whether more text could still make ``text`` a name followed by [ARGS]."""
    m = _NAME_CHARS.match(text)
    return m is not None and ARGS_TAG.startswith(text[m.end() :]) and len(text) - m.end() < len(ARGS_TAG)


class TaggedCallParser:
    """``feed`` each text delta, then ``finish`` once; ``message`` is then the complete parse."""

    def __init__(self, open_tag: str, close_tag: str | None, allow_array: bool, named_form: bool = False) -> None:
        self.open_tag, self.close_tag, self.allow_array = open_tag, close_tag, allow_array
        self.named_form = named_form
        self._state: State = self._outside
        self._buf = ""  # text not yet consumed, always the end of the output so far
        self._spans = CallSpans()
        self._content = ContentSegments()
        self._index = -1  # the current call's index
        # The current block, from its opening tag on:
        self._block = ""  # its raw text, handed back if it is no call
        self._block_at = 0  # where it starts in the output
        self._block_calls: list[ToolCall] | None = []  # its calls for the message; None: text there
        self._named = False  # it released a call's name
        self._in_array = False
        self._call = CallObjectStream()  # the call object being read
        self._name = ""  # named form: the call's name, and its arguments as far as they came
        self._args = ""
        self._depth = Depth()

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        self._spans.add(text)
        while self._buf and self._state(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._state == self._closing:
            self._end_block()
        if self._state in (self._outside, self._after_item, self._closing):
            self._text(out, self._buf)
        elif not self._named:
            self._text(out, self._block + self._buf)  # a block cut short before any call: text
        self._buf = self._block = ""
        self._state = self._outside
        out.content += self._content.finish()
        return out

    def message(self) -> ParsedMessage:
        return self._spans.message()

    # --- the states

    def _outside(self, out: ParsedDelta) -> bool:
        """Text, up to an opening tag (the start of one at the end is held back)."""
        k = self._buf.find(self.open_tag)
        if k < 0:
            keep = held_suffix(self._buf, [self.open_tag])
            self._text(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        self._text(out, self._buf[:k])
        self._buf = self._buf[k:]
        self._block, self._block_at, self._block_calls = "", self._here(), []
        self._named = self._in_array = False
        self._take(len(self.open_tag))
        self._state = self._after_tag
        return True

    def _after_tag(self, out: ParsedDelta) -> bool:
        """Past the opening tag: a call object, an array of them, or (named form) a name."""
        if not self._skip_space():
            return False
        first = self._buf[0]
        if first == "{":
            self._call, self._state = CallObjectStream(), self._in_call
        elif first == "[" and self.allow_array:
            self._take(1)
            self._in_array, self._state = True, self._array_item
        elif self.named_form and _NAME_CHARS.match(first):
            self._state = self._call_name
        else:
            self._not_a_call(out)  # the tag opened no call: it is text
        return True

    def _array_item(self, out: ParsedDelta) -> bool:
        """In an array: the next call object."""
        if not self._skip_space():
            return False
        if self._buf[0] == "{":
            self._call, self._state = CallObjectStream(), self._in_call
        else:
            self._not_a_call(out)
        return True

    def _in_call(self, out: ParsedDelta) -> bool:
        """A call object: its name once it closes its string, its arguments as they come."""
        chunk, self._buf = self._buf, ""
        piece = self._call.feed(chunk)
        self._block += chunk[: len(chunk) - len(piece.leftover)]
        if piece.name is not None:
            self._call_starts(out, piece.name, piece.arguments)
        elif piece.arguments:
            out.tool_calls.append(ToolCallDelta(self._index, None, piece.arguments))
        if not piece.done:
            return False
        self._buf = piece.leftover
        if piece.not_a_call is not None:
            self._not_a_call(out)
            return True
        self._add_call(piece.call)
        self._state = self._after_item if self._in_array else self._closing
        return True

    def _after_item(self, out: ParsedDelta) -> bool:
        """After a call in an array: a comma and the next, or the array's end."""
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        if stripped[0] == ",":
            self._buf, self._state = stripped[1:], self._array_item
            return True
        if stripped[0] == "]":
            self._buf = stripped[1:]
        else:
            self._buf = stripped
            self._block_calls = None  # an array never closed: text in the message
        self._in_array, self._state = False, self._closing
        return True

    def _call_name(self, out: ParsedDelta) -> bool:
        """Named form: the call's name and [ARGS]."""
        head = _NAMED_HEAD.match(self._buf)
        if head is None:
            if _may_become_named_head(self._buf):
                return False
            self._not_a_call(out)  # no name and [ARGS]: the tag is text
            return True
        self._name = head.group(1)
        self._take(head.end())
        self._state = self._before_arguments
        return True

    def _before_arguments(self, out: ParsedDelta) -> bool:
        """Named form: past [ARGS], the arguments object opens the call."""
        if not self._skip_space():
            return False
        if self._buf[0] != "{":
            self._not_a_call(out)  # [ARGS] not followed by an object: text
            return True
        self._args, self._depth = "", Depth()
        self._call_starts(out, self._name, "")
        self._state = self._named_arguments
        return True

    def _named_arguments(self, out: ParsedDelta) -> bool:
        """Named form: the arguments object, streamed as written until it closes."""
        depth = self._depth
        for i, ch in enumerate(self._buf):
            depth.step(ch)
            if depth.depth == 0:
                self._named_piece(out, i + 1)
                decoded = decode_value(self._args, 0)
                valid = decoded is not None and isinstance(decoded[0], dict)
                self._add_call(ToolCall(self._name, self._args) if valid else None)
                self._end_block()  # the named form has no closing tag
                self._state = self._outside
                return True
        self._named_piece(out, len(self._buf))
        return False

    def _closing(self, out: ParsedDelta) -> bool:
        """After the call (or the array): the closing tag, if the format has one."""
        if self.close_tag is not None:
            stripped = self._buf.lstrip()
            if self.close_tag.startswith(stripped) and stripped != self.close_tag:
                return False  # only whitespace, or part of the tag, so far
            if stripped.startswith(self.close_tag):
                self._buf = stripped[len(self.close_tag) :]
        self._end_block()  # with no closing tag, the rest is text
        self._state = self._outside
        return True

    # --- what the states share

    def _here(self) -> int:
        return self._spans.length - len(self._buf)

    def _take(self, n: int) -> None:
        self._block += self._buf[:n]
        self._buf = self._buf[n:]

    def _skip_space(self) -> bool:
        """Leading whitespace into the block; whether anything else is left."""
        stripped = self._buf.lstrip()
        self._take(len(self._buf) - len(stripped))
        return bool(stripped)

    def _text(self, out: ParsedDelta, text: str) -> None:
        out.content += self._content.add(text)

    def _call_starts(self, out: ParsedDelta, name: str, arguments: str) -> None:
        self._content.call_starts()
        self._index += 1
        self._named = True
        out.tool_calls.append(ToolCallDelta(self._index, name, arguments))

    def _named_piece(self, out: ParsedDelta, n: int) -> None:
        piece, self._buf = self._buf[:n], self._buf[n:]
        self._args += piece
        out.tool_calls.append(ToolCallDelta(self._index, None, piece))

    def _add_call(self, call: ToolCall | None) -> None:
        if call is None:
            self._block_calls = None  # one call is no valid JSON: the block is text in the message
        elif self._block_calls is not None:
            self._block_calls.append(call)

    def _not_a_call(self, out: ParsedDelta) -> None:
        self._text(out, self._block)
        self._block = ""
        self._in_array = False
        self._state = self._outside

    def _end_block(self) -> None:
        if self._block_calls:
            self._spans.calls(self._block_at, self._here(), self._block_calls)
        self._block_calls = None
