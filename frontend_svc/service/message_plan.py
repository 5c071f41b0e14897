"""Tools and reasoning in a plan: what the chat template gets, how the output is split, and
the grammar that forces calls.

    GenerateInput (tools, tool_choice, chat) ── prepare() ──▶ ChatRendering (messages, template kwargs)
    rendered prompt text, sampling params    ── finish()  ──▶ MessageFormat, params (+ grammar), skip flag

Rules (docs/tools.md):
* tools apply only to a chat; tool_choice none leaves them out of the template, the
  parse and any grammar;
* the call format is --tool-call-parser, or the one the chat template shows;
* a template that does not show tools gets them in a generic system prompt, and earlier
  calls as text in the format, when it does not show calls (text/tools/prompt.py);
* the output starts inside a thought when the rendered prompt ends with ``<think>``; a
  prompt that ends with ``</think>`` leaves no thought for a grammar to allow;
* required / a named function, and a response format together with tools, become one
  grammar in the format (text/tools/forcing.py); a reasoning model's constraint gets the
  thought in front of it;
* when a tag the parsers need is a special token, special tokens are kept in the text,
  or the parser would never see the tag.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from frontend_svc.text import nesting
from frontend_svc.text.grammar_check import grammar_problem
from frontend_svc.text.message_parser import MessageFormat
from frontend_svc.text.reasoning import CLOSE_TAG, OPEN_TAG, prompt_opens_thought
from frontend_svc.text.tokenizer import Tokenizer
from frontend_svc.text.tools import ToolCallFormat, format_for, tools_grammar
from frontend_svc.text.tools.forcing import ForcingError, answer_grammar, arguments_rule
from frontend_svc.text.tools.prompt import (
    calls_as_content,
    template_shows_calls,
    template_shows_tools,
    tools_system_prompt,
    with_system_prompt,
)
from frontend_svc.text.tools.spec import (
    MAX_TOOL_CALLS_PER_MESSAGE,
    ToolRequest,
    check_tools,
    template_tools,
)
from frontend_svc.types import CallError
from tandem_common.sampling import SamplingParams, StructuredOutput
from tandem_common.types import ErrorCode


@dataclass(frozen=True)
class OutputParsers:
    """The frontend's --tool-call-parser (None: from the chat template) and --reasoning-parser."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None


@dataclass
class ChatRendering:
    """The messages and variables the chat template renders, and the tool format in use."""

    messages: list[dict[str, Any]]
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_format: ToolCallFormat | None = None


def _invalid(name: str, message: str) -> CallError:
    return CallError(ErrorCode.INVALID_ARGUMENT, f"{name}: {message}")


def check_tool_request(tools: ToolRequest, is_chat: bool) -> None:
    """The tools' rules, then each schema compiled as a forced call would compile it (under
    any tool_choice: a schema is refused the same way whether or not this request forces
    it), so a broken one is refused before the call is answered, never on its stream."""
    problem = check_tools(tools, "tools", "tool_choice")
    if problem is not None:
        raise _invalid(*problem)
    if tools.tools and not is_chat:
        raise _invalid("tools", "tools need a chat (messages input): the chat template shows them to the model")
    for i, tool in enumerate(tools.tools):
        compile_error = grammar_problem(f"start: {arguments_rule(tool)}\n")
        if compile_error is not None:
            raise _invalid(f"tools[{i}].parameters", f"is not a JSON Schema the engine can follow: {compile_error}")


def prepare(
    messages: list[dict[str, Any]],
    tools: ToolRequest,
    enable_thinking: bool | None,
    tokenizer: Tokenizer,
    parsers: OutputParsers,
) -> ChatRendering:
    """The template's input: the tools when active, assistant calls with their arguments
    as objects (as Hugging Face templates read them), enable_thinking when set. A template
    that does not show tools or calls gets them as text (text/tools/prompt.py)."""
    rendered = [_template_message(i, m) for i, m in enumerate(messages)]
    kwargs: dict[str, Any] = {}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    tool_format = None
    template = tokenizer.chat_template
    if tools.active:
        kwargs["tools"] = template_tools(tools.tools)
        tool_format = format_for(parsers.tool_call_parser, template)
        if not template_shows_tools(template):
            rendered = with_system_prompt(rendered, tools_system_prompt(tools.tools, tool_format.write_calls))
    if not template_shows_calls(template):
        writer = (tool_format or format_for(parsers.tool_call_parser, template)).write_calls
        rendered = [calls_as_content(m, writer) if m.get("tool_calls") else m for m in rendered]
    return ChatRendering(rendered, kwargs, tool_format)


