"""Forced tool calls as a grammar in the model's own call format (llguidance's Lark).

The engine's sampler enforces the grammar token by token, so a forced output is always
the calls the format's parser reads, with arguments valid against each tool's schema.
Each format writes its own ``calls`` rule from a ``Forced`` (its row in formats.py), most
of them from one ``call`` rule, one branch per allowed tool:

    call: call_0 | call_1 ...
    call_0: "{\"name\":\"get_weather\",\"<arguments key>\":" args_0 "}"
    args_0: %json {<the tool's arguments schema>}

Each tool's arguments are a ``%json`` of their own, so the schema is the root of its own
compile and its references (``#/$defs/Address``, ``#/definitions/...``, ``#``) resolve
where the tool's author wrote them; inside one wrapper object they would point at the
wrapper and fail. Recursive schemas compile to recursive rules, never an unbounded walk.
The arguments schema has its objects closed (schema.py): a forced call takes the keys
its schema lists and no others, unless the schema leaves them open.

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

from .schema import close_objects
from .spec import ToolRequest, ToolSpec

_EXACT = {"whitespace_flexible": False, "lenient": True}


class ForcingError(ValueError):
    """The request's tools cannot be forced in this format; the message says why."""


@dataclass(frozen=True)
class Forced:
    """One request's forced calls, as a format's rule reads them."""

    tools: tuple[ToolSpec, ...]  # the tools a call may name
    many: bool  # more than one call allowed
    call: str  # the rules of one call object in the format's arguments key (``call`` and its branches)
    tag: Callable[[str], str]  # a tag as the grammar writes it


# A format's rule: the Lark lines that define ``calls``.
CallsRule = Callable[[Forced], list[str]]


def call_rules(request: ToolRequest, arguments_key: str) -> str:
    """The Lark rules of one call object of any allowed tool: ``call`` and one branch per tool,
    written compact, as the arguments' ``%json`` writes them."""
    tools = request.forced_tools()
    lines = ["call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, t in enumerate(tools):
        head = "{" + json.dumps("name") + ":" + json.dumps(t.name) + "," + json.dumps(arguments_key) + ":"
        lines += [f'call_{i}: {json.dumps(head)} args_{i} "}}"', f"args_{i}: {arguments_rule(t)}"]
    return "\n".join(lines)


def arguments_schema(tool: ToolSpec) -> dict[str, Any]:
    """The schema of one tool's arguments object, as a forced call writes it (closed)."""
    return {**close_objects(tool.schema()), "x-guidance": _EXACT}


def arguments_rule(tool: ToolSpec) -> str:
    """The grammar item of one tool's arguments: a ``%json`` with the schema as its root."""
    return f"%json {json.dumps(arguments_schema(tool))}"


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
    lines = rule(Forced(request.forced_tools(), many, call_rules(request, arguments_key), tag))
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
