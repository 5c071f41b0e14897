"""Forcing grammars against their own formats: what the grammar allows, the format's parser
reads back as the same calls, and what breaks a schema the grammar refuses (llguidance,
the engine's grammar library, on the demo model's tokenizer)."""

from __future__ import annotations

import json

import llguidance
import pytest

from frontend_svc.text.grammar_check import grammar_problem
from frontend_svc.text.tools import FORCEABLE, FORMATS, tools_grammar
from frontend_svc.text.tools.forcing import ForcingError, arguments_rule
from frontend_svc.text.tools.schema import close_objects
from frontend_svc.text.tools.spec import ToolChoice, ToolRequest, ToolSpec
from tandem_common.sampling import StructuredOutput

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = (ToolSpec("get_weather", parameters=json.dumps(CITY)), ToolSpec("get_time"))
REQUIRED = ToolRequest(TOOLS, ToolChoice("required"))


def written(fmt: str, calls: list[tuple[str, dict]]) -> str:
    """Calls as the model writes them in ``fmt``, compact JSON as the grammar allows."""
    key = "parameters" if fmt == "llama3_json" else "arguments"
    objs = [json.dumps({"name": n, key: a}, separators=(",", ":")) for n, a in calls]
    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
    if fmt == "mistral":
        return "[TOOL_CALLS][" + ",".join(objs) + "]"
    if fmt == "llama3_json":
        return ";".join(objs)
    return objs[0] if len(objs) == 1 else "[" + ",".join(objs) + "]"


@pytest.fixture(scope="module")
def llg_tokenizer(demo_model_dir):
    return llguidance.LLTokenizer((demo_model_dir / "tokenizer.json").read_text(), n_vocab=2048, eos_token=[1])


def accepts(tokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize("fmt", FORCEABLE)
def test_what_the_grammar_allows_the_parser_reads_back(llg_tokenizer, fmt):
    grammar = tools_grammar(FORMATS[fmt], REQUIRED, None, lambda _: None)
    for calls in ([("get_weather", {"city": "Oslo"})], [("get_time", {}), ("get_weather", {"city": "x"})]):
        text = written(fmt, calls)
        assert accepts(llg_tokenizer, grammar, text), text
        parsed = FORMATS[fmt].parse(text)
        assert parsed.content == ""
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls


@pytest.mark.parametrize("fmt", FORCEABLE)
def test_the_grammar_refuses_text_unknown_tools_and_bad_arguments(llg_tokenizer, fmt):
    grammar = tools_grammar(FORMATS[fmt], REQUIRED, None, lambda _: None)
    assert not accepts(llg_tokenizer, grammar, "Sure, let me check.")
    assert not accepts(llg_tokenizer, grammar, written(fmt, [("rm_rf", {})]))
    assert not accepts(llg_tokenizer, grammar, written(fmt, [("get_weather", {"city": 3})]))
    assert not accepts(llg_tokenizer, grammar, written(fmt, [("get_time", {"extra": 1})]))


def test_mistral_named_form_is_forced_as_its_templates_show_it(llg_tokenizer):
    grammar = tools_grammar(FORMATS["mistral"].for_template("[ARGS]"), REQUIRED, None, lambda _: None)
    text = '[TOOL_CALLS]get_weather[ARGS]{"city":"Oslo"}[TOOL_CALLS]get_time[ARGS]{}'
    assert accepts(llg_tokenizer, grammar, text)
    parsed = FORMATS["mistral"].parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert not accepts(llg_tokenizer, grammar, '[TOOL_CALLS]get_time[ARGS]{"x":1}')
    assert not accepts(llg_tokenizer, grammar, written("mistral", [("get_time", {})]))  # the array form


def test_named_and_single_calls_allow_exactly_one(llg_tokenizer):
    named = tools_grammar(
        FORMATS["hermes"], ToolRequest(TOOLS, ToolChoice("function", "get_time")), None, lambda _: None
    )
    assert accepts(llg_tokenizer, named, written("hermes", [("get_time", {})]))
    assert not accepts(llg_tokenizer, named, written("hermes", [("get_weather", {"city": "x"})]))
    assert not accepts(llg_tokenizer, named, written("hermes", [("get_time", {}), ("get_time", {})]))
    single = tools_grammar(FORMATS["json"], ToolRequest(TOOLS, ToolChoice("required"), False), None, lambda _: None)
    assert not accepts(llg_tokenizer, single, written("json", [("get_time", {}), ("get_time", {})]))


def test_auto_with_a_response_format_allows_calls_or_the_answer(llg_tokenizer):
    answer = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    grammar = tools_grammar(FORMATS["hermes"], ToolRequest(TOOLS), answer, lambda _: None)
    assert accepts(llg_tokenizer, grammar, '{"a":1}')
    assert accepts(llg_tokenizer, grammar, written("hermes", [("get_time", {})]))
    assert not accepts(llg_tokenizer, grammar, "free text")


def test_a_thought_comes_first_when_the_prompt_opened_it(llg_tokenizer):
    grammar = tools_grammar(FORMATS["hermes"], REQUIRED, None, lambda _: None, thought="open")
    call = written("hermes", [("get_time", {})])
    assert accepts(llg_tokenizer, grammar, "I need the time. <b>{x}</b></think>" + call)
    assert not accepts(llg_tokenizer, grammar, call)  # the thought must be closed first
    optional = tools_grammar(FORMATS["hermes"], REQUIRED, None, lambda _: None, thought="optional")
    assert accepts(llg_tokenizer, optional, call)
    assert accepts(llg_tokenizer, optional, "<think>hm</think>" + call)


def test_a_special_token_tag_is_written_as_the_token():
    grammar = tools_grammar(FORMATS["mistral"], REQUIRED, None, lambda t: 7 if t == "[TOOL_CALLS]" else None)
    assert 'calls: <[7]> "["' in grammar


def test_pythonic_and_grammar_answers_cannot_be_forced():
    with pytest.raises(ForcingError, match="pythonic"):
        tools_grammar(FORMATS["pythonic"], REQUIRED, None, lambda _: None)
    with pytest.raises(ForcingError, match="grammar constraint"):
        tools_grammar(FORMATS["hermes"], ToolRequest(TOOLS), StructuredOutput("grammar", "start: x"), lambda _: None)


# A pydantic model with a nested one, as model_json_schema() writes it: the nested model in
# $defs, referenced from the root; and a tree that refers to itself.
ADDRESS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PERSON = {
    "$defs": {"Address": ADDRESS},
    "type": "object",
    "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Address"}},
    "required": ["name", "home"],
}
TREE = {
    "definitions": {
        "Node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/definitions/Node"}},
            },
            "required": ["v"],
        }
    },
    "$ref": "#/definitions/Node",
}


