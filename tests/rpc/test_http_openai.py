"""The OpenAI-compatible HTTP face end to end: the real ``openai`` client against a real pair on 127.0.0.1.

One engine and one frontend (--http-port 0, an API key) for the module; gRPC calls to the
same frontend give the reference for every comparison.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem_protos.tandem.generate.v1 import generate_pb2 as g
from tests.rpc.http_face import API_KEY, engine_busy, engine_idle, grpc_stream, http_base, post
from tests.services import start_frontend
from tests.structured_cases import SCHEMA

PROMPT = "The capital of France is"
GREEDY = dict(temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def served(engine_proc):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    extra = ("--http-port", "0", "--api-key", API_KEY, "--metrics-port", str(metrics_port))
    frontend = start_frontend(engine_proc.address, extra=extra)
    try:
        base = http_base(frontend)
        yield engine_proc, frontend, base, f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        frontend.terminate()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[2] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_engines_model(client, model):
    assert [m.id for m in client.models.list().data] == [model] and model


def test_completion_stream_is_byte_identical_to_the_grpc_stream(client, model, served):
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, stream=True, **GREEDY)
    http_text = "".join(c.choices[0].text for c in stream if c.choices)
    request = g.GenerateRequest(
        text=PROMPT, sampling_params=g.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )
    grpc_text = "".join(r.text for r in grpc_stream(served[1].address, request))
    assert http_text.encode() == grpc_text.encode() and http_text
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, **GREEDY)
    assert whole.choices[0].text == grpc_text and whole.choices[0].finish_reason == "length"


def test_chat_stream_is_byte_identical_to_grpc_and_the_first_chunk_has_the_role(client, model, served):
    messages = [{"role": "user", "content": "Tell me about Paris"}]
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=20, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    http_text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    request = g.GenerateRequest(
        messages=g.ChatMessages(messages=[g.ChatMessage(role="user", content="Tell me about Paris")]),
        sampling_params=g.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    )
    assert http_text.encode() == "".join(r.text for r in grpc_stream(served[1].address, request)).encode()
    assert chunks[-1].choices[0].finish_reason == "length"


def test_include_usage_ends_with_the_grpc_usage(client, model, served):
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=9,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    request = g.GenerateRequest(text=PROMPT, sampling_params=g.SamplingParams(max_tokens=9, temperature=0.0))
    usage = grpc_stream(served[1].address, request)[-1].usage
    u = chunks[-1].usage
    assert (
        (u.prompt_tokens, u.completion_tokens)
        == (usage.prompt_tokens, usage.completion_tokens)
        == (usage.prompt_tokens, 9)
    )
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_continuous_usage_counts_up_in_every_chunk(served, model):
    body = dict(model=model, prompt=PROMPT, max_tokens=6, ignore_eos=True, temperature=0.0, stream=True)
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    lines = [ln for ln in post(served[2], "/v1/completions", body).text.splitlines() if ln.startswith("data: {")]
    counts = [json.loads(ln[6:])["usage"]["completion_tokens"] for ln in lines]
    assert counts == sorted(counts) and counts[-1] == 6


def test_n_2_has_two_indexed_choices_and_seed_reproduces(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=12, n=2, seed=1234, temperature=1.0)
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[0].text != first.choices[1].text  # choice i samples with seed + i
    assert first.usage.completion_tokens == 24


def test_chat_n_2_streams_both_choices(client, model):
    chunks = list(
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=2, seed=5, stream=True
        )
    )
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
    assert all(texts.values()) and {c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason} == {
        "length"
    }


def test_stop_string_cuts_the_text(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=30, **GREEDY).choices[0].text
    stop = full[8:11]
    cut = client.completions.create(model=model, prompt=PROMPT, max_tokens=30, stop=[stop], **GREEDY).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"
    assert cut.model_extra["stop_reason"] == stop


def test_logprobs_in_both_shapes(client, model):
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY
    ).choices[0]
    content = chat.logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == chat.message.content
    assert all(t.bytes == list(t.token.encode()) and len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)

    text = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, logprobs=2, **GREEDY).choices[0]
    lp = text.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert lp.text_offset[0] == 0 and all(
        b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens)
    )
    assert all(len(top) <= 2 for top in lp.top_logprobs)


def test_response_format_json_schema_validates(client, model):
    valid = 0
    for i in range(3):
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Order {i}: list the items of shipment {i * 13}, please"}],
            max_tokens=80,
            temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}},
        ).choices[0]
        if answer.finish_reason == "stop":
            jsonschema.validate(json.loads(answer.message.content), SCHEMA)
            valid += 1
    assert valid >= 1
    obj = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "json"}],
        max_tokens=60,
        temperature=0.0,
        response_format={"type": "json_object"},
    ).choices[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.message.content), dict)


BAD_INPUTS = [
    ("/v1/completions", {"prompt": PROMPT, "top_p": 2.0}, 400, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "n": True}, 400, "n"),
    ("/v1/completions", {"prompt": PROMPT, "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": {"text": 1}}, 400, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "stop": [""]}, 400, "stop[0]"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0].type",
    ),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
        400,
        "response_format.type",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("/v1/completions", {"prompt": PROMPT, "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_INPUTS)
def test_bad_inputs_get_the_right_status_and_param(served, path, body, status, param):
    response = post(served[2], path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ") or status == 404, error
    assert set(error) == {"message", "type", "param", "code"}


def test_malformed_bodies_never_get_a_500(served):
    for body in (b"{not json", b"[1, 2]", b"\xff\xfe", b"null", b'"text"', b"[" * 100000):
        response = post(served[2], "/v1/chat/completions", body)
        assert response.status_code == 400 and "error" in response.json(), (body[:10], response.text)
    assert post(served[2], "/v1/nothing", {}).status_code == 404
    big = b'{"prompt": "' + b"a" * (17 << 20) + b'"}'
    assert post(served[2], "/v1/completions", big).status_code == 413


def test_the_api_key_is_required_except_for_health(served):
    base = served[2]
    assert httpx.get(base + "/health").status_code == 200
    for key in (None, "wrong"):
        response = post(base, "/v1/completions", {"prompt": PROMPT}, key=key)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    ok = httpx.get(base + "/v1/models", headers={"x-api-key": API_KEY})
    assert ok.status_code == 200


def test_tokenize_and_detokenize(served, model):
    ids = post(served[2], "/tokenize", {"model": model, "prompt": "Hello world", "add_special_tokens": False}).json()
    assert ids["count"] == len(ids["tokens"]) > 0
    assert post(served[2], "/detokenize", {"tokens": ids["tokens"]}).json()["prompt"] == "Hello world"
    assert post(served[2], "/detokenize", {"tokens": [1, 10**7]}).json()["error"]["param"] == "tokens"


def test_a_disconnected_stream_aborts_its_engine_request(served, model):
    engine = served[0]
    body = dict(model=model, prompt=PROMPT, max_tokens=1500, ignore_eos=True, stream=True)
    with httpx.stream(
        "POST", served[2] + "/v1/completions", json=body, headers={"authorization": f"Bearer {API_KEY}"}
    ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine_busy(engine.address)
    assert engine_idle(engine.address, timeout=5)


def test_a_disconnected_plain_request_aborts_its_engine_request(served, model):
    engine = served[0]
    body = dict(model=model, prompt=PROMPT, max_tokens=1900, ignore_eos=True)
    error: list[BaseException] = []

    def call():  # gives up after 1 s: a client that goes away while its answer is made
        try:
            post(served[2], "/v1/completions", body, timeout=1.0)
        except httpx.TimeoutException as e:
            error.append(e)

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 2.5
    while not engine_busy(engine.address) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_busy(engine.address)
    thread.join(10)
    assert error and engine_idle(engine.address, timeout=5)


def test_http_requests_are_counted_by_route_and_status(served, model):
    post(served[2], "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    post(served[2], "/v1/completions", {"prompt": PROMPT, "top_p": 9.0})
    post(served[2], "/v1/completions", {"prompt": PROMPT}, key=None)
    samples = {
        (s.labels.get("route"), s.labels.get("status")): s.value
        for family in text_string_to_metric_families(httpx.get(served[3], timeout=10).text)
        for s in family.samples
        if s.name == "tandem_frontend_http_requests_total"
    }
    assert all(samples.get(("/v1/completions", status), 0) >= 1 for status in ("200", "400", "401")), samples


def test_streams_cut_at_once_leave_no_call_in_flight(served, model):
    body = dict(model=model, prompt=PROMPT, max_tokens=1500, ignore_eos=True, stream=True)
    headers = {"authorization": f"Bearer {API_KEY}"}
    for _ in range(10):
        with httpx.stream("POST", served[2] + "/v1/completions", json=body, headers=headers, timeout=60):
            pass  # gone before reading a byte of the body
    deadline = time.monotonic() + 10
    while True:
        in_flight = [
            s.value
            for family in text_string_to_metric_families(httpx.get(served[3], timeout=10).text)
            for s in family.samples
            if s.name == "tandem_frontend_requests_in_flight"
        ]
        if in_flight == [0.0] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert in_flight == [0.0] and engine_idle(served[0].address, timeout=5)


def test_echo_puts_the_prompt_before_the_output(client, model):
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, **GREEDY).choices[0].text
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, echo=True, **GREEDY).choices[0].text
    assert echoed == PROMPT + plain
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, echo=True, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == PROMPT + plain
