"""Streamed pieces -> OpenAI answers (bodies and chunks), for completions and chat.

    ChoiceOutput ... ── OpenAIAnswer.chunk(piece) ──▶ one "chat.completion.chunk" / "text_completion"
                                                      dict per piece (one per coalesced engine message)
                     ── OpenAIAnswer.events(piece) ... .end_events() ──▶ the stream's chunks (endpoint.Answer)
                     ── OpenAIAnswer.add(piece) ... .response() ──▶ the whole response (stream: false)

Logprobs come in OpenAI's two shapes: chat ``logprobs.content[]`` with ``bytes``;
completions ``tokens / token_logprobs / top_logprobs / text_offset``. A log-probability of
-inf (a token the sampler masked) is written as -9999.0, as vLLM does: JSON has no -inf.
The first chunk of each chat choice carries ``role``. finish_reason is ``stop``,
``length`` or ``tool_calls``; ``stop_reason`` (a vLLM extra) names the stop string or stop
token id that ended the choice. With tools or a reasoning parser, chat deltas carry
``tool_calls`` pieces and ``reasoning_content`` beside ``content``, and the whole message
is the frontend's complete parse: ``content`` is null when the answer is only calls.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from frontend_svc.service.http.openai_tools import call_delta, message_call
from frontend_svc.text.message_parser import AssistantMessage
from frontend_svc.text.output_processor import ChoiceOutput, LogprobText
from tandem_common.types import FinishReason

MIN_LOGPROB = -9999.0
_FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.TOOL_CALLS: "tool_calls",
}


def logprob_value(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB  # also NaN (comparison is False)


def finish_reason(piece: ChoiceOutput) -> str | None:
    return None if piece.finish_reason is None else _FINISH.get(piece.finish_reason, "stop")


def stop_reason(piece: ChoiceOutput) -> str | int | None:
    return piece.stop_str if piece.stop_str is not None else piece.stop_token_id


def chat_logprobs(lps: list[LogprobText]) -> list[dict]:
    return [
        {
            "token": lp.token,
            "logprob": logprob_value(lp.logprob),
            "bytes": list(lp.token.encode()),
            "top_logprobs": [
                {"token": t.token, "logprob": logprob_value(t.logprob), "bytes": list(t.token.encode())} for t in lp.top
            ],
        }
        for lp in lps
    ]


def completion_logprobs(lps: list[LogprobText], offset: int) -> dict:
    """The completions shape; ``offset`` is the text offset of the first token."""
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [logprob_value(lp.logprob) for lp in lps],
        "top_logprobs": [{t.token: logprob_value(t.logprob) for t in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def prompt_logprobs(lps: list[LogprobText]) -> list[dict | None]:
    """vLLM's shape: None for the first prompt token, then {token_id: {logprob, rank, decoded_token}}."""
    out: list[dict | None] = [None]
    for lp in lps:
        entry = {str(t.token_id): {"logprob": logprob_value(t.logprob), "decoded_token": t.token} for t in lp.top}
        entry[str(lp.token_id)] = {"logprob": logprob_value(lp.logprob), "rank": lp.rank, "decoded_token": lp.token}
        out.append(entry)
    return out


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprobs: list[LogprobText] = field(default_factory=list)
    prompt_logprobs: list[LogprobText] = field(default_factory=list)
    num_tokens: int = 0
    offset: int = 0  # completions: text offset of the next token
    role_sent: bool = False  # chat: the role went out; completions: the echo did
    last: ChoiceOutput | None = None  # the finished piece


