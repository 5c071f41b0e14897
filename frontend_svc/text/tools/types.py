"""What a tool-call parser produces: deltas while the text streams, one message at the end.

The message is the same parse's result, so the deltas of a text, in any cut, add up to it
(content exactly; each call's name exactly and its arguments as the same JSON value: deltas
carry the arguments as the model wrote them, the message re-encoded), except for a call
left unfinished or whose text is no valid JSON, which the message holds as text
(content.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    """One call of a complete message. ``arguments`` is JSON text of an object."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call ``index``: the first piece of a call carries its name, later pieces
    only argument text. Concatenating a call's ``arguments`` gives JSON text."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """What one text delta released: plain content and pieces of calls, in order (content
    released before a call starts comes first)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass(frozen=True)
class ParsedMessage:
    """The complete parse of a whole output."""

    content: str
    tool_calls: tuple[ToolCall, ...] = ()
