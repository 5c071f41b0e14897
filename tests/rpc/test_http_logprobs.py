"""Prompt logprobs over HTTP: completions echo + logprobs (an evaluation harness's
loglikelihood), vLLM's prompt_logprobs in both shapes, and the logprobs wire details.

One engine with a small step budget (so a prompt is prefilled in several chunks) and one
frontend; ``transformers`` on the same float32 weights is the reference.
"""

from __future__ import annotations

import openai
import pytest
import torch
import transformers

from tests.rpc.http_face import API_KEY, http_base, post
from tests.services import running_pair

# Past one step's budget: the prompt's logprobs come from several prefill chunks.
BUDGET = 24
CONTEXT = "Question: which way does the river run? Answer:" * 3
CONTINUATION = " down to the sea, past the old mill and the bridge"
TOL = 1e-4


@pytest.fixture(scope="module")
def served(demo_model_dir):
    engine_args = ("--max-num-batched-tokens", str(BUDGET), "--num-kv-blocks", "256", "--dtype", "float32")
    frontend_args = ("--http-port", "0", "--api-key", API_KEY)
    with running_pair(demo_model_dir, *engine_args, frontend_args=frontend_args) as (_, frontend):
        yield http_base(frontend)


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def reference(demo_model_dir):
    """Log-probabilities of each token given the ones before it, by ``transformers``."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> list[float]:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()  # [len, vocab]
        lps = torch.log_softmax(logits[:-1], dim=-1)
        return lps.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()

    return logprobs


def tokenize(base: str, text: str, add_special_tokens: bool = False) -> list[int]:
    body = {"prompt": text, "add_special_tokens": add_special_tokens}
    return post(base, "/tokenize", body).json()["tokens"]


def test_loglikelihood_through_echo_and_logprobs_is_transformers(client, model, served, reference):
    """As lm-evaluation-harness's local-completions asks: the context and continuation as
    token ids, echo, logprobs 1, max_tokens 1; the continuation's score is the sum of its
    token_logprobs, which must be the model's own."""
    context, continuation = tokenize(served, CONTEXT), tokenize(served, CONTINUATION)
    ids = context + continuation
    assert len(ids) > 2 * BUDGET
    for _ in range(2):  # the second time the prompt's blocks are cached: its logprobs are not served from there
        c = client.completions.create(model=model, prompt=[ids], echo=True, logprobs=1, max_tokens=1, temperature=0)
        lp = c.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        want = reference(ids)
        got = lp.token_logprobs[1 : len(ids)]
        assert max(abs(a - b) for a, b in zip(got, want)) < TOL
        score = sum(lp.token_logprobs[len(context) : len(ids)])
        assert abs(score - sum(want[len(context) - 1 :])) < TOL * len(continuation)
        # Each prompt position's top entry names its token; the best alternative heads the rest.
        assert all(tok in top for tok, top in zip(lp.tokens[1 : len(ids)], lp.top_logprobs[1 : len(ids)]))
        assert c.choices[0].text.startswith(CONTEXT + CONTINUATION)


def test_echoed_text_offsets_point_into_the_text(client, model, served):
    prompt = CONTEXT + CONTINUATION
    c = client.completions.create(model=model, prompt=prompt, echo=True, logprobs=2, max_tokens=4, temperature=0)
    choice = c.choices[0]
    lp = choice.logprobs
    num_prompt = len(tokenize(served, prompt, add_special_tokens=True))  # the BOS too, which the text lacks
    assert len(lp.tokens) == num_prompt + 4 and lp.text_offset[:2] == [0, 0]
    assert lp.tokens[0] == "<|begin_of_text|>" and lp.token_logprobs[0] is None
    assert lp.text_offset[num_prompt] == len(prompt)  # the output starts where the prompt ends
    for token, offset in zip(lp.tokens[1:], lp.text_offset[1:]):
        assert choice.text[offset : offset + len(token)] == token  # a byte-level BPE of ASCII text
    assert all(len(top) <= 3 for top in lp.top_logprobs[1:])  # the token and its 2 best alternatives


def test_echo_with_max_tokens_0_answers_the_prompt_alone(client, model, served, reference):
    ids = tokenize(served, CONTEXT)
    c = client.completions.create(model=model, prompt=[ids], echo=True, logprobs=0, max_tokens=0)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(ids) and c.usage.completion_tokens == 0
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], reference(ids))) < TOL
    assert c.choices[0].text == post(served, "/detokenize", {"tokens": ids}).json()["prompt"]
    plain = post(served, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 0})
    assert plain.status_code == 400 and "max_tokens" in plain.json()["error"]["message"]


def test_echo_logprobs_stream_as_the_whole_answer(client, model):
    kw = dict(model=model, prompt=CONTEXT, echo=True, logprobs=1, max_tokens=5, temperature=0, n=2)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        tokens = [t for c in mine for t in c.logprobs.tokens]
        logprobs = [x for c in mine for x in c.logprobs.token_logprobs]
        offsets = [x for c in mine for x in c.logprobs.text_offset]
        assert tokens == choice.logprobs.tokens and offsets == choice.logprobs.text_offset
        assert logprobs == choice.logprobs.token_logprobs and logprobs[0] is None


def test_logprobs_0_names_the_sampled_token(client, model):
    c = client.completions.create(model=model, prompt="The river", logprobs=0, max_tokens=4, temperature=0)
    lp = c.choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert [top[t] for t, top in zip(lp.tokens, lp.top_logprobs)] == lp.token_logprobs


def test_completions_prompt_logprobs_are_vllms_shape(client, model, served, reference):
    ids = tokenize(served, "The river runs down")
    c = client.completions.create(model=model, prompt=[ids], max_tokens=1, extra_body={"prompt_logprobs": 2})
    entries = c.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    for pos, (entry, want) in enumerate(zip(entries[1:], reference(ids)), 1):
        mine = entry[str(ids[pos])]
        assert abs(mine["logprob"] - want) < TOL and mine["rank"] >= 1 and isinstance(mine["decoded_token"], str)
        others = sorted((v for k, v in entry.items() if k != str(ids[pos])), key=lambda v: v["rank"])
        assert len(entry) <= 3 and all(v["rank"] in (1, 2) for v in others)


def test_chat_prompt_logprobs_are_at_the_top_level(client, model):
    kw = dict(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    chat = client.chat.completions.create(extra_body={"prompt_logprobs": 1}, **kw)
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == chat.usage.prompt_tokens
    assert "prompt_logprobs" not in (chat.choices[0].model_extra or {})
    streamed = [c for c in client.chat.completions.create(stream=True, extra_body={"prompt_logprobs": 1}, **kw)]
    carried = [c.model_extra["prompt_logprobs"] for c in streamed if (c.model_extra or {}).get("prompt_logprobs")]
    assert carried == [entries]
