"""Streamed pieces -> OpenAI answers (bodies and chunks), for completions and chat.

    ChoiceOutput ... ── OpenAIAnswer.chunk(piece) ──▶ one "chat.completion.chunk" / "text_completion"
                                                      dict per piece (one per coalesced engine message)
                     ── OpenAIAnswer.events(piece) ... .end_events() ──▶ the stream's chunks (endpoint.Answer)
                     ── OpenAIAnswer.add(piece) ... .response() ──▶ the whole response (stream: false)

Logprobs come in OpenAI's two shapes: chat ``logprobs.content[]`` with ``bytes``;
completions ``tokens / token_logprobs / top_logprobs / text_offset``, whose top entries
name the token itself first (so ``logprobs: 0`` names it, as vLLM does) and which, with
``echo``, start with the prompt's own (echo.py). vLLM's ``prompt_logprobs`` extra is
per choice in completions and at the top level of a chat answer, as vLLM places it. A
log-probability of -inf (a token the sampler masked) is written as -9999.0, as vLLM does:
JSON has no -inf.
The first chunk of each chat choice carries ``role``; its last, with finish_reason, has
``"delta": {}`` (the last piece's text goes in a chunk before it), as OpenAI streams. finish_reason is ``stop``,
``length`` or ``tool_calls``; ``stop_reason`` (a vLLM extra) names the stop string or stop
token id that ended the choice. With tools or a reasoning parser, chat deltas carry
``tool_calls`` pieces and ``reasoning_content`` beside ``content``, and the whole message
is the frontend's complete parse: ``content`` is null when the answer is only calls.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from frontend_svc.service.http.echo import Echo, completion_top, echo_logprobs
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


def completion_logprobs(lps: list[LogprobText], offset: int, echo: dict | None = None) -> dict:
    """The completions shape; ``offset`` is the text offset of the first token; ``echo``
    the prompt's part (echo.py), which comes first."""
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.token)
    out = {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [logprob_value(lp.logprob) for lp in lps],
        "top_logprobs": [completion_top(lp, None, logprob_value) for lp in lps],
        "text_offset": offsets,
    }
    if echo is None:
        return out
    return {key: echo[key] + out[key] for key in out}


def prompt_logprobs(lps: list[LogprobText], num_top: int | None = None) -> list[dict | None]:
    """vLLM's shape: None for the first prompt token, then {token_id: {logprob, rank,
    decoded_token}}: the prompt token and up to ``num_top`` best alternatives (None: all
    the engine sent), ranked from 1."""
    out: list[dict | None] = [None]
    for lp in lps:
        top = lp.top if num_top is None else lp.top[:num_top]
        entry = {
            str(t.token_id): {"logprob": logprob_value(t.logprob), "rank": rank, "decoded_token": t.token}
            for rank, t in enumerate(top, 1)
        }
        entry[str(lp.token_id)] = {"logprob": logprob_value(lp.logprob), "rank": lp.rank, "decoded_token": lp.token}
        out.append(entry)
    return out


