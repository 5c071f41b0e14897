"""Tools for a chat template that does not show them: the generic system prompt, and earlier
calls as text in the format (text/tools/prompt.py, through message_plan.prepare)."""

from __future__ import annotations

import json

import pytest

from frontend_svc.service.message_plan import OutputParsers, prepare
from frontend_svc.text.tokenizer import Tokenizer
from frontend_svc.text.tools import FORMATS
from frontend_svc.text.tools.spec import ToolChoice, ToolRequest, ToolSpec
from tests.chat_templates import CHATML, HERMES_THINKING
from tests.frontend.tokenizer_factory import tokenizer_files

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "days"],
}
TOOLS = ToolRequest((ToolSpec("get_weather", "The weather", json.dumps(WEATHER)), ToolSpec("get_time")))
CALL = {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21}'},
]


def tokenizer(template: str) -> Tokenizer:
    return Tokenizer.from_files({**tokenizer_files("byte_level"), "chat_template.jinja": template.encode()})


def test_a_template_without_tools_gets_them_in_a_system_prompt_and_calls_as_text():
    rendering = prepare(CHAT, TOOLS, None, tokenizer(CHATML), OutputParsers())
    assert rendering.tool_format is FORMATS["json"]
    system, user, assistant, result = rendering.messages
    assert system["role"] == "system" and user == CHAT[0] and result == CHAT[2]
    lines = system["content"].splitlines()
    listed = [json.loads(line) for line in lines if line.startswith('{"name": "get_')]
    assert [t["name"] for t in listed] == ["get_weather", "get_time", "get_weather"]
    assert listed[0]["parameters"] == WEATHER and listed[0]["description"] == "The weather"
    assert listed[2] == {"name": "get_weather", "arguments": {"city": "...", "days": 0}}  # the example call
    # The model's earlier call, in the format it is parsed with, where the template shows none.
    assert "tool_calls" not in assistant
    assert FORMATS["json"].parse(assistant["content"]).tool_calls[0].name == "get_weather"
    # The request's own system turn keeps its text first.
    own = prepare([{"role": "system", "content": "Be brief."}, *CHAT], TOOLS, None, tokenizer(CHATML), OutputParsers())
    assert own.messages[0]["content"].startswith("Be brief.\n\nYou can call these functions.")
    assert len(own.messages) == 4


def test_a_template_that_shows_tools_gets_them_as_they_are():
    rendering = prepare(CHAT, TOOLS, None, tokenizer(HERMES_THINKING), OutputParsers())
    assert [m["role"] for m in rendering.messages] == ["user", "assistant", "tool"]
    assert rendering.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 2}
    none = ToolRequest(TOOLS.tools, ToolChoice("none"))
    assert prepare(CHAT[:1], none, None, tokenizer(CHATML), OutputParsers()).messages == CHAT[:1]


@pytest.mark.parametrize("name", [*FORMATS, "mistral_named"])
def test_every_format_reads_back_the_calls_it_writes(name):
    fmt = FORMATS["mistral"].for_template("[ARGS]") if name == "mistral_named" else FORMATS[name]
    calls = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    parsed = fmt.parse(fmt.write_calls(calls))
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert parsed.content == ""
