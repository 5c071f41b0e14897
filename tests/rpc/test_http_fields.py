"""Request fields on the HTTP face end to end: served or refused, never ignored. The real
``openai`` and ``anthropic`` clients (vLLM's extras through extra_body) and raw httpx
against a real pair on 127.0.0.1."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from tests.rpc.http_face import API_KEY, http_base, post
from tests.services import start_frontend
from tests.structured_cases import ARITHMETIC, CHOICES, REGEX, SCHEMA, VALID

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Tell me about Paris"}]
# Greedy, and without EOS: the constraint alone decides where the answer ends
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def served(engine_proc):
    frontend = start_frontend(engine_proc.address, extra=("--http-port", "0", "--api-key", API_KEY))
    try:
        yield engine_proc, frontend, http_base(frontend)
    finally:
        frontend.terminate()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[2] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_an_unknown_field_is_a_400_naming_it_in_openais_shape(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, extra_body={"max_token": 3})
    assert e.value.body["param"] == "max_token" and "did you mean 'max_tokens'" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=3, extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "use_beam_search" and "is not served by this server" in e.value.body["message"]


def test_a_field_not_served_is_a_400_in_anthropics_shape(served, model):
    client = anthropic.Anthropic(base_url=served[2], api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=3, messages=MESSAGES, extra_body={"mcp_servers": [{"u": 1}]})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("mcp_servers: is not served by this server")
    r = post(served[2], "/v1/messages/count_tokens", {"model": model, "messages": MESSAGES, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("stream: is not a field")


def test_a_streamed_request_is_refused_before_its_stream(served, model):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 3, "stream": True, "guided_decoding_backend": "x"}
    r = post(served[2], "/v1/completions", body)
    assert r.status_code == 400 and r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["param"] == "guided_decoding_backend"


def test_best_of_answers_the_likeliest_of_its_choices(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=77, extra_body={"ignore_eos": True})
    every = client.completions.create(n=4, logprobs=0, **kw)  # choice i samples with seed + i, as under best_of
    sums = [sum(c.logprobs.token_logprobs) for c in every.choices]
    best = client.completions.create(n=2, best_of=4, **kw)
    ranked = sorted(range(4), key=lambda i: -sums[i])[:2]
    assert [c.text for c in best.choices] == [every.choices[i].text for i in ranked]
    assert [c.index for c in best.choices] == [0, 1] and all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == every.usage.completion_tokens == 24  # all four generated


@pytest.mark.parametrize(
    "fields, kind",
    [
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema"),
        ({"structured_outputs": {"regex": REGEX}}, "regex"),
        ({"structured_outputs": {"choice": list(CHOICES)}}, "choice"),
        ({"structured_outputs": {"grammar": ARITHMETIC}}, "grammar"),
        ({"guided_json": SCHEMA}, "json_schema"),
        ({"guided_regex": REGEX}, "regex"),
        ({"guided_choice": list(CHOICES)}, "choice"),
        ({"guided_grammar": ARITHMETIC}, "grammar"),
    ],
)
def test_each_structured_field_constrains_the_output(client, model, fields, kind):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=120, extra_body=fields, **GREEDY)
    assert VALID[kind](whole.choices[0].text), whole.choices[0].text
    assert whole.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=120, stream=True, extra_body=fields, **GREEDY
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert VALID[kind](text), text


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "start: (("}, "guided_grammar"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_regex_or_grammar_is_a_400_before_any_stream(served, model, fields, param, stream):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 5, "stream": stream, **fields}
    r = post(served[2], "/v1/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(error["param"] + ": ")


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, model):
    long_prompt = PROMPT * 8
    full = client.completions.create(model=model, prompt=long_prompt, max_tokens=1)
    cut = client.completions.create(
        model=model, prompt=long_prompt, max_tokens=1, extra_body={"truncate_prompt_tokens": 5}
    )
    assert full.usage.prompt_tokens > 5 and cut.usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=1, extra_body={"truncate_prompt_tokens": 10**6}
        )
    assert e.value.body["param"] == "truncate_prompt_tokens"


def test_seed_outside_int64_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1, seed=1 << 63)
    assert e.value.body["param"] == "seed"


def test_the_request_id_is_echoed_and_logged(served, model):
    base, headers = served[2], {"authorization": f"Bearer {API_KEY}", "x-request-id": "client-id-7"}
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2}
    r = httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-id-7"
    with httpx.stream("POST", base + "/v1/completions", json=body | {"stream": True}, headers=headers) as s:
        assert s.status_code == 200 and s.headers["x-request-id"] == "client-id-7"
        assert [ln for ln in s.iter_lines() if ln][-1] == "data: [DONE]"
    r = httpx.post(base + "/v1/completions", json=body | {"n": "x"}, headers=headers, timeout=60)
    assert r.status_code == 400 and r.headers["x-request-id"] == "client-id-7"
    assert post(base, "/v1/completions", body).headers["x-request-id"]  # one is made when none is sent
    deadline = time.monotonic() + 10
    while served[1].log().count("Generate client-id-7 OK") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served[1].log().count("Generate client-id-7 OK") == 2


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("request_id", ["caf\u00e9-\u2603", "x" * 257, "tab\there"])
def test_a_body_request_id_a_header_cannot_carry_is_a_400(served, model, request_id, stream):
    """The body's request_id is echoed in X-Request-Id: one a header cannot carry is refused,
    never a 500 after the answer was generated, and the frontend serves on."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, "request_id": request_id, "stream": stream}
    r = post(served[2], "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
    assert post(served[2], "/v1/completions", body | {"request_id": "fine-1"}).status_code == 200


def test_echo_with_truncate_prompt_tokens_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, extra_body={"truncate_prompt_tokens": 2}
        )
    assert e.value.body["param"] == "truncate_prompt_tokens"
