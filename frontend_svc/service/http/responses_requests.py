"""OpenAI Responses request bodies (``POST /v1/responses``) -> plain values.

    JSON body ── responses_request(body, store) ──▶ ResponsesRequest
                   .input: GenerateInput   a chat, as /v1/chat/completions makes (planning checks it)
                   .conversation           its turns without the instructions: stored with the output
                   .echo                   the request's fields the Response object repeats

``input`` is a string (one user turn) or items: messages (roles user, system, developer,
assistant; content a string or ``input_text`` / ``output_text`` parts), ``function_call``
(an earlier call of the model: an assistant turn's tool_calls) and ``function_call_output``
(a tool turn); ``reasoning`` items are dropped, as earlier thoughts are on the other APIs.
A ``developer`` turn is rendered as a system turn, which every chat template knows.
``reasoning.effort`` reaches the chat template as ``reasoning_effort``; ``"none"`` also sets
``enable_thinking`` false.
``instructions`` is a leading system turn of this request only: with
``previous_response_id`` the stored conversation continues without the earlier
instructions, as OpenAI does.

Every top-level field is served or refused (``SERVED`` / ``REFUSED``): one Tandem does not
serve, or does not know, is a 400 naming it and what to do instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from frontend_svc.service.http import allow_list
from frontend_svc.service.http.errors import HttpError, bad_request
from frontend_svc.service.http.fields import Fields
from frontend_svc.service.http.openai_requests import format_constraint, message_text
from frontend_svc.service.http.openai_tools import function_tool
from frontend_svc.service.http.responses_store import ResponseStore
from frontend_svc.service.planning import Chat, GenerateInput
from frontend_svc.text.tools.spec import ToolChoice, ToolRequest, ToolSpec
from tandem_common.sampling import DEFAULT_MAX_TOKENS, SamplingParams, StructuredOutput

MAX_METADATA_KEYS = 16  # OpenAI's limits on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class ResponsesRequest:
    input: GenerateInput
    model: str | None
    stream: bool = False
    store: bool = True
    conversation: list[dict[str, Any]] = field(default_factory=list)  # without the instructions
    echo: dict[str, Any] = field(default_factory=dict)  # fields the Response object repeats


def responses_request(body: Any, store: ResponseStore) -> ResponsesRequest:
    allow_list.check(body, allow_list.RESPONSES)
    f = Fields(body)
    _refuse_unserved_values(f)

    previous_id = f.str("previous_response_id")
    earlier: list[dict[str, Any]] = []
    if previous_id is not None:
        stored = store.get(previous_id)
        if stored is None:
            raise HttpError(
                400,
                f"Previous response with id {previous_id!r} not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        earlier = list(stored.conversation)
    turns = earlier + _input_turns(f, earlier)
    if not turns:
        raise bad_request("input", "is required: a string or an array of input items")
    instructions = f.str("instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + turns

    reasoning = f.object("reasoning")
    effort = reasoning.str("effort") if reasoning is not None else None
    max_tokens = f.int("max_output_tokens")
    seed = f.int("seed")
    params = SamplingParams(
        max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        temperature=f.float("temperature", 1.0),
        top_p=f.float("top_p", 1.0),
        top_k=f.int("top_k", 0),
        min_p=f.float("min_p", 0.0),
        repetition_penalty=f.float("repetition_penalty", 1.0),
        seed=seed % (1 << 64) if seed is not None else None,
        ignore_eos=f.bool("ignore_eos", False),
        structured=_text_format(f),
    )
    tools, choice, text = _tools(f), _tool_choice(f), f.object("text")
    gen = GenerateInput(
        input="messages",
        chat=Chat(
            messages,
            # effort "none" asks for no thought: a template that can leave it out is told so
            enable_thinking=False if effort == "none" else None,
            template_kwargs={"reasoning_effort": effort} if effort else {},
        ),
        params=params,
        max_tokens_set=max_tokens is not None,
        tools=ToolRequest(tools, choice, f.bool("parallel_tool_calls", True)),
    )
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_tokens,
        "metadata": _metadata(f),
        "parallel_tool_calls": f.bool("parallel_tool_calls", True),
        "previous_response_id": previous_id,
        "reasoning": {"effort": effort, "summary": None},
        "temperature": params.temperature,
        "text": {"format": (text.raw("format") if text is not None else None) or {"type": "text"}},
        "tool_choice": f.raw("tool_choice", "auto"),
        "tools": [dict(t) for t in f.list("tools") or []],
        "top_p": params.top_p,
        "truncation": "disabled",
        "user": f.str("user"),
    }
    return ResponsesRequest(gen, f.str("model"), f.bool("stream", False), f.bool("store", True), turns, echo)


def _refuse_unserved_values(f: Fields) -> None:
    """Fields served only at some values: the others are refused, each saying why."""
    if f.bool("background", False):
        raise bad_request(
            "background", "background responses are not served; send the request and read its answer (or stream it)"
        )
    if f.str("truncation", "disabled") != "disabled":
        raise bad_request("truncation", "only 'disabled' is served: an input longer than the context is refused")
    if f.str("service_tier", "auto") not in ("auto", "default"):
        raise bad_request("service_tier", "only 'auto' and 'default' are served")
    include = f.list("include") or []
    if include:
        raise bad_request("include", f"{include[0]!r} is not served: no extra output data is produced")
    options = f.object("stream_options")
    if options is not None:
        if not f.bool("stream", False):
            raise bad_request("stream_options", "is only allowed with stream: true")
        if options.bool("include_obfuscation", False):
            raise bad_request("stream_options.include_obfuscation", "is not served: events carry no padding")
        _only(options, ("include_obfuscation",))
    reasoning = f.object("reasoning")
    if reasoning is not None:
        for key in reasoning.body:
            if key not in ("effort", "summary", "generate_summary") and reasoning.body[key] is not None:
                raise bad_request(reasoning.name(key), "is not served; reasoning takes effort")
        if reasoning.raw("summary") is not None or reasoning.raw("generate_summary") is not None:
            raise bad_request(reasoning.name("summary"), "summaries are not served; reasoning items hold the thought")
    text = f.object("text")
    if text is not None and text.raw("verbosity") is not None:
        raise bad_request("text.verbosity", "is not served; ask for brevity in the instructions")
    if text is not None:
        _only(text, ("format", "verbosity"))


def _only(f: Fields, known: tuple[str, ...]) -> None:
    """Refuses a member of a nested object that the API does not define, as at the top level."""
    for key in f.body:
        if key not in known and f.body[key] is not None:
            raise bad_request(f.name(key), "is not a field of the Responses API that this server serves; leave it out")


def _input_turns(f: Fields, earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as chat turns; ``earlier``: the stored turns they continue."""
    raw = f.raw("input")
    if raw is None:
        return []
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    items = f.list("input")
    assert items is not None
    turns: list[dict[str, Any]] = []
    # call_id -> the function's name, for the tool turns that answer it (a call made earlier too)
    names = {c["id"]: c["name"] for turn in earlier for c in turn.get("tool_calls", ())}
    for i, item in enumerate(items):
        it = Fields(item, f"input[{i}]")
        kind = it.str("type", "message")
        if kind == "message":
            role = it.str("role")
            if role not in _ROLES:
                raise bad_request(it.name("role"), f"must be user, system, developer or assistant, got {role!r}")
            turns.append({"role": _ROLES[role], "content": message_text(it, _TEXT_PARTS)})
        elif kind == "function_call":
            call_id, name = it.str("call_id", ""), it.str("name", "")
            if not call_id or not name:
                raise bad_request(it.name("call_id"), "a function_call item needs call_id and name")
            arguments = it.str("arguments", "{}")
            names[call_id] = name
            last = turns[-1] if turns else None
            if last is None or last["role"] != "assistant":  # calls join the assistant turn before them
                last = {"role": "assistant", "content": ""}
                turns.append(last)
            last.setdefault("tool_calls", []).append({"id": call_id, "name": name, "arguments": arguments})
        elif kind == "function_call_output":
            call_id = it.str("call_id", "")
            if not call_id:
                raise bad_request(it.name("call_id"), "is required: the call_id of the function_call it answers")
            turn = {"role": "tool", "tool_call_id": call_id, "content": _output_text(it)}
            if call_id in names:
                turn["name"] = names[call_id]
            turns.append(turn)
        elif kind == "reasoning":
            continue  # earlier thoughts are not shown to the model again
        else:
            raise bad_request(
                it.name("type"),
                f"{kind!r} items are not served; use message, function_call, function_call_output or reasoning",
            )
    return turns


