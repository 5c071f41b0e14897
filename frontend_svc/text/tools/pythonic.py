"""Calls written as a Python list, the whole output (Llama 3.2 / 4's pythonic format):

    [get_weather(city="Paris", unit="celsius"), get_time()]

optionally between ``<|python_start|>`` and ``<|python_end|>``. The list is held until the
output ends, then parsed with ``ast``; argument values must be literals and are re-encoded
as JSON. An output that does not start with ``[``, or a list that is not all calls, is
content.
"""

from __future__ import annotations

import ast
import json

from .types import ParsedDelta, ParsedMessage, ToolCall, ToolCallDelta

START_TAG, END_TAG = "<|python_start|>", "<|python_end|>"


class PythonicCallParser:
    """``feed`` each text delta, then ``finish`` once; ``message`` is then the complete parse."""

    def __init__(self) -> None:
        self._buf = ""  # a list held until the end, or nothing once the output is content
        self._text: list[str] = []
        self._content = False
        self._message = ParsedMessage("")

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        self._text.append(text)
        if self._content:
            out, self._buf = self._buf, ""
            return ParsedDelta(content=out)
        body = _body(self._buf)
        if not body:
            return ParsedDelta()
        if body[0] != "[":
            self._content = True
            out, self._buf = self._buf, ""
            return ParsedDelta(content=out)
        return ParsedDelta()  # a list: held until the end

    def finish(self) -> ParsedDelta:
        text, self._buf = self._buf, ""
        if self._content:
            self._message = ParsedMessage("".join(self._text))
            return ParsedDelta(content=text)
        self._message = parse_pythonic(text)
        return ParsedDelta(
            content=self._message.content,
            tool_calls=[ToolCallDelta(i, c.name, c.arguments) for i, c in enumerate(self._message.tool_calls)],
        )

    def message(self) -> ParsedMessage:
        return self._message


def _body(text: str) -> str:
    stripped = text.lstrip()
    if stripped.startswith(START_TAG):
        stripped = stripped[len(START_TAG) :].lstrip()
    elif START_TAG.startswith(stripped):
        return ""
    return stripped


def parse_pythonic(text: str) -> ParsedMessage:
    """A whole output held as a list: its calls, or all of it as content."""
    body = _body(text).rstrip()
    if body.endswith(END_TAG):
        body = body[: -len(END_TAG)].rstrip()
    if not body.startswith("["):
        return ParsedMessage(text)
    try:
        tree = ast.parse(body, mode="eval")
    except (SyntaxError, ValueError):
        return ParsedMessage(text)
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return ParsedMessage(text)
    calls = []
    for node in tree.body.elts:
        call = _call(node)
        if call is None:
            return ParsedMessage(text)
        calls.append(call)
    return ParsedMessage("", tuple(calls))


def _call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    if name is None:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, SyntaxError, TypeError):
            return None
    try:
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))
    except (TypeError, ValueError):
        return None


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        prefix = _dotted(node.value)
        return None if prefix is None else f"{prefix}.{node.attr}"
    return None
