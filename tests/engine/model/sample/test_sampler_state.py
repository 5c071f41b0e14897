"""The sampler's per-request state: built once per request, brought up to date by new
tokens only, fresh for a reused id, and gone after ``forget``."""

from __future__ import annotations

import torch

from engine_svc.model.sample import sampler_stages as stages
from engine_svc.model.sample.sampler_state import SamplerState
from engine_svc.sched.request import Request
from engine_svc.types import SamplingParams

VOCAB = 8
CPU = torch.device("cpu")


def make_request(request_id: str = "r", prompt=(1, 2), output=(), **params) -> Request:
    request = Request(request_id, list(prompt), SamplingParams(**params), eos_token_ids=(0,))
    for token_id in output:
        request.append_output_token(token_id)
    return request


def counts(state: SamplerState, request: Request) -> tuple[list[bool], list[float]]:
    with torch.inference_mode():
        prompt_mask, output_counts = state.penalty_counts([request])
    return prompt_mask[0].tolist(), output_counts[0].tolist()


def test_token_counts_follow_the_output_and_count_each_token_once():
    state, r = SamplerState(VOCAB, CPU), make_request(prompt=(1, 2, 2, VOCAB + 5), output=(3,))
    prompt_mask, output_counts = counts(state, r)
    assert prompt_mask == [i in (1, 2) for i in range(VOCAB)]  # out-of-vocabulary ids are ignored
    assert output_counts == [1.0 if i == 3 else 0.0 for i in range(VOCAB)]
    r.append_output_token(3)
    r.append_output_token(5)
    assert counts(state, r)[1] == [{3: 2.0, 5: 1.0}.get(i, 0.0) for i in range(VOCAB)]
    assert counts(state, r)[1] == [{3: 2.0, 5: 1.0}.get(i, 0.0) for i in range(VOCAB)]  # nothing new


def test_a_reused_id_or_slot_starts_from_nothing():
    state = SamplerState(VOCAB, CPU)
    first = make_request(prompt=(1,), output=(4, 4))
    counts(state, first)
    second = make_request(prompt=(6,), output=(7,))  # the same id, another request
    assert counts(state, second) == ([i == 6 for i in range(VOCAB)], [float(i == 7) for i in range(VOCAB)])
    state.forget(["r"])
    other = make_request("other", prompt=(2,))  # takes the freed slot
    assert counts(state, other) == ([i == 2 for i in range(VOCAB)], [0.0] * VOCAB)


def test_request_tensors_are_built_once_per_request():
    state = SamplerState(VOCAB, CPU)
    r = make_request(logit_bias={1: 2.0, VOCAB: 9.0}, stop_token_ids=[5, 5, 3], min_tokens=2)
    entry = state.request_tensors(r)
    assert state.request_tensors(r) is entry
    assert entry.bias_cols is not None and entry.bias_cols.tolist() == [1]  # within the vocabulary
    assert entry.min_tokens_cols is not None and entry.min_tokens_cols.tolist() == [0, 3, 5]  # EOS too, unique
    ignoring_eos = make_request(stop_token_ids=[5], ignore_eos=True)
    assert state.request_tensors(ignoring_eos) is not entry  # same id, another request
    assert state.request_tensors(ignoring_eos).min_tokens_cols.tolist() == [5]
    assert state.request_tensors(ignoring_eos).bias_cols is None


def test_forget_drops_every_kind_of_state_and_sampling_does_not_change():
    state = SamplerState(VOCAB, CPU)
    r = make_request(output=(3, 4), seed=11, logit_bias={1: 1.0}, repetition_penalty=1.2)
    entry = state.request_tensors(r)
    generator = state.seeded_generator(r)
    draw = torch.rand(4, generator=generator)
    counts(state, r)
    state.forget(["r", "unknown"])
    assert state.request_tensors(r) is not entry
    again = state.seeded_generator(r)
    assert again is not generator and torch.equal(torch.rand(4, generator=again), draw)
    assert counts(state, r)[1] == [float(i in (3, 4)) for i in range(VOCAB)]  # rebuilt from the tokens


def test_a_seeded_generator_moves_on_with_each_output_token():
    state, r = SamplerState(VOCAB, CPU), make_request(seed=3)
    first = torch.rand(4, generator=state.seeded_generator(r))
    assert torch.equal(torch.rand(4, generator=state.seeded_generator(r)), first)  # re-seeded, not running on
    r.append_output_token(1)
    assert not torch.equal(torch.rand(4, generator=state.seeded_generator(r)), first)
    assert stages.step_seed(3, 0) != stages.step_seed(3, 1) != stages.step_seed(4, 0)


def test_the_exponential_race_and_min_p_stages():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.45, 0.05]])
    uniform = torch.rand(2, 3, generator=torch.Generator().manual_seed(0))
    assert stages.exponential_race(probs.clone(), uniform)[0].item() == 1  # a certain token always wins
    kept = stages.min_p_filter(probs, torch.tensor([[0.0], [0.2]]))
    assert torch.equal(kept[1], torch.tensor([0.5, 0.45, 0.0])) and torch.equal(kept[0], probs[0])  # 0.05 < 0.2 x 0.5
