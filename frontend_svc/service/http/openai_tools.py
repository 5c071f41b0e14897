"""OpenAI's tool fields -> plain values, and the calls of an answer -> OpenAI's shapes.

    tools: [{"type": "function", "function": {name, description, parameters, strict}}]
    tool_choice: "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}
    parallel_tool_calls: bool
    messages: assistant {"tool_calls": [{id, type, function: {name, arguments}}]},
              tool {"role": "tool", tool_call_id, content}

The same ToolRequest the gRPC face makes (text/tools/spec.py); planning checks it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from frontend_svc.service.http.errors import bad_request
from frontend_svc.service.http.fields import Fields
from frontend_svc.text.message_parser import FinishedCall, ToolCallPiece
from frontend_svc.text.nesting import too_deep
from frontend_svc.text.tools.spec import ToolChoice, ToolRequest, ToolSpec

# Planning names a tool's fields as the gRPC Tool does (tools[i].parameters); here they sit in "function".
_TOOL_FIELD = re.compile(r"tools\[(\d+)\]\.(name|description|parameters|strict)")


def tool_param(path: str) -> str:
    """A planning path into a tool as the OpenAI parameter (``tools[0].function.parameters``)."""
    return _TOOL_FIELD.sub(r"tools[\1].function.\2", path)


def tool_request(f: Fields) -> ToolRequest:
    tools = []
    for i, item in enumerate(f.list("tools") or []):
        tf = Fields(item, f"tools[{i}]")
        kind = tf.str("type", "function")
        if kind != "function":
            raise bad_request(tf.name("type"), f"only function tools are supported, got {kind!r}")
        fn = tf.object("function")
        if fn is None:
            raise bad_request(tf.name("function"), "is required: {name, description, parameters}")
        tools.append(function_tool(fn))
    return ToolRequest(tuple(tools), _choice(f), f.bool("parallel_tool_calls", True))


def function_tool(fn: Fields) -> ToolSpec:
    """A function's ``name``, ``description``, ``parameters`` (a JSON Schema) and ``strict``:
    chat's ``tools[i].function``, or a Responses API tool, which holds them at its top."""
    parameters = fn.raw("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(fn.name("parameters"), "must be a JSON Schema object")
    problem = too_deep(parameters)
    if problem is not None:
        raise bad_request(fn.name("parameters"), problem)
    return ToolSpec(
        fn.str("name", "") or "",
        fn.str("description", "") or "",
        json.dumps(parameters) if parameters is not None else "",
        fn.bool("strict", False) or False,
    )


def _choice(f: Fields) -> ToolChoice:
    raw = f.raw("tool_choice")
    if raw is None:
        return ToolChoice("auto")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise bad_request("tool_choice", f"must be auto, none, required or a function, got {raw!r}")
        return ToolChoice(raw)
    cf = Fields(raw, "tool_choice")
    fn = cf.object("function")
    name = fn.str("name") if fn is not None else None
    if cf.str("type") != "function" or not name:
        raise bad_request("tool_choice", 'a named choice is {"type": "function", "function": {"name": ...}}')
    return ToolChoice("function", name)


def message_extras(mf: Fields) -> dict[str, Any]:
    """An assistant turn's tool_calls, a tool turn's tool_call_id and name, as planning reads them."""
    out: dict[str, Any] = {}
    calls = mf.list("tool_calls")
    if calls:
        out["tool_calls"] = []
        for j, call in enumerate(calls):
            cf = Fields(call, mf.name(f"tool_calls[{j}]"))
            fn = cf.object("function")
            if fn is None:
                raise bad_request(cf.name("function"), "is required: {name, arguments}")
            arguments = fn.raw("arguments", "{}")
            if not isinstance(arguments, str):  # some clients send the object itself
                problem = too_deep(arguments)
                if problem is not None:
                    raise bad_request(fn.name("arguments"), problem)
                arguments = json.dumps(arguments)
            out["tool_calls"].append({"id": cf.str("id", ""), "name": fn.str("name", ""), "arguments": arguments})
    if mf.str("tool_call_id"):
        out["tool_call_id"] = mf.str("tool_call_id")
    if mf.str("name"):
        out["name"] = mf.str("name")
    return out


def call_delta(piece: ToolCallPiece) -> dict:
    """One streamed piece: the first names the call (id, type, name), later ones add arguments."""
    if piece.name is not None:
        return {
            "index": piece.index,
            "id": piece.id,
            "type": "function",
            "function": {"name": piece.name, "arguments": piece.arguments},
        }
    return {"index": piece.index, "function": {"arguments": piece.arguments}}


def message_call(call: FinishedCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
