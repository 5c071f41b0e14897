"""Forced tool calls as a grammar in the model's own call format (llguidance's Lark).

The engine's sampler enforces the grammar token by token, so a forced output is always
the calls the format's parser reads, with arguments valid against each tool's schema.
Each format writes its own ``calls`` rule from a ``Forced`` (its row in formats.py), most
of them from one ``call`` rule:

    call: %json {"name": <const>, "<arguments key>": <the tool's schema>}   (any allowed tool)

A tag that is a special token of the tokenizer is written as that token (``<[id]>``), the
way the model emits it; otherwise as text.

With a response format (json_schema, json_object, regex or choice) the grammar is
``start: calls | answer`` (auto: the model calls tools or answers in the format); with
required or a named tool the answer branch is left out, since the client asked for calls.
A reasoning model gets the thought in front: ``start: thought body``, where the thought
is free text up to ``</think>`` (optional ``<think>`` when the prompt did not open it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem_common.sampling import StructuredOutput

from .spec import ToolRequest, ToolSpec

_EXACT = {"whitespace_flexible": False, "lenient": True}


class ForcingError(ValueError):
    """The request's tools cannot be forced in this format; the message says why."""


@dataclass(frozen=True)
class Forced:
    """One request's forced calls, as a format's rule reads them."""

    tools: tuple[ToolSpec, ...]  # the tools a call may name
    many: bool  # more than one call allowed
    call: str  # the rule of one call object in the format's arguments key
    tag: Callable[[str], str]  # a tag as the grammar writes it


# A format's rule: the Lark lines that define ``calls``.
CallsRule = Callable[[Forced], list[str]]


def call_schema(request: ToolRequest, arguments_key: str) -> dict[str, Any]:
    """The JSON Schema of one call object of any allowed tool."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, arguments_key: t.schema()},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for t in request.forced_tools()
    ]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": _EXACT}


def arguments_schema(tool: ToolSpec) -> dict[str, Any]:
    """The schema of one tool's arguments object alone, as a call writes it."""
    return {**tool.schema(), "x-guidance": _EXACT}


def calls_grammar(
    rule: CallsRule,
    arguments_key: str,
    request: ToolRequest,
    answer: StructuredOutput | None,
    special_token_id: Callable[[str], int | None],
    thought: str | None,
) -> str:
    """The Lark grammar for this request. ``thought`` is None (no reasoning parser),
    "open" (the prompt opened the thought) or "optional" (the model may open one)."""
    forced = request.choice.forced
    tag = _tag_writer(special_token_id)
    many = request.parallel_tool_calls and request.choice.mode != "function"
    call = f"call: %json {json.dumps(call_schema(request, arguments_key))}"
    lines = rule(Forced(request.forced_tools(), many, call, tag))
    body = "calls"
    if answer is not None and not forced:
        lines.append(f"answer: {_answer_rule(answer)}")
        body = "calls | answer"
    return "\n".join([*_thought_rules(thought, tag, body), *lines]) + "\n"


def _tag_writer(special_token_id: Callable[[str], int | None]) -> Callable[[str], str]:
    def tag(text: str) -> str:
        token_id = special_token_id(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)

    return tag


def answer_grammar(answer: StructuredOutput, special_token_id: Callable[[str], int | None], thought: str) -> str:
    """A response format alone behind a thought (a reasoning model, no tools)."""
    tag = _tag_writer(special_token_id)
    return "\n".join([*_thought_rules(thought, tag, "answer"), f"answer: {_answer_rule(answer)}"]) + "\n"


def _thought_rules(thought: str | None, tag: Callable[[str], str], body: str) -> list[str]:
    if thought is None:
        return [f"start: {body}"]
    # A lazy lexeme: the thought ends at the first </think>, which the rule writes itself.
    rules = [f"thought_text[lazy]: /(?s:.*){_regex_escape('</think>')}/"]
    if thought == "open":
        return ["start: thought_text body", f"body: {body}", *rules]
    return [f"start: ({tag('<think>')} thought_text)? body", f"body: {body}", *rules]


def _answer_rule(answer: StructuredOutput) -> str:
    if answer.kind == "json_schema":
        schema = json.loads(answer.text)
    elif answer.kind == "json_object":
        schema = {"type": "object"}
    elif answer.kind == "regex":
        return f"/{answer.text.replace('/', chr(92) + '/')}/"
    elif answer.kind == "choice":
        return " | ".join(json.dumps(c) for c in answer.choices)
    else:
        raise ForcingError(
            "a grammar constraint cannot be combined with tools or a reasoning parser; "
            "use json_schema, json_object, regex or choice"
        )
    if isinstance(schema, dict):
        options = {"whitespace_flexible": answer.json_whitespace == "flexible", "lenient": answer.json_lenient}
        schema = {**schema, "x-guidance": options}
    return f"%json {json.dumps(schema)}"


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$/" else c for c in text)
