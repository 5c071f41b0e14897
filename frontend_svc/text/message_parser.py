"""A choice's text split into reasoning, content and tool calls, while it streams.

    text deltas (after stop strings)
        -> ReasoningParser   <think> ... </think>  -> reasoning
        -> ToolCallParser    the format's calls     -> tool-call pieces (index, id, name, arguments)
        -> the rest                                 -> content

Both stages are optional: without a reasoning parser all text goes to the tool parser;
without tools (or with tool_choice none) the content is the text after the thought. Tool
calls are looked for only after the thought ends, so a call the model drafts while
thinking is never returned. ``message``, after ``finish``, is the whole answer from the
same parse; it equals the deltas joined (content and reasoning exactly, calls by name, id
and arguments as the same JSON value), except where max_tokens cut a call short or a
call's text is no valid JSON: the deltas carry that call, the message its text as content.
An answer cut by max_tokens (``message(cut=True)``) is whole as the deltas carried it: a
call cut short after its name is a call (its arguments as far as they were written), and
the content is what streamed as content. Forced calls (``calls_only``) have no content:
there a call cut short is kept the same way, so a forced answer is the same streamed and
whole however it ends.

Call ids are made here, one per call index, and shared by the streamed pieces and the
complete parse, so a client that joins the pieces and one that reads the final message
see the same ids.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from frontend_svc.text.reasoning import ReasoningParser
from frontend_svc.text.tools import ToolCallFormat, ToolCallParser


@dataclass(frozen=True)
class ToolCallPiece:
    """A piece of call ``index``: the first carries its id and name, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True)
class FinishedCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass
class MessageDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallPiece] = field(default_factory=list)


@dataclass(frozen=True)
class AssistantMessage:
    """A whole answer, split."""

    content: str
    reasoning: str = ""
    tool_calls: tuple[FinishedCall, ...] = ()


@dataclass(frozen=True)
class MessageFormat:
    """How to split one request's output: its tool-call format (None: no tools) and
    whether a reasoning parser runs, and if so whether the prompt opened the thought."""

    tools: ToolCallFormat | None = None
    reasoning: bool = False
    starts_in_thought: bool = False
    # Forced calls (tool_choice required or a named function): the grammar writes calls and
    # the separators between them, nothing else, so no text is content; a call cut short
    # by max_tokens before its name would otherwise come out as raw markup.
    calls_only: bool = False

    @property
    def active(self) -> bool:
        return self.tools is not None or self.reasoning


class MessageParser:
    def __init__(self, fmt: MessageFormat) -> None:
        self.fmt = fmt
        self._reasoning = ReasoningParser(fmt.starts_in_thought) if fmt.reasoning else None
        self._tools: ToolCallParser | None = fmt.tools.new_parser() if fmt.tools is not None else None
        self._ids: list[str] = []
        self._reasoning_text: list[str] = []
        self._content_text: list[str] = []  # without tools: the content, for the message
        self._streamed: list[tuple[str, list[str]]] = []  # each streamed call's name and argument pieces
        self._streamed_content: list[str] = []  # with tools: the content as it streamed

    def call_id(self, index: int) -> str:
        while len(self._ids) <= index:
            self._ids.append(f"call_{uuid.uuid4().hex[:24]}")
        return self._ids[index]

    def feed(self, text: str) -> MessageDelta:
        if self._reasoning is None:
            return self._body(text, final=False)
        split = self._reasoning.feed(text)
        out = self._body(split.content, final=False)
        out.reasoning = split.reasoning
        if split.reasoning:
            self._reasoning_text.append(split.reasoning)
        return out

    def finish(self) -> MessageDelta:
        if self._reasoning is None:
            return self._body("", final=True)
        split = self._reasoning.finish()
        out = self._body(split.content, final=True)
        out.reasoning = split.reasoning
        self._reasoning_text.append(split.reasoning)
        return out

    def message(self, *, cut: bool = False) -> AssistantMessage:
        """The whole answer (after ``finish``), with the ids the pieces carried; ``cut``: max_tokens
        ended it, so a call it cut short is kept as the pieces carried it (module docstring)."""
        reasoning = "".join(self._reasoning_text)
        if self._tools is None:
            return AssistantMessage("".join(self._content_text), reasoning)
        parsed = self._tools.message()
        calls = tuple(FinishedCall(self.call_id(i), c.name, c.arguments) for i, c in enumerate(parsed.tool_calls))
        if not (self.fmt.calls_only or (cut and len(self._streamed) > len(calls))):
            return AssistantMessage(parsed.content, reasoning, calls)
        # What the parse did not take as a call (one cut short, or the whole array it was in)
        # is the calls as they streamed; beside them, the content as it streamed (forced: none).
        streamed = tuple(
            FinishedCall(self.call_id(i), name, "".join(pieces))
            for i, (name, pieces) in enumerate(self._streamed)
            if i >= len(calls)
        )
        return AssistantMessage("".join(self._streamed_content), reasoning, calls + streamed)

    def _body(self, text: str, final: bool) -> MessageDelta:
        if self._tools is None:
            self._content_text.append(text)
            return MessageDelta(content=text)
        parsed = self._tools.feed(text) if text else None
        out = MessageDelta()
        for delta in (parsed, self._tools.finish() if final else None):
            if delta is None:
                continue
            if not self.fmt.calls_only:
                out.content += delta.content
                self._streamed_content.append(delta.content)
            for piece in delta.tool_calls:
                first = piece.name is not None
                if first:
                    self._streamed.append((piece.name or "", []))
                self._streamed[piece.index][1].append(piece.arguments)
                out.tool_calls.append(
                    ToolCallPiece(
                        piece.index,
                        self.call_id(piece.index) if first else None,
                        piece.name,
                        piece.arguments,
                    )
                )
        return out
