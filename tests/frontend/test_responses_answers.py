"""The Responses API's answer in plain values: pieces in, numbered events and one Response out."""

from __future__ import annotations

from frontend_svc.service.http.errors import HttpError
from frontend_svc.service.http.responses_answers import ResponsesAnswer
from frontend_svc.service.http.responses_requests import responses_request
from frontend_svc.service.http.responses_store import ResponseStore
from frontend_svc.text.message_parser import ToolCallPiece
from frontend_svc.text.output_processor import ChoiceOutput, Usage
from tandem_common.types import FinishReason


def _answer(kept: ResponseStore, **body) -> ResponsesAnswer:
    return ResponsesAnswer(responses_request({"input": "hi", **body}, kept), "m", 3, kept)


def _pieces() -> list[ChoiceOutput]:
    last = ChoiceOutput(0, token_ids=[4], tool_calls=[ToolCallPiece(0, arguments="1}")])
    last.finish_reason, last.usage = FinishReason.TOOL_CALLS, Usage(3, 4, 0)
    return [
        ChoiceOutput(0, reasoning="hm", token_ids=[1]),
        ChoiceOutput(0, text="ok", token_ids=[2]),
        ChoiceOutput(0, token_ids=[3], tool_calls=[ToolCallPiece(0, "call_1", "f", '{"a": ')]),
        last,
    ]


def test_the_events_build_reasoning_message_and_call_items_and_fold_to_the_response():
    store = ResponseStore(1 << 20, 60.0)
    streamed = _answer(store)
    events = streamed.start_events() + [e for p in _pieces() for e in streamed.events(p)] + streamed.end_events()
    assert [n for n, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    assert all(e["type"] == n for n, e in events)
    final = events[-1][1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][2]["arguments"] == '{"a": 1}' and final["output"][2]["call_id"] == "call_1"
    assert final["usage"]["output_tokens"] == 4 and final["usage"]["output_tokens_details"]["reasoning_tokens"] == 1

    whole = _answer(store)
    for piece in _pieces():
        whole.add(piece)
    strip = [{k: v for k, v in i.items() if k != "id"} for i in final["output"]]
    assert [{k: v for k, v in i.items() if k != "id"} for i in whole.response()["output"]] == strip
    stored = store.get(whole.id)
    assert stored is not None and stored.conversation[-1] == {
        "role": "assistant",
        "content": "ok",
        "tool_calls": [{"id": "call_1", "name": "f", "arguments": '{"a": 1}'}],
    }


def test_store_false_keeps_nothing_and_a_failure_is_an_error_then_response_failed():
    store = ResponseStore(1 << 20, 60.0)
    answer = _answer(store, store=False)
    answer.start_events()
    for piece in _pieces():
        answer.add(piece)
    assert answer.response()["store"] is False and len(store) == 0

    cut = _answer(store)
    cut.start_events()
    cut.events(_pieces()[1])
    (error, failed) = cut.failed_events(HttpError(503, "no engine", code="unavailable"))
    assert error[0] == "error" and error[1]["code"] == "unavailable" and error[1]["sequence_number"] == 5
    assert failed[0] == "response.failed" and failed[1]["response"]["status"] == "failed"
    assert failed[1]["response"]["output"][0]["content"] == [] and len(store) == 0
