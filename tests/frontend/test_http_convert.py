"""The HTTP face's conversions, in plain values: JSON bodies in, chunks out, no server."""

from __future__ import annotations

import asyncio
import json

import pytest

from frontend_svc.service.http import sse
from frontend_svc.service.http.anthropic_api import param_name as anthropic_param
from frontend_svc.service.http.errors import HttpError, from_call_error
from frontend_svc.service.http.openai_answers import OpenAIAnswer
from frontend_svc.service.http.openai_requests import chat_request, completion_request, param_name
from frontend_svc.text.output_processor import ChoiceOutput, LogprobText, TopLogprobText, Usage
from frontend_svc.types import CallError
from tandem_common.types import ErrorCode, FinishReason


def test_a_completion_body_becomes_the_same_plain_values_as_grpc():
    r = completion_request(
        {"prompt": "hi", "max_tokens": 7, "n": 2, "stop": ".", "seed": -1, "top_k": 5, "logprobs": 3, "user": "u"}
    )
    gen = r.input
    assert (gen.input, gen.text, gen.n, gen.stop, gen.max_tokens_set) == ("text", "hi", 2, ["."], True)
    assert (gen.params.max_tokens, gen.params.top_k, gen.params.logprobs) == (7, 5, 3)
    assert gen.params.seed == (1 << 64) - 1  # a signed 64-bit seed as the uint64 the engine takes
    assert completion_request({"prompt": [[1, 2, 3]]}).input.token_ids == [1, 2, 3]


def test_chat_fields_and_response_format():
    r = chat_request(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_completion_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            "chat_template_kwargs": {"enable_thinking": False},
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert r.input.chat.messages == [{"role": "user", "content": "ab"}]
    assert r.input.chat.template_kwargs == {"enable_thinking": False}
    assert r.input.params.structured.kind == "json_schema" and json.loads(r.input.params.structured.text)
    assert (r.input.params.max_tokens, r.input.params.logprobs, r.stream, r.include_usage) == (3, 2, True, True)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [], "n": True}, "n"),
        ({"messages": [], "temperature": float("nan")}, "temperature"),
        ({"messages": [], "stop": [1]}, "stop"),
        ({"messages": [], "tools": [{"type": "function"}]}, "tools[0].function"),
        ({"messages": [], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ([], None),
    ],
)
def test_wrong_types_name_their_field(body, param):
    with pytest.raises(HttpError) as error:
        chat_request(body)
    assert error.value.status == 400 and error.value.param == param


def test_planning_paths_become_openai_params():
    assert param_name("sampling_params.top_p") == "top_p"
    assert param_name("sampling_params.stop[2]") == "stop[2]"
    assert param_name("text") == param_name("token_ids.ids") == "prompt"
    assert param_name("messages.messages") == "messages"
    assert param_name("sampling_params.json_schema") == "response_format"
    assert param_name("tools[3].parameters") == "tools[3].function.parameters"
    assert param_name("tools[0].name") == "tools[0].function.name"
    assert param_name("tools") == "tools" and anthropic_param("tools[1].parameters") == "tools[1].input_schema"
    error = from_call_error(CallError(ErrorCode.INVALID_ARGUMENT, "sampling_params.n: must be in [1, 16]"), param_name)
    assert (error.status, error.param, error.message) == (400, "n", "n: must be in [1, 16]")
    busy = from_call_error(CallError(ErrorCode.RESOURCE_EXHAUSTED, "full"), param_name)
    assert busy.status == 429 and busy.headers() == {"retry-after": "1"}
    assert from_call_error(CallError(ErrorCode.UNAVAILABLE, "no engine"), param_name).status == 503


def _piece(index=0, text="x", logprob=float("-inf"), finished=False) -> ChoiceOutput:
    lp = LogprobText(5, "x", logprob, 1, [TopLogprobText(6, "y", float("-inf"))])
    piece = ChoiceOutput(index, text, [5], [lp])
    if finished:
        piece.finish_reason, piece.stop_str, piece.usage = FinishReason.STOP, "x", Usage(3, 1, 0)
    return piece


def test_minus_infinity_never_reaches_json():
    for chat in (True, False):
        answer = OpenAIAnswer(chat=chat, model="m", n=1, num_prompt_tokens=3, logprobs=True)
        chunk = sse.dumps(answer.chunk(_piece(finished=True), usage=True)).decode()
        assert "Infinity" not in chunk and "-9999.0" in chunk
        assert json.loads(chunk)["usage"]["completion_tokens"] == 1
    with pytest.raises(ValueError):  # a stray non-finite value is a bug, never invalid JSON on the wire
        sse.dumps({"x": float("inf")})


def test_chat_chunks_carry_the_role_first_and_stop_reason_last():
    answer = OpenAIAnswer(chat=True, model="m", n=1, num_prompt_tokens=3, logprobs=False)
    first, last = answer.chunk(_piece()), answer.chunk(_piece(finished=True))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "x"}
    assert last["choices"][0]["delta"] == {"content": "x"} and last["choices"][0]["finish_reason"] == "stop"
    assert last["choices"][0]["stop_reason"] == "x" and "usage" not in last


async def test_pings_go_out_only_while_nothing_came():
    async def slow():
        await asyncio.sleep(0.25)
        yield 1
        yield 2

    got = [item async for item in sse.with_pings(slow(), ping_s=0.1)]
    assert got[-2:] == [1, 2] and got[:-2] == [None] * len(got[:-2]) and len(got) >= 3
