"""Streamed pieces -> the Responses API's answer: one Response object, whole or as its events.

    ChoiceOutput ... ── ResponsesAnswer.events(piece) ──▶ response.output_item.added, *.delta ... (endpoint.Answer)
                     ── ResponsesAnswer.add(piece) ... .response() ──▶ the Response object (stream: false)

The answer is a list of output items, each opened when its first piece arrives and done
when the next one opens or the answer ends: ``reasoning`` (its text as one reasoning_text
part; a reasoning parser runs), ``message`` (one output_text part), ``function_call``
(call_id, name, the arguments' JSON text as it streams). The whole response is the same
stream folded, so its text is the streamed text byte for byte. A stream goes:

    response.created, response.in_progress
    per item: response.output_item.added
              message:   response.content_part.added, response.output_text.delta ...,
                         response.output_text.done, response.content_part.done
              reasoning: the same with reasoning_text
              call:      response.function_call_arguments.delta ..., .done
              response.output_item.done
    response.completed, or response.incomplete (max_output_tokens cut it)

every event numbered by ``sequence_number`` from 0. An error after the stream began is an
``error`` event and then ``response.failed``. A finished response is stored with its
conversation unless the request said ``store: false`` (responses_store.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from frontend_svc.service.http.errors import HttpError
from frontend_svc.service.http.responses_requests import ResponsesRequest
from frontend_svc.service.http.responses_store import ResponseStore
from frontend_svc.text.output_processor import ChoiceOutput
from tandem_common.types import FinishReason

Event = tuple[str, dict[str, Any]]


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class OutputItems:
    """The output items of one answer as its pieces arrive, and the events that build them."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: str | None = None  # "reasoning", "message" or "call:<index>"
        self._text: list[str] = []  # the open item's text (or arguments) so far

    def feed(self, piece: ChoiceOutput) -> list[Event]:
        out: list[Event] = []
        if piece.reasoning:
            self._enter(out, "reasoning", {"type": "reasoning", "summary": [], "content": []}, "rs_")
            out.append(self._delta("response.reasoning_text.delta", piece.reasoning))
        if piece.text:
            self._enter(out, "message", {"type": "message", "role": "assistant", "content": []}, "msg_")
            out.append(self._delta("response.output_text.delta", piece.text))
        for call in piece.tool_calls:
            if call.name is not None:
                item = {"type": "function_call", "call_id": call.id, "name": call.name, "arguments": ""}
                self._enter(out, f"call:{call.index}", item, "fc_")
            if call.arguments:
                out.append(self._delta("response.function_call_arguments.delta", call.arguments))
        return out

    def close(self, status: str) -> list[Event]:
        """Ends the answer: its open item done with ``status`` (an empty answer is one empty message)."""
        out: list[Event] = []
        if self._open is None and not self.items:
            self._enter(out, "message", {"type": "message", "role": "assistant", "content": []}, "msg_")
        if self._open is not None:
            self._close(out, status)
        return out

    def conversation_turn(self) -> dict[str, Any]:
        """The answer as the assistant turn a later request continues from (thoughts left out)."""
        text = "".join(_part(item)["text"] for item in self.items if item["type"] == "message")
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [i for i in self.items if i["type"] == "function_call"]
        if calls:
            turn["tool_calls"] = [{"id": c["call_id"], "name": c["name"], "arguments": c["arguments"]} for c in calls]
        return turn

    # -- events ---------------------------------------------------------------------------

    def _enter(self, out: list[Event], kind: str, item: dict[str, Any], prefix: str) -> None:
        if self._open == kind:
            return
        if self._open is not None:
            self._close(out, "completed")
        self._open, self._text = kind, []
        item = {"id": _id(prefix), **item, "status": "in_progress"}
        self.items.append(item)
        out.append(("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(item)}))
        if item["type"] != "function_call":
            out.append(("response.content_part.added", {**self._where(), "content_index": 0, "part": self._part("")}))

    def _delta(self, name: str, text: str) -> Event:
        self._text.append(text)
        where = self._where() if name.endswith("arguments.delta") else {**self._where(), "content_index": 0}
        if name == "response.output_text.delta":
            where["logprobs"] = []
        return name, {**where, "delta": text}

    def _close(self, out: list[Event], status: str) -> None:
        item, text = self.items[-1], "".join(self._text)
        if item["type"] == "function_call":
            item["arguments"] = text
            done = {**self._where(), "name": item["name"], "arguments": text}
            out.append(("response.function_call_arguments.done", done))
        else:
            part = self._part(text)
            item["content"] = [part]
            done = {**self._where(), "content_index": 0, "text": text}
            if item["type"] == "message":
                out.append(("response.output_text.done", {**done, "logprobs": []}))
            else:
                out.append(("response.reasoning_text.done", done))
            out.append(("response.content_part.done", {**self._where(), "content_index": 0, "part": dict(part)}))
        item["status"] = status
        out.append(("response.output_item.done", {"output_index": len(self.items) - 1, "item": _copy(item)}))
        self._open, self._text = None, []

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _part(self, text: str) -> dict[str, Any]:
        if self.items[-1]["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _part(item: dict[str, Any]) -> dict[str, Any]:
    return item["content"][0] if item["content"] else {"text": ""}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out


class ResponsesAnswer:
    """One Response (the API has no n), built piece by piece; stored once finished."""

    def __init__(self, request: ResponsesRequest, model: str, num_prompt_tokens: int, store: ResponseStore) -> None:
        self.request = request
        self.model = model
        self.store = store
        self.id = _id("resp_")
        self.created_at = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.items = OutputItems()
        self.num_tokens = 0
        self.num_reasoning_tokens = 0  # tokens of the pieces that held only thought
        self.num_cached_tokens = 0
        self.last: ChoiceOutput | None = None
        self._sequence = 0
        self._final: dict[str, Any] | None = None

    # -- whole response -------------------------------------------------------------------

    def add(self, piece: ChoiceOutput) -> None:
        self._feed(piece)

    def response(self) -> dict[str, Any]:
        assert self._final is not None  # the last piece was added
        return self._final

    # -- streaming ------------------------------------------------------------------------

    def start_events(self) -> list[Event]:
        head = self._object("in_progress", [], None)
        return self._numbered([("response.created", {"response": head}), ("response.in_progress", {"response": head})])

    def events(self, piece: ChoiceOutput) -> list[Event]:
        out = self._feed(piece)
        if self._final is not None:
            name = "response.incomplete" if self._final["status"] == "incomplete" else "response.completed"
            out.append((name, {"response": self._final}))
        return self._numbered(out)

    def end_events(self) -> list[Event]:
        return []  # response.completed went with the last piece

    def failed_events(self, error: HttpError) -> list[Event]:
        """A stream cut by an error: OpenAI's error event, then the response as failed."""
        failed = self._object("failed", [_copy(i) for i in self.items.items], None)
        failed["error"] = {"code": error.code or error.type, "message": error.message}
        error_event = {"code": error.code or error.type, "message": error.message, "param": error.param}
        return self._numbered([("error", error_event), ("response.failed", {"response": failed})])

    # -- shared ---------------------------------------------------------------------------

    def _feed(self, piece: ChoiceOutput) -> list[Event]:
        out = self.items.feed(piece)
        self.num_tokens += len(piece.token_ids)
        if piece.reasoning and not piece.text and not piece.tool_calls:
            self.num_reasoning_tokens += len(piece.token_ids)
        if piece.finished:
            self.last = piece
            if piece.usage is not None:
                self.num_tokens = piece.usage.completion_tokens
                self.num_cached_tokens = piece.usage.cached_tokens
            cut = piece.finish_reason is FinishReason.LENGTH
            out.extend(self.items.close("incomplete" if cut else "completed"))
            self._final = self._object("incomplete" if cut else "completed", self.items.items, self._usage())
            if cut:
                self._final["incomplete_details"] = {"reason": "max_output_tokens"}
            if self.request.store:
                self.store.put(self.id, self._final, [*self.request.conversation, self.items.conversation_turn()])
        return out

    def _usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens": self.num_tokens,
            "output_tokens_details": {"reasoning_tokens": min(self.num_reasoning_tokens, self.num_tokens)},
            "total_tokens": self.num_prompt_tokens + self.num_tokens,
        }

    def _object(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "model": self.model,
            "output": output,
            "usage": usage,
            "store": self.request.store,
            **self.request.echo,
        }

    def _numbered(self, events: list[Event]) -> list[Event]:
        out = []
        for name, obj in events:
            out.append((name, {"type": name, **obj, "sequence_number": self._sequence}))
            self._sequence += 1
        return out