def _output_text(it: Fields) -> str:
    output = it.raw("output", "")
    if isinstance(output, str):
        return output
    return message_text(Fields({"content": output}, it.name("output")), _TEXT_PARTS)


def _tools(f: Fields) -> tuple[ToolSpec, ...]:
    tools = []
    for i, item in enumerate(f.list("tools") or []):
        tf = Fields(item, f"tools[{i}]")
        kind = tf.str("type")
        if kind != "function":
            raise bad_request(
                tf.name("type"), f"{kind!r} tools are not served: only function tools, which the client runs"
            )
        tools.append(function_tool(tf))
    return tuple(tools)


def _tool_choice(f: Fields) -> ToolChoice:
    raw = f.raw("tool_choice")
    if raw is None:
        return ToolChoice("auto")
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise bad_request("tool_choice", f"must be auto, none, required or a function, got {raw!r}")
        return ToolChoice(raw)
    cf = Fields(raw, "tool_choice")
    if cf.str("type") != "function" or not cf.str("name"):
        raise bad_request("tool_choice", 'a named choice is {"type": "function", "name": ...}; no other kind is served')
    return ToolChoice("function", cf.str("name"))


def _text_format(f: Fields) -> StructuredOutput | None:
    """text.format as the engine's structured output, as chat's response_format."""
    text = f.object("text")
    fmt = text.object("format") if text is not None else None
    return format_constraint(fmt, "text.format", lambda tf: tf.raw("schema"), "schema")


def _metadata(f: Fields) -> dict[str, str]:
    meta = f.object("metadata")
    if meta is None:
        return {}
    if len(meta.body) > MAX_METADATA_KEYS:
        raise bad_request("metadata", f"at most {MAX_METADATA_KEYS} keys are allowed, got {len(meta.body)}")
    for key in meta.body:
        value = meta.str(key, "")
        if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(
                meta.name(key),
                f"keys are at most {MAX_METADATA_KEY_CHARS} characters, values {MAX_METADATA_VALUE_CHARS}",
            )
    return dict(meta.body)


def param_name(path: str) -> str:
    """A planning field path as the Responses parameter (``sampling_params.max_tokens``: max_output_tokens)."""
    head = path.split("[", 1)[0].split(".", 1)[0]
    if head in ("messages", "input", "text", "chat_template_kwargs"):
        return "input" if head != "chat_template_kwargs" else "reasoning"
    name = path.removeprefix("sampling_params.")
    if name == "max_tokens":
        return "max_output_tokens"
    if name.split(".", 1)[0].split("[", 1)[0] in ("json_schema", "json_object", "structured", "constraint"):
        return "text.format"
    return name
