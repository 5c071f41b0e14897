"""Tool calls and reasoning through the public API: a real engine and real frontends on 127.0.0.1.

One engine serves the demo model's weights with a Qwen3-style chat template (hermes calls,
a thought the template opens); two frontends reach it: one with --reasoning-parser qwen3
and the template's own format, one with --tool-call-parser json and no reasoning split.
Forced calls are sampled at temperature 1 from random weights, so only the grammar keeps
them valid: every one must validate against its tool's schema with jsonschema.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import jsonschema
import pytest

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.chat_templates import HERMES_THINKING, model_with_template
from tests.rpc.frontend_calls import by_choice, stub_of
from tests.services import start_engine, start_frontend

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["celsius", "fahrenheit"]},
        "when": {
            "type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
            "required": ["hour"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "days", "units", "when"],
    "additionalProperties": False,
}
TOOLS = [
    g.Tool(name="get_weather", description="Weather for a city", parameters=json.dumps(WEATHER)),
    g.Tool(name="get_time", description="The current time"),  # no parameters
]
SCHEMAS = {"get_weather": WEATHER, "get_time": {"type": "object", "properties": {}, "additionalProperties": False}}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
QUESTION = [g.ChatMessage(role="user", content="What is the weather in Paris, and what time is it?")]


@pytest.fixture(scope="module")
def services(demo_model_dir, tmp_path_factory):
    model = model_with_template(demo_model_dir, tmp_path_factory.mktemp("hermes") / "model", HERMES_THINKING)
    engine = start_engine(model, "--num-kv-blocks", "1024")
    frontends = []
    try:
        engine.wait_serving()
        frontends.append(start_frontend(engine.address, extra=("--reasoning-parser", "qwen3")))
        frontends.append(start_frontend(engine.address, extra=("--tool-call-parser", "json")))
        yield [f.wait_serving() for f in frontends]
    finally:
        for f in frontends:
            f.terminate()
        engine.terminate()


@pytest.fixture
async def stubs(services):
    async with (
        grpc.aio.insecure_channel(services[0].address) as hermes,
        grpc.aio.insecure_channel(services[1].address) as plain,
    ):
        yield stub_of(hermes), stub_of(plain)


def chat(enable_thinking: bool | None = None, messages=QUESTION) -> g.ChatMessages:
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    return g.ChatMessages(messages=messages, **kw)


async def call(stub, *, messages, params, tools=TOOLS, **kw) -> dict[int, list[g.GenerateResponse]]:
    request = g.GenerateRequest(messages=messages, sampling_params=g.SamplingParams(**params), tools=tools, **kw)
    return by_choice([r async for r in stub.Generate(request, timeout=300)])


def joined(responses: list[g.GenerateResponse]) -> dict:
    """What a streaming client assembles from the deltas."""
    calls: dict[int, dict] = {}
    for r in responses:
        for d in r.tool_calls:
            if d.index not in calls:
                assert d.name and d.id, f"the first piece of call {d.index} names it: {d}"
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            else:
                assert not d.name and not d.id, "only a call's first piece names it"
            calls[d.index]["arguments"] += d.arguments
    return {
        "content": "".join(r.text for r in responses),
        "reasoning": "".join(r.reasoning_text for r in responses),
        "calls": [calls[i] for i in sorted(calls)],
    }


def check_stream_equals_message(responses: list[g.GenerateResponse]) -> dict:
    """The deltas joined equal the final message, unless max_tokens cut the output inside
    a call: the stream then carries the open call, the message its text as content."""
    stream, message = joined(responses), responses[-1].message
    if responses[-1].finish_reason == g.FINISH_REASON_LENGTH and stream["calls"]:
        return stream
    assert stream["content"] == message.content
    assert stream["reasoning"] == message.reasoning
    assert [(c["id"], c["name"]) for c in stream["calls"]] == [(c.id, c.name) for c in message.tool_calls]
    for streamed, whole in zip(stream["calls"], message.tool_calls, strict=True):
        assert json.loads(streamed["arguments"]) == json.loads(whole.arguments)
    return stream


def check_forced(choices: dict[int, list[g.GenerateResponse]], only: str | None, exactly_one: bool) -> int:
    num_calls = 0
    for responses in choices.values():
        last = responses[-1]
        assert last.finish_reason == g.FINISH_REASON_TOOL_CALLS, last
        stream = check_stream_equals_message(responses)
        assert stream["content"] == "" and stream["calls"], stream
        if exactly_one:
            assert len(stream["calls"]) == 1, stream
        for c in stream["calls"]:
            assert only is None or c["name"] == only
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
            num_calls += 1
    return num_calls


@pytest.mark.parametrize("which", [0, 1], ids=["hermes", "json"])
async def test_required_and_named_give_100_of_100_valid_calls(stubs, which):
    stub = stubs[which]
    thinking = {} if which else {"enable_thinking": False}
    params = dict(max_tokens=160, temperature=1.0, n=10)
    required = g.ToolChoice(mode=g.TOOL_CHOICE_MODE_REQUIRED)
    named = g.ToolChoice(function_name="get_weather")
    runs = [
        *(
            call(
                stub,
                messages=chat(**thinking),
                params={**params, "seed": s},
                tool_choice=required,
                parallel_tool_calls=False,
            )
            for s in range(5)
        ),
        *(
            call(stub, messages=chat(**thinking), params={**params, "seed": 20 + s}, tool_choice=named)
            for s in range(5)
        ),
    ]
    results = await asyncio.gather(*runs)
    assert sum(len(r) for r in results) == 100
    counted = sum(check_forced(r, None, exactly_one=True) for r in results[:5])
    counted += sum(check_forced(r, "get_weather", exactly_one=True) for r in results[5:])
    assert counted == 100


async def test_required_parallel_calls_are_each_valid(stubs):
    """Random weights may chain calls past max_tokens: every call that closed validates,
    and the calls are in order, one per index."""
    choices = await call(
        stubs[0],
        messages=chat(enable_thinking=False),
        params=dict(max_tokens=240, temperature=1.0, n=8, seed=5),
        tool_choice=g.ToolChoice(mode=g.TOOL_CHOICE_MODE_REQUIRED),
    )
    for responses in choices.values():
        stream = check_stream_equals_message(responses)
        finished = responses[-1].finish_reason
        assert finished in (g.FINISH_REASON_TOOL_CALLS, g.FINISH_REASON_LENGTH)
        complete = stream["calls"] if finished == g.FINISH_REASON_TOOL_CALLS else stream["calls"][:-1]
        assert stream["content"] == "" and stream["calls"]
        for c in complete:
            jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


async def test_response_format_with_auto_keeps_tools_reachable(stubs):
    params = dict(max_tokens=160, temperature=1.0, n=12, json_schema=json.dumps(ANSWER))
    results = await asyncio.gather(
        *(
            call(
                stubs[0], messages=chat(enable_thinking=False), params={**params, "seed": s}, parallel_tool_calls=False
            )
            for s in range(4)
        )
    )
    kinds = set()
    for choices in results:
        for responses in choices.values():
            stream = check_stream_equals_message(responses)
            if stream["calls"]:
                assert responses[-1].finish_reason == g.FINISH_REASON_TOOL_CALLS
                for c in stream["calls"]:
                    jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
                kinds.add("calls")
            else:
                assert responses[-1].finish_reason == g.FINISH_REASON_STOP
                jsonschema.validate(json.loads(stream["content"]), ANSWER)
                kinds.add("answer")
    assert kinds == {"calls", "answer"}, "both branches of the grammar are taken in 48 samples"


async def test_template_opened_thought_cut_short_stays_reasoning(stubs):
    choices = await call(stubs[0], messages=chat(), params=dict(max_tokens=24, temperature=1.0, seed=3), tools=[])
    responses = choices[0]
    stream = check_stream_equals_message(responses)
    assert responses[-1].finish_reason == g.FINISH_REASON_LENGTH
    assert stream["content"] == "" and stream["reasoning"], stream


async def test_thought_closed_by_the_template_leaves_content(stubs):
    choices = await call(
        stubs[0], messages=chat(enable_thinking=False), params=dict(max_tokens=24, temperature=1.0, seed=3), tools=[]
    )
    stream = check_stream_equals_message(choices[0])
    assert stream["reasoning"] == "" and stream["content"], stream


async def test_tool_choice_none_leaves_the_tools_out(stubs):
    params = dict(max_tokens=1, temperature=0.0)
    with_tools = await call(stubs[1], messages=chat(), params=params)
    none = await call(stubs[1], messages=chat(), params=params, tool_choice=g.ToolChoice(mode=g.TOOL_CHOICE_MODE_NONE))
    without = await call(stubs[1], messages=chat(), params=params, tools=[])
    assert none[0][-1].usage.prompt_tokens == without[0][-1].usage.prompt_tokens
    assert with_tools[0][-1].usage.prompt_tokens > without[0][-1].usage.prompt_tokens


async def test_a_conversation_with_calls_and_results_renders(stubs):
    turns = [
        *QUESTION,
        g.ChatMessage(
            role="assistant",
            tool_calls=[g.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')],
        ),
        g.ChatMessage(role="tool", tool_call_id="call_1", name="get_weather", content='{"temp": 21}'),
    ]
    choices = await call(stubs[0], messages=chat(False, turns), params=dict(max_tokens=4, temperature=0.0))
    short = await call(stubs[0], messages=chat(False), params=dict(max_tokens=4, temperature=0.0))
    assert choices[0][-1].usage.prompt_tokens > short[0][-1].usage.prompt_tokens


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        (dict(tool_choice=g.ToolChoice(function_name="nope")), "tool_choice: function 'nope' is not one of"),
        (dict(tools=[g.Tool(name="f", parameters="{oops")]), "tools[0].parameters: is not valid JSON"),
        (dict(tools=[g.Tool(name="f"), g.Tool(name="f")]), "tools[1].name: 'f' is named twice"),
        (dict(tools=[g.Tool(name="a b")]), "tools[0].name: 'a b' is not a valid name"),
        (
            dict(
                messages=chat(
                    messages=[g.ChatMessage(role="assistant", tool_calls=[g.ToolCall(name="f", arguments="[1]")])]
                )
            ),
            "messages.messages[0].tool_calls[0].arguments: must be a JSON object",
        ),
        (dict(messages=None, text="hi"), "tools: tools need a chat"),
        (
            dict(tools=[g.Tool(name="f", parameters=json.dumps({"properties": {"a": {"$ref": "#/$defs/Gone"}}}))]),
            "tools[0].parameters: is not a JSON Schema the engine can follow",
        ),
        (
            dict(tools=[g.Tool(name="f", parameters='{"type": "colour"}')], tool_choice=None),
            "tools[0].parameters: is not a JSON Schema the engine can follow",
        ),
    ],
)
async def test_bad_tool_requests_are_invalid_argument(stubs, kw, needle):
    kw = {"messages": chat(), **kw}
    for name in ("messages", "tool_choice"):
        if name in kw and kw[name] is None:
            kw.pop(name)
    request = g.GenerateRequest(sampling_params=g.SamplingParams(max_tokens=2), **{"tools": TOOLS, **kw})
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _ = [r async for r in stubs[0].Generate(request, timeout=30)]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details(), e.value.details()


# A nested model in $defs and a tree that refers to itself, as pydantic writes them: each
# schema is the root of its own compile, so its refs resolve, forced or under auto.
ADDRESS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
}
PERSON = {
    "$defs": {"Address": ADDRESS},
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "home": {"$ref": "#/$defs/Address"}},
    "required": ["name", "home"],
}
TREE = {
    "definitions": {
        "Node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
                "kids": {"type": "array", "items": {"$ref": "#/definitions/Node"}, "maxItems": 2},
            },
            "required": ["v", "kids"],
        }
    },
    "$ref": "#/definitions/Node",
}
REF_TOOLS = [
    g.Tool(name="save_person", parameters=json.dumps(PERSON)),
    g.Tool(name="save_tree", parameters=json.dumps(TREE)),
]


@pytest.mark.parametrize("which", [0, 1], ids=["hermes", "json"])
async def test_schemas_with_refs_are_forced_and_closed(stubs, which):
    thinking = {} if which else {"enable_thinking": False}
    choices = await call(
        stubs[which],
        messages=chat(**thinking),
        params=dict(max_tokens=200, temperature=1.0, n=6, seed=3),
        tools=REF_TOOLS,
        tool_choice=g.ToolChoice(function_name="save_person"),
    )
    for responses in choices.values():
        assert responses[-1].finish_reason == g.FINISH_REASON_TOOL_CALLS, responses[-1]
        (person,) = check_stream_equals_message(responses)["calls"]
        arguments = json.loads(person["arguments"])
        jsonschema.validate(arguments, PERSON)
        assert set(arguments) == {"name", "home"} and set(arguments["home"]) == {"city"}  # closed objects
    auto = await call(stubs[which], messages=chat(**thinking), params=dict(max_tokens=8), tools=REF_TOOLS)
    assert auto[0][-1].finish_reason in (g.FINISH_REASON_LENGTH, g.FINISH_REASON_STOP, g.FINISH_REASON_TOOL_CALLS)
