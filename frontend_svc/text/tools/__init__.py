"""Tool-call parsers: the calls a model writes in its text, found while the text streams.

One parser per format, a state machine fed text deltas (``feed``, then ``finish``) whose
``message`` is the complete parse, so a whole output (``parse``) is that parser fed it at
once; the rules they share are in ``content`` (whitespace between calls, the message) and
``scan`` (marker hold-back, JSON call objects).

    name          what the model writes                                        models
    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>      Hermes, Qwen2.5, Qwen3
    llama3_json   [<|python_tag|>]{"name": ..., "parameters": {...}}[; ...]     Llama 3.1 / 3.2 / 3.3
    mistral       [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]          Mistral, Mixtral
                  [TOOL_CALLS]name[ARGS]{...}  (tokenizer v11 on)              Mistral Small 3.2, Magistral, Devstral
    pythonic      [f(a=1), g(b="x")]                                            Llama 3.2 / 4 (pythonic)
    json          {"name": ..., "arguments": {...}}  or a JSON array of them   any model (no native format)

``parser_for_template`` picks one from a chat template's text when the template shows its
format; ``json`` is the fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .leading import LeadingCallParser
from .pythonic import PythonicCallParser
from .tagged import TaggedCallParser
from .types import ParsedDelta, ParsedMessage, ToolCall, ToolCallDelta

__all__ = [
    "FORMATS",
    "ParsedDelta",
    "ParsedMessage",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallFormat",
    "ToolCallParser",
    "format_named",
    "parser_for_template",
]


class ToolCallParser(Protocol):
    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...

    def message(self) -> ParsedMessage: ...


@dataclass(frozen=True)
class ToolCallFormat:
    """A format: its incremental parser's factory."""

    name: str
    new_parser: Callable[[], ToolCallParser]

    def parse(self, text: str) -> ParsedMessage:
        """The complete parse of a whole output: the streaming parse, fed it at once."""
        parser = self.new_parser()
        parser.feed(text)
        parser.finish()
        return parser.message()


FORMATS: dict[str, ToolCallFormat] = {
    f.name: f
    for f in (
        ToolCallFormat("hermes", lambda: TaggedCallParser("<tool_call>", "</tool_call>", allow_array=True)),
        ToolCallFormat("llama3_json", lambda: LeadingCallParser("<|python_tag|>", ";", allow_array=False)),
        ToolCallFormat("mistral", lambda: TaggedCallParser("[TOOL_CALLS]", None, allow_array=True, named_form=True)),
        ToolCallFormat("pythonic", PythonicCallParser),
        ToolCallFormat("json", lambda: LeadingCallParser(None, "", allow_array=True)),
    )
}

# What a chat template shows of its format, most specific first.
_TEMPLATE_SIGNS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_start|>", "pythonic"),
    ("<|python_tag|>", "llama3_json"),
)


def format_named(name: str) -> ToolCallFormat:
    """The format called ``name``; ValueError naming the known ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(FORMATS)}") from None


def parser_for_template(chat_template: str | None) -> ToolCallFormat:
    """The format a chat template shows, or the generic JSON one."""
    for sign, name in _TEMPLATE_SIGNS:
        if chat_template and sign in chat_template:
            return FORMATS[name]
    return FORMATS["json"]
