"""Anthropic's tool use and thinking <-> plain values and content blocks.

    tools: [{name, description, input_schema}]          tool_choice: {"type": auto | any | tool (name) | none}
    assistant content: tool_use {id, name, input}        user content: tool_result {tool_use_id, content}
    thinking: {"type": "enabled" | "disabled"}  -> the template's enable_thinking

An answer is a list of content blocks: ``thinking`` (the reasoning), ``text``, then one
``tool_use`` per call. Streamed, each block is opened when its first piece arrives
(content_block_start), grows by deltas (thinking_delta, text_delta, input_json_delta with
the arguments' JSON text as it streams) and is closed when the next one opens or the
answer ends.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jiter

from frontend_svc.service.http.errors import bad_request
from frontend_svc.service.http.fields import Fields
from frontend_svc.text.message_parser import AssistantMessage
from frontend_svc.text.nesting import too_deep
from frontend_svc.text.output_processor import ChoiceOutput
from frontend_svc.text.tools.spec import ToolChoice, ToolRequest, ToolSpec

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def tool_param(path: str) -> str:
    """A planning path into a tool as the Anthropic parameter: the schema is ``input_schema``."""
    return re.sub(r"^(tools\[\d+\])\.parameters", r"\1.input_schema", path)


def tool_request(f: Fields) -> ToolRequest:
    tools = []
    for i, item in enumerate(f.list("tools") or []):
        tf = Fields(item, f"tools[{i}]")
        schema = tf.raw("input_schema")
        if schema is not None and not isinstance(schema, dict):
            raise bad_request(tf.name("input_schema"), "must be a JSON Schema object")
        problem = too_deep(schema)
        if problem is not None:
            raise bad_request(tf.name("input_schema"), problem)
        tools.append(
            ToolSpec(tf.str("name", ""), tf.str("description", ""), json.dumps(schema) if schema is not None else "")
        )
    choice, parallel = ToolChoice("auto"), True
    cf = f.object("tool_choice")
    if cf is not None:
        kind = cf.str("type")
        if kind == "tool":
            choice = ToolChoice("function", cf.str("name"))
        elif kind in _CHOICES:
            choice = ToolChoice(_CHOICES[kind])
        else:
            raise bad_request(cf.name("type"), f"must be auto, any, tool or none, got {kind!r}")
        parallel = not cf.bool("disable_parallel_tool_use", False)
    return ToolRequest(tuple(tools), choice, parallel)


def enable_thinking(f: Fields) -> bool | None:
    thinking = f.object("thinking")
    if thinking is None:
        return None
    kind = thinking.str("type")
    if kind not in ("enabled", "disabled"):
        raise bad_request(thinking.name("type"), f"must be enabled or disabled, got {kind!r}")
    return kind == "enabled"


def turns(mf: Fields, role: str) -> list[dict[str, Any]]:
    """One Anthropic message as chat turns: its text (an assistant's tool_use blocks as
    tool_calls), and each tool_result block as a turn of its own with role "tool"."""
    content = mf.raw("content", "")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request(mf.name("content"), "must be a string or an array of content blocks")
    text, calls, results = [], [], []
    for j, block in enumerate(content):
        bf = Fields(block, f"{mf.name('content')}[{j}]")
        kind = bf.str("type")
        if kind == "text":
            text.append(bf.str("text", ""))
        elif kind == "tool_use" and role == "assistant":
            arguments = bf.raw("input", {})
            problem = too_deep(arguments)
            if problem is not None:
                raise bad_request(bf.name("input"), problem)
            calls.append({"id": bf.str("id", ""), "name": bf.str("name", ""), "arguments": json.dumps(arguments)})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": bf.str("tool_use_id", ""), "content": _result_text(bf)})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier thoughts are not shown to the model again
        else:
            raise bad_request(bf.name("type"), f"a {role} message cannot hold a {kind!r} block")
    out = results
    if text or calls or not results:
        turn: dict[str, Any] = {"role": role, "content": "".join(text)}
        if calls:
            turn["tool_calls"] = calls
        out = [*results, turn]
    return out


def _result_text(bf: Fields) -> str:
    content = bf.raw("content", "")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    raise bad_request(bf.name("content"), "must be a string or an array of text blocks")


def message_blocks(m: AssistantMessage) -> list[dict]:
    blocks: list[dict] = []
    if m.reasoning:
        blocks.append({"type": "thinking", "thinking": m.reasoning, "signature": ""})
    if m.content or not m.tool_calls:
        blocks.append({"type": "text", "text": m.content})
    for call in m.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)})
    return blocks


def _input(arguments: str) -> Any:
    """A call's arguments as tool_use ``input``. A forced call cut short by max_tokens has
    argument text that is no whole JSON: it is read as far as it goes, the way the Anthropic
    SDKs read the input_json_delta pieces of a stream (jiter's partial mode: what is whole
    is kept, an unfinished string or key dropped), so the whole answer and the stream agree."""
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return jiter.from_json(arguments.encode(), partial_mode=True)


class BlockStream:
    """The content-block events of a split answer, piece by piece."""

    def __init__(self) -> None:
        self._index = -1
        self._open: str | None = None  # "thinking", "text" or "tool_use:<call index>"

    def events(self, piece: ChoiceOutput) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        if piece.reasoning:
            self._enter(out, "thinking", {"type": "thinking", "thinking": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": piece.reasoning}))
        if piece.text:
            self._enter(out, "text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": piece.text}))
        for call in piece.tool_calls:
            if call.name is not None:
                block: dict = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                self._enter(out, f"tool_use:{call.index}", block)
            if call.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        if piece.finished:
            if self._open is None:  # an empty answer still has its one text block
                self._enter(out, "text", {"type": "text", "text": ""})
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        return out

    def _enter(self, out: list, kind: str, block: dict) -> None:
        if self._open == kind:
            return
        if self._open is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        self._index += 1
        self._open = kind
        out.append(
            ("content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})
        )

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}
