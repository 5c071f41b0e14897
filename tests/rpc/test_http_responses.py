"""The Responses API end to end: the real ``openai`` client's ``responses.create`` and
``responses.stream`` against a real pair on 127.0.0.1 (the demo model's weights with a
Qwen3-style template, a frontend with --reasoning-parser qwen3 and --http-port 0)."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.chat_templates import HERMES_THINKING, model_with_template
from tests.rpc.http_face import API_KEY, http_base, post
from tests.services import start_engine, start_frontend
from tests.structured_cases import SCHEMA

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}
NO_THINKING = {"effort": "none"}  # the template writes a closed, empty thought
PLAIN = dict(reasoning=NO_THINKING, temperature=0.0, max_output_tokens=12)


@pytest.fixture(scope="module")
def served(demo_model_dir, tmp_path_factory):
    model = model_with_template(demo_model_dir, tmp_path_factory.mktemp("hermes") / "model", HERMES_THINKING)
    engine = start_engine(model, "--num-kv-blocks", "512")
    frontend = None
    try:
        engine.wait_serving()
        extra = ("--http-port", "0", "--api-key", API_KEY, "--reasoning-parser", "qwen3")
        frontend = start_frontend(engine.address, extra=extra)
        yield http_base(frontend)
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_text_input_answers_a_message_with_the_chat_answers_text(client, model):
    response = client.responses.create(model=model, input="Hello", instructions="Be brief.", **PLAIN)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text and response.usage.output_tokens == 12
    assert response.instructions == "Be brief." and response.max_output_tokens == 12
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=12,
        temperature=0.0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert response.output_text == chat.choices[0].message.content  # the same plan as chat
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_the_stream_has_the_documented_events_and_folds_to_the_whole_response(client, model):
    whole = client.responses.create(model=model, input="Hello", **PLAIN)
    with client.responses.stream(model=model, input="Hello", **PLAIN) as stream:
        events = list(stream)
    final = events[-1].response  # cut by max_output_tokens: OpenAI's response.incomplete, not .completed
    names = [e.type for e in events]
    assert names[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert names[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text  # byte for byte
    assert final.id != whole.id and final.usage.output_tokens == whole.usage.output_tokens


def test_a_thought_is_a_reasoning_item_before_the_message(client, model):
    response = client.responses.create(model=model, input="Weather in Paris?", max_output_tokens=16, temperature=0.0)
    assert response.output[0].type == "reasoning"
    assert response.output[0].content[0].text and response.usage.output_tokens == 16
    with client.responses.stream(model=model, input="Weather in Paris?", max_output_tokens=16, temperature=0.0) as s:
        streamed = "".join(e.delta for e in s if e.type == "response.reasoning_text.delta")
    assert streamed == response.output[0].content[0].text


def test_a_function_tool_round_trip_with_previous_response_id(client, model):
    kw = dict(model=model, tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}, temperature=0.0)
    first = client.responses.create(input="Weather in Paris?", max_output_tokens=120, reasoning=NO_THINKING, **kw)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    with client.responses.stream(input="Weather in Paris?", max_output_tokens=120, reasoning=NO_THINKING, **kw) as s:
        events = list(s)
        final = s.get_final_response()
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    (streamed,) = [item for item in final.output if item.type == "function_call"]
    assert arguments == done.arguments == streamed.arguments == call.arguments
    assert events[-1].type == "response.completed"

    answer = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}],
        tools=[TOOL],
        **PLAIN,
    )
    assert answer.previous_response_id == first.id and answer.output_text
    assert answer.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # the call and result

    # Stateless, as a client with store: false does: the output items sent back as input.
    items = [{"role": "user", "content": "Weather in Paris?"}, *(i.model_dump() for i in first.output)]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'})
    again = client.responses.create(model=model, input=items, tools=[TOOL], store=False, **PLAIN)
    assert again.usage.input_tokens == answer.usage.input_tokens and again.output_text == answer.output_text


def test_required_without_parallel_calls_is_one_valid_call(client, model):
    tools = [TOOL, {"type": "function", "name": "get_time", "description": "The time"}]
    for seed in range(3):
        response = client.responses.create(
            model=model,
            input="Weather in Paris?",
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            reasoning=NO_THINKING,
            max_output_tokens=120,
            extra_body={"seed": seed},
        )
        (call,) = [item for item in response.output if item.type == "function_call"]
        assert response.parallel_tool_calls is False and call.name in ("get_weather", "get_time")
        if call.name == "get_weather":
            jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_previous_response_id_continues_the_conversation_and_store_false_keeps_none(client, model):
    first = client.responses.create(model=model, input="My name is Ada.", **PLAIN)
    second = client.responses.create(model=model, input="What is my name?", previous_response_id=first.id, **PLAIN)
    alone = client.responses.create(model=model, input="What is my name?", **PLAIN)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens

    unstored = client.responses.create(model=model, input="Hello", store=False, **PLAIN)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="Again", previous_response_id=unstored.id, **PLAIN)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"


def test_get_and_delete_a_stored_response(served, client, model):
    response = client.responses.create(model=model, input="Hello", **PLAIN)
    got = client.responses.retrieve(response.id)
    assert got.id == response.id and got.output_text == response.output_text and got.usage == response.usage
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(response.id)  # only background responses can be cancelled
    r = httpx.get(f"{served}/v1/responses/{response.id}?stream=true", headers={"authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)


def test_text_format_json_schema_is_constrained(client, model):
    response = client.responses.create(
        model=model,
        input="A person as JSON",
        reasoning=NO_THINKING,
        max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}},
    )
    assert response.status == "completed", response.output_text
    jsonschema.validate(json.loads(response.output_text), SCHEMA)


class Day(pydantic.BaseModel):
    id: int = pydantic.Field(ge=0, le=999)
    day: Literal["sun", "rain"]


def test_the_sdks_parse_gets_its_pydantic_model(client, model):
    response = client.responses.parse(
        model=model, input="A day as JSON", reasoning=NO_THINKING, max_output_tokens=100, text_format=Day
    )
    assert isinstance(response.output_parsed, Day), response.output_text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"conversation": "conv_1"}, "conversation"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
        ({"max_output_tokens": "many"}, "max_output_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"text": {"format": {"type": "text"}, "schema": {}}}, "text.schema"),
        ({"reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
    ],
)
def test_a_field_not_served_is_400_naming_it(served, model, body, param):
    r = post(served, "/v1/responses", {"model": model, "input": "Hi", "max_output_tokens": 2, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", r.text


def test_a_bad_request_to_a_stream_is_400_before_it_starts(served, model):
    with httpx.stream(
        "POST",
        served + "/v1/responses",
        json={"model": model, "input": "Hi", "stream": True, "tools": [{"type": "function", "name": "a b"}]},
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=30,
    ) as r:
        r.read()
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools"), r.text
