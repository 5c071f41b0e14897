"""Forced tool calls from real weights: SmolLM2-135M-Instruct (the demo checkpoint, Q4_1
GGUF) behind a real pair, called with the real ``openai`` client on 127.0.0.1.

SmolLM2 has no native call format, so the frontend uses the generic json one; required
and named tool_choice must give 100 of 100 calls whose arguments validate against the
tool's schema, and a streamed answer must carry the same calls as the plain one.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.rpc.http_face import API_KEY, http_base
from tests.services import start_engine, start_frontend

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 16}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a time zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
# Real weights on a CPU: a few minutes when the machine is busy.
pytestmark = pytest.mark.timeout(900)
QUESTION = [{"role": "user", "content": "What will the weather be in Paris for the next three days?"}]


@pytest.fixture(scope="module")
def client(smollm2_gguf):
    engine = start_engine(smollm2_gguf, "--num-kv-blocks", "512", "--max-model-len", "2048")
    frontend = None
    try:
        engine.wait_serving()
        frontend = start_frontend(engine.address, extra=("--http-port", "0", "--api-key", API_KEY))
        base = http_base(frontend)
        yield openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    finally:
        if frontend is not None:
            frontend.terminate()
        engine.terminate()


def _calls(choice) -> list[tuple[str, dict]]:
    assert choice.finish_reason == "tool_calls", choice
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


def test_required_and_named_give_100_of_100_valid_calls(client):
    model = client.models.list().data[0].id
    num_valid = 0
    for i, choice in enumerate(["required", {"type": "function", "function": {"name": "get_weather"}}] * 5):
        answer = client.chat.completions.create(
            model=model,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            n=10,
            seed=i,
            temperature=0.8,
            max_tokens=64,
        )
        for c in answer.choices:
            ((name, arguments),) = _calls(c)
            assert choice == "required" or name == "get_weather"
            jsonschema.validate(arguments, SCHEMAS[name])
            num_valid += 1
    assert num_valid == 100


def test_streamed_calls_equal_the_plain_answer(client):
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=64, temperature=0.0)
    plain = _calls(client.chat.completions.create(**kw).choices[0])
    pieces: dict[int, dict] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = pieces.setdefault(d.index, {"name": d.function.name, "arguments": ""})
            entry["arguments"] += d.function.arguments or ""
    assert [(p["name"], json.loads(p["arguments"])) for p in pieces.values()] == plain


def test_tools_reach_a_template_without_tool_support_in_the_generic_prompt(client):
    """SmolLM2's own template never reads ``tools``: the frontend's generic system prompt
    shows them, and an earlier call as the json format writes it."""
    model = client.models.list().data[0].id
    base = str(client.base_url).removesuffix("/v1/")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]}]
    body = {"model": model, "messages": history, "tools": TOOLS}
    headers = {"authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(f"{base}/tokenize", json=body, headers=headers, timeout=60).json()["tokens"]
    detokenize = {"model": model, "tokens": tokens}
    text = httpx.post(f"{base}/detokenize", json=detokenize, headers=headers, timeout=60).json()["prompt"]
    assert "You can call these functions" in text and json.dumps(TIME) in text
    assert '{"name": "get_time", "arguments": {"zone": "UTC"}}' in text
    answer = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, max_tokens=1)
    plain = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1)
    assert answer.usage.prompt_tokens > plain.usage.prompt_tokens + 100
