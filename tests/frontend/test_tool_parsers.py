"""Tool-call parsers: for every golden output of every format, the incremental parse, fed
in any cut, adds up to the complete parse; and the complete parse finds what the output holds."""

from __future__ import annotations

import json
import time

import pytest

from frontend_svc.text.reasoning import ReasoningParser, prompt_opens_thought, split_reasoning
from frontend_svc.text.tools import FORMATS, ParsedMessage, ToolCall, format_named, parser_for_template

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
NESTED = '{"name": "book", "arguments": {"trip": {"legs": [{"from": "A", "to": "B"}], "note": "a \\"quoted\\" }"}}}'
NOARGS = '{"name": "get_time", "arguments": {}}'
CLOSING_IN_STRING = '{"name": "echo", "arguments": {"text": "</tool_call> and [TOOL_CALLS] and } ]"}}'
ESCAPES = '{"name": "say", "arguments": {"text": "line\\nnext \\u00e9 \\\\ end"}}'
ARGS_FIRST = '{"arguments": {"q": 1}, "name": "search"}'
STRING_ARGS = '{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}'
NO_ARGUMENTS_KEY = '{"name": "ping"}'


def call(text: str) -> ToolCall:
    value = json.loads(text)
    args = value.get("arguments", value.get("parameters", {}))
    return ToolCall(value["name"], args if isinstance(args, str) else json.dumps(args))


