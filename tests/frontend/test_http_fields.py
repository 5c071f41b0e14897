"""Every request field of the HTTP APIs is served or refused, in plain values: the allow-list
against the real SDKs' own parameter lists, and the converters of the fields it serves."""

from __future__ import annotations

import asyncio
import inspect
import json
from pathlib import Path

import anthropic.resources.messages
import openai.resources.chat.completions
import openai.resources.completions
import openai.resources.responses
import pytest

from frontend_svc.service.http import allow_list, endpoint
from frontend_svc.service.http.anthropic_api import messages_request
from frontend_svc.service.http.errors import HttpError
from frontend_svc.service.http.openai_requests import chat_request, completion_request
from frontend_svc.service.planning import truncated
from frontend_svc.types import CallError
from tandem_common.sampling import SamplingParams

_TRANSPORT = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}  # the SDK's, not the API's

MESSAGES = [{"role": "user", "content": "hi"}]


def _sdk_fields(method) -> set[str]:
    return set(inspect.signature(method).parameters) - _TRANSPORT


@pytest.mark.parametrize(
    "method, table",
    [
        (openai.resources.chat.completions.Completions.create, allow_list.CHAT),
        (openai.resources.completions.Completions.create, allow_list.COMPLETIONS),
        (anthropic.resources.messages.Messages.create, allow_list.MESSAGES),
        (anthropic.resources.messages.Messages.count_tokens, allow_list.COUNT_TOKENS),
        (openai.resources.responses.Responses.create, allow_list.RESPONSES),
    ],
)
def test_every_sdk_parameter_has_a_line(method, table):
    """A parameter the SDK can send is never refused as unknown: it is served or refused with
    what to do (a new SDK release that adds one fails here until it gets its line)."""
    assert _sdk_fields(method) - set(table) == set()


def _refusal(convert, body) -> HttpError:
    with pytest.raises(HttpError) as e:
        convert(body)
    assert e.value.status == 400
    return e.value


def test_an_unknown_field_is_refused_by_name_with_the_likely_one():
    e = _refusal(chat_request, {"messages": MESSAGES, "max_token": 5})
    assert e.param == "max_token" and "did you mean 'max_tokens'" in str(e)
    e = _refusal(messages_request, {"messages": MESSAGES, "max_tokens": 5, "stop": ["x"]})
    assert e.param == "stop" and "not a field of this request" in str(e)


@pytest.mark.parametrize(
    "convert, field, value",
    [
        (chat_request, "use_beam_search", True),
        (chat_request, "store", True),
        (chat_request, "guided_decoding_backend", "xgrammar"),
        (chat_request, "functions", [{"name": "f"}]),
        (chat_request, "include_reasoning", False),
        (completion_request, "suffix", "end"),
        (completion_request, "logits_processors", ["x"]),
        (messages_request, "mcp_servers", [{"url": "x"}]),
    ],
)
def test_a_field_not_served_is_refused_with_what_to_do(convert, field, value):
    body = {"messages": MESSAGES, "prompt": "hi", "max_tokens": 5, field: value}
    body = {k: v for k, v in body.items() if k != ("prompt" if convert is not completion_request else "messages")}
    e = _refusal(convert, body)
    assert e.param == field and "is not served by this server: " in str(e)


def test_the_neutral_value_of_a_refused_field_and_null_are_accepted():
    neutral = {"use_beam_search": False, "store": False, "service_tier": "auto", "audio": None}
    chat_request({"messages": MESSAGES, **neutral})
    completion_request({"prompt": "hi", "suffix": "", "echo": True, "cache_salt": "tenant-a"})
    messages_request({"messages": MESSAGES, "max_tokens": 5, "service_tier": "auto", "metadata": {"user_id": "u"}})


@pytest.mark.parametrize(
    "body, kind, value",
    [
        ({"structured_outputs": {"json": {"type": "object"}}}, "json_schema", '{"type": "object"}'),
        ({"structured_outputs": {"json": '{"type": "object"}'}}, "json_schema", '{"type": "object"}'),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", ("a", "b")),
        ({"structured_outputs": {"grammar": 'start: "a"+'}}, "grammar", 'start: "a"+'),
        ({"structured_outputs": {"json_object": True}}, "json_object", ""),
        ({"guided_json": {"type": "object"}}, "json_schema", '{"type": "object"}'),
        ({"guided_regex": "[0-9]{3}"}, "regex", "[0-9]{3}"),
        ({"guided_choice": ["yes", "no"]}, "choice", ("yes", "no")),
        ({"guided_grammar": 'root ::= "a"+'}, "grammar", 'root ::= "a"+'),
    ],
)
def test_structured_fields_become_the_engines_constraint(body, kind, value):
    for request in (chat_request({"messages": MESSAGES, **body}), completion_request({"prompt": "hi", **body})):
        s = request.input.params.structured
        assert s is not None and s.kind == kind
        assert (s.choices if kind == "choice" else s.text) == value
        if kind == "grammar":
            assert s.grammar_syntax == ("gbnf" if "::=" in value else "lark")


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_json": 5}, "guided_json"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ],
)
def test_a_bad_or_second_constraint_is_refused_naming_its_field(extra, param):
    assert _refusal(completion_request, {"prompt": "hi", **extra}).param == param


