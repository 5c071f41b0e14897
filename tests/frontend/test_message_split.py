"""Reasoning and tool calls split from a choice's tokens by ChoiceProcessor (real tokenizers,
engine outputs one token at a time and merged), and the plan's choices that decide it."""

from __future__ import annotations

import json

import pytest
import tokenizers

from frontend_svc.service.message_plan import ChatRendering, OutputParsers, finish
from frontend_svc.text.message_parser import MessageFormat
from frontend_svc.text.output_processor import ChoiceProcessor, TextParams
from frontend_svc.text.tokenizer import Tokenizer
from frontend_svc.text.tools import FORMATS
from frontend_svc.text.tools.spec import ToolChoice, ToolRequest, ToolSpec
from frontend_svc.types import EngineOutput
from tandem_common.sampling import SamplingParams, StructuredOutput
from tandem_common.types import FinishReason
from tests.frontend.tokenizer_factory import tokenizer_files

TOK = Tokenizer.from_files(tokenizer_files("byte_level"))
PROMPT = TOK.encode("Hello")
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
NOARGS = '{"name": "get_time", "arguments": {}}'
STOP, LENGTH, TOOL_CALLS = FinishReason.STOP, FinishReason.LENGTH, FinishReason.TOOL_CALLS


def outputs(text: str, finish: FinishReason, merged: bool, tok: Tokenizer = TOK) -> list[EngineOutput]:
    ids = tok.encode(text, add_special_tokens=False)
    if merged:
        return [EngineOutput("r", ids, finish_reason=finish, num_prompt_tokens=len(PROMPT))]
    return [EngineOutput("r", [t], num_prompt_tokens=len(PROMPT)) for t in ids[:-1]] + [
        EngineOutput("r", ids[-1:], finish_reason=finish, num_prompt_tokens=len(PROMPT))
    ]


def run(text: str, fmt: MessageFormat, finish=FinishReason.STOP, merged=False, tok=TOK, skip=True, stop=()):
    proc = ChoiceProcessor(0, tok, PROMPT, TextParams(message=fmt, skip_special_tokens=skip, stop=list(stop)))
    pieces = [p for p in (proc.process(o) for o in outputs(text, finish, merged, tok)) if p is not None]
    calls: dict[int, dict] = {}
    for p in pieces:
        for c in p.tool_calls:
            if c.name is not None:
                calls[c.index] = {"id": c.id, "name": c.name, "arguments": ""}
            calls[c.index]["arguments"] += c.arguments
    stream = {
        "content": "".join(p.text for p in pieces),
        "reasoning": "".join(p.reasoning for p in pieces),
        "calls": [calls[i] for i in sorted(calls)],
    }
    return stream, pieces[-1]


@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize(
    ("text", "opened", "finish", "reasoning", "content", "names", "reason"),
    [
        # the template opened the thought; the model closes it and answers
        ("Paris is in France.</think>It is Paris.", True, STOP, "Paris is in France.", "It is Paris.", [], STOP),
        # the model opens and closes its own thought
        ("<think>hmm</think>Yes.", False, STOP, "hmm", "Yes.", [], STOP),
        # cut short while thinking: all of it stays reasoning
        ("Let me think about the wea", True, LENGTH, "Let me think about the wea", "", [], LENGTH),
        # no thought at all
        ("Just an answer.", False, STOP, "", "Just an answer.", [], STOP),
        # a thought, then calls (one without arguments): TOOL_CALLS
        (
            f"plan</think>\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{NOARGS}\n</tool_call>",
            True,
            STOP,
            "plan",
            "",
            ["get_weather", "get_time"],
            TOOL_CALLS,
        ),
        # a call drafted inside the thought is no call
        (
            f"<tool_call>{CALL}</tool_call></think>No call needed.",
            True,
            STOP,
            f"<tool_call>{CALL}</tool_call>",
            "No call needed.",
            [],
            STOP,
        ),
    ],
)
def test_thought_content_and_calls_are_split_and_the_stream_equals_the_message(
    text, opened, finish, reasoning, content, names, reason, merged
):
    fmt = MessageFormat(tools=FORMATS["hermes"], reasoning=True, starts_in_thought=opened)
    stream, last = run(text, fmt, finish, merged)
    assert (stream["reasoning"], stream["content"]) == (reasoning, content)
    assert [c["name"] for c in stream["calls"]] == names
    assert last.finish_reason is reason
    message = last.message
    assert (message.reasoning, message.content) == (reasoning, content)
    assert [(c.id, c.name) for c in message.tool_calls] == [(c["id"], c["name"]) for c in stream["calls"]]
    for streamed, whole in zip(stream["calls"], message.tool_calls, strict=True):
        assert json.loads(streamed["arguments"]) == json.loads(whole.arguments)
    assert all(c["id"].startswith("call_") for c in stream["calls"])


def test_a_parameterless_call_keeps_its_empty_object_in_the_stream():
    stream, _ = run(f"<tool_call>{NOARGS}</tool_call>", MessageFormat(tools=FORMATS["hermes"]))
    assert stream["calls"] == [{"id": stream["calls"][0]["id"], "name": "get_time", "arguments": "{}"}]


def test_a_stop_string_ends_the_answer_before_the_parsers_see_it():
    stream, last = run(f"Sure.<tool_call>{CALL}</tool_call>", MessageFormat(tools=FORMATS["hermes"]), stop=["<tool"])
    assert stream == {"content": "Sure.", "reasoning": "", "calls": []}
    assert last.finish_reason is FinishReason.STOP and last.stop_str == "<tool"


