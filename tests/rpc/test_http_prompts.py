"""Several prompts in one completions request: choices indexed prompt × n, streamed and whole,
each the same as its prompt sent alone."""

from __future__ import annotations

import openai
import pytest

from frontend_svc.service.http.prompts import MAX_PROMPTS
from tests.rpc.http_face import API_KEY, http_base, post
from tests.services import start_frontend

PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):"]
GREEDY = dict(temperature=0.0, max_tokens=8, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def served(engine_proc):
    frontend = start_frontend(engine_proc.address, extra=("--http-port", "0", "--api-key", API_KEY))
    try:
        yield http_base(frontend)
    finally:
        frontend.terminate()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_several_prompts_give_choices_indexed_prompt_times_n(client, model):
    alone = [client.completions.create(model=model, prompt=p, **GREEDY) for p in PROMPTS]
    both = client.completions.create(model=model, prompt=PROMPTS, n=2, **GREEDY)
    assert [c.index for c in both.choices] == list(range(2 * len(PROMPTS)))
    for k, one in enumerate(alone):
        assert both.choices[2 * k].text == both.choices[2 * k + 1].text == one.choices[0].text
    assert both.usage.prompt_tokens == sum(one.usage.prompt_tokens for one in alone)
    assert both.usage.completion_tokens == 2 * len(PROMPTS) * 8


def test_token_id_prompts_echo_each_its_own(client, model, served):
    ids = [post(served, "/tokenize", {"prompt": p, "add_special_tokens": False}).json()["tokens"] for p in PROMPTS]
    answer = client.completions.create(model=model, prompt=ids, echo=True, logprobs=1, **GREEDY)
    for k, choice in enumerate(answer.choices):
        assert choice.text.startswith(PROMPTS[k]) and choice.logprobs.token_logprobs[0] is None
        assert len(choice.logprobs.tokens) == len(ids[k]) + 8


def test_several_prompts_stream_as_the_whole_answer(client, model):
    whole = client.completions.create(model=model, prompt=PROMPTS, n=2, **GREEDY)
    chunks = list(
        client.completions.create(
            model=model, prompt=PROMPTS, n=2, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text and mine[-1].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize(
    "prompt",
    [["a", 1], [["x"]], [], ["a"] * (MAX_PROMPTS + 1)],
    ids=["mixed", "nested-text", "empty", "too-many"],
)
def test_bad_prompt_lists_are_refused_naming_prompt(served, model, prompt):
    response = post(served, "/v1/completions", {"model": model, "prompt": prompt})
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt", response.text


def test_best_of_keeps_the_likeliest_choices_of_each_prompt(client, model):
    """best_of over several prompts: each prompt's best_of choices are ranked among themselves,
    so every prompt keeps its own n answers (echo shows whose), and usage counts all generated."""
    sampled = dict(temperature=1.0, max_tokens=4, seed=7, extra_body={"ignore_eos": True})
    answer = client.completions.create(model=model, prompt=PROMPTS, n=1, best_of=3, echo=True, logprobs=0, **sampled)
    assert [c.index for c in answer.choices] == list(range(len(PROMPTS)))
    for k, choice in enumerate(answer.choices):
        assert choice.text.startswith(PROMPTS[k]), (k, choice.text)
    assert answer.usage.completion_tokens == 3 * len(PROMPTS) * 4
