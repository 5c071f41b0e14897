"""Anthropic Messages on the HTTP face: the real ``anthropic`` client against a real pair on 127.0.0.1."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.rpc.http_face import API_KEY, grpc_stream, http_base, post
from tests.services import start_frontend

MESSAGES = [{"role": "user", "content": "Tell me about Paris"}]
GREEDY = {"temperature": 0.0}  # this SDK release takes sampling fields only through extra_body


@pytest.fixture(scope="module")
def served(engine_proc):
    frontend = start_frontend(engine_proc.address, extra=("--http-port", "0", "--api-key", API_KEY))
    try:
        yield engine_proc, frontend, http_base(frontend)
    finally:
        frontend.terminate()


@pytest.fixture(scope="module")
def client(served) -> anthropic.Anthropic:
    # The SDK sends the key as x-api-key.
    return anthropic.Anthropic(base_url=served[2], api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(served) -> str:
    return httpx.get(served[2] + "/v1/models", headers={"x-api-key": API_KEY}).json()["data"][0]["id"]


def _grpc_text(served, max_tokens: int, **params) -> list[g.GenerateResponse]:
    request = g.GenerateRequest(
        messages=g.ChatMessages(messages=[g.ChatMessage(**m) for m in MESSAGES]),
        sampling_params=g.SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
    )
    return grpc_stream(served[1].address, request)


def test_a_message_matches_the_grpc_chat(client, model, served):
    message = client.messages.create(model=model, max_tokens=12, messages=MESSAGES, extra_body=GREEDY)
    responses = _grpc_text(served, 12)
    assert message.content[0].type == "text" and message.content[0].text == "".join(r.text for r in responses)
    assert message.role == "assistant" and message.model == model
    usage, mine = responses[-1].usage, message.usage
    prompt_tokens = mine.input_tokens + mine.cache_read_input_tokens + mine.cache_creation_input_tokens
    assert (prompt_tokens, mine.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    expected = "max_tokens" if responses[-1].finish_reason == g.FINISH_REASON_LENGTH else "end_turn"
    assert message.stop_reason == expected


def test_a_streamed_message_gives_the_same_text_and_events(client, model, served):
    with client.messages.stream(model=model, max_tokens=12, messages=MESSAGES, extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert final.content[0].text == "".join(r.text for r in _grpc_text(served, 12))


def test_stop_sequences_and_system(client, model):
    full = client.messages.create(model=model, max_tokens=30, messages=MESSAGES, extra_body=GREEDY, system="Be brief.")
    text = full.content[0].text
    stop = text[6:9]
    cut = client.messages.create(
        model=model, max_tokens=30, messages=MESSAGES, extra_body=GREEDY, system="Be brief.", stop_sequences=[stop]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_count_tokens_is_the_prompt_of_the_message(client, model):
    counted = client.messages.count_tokens(model=model, messages=MESSAGES)
    message = client.messages.create(model=model, max_tokens=1, messages=MESSAGES)
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens > 0


def test_usage_counts_the_prompt_served_from_the_prefix_cache(client, model):
    """Anthropic's usage splits the prompt: input_tokens computed, cache_read_input_tokens
    from the cache (Tandem's prefix cache), cache_creation_input_tokens written on request."""
    messages = [{"role": "user", "content": "Describe the river that runs past the old mill, " * 8}]
    counted = client.messages.count_tokens(model=model, messages=messages).input_tokens
    client.messages.create(model=model, max_tokens=2, messages=messages, extra_body=GREEDY)  # fills the cache
    again = client.messages.create(model=model, max_tokens=2, messages=messages, extra_body=GREEDY).usage
    assert again.cache_read_input_tokens > 0 and again.cache_creation_input_tokens == 0
    assert again.input_tokens + again.cache_read_input_tokens == counted
    with client.messages.stream(model=model, max_tokens=2, messages=messages, extra_body=GREEDY) as stream:
        deltas = [e.usage for e in stream if e.type == "message_delta"]
        final = stream.get_final_message().usage
    assert deltas[-1].cache_read_input_tokens == final.cache_read_input_tokens == again.cache_read_input_tokens
    assert final.input_tokens == again.input_tokens


def test_errors_come_in_anthropics_shape(client, model, served):
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model=model, max_tokens=5, messages=MESSAGES, extra_body={"top_p": 3.0})
    body = error.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("top_p: ")
    missing = post(served[2], "/v1/messages", {"model": model, "messages": MESSAGES}).json()
    assert missing["error"]["message"].startswith("max_tokens: ")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-0", max_tokens=5, messages=MESSAGES)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=served[2], api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=5, messages=MESSAGES
        )
