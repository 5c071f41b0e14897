"""Tools for a chat template that does not show them: a generic system prompt.

A template that never reads ``tools`` (SmolLM2's own, plain ChatML) drops them, so the model
would never learn of them and ``auto`` could never call. For such a template the tools go
in a system prompt of the frontend's own, which lists each function with its JSON Schema
and shows how one call is written, in the call format the request is parsed with (its
``write_calls``, formats.py; the generic ``json`` one for a template with no format):

    <the request's own system prompt, if any>

    You can call these functions. Each line is one function: its name, what it does, and
    the JSON Schema of its arguments.
    {"name": "get_weather", "description": "...", "parameters": {...}}
    To call functions, reply with the calls alone, written like this:
    {"name": "get_weather", "arguments": {"city": "..."}}
    Otherwise answer in plain text.

An assistant turn's calls reach a template that never reads ``tool_calls`` the same way,
as text in the format after the turn's content, so the model sees its own earlier calls.
Tool results are left as the request wrote them (a ``tool`` turn).

Whether a template shows tools is read from its source: one that never names ``tools``
(``tool_calls``) cannot render them. llama.cpp's "generic" chat handler is the model for
the idea: a model with no native format is told the format in the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from .spec import ToolSpec

# A call as a format writes it: (name, arguments) pairs -> the text a model writes.
CallWriter = Callable[[Sequence[tuple[str, dict[str, Any]]]], str]

MAX_EXAMPLE_ARGUMENTS = 3  # the example call shows at most this many of the first tool's arguments
_SAMPLE = {"string": "...", "integer": 0, "number": 0, "boolean": False, "array": [], "object": {}}


def template_shows_tools(chat_template: str | None) -> bool:
    return chat_template is not None and "tools" in chat_template


def template_shows_calls(chat_template: str | None) -> bool:
    return chat_template is not None and "tool_calls" in chat_template


def tools_system_prompt(tools: Sequence[ToolSpec], write_calls: CallWriter) -> str:
    """The system prompt that shows ``tools`` and the call format (module docstring)."""
    lines = [
        "You can call these functions. Each line is one function: its name, what it does, "
        "and the JSON Schema of its arguments."
    ]
    lines += [
        json.dumps({"name": t.name, "description": t.description, "parameters": t.schema()}, ensure_ascii=False)
        for t in tools
    ]
    lines += [
        "To call functions, reply with the calls alone, written like this:",
        write_calls([(tools[0].name, _example_arguments(tools[0].schema()))]),
        "Otherwise answer in plain text.",
    ]
    return "\n".join(lines)


def with_system_prompt(messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
    """``messages`` with ``prompt`` after the text of a leading system turn, or in a new one."""
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        first = messages[0]
        content = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def calls_as_content(message: dict[str, Any], write_calls: CallWriter) -> dict[str, Any]:
    """An assistant turn whose calls (arguments as objects, as templates read them) become
    text in the format after its content."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    content = message.get("content") or ""
    written = write_calls(calls)
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = f"{content}\n{written}" if content else written
    return out


def _example_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return {}
    required = [p for p in schema.get("required") or [] if p in properties]
    names = (required or list(properties))[:MAX_EXAMPLE_ARGUMENTS]
    return {n: _sample(properties[n]) for n in names}


def _sample(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return "..."
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type")
    return _SAMPLE.get(kind, "...") if isinstance(kind, str) else "..."
