"""What a request says about tools, in plain values: the functions, and how freely to call them.

Both public faces (gRPC, and the HTTP ones) convert their own spelling to these values;
``check_tools`` holds the rules they share, and ``template_tools`` gives the chat template
the OpenAI-shaped list that Hugging Face templates read (``tool.function.name`` ...).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from frontend_svc.text import nesting
from tandem_common.sampling import StructuredOutput, check_structured_output

MAX_TOOLS = 128
MAX_TOOL_CALLS_PER_MESSAGE = 128
MAX_PARAMETERS_BYTES = 64 * 1024
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
TOOL_CHOICE_MODES = ("auto", "none", "required", "function")
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call. ``parameters`` is JSON Schema text ("" = none)."""

    name: str
    description: str = ""
    parameters: str = ""
    strict: bool = False

    def schema(self) -> dict[str, Any]:
        """The arguments' schema as a value (checked by ``check_tools`` first)."""
        return json.loads(self.parameters) if self.parameters else dict(_NO_ARGUMENTS)


@dataclass(frozen=True)
class ToolChoice:
    """``mode`` is one of TOOL_CHOICE_MODES; ``function_name`` is set for "function"."""

    mode: str = "auto"
    function_name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[ToolSpec, ...] = ()
    choice: ToolChoice = ToolChoice()
    parallel_tool_calls: bool = True

    @property
    def active(self) -> bool:
        """Whether the model sees the tools and its calls are parsed."""
        return bool(self.tools) and self.choice.mode != "none"

    def forced_tools(self) -> tuple[ToolSpec, ...]:
        if self.choice.mode == "function":
            return tuple(t for t in self.tools if t.name == self.choice.function_name)
        return self.tools


def check_tools(request: ToolRequest, tools_field: str, choice_field: str) -> tuple[str, str] | None:
    """(field, what to fix) for the first broken rule, or None."""
    if len(request.tools) > MAX_TOOLS:
        return tools_field, f"at most {MAX_TOOLS} tools are allowed, got {len(request.tools)}"
    seen: set[str] = set()
    for i, tool in enumerate(request.tools):
        if not NAME_PATTERN.fullmatch(tool.name):
            return (
                f"{tools_field}[{i}].name",
                f"{tool.name[:80]!r} is not a valid name: use 1 to 64 letters, digits, '_', '-' or '.'",
            )
        if tool.name in seen:
            return f"{tools_field}[{i}].name", f"{tool.name!r} is named twice; tool names must be unique"
        seen.add(tool.name)
        problem = _schema_problem(tool.parameters)
        if problem is not None:
            return f"{tools_field}[{i}].parameters", problem
    choice = request.choice
    if choice.mode not in TOOL_CHOICE_MODES:
        return choice_field, f"must be one of {', '.join(TOOL_CHOICE_MODES[:3])} or a function, got {choice.mode!r}"
    if choice.forced and not request.tools:
        return choice_field, f"{choice.mode!r} needs tools, and the request has none"
    if choice.mode == "function" and choice.function_name not in seen:
        return choice_field, f"function {choice.function_name!r} is not one of the request's tools"
    return None


def _schema_problem(parameters: str) -> str | None:
    if not parameters:
        return None
    if len(parameters.encode()) > MAX_PARAMETERS_BYTES:
        return f"at most {MAX_PARAMETERS_BYTES} bytes are allowed, got {len(parameters.encode())}"
    try:
        value = nesting.loads(parameters)
    except json.JSONDecodeError as e:
        return f"is not valid JSON: {e}"
    except nesting.TooDeep as e:
        return str(e)
    if not isinstance(value, dict):
        return f"must be a JSON Schema object, got {type(value).__name__}"
    # What would make its compile expensive (counted repetitions in patterns), before it is compiled.
    error = check_structured_output(StructuredOutput("json_schema", parameters))
    return None if error is None else error.message


def template_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    """The tools as chat templates read them (the OpenAI request shape)."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.schema(),
                **({"strict": True} if t.strict else {}),
            },
        }
        for t in tools
    ]