def _template_message(i: int, message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return {k: v for k, v in message.items() if v or k in ("role", "content")}
    if len(calls) > MAX_TOOL_CALLS_PER_MESSAGE:
        raise _invalid(
            f"messages.messages[{i}].tool_calls",
            f"at most {MAX_TOOL_CALLS_PER_MESSAGE} calls are allowed, got {len(calls)}",
        )
    out = []
    for j, call in enumerate(calls):
        where = f"messages.messages[{i}].tool_calls[{j}]"
        if not call.get("name"):
            raise _invalid(f"{where}.name", "a call needs the name of the function it called")
        try:
            arguments = nesting.loads(call.get("arguments") or "{}")
        except json.JSONDecodeError as e:
            raise _invalid(f"{where}.arguments", f"is not valid JSON: {e}") from None
        except nesting.TooDeep as e:
            raise _invalid(f"{where}.arguments", str(e)) from None
        if not isinstance(arguments, dict):
            raise _invalid(f"{where}.arguments", f"must be a JSON object, got {type(arguments).__name__}")
        out.append(
            {"id": call.get("id", ""), "type": "function", "function": {"name": call["name"], "arguments": arguments}}
        )
    return {**{k: v for k, v in message.items() if k != "tool_calls"}, "tool_calls": out}


def finish(
    rendering: ChatRendering | None,
    prompt_text: str,
    tools: ToolRequest,
    params: SamplingParams,
    skip_special_tokens: bool,
    tokenizer: Tokenizer,
    parsers: OutputParsers,
) -> tuple[MessageFormat, SamplingParams, bool]:
    """The output split, the sampling params with any grammar, and skip_special_tokens."""
    reasoning = parsers.reasoning_parser is not None and rendering is not None
    fmt = MessageFormat(
        tools=rendering.tool_format if rendering is not None else None,
        reasoning=reasoning,
        starts_in_thought=reasoning and prompt_opens_thought(prompt_text),
    )
    # A prompt that closed the thought itself (enable_thinking false) leaves none to write.
    thought = None
    if fmt.reasoning and fmt.starts_in_thought:
        thought = "open"
    elif fmt.reasoning and not prompt_text.rstrip().endswith(CLOSE_TAG):
        thought = "optional"
    answer = params.structured
    grammar = None
    try:
        if fmt.tools is not None and (tools.choice.forced or answer is not None):
            grammar = tools_grammar(fmt.tools, tools, answer, tokenizer.special_token_id, thought=thought)
        elif answer is not None and thought is not None:
            grammar = answer_grammar(answer, tokenizer.special_token_id, thought)
    except ForcingError as e:
        raise _invalid("tool_choice" if tools.choice.forced else "sampling_params", str(e)) from None
    if grammar is not None:
        # Each tool's schema compiled already (check_tool_request): what fails here is the
        # response format the grammar joined to the tools.
        problem = grammar_problem(grammar)
        if problem is not None:
            raise _invalid("tool_choice" if tools.choice.forced else "sampling_params.structured", problem)
    if grammar is not None:
        params = replace(params, structured=StructuredOutput(kind="grammar", text=grammar))
        if tools.choice.forced:  # the grammar writes calls only
            fmt = replace(fmt, calls_only=True)

    tags = list(fmt.tools.tags) if fmt.tools is not None else []
    if fmt.reasoning:
        tags += [OPEN_TAG, CLOSE_TAG]
    if any(tag in tokenizer.special_tokens for tag in tags):
        skip_special_tokens = False
    return fmt, params, skip_special_tokens