class OpenAIAnswer:
    """The answer to one completions (``chat=False``) or chat request, built piece by piece."""

    def __init__(
        self,
        *,
        chat: bool,
        model: str,
        n: int,
        num_prompt_tokens: int,
        logprobs: bool,
        echo: str = "",
        include_usage: bool = False,
        continuous_usage: bool = False,
        keep: int | None = None,
    ):
        """``keep``: best_of, whole answers only: of the ``n`` choices generated, answer the
        ``keep`` with the highest cumulative logprob, likeliest first (vLLM's order)."""
        self.chat = chat
        # stream_options: a last chunk with the usage; the running usage in every chunk
        self.include_usage = include_usage
        self._chunk_usage = True if continuous_usage else False if include_usage else None
        self.model = model
        self.logprobs = logprobs
        self.echo = echo
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.choices = [_Choice(offset=len(echo)) for _ in range(n)]
        self.keep = keep
        self.object = "chat.completion" if chat else "text_completion"

    # -- usage ----------------------------------------------------------------------------

    def usage(self) -> dict:
        """Prompt tokens once (n choices share the prompt), completion tokens over all choices."""
        usages = [c.last.usage if c.last is not None else None for c in self.choices]
        completion = sum(u.completion_tokens if u is not None else c.num_tokens for u, c in zip(usages, self.choices))
        cached = max((u.cached_tokens for u in usages if u is not None), default=0)
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # -- streaming ------------------------------------------------------------------------

    def chunk(self, piece: ChoiceOutput, *, usage: bool | None = None) -> dict:
        """The chunk carrying ``piece``. ``usage``: None leaves the key out, False writes
        null (include_usage), True the running usage (continuous_usage_stats)."""
        c = self.choices[piece.index]
        c.num_tokens += len(piece.token_ids)
        if piece.finished:
            c.last = piece
        choice: dict = {"index": piece.index}
        text = piece.text
        if self.chat:
            delta: dict = {}
            if not c.role_sent:
                delta["role"] = "assistant"
                c.role_sent = True
            if text or not (piece.reasoning or piece.tool_calls):
                delta["content"] = text
            if piece.reasoning:
                delta["reasoning_content"] = piece.reasoning
            if piece.tool_calls:
                delta["tool_calls"] = [call_delta(p) for p in piece.tool_calls]
            choice["delta"] = delta
            choice["logprobs"] = {"content": chat_logprobs(piece.logprobs)} if self.logprobs else None
        else:
            if self.echo and not c.role_sent:  # the prompt text goes before the first piece
                text = self.echo + text
                c.role_sent = True
            choice["text"] = text
            choice["logprobs"] = completion_logprobs(piece.logprobs, c.offset) if self.logprobs else None
            c.offset += sum(len(lp.token) for lp in piece.logprobs)
        choice["finish_reason"] = finish_reason(piece)
        if piece.finished:
            choice["stop_reason"] = stop_reason(piece)
        if piece.prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs(piece.prompt_logprobs)
        body = self._head(self.object + ".chunk" if self.chat else self.object, [choice])
        if usage is not None:
            body["usage"] = self.usage() if usage else None
        return body

    def usage_chunk(self) -> dict:
        """stream_options.include_usage: the last chunk, with no choices."""
        body = self._head(self.object + ".chunk" if self.chat else self.object, [])
        body["usage"] = self.usage()
        return body

    def start_events(self) -> list[tuple[str, dict]]:
        return []

    def events(self, piece: ChoiceOutput) -> list[tuple[str, dict]]:
        return [("", self.chunk(piece, usage=self._chunk_usage))]  # OpenAI's events have no names

    def end_events(self) -> list[tuple[str, dict]]:
        return [("", self.usage_chunk())] if self.include_usage else []

    # -- whole response -------------------------------------------------------------------

    def add(self, piece: ChoiceOutput) -> None:
        c = self.choices[piece.index]
        c.text.append(piece.text)
        c.logprobs.extend(piece.logprobs)
        c.prompt_logprobs.extend(piece.prompt_logprobs)
        c.num_tokens += len(piece.token_ids)
        if piece.finished:
            c.last = piece

    def response(self) -> dict:
        choices = []
        answered = self.choices
        if self.keep is not None:  # usage still counts every choice generated, as OpenAI bills best_of
            answered = sorted(answered, key=lambda c: -sum(lp.logprob for lp in c.logprobs))[: self.keep]
        for i, c in enumerate(answered):
            text = "".join(c.text)
            choice: dict = {"index": i}
            assert c.last is not None  # every choice finished before the response is made
            if self.chat:
                message = c.last.message
                choice["message"] = {"role": "assistant", "content": text} if message is None else _message(message)
                choice["logprobs"] = {"content": chat_logprobs(c.logprobs)} if self.logprobs else None
            else:
                choice["text"] = self.echo + text
                choice["logprobs"] = completion_logprobs(c.logprobs, len(self.echo)) if self.logprobs else None
            choice["finish_reason"] = finish_reason(c.last)
            choice["stop_reason"] = stop_reason(c.last)
            if c.prompt_logprobs:
                choice["prompt_logprobs"] = prompt_logprobs(c.prompt_logprobs)
            choices.append(choice)
        body = self._head(self.object, choices)
        body["usage"] = self.usage()
        return body

    def _head(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}


def _message(m: AssistantMessage) -> dict:
    """The parsed answer as an OpenAI chat message."""
    out: dict = {"role": "assistant", "content": None if m.tool_calls and not m.content else m.content}
    if m.reasoning:
        out["reasoning_content"] = m.reasoning
    if m.tool_calls:
        out["tool_calls"] = [message_call(c) for c in m.tool_calls]
    return out
