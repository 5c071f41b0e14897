"""Tools and reasoning on the HTTP face: the real ``openai`` and ``anthropic`` clients against
a real pair on 127.0.0.1 (the demo model's weights with a Qwen3-style template, a frontend
with --reasoning-parser qwen3 and --http-port 0)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.chat_templates import HERMES_THINKING, model_with_template
from tests.rpc.http_face import API_KEY, http_base
from tests.services import start_engine, start_frontend

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time"}},
]
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


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


def test_named_tool_choice_streams_the_calls_of_the_plain_answer(client, model):
    kw = dict(
        model=model,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
        temperature=1.0,
        extra_body=NO_THINKING,
    )
    for seed in range(5):
        whole = client.chat.completions.create(seed=seed, **kw).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        (call,) = whole.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)

        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(seed=seed, stream=True, **kw):
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                entry["arguments"] += d.function.arguments or ""
        assert finish == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
            (call.function.name, json.loads(call.function.arguments))
        ]


def test_required_gives_valid_calls_and_a_tool_turn_renders(client, model):
    answer = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        n=6,
        seed=4,
        extra_body=NO_THINKING,
    )
    schemas = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}, "additionalProperties": False}}
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        fn = choice.message.tool_calls[0].function
        jsonschema.validate(json.loads(fn.arguments), schemas[fn.name])
    call = answer.choices[0].message.tool_calls[0]
    follow_up = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    again = client.chat.completions.create(model=model, messages=follow_up, tools=TOOLS, max_tokens=4)
    assert again.usage.prompt_tokens > answer.usage.prompt_tokens


def test_a_thought_the_template_opened_is_reasoning_content(client, model):
    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, seed=1)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "length"
    assert message.content == "" and message.model_extra["reasoning_content"]
    streamed = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        for c in client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, seed=1, stream=True)
    )
    assert streamed == message.model_extra["reasoning_content"]


def test_bad_tools_are_400_naming_the_field(served, model):
    for body, param in [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ]:
        r = httpx.post(
            served + "/v1/chat/completions",
            json={"model": model, "messages": QUESTION, "max_tokens": 2, **body},
            headers={"authorization": f"Bearer {API_KEY}"},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


def test_anthropic_tool_use_blocks_stream_as_the_whole_message(served, model):
    client = anthropic.Anthropic(base_url=served, api_key=API_KEY, max_retries=0, timeout=120)
    kw = dict(
        model=model,
        max_tokens=120,
        messages=QUESTION,
        tools=[{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0.0, "thinking": {"type": "disabled"}},
    )
    message = client.messages.create(**kw)
    assert message.stop_reason == "tool_use"
    (block,) = [b for b in message.content if b.type == "tool_use"]
    assert block.name == "get_weather"
    jsonschema.validate(block.input, WEATHER)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (block.name, block.input) and final.stop_reason == "tool_use"

    follow_up = [
        *QUESTION,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": "21 C"}]},
    ]
    again = client.messages.create(model=model, max_tokens=4, messages=follow_up, extra_body={"temperature": 0.0})
    plain = client.messages.create(model=model, max_tokens=4, messages=QUESTION, extra_body={"temperature": 0.0})
    assert again.usage.input_tokens > plain.usage.input_tokens  # the call and its result were rendered


def test_anthropic_thinking_is_a_thinking_block(served, model):
    client = anthropic.Anthropic(base_url=served, api_key=API_KEY, max_retries=0, timeout=120)
    message = client.messages.create(model=model, max_tokens=12, messages=QUESTION, extra_body={"temperature": 0.0})
    assert [b.type for b in message.content][0] == "thinking" and message.stop_reason == "max_tokens"


class Address(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)


class Person(pydantic.BaseModel):
    """A person and where they live."""

    name: str = pydantic.Field(max_length=10)
    home: Address


def test_a_pydantic_model_with_a_nested_model_is_a_forced_tool(served, client, model):
    tool = openai.pydantic_function_tool(Person)
    assert "$defs" in tool["function"]["parameters"]
    kw = dict(
        model=model,
        messages=QUESTION,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "Person"}},
        max_tokens=120,
        temperature=1.0,
        seed=4,
        extra_body=NO_THINKING,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    (call,) = whole.message.tool_calls
    person = Person.model_validate_json(call.function.arguments)
    arguments = ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in chunk.choices[0].delta.tool_calls or []:
            arguments += d.function.arguments or ""
    assert Person.model_validate_json(arguments) == person

    anthropic_client = anthropic.Anthropic(base_url=served, api_key=API_KEY, max_retries=0, timeout=120)
    akw = dict(
        model=model,
        max_tokens=120,
        messages=QUESTION,
        tools=[{"name": "Person", "input_schema": Person.model_json_schema()}],
        tool_choice={"type": "tool", "name": "Person"},
        extra_body={"temperature": 0.0, "thinking": {"type": "disabled"}},
    )
    message = anthropic_client.messages.create(**akw)
    (block,) = [b for b in message.content if b.type == "tool_use"]
    Person.model_validate(block.input)
    with anthropic_client.messages.stream(**akw) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert Person.model_validate(streamed.input) == Person.model_validate(block.input)


BROKEN = {"type": "object", "properties": {"home": {"$ref": "#/$defs/Missing"}}}


def test_a_broken_schema_is_400_before_a_stream_starts(served, model):
    headers = {"authorization": f"Bearer {API_KEY}"}
    openai_body = {
        "model": model,
        "messages": QUESTION,
        "max_tokens": 4,
        "stream": True,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": BROKEN}}],
    }
    anthropic_body = {
        "model": model,
        "messages": QUESTION,
        "max_tokens": 4,
        "stream": True,
        "tools": [{"name": "f", "input_schema": BROKEN}],
        "tool_choice": {"type": "any"},
    }
    for path, body in [("/v1/chat/completions", openai_body), ("/v1/messages", anthropic_body)]:
        with httpx.stream("POST", served + path, json=body, headers=headers, timeout=30) as r:
            r.read()
        assert r.status_code == 400, r.text
        assert "text/event-stream" not in r.headers.get("content-type", "")
        error = r.json()["error"]
        assert "$defs/Missing" in error["message"], error
        if path == "/v1/messages":
            assert r.json()["type"] == "error" and error["type"] == "invalid_request_error"
        else:
            assert error["param"] == "tools[0].function.parameters", error


MAX_CUT = 40  # enough for the call's name, not for its arguments


def test_a_forced_call_cut_by_max_tokens_is_the_same_streamed_and_whole(served, client, model):
    tool = openai.pydantic_function_tool(Person)
    kw = dict(
        model=model,
        messages=QUESTION,
        tools=[tool],
        tool_choice="required",
        max_tokens=MAX_CUT,
        temperature=1.0,
        seed=7,
        extra_body=NO_THINKING,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in chunk.choices[0].delta.tool_calls or []:
            calls.setdefault(d.index, [d.function.name or "", ""])[1] += d.function.arguments or ""
    assert whole.finish_reason == "length" and calls, whole
    assert [[c.function.name, c.function.arguments] for c in whole.message.tool_calls or []] == list(calls.values())
    with pytest.raises(ValueError):
        json.loads(whole.message.tool_calls[-1].function.arguments)  # cut: as far as it was written

    anthropic_client = anthropic.Anthropic(base_url=served, api_key=API_KEY, max_retries=0, timeout=120)
    akw = dict(
        model=model,
        max_tokens=MAX_CUT,
        messages=QUESTION,
        tools=[{"name": "Person", "input_schema": Person.model_json_schema()}],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0.0, "thinking": {"type": "disabled"}},
    )
    message = anthropic_client.messages.create(**akw)
    with anthropic_client.messages.stream(**akw) as stream:
        final = stream.get_final_message()
    assert message.stop_reason == final.stop_reason == "max_tokens"
    uses = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    assert uses and uses == [(b.name, b.input) for b in final.content if b.type == "tool_use"]


def test_token_counts_are_of_the_prompt_a_call_renders_tools_included(served, client, model):
    headers = {"authorization": f"Bearer {API_KEY}"}
    tool = openai.pydantic_function_tool(Person)
    answer = client.chat.completions.create(model=model, messages=QUESTION, tools=[tool], max_tokens=1)
    plain = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1)
    body = {"model": model, "messages": QUESTION, "tools": [tool]}
    counted = httpx.post(served + "/tokenize", json=body, headers=headers, timeout=30).json()["count"]
    assert counted == answer.usage.prompt_tokens > plain.usage.prompt_tokens

    anthropic_client = anthropic.Anthropic(base_url=served, api_key=API_KEY, max_retries=0, timeout=120)
    akw = dict(
        model=model,
        messages=QUESTION,
        tools=[{"name": "Person", "input_schema": Person.model_json_schema()}],
        thinking={"type": "disabled"},
    )
    message = anthropic_client.messages.create(max_tokens=1, **akw)
    usage = message.usage  # Anthropic's usage splits the prompt into computed and cache-read tokens
    prompt_tokens = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert anthropic_client.messages.count_tokens(**akw).input_tokens == prompt_tokens
