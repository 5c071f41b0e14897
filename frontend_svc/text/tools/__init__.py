"""Tool-call formats: the calls a model writes in its text, found while the text streams,
and the grammar that forces them.

``formats`` holds one object per format, in one table; each object's parser (``tagged``,
``leading``, ``pythonic``) is a state machine fed text deltas, whose end is also the
complete parse. The rules the parsers share are in ``content`` (whitespace between calls,
the complete message) and ``scan`` (marker hold-back, JSON call objects); the grammars in
``forcing``, with ``schema`` closing a schema's objects for them; the generic system
prompt for a template that does not show tools in ``prompt``; what a request says about
tools in ``spec``.
"""

from __future__ import annotations

from .formats import (
    FORCEABLE,
    FORMATS,
    ToolCallFormat,
    ToolCallParser,
    format_for,
    format_named,
    parser_for_template,
    tools_grammar,
)
from .types import ParsedDelta, ParsedMessage, ToolCall, ToolCallDelta

__all__ = [
    "FORCEABLE",
    "FORMATS",
    "ParsedDelta",
    "ParsedMessage",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallFormat",
    "ToolCallParser",
    "format_for",
    "format_named",
    "parser_for_template",
    "tools_grammar",
]
