"""The sampler's grammar stage on its own: masks, catch-up after preemption, held-back tokens.

Real compiled grammars on the demo model's tokenizer, fake logits; each test runs in
milliseconds.
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from engine_svc.model.sample.sampler import Sampler
from engine_svc.model.structured import GrammarMasks, LLGuidanceBackend
from engine_svc.sched.request import Request
from engine_svc.types import SamplingParams
from tandem_common.sampling import StructuredOutput


@pytest.fixture(scope="module")
def setup(demo_model_dir):
    from engine_svc.model.load.loader import read_special_token_ids

    _, eos = read_special_token_ids(demo_model_dir)
    backend = LLGuidanceBackend.from_model_dir(demo_model_dir, 2048, eos)
    return backend, Tokenizer.from_file(str(demo_model_dir / "tokenizer.json")), eos


def _request(backend, eos, constraint, output=(), request_id="r", **params) -> Request:
    request = Request(request_id, [1, 2, 3], SamplingParams(structured=constraint, **params), eos_token_ids=eos)
    request.grammar = backend.compile(constraint)
    for t in output:
        request.append_output_token(t)
    return request


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_the_mask_follows_the_output_tokens_and_is_rebuilt_after_forget(setup):
    backend, tokenizer, eos = setup
    choice = StructuredOutput("choice", choices=("rain please", "red"))  # "red" is one token
    masks = GrammarMasks(2048, torch.device("cpu"))
    request = _request(backend, eos, choice)
    first = masks.batch_mask([request]).allowed[0]
    assert first[_ids(tokenizer, "rain")[0]] and not first[eos[0]]
    request.append_output_token(_ids(tokenizer, "red")[0])
    after_red = masks.batch_mask([request]).allowed[0]
    assert after_red.nonzero().flatten().tolist() == sorted(eos)  # "red" is complete: only the end

    masks.forget("r")  # a preemption: the matcher is rebuilt from the request's tokens
    assert torch.equal(masks.batch_mask([request]).allowed[0], after_red)
    fresh = _request(backend, eos, choice)  # the same id, a new request: a new matcher
    assert torch.equal(masks.batch_mask([fresh]).allowed[0], first)


def test_min_tokens_and_ignore_eos_hold_eos_back_only_while_the_grammar_goes_on(setup):
    backend, tokenizer, eos = setup
    letters = StructuredOutput("regex", "a{1,3}")
    a = _ids(tokenizer, "a")
    masks = GrammarMasks(2048, torch.device("cpu"))
    may_go_on = _request(backend, eos, letters, output=a, request_id="on", min_tokens=5)
    free = _request(backend, eos, letters, output=a, request_id="free")
    complete = _request(backend, eos, letters, output=a * 3, request_id="done", ignore_eos=True)
    allowed = masks.batch_mask([may_go_on, free, complete]).allowed
    assert not allowed[0, eos].any() and allowed[0, a[0]]  # held back: "a" may follow
    assert allowed[1, eos].all() and allowed[1, a[0]]
    assert allowed[2].nonzero().flatten().tolist() == sorted(eos)  # nothing else: the end wins


def test_the_mask_comes_after_logit_bias_and_before_temperature(setup):
    backend, tokenizer, eos = setup
    choice = StructuredOutput("choice", choices=("red", "day"))
    no, other = _ids(tokenizer, "day")[0], _ids(tokenizer, "way")[0]
    sampler = Sampler(2048, "cpu")
    logits = torch.zeros(3, 2048)
    logits[:, other] = 50.0  # the model's favourite is forbidden
    requests = [
        _request(backend, eos, choice, request_id="greedy", temperature=0.0),
        _request(backend, eos, choice, request_id="biased", temperature=0.0, logit_bias={no: 10.0, other: 100.0}),
        _request(backend, eos, choice, request_id="hot", temperature=100.0, seed=1),
    ]
    out = sampler.sample(logits, requests)
    starts = [tokenizer.decode([t]) for t in out.token_ids]
    assert all("red".startswith(t) or "day".startswith(t) for t in starts), starts  # never "way"
    assert out.token_ids[1] == no and out.errors == {}
