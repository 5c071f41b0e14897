"""Forced tool calls as a grammar in the model's own call format (llguidance's Lark).

The engine's sampler enforces the grammar token by token, so a forced output is always
the calls the format's parser reads, with arguments valid against each tool's schema:

    hermes       <tool_call>\\n%json{call}\\n</tool_call> ("\\n" <tool_call>...)*
    mistral      [TOOL_CALLS] "[" %json{call} ("," %json{call})* "]"
                 or, for templates of the newer form (``mistral_named``, they show [ARGS]):
                 ([TOOL_CALLS] name [ARGS] %json{the tool's schema})+
    llama3_json  %json{call} (";" %json{call})*         ("parameters", as Llama writes it)
    json         %json{call}   or   "[" %json{call} ("," ...)* "]"   (parallel)

where %json{call} is {"name": <const>, "arguments": <the tool's schema>} for any of the
allowed tools. A tag that is a special token of the tokenizer is written as that token
(``<[id]>``), the way the model emits it; otherwise as text. Pythonic calls are Python
syntax, not JSON, and are not forced.

With a response format (json_schema, json_object, regex or choice) the grammar is
``start: calls | answer`` (auto: the model calls tools or answers in the format); with
required or a named tool the answer branch is left out, since the client asked for calls.
A reasoning model gets the thought in front: ``start: thought body``, where the thought
is free text up to ``</think>`` (optional ``<think>`` when the prompt did not open it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tandem_common.sampling import StructuredOutput

from .spec import ToolRequest, ToolSpec

FORCEABLE = ("hermes", "mistral", "llama3_json", "json")


class ForcingError(ValueError):
    """The request's tools cannot be forced in this format; the message says why."""


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
    return {**schema, "x-guidance": {"whitespace_flexible": False, "lenient": True}}


def _args(tool: ToolSpec) -> dict[str, Any]:
    return {**tool.schema(), "x-guidance": {"whitespace_flexible": False, "lenient": True}}


def tools_grammar(
    format_name: str,
    request: ToolRequest,
    answer: StructuredOutput | None,
    special_token_id: Callable[[str], int | None],
    *,
    thought: str | None = None,
    mistral_named: bool = False,
) -> str:
    """The Lark grammar for this request. ``thought`` is None (no reasoning parser),
    "open" (the prompt opened the thought) or "optional" (the model may open one)."""
    if format_name not in FORCEABLE:
        raise ForcingError(
            f"the {format_name} tool-call format cannot be forced by a grammar; "
            f"tool_choice required or a named function needs one of: {', '.join(FORCEABLE)}"
        )
    forced = request.choice.forced
    many = request.parallel_tool_calls and request.choice.mode != "function"
    key = "parameters" if format_name == "llama3_json" else "arguments"
    lines = [f"call: %json {json.dumps(call_schema(request, key))}"]

    def tag(text: str) -> str:
        token_id = special_token_id(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)

    if format_name == "hermes":
        lines.append(f'one: {tag("<tool_call>")} "\\n" call "\\n" {tag("</tool_call>")}')
        lines.append('calls: one ("\\n" one)*' if many else "calls: one")
    elif format_name == "mistral" and mistral_named:
        lines = [
            "one: " + " | ".join(f"one_{i}" for i in range(len(request.forced_tools()))),
            *(
                f"one_{i}: {tag('[TOOL_CALLS]')} {json.dumps(t.name)} {tag('[ARGS]')} %json {json.dumps(_args(t))}"
                for i, t in enumerate(request.forced_tools())
            ),
            "calls: one+" if many else "calls: one",
        ]
    elif format_name == "mistral":
        lines.append(f'calls: {tag("[TOOL_CALLS]")} "[" call ' + ('("," call)* "]"' if many else '"]"'))
    elif format_name == "llama3_json":
        lines.append('calls: call (";" call)*' if many else "calls: call")
    else:
        lines.append('calls: call | "[" call ("," call)* "]"' if many else "calls: call")

    body = "calls"
    if answer is not None and not forced:
        lines.append(f"answer: {_answer_rule(answer)}")
        body = "calls | answer"
    return "\n".join([*_thought_rules(thought, tag, body), *lines]) + "\n"


def answer_grammar(answer: StructuredOutput, special_token_id: Callable[[str], int | None], thought: str) -> str:
    """A response format alone behind a thought (a reasoning model, no tools)."""

    def tag(text: str) -> str:
        token_id = special_token_id(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)

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