@pytest.mark.parametrize("fmt", [*FORCEABLE, "mistral_named"])
def test_schemas_with_references_are_forced_where_their_refs_point(llg_tokenizer, fmt):
    tools = (ToolSpec("save_person", parameters=json.dumps(PERSON)), ToolSpec("save_tree", parameters=json.dumps(TREE)))
    form = FORMATS["mistral"].for_template("[ARGS]") if fmt == "mistral_named" else FORMATS[fmt]
    grammar = tools_grammar(form, ToolRequest(tools, ToolChoice("required")), None, lambda _: None)
    person = {"name": "Ada", "home": {"city": "London"}}
    tree = {"v": 1, "kids": [{"v": 2, "kids": [{"v": 3}]}]}
    if fmt == "mistral_named":
        ok = f"[TOOL_CALLS]save_person[ARGS]{json.dumps(person, separators=(',', ':'))}"
        bad = '[TOOL_CALLS]save_person[ARGS]{"name":"Ada","home":{"town":"x"}}'
    else:
        ok = written(fmt, [("save_person", person), ("save_tree", tree)])
        bad = written(fmt, [("save_person", {"name": "Ada", "home": {"city": 3}})])
    assert accepts(llg_tokenizer, grammar, ok)
    assert not accepts(llg_tokenizer, grammar, bad)


def test_forced_objects_take_only_the_keys_their_schema_lists(llg_tokenizer):
    tools = (
        ToolSpec("save_person", parameters=json.dumps(PERSON)),
        ToolSpec("tag", parameters=json.dumps({"type": "object", "properties": {"labels": {"type": "object"}}})),
        ToolSpec("note", parameters=json.dumps({**CITY, "additionalProperties": True})),
    )
    grammar = tools_grammar(FORMATS["json"], ToolRequest(tools, ToolChoice("required")), None, lambda _: None)
    extra_root = {"name": "Ada", "home": {"city": "x"}, "age": 3}
    extra_nested = {"name": "Ada", "home": {"city": "x", "zip": "1"}}
    assert not accepts(llg_tokenizer, grammar, written("json", [("save_person", extra_root)]))
    assert not accepts(llg_tokenizer, grammar, written("json", [("save_person", extra_nested)]))
    # What the schema leaves open stays open: a free-form object, additionalProperties true.
    assert accepts(llg_tokenizer, grammar, written("json", [("tag", {"labels": {"any": 1}})]))
    assert accepts(llg_tokenizer, grammar, written("json", [("note", {"city": "x", "mood": "ok"})]))


def test_closing_keeps_what_a_schema_states_and_what_it_requires():
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}}
    assert close_objects(nested) == {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {}}, "additionalProperties": False}},
        "additionalProperties": False,
    }
    stated = {"properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert close_objects(stated) == stated
    beside = {"properties": {"a": {}}, "required": ["a", "b"]}  # b must come beside the listed keys
    assert close_objects(beside) == beside
    composed = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert close_objects(composed) == composed
    assert grammar_problem(f"start: {arguments_rule(ToolSpec('f', parameters=json.dumps(beside)))}\n") is None
