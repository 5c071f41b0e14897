"""Scanning helpers the tool-call formats share: marker hold-back, and one JSON call object
streamed as it arrives.

A call object is ``{"name": "f", "arguments": {...}}`` (``parameters`` in Llama's format).
When the name comes first, as every format's examples write it, the name is released as
soon as its string closes and the arguments as their characters arrive:

    text so far:  {"name": "get_weather", "arguments": {"city": "Par
    released:      name "get_weather"        arguments '{"city": "Par'

Any other shape (arguments first, extra keys, a name that is not a string) is buffered and
decoded whole when the object closes; an object that is not a call is handed back as text.
Once the object closes it is decoded whole in either case, for the complete message: a call
there has its arguments re-encoded, and a streamed call whose text is no valid JSON is none.
Scanning is string- and escape-aware, so braces and closing tags inside strings never end
an object.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

from .types import ToolCall

# The head of a call whose name comes first; the arguments' value starts at the match's end.
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
# Past this many characters without a recognisable head, stop looking and decode at the end.
_MAX_HEAD_CHARS = 4096
ARGUMENT_KEYS = ("arguments", "parameters")
# One of each, as json.loads and json.dumps keep theirs: building one costs more than most
# calls' decoding.
_DECODER = json.JSONDecoder()
_encode = json.JSONEncoder(ensure_ascii=False).encode


def held_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that is a proper start of a marker: the
    characters to hold back because the next delta may complete the marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


def call_from_value(value: object) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object, or None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args: object = next((value[k] for k in ARGUMENT_KEYS if k in value), {})
    try:
        return value["name"], args if isinstance(args, str) else _encode(args)
    except RecursionError:  # the model's output nests ~1,000 levels deep: text, not a call
        return None


def decode_value(text: str, start: int) -> tuple[object, int] | None:
    """The JSON value at ``text[start:]`` and the index past it, or None if there is none
    (text nested too deep for Python's json included: the model's output stays text)."""
    try:
        return _DECODER.raw_decode(text, start)
    except (json.JSONDecodeError, RecursionError):
        return None


class Depth:
    """Bracket depth over JSON text, string- and escape-aware."""

    __slots__ = ("depth", "in_string", "escaped")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def step(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1


@dataclass
class CallPiece:
    """What one feed of a call object released."""

    name: str | None = None
    arguments: str = ""
    done: bool = False  # the object closed
    not_a_call: str | None = None  # the object's text, when it closed and is not a call
    call: ToolCall | None = None  # once closed: the call as the complete message holds it, if any
    leftover: str = ""  # text after the object


class CallObjectStream:
    """One JSON call object, fed as its text arrives (the first character fed is ``{``)."""

    def __init__(self) -> None:
        self._text = ""
        self._outer = Depth()
        self._scanned = 0
        self._name: str | None = None
        self._value_at: int | None = None  # where the arguments' value starts (first non-space)
        self._args = Depth()
        self._args_pos: int | None = None  # argument characters scanned up to here
        self._args_kind = ""  # "bracket", "string" or "scalar", from the value's first character
        self._args_done = False

    @property
    def named(self) -> bool:
        return self._name is not None

    @property
    def text(self) -> str:
        return self._text

    def feed(self, chunk: str) -> CallPiece:
        piece = CallPiece()
        self._text += chunk
        end = self._scan()
        text = self._text if end is None else self._text[:end]
        if self._name is None and self._args_pos is None and len(text) <= _MAX_HEAD_CHARS:
            head = _HEAD.match(text)
            if head:
                self._name = json.loads(f'"{head.group(1)}"')
                self._args_pos = head.end()
                piece.name = self._name
        if self._args_pos is not None:
            piece.arguments = self._stream_arguments(text, closed=end is not None)
        if end is None:
            return piece
        piece.done = True
        piece.leftover = self._text[end:]
        decoded = decode_value(text, 0)
        call = call_from_value(decoded[0]) if decoded else None
        piece.call = None if call is None else ToolCall(*call)
        if self._args_pos is None:
            if call is None:
                piece.not_a_call = text
            else:
                piece.name, piece.arguments = call
        return piece

    def _scan(self) -> int | None:
        """Advance the outer depth; the index past the closing brace once it is seen."""
        outer, text = self._outer, self._text
        for i in range(self._scanned, len(text)):
            outer.step(text[i])
            if outer.depth == 0:
                self._scanned = i + 1
                return i + 1
        self._scanned = len(text)
        return None

    def _stream_arguments(self, text: str, closed: bool) -> str:
        """Argument characters that arrived since the last feed. A bracketed value streams
        as it comes; a string value (JSON text inside a string) is released decoded once it
        closes, a scalar as written once it ends."""
        if self._args_done:
            return ""
        assert self._args_pos is not None
        out: list[str] = []
        i = self._args_pos
        while i < len(text):
            ch = text[i]
            if self._value_at is None:
                if ch.isspace():
                    i += 1
                    continue
                self._value_at = i
                self._args_kind = "bracket" if ch in "{[" else "string" if ch == '"' else "scalar"
            if self._args_kind == "scalar":
                if ch in ",}":
                    self._args_pos = len(text)
                    return self._finish(text[self._value_at : i].strip() or "{}")
            else:
                self._args.step(ch)
                if self._args_kind == "bracket":
                    out.append(ch)
                if self._args.depth == 0 and not self._args.in_string:
                    self._args_pos = len(text)
                    if self._args_kind == "string":
                        return self._finish(_decoded_string(text[self._value_at : i + 1]))
                    self._args_done = True
                    return "".join(out)
            i += 1
        self._args_pos = len(text)
        if closed and self._value_at is None:
            return self._finish("{}")
        return "".join(out)

    def _finish(self, arguments: str) -> str:
        self._args_done = True
        return arguments


def _decoded_string(raw: str) -> str:
    """Arguments written as a JSON string holding JSON text: the text itself."""
    try:
        value = json.loads(raw)
        return value if isinstance(value, str) else _encode(value)
    except (json.JSONDecodeError, RecursionError):
        return raw