def test_seed_outside_int64_is_refused():
    assert completion_request({"prompt": "hi", "seed": (1 << 63) - 1}).input.params.seed == (1 << 63) - 1
    for seed in (1 << 63, -(1 << 63) - 1):
        assert _refusal(completion_request, {"prompt": "hi", "seed": seed}).param == "seed"


def test_best_of_generates_more_choices_with_their_logprobs_and_keeps_n():
    assert completion_request({"prompt": "hi", "n": 2, "best_of": 2}).best_of_keep is None
    r = completion_request({"prompt": "hi", "n": 1, "best_of": 3})
    assert (r.input.n, r.best_of_keep, r.input.params.logprobs, r.logprobs) == (3, 1, 0, False)
    r = chat_request({"messages": MESSAGES, "n": 2, "best_of": 4, "logprobs": True, "top_logprobs": 2})
    assert (r.input.n, r.best_of_keep, r.input.params.logprobs, r.logprobs) == (4, 2, 2, True)
    assert _refusal(completion_request, {"prompt": "hi", "n": 2, "best_of": 1}).param == "best_of"
    e = _refusal(completion_request, {"prompt": "hi", "best_of": 2, "stream": True})
    assert e.param == "best_of" and "when streaming" in str(e)


def test_reasoning_effort_reaches_the_template_and_chat_template_kwargs_wins():
    chat = chat_request({"messages": MESSAGES, "reasoning_effort": "low"}).input.chat
    assert chat.template_kwargs == {"reasoning_effort": "low"}
    body = {"messages": MESSAGES, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}}
    assert chat_request(body).input.chat.template_kwargs == {"reasoning_effort": "high"}
    assert _refusal(chat_request, {"messages": MESSAGES, "reasoning_effort": "max"}).param == "reasoning_effort"


class _Info:
    max_model_len = 10


def test_truncate_prompt_tokens_keeps_the_last_tokens():
    prompt = list(range(8))
    params = SamplingParams(max_tokens=4)
    assert truncated(prompt, 3, params, True, _Info()) == [5, 6, 7]
    assert truncated(prompt, 8, params, True, _Info()) == prompt
    assert truncated(prompt, -1, params, True, _Info()) == [2, 3, 4, 5, 6, 7]  # room for max_tokens
    with pytest.raises(CallError, match="truncate_prompt_tokens"):
        truncated(prompt, 11, params, True, _Info())
    assert completion_request({"prompt": "hi", "truncate_prompt_tokens": 5}).input.truncate_prompt_tokens == 5
    e = _refusal(completion_request, {"prompt": "hi", "truncate_prompt_tokens": -2})
    assert e.param == "truncate_prompt_tokens"


def test_tokenize_renders_a_chat_body_without_the_generation_checks():
    body = {"messages": MESSAGES, "add_special_tokens": True, "return_token_strs": True}
    assert json.dumps(chat_request(body, check_fields=False).input.chat.messages) == json.dumps(MESSAGES)


def test_docs_name_every_field_of_the_allow_list():
    docs = (Path(__file__).parents[2] / "docs" / "http.md").read_text()
    section = docs.split("## Served or refused", 1)[1].split("\n## ", 1)[0]
    tables = (
        allow_list.CHAT,
        allow_list.COMPLETIONS,
        allow_list.MESSAGES,
        allow_list.COUNT_TOKENS,
        allow_list.RESPONSES,
    )
    assert {name for t in tables for name in t if f"`{name}`" not in section} == set()


async def test_pieces_a_stream_never_read_are_closed_whether_or_not_the_first_came():
    """The first piece is awaited before a stream's headers; a client gone before the body
    started would leave the pieces (the engine requests) running but for endpoint._close."""
    closed = []

    async def pieces(hang: bool):
        try:
            if hang:
                await asyncio.Event().wait()
            while True:
                yield "piece"
        finally:
            closed.append(hang)

    for hang in (False, True):
        gen = pieces(hang)
        first = await endpoint.first_piece(gen) if not hang else asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0)
        await endpoint._close(first, gen)
    assert closed == [False, True]