def _with_special(token: str) -> Tokenizer:
    files = tokenizer_files("byte_level")
    backend = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode())
    backend.add_special_tokens([token])
    return Tokenizer(backend, json.loads(files["tokenizer_config.json"]))


def test_a_tag_that_is_a_special_token_keeps_special_tokens_in_the_text():
    tok = _with_special("[TOOL_CALLS]")
    tools = ToolRequest((ToolSpec("get_weather"),))
    rendering = ChatRendering([], {}, FORMATS["mistral"])
    fmt, _, skip = finish(rendering, "prompt", tools, SamplingParams(), True, tok, OutputParsers())
    assert skip is False
    text = f"[TOOL_CALLS][{CALL}]"
    stream, last = run(text, fmt, tok=tok, skip=skip)
    assert [c["name"] for c in stream["calls"]] == ["get_weather"] and last.finish_reason is FinishReason.TOOL_CALLS
    # with special tokens skipped the tag never reaches the parser: no call
    stream, last = run(text, fmt, tok=tok, skip=True)
    assert stream["calls"] == [] and last.finish_reason is FinishReason.STOP


def test_forced_and_answer_grammars_go_to_the_engine_as_one_lark_grammar():
    tools = ToolRequest((ToolSpec("get_weather"),), ToolChoice("required"))
    rendering = ChatRendering([], {}, FORMATS["hermes"])
    _, params, _ = finish(rendering, "<think>\n", tools, SamplingParams(), True, TOK, OutputParsers(None, "qwen3"))
    assert params.structured is not None and params.structured.kind == "grammar"
    assert params.structured.text.startswith("start: thought_text body")
    auto = ToolRequest((ToolSpec("get_weather"),))
    answer = SamplingParams(structured=StructuredOutput("json_object"))
    _, params, _ = finish(rendering, "user: hi", auto, answer, True, TOK, OutputParsers())
    assert "start: calls | answer" in params.structured.text
    none = ToolRequest((ToolSpec("get_weather"),), ToolChoice("none"))
    _, params, _ = finish(None, "user: hi", none, answer, True, TOK, OutputParsers())
    assert params.structured == StructuredOutput("json_object")  # none: the client's format alone


@pytest.mark.parametrize("merged", [False, True])
def test_forced_calls_cut_short_before_a_name_leave_no_markup_in_the_content(merged):
    """tool_choice required: the grammar writes calls only, so a call that max_tokens cuts
    before its name is dropped, not handed back as text (as it is where calls are optional),
    and one cut after its name is in the whole message as the stream carried it."""
    tools = ToolRequest((ToolSpec("get_weather"),), ToolChoice("required"))
    fmt, _, _ = finish(ChatRendering([], {}, FORMATS["hermes"]), "user: hi", tools, SamplingParams(), True, TOK,
                       OutputParsers())  # fmt: skip
    assert fmt.calls_only
    cut = f'<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{{"name": "get_weather", "argu'
    stream, last = run(cut, fmt, LENGTH, merged)
    assert stream["content"] == "" and [c["name"] for c in stream["calls"]] == ["get_weather"]
    assert last.message.content == "" and len(last.message.tool_calls) == 1
    cut_args = f'<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{{"name": "get_weather", "arguments": {{"ci'
    stream, last = run(cut_args, fmt, LENGTH, merged)
    assert [c["name"] for c in stream["calls"]] == ["get_weather", "get_weather"]
    assert stream["calls"][1]["arguments"] == '{"ci'
    assert last.finish_reason is LENGTH and last.message.content == ""
    assert [(c.id, c.name) for c in last.message.tool_calls] == [(c["id"], c["name"]) for c in stream["calls"]]
    assert json.loads(last.message.tool_calls[0].arguments) == {"city": "Paris"}
    assert last.message.tool_calls[1].arguments == '{"ci'  # as far as it was written
    auto, _, _ = finish(ChatRendering([], {}, FORMATS["hermes"]), "user: hi", ToolRequest((ToolSpec("get_weather"),)),
                        SamplingParams(), True, TOK, OutputParsers())  # fmt: skip
    stream, _ = run(cut, auto, LENGTH, merged)
    assert stream["content"].endswith('"argu')  # optional calls: the cut block is text, as before


@pytest.mark.parametrize("merged", [False, True])
def test_an_optional_call_cut_after_its_name_is_a_call_streamed_and_whole(merged):
    """tool_choice auto: once the stream has carried a call's name, max_tokens cutting its
    arguments leaves the whole answer as the stream carried it, not its markup as content."""
    auto, _, _ = finish(ChatRendering([], {}, FORMATS["hermes"]), "user: hi", ToolRequest((ToolSpec("get_weather"),)),
                        SamplingParams(), True, TOK, OutputParsers())  # fmt: skip
    text = f'Checking.<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{{"name": "get_weather", "arguments": {{"ci'
    stream, last = run(text, auto, LENGTH, merged)
    assert [c["name"] for c in stream["calls"]] == ["get_weather", "get_weather"]
    assert last.finish_reason is LENGTH
    assert last.message.content == stream["content"] == "Checking."
    assert [(c.id, c.name, c.arguments) for c in last.message.tool_calls][1:] == [
        (c["id"], c["name"], c["arguments"]) for c in stream["calls"]
    ][1:]
    assert last.message.tool_calls[1].arguments == '{"ci'
    assert json.loads(last.message.tool_calls[0].arguments) == {"city": "Paris"}
    # Ended by the model, not cut: a call whose text is no JSON stays text, as before.
    stream, last = run(text, auto, STOP, merged)
    assert len(last.message.tool_calls) == 1 and last.message.content.endswith('"ci')
