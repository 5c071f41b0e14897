"""Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``) <-> plain values.

    JSON body ── messages_request() ──▶ AnthropicRequest (.input: GenerateInput, rendered as chat)
    AnthropicRequest, Plan ── answer() ──▶ AnthropicAnswer (one message: Messages has no n)
    ChoiceOutput ... ── AnthropicAnswer.events(piece) ──▶ content_block_delta ... message_delta, message_stop
                     ── AnthropicAnswer.add(piece) ... .response() ──▶ the whole message (stream: false)

``system`` becomes a leading system message; text content blocks are joined. The stream
follows Anthropic's event sequence: message_start, content_block_start, deltas,
content_block_stop, message_delta (stop_reason, usage), message_stop. stop_reason is
``end_turn`` (EOS or a stop token), ``stop_sequence`` (with the string), ``max_tokens`` or
``tool_use``. Tools, tool_use / tool_result blocks and thinking are converted by
``anthropic_tools``; an answer split into thinking, text and tool_use blocks streams its
blocks as they open (``anthropic_tools.BlockStream``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from frontend_svc.service.http import allow_list
from frontend_svc.service.http.anthropic_tools import (
    BlockStream,
    enable_thinking,
    message_blocks,
    tool_param,
    tool_request,
    turns,
)
from frontend_svc.service.http.errors import bad_request
from frontend_svc.service.http.fields import Fields
from frontend_svc.service.http.openai_requests import message_text
from frontend_svc.service.planning import Chat, GenerateInput, Plan
from frontend_svc.text.output_processor import ChoiceOutput
from tandem_common.sampling import SamplingParams
from tandem_common.types import FinishReason


@dataclass
class AnthropicRequest:
    input: GenerateInput
    model: str | None
    stream: bool = False


def messages_request(body, *, count_only: bool = False) -> AnthropicRequest:
    allow_list.check(body, allow_list.COUNT_TOKENS if count_only else allow_list.MESSAGES)
    f = Fields(body)
    chat = Chat(_messages(f), add_generation_prompt=True, enable_thinking=enable_thinking(f))
    max_tokens = f.int("max_tokens")
    if max_tokens is None and not count_only:
        raise bad_request("max_tokens", "is required: the most tokens to generate")
    top_k = f.int("top_k", 0)
    params = SamplingParams(
        max_tokens=max_tokens or 1,
        temperature=f.float("temperature", 1.0),
        top_p=f.float("top_p", 1.0),
        top_k=top_k,
    )
    gen = GenerateInput(
        input="messages",
        chat=chat,
        params=params,
        max_tokens_set=max_tokens is not None,
        stop=_stop_sequences(f),
        tools=tool_request(f),
    )
    return AnthropicRequest(gen, f.str("model"), stream=f.bool("stream", False))


def _messages(f: Fields) -> list[dict[str, Any]]:
    messages = f.list("messages")
    if messages is None:
        raise bad_request("messages", "is required: an array of {role, content} messages")
    out = []
    system = f.raw("system")
    if system is not None:
        out.append({"role": "system", "content": message_text(Fields({"content": system}, "system"))})
    for i, m in enumerate(messages):
        mf = Fields(m, f"messages[{i}]")
        role = mf.str("role")
        if role not in ("user", "assistant"):
            raise bad_request(mf.name("role"), f"must be user or assistant, got {role!r}")
        out.extend(turns(mf, role))
    return out


def _stop_sequences(f: Fields) -> list[str]:
    stops = f.list("stop_sequences")
    if stops is None:
        return []
    if not all(isinstance(s, str) for s in stops):
        raise bad_request("stop_sequences", "must be an array of strings")
    return stops


def param_name(path: str) -> str:
    name = path.removeprefix("sampling_params.")
    if name == "stop" or name.startswith("stop["):
        return "stop_sequences"
    return "messages" if name.startswith(("messages", "input")) else tool_param(name)


def answer(request: AnthropicRequest, model: str, plan: Plan) -> AnthropicAnswer:
    return AnthropicAnswer(model, len(plan.prompt_token_ids), split=plan.text.message.active)


def _stop_reason(piece: ChoiceOutput) -> str:
    if piece.finish_reason is FinishReason.LENGTH:
        return "max_tokens"
    if piece.finish_reason is FinishReason.TOOL_CALLS:
        return "tool_use"
    return "stop_sequence" if piece.stop_str is not None else "end_turn"


class AnthropicAnswer:
    """One message, built piece by piece (one choice: Messages has no n)."""

    def __init__(self, model: str, num_prompt_tokens: int, *, split: bool = False) -> None:
        self.blocks = BlockStream() if split else None  # thinking / tool_use blocks possible
        self.id = "msg_" + uuid.uuid4().hex
        self.model = model
        self.num_prompt_tokens = num_prompt_tokens
        self.text: list[str] = []
        self.num_tokens = 0
        self.last: ChoiceOutput | None = None

    def _message(self, text: str | None) -> dict:
        last = self.last
        content = [] if text is None else [{"type": "text", "text": text}]
        if text is not None and last is not None and last.message is not None:
            content = message_blocks(last.message)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None if last is None else _stop_reason(last),
            "stop_sequence": None if last is None else last.stop_str,
            "usage": {**self._input_usage(), "output_tokens": self.num_tokens},
        }

    def _input_usage(self) -> dict[str, int]:
        """Anthropic counts the prompt in parts: ``input_tokens`` computed, plus
        ``cache_read_input_tokens`` served from the prefix cache, plus
        ``cache_creation_input_tokens`` written on request (Tandem caches every full block by
        itself, never on request: 0). The cached count is known once the choice ends; until
        then (message_start) the whole prompt counts as input."""
        cached = self.last.usage.cached_tokens if self.last is not None and self.last.usage is not None else 0
        return {
            "input_tokens": self.num_prompt_tokens - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def add(self, piece: ChoiceOutput) -> None:
        self.text.append(piece.text)
        self.num_tokens += len(piece.token_ids)
        if piece.finished:
            self.last = piece
            assert piece.usage is not None
            self.num_tokens = piece.usage.completion_tokens

    def response(self) -> dict:
        return self._message("".join(self.text))

    # -- streaming: (event name, data) pairs ------------------------------------------------

    def start_events(self) -> list[tuple[str, dict]]:
        if self.blocks is not None:  # blocks open as their first pieces arrive
            return [("message_start", {"type": "message_start", "message": self._message(None)})]
        return [
            ("message_start", {"type": "message_start", "message": self._message(None)}),
            (
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            ),
        ]

    def events(self, piece: ChoiceOutput) -> list[tuple[str, dict]]:
        self.add(piece)
        out = []
        if self.blocks is not None:
            out = self.blocks.events(piece)
        elif piece.text:
            delta = {"type": "text_delta", "text": piece.text}
            out.append(("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}))
        if piece.finished:
            if self.blocks is None:
                out.append(("content_block_stop", {"type": "content_block_stop", "index": 0}))
            stop: dict[str, str | None] = {"stop_reason": _stop_reason(piece), "stop_sequence": piece.stop_str}
            usage = {**self._input_usage(), "output_tokens": self.num_tokens}  # final, as Anthropic's
            out.append(("message_delta", {"type": "message_delta", "delta": stop, "usage": usage}))
            out.append(("message_stop", {"type": "message_stop"}))
        return out

    def end_events(self) -> list[tuple[str, dict]]:
        return []  # message_stop went with the last piece