# (format, output, expected content, expected calls)
GOLDEN: list[tuple[str, str, str, list[ToolCall]]] = [
    ("hermes", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("hermes", "Plain answer ending in a newline\n", "Plain answer ending in a newline\n", []),
    ("hermes", f"<tool_call>\n{W}\n</tool_call>", "", [call(W)]),
    ("hermes", f"Let me check.\n<tool_call>\n{W}\n</tool_call>\n", "Let me check.\n", [call(W)]),
    ("hermes", f"<tool_call>\n{W}\n</tool_call>\n<tool_call>\n{NOARGS}\n</tool_call>", "", [call(W), call(NOARGS)]),
    ("hermes", f"<tool_call>{NESTED}</tool_call> Done.", " Done.", [call(NESTED)]),
    ("hermes", f"<tool_call>{CLOSING_IN_STRING}</tool_call>", "", [call(CLOSING_IN_STRING)]),
    ("hermes", f"<tool_call>{ESCAPES}</tool_call>", "", [call(ESCAPES)]),
    ("hermes", f"<tool_call>{ARGS_FIRST}</tool_call>", "", [call(ARGS_FIRST)]),
    ("hermes", f"<tool_call>{STRING_ARGS}</tool_call>", "", [call(STRING_ARGS)]),
    ("hermes", f"<tool_call>{NO_ARGUMENTS_KEY}</tool_call>", "", [call(NO_ARGUMENTS_KEY)]),
    ("hermes", f"<tool_call>[{W}, {NOARGS}]</tool_call>", "", [call(W), call(NOARGS)]),
    ("hermes", "a <tool_call> is how I call tools", "a <tool_call> is how I call tools", []),
    ("hermes", 'Use <tool_call>{"x": 1}</tool_call> tags', 'Use <tool_call>{"x": 1}</tool_call> tags', []),
    ("hermes", f"<tool_call>{W}", "", [call(W)]),  # the closing tag forgotten
    ("hermes", "x < y <tool", "x < y <tool", []),
    ("llama3_json", "Paris is the capital.", "Paris is the capital.", []),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [ToolCall("get_weather", '{"city": "Paris"}')],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1, 2]}}',
        "",
        [ToolCall("a", "{}"), ToolCall("b", '{"x": [1, 2]}')],
    ),
    (
        "llama3_json",
        '  {"name": "a", "parameters": {"s": "}{"}}\nThat is all.',
        "\nThat is all.",
        [ToolCall("a", '{"s": "}{"}')],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "{ not json", "{ not json", []),
    ("mistral", "Sure, here it is.", "Sure, here it is.", []),
    ("mistral", f"[TOOL_CALLS][{W}]", "", [call(W)]),
    ("mistral", f"[TOOL_CALLS] [{W}, {NESTED}, {NOARGS}]", "", [call(W), call(NESTED), call(NOARGS)]),
    ("mistral", f"Checking. [TOOL_CALLS][{CLOSING_IN_STRING}]", "Checking. ", [call(CLOSING_IN_STRING)]),
    # the newer form (tokenizer v11 on): one tag per call, the name and [ARGS] apart
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}',
        "",
        [ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')],
    ),
    (
        "mistral",
        'Two calls.[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]echo[ARGS]{"text": "[TOOL_CALLS]x[ARGS]{ } \\" end"}',
        "Two calls.",
        [ToolCall("get_time", "{}"), ToolCall("echo", '{"text": "[TOOL_CALLS]x[ARGS]{ } \\" end"}')],
    ),
    (
        "mistral",
        '[TOOL_CALLS]book[ARGS] {"trip": {"legs": [{"to": "B"}]}}\nBooked.',
        "\nBooked.",
        [ToolCall("book", '{"trip": {"legs": [{"to": "B"}]}}')],
    ),
    (
        "mistral",
        "The [TOOL_CALLS] tag and [ARGS] are words here.",
        "The [TOOL_CALLS] tag and [ARGS] are words here.",
        [],
    ),
    ("mistral", "[TOOL_CALLS]name[ARGS] not an object", "[TOOL_CALLS]name[ARGS] not an object", []),
    ("pythonic", "No tools needed.", "No tools needed.", []),
    (
        "pythonic",
        '[get_weather(city="Paris", unit="celsius")]',
        "",
        [ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')],
    ),
    (
        "pythonic",
        '<|python_start|>[a(), b(x=[1, 2], s="it\'s ] fine", n=None)]<|python_end|>',
        "",
        [ToolCall("a", "{}"), ToolCall("b", '{"x": [1, 2], "s": "it\'s ] fine", "n": null}')],
    ),
    ("pythonic", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    ("json", "Hello there!", "Hello there!", []),
    ("json", W, "", [call(W)]),
    ("json", f"[{W}, {NOARGS}]", "", [call(W), call(NOARGS)]),
    ("json", f"\n{NESTED}\n", "", [call(NESTED)]),
    ("json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("json", f"[{ESCAPES}] trailing words", " trailing words", [call(ESCAPES)]),
]


def run_incremental(fmt: str, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    """Feed the pieces, then add the deltas up: content, and per call its name and arguments."""
    parser = FORMATS[fmt].new_parser()
    content = ""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for delta in [*(parser.feed(p) for p in pieces), parser.finish()]:
        content += delta.content
        for d in delta.tool_calls:
            if d.name is not None:
                assert d.index not in names, "a call's name comes once"
                assert d.index == len(names), "calls are numbered in order"
                names[d.index] = d.name
            assert d.index in names, "a call's name comes before its arguments"
            args[d.index] = args.get(d.index, "") + d.arguments
    return content, [ToolCall(names[i], args[i]) for i in sorted(names)]


def same_calls(got: list[ToolCall], want: list[ToolCall]) -> bool:
    return [(c.name, json.loads(c.arguments)) for c in got] == [(c.name, json.loads(c.arguments)) for c in want]


def chunked(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("fmt,text,content,calls", GOLDEN, ids=[f"{g[0]}-{i}" for i, g in enumerate(GOLDEN)])
def test_complete_parse_finds_what_the_output_holds(fmt, text, content, calls):
    message = FORMATS[fmt].parse(text)
    assert message.content == content
    assert same_calls(list(message.tool_calls), calls)


@pytest.mark.parametrize("fmt,text,content,calls", GOLDEN, ids=[f"{g[0]}-{i}" for i, g in enumerate(GOLDEN)])
def test_incremental_parse_adds_up_to_the_complete_parse_in_any_cut(fmt, text, content, calls):
    complete = FORMATS[fmt].parse(text)
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts += [chunked(text, size) for size in (1, 2, 3, 5, 8)] + [[text]]
    for pieces in cuts:
        got_content, got_calls = run_incremental(fmt, pieces)
        assert got_content == complete.content, pieces
        assert same_calls(got_calls, list(complete.tool_calls)), pieces


def test_arguments_stream_before_the_call_closes():
    parser = FORMATS["hermes"].new_parser()
    first = parser.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa')
    assert [(d.index, d.name, d.arguments) for d in first.tool_calls] == [(0, "get_weather", '{"city": "Pa')]
    second = parser.feed('ris"}}</tool_call>')
    assert [(d.name, d.arguments) for d in second.tool_calls] == [(None, 'ris"}')]
    assert not parser.finish()


def test_a_parameterless_call_streams_its_empty_object():
    content, calls = run_incremental("hermes", chunked(f"<tool_call>{NOARGS}</tool_call>", 1))
    assert calls == [ToolCall("get_time", "{}")]
    content, calls = run_incremental("hermes", chunked(f"<tool_call>{NO_ARGUMENTS_KEY}</tool_call>", 1))
    assert calls == [ToolCall("ping", "{}")]


def test_formats_are_picked_from_the_chat_template_or_by_name():
    assert parser_for_template("{% for tool in tools %}<tool_call>{% endfor %}").name == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert parser_for_template("<|python_tag|>").name == "llama3_json"
    assert parser_for_template("<|im_start|>{{ message.content }}").name == "json"
    assert parser_for_template(None).name == "json"
    assert format_named("pythonic").name == "pythonic"
    with pytest.raises(ValueError, match="known: hermes, llama3_json, mistral, pythonic, json"):
        format_named("xml")


REASONING = [
    # (output, template opened the thought, reasoning, content)
    ("<think>Paris is in France.</think>The answer is Paris.", False, "Paris is in France.", "The answer is Paris."),
    ("Paris is in France.</think>\n\nParis.", True, "Paris is in France.", "\n\nParis."),
    ("Still thinking about it", True, "Still thinking about it", ""),  # cut short: stays reasoning
    ("<think>half a thought", False, "half a thought", ""),
    ("No thought here, <think> is just text.", False, "", "No thought here, <think> is just text."),
    ("  <think></think>Direct answer.", False, "", "Direct answer."),
]


@pytest.mark.parametrize("text,opened,reasoning,content", REASONING)
def test_reasoning_is_split_the_same_in_any_cut(text, opened, reasoning, content):
    whole = split_reasoning(text, opened)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [chunked(text, s) for s in (1, 2, 3, 5, 8)]:
        parser = ReasoningParser(opened)
        got_r, got_c = "", ""
        for delta in [*(parser.feed(p) for p in pieces), parser.finish()]:
            got_r += delta.reasoning
            got_c += delta.content
        assert (got_r, got_c) == (reasoning, content), pieces


def test_whether_the_prompt_opened_a_thought_comes_from_the_rendered_prompt():
    assert prompt_opens_thought("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thought("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thought("<|im_start|>assistant\n")


def test_parser_cost_per_token_is_small():
    """Not a timed assertion: the cost is printed (the target is well under 20 us a token)."""
    text = "Sure. " + " ".join(f"<tool_call>{W}</tool_call>" for _ in range(20))
    pieces = chunked(text, 4)  # about a token's worth of characters
    start = time.perf_counter()
    for _ in range(5):
        run_incremental("hermes", pieces)
    per_token = (time.perf_counter() - start) / (5 * len(pieces))
    print(f"hermes parser: {per_token * 1e6:.2f} us per 4-character delta")
    assert isinstance(ParsedMessage("x"), ParsedMessage)


@pytest.mark.parametrize("name", ["hermes", "json", "llama3_json", "mistral"])
def test_output_nested_too_deep_for_python_is_text_not_a_crash(name):
    deep = '{"name": "f", "arguments": ' + "[" * 3000 + "]" * 3000 + "}"
    output = {"hermes": f"<tool_call>{deep}</tool_call>", "mistral": f"[TOOL_CALLS][{deep}]"}.get(name, deep)
    parsed = format_named(name).parse(output)
    assert not parsed.tool_calls and parsed.content


# (format, output, calls streamed, message content (None: the output), calls in the message):
# the stream carries every named call; the message only those whole and valid JSON, the
# rest of their block as text.
UNFINISHED = [
    (
        "hermes",
        'Sure.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": {"b"',
        ["f", "g"],
        'Sure.\n\n<tool_call>{"name": "g", "arguments": {"b"',
        ["f"],
    ),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call>', ["f"], None, []),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "g", "arguments": {', ["f", "g"], None, []),
    ("mistral", '[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]g[ARGS]{"b"', ["f", "g"], '[TOOL_CALLS]g[ARGS]{"b"', ["f"]),
    (
        "llama3_json",
        '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"b"',
        ["f", "g"],
        ' {"name": "g", "parameters": {"b"',
        ["f"],
    ),
    ("llama3_json", '{"name": "f", "parameters": {"a": True}}', ["f"], None, []),
    (
        "json",
        '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b"',
        ["f", "g"],
        ' {"name": "g", "arguments": {"b"',
        ["f"],
    ),
]


@pytest.mark.parametrize("fmt,text,streamed,content,names", UNFINISHED)
def test_a_call_cut_short_or_not_json_streams_as_a_call_and_is_text_in_the_message(fmt, text, streamed, content, names):
    for pieces in ([text], chunked(text, 1), chunked(text, 3)):
        assert [c.name for c in run_incremental(fmt, pieces)[1]] == streamed
    message = FORMATS[fmt].parse(text)
    assert message.content == (text if content is None else content)
    assert [c.name for c in message.tool_calls] == names