@dataclass
class _Choice:
    prompt: int = 0  # the index of its prompt (completions with several)
    echo: Echo = field(default_factory=Echo)
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
        num_prompt_tokens: int | list[int],
        logprobs: bool,
        echoes: list[Echo] | None = None,
        include_usage: bool = False,
        continuous_usage: bool = False,
        num_logprobs: int | None = None,
        echo_only: bool = False,
        num_prompt_logprobs: int | None = None,
        keep: int | None = None,
    ):
        """``n`` choices per prompt, ``num_prompt_tokens`` each prompt's (one or a list:
        completions with several prompts, choice i's prompt i // n). ``echoes``: each
        prompt's completions echo; with its EchoPrompt the echoed prompt's logprobs go first
        (their alternatives cut to ``num_logprobs``); ``echo_only``: the prompt alone is the
        answer (``max_tokens: 0``), the one generated token is left out;
        ``num_prompt_logprobs``: the client's ``prompt_logprobs`` (None: the field is not
        answered, though the engine may have sent them for the echo).
        ``keep``: best_of, whole answers only: of each prompt's ``n`` choices generated, answer
        the ``keep`` with the highest cumulative logprob, likeliest first (vLLM's order)."""
        self.chat = chat
        self.num_logprobs = num_logprobs
        self.echo_only = echo_only
        self.num_prompt_logprobs = num_prompt_logprobs
        # stream_options: a last chunk with the usage; the running usage in every chunk
        self.include_usage = include_usage
        self._chunk_usage = True if continuous_usage else False if include_usage else None
        self.model = model
        self.logprobs = logprobs
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.prompt_tokens = num_prompt_tokens if isinstance(num_prompt_tokens, list) else [num_prompt_tokens]
        self.num_prompt_tokens = sum(self.prompt_tokens)
        echoes = echoes or [Echo()] * len(self.prompt_tokens)
        self.choices = [
            _Choice(prompt=k, echo=echo, offset=len(echo.text)) for k, echo in enumerate(echoes) for _ in range(n)
        ]
        self.keep = keep
        self.object = "chat.completion" if chat else "text_completion"

    # -- usage ----------------------------------------------------------------------------

    def usage(self) -> dict:
        """Each prompt's tokens once (its n choices share it), completion tokens over all
        choices; cached: each prompt's best choice."""
        usages = [c.last.usage if c.last is not None else None for c in self.choices]
        completion = sum(u.completion_tokens if u is not None else c.num_tokens for u, c in zip(usages, self.choices))
        completion = 0 if self.echo_only else completion
        cached = sum(
            max((u.cached_tokens for u, c in zip(usages, self.choices) if u is not None and c.prompt == k), default=0)
            for k in range(len(self.prompt_tokens))
        )
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
        if piece.finished:
            c.last = piece
        choice: dict = {"index": piece.index}
        text, lps = ("", []) if self.echo_only else (piece.text, piece.logprobs)
        c.num_tokens += len(piece.token_ids)
        if self.chat:
            delta: dict = {}
            if not c.role_sent:
                delta["role"] = "assistant"
                c.role_sent = True
            # The role's chunk opens the content with ""; later ones carry content only when
            # they have some, so a last chunk's delta is {} (OpenAI's shape, which clients check).
            if text or ("role" in delta and not (piece.reasoning or piece.tool_calls)):
                delta["content"] = text
            if piece.reasoning:
                delta["reasoning_content"] = piece.reasoning
            if piece.tool_calls:
                delta["tool_calls"] = [call_delta(p) for p in piece.tool_calls]
            choice["delta"] = delta
            choice["logprobs"] = {"content": chat_logprobs(piece.logprobs)} if self.logprobs else None
        else:
            echo = None
            # The prompt goes before the choice's first piece, which has its logprobs.
            if (c.echo.text or c.echo.prompt is not None) and not c.role_sent:
                text = c.echo.text + text
                c.role_sent = True
                echo = self._echo_logprobs(c.echo, piece.prompt_logprobs)
            choice["text"] = text
            choice["logprobs"] = completion_logprobs(lps, c.offset, echo) if self.logprobs else None
            c.offset += sum(len(lp.token) for lp in lps)
        choice["finish_reason"] = finish_reason(piece)
        if piece.finished:
            choice["stop_reason"] = stop_reason(piece)
        shown = self._prompt_logprobs(piece.prompt_logprobs)
        if shown is not None and not self.chat:
            choice["prompt_logprobs"] = shown
        body = self._head(self.object + ".chunk" if self.chat else self.object, [choice])
        if shown is not None and self.chat:
            body["prompt_logprobs"] = shown
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
        body = self.chunk(piece, usage=self._chunk_usage)
        choice = body["choices"][0]
        if not (self.chat and choice["finish_reason"] is not None and choice["delta"]):
            return [("", body)]  # OpenAI's events have no names
        # A chat choice ends with a chunk of its own, "delta": {} beside finish_reason, as
        # OpenAI sends it: the last piece's text or calls go first, in a chunk without it.
        end = {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
        end["stop_reason"] = choice.pop("stop_reason", None)
        choice["finish_reason"] = None
        last = {key: value for key, value in body.items() if key != "prompt_logprobs"} | {"choices": [end]}
        return [("", body), ("", last)]

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
            answered = [
                c
                for k in range(len(self.prompt_tokens))
                for c in sorted(
                    (c for c in answered if c.prompt == k), key=lambda c: -sum(lp.logprob for lp in c.logprobs)
                )[: self.keep]
            ]
        for i, c in enumerate(answered):
            text = "".join(c.text)
            choice: dict = {"index": i}
            assert c.last is not None  # every choice finished before the response is made
            if self.chat:
                message = c.last.message
                choice["message"] = {"role": "assistant", "content": text} if message is None else _message(message)
                choice["logprobs"] = {"content": chat_logprobs(c.logprobs)} if self.logprobs else None
            else:
                lps = [] if self.echo_only else c.logprobs
                choice["text"] = c.echo.text + ("" if self.echo_only else text)
                echo = self._echo_logprobs(c.echo, c.prompt_logprobs)
                choice["logprobs"] = completion_logprobs(lps, len(c.echo.text), echo) if self.logprobs else None
            choice["finish_reason"] = finish_reason(c.last)
            choice["stop_reason"] = stop_reason(c.last)
            shown = self._prompt_logprobs(c.prompt_logprobs)
            if shown is not None and not self.chat:
                choice["prompt_logprobs"] = shown
            choices.append(choice)
        body = self._head(self.object, choices)
        shown = self._prompt_logprobs(self.choices[0].prompt_logprobs) if self.chat else None
        if shown is not None:  # the prompt is every choice's: vLLM puts its logprobs beside the choices
            body["prompt_logprobs"] = shown
        body["usage"] = self.usage()
        return body

    def _echo_logprobs(self, echo: Echo, lps: list[LogprobText]) -> dict | None:
        if echo.prompt is None:
            return None
        return echo_logprobs(echo.prompt, lps, self.num_logprobs, logprob_value)

    def _prompt_logprobs(self, lps: list[LogprobText]) -> list[dict | None] | None:
        if not lps or self.num_prompt_logprobs is None:
            return None
        return prompt_logprobs(lps, self.num_prompt_logprobs)

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
